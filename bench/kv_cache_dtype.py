"""``--kv-cache-dtype`` against float32: what the pool holds, what it costs in agreement, speed.

Three measurements on one model (the default: the Q4_1 file, on the native kernels), each for ``float32``,
``bfloat16``, ``float16`` and ``fp8`` in turn:

- **capacity**: KV blocks in a pool of ``--kv-cache-memory``, and the most requests running at once when
  ``--hold-requests`` prompts of ``--hold-prompt-len`` tokens arrive together and each decodes 16 tokens;
- **greedy agreement**: the W1 chat prompts (64, 128 greedy tokens each, all at once), each request's
  tokens compared with the ``float32`` run's: how many are identical, and the tokens in common before the
  first that differs (an fp8 cache rounds K and V to 2 mantissa bits, so two near-equal logits may swap);
- **decode speed** at one request and a long context (``--long-context`` tokens): attention reads half
  (bfloat16, float16) or a quarter (fp8) of float32's bytes.

    python bench/kv_cache_dtype.py [--model M] [--kv-cache-memory 256MiB] [--long-context 4000]
"""

from __future__ import annotations

import argparse
import random
import time

from conveyor.benchmarks.decode import measure_decode
from conveyor.benchmarks.workload import W1_OUTPUT_LEN, w1_requests
from conveyor.core.config import EngineConfig
from conveyor.core.sampling import SamplingParams
from conveyor.engine import Engine

DTYPES = ("float32", "bfloat16", "float16", "fp8")


def greedy_outputs(engine: Engine) -> list[list[int]]:
    """The W1 prompts all at once, greedy, each to its full length."""
    params = SamplingParams(temperature=0.0, max_tokens=W1_OUTPUT_LEN, ignore_eos=True)
    requests = w1_requests(engine.tokenizer)
    ids = [f"w1-{i}" for i in range(len(requests))]
    for request_id, request in zip(ids, requests, strict=True):
        engine.add_request(request.prompt_token_ids, params, request_id)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] = list(output.token_ids)
    return [tokens[request_id] for request_id in ids]


def peak_running(engine: Engine, count: int, prompt_len: int) -> int:
    """The most requests running at once when ``count`` prompts of ``prompt_len`` random tokens arrive together."""
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for i in range(count):
        engine.add_request([rng.randrange(vocab // 8, vocab) for _ in range(prompt_len)], params, f"hold-{i}")
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.stats().num_running)
    return peak


def agreement(ours: list[list[int]], reference: list[list[int]]) -> tuple[int, float]:
    """(outputs identical to the reference's, mean share of tokens before the first that differs)."""
    same = sum(a == b for a, b in zip(ours, reference, strict=True))
    shares = []
    for a, b in zip(ours, reference, strict=True):
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        shares.append(common / len(b))
    return same, sum(shares) / len(shares)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF folder or GGUF file (default: the default model)")
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--hold-requests", type=int, default=64)
    parser.add_argument("--hold-prompt-len", type=int, default=1000)
    parser.add_argument("--long-context", type=int, default=4000)
    parser.add_argument("--decode-steps", type=int, default=64)
    args = parser.parse_args()

    results: dict[str, dict] = {}
    reference: list[list[int]] | None = None
    for name in DTYPES:
        config = EngineConfig(model=args.model, kv_cache_dtype=name, kv_cache_memory=args.kv_cache_memory,
                              max_model_len=args.long_context + args.decode_steps + 8)
        engine = Engine(config)
        start = time.perf_counter()
        outputs = greedy_outputs(engine)
        w1_s = time.perf_counter() - start
        reference = reference or outputs
        same, share = agreement(outputs, reference)
        results[name] = {
            "blocks": engine.executor.kv_cache.shape[2],
            "peak_running": peak_running(engine, args.hold_requests, args.hold_prompt_len),
            "identical": same, "common_share": share, "w1_tok_s": sum(map(len, outputs)) / w1_s,
            "long_decode_tok_s": measure_decode(engine, 1, args.long_context, args.decode_steps, 0),
        }
        print(name, results[name], flush=True)

    print()
    print(f"| --kv-cache-dtype | KV blocks in {args.kv_cache_memory} | peak running ({args.hold_requests} x "
          f"{args.hold_prompt_len}-token prompts) | W1 outputs identical to float32's | tokens before the first "
          f"difference | W1@64 tok/s | decode tok/s at {args.long_context} tokens |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['blocks']} | {r['peak_running']} | {r['identical']}/64 | {r['common_share']:.0%} | "
              f"{r['w1_tok_s']:.1f} | {r['long_decode_tok_s']:.1f} |")


if __name__ == "__main__":
    main()
