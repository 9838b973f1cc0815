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
