"""The server's ASGI layers, outside FastAPI: a Host allow-list, an API key on every route but the open ones,
and a cap on the request body's size (declared or chunked) and on the time to send it; each refuses before the
body reaches FastAPI, in the error shape of the API called: OpenAI's, or under ``/api/`` Ollama's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json

# Ollama's API (conveyor.entrypoints.ollama) lies under this path; its clients read an error as {"error": message}.
OLLAMA_PATH = "/api/"


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def _send_error(send, scope, status: int, message: str, kind: str, code: str | None,
                      headers: dict[str, str] | None = None) -> None:
    """An error answered straight from an ASGI middleware, in the shape of the API the path belongs to."""
    ollama = scope.get("path", "").startswith(OLLAMA_PATH)
    body = json.dumps({"error": message} if ollama else error_body(message, kind, code=code)).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    head += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


async def _drain(receive, limit: int) -> None:
    """Read and drop the rest of a refused body (up to ``limit`` bytes, for up to 5 s): a socket closed with
    unread data resets the connection, and the client would lose the answer before reading it."""
    received = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(5):
            while received <= limit:
                message = await receive()
                if message["type"] != "http.request":
                    return
                received += len(message.get("body", b""))
                if not message.get("more_body"):
                    return


_GONE = object()  # what BodyLimit._read returns for a client that disconnected mid-body


class BodyLimit:
    """ASGI middleware: refuse a body over the limit with 413, whether it declares its length or comes chunked,
    and one not sent whole within ``read_timeout`` seconds with 408, closing the connection (60 connections
    that declared 1,000 bytes and sent 10 once all stayed open).

    The body is read here, before FastAPI sees it, and handed on whole: an error raised from inside FastAPI's
    own reading would turn into its 400 "error parsing the body" instead.
    """

    def __init__(self, app, limit: int, read_timeout: float = 30.0) -> None:
        self.app, self.limit, self.read_timeout = app, limit, read_timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, receive, send)
        try:
            async with asyncio.timeout(self.read_timeout):
                chunks = await self._read(receive)
        except TimeoutError:  # a slow sender (or one that never finishes) holds a connection: end it
            return await _send_error(send, scope, 408,
                                     f"the request body did not arrive within {self.read_timeout:g} s",
                                     "invalid_request_error", "request_timeout", {"Connection": "close"})
        if chunks is None:
            return await self._refuse(scope, receive, send)
        if chunks is _GONE:
            return  # the client left before it finished sending
        body, handed = b"".join(chunks), False

        async def replay():
            nonlocal handed
            if handed:
                return await receive()  # after the body: the disconnect, when it comes
            handed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _read(self, receive) -> list[bytes] | object | None:
        """The body's chunks; None when it grows over the limit, _GONE when the client left first."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return _GONE
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body"):
                return chunks

    async def _refuse(self, scope, receive, send) -> None:
        await _drain(receive, 4 * self.limit)
        await _send_error(send, scope, 413, f"request body is over the limit of {self.limit} bytes",
                          "invalid_request_error", "request_too_large")


def carries_key(headers, api_key: str | None) -> bool:
    """Whether ASGI ``headers`` carry ``Authorization: Bearer api_key`` (always, when no key is set); compared in
    constant time."""
    if api_key is None:
        return True
    header = dict(headers or []).get(b"authorization", b"")
    scheme, _, token = header.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), api_key.encode())


class APIKeyAuth:
    """ASGI middleware: every route needs ``Authorization: Bearer KEY`` except those in ``open_paths``.

    Outermost, so that nothing (not even the body) is read for a caller without the key; the key is compared
    in constant time.
    """

    def __init__(self, app, api_key: str, open_paths: frozenset[str], drain_limit: int) -> None:
        self.app, self._key, self.open_paths, self.drain_limit = app, api_key, open_paths, drain_limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths or carries_key(scope.get("headers"),
                                                                                       self._key):
            return await self.app(scope, receive, send)
        await _drain(receive, self.drain_limit)
        await _send_error(send, scope, 401, "invalid or missing API key (send Authorization: Bearer KEY)",
                          "authentication_error", "invalid_api_key", {"WWW-Authenticate": "Bearer"})


class HostAllowList:
    """ASGI middleware: answer only requests whose Host header names one of ``allowed_hosts`` (the port aside).

    Without an API key, a web page a user visits could otherwise rebind its own name to 127.0.0.1 and reach
    the server from the user's browser (DNS rebinding): the Host header is still the page's name.
    """

    def __init__(self, app, allowed_hosts: frozenset[str]) -> None:
        self.app, self.allowed_hosts = app, frozenset(host.lower() for host in allowed_hosts)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or "*" in self.allowed_hosts or self._host(scope) in self.allowed_hosts:
            return await self.app(scope, receive, send)
        await _drain(receive, 1 << 20)
        await _send_error(send, scope, 421, "this server does not answer for that Host (see --allowed-hosts)",
                          "invalid_request_error", "host_not_allowed")

    @staticmethod
    def _host(scope) -> str:
        host = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1").lower()
        return host[: host.index("]") + 1] if host.startswith("[") else host.rsplit(":", 1)[0]
