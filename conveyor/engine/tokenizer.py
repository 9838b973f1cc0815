"""Text <-> token ids, the chat template, and incremental detokenization for streams and stop strings."""

from __future__ import annotations

import functools
import inspect
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from conveyor.core.errors import FieldError

# Tokenizers ship inside the model folder; never reach for a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# Tokens of prompt context kept ahead of the output, so that a tokenizer that
# decides spacing from the previous token decodes the first output token right.
_CONTEXT_TOKENS = 6


def _hf_tokenizer(folder: Path) -> Any:
    """The transformers tokenizer of ``folder``. A folder whose tokenizer_config.json names the plain
    ``TokenizersBackend`` (what Conveyor's GGUF conversion writes for the default model), with no remote code
    (``auto_map``) and no Mistral ``tekken.json``, is one AutoTokenizer would load as exactly that class after
    reading the model's config to rule out the exceptions; loaded directly, the config is not read, which
    skips importing transformers' model configurations (and through them torch.distributed and sympy):
    about 3 of a server's 8 seconds of start on the tiny model. Any other folder goes through AutoTokenizer."""
    from transformers import AutoTokenizer

    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = None
    if (isinstance(config, dict) and config.get("tokenizer_class") == "TokenizersBackend"
            and "auto_map" not in config and not (folder / "tekken.json").exists()):
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(folder))
    return AutoTokenizer.from_pretrained(str(folder))


NO_TEMPLATE = ("this model has no chat template: give one (the server's --chat-template FILE|TEMPLATE, offline "
               "LLM(chat_template=...)), or send a plain prompt (/v1/completions)")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npy")


def _tokenizer_files(folder: Path) -> tuple[tuple[str, int, int], ...]:
    """The folder's files a tokenizer may read (all but weights), each with its size and modification time."""
    files = []
    for entry in os.scandir(folder):
        if entry.is_file() and not entry.name.endswith(WEIGHT_SUFFIXES):
            stat = entry.stat()
            files.append((entry.name, stat.st_size, stat.st_mtime_ns))
    return tuple(sorted(files))


@functools.lru_cache(maxsize=4)
def _loaded_tokenizer(folder: Path, files: tuple[tuple[str, int, int], ...]) -> Any:
    """A folder's tokenizer, loaded once per process while its files stay as they were (``files`` is the key):
    an engine built again on the same model (a sweep of configurations, a notebook, the tests) finds it loaded,
    where loading takes 0.3 s for the default model's and seconds for a vocabulary of 262k. Engines share it
    read-only: Conveyor never sets truncation or padding, the only state transformers keeps on it."""
    return _hf_tokenizer(folder)


class Tokenizer:
    def __init__(self, folder: str | Path, chat_template: str | None = None) -> None:
        """``chat_template``: a template's source, used in place of the model's own (``--chat-template``); one
        that does not compile is refused here, at start, naming its line."""
        try:
            resolved = Path(folder).resolve()
            self._tok = _loaded_tokenizer(resolved, _tokenizer_files(resolved))
        except Exception as error:  # transformers' message spans lines and names classes, not files
            raise ValueError(f"{folder}: no usable tokenizer (a model folder needs tokenizer.json, or a "
                             f"tokenizer_config.json with the vocabulary files it names): {_first_line(error)}"
                             ) from None
        self.folder = folder
        self.eos_token_id: int | None = self._tok.eos_token_id
        self.vocab_size = len(self._tok)
        self._template_override = chat_template
        if chat_template is not None:
            try:
                _compiled(chat_template)
            except Exception as error:  # jinja2's TemplateSyntaxError, with the line it stopped at
                raise ValueError(f"chat_template: the template does not compile{_template_line(error)}: "
                                 f"{_first_line(error)}") from None

    def check_model_vocabulary(self, model_vocab_size: int) -> None:
        """Refuse at start, in one line, a tokenizer that cannot serve this model: one that makes no tokens of
        plain text (every request would fail its step), or whose ids reach past the model's vocabulary."""
        if not self.encode("Hello world"):
            raise ValueError(f"{self.folder}: the tokenizer makes no tokens of 'Hello world'; is it this model's?")
        if self.vocab_size > model_vocab_size:
            raise ValueError(f"{self.folder}: the tokenizer has {self.vocab_size} tokens but the model's vocabulary "
                             f"only {model_vocab_size} (config.json's vocab_size): they are not a pair")
        if self.eos_token_id is not None and not 0 <= self.eos_token_id < model_vocab_size:
            raise ValueError(f"{self.folder}: the tokenizer's end-of-sequence id {self.eos_token_id} is outside the "
                             f"model's vocabulary of {model_vocab_size}")

    @property
    def hf_tokenizer(self) -> Any:
        """The transformers tokenizer underneath (xgrammar builds its token table from it)."""
        return self._tok

    @property
    def chat_template(self) -> str | None:
        """The chat template's source: the one given in place of the model's, else the model's (None: none)."""
        if self._template_override is not None:
            return self._template_override
        template = self._tok.chat_template
        return template if isinstance(template, str) or template is None else str(template)

    def encode(self, text: str) -> list[int]:
        """The text's token ids; a ValueError naming ``prompt`` for whatever the tokenizer raises on, so a text
        it cannot take is the client's 400, not the server's 500."""
        try:
            return self._tok.encode(text, add_special_tokens=True)
        except Exception as error:  # the tokenizers library raises TypeError, ValueError, Rust panics, ...
            raise FieldError("prompt", f"prompt: the tokenizer cannot take this text ({type(error).__name__}: "
                             f"{_first_line(error)})") from None

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            template_kwargs: Mapping[str, Any] | None = None,
                            tools: list[dict[str, Any]] | None = None,
                            chat_template: str | None = None) -> list[int]:
        """The messages rendered by the model's chat template and tokenized: ending with the header of the
        assistant's answer, or with the final message left open for the model to continue; ``template_kwargs``
        are further variables the template may read, ``tools`` OpenAI's tool definitions (a template that
        knows tools shows them to the model; others leave them out); ``chat_template`` a template's source for
        this call, in place of the tokenizer's."""
        template = chat_template or self._template_override
        if not (template or self.chat_template):
            raise FieldError("messages", f"messages: {NO_TEMPLATE}")
        from jinja2 import TemplateError

        taken = sorted(set(template_kwargs or ()) & self._template_arguments)
        if taken:
            raise FieldError("chat_template_kwargs",
                             f"chat_template_kwargs: {', '.join(taken)} cannot be set there (the server sets them)")
        try:
            ids = self._tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                continue_final_message=continue_final_message, tokenize=True,
                                                chat_template=template, **(template_kwargs or {}))
        except TemplateError as error:  # the template refused these messages (roles, order, ...)
            raise FieldError("messages", f"messages: the chat template refused them{_template_line(error)}: "
                             f"{_first_line(error)}") from None
        except ValueError as error:  # e.g. a final message the template's output does not end with
            raise FieldError("messages", f"messages: {error}") from None
        except Exception as error:  # the template's own code failed on what the client sent (a TypeError when
            # a chat_template_kwargs value has a type the template does not expect, a RecursionError, ...)
            raise FieldError("messages", f"messages: the chat template failed on these messages, tools and "
                             f"chat_template_kwargs{_template_line(error)} ({type(error).__name__}: "
                             f"{_first_line(error)})") from None
        # Newer transformers return a BatchEncoding here, older ones a plain list.
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    @functools.cached_property
    def _template_arguments(self) -> frozenset[str]:
        """Names a template kwarg may not take: transformers' own arguments, and ``messages`` (read once: a
        signature is not free, and every chat request asks)."""
        names = inspect.signature(self._tok.apply_chat_template).parameters
        return frozenset(name for name in names if name != "kwargs") | {"messages"}


def _compiled(template: str) -> Any:
    """The template compiled as transformers renders it (its sandbox and extensions; cached there by source)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a transformers that moved it: jinja2's sandbox, which parses the same syntax
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        return ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).from_string(template)
    return _compile_jinja_template(template)


def _template_line(error: BaseException) -> str:
    """Where in the template an error arose, as " at line N of the template" (empty where unknown): jinja2 gives
    a syntax error its line, and a failure while rendering a traceback frame of the template's own lines."""
    line = getattr(error, "lineno", None)
    traceback = error.__traceback__
    while traceback is not None:
        if traceback.tb_frame.f_code.co_filename == "<template>":
            line = traceback.tb_lineno
        traceback = traceback.tb_next
    return f" at line {line} of the template" if line else ""


def _first_line(error: BaseException) -> str:
    """An exception's message, one line of at most 200 characters: enough for the client, never a dump."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else "no message"
    return text if len(text) <= 200 else text[:200] + "..."


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
