"""Property-based fuzzing of the HTTP API from its own OpenAPI schema: no input makes it fail with a 5xx.

Schemathesis generates requests (valid and invalid) for every operation the
schema describes; each must get an answer below 500, and afterwards the
server must still be healthy with nothing left running.
"""

from __future__ import annotations

import time

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from conveyor.core.config import EngineConfig
from conveyor.engine import Engine
from conveyor.engine.async_engine import AsyncEngine
from conveyor.entrypoints.metrics import EngineMetrics
from conveyor.entrypoints.ollama import add_ollama_routes
from conveyor.entrypoints.openai.api_server import build_app
from conveyor.entrypoints.openai.serving import ServerSettings


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    # A short context and a small default max_tokens: the fuzzer's valid requests finish in a few steps (what
    # they ask is checked all the same; a long generation tests nothing more here).
    engine = Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, max_model_len=128))
    metrics = EngineMetrics("tiny")
    async_engine = AsyncEngine(engine, max_waiting_requests=64, on_step=metrics.on_step)
    app = build_app(async_engine, ServerSettings("tiny", max_request_bytes=1 << 16, default_max_tokens=8), metrics,
                    more_apis=(add_ollama_routes,))
    async_engine.start()
    yield app, async_engine
    async_engine.stop()


@pytest.fixture(scope="module")
def api_schema(served):
    return schemathesis.openapi.from_asgi("/openapi.json", served[0])


def test_no_input_gets_a_server_error(api_schema):
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 8, "every endpoint should be in the schema"
    for operation in operations:

        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=operation.as_strategy())
        def answers_below_500(case) -> None:
            response = case.call()
            assert response.status_code < 500, (
                f"{case.method} {case.path}: {response.status_code} {response.text[:300]}"
            )

        answers_below_500()


def test_still_healthy_afterwards(served):
    app, async_engine = served
    from starlette.testclient import TestClient

    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        reply = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "temperature": 0})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
    deadline = time.monotonic() + 10
    while async_engine.stats().num_unfinished or async_engine.num_unfinished:
        assert time.monotonic() < deadline, "requests left running after the fuzzing"
        time.sleep(0.1)
    assert async_engine.stats().kv_usage == 0
