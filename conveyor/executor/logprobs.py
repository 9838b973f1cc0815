"""Log-probabilities of chosen tokens and their top alternatives, from the raw logits of the rows that ask.

Only those rows pay for a full-vocabulary log-softmax; a request that did not ask costs nothing.
"""

from __future__ import annotations

import torch

from conveyor.core.logprobs import TokenLogprob


def token_logprobs(raw_logits: torch.Tensor, chosen: list[int], num_top: list[int]) -> list[TokenLogprob]:
    """One TokenLogprob per row of ``raw_logits`` [rows, vocab]: ``chosen[i]``'s log-probability and rank, and
    the ``num_top[i]`` most likely tokens, best first."""
    if not chosen:
        return []
    logprobs = raw_logits.float().log_softmax(dim=-1)
    chosen_ids = torch.tensor(chosen, dtype=torch.long, device=logprobs.device)[:, None]
    chosen_logprobs = logprobs.gather(1, chosen_ids)
    ranks = ((logprobs > chosen_logprobs).sum(dim=1) + 1).tolist()
    most = max(num_top)
    top_values, top_ids = logprobs.topk(most, dim=1) if most else (logprobs[:, :0], chosen_ids[:, :0])
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprob(token, value, rank, tuple(zip(ids[:k], values[:k])))
        for token, value, rank, ids, values, k in zip(
            chosen, chosen_logprobs[:, 0].tolist(), ranks, top_ids, top_values, num_top
        )
    ]
