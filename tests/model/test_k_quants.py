"""The K-quants at the file's own size (model/quant/k_quants.py, model/native/csrc/kquant_tiles.h), and fused
projections whose parts differ in type, as llama-quantize's Q4_K_M files have them.

The uniform form (quant_formats.decode: a float32 scale and min per group) is the reference: it is exact
against gguf's dequantization. A K layout takes its activations quantized per super-block of 256 inputs (one
step, as llama.cpp's Q8_K) rather than per group, so its outputs are held to the reference of that
quantization, and every dot-product kind to the same bits, while taking no more bytes than the file. The
``kernels`` fixture is conftest's (the native kernels must build on the test machine).
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from conveyor import LLM, SamplingParams
from conveyor.benchmarks.compare import ROOT
from conveyor.model.quant.formats import TILE, dequantize, permute_rows, reference_linear
from conveyor.model.quant.k_quants import K_TYPES, JoinedRows, RawBlocks, block_bytes, concat_blocks
from conveyor.model.quant.linear import native_weight
from tests.model.test_quant_formats import random_raw

RTOL = 2e-6  # of the largest output, as tests/model/test_quantized.py holds the uniform kernels
SUPER_BLOCK = 256  # the inputs an activation step covers for these layouts
TYPES = sorted(K_TYPES)


def random_blocks(type_name: str, n: int, k: int, seed: int) -> RawBlocks:
    raw = random_raw(type_name, n, k, np.random.default_rng(seed), 1e-3, 0.05)
    return RawBlocks.from_file(raw, type_name, n, k)


def run(kernels, x: np.ndarray, weight, dot: str) -> np.ndarray:
    return kernels.quantized_linear(torch.from_numpy(x), weight, dot).numpy()


@pytest.mark.parametrize("type_name", TYPES)
def test_stored_at_the_files_size(kernels, type_name: str) -> None:
    _, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    assert block_bytes(type_name) == TILE * size  # a tile's super-block: 16 rows of the file's block, no more
    matrix = random_blocks(type_name, 64, 512, 0)
    assert native_weight(kernels, matrix).bytes == matrix.raw.nbytes


@pytest.mark.parametrize("type_name", TYPES)
def test_every_dot_product_gives_the_same_bits_near_the_reference(kernels, type_name: str) -> None:
    """The activations are quantized per super-block and the sub-block scales applied to integer sums, then three
    float operations a super-block in one order on every kind: all kinds agree to the bit."""
    rng = np.random.default_rng(1)
    for n, k, rows in [(1, 256, 1), (17, 512, 3), (33, 256, 9), (100, 768, 13), (40, 1024, 70)]:
        matrix = random_blocks(type_name, n, k, n + k)
        weight = native_weight(kernels, matrix)
        x = rng.standard_normal((rows, k)).astype(np.float32)
        want = reference_linear(x, matrix.decoded(), SUPER_BLOCK)
        first = None
        for dot in kernels.quant_dots():
            got = run(kernels, x, weight, dot)
            assert np.abs(got - want).max() <= RTOL * max(np.abs(want).max(), 1e-12), (type_name, n, k, rows, dot)
            if first is None:
                first = got
            assert np.array_equal(got, first), (type_name, n, k, rows, dot)


def test_row_counts_from_1_to_600(kernels) -> None:
    """Every micro-kernel height (1-8) and the row blocks of 64, on the vector kernels: each row's outputs are
    its outputs alone."""
    matrix = random_blocks("Q4_K", 40, 512, 3)
    weight = native_weight(kernels, matrix)
    x_all = np.random.default_rng(2).standard_normal((600, 512)).astype(np.float32) * 3
    for dot in kernels.quant_dots():
        alone = np.concatenate([run(kernels, x_all[i:i + 1], weight, dot) for i in range(0, 600, 37)])
        for rows in [*range(1, 10), 63, 64, 65, 129, 600]:
            got = run(kernels, x_all[:rows], weight, dot)
            assert np.array_equal(got[::37], alone[:len(got[::37])]), (rows, dot)


@pytest.mark.parametrize("type_name", TYPES)
def test_rows_looked_up_are_ggufs_dequantized_rows(kernels, type_name: str) -> None:
    n, k = 37, 512
    raw = random_raw(type_name, n, k, np.random.default_rng(4))
    weight = native_weight(kernels, RawBlocks.from_file(raw, type_name, n, k))
    want = gguf_dequantize(raw, GGMLQuantizationType[type_name]).reshape(n, k)
    ids = [0, 36, 15, 16, 5, 5]
    assert np.array_equal(kernels.quantized_rows(weight, ids).numpy().view(np.uint32), want[ids].view(np.uint32))


def test_rows_reorder_and_join_as_the_decoded_rows_do() -> None:
    a, b = random_blocks("Q6_K", 24, 256, 5), random_blocks("Q6_K", 8, 256, 6)
    order = np.random.default_rng(7).permutation(24)
    assert np.array_equal(a.permute_rows(order).decoded().q, permute_rows(a.decoded(), order).q)
    joined = concat_blocks([a, b])
    assert joined.n == 32 and np.array_equal(dequantize(joined.decoded())[24:], dequantize(b.decoded()))
    with pytest.raises(ValueError, match="one type"):
        concat_blocks([a, random_blocks("Q4_K", 8, 256, 8)])
    with pytest.raises(ValueError, match="permutation"):
        a.permute_rows(np.zeros(24, dtype=int))


def test_malformed_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="no super-block format"):
        RawBlocks("Q8_0", np.zeros((1, 34), np.uint8), 1, 32)
    with pytest.raises(ValueError, match=r"takes uint8 \[2, 288\]"):
        RawBlocks("Q4_K", np.zeros((2, 144), np.uint8), 2, 512)


def test_parts_of_different_types_run_side_by_side_with_a_bias(kernels) -> None:
    """A Q4_K_M layer's q/k/v: Q4_K queries and keys beside Q6_K values (and a uniform Q8_0 part for good measure),
    each on its own kernel, written into one output row."""
    from tests.model.test_quant_formats import random_matrix

    parts = (random_blocks("Q4_K", 48, 512, 9), random_blocks("Q6_K", 20, 512, 10), random_matrix("Q8_0", 9, 512, 11))
    joined = native_weight(kernels, JoinedRows(parts))
    assert (joined.n, joined.k) == (77, 512)
    assert joined.bytes == sum(native_weight(kernels, part).bytes for part in parts)
    x = np.random.default_rng(12).standard_normal((5, 512)).astype(np.float32)
    for dot in kernels.quant_dots():
        want = np.concatenate([run(kernels, x, native_weight(kernels, part), dot) for part in parts], axis=1)
        assert np.array_equal(run(kernels, x, joined, dot), want)
    rows = kernels.quantized_rows(joined, [0, 47, 48, 67, 68, 76]).numpy()
    floats = np.concatenate([dequantize(part.decoded() if isinstance(part, RawBlocks) else part) for part in parts])
    assert np.array_equal(rows, floats[[0, 47, 48, 67, 68, 76]])


def _harness():
    spec = importlib.util.spec_from_file_location("random_gguf", ROOT / "bench" / "random_gguf.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["random_gguf"] = module
    spec.loader.exec_module(module)
    return module


# A Q4_K_M file's mix, as llama-quantize writes it: Q6_K values and down projections beside Q4_K, the LM head
# tied to a Q6_K embedding.
Q4_K_M_MIX = {"token_embd.weight": "Q6_K", "attn_q.weight": "Q4_K", "attn_k.weight": "Q4_K",
              "attn_v.weight": "Q6_K", "attn_output.weight": "Q4_K", "ffn_gate.weight": "Q4_K",
              "ffn_up.weight": "Q4_K", "ffn_down.weight": "Q6_K"}


def test_a_file_mixing_types_in_a_layer_with_a_tied_q6_k_head_runs_natively(kernels, tmp_path) -> None:
    harness = _harness()
    path = tmp_path / "tiny-mixed.gguf"
    harness.write_f16(harness.SHAPES["tiny"], path, block_types=Q4_K_M_MIX)
    native = LLM(str(path), num_kv_blocks=64, kv_cache_dtype="float32")
    assert native.engine.runner.kernel_dtype == "Q4_K+Q6_K"  # every projection kept quantized, none fell back to float
    assert_first_tokens_agree_with_the_float_path(native, path)


def assert_first_tokens_agree_with_the_float_path(native: LLM, path) -> None:
    """The file's first greedy token and its top-5 logprobs on the native kernels against the float path of the
    same weights (--kernels torch) over the same cache: the same candidates within 0.01, the same choice where the
    float one is clear. The callers keep a float32 cache, so that what differs is the kernels' arithmetic alone
    (a float16 one, auto's for a GGUF file, moved a tiny random file's logprobs by up to 0.012 more)."""
    reference = LLM(str(path), num_kv_blocks=64, kernels="torch", kv_cache_dtype=native.engine.runner.kv_cache_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=5)
    prompts = [[1, 2, 3], [5, 100, 2000, 7], [42] * 10, [300, 301, 302, 303, 304], [9, 8, 7, 6, 5, 4]]
    for got, want in zip(native.generate(prompts, params, use_tqdm=False),
                         reference.generate(prompts, params, use_tqdm=False), strict=True):
        got_top, want_top = dict(got.logprobs[0].top), dict(want.logprobs[0].top)
        common = set(got_top) & set(want_top)
        assert len(common) >= 4 and all(abs(got_top[t] - want_top[t]) < 0.01 for t in common)
        ranked = sorted(want_top.values(), reverse=True)
        if ranked[0] - ranked[1] > 0.01:  # a clear float choice: the quantized path makes it too
            assert got.token_ids == want.token_ids


def test_the_format_registry_states_the_files_bits_and_the_kernels(kernels) -> None:
    """conveyor.core.formats.BLOCK_FORMATS, which the cost model reads, against gguf's block sizes and the
    bytes the kernels' weights really take."""
    from conveyor.core.formats import BLOCK_FORMATS
    from conveyor.model.quant.formats import SUPPORTED_TYPES, decode

    assert set(BLOCK_FORMATS) == set(SUPPORTED_TYPES)
    n, k = 64, 512
    for name, fmt in BLOCK_FORMATS.items():
        assert (fmt.block, fmt.file_bytes) == GGML_QUANT_SIZES[GGMLQuantizationType[name]]
        raw = random_raw(name, n, k, np.random.default_rng(13))
        matrix = RawBlocks.from_file(raw, name, n, k) if name in K_TYPES else decode(raw, name, n, k)
        assert native_weight(kernels, matrix).bytes * 8 / (n * k) == fmt.stored_bits, name
