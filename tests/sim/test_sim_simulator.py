"""The simulator: the real scheduler on a virtual clock, checked for determinism, conservation and the seed's claims."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import subprocess
import sys
from collections import Counter

import pytest

from conveyor.core.config import EngineConfig
from conveyor.core.scheduler import SchedulerOutput
from conveyor.entrypoints.cli import build_parser, main
from conveyor.observe.trace import Trace
from conveyor.sim.cost import CostModel
from conveyor.sim.hardware import load_hardware, load_model_config
from conveyor.sim.simulator import Simulation, device_kv_cache_memory, simulate
from conveyor.sim.workload import (
    WorkloadRequest,
    multi_turn_shapes,
    parse_lengths,
    shared_prefix_requests,
    synthetic_workload,
)

A100 = load_hardware("A100-80GB")
SMALL = CostModel(load_model_config("SmolLM2-135M"), A100, "float16")
LLAMA_13B = CostModel(load_model_config("Llama-2-13B"), A100, "float16")
SHAREGPT = (parse_lengths("longtail:161"), parse_lengths("longtail:338"))


def _mixed_workload(num: int, seed: int) -> list[WorkloadRequest]:
    """Bursts and gaps, long and short requests, three priorities."""
    rng = random.Random(seed)
    times = sorted(rng.choice([0.0, rng.uniform(0, 2.0)]) for _ in range(num))
    return [WorkloadRequest(t, rng.randint(1, 120), rng.choice([1, 2, rng.randint(3, 150)]), rng.randint(0, 2))
            for t in times]


COMBOS = list(itertools.product(["continuous", "static"], ["fcfs", "priority"], ["recompute", "swap"],
                                ["paged", "contiguous"]))


@pytest.mark.parametrize(("scheduler", "policy", "preemption", "layout"), COMBOS,
                         ids=["-".join(map(str, c)) for c in COMBOS])
def test_every_request_arrives_runs_and_finishes_once_within_the_limits(scheduler, policy, preemption, layout):
    config = EngineConfig(
        scheduler=scheduler, scheduling_policy=policy, preemption_mode=preemption, kv_layout=layout,
        max_num_seqs=6, max_num_batched_tokens=64, block_size=8,
        num_kv_blocks=48, max_model_len=192, swap_space=12 * 8 * SMALL.kv_bytes_per_token,
    )
    workload = _mixed_workload(40, seed=7)
    simulation = Simulation(config, SMALL, workload, record_trace=True)
    num_blocks = config.num_kv_blocks
    execute = simulation.executor.execute

    def checked(output: SchedulerOutput):
        assert len(output.scheduled) <= config.max_num_seqs
        assert output.num_batched_tokens <= config.max_num_batched_tokens
        owned = [block for item in output.scheduled for block in item.block_ids]
        assert len(owned) == len(set(owned)) and all(0 <= b < num_blocks for b in owned)
        for item in output.scheduled:
            assert item.context_len <= len(item.block_ids) * config.block_size
            assert item.context_len <= config.max_model_len
        return execute(output)

    simulation.executor.execute = checked
    figures = simulation.run()

    ids = {f"sim-{i}" for i in range(len(workload))}
    finished = Counter(r for step in simulation.trace.steps for r in step.finished)
    assert set(finished) == ids and set(finished.values()) == {1}, "each request finishes exactly once"
    assert {r for step in simulation.trace.steps for r in step.scheduled} == ids, "each request ran"
    assert figures["num_requests"] == len(workload)
    if scheduler == "continuous" and layout == "paged":
        assert figures["preemptions"] > 0, "the pool is small enough to force preemption"
        assert figures["swaps_out"] > 0 or preemption == "recompute"
    expected_tokens = sum(min(w.output_len, config.max_model_len - w.prompt_len) for w in workload)
    assert figures["output_tokens"] == expected_tokens
    stats = simulation.core.stats()
    assert stats.num_free_kv_blocks == num_blocks, "every block is back in the pool"
    assert stats.num_free_cpu_blocks == stats.num_cpu_blocks
    assert stats.num_unfinished == 0 and not simulation.core.has_unfinished_requests()
    assert all(step.num_running <= config.max_num_seqs for step in simulation.trace.steps)
    assert all(b >= a for a, b in itertools.pairwise(s.end for s in simulation.trace.steps)), "time moves forward"


def test_the_same_seed_gives_the_same_trace_and_another_seed_does_not(tmp_path):
    config = EngineConfig(num_kv_blocks=64, block_size=8, max_num_seqs=8, max_model_len=256)

    def trace_text(seed: int) -> str:
        workload = synthetic_workload(60, 20.0, parse_lengths("longtail:40"), parse_lengths("longtail:60"), seed)
        _, trace = simulate(config, SMALL, workload, record_trace=True)
        path = tmp_path / f"{seed}.jsonl"
        trace.write(path)
        return path.read_text()

    first = trace_text(1)
    assert trace_text(1) == first
    assert trace_text(2) != first
    assert sum(1 for step in Trace.read(tmp_path / "1.jsonl").steps if step.preempted) > 0, "memory was short"


def test_continuous_batching_outruns_static_on_a_long_tailed_workload_at_high_load():
    workload = synthetic_workload(600, 20.0, *SHAREGPT, seed=0)
    kv = device_kv_cache_memory(LLAMA_13B)
    results = {
        scheduler: simulate(EngineConfig(scheduler=scheduler, kv_cache_memory=kv), LLAMA_13B, workload)[0]
        for scheduler in ("continuous", "static")
    }
    continuous, static = results["continuous"], results["static"]
    assert continuous["output_tokens_per_s"] > 1.5 * static["output_tokens_per_s"]
    assert continuous["latency_mean_s"] < static["latency_mean_s"]
    assert static["idle_slot_fraction"] > continuous["idle_slot_fraction"]


def test_paged_kv_admits_more_requests_at_once_than_contiguous_in_the_same_memory():
    workload = synthetic_workload(300, float("inf"), *SHAREGPT, seed=0)
    kv = device_kv_cache_memory(LLAMA_13B)
    paged, _ = simulate(EngineConfig(kv_layout="paged", kv_cache_memory=kv), LLAMA_13B, workload)
    contiguous, _ = simulate(EngineConfig(kv_layout="contiguous", kv_cache_memory=kv), LLAMA_13B, workload)
    assert paged["num_kv_blocks"] == contiguous["num_kv_blocks"]
    assert paged["peak_running"] >= 4 * contiguous["peak_running"]
    assert contiguous["kv_waste_fraction"] > 0.5 > 0.05 > paged["kv_waste_fraction"]
    assert paged["output_tokens_per_s"] > 1.5 * contiguous["output_tokens_per_s"]


def test_the_simulator_runs_without_torch():
    code = ("import sys; import conveyor.entrypoints.cli, conveyor.entrypoints.simulate, conveyor.sim.simulator; "
            "from conveyor.entrypoints.cli import main; "
            "main(['simulate', '--num-requests', '20', '--model-config', 'SmolLM2-135M']); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_cli_sweep_writes_the_plot_the_traces_and_the_max_sustainable_rates(tmp_path, capsys):
    traces, plot = tmp_path / "traces", tmp_path / "sweep.png"
    code = main(["simulate", "--model-config", "Llama-2-13B", "--num-requests", "40", "--request-rates", "1,4,16",
                 "--compare", "scheduler=static", "kv_layout=paged", "--sweep", "--plot", str(plot),
                 "--trace", str(traces), "--json", str(tmp_path / "out.json")])
    out = capsys.readouterr().out
    assert code == 0 and plot.stat().st_size > 0
    assert "max sustainable rate" in out and "kv_layout=paged" in out
    results = json.loads((tmp_path / "out.json").read_text())
    assert [r["request_rate"] for r in results["scheduler=static"]] == [1, 4, 16]
    files = sorted(traces.iterdir())
    assert len(files) == 6
    assert main(["plot", "timeline", str(files[0]), "-o", str(tmp_path / "t.png")]) == 0
    assert main(["plot", "memory", str(files[0]), "-o", str(tmp_path / "m.png")]) == 0


def test_simulate_defaults_to_the_hardwares_dtype_and_calibrate_to_the_engines():
    args = build_parser().parse_args(["simulate", "--hardware", "H100-SXM"])
    assert args.simulate_command is None and args.dtype is None and args.kv_cache_memory is None
    args = build_parser().parse_args(["simulate", "calibrate", "--no-validate"])
    assert args.simulate_command == "calibrate" and not args.validate
    assert (args.max_num_seqs, args.dtype, args.kv_cache_memory) == (32, "float32", None)  # the engine's default
    args = build_parser().parse_args(["simulate", "validate", "--workloads", "swap"])
    assert args.simulate_command == "validate" and args.workloads == "swap"


def test_cli_replays_a_trace_file(tmp_path, capsys):
    (tmp_path / "w.csv").write_text("arrival_time,prompt_tokens,output_tokens\n0,100,50\n0.5,20,10\n3,5000,5\n")
    assert main(["simulate", "--workload", str(tmp_path / "w.csv"), "--model-config", "Llama-2-7B"]) == 0
    out = capsys.readouterr().out
    assert "| num_requests" in out and "| 3 " in out
    assert main(["simulate", "--workload", str(tmp_path / "w.csv"), "--request-rates", "2"]) == 2


def test_cpu_local_names_how_to_measure_this_machine_and_user_catalogs_extend_the_packaged_one(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="conveyor roofline"):
        load_hardware("cpu-local")
    (tmp_path / "machine.json").write_text(json.dumps({
        "memory_bandwidth": 2e10, "gemm_flops": 1e11, "dtype": "float32", "threads": 2, "cpu": "test",
        "measured_at": "now"}))
    cpu = load_hardware("cpu-local")
    assert cpu.flops("float32") == 1e11 and cpu.memory_bandwidth == 2e10
    with pytest.raises(ValueError, match="no peak FLOP/s for float16"):
        cpu.flops("float16")
    (tmp_path / "sim").mkdir()
    (tmp_path / "sim" / "hardware.json").write_text(json.dumps({"my-gpu": {
        "peak_flops": {"float16": 1e14}, "memory_bandwidth": 1e12, "memory_capacity": 16e9,
        "host_link_bandwidth": 1e10}}))
    assert load_hardware("my-gpu").flops("float16") == 1e14
    assert load_hardware("A100-80GB").memory_bandwidth == 2039e9
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}))
    assert load_model_config(str(tmp_path)).num_layers == 2
    with pytest.raises(ValueError, match="Llama-2-13B"):
        load_model_config("no-such-model")


def test_multi_turn_conversations_resend_their_history_and_hit_the_prefix_cache():
    shapes = multi_turn_shapes(4, seed=0, num_turns=3, output_len=8)
    config = EngineConfig(num_kv_blocks=512, block_size=16)
    runs = {caching: simulate(dataclasses.replace(config, enable_prefix_caching=caching), SMALL, [],
                              conversations=shapes)[0] for caching in (False, True)}
    for figures in runs.values():
        assert figures["num_requests"] == 12 and figures["output_tokens"] == 12 * 8
    history = [s.system_len + sum(s.question_lens[:t + 1]) + 8 * t for s in shapes for t in range(3)]
    assert runs[False]["prompt_tokens"] == runs[True]["prompt_tokens"] == sum(history)
    assert runs[False]["prompt_tokens_computed"] == sum(history)
    # Later turns find every earlier full block: only the last partial block and the new question are computed.
    assert runs[True]["prompt_tokens_computed"] < 0.5 * sum(history)
    assert runs[True]["elapsed_s"] < runs[False]["elapsed_s"]


def test_shared_prefixes_are_computed_once_per_prefix_in_the_simulator():
    workload = shared_prefix_requests(32, seed=1, num_prefixes=4)
    results = {caching: simulate(EngineConfig(num_kv_blocks=4096, enable_prefix_caching=caching), SMALL,
                                 workload)[0] for caching in (False, True)}
    prefix_tokens = sum(r.shared_prefix_len for r in workload)
    saved = results[False]["prompt_tokens_computed"] - results[True]["prompt_tokens_computed"]
    # A prefix is computed by the first request to reach it, and by any admitted in that same step (the blocks
    # are indexed once computed): most of the shared tokens are saved, never more.
    assert prefix_tokens / 2 < saved <= prefix_tokens
    assert results[True]["ttft_mean_s"] < results[False]["ttft_mean_s"]


def test_conversations_sharing_a_system_prompt_find_it_cached_on_their_first_turn():
    own = multi_turn_shapes(8, seed=0, num_turns=2, output_len=8)
    shared = multi_turn_shapes(8, seed=0, num_turns=2, output_len=8, num_system_prompts=2)
    assert [s.question_lens for s in shared] == [s.question_lens for s in own]  # only the system prompts change
    assert {s.system_id for s in shared} == {0, 1} and all(s.system_id is None for s in own)
    assert all(s.system_len == shared[s.system_id].system_len for s in shared)
    config = EngineConfig(num_kv_blocks=1024, block_size=16, max_num_seqs=1)  # one at a time: each sees the last
    first_turns = {}
    for name, shapes in (("own", own), ("shared", shared)):
        one_turn = [dataclasses.replace(s, question_lens=s.question_lens[:1]) for s in shapes]
        first_turns[name] = simulate(config, SMALL, [], conversations=one_turn)[0]
    assert first_turns["own"]["prompt_tokens_computed"] == first_turns["own"]["prompt_tokens"]
    # Two system prompts, each computed by its first conversation; the other six find all its full blocks.
    reused = sum(s.system_len // 16 * 16 for s in shared[2:])
    computed = first_turns["shared"]["prompt_tokens"] - first_turns["shared"]["prompt_tokens_computed"]
    assert computed == reused
