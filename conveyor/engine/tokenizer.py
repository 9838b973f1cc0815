"""Text <-> token ids, the chat template, and incremental detokenization for streams and stop strings."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# Tokenizers ship inside the model folder; never reach for a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# Tokens of prompt context kept ahead of the output, so that a tokenizer that
# decides spacing from the previous token decodes the first output token right.
_CONTEXT_TOKENS = 6


class Tokenizer:
    def __init__(self, folder: str | Path) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(folder))
        self.eos_token_id: int | None = self._tok.eos_token_id
        self.vocab_size = len(self._tok)

    @property
    def hf_tokenizer(self) -> Any:
        """The transformers tokenizer underneath (xgrammar builds its token table from it)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        if not self._tok.chat_template:
            raise ValueError("messages: this model has no chat template; send a plain prompt instead")
        from jinja2 import TemplateError

        try:
            ids = self._tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        except TemplateError as error:  # the template refused these messages (roles, order, ...)
            raise ValueError(f"messages: the chat template refused them: {error}") from None
        # Newer transformers return a BatchEncoding here, older ones a plain list.
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas.

    It decodes a short window and emits only the text past what the window
    already produced, holding back a trailing partial UTF-8 character.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = decode(self._ids[self._prefix_offset :], self._skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta
