"""The dashboard in a real headless Chromium: live against a running server, and replaying a trace file.

Chromium comes from Debian's packages (``make install`` installs it); Playwright drives that executable and
downloads no browser of its own. Without Chromium these tests fail and say how to install it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.serving import free_port, running_server

DASH = "window.conveyorDashboard"  # what the page exposes to tests

KEY = "dashboard-key"
INSTALL_HINT = ("Chromium is needed for the dashboard's browser tests: run `make install` (it installs Debian's "
                "`chromium`), or `apt-get install -y chromium`, or set CONVEYOR_CHROMIUM to a Chromium executable")


def chromium_executable() -> str:
    path = os.environ.get("CONVEYOR_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail(INSTALL_HINT)
    return path


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    executable = chromium_executable()
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable,
                                              args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield chromium
        chromium.close()


def metric(base: str, name: str) -> float:
    response = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    response.raise_for_status()  # /metrics is behind the key too
    text = response.text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"conveyor:{name}{{"))


def wait_for(condition, timeout: float = 60, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def send_traffic(base: str, num_requests: int, max_tokens: int) -> threading.Thread:
    def one(i: int) -> None:
        body = {"prompt": [1000 + i] * (8 + 3 * i), "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=300)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(num_requests)]
    for thread in threads:
        thread.start()
    waiter = threading.Thread(target=lambda: [t.join() for t in threads], daemon=True)
    waiter.start()
    return waiter


@pytest.fixture(scope="module")
def live_server(tiny_model_dir) -> Iterator[str]:
    with running_server(tiny_model_dir, "--max-num-seqs", "4", "--num-kv-blocks", "512", "--block-size", "8",
                        "--api-key", KEY, "--kernels", "torch") as server:
        yield server.base


def test_live_page_follows_the_engine(browser, live_server) -> None:
    page = browser.new_page()
    page.goto(f"{live_server}/dashboard?api_key={KEY}&fps=10")  # redrawn ten times a second: the tiny model is quick
    traffic = send_traffic(live_server, num_requests=10, max_tokens=400)
    wait_for(lambda: page.evaluate(f"{DASH}.timelineRequestIds().length") > 0, what="a request in the timeline")

    # The running count on the page is /metrics' gauge, give or take one update of the page: two redraws after
    # `before`, what it shows came from the server after it.
    for _ in range(3):
        before = metric(live_server, "num_requests_running")
        seen = page.evaluate(f"{DASH}.draws()")
        wait_for(lambda seen=seen: page.evaluate(f"{DASH}.draws()") >= seen + 2, 10, "two more redraws")
        shown = int(page.inner_text("#count-running"))
        after = metric(live_server, "num_requests_running")
        assert min(before, after) <= shown <= max(before, after), (before, shown, after)

    # A request seen in the timeline holds blocks, then finishes and leaves: its row goes, its blocks free up.
    def holding():  # a request in the timeline's latest step that holds blocks (not one that just finished)
        for request_id in page.evaluate(f"{DASH}.timelineRequestIds()"):
            if held := page.evaluate(f"{DASH}.blocksOf({json.dumps(request_id)})"):
                return request_id, held
        return None

    watched, blocks = wait_for(holding, 10, "a request in the timeline that holds blocks")
    wait_for(lambda: page.locator(f'#requests tr[data-id="{watched}"]').count() == 1, 10, "its row")
    wait_for(lambda: watched not in page.evaluate(f"{DASH}.timelineRequestIds()"), 120, "it to leave the batch")
    wait_for(lambda: page.locator(f'#requests tr[data-id="{watched}"]').count() == 0, 10, "its row to go")
    traffic.join(timeout=300)
    wait_for(lambda: page.evaluate(f"{DASH}.heldBlocks()") == 0, 20, "every block to return")
    states = {page.evaluate(f"{DASH}.blockState({b})") for b in blocks}
    assert states <= {"free", "evictable"}, states
    # The header is drawn at the page's next redraw after the last update (at most 1/fps later).
    wait_for(lambda: page.inner_text("#count-running") == "0", 5, "the header to show none running")
    assert metric(live_server, "num_requests_running") == 0
    assert page.evaluate(f"{DASH}.error()") is None
    page.close()


def test_stream_and_page_want_the_api_key(live_server) -> None:
    assert httpx.get(f"{live_server}/dashboard").status_code == 401
    assert httpx.get(f"{live_server}/dashboard?api_key=wrong").status_code == 401
    assert httpx.get(f"{live_server}/debug/stream").status_code == 401
    page = httpx.get(f"{live_server}/dashboard?api_key={KEY}")
    assert page.status_code == 200 and "conveyorDashboard" in page.text
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("GET", f"{live_server}/debug/stream", headers=headers, timeout=10) as response:
        assert response.status_code == 200
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
    keyframe = json.loads(first.removeprefix("data: "))
    assert keyframe["keyframe"] and keyframe["config"]["max_num_seqs"] == 4 and "num_running" in keyframe["stats"]


@contextlib.contextmanager
def replay_server(trace: Path) -> Iterator[str]:
    port = free_port()
    command = [sys.executable, "-m", "conveyor.entrypoints.cli", "dashboard", str(trace), "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            assert process.poll() is None, process.stdout.read()
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{base}/dashboard", timeout=1).status_code == 200
            return False

        wait_for(up, 30, "the replay server")
        yield base
    finally:
        process.terminate()
        process.wait(timeout=10)


def simulated_trace(trace: Path, *flags: str) -> int:
    """A simulated Llama-2-7B on an A100 (``flags``: the workload) writes ``trace``; the steps it holds."""
    subprocess.run([sys.executable, "-m", "conveyor.entrypoints.cli", "simulate", "--hardware", "A100-80GB",
                    "--model-config", "Llama-2-7B", *flags, "--trace", str(trace)], check=True, capture_output=True)
    return len(trace.read_text().splitlines()) - 1


@contextlib.contextmanager
def replayed_page(browser, trace: Path) -> Iterator:
    """The dashboard replaying ``trace``, loaded, in a new page (closed after)."""
    with replay_server(trace) as base:
        page = browser.new_page()
        page.goto(f"{base}/dashboard")
        wait_for(lambda: page.evaluate(f"{DASH}.loadMs()") is not None, 60, "the trace to load")
        try:
            yield page
        finally:
            page.close()


def test_a_replayed_trace_shows_each_requests_drafts(browser, tmp_path) -> None:
    """A simulated run with speculative decoding: the requests table's drafts column counts, for each request,
    the drafts accepted of those carried up to the step shown."""
    profile, trace = tmp_path / "profile.json", tmp_path / "spec.jsonl"
    profile.write_text(json.dumps({"proposal_lengths": [0.5, 0, 0, 0, 0.5], "acceptance": [0.8, 0.6, 0.4, 0.2]}))
    num_steps = simulated_trace(trace, "--num-requests", "40", "--request-rates", "5", "--speculative-config",
                                '{"method": "ngram"}', "--acceptance-profile", str(profile))
    with replayed_page(browser, trace) as page:
        page.evaluate(f"{DASH}.seek({num_steps // 2})")
        column = "Array.from(document.querySelectorAll('#requests tbody td:nth-child(10)'), td => td.textContent)"
        wait_for(lambda: any(re.fullmatch(r"\d+/\d+", cell) for cell in page.evaluate(column)), 10, "drafts")
        assert page.evaluate(f"{DASH}.error()") is None


def test_a_replayed_trace_shows_every_step_of_the_file(browser, tmp_path) -> None:
    trace = tmp_path / "sim.jsonl"
    num_steps = simulated_trace(trace, "--num-requests", "300", "--request-rates", "20")
    with replayed_page(browser, trace) as page:
        assert page.evaluate(f"{DASH}.stepCount()") == num_steps
        page.evaluate(f"{DASH}.seek({num_steps})")
        wait_for(lambda: page.inner_text("#replay-position") == f"step {num_steps} of {num_steps}", 10, "the end")
        assert page.evaluate(f"{DASH}.heldBlocks()") == 0  # every request finished: every block returned
        # The same file, opened from the page's file picker.
        page.set_input_files("#trace-input", str(trace))
        wait_for(lambda: "loaded" in page.inner_text("#status"), 60, "the picked file to load")
        assert page.evaluate(f"{DASH}.stepCount()") == num_steps
        assert page.evaluate(f"{DASH}.error()") is None
