"""The scheduler dashboard over HTTP: the page at ``/dashboard``, the live stream at ``/debug/stream``.

``conveyor serve`` adds both to its app; ``conveyor dashboard TRACE.jsonl``
serves the same page over a trace file instead, which the page replays. The
stream is server-sent events, one JSON delta per event (see
:mod:`conveyor.observe.live`). Both routes want the server's API key, as every
route does; since a browser cannot send a header when it opens a page, the
key may also come as ``?api_key=`` (the page then sends it as a header).
With several models, ``?model=NAME`` picks the one watched (the first by
default), and every event names it.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse

from conveyor.engine import LiveViewUnavailable
from conveyor.engine.model_pool import ModelPool
from conveyor.observe.live import delta_as_json_ready
from conveyor.viz.dashboard import dashboard_page

TRACE_ROUTE = "/dashboard/trace.jsonl"
DASHBOARD_PATHS = ("/dashboard", "/debug/stream")  # they check the API key themselves (header or query)


def add_dashboard_routes(app: FastAPI, models: ModelPool, api_key: str | None) -> None:
    """``GET /dashboard`` (the page, live) and ``GET /debug/stream`` (its events), behind ``api_key``."""

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard(request: Request) -> Response:
        return _refusal(request, api_key) or HTMLResponse(dashboard_page())

    @app.get("/debug/stream", include_in_schema=False)
    async def stream(request: Request) -> Response:
        refused = _refusal(request, api_key)
        if refused is not None:
            return refused
        asked = request.query_params.get("model") or models.default_name()
        name = models.reported_name(asked)
        if name is None:
            return _error(404, models.not_served(asked), "model_not_found")
        engine = models.loaded().get(name)
        if engine is None:  # watching does not load a model: its first request does
            return _error(503, f"model {name!r} is not loaded now; it loads on its next request", "model_not_loaded")
        try:
            deltas = engine.watch()
        except LiveViewUnavailable as why:  # replicas (--data-parallel-size > 1): no one scheduler to show
            return _error(501, str(why), "not_supported")
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        label = {"model": name} if models.several else {}  # one model: the events are what they always were
        return StreamingResponse(_events(deltas, label), media_type="text/event-stream", headers=headers)


def _error(status: int, message: str, code: str) -> JSONResponse:
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}},
                        status_code=status)


async def _events(deltas: AsyncIterator[dict[str, Any]], label: dict[str, str]) -> AsyncIterator[str]:
    async for delta in deltas:
        yield f"data: {json.dumps(delta_as_json_ready(delta) | label, separators=(',', ':'))}\n\n"


def _refusal(request: Request, api_key: str | None) -> Response | None:
    """A 401 in OpenAI's error shape unless the request carries the key (header, or ``api_key`` in the query)."""
    if not api_key:
        return None
    header = request.headers.get("authorization", "")
    given = header.removeprefix("Bearer ") if header.startswith("Bearer ") else request.query_params.get("api_key", "")
    if hmac.compare_digest(given.encode(), api_key.encode()):
        return None
    error = {"message": "invalid or missing API key", "type": "authentication_error", "param": None,
             "code": "invalid_api_key"}
    return JSONResponse({"error": error}, status_code=401)


def replay_app(trace: Path) -> FastAPI:
    """The page over one trace file: it fetches the file and replays it step by step."""
    if not trace.is_file():
        raise FileNotFoundError(f"no trace file at {trace}")
    app = FastAPI(title="Conveyor dashboard", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/")
    async def root() -> Response:
        return RedirectResponse("/dashboard")

    @app.get("/dashboard")
    async def dashboard() -> Response:
        return HTMLResponse(dashboard_page(trace_url=TRACE_ROUTE, trace_name=trace.name))

    @app.get(TRACE_ROUTE)
    async def trace_file() -> Response:
        return FileResponse(trace, media_type="application/x-ndjson")

    return app


def serve_replay(trace: str, host: str, port: int) -> int:
    """``conveyor dashboard TRACE.jsonl``: serve the replay page until Ctrl-C."""
    import uvicorn

    app = replay_app(Path(trace))
    print(f"Replaying {trace} on http://{host}:{port}/dashboard  (Ctrl-C stops)", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
    return 0
