"""Log-probabilities of tokens, as plain data: what the executor reports and the server formats.

Computed from the raw model distribution (log-softmax of the logits before penalties, bias,
temperature or constraints), as vLLM does by default, so they say what the model thinks of a
token, not how likely the sampler was to pick it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One position: the token there, its log-probability and rank (1 = the model's top choice), and the
    ``top`` alternatives, best first, as (token id, log-probability) pairs."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()
