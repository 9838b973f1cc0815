"""Layers whose weights stay quantized: a GGUF file's integer codes, run by the native quantized kernels.

A quantized projection holds no float copy of its weight: the model's resident size is the file's. Its
``forward`` is what the PyTorch side of the model calls (prompt logprobs run the LM head from Python); a step
runs in the native stack, which takes the same ``QuantizedWeight`` objects (Decoder.use_native_kernels).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn

from conveyor.model.quant.formats import TILE, QuantizedMatrix, pack_tiles, row_slice
from conveyor.model.quant.k_quants import SUPER_BLOCK, JoinedRows, RawBlocks, block_bytes, pack_blocks

ROWS_PER_PACK = 4096  # rows packed at a time: a whole table at once held three copies of it (30 MB each, Q8_0)
ARENA_CHUNK_BYTES = 256 << 20  # a WeightArena's chunks


class WeightArena:
    """Memory for a model's packed weights, carved one after another, in the order they load, out of chunks
    on huge pages (the kernels' ``huge_page_buffer``; a weight larger than a chunk gets one of its own). A
    decode step streams every weight once, and on 4 KiB pages that stream crosses a page every 4 KiB: on a
    2-core Zen 4, one thread streamed a 57,344 x 4,096 Q4_K weight at one row at 16-17 GB/s from 4 KiB pages
    and 26-27 GB/s from huge pages (`kernel_check bench`). One mapping a weight would leave the many weights
    under 2 MiB (a mixture's experts) on small pages, since a huge page must lie wholly inside the range
    advised. A chunk lives as long as any weight carved from it."""

    def __init__(self, kernels: ModuleType, chunk_bytes: int = ARENA_CHUNK_BYTES) -> None:
        self._kernels = kernels
        self._chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised (zero) tensor of ``shape`` and ``dtype``, 64-byte aligned."""
        nbytes = math.prod(shape) * dtype.itemsize
        span = -(-max(nbytes, 1) // 64) * 64
        if span > self._chunk_bytes:
            return self._bytes(span)[:nbytes].view(dtype).view(shape)
        if self._chunk is None or self._used + span > self._chunk.numel():
            self._chunk, self._used = self._bytes(self._chunk_bytes), 0
        out = self._chunk[self._used:self._used + nbytes]
        self._used += span
        return out.view(dtype).view(shape)

    def _bytes(self, nbytes: int) -> torch.Tensor:
        return self._kernels.huge_page_buffer(-(-nbytes // 4), False).view(torch.uint8)


def native_weight(kernels: ModuleType, matrix: QuantizedMatrix | RawBlocks | JoinedRows,
                  arena: WeightArena | None = None) -> object:
    """A matrix as the kernels' ``QuantizedWeight``: a uniform matrix packed once into its tiles
    (native/csrc/quant_gemm.h), a K-quant into its super-blocks at the file's size (kquant_tiles.h), joined
    rows as their parts side by side; into ``arena``'s memory where given, else ordinary allocations. The weight
    keeps the packed tensors alive. Packed ROWS_PER_PACK rows at a time into the final tensors, so that loading
    peaks at one part decoded plus the packed copy, not at several."""
    if isinstance(matrix, JoinedRows):
        return kernels.QuantizedWeight.join([native_weight(kernels, part, arena) for part in matrix.parts])
    empty = torch.empty if arena is None else arena.empty
    if isinstance(matrix, RawBlocks):
        return _native_k_quant(kernels, matrix, empty)
    tiles, groups = -(-matrix.n // TILE), matrix.k // matrix.group
    bytes_per_group = TILE * matrix.group * matrix.storage_bits // 8
    scale_dtype = torch.float16 if matrix.scales.dtype.itemsize == 2 else torch.float32
    codes = empty((tiles, groups, bytes_per_group), dtype=torch.uint8)
    scales = empty((tiles, groups, TILE), dtype=scale_dtype)
    mins = empty((tiles, groups, TILE) if matrix.mins is not None else (0,), dtype=scale_dtype)
    for start in range(0, matrix.n, ROWS_PER_PACK):
        part = pack_tiles(row_slice(matrix, start, start + ROWS_PER_PACK))
        first = start // TILE
        last = first + part.codes.shape[0]
        codes[first:last] = torch.from_numpy(part.codes)
        scales[first:last] = torch.from_numpy(part.scales)
        if part.mins is not None:
            mins[first:last] = torch.from_numpy(part.mins)
    return kernels.QuantizedWeight(codes, scales, mins, matrix.n, matrix.k, matrix.group, matrix.storage_bits,
                                   matrix.code_bits, matrix.zero_point, matrix.levels is not None)


def _native_k_quant(kernels: ModuleType, matrix: RawBlocks, empty: Callable[..., torch.Tensor]) -> object:
    tiles = -(-matrix.n // TILE)
    blocks = empty((tiles, matrix.k // SUPER_BLOCK, block_bytes(matrix.type_name)), dtype=torch.uint8)
    for start in range(0, matrix.n, ROWS_PER_PACK):
        part = pack_blocks(matrix.rows(start, start + ROWS_PER_PACK))
        blocks[start // TILE: start // TILE + part.shape[0]] = torch.from_numpy(part)
    return kernels.QuantizedWeight.k_quant(blocks, matrix.type_name, matrix.n, matrix.k)


class QuantizedLinear(nn.Module):
    """y = x W^T (+ bias) with W quantized; x and y float32, on the build's best dot-product kind (the native
    stack runs each projection on the kind --kernels auto chose; this forward serves prompt logprobs)."""

    def __init__(self, kernels: ModuleType, weight: object, bias: torch.Tensor | None, source: str) -> None:
        super().__init__()
        self.kernels = kernels
        self.quantized = weight
        self.in_features, self.out_features = weight.k, weight.n
        self.source = source  # the GGUF type its codes came from, e.g. "Q4_1"
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernels.quantized_linear(x.float().contiguous(), self.quantized)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.source}"


class QuantizedExperts(nn.Module):
    """One projection of every expert of a mixture, each expert's weight kept quantized (a GGUF file's stacked
    3-D tensor, one ``QuantizedWeight`` per expert), for the native stack's expert-grouped step. ``in_features``
    and ``out_features`` count all experts' outputs, as ExpertLinears' do."""

    def __init__(self, weights: list[object], source: str) -> None:
        super().__init__()
        self.quantized_experts = list(weights)
        self.in_features, self.out_features = weights[0].k, sum(weight.n for weight in weights)
        self.source = source  # the GGUF type its codes came from, e.g. "Q4_K"

    def expert_weights(self) -> list[object]:
        """Each expert's weight as the native stack takes it."""
        return list(self.quantized_experts)

    def stored_bytes(self) -> int:
        """What a step that touches every expert reads of this projection."""
        return sum(weight.bytes for weight in self.quantized_experts)

    def extra_repr(self) -> str:
        return (f"experts={len(self.quantized_experts)}, in_features={self.in_features}, "
                f"out_features={self.out_features}, {self.source}")


class QuantizedEmbedding(nn.Module):
    """Token embeddings looked up from a quantized table (tied models share it with their LM head). ``weight`` is
    an empty float32 tensor: it tells the executor the model's device and activation dtype."""

    def __init__(self, kernels: ModuleType, weight: object) -> None:
        super().__init__()
        self.kernels = kernels
        self.quantized = weight
        self.num_embeddings, self.embedding_dim = weight.n, weight.k
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        flat = self.kernels.quantized_rows(self.quantized, token_ids.reshape(-1).tolist())
        return flat.view(*token_ids.shape, self.embedding_dim)
