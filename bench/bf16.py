"""float32 against bfloat16 on the native kernels, side by side in one process (ratios, on a noisy machine).

GEMM GFLOP/s on SmolLM2-135M's shapes, float32 (512-bit) and bf16 weights, and the bf16 micro-kernel at
other heights (the packed_linear knob); then two engines on the default model, one per dtype, stepped in
turn: decode tokens/s at batch 1, 8 and 64 and prefill tokens/s (8 prompts of 256 tokens); each figure the
median of interleaved samples. Last, greedy agreement on W1 (64 chat prompts of 41 tokens, 128 tokens
each): how many of the 64 bf16 outputs equal float32's token for token, and the mean common prefix; the same
for PyTorch ops in bfloat16, for comparison.

    python bench/bf16.py [--quick] [--only gemm,heights,engine,agreement]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from functools import partial

import torch

from conveyor.benchmarks.interleave import gemm_ab, interleaved
from conveyor.model.native.kernels import BF16_FEATURE, native_kernels

# (name, K, N): SmolLM2-135M's projections (qkv and gate/up fused as the engine packs them) and its LM head.
SHAPES = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576), ("lm_head", 576, 49152)]
ROWS = [1, 8, 64, 256]
DTYPES = ("float32", "bfloat16")


def gemm(kernels, samples: int, min_s: float) -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    print(f"\nGEMM GFLOP/s, {torch.get_num_threads()} thread(s): float32 (512-bit) | bf16 | ratio")
    gemm_ab(kernels, SHAPES, ROWS, {dtype: partial(kernels.pack_linear_weight, width=512, bfloat16=dtype == "bfloat16")
                                    for dtype in DTYPES}, samples, min_s)


def heights(kernels, samples: int, min_s: float) -> None:
    torch.set_num_threads(1)
    print("\nbf16 micro-kernel heights (32 columns), 1 thread, GFLOP/s")
    for name, k, n in SHAPES[2:4]:
        packed = kernels.pack_linear_weight(torch.randn(n, k), 512, True)
        for m in (64, 256):
            x = torch.randn(m, k)
            variants = {f"x{h}": partial(kernels.packed_linear, x, packed, n, h) for h in (4, 6, 8, 10, 12, 14)}
            secs = interleaved(variants, samples, min_s)
            flops = 2 * m * k * n / 1e9
            print(f"  {name:8} M={m:<4} " + "  ".join(f"{v} {flops / s:6.1f}" for v, s in secs.items()), flush=True)


def measure_prefill(engine, prompts: int, prompt_len: int, seed: int) -> float:
    """Prompt tokens/s of ``prompts`` fresh random prompts submitted at once, each producing one token."""
    from conveyor.core.sampling import SamplingParams

    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for _ in range(prompts):
        engine.add_request([rng.randrange(vocab // 8, vocab) for _ in range(prompt_len)], params)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return prompts * prompt_len / (time.perf_counter() - start)


def build_engines() -> dict:
    from conveyor.core.config import EngineConfig
    from conveyor.engine import Engine

    engines = {d: Engine(EngineConfig(dtype=d, num_kv_blocks=1024, enable_prefix_caching=False)) for d in DTYPES}
    assert engines["bfloat16"].kernel_dtype == "bfloat16", "the bf16 engine runs torch ops (see its log line)"
    return engines


def speed(engines: dict, rounds: int) -> None:
    from conveyor.benchmarks.decode import measure_decode

    torch.set_num_threads(os.cpu_count() or 1)
    print(f"\nSmolLM2-135M, medians of {rounds} interleaved rounds: float32 | bfloat16 | ratio")
    cases = {f"decode tok/s, batch {b}": partial(measure_decode, batch_size=b, prompt_len=64, steps=16)
             for b in (1, 8, 64)}
    cases["prefill tok/s, 8 x 256"] = partial(measure_prefill, prompts=8, prompt_len=256)
    for label, measure in cases.items():
        rates: dict[str, list[float]] = {d: [] for d in DTYPES}
        for round_ in range(rounds):
            for dtype, engine in engines.items():
                rates[dtype].append(measure(engine, seed=round_))
        a, b = statistics.median(rates["float32"]), statistics.median(rates["bfloat16"])
        print(f"  {label:24} {a:8.1f} | {b:8.1f} | {b / a:.3f}x", flush=True)


def agreement(engines: dict) -> None:
    """W1's greedy outputs of the bf16 engine, and of PyTorch ops in bfloat16 (what ``--dtype bfloat16`` runs
    on a CPU without avx512_bf16) for comparison, against the float32 engine's."""
    from conveyor.benchmarks.throughput import run_all_at_once
    from conveyor.benchmarks.workload import w1_requests
    from conveyor.core.config import EngineConfig
    from conveyor.engine import Engine

    requests = w1_requests(engines["float32"].tokenizer)
    length = len(requests[0].prompt_token_ids), requests[0].output_len
    print(f"\nW1 greedy ({len(requests)} chat prompts of {length[0]} tokens, {length[1]} tokens each) against "
          "float32's:")
    want = [o.token_ids for o in run_all_at_once(engines["float32"], requests)[0]]
    torch_ops = Engine(EngineConfig(dtype="bfloat16", kernels="torch", num_kv_blocks=1024))
    for label, engine in (("bfloat16, native", engines["bfloat16"]), ("bfloat16, PyTorch ops", torch_ops)):
        got = [o.token_ids for o in run_all_at_once(engine, requests)[0]]
        prefixes = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    for a, b in zip(want, got)]
        identical = sum(a == b for a, b in zip(want, got))
        print(f"  {label:22} identical outputs {identical} / {len(requests)}; common prefix mean "
              f"{statistics.mean(prefixes):.1f} tokens, median {statistics.median(prefixes):.0f}, "
              f"shortest {min(prefixes)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter samples")
    parser.add_argument("--only", default="gemm,heights,engine,agreement")
    args = parser.parse_args()
    kernels = native_kernels()
    assert kernels is not None and kernels.has_bfloat16(), f"needs the bfloat16 kernels (a CPU with {BF16_FEATURE})"
    samples, min_s = (3, 0.03) if args.quick else (5, 0.08)
    only = set(args.only.split(","))
    if "gemm" in only:
        gemm(kernels, samples, min_s)
    if "heights" in only:
        heights(kernels, samples, min_s)
    if only & {"engine", "agreement"}:
        engines = build_engines()
        if "engine" in only:
            speed(engines, rounds=3 if args.quick else 5)
        if "agreement" in only:
            agreement(engines)


if __name__ == "__main__":
    main()
