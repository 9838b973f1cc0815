"""The server's loop takes requests sent at once into one first step (``--burst-wait-ms``, conveyor.core.burst)."""

from __future__ import annotations

import asyncio

from conveyor import SamplingParams
from conveyor.core.config import EngineConfig
from conveyor.engine import AsyncEngine, Engine


def first_step_requests(model_dir, wait_ms: int, gap_s: float, count: int = 4) -> set[str]:
    """``count`` requests submitted ``gap_s`` apart to an idle engine: those its first step gave a token to."""
    steps: list[set[str]] = []
    engine = Engine(EngineConfig(model=str(model_dir), num_kv_blocks=64, kernels="torch", burst_wait_ms=wait_ms))
    served = AsyncEngine(engine, on_step=lambda stats, outputs: steps.append({o.request_id for o in outputs}))
    served.start()

    async def send() -> None:
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        streams = []
        for index in range(count):
            streams.append(served.submit(served.requests.build([5, 6, 7 + index], params, f"r{index}")))
            await asyncio.sleep(gap_s)
        for stream in streams:
            async for _ in stream:
                pass

    try:
        asyncio.run(send())
    finally:
        served.stop()
    return next(step for step in steps if step)


def test_requests_sent_a_few_milliseconds_apart_share_the_first_step(tiny_model_dir) -> None:
    assert first_step_requests(tiny_model_dir, wait_ms=200, gap_s=0.02) == {"r0", "r1", "r2", "r3"}


def test_without_a_wait_the_first_request_steps_alone(tiny_model_dir) -> None:
    assert first_step_requests(tiny_model_dir, wait_ms=0, gap_s=0.2) == {"r0"}
