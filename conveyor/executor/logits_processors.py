"""What changes a step's logits before a token is drawn: penalties, logit_bias, min_tokens.

Each works on all the rows that need it at once, with tensor ops over flattened (row, token)
index lists: no Python loop over tokens, and a row's result depends on its own request alone,
so a request gets the same logits whatever else shares the batch. The definitions are vLLM's
(and OpenAI's for presence and frequency): repetition divides positive logits and multiplies
negative ones of every token in the prompt or output; frequency subtracts once per occurrence in
the output, presence once per token present in it.
"""

from __future__ import annotations

import itertools

import torch

from conveyor.core.scheduler.output import ScheduledRequest


def apply_processors(logits: torch.Tensor, batch: list[ScheduledRequest]) -> None:
    """Change ``logits`` ([len(batch), vocab]) in place for the rows whose requests ask for it, in vLLM's
    order: min_tokens, logit_bias, then penalties."""
    _mask_stops_before_min_tokens(logits, batch)
    _add_logit_bias(logits, batch)
    rows = [i for i, item in enumerate(batch) if item.sampling_params.has_penalties]
    if rows:
        _apply_penalties(logits, rows, [batch[i] for i in rows])


def _mask_stops_before_min_tokens(logits: torch.Tensor, batch: list[ScheduledRequest]) -> None:
    rows: list[int] = []
    tokens: list[int] = []
    for i, item in enumerate(batch):
        params = item.sampling_params
        if item.num_output_tokens < params.min_tokens:
            stops = [*params.stop_token_ids, *([item.eos_token_id] if item.eos_token_id is not None else [])]
            rows.extend([i] * len(stops))
            tokens.extend(stops)
    if rows:
        index = _in_vocab(rows, tokens, logits.shape[1])
        logits.index_put_(index, torch.tensor(float("-inf"), dtype=logits.dtype))


def _add_logit_bias(logits: torch.Tensor, batch: list[ScheduledRequest]) -> None:
    rows: list[int] = []
    tokens: list[int] = []
    biases: list[float] = []
    for i, item in enumerate(batch):
        pairs = item.sampling_params.logit_bias
        if pairs:
            rows.extend([i] * len(pairs))
            tokens.extend(token for token, _ in pairs)
            biases.extend(bias for _, bias in pairs)
    if rows:
        vocab = logits.shape[1]
        keep = [token < vocab for token in tokens]
        values = torch.tensor([b for b, k in zip(biases, keep) if k], dtype=logits.dtype, device=logits.device)
        logits.index_put_(_in_vocab(rows, tokens, vocab), values, accumulate=True)


def _in_vocab(rows: list[int], tokens: list[int], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [(r, t) for r, t in zip(rows, tokens) if 0 <= t < vocab]
    return torch.tensor([r for r, _ in pairs], dtype=torch.long), torch.tensor([t for _, t in pairs], dtype=torch.long)


def token_counts(token_lists: list[list[int]], vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """[len(token_lists), vocab]: how many times each token occurs in each list, built in one scatter."""
    counts = torch.zeros((len(token_lists), vocab), dtype=dtype)
    lengths = torch.tensor([len(tokens) for tokens in token_lists], dtype=torch.long)
    flat = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)
    if flat.numel():
        row_of = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
        counts.index_put_((row_of, flat), torch.ones_like(flat, dtype=dtype), accumulate=True)
    return counts


def _apply_penalties(logits: torch.Tensor, rows: list[int], items: list[ScheduledRequest]) -> None:
    vocab, dtype = logits.shape[1], logits.dtype
    index = torch.tensor(rows, dtype=torch.long)
    sub = logits[index].cpu()
    output_counts = token_counts([item.output_token_ids for item in items], vocab, dtype)
    in_output = output_counts > 0

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(item.sampling_params, name) for item in items], dtype=dtype)[:, None]

    repetition = column("repetition_penalty")
    if bool((repetition != 1.0).any()):
        in_prompt = token_counts([item.prompt_token_ids for item in items], vocab, dtype) > 0
        seen = in_prompt | in_output
        penalized = torch.where(sub > 0, sub / repetition, sub * repetition)
        sub = torch.where(seen, penalized, sub)
    sub = sub - column("frequency_penalty") * output_counts - column("presence_penalty") * in_output.to(dtype)
    logits[index] = sub.to(logits.device)
