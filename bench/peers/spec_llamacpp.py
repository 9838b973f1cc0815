"""llama.cpp's n-gram speculative decoding beside Conveyor's, on the same workload, model file and threads.

``conveyor bench speculative``'s rewrite prompts (functions of Conveyor's own source to rewrite with one name
changed, docstrings to repeat word for word), one at a time, greedy, up to 320 tokens each, sent as token ids:
llama-server (one slot, the default model's own Q4_1 file) without speculation and with each ``--llama-spec``
(its draft-free n-gram kinds: by default ``--spec-type ngram-simple`` as it comes, and the same matching
Conveyor's lookup, 2-4 tokens, 4 drafts), then Conveyor without and with ``--speculative-config``. Each
engine's speed-up is over its own baseline, the runs taken in turns (``--repeats``), medians reported. Run with
the project's .venv after bench/peers/setup_llamacpp.sh:

    .venv/bin/python bench/peers/spec_llamacpp.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import http_client
import httpx
import run_llamacpp

from conveyor.benchmarks.speculative import DEFAULT_SPEC, REWRITE_MAX_TOKENS, rewrite_prompts
from conveyor.benchmarks.throughput import run_together
from conveyor.core.config import EngineConfig, usable_cores
from conveyor.core.sampling import SamplingParams
from conveyor.engine import Engine

LOG_DIR = run_llamacpp.DIR  # spec-server-N.log: each server's output
DEFAULT_LLAMA_SPECS = ["--spec-type ngram-simple",
                       "--spec-type ngram-simple --spec-ngram-simple-size-n 2 --spec-ngram-simple-size-m 4"]


def llama_server(spec: list[str], threads: int, log: Path) -> tuple[subprocess.Popen, str]:
    """llama-server on the default model's Q4_1 file, one slot, with ``spec`` flags; (process, completion url)."""
    port = http_client.free_port()
    server = run_llamacpp.start_server(run_llamacpp.gguf_file("q4_1"), port, log, threads,
                                       ("-np", "1", "-c", "4096", "--no-ui", *spec))
    return server, f"http://127.0.0.1:{port}/completion"


def llama_run(url: str, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    """Tokens per second over the prompts one at a time (greedy, EOS ends a request), and the outputs."""
    outputs = []
    start = time.perf_counter()
    with httpx.Client(timeout=None) as client:
        for prompt in prompts:
            body = {"prompt": prompt, "n_predict": REWRITE_MAX_TOKENS, "temperature": 0.0, "cache_prompt": False,
                    "return_tokens": True, "stream": False}
            response = client.post(url, json=body)
            response.raise_for_status()
            outputs.append(response.json()["tokens"])
    return sum(map(len, outputs)) / (time.perf_counter() - start), outputs


def conveyor_run(engine: Engine, prompts: list[list[int]]) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=REWRITE_MAX_TOKENS)
    start = time.perf_counter()
    tokens = sum(len(run_together(engine, [p], [params])[0][0].token_ids) for p in prompts)
    return tokens / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--llama-spec", action="append", help="llama-server's speculation flags, one configuration "
                        "per use (default: the two of the module's doc)")
    parser.add_argument("--threads", type=int, default=usable_cores())
    parser.add_argument("-o", "--output", help="write the figures as JSON here")
    args = parser.parse_args()
    plain_engine = Engine(EngineConfig(num_threads=args.threads, enable_prefix_caching=False))
    drafted_engine = Engine(EngineConfig(num_threads=args.threads, enable_prefix_caching=False,
                                         speculative_config=DEFAULT_SPEC))
    prompts = rewrite_prompts(plain_engine)
    specs = args.llama_spec or DEFAULT_LLAMA_SPECS
    servers = {"llama.cpp": llama_server([], args.threads, LOG_DIR / "spec-server-0.log")}
    servers |= {f"llama.cpp {flags}": llama_server(flags.split(), args.threads, LOG_DIR / f"spec-server-{i}.log")
                for i, flags in enumerate(specs, start=1)}
    rates: dict[str, list[float]] = {name: [] for name in (*servers, "Conveyor", "Conveyor spec")}
    try:
        for _, url in servers.values():  # warm each
            llama_run(url, prompts[:1])
        conveyor_run(plain_engine, prompts[:1])
        conveyor_run(drafted_engine, prompts[:1])
        for _ in range(args.repeats):
            for name, (_, url) in servers.items():
                rates[name].append(llama_run(url, prompts)[0])
            rates["Conveyor"].append(conveyor_run(plain_engine, prompts))
            rates["Conveyor spec"].append(conveyor_run(drafted_engine, prompts))
    finally:
        for server, _ in servers.values():
            server.terminate()
            server.wait(timeout=30)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    speedups = {name: medians[name] / medians["llama.cpp"] for name in servers if name != "llama.cpp"}
    speedups["Conveyor spec"] = medians["Conveyor spec"] / medians["Conveyor"]
    figures = {"llama.cpp": run_llamacpp.server_version(), "conveyor_spec": DEFAULT_SPEC, "tokens_per_s": medians,
               "speed-ups": speedups,
               "Conveyor's speed-up / llama.cpp's best": speedups["Conveyor spec"] / max(
                   v for name, v in speedups.items() if name != "Conveyor spec")}
    print(json.dumps(figures, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
