"""The ``conveyor`` command: generate, serve, bench, plot, simulate, roofline, export-hf."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections import defaultdict
from pathlib import Path

from conveyor.benchmarks.workload import WORKLOADS
from conveyor.core.config import EngineConfig, parse_bytes
from conveyor.core.pooling import PoolingMethod
from conveyor.core.sampling import SamplingParams
from conveyor.entrypoints.args import add_engine_args, as_options, engine_config, int_pair, with_overrides
from conveyor.entrypoints.openai.reasoning import PARSERS as REASONING_PARSERS
from conveyor.entrypoints.openai.tool_parsers import PARSERS as TOOL_PARSERS
from conveyor.platform.cache_dir import CacheDirError
from conveyor.router import POLICY_NAMES

EXAMPLE_CHATS = [
    "What is the capital of France?",
    "Write a haiku about a river.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for learning a new language.",
    "What does a compiler do?",
    "Name the planets of the solar system.",
]
Commands = argparse._SubParsersAction  # what add_subparsers returns


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_generate(commands)
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    _add_bench_throughput(bench)
    _add_bench_decode(bench)
    _add_bench_speculative(bench)
    _add_bench_perplexity(bench)
    _add_bench_agreement(bench)
    _add_bench_compare(bench)
    _add_bench_serve(bench)
    _add_export_hf(commands)
    _add_serve(commands)
    _add_roofline(commands)
    _add_plot(commands)
    dashboard = commands.add_parser("dashboard", help="replay a trace file (JSON lines) in the dashboard page")
    dashboard.add_argument("trace", help="a trace written by --trace (bench throughput, simulate)")
    dashboard.add_argument("--host", default="127.0.0.1")
    dashboard.add_argument("--port", type=int, default=8000)

    from conveyor.entrypoints.simulate import add_simulate_parser

    add_simulate_parser(commands)
    return parser


def _add_generate(commands: Commands) -> None:
    gen = commands.add_parser("generate", help="generate for a few prompts and print a per-request table")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable); default: built-in example chats")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                     help="wrap each prompt as a user message in the model's chat template (default: on)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    add_engine_args(gen)


def _add_bench_throughput(bench: Commands) -> None:
    thr = bench.add_parser("throughput", help="a seeded workload run to the end; requests/s, tokens/s, TTFT, latency")
    thr.add_argument("--workload", default="longtail", choices=WORKLOADS,
                     help="longtail: long-tailed requests at once; shared-prefix: requests over a few shared "
                     "prefixes, at once; multi-turn: conversations whose turns resend their history")
    thr.add_argument("--num-prompts", type=int, default=128, help="requests (conversations, for multi-turn)")
    thr.add_argument("--workload-seed", type=int, default=0)
    thr.add_argument("--output-len", default="8,512", help="min,max output tokens (long-tailed between); "
                     "shared-prefix and multi-turn use max")
    thr.add_argument("--prompt-len", default="16,512", help="min,max prompt tokens (long-tailed between)")
    thr.add_argument("--num-prefixes", type=int, default=8, help="shared-prefix: how many shared prefixes")
    thr.add_argument("--prefix-len", default="400,800", help="shared-prefix: min,max tokens of a shared prefix")
    thr.add_argument("--num-turns", type=int, default=6, help="multi-turn: turns per conversation")
    thr.add_argument("--json", default=None, help="also write the figures to this file")
    thr.add_argument("--trace", default=None,
                     help="write the scheduler trace (JSON lines); with --compare, a folder for one trace each")
    thr.add_argument("--compare", nargs="+", metavar="OPTION=VALUE[,OPTION=VALUE]",
                     help="run the same workload under each configuration, e.g. scheduler=static scheduler=continuous")
    add_engine_args(thr)


def _add_bench_perplexity(bench: Commands) -> None:
    ppl = bench.add_parser("perplexity", help="perplexity over a text file, as llama-perplexity computes it")
    ppl.add_argument("text", help="a UTF-8 text file")
    ppl.add_argument("--context", type=int, default=512, help="tokens per chunk (llama-perplexity's -c)")
    add_engine_args(ppl)


def _add_bench_agreement(bench: Commands) -> None:
    agree = bench.add_parser("agreement", help="greedy answers and perplexity of a quantized file against its "
                             "float32 weights, for Conveyor and llama.cpp where it is set up")
    agree.add_argument("text", help="a UTF-8 text file: the prompts are windows of it, perplexity is over it")
    agree.add_argument("--prompts", type=int, default=32, help="windows of the text continued greedily")
    agree.add_argument("--prompt-len", type=int, default=48, help="tokens per window")
    agree.add_argument("--tokens", type=int, default=32, help="tokens each window is continued by")
    agree.add_argument("--context", type=int, default=256, help="perplexity's tokens per chunk")
    agree.add_argument("--no-llamacpp", action="store_true", help="leave llama.cpp out")
    agree.add_argument("--json", default=None, help="also write every engine's answers and perplexity here")
    add_engine_args(agree)


def _add_bench_decode(bench: Commands) -> None:
    dec = bench.add_parser("decode", help="steady-state decode tokens/s per batch size")
    dec.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    dec.add_argument("--prompt-len", type=int, default=64)
    dec.add_argument("--steps", type=int, default=16, help="timed decode steps per batch size")
    add_engine_args(dec)


def _add_bench_speculative(bench: Commands) -> None:
    spec = bench.add_parser("speculative", help="tokens/s with and without speculative decoding, on a workload "
                            "that repeats its input (one at a time, at once) and on W2")
    spec.add_argument("--batch", type=int, default=64, help="requests of the at-once case")
    spec.add_argument("--repeats", type=int, default=3, help="runs of each case per engine, in turns")
    spec.add_argument("--no-w2", action="store_true", help="leave out W2")
    spec.add_argument("--no-simulate", action="store_true", help="leave out the simulator's predicted speed-ups")
    spec.add_argument("-o", "--output", help="write the figures (and each case's acceptance profile) as JSON here")
    spec.add_argument("--profile-out", help="write the one-at-a-time case's acceptance profile here, for "
                      "`conveyor simulate --acceptance-profile`")
    add_engine_args(spec)


def _add_bench_compare(bench: Commands) -> None:
    cmp = bench.add_parser("compare", help="Conveyor and the peers set up under .peers/ on the same fixed workloads")
    cmp.add_argument("--workloads", default="W1@1,W1@64,W2",
                     help="W1@1: W1 prompts one at a time; W1@64: all 64 at once; W2: 256 long-tailed at once; "
                     "SP: 128 requests over 8 shared prefixes at once, every engine's prefix caching on")
    cmp.add_argument("--peers", default="openvino,openvino-u8kv,llamacpp,vllm,transformers",
                     help="peers to run (those not set up are skipped; see bench/peers/)")
    cmp.add_argument("--w1-single", type=int, default=8, help="W1 prompts run one at a time in W1@1")
    cmp.add_argument("--limit", type=int, default=None, help="first N requests of each workload (a quick check)")
    cmp.add_argument("--max-output-len", type=int, default=None, help="cap output lengths (a quick check)")
    cmp.add_argument("-o", "--output", default=None, help="write machine, figures and agreement as JSON")
    cmp.add_argument("--num-threads", type=int, default=None,
                     help="CPU threads of Conveyor and of every peer alike (default: the cores this process may use)")
    cmp.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                     help="Conveyor's weights and KV cache (the peers run as each is set up: see bench/peers/)")
    cmp.add_argument("--model", default=None,
                     help="Conveyor's model: a GGUF file (weights kept quantized) or a HF folder (default: the "
                          "default model's Q4_1 file)")
    cmp.add_argument("--float32", action="store_true",
                     help="also run Conveyor's server on the same model's float32 weights (dequantized once)")
    cmp.add_argument("--in-process", action="store_true",
                     help="also time Conveyor's engine called in this process (no HTTP, no server threads), "
                          "as a row of its own")
    cmp.add_argument("--serve-args", default="",
                     help="more flags for Conveyor's `conveyor serve`, as one string (e.g. \"--max-num-seqs 64\")")
    cmp.add_argument("--rounds", type=int, default=1,
                     help="run every engine this many times in turn (Conveyor, the peers, Conveyor, ...) and report "
                          "the median of each round's ratios: the machine's speed drifts within minutes")


def _add_bench_serve(bench: Commands) -> None:
    srv = bench.add_parser("serve", help="Poisson arrivals of streaming requests against an OpenAI-compatible server")
    srv.add_argument("--base-url", default="http://127.0.0.1:8000")
    srv.add_argument("--model", default=None, help="model name to send (default: none, the server's own)")
    srv.add_argument("--api-key", default=os.environ.get("CONVEYOR_API_KEY"))
    srv.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    srv.add_argument("--workload", default="longtail", choices=("longtail", "shared-prefix", "multi-turn"),
                     help="longtail: bench throughput's requests; shared-prefix: its requests over 8 shared "
                     "prefixes (the server's cached_tokens are summed); multi-turn: --num-prompts conversations "
                     "of --num-turns turns, each resending its history when the previous answer is complete")
    srv.add_argument("--num-turns", type=int, default=6, help="multi-turn: turns per conversation")
    srv.add_argument("--num-system-prompts", type=int, default=0, help="multi-turn: conversations open with one "
                     "of this many shared system prompts (a chat application's, sent by all its users); 0: each "
                     "its own")
    srv.add_argument("--num-prompts", type=int, default=64)
    srv.add_argument("--seed", type=int, default=0)
    srv.add_argument("--output-len", default="8,512", help="min,max output tokens (long-tailed between); "
                     "shared-prefix uses max")
    srv.add_argument("--vocab-size", type=int, default=49152, help="prompt token ids are drawn below this")
    srv.add_argument("--slo-ttft", type=float, default=None, help="seconds; goodput counts requests within it")
    srv.add_argument("--slo-tpot", type=float, default=None, help="seconds per output token, for goodput")
    srv.add_argument("--send-slo", action="store_true", help="send --slo-ttft and --slo-tpot with every request as "
                     "its targets (ttft_slo_ms, tpot_slo_ms), for a server run with --scheduling-policy slo and "
                     "--admission-control; refusals (429) are counted apart")
    srv.add_argument("--extra-body", default=None, help="JSON object merged into the requests' bodies (e.g. "
                     "logprobs, penalties, guided_json), to measure what those parameters cost")
    srv.add_argument("--extra-body-fraction", type=float, default=1.0, help="share of the requests, spread "
                     "evenly, that get --extra-body")
    srv.add_argument("--json", default=None)


def _add_export_hf(commands: Commands) -> None:
    export = commands.add_parser("export-hf", help="write the model as a float32 Hugging Face folder for other engines")
    export.add_argument("output", help="the folder to write (new, or empty)")
    export.add_argument("--model", default=None, help="HF model folder, .gguf file or a model's name (default: "
                        "SmolLM2-135M-Instruct)")


def _add_serve(commands: Commands) -> None:
    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=os.environ.get("CONVEYOR_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on every route but /health and the chat page at / "
                       "(whose calls need the key) (default: $CONVEYOR_API_KEY; an empty key is refused)")
    serve.add_argument("--metrics-without-auth", action="store_true",
                       help="with --api-key, leave /metrics open to anyone who can reach the port (a scraper "
                       "without the key)")
    serve.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="the model names clients may send (each is accepted; responses report the first)")
    serve.add_argument("--max-request-bytes", type=int, default=1 << 20, help="largest request body")
    serve.add_argument("--max-waiting-requests", type=int, default=1024, help="503 beyond this many waiting")
    serve.add_argument("--default-max-tokens", type=int, default=None,
                       help="max_tokens of a request that sends none (default: the rest of the model's context)")
    _add_request_limit_args(serve)
    _add_browser_args(serve)
    _add_replica_args(serve)
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds in-flight requests get to finish on SIGTERM/SIGINT")
    serve.add_argument("--dashboard-show-text", action="store_true",
                       help="show prompt text on /dashboard (default: request ids and lengths only)")
    _add_tool_args(serve)
    serve.add_argument("--reasoning-parser", default=None, choices=tuple(REASONING_PARSERS),
                       help="split the model's <think> reasoning from its answer, into reasoning_content (chat) and "
                       "a reasoning item (the Responses API): deepseek_r1 (reasoning up to </think>, opened in the "
                       "prompt or not) or qwen3 (only a <think>...</think> block the reply writes) (default: none, "
                       "the reasoning stays in the content)")
    serve.add_argument("--pooling", default=PoolingMethod.LAST.value, choices=[m.value for m in PoolingMethod],
                       help="how /v1/embeddings makes a prompt one vector (llama.cpp's name): the last position's "
                       "final hidden state, which has attended to the whole prompt, or the mean over every "
                       "position; either scaled to unit length (default: last)")
    _add_model_budget_args(serve)
    add_engine_args(serve, several_models=True)


def _add_model_budget_args(parser: argparse.ArgumentParser) -> None:
    """Several --model: how many are kept loaded; the least recently used idle one is stopped for another."""
    g = parser.add_argument_group("several models")
    g.add_argument("--max-loaded-models", type=int, default=None,
                   help="most models loaded at once (Ollama's OLLAMA_MAX_LOADED_MODELS) (default: no cap)")
    g.add_argument("--max-loaded-bytes", type=parse_bytes, default=None,
                   help="most bytes of loaded models (weights' files and KV pools), e.g. 2GiB (default: no cap)")


def _add_tool_args(parser: argparse.ArgumentParser) -> None:
    """tool_choice auto (vLLM's flags): the model's replies read for the calls it chose to make."""
    g = parser.add_argument_group("tools")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="read replies to chat requests with tools (tool_choice auto, the default with tools) for "
                   "calls in the model's own format; without it such requests are a 400")
    g.add_argument("--tool-call-parser", default=None, choices=TOOL_PARSERS,
                   help="the model's tool-call format (default: the one its chat template shows: hermes for "
                   "<tool_call>, llama3_json for <|python_tag|>)")


def _add_request_limit_args(parser: argparse.ArgumentParser) -> None:
    """What one client may ask of the server: sequences per request, and time to send its body."""
    parser.add_argument("--max-sequences-per-request", type=int, default=64,
                        help="most sequences (prompts x n) one request may ask for; more: 400")
    parser.add_argument("--body-read-timeout", type=float, default=30.0,
                        help="seconds a client has to send its request body; slower: 408, connection closed")


def _add_browser_args(parser: argparse.ArgumentParser) -> None:
    """CORS (vLLM's flags, JSON lists) for browser apps on other origins, and a Host allow-list."""
    g = parser.add_argument_group("browsers")
    g.add_argument("--allowed-origins", type=json.loads, default=[],
                   help='origins a browser app may call from, as JSON: \'["https://app.example"]\' or \'["*"]\' '
                   "(default: none, no CORS)")
    g.add_argument("--allowed-methods", type=json.loads, default=["*"], help="CORS methods, as JSON")
    g.add_argument("--allowed-headers", type=json.loads, default=["*"], help="CORS request headers, as JSON")
    g.add_argument("--allowed-hosts", type=json.loads, default=["*"],
                   help='Host header names answered, as JSON: \'["localhost", "127.0.0.1"]\' (others: 421; '
                   "against DNS rebinding; default: any)")


def _add_replica_args(parser: argparse.ArgumentParser) -> None:
    """Data-parallel replicas on Ray (``pip install conveyor[ray]``), and the router in front of them."""
    g = parser.add_argument_group("replicas")
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas, each a Ray actor with its own KV pool; 1: one engine in this process")
    g.add_argument("--router-policy", default="cache-aware", choices=POLICY_NAMES,
                   help="how requests are spread over the replicas")
    g.add_argument("--ray-address", default=None,
                   help="an existing Ray cluster (auto, or host:port); default: start Ray on this machine")
    g.add_argument("--ray-host", default="127.0.0.1",
                   help="the node address of the Ray started here, where its processes listen: loopback by "
                   "default; this machine's address lets other machines join (Ray then listens on all interfaces)")
    g.add_argument("--max-replica-restarts", type=int, default=3, help="times Ray restarts a replica that dies")


def _add_roofline(commands: Commands) -> None:
    roof = commands.add_parser("roofline", help="this machine's bandwidth and GEMM limits vs the engine's decode")
    roof.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128,256")
    roof.add_argument("--context-lens", default="128,512,2048", help="contexts for the bound table")
    roof.add_argument("--measured-context-len", type=int, default=128,
                      help="context at which the engine is measured (0: bounds only)")
    roof.add_argument("--steps", type=int, default=8,
                      help="timed decode steps per run (each batch size: 4 runs, the bandwidth read between them)")
    roof.add_argument("-o", "--output", default="roofline.png", help="the picture (PNG)")
    roof.add_argument("--json", default=None, help="also write the table here")
    add_engine_args(roof)


def _add_plot(commands: Commands) -> None:
    plot = commands.add_parser("plot", help="pictures from traces").add_subparsers(dest="plot", required=True)
    timeline = plot.add_parser("timeline", help="batch slots x steps, busy or idle, one panel per trace")
    timeline.add_argument("traces", nargs="+")
    timeline.add_argument("-o", "--output", default="timeline.png")
    memory = plot.add_parser("memory", help="KV slots reserved vs used over time, and running requests")
    memory.add_argument("traces", nargs="+")
    memory.add_argument("-o", "--output", default="memory.png")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        if args.command == "simulate":
            from conveyor.entrypoints.simulate import run_simulate

            return run_simulate(args)
        if args.command == "export-hf":
            return _export_hf(args)
        if args.command == "dashboard":
            from conveyor.entrypoints.dashboard import serve_replay

            return serve_replay(args.trace, args.host, args.port)
        config = engine_config(args) if hasattr(args, "max_num_seqs") else None
        if getattr(args, "bench", None) == "serve":
            return _bench_serve(args)
        if getattr(args, "bench", None) == "compare":
            from conveyor.benchmarks.compare import compare

            return compare(args.workloads.split(","), args.peers.split(",") if args.peers else [], args.w1_single,
                           args.limit, args.max_output_len, args.output, args.num_threads, args.dtype, args.model,
                           args.float32, args.in_process, args.serve_args, args.rounds)
        if args.command == "plot":
            return _plot_timeline(args) if args.plot == "timeline" else _plot_memory(args)
        if args.command == "generate":
            return _generate(args, config)
        if args.command == "serve":
            from conveyor.entrypoints.serve import serve

            return serve(args, config)
        if args.command == "roofline":
            return _roofline(args, config)
        if args.bench == "throughput":
            return _bench_throughput(args, config)
        if args.bench == "perplexity":
            return _bench_perplexity(args, config)
        if args.bench == "agreement":
            return _bench_agreement(args, config)
        if args.bench == "speculative":
            return _bench_speculative(args, config)
        return _bench_decode(args, config)
    except (ValueError, FileNotFoundError, CacheDirError) as error:
        print(f"conveyor: error: {error}", file=sys.stderr)
        return 2


def _generate(args: argparse.Namespace, config: EngineConfig) -> int:
    from conveyor.benchmarks.report import format_table
    from conveyor.entrypoints.llm import LLM

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        stop=tuple(args.stop), ignore_eos=args.ignore_eos,
    )
    llm = LLM(**as_options(config))
    prompts = args.prompt or EXAMPLE_CHATS
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    rows = []
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        print(f"[{i}] {prompt}\n    -> {out.text.strip() if out.error is None else 'error: ' + out.error}\n")
        m = out.metrics
        ttft, latency = (None if t is None else round(t, 3) for t in (m.time_to_first_token, m.latency))
        rows.append([i, len(out.prompt_token_ids), len(out.token_ids), ttft, latency, out.finish_reason])
    print(format_table(["request", "prompt tokens", "output tokens", "TTFT s", "latency s", "finish"], rows))
    return 0


def _bench_throughput(args: argparse.Namespace, config: EngineConfig) -> int:
    from conveyor.benchmarks.throughput import (
        WorkloadSpec,
        print_comparison,
        print_throughput,
        run_throughput,
        write_json,
    )
    from conveyor.engine import Engine

    spec = WorkloadSpec(args.workload, args.num_prompts, args.workload_seed, int_pair(args.output_len, "--output-len"),
                        int_pair(args.prompt_len, "--prompt-len"), args.num_prefixes,
                        int_pair(args.prefix_len, "--prefix-len"), args.num_turns)
    if not args.compare:
        engine = Engine(config)
        result = run_throughput(engine, spec)
        print_throughput(result)
        write_json(result, args.json)
        if args.trace:
            engine.trace.write(args.trace)
        return 0
    configs = [with_overrides(config, label) for label in args.compare]  # all checked before any run
    results, outputs = [], []
    for label, variant in zip(args.compare, configs):
        print(f"running {label} ...", file=sys.stderr, flush=True)
        engine = Engine(variant)
        outputs.append([])
        results.append(run_throughput(engine, spec, outputs[-1]))
        if args.trace:
            Path(args.trace).mkdir(parents=True, exist_ok=True)
            engine.trace.write(Path(args.trace) / f"{label.replace(',', '_').replace('=', '-')}.jsonl")
        del engine
    print_comparison(args.compare, results, outputs)
    write_json(dict(zip(args.compare, results)), args.json)
    return 0


def _read_traces(paths: list[str], describe: str) -> tuple[list, list[str]]:
    """Traces and their labels: the file name, and the config fields that ``describe`` names."""
    from conveyor.observe.trace import Trace

    traces = [Trace.read(path) for path in paths]
    labels = [f"{Path(p).stem} ({describe.format_map(defaultdict(str, t.config))})" for p, t in zip(paths, traces)]
    return traces, labels


def _plot_memory(args: argparse.Namespace) -> int:
    from conveyor.viz.memory import plot_memory

    traces, labels = _read_traces(args.traces, "{kv_layout}, {max_model_len}-token max length")
    for label, summary in zip(labels, plot_memory(traces, labels, args.output)):
        print(f"{label}: {summary['mean_waste']:.1%} of reserved KV slots unused on average, "
              f"peak {summary['peak_running']} running requests")
    print(f"wrote {args.output}")
    return 0


def _plot_timeline(args: argparse.Namespace) -> int:
    from conveyor.viz.timeline import plot_timeline

    traces, labels = _read_traces(args.traces, "{scheduler}, max_num_seqs {max_num_seqs}")
    for label, idle in zip(labels, plot_timeline(traces, labels, args.output)):
        print(f"{label}: {idle:.1%} of slot-steps idle")
    print(f"wrote {args.output}")
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    from conveyor.benchmarks.serve import bench_serve, parse_extra_body, print_serve
    from conveyor.benchmarks.throughput import write_json

    if args.request_rate <= 0 or args.num_prompts < 1:
        raise ValueError("--request-rate must be > 0 and --num-prompts >= 1")
    result = bench_serve(args.base_url, args.model, args.num_prompts, args.request_rate, args.seed,
                         int_pair(args.output_len, "--output-len"), args.vocab_size, args.slo_ttft, args.slo_tpot,
                         args.api_key, args.workload, parse_extra_body(args.extra_body, args.extra_body_fraction),
                         args.num_turns, args.num_system_prompts, args.send_slo)
    print_serve(result)
    write_json(result, args.json)
    return 0 if result["completed"] else 1


def _export_hf(args: argparse.Namespace) -> int:
    from conveyor.benchmarks.export import export_hf

    print(f"wrote {export_hf(args.model, args.output)}")
    return 0


def _bench_decode(args: argparse.Namespace, config: EngineConfig) -> int:
    from conveyor.benchmarks.decode import print_decode, run_decode
    from conveyor.engine import Engine

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    config.max_num_seqs = max(config.max_num_seqs, *batch_sizes)
    engine = Engine(config)
    print(f"kernels: {_kernels_in_use(engine)}")
    print_decode(run_decode(engine, batch_sizes, args.prompt_len, args.steps, args.seed))
    return 0


def _bench_speculative(args: argparse.Namespace, config: EngineConfig) -> int:
    """Two engines of ``config``, without drafts and with ``--speculative-config`` (default: ngram, auto)."""
    from conveyor.benchmarks.speculative import (
        DEFAULT_SPEC,
        predicted_speedups,
        print_speculative,
        run_speculative_bench,
    )
    from conveyor.engine import Engine

    config.max_num_seqs = max(config.max_num_seqs, args.batch)
    config = dataclasses.replace(config, speculative_config=config.speculative_config or DEFAULT_SPEC)
    plain = Engine(dataclasses.replace(config, speculative_config=None))
    drafted = Engine(config)
    print(f"kernels: {_kernels_in_use(plain)}; speculative_config: {config.speculative_config}")
    results = run_speculative_bench(plain, drafted, args.batch, args.repeats, not args.no_w2)
    if not args.no_simulate:
        print(f"simulated speed-ups: steps priced by the {predicted_speedups(plain, config, results)}")
    print_speculative(results)
    if args.output:
        Path(args.output).write_text(json.dumps({"speculative_config": config.speculative_config, "cases": results},
                                                indent=1))
    if args.profile_out and results["rewrite@1"]["acceptance_profile"] is not None:
        Path(args.profile_out).write_text(json.dumps(results["rewrite@1"]["acceptance_profile"], indent=1))
    return 0


def _bench_perplexity(args: argparse.Namespace, config: EngineConfig) -> int:
    from conveyor.benchmarks.perplexity import perplexity
    from conveyor.engine import Engine

    text = Path(args.text).read_text(encoding="utf-8")
    config.max_model_len = max(config.max_model_len or 0, args.context + 1)  # a chunk, and the one token it draws
    engine = Engine(config)
    print(f"kernels: {_kernels_in_use(engine)}")
    result = perplexity(engine, text, args.context)
    print(f"perplexity {result.value:.4f} over {result.scored_tokens} tokens ({result.chunks} chunks of "
          f"{args.context}; the text is {result.text_tokens} tokens)")
    return 0


def _bench_agreement(args: argparse.Namespace, config: EngineConfig) -> int:
    from dataclasses import asdict

    from conveyor.benchmarks.agreement import bench_agreement

    table, answers = bench_agreement(config, Path(args.text), args.prompts, args.prompt_len, args.tokens,
                                     args.context, not args.no_llamacpp)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(a) for a in answers]) + "\n")
    return 0


def _kernels_in_use(engine) -> str:
    """What runs the model's layers, as ``bench decode`` and ``roofline`` print it."""
    summary = engine.runner.native_kernels_summary
    return f"native, {summary}" if summary else "torch ops"


def _roofline(args: argparse.Namespace, config: EngineConfig) -> int:
    from conveyor.benchmarks.machine import ReadProbe, measure_machine
    from conveyor.benchmarks.roofline import format_kernel_choice, format_roofline, run_roofline
    from conveyor.benchmarks.throughput import write_json
    from conveyor.engine import Engine
    from conveyor.viz.roofline import plot_roofline

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    context_lens = [int(c) for c in args.context_lens.split(",")]
    if args.measured_context_len and args.measured_context_len not in context_lens:
        context_lens.insert(0, args.measured_context_len)
    probe = ReadProbe()
    machine = measure_machine(config.dtype, probe)
    print(f"machine figures saved to {machine.save()}", flush=True)
    config.max_num_seqs = max(config.max_num_seqs, *batch_sizes)
    engine = Engine(config)
    print(f"kernels: {_kernels_in_use(engine)}", flush=True)
    weights = engine.runner.weight_format
    print(f"weights: {weights.name}, {weights.layer_bits:.2f} bits a weight in the layers, "
          f"{weights.lm_head_bits:.2f} in the LM head (the bytes each step's bound counts)", flush=True)
    if engine.runner.kernel_choice is not None:
        print(format_kernel_choice(engine.runner.kernel_choice), flush=True)
    points = run_roofline(engine, machine, batch_sizes, context_lens, args.measured_context_len, args.steps, args.seed,
                          probe)
    print(format_roofline(points, machine))
    plot_roofline(points, machine, args.output)
    print(f"picture: {args.output}")
    choice = engine.runner.kernel_choice and dataclasses.asdict(engine.runner.kernel_choice)
    write_json({"machine": dataclasses.asdict(machine), "points": [dataclasses.asdict(p) for p in points],
                "kernel_choice": choice, "weights": dataclasses.asdict(weights)}, args.json)
    return 0


def run() -> None:
    """The ``conveyor`` command: ``main``, then out of the process at once. Python's own finalization of torch,
    transformers and a served model's heap took 0.8 s of a server's stop, which a supervisor restarting it or a
    script starting many waits out; the operating system frees the heap in no time. Ray's exit hook stops the
    processes it started, so with Ray loaded the process ends the usual way."""
    code = main()
    if "ray" in sys.modules:
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
