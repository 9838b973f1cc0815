"""The formats Conveyor runs, in one place: float dtypes, KV cache dtypes and GGUF block types, with the bytes
a file holds and the bits the engine stores.

The torch and numpy tables (conveyor.model.dtypes, conveyor.model.quant.formats) key into these; the options'
choices are read from them. The engine reports the format of the weights it runs as a WeightFormat of stored
bits, and the cost model prices a step's weight reads by it, so that the roofline and the simulator hold for
quantized models as for float ones.
"""

from __future__ import annotations

from dataclasses import dataclass

# Float dtypes (--dtype): bytes per element.
FLOAT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# --kv-cache-dtype: bytes per K or V element (None: auto, resolved by kv_cache_format). fp8 is e5m2, held as its
# bits.
KV_CACHE_BYTES: dict[str, int | None] = {"auto": None, "float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1,
                                         "fp8_e5m2": 1}

# What ``auto`` stores for a GGUF file's weights run in float32: float16, the cache llama.cpp and Ollama keep for
# such a file by default, half float32's bytes (docs/kv-cache.md, "A float16 KV cache").
GGUF_KV_CACHE = "float16"


def kv_cache_format(kv_cache_dtype: str, model_dtype: str, gguf_file: bool) -> str:
    """What the cache stores, ``auto`` resolved: for a GGUF file's weights in float32, GGUF_KV_CACHE; else the
    model's dtype (a float checkpoint's cache is its activations' precision, as vLLM's ``auto``)."""
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    return GGUF_KV_CACHE if gguf_file and model_dtype == "float32" else model_dtype


def kv_element_bytes(kv_cache_dtype: str, model_dtype: str, gguf_file: bool) -> int:
    """Bytes of one K or V element in the cache (kv_cache_format's)."""
    return KV_CACHE_BYTES[kv_cache_format(kv_cache_dtype, model_dtype, gguf_file)]


@dataclass(frozen=True, slots=True)
class WeightFormat:
    """Bits a weight takes as stored: the layers' projections and the LM head (a GGUF file often stores them
    differently: the default model's Q4_1 layers and Q8_0 embedding); ``name`` says which format it is."""

    name: str
    layer_bits: float
    lm_head_bits: float

    @property
    def quantized(self) -> bool:
        """Whether the layers are stored as integer codes (under 16 bits a weight), whose products run as int8
        dot products rather than float GEMMs."""
        return self.layer_bits < 16


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """A GGUF block format: weights per block and bytes per block in the file (llama.cpp's block sizes: Q4_1 is
    32 weights in 20 bytes, Q4_K 256 in 144), and the bits a weight takes as the kernels store it, scales and
    mins included (conveyor/model/quant/formats.py, k_quants.py)."""

    name: str
    block: int
    file_bytes: int
    stored_bits: float

    @property
    def file_bits(self) -> float:
        return 8.0 * self.file_bytes / self.block

    @property
    def super_block(self) -> bool:
        """256-weight super-blocks (the K-quants, IQ4_XS), run from their own layout
        (conveyor/model/quant/k_quants.py)."""
        return self.block == 256


# The one table of the formats Conveyor runs. Stored bits equal the file's but for Q5_0 and Q5_1, whose 5-bit codes
# the uniform tiles hold in whole bytes (each beside its float16 scale, and Q5_1's float16 min).
BLOCK_FORMATS = {f.name: f for f in (
    BlockFormat("Q8_0", 32, 34, 8.5),
    BlockFormat("Q4_0", 32, 18, 4.5),
    BlockFormat("Q4_1", 32, 20, 5.0),
    BlockFormat("Q5_0", 32, 22, 8.5),
    BlockFormat("Q5_1", 32, 24, 9.0),
    BlockFormat("IQ4_NL", 32, 18, 4.5),
    BlockFormat("Q4_K", 256, 144, 4.5),
    BlockFormat("Q5_K", 256, 176, 5.5),
    BlockFormat("Q6_K", 256, 210, 6.5625),
    BlockFormat("IQ4_XS", 256, 136, 4.25),
    BlockFormat("Q3_K", 256, 110, 3.4375),
    BlockFormat("Q2_K", 256, 84, 2.625),
)}


def gguf_weights(layer_type: str, lm_head_type: str) -> WeightFormat | None:
    """A GGUF file's format as the engine stores it (what a step reads), its layers in one block type and its LM
    head in another; None for a type not in BLOCK_FORMATS."""
    if layer_type not in BLOCK_FORMATS or lm_head_type not in BLOCK_FORMATS:
        return None
    layers, head = BLOCK_FORMATS[layer_type], BLOCK_FORMATS[lm_head_type]
    return WeightFormat(f"{layer_type}/{lm_head_type}", layers.stored_bits, head.stored_bits)
