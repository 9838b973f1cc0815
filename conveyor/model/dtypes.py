"""The torch dtypes of the float and KV cache formats that conveyor.core.formats names (the one registry)."""

from __future__ import annotations

import torch

from conveyor.core.formats import FLOAT_BYTES, KV_CACHE_BYTES

# --dtype's names as torch dtypes.
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in FLOAT_BYTES}

# --kv-cache-dtype's names as the cache tensor's dtype (None: auto, which the runner resolves before it asks:
# conveyor.core.formats.kv_cache_format). fp8 is e5m2, the one fp8 format
# that needs no scale (e4m3 tops out at 448, which K can pass), as vLLM's CPU backend stores it; held as its
# uint8 bits, since torch has no index ops on float8 tensors.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    name: None if size is None else torch.uint8 if size == 1 else DTYPES[name] for name, size in KV_CACHE_BYTES.items()
}
assert all(DTYPES[name].itemsize == size for name, size in FLOAT_BYTES.items())


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype for ``--kv-cache-dtype name`` (uint8 holds fp8 e5m2 bits)."""
    return KV_CACHE_DTYPES[name] or model_dtype
