"""The error a request's bad field raises, carrying the field's name.

A client is told which field to fix (the ``param`` of an OpenAI-style 400), so the name travels with the
error as data; reading it back out of the message would tie every caller to the wording of every check.
It is a ValueError, so code that only needs to know "this request is bad" catches it as one.
"""

from __future__ import annotations


class FieldError(ValueError):
    """``field`` (as the API names it: ``max_tokens``, ``messages``, ``structured_output.json``) is wrong;
    the message, meant for the client, says why and usually starts with the field's name."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

    @property
    def reason(self) -> str:
        """The message without a leading ``field:``, to be put under another name."""
        return str(self).removeprefix(f"{self.field}: ")

    def renamed(self, field: str) -> FieldError:
        """The same error under the name the client used for the field (``response_format`` for a
        ``structured_output`` it asked for that way)."""
        return FieldError(field, f"{field}: {self.reason}")


class RequestRefused(Exception):
    """The engine will not queue this request now, though it could take it later: a queue is at its cap
    (``--max-num-queued-requests`` / ``--max-num-queued-tokens``), or the wait ahead of it already misses its
    time-to-first-token target (admission control). Refused before it costs anything, so the client can go
    elsewhere or come back: the server answers 429 with ``Retry-After``; offline, the caller gets this error.

    ``reason`` is the code a client sees (``queue_full``, ``deadline_unattainable``); ``retry_after`` the seconds
    after which the engine expects to have room.
    """

    def __init__(self, reason: str, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after
