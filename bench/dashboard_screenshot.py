"""Take docs/dashboard.png: a real server under `conveyor bench serve` traffic, its /dashboard in headless Chromium.

    .venv/bin/python bench/dashboard_screenshot.py -o docs/dashboard.png      # or: make dashboard-screenshot

Extra arguments after ``--`` go to ``conveyor serve`` (default: the default model, 32 sequences).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx


def wait_until_up(base: str, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited:\n{process.stdout.read()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        time.sleep(0.5)
    raise SystemExit("the server did not start")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--output", default="docs/dashboard.png")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--watch", type=float, default=40.0, help="seconds of traffic before the screenshot")
    parser.add_argument("serve_args", nargs="*", default=["--max-num-seqs", "32"])
    args = parser.parse_args()
    chromium = os.environ.get("CONVEYOR_CHROMIUM") or shutil.which("chromium")
    if chromium is None:
        raise SystemExit("Chromium is missing: run `make install` or `apt-get install -y chromium`")
    base = f"http://127.0.0.1:{args.port}"
    conveyor = [sys.executable, "-m", "conveyor.entrypoints.cli"]
    server = subprocess.Popen([*conveyor, "serve", "--port", str(args.port), *args.serve_args],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    traffic = None
    try:
        wait_until_up(base, server)
        traffic = subprocess.Popen([*conveyor, "bench", "serve", "--base-url", base, "--num-prompts", "200",
                                    "--request-rate", "4", "--output-len", "16,256"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        screenshot(chromium, f"{base}/dashboard", args.output, args.watch)
    finally:
        if traffic is not None:
            traffic.kill()
        server.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=40)
    print(f"wrote {args.output}")
    return 0


def screenshot(chromium: str, url: str, output: str, watch: float) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1100}, device_scale_factor=1)
        page.goto(url)
        time.sleep(watch)
        rows = page.locator("#requests tbody tr")
        if rows.count():
            rows.nth(min(3, rows.count() - 1)).click()  # a selected request: its slots and blocks stand out
            time.sleep(1.0)
        page.screenshot(path=output, full_page=True)
        browser.close()


if __name__ == "__main__":
    sys.exit(main())
