"""Attention over block tables, for a flat batch that mixes prefill and decode.

The executor orders a step's tokens decode-first: the leading rows are one
token each of running requests, the rest are prompt chunks. Decode rows come
in groups of similar context length; a group attends at once, its cached K/V
gathered through a block table padded to the group's longest context, so a
long-tailed batch does not pad every row to its longest request. Each prompt
chunk attends causally to its own cached prefix plus itself.

With the native kernels the whole decoder stack runs in one native call
(model/native/csrc/native_decoder.h, Decoder.run_native), whose attention reads every
row's context, prompt rows and decode rows alike, through its sequence's
block table; no grouping, no padded copy, and none of this metadata.

A layer with a window attends to the last ``window`` positions only (itself
included, as the reference's sliding-window mask): its masks are the full
ones with the positions behind the window cleared, built once per step and
window (:func:`windowed`) and shared by every layer of that window. Where the
block size is known, the blocks wholly behind every row's window are left out
of the gather too (a decode group's by its shortest row), so a windowed layer
reads about its window, not its context; they may be blocks a windowed KV
group has given back (conveyor.core.kv.groups), whose entries read block 0.

The cache may store K and V in a narrower dtype than the model computes in (``--kv-cache-dtype``):
bfloat16, float16, or fp8 e5m2 held as its uint8 bits (torch has no index ops on float8 tensors). K and V are
rounded as they are written and widened as they are read, and a first prompt chunk, which attends to
its own rows without reading the cache, attends to them rounded the same way: every row sees K and V
as the cache holds them, as the native stack's attention does (it reads everything from the cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillChunk:
    """A prompt chunk: query rows ``[query_start, query_end)`` at positions ``start_position...``."""

    query_start: int
    query_end: int
    start_position: int
    block_ids: torch.Tensor  # blocks covering [key_start, context_len), only read when start_position > 0
    # [n, context_len - key_start] bool, when start_position > 0 or the layers have a window; None: plain causal
    causal_mask: torch.Tensor | None
    key_start: int = 0  # the position of the first key block_ids holds (a multiple of the block size)

    @property
    def context_len(self) -> int:
        return self.start_position + self.query_end - self.query_start


@dataclass(slots=True)
class DecodeGroup:
    """Decode rows ``[row_start, row_end)``, one token each, of similar context length."""

    row_start: int
    row_end: int
    block_tables: torch.Tensor  # [rows, max_blocks], padded with block 0
    mask: torch.Tensor  # [rows, 1, 1, max_blocks * block_size] bool, False on padding
    context_lens: torch.Tensor | None = None  # [rows]: each row's context, for a window's mask


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step by the executor and shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] flat KV slot of each new token
    decodes: list[DecodeGroup]
    prefills: list[PrefillChunk]
    by_window: dict[int, AttentionMetadata] = field(default_factory=dict)  # windowed(): built once per window
    block_size: int = 0  # 0: unknown, so windowed() gathers every block and only masks


def windowed(meta: AttentionMetadata, window: int | None) -> AttentionMetadata:
    """``meta`` for layers that see the last ``window`` positions: each mask also cleared where key position
    <= query position - window, and blocks wholly behind every row's window left out (None: ``meta`` as it
    is)."""
    if window is None:
        return meta
    if window not in meta.by_window:
        decodes = [_windowed_decodes(group, window, meta.block_size) for group in meta.decodes]
        prefills = [_windowed_chunk(chunk, window, meta.block_size) for chunk in meta.prefills]
        meta.by_window[window] = AttentionMetadata(meta.slot_mapping, decodes, prefills, block_size=meta.block_size)
    return meta.by_window[window]


def _within(key_start: int, key_end: int, query_positions: torch.Tensor, window: int) -> torch.Tensor:
    """[queries, key_end - key_start] bool: key position within the window of each query position."""
    keys = torch.arange(key_start, key_end, device=query_positions.device)
    return keys[None, :] > query_positions[:, None] - window


def _windowed_decodes(group: DecodeGroup, window: int, block_size: int) -> DecodeGroup:
    """A decode group's tables from the first block its shortest row's window reaches, its mask to match."""
    first = max(0, (int(group.context_lens.min()) - window) // block_size) if block_size else 0
    num_keys, rows = group.mask.shape[-1], group.mask.shape[0]
    within = _within(first * block_size, num_keys, group.context_lens - 1, window).view(rows, 1, 1, -1)
    mask = group.mask[..., first * block_size :] & within
    return replace(group, block_tables=group.block_tables[:, first:], mask=mask)


def _windowed_chunk(chunk: PrefillChunk, window: int, block_size: int) -> PrefillChunk:
    queries = torch.arange(chunk.start_position, chunk.context_len, device=chunk.block_ids.device)
    causal = chunk.causal_mask
    if causal is None:  # a first chunk: its keys are its own rows
        causal = torch.arange(chunk.context_len, device=queries.device)[None, :] <= queries[:, None]
        return replace(chunk, causal_mask=causal & _within(0, chunk.context_len, queries, window))
    first = 0
    if block_size:  # blocks left out: those wholly before the first query's window
        first = max(0, (chunk.start_position - window + 1) // block_size - chunk.key_start // block_size)
    key_start = chunk.key_start + first * block_size
    mask = causal[:, first * block_size:] & _within(key_start, chunk.context_len, queries, window)
    return replace(chunk, block_ids=chunk.block_ids[first:], causal_mask=mask, key_start=key_start)


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to what a cache of ``cache_dtype`` stores (fp8 e5m2 as its bits)."""
    if cache_dtype == torch.uint8:
        return x.to(torch.float8_e5m2).view(torch.uint8)
    return x.to(cache_dtype)


def from_cache(stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache elements widened to ``dtype`` (a no-op where the cache is in it already)."""
    if stored.dtype == torch.uint8:
        return stored.view(torch.float8_e5m2).to(dtype)
    return stored.to(dtype)


def as_cached(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a cache of ``cache_dtype`` gives it back: rounded there and widened again."""
    return x if cache_dtype == x.dtype else from_cache(to_cache(x, cache_dtype), x.dtype)


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store this step's K/V in their slots, rounded to the cache's dtype. ``kv_cache``: [2, num_blocks,
    block_size, kv_heads, head_dim]."""
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, to_cache(key, kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, to_cache(value, kv_cache.dtype))


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., num_blocks] block ids -> [..., kv_heads, num_blocks * block_size, head_dim], widened to ``dtype``."""
    blocks = from_cache(cache[block_ids], dtype)  # [..., nb, bs, kvh, d]
    *lead, nb, bs, kvh, d = blocks.shape
    return blocks.reshape(*lead, nb * bs, kvh, d).transpose(-3, -2)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """query [T, H, D], key/value [T, KVH, D] of this step's tokens -> [T, H, D]; with ``window``, each row
    attends to the last ``window`` positions only."""
    write_kv(kv_cache, key, value, meta.slot_mapping)
    meta = windowed(meta, window)
    out = torch.empty_like(query)
    for group in meta.decodes:
        rows = slice(group.row_start, group.row_end)
        k = _gather(kv_cache[0], group.block_tables, query.dtype)
        v = _gather(kv_cache[1], group.block_tables, query.dtype)
        q = query[rows].unsqueeze(2)  # [rows, H, 1, D]
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale, enable_gqa=True)
        out[rows] = attn.squeeze(2)
    for chunk in meta.prefills:
        rows = slice(chunk.query_start, chunk.query_end)
        q = query[rows].transpose(0, 1)  # [H, n, D]
        if chunk.start_position == 0:
            k = as_cached(key[rows], kv_cache.dtype).transpose(0, 1)
            v = as_cached(value[rows], kv_cache.dtype).transpose(0, 1)
            causal = chunk.causal_mask is None
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.causal_mask, is_causal=causal, scale=scale,
                                                  enable_gqa=True)
        else:
            num_keys = chunk.context_len - chunk.key_start
            k = _gather(kv_cache[0], chunk.block_ids, query.dtype)[:, :num_keys]
            v = _gather(kv_cache[1], chunk.block_ids, query.dtype)[:, :num_keys]
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.causal_mask, scale=scale, enable_gqa=True)
        out[rows] = attn.transpose(0, 1)
    return out
