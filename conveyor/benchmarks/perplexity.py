"""``conveyor bench perplexity``: a model's perplexity over a text file, as ``llama-perplexity`` computes it.

The protocol is llama.cpp's, so that the two figures on the same GGUF file can be held side by side (a
quantized engine that computed its weights wrongly shows it here first): the text is tokenized once, cut into
chunks of ``context`` tokens (a partial last chunk is dropped), the first token of each chunk is the BOS
token where the tokenizer adds one, and only the second half of each chunk is scored, each token given all
the chunk's tokens before it. The chunks run as one batch of prompts, scored by their prompt logprobs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from conveyor.benchmarks.throughput import run_together
from conveyor.core.sampling import SamplingParams
from conveyor.engine import Engine


@dataclass(frozen=True, slots=True)
class Perplexity:
    value: float
    chunks: int
    scored_tokens: int
    text_tokens: int


def chunks_of(token_ids: list[int], context: int, bos_token_id: int | None) -> list[list[int]]:
    """Whole chunks of ``context`` tokens, each starting with BOS in place of its first token (when given)."""
    if context < 2:
        raise ValueError(f"context must be at least 2 tokens, got {context}")
    chunks = [token_ids[start:start + context] for start in range(0, len(token_ids) - context + 1, context)]
    if bos_token_id is not None:
        chunks = [[bos_token_id, *chunk[1:]] for chunk in chunks]
    return chunks


def text_chunks(engine: Engine, text: str, context: int) -> tuple[list[list[int]], int]:
    """The text cut as llama-perplexity cuts it (chunks_of, BOS first where the tokenizer adds one), and its
    token count."""
    tokenizer = engine.tokenizer
    token_ids = tokenizer.encode(text)
    adds_bos = bool(token_ids) and token_ids[0] == tokenizer.hf_tokenizer.bos_token_id
    chunks = chunks_of(token_ids, context, tokenizer.hf_tokenizer.bos_token_id if adds_bos else None)
    if not chunks:
        raise ValueError(f"the text has {len(token_ids)} tokens, fewer than one chunk of {context}")
    return chunks, len(token_ids)


def perplexity(engine: Engine, text: str, context: int = 512) -> Perplexity:
    """exp of the mean negative log-likelihood of the scored tokens (each chunk's tokens from context / 2 + 1 on)."""
    chunks, text_tokens = text_chunks(engine, text, context)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs, _ = run_together(engine, chunks, [params] * len(chunks))
    first = context // 2
    nll = -sum(entry.logprob for output in outputs for entry in output.prompt_logprobs[first + 1:])
    scored = len(chunks) * (context - 1 - first)
    return Perplexity(math.exp(nll / scored), len(chunks), scored, text_tokens)
