"""An executor that runs no model: it prices a step with the cost model and moves a virtual clock.

It carries out the same SchedulerOutput as the torch executor and answers in
the same shape, a token for each request whose chunk samples. The token is
always ``token_id``; requests end where a real run of their workload would
because the simulator gives them ``max_tokens`` equal to their output length
and ``ignore_eos``. With multi-step scheduling it prices each decode step of
the window from the window's shape in one pass, without building the steps.
"""

from __future__ import annotations

from conveyor.scheduler.output import SchedulerOutput
from conveyor.sim.cost import CostModel, StepWork, chunk_attention_pairs


class VirtualClock:
    """Simulated seconds; the scheduler reads it as it would read ``time.monotonic``."""

    __slots__ = ("now",)

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class SimulatedExecutor:
    runs_multi_step = True  # prices a whole multi-step window per call

    def __init__(
        self, cost: CostModel, clock: VirtualClock, block_size: int, num_scheduler_steps: int = 1, token_id: int = 0
    ) -> None:
        self.cost = cost
        self.clock = clock
        self.block_size = block_size
        self.num_scheduler_steps = num_scheduler_steps
        self.token_id = token_id
        self.num_model_steps = 0
        self.num_busy_slot_steps = 0  # sum over model steps of the requests computing in them
        self.busy_time = 0.0

    def execute(self, output: SchedulerOutput) -> dict[str, int] | dict[str, list[int]]:
        sampled: dict = {}
        token = self.token_id
        num_tokens = attention_pairs = kv_tokens_read = 0
        # Requests that decode on after the first step, by how many steps they run: count and context sum.
        ending_count = [0] * (self.num_scheduler_steps + 1)
        ending_context = [0] * (self.num_scheduler_steps + 1)
        window = 1
        for item in output.scheduled:
            start, chunk = item.start_position, len(item.token_ids)
            context = start + chunk
            num_tokens += chunk
            kv_tokens_read += context
            attention_pairs += context if chunk == 1 else chunk_attention_pairs(start, chunk)
            if item.sample:
                steps = item.num_steps
                if steps == 1:
                    sampled[item.request_id] = token
                else:
                    sampled[item.request_id] = [token] * steps
                    ending_count[steps] += 1
                    ending_context[steps] += context
                    if steps > window:
                        window = steps
        num_seqs = len(output.scheduled)
        swap_blocks = len(output.blocks_to_swap_in) + len(output.blocks_to_swap_out)
        work = StepWork(num_seqs, num_tokens, len(sampled), attention_pairs, kv_tokens_read, swap_blocks)
        duration = self.cost.step_time(work, self.block_size)
        busy = num_seqs
        live, live_context = 0, 0
        for index in range(window - 1, 0, -1):  # decode step ``index`` runs the requests with more steps than it
            live += ending_count[index + 1]
            live_context += ending_context[index + 1]
            duration += self.cost.decode_time(live, live_context + index * live)
            busy += live
        self.clock.now += duration
        self.busy_time += duration
        self.num_model_steps += window if num_seqs else 0
        self.num_busy_slot_steps += busy
        return sampled
