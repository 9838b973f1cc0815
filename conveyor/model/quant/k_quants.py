"""The super-block formats (the K-quants Q4_K, Q5_K, Q6_K, Q3_K, Q2_K, and IQ4_XS) kept at the file's own size, in
the layout their kernels stream.

Such a tensor is read as the file holds it (:class:`RawBlocks`: each row's 256-weight super-blocks, bytes as
llama.cpp wrote them), reordered and joined as whole rows, and packed once into native/csrc/kquant_tiles.h's
layout: per 16 output rows and super-block, the rows' float16 d (and dmin), their sub-block scales still in 6
bits (Q6_K: 8; Q2_K: 4), and their codes in planes, the low bits in the nibble tiles the uniform formats use
(Q3_K, Q2_K: a plane of 2 bits), the bits above them in a plane of their own. Every byte of the file is kept and
none is added: Q4_K stays at 4.5 bits a weight, Q5_K at 5.5, Q6_K at 6.5625, IQ4_XS at 4.25, Q3_K at 3.4375,
Q2_K at 2.625 (decoded into the uniform form they would take 6.0, 10, 10, 5.0, 10 and 12).

A fused projection whose parts differ in type (a Q4_K_M file's Q4_K queries and keys beside Q6_K values) is
:class:`JoinedRows`: each part keeps its own layout and kernel, and the kernels write them side by side.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from conveyor.core.formats import BLOCK_FORMATS
from conveyor.model.quant.formats import (
    TILE,
    QuantizedMatrix,
    decode,
    iq4_xs_sub_scales,
    k_sub_scales,
    q3_k_sub_scales,
)

K_TYPES = frozenset(name for name, f in BLOCK_FORMATS.items() if f.super_block)
SUPER_BLOCK = 256  # inputs per super-block


@dataclass(frozen=True, slots=True)
class RawBlocks:
    """A K-quant matrix [n, k] as the file stores it: ``raw`` is [n, bytes per row] of whole super-blocks."""

    type_name: str
    raw: np.ndarray
    n: int
    k: int

    def __post_init__(self) -> None:
        if self.type_name not in K_TYPES:
            raise ValueError(f"quant: {self.type_name} is no super-block format ({', '.join(sorted(K_TYPES))})")
        block, size = BLOCK_FORMATS[self.type_name].block, BLOCK_FORMATS[self.type_name].file_bytes
        if self.k % block or self.raw.dtype != np.uint8 or self.raw.shape != (self.n, self.k // block * size):
            raise ValueError(f"quant: {self.type_name} [{self.n}, {self.k}] takes uint8 [{self.n}, "
                             f"{self.k // block * size}] (k a multiple of {block}); got {self.raw.dtype} "
                             f"{list(self.raw.shape)}")

    @classmethod
    def from_file(cls, raw: np.ndarray, type_name: str, n: int, k: int) -> RawBlocks:
        """A tensor's bytes (flat, as read from the file) of numpy shape (n, k)."""
        return cls(type_name, np.asarray(raw).reshape(n, -1), n, k)

    @property
    def source(self) -> str:
        return self.type_name

    def permute_rows(self, order: np.ndarray) -> RawBlocks:
        """Output rows reordered (llama.cpp's rotary order of the q/k rows undone): whole rows of blocks move."""
        order = np.asarray(order)
        if order.shape != (self.n,) or not np.array_equal(np.sort(order), np.arange(self.n)):
            raise ValueError(f"quant: row order must be a permutation of range({self.n})")
        return RawBlocks(self.type_name, self.raw[order], self.n, self.k)

    def rows(self, start: int, stop: int) -> RawBlocks:
        stop = min(stop, self.n)
        return RawBlocks(self.type_name, self.raw[start:stop], stop - start, self.k)

    def decoded(self) -> QuantizedMatrix:
        """The uniform form (quant_formats.decode): the reference the kernels are held to, and the float path's."""
        return decode(self.raw, self.type_name, self.n, self.k)


@dataclass(frozen=True, slots=True)
class JoinedRows:
    """Quantized parts of one input width stacked along the outputs, each in its own format."""

    parts: tuple[QuantizedMatrix | RawBlocks, ...]

    def __post_init__(self) -> None:
        if not self.parts or len({part.k for part in self.parts}) != 1:
            raise ValueError("quant: joined rows need parts of one input width")

    @property
    def n(self) -> int:
        return sum(part.n for part in self.parts)

    @property
    def k(self) -> int:
        return self.parts[0].k

    @property
    def source(self) -> str:
        return "+".join(dict.fromkeys(part.source for part in self.parts))


def concat_blocks(parts: list[RawBlocks]) -> RawBlocks:
    """Parts of one K type stacked along the outputs."""
    if len({(part.type_name, part.k) for part in parts}) != 1:
        raise ValueError("quant: only blocks of one type and width are concatenated")
    return RawBlocks(parts[0].type_name, np.concatenate([part.raw for part in parts]), sum(p.n for p in parts),
                     parts[0].k)


def _by_tile(x: np.ndarray, tiles: int) -> np.ndarray:
    """[n, ...] -> [tiles, 16, ...], padding rows with zeros (a zero row's d is 0: its weights are 0)."""
    padded = np.zeros((tiles * TILE, *x.shape[1:]), x.dtype)
    padded[: x.shape[0]] = x
    return padded.reshape(tiles, TILE, *x.shape[1:])


def _bit_plane(values: np.ndarray, bits: int) -> np.ndarray:
    """Values [tiles, 16, k] under 2**bits as a plane of ``bits`` bits a code, [tiles, k * bits / 2] bytes: 64-byte
    vectors of 32 / bits inputs each, byte 4c + b holding input 4t + b of row c at bits t * bits (4 bits: the
    nibble tiles of quant_formats.pack_tiles, input b in the low nibble and 4 + b in the high one)."""
    tiles, _, k = values.shape
    span = 32 // bits
    v = values.reshape(tiles, TILE, k // span, span // 4, 4).astype(np.uint8)
    # The fields OR'd in one by one: a ufunc reduce over that short middle axis took 60% of packing a model.
    packed = v[:, :, :, 0].copy()  # [tiles, rows, vectors, 4]
    for field in range(1, span // 4):
        packed |= v[:, :, :, field] << np.uint8(field * bits)
    return np.ascontiguousarray(packed.transpose(0, 2, 1, 3)).reshape(tiles, -1)


def _halves(rows: np.ndarray, tiles: int) -> np.ndarray:
    """Float16 fields' bytes [n, blocks, 2 * count] (d, or d and dmin) as each tile's [blocks, 32 * count] bytes,
    field by field."""
    fields = _by_tile(np.ascontiguousarray(rows).view(np.uint16), tiles)  # [tiles, 16, blocks, count]
    return np.ascontiguousarray(fields.transpose(0, 2, 3, 1)).view(np.uint8).reshape(tiles, rows.shape[1], -1)


def _six_bit_header(blocks: np.ndarray, tiles: int, n: int, per_row: int) -> np.ndarray:
    """Q4_K/Q5_K: per tile and super-block, d[16], dmin[16] (f16) and the 6-bit scales and mins (see kquant_tiles.h)."""
    rows = blocks.reshape(n, per_row, -1)
    sc, m = (_by_tile(part.reshape(n, per_row, 8), tiles) for part in k_sub_scales(blocks))  # [tiles, 16, blocks, 8]
    sc, m = sc.transpose(0, 2, 3, 1), m.transpose(0, 2, 3, 1)  # [tiles, blocks, sub-block, row]
    lows = [(x[..., :8] & 0x0F) | ((x[..., 8:] & 0x0F) << 4) for x in (sc, m)]
    top = ((sc[..., :8] >> 4) | ((sc[..., 8:] >> 4) << 2) | ((m[..., :8] >> 4) << 4) | ((m[..., 8:] >> 4) << 6))
    scales = np.concatenate([*lows, top], axis=2).astype(np.uint8)  # [tiles, blocks, 24, 8]
    return np.concatenate([_halves(rows[:, :, 0:4], tiles), scales.reshape(tiles, per_row, 192)], axis=-1)


def _q6_header(blocks: np.ndarray, tiles: int, n: int, per_row: int) -> np.ndarray:
    """Q6_K: per tile and super-block, d[16] (f16) and the int8 scales [16 groups][16 rows]."""
    rows = blocks.reshape(n, per_row, -1)
    sc = _by_tile(rows[:, :, 192:208], tiles)  # [tiles, 16, blocks, 16 groups]
    sc_bytes = np.ascontiguousarray(sc.transpose(0, 2, 3, 1)).reshape(tiles, per_row, 256)
    return np.concatenate([_halves(rows[:, :, 208:210], tiles), sc_bytes], axis=-1)


def _signed_six_bit_header(d: np.ndarray, sc: np.ndarray, tiles: int, n: int, per_row: int) -> np.ndarray:
    """IQ4_XS/Q3_K: per tile and super-block, d[16] (f16 bytes [n, blocks, 2]) and the 6-bit scales sc [n * blocks,
    groups]: their low nibbles [groups][8] (row b, then row b + 8 in the high nibble) and their top 2 bits
    [groups / 2][8] (sub-block 2p's rows b and b + 8 at bits 0 and 2, sub-block 2p + 1's at 4 and 6)."""
    groups = sc.shape[-1]
    sc = _by_tile(sc.reshape(n, per_row, groups), tiles).transpose(0, 2, 3, 1)  # [tiles, blocks, groups, 16 rows]
    low = (sc[..., :8] & 0x0F) | ((sc[..., 8:] & 0x0F) << 4)
    top = (sc[..., :8] >> 4) | ((sc[..., 8:] >> 4) << 2)  # [tiles, blocks, groups, 8]: 4 bits a sub-block
    top = top[:, :, 0::2] | (top[:, :, 1::2] << 4)
    return np.concatenate([_halves(d, tiles), low.reshape(tiles, per_row, -1), top.reshape(tiles, per_row, -1)],
                          axis=-1)


def _iq4_xs_header(blocks: np.ndarray, tiles: int, n: int, per_row: int) -> np.ndarray:
    return _signed_six_bit_header(blocks.reshape(n, per_row, -1)[:, :, 0:2], iq4_xs_sub_scales(blocks), tiles, n,
                                  per_row)


def _q3_header(blocks: np.ndarray, tiles: int, n: int, per_row: int) -> np.ndarray:
    return _signed_six_bit_header(blocks.reshape(n, per_row, -1)[:, :, 108:110], q3_k_sub_scales(blocks), tiles, n,
                                  per_row)


def _q2_header(blocks: np.ndarray, tiles: int, n: int, per_row: int) -> np.ndarray:
    """Q2_K: per tile and super-block, d[16], dmin[16] (f16) and the file's scale-and-min bytes [16 groups][16 rows]."""
    rows = blocks.reshape(n, per_row, -1)
    sc = _by_tile(rows[:, :, 0:16], tiles)  # [tiles, 16, blocks, 16 groups]
    sc_bytes = np.ascontiguousarray(sc.transpose(0, 2, 3, 1)).reshape(tiles, per_row, 256)
    return np.concatenate([_halves(rows[:, :, 80:84], tiles), sc_bytes], axis=-1)


@dataclass(frozen=True, slots=True)
class _Layout:
    """How kquant_tiles.h lays out a type's super-blocks: the header (d, dmin, the sub-block scales) and how many
    of the codes' bits lie in the low plane and the high one."""

    header: Callable[[np.ndarray, int, int, int], np.ndarray]
    header_bytes: int
    low_bits: int
    high_bits: int


LAYOUTS = {
    "Q4_K": _Layout(_six_bit_header, 256, 4, 0),
    "Q5_K": _Layout(_six_bit_header, 256, 4, 1),
    "Q6_K": _Layout(_q6_header, 32 + 256, 4, 2),
    "IQ4_XS": _Layout(_iq4_xs_header, 32 + 96, 4, 0),
    "Q3_K": _Layout(_q3_header, 32 + 192, 2, 1),
    "Q2_K": _Layout(_q2_header, 64 + 256, 2, 0),
}
assert set(LAYOUTS) == K_TYPES, "every super-block format of the registry has its layout, and no other"


def block_bytes(type_name: str) -> int:
    """Bytes of one tile's super-block in the packed layout: 16 rows of the file's block, no more."""
    layout = LAYOUTS[type_name]
    return layout.header_bytes + TILE * SUPER_BLOCK * (layout.low_bits + layout.high_bits) // 8


def pack_blocks(m: RawBlocks) -> np.ndarray:
    """The kernels' layout of a super-block matrix: uint8 [tiles, k / 256, block_bytes(type)]."""
    tiles, per_row = -(-m.n // TILE), m.k // SUPER_BLOCK
    layout = LAYOUTS[m.type_name]
    blocks = np.ascontiguousarray(m.raw).reshape(m.n * per_row, -1)
    codes = _by_tile(m.decoded().q, tiles)
    parts = [layout.header(blocks, tiles, m.n, per_row),
             _bit_plane(codes & ((1 << layout.low_bits) - 1), layout.low_bits).reshape(tiles, per_row, -1)]
    if layout.high_bits:
        parts.append(_bit_plane(codes >> layout.low_bits, layout.high_bits).reshape(tiles, per_row, -1))
    packed = np.concatenate(parts, axis=-1)
    assert packed.shape[-1] == block_bytes(m.type_name)
    return packed
