"""Request bodies of the OpenAI-compatible API, validated by pydantic.

Fields the engine does not support yet are declared so that a request using
them gets a 400 that says so, rather than being silently ignored; fields
nobody declared are refused too. A JSON null means "not given", as in
OpenAI's API. OpenAI's fields that ask for nothing this server lacks are
accepted: ``user``, ``metadata``, ``store`` false, ``service_tier`` auto or
default, ``modalities`` text, ``parallel_tool_calls``; function ``tools`` with
``tool_choice`` required, a named function or none (see tool_calls.py). vLLM's extra fields (``repetition_penalty``,
``min_p``, ``min_tokens``, ``prompt_logprobs``, ``include_stop_str_in_output``,
``skip_special_tokens``, ``guided_json`` / ``guided_regex`` /
``guided_choice``, ``stream_options.continuous_usage_stats``; on chat
``add_generation_prompt``, ``continue_final_message``,
``chat_template_kwargs`` and ``echo``; ``cache_salt``) are accepted as vLLM accepts them. Conveyor's own:
``ttft_slo_ms`` and ``tpot_slo_ms``, the request's latency targets (the slo policy and admission control).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from conveyor.core.errors import FieldError
from conveyor.core.sampling import MAX_LOGPROBS, SamplingParams
from conveyor.core.structured import StructuredOutput
from conveyor.entrypoints.openai.tool_calls import ForcedToolCalls

MAX_MESSAGES = 1024  # messages of one chat request: the template renders them all, on the tokenizer pool
MAX_TOOLS = 128  # tools of one chat request (OpenAI's limit): each is a branch of the grammar
# Levels of objects and lists a body may nest: 900 levels inside chat_template_kwargs made the chat template
# recurse past Python's limit (a 500); no field of the API needs more than a few.
MAX_NESTING = 64


def check_text_and_nesting(value: Any, path: str = "", depth: int = 0) -> None:
    """Refuse, naming where, a string that is not Unicode text (JSON's ``"\\ud800"`` decodes to a lone surrogate,
    which no tokenizer takes: it was a 500 and a dropped connection), nesting deeper than MAX_NESTING, and a
    number that is not finite (NaN for temperature was refused as "less than or equal to 2")."""
    if depth > MAX_NESTING:
        where = path if len(path) <= 80 else path[:80] + "..."
        raise ValueError(f"{where or 'the body'}: nested deeper than {MAX_NESTING} levels of objects and lists")
    if isinstance(value, float) and not math.isfinite(value):  # JSON's NaN and Infinity, which Python reads
        raise ValueError(f"{path or 'the body'}: must be a finite number, got {value}")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            surrogate = ord(value[error.start])
            raise ValueError(f"{path or 'the body'}: not Unicode text (a lone surrogate, \\u{surrogate:x}, at "
                             f"character {error.start})") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text_and_nesting(key, path or "the body", depth + 1)
            check_text_and_nesting(item, f"{path}.{key}" if path else str(key), depth + 1)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_text_and_nesting(item, f"{path}.{index}" if path else str(index), depth + 1)


def field_error_of(error: ValidationError) -> FieldError:
    """Pydantic's first complaint as a FieldError naming its field by its path (``messages.0.content``): for a
    body that stands for another API's request, whose fields the client named otherwise."""
    first = error.errors()[0]
    field = ".".join(str(part) for part in first["loc"])
    return FieldError(field, f"{field}: {first['msg']}")


def one_or_several(given: str | list[int] | list[str] | list[list[int]], field: str, limit: int,
                   what: str) -> list[str | list[int]]:
    """A field that takes one prompt (a string or a list of token ids) or a list of them, as a list; FieldError
    naming ``field`` where it is empty or holds more than ``limit``."""
    several = isinstance(given, list) and given and not isinstance(given[0], int)
    items = list(given) if several else [given]
    if not items:
        raise FieldError(field, f"{field}: empty list of {what}")
    if len(items) > limit:
        raise FieldError(field, f"{field}: at most {limit} {what} in one request, got {len(items)}")
    return items


class Body(BaseModel):
    """A part of a request body: unknown fields are refused, a null is the same as leaving a field out, and
    every string must be Unicode text, nested no deeper than MAX_NESTING (check_text_and_nesting)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_means_not_given(cls, data: Any) -> Any:
        # OpenAI's API takes null for every optional field (clients send {"temperature": null}): the default.
        if isinstance(data, dict):
            check_text_and_nesting(data)
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class SamplingRequest(Body):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)  # OpenAI's range (the Responses API's too)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)  # OpenAI says 0-1, but 0 keeps no token: refused, as by vLLM
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    user: str | None = None
    # vLLM's: the prefix cache shares blocks only between requests of the same salt (and, with
    # --tenant-cache-salt, the same tenant)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # Conveyor's latency targets for this request, in ms (the server's --ttft-slo-ms / --tpot-slo-ms otherwise)
    ttft_slo_ms: float | None = Field(default=None, gt=0, le=86_400_000)
    tpot_slo_ms: float | None = Field(default=None, gt=0, le=86_400_000)
    n: int = 1  # sequences per prompt; they share the prompt's KV blocks (prefix caching)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(default=0, ge=0)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # vLLM's: each prompt token's
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    # vLLM's: each choice carries its output token ids (a streamed chunk: those it adds) and the answer its
    # prompt's, so a client can compare engines token for token without a tokenizer of its own.
    return_token_ids: bool = False
    # The names of the API the client called, where this body stands for another API's request (a Responses
    # request runs as a chat request): a field's name here -> the client's. None: the client sent this body.
    _client_field: Callable[[str], str] | None = PrivateAttr(default=None)

    def speaking_for(self, client_field: Callable[[str], str]) -> Self:
        """This body, with errors named as ``client_field`` maps its fields (the API the client called)."""
        self._client_field = client_field
        return self

    def check_supported(self) -> None:
        """FieldError naming the first field set to something the engine cannot do yet."""

    def structured_output(self) -> tuple[str, StructuredOutput] | None:
        """The constraint the body asks for, with the name of the field that asked (for a 400 naming it)."""
        given = [(name, value) for name, value in (
            ("guided_json", self.guided_json), ("guided_regex", self.guided_regex),
            ("guided_choice", self.guided_choice)) if value is not None]
        if len(given) > 1:
            raise FieldError(given[1][0], f"{given[1][0]}: give only one of guided_json, guided_regex, guided_choice")
        if not given:
            return None
        name, value = given[0]
        try:
            if name == "guided_json":
                return name, StructuredOutput(json=value)
            if name == "guided_regex":
                return name, StructuredOutput(regex=value)
            return name, StructuredOutput(choice=tuple(value))
        except FieldError as error:
            raise error.renamed(name) from None

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(logprobs, prompt_logprobs) as SamplingParams takes them; the endpoints read ``logprobs`` differently."""
        return None, self.prompt_logprobs

    def in_client_terms(self, error: FieldError) -> FieldError:
        """An error raised while making the request, under the name the client knows: a constraint that does
        not compile is named by the field the client used for it (``response_format``, ``guided_json``, ...),
        and a body that stands for another API's request names that API's field."""
        if error.field.startswith("structured_output"):
            structured = self.structured_output()
            error = error.renamed(structured[0] if structured else "structured_output")
        if self._client_field is None:
            return error
        field = self._client_field(error.field)
        return error if field == error.field else error.renamed(field)

    def _logit_bias(self) -> dict[int, float]:
        try:
            return {int(token): bias for token, bias in (self.logit_bias or {}).items()}
        except ValueError:
            keys = list(self.logit_bias or {})[:5]
            raise FieldError("logit_bias", f"logit_bias: keys must be token ids, got {keys}") from None

    def sampling_params(self) -> SamplingParams:
        """The body's sampling fields; max_tokens None where the client gave none (the request builder settles
        it, from the server's --default-max-tokens or the room left in the context)."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        structured = self.structured_output()
        logprobs, prompt_logprobs = self.logprob_counts()
        return SamplingParams(
            max_tokens=self.max_tokens_given(),
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self._logit_bias(),
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured_output=None if structured is None else structured[1],
        )

    def max_tokens_given(self) -> int | None:
        """The client's max_tokens (or max_completion_tokens), None when it sent neither."""
        return self.max_tokens

    def usage_in_stream(self) -> tuple[bool, bool]:
        """(a usage chunk at the end of the stream, usage in every chunk): vLLM's continuous_usage_stats counts
        only with include_usage, as vLLM reads it."""
        options = self.stream_options or StreamOptions()
        return options.include_usage, options.include_usage and options.continuous_usage_stats


MAX_PROMPTS = 64  # prompts in one /v1/completions request: each becomes a request of its own


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # top alternatives per token (legacy API)

    def check_supported(self) -> None:
        if self.suffix:
            raise FieldError("suffix", "suffix is not supported yet")
        if self.best_of not in (None, 1):
            raise FieldError("best_of", "best_of is not supported yet")
        super().check_supported()

    def logprob_counts(self) -> tuple[int | None, int | None]:
        # echo with logprobs returns the prompt's logprobs too, as OpenAI's legacy API does.
        echoed = self.logprobs if self.echo else None
        asked = [count for count in (echoed, self.prompt_logprobs) if count is not None]
        return self.logprobs, max(asked) if asked else None

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one string or token list, or a list of several (choices are indexed prompt by prompt)."""
        return one_or_several(self.prompt, "prompt", MAX_PROMPTS, "prompts")


class JsonSchemaFormat(Body):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    """OpenAI's ``response_format``: ``text``, ``json_object`` (any JSON object), or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured_output(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput(json_object=True)
        if self.json_schema is None:
            raise FieldError("response_format", "response_format: type json_schema needs a json_schema field")
        schema = self.json_schema.schema_ if self.json_schema.schema_ is not None else {}
        try:
            return StructuredOutput(json=schema)
        except FieldError as error:
            raise error.renamed("response_format") from None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class FunctionDefinition(Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # the grammar holds every call to its schema anyway


class ToolDefinition(Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


class ChatTemplateOptions(Body):
    """How the chat template renders the messages (vLLM's fields): with the header that starts the assistant's
    answer (the default), or continuing the final message (a reply begun by the caller); with extra variables
    for the template, and the tools, for a template that shows them."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)

    def template_options(self) -> dict[str, Any]:
        """Tokenizer.apply_chat_template's keyword arguments. Continuing the final message leaves out the
        generation prompt unless the caller asked for both, which no template can do."""
        continuing = self.continue_final_message
        if continuing and self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
            raise FieldError("continue_final_message", "continue_final_message: cannot continue the final message "
                             "and add a generation prompt after it; set add_generation_prompt to false")
        tools = [tool.model_dump(exclude_none=True) for tool in self.tools or ()]
        return {"add_generation_prompt": self.add_generation_prompt and not continuing,
                "continue_final_message": continuing, "template_kwargs": self.chat_template_kwargs or {},
                "tools": tools or None}


class ChatCompletionRequest(SamplingRequest, ChatTemplateOptions):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: tool_choice required makes exactly one call
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # vLLM's: the reply repeats the final message first, where that is the assistant's
    # OpenAI's; the values accepted ask for nothing this server lacks: tags for stored completions (none are
    # stored), the default processing tier, text output.
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    store: bool = False
    service_tier: Literal["auto", "default"] | None = None
    modalities: list[Literal["text"]] | None = None

    def check_supported(self) -> None:
        if self.store:
            raise FieldError("store", "store: this server keeps no completions (store must be false)")
        super().check_supported()

    def logprob_counts(self) -> tuple[int | None, int | None]:
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs: needs logprobs set to true")
        return (self.top_logprobs or 0) if self.logprobs else None, self.prompt_logprobs

    def structured_output(self) -> tuple[str, StructuredOutput] | None:
        wanted = self.response_format.structured_output() if self.response_format else None
        forced = self.forced_tool_calls()
        asked = [given for given in (super().structured_output(), wanted and ("response_format", wanted),
                                     forced and ("tool_choice", forced.structured_output())) if given]
        if len(asked) > 1:
            raise FieldError(asked[1][0], f"{asked[1][0]}: give only one of {asked[0][0]} and {asked[1][0]}")
        return asked[0] if asked else None

    def forced_tool_calls(self) -> ForcedToolCalls | None:
        """The calls tool_choice forces (required, or a named function); None when it forces none."""
        choice = self.tool_choice
        tools = {tool.function.name: tool.function.parameters or {"type": "object"} for tool in self.tools or ()}
        if len(tools) < len(self.tools or ()):
            raise FieldError("tools", "tools: two tools have the same name")
        if choice in (None, "auto", "none"):
            return None
        named = None if choice == "required" else choice.function.name
        if not tools:
            raise FieldError("tool_choice", "tool_choice: needs tools to call")
        if named is not None and named not in tools:
            raise FieldError("tool_choice", f"tool_choice: no tool named {named!r} in tools")
        if self.echo:
            raise FieldError("echo", "echo: a reply of tool calls repeats no message")
        return ForcedToolCalls(tools, named, parallel=self.parallel_tool_calls is not False)

    def auto_tool_parser(self, parser: str | None) -> str | None:
        """The parser the reply is read with for calls the model chooses to make (tools given, tool_choice auto
        or left out), or None where none are read; without a parser such a request is refused (the server
        was started without --enable-auto-tool-choice)."""
        if not self.tools or self.tool_choice not in (None, "auto"):
            return None
        if parser is None:
            raise FieldError("tool_choice", "tool_choice: auto (the default with tools) needs a parser of this "
                             "model's own tool-call format: start the server with --enable-auto-tool-choice (and "
                             "--tool-call-parser where the chat template shows no format it knows); or send "
                             "tool_choice required or a named function (the calls are then held to the tools' "
                             "schemas), or none")
        if self.echo:
            raise FieldError("echo", "echo: a reply read for tool calls repeats no message")
        return parser

    def max_tokens_given(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def message_dicts(self) -> list[dict[str, Any]]:
        return message_dicts(self.messages)

    def echoed(self) -> str | None:
        """With echo, the text the reply starts with: the final message's, where it is the assistant's."""
        if not self.echo or self.messages[-1].role != "assistant":
            return None
        return self.message_dicts()[-1]["content"]


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: content parts of type text joined; an assistant's earlier
    tool calls and reasoning_content, and a tool message's call id and name passed on, for templates that show
    them."""
    out = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            if any(part.get("type") != "text" for part in content):
                raise FieldError("messages", "messages: only text content parts are supported")
            content = "".join(str(part.get("text", "")) for part in content)
        extra = {key: value for key, value in (message.model_extra or {}).items()
                 if key in ("name", "tool_call_id") or (key == "tool_calls" and isinstance(value, list))
                 or (key == "reasoning_content" and isinstance(value, str))}
        if "tool_calls" in extra:
            extra["tool_calls"] = [_with_parsed_arguments(call) for call in extra["tool_calls"]]
        out.append({"role": message.role, "content": content or ""} | extra)
    return out


def _with_parsed_arguments(call: Any) -> Any:
    """A tool call whose arguments (OpenAI's JSON text) are an object, as chat templates read them (vLLM does
    the same); a call of another shape is passed on as it came."""
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return call
    return call | {"function": function | {"arguments": parsed}} if isinstance(parsed, dict) else call


class TokenizeRequest(ChatTemplateOptions):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int]
