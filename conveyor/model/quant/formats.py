"""GGUF quantized tensors decoded exactly into one form the native kernels can run, and packed into their tiles.

llama.cpp's block formats each pack codes, scales and minimums their own way. Every supported format decodes
here into one uniform :class:`QuantizedMatrix`: a uint8 code per weight plus one scale (and, for the
asymmetric formats, one minimum) per group of 16 or 32 weights along the input dimension (IQ4_NL's and IQ4_XS's
codes index 16 non-linear levels, which the matrix names). The 32-weight formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
IQ4_NL) run in this form, at their file's size but for Q5's codes in whole bytes; the super-block formats (the
K-quants, IQ4_XS) would take more bits in it than in the file (a float32 scale per group), so they run from their
own super-blocks (:mod:`conveyor.model.quant.k_quants`) and come here only to be checked and for the float path. The
decode loses nothing: for every supported type, :func:`dequantize` of the result is bit-identical to
``gguf.quants.dequantize`` of the raw bytes, so a model run from the codes sees the very weights llama.cpp's
reference sees.

Why exactness holds (tested bit-for-bit over the whole finite f16 range): each weight's ``scale * code``
is an f16 (11 significant bits) times integers whose product stays within 2**12 (Q6_K's
``|sc * (q - 32)| <= 128 * 32``, the K-quants' ``63 * 31``, Q8_0's ``128``, IQ4_XS's ``32 * 127``), so it is
exact in float32, and gguf's own float32 arithmetic rounds at most once, at the final ``+ min``. Here the whole
affine expression is computed in float64, where it is exact (its terms are multiples of 2**-24 below 2**28),
and rounded once to float32: the same single, correctly rounded step.

:func:`pack_tiles` then lays the codes out for the kernels: 16 output rows per tile, and within a
(tile, group) block, 4 consecutive inputs for each of the 16 rows side by side, so one 64-byte vector is
the unsigned operand of a ``vpdpbusd`` against a broadcast of 4 int8 activations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf.quants import IQ4_NL

from conveyor.core.formats import BLOCK_FORMATS

TILE = 16  # output rows per kernel tile: one 64-byte vector holds 4 inputs for each of 16 rows

_F16, _F32 = np.dtype(np.float16), np.dtype(np.float32)
_Decoded = tuple[np.ndarray, np.ndarray, np.ndarray | None]  # codes [blocks, block], scales, mins or None


@dataclass(frozen=True, slots=True)
class QuantizedMatrix:
    """A weight matrix W [n, k] as codes plus per-group affine parameters, whatever GGUF format it came from.

    w[i, j] = scales[i, j // group] * q[i, j] + mins[i, j // group]   when mins is not None, else
    w[i, j] = scales[i, j // group] * (q[i, j] - zero_point),
    with q[i, j] read as levels[q[i, j]] where the codes index ``levels`` (IQ4_NL's non-linear 16).
    Scales stay float16 where the format's scale is exactly an f16, so nothing is widened that need not be.
    """

    q: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None
    zero_point: int
    code_bits: int
    group: int
    source: str
    levels: np.ndarray | None = None

    def __post_init__(self) -> None:
        """Catch a malformed matrix where it is built rather than as a wrong answer in a kernel."""
        if self.q.ndim != 2 or self.q.dtype != np.uint8 or self.q.shape[1] % self.group:
            raise ValueError(f"quant: codes must be uint8 [n, k] with k a multiple of {self.group}")
        n, k = self.q.shape
        if self.scales.shape != (n, k // self.group) or self.scales.dtype not in (_F16, _F32):
            raise ValueError(f"quant: scales must be float16/float32 [{n}, {k // self.group}]")
        if self.mins is not None and (self.mins.shape != self.scales.shape or self.mins.dtype != self.scales.dtype):
            raise ValueError("quant: mins must match the scales in shape and dtype")
        if self.levels is not None and (self.levels.shape != (1 << self.code_bits,) or self.mins is not None):
            raise ValueError(f"quant: codes of {self.code_bits} bits index {1 << self.code_bits} levels, with no mins")

    @property
    def n(self) -> int:
        return self.q.shape[0]

    @property
    def k(self) -> int:
        return self.q.shape[1]

    @property
    def storage_bits(self) -> int:
        """The kernels store codes of up to 4 bits as nibbles, wider ones (and those of 16-input groups) as whole
        bytes."""
        return 4 if self.code_bits <= 4 and self.group == 32 else 8

    def values(self, rows: slice = slice(None)) -> np.ndarray:
        """The numbers the codes of ``rows`` stand for: the codes themselves, or the levels they index."""
        return self.q[rows] if self.levels is None else self.levels[self.q[rows]]


@dataclass(frozen=True, slots=True)
class PackedTiles:
    """A :class:`QuantizedMatrix` in the kernels' layout, n padded to a whole number of tiles with zeros."""

    codes: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None
    n: int
    k: int
    group: int
    storage_bits: int
    zero_point: int


# -- the block decoders: raw blocks [blocks, type_size] -> (codes [blocks, block], scales, mins or None) ----


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """An f16 field of every block, as [blocks, 1] (copied: the field is not aligned inside its block)."""
    return np.ascontiguousarray(blocks[:, offset : offset + 2]).view(np.float16)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """ggml's nibble order: within each row of bytes, all the low nibbles first, then all the high ones."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _bits(packed: np.ndarray) -> np.ndarray:
    """Bit j of a little-endian bit field (qh of Q5_0/Q5_1) as the j-th entry."""
    return np.unpackbits(packed, axis=-1, bitorder="little")


def _q8_0(b: np.ndarray) -> _Decoded:
    # int8 + 128 is the byte with its top bit flipped: codes 0..255 around zero point 128
    return b[:, 2:34] ^ np.uint8(0x80), _f16(b, 0), None


def _q4_0(b: np.ndarray) -> _Decoded:
    return _nibbles(b[:, 2:18]), _f16(b, 0), None


# IQ4_NL's 16 levels plus 128 (native/csrc/quant_tiles.h's kIq4Levels): a code's weight is d * (level - 128).
IQ4_LEVELS = (np.array(IQ4_NL.kvalues, np.int16) + 128).astype(np.uint8)


def _iq4_nl(b: np.ndarray) -> _Decoded:
    return _nibbles(b[:, 2:18]), _f16(b, 0), None


def _q4_1(b: np.ndarray) -> _Decoded:
    return _nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2)


def _q5_0(b: np.ndarray) -> _Decoded:
    return _nibbles(b[:, 6:22]) | (_bits(b[:, 2:6]) << 4), _f16(b, 0), None


def _q5_1(b: np.ndarray) -> _Decoded:
    return _nibbles(b[:, 8:24]) | (_bits(b[:, 4:8]) << 4), _f16(b, 0), _f16(b, 2)


def k_sub_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K blocks' 6-bit sub-block scales and mins [blocks, 8], unpacked from their 12 bytes."""
    s = b[:, 4:16].reshape(-1, 3, 4)
    lo, hi, top = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([lo & 0x3F, (top & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    m = np.concatenate([hi & 0x3F, (top >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    return sc, m


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K sub-block parameters: d * sc and -(dmin * m).

    Both products are f16 times a 6-bit integer, exact in float32.
    """
    sc, m = k_sub_scales(b)
    d, dmin = _f16(b, 0).astype(np.float32), _f16(b, 2).astype(np.float32)
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """K-quant nibbles: each 32 bytes hold two sub-blocks of 32, the low nibbles then the high ones."""
    return _nibbles(qs.reshape(qs.shape[0], -1, 32)).reshape(qs.shape[0], -1)


def _q4_k(b: np.ndarray) -> _Decoded:
    return (_k_nibbles(b[:, 16:144]), *_k_scales(b))


def _q5_k(b: np.ndarray) -> _Decoded:
    high = (b[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # sub-block s: bit s of qh
    return (_k_nibbles(b[:, 48:176]) | (high.reshape(b.shape[0], -1) << 4), *_k_scales(b))


def iq4_xs_sub_scales(b: np.ndarray) -> np.ndarray:
    """IQ4_XS blocks' 6-bit sub-block scales [blocks, 8] (stored 32 above the signed scale): the low 4 bits two
    to a byte of scales_l, the top 2 bits of sub-block j at bits 2j of the 16-bit scales_h."""
    low = _nibbles(b[:, 4:8, None]).reshape(-1, 8)  # byte i: sub-block 2i in its low nibble, 2i + 1 in its high
    high = b[:, 2:4].view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))
    return low | ((high & 3).astype(np.uint8) << 4)


def _iq4_xs(b: np.ndarray) -> _Decoded:
    """Per sub-block of 32, 16 bytes of codes: the low nibbles the first 16 inputs, the high ones the next."""
    d = _f16(b, 0).astype(np.float32)
    scales = d * (iq4_xs_sub_scales(b).astype(np.float32) - 32)
    return _nibbles(b[:, 8:136].reshape(-1, 8, 16)).reshape(-1, 256), scales, None


def q3_k_sub_scales(b: np.ndarray) -> np.ndarray:
    """Q3_K blocks' 6-bit sub-block scales [blocks, 16] (stored 32 above the signed scale), from their 12 bytes:
    sub-block j's low 4 bits in byte j % 8 (the high nibble for j >= 8), its top 2 at bits 2 (j // 4) of byte
    8 + j % 4."""
    low = _nibbles(b[:, 96:104])
    high = (b[:, None, 104:108] >> (2 * np.arange(4, dtype=np.uint8))[None, :, None]).reshape(-1, 16) & 3
    return low | (high << 4)


def _crumbs(packed: np.ndarray) -> np.ndarray:
    """2-bit codes [blocks, 256] of Q3_K's and Q2_K's 64 bytes: each 32 bytes hold 128 inputs, input 32s + i at bits
    2s of byte i."""
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    return ((packed.reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 256)


def _q3_k(b: np.ndarray) -> _Decoded:
    """Codes 0..7 about zero point 4: the 2 low bits, and above them the bit of hmask (input 32s + i at bit s of
    byte i), set where gguf does not subtract 4."""
    high = (b[:, None, :32] >> np.arange(8, dtype=np.uint8)[None, :, None]).reshape(-1, 256) & 1
    scales = _f16(b, 108).astype(np.float32) * (q3_k_sub_scales(b).astype(np.float32) - 32)
    return _crumbs(b[:, 32:96]) | (high << 2), scales, None


def _q2_k(b: np.ndarray) -> _Decoded:
    """Per sub-block of 16, a byte of 4-bit scale (low) and min (high): d * sc and -(dmin * m), exact in float32."""
    d, dmin = _f16(b, 80).astype(np.float32), _f16(b, 82).astype(np.float32)
    return _crumbs(b[:, 16:80]), d * (b[:, :16] & 15).astype(np.float32), -(dmin * (b[:, :16] >> 4).astype(np.float32))


def _q6_k(b: np.ndarray) -> _Decoded:
    """Two halves of 128 weights: low nibbles from 64 bytes of ql, the 2 high bits from 32 bytes of qh."""
    nb = b.shape[0]
    low = _nibbles(b[:, :128].reshape(nb, 2, 64))
    high = (b[:, 128:192].reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]) & 3
    q = (low | (high.reshape(nb, 2, 128) << 4)).reshape(nb, 256)
    scales = _f16(b, 208).astype(np.float32) * b[:, 192:208].view(np.int8).astype(np.float32)
    return q, scales, None


@dataclass(frozen=True, slots=True)
class _Format:
    decode: Callable[[np.ndarray], _Decoded]
    code_bits: int
    group: int
    zero_point: int  # 0 for the asymmetric formats
    levels: np.ndarray | None = None  # what the codes index, where they are not the numbers themselves


_FORMATS: dict[str, _Format] = {
    "Q8_0": _Format(_q8_0, 8, 32, 128),
    "Q4_0": _Format(_q4_0, 4, 32, 8),
    "Q4_1": _Format(_q4_1, 4, 32, 0),
    "IQ4_NL": _Format(_iq4_nl, 4, 32, 128, IQ4_LEVELS),
    "Q5_0": _Format(_q5_0, 5, 32, 16),
    "Q5_1": _Format(_q5_1, 5, 32, 0),
    "Q4_K": _Format(_q4_k, 4, 32, 0),
    "Q5_K": _Format(_q5_k, 5, 32, 0),
    "Q6_K": _Format(_q6_k, 6, 16, 32),
    "IQ4_XS": _Format(_iq4_xs, 4, 32, 128, IQ4_LEVELS),
    "Q3_K": _Format(_q3_k, 3, 16, 4),
    "Q2_K": _Format(_q2_k, 2, 16, 0),
}
SUPPORTED_TYPES: frozenset[str] = frozenset(_FORMATS)
assert set(BLOCK_FORMATS) == SUPPORTED_TYPES, "every format the registry names decodes here, and no other"


def _format(type_name: str) -> tuple[_Format, int, int]:
    """The decoder and (weights, bytes) per block of a type, refusing the ones without an exact uniform form."""
    if type_name not in _FORMATS:
        raise ValueError(f"quant: GGUF type {type_name} is not supported; supported: {', '.join(sorted(_FORMATS))}")
    return _FORMATS[type_name], BLOCK_FORMATS[type_name].block, BLOCK_FORMATS[type_name].file_bytes


def decode(raw: np.ndarray, type_name: str, n: int, k: int) -> QuantizedMatrix:
    """Decode a GGUF tensor's bytes (flat or [n, bytes_per_row]) of numpy shape (n, k) into codes and scales.

    With ``gguf.GGUFReader``: ``decode(t.data, t.tensor_type.name, *reversed(t.shape))``.
    """
    fmt, block, type_size = _format(type_name)
    if n <= 0 or k <= 0 or k % block:
        raise ValueError(f"quant: {type_name} needs k a positive multiple of {block}; got n={n}, k={k}")
    raw = np.asarray(raw)
    expected = n * (k // block) * type_size
    if raw.dtype != np.uint8 or raw.size != expected:
        raise ValueError(f"quant: {type_name} [{n}, {k}] takes {expected} uint8 bytes; got {raw.size} of {raw.dtype}")
    q, scales, mins = fmt.decode(np.ascontiguousarray(raw).reshape(-1, type_size))
    groups = k // fmt.group
    return QuantizedMatrix(
        q=np.ascontiguousarray(q).reshape(n, k),
        scales=scales.reshape(n, groups),
        mins=None if mins is None else mins.reshape(n, groups),
        zero_point=fmt.zero_point,
        code_bits=fmt.code_bits,
        group=fmt.group,
        source=type_name,
        levels=fmt.levels,
    )


def dequantize(m: QuantizedMatrix, rows_per_chunk: int = 4096) -> np.ndarray:
    """The float32 weights: computed in float64, where the affine step is exact, then rounded once.

    Chunked over rows only to bound the float64 temporaries on large embeddings.
    """
    out = np.empty((m.n, m.k), np.float32)
    groups = m.k // m.group
    for start in range(0, m.n, rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        q = m.values(rows).reshape(-1, groups, m.group).astype(np.float64)
        s = m.scales[rows].astype(np.float64)[..., None]
        w = s * (q - m.zero_point) if m.mins is None else s * q + m.mins[rows].astype(np.float64)[..., None]
        out[rows] = w.reshape(-1, m.k)
    return out


def _with_rows(m: QuantizedMatrix, q: np.ndarray, scales: np.ndarray, mins: np.ndarray | None) -> QuantizedMatrix:
    return QuantizedMatrix(q, scales, mins, m.zero_point, m.code_bits, m.group, m.source, m.levels)


def row_slice(m: QuantizedMatrix, start: int, stop: int) -> QuantizedMatrix:
    """Rows [start, stop) of a matrix (views, no copy)."""
    rows = slice(start, stop)
    return _with_rows(m, m.q[rows], m.scales[rows], None if m.mins is None else m.mins[rows])


def permute_rows(m: QuantizedMatrix, order: np.ndarray) -> QuantizedMatrix:
    """Reorder output rows, codes and their scales and mins together.

    The loader undoes llama.cpp's rotary row permutation of the q/k projections this way, on the codes,
    which is exact, instead of on dequantized floats.
    """
    order = np.asarray(order)
    if order.shape != (m.n,) or not np.array_equal(np.sort(order), np.arange(m.n)):
        raise ValueError(f"quant: row order must be a permutation of range({m.n})")
    mins = None if m.mins is None else m.mins[order]
    return _with_rows(m, m.q[order], m.scales[order], mins)


def _exact_cast(x: np.ndarray, dtype: np.dtype) -> np.ndarray | None:
    """x (float64) in dtype, or None where some value would overflow or round."""
    with np.errstate(over="ignore"):
        y = x.astype(dtype)
    return y if np.array_equal(y.astype(np.float64), x, equal_nan=True) else None


def _as_asymmetric(m: QuantizedMatrix, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray] | None:
    """(scales, mins) of m in dtype, mins = -zero_point * scales for a symmetric m; None if not exact."""
    scales = _exact_cast(m.scales.astype(np.float64), dtype)
    if m.mins is not None:
        mins = _exact_cast(m.mins.astype(np.float64), dtype)
    else:
        mins = _exact_cast(-float(m.zero_point) * m.scales.astype(np.float64), dtype)
    return None if scales is None or mins is None else (scales, mins)


def _common_asymmetric(mats: list[QuantizedMatrix], narrowest: np.dtype) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Every matrix's (scales, mins) in the narrowest dtype, from ``narrowest`` up, that holds them exactly."""
    for dtype in dict.fromkeys((narrowest, _F32)):
        pairs = [_as_asymmetric(m, dtype) for m in mats]
        if all(p is not None for p in pairs):
            return [p[0] for p in pairs], [p[1] for p in pairs]
    raise ValueError("quant: these matrices have no exact common form in float32")


def concat_rows(mats: list[QuantizedMatrix]) -> QuantizedMatrix:
    """Stack matrices along n, as the loader fuses q/k/v and gate/up into one matmul.

    One fused matrix has one zero point and one scale dtype, so differently formatted parts are first
    brought to a common form, exactly: f16 scales widen to f32 losslessly, and a symmetric part becomes
    asymmetric with mins = -zero_point * scales, kept in f16 only where that product is exact there (the
    zero points are powers of two, so only overflow can break it). The codes need no change: they stay
    below 2**code_bits of the widest part. Groups cannot be reconciled this way, so they must match.
    The one thing such a conversion cannot keep is the sign of a zero weight: s * (q - zp) is -0.0 for
    q == zp under a negative scale, while s * q - zp * s is +0.0, equal in value and in every product.
    """
    if not mats:
        raise ValueError("quant: nothing to concatenate")
    first = mats[0]
    if any(m.group != first.group or m.k != first.k for m in mats):
        raise ValueError(
            "quant: cannot join rows of different groups or widths: "
            + ", ".join(f"{m.source} (k={m.k}, group={m.group})" for m in mats)
        )
    if len({None if m.levels is None else m.levels.tobytes() for m in mats}) > 1:
        raise ValueError("quant: cannot join codes that index levels with other codes: "
                         + ", ".join(dict.fromkeys(m.source for m in mats)))
    dtype = _F16 if all(m.scales.dtype == _F16 for m in mats) else _F32
    zero_points = {None if m.mins is not None else m.zero_point for m in mats}
    if len(zero_points) == 1:  # one form already, at most the scales to widen
        scales = [m.scales.astype(dtype) for m in mats]
        mins = None if first.mins is None else [m.mins.astype(dtype) for m in mats]
        zero_point = first.zero_point if first.mins is None else 0
    else:
        scales, mins = _common_asymmetric(mats, dtype)
        zero_point = 0
    return QuantizedMatrix(
        q=np.concatenate([m.q for m in mats]),
        scales=np.concatenate(scales),
        mins=None if mins is None else np.concatenate(mins),
        zero_point=zero_point,
        code_bits=max(m.code_bits for m in mats),
        group=first.group,
        source="+".join(dict.fromkeys(m.source for m in mats)),
        levels=first.levels,
    )


# -- the kernels' tile layout -------------------------------------------------------------------------------


def _tile_params(x: np.ndarray, tiles: int) -> np.ndarray:
    """[n, groups] -> [tiles, groups, 16], padding rows with zeros."""
    padded = np.zeros((tiles * TILE, x.shape[1]), x.dtype)
    padded[: x.shape[0]] = x
    return np.ascontiguousarray(padded.reshape(tiles, TILE, -1).transpose(0, 2, 1))


def pack_tiles(m: QuantizedMatrix) -> PackedTiles:
    """Lay codes out as [tile, group, 4-input step, row of 16, 4 inputs] (bytes) or 8-input steps (nibbles).

    For 4-bit codes, byte b of a row within an octet of inputs holds input b in its low nibble and input
    4 + b in its high one, so a mask and a shift of the same 64 bytes give two vpdpbusd operands.
    """
    tiles, groups = -(-m.n // TILE), m.k // m.group
    q = np.zeros((tiles * TILE, m.k), np.uint8)
    q[: m.n] = m.q
    if m.storage_bits == 8:
        blocks = q.reshape(tiles, TILE, groups, m.group // 4, 4)
    else:
        if m.group % 8:
            raise ValueError(f"quant: 4-bit tiles need a group that is a multiple of 8, not {m.group}")
        pairs = q.reshape(tiles, TILE, groups, m.group // 8, 2, 4)
        blocks = pairs[..., 0, :] | (pairs[..., 1, :] << 4)
    codes = np.ascontiguousarray(blocks.transpose(0, 2, 3, 1, 4)).reshape(tiles, groups, -1)
    return PackedTiles(
        codes=codes,
        scales=_tile_params(m.scales, tiles),
        mins=None if m.mins is None else _tile_params(m.mins, tiles),
        n=m.n,
        k=m.k,
        group=m.group,
        storage_bits=m.storage_bits,
        zero_point=m.zero_point,
    )


def _untile_params(x: np.ndarray, rows: int) -> np.ndarray:
    """[tiles, groups, 16] -> the first ``rows`` rows of [n, groups]."""
    return x.transpose(0, 2, 1).reshape(-1, x.shape[1])[:rows]


def unpack_tiles(p: PackedTiles, *, keep_padding: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(q [n, k], scales [n, groups], mins or None) back from the tiles: the proof that the layout round-trips.

    ``keep_padding`` keeps the padding rows, to check they are zero.
    """
    tiles, groups = p.codes.shape[:2]
    if p.storage_bits == 8:
        blocks = p.codes.reshape(tiles, groups, p.group // 4, TILE, 4).transpose(0, 3, 1, 2, 4)
    else:
        packed = p.codes.reshape(tiles, groups, p.group // 8, TILE, 4).transpose(0, 3, 1, 2, 4)
        blocks = np.stack([packed & 0x0F, packed >> 4], axis=-2)
    rows = tiles * TILE if keep_padding else p.n
    q = blocks.reshape(tiles * TILE, p.k)[:rows]
    return q, _untile_params(p.scales, rows), None if p.mins is None else _untile_params(p.mins, rows)


# ---------------------------------------------------------------------------------------------------------
# The quantized kernels' arithmetic, in numpy: the reference the native kernels are held to


def quantize_activations(x: np.ndarray, group: int,
                         span: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of float32 activations as the quantized kernels take them (native/csrc/quant_gemm.h): int8 codes
    [m, k], each span's step d = max|x| / 127 [m, k / span] and each group's code sum [m, k / group]. The span is
    the group (the uniform layouts) unless given (the super-block layouts: 256). The codes are
    round(x * (127 / max|x|)) to nearest even, all in float32, as the kernels compute them; bit for bit the same."""
    m, k = x.shape
    span = span or group
    spans = np.asarray(x, dtype=np.float32).reshape(m, k // span, span)
    amax = np.abs(spans).max(axis=-1)
    step = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    codes = np.rint(spans * inverse[..., None]).astype(np.int32).reshape(m, k)
    return codes.astype(np.int8), step, codes.reshape(m, k // group, group).sum(axis=-1).astype(np.int32)


def reference_linear(x: np.ndarray, m: QuantizedMatrix, span: int | None = None) -> np.ndarray:
    """y = x . W^T as the quantized kernels define it (activations quantized per span, integer sums per group, one
    scale per group), in float64: the kernels differ from it only by float32 rounding. ``span``: as
    quantize_activations takes it (256 for a super-block format's decoded form)."""
    codes, step, sums = quantize_activations(x, m.group, span)
    rows, groups = x.shape[0], m.k // m.group
    products = np.einsum("rgj,ngj->rng", codes.reshape(rows, groups, m.group).astype(np.int64),
                         m.values().reshape(m.n, groups, m.group).astype(np.int64))
    scales = m.scales.astype(np.float64)[None]
    if m.mins is None:
        terms = (products - m.zero_point * sums[:, None, :]) * scales
    else:
        terms = products * scales + m.mins.astype(np.float64)[None] * sums[:, None, :]
    steps = np.repeat(step.astype(np.float64), groups // step.shape[1], axis=1)  # each group's span's step
    return (terms * steps[:, None, :]).sum(axis=-1)


# ---------------------------------------------------------------------------------------------------------
# Float weights quantized (--quantization): the same forms the GGUF formats decode into

QUANTIZE_GROUP = 32


def quantize_matrix(weights: np.ndarray, scheme: str) -> QuantizedMatrix:
    """A float [n, k] matrix quantized by round to nearest, per group of 32 inputs: ``int8`` symmetric (Q8_0's
    form: d = max|w| / 127 in float16, codes w / d + 128), ``int4`` asymmetric (Q4_1's form: scale (max - min) /
    15 and min, both float16, codes 0..15). The error of each weight is at most half a step of its group's
    (float16-rounded) scale, which the tests hold it to."""
    n, k = weights.shape
    if k % QUANTIZE_GROUP:
        raise ValueError(f"quant: {scheme} needs k a multiple of {QUANTIZE_GROUP}, not {k}")
    grouped = np.asarray(weights, dtype=np.float32).reshape(n, k // QUANTIZE_GROUP, QUANTIZE_GROUP)
    if scheme == "int8":
        return _symmetric_int8(grouped, n, k)
    if scheme == "int4":
        return _asymmetric_int4(grouped, n, k)
    raise ValueError(f"quant: no scheme {scheme!r} (int8, int4)")


def _symmetric_int8(grouped: np.ndarray, n: int, k: int) -> QuantizedMatrix:
    step = (np.abs(grouped).max(axis=-1) / 127).astype(np.float16)
    safe = np.where(step > 0, step, 1).astype(np.float32)[..., None]
    codes = np.clip(np.rint(grouped / safe), -127, 127).astype(np.int16) + 128
    return QuantizedMatrix(codes.astype(np.uint8).reshape(n, k), step, None, 128, 8, QUANTIZE_GROUP, "int8")


def _asymmetric_int4(grouped: np.ndarray, n: int, k: int) -> QuantizedMatrix:
    low = grouped.min(axis=-1).astype(np.float16)
    high = grouped.max(axis=-1)
    step = ((high - low.astype(np.float32)) / 15).astype(np.float16)
    safe = np.where(step > 0, step, 1).astype(np.float32)[..., None]
    codes = np.clip(np.rint((grouped - low.astype(np.float32)[..., None]) / safe), 0, 15)
    return QuantizedMatrix(codes.astype(np.uint8).reshape(n, k), step, low, 0, 4, QUANTIZE_GROUP, "int4")
