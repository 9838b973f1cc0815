"""The cost model against FLOPs and bytes computed by hand from published model configs."""

from __future__ import annotations

import dataclasses
import random

import pytest

from conveyor.core.sampling import SamplingParams
from conveyor.core.scheduler import ScheduledRequest, SchedulerOutput
from conveyor.sim.cost import CostModel, StepWork, chunk_attention_pairs, total_params
from conveyor.sim.executor import SimulatedExecutor, VirtualClock
from conveyor.sim.hardware import load_hardware, load_model_config
from conveyor.sim.simulator import device_kv_cache_memory

A100 = load_hardware("A100-80GB")
LLAMA_7B = load_model_config("Llama-2-7B")
# One Llama-2-7B layer: q, k, v, o are 4096 x 4096; gate, up, down are 4096 x 11008.
LAYER_7B = 4 * 4096 * 4096 + 3 * 4096 * 11008


def test_llama2_7b_has_its_published_parameter_count():
    # 32 layers, untied 32000 x 4096 embedding and LM head, 65 RMSNorm vectors: 6.74B.
    assert total_params(LLAMA_7B) == 32 * LAYER_7B + 2 * 32000 * 4096 + 65 * 4096 == 6_738_415_616
    assert total_params(load_model_config("Llama-2-13B")) == pytest.approx(13.0e9, rel=0.01)
    assert total_params(load_model_config("Llama-2-70B")) == pytest.approx(69.0e9, rel=0.01)


def test_llama2_7b_fp16_decode_at_batch_1_reads_about_13_5_gb_of_weights():
    cost = CostModel(LLAMA_7B, A100, "float16")
    # Every projection and MLP weight, plus the LM head for the sampled row; the embedding is a one-row gather.
    read = cost.dense_weight_bytes + cost.lm_head_bytes
    assert read == 2 * (32 * LAYER_7B + 32000 * 4096) == 13_214_154_752
    assert read == pytest.approx(13.5e9, rel=0.03)
    assert cost.weight_bytes == 2 * 6_738_415_616  # what the device holds
    # Batch 1 is bandwidth-bound: the dense part takes the weight bytes over the usable bandwidth.
    assert cost.dense_time(1, 1) == pytest.approx(read / (2039e9 * A100.bandwidth_efficiency))


def test_flops_per_token_and_the_compute_bound_prefill():
    cost = CostModel(LLAMA_7B, A100, "float16")
    assert cost.dense_flops_per_token == 2 * 32 * LAYER_7B
    assert cost.lm_head_flops_per_row == 2 * 32000 * 4096
    # 2048 prompt tokens: 2 FLOPs per weight per token dwarf one read of the weights.
    flops = 2048 * 2 * 32 * LAYER_7B + 2 * 32000 * 4096
    assert cost.dense_time(2048, 1) == pytest.approx(flops / (312e12 * A100.flops_efficiency))


def test_attention_pairs_flops_and_kv_bytes():
    assert chunk_attention_pairs(0, 4) == 1 + 2 + 3 + 4
    assert chunk_attention_pairs(10, 3) == 11 + 12 + 13
    cost = CostModel(LLAMA_7B, A100, "float16")
    assert cost.attention_flops_per_pair == 4 * 32 * 32 * 128  # QK^T and PV, all layers and heads
    assert cost.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2 == 512 * 1024  # K and V, fp16: 0.5 MiB
    assert CostModel(load_model_config("Llama-2-13B"), A100, "float16").kv_bytes_per_token == 819_200
    # A decode of 1000 cached tokens reads their K/V and writes its own.
    bandwidth = 2039e9 * A100.bandwidth_efficiency
    assert cost.attention_time(1000, 1000, 1) == pytest.approx(1001 * 512 * 1024 / bandwidth)


def test_step_time_adds_overheads_and_swap_copies():
    cost = CostModel(LLAMA_7B, A100, "float16")
    work = StepWork(num_seqs=4, num_tokens=4, num_sampled=4, attention_pairs=400, kv_tokens_read=400, swap_blocks=10)
    expected = (
        A100.step_overhead_s + 4 * A100.per_sequence_overhead_s
        + cost.dense_time(4, 4) + cost.attention_time(400, 400, 4)
        + 10 * 16 * 512 * 1024 / A100.host_link_bandwidth
    )
    assert cost.step_time(work, block_size=16) == pytest.approx(expected)
    assert cost.decode_time(4, 400) == pytest.approx(cost.step_time(dataclasses.replace(work, swap_blocks=0)))


def test_tensor_parallel_splits_weights_and_kv_and_adds_two_all_reduces_per_layer():
    model = load_model_config("Llama-2-70B")
    one, two = CostModel(model, A100, "float16", 1), CostModel(model, A100, "float16", 2)
    assert two.weight_bytes == pytest.approx(one.weight_bytes / 2)
    assert two.kv_bytes_per_token == one.kv_bytes_per_token // 2  # 8 KV heads: 4 per device
    assert one.allreduce_time(64) == 0.0
    per_call = A100.allreduce_latency_s + 2 * (1 / 2) * 64 * 8192 * 2 / A100.interconnect_bandwidth
    assert two.allreduce_time(64) == pytest.approx(2 * 80 * per_call)
    with pytest.raises(ValueError, match="divide"):
        CostModel(model, A100, "float16", 3)


def test_kv_memory_is_device_memory_less_weights():
    cost = CostModel(load_model_config("Llama-2-13B"), A100, "float16")
    assert device_kv_cache_memory(cost, 0.9) == int(0.9 * 80 * 2**30 - cost.weight_bytes)
    with pytest.raises(ValueError, match="tensor-parallel-size"):
        device_kv_cache_memory(CostModel(load_model_config("Llama-2-70B"), A100, "float16"))
    assert device_kv_cache_memory(CostModel(load_model_config("Llama-2-70B"), A100, "float16", 2)) > 0


def _item(request_id: str, start: int, num_tokens: int, samples_token: bool) -> ScheduledRequest:
    return ScheduledRequest(request_id, start, [0] * num_tokens, [], SamplingParams(), samples_token, 0)


def test_simulated_executor_prices_a_mixed_step_and_advances_the_clock():
    cost = CostModel(LLAMA_7B, A100, "float16")
    clock = VirtualClock(5.0)
    executor = SimulatedExecutor(cost, clock, block_size=16)
    output = SchedulerOutput(step=1, scheduled=[_item("decode", 99, 1, True), _item("prompt", 0, 50, False)])
    assert executor.execute(output) == {"decode": 0}
    work = StepWork(num_seqs=2, num_tokens=51, num_sampled=1, attention_pairs=100 + 50 * 51 // 2,
                    kv_tokens_read=100 + 50)
    assert clock.now == pytest.approx(5.0 + cost.step_time(work))


def test_step_work_counts_the_blocks_decodes_read_again_only_where_blocks_are_shared():
    from conveyor.core.kv import MemoryReport
    from conveyor.sim.cost import step_work

    def decode(request_id: str, blocks: list[int]) -> ScheduledRequest:
        return ScheduledRequest(request_id, 16 * len(blocks) - 1, [0], blocks, SamplingParams(), True, 0)

    # Two decodes over one prefix of blocks 1-3, a third over its own; a prompt chunk reading block 1 is no decode.
    items = [decode("a", [1, 2, 3, 7]), _item("prompt", 0, 40, False), decode("b", [1, 2, 3, 8]), decode("c", [9])]
    items[1] = dataclasses.replace(items[1], block_ids=[1, 2, 3])
    shared = MemoryReport(capacity_slots=320, reserved_slots=160, used_slots=100, unusable_free_slots=0,
                          num_requests=4, shared_slots=96)
    work, sampled = step_work(SchedulerOutput(step=1, scheduled=items, memory=shared))
    assert work.shared_decode_blocks == 3 and sampled == ["a", "b", "c"]
    unshared = dataclasses.replace(shared, shared_slots=0)  # no block held twice: not even looked at
    assert step_work(SchedulerOutput(step=1, scheduled=items, memory=unshared))[0].shared_decode_blocks == 0


def test_catalog_names_are_found_whatever_their_case():
    assert load_model_config("llama-2-13b") == load_model_config("Llama-2-13B")
    assert load_hardware("a100-80gb").name == "A100-80GB"
    with pytest.raises(ValueError, match="neither"):
        load_model_config("llama-2-14b")


def test_a_pace_stretches_every_step_by_its_factor_and_leaves_the_model_alone():
    from conveyor.core.config import EngineConfig
    from conveyor.sim.cost import with_pace
    from conveyor.sim.simulator import simulate
    from conveyor.sim.workload import WorkloadRequest

    cost = CostModel(load_model_config("SmolLM2-135M"), load_hardware("A100-80GB"), "float16")
    config = EngineConfig(burst_wait_ms=0, max_num_seqs=4, max_num_batched_tokens=256, block_size=8, num_kv_blocks=512,
                          max_model_len=512)
    workload = [WorkloadRequest(0.0, 40, 12) for _ in range(3)]
    plain, _ = simulate(config, cost, workload)
    slower, _ = simulate(config, with_pace(cost, 1.5), workload)
    assert slower["elapsed_s"] == pytest.approx(1.5 * plain["elapsed_s"])
    assert slower["steps"] == plain["steps"] and cost.pace == 1.0
    with pytest.raises(ValueError, match="pace"):
        with_pace(cost, 0.0)


# Qwen3-30B-A3B's published config: 128 experts of 768, 8 picked per token, 48 layers.
QWEN3_30B_A3B = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, num_experts=128, num_experts_per_tok=8, tie_word_embeddings=False)


def test_expected_experts_grow_from_the_picked_to_every_expert_as_uniform_routing_does():
    from conveyor.sim.cost import expected_experts

    assert expected_experts(128, 8, 1) == pytest.approx(8)
    assert expected_experts(128, 8, 100_000) == pytest.approx(128)
    assert expected_experts(0, 0, 5) == 0.0
    rng = random.Random(0)
    for tokens in (2, 8, 32):
        trials = [len({e for _ in range(tokens) for e in rng.sample(range(64), 8)}) for _ in range(3000)]
        assert sum(trials) / len(trials) == pytest.approx(expected_experts(64, 8, tokens), rel=0.02)


def test_a_mixture_of_experts_holds_every_expert_and_reads_the_picked_ones():
    """Qwen3-30B-A3B: 30.5B parameters held, 3.3B read per token at batch 1 (the published figures); a batch
    reads more experts as it grows, every one of them once it is large."""
    from conveyor.core.model_config import ModelConfig
    from conveyor.sim.cost import expected_experts

    model = ModelConfig.from_hf_dict(QWEN3_30B_A3B)
    cost = CostModel(model, A100, "bfloat16")
    assert total_params(model) == pytest.approx(30.5e9, rel=0.01)
    read_at_1 = cost.weights_read(1) + cost.lm_head_bytes + model.vocab_size * model.hidden_size * 2
    assert read_at_1 / 2 == pytest.approx(3.3e9, rel=0.03)
    assert cost.weights_read(1) == pytest.approx(cost.dense_weight_bytes + 8 * cost.expert_bytes)
    assert cost.weights_read(16) == pytest.approx(cost.dense_weight_bytes
                                                  + expected_experts(128, 8, 16) * cost.expert_bytes)
    every = cost.dense_weight_bytes + 128 * cost.expert_bytes
    assert cost.weights_read(4096) == pytest.approx(every)
    assert cost.weight_bytes == pytest.approx(2 * total_params(model), rel=1e-6)
    # Batch 1 is bound by the active bytes, not the held ones: a dense model of 30.5B reads 9x more.
    assert cost.dense_time(1, 1) < cost.weight_bytes / cost.bandwidth / 5
    assert cost.dense_flops_per_token == pytest.approx(2 * (cost.weights_read(1) / 2), rel=1e-9)
