"""``conveyor simulate``: the real scheduler on a virtual clock, for hardware and traffic this machine cannot run.

It takes the engine flags of ``serve`` and ``bench throughput``, plus the
hardware, the model's config, the workload and the request rates; it prints
the benchmark's figures for each configuration and rate, writes the same
trace format, and with ``--sweep`` draws latency against request rate and
names each configuration's max sustainable rate (see :mod:`conveyor.sim.sweep`).
``conveyor simulate calibrate`` fits ``cpu-local`` to the real engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

from conveyor.benchmarks.report import format_table
from conveyor.core.config import EngineConfig
from conveyor.core.model_config import ModelConfig
from conveyor.entrypoints.args import add_engine_args, engine_config, with_overrides
from conveyor.model.weights.paths import resolve_model
from conveyor.router import POLICY_NAMES
from conveyor.sim.cluster import simulate_cluster
from conveyor.sim.hardware import hardware_names, load_hardware, load_model_config, model_names
from conveyor.sim.profile import step_cost_model
from conveyor.sim.simulator import device_kv_cache_memory, simulate
from conveyor.sim.speculative import AcceptanceProfile
from conveyor.sim.sweep import DEFAULT_LATENCY_BOUND, is_sustainable, max_sustainable_rate
from conveyor.sim.validation import CASE_NAMES
from conveyor.sim.workload import (
    LENGTH_PRESETS,
    ConversationShape,
    WorkloadRequest,
    multi_tenant_requests,
    multi_turn_shapes,
    parse_lengths,
    read_trace_file,
    shared_prefix_requests,
    synthetic_workload,
)

DEFAULT_MODEL_CONFIG = "Llama-2-7B"
DEFAULT_NUM_REQUESTS = 1000
KV_OPTIONS = ("kv_cache_memory", "num_kv_blocks")


def add_simulate_parser(commands: argparse._SubParsersAction) -> None:
    sim = commands.add_parser("simulate", help="the scheduler on a cost model: GPUs, models and traffic at scale")
    g = sim.add_argument_group("simulation")
    g.add_argument("--hardware", default="A100-80GB", help=f"{', '.join(hardware_names())}, or a JSON spec file")
    g.add_argument("--model-config", default=None,
                   help=f"{', '.join(model_names())}, or a HF config.json or folder "
                   f"(default: --model's config, else {DEFAULT_MODEL_CONFIG})")
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="devices that split each layer")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of device memory for weights and KV, when --kv-cache-memory is not given")
    g.add_argument("--workload", default="sharegpt",
                   help=f"{', '.join(LENGTH_PRESETS)} (long-tailed lengths of those means); shared-prefix "
                   "(requests over --num-prefixes shared prefixes of 400-800 tokens, questions of 16-48, 64 output "
                   "tokens, all at once); multi-turn (--num-requests conversations of --num-turns turns, each "
                   "resending its history, as bench throughput's); multi-tenant (--num-tenants tenants, each with a "
                   "6000-token context its requests share, questions of 600-1200 tokens, 256 output tokens, at "
                   "--request-rates); or a CSV/JSONL file of arrival_time, prompt_tokens, output_tokens")
    g.add_argument("--num-prefixes", type=int, default=8, help="shared-prefix: how many shared prefixes")
    g.add_argument("--num-turns", type=int, default=6, help="multi-turn: turns per conversation")
    g.add_argument("--num-system-prompts", type=int, default=0,
                   help="multi-turn: conversations open with one of this many shared system prompts (chat "
                   "applications with many users); 0: each its own")
    g.add_argument("--num-tenants", type=int, default=150, help="multi-tenant: tenants, each with its own context")
    g.add_argument("--num-replicas", type=int, default=1, help="engine replicas behind one router")
    g.add_argument("--router-policy", default="cache-aware",
                   help=f"with --num-replicas > 1: {', '.join(POLICY_NAMES)}; comma-separated to compare several")
    g.add_argument("--prompt-len", default=None, help="N, uniform:LOW,HIGH or longtail:MEAN (overrides --workload)")
    g.add_argument("--output-len", default=None, help="N, uniform:LOW,HIGH or longtail:MEAN (overrides --workload)")
    g.add_argument("--num-requests", type=int, default=None, help=f"default {DEFAULT_NUM_REQUESTS}; a file: all")
    g.add_argument("--request-rates", default=None, help="requests/s, comma-separated, e.g. 1,2,4 (default inf: "
                   "all at once); arrivals are a Poisson process, or gamma with --burstiness")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 Poisson, < 1 burstier")
    g.add_argument("--workload-seed", type=int, default=0)
    g.add_argument("--compare", nargs="+", metavar="OPTION=VALUE[,OPTION=VALUE]",
                   help="simulate each configuration on the same workload, e.g. scheduler=static kv_layout=contiguous")
    g.add_argument("--sweep", action="store_true", help="draw latency vs request rate (to --plot) and print each "
                   "configuration's max sustainable rate")
    g.add_argument("--plot", default="sweep.png", help="where --sweep draws")
    g.add_argument("--latency-bound", type=float, default=DEFAULT_LATENCY_BOUND,
                   help="mean normalized latency (s per output token) a sustainable rate stays under")
    g.add_argument("--fast-forward", action=argparse.BooleanOptionalAction, default=True,
                   help="advance the running requests whose decodes are determined as a group, exact to the step "
                   "(the same figures and trace as one request at a time, several times faster)")
    g.add_argument("--trace", default=None, help="write the scheduler trace (JSON lines); a folder when there "
                   "are several runs")
    g.add_argument("--json", default=None, help="also write the figures to this file")
    g.add_argument("--step-profile", default="auto", help="how steps are priced: auto (cpu-local: this machine's "
                   "measured profile when current, else the roofline; other hardware: the roofline), none (the "
                   "roofline), or a profile file measured by `conveyor simulate calibrate` on your hardware")
    sim.add_argument("--acceptance-profile", help="with --speculative-config: what the workload's drafts look like "
                     "(a file written by `conveyor bench speculative --profile-out`)")
    add_engine_args(sim)
    sim.set_defaults(dtype=None, kv_cache_memory=None)  # the hardware's dtype; the KV its memory leaves

    _add_calibration_parsers(sim)


def _add_calibration_parsers(sim: argparse.ArgumentParser) -> None:
    """``simulate calibrate`` and ``simulate validate``: the simulator measured against the real engine."""
    commands = sim.add_subparsers(dest="simulate_command")
    calibrate = commands.add_parser(
        "calibrate", help="time the real engine's steps over a grid of shapes and fit this machine's step "
        "profile, then run the validation workloads through the engine and the simulator")
    calibrate.add_argument("--validate", action=argparse.BooleanOptionalAction, default=True,
                           help="then run the validation workloads (see `conveyor simulate validate`)")
    validate = commands.add_parser(
        "validate", help="run the validation workloads through the real engine and the simulator (priced by "
        "this machine's step profile) and print the simulator's error on each figure")
    for parser in (calibrate, validate):
        v = parser.add_argument_group("validation")
        v.add_argument("--num-prompts", type=int, default=48, help="requests of each validation workload")
        v.add_argument("--workloads", default=",".join(CASE_NAMES), help="which, comma-separated")
        v.add_argument("--workload-seed", type=int, default=0)
        v.add_argument("--repeats", type=int, default=3, help="real-engine runs of each workload; the simulator is "
                       "compared with their median")
        v.add_argument("--json", default=None, help="also write every workload's figures, both sides, here")
        add_engine_args(parser)
        parser.set_defaults(max_num_seqs=32)


def _model_config(args: argparse.Namespace) -> ModelConfig:
    """--model-config; else --model's own config, found as the engine finds the model (a folder, a GGUF file's
    description, a packaged name, a name in the models directory or the Hugging Face cache), where it is not a
    catalog name; else the default model's."""
    if args.model_config is not None or args.model is None:
        return load_model_config(args.model_config or DEFAULT_MODEL_CONFIG)
    if args.model.lower() in {name.lower() for name in model_names()}:
        return load_model_config(args.model)
    return load_model_config(str(resolve_model(args.model)))


def run_simulate(args: argparse.Namespace) -> int:
    if args.simulate_command in ("calibrate", "validate"):
        return _calibrate(args)
    hardware = load_hardware(args.hardware)
    model = _model_config(args)
    args.dtype = args.dtype or hardware.default_dtype
    kv_auto = args.kv_cache_memory is None and args.num_kv_blocks is None
    args.kv_cache_memory = args.kv_cache_memory or "2GiB"  # replaced below when kv_auto
    base = engine_config(args)
    specs = args.compare or [_describe(base)]
    configs = [with_overrides(base, spec) if args.compare else base for spec in specs]  # all checked before any run
    rates, workloads = _workloads(args)
    conversations = _conversations(args)
    policies = _router_policies(args)
    acceptance = AcceptanceProfile.read(args.acceptance_profile) if args.acceptance_profile else None
    if policies:
        specs, configs = _with_policies(specs, configs, policies)
    results: dict[str, list[dict[str, Any]]] = {}
    several = len(configs) * len(rates) > 1
    for spec, config in zip(specs, configs):
        cost, priced_by = step_cost_model(model, hardware, config.dtype, args.tensor_parallel_size,
                                          args.step_profile, config.num_threads,
                                          config.kv_cache_element_bytes(model.gguf_file))
        print(f"steps priced by the {priced_by}", file=sys.stderr, flush=True)
        if kv_auto and not any(option in spec for option in KV_OPTIONS):
            config = dataclasses.replace(config, kv_cache_memory=device_kv_cache_memory(cost,
                                                                                     args.gpu_memory_utilization))
        results[spec] = []
        for rate, workload in zip(rates, workloads):
            print(f"simulating {spec} at {_rate(rate)} ...", file=sys.stderr, flush=True)
            if policies:
                policy = spec.rpartition("router=")[2]
                result, trace = simulate_cluster(config, cost, workload, args.num_replicas, policy, conversations,
                                                 args.workload_seed, args.fast_forward), None
            else:
                result, trace = simulate(config, cost, workload, bool(args.trace), conversations,
                                         args.fast_forward, acceptance)
            result = {"configuration": spec, "request_rate": rate, "steps_priced_by": priced_by, **result}
            results[spec].append(result)
            if trace is not None:
                trace.write(_trace_path(args.trace, spec, rate) if several else args.trace)
    _report(args, rates, results, several)
    return 0


def _router_policies(args: argparse.Namespace) -> list[str]:
    """The router policies to compare, or none for one engine alone."""
    if args.num_replicas < 1:
        raise ValueError(f"--num-replicas must be >= 1, got {args.num_replicas}")
    if args.num_replicas == 1:
        return []
    if args.trace:
        raise ValueError("--trace records one engine's steps; drop it with --num-replicas > 1")
    policies = [name.strip() for name in args.router_policy.split(",")]
    unknown = [name for name in policies if name not in POLICY_NAMES]
    if unknown:
        raise ValueError(f"--router-policy: {', '.join(unknown)} not among {', '.join(POLICY_NAMES)}")
    return policies


def _with_policies(specs: list[str], configs: list[EngineConfig],
                   policies: list[str]) -> tuple[list[str], list[EngineConfig]]:
    """Every configuration behind every router policy, labelled ``CONFIG,router=POLICY``."""
    pairs = [(f"{spec},router={policy}", config) for spec, config in zip(specs, configs) for policy in policies]
    return [spec for spec, _ in pairs], [config for _, config in pairs]


def _describe(config: EngineConfig) -> str:
    return f"scheduler={config.scheduler},kv_layout={config.kv_layout}"


def _conversations(args: argparse.Namespace) -> list[ConversationShape]:
    if args.workload != "multi-turn":
        return []
    return multi_turn_shapes(args.num_requests or 16, args.workload_seed, args.num_turns,
                             num_system_prompts=args.num_system_prompts)


def _workloads(args: argparse.Namespace) -> tuple[list[float], list[list[WorkloadRequest]]]:
    """The request rates, and the workload at each (one workload, replayed as it is, for a trace file)."""
    if args.workload in ("shared-prefix", "multi-turn"):
        if args.request_rates or args.prompt_len or args.output_len:
            raise ValueError(f"--workload {args.workload}: all at once, with its own lengths; drop --request-rates, "
                             "--prompt-len and --output-len")
        if args.workload == "multi-turn":
            return [math.inf], [[]]  # the conversations (_conversations) are the workload
        return [math.inf], [shared_prefix_requests(args.num_requests or 128, args.workload_seed, args.num_prefixes)]
    if args.workload == "multi-tenant":
        if args.prompt_len or args.output_len:
            raise ValueError("--workload multi-tenant has its own lengths; drop --prompt-len and --output-len")
        rates = _parse_rates(args.request_rates or "inf")
        num = args.num_requests or DEFAULT_NUM_REQUESTS
        return rates, [multi_tenant_requests(num, rate, args.workload_seed, args.num_tenants,
                                             burstiness=args.burstiness) for rate in rates]
    if args.workload not in LENGTH_PRESETS:
        if args.request_rates or args.prompt_len or args.output_len:
            raise ValueError("--workload FILE: the file sets arrival times and lengths; drop --request-rates, "
                             "--prompt-len and --output-len")
        requests = read_trace_file(args.workload)
        return [math.nan], [requests[: args.num_requests] if args.num_requests else requests]
    prompt_default, output_default = LENGTH_PRESETS[args.workload]
    prompt_lengths = parse_lengths(args.prompt_len or prompt_default)
    output_lengths = parse_lengths(args.output_len or output_default)
    rates = _parse_rates(args.request_rates or "inf")
    num = args.num_requests or DEFAULT_NUM_REQUESTS
    if num < 1:
        raise ValueError("--num-requests must be >= 1")
    return rates, [
        synthetic_workload(num, rate, prompt_lengths, output_lengths, args.workload_seed, args.burstiness)
        for rate in rates
    ]


def _parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--request-rates must be numbers like 1,2,4 or inf, got {text!r}") from None
    if any(not rate > 0 for rate in rates):
        raise ValueError(f"--request-rates must be > 0, got {text!r}")
    return rates


def _rate(rate: float) -> str:
    if math.isnan(rate):
        return "the file's arrival times"
    return "once (all at t=0)" if math.isinf(rate) else f"{rate:g} req/s"


def _trace_path(folder: str, spec: str, rate: float) -> Path:
    Path(folder).mkdir(parents=True, exist_ok=True)
    return Path(folder) / f"{spec.replace(',', '_').replace('=', '-')}_rate-{rate:g}.jsonl"


TABLE_COLUMNS = {
    "req/s": "requests_per_s",
    "output tok/s": "output_tokens_per_s",
    "TTFT mean s": "ttft_mean_s",
    "TTFT p99 s": "ttft_p99_s",
    "TPOT mean s": "tpot_mean_s",
    "goodput req/s": "goodput_requests_per_s",
    "refused": "refused",
    "latency p50 s": "latency_p50_s",
    "latency p90 s": "latency_p90_s",
    "latency p99 s": "latency_p99_s",
    "norm. latency s/tok": "normalized_latency_mean_s",
    "preemptions": "preemptions",
    "swaps": "swaps_out",
    "peak running": "peak_running",
    "KV waste": "kv_waste_fraction",
    "sim wall s": "simulation_wall_s",
}

CLUSTER_COLUMNS = {
    "req/s": "requests_per_s",
    "output tok/s": "output_tokens_per_s",
    "TTFT p50 s": "ttft_p50_s",
    "TTFT p90 s": "ttft_p90_s",
    "latency p90 s": "latency_p90_s",
    "norm. latency s/tok": "normalized_latency_mean_s",
    "prefix hit rate": "prefix_cache_hit_rate",
    "preemptions": "preemptions",
    "requests per replica": "requests_per_replica",
    "sim wall s": "simulation_wall_s",
}


def _report(args: argparse.Namespace, rates: list[float], results: dict[str, list[dict[str, Any]]],
            several: bool) -> None:
    from conveyor.benchmarks.throughput import print_throughput, write_json

    columns = CLUSTER_COLUMNS if args.num_replicas > 1 else TABLE_COLUMNS
    if not several:
        print_throughput(next(iter(results.values()))[0])
    else:
        rows = [[spec, _rate(r["request_rate"]), *(r[key] for key in columns.values())]
                for spec, runs in results.items() for r in runs]
        print(format_table(["configuration", "rate", *columns], rows))
    if args.sweep:
        _sweep(args, rates, results)
    write_json(results if several else next(iter(results.values()))[0], args.json)


def _sweep(args: argparse.Namespace, rates: list[float], results: dict[str, list[dict[str, Any]]]) -> None:
    from conveyor.viz.sweep import plot_sweep

    finite = [i for i, rate in enumerate(rates) if math.isfinite(rate)]
    if len(finite) < 2:
        raise ValueError("--sweep needs at least two finite --request-rates")
    swept = [rates[i] for i in finite]
    best = {spec: max_sustainable_rate(swept, [runs[i] for i in finite], args.latency_bound)
            for spec, runs in results.items()}
    curves = {spec: (swept, [runs[i]["normalized_latency_mean_s"] for i in finite]) for spec, runs in results.items()}
    first = next(iter(results.values()))[0]
    title = (f"{args.model_config or args.model or DEFAULT_MODEL_CONFIG} on {first['hardware']}"
             f"{' x' + str(args.tensor_parallel_size) if args.tensor_parallel_size > 1 else ''}, "
             f"{args.workload}, {first['num_requests']} requests")
    plot_sweep(curves, best, args.latency_bound, title, args.plot)
    print()
    print(format_table(
        ["configuration", "max sustainable rate", "sustainable at"],
        [[spec, "none" if best[spec] is None else f"{best[spec]:g} req/s",
          " ".join(f"{rates[i]:g}" for i in finite if is_sustainable(results[spec][i], args.latency_bound))]
         for spec in results],
    ))
    print(f"sustainable: completions keep up with arrivals (>= 90% of their rate) and the mean normalized latency "
          f"is under {args.latency_bound} s/token, at that rate and every lower one swept")
    print(f"wrote {args.plot}")


def _calibrate(args: argparse.Namespace) -> int:
    """``calibrate``: fit and save the profile, then validate unless told not to; ``validate``: validate."""
    from conveyor.benchmarks.calibrate import calibrate
    from conveyor.benchmarks.sim_validation import validate_suite

    config = engine_config(args)
    names = tuple(name.strip() for name in args.workloads.split(","))
    unknown = [name for name in names if name not in CASE_NAMES]
    if unknown:
        raise ValueError(f"--workloads: {', '.join(unknown)} not among {', '.join(CASE_NAMES)}")
    if args.simulate_command == "calibrate":
        calibrate(config)
        if not args.validate:
            return 0
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    results = validate_suite(config, args.num_prompts, args.workload_seed, names, repeats=args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0
