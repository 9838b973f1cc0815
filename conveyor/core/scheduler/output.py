"""What the scheduler decided for one step, as plain data.

An executor carries it out; tests assert on it; a trace records it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.core.kv import MemoryReport
from conveyor.core.pooling import PoolingParams
from conveyor.core.sampling import SamplingParams


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: ``token_ids`` at positions ``start_position...``."""

    request_id: str
    start_position: int
    token_ids: list[int]
    block_ids: list[int]
    sampling_params: SamplingParams
    samples_token: bool  # the chunk reaches the request's last known token, so a new one is drawn
    num_output_tokens: int  # output tokens before this step; seeds the request's random stream
    # The request's own lists (references, not copies), read by the sampler for penalties, min_tokens and
    # constraints, which look at the whole history; the executor must not change them.
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_id: int | None = None
    # With KV groups (conveyor.core.kv.groups): the request's table in each group, ``block_ids`` being group
    # 0's; empty with one group.
    group_block_ids: tuple[list[int], ...] = ()
    # Speculative decoding: the last this many of ``token_ids`` are drafts (guesses of the tokens after the
    # request's last one), verified in this step: the executor draws a token at each of them and at the row
    # before, and reports how many drafts matched (see conveyor.core.spec).
    num_draft_tokens: int = 0
    # A pooled request's (Request.pooling): the executor pools its hidden states and, at its last prompt
    # position, reports the vector instead of drawing a token.
    pooling: PoolingParams | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens computed for this request in this step (vLLM's name): a prompt chunk, or 1 for a decode."""
        return len(self.token_ids)

    @property
    def draws_token(self) -> bool:
        """Whether the step runs the LM head for it and draws a token: its chunk reaches its last token and it
        is not pooled (a pooled prompt ends there with a vector instead)."""
        return self.samples_token and self.pooling is None

    @property
    def context_len(self) -> int:
        """Tokens the request attends to after this step (cached + new)."""
        return self.start_position + len(self.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    step: int
    scheduled: list[ScheduledRequest]
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests that ended since the previous step: the executor drops their state.
    finished_request_ids: list[str] = field(default_factory=list)
    # (cpu block, device block) and (device block, cpu block) pairs to copy before the step runs:
    # swap-ins first, then swap-outs (a CPU block freed by a swap-in may be a swap-out's destination).
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    num_waiting: int = 0
    num_running: int = 0
    num_swapped: int = 0
    kv_usage: float = 0.0
    memory: MemoryReport | None = None  # after this step's allocations
    # Requests admitted in this step whose leading blocks came from the prefix cache: request id -> tokens.
    cached_tokens: dict[str, int] = field(default_factory=dict)
    # Decodes advanced as a group (the simulator's fast-forward, scheduler/fast_forward.py): counted here, not
    # listed in ``scheduled``; each computes one token and draws one, and together they attend to
    # ``grouped_decode_context`` keys. Always 0 on the real engine.
    num_grouped_decodes: int = 0
    grouped_decode_context: int = 0
    num_draft_tokens: int = 0  # drafts over all scheduled requests (speculative decoding; 0 without)

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled) + self.num_grouped_decodes

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.num_grouped_decodes
