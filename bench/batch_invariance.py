"""Whether a request's greedy tokens depend on who else is served: each prompt alone, then all in one batch.

64 chat prompts (none of them in the tests), 48 greedy tokens each (ignore_eos), on one engine:

- **alone**: one request at a time, to its end;
- **batch**: all 64 at once, with chunked prefill (``--max-num-batched-tokens``, small, so that prompts are cut
  into chunks beside other requests' decodes);
- the same two with prefix caching on and a shared system prompt, where every request after the first finds the
  system prompt's blocks in the cache;
- the same two with a long document before each question (about 600 tokens, prefix caching off), so that every
  prompt is attended over hundreds of positions in chunks that fall elsewhere alone than in the batch.

Prints, per case, how many requests got the same tokens as alone (bit-identical logits would give 64/64), and
for the others where they first part. A benchmark of correctness, not speed: machine noise does not move it,
but the CPU's kernel kinds do (name the CPU with the figures).

    python bench/batch_invariance.py [--model M] [--kernels auto|native|torch] [--max-num-batched-tokens 64]
"""

from __future__ import annotations

import argparse

from conveyor.core.config import EngineConfig
from conveyor.core.sampling import SamplingParams
from conveyor.engine import Engine

TOPICS = ("volcanoes", "the Roman roads", "tides", "bread yeast", "glaciers", "bees", "the printing press",
          "coral reefs", "lighthouses", "copper", "owls", "the monsoon", "paper money", "comets", "olive trees",
          "the telegraph")
FORMS = ("Explain {} to a ten-year-old.", "Give three surprising facts about {}.",
         "Write a short poem about {}.", "What would a historian say about {}?")
SYSTEM = ("You are a patient teacher who answers in plain words, gives one example for every claim, and never uses "
          "more than five sentences.")
OUTPUT_LEN = 48


def prompts(engine: Engine, system: bool, document: bool = False) -> list[list[int]]:
    """The 64 prompts as token ids in the model's chat template (with the shared system prompt, or after a long
    document made of every question, if asked)."""
    head = [{"role": "system", "content": SYSTEM}] if system else []
    texts = [form.format(topic) for topic in TOPICS for form in FORMS]
    before = "Questions asked so far: " + " ".join(texts) + "\n\nNow answer this one. " if document else ""
    return [engine.tokenizer.apply_chat_template([*head, {"role": "user", "content": before + text}])
            for text in texts]


def run(engine: Engine, batch: list[list[int]], tag: str) -> list[list[int]]:
    """Greedy tokens of every prompt in ``batch``, all added at once."""
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(batch))]
    for request_id, prompt in zip(ids, batch, strict=True):
        engine.add_request(prompt, params, request_id)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = list(output.token_ids)
    return [tokens[i] for i in ids]


def compare(alone: list[list[int]], together: list[list[int]]) -> str:
    same = sum(a == b for a, b in zip(alone, together, strict=True))
    parts = sorted(next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
                   for a, b in zip(alone, together, strict=True) if a != b)
    where = f"; the others part at tokens {parts}" if parts else ""
    return f"{same}/{len(alone)} identical{where}"


def case(options: dict, shared: bool, document: bool = False) -> tuple[str, str]:
    """How the engine runs, and how many of the 64 requests got the same tokens alone as together."""
    engine = Engine(EngineConfig(**options, enable_prefix_caching=shared))
    batch = prompts(engine, system=shared, document=document)
    alone = [run(engine, [prompt], f"alone{i}")[0] for i, prompt in enumerate(batch)]
    together = run(engine, batch, "batch")
    return engine.runner.summary, compare(alone, together)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--kernels", default="auto", choices=("auto", "native", "torch"))
    parser.add_argument("--max-num-batched-tokens", type=int, default=64)
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()
    options = dict(model=args.model, kernels=args.kernels, max_num_batched_tokens=args.max_num_batched_tokens,
                   max_num_seqs=64, num_threads=args.num_threads)
    summary, plain = case(options, shared=False)
    print(f"{summary}; 64 prompts, {OUTPUT_LEN} greedy tokens each, chunks of {args.max_num_batched_tokens} tokens")
    print(f"alone vs one batch of 64:                       {plain}", flush=True)
    print(f"the same with a shared system prompt, caching on: {case(options, shared=True)[1]}", flush=True)
    print(f"the same after a long document, caching off:      {case(options, False, document=True)[1]}", flush=True)


if __name__ == "__main__":
    main()
