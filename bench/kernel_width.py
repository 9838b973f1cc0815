"""The native kernels' 256-bit and 512-bit paths side by side, in one process (ratios, on a noisy machine).

GEMM GFLOP/s on SmolLM2-135M's shapes at 1, 8, 32, 64 and 256 rows, on one thread and on all; the 512-bit
micro-kernel at other heights (the packed_linear knob); paged attention of decode rows; and end to end,
decode tokens/s of two engines (one per width, CONVEYOR_KERNEL_WIDTH) stepped in turn. Each figure is the
median of interleaved samples, A and B alternating, so that drift in the machine's load hits both.

    python bench/kernel_width.py [--quick] [--skip-engine]
"""

from __future__ import annotations

import argparse
import os
import statistics
from functools import partial

import torch

from conveyor.benchmarks.interleave import gemm_ab, interleaved
from conveyor.model.native.kernels import WIDTH_ENV, native_kernels

# (name, K, N): SmolLM2-135M's projections (qkv and gate/up fused as the engine packs them) and its LM head.
SHAPES = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576), ("lm_head", 576, 49152)]
ROWS = [1, 8, 32, 64, 256]


def gemm(kernels, threads: int, samples: int, min_s: float) -> None:
    torch.set_num_threads(threads)
    print(f"\nGEMM GFLOP/s, {threads} thread(s): 256-bit | 512-bit | ratio")
    gemm_ab(kernels, SHAPES, ROWS, {w: partial(kernels.pack_linear_weight, width=w) for w in (256, 512)}, samples,
            min_s)


def heights(kernels, samples: int, min_s: float) -> None:
    torch.set_num_threads(1)
    print("\n512-bit micro-kernel heights, 1 thread, GFLOP/s (the 256-bit path at its 6 rows for reference)")
    for name, k, n in SHAPES[2:4]:
        weight = torch.randn(n, k)
        p256, p512 = kernels.pack_linear_weight(weight, 256), kernels.pack_linear_weight(weight, 512)
        for m in (64, 256):
            x = torch.randn(m, k)
            variants = {"256x6": partial(kernels.packed_linear, x, p256, n)}
            variants |= {f"512x{h}": partial(kernels.packed_linear, x, p512, n, h) for h in (6, 8, 10, 12, 14)}
            secs = interleaved(variants, samples, min_s)
            flops = 2 * m * k * n / 1e9
            print(f"  {name:8} M={m:<4} " + "  ".join(f"{v} {flops / s:6.1f}" for v, s in secs.items()), flush=True)


def attention(kernels, samples: int, min_s: float) -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    print("\npaged attention (9 heads, 3 KV heads, dim 64, block 16), all threads: ms 256-bit | 512-bit | ratio")
    cache = torch.randn(2, 4096, 16, 3, 64)
    for rows, ctx in ((1, 512), (8, 512), (32, 256), (64, 128)):
        tables = torch.stack([torch.randperm(4096)[: ctx // 16] for _ in range(rows)])
        query, lens = torch.randn(rows, 9, 64), torch.full((rows,), ctx)
        args = (query, cache[0], cache[1], tables, torch.arange(rows), lens, 0.125)
        secs = interleaved({w: partial(kernels.paged_attention, *args, w) for w in (256, 512)}, samples, min_s)
        print(f"  rows {rows:<3} ctx {ctx:<4} {1e3 * secs[256]:7.3f} | {1e3 * secs[512]:7.3f} | "
              f"{secs[256] / secs[512]:.3f}x", flush=True)


def engines(batch_sizes: list[int], rounds: int, steps: int) -> None:
    """Decode tokens/s of an engine per width (the engine reads the width when it packs the model), both on
    ``--kernels native``: the packed kernels everywhere, so that only the width differs."""
    from conveyor.benchmarks.decode import measure_decode
    from conveyor.core.config import EngineConfig
    from conveyor.engine import Engine

    built = {}
    for width in (256, 512):
        os.environ[WIDTH_ENV] = str(width)
        built[width] = Engine(EngineConfig(num_kv_blocks=1024, kernels="native"))
    os.environ.pop(WIDTH_ENV)
    print(f"\ndecode tok/s (SmolLM2-135M, prompt 64, {steps} steps), medians of {rounds}: 256-bit | 512-bit | ratio")
    for batch in batch_sizes:
        rates: dict[int, list[float]] = {256: [], 512: []}
        for round_ in range(rounds):
            for width, engine in built.items():
                rates[width].append(measure_decode(engine, batch, 64, steps, seed=round_))
        a, b = statistics.median(rates[256]), statistics.median(rates[512])
        print(f"  batch {batch:<3} {a:8.1f} | {b:8.1f} | {b / a:.3f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter samples")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--only", default="gemm,heights,attention,engine")
    args = parser.parse_args()
    kernels = native_kernels()
    assert kernels is not None and 512 in kernels.kernel_widths(), "needs the 512-bit kernels (an AVX-512 CPU)"
    samples, min_s = (3, 0.03) if args.quick else (5, 0.08)
    only = set(args.only.split(","))
    if "gemm" in only:
        for threads in (1, os.cpu_count() or 1):
            gemm(kernels, threads, samples, min_s)
    if "heights" in only:
        heights(kernels, samples, min_s)
    if "attention" in only:
        attention(kernels, samples, min_s)
    if "engine" in only and not args.skip_engine:
        torch.set_num_threads(os.cpu_count() or 1)
        engines([1, 8, 32, 64], rounds=3 if args.quick else 5, steps=16)


if __name__ == "__main__":
    main()
