"""Engine options, named as vLLM's flags where the meaning is the same.

``EngineConfig`` is the one place an option is written: its default, help text,
choices and minimum live in the field, and from them come the validation here,
the command-line flags (:mod:`conveyor.entrypoints.args`) and the check of
the flag table of docs/configuration.md (tests/entrypoints/test_flags.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import types
import typing
from dataclasses import dataclass
from typing import Any

from conveyor.core.burst import BURST_WAIT_CAP
from conveyor.core.formats import FLOAT_BYTES, KV_CACHE_BYTES, kv_cache_format, kv_element_bytes
from conveyor.core.spec.config import SpeculativeConfig

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12}


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or a ``taskset``'s share), which is
    what torch would otherwise guess from the whole machine: the default of ``num_threads``."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform (macOS)
        return os.cpu_count() or 1


def parse_bytes(value: str | int) -> int:
    """``"2GiB"``, ``"512MB"``, ``"1e9"`` or an int -> bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    number = float(match.group(1)) * _UNITS.get(match.group(2).lower(), math.nan) if match else math.nan
    if not math.isfinite(number):
        raise ValueError(f"not a size in bytes: {value!r} (examples: 2GiB, 512MB, 1000000)")
    return int(number)


def _option(default: Any, help: str, *, choices: tuple[str, ...] = (), minimum: int | None = None,
            size: bool = False, unset: str | None = None) -> Any:
    """A field of EngineConfig: ``size``: bytes, given as an int or a string like ``"2GiB"``;
    ``unset``: what the default ``None`` means, for help text and the docs."""
    metadata = {"help": help, "choices": choices, "minimum": minimum, "size": size, "unset": unset}
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(slots=True)
class EngineConfig:
    model: str | None = _option(None, "HF model folder, .gguf file, or a name: packaged (gemma3-270m), NAME in "
                                "$CONVEYOR_MODELS, ORG/NAME in the Hugging Face cache", unset="SmolLM2-135M-Instruct")
    dtype: str = _option("float32", "dtype of the weights, activations and KV cache",
                         choices=tuple(FLOAT_BYTES))
    kv_cache_dtype: str = _option("auto", "what the KV cache stores: auto (a GGUF file's weights in float32: float16, "
                                  "as llama.cpp keeps it; else --dtype), float32, bfloat16, float16 (llama.cpp's "
                                  "f16 cache: half float32's bytes, rounded to 11 significant bits), or fp8 (fp8_e5m2: "
                                  "one byte an element, as vLLM's CPU backend, so the pool holds four times "
                                  "float32's tokens; attention reads a quarter of the bytes, and greedy output "
                                  "may part from float32's where two tokens are close)",
                                  choices=tuple(KV_CACHE_BYTES))
    device: str = _option("auto", "auto (CUDA when present), cpu, cuda, cuda:1, ...")
    max_num_seqs: int = _option(128, "most requests in one batch", minimum=1)
    max_num_batched_tokens: int = _option(2048, "token budget of one step", minimum=1)
    burst_wait_ms: int = _option(5, "an idle engine, woken by a request, steps once no other has come for this "
                                 f"many ms (at most {BURST_WAIT_CAP} times it after the first), so that requests "
                                 "sent at once share their first step; 0: it steps at once", minimum=0)
    block_size: int = _option(16, "tokens per KV block", minimum=1)
    kv_cache_memory: int | str | None = _option(
        None, "KV pool size in bytes, e.g. 2GiB, 512MB", minimum=1, size=True,
        unset="sized to the model: max_num_seqs requests of 256 tokens (64 of 512 at the default), at most half "
              "the memory free once the weights are in")
    num_kv_blocks: int | None = _option(None, "KV pool size in blocks (overrides memory)", minimum=1)
    max_model_len: int | None = _option(None, "longest prompt + output", minimum=1,
                                        unset="the model's, capped by the pool")
    seed: int = _option(0, "seed of unseeded random sampling")
    scheduler: str = _option("continuous", "continuous: iteration-level batching; static: request-level batches "
                             "(the baseline)", choices=("continuous", "static"))
    scheduling_policy: str = _option("fcfs", "priority: lower value first, preempting less important running "
                                     "requests; lpm: longest cached prefix first (SGLang's cache-aware order), "
                                     "first come first served when the queue is long; fair: fair shares between "
                                     "tenants (VTC's virtual token counters; see --tenant-weights); slo: least "
                                     "slack to its deadline first, the running requests' time per output token "
                                     "protected (see --ttft-slo-ms, --tpot-slo-ms)",
                                     choices=("fcfs", "priority", "lpm", "fair", "slo"))
    preemption_mode: str = _option("recompute", "what happens to a preempted request's KV: dropped and recomputed, "
                                   "or swapped to CPU", choices=("recompute", "swap"))
    max_num_partial_prefills: int = _option(1, "prompts computed in chunks side by side, each taking at most "
                                            "max_num_batched_tokens / this many tokens a step, so a long prompt "
                                            "does not hold up short ones (vLLM v0's name)", minimum=1)
    max_long_partial_prefills: int = _option(1, "of those, how many may be long (see --long-prefill-token-threshold); "
                                             "a later short prompt is admitted ahead of a waiting long one",
                                             minimum=1)
    long_prefill_token_threshold: int = _option(0, "a prompt with more tokens than this still to compute is long; "
                                                "0: 4% of max_model_len", minimum=0)
    tenant_weights: str | None = _option(None, "the fair policy's weight per tenant: a JSON object such as "
                                         "'{\"gold\": 4, \"free\": 1}', or the path of a JSON file holding one; "
                                         "a tenant gets served tokens in proportion to its weight",
                                         unset="every tenant weighs 1")
    tenant_header: str | None = _option(None, "HTTP header that names a request's tenant (e.g. X-Tenant-Id), "
                                        "for a gateway that authenticates callers",
                                        unset="the body's user field (OpenAI's)")
    tenant_cache_salt: bool = _option(False, "salt each tenant's prefix cache apart: a tenant's prompts are never "
                                      "found cached by another's requests, so none can probe them through "
                                      "cached_tokens (a body's cache_salt, vLLM's, salts within a tenant)")
    max_num_queued_requests: int | None = _option(None, "most requests waiting to be admitted; a new one past it is "
                                                  "refused: 429 with Retry-After (offline: RequestRefused) "
                                                  "(vLLM's name)", minimum=1, unset="no cap")
    max_num_queued_tokens: int | None = _option(None, "most tokens (prompts, and output so far of a preempted "
                                                "request) waiting to be admitted; a new request that would pass it "
                                                "is refused the same way", minimum=1, unset="no cap")
    ttft_slo_ms: int | None = _option(None, "time-to-first-token target, in ms, of a request that names none (its "
                                      "body's ttft_slo_ms): the slo policy orders by it, --admission-control "
                                      "refuses by it, goodput counts it", minimum=1, unset="none")
    tpot_slo_ms: int | None = _option(None, "time-per-output-token target (the mean after the first), in ms, of a "
                                      "request that names none (tpot_slo_ms): the slo policy protects it, goodput "
                                      "counts it", minimum=1, unset="none")
    admission_control: bool = _option(False, "refuse (429 with Retry-After; offline: RequestRefused) a request "
                                      "whose time-to-first-token target the wait ahead of it, predicted from the "
                                      "measured step times, already misses")
    grammar_compile_timeout_ms: int = _option(5000, "time a structured-output constraint's grammar may take to "
                                              "compile, in ms; a compile still running then is abandoned (its "
                                              "process ended) and the request refused (400), and a constraint that "
                                              "waits that long for a free compiler gets 429", minimum=1)
    swap_space: int | str = _option("4GiB", "CPU memory for swapped KV (with --preemption-mode swap)", minimum=0,
                                    size=True)
    kv_layout: str = _option("paged", "paged: blocks on demand; contiguous: a --max-model-len slab reserved per "
                             "request", choices=("paged", "contiguous"))
    enable_prefix_caching: bool | None = _option(
        None, "keep the KV of full blocks after their requests end, found again by content, so a shared prompt "
        "prefix is computed once", unset="on for the paged layout")
    kernels: str = _option("auto", "auto: the native stack, each projection and batch size on the GEMM this "
                           "machine measured fastest (the packed kernels or torch's; timed on a first start, then "
                           "cached); native: the decoder stack in C++ on packed weights (CPU: float32, and "
                           "bfloat16 where the CPU has avx512_bf16); "
                           "torch: plain PyTorch ops, the reference", choices=("auto", "native", "torch"))
    quantization: str = _option("none", "quantize a float checkpoint's weights once as it loads (on the native "
                                "kernels): int8 (symmetric, per group of 32 inputs) or int4 (asymmetric, per group "
                                "of 32; the embedding and LM head int8); none: it runs in --dtype. A GGUF file's "
                                "weights stay in the file's own formats", choices=("none", "int8", "int4"))
    num_threads: int | None = _option(None, "CPU threads the model's kernels use (torch/OpenMP); with "
                                      "--data-parallel-size, per replica", minimum=1,
                                      unset="the cores this process may use (per replica: divided among them)")
    speculative_config: str | None = _option(
        None, "speculative decoding, as vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 4}; method ngram (prompt lookup) or suffix (also from "
        "recent requests' outputs); \"draft_length\": auto (the default: each step carries the drafts expected to "
        "pay, from acceptance so far and measured step costs, none where the batch makes them dear) or fixed",
        unset="off")
    chat_template: str | None = _option(None, "the chat template of chat requests, in place of the model's own "
                                        "(vLLM's): the path of a Jinja file, or the template itself (a one-line "
                                        "template's \\n escapes read as newlines)", unset="the model's own")

    def __post_init__(self) -> None:
        for option in engine_options():
            setattr(self, option.name, check_option(option.name, getattr(self, option.name)))
        if self.scheduling_policy == "lpm" and self.scheduler == "static":
            raise ValueError("scheduling_policy: lpm orders continuous admission; static batches form in arrival "
                             "order (use fcfs or priority with scheduler static)")
        if self.scheduling_policy == "fair" and self.scheduler == "static":
            raise ValueError("scheduling_policy: fair orders continuous admission; static batches form in arrival "
                             "order (use fcfs or priority with scheduler static)")
        if self.scheduling_policy == "slo" and self.scheduler == "static":
            raise ValueError("scheduling_policy: slo orders continuous admission by deadline; static batches form in "
                             "arrival order (use fcfs or priority with scheduler static)")
        self.tenant_weight_map()  # a ValueError now rather than at the first request
        self.chat_template_text()
        if self.speculative() is not None and self.scheduler == "static":
            raise ValueError("speculative_config: drafts are verified in continuous steps; static batches do not "
                             "take them (use scheduler continuous)")
        check_partial_prefills(self.max_num_partial_prefills, self.max_long_partial_prefills)
        if self.enable_prefix_caching and self.kv_layout == "contiguous":
            raise ValueError("enable_prefix_caching: the contiguous layout cannot share blocks; "
                             "use kv_layout paged, or leave prefix caching off")

    def kv_cache_format(self, gguf_file: bool) -> str:
        """What the KV cache stores for a model whose weights are (or are not) a GGUF file's: ``auto`` resolved
        (conveyor.core.formats.kv_cache_format)."""
        return kv_cache_format(self.kv_cache_dtype, self.dtype, gguf_file)

    def kv_cache_element_bytes(self, gguf_file: bool) -> int:
        """Bytes of one K or V element in the cache (kv_cache_format's)."""
        return kv_element_bytes(self.kv_cache_dtype, self.dtype, gguf_file)

    def tenant_weight_map(self) -> dict[str, float]:
        """``tenant_weights`` read: from its JSON text, or from the file it names."""
        return parse_tenant_weights(self.tenant_weights)

    def chat_template_text(self) -> str | None:
        """``chat_template`` read: the template in the file it names, or the template itself (None: the model's)."""
        return read_chat_template(self.chat_template)

    def speculative(self) -> SpeculativeConfig | None:
        """``speculative_config`` read (None: off); ValueError naming the key that is wrong."""
        return SpeculativeConfig.parse(self.speculative_config)

    def slo_seconds(self) -> tuple[float | None, float | None]:
        """The default TTFT and TPOT targets in seconds (the scheduler's unit)."""
        return tuple(None if ms is None else ms / 1000 for ms in (self.ttft_slo_ms, self.tpot_slo_ms))

    @property
    def prefix_caching(self) -> bool:
        """Whether prefix caching is on: as asked, or by default wherever the layout allows it (paged)."""
        return self.kv_layout == "paged" if self.enable_prefix_caching is None else self.enable_prefix_caching


def check_partial_prefills(max_num_partial_prefills: int, max_long_partial_prefills: int) -> None:
    if max_long_partial_prefills > max_num_partial_prefills:
        raise ValueError(f"max_long_partial_prefills ({max_long_partial_prefills}) must be <= "
                         f"max_num_partial_prefills ({max_num_partial_prefills})")


def parse_tenant_weights(text: str | None) -> dict[str, float]:
    """``'{"a": 2}'`` or the path of a file holding it -> {"a": 2.0}; ValueError naming the flag otherwise."""
    if text is None:
        return {}
    source = text.strip()
    if not source.startswith(("{", "[")):  # otherwise a path
        try:
            with open(source, encoding="utf-8") as file:
                source = file.read()
        except OSError as error:
            raise ValueError(f"tenant_weights: neither a JSON object nor a readable file: {error}") from None
    try:
        weights = json.loads(source)
    except json.JSONDecodeError as error:
        raise ValueError(f"tenant_weights: not JSON: {error}") from None
    if not isinstance(weights, dict):
        raise ValueError("tenant_weights: must be a JSON object of tenant -> weight")
    for tenant, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < math.inf:
            raise ValueError(f"tenant_weights: {tenant!r} must weigh a positive number, got {weight!r}")
    return {tenant: float(weight) for tenant, weight in weights.items()}


def read_chat_template(value: str | None) -> str | None:
    """vLLM's reading of ``--chat-template``: the file it names, else, where it holds a brace or a line break, the
    template itself (one written on a single line has its ``\\n`` and other escapes read, as a shell passes them
    on); a value that looks like a path but opens no file is refused, naming the flag."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as file:
            return file.read()
    except (OSError, ValueError) as error:  # ValueError: a NUL in the text
        if not any(mark in value for mark in "{}\n"):
            raise ValueError(f"chat_template: {value!r} looks like a file's path, but it cannot be read: "
                             f"{error.strerror if isinstance(error, OSError) else error}") from None
    if "\n" in value:
        return value
    # latin-1 with backslashreplace keeps any non-Latin text intact through unicode_escape.
    return value.encode("latin-1", "backslashreplace").decode("unicode_escape")


@dataclass(frozen=True, slots=True)
class Option:
    """One EngineConfig field, as the command line, the validation and the docs see it."""

    name: str
    default: Any
    help: str
    type: type  # what a command-line value becomes: int, bool, or str (sizes in bytes stay text until checked)
    optional: bool  # None is allowed
    choices: tuple[str, ...]
    minimum: int | None
    size: bool
    unset: str | None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@functools.cache
def engine_options() -> tuple[Option, ...]:
    """EngineConfig's fields, in order."""
    hints = typing.get_type_hints(EngineConfig)
    options = []
    for field in dataclasses.fields(EngineConfig):
        kinds = typing.get_args(hints[field.name]) if isinstance(hints[field.name], types.UnionType) else ()
        kinds = kinds or (hints[field.name],)
        meta = field.metadata
        options.append(Option(
            name=field.name, default=field.default, help=meta["help"],
            type=_value_type(kinds, meta["size"]), optional=type(None) in kinds,
            choices=meta["choices"], minimum=meta["minimum"], size=meta["size"], unset=meta["unset"],
        ))
    return tuple(options)


def _value_type(kinds: tuple[type, ...], size: bool) -> type:
    if bool in kinds:
        return bool
    return int if int in kinds and not size else str


def engine_option(name: str) -> Option:
    for option in engine_options():
        if option.name == name:
            return option
    raise KeyError(name)


def check_option(name: str, value: Any) -> Any:
    """``value`` checked against the rules of EngineConfig's field ``name``; sizes in bytes come back as ints."""
    option = engine_option(name)
    if value is None and option.optional:
        return None
    if option.size:
        try:
            value = parse_bytes(value)
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None
    if option.type is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if option.type is bool and not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    if option.choices and value not in option.choices:
        raise ValueError(f"{name} must be {_one_of(option.choices)}, got {value!r}")
    if option.minimum is not None and value < option.minimum:
        raise ValueError(f"{name} must be >= {option.minimum}, got {value}")
    return value


def option_from_text(name: str, text: str) -> Any:
    """A command-line value (``"32"``, ``"static"``, ``"2GiB"``, ``"none"``) as EngineConfig's field ``name`` wants."""
    option = engine_option(name)
    text = text.strip()
    if option.optional and text.lower() in ("", "none"):
        return None
    if option.type is bool:
        if text.lower() not in _BOOLEANS:
            raise ValueError(f"{name} must be true or false, got {text!r}")
        return _BOOLEANS[text.lower()]
    if option.type is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {text!r}") from None
    return text


_BOOLEANS = {"true": True, "on": True, "yes": True, "1": True, "false": False, "off": False, "no": False, "0": False}


def _one_of(choices: tuple[str, ...]) -> str:
    return choices[0] if len(choices) == 1 else f"{', '.join(choices[:-1])} or {choices[-1]}"
