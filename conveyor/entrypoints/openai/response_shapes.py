"""The shapes of the OpenAI API's answers: a whole completion or chat completion, its streamed chunks, and the
usage they report; vLLM's echo (the prompt, or the assistant's final message, ahead of the text)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from conveyor.engine import RequestOutput
from conveyor.entrypoints.openai.logprob_format import LogprobFormatter
from conveyor.entrypoints.openai.reasoning import ReasoningParser, count_reasoning_tokens, read, split
from conveyor.entrypoints.openai.tool_calls import ForcedToolCalls, ToolCallStream, call_delta, whole_call
from conveyor.entrypoints.openai.tool_calls import finish_reason as tool_finish_reason
from conveyor.entrypoints.openai.tool_parsers import AutoToolStream, parse


def _prompts(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """One output per prompt of an answer (its n choices share their prompt)."""
    return list({o.request_id: o for o in outputs}.values())


def usage(outputs: list[RequestOutput]) -> dict[str, Any]:
    """A response's usage: each prompt once, the completion tokens of all its choices."""
    prompts = _prompts(outputs)
    prompt = sum(len(o.prompt_token_ids) for o in prompts)
    completion = sum(len(o.token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens for o in prompts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def timings(outputs: list[RequestOutput]) -> dict[str, Any]:
    """llama.cpp's ``timings`` of a whole answer, under its names: the prompt's computing (from its first step to
    the first token) and the output's (first token to last), so a client can tell time to first token from a
    response that was not streamed."""
    prompts = _prompts(outputs)
    starts = [o.metrics.first_scheduled_time for o in prompts]
    firsts = [o.metrics.first_token_time for o in outputs]
    ends = [o.metrics.finish_time for o in outputs]
    if None in starts or None in firsts or None in ends:
        return {}
    prompt_n = sum(len(o.prompt_token_ids) - o.num_cached_tokens for o in prompts)
    predicted_n = sum(len(o.token_ids) for o in outputs)
    prompt_ms = max(first - start for first, start in zip(firsts, starts)) * 1000
    predicted_ms = (max(ends) - min(firsts)) * 1000
    return {"timings": {
        "cache_n": sum(o.num_cached_tokens for o in prompts), "prompt_n": prompt_n, "prompt_ms": prompt_ms,
        "prompt_per_second": prompt_n / prompt_ms * 1000 if prompt_ms > 0 else None,
        "predicted_n": predicted_n, "predicted_ms": predicted_ms,
        "predicted_per_second": predicted_n / predicted_ms * 1000 if predicted_ms > 0 else None}}


class ResponseShape:
    """One answer's shape, whole (``full``) or chunk by chunk (``chunk``), for the completion and chat
    endpoints: the envelope, echo, and the usage chunk that ends a stream."""

    object_full = ""
    object_chunk = ""

    def __init__(self, request_id: str, model: str, logprobs: LogprobFormatter, echo: bool = False,
                 prompt_logprobs: bool = False, return_token_ids: bool = False) -> None:
        self.request_id, self.model, self.created = request_id, model, int(time.time())
        self.logprobs, self.echo, self.prompt_logprobs = logprobs, echo, prompt_logprobs
        self.return_token_ids = return_token_ids
        self._echoed: set[int] = set()  # choices whose stream has sent what echo repeats
        self._prompts_sent: set[int] = set()  # choices whose stream has sent their prompt_logprobs
        self._tokens_sent: dict[int, int] = {}  # per streamed choice, output token ids already sent

    def token_part(self, output: RequestOutput, streamed: bool = False) -> dict[str, Any]:
        """vLLM's ``return_token_ids``: a choice's output token ids (a chunk's: those it adds), where asked."""
        if not self.return_token_ids:
            return {}
        start = self._tokens_sent.get(output.index, 0) if streamed else 0
        self._tokens_sent[output.index] = len(output.token_ids)
        return {"token_ids": output.token_ids[start:]}

    def prompt_ids_part(self, output: RequestOutput) -> dict[str, Any]:
        """vLLM's ``prompt_token_ids`` beside the output's, where ``return_token_ids`` asked."""
        return {"prompt_token_ids": output.prompt_token_ids} if self.return_token_ids else {}

    def prompt_part(self, output: RequestOutput, streamed: bool = False) -> dict[str, Any]:
        """vLLM's ``prompt_logprobs`` field, where the client asked: in the whole answer, or in the first chunk
        of a choice after its prompt is computed."""
        if not self.prompt_logprobs or (streamed and (output.index in self._prompts_sent
                                                      or output.prompt_logprobs is None)):
            return {}
        self._prompts_sent.add(output.index)
        return {"prompt_logprobs": self.logprobs.prompt(output)}

    def echoed_text(self, output: RequestOutput, text: str) -> str:
        """``text`` after what echo repeats, in a full answer or a choice's first chunk."""
        if not self.echo or output.index in self._echoed:
            return text
        self._echoed.add(output.index)
        return self.echo_of(output) + text

    def echo_of(self, output: RequestOutput) -> str:
        """What echo repeats ahead of a choice's text."""
        raise NotImplementedError

    def full(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        """The whole answer from every choice's final output."""
        raise NotImplementedError

    def chunk(self, output: RequestOutput, is_first: bool) -> dict[str, Any]:
        """One streamed chunk: what ``output`` adds to its choice (``is_first``: the choice's first)."""
        raise NotImplementedError

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def usage(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        return usage(outputs)

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        return self._envelope(self.object_chunk, []) | {"usage": self.usage(outputs)}


class CompletionShape(ResponseShape):
    object_full = object_chunk = "text_completion"

    def echo_of(self, output: RequestOutput) -> str:
        """The choice's prompt (each prompt of several has its own)."""
        if output.prompt is not None:
            return output.prompt
        return self.logprobs.tokenizer_decode(output.prompt_token_ids)

    def full(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = [{"index": o.index, "text": self.echoed_text(o, o.text), "finish_reason": o.finish_reason,
                    "logprobs": self.logprobs.completion_full(o, self.echo), "stop_reason": o.stop_reason}
                   | self.prompt_part(o) | self.prompt_ids_part(o) | self.token_part(o) for o in outputs]
        return self._envelope(self.object_full, choices) | {"usage": usage(outputs)} | timings(outputs)

    def chunk(self, output: RequestOutput, is_first: bool) -> dict[str, Any]:
        choice = {"index": output.index, "text": self.echoed_text(output, output.delta_text),
                  "finish_reason": output.finish_reason, "logprobs": self.logprobs.completion_delta(output, self.echo)}
        return self._envelope(self.object_chunk, [choice | self.prompt_part(output, streamed=True)
                                                  | self.token_part(output, streamed=True)])


class ChatShape(ResponseShape):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, logprobs: LogprobFormatter, echoed: str | None = None,
                 tools: ForcedToolCalls | None = None, prompt_logprobs: bool = False,
                 auto_tools: str | None = None, return_token_ids: bool = False,
                 reasoning: Callable[[], ReasoningParser] | None = None) -> None:
        """``echoed``: the text every choice starts with (vLLM's echo: the assistant's final message), if any;
        ``tools``: the calls tool_choice forces, which the choices' text is read back as; ``auto_tools``: the
        parser (tool_parsers.py) that reads the calls the model chose to make out of its text; ``reasoning``:
        what makes the parser (reasoning.py) that splits the reasoning off, ahead of the tool-call parser, which
        sees only the content. prompt_logprobs go at the top, as vLLM puts them (the choices share the
        prompt)."""
        super().__init__(request_id, model, logprobs, echo=echoed is not None, prompt_logprobs=prompt_logprobs,
                         return_token_ids=return_token_ids)
        self._echoed_text = echoed or ""
        self.tools = tools
        self.auto_tools = auto_tools
        self._tool_streams: dict[int, ToolCallStream] = {}  # per streamed choice, with tools
        self._auto_streams: dict[int, AutoToolStream] = {}  # per streamed choice, with auto_tools
        self.reasoning = reasoning
        self._reasoning_streams: dict[int, ReasoningParser] = {}  # per streamed choice, with reasoning

    def echo_of(self, output: RequestOutput) -> str:
        return self._echoed_text

    def full(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = [{"index": o.index, **self._message(o), "stop_reason": o.stop_reason,
                    "logprobs": None if o.logprobs is None else self.logprobs.chat(o.logprobs)} | self.token_part(o)
                   for o in outputs]
        return (self._envelope(self.object_full, choices) | self.prompt_part(outputs[0])
                | self.prompt_ids_part(outputs[0]) | {"usage": self.usage(outputs)} | timings(outputs))

    def usage(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        """With a reasoning parser, OpenAI's completion_tokens_details.reasoning_tokens too."""
        if self.reasoning is None:
            return usage(outputs)
        spent = sum(count_reasoning_tokens(self.reasoning, o.token_ids, self.logprobs.tokenizer_decode)
                    for o in outputs)
        return usage(outputs) | {"completion_tokens_details": {"reasoning_tokens": spent}}

    def _message(self, output: RequestOutput) -> dict[str, Any]:
        """A whole choice's message and finish_reason: its text (its reasoning apart, with a reasoning parser),
        or the tool calls it made."""
        if self.reasoning is not None and self.tools is None:
            reasoning, text = split(self.reasoning, output.text)
            message = self._text_message(output, text or "")
            message["message"] = message["message"] | {"reasoning_content": reasoning}
            return message
        return self._text_message(output, output.text)

    def _text_message(self, output: RequestOutput, text: str) -> dict[str, Any]:
        """The message of a reply's text (its content, where a reasoning parser took the reasoning)."""
        if self.auto_tools is not None:
            content, parsed = parse(self.auto_tools, text)
            calls = [whole_call(call.name, call.arguments) for call in parsed]
            content = content or None if self.reasoning else content
            message = {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})
            return {"message": message, "finish_reason": tool_finish_reason(bool(calls), output.finish_reason)}
        if self.tools is None:
            content = self.echoed_text(output, text)
            return {"message": {"role": "assistant", "content": content or None if self.reasoning else content},
                    "finish_reason": output.finish_reason}
        calls = self.tools.calls(output.text)
        message = {"role": "assistant", "content": None} | ({"tool_calls": calls} if calls else {})
        return {"message": message, "finish_reason": tool_finish_reason(bool(calls), output.finish_reason)}

    def chunk(self, output: RequestOutput, is_first: bool) -> dict[str, Any]:
        finish_reason = output.finish_reason
        reasoning, text = self._reasoning_delta(output)
        if self.auto_tools is not None:
            delta, finish_reason = self._auto_delta(output, text, is_first)
        elif self.tools is None:
            content = self.echoed_text(output, text)
            delta = {"role": "assistant"} if is_first else {}
            if content or self.reasoning is None:
                delta["content"] = content
        else:
            stream = self._tool_streams.setdefault(output.index, self.tools.stream())
            calls = stream.feed(output.delta_text)
            delta = {"role": "assistant", "content": None} if is_first else {}
            if calls:
                delta["tool_calls"] = calls
            finish_reason = tool_finish_reason(stream.num_calls > 0, finish_reason)
        if reasoning:
            delta["reasoning_content"] = reasoning
        choice = {"index": output.index, "delta": delta, "finish_reason": finish_reason,
                  "logprobs": self.logprobs.chat_delta(output)} | self.token_part(output, streamed=True)
        return self._envelope(self.object_chunk, [choice]) | self.prompt_part(output, streamed=True)

    def _reasoning_delta(self, output: RequestOutput) -> tuple[str, str]:
        """A streamed chunk's (reasoning, rest of the text): ("", its text) without a reasoning parser, or where
        tool_choice forces calls; what the parser held back goes in the last chunk."""
        if self.reasoning is None or self.tools is not None:
            return "", output.delta_text
        parser = self._reasoning_streams.get(output.index)
        if parser is None:
            parser = self._reasoning_streams[output.index] = self.reasoning()
        return read(parser, output.delta_text, ending=output.finish_reason is not None)

    def _auto_delta(self, output: RequestOutput, text: str, is_first: bool) -> tuple[dict[str, Any], str | None]:
        """A streamed chunk's delta where the model may call tools: the content read so far that cannot begin a
        call, and each call once complete; what was held back goes in the last chunk."""
        stream = self._auto_streams.setdefault(output.index, AutoToolStream(self.auto_tools))
        content, parsed = stream.feed(text)
        if output.finish_reason is not None:
            more, last = stream.finish()
            content, parsed = content + more, parsed + last
        first_call = stream.num_calls - len(parsed)
        delta: dict[str, Any] = {"role": "assistant"} if is_first else {}
        if content or is_first:
            delta["content"] = content
        if parsed:
            delta["tool_calls"] = [call_delta(first_call + i, c.name, c.arguments) for i, c in enumerate(parsed)]
        return delta, tool_finish_reason(stream.num_calls > 0, output.finish_reason)
