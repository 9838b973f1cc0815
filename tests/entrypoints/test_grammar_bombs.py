"""Grammar bombs against a real ``conveyor serve``: constraints too big or too deep are refused before any
compile, a schema that refers outside itself is refused, and a compile that never ends is abandoned at its
budget while plain requests go on being served.

Found by attacking the server: a schema of 900 nested arrays compiled for 61 s, and two schemas 600 deep made
a plain completion sent after them wait 34 s (the compiles held the tokenizer's two threads); a ``$ref`` to
``http://`` or ``file://`` silently became "any JSON".
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conveyor.core.structured import MAX_ENUM_VALUES
from conveyor.executor.grammar import CompiledCache
from tests.serving import running_server, wait_until_idle

HANG = "HANG-ME"  # a compile whose source holds this never ends (the test hook of conveyor.executor.faults)
PLAIN = {"prompt": "hi", "max_tokens": 2}
# The compile budget of the served engine: 2 s rather than the default 5, so that the tests that wait it out wait
# less; a compile past it is abandoned all the same. Far above what the constraints that do compile take here.
BUDGET_MS = 2000


def nested_arrays(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | fields


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    with running_server(tiny_model_dir, "--num-kv-blocks", "256", "--grammar-compile-timeout-ms", str(BUDGET_MS),
                        env={"CONVEYOR_FAULT_INJECTION": f"grammar-hang:{HANG}"}) as running:
        yield running


@pytest.fixture(scope="module")
def connection(served):
    with httpx.Client(base_url=served.base, timeout=60) as client:
        yield client


REFUSED = [
    ("/v1/completions", PLAIN | {"guided_json": json.dumps(nested_arrays(900))}, "guided_json", "32 levels"),
    ("/v1/chat/completions", chat(response_format=json_schema_format({"enum": list(range(MAX_ENUM_VALUES + 1))})),
     "response_format", f"limit of {MAX_ENUM_VALUES}"),
    ("/v1/completions", PLAIN | {"guided_choice": [f"c{i}" for i in range(MAX_ENUM_VALUES + 1)]}, "guided_choice",
     f"limit of {MAX_ENUM_VALUES}"),
    ("/v1/completions", PLAIN | {"guided_regex": "a" * 40_000}, "guided_regex", "32768 bytes"),
    ("/v1/completions", PLAIN | {"guided_json": {"$ref": "http://127.0.0.1:9/schema.json"}}, "guided_json", "$ref"),
    ("/v1/chat/completions", chat(response_format=json_schema_format(
        {"type": "object", "properties": {"a": {"$ref": "file:///etc/passwd"}}})), "response_format", "$ref"),
]


@pytest.mark.parametrize(("path", "body", "param", "words"), REFUSED)
def test_a_constraint_over_a_limit_or_refering_outside_is_a_400_naming_it(connection, path, body, param,
                                                                          words) -> None:
    start = time.perf_counter()
    response = connection.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert time.perf_counter() - start < 5, "refused before compiling"
    assert connection.post("/v1/completions", json=PLAIN).status_code == 200


def test_a_local_ref_is_followed(connection) -> None:
    schema = {"$defs": {"yes": {"enum": ["yes"]}}, "$ref": "#/$defs/yes"}
    response = connection.post("/v1/completions", json=PLAIN | {"guided_json": schema, "max_tokens": 8})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == '"yes"'


def test_a_compile_past_its_budget_is_abandoned_and_plain_requests_go_on(served, connection) -> None:
    def hanging(index: int) -> httpx.Response:
        body = PLAIN | {"guided_regex": f"{HANG}-{index}[a-z]+"}
        return httpx.post(f"{served.base}/v1/completions", json=body, timeout=60)

    with ThreadPoolExecutor(2) as pool:  # one per compiler: every compiler is stuck
        bombs = [pool.submit(hanging, index) for index in range(2)]
        time.sleep(0.5)
        start = time.perf_counter()
        plain = connection.post("/v1/completions", json=PLAIN)
        plain_latency = time.perf_counter() - start
        results = [bomb.result() for bomb in bombs]
    assert plain.status_code == 200 and plain_latency < 2.0, f"a plain request waited {plain_latency:.1f} s"
    for response in results:
        assert response.status_code == 400, response.text
        assert f"budget of {BUDGET_MS / 1000:g} s" in response.json()["error"]["message"]
        assert response.json()["error"]["param"] == "guided_regex"
    # The compilers were ended; fresh ones compile the next constraint.
    after = connection.post("/v1/completions", json=PLAIN | {"guided_choice": ["yes", "no"], "max_tokens": 4})
    assert after.status_code == 200 and after.json()["choices"][0]["text"] in ("yes", "no"), after.text
    wait_until_idle(served)


def test_the_compiled_grammar_cache_keeps_to_its_bytes_least_recently_used_first() -> None:
    cache = CompiledCache(limit_bytes=100)
    for index in range(5):
        cache.put(("json", str(index)), f"grammar {index}", 30)
        cache.get(("json", "0"))  # kept in use: never the least recently used
    assert cache.num_bytes <= 100 and len(cache) == 3
    assert cache.get(("json", "0")) == "grammar 0" and cache.get(("json", "1")) is None
    assert cache.get(("json", "4")) == "grammar 4"


def test_compilers_that_stay_busy_are_a_429_to_retry(served, connection) -> None:
    """Two compilers, five constraints that never compile: the first two hold the compilers for the whole
    budget, so a constraint that waits that long for one is answered 429 "busy" (with Retry-After), not held:
    too many constraints, not a server that is down."""
    def hanging(index: int) -> httpx.Response:
        body = PLAIN | {"guided_regex": f"{HANG}-busy-{index}[a-z]+"}
        return httpx.post(f"{served.base}/v1/completions", json=body, timeout=120)

    with ThreadPoolExecutor(5) as pool:
        first = [pool.submit(hanging, index) for index in range(2)]
        time.sleep(0.3)  # the first two hold both compilers; the next three wait for one from now
        waiting = [pool.submit(hanging, index) for index in range(2, 5)]
        results = [future.result() for future in first + waiting]
    statuses = sorted(response.status_code for response in results)
    assert set(statuses) <= {400, 429} and 429 in statuses, [r.text for r in results]
    for busy in (response for response in results if response.status_code == 429):
        error = busy.json()["error"]
        assert busy.headers["retry-after"] == "1" and "stayed busy" in error["message"], busy.text
        assert error["code"] == "grammar_compilers_busy", busy.text
    assert connection.post("/v1/completions", json=PLAIN).status_code == 200
    wait_until_idle(served)
