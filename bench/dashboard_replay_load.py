"""How long a trace takes to load into the dashboard page, and the longest the page went without answering.

    .venv/bin/conveyor simulate --hardware A100-80GB --model-config Llama-2-13B --workload sharegpt \\
        --num-requests 100000 --request-rates 5 --trace traces/sim-100k.jsonl
    .venv/bin/python bench/dashboard_replay_load.py traces/sim-100k.jsonl

It serves the file with `conveyor dashboard`, opens the page in headless Chromium, waits for the load, then
plays it for a few seconds at the highest speed and prints the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--port", type=int, default=8766)
    args = parser.parse_args()
    chromium = os.environ.get("CONVEYOR_CHROMIUM") or shutil.which("chromium")
    if chromium is None:
        raise SystemExit("Chromium is missing: run `make install` or `apt-get install -y chromium`")
    base = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([sys.executable, "-m", "conveyor.entrypoints.cli", "dashboard", args.trace,
                               "--port", str(args.port)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        for _ in range(100):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/dashboard", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        measure(chromium, f"{base}/dashboard", Path(args.trace))
    finally:
        server.terminate()
        server.wait(timeout=10)
    return 0


def measure(chromium: str, url: str, trace: Path) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-dev-shm-usage"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        dash = "window.conveyorDashboard"
        began = time.monotonic()
        page.goto(url)
        while page.evaluate(f"{dash}.loadMs()") is None:
            if page.evaluate(f"{dash}.error()"):
                raise SystemExit(page.evaluate(f"{dash}.error()"))
            time.sleep(0.5)
        wall = time.monotonic() - began
        load_stall = page.evaluate(f"{dash}.maxStallMs()")
        print(f"trace: {trace} ({trace.stat().st_size / 1e6:.0f} MB), steps: {page.evaluate(f'{dash}.stepCount()')}")
        print(f"load: {page.evaluate(f'{dash}.loadMs()') / 1000:.1f} s in the page ({wall:.1f} s from opening it)")
        print(f"longest stall while loading: {load_stall:.0f} ms")
        page.click("#requests tbody tr >> nth=0")  # a selected request: the costliest drawing
        for speed in ("60", "20000"):
            page.select_option("#speed", speed)
            start = page.evaluate(f"{dash}.playhead()")
            time.sleep(5)
            played = page.evaluate(f"{dash}.playhead()") - start
            print(f"playing at {speed} steps/s: {played / 5:.0f} steps/s shown; slowest frame so far: "
                  f"{page.evaluate(f'{dash}.maxRenderMs()'):.0f} ms; longest stall so far: "
                  f"{page.evaluate(f'{dash}.maxStallMs()'):.0f} ms")
        heap = page.evaluate("performance.memory ? performance.memory.usedJSHeapSize : null")
        print(f"JS heap: {(heap or 0) / 1e6:.0f} MB (typed arrays outside it)")
        browser.close()


if __name__ == "__main__":
    sys.exit(main())
