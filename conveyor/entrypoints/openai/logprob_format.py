"""Logprobs in OpenAI's two shapes: chat's ``{"content": [{token, logprob, bytes, top_logprobs}]}`` and the
legacy completions' ``{tokens, token_logprobs, top_logprobs, text_offset}``; and what a stream has not
sent yet, per choice, so the streamed chunks add up to the whole answer.
"""

from __future__ import annotations

from typing import Any

from conveyor.core.logprobs import TokenLogprob
from conveyor.engine import RequestOutput
from conveyor.engine.tokenizer import Tokenizer


class LogprobFormatter:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}  # token id -> its text, decoded once per response
        self._sent: dict[int, tuple[int, int]] = {}  # choice index -> (entries streamed, text offset)

    def tokenizer_decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids)

    def token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    # ----- chat ---------------------------------------------------------------

    def chat(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        return {"content": [self._chat_entry(entry) for entry in entries], "refusal": None}

    def _chat_entry(self, entry: TokenLogprob) -> dict[str, Any]:
        text = self.token_text(entry.token_id)
        top = [{"token": (t := self.token_text(token)), "logprob": value, "bytes": list(t.encode())}
               for token, value in entry.top]
        return {"token": text, "logprob": entry.logprob, "bytes": list(text.encode()), "top_logprobs": top}

    def chat_delta(self, output: RequestOutput) -> dict[str, Any] | None:
        """The entries of ``output``'s choice not streamed yet (None when it did not ask for logprobs)."""
        if output.logprobs is None:
            return None
        sent, offset = self._sent.get(output.index, (0, 0))
        self._sent[output.index] = (len(output.logprobs), offset)
        return self.chat(output.logprobs[sent:])

    # ----- vLLM's prompt_logprobs -----------------------------------------------

    def prompt(self, output: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's ``prompt_logprobs``: per prompt position, None for the first (nothing predicts it), else
        ``{token id: {logprob, rank, decoded_token}}`` for the prompt's token and its top alternatives; None
        until the whole prompt is computed."""
        if output.prompt_logprobs is None:
            return None
        return [None if entry is None else self._prompt_entry(entry) for entry in output.prompt_logprobs]

    def _prompt_entry(self, entry: TokenLogprob) -> dict[str, dict[str, Any]]:
        found = {str(entry.token_id): {"logprob": entry.logprob, "rank": entry.rank,
                                       "decoded_token": self.token_text(entry.token_id)}}
        for rank, (token, value) in enumerate(entry.top, 1):
            found.setdefault(str(token), {"logprob": value, "rank": rank, "decoded_token": self.token_text(token)})
        return found

    # ----- completions ----------------------------------------------------------

    def completion(self, token_ids: list[int], entries: list[TokenLogprob | None], offset: int = 0) -> dict[str, Any]:
        """``entries[i]`` is token_ids[i]'s (None for a prompt's first token, which nothing predicts)."""
        tokens = [self.token_text(token) for token in token_ids]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [None if e is None else {self.token_text(t): v for t, v in e.top} for e in entries],
            "text_offset": offsets,
        }

    def completion_full(self, output: RequestOutput, echo: bool) -> dict[str, Any] | None:
        if output.logprobs is None:
            return None
        token_ids, entries = self._with_prompt(output, echo, [e.token_id for e in output.logprobs])
        return self.completion(token_ids, entries)

    def completion_delta(self, output: RequestOutput, echo: bool) -> dict[str, Any] | None:
        if output.logprobs is None:
            return None
        first = output.index not in self._sent
        sent, offset = self._sent.get(output.index, (0, 0))
        new = output.logprobs[sent:]
        token_ids, entries = [e.token_id for e in new], list(new)
        if first:
            token_ids, entries = self._with_prompt(output, echo, token_ids, entries)
        formatted = self.completion(token_ids, entries, offset)
        offset += sum(len(text) for text in formatted["tokens"])
        self._sent[output.index] = (len(output.logprobs), offset)
        return formatted

    @staticmethod
    def _with_prompt(
        output: RequestOutput, echo: bool, token_ids: list[int], entries: list[TokenLogprob | None] | None = None
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        entries = list(output.logprobs or []) if entries is None else entries
        if echo and output.prompt_logprobs is not None:
            return [*output.prompt_token_ids, *token_ids], [*output.prompt_logprobs, *entries]
        return token_ids, entries
