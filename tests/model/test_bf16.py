"""bfloat16 on CPUs with AVX512-BF16: the GEMMs on bf16 weights, attention over a bf16 KV cache, the native
stack and the engine with ``dtype="bfloat16"``.

The kernels are held to float32 PyTorch on the same bf16-rounded values (what the hardware multiplies
exactly; only the order of float32 additions differs); the stack and the engine, whose activations are
rounded to bf16 on the way into each GEMM, to the float32 model within a relative error and against the
torch bfloat16 path's own. Every test that needs the bf16 kernels is skipped, naming avx512_bf16, on a CPU
without it; the fallback there is tested everywhere.
"""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conveyor.model.native.kernels import BF16_FEATURE, WIDTH_ENV, bfloat16_unavailable
from tests.harness import cpu_flags
from tests.references import paged_attention_reference, ragged_rows


@pytest.fixture(scope="module")
def bf16(kernels):
    """The kernels, where they have the bfloat16 GEMMs; skipped, naming the feature, where the CPU lacks it."""
    if not kernels.has_bfloat16():
        pytest.skip(f"CPU lacks {BF16_FEATURE}: no bfloat16 kernels to check")
    return kernels


def rounded(t: torch.Tensor) -> torch.Tensor:
    """t's values as bf16 holds them, in float32: what the bf16 kernels multiply."""
    return t.bfloat16().float()


def test_an_avx512_bf16_cpu_gets_the_bfloat16_kernels(kernels):
    """The bf16 path is only ever skipped on a CPU without avx512_bf16, never lost on one that has it."""
    flags = cpu_flags()
    assert kernels.has_bfloat16() == (BF16_FEATURE in flags) or not flags


@pytest.mark.parametrize("n", [1, 17, 31, 32, 33, 100])
@pytest.mark.parametrize("k", [1, 7, 8, 64, 71])
def test_bf16_linear_matches_f_linear_on_the_rounded_values(bf16, n, k):
    """Ragged everything: n off the 32-column tile, odd k (the packing pads the last pair with a zero), and
    every row count from 1 to 70 (the 8-row micro-kernel, its remainders, the 64-row block and past it)."""
    torch.manual_seed(n * 100 + k)
    weight = torch.randn(n, k)
    packed = bf16.pack_linear_weight(weight, 512, bfloat16=True)
    assert packed.dtype == torch.bfloat16 and packed.shape == (-(-n // 32), (k + 1) // 2, 32, 2)
    x = torch.randn(70, k)
    want = F.linear(rounded(x), rounded(weight))
    for m in range(1, 71):
        torch.testing.assert_close(bf16.packed_linear(x[:m], packed, n), want[:m], rtol=1e-5, atol=1e-4)


def test_bf16_linear_at_every_micro_kernel_height(bf16):
    torch.manual_seed(2)
    weight, x = torch.randn(45, 37), torch.randn(67, 37)
    packed = bf16.pack_linear_weight(weight, 512, bfloat16=True)
    want = F.linear(rounded(x), rounded(weight))
    for rows in range(1, 15):
        torch.testing.assert_close(bf16.packed_linear(x, packed, 45, rows), want, rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="max_rows"):
        bf16.packed_linear(x, packed, 45, 15)


def test_bf16_packing_lays_pairs_of_k_side_by_side(bf16):
    """[tiles, k / 2, 32, 2]: column c's inputs 2p and 2p + 1 at [c // 32, p, c % 32, 0 and 1], zeros past n
    and k; a weight given in bf16 packs to the same as its float32 values."""
    weight = torch.randn(40, 5)
    packed = bf16.pack_linear_weight(weight, 512, bfloat16=True)
    assert packed[1, 2, 3, 0] == weight[35, 4].bfloat16() and packed[0, 1, 7, 1] == weight[7, 3].bfloat16()
    assert packed[:, 2, :, 1].eq(0).all() and packed[1, :, 8:].eq(0).all()
    assert torch.equal(bf16.pack_linear_weight(weight.bfloat16(), 512, bfloat16=True), packed)


def test_bf16_weights_refuse_what_they_cannot_run(bf16):
    packed = bf16.pack_linear_weight(torch.randn(16, 7), 512, bfloat16=True)
    bf16.packed_linear(torch.randn(2, 8), packed, 16)  # 7 or 8 inputs: both fill 4 pairs
    with pytest.raises(RuntimeError, match="features"):
        bf16.packed_linear(torch.randn(2, 9), packed, 16)
    with pytest.raises(RuntimeError, match="512-bit"):
        bf16.pack_linear_weight(torch.randn(16, 8), 256, bfloat16=True)
    with pytest.raises(RuntimeError, match="float32"):
        bf16.pack_linear_weight(torch.randn(16, 8).bfloat16(), 512)


def test_packing_bf16_where_the_cpu_lacks_it_names_the_feature(kernels):
    if kernels.has_bfloat16():
        pytest.skip(f"this CPU has {BF16_FEATURE}: bfloat16 packs")
    with pytest.raises(RuntimeError, match=BF16_FEATURE):
        kernels.pack_linear_weight(torch.randn(4, 4), 512, bfloat16=True)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (6, 2, 8), (9, 3, 64), (2, 1, 128)])
def test_attention_over_a_bf16_cache_matches_sdpa_on_the_rounded_values(bf16, width, block_size, heads, kv_heads,
                                                                           head_dim):
    """Decode rows of ragged contexts and three prompt chunks (causal) in one call, over a bf16 cache; the
    last chunk (positions 200..239) long enough for the tiled kernel."""
    torch.manual_seed(block_size + head_dim)
    cache = torch.randn(2, 400, block_size, kv_heads, head_dim).bfloat16()
    tables, row_seq, lens = ragged_rows(400, block_size)
    query = torch.randn(len(row_seq), heads, head_dim)
    got = bf16.paged_attention(query, cache[0], cache[1], tables, row_seq, lens, head_dim**-0.5, width)
    want = paged_attention_reference(query, cache[0].float(), cache[1].float(), tables, row_seq, lens, head_dim**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_attention_refuses_k_and_v_of_different_dtypes(kernels):
    k, v = torch.randn(8, 4, 1, 8).bfloat16(), torch.randn(8, 4, 1, 8)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernels.paged_attention(torch.randn(1, 1, 8), k, v, torch.tensor([[0, 1]]), torch.tensor([0]),
                                torch.tensor([3]), 1.0)


def _bf16_valued_model(intermediate_size: int):
    """tests.model.test_kernels' random two-layer model (biases everywhere), its weights rounded to bf16 values."""
    from tests.model.test_native_stack import _stack_model

    model = _stack_model(intermediate_size)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(rounded(p))
    return model


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


def _stack_errors(kernels, intermediate_size: int, rows: int, torch_rows=None) -> tuple[float, float]:
    """A prompt of ``rows`` tokens after a cached prefix of 5, through the float32 torch layers (the
    reference), the native bf16 stack and the torch layers in bfloat16, all on the same bf16-valued weights:
    the native stack's and torch bf16's relative errors in the hidden states. The native stack's bf16 cache
    must hold the reference's K/V rounded."""
    from conveyor.model.attention import AttentionMetadata, PrefillChunk
    from conveyor.model.decoder import StepInputs

    torch.manual_seed(rows)
    model, block_size = _bf16_valued_model(intermediate_size), 4
    config = model.config
    tables = torch.randperm(32)[:20].view(1, 20)
    positions, row_seq = torch.arange(5, 5 + rows), torch.zeros(rows, dtype=torch.long)
    slots = tables[0, positions // block_size] * block_size + positions % block_size
    cache = rounded(torch.randn(config.num_layers, 2, 32, block_size, config.num_kv_heads, config.head_dim))
    mask = torch.arange(5 + rows)[None, :] <= positions[:, None]
    prefills = [PrefillChunk(0, rows, 5, tables[0], mask)]
    ids = torch.randint(0, config.vocab_size, (rows,))
    native, torch_bf16 = copy.deepcopy(model), copy.deepcopy(model).to(torch.bfloat16)
    want_cache, native_cache, bf16_cache = cache.clone(), cache.bfloat16(), cache.bfloat16()
    with torch.inference_mode():
        want = model(ids, positions, want_cache, AttentionMetadata(slots, [], prefills))
        native.use_native_kernels(kernels, 512, bfloat16=True, torch_rows=torch_rows)
        inputs = StepInputs(ids.tolist(), positions.tolist(), slots.tolist(), tables.tolist(), row_seq.tolist(), [])
        got, _, _ = native.run_native(inputs, native_cache)
        other = torch_bf16(ids, positions, bf16_cache, AttentionMetadata(slots, [], prefills))
    assert got.dtype == torch.float32 and native_cache.dtype == torch.bfloat16
    written = native_cache.flatten(2, 3)[:, :, slots], want_cache.flatten(2, 3)[:, :, slots]
    assert _relative_error(*written) < 0.01, "the step's K/V, rounded, in their slots"
    untouched = torch.ones(32 * block_size, dtype=torch.bool).index_fill_(0, slots, False)
    assert torch.equal(native_cache.flatten(2, 3)[:, :, untouched], cache.bfloat16().flatten(2, 3)[:, :, untouched])
    return _relative_error(got, want), _relative_error(other, want)


@pytest.mark.parametrize(("intermediate_size", "rows"), [(96, 3), (96, 70), (80, 70)])
def test_native_bf16_stack_is_closer_to_float32_than_the_torch_bf16_layers(bf16, intermediate_size, rows):
    """The stack rounds only what it stores (weights, K/V) and each GEMM's input; the torch bf16 layers round
    every activation. On weights with bf16 values both are held to the float32 layers: the native stack's
    relative error under 1%, and no larger than torch bf16's. 70 rows with an intermediate size of 96 run the
    fused SwiGLU, 80 (no whole number of 32-column tiles) the unfused one; 3 rows are a decode-sized step."""
    native_error, torch_error = _stack_errors(bf16, intermediate_size, rows)
    assert native_error < 0.01, (native_error, torch_error)
    assert native_error <= torch_error, (native_error, torch_error)


@pytest.mark.parametrize("rows", [3, 70])
def test_bf16_stack_with_its_gemms_on_torch_stays_close_to_float32(bf16, rows):
    """--kernels auto may route bf16 GEMMs to torch's (oneDNN: AMX where the CPU has it); the stack's result
    stays within 1% of the float32 layers."""
    every_row = [(1, 2**62)]
    routes = {name: every_row for name in ("qkv", "o", "gate_up", "down")}
    native_error, torch_error = _stack_errors(bf16, 96, rows, torch_rows=routes)
    assert native_error < 0.01, (native_error, torch_error)


def test_bfloat16_unavailable_names_what_is_missing():
    without = SimpleNamespace(has_bfloat16=lambda: False)
    assert BF16_FEATURE in bfloat16_unavailable(without, 512)
    assert BF16_FEATURE in bfloat16_unavailable(SimpleNamespace(), 512)  # a build from before bf16
    with_bf16 = SimpleNamespace(has_bfloat16=lambda: True)
    assert bfloat16_unavailable(with_bf16, 512) is None
    assert WIDTH_ENV in bfloat16_unavailable(with_bf16, 256)


def test_bfloat16_without_the_kernels_runs_torch_ops_and_says_why(tiny_model_dir, kernels, monkeypatch, caplog):
    """A CPU without avx512_bf16 (stood in for by a build that reports none): torch ops, one warning."""
    from conveyor import LLM
    from conveyor.model.native import kernels as kernels_module

    lacking = SimpleNamespace(kernel_widths=kernels.kernel_widths, has_bfloat16=lambda: False)
    monkeypatch.setattr(kernels_module, "native_kernels", lambda: lacking)
    with caplog.at_level(logging.WARNING, logger="conveyor"):
        llm = LLM(str(tiny_model_dir), dtype="bfloat16", num_kv_blocks=64)
    assert llm.engine.runner.kernel_width is None and llm.engine.runner.kernel_dtype is None
    assert llm.engine.executor.model.native is None
    [line] = [r.getMessage() for r in caplog.records if "bfloat16" in r.getMessage()]
    assert BF16_FEATURE in line and "PyTorch ops" in line


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_engine_runs_bfloat16_on_the_native_stack_close_to_float32(bf16, tiny_model_dir, tiny_hf_model, caplog):
    """``dtype="bfloat16"``: bf16 packed weights, a bf16 KV cache, the log line saying so. Greedy tokens are not
    asserted equal to float32's: on the tiny random model the top two logits of a step are often a few
    thousandths apart, and rounding weights to bf16 (2^-9 relative) moves them by about that, so a flip
    anywhere ends the common prefix. What holds is closeness: over 12 prompts of 1 to 300 tokens, 16 tokens
    each, the native bf16 engine's common prefix with transformers' float32 greedy output is at least 3/4 of
    the tokens and no shorter in total than the torch bfloat16 path's (which rounds every activation too)."""
    from conveyor import LLM, SamplingParams
    from tests.engine.test_correctness import LENGTHS, _prompts
    from tests.harness import hf_greedy

    with caplog.at_level(logging.INFO, logger="conveyor"):
        llm = LLM(str(tiny_model_dir), dtype="bfloat16", num_kv_blocks=2048, max_num_batched_tokens=128)
    engine = llm.engine
    assert (engine.runner.kernel_width, engine.runner.kernel_dtype) == (512, "bfloat16")
    assert engine.executor.kv_cache.dtype == torch.bfloat16
    assert engine.executor.model.lm_head.packed.dtype == torch.bfloat16
    assert "native kernels: 512-bit vectors, bfloat16 weights and KV cache" in caplog.text
    prompts = _prompts(LENGTHS, seed=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    want = [hf_greedy(tiny_hf_model, prompt, 16) for prompt in prompts]
    native = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    torch_llm = LLM(str(tiny_model_dir), dtype="bfloat16", kernels="torch", num_kv_blocks=2048)
    torch_bf16 = [o.token_ids for o in torch_llm.generate(prompts, greedy, use_tqdm=False)]
    native_common = sum(map(_common_prefix, native, want))
    torch_common = sum(map(_common_prefix, torch_bf16, want))
    assert native_common >= 0.75 * 16 * len(prompts), (native_common, torch_common)
    assert native_common >= torch_common, (native_common, torch_common)
