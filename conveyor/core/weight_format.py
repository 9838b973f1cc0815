"""How many bits a model's weights take as stored: what a decode step reads, whatever it computes in.

The engine reports the format of the weights it runs (a GGUF file's quantized codes, scales and mins), and the
cost model prices a step's weight reads by it, so that the roofline and the simulator hold for quantized
models as for float ones.
"""

from __future__ import annotations

from dataclasses import dataclass


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


# Bits a weight of each GGUF block format takes, scales and mins included (llama.cpp's block sizes: Q4_1 is 32
# weights in 20 bytes, Q4_K 256 in 144).
GGUF_BITS = {"Q8_0": 8.5, "Q4_0": 4.5, "Q4_1": 5.0, "Q5_0": 5.5, "Q5_1": 6.0, "Q4_K": 4.5, "Q5_K": 5.5, "Q6_K": 6.5625}


def gguf_weights(layer_type: str, lm_head_type: str) -> WeightFormat | None:
    """A GGUF file's format, its layers in one block type and its LM head in another; None for a type not in
    GGUF_BITS."""
    if layer_type not in GGUF_BITS or lm_head_type not in GGUF_BITS:
        return None
    return WeightFormat(f"{layer_type}/{lm_head_type}", GGUF_BITS[layer_type], GGUF_BITS[lm_head_type])

