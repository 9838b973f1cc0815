"""The engine's command-line options, shared by every ``conveyor`` command that builds an engine."""

from __future__ import annotations

import argparse
import dataclasses

from conveyor.core.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:1, ...")
    g.add_argument("--max-num-seqs", type=int, default=128, help="most requests in one batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--kv-cache-memory", default="2GiB", help="KV pool size in bytes, e.g. 2GiB, 512MB")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (overrides memory)")
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (default: model's)")
    g.add_argument("--seed", type=int, default=0, help="seed of unseeded random sampling")
    g.add_argument("--scheduler", default="continuous", choices=["continuous", "static"],
                   help="continuous: iteration-level batching; static: request-level batches (the baseline)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="priority: lower value first, preempting less important running requests")
    g.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                   help="what happens to a preempted request's KV: dropped and recomputed, or swapped to CPU")
    g.add_argument("--swap-space", default="4GiB", help="CPU memory for swapped KV (with --preemption-mode swap)")
    g.add_argument("--kv-layout", default="paged", choices=["paged", "contiguous"],
                   help="paged: blocks on demand; contiguous: a --max-model-len slab reserved per request")
    g.add_argument("--kernels", default="native", choices=["native", "torch"],
                   help="native: the decoder stack in C++ on packed weights (float32 CPU); "
                   "torch: plain PyTorch ops, the reference")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len,
        seed=args.seed,
        scheduler=args.scheduler,
        scheduling_policy=args.scheduling_policy,
        preemption_mode=args.preemption_mode,
        swap_space=args.swap_space,
        kv_layout=args.kv_layout,
        kernels=args.kernels,
    )


def with_overrides(config: EngineConfig, spec: str) -> EngineConfig:
    """``"scheduler=static,max_num_seqs=32"`` applied to a copy of ``config`` (option names as in EngineConfig)."""
    options = as_options(config)
    for item in spec.split(","):
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in options:
            raise ValueError(f"--compare: {item!r} is not OPTION=VALUE with a known option ({', '.join(options)})")
        options[name] = int(value) if value.strip().lstrip("-").isdigit() else value.strip()
    return EngineConfig(**options)


def int_pair(text: str, flag: str) -> tuple[int, int]:
    try:
        low, high = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} must be two integers like 8,512, got {text!r}") from None
    if not 1 <= low <= high:
        raise ValueError(f"{flag} must satisfy 1 <= min <= max, got {text!r}")
    return low, high


def as_options(config: EngineConfig) -> dict:
    return dataclasses.asdict(config)
