"""transformers' static ``generate`` on the exported float32 HF folder: the request-level batching baseline.

Requests go in batches of 64 in arrival order, left-padded; a batch runs until
its longest request is done and only then does the next one start.
Runs in the project's own .venv (transformers is a dependency of Conveyor).
"""

from __future__ import annotations

import time

import peer_io
import torch
import transformers
from transformers import AutoModelForCausalLM

BATCH_SIZE = 64


def load(model_dir: str) -> AutoModelForCausalLM:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # ignore_eos: every request runs to its length
    return model


def generate_batch(model: AutoModelForCausalLM, requests: list[peer_io.Request]) -> list[list[int]]:
    """Greedy continuations of left-padded prompts, each cut to its own output length."""
    width = max(len(r["prompt_token_ids"]) for r in requests)
    pad = model.config.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(r["prompt_token_ids"])) + r["prompt_token_ids"] for r in requests])
    mask = torch.tensor([[0] * (width - len(r["prompt_token_ids"])) + [1] * len(r["prompt_token_ids"])
                         for r in requests])
    longest = max(r["output_len"] for r in requests)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=longest,
                             do_sample=False, pad_token_id=pad)
    return [out[i, width : width + r["output_len"]].tolist() for i, r in enumerate(requests)]


def run_together(model: AutoModelForCausalLM, requests: list[peer_io.Request]) -> list[peer_io.Record]:
    start = time.perf_counter()
    records = []
    for first in range(0, len(requests), BATCH_SIZE):
        batch = requests[first : first + BATCH_SIZE]
        outputs = generate_batch(model, batch)
        finished = time.perf_counter() - start
        records += [peer_io.record(tokens, None, finished) for tokens in outputs]  # no streaming: no TTFT
    return records


if __name__ == "__main__":
    args = peer_io.argument_parser(__doc__.splitlines()[0], peer_io.PEERS / "model").parse_args()
    torch.set_num_threads(args.threads)
    model = load(args.model)
    peer_io.main("transformers generate (static batches)", transformers.__version__, args,
                 lambda requests: run_together(model, requests))
