"""The chat page at ``/``: talk to the served models from a browser, through the server's own API.

The page is the same few kilobytes for everyone and holds nothing of the server's: no model, no key, no
conversation (those stay in the browser). So it is served without the API key, unlike every other route but
``/health``: a browser opening it cannot send the header, and a page that opened only with the key in its
address could never ask for a missing one. Every call the page then makes (``/v1/models``,
``/v1/chat/completions``) goes through the key check as any client's does; the page sends the key it was given
as ``?api_key=`` (or that the user typed in when a call was refused) as ``Authorization: Bearer``.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from conveyor.viz.chat import chat_page

CHAT_PAGE_PATHS = ("/",)  # served without the key (the page's own calls need it)


def add_chat_page_route(app: FastAPI) -> None:
    """``GET /``: the page, with a policy that lets it run only its own script and call only this server."""

    @app.get("/", include_in_schema=False)
    async def chat() -> HTMLResponse:
        page = chat_page()
        headers = {"Content-Security-Policy": page.content_security_policy, "Referrer-Policy": "no-referrer",
                   "Cache-Control": "no-cache"}
        return HTMLResponse(page.html, headers=headers)
