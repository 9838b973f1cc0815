"""``--kv-cache-dtype``: a KV cache narrower than the model, fp8 e5m2 (one byte an element), bfloat16 or float16.

The native stack rounds K and V as torch's ``.to(torch.float8_e5m2)`` and ``.to(torch.float16)`` do (held bit for
bit over every float16 value, random floats of every magnitude and the edges: the largest finite, the overflow
to infinity, denormals, NaN; a float16 NaN stays NaN, its payload F16C's), its attention over such a cache
matches PyTorch's on the widened values, the whole stack matches the torch layers over it, and the pool holds
two or four times the blocks of float32's.
"""

from __future__ import annotations

import pytest
import torch

from tests.model.test_native_stack import _assert_native_stack_matches, _stack_model, mixed_batch
from tests.references import paged_attention_reference, ragged_rows


def _every_kind_of_float() -> torch.Tensor:
    halves = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    torch.manual_seed(0)
    spread = torch.randn(100_000) * torch.logspace(-9, 6, 100_000)
    edges = torch.tensor([57344.0, 61439.99, 61440.0, 65535.0, 65536.0, 1e30, float("inf"), float("nan"), 0.0,
                          2.0**-17, 3 * 2.0**-17, 1.5 * 2.0**-16, 2.5 * 2.0**-16, 2.0**-14, 2.0**-15 * 1.75])
    return torch.cat([halves, spread, -spread, edges, -edges])


def test_fp8_rounding_is_torch_s_bit_for_bit(kernels):
    x = _every_kind_of_float()
    got = kernels.fp8_e5m2(x)
    want = x.to(torch.float8_e5m2).view(torch.uint8)
    differ = (got != want).nonzero().flatten()
    assert differ.numel() == 0, f"{differ.numel()} values round apart, e.g. {x[differ[:5]].tolist()}"


def test_float16_rounding_is_torch_s_bit_for_bit(kernels):
    """Every value but NaN to the bit (F16C keeps a NaN's payload where torch writes one NaN); NaN stays NaN."""
    x = _every_kind_of_float()
    got, want = kernels.float16(x), x.to(torch.float16)
    nan = x.isnan()
    assert got[nan].isnan().all()
    differ = (got[~nan].view(torch.int16) != want[~nan].view(torch.int16)).nonzero().flatten()
    assert differ.numel() == 0, f"{differ.numel()} values round apart, e.g. {x[~nan][differ[:5]].tolist()}"


def _cache_of(values: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    from conveyor.model.attention import to_cache
    from conveyor.model.dtypes import kv_cache_dtype as storage_dtype

    return to_cache(values, storage_dtype(kv_cache_dtype, torch.float32))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "bfloat16", "float16"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (6, 2, 8), (9, 3, 64), (2, 1, 128)])
def test_attention_over_a_narrow_cache_matches_sdpa_on_the_widened_values(kernels, width, kv_cache_dtype, block_size,
                                                                          heads, kv_heads, head_dim):
    """Decode rows of ragged contexts and prompt chunks (causal), the last long enough for the tiled kernel,
    over a cache of the narrow dtype under a float32 stack."""
    from conveyor.model.attention import from_cache

    torch.manual_seed(block_size + head_dim)
    cache = _cache_of(torch.randn(2, 400, block_size, kv_heads, head_dim) * 3, kv_cache_dtype)
    tables, row_seq, lens = ragged_rows(400, block_size)
    query = torch.randn(len(row_seq), heads, head_dim)
    got = kernels.paged_attention(query, cache[0], cache[1], tables, row_seq, lens, head_dim**-0.5, width)
    wide = from_cache(cache, torch.float32)
    want = paged_attention_reference(query, wide[0], wide[1], tables, row_seq, lens, head_dim**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_attention_refuses_k_and_v_of_different_dtypes(kernels):
    k, v = torch.zeros(8, 4, 1, 8, dtype=torch.uint8), torch.randn(8, 4, 1, 8)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernels.paged_attention(torch.randn(1, 1, 8), k, v, torch.tensor([[0, 1]]), torch.tensor([0]),
                                torch.tensor([3]), 1.0)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "bfloat16", "float16"])
def test_native_stack_over_a_narrow_cache_matches_the_torch_layers(kernels, width, kv_cache_dtype):
    """A prompt after a cached prefix, a fresh prompt and a decode row in one step, with a float32 model over a
    narrow cache (how the caches and outputs are held: test_native_stack._assert_native_stack_matches)."""
    torch.manual_seed(5)
    positions, row_seq, tables, decodes, prefills = mixed_batch()
    _assert_native_stack_matches(kernels, width, _stack_model(80), positions, row_seq, tables, decodes, prefills,
                                 kv_cache_dtype=kv_cache_dtype)


def test_the_pool_holds_more_blocks_in_a_narrow_dtype(tiny_model_dir):
    from conveyor.core.config import EngineConfig
    from conveyor.engine import Engine

    pools = {}
    for name in ("auto", "bfloat16", "float16", "fp8", "fp8_e5m2"):
        config = EngineConfig(model=str(tiny_model_dir), kv_cache_memory="4MiB", kv_cache_dtype=name)
        cache = Engine(config).executor.kv_cache
        pools[name] = (cache.shape[2], cache.dtype)
    float_blocks = pools["auto"][0]
    assert pools == {"auto": (float_blocks, torch.float32), "bfloat16": (2 * float_blocks, torch.bfloat16),
                     "float16": (2 * float_blocks, torch.float16), "fp8": (4 * float_blocks, torch.uint8),
                     "fp8_e5m2": (4 * float_blocks, torch.uint8)}


@pytest.mark.parametrize(("kv_cache_dtype", "stored"), [("fp8", torch.uint8), ("float16", torch.float16)])
@pytest.mark.parametrize("kernels_flag", ["native", "torch"])
def test_generation_over_a_narrow_cache_runs_and_repeats_itself(tiny_model_dir, kernels_flag, kv_cache_dtype, stored):
    """Greedy tokens over an fp8 or float16 cache, alone and beside other requests (batching must not change what
    the cache holds: each row's K and V are rounded on their own), on either path."""
    from conveyor.core.sampling import SamplingParams
    from conveyor.entrypoints.llm import LLM

    llm = LLM(model=str(tiny_model_dir), kv_cache_dtype=kv_cache_dtype, kernels=kernels_flag, kv_cache_memory="8MiB")
    assert llm.engine.executor.kv_cache.dtype == stored
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["The capital of France is", "One, two, three,", "def add(a, b):"]
    batched = [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([prompt], params, use_tqdm=False)[0].token_ids for prompt in prompts]
    assert batched == alone and all(len(tokens) == 24 for tokens in batched)


def test_an_unknown_kv_cache_dtype_is_refused_by_name():
    from conveyor.core.config import EngineConfig

    with pytest.raises(ValueError, match=r"kv_cache_dtype.*fp8"):
        EngineConfig(kv_cache_dtype="fp8_e4m3")


def test_the_cost_model_reads_a_quarter_of_the_kv_bytes_in_fp8(machine_cache):
    """The simulator and the roofline count K and V in the cache's dtype; a step profile (timed over a cache in
    the model's dtype) is not used for another one."""
    from conveyor.core.config import EngineConfig
    from conveyor.sim.cost import CostModel
    from conveyor.sim.hardware import load_hardware, load_model_config
    from conveyor.sim.profile import step_cost_model

    model, hardware = load_model_config("SmolLM2-135M"), load_hardware("cpu-local")
    plain = CostModel(model, hardware, "float32")
    fp8 = CostModel(model, hardware, "float32", kv_element_bytes=EngineConfig(kv_cache_dtype="fp8")
                    .kv_cache_element_bytes(gguf_file=False))
    assert fp8.kv_bytes_per_token * 4 == plain.kv_bytes_per_token
    assert fp8.decode_time(1, 4000) < plain.decode_time(1, 4000)
    cost, priced_by = step_cost_model(model, hardware, "float32", kv_element_bytes=1)
    assert cost.kv_bytes_per_token == fp8.kv_bytes_per_token and priced_by.startswith("roofline")


@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_preemption_over_an_fp8_cache_gives_the_tokens_of_an_ample_pool(tiny_model_dir, preemption_mode):
    """Swapped fp8 blocks come back as they left (the swap space stores the same bytes), and a recomputed
    prompt's K and V round to what they were."""
    from conveyor.entrypoints.llm import LLM
    from tests.engine.test_swap import _workload

    prompts, params = _workload(seed=21)
    reference = LLM(str(tiny_model_dir), num_kv_blocks=1024, kv_cache_dtype="fp8").generate(prompts, params,
                                                                                            use_tqdm=False)
    llm = LLM(str(tiny_model_dir), num_kv_blocks=24, block_size=4, max_model_len=96, kv_cache_dtype="fp8",
              preemption_mode=preemption_mode, swap_space=10**7)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and (preemption_mode == "recompute" or stats.num_swaps_out > 0)


def test_auto_stores_float16_for_a_gguf_file_and_the_dtype_otherwise():
    """``auto`` resolved in one place (conveyor.core.formats.kv_cache_format), which the engine, the simulator and
    the pool's sizing read: a GGUF file's weights run in float32 get llama.cpp's float16 cache, a float checkpoint
    its dtype's, and a named dtype is kept whatever the weights."""
    from conveyor.core.config import EngineConfig
    from conveyor.core.formats import kv_cache_format

    assert kv_cache_format("auto", "float32", gguf_file=True) == "float16"
    assert kv_cache_format("auto", "float32", gguf_file=False) == "float32"
    assert kv_cache_format("auto", "bfloat16", gguf_file=True) == "bfloat16"
    assert kv_cache_format("float32", "float32", gguf_file=True) == "float32"
    assert kv_cache_format("fp8", "float32", gguf_file=False) == "fp8"
    assert EngineConfig().kv_cache_element_bytes(gguf_file=True) == 2
    assert EngineConfig(kv_cache_dtype="float32").kv_cache_element_bytes(gguf_file=True) == 4


def test_the_default_gguf_model_runs_over_a_float16_cache_with_twice_float32s_blocks():
    """The engine on the default model (a GGUF file) keeps its cache in float16 under ``auto``: the pool's tensor,
    the plan, and a pool of the same bytes holding twice the blocks of ``--kv-cache-dtype float32``."""
    from conveyor.core.config import EngineConfig
    from conveyor.engine.llm_engine import Engine

    engines = {name: Engine(EngineConfig(kv_cache_dtype=name, kv_cache_memory="8MiB")) for name in ("auto", "float32")}
    auto, float32 = engines["auto"], engines["float32"]
    assert (auto.runner.kv_cache_dtype, auto.runner.kv_itemsize) == ("float16", 2)
    assert (float32.runner.kv_cache_dtype, float32.runner.kv_itemsize) == ("float32", 4)
    assert auto.stats().num_kv_blocks == 2 * float32.stats().num_kv_blocks
