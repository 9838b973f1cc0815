"""What the server costs one request: its decode speed through HTTP against the same engine stepped in process.

The same model and threads both ways, in alternating rounds (the machines of this
kind change speed by a third within minutes, so only ratios of neighbours mean
anything): a round times the engine in this process decoding one request for
``--tokens`` steps from a ``--prompt-len`` prompt (``conveyor bench decode``'s
measure), then one request of the same lengths through ``conveyor serve``'s
``/v1/completions``, its decode time from the server's own ``timings``
(``predicted_ms``: first token to last, so the prompt's time is left out on
both sides). Each round also times the whole request both ways (its prompt, its decode and, through the
server, HTTP: output tokens over the client's latency against ``run_all_at_once``'s). Prints each round and the
median ratios.

    .venv/bin/python bench/server_overhead.py --rounds 9
    .venv/bin/python bench/server_overhead.py --model FILE.gguf -- --num-threads 2
    .venv/bin/python bench/server_overhead.py --model FILE.gguf --tokens 64 --at-once 16
"""

from __future__ import annotations

import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from conveyor.benchmarks.decode import decode_slices
from conveyor.benchmarks.local_server import local_server, save_results, server_script_parser
from conveyor.benchmarks.throughput import run_all_at_once
from conveyor.benchmarks.workload import SyntheticRequest
from conveyor.core.config import EngineConfig
from conveyor.engine import Engine


def in_process(engine: Engine, prompt_len: int, tokens: int) -> float:
    """Decode tokens/s of one request in this process, over ``tokens`` steps."""
    runs = decode_slices(engine, 1, prompt_len, tokens, seed=0, slices=1)
    produced, seconds = next(runs)
    runs.close()
    return produced / seconds


def whole_in_process(engine: Engine, prompt: list[int], tokens: int) -> float:
    """Output tokens/s of one whole request in this process: its prompt and ``tokens`` outputs."""
    start = time.perf_counter()
    run_all_at_once(engine, [SyntheticRequest(prompt, tokens)])
    return tokens / (time.perf_counter() - start)


def through_server(client: httpx.Client, base: str, prompt: list[int], tokens: int) -> tuple[float, float]:
    """One request of ``tokens + 1`` outputs through the server: its decode tokens/s (the outputs after the
    first over the server's own time from the first to the last), and its output tokens/s over the client's
    latency (prompt, decode and HTTP)."""
    body = {"prompt": prompt, "max_tokens": tokens + 1, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    answer = client.post(f"{base}/v1/completions", json=body).raise_for_status().json()
    latency = time.perf_counter() - start
    return tokens / (answer["timings"]["predicted_ms"] / 1000), (tokens + 1) / latency


def at_once_both_ways(engine: Engine, client: httpx.Client, base: str, prompt: list[int], tokens: int,
                      count: int) -> tuple[float, float]:
    """Output tokens/s of ``count`` copies of one request sent together, whole (prompts, decodes and, through
    the server, HTTP), in this process and then through the server (each copy a client thread of its own)."""
    start = time.perf_counter()
    run_all_at_once(engine, [SyntheticRequest(prompt, tokens)] * count)
    ours = count * tokens / (time.perf_counter() - start)
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    with ThreadPoolExecutor(count) as pool:
        list(pool.map(lambda _: client.post(f"{base}/v1/completions", json=body).raise_for_status(), range(count)))
    return ours, count * tokens / (time.perf_counter() - start)


def main() -> int:
    parser = server_script_parser(__doc__)
    parser.add_argument("--model", default=None, help="a GGUF file or HF folder (default: the default model)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--prompt-len", type=int, default=41)
    parser.add_argument("--tokens", type=int, default=128, help="decode steps timed per round and side")
    parser.add_argument("--at-once", type=int, default=0,
                        help="also time this many copies of the request sent together, whole, both ways")
    args = parser.parse_args()
    flags = [*(["--model", args.model] if args.model else []), *args.engine_flags]
    engine = Engine(EngineConfig(model=args.model))
    prompt = list(range(1000, 1000 + args.prompt_len))
    rows = []
    with local_server(flags) as base, httpx.Client(timeout=None) as client:
        through_server(client, base, prompt, 4)  # first-call costs on both sides are not what is compared
        in_process(engine, args.prompt_len, 4)
        for round_ in range(args.rounds):
            ours = in_process(engine, args.prompt_len, args.tokens)
            whole = whole_in_process(engine, prompt, args.tokens + 1)
            served, served_whole = through_server(client, base, prompt, args.tokens)
            rows.append({"in_process_tok_s": ours, "server_tok_s": served, "ratio": served / ours,
                         "whole_in_process_tok_s": whole, "whole_server_tok_s": served_whole,
                         "whole_ratio": served_whole / whole})
            line = (f"round {round_ + 1}: decode in process {ours:.1f} tok/s, server {served:.1f} "
                    f"({served / ours:.3f}); whole request {whole:.1f}, server {served_whole:.1f} "
                    f"({served_whole / whole:.3f})")
            if args.at_once:
                together, served_together = at_once_both_ways(engine, client, base, prompt, args.tokens,
                                                              args.at_once)
                rows[-1].update(at_once_in_process_tok_s=together, at_once_server_tok_s=served_together,
                                at_once_ratio=served_together / together)
                line += f"; {args.at_once} at once {together:.1f}, server {served_together:.1f} " \
                        f"({served_together / together:.3f})"
            print(line, flush=True)
    median = statistics.median(r["ratio"] for r in rows)
    whole_median = statistics.median(r["whole_ratio"] for r in rows)
    summary = f"median server / in process: decode {median:.3f}, whole request {whole_median:.3f}"
    results = {"rounds": rows, "median_ratio": median, "whole_median_ratio": whole_median, "flags": flags}
    if args.at_once:
        results["at_once_median_ratio"] = statistics.median(r["at_once_ratio"] for r in rows)
        summary += f", {args.at_once} at once {results['at_once_median_ratio']:.3f}"
    print(summary)
    save_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
