"""--num-threads: the engine runs its kernels on the threads asked for, else on the cores it may use."""

from __future__ import annotations

import logging
import os

import torch

from conveyor.core.config import EngineConfig, usable_cores
from conveyor.engine import Engine


def test_the_engine_uses_the_threads_asked_for_and_by_default_the_cores_it_may_use(tiny_model_dir) -> None:
    before = torch.get_num_threads()
    try:
        Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, num_threads=1))
        assert torch.get_num_threads() == 1
        Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64))
        assert torch.get_num_threads() == usable_cores()
    finally:
        torch.set_num_threads(before)
    if hasattr(os, "sched_getaffinity"):
        assert usable_cores() == len(os.sched_getaffinity(0))


def test_more_threads_than_cores_runs_with_a_warning(tiny_model_dir, caplog) -> None:
    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.WARNING, logger="conveyor"):
            engine = Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, num_threads=usable_cores() + 1,
                                         kernels="torch"))
        assert torch.get_num_threads() == usable_cores() + 1 and engine.runner.num_threads == usable_cores() + 1
        assert f"more than the {usable_cores()} cores this process may use" in caplog.text
    finally:
        torch.set_num_threads(before)


RELEASE_SCRIPT = """
import os, time, torch
from conveyor.executor.compute_threads import release_openmp_pool

def threads():
    return len(os.listdir("/proc/self/task"))

torch.set_num_threads(3)
alone = threads()
torch.ones(1 << 22).sum()  # a parallel region: this thread's pool of 2 workers
pooled = threads()
assert release_openmp_pool()
deadline = time.monotonic() + 10
while threads() > alone and time.monotonic() < deadline:
    time.sleep(0.01)
print(alone, pooled, threads(), float(torch.ones(1 << 22).sum()))
"""


def test_the_loading_thread_gives_its_openmp_workers_back() -> None:
    """A second pool (the model loaded on one thread, stepped on another) makes libgomp throttle every
    barrier's wait into sleeps: the thread that loaded gives its workers back before the loop starts."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", RELEASE_SCRIPT], capture_output=True, text=True, timeout=120,
                         check=True)
    alone, pooled, released, total = run.stdout.split()
    assert int(pooled) == int(alone) + 2  # the workers a parallel region started
    assert int(released) == int(alone)  # gone again
    assert float(total) == float(1 << 22)  # a later region starts a pool of its own and computes


def test_the_async_engine_releases_the_starting_threads_pool(tiny_model_dir, monkeypatch) -> None:
    from conveyor.engine import AsyncEngine, async_engine

    calls = []
    monkeypatch.setattr(async_engine, "release_openmp_pool", lambda: calls.append(1) or True)
    engine = AsyncEngine(Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, kernels="torch")))
    engine.start()
    try:
        assert calls == [1]
    finally:
        engine.stop()


def test_a_reader_that_answers_whole_gets_each_sequences_final_output_alone(tiny_model_dir) -> None:
    """Outputs are cumulative, so a response sent whole needs only the last; every step's goes to a stream."""
    import asyncio

    from conveyor import SamplingParams
    from conveyor.engine import AsyncEngine

    engine = Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, kernels="torch"))
    served = AsyncEngine(engine)
    served.start()

    async def read(final_only: bool, n: int) -> list:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=n, seed=1)
        request = served.requests.build([5, 6, 7], params, f"r-{final_only}-{n}")
        return [output async for output in served.generate(request, final_only=final_only)]

    try:
        every, finals, finals_of_two = (asyncio.run(read(f, n)) for f, n in ((False, 1), (True, 1), (True, 2)))
    finally:
        served.stop()
    assert len(every) == 6 and [o.finished for o in every] == [False] * 5 + [True]
    assert len(finals) == 1 and finals[0].finished and finals[0].token_ids == every[-1].token_ids
    assert sorted(o.index for o in finals_of_two) == [0, 1] and all(o.finished for o in finals_of_two)
