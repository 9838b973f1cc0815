"""An executor that runs no model: it prices a step with the cost model and moves a virtual clock.

It carries out the same SchedulerOutput as the torch executor and answers in
the same shape, a token for each request whose chunk samples. The token is
always ``token_id``; requests end where a real run of their workload would
because the simulator gives them ``max_tokens`` equal to their output length
and ``ignore_eos``.
"""

from __future__ import annotations

from collections.abc import Callable

from conveyor.core.scheduler.output import SchedulerOutput
from conveyor.sim.cost import CostModel, StepWork, step_work
from conveyor.sim.speculative import DraftAcceptance


class VirtualClock:
    """Simulated seconds; the scheduler reads it as it would read ``time.monotonic``."""

    __slots__ = ("now",)

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class SimulatedExecutor:
    def __init__(self, cost: CostModel, clock: VirtualClock, block_size: int, token_id: int = 0,
                 acceptance: DraftAcceptance | None = None) -> None:
        """``acceptance``: how many drafts the simulated model accepts (speculative decoding; see
        conveyor.sim.speculative)."""
        self.cost = cost
        self.acceptance = acceptance
        self.accepted_drafts: dict[str, int] = {}  # the latest step's, by request (see Executor)
        self.clock = clock
        self.block_size = block_size
        self.token_id = token_id
        self.num_model_steps = 0
        self.num_busy_slot_steps = 0  # sum over model steps of the requests computing in them
        self.busy_time = 0.0
        # The scheduler's ``listed`` (set by whoever builds the engine core around this executor): a step whose
        # fast-forward group is only counted is listed in full where blocks are shared, so that its price sees
        # which of them its decodes read again.
        self.listed: Callable[[SchedulerOutput], SchedulerOutput] | None = None

    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        """Price the step and move the clock."""
        memory = output.memory
        if output.num_grouped_decodes and memory is not None and memory.shared_slots and self.listed is not None:
            output = self.listed(output)
        work, sampled = step_work(output)
        self._run(work)
        if output.num_draft_tokens:
            accepted = self.acceptance.accepted
            self.accepted_drafts = {s.request_id: accepted(s.num_draft_tokens)
                                    for s in output.scheduled if s.num_draft_tokens}
        token = self.token_id
        return dict.fromkeys(sampled, token)

    def execute_group(self, num_decodes: int, context: int, shared_blocks: int = 0) -> None:
        """A step of decodes only, given by their number, the keys they attend to in all and the blocks they read
        that an earlier one read too (a fast-forward's group): priced as ``execute`` prices the same decodes
        listed one by one."""
        n = num_decodes
        self._run(StepWork(n, n, n, context, context, 0, context, n, shared_blocks))

    def _run(self, work: StepWork) -> None:
        cost = self.cost
        duration = cost.step_time(work, self.block_size) * cost.pace + cost.serving_s_per_token * work.num_sampled
        self.clock.now += duration
        self.busy_time += duration
        self.num_model_steps += 1 if work.num_seqs else 0
        self.num_busy_slot_steps += work.num_seqs
