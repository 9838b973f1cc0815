"""Pictures drawn from scheduler traces (matplotlib, no screen needed), and the server's pages: the dashboard
(``dashboard/``) and the chat page (``chat/``), which share the scripts at this level (``sse.js``: server-sent
events read from a fetch body)."""

from __future__ import annotations

import functools
from importlib.resources import files


@functools.cache
def shared_script(name: str) -> str:
    """A script both pages inline (they are one response each, and load nothing else)."""
    return files(__name__).joinpath(name).read_text(encoding="utf-8")
