"""What watching costs: `conveyor bench serve` output tokens/s with /dashboard open in Chromium, and without.

    .venv/bin/python bench/dashboard_cost.py --pairs 3            # one server, runs alternating off / on

One server serves every run; runs alternate (off-on, on-off, ...) between no watcher and the page open and
streaming (a headless Chromium on /dashboard, drawing every update), so drift of a shared machine hits both alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from dashboard_screenshot import wait_until_up


def bench_serve(base: str, args: argparse.Namespace) -> float:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "figures.json"
        subprocess.run([sys.executable, "-m", "conveyor.entrypoints.cli", "bench", "serve", "--base-url", base,
                        "--num-prompts", str(args.num_prompts), "--output-len", args.output_len,
                        "--json", str(out)], check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["output_tokens_per_s"]


def run(browser, base: str, args: argparse.Namespace, watching: bool) -> float:
    """One bench serve run, with the dashboard open in a page or not."""
    if not watching:
        return bench_serve(base, args)
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    page.goto(f"{base}/dashboard")
    figure = bench_serve(base, args)
    updates, error = page.evaluate("[window.conveyorDashboard.updates(), window.conveyorDashboard.error()]")
    page.close()
    print(f"  (the page drew {updates} updates{'; error: ' + error if error else ''})", flush=True)
    return figure


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--port", type=int, default=8767)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", default="8,256")
    # Prefix caching off: every run repeats the same seeded prompts, which later runs would find cached.
    parser.add_argument("serve_args", nargs="*", default=["--max-num-seqs", "32", "--no-enable-prefix-caching"])
    args = parser.parse_args()
    chromium = os.environ.get("CONVEYOR_CHROMIUM") or shutil.which("chromium")
    if chromium is None:
        raise SystemExit("Chromium is missing: run `make install` or `apt-get install -y chromium`")
    from playwright.sync_api import sync_playwright

    base = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([sys.executable, "-m", "conveyor.entrypoints.cli", "serve", "--port", str(args.port),
                               *args.serve_args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    figures: dict[str, list[float]] = {"off": [], "on": []}
    try:
        wait_until_up(base, server)
        bench_serve(base, argparse.Namespace(num_prompts=4, output_len="8,16"))  # warm-up
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            for pair in range(args.pairs):
                for watching in (False, True) if pair % 2 == 0 else (True, False):  # off-on, then on-off
                    figures["on" if watching else "off"].append(run(browser, base, args, watching))
                print(f"off {figures['off'][-1]:.1f}  on {figures['on'][-1]:.1f} output tok/s", flush=True)
            browser.close()
    finally:
        server.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=40)
    off, on = (sum(v) / len(v) for v in (figures["off"], figures["on"]))
    print(f"mean: off {off:.1f}, on {on:.1f} output tok/s; on / off = {on / off:.3f} ({(on / off - 1) * 100:+.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
