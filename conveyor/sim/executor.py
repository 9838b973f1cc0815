"""An executor that runs no model: it prices a step with the cost model and moves a virtual clock.

It carries out the same SchedulerOutput as the torch executor and answers in
the same shape, a token for each request whose chunk samples. The token is
always ``token_id``; requests end where a real run of their workload would
because the simulator gives them ``max_tokens`` equal to their output length
and ``ignore_eos``.
"""

from __future__ import annotations

from conveyor.core.scheduler.output import SchedulerOutput
from conveyor.sim.cost import CostModel, StepWork, chunk_attention_pairs


class VirtualClock:
    """Simulated seconds; the scheduler reads it as it would read ``time.monotonic``."""

    __slots__ = ("now",)

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class SimulatedExecutor:
    def __init__(self, cost: CostModel, clock: VirtualClock, block_size: int, token_id: int = 0) -> None:
        self.cost = cost
        self.clock = clock
        self.block_size = block_size
        self.token_id = token_id
        self.num_model_steps = 0
        self.num_busy_slot_steps = 0  # sum over model steps of the requests computing in them
        self.busy_time = 0.0

    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        """Price the step and move the clock; one pass over the scheduled requests, which are most of its cost."""
        scheduled = output.scheduled
        sampled: dict[str, int] = {}
        token = self.token_id
        num_tokens = attention_pairs = kv_tokens_read = 0
        for item in scheduled:
            start, chunk = item.start_position, len(item.token_ids)
            context = start + chunk
            num_tokens += chunk
            kv_tokens_read += context
            # A decode's one query sees its whole context (chunk_attention_pairs(start, 1), without the call).
            attention_pairs += context if chunk == 1 else chunk_attention_pairs(start, chunk)
            if item.samples_token:
                sampled[item.request_id] = token
        num_seqs = len(scheduled)
        swap_blocks = len(output.blocks_to_swap_in) + len(output.blocks_to_swap_out)
        work = StepWork(num_seqs, num_tokens, len(sampled), attention_pairs, kv_tokens_read, swap_blocks)
        duration = self.cost.step_time(work, self.block_size)
        self.clock.now += duration
        self.busy_time += duration
        self.num_model_steps += 1 if num_seqs else 0
        self.num_busy_slot_steps += num_seqs
        return sampled
