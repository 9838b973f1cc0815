"""Request bodies of the OpenAI-compatible API, validated by pydantic.

Fields the engine does not support yet are declared so that a request using
them gets a 400 that says so, rather than being silently ignored; fields
nobody declared are refused too.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from conveyor.core.sampling import SamplingParams

MAX_MESSAGES = 1024  # messages of one chat request: the template renders them all, on the tokenizer pool


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    user: str | None = None
    n: int = 1  # sequences per prompt; they share the prompt's KV blocks (prefix caching)
    # Declared to be refused with a clear message (see unsupported()).
    logprobs: Any = None
    top_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> str | None:
        """The first field set to something the engine cannot do yet, as an error message."""
        checks = {
            "logprobs": self.logprobs not in (None, False),
            "top_logprobs": self.top_logprobs not in (None, 0),
            "presence_penalty": self.presence_penalty != 0,
            "frequency_penalty": self.frequency_penalty != 0,
            "logit_bias": bool(self.logit_bias),
        }
        for name, bad in checks.items():
            if bad:
                return f"{name}={getattr(self, name)!r} is not supported yet"
        return None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(
            max_tokens=self.max_tokens_given() or default_max_tokens,
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
        )

    def max_tokens_given(self) -> int | None:
        """The client's max_tokens (or max_completion_tokens), None when it sent neither."""
        return self.max_tokens


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> str | None:
        several = isinstance(self.prompt, list) and len(self.prompt) > 1 and not isinstance(self.prompt[0], int)
        if several:
            return "prompt: a list of several prompts is not supported yet; send one prompt per request"
        if self.echo:
            return "echo=true is not supported yet"
        if self.suffix:
            return "suffix is not supported yet"
        if self.best_of not in (None, 1):
            return "best_of is not supported yet"
        return super().unsupported()

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return prompt[0]
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools are not supported yet"
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            return "response_format other than text is not supported yet"
        return super().unsupported()

    def max_tokens_given(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def message_dicts(self) -> list[dict[str, Any]]:
        return message_dicts(self.messages)


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them; content parts of type text are joined."""
    out = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            if any(part.get("type") != "text" for part in content):
                raise ValueError("messages: only text content parts are supported")
            content = "".join(str(part.get("text", "")) for part in content)
        out.append({"role": message.role, "content": content or ""})
    return out


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]
