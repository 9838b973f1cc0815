"""Ollama's request bodies (``/api/chat``, ``/api/generate``, ``/api/show``), validated by pydantic, and each as
the OpenAI request it runs as: a chat request, or with ``raw`` a completion. The sampling fields, their checks,
structured output, the chat template, tool calls and the reasoning parser are then the OpenAI path's own, and a
field that path refuses is named as the Ollama client sent it (``options.num_predict``, ``format``).

What is not Ollama's own to refuse is ignored, as Ollama ignores it: a body's fields and ``options`` it does not
know, the options that tune how Ollama loads or runs a model (``num_gpu``, ``num_thread``, ``num_batch``, ...;
this server's flags decide those), and ``keep_alive`` (a model stays loaded until the pool needs its room). Each
is logged. What would change the tokens drawn, and what the server cannot do, is refused with a 400 naming it:
mirostat, typical_p and tfs_z other than off, images, a suffix, a template of Ollama's own.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ConfigDict, Field

from conveyor.core.errors import FieldError
from conveyor.core.sampling import MAX_LOGPROBS
from conveyor.engine.request_builder import MaxTokensRule
from conveyor.entrypoints.openai.protocol import MAX_MESSAGES, MAX_TOOLS, Body, ToolDefinition

logger = logging.getLogger("conveyor.server.ollama")

# Ollama's sampling options -> the OpenAI body's fields (vLLM's names where OpenAI has none) they set. An option
# left out takes the OpenAI API's default here, not Ollama's built-in one (temperature 0.8, top_k 40, top_p 0.9,
# repeat_penalty 1.1), so that the two APIs answer one request alike.
SAMPLING_OPTIONS = {"num_predict": "max_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                    "min_p": "min_p", "seed": "seed", "stop": "stop", "repeat_penalty": "repetition_penalty",
                    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
UP_TO_CONTEXT = (-1, -2)  # num_predict: no limit (-1) or fill the context (-2); either way the context's end
THINK_LEVELS = ("high", "medium", "low")  # think as a level: gpt-oss's reasoning_effort

# Where a field of the OpenAI body came from, for its errors: the option, or the body field, that set it.
_CLIENT_FIELDS = {openai: f"options.{option}" for option, openai in SAMPLING_OPTIONS.items()} | {
    "max_completion_tokens": "options.num_predict", "response_format": "format", "guided_json": "format",
    "structured_output": "format", "chat_template_kwargs": "think", "tool_choice": "tools",
}


class Options(Body):
    """``options``: the sampling ones mapped (SAMPLING_OPTIONS), ``num_ctx`` checked, the rest ignored."""

    model_config = ConfigDict(extra="allow")
    num_predict: int | None = None
    num_ctx: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # The sampler has none of these: refused unless off (their values that leave sampling as it is).
    mirostat: int = 0
    typical_p: float = 1.0
    tfs_z: float = 1.0

    def openai_fields(self) -> dict[str, Any]:
        """The OpenAI body's sampling fields these options set (only those given)."""
        for name, off in (("mirostat", 0), ("typical_p", 1.0), ("tfs_z", 1.0)):
            if getattr(self, name) != off:
                raise FieldError(f"options.{name}", f"options.{name}: the sampler has no {name}; leave it at {off} "
                                 "(temperature, top_k, top_p, min_p and the penalties are there)")
        given = {SAMPLING_OPTIONS[name]: getattr(self, name) for name in SAMPLING_OPTIONS
                 if getattr(self, name) is not None}
        if given.get("max_tokens") in UP_TO_CONTEXT:
            del given["max_tokens"]
        elif given.get("max_tokens", 1) < 1:
            raise FieldError("options.num_predict", f"options.num_predict: the most tokens to draw, >= 1, or -1 or "
                             f"-2 for up to the context's end; got {self.num_predict}")
        return given

    def max_tokens_rule(self, default: int | None) -> MaxTokensRule:
        """How a request's max_tokens is settled. As Ollama, num_predict caps the reply and the context's end
        stops it (no refusal past the context, unlike OpenAI's max_tokens); -1 and -2 ask for the room left
        in the context, whatever the server's --default-max-tokens (``default``)."""
        return MaxTokensRule(None if self.num_predict in UP_TO_CONTEXT else default, fit_context=False)

    def check_context(self, max_model_len: int) -> None:
        """num_ctx asks Ollama for a context window of that many tokens. Here the paged KV cache holds only what
        a request uses, so a smaller window saves nothing and is accepted as it is; a larger one than the model
        runs with cannot be given and is refused."""
        if self.num_ctx is not None and self.num_ctx > max_model_len:
            raise FieldError("options.num_ctx", f"options.num_ctx: {self.num_ctx} tokens is more than this model's "
                             f"context of {max_model_len} tokens; ask for at most that")


class FunctionCall(Body):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCall(Body):
    model_config = ConfigDict(extra="allow")
    function: FunctionCall


class Message(Body):
    """A chat message as Ollama sends one: the assistant's earlier thinking and tool calls, a tool's answer
    naming its tool."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str = ""
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None

    def openai_message(self, index: int) -> dict[str, Any]:
        """The message as the OpenAI chat body has it (thinking as reasoning_content, tool_name as name)."""
        if self.images:
            raise FieldError(f"messages.{index}.images", f"messages.{index}.images: no model served here reads "
                             "images; send text only")
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.thinking:
            message["reasoning_content"] = self.thinking
        if self.tool_calls:
            message["tool_calls"] = [{"type": "function", "function": {"name": call.function.name,
                                                                      "arguments": call.function.arguments}}
                                     for call in self.tool_calls]
        if self.tool_name:
            message["name"] = self.tool_name
        return message


class OllamaRequest(Body):
    """What /api/chat and /api/generate share: the model, streaming (on by default, as Ollama), the options,
    ``format``, ``think``, logprobs; unknown fields ignored, as Ollama ignores them."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    stream: bool = True
    format: str | dict[str, Any] | None = None
    options: Options = Field(default_factory=Options)
    keep_alive: float | str | None = None  # accepted; a model stays loaded until the pool needs its room
    think: bool | str | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def log_ignored(self) -> None:
        """Name, in the log, the body's fields and options that change nothing here."""
        fields = sorted((self.model_extra or {}).keys())
        options = sorted((self.options.model_extra or {}).keys())
        if self.keep_alive is not None:
            fields.append("keep_alive")
        if fields or options:
            logger.warning("ollama %s: ignored%s%s", self.model, f" fields {fields}" if fields else "",
                           f" options {options}" if options else "")

    def sampling_fields(self) -> dict[str, Any]:
        """The OpenAI body's fields that the options, ``format`` and logprobs set."""
        return {"model": self.model, "stream": self.stream, **self.options.openai_fields()}

    def response_format(self) -> dict[str, Any] | None:
        """``format``: "json" is any JSON object, an object a JSON schema, "" nothing."""
        if self.format in (None, ""):
            return None
        if self.format == "json":
            return {"type": "json_object"}
        if isinstance(self.format, dict):
            return {"type": "json_schema", "json_schema": {"name": "response", "schema": self.format}}
        raise FieldError("format", f'format: "json", or a JSON schema (an object); got {self.format!r}')

    def thinks(self) -> bool | None:
        """Whether the reply's reasoning is asked for (True), asked away (False), or left to the server (None)."""
        if self.think is None or isinstance(self.think, bool):
            return self.think
        if self.think not in THINK_LEVELS:
            raise FieldError("think", f"think: true, false or one of {', '.join(THINK_LEVELS)}; got {self.think!r}")
        return True

    def chat_fields(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The OpenAI chat body this request runs as, over ``messages``. ``think`` reaches the chat template as
        the variables templates read it by: Qwen3's enable_thinking, gpt-oss's reasoning_effort."""
        body = self.sampling_fields() | {"messages": messages, "logprobs": self.logprobs,
                                         "top_logprobs": self.top_logprobs}
        response_format = self.response_format()
        if response_format is not None:
            body["response_format"] = response_format
        thinks = self.thinks()
        if thinks is not None:
            level = {"reasoning_effort": self.think} if isinstance(self.think, str) else {}
            body["chat_template_kwargs"] = {"enable_thinking": thinks} | level
        return body


class ChatRequest(OllamaRequest):
    messages: list[Message] = Field(default_factory=list, max_length=MAX_MESSAGES)
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)

    def openai_body(self) -> dict[str, Any]:
        body = self.chat_fields([message.openai_message(i) for i, message in enumerate(self.messages)])
        if self.tools:  # the model chooses whether to call (tool_choice auto): Ollama has no tool_choice
            body["tools"] = [tool.model_dump(exclude_none=True) for tool in self.tools]
        return body

    @staticmethod
    def client_field(field: str) -> str:
        return client_field(field)


class GenerateRequest(OllamaRequest):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    context: list[int] | None = None  # an earlier reply's context: its prompt and output, as token ids
    suffix: str | None = None
    template: str | None = None
    images: list[str] | None = None

    def check_supported(self, templated: bool) -> None:
        """Refuse what cannot be done, naming the field; ``templated``: the prompt goes through a chat template
        (not raw, and the model has one)."""
        if self.images:
            raise FieldError("images", "images: no model served here reads images; send text only")
        if self.suffix:
            raise FieldError("suffix", "suffix: fill-in-the-middle is not supported (no template here places a "
                             "suffix); send the prompt alone")
        if self.template:
            raise FieldError("template", "template: Ollama's Go templates are not read here; the model's own chat "
                             "template applies (or none, with raw)")
        if self.system is not None and not templated:
            raise FieldError("system", "system: a raw prompt (or a model without a chat template) is sent as it is, "
                             "with no template to place a system message in; put it in the prompt")

    def chat_body(self) -> dict[str, Any]:
        """The chat request a templated prompt is: the system message, if any, then the prompt as the user's."""
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        return self.chat_fields([*system, {"role": "user", "content": self.prompt}])

    def completion_body(self) -> dict[str, Any]:
        """The completion request a raw prompt is (its text is the prompt, tokenized by the caller)."""
        body = self.sampling_fields() | {"prompt": self.prompt}
        if self.logprobs:
            body["logprobs"] = self.top_logprobs or 0
        response_format = self.response_format()
        if response_format is not None:  # a completion takes a schema; any object is the schema of any object
            body["guided_json"] = response_format.get("json_schema", {}).get("schema", {"type": "object"})
        return body

    @staticmethod
    def client_field(field: str) -> str:
        """A generate request's messages are its system and its prompt: an error in them is the prompt's."""
        return "prompt" if field.split(".")[0] == "messages" else client_field(field)


def client_field(field: str) -> str:
    """An OpenAI body's field under the name the Ollama client sent it by (``max_tokens`` is
    ``options.num_predict``, ``response_format.json_schema`` is ``format``)."""
    head = field.split(".")[0]
    return _CLIENT_FIELDS.get(head, field)


class ShowRequest(Body):
    """``/api/show``: the model (by ``model``, or by ``name`` as older clients send it)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    name: str | None = None
    verbose: bool = False  # Ollama's tensors and vocabulary: not shown here

    def model_name(self) -> str:
        name = self.model or self.name
        if not name:
            raise FieldError("model", "model: name the model to show")
        return name
