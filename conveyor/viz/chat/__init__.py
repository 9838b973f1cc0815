"""The chat page: hand-written HTML, CSS and JavaScript shipped inside the package (no CDN, no build step).

``conversation.js`` keeps the conversation, the chosen model and the sampling settings in the browser's
localStorage; ``api.js`` calls the server (the API key as a header, errors put in words, a streamed answer read
from server-sent events); ``chat.js`` draws the turns and wires the controls. The page is one response, its
script and style sheet inlined, so it needs nothing else from the server but the API; the hashes of those two
let the page's Content-Security-Policy allow them and nothing else.
"""

from __future__ import annotations

import base64
import functools
import hashlib
from dataclasses import dataclass
from importlib.resources import files

from conveyor.viz import shared_script

SCRIPTS = ("conversation.js", "api.js", "chat.js")


@dataclass(frozen=True, slots=True)
class ChatPage:
    html: str
    content_security_policy: str


@functools.cache
def _asset(name: str) -> str:
    return files(__name__).joinpath(name).read_text(encoding="utf-8")


def _digest(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


@functools.cache
def chat_page() -> ChatPage:
    """The page, and the policy that lets it run its own inlined script and style and call its own server only
    (so that text the model writes could never load or send anything elsewhere, were it ever read as markup)."""
    style, script = _asset("chat.css"), "\n".join([shared_script("sse.js"), *(_asset(name) for name in SCRIPTS)])
    page = _asset("index.html").replace("{{STYLE}}", style).replace("{{SCRIPT}}", script)
    policy = (f"default-src 'none'; script-src {_digest(script)}; style-src {_digest(style)}; connect-src 'self'; "
              "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return ChatPage(page, policy)
