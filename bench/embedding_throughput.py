"""Embedding throughput: Conveyor's server against llama.cpp's ``llama-server --embeddings`` on the same GGUF file.

Both servers run the same file on the same threads, one after the other, and get the same inputs (token ids,
so no tokenizer differs) from the same HTTP client at ``/v1/embeddings``, in two shapes: one input per request
with many requests in flight (a service embedding queries), and many inputs per request, one request at a time
(a RAG stack indexing documents). Both pool the last position's final hidden state, scaled to unit length.
Prints inputs/s and prompt tokens/s of each, their ratio, and how closely their vectors agree (the cosine of
each input's two vectors). llama.cpp must be set up first (bench/peers/setup_llamacpp.sh).

    .venv/bin/python bench/embedding_throughput.py [--model FILE.gguf] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent / "peers"))

import http_client  # bench/peers: the peers' runners
import run_llamacpp

from conveyor.benchmarks.compare import machine_info
from conveyor.benchmarks.local_server import local_server, save_results
from conveyor.model.weights.paths import default_model_path

# (name, inputs per request, requests in flight): queries one by one, many at once; documents in batches.
SHAPES = (("queries", 1, 16), ("documents", 32, 1))
# The fastest of the flags tried on the default model's file (2-core Zen 4, 64 inputs of 128 tokens a shape):
# 4 slots of 512 tokens, 2.4 inputs/s both shapes; 16 slots of 1,024 with 2,048-token batches, 1.1; 16 slots of 256,
# 0.7-0.8; the same, not unified, with 2,048-token batches, 1.0-1.8. llama.cpp marks every token of an input an
# output when it pools a generative model's states, and runs the LM head on each (its log: "embeddings required
# but some input tokens were not marked as outputs -> overriding").
LLAMACPP_ARGS = ("--embeddings", "--pooling", "last", "-np", "4", "-c", "2048", "--no-ui")


def inputs(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(length)] for _ in range(count)]


async def embed_all(base: str, given: list[list[int]], per_request: int, in_flight: int) -> list[list[float]]:
    """Every input's vector, sent ``per_request`` inputs to a request with ``in_flight`` requests at a time."""
    batches = [given[i:i + per_request] for i in range(0, len(given), per_request)]
    gate = asyncio.Semaphore(in_flight)
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(batch: list[list[int]]) -> list[list[float]]:
            async with gate:
                answer = await client.post(f"{base}/v1/embeddings", json={"input": batch})
                answer.raise_for_status()
                return [item["embedding"] for item in sorted(answer.json()["data"], key=lambda d: d["index"])]
        results = await asyncio.gather(*(one(batch) for batch in batches))
    return [vector for result in results for vector in result]


def timed(base: str, given: dict[str, list[list[int]]]) -> dict[str, tuple[float, list[list[float]]]]:
    """Each shape's seconds and vectors (each shape its own inputs, so none finds another's in a prompt cache),
    after a warm-up of a few inputs of none of them."""
    asyncio.run(embed_all(base, given["warm-up"], 1, 4))
    runs = {}
    for name, per_request, in_flight in SHAPES:
        start = time.perf_counter()
        vectors = asyncio.run(embed_all(base, given[name], per_request, in_flight))
        runs[name] = (time.perf_counter() - start, vectors)
    return runs


@contextlib.contextmanager
def llamacpp_server(model: str, threads: int, flags: tuple[str, ...]) -> Iterator[str]:
    port = http_client.free_port()
    process: subprocess.Popen = run_llamacpp.start_server(model, port, run_llamacpp.DIR / "embeddings.log",
                                                          threads, flags)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        http_client.stop_server(process)


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model's Q4_1 file)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--inputs", type=int, default=256, help="inputs per shape")
    parser.add_argument("--length", type=int, default=128, help="tokens per input")
    parser.add_argument("--json", default=None, help="write the results to this file as JSON")
    parser.add_argument("--llamacpp-args", default=" ".join(LLAMACPP_ARGS),
                        help=f"llama-server's flags beside -m and -t (default: {' '.join(LLAMACPP_ARGS)})")
    args = parser.parse_args()
    model = str(Path(args.model).resolve()) if args.model else str(default_model_path())
    given = {name: inputs(count, args.length, seed) for seed, (name, count) in
             enumerate([("warm-up", 4), *((shape[0], args.inputs) for shape in SHAPES)])}
    conveyor_flags = ["--model", model, "--num-threads", str(args.threads), "--pooling", "last"]
    with local_server(conveyor_flags) as base:
        ours = timed(base, given)
    with llamacpp_server(model, args.threads, tuple(args.llamacpp_args.split())) as base:
        theirs = timed(base, given)
    results = {"machine": machine_info(args.threads), "model": model, "llama.cpp": run_llamacpp.server_version(),
               "llama.cpp flags": args.llamacpp_args, "inputs": args.inputs, "tokens_per_input": args.length,
               "shapes": {}}
    print(f"{Path(model).name}, {args.inputs} inputs of {args.length} tokens, {args.threads} threads")
    print("| shape | Conveyor inputs/s | llama.cpp inputs/s | ratio | cosine (min / mean) |")
    print("|---|---|---|---|---|")
    for name, per_request, in_flight in SHAPES:
        (ours_s, ours_v), (theirs_s, theirs_v) = ours[name], theirs[name]
        cosines = [cosine(a, b) for a, b in zip(ours_v, theirs_v)]
        rates = args.inputs / ours_s, args.inputs / theirs_s
        print(f"| {name} ({per_request} per request, {in_flight} in flight) | {rates[0]:.1f} | {rates[1]:.1f} | "
              f"{rates[0] / rates[1]:.2f}x | {min(cosines):.4f} / {sum(cosines) / len(cosines):.4f} |")
        results["shapes"][name] = {"per_request": per_request, "in_flight": in_flight, "conveyor_inputs_per_s":
                                   rates[0], "llamacpp_inputs_per_s": rates[1], "cosine_min": min(cosines),
                                   "cosine_mean": sum(cosines) / len(cosines)}
    save_results(args.json, results)


if __name__ == "__main__":
    main()
