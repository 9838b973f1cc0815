"""The formats at 4.5 bits a weight and under: IQ4_NL (32-weight blocks whose 4-bit codes index 16 non-linear
levels), kept at the file's size in the uniform tiles, its codes looked up in registers; IQ4_XS (the same levels in
256-weight super-blocks with 6-bit sub-block scales), Q3_K and Q2_K, kept in their super-blocks.

What the shared tests hold of every format (tests/model/test_quant_formats.py: the decode bit for bit against
gguf's; tests/model/test_quantized.py: every dot-product kind against the reference at a few shapes;
tests/model/test_k_quants.py, of the super-block formats: every kind to the same bits) holds of these too; here,
what is theirs: the levels' table, 1 to 600 rows on every kind, and a tiny file of each type served natively.
The ``kernels`` fixture is conftest's (the native kernels must build on the test machine).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import IQ4_NL
from gguf.quants import dequantize as gguf_dequantize

from conveyor import LLM
from conveyor.core.formats import BLOCK_FORMATS
from conveyor.model.quant.formats import IQ4_LEVELS, QuantizedMatrix, decode, dequantize, reference_linear
from conveyor.model.quant.k_quants import K_TYPES, RawBlocks
from conveyor.model.quant.linear import native_weight
from tests.model.test_k_quants import _harness, assert_first_tokens_agree_with_the_float_path
from tests.model.test_quant_formats import random_raw

RTOL = 2e-6  # of the largest output, as tests/model/test_quantized.py holds every format
TYPES = ["IQ4_NL", "IQ4_XS", "Q3_K", "Q2_K"]
PROJECTIONS = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight",
               "ffn_up.weight", "ffn_down.weight")


def kept(raw: np.ndarray, type_name: str, n: int, k: int) -> QuantizedMatrix | RawBlocks:
    """A tensor's bytes as the loader keeps them: the uniform form, or the super-blocks as read."""
    return RawBlocks.from_file(raw, type_name, n, k) if type_name in K_TYPES else decode(raw, type_name, n, k)


def random_weight(type_name: str, n: int, k: int, seed: int) -> QuantizedMatrix | RawBlocks:
    return kept(random_raw(type_name, n, k, np.random.default_rng(seed), 1e-3, 0.05), type_name, n, k)


def uniform(weight: QuantizedMatrix | RawBlocks) -> QuantizedMatrix:
    return weight.decoded() if isinstance(weight, RawBlocks) else weight


def run(kernels, x: np.ndarray, weight, dot: str) -> np.ndarray:
    return kernels.quantized_linear(torch.from_numpy(x), weight, dot).numpy()


def test_the_levels_are_ggufs_plus_128() -> None:
    assert IQ4_LEVELS.dtype == np.uint8 and np.array_equal(IQ4_LEVELS.astype(int) - 128, IQ4_NL.kvalues)


@pytest.mark.parametrize("type_name", TYPES)
def test_stored_at_the_files_bits(kernels, type_name: str) -> None:
    n, k = 64, 512
    weight = native_weight(kernels, random_weight(type_name, n, k, 0))
    assert weight.bytes * 8 / (n * k) == BLOCK_FORMATS[type_name].file_bits == BLOCK_FORMATS[type_name].stored_bits


@pytest.mark.parametrize("type_name", TYPES)
def test_rows_looked_up_are_ggufs_dequantized_rows(kernels, type_name: str) -> None:
    """The native side's own copy of the levels, held to gguf's through the rows it looks up."""
    n, k = 37, 512
    raw = random_raw(type_name, n, k, np.random.default_rng(4))
    weight = native_weight(kernels, kept(raw, type_name, n, k))
    want = gguf_dequantize(raw, GGMLQuantizationType[type_name]).reshape(n, k)
    ids = [0, 36, 15, 16, 5, 5]
    assert np.array_equal(kernels.quantized_rows(weight, ids).numpy().view(np.uint32), want[ids].view(np.uint32))


@pytest.mark.parametrize("type_name", TYPES)
def test_row_counts_from_1_to_600_on_every_kind(kernels, type_name: str) -> None:
    """Every micro-kernel height and the row blocks of 64, a ragged last tile, on every dot-product kind the build
    has (vnni512, vnni256, avx2, portable on an AVX-512 VNNI machine), against the reference of their arithmetic."""
    matrix = random_weight(type_name, 40, 512, 3)
    weight = native_weight(kernels, matrix)
    x_all = np.random.default_rng(2).standard_normal((600, 512)).astype(np.float32) * 3
    for rows in [*range(1, 10), 17, 63, 64, 65, 129, 600]:
        want = reference_linear(x_all[:rows], uniform(matrix), 256 if type_name in K_TYPES else None)
        for dot in kernels.quant_dots():
            got = run(kernels, x_all[:rows], weight, dot)
            assert np.abs(got - want).max() <= RTOL * np.abs(want).max(), (rows, dot)


def test_iq4_nl_beside_another_format_runs_side_by_side(kernels) -> None:
    """Codes that index levels join no other codes into one matrix: each part keeps its own form and kernel."""
    from conveyor.model.weights.gguf_weights import join_rows

    parts = [random_weight("IQ4_NL", 24, 256, 5), random_weight("Q4_0", 8, 256, 6)]
    joined = join_rows(parts)
    x = np.random.default_rng(7).standard_normal((3, 256)).astype(np.float32)
    for dot in kernels.quant_dots():
        want = np.concatenate([run(kernels, x, native_weight(kernels, part), dot) for part in parts], axis=1)
        assert np.array_equal(run(kernels, x, native_weight(kernels, joined), dot), want)
    assert np.array_equal(dequantize(join_rows(parts[:1] * 2)), np.concatenate([dequantize(parts[0])] * 2))


@pytest.mark.parametrize("type_name", TYPES)
def test_a_tiny_file_of_the_type_runs_natively(kernels, tmp_path, type_name: str) -> None:
    """Every projection and the tied embedding of the type (the values Q8_0 beside them in the qkv projection):
    loaded natively, and its first greedy tokens agree with the float path of the same weights."""
    path = tmp_path / f"tiny-{type_name}.gguf"
    mix = {name: type_name for name in ("token_embd.weight", *PROJECTIONS)} | {"attn_v.weight": "Q8_0"}
    _harness().write_f16(_harness().SHAPES["tiny"], path, block_types=mix)
    native = LLM(str(path), num_kv_blocks=64, kv_cache_dtype="float32")
    assert native.engine.runner.kernel_dtype == "+".join(sorted({type_name, "Q8_0"}))
    assert_first_tokens_agree_with_the_float_path(native, path)
