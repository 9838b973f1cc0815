"""The engine's command-line options, shared by every ``conveyor`` command that builds an engine."""

from __future__ import annotations

import argparse
import dataclasses

from conveyor.core.config import EngineConfig, engine_options, option_from_text


def add_engine_args(parser: argparse.ArgumentParser, several_models: bool = False) -> None:
    """One ``--flag-name`` per EngineConfig field: its type, default, choices and help. With ``several_models``
    (``conveyor serve``), ``--model`` may be given more than once: a list, the first building ``engine_config``."""
    g = parser.add_argument_group("engine")
    for option in engine_options():
        help_text = f"{option.help} (default: {option.unset})" if option.unset else option.help
        help_text = help_text.replace("%", "%%")  # argparse formats help with %: "4% of" would break --help
        if option.type is bool:  # --flag and --no-flag, as vLLM's --enable-prefix-caching
            g.add_argument(option.flag, action=argparse.BooleanOptionalAction, default=option.default, help=help_text)
        elif option.name == "model" and several_models:
            g.add_argument(option.flag, action="append", default=None,
                           help=f"{help_text}; give it again to serve several models, a request's model picking one")
        else:
            g.add_argument(option.flag, type=option.type, default=option.default,
                           choices=option.choices or None, help=help_text)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    options = {option.name: getattr(args, option.name) for option in engine_options()}
    if isinstance(options["model"], list):  # serve's --model, given once or more: the first
        options["model"] = options["model"][0]
    return EngineConfig(**options)


def with_overrides(config: EngineConfig, spec: str) -> EngineConfig:
    """``"scheduler=static,max_num_seqs=32"`` applied to a copy of ``config`` (option names as in EngineConfig)."""
    options = as_options(config)
    for item in spec.split(","):
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in options:
            raise ValueError(f"--compare: {item!r} is not OPTION=VALUE with a known option ({', '.join(options)})")
        try:
            options[name] = option_from_text(name, value)
        except ValueError as error:
            raise ValueError(f"--compare: {error}") from None
    return EngineConfig(**options)


def int_pair(text: str, flag: str) -> tuple[int, int]:
    try:
        low, high = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} must be two integers like 8,512, got {text!r}") from None
    if not 1 <= low <= high:
        raise ValueError(f"{flag} must satisfy 1 <= min <= max, got {text!r}")
    return low, high


def as_options(config: EngineConfig) -> dict:
    return dataclasses.asdict(config)
