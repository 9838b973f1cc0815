"""The dashboard page: hand-written HTML, CSS and JavaScript shipped inside the package (no CDN, no build step).

``model.js`` turns step records and live deltas into compact per-step arrays
and the current block map; ``view.js`` draws them on canvases; ``controls.js``
follows the live stream or replays a trace file, and wires the controls. The
page is one response (scripts and style sheet inlined), so it needs nothing
else from the server but its data.
"""

from __future__ import annotations

import functools
import html
from importlib.resources import files

from conveyor.viz import shared_script


@functools.cache
def _asset(name: str) -> str:
    return files(__name__).joinpath(name).read_text(encoding="utf-8")


def dashboard_page(trace_url: str = "", trace_name: str = "") -> str:
    """The page; with ``trace_url`` it replays that trace file, without it it follows ``/debug/stream``."""
    page = _asset("index.html")
    for placeholder, value in (
        ("{{STYLE}}", _asset("dashboard.css")),
        ("{{SCRIPT}}", "\n".join([shared_script("sse.js"),
                                   *(_asset(name) for name in ("model.js", "view.js", "controls.js"))])),
        ("{{TRACE_URL}}", html.escape(trace_url, quote=True)),
        ("{{TRACE_NAME}}", html.escape(trace_name, quote=True)),
    ):
        page = page.replace(placeholder, value)
    return page
