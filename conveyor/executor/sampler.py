"""Turning a step's logits into tokens: constraints, penalties, bias, then greedy, temperature, min-p, top-k,
top-p (vLLM's order).

Random draws invert the distribution's cumulative sum at one uniform
number, which samples from p exactly. A seeded request draws from a generator
seeded by (seed, index of the token), so its tokens do not depend on what
else shares the batch, nor on preemption and recompute. A batch of plain
greedy requests (no penalties, bias, constraints or logprobs) is one argmax.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from conveyor.core.logprobs import TokenLogprob
from conveyor.core.sampling import SamplingParams
from conveyor.core.scheduler.output import ScheduledRequest
from conveyor.executor.logits_processors import apply_processors
from conveyor.executor.logprobs import token_logprobs

TOP_P_CANDIDATES = 256  # tokens ranked before top-p sorts a whole vocabulary (see _top_p_drops)

# Masks the rows of constrained requests to the tokens their grammar allows (see executor/grammar.py).
Constrain = Callable[[torch.Tensor, list[ScheduledRequest]], None]


def _truncate(logits: torch.Tensor, min_p: float, top_k: int, top_p: float) -> torch.Tensor:
    """One row's logits (after temperature) with the tokens that min-p, top-k and top-p drop set to -inf."""
    if min_p > 0.0:
        # p < min_p * p_max  <=>  logit < max logit + log(min_p): no softmax needed.
        logits = logits.masked_fill(logits < logits.max() + math.log(min_p), float("-inf"))
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        logits = logits.masked_fill(_top_p_drops(logits, top_p), float("-inf"))
    return logits


def _top_p_drops(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which tokens top-p drops: those whose higher-ranked tokens already reach ``top_p``. Ranked among the
    ``TOP_P_CANDIDATES`` likeliest first (torch.topk: 0.1 ms over 49k tokens, where sorting them all took 3.5 ms a
    token; torch 2.13, one Zen 4 core); the whole vocabulary is sorted only when those do not reach ``top_p``."""
    probs = logits.softmax(-1)
    ranked, order = torch.topk(probs, min(TOP_P_CANDIDATES, probs.shape[-1]))
    before = ranked.cumsum(-1) - ranked  # what the tokens ranked above each one hold
    if float(before[-1] + ranked[-1]) < top_p and ranked.shape[-1] < probs.shape[-1]:
        return _top_p_drops_by_value(probs, top_p)
    drops = torch.ones_like(probs, dtype=torch.bool)  # outside the candidates: the candidates reach top_p
    kept = before < top_p
    kept[0] = True
    drops[order] = ~kept
    return drops


def _top_p_drops_by_value(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``_top_p_drops`` for a flat distribution, whose kept set is most of the vocabulary: the probabilities sorted
    as values alone (NumPy, 1.0 ms over 49k tokens where torch's sort with its indices took 3.5), the count kept
    read from their sums, and the tokens kept those above the last one kept's probability, with as many of the
    tokens equal to it as the count leaves, the lowest ids first."""
    ranked = torch.from_numpy(np.sort(probs.numpy())[::-1].copy())
    before = ranked.cumsum(-1) - ranked
    kept = max(1, int((before < top_p).sum()))  # ``before`` only grows: the kept tokens are a prefix
    last = ranked[kept - 1]
    drops = probs < last
    ties = (probs == last).nonzero().flatten()
    drops[ties[kept - int((probs > last).sum()):]] = True
    return drops


def _probabilities(row_logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled row draws from: its logits after temperature, min-p, top-k and top-p."""
    return _truncate(row_logits / params.temperature, params.min_p, params.top_k, params.top_p).softmax(-1)


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """A token drawn from ``probs`` (weights of any positive total) by inverting their cumulative sum, in float64,
    at one uniform number: 65 us over 49k tokens, where the exponential race (the argmax of p / E, an Exp(1)
    draw per token) took 990 (torch 2.13, one Zen 4 core). A zero weight is never drawn: its cumulative sum
    equals the one before it, and the search takes the first sum above the number."""
    cumulative = probs.to(torch.float64).cumsum(-1)
    target = torch.rand((), dtype=torch.float64, generator=generator) * cumulative[-1]
    index = int(torch.searchsorted(cumulative, target, right=True))
    if index == probs.shape[-1]:  # the product rounded up to the total: the last token of any weight
        index = int(probs.nonzero()[-1])
    return index


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The index of each row's largest logit (the first of equals; a NaN counts as largest, as in torch). On
    CPU through NumPy: torch's CPU argmax over a 49k-token vocabulary took 43 us a row where NumPy's took 4
    (1.3 ms vs 0.2 ms for 64 rows; torch 2.13, Zen 4)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.detach().numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._unseeded = torch.Generator().manual_seed(seed)
        self._seeded = torch.Generator()

    def sample_batch(
        self, logits: torch.Tensor, batch: list[ScheduledRequest], constrain: Constrain | None = None,
        argmax: list[int] | None = None,
    ) -> tuple[list[int], dict[int, TokenLogprob]]:
        """The token of each row of ``logits`` [len(batch), vocab], and the logprobs of the rows that asked
        (row -> TokenLogprob), taken from the logits before anything changed them. ``argmax``: each row's
        argmax of these logits, where the caller has it already (the native stack's)."""
        params = [item.sampling_params for item in batch]
        logprob_rows = [row for row, p in enumerate(params) if p.logprobs is not None]
        raw = logits[torch.tensor(logprob_rows, dtype=torch.long, device=logits.device)] if logprob_rows else None
        if any(p.processes_logits for p in params):
            if constrain is not None and any(p.structured_output is not None for p in params):
                constrain(logits, batch)
            apply_processors(logits, batch)
            argmax = None  # of the logits as they were
        tokens = self.sample(logits, params, [item.num_output_tokens for item in batch], argmax)
        if raw is None:
            return tokens, {}
        num_top = [params[row].logprobs or 0 for row in logprob_rows]
        found = token_logprobs(raw, [tokens[row] for row in logprob_rows], num_top)
        return tokens, dict(zip(logprob_rows, found))

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], token_indices: list[int],
        argmax: list[int] | None = None,
    ) -> list[int]:
        """``logits`` [n, vocab] float32; ``token_indices[i]`` = how many tokens row i's request already output;
        ``argmax``, where given, each row's argmax of ``logits``."""
        greedy = list(argmax) if argmax is not None else argmax_rows(logits)
        if all(p.greedy for p in params):
            return greedy
        cpu_logits = logits.cpu()
        for row, p in enumerate(params):
            if p.greedy:
                continue
            greedy[row] = _draw(_probabilities(cpu_logits[row], p), self._generator(p, token_indices[row]))
        return greedy

    def _generator(self, params: SamplingParams, token_index: int) -> torch.Generator:
        """Where a sampled token's random numbers come from: the sampler's own stream, or for a seeded request
        a generator seeded by (seed, index of the token), so its draws depend on nothing else."""
        if params.seed is None:
            return self._unseeded
        return self._seeded.manual_seed(hash((params.seed, token_index)) & 0x7FFF_FFFF_FFFF_FFFF)

    def verify(self, logits: torch.Tensor, item: ScheduledRequest, argmax: list[int] | None = None) -> tuple[int, int]:
        """Speculative decoding's check of one request's drafts: ``logits`` [1 + drafts, vocab] are its rows,
        the first after its last token, each next one after a draft. Returns how many drafts are accepted and
        the token drawn after them.

        Greedy: a draft is accepted while it is the argmax of the row before it, and the token is the argmax
        of the first row whose draft was not: the tokens are exactly those of decoding one at a time.
        Sampled: the rule of speculative sampling (Leviathan et al., Chen et al.) for a draft proposed with
        certainty: accept draft ``x`` with probability ``p(x)``; on a rejection draw from ``p`` without ``x``
        (renormalized), and after every draft was accepted, from the last row's ``p``. Each token drawn follows
        ``p`` exactly, so the output's distribution is that of decoding without drafts. A seeded request
        draws row ``i``'s numbers from a generator seeded by (seed, index of that token), as ``sample`` does.
        """
        drafts = item.token_ids[len(item.token_ids) - item.num_draft_tokens:]
        params = item.sampling_params
        if params.greedy:
            best = list(argmax) if argmax is not None else argmax_rows(logits)
            accepted = 0
            while accepted < len(drafts) and best[accepted] == drafts[accepted]:
                accepted += 1
            return accepted, best[accepted]
        cpu_logits = logits.cpu()
        for row in range(len(drafts) + 1):
            probs = _probabilities(cpu_logits[row], params)
            generator = self._generator(params, item.num_output_tokens + row)
            if row < len(drafts):
                draft = drafts[row]
                if float(torch.rand((), generator=generator)) < float(probs[draft]):
                    continue
                probs[draft] = 0.0  # the rest of p: a zero weight is never drawn below
            return row, _draw(probs, generator)
        raise AssertionError("unreachable: the last row always draws")
