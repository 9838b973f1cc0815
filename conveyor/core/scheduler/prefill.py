"""Several partial prefills per step, with a cap on long ones: no head-of-line blocking by a long prompt.

With one prompt computed at a time, a 4,000-token prompt takes the whole token budget for several
steps and every short prompt behind it waits (vLLM v1 issue 57413). With ``--max-num-partial-prefills
N`` above 1 (vLLM v0's flags), up to N prompts are computed in chunks side by side, each taking at most
its share of the step's budget, ``max_num_batched_tokens / N``, even when it is alone: a step that holds
a long prompt stays short, so a short prompt that arrives during it waits for one short step, not for
a chunk of the whole budget (which, deep in a 4,000-token prompt, takes seconds on a CPU). Of the
prompts under way at most ``--max-long-partial-prefills`` may be long (more than
``--long-prefill-token-threshold`` tokens still to compute), so when that many long ones are under way,
a later short prompt is admitted ahead of a waiting long one. A prompt that completes in the step it is
admitted is not a partial prefill and takes no place.

The aging bound: a waiting request passed over for these caps in ``PREFILL_AGING_STEPS`` steps stops
admission at itself (nobody overtakes it any more), and is admitted as soon as a place frees, which
the prefills under way do within a bounded number of steps, since each advances every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.core.request import Request

PREFILL_AGING_STEPS = 8  # steps a waiting request may be overtaken for the prefill caps before it blocks overtakers
LONG_PREFILL_SHARE = 0.04  # vLLM's default threshold: 4% of max_model_len


@dataclass(slots=True)
class PartialPrefills:
    """The caps, and this step's count of the prefills under way (running requests still short of their prompt)."""

    max_num_partial_prefills: int
    max_long_partial_prefills: int
    long_prefill_token_threshold: int
    max_num_batched_tokens: int
    num_partial: int = 0
    num_long: int = 0
    long_ids: set[str] = field(default_factory=set)  # the long prefills under way
    skips: dict[str, int] = field(default_factory=dict)  # waiting request -> steps it was passed over

    @classmethod
    def from_limits(cls, max_num_partial_prefills: int, max_long_partial_prefills: int, threshold: int,
                    max_num_batched_tokens: int, max_model_len: int) -> PartialPrefills | None:
        """None with one partial prefill (the default): the scheduler then computes prompts one at a time."""
        if max_num_partial_prefills == 1:
            return None
        threshold = threshold or max(1, int(max_model_len * LONG_PREFILL_SHARE))
        return cls(max_num_partial_prefills, max_long_partial_prefills, threshold, max_num_batched_tokens)

    @property
    def chunk_cap(self) -> int:
        """Tokens one prefill may take in a step: the budget over N, alone too."""
        return max(1, self.max_num_batched_tokens // self.max_num_partial_prefills)

    def count_under_way(self, running: list[Request], scheduled_tokens: dict[str, int]) -> None:
        """Count the running requests that this step's chunk (if any) leaves short of their last token."""
        partial = {r.request_id for r in running
                   if r.num_tokens - r.num_computed_tokens - scheduled_tokens.get(r.request_id, 0) > 0}
        self.long_ids &= partial
        self.num_partial = len(partial)
        self.num_long = len(self.long_ids)

    def has_place(self, request: Request, lacking: int, num_new: int) -> bool:
        """Whether a request that lacks ``lacking`` tokens may start its prefill with ``num_new`` of them."""
        if num_new >= lacking:
            return True  # it completes in this step: not a partial prefill
        if self.num_partial >= self.max_num_partial_prefills:
            return False
        return lacking <= self.long_prefill_token_threshold or self.num_long < self.max_long_partial_prefills

    def started(self, request: Request, lacking: int, num_new: int) -> None:
        """The request was admitted (or resumed) with ``num_new`` of the ``lacking`` tokens."""
        self.skips.pop(request.request_id, None)
        if num_new >= lacking:
            return
        self.num_partial += 1
        if lacking > self.long_prefill_token_threshold:
            self.num_long += 1
            self.long_ids.add(request.request_id)

    def pass_over(self, request: Request) -> bool:
        """The request must wait for a place: may later ones overtake it? Not once it has aged."""
        skips = self.skips.get(request.request_id, 0)
        if skips >= PREFILL_AGING_STEPS:
            return False
        self.skips[request.request_id] = skips + 1
        return True

    def forget(self, request_id: str) -> None:
        self.skips.pop(request_id, None)
        self.long_ids.discard(request_id)
