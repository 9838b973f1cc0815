"""The K-quants (Q4_K, Q5_K, Q6_K) kept at the file's own size, in the layout their kernels stream.

A K-quant tensor is read as the file holds it (:class:`RawBlocks`: each row's 256-weight super-blocks, bytes as
llama.cpp wrote them), reordered and joined as whole rows, and packed once into native/csrc/kquant_tiles.h's
layout: per 16 output rows and super-block, the rows' float16 d (and dmin), their sub-block scales still in 6
bits (Q6_K: 8), and their codes in the nibble tiles the uniform formats use, the bits above the fourth in a
plane of their own. Every byte of the file is kept and none is added: Q4_K stays at 4.5 bits a weight, Q5_K at
5.5, Q6_K at 6.5625 (decoded into the uniform form they would take 6.0, 10 and 10).

A fused projection whose parts differ in type (a Q4_K_M file's Q4_K queries and keys beside Q6_K values) is
:class:`JoinedRows`: each part keeps its own layout and kernel, and the kernels write them side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from conveyor.core.formats import BLOCK_FORMATS
from conveyor.model.quant.formats import TILE, QuantizedMatrix, decode, k_sub_scales

K_TYPES = frozenset(name for name, f in BLOCK_FORMATS.items() if f.super_block)
SUPER_BLOCK = 256  # inputs per super-block
HEADER_BYTES = {"Q4_K": 256, "Q5_K": 256, "Q6_K": 32 + 256}  # per tile and super-block: d (dmin) and sub-scales
HIGH_BITS = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2}  # code bits above the fourth, in their own plane


def block_bytes(type_name: str) -> int:
    """Bytes of one tile's super-block in the packed layout: 16 rows of the file's block, no more."""
    return HEADER_BYTES[type_name] + TILE * SUPER_BLOCK * (4 + HIGH_BITS[type_name]) // 8


@dataclass(frozen=True, slots=True)
class RawBlocks:
    """A K-quant matrix [n, k] as the file stores it: ``raw`` is [n, bytes per row] of whole super-blocks."""

    type_name: str
    raw: np.ndarray
    n: int
    k: int

    def __post_init__(self) -> None:
        if self.type_name not in K_TYPES:
            raise ValueError(f"quant: {self.type_name} is not a K-quant ({', '.join(sorted(K_TYPES))})")
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


def _low_nibbles(q: np.ndarray, group: int) -> np.ndarray:
    """Codes [tiles, 16, k]: their low 4 bits in the nibble tiles, per group [tiles, groups, group * 8] bytes.

    A group's vector o holds inputs 8o..8o + 7: byte 4c + b has input 8o + b of row c in its low nibble and
    input 8o + 4 + b in its high one (quant_formats.pack_tiles' 4-bit layout)."""
    tiles, _, k = q.shape
    pairs = (q & 0x0F).reshape(tiles, TILE, k // group, group // 8, 2, 4)
    nibbles = pairs[..., 0, :] | (pairs[..., 1, :] << 4)  # [tiles, rows, groups, o, 4]
    return np.ascontiguousarray(nibbles.transpose(0, 2, 3, 1, 4)).reshape(tiles, k // group, -1)


def _high_plane(q: np.ndarray, group: int, bits: int) -> np.ndarray:
    """Codes [tiles, 16, k]: the bits above the fourth, per group [tiles, groups, 64] bytes: byte 4c + b holds
    input 4t + b of row c at bits t * bits (t = 0 .. group / 4 - 1)."""
    tiles, _, k = q.shape
    high = (q >> 4).reshape(tiles, TILE, k // group, group // 4, 4).astype(np.uint8)
    shifts = (np.arange(group // 4, dtype=np.uint8) * bits)[None, None, None, :, None]
    packed = np.bitwise_or.reduce(high << shifts, axis=3)  # [tiles, rows, groups, 4]
    return np.ascontiguousarray(packed.transpose(0, 2, 1, 3)).reshape(tiles, k // group, 64)


def _six_bit_header(blocks: np.ndarray, tiles: int, n: int, per_row: int) -> np.ndarray:
    """Q4_K/Q5_K: per tile and super-block, d[16], dmin[16] (f16) and the 6-bit scales and mins (see kquant_tiles.h)."""
    rows = blocks.reshape(n, per_row, -1)
    d = _by_tile(np.ascontiguousarray(rows[:, :, 0:4]).view(np.uint16), tiles)  # [tiles, 16, blocks, 2]: d, dmin
    sc, m = (_by_tile(part.reshape(n, per_row, 8), tiles) for part in k_sub_scales(blocks))  # [tiles, 16, blocks, 8]
    sc, m = sc.transpose(0, 2, 3, 1), m.transpose(0, 2, 3, 1)  # [tiles, blocks, sub-block, row]
    lows = [(x[..., :8] & 0x0F) | ((x[..., 8:] & 0x0F) << 4) for x in (sc, m)]
    top = ((sc[..., :8] >> 4) | ((sc[..., 8:] >> 4) << 2) | ((m[..., :8] >> 4) << 4) | ((m[..., 8:] >> 4) << 6))
    scales = np.concatenate([*lows, top], axis=2).astype(np.uint8)  # [tiles, blocks, 24, 8]
    halves = np.ascontiguousarray(d.transpose(0, 2, 3, 1)).view(np.uint8)  # [tiles, blocks, 2, 32]
    return np.concatenate([halves.reshape(tiles, per_row, 64), scales.reshape(tiles, per_row, 192)], axis=-1)


def _q6_header(blocks: np.ndarray, tiles: int, n: int, per_row: int) -> np.ndarray:
    """Q6_K: per tile and super-block, d[16] (f16) and the int8 scales [16 groups][16 rows]."""
    rows = blocks.reshape(n, per_row, -1)
    d = _by_tile(np.ascontiguousarray(rows[:, :, 208:210]).view(np.uint16)[..., 0], tiles)  # [tiles, 16, blocks]
    sc = _by_tile(rows[:, :, 192:208], tiles)  # [tiles, 16, blocks, 16 groups]
    d_bytes = np.ascontiguousarray(d.transpose(0, 2, 1)).view(np.uint8)  # [tiles, blocks, 32]
    sc_bytes = np.ascontiguousarray(sc.transpose(0, 2, 3, 1)).reshape(tiles, per_row, 256)
    return np.concatenate([d_bytes, sc_bytes], axis=-1)


def pack_blocks(m: RawBlocks) -> np.ndarray:
    """The kernels' layout of a K-quant matrix: uint8 [tiles, k / 256, block_bytes(type)]."""
    tiles, per_row = -(-m.n // TILE), m.k // SUPER_BLOCK
    blocks = np.ascontiguousarray(m.raw).reshape(m.n * per_row, -1)
    codes = _by_tile(m.decoded().q, tiles)
    group = 16 if m.type_name == "Q6_K" else 32
    header = (_q6_header if m.type_name == "Q6_K" else _six_bit_header)(blocks, tiles, m.n, per_row)
    parts = [header, _low_nibbles(codes, group).reshape(tiles, per_row, -1)]
    if HIGH_BITS[m.type_name]:
        parts.append(_high_plane(codes, group, HIGH_BITS[m.type_name]).reshape(tiles, per_row, -1))
    packed = np.concatenate(parts, axis=-1)
    assert packed.shape[-1] == block_bytes(m.type_name)
    return packed
