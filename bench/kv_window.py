"""Sliding-window KV groups on a long-context workload: the requests one KV pool holds with and without them.

``--requests`` prompts of ``--prompt-len`` random tokens arrive at once, each to decode ``--output-len``
tokens (ignore_eos), on Gemma 3 270M, with a KV pool of fixed bytes: what ``--hold`` such requests take when
every layer keeps every block. Two configurations over the same pool:

- windowed: prefix caching off, so the 15 windowed layers form five KV groups that give back the blocks
  their 512-token window has passed (conveyor/core/kv/grouped.py), beside the group of the 3 full layers;
- without: prefix caching on, where every layer keeps every block (one KV group; windowed layers attend
  through a mask): what the pool holds without window-aware freeing. The prompts share no block, so the
  prefix cache changes nothing else.

Each runs on the real engine (the native stack, the file kept quantized) and on the simulator,
which runs the same scheduler and KV manager on a cost model; every request arrives at once, so the
simulator's clock plays no part in who is admitted. Printed for each: the peak of running requests, the
peak of requests decoding at once (prompt done), and the KV bytes a running request held at that peak.

    python bench/kv_window.py [--model gemma3-270m] [--requests 32] [--prompt-len 4000] [--output-len 64]
                              [--hold 8] [--simulate-only]
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

from conveyor.core.config import EngineConfig
from conveyor.core.engine_core import EngineCore
from conveyor.core.kv import blocks_for_tokens
from conveyor.core.model_config import ModelConfig

CONFIGS = {"windowed": dict(enable_prefix_caching=False), "without": dict(enable_prefix_caching=True)}


@dataclass
class Peaks:
    """What one run of the workload held at its fullest."""

    running: int = 0
    decoding: int = 0
    kv_bytes_per_request: float = 0.0
    preemptions: int = 0
    wall_s: float = 0.0

    def track(self, core: EngineCore, block_bytes: int) -> None:
        output = core.last_output
        running = core.scheduler.running
        decoding = sum(1 for r in running if r.num_computed_tokens >= r.num_prompt_tokens)
        self.decoding = max(self.decoding, decoding)
        if output.num_running > self.running and output.memory is not None:
            self.running = output.num_running
            blocks = output.memory.reserved_slots // core.config.block_size
            self.kv_bytes_per_request = blocks * block_bytes / output.num_running
        self.preemptions = core.scheduler.num_preemptions


def engine_config(args: argparse.Namespace, pool_bytes: int, name: str) -> EngineConfig:
    return EngineConfig(model=args.model, kv_cache_memory=pool_bytes, max_model_len=args.prompt_len + args.output_len,
                        max_num_seqs=args.requests, **CONFIGS[name])


def pool_bytes(args: argparse.Namespace, model: ModelConfig, block_size: int) -> int:
    """The bytes ``--hold`` requests take at their full length with every layer's K/V (float32)."""
    blocks = blocks_for_tokens(args.prompt_len + args.output_len, block_size)
    return args.hold * blocks * block_size * model.kv_bytes_per_token * 4


def prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1000, vocab_size) for _ in range(args.prompt_len)] for _ in range(args.requests)]


def run_engine(args: argparse.Namespace, config: EngineConfig) -> Peaks:
    from conveyor.core.sampling import SamplingParams
    from conveyor.engine.llm_engine import Engine

    engine = Engine(config)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    for i, prompt in enumerate(prompts(args, engine.model_config.vocab_size)):
        engine.add_request(prompt, params, request_id=f"r{i}")
    peaks, start = Peaks(), time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        peaks.track(engine.core, engine.kv_block_bytes)
    peaks.wall_s = time.perf_counter() - start
    return peaks


def run_simulator(args: argparse.Namespace, config: EngineConfig, model: ModelConfig) -> Peaks:
    from conveyor.sim.cost import CostModel
    from conveyor.sim.hardware import load_hardware
    from conveyor.sim.simulator import Simulation, workload_request
    from conveyor.sim.workload import WorkloadRequest

    cost = CostModel(model, load_hardware("A100-80GB"), "float32")  # the clock decides nothing here
    workload = [WorkloadRequest(0.0, args.prompt_len, args.output_len) for _ in range(args.requests)]
    sim = Simulation(config, cost, workload)
    for index, item in enumerate(workload):
        sim.core.add_request(workload_request(item, index, sim.plan.max_model_len))
    peaks, start = Peaks(), time.perf_counter()
    while sim.core.has_unfinished_requests():
        sim.core.step()
        peaks.track(sim.core, sim.plan.block_bytes)
    peaks.wall_s = time.perf_counter() - start
    return peaks


def report(results: dict[tuple[str, str], Peaks], sources: list[str]) -> None:
    print("| configuration | run on | peak running | peak decoding | KV MiB per running request | preemptions |")
    print("|---|---|---:|---:|---:|---:|")
    for (name, source), peaks in results.items():
        print(f"| {name} | {source} | {peaks.running} | {peaks.decoding} | {peaks.kv_bytes_per_request / 2**20:.1f} "
              f"| {peaks.preemptions} |")
    for source in sources:
        windowed, without = results[("windowed", source)], results[("without", source)]
        print(f"{source}: {windowed.running / without.running:.2f}x the running requests, "
              f"{windowed.decoding / without.decoding:.2f}x the decoding ones, "
              f"{without.kv_bytes_per_request / windowed.kv_bytes_per_request:.2f}x less KV per request")
    if "engine" in sources:
        for name in CONFIGS:
            real, sim = results[(name, "engine")], results[(name, "simulator")]
            print(f"{name}: simulator's peak running {sim.running} vs the engine's {real.running} "
                  f"({(sim.running - real.running) / real.running:+.1%}); engine run {real.wall_s:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=4000)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--hold", type=int, default=8, help="requests the pool holds without window-aware freeing")
    parser.add_argument("--simulate-only", action="store_true", help="the simulator alone (no model is loaded)")
    args = parser.parse_args()
    from conveyor.model.weights.paths import resolve_model

    model = ModelConfig.from_folder(resolve_model(args.model))
    pool = pool_bytes(args, model, EngineConfig().block_size)
    print(f"{args.requests} requests of {args.prompt_len} + {args.output_len} tokens on {args.model}; KV pool "
          f"{pool / 2**20:.0f} MiB ({args.hold} requests with every layer's blocks)")
    sources = ["simulator"] if args.simulate_only else ["engine", "simulator"]
    results = {}
    for name in CONFIGS:
        config = engine_config(args, pool, name)
        results[(name, "simulator")] = run_simulator(args, config, model)
        if not args.simulate_only:
            results[(name, "engine")] = peaks = run_engine(args, config)
            print(f"{name} on the engine: {peaks}", flush=True)  # the engine's runs are long: each as it ends
    report(dict(sorted(results.items(), key=lambda kv: (kv[0][0] != "windowed", kv[0][1]))), sources)


if __name__ == "__main__":
    main()
