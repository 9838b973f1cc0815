"""Which running requests carry drafts in a step, and how many: the scheduler's side of speculative decoding.

A request that is decoding (its KV holds every token but the last) and samples plainly (no logprobs, no
logits processors, penalties or grammar, which would each need every draft position's own treatment) asks
the proposer for drafts. At most ``num_speculative_tokens``, and never past ``max_tokens`` or the model's
length: a draft accepted there could not be kept.

How many of them the step carries (``draft_length`` auto): a draft of a request is worth the chance that it
and every draft before it are accepted, ``a ** j`` for the j-th with ``a`` that request's acceptance rate so
far (leaning on the rate of all requests while it has few drafts of its own behind it); a step is worth the
tokens it is expected to yield over the seconds it is expected to take (``StepCost``, measured). The step
takes the most valuable drafts first, as many as make tokens per second largest: at one request a step reads
the weights whatever its rows, so drafts come nearly free and many are carried; at 64 requests each row is
compute, and drafts are carried only where acceptance is high enough to pay for their rows, down to none.
With ``fixed``, every proposed draft is carried (vLLM's behaviour).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.core.request import Request
from conveyor.core.spec.config import SpeculativeConfig
from conveyor.core.spec.proposers import Proposer, make_proposer
from conveyor.core.spec.step_cost import StepCost
from conveyor.core.stats import EngineStats

PRIOR_DRAFTS = 4.0  # a request's own acceptance counts as much as the global rate after this many drafts
GLOBAL_WEIGHT = 0.02  # a draft's weight in the global acceptance rate's running mean
FIRST_GUESS = 0.5  # the global acceptance rate before any draft was verified


@dataclass(slots=True)
class SpecDecodeStats:
    """vLLM's spec-decode counters: steps-requests that carried drafts, drafts, accepted drafts, and accepted
    drafts by their position in the draft (0: the first); and what the simulator's acceptance profile is made
    of (conveyor.sim.speculative): drafts carried by position, and how many drafts the proposer offered a
    decoding request in each step (index: that many, 0 to num_speculative_tokens)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    carried_per_position: list[int] = field(default_factory=list)
    proposal_lengths: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a drafted request gained per step (accepted drafts and the token drawn after them)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def engine_stats_fields(self) -> dict[str, int | tuple[int, ...]]:
        """These counters as EngineStats' fields (its ``spec_decode_*``)."""
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_accepted_per_position": tuple(self.accepted_per_position),
                "spec_decode_carried_per_position": tuple(self.carried_per_position),
                "spec_decode_proposal_lengths": tuple(self.proposal_lengths)}

    @classmethod
    def from_engine_stats(cls, stats: EngineStats) -> SpecDecodeStats:
        """The counters as an EngineStats snapshot holds them."""
        return cls(stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens,
                   stats.spec_decode_num_accepted_tokens, list(stats.spec_decode_accepted_per_position),
                   list(stats.spec_decode_carried_per_position), list(stats.spec_decode_proposal_lengths))

    def since(self, earlier: SpecDecodeStats) -> SpecDecodeStats:
        """What was counted after ``earlier`` (a copy taken before)."""
        def minus(now: list[int], before: list[int]) -> list[int]:
            return [a - b for a, b in zip(now, before)]

        return SpecDecodeStats(self.num_drafts - earlier.num_drafts, self.num_draft_tokens - earlier.num_draft_tokens,
                               self.num_accepted_tokens - earlier.num_accepted_tokens,
                               minus(self.accepted_per_position, earlier.accepted_per_position),
                               minus(self.carried_per_position, earlier.carried_per_position),
                               minus(self.proposal_lengths, earlier.proposal_lengths))


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer: Proposer | None = None) -> None:
        """``proposer``: the config's method's when None (the simulator hands in one that follows a measured
        profile)."""
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = proposer or make_proposer(config)
        self.cost = StepCost()
        k = config.num_speculative_tokens
        self.stats = SpecDecodeStats(accepted_per_position=[0] * k, carried_per_position=[0] * k,
                                     proposal_lengths=[0] * (k + 1))
        self._rate = FIRST_GUESS  # acceptance of all requests' drafts, a running mean
        self._own: dict[str, tuple[int, int]] = {}  # request id -> (drafts verified, accepted)

    def drafts(self, running: list[Request], budget: int) -> dict[str, list[int]]:
        """The drafts each running request carries this step (only those with some), within ``budget`` tokens
        for the whole running batch."""
        proposed: dict[str, list[int]] = {}
        base_tokens = 0
        for request in running:
            lacking = request.num_tokens - request.num_computed_tokens
            base_tokens += lacking
            if lacking != 1:
                continue
            room = self._room(request)
            if room > 0:
                draft = self.proposer.propose(request, room)
                self.stats.proposal_lengths[len(draft)] += 1
                if draft:
                    proposed[request.request_id] = draft
        spare = budget - base_tokens
        if not proposed or spare <= 0:
            return {}
        if self.config.draft_length == "fixed":
            return proposed
        return self._worth_carrying(proposed, base_tokens, len(running), spare)

    def _room(self, request: Request) -> int:
        """Drafts the request may carry: the config's most, less what max_tokens and the model's length allow
        (the token drawn after the drafts needs a place too); 0 where its sampling is not plain."""
        params = request.sampling_params
        if params.processes_logits or params.logprobs is not None:
            return 0
        return min(self.config.num_speculative_tokens, request.tokens_left(self.max_model_len) - 1)

    def _worth_carrying(self, proposed: dict[str, list[int]], base_tokens: int, num_requests: int,
                        spare: int) -> dict[str, list[int]]:
        """The drafts that make the step's expected tokens per second largest (see the module's doc)."""
        curve = self.cost.curve()
        if curve is None:
            return proposed  # nothing measured yet: carry them and measure
        gains = []  # (worth, request id, position): a request's worths fall with position, so any top set
        for request_id, draft in proposed.items():  # takes a prefix of each draft
            rate = self.acceptance(request_id)
            worth = 1.0
            for position in range(len(draft)):
                worth *= rate
                gains.append((worth, request_id, position))
        gains.sort(key=lambda gain: -gain[0])
        best_count, best_rate, expected = 0, num_requests / curve.seconds(base_tokens), float(num_requests)
        for count, (worth, _, _) in enumerate(gains[:spare], start=1):
            expected += worth
            rate = expected / curve.seconds(base_tokens + count)
            if rate > best_rate:
                best_count, best_rate = count, rate
        carried: dict[str, list[int]] = {}
        for _, request_id, position in gains[:best_count]:
            carried[request_id] = proposed[request_id][:position + 1]
        return carried

    def acceptance(self, request_id: str) -> float:
        """The request's acceptance rate so far, shrunk toward all requests' while it has few drafts behind it."""
        verified, accepted = self._own.get(request_id, (0, 0))
        return (accepted + PRIOR_DRAFTS * self._rate) / (verified + PRIOR_DRAFTS)

    def request_counts(self, request_id: str) -> tuple[int, int]:
        """The request's drafts verified so far, and of them accepted (the dashboard's row shows them)."""
        return self._own.get(request_id, (0, 0))

    def verified(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A step verified ``num_drafts`` drafts of the request and accepted the first ``num_accepted``."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            stats.accepted_per_position[position] += 1
        for position in range(num_drafts):
            stats.carried_per_position[position] += 1
        verified, accepted = self._own.get(request_id, (0, 0))
        self._own[request_id] = (verified + num_drafts, accepted + num_accepted)
        self._rate += GLOBAL_WEIGHT * num_drafts * (num_accepted / num_drafts - self._rate)

    def record_step(self, num_tokens: int, seconds: float) -> None:
        self.cost.record(num_tokens, seconds)

    def finished(self, request: Request) -> None:
        self._own.pop(request.request_id, None)
        self.proposer.finished(request)
