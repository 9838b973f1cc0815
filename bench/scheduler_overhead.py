"""What prefix caching costs the scheduler on traffic with nothing to share (W2's shapes), without the model.

The engine loop's own side: schedule() and update() over the 256 long-tailed requests of W2, with the plain
paged KV manager and with the prefix-caching one, on process CPU time. Each step's model forward takes tens
to hundreds of milliseconds on a CPU, so the difference per step, set against that, is the most caching can
cost a workload that never hits.

    .venv/bin/python bench/scheduler_overhead.py
"""

from __future__ import annotations

import time

from conveyor.benchmarks.workload import long_tail_workload
from conveyor.core.kv import PagedKVCacheManager, PrefixCachingKVCacheManager
from conveyor.core.request import Request
from conveyor.core.sampling import SamplingParams
from conveyor.core.scheduler import Scheduler, SchedulerConfig

NUM_BLOCKS, BLOCK_SIZE = 2900, 16  # about 2 GiB of SmolLM2-135M's float32 KV, the engine's default
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, MAX_MODEL_LEN = 128, 2048, 8192
VOCAB = 49152


def run(caching: bool) -> tuple[float, int]:
    """Scheduler CPU seconds and steps for W2 run to the end (every sampled token is the same id)."""
    manager = PrefixCachingKVCacheManager if caching else PagedKVCacheManager
    scheduler = Scheduler(SchedulerConfig(MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, MAX_MODEL_LEN),
                          manager(NUM_BLOCKS, BLOCK_SIZE, 0.01))
    for i, r in enumerate(long_tail_workload(256, 0, VOCAB)):
        params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        scheduler.add_request(Request(f"r{i}", r.prompt_token_ids, params, arrival_time=0.0))
    steps, start = 0, time.process_time()
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        scheduler.update(output, {item.request_id: 7 for item in output.scheduled if item.samples_token})
        steps += 1
    return time.process_time() - start, steps


def main() -> None:
    per_step = {False: [], True: []}
    for _ in range(3):
        for caching in (False, True):
            cpu_s, steps = run(caching)
            per_step[caching].append(cpu_s / steps)
            print(f"prefix caching {'on ' if caching else 'off'}: {steps} steps, scheduler {cpu_s:.3f} s CPU, "
                  f"{cpu_s / steps * 1e6:.0f} us per step")
    extra = min(per_step[True]) - min(per_step[False])
    print(f"caching adds {extra * 1e6:.0f} us per step (best of 3 each)")


if __name__ == "__main__":
    main()
