"""Flags are written once in code (EngineConfig, and the serve parser for the server and replica flags): the
parser, the flag tables of docs/configuration.md and the checks follow from it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

import pytest

from conveyor.core.config import EngineConfig, check_option, engine_options
from conveyor.core.scheduler import SchedulerConfig
from conveyor.entrypoints.args import add_engine_args, engine_config, with_overrides
from conveyor.entrypoints.cli import build_parser

CONFIGURATION = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
ROW = re.compile(r"^\| `(--[a-z0-9-]+)` \|(.*)\|(.*)\|$")


def flag_table(section: str) -> dict[str, list[tuple[str, str]]]:
    """The flag table under ``## {section}`` of docs/configuration.md: flag -> [(meaning, default)], one per row."""
    text = CONFIGURATION.read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    lines = text.splitlines()
    start = lines.index("| flag | meaning | default |")
    rows: dict[str, list[tuple[str, str]]] = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        match = ROW.match(line)
        assert match, f"{section} table: cannot read the row {line!r}"
        rows.setdefault(match.group(1), []).append((match.group(2).strip(), match.group(3).strip()))
    return rows


def shown_default(option) -> str:
    """How the docs write a default: an int as it is, text in backticks, None as what it means (or nothing)."""
    if option.default is None:
        return option.unset or ""
    return str(option.default) if isinstance(option.default, int) else f"`{option.default}`"


def test_engine_flag_table_matches_engine_config() -> None:
    rows = flag_table("Engine flags")
    flags = {option.flag: option for option in engine_options()}
    assert sorted(set(rows) - set(flags)) == [], "the docs name flags the engine does not have"
    assert sorted(set(flags) - set(rows)) == [], "engine flags missing from the docs' table"
    for flag, option in flags.items():
        assert len(rows[flag]) == 1, f"{flag} appears {len(rows[flag])} times in the docs' table"
        meaning, default = rows[flag][0]
        assert default == shown_default(option), f"{flag}: the docs' default {default!r}"
        for choice in option.choices:
            assert f"`{choice}`" in meaning, f"{flag}: the docs' meaning does not name the choice {choice!r}"


def serve_groups(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, argparse.Action]]:
    """The serve command's own flags by group: "replicas", and the rest (the engine's are checked above)."""
    monkeypatch.delenv("CONVEYOR_API_KEY", raising=False)
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    groups: dict[str, dict[str, argparse.Action]] = {"replicas": {}, "server": {}}
    for group in serve._action_groups:
        for action in group._group_actions:
            if group.title != "engine" and action.option_strings and action.dest != "help":
                groups["replicas" if group.title == "replicas" else "server"][action.option_strings[0]] = action
    return groups


def shown_action_default(action: argparse.Action) -> str | None:
    """How the docs write a parser default; None: the default is None, and the docs say what that means."""
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if action.default is None:
        return None
    if isinstance(action.default, list):  # a JSON-list flag: written as JSON
        return f"`{json.dumps(action.default)}`"
    return f"`{action.default}`" if isinstance(action.default, str) else str(action.default)


@pytest.mark.parametrize(("section", "group"), [("Server flags", "server"), ("Replica flags", "replicas")])
def test_server_and_replica_flag_tables_match_the_parser(section: str, group: str, monkeypatch) -> None:
    rows = flag_table(section)
    actions = serve_groups(monkeypatch)[group]
    assert sorted(set(rows) - set(actions)) == [], f"{section}: the docs name flags serve does not have"
    assert sorted(set(actions) - set(rows)) == [], f"{section}: flags missing from the docs' table"
    for flag, action in actions.items():
        assert len(rows[flag]) == 1, f"{flag} appears {len(rows[flag])} times in the docs' table"
        meaning, default = rows[flag][0]
        expected = shown_action_default(action)
        if flag == "--api-key":
            expected = "`$CONVEYOR_API_KEY`"
        if expected is None:  # a None default: the docs say what it means
            assert default, f"{flag}: the docs do not say what its default is"
        else:
            assert default == expected, f"{flag}: the docs' default {default!r}, the parser's {expected!r}"
        for choice in action.choices or ():
            assert f"`{choice}`" in meaning, f"{flag}: the docs' meaning does not name the choice {choice!r}"


def test_every_field_has_help_and_valid_default() -> None:
    for option in engine_options():
        assert option.help, option.name
        assert not option.choices or option.default in option.choices, option.name
    EngineConfig()  # the defaults pass their own checks


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(argv)


def test_parser_has_one_option_per_field_with_its_default() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    actions = {a.dest: a for a in parser._actions if a.dest != "help"}
    assert list(actions) == [f.name for f in dataclasses.fields(EngineConfig)]
    for option in engine_options():
        action = actions[option.name]
        expected = [option.flag, option.flag.replace("--", "--no-", 1)] if option.type is bool else [option.flag]
        assert action.option_strings == expected
        assert action.default == option.default
        assert tuple(action.choices or ()) == option.choices
        assert option.help.replace("%", "%%") in action.help
    assert engine_config(parse([])) == EngineConfig()


def test_engine_config_round_trips_through_the_flags() -> None:
    argv = ["--model", "m.gguf", "--dtype", "bfloat16", "--kv-cache-dtype", "fp8", "--device", "cpu",
            "--max-num-seqs", "7",
            "--max-num-batched-tokens", "99", "--burst-wait-ms", "5", "--block-size", "8", "--kv-cache-memory", "1GiB",
            "--num-kv-blocks", "12", "--max-model-len", "64", "--seed", "3", "--scheduler", "continuous",
            "--scheduling-policy", "priority", "--preemption-mode", "swap", "--tenant-weights", '{"a": 2}',
            "--tenant-header", "X-Tenant", "--tenant-cache-salt", "--max-num-queued-requests", "5",
            "--max-num-queued-tokens", "500", "--ttft-slo-ms", "800", "--tpot-slo-ms", "50", "--admission-control",
            "--grammar-compile-timeout-ms", "1500",
            "--max-num-partial-prefills", "4", "--max-long-partial-prefills", "2",
            "--long-prefill-token-threshold", "300", "--swap-space", "512MB",
            "--kv-layout", "contiguous", "--no-enable-prefix-caching", "--kernels", "torch", "--quantization", "int8",
            "--num-threads", "3", "--speculative-config", '{"method": "suffix"}',
            "--chat-template", "{{ messages[0].content }}"]
    assert len(argv) == 2 * len(engine_options()) - 3  # the three switches take no value
    assert engine_config(parse(argv)) == EngineConfig(
        model="m.gguf", dtype="bfloat16", kv_cache_dtype="fp8", device="cpu", max_num_seqs=7,
        max_num_batched_tokens=99, burst_wait_ms=5, block_size=8,
        kv_cache_memory=2**30, num_kv_blocks=12, max_model_len=64, seed=3, scheduler="continuous",
        scheduling_policy="priority", preemption_mode="swap", tenant_weights='{"a": 2}', tenant_header="X-Tenant",
        tenant_cache_salt=True, max_num_queued_requests=5, max_num_queued_tokens=500, ttft_slo_ms=800, tpot_slo_ms=50,
        admission_control=True, grammar_compile_timeout_ms=1500,
        max_num_partial_prefills=4, max_long_partial_prefills=2, long_prefill_token_threshold=300,
        swap_space=512 * 10**6, kv_layout="contiguous",
        enable_prefix_caching=False, kernels="torch", quantization="int8", num_threads=3,
        speculative_config='{"method": "suffix"}', chat_template="{{ messages[0].content }}",
    )


def test_prefix_caching_is_on_by_default_for_paged_blocks_only() -> None:
    assert EngineConfig().prefix_caching and not EngineConfig(kv_layout="contiguous").prefix_caching
    assert not EngineConfig(enable_prefix_caching=False).prefix_caching
    assert engine_config(parse(["--enable-prefix-caching"])).enable_prefix_caching is True
    with pytest.raises(ValueError, match="contiguous layout cannot share blocks"):
        EngineConfig(kv_layout="contiguous", enable_prefix_caching=True)
    with pytest.raises(ValueError, match="enable_prefix_caching must be true or false"):
        EngineConfig(enable_prefix_caching="yes")
    assert with_overrides(EngineConfig(), "enable_prefix_caching=off").prefix_caching is False
    with pytest.raises(ValueError, match="lpm orders continuous admission"):
        EngineConfig(scheduler="static", scheduling_policy="lpm")
    with pytest.raises(ValueError, match="fair orders continuous admission"):
        EngineConfig(scheduler="static", scheduling_policy="fair")
    with pytest.raises(ValueError, match="slo orders continuous admission"):
        EngineConfig(scheduler="static", scheduling_policy="slo")
    with pytest.raises(ValueError, match="drafts are verified in continuous steps"):
        EngineConfig(scheduler="static", speculative_config='{"method": "ngram"}')
    with pytest.raises(ValueError, match="speculative_config: unknown key"):
        EngineConfig(speculative_config='{"num_speculative_tokens": 4, "draft_model": "x"}')
    with pytest.raises(ValueError, match=r"max_long_partial_prefills \(3\) must be <= max_num_partial_prefills \(2\)"):
        EngineConfig(max_num_partial_prefills=2, max_long_partial_prefills=3)


def test_tenant_weights_are_a_json_object_given_inline_or_in_a_file(tmp_path) -> None:
    assert EngineConfig(tenant_weights='{"gold": 4, "free": 1}').tenant_weight_map() == {"gold": 4.0, "free": 1.0}
    path = tmp_path / "weights.json"
    path.write_text('{"gold": 2.5}')
    assert EngineConfig(tenant_weights=str(path)).tenant_weight_map() == {"gold": 2.5}
    assert EngineConfig().tenant_weight_map() == {}
    for text, message in [('{"a": 0}', "must weigh a positive number"), ('{"a": true}', "positive number"),
                          ("[1]", "must be a JSON object"), ("{nope", "not JSON"),
                          (str(tmp_path / "missing.json"), "neither a JSON object nor a readable file")]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(tenant_weights=text)


def test_every_command_prints_its_help() -> None:
    """argparse formats help strings with %: one unescaped percent sign in any flag's help breaks --help."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert commands
    for name, command in {"conveyor": parser, **commands}.items():
        assert command.format_help(), name


def test_parser_refuses_a_bad_choice_or_integer() -> None:
    for argv in (["--dtype", "int8"], ["--max-num-seqs", "many"]):
        with pytest.raises(SystemExit):
            parse(argv)


def test_simulate_keeps_its_unset_defaults() -> None:
    """``conveyor simulate`` fills dtype and the KV size from the hardware when they are not given."""
    args = build_parser().parse_args(["simulate"])
    assert args.dtype is None and args.kv_cache_memory is None and args.max_num_seqs == 128
    assert build_parser().parse_args(["simulate", "calibrate"]).max_num_seqs == 32


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1, got 0"),
        ({"max_model_len": 0}, "max_model_len must be >= 1"),
        ({"scheduler": "dynamic"}, "scheduler must be continuous or static"),
        ({"dtype": "int8"}, "dtype must be float32, bfloat16 or float16"),
        ({"kv_cache_memory": "lots"}, "kv_cache_memory: not a size in bytes"),
        ({"swap_space": -1}, "swap_space must be >= 0"),
        ({"seed": "42"}, "seed must be an integer"),
        ({"block_size": True}, "block_size must be an integer"),
    ],
)
def test_engine_config_checks_name_the_field(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(**options)


def test_sizes_become_bytes() -> None:
    config = EngineConfig(kv_cache_memory="2GiB", swap_space=1000)
    assert (config.kv_cache_memory, config.swap_space) == (2 * 2**30, 1000)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
        ({"policy": "lifo"}, "scheduling_policy must be fcfs, priority, lpm, fair or slo"),
        ({"preemption_mode": "drop"}, "preemption_mode must be recompute or swap"),
    ],
)
def test_scheduler_config_uses_the_same_rules(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**options)
    name = "scheduling_policy" if "policy" in options else next(iter(options))
    with pytest.raises(ValueError, match=message):
        check_option(name, next(iter(options.values())))


def test_compare_overrides_convert_by_field_type() -> None:
    base = EngineConfig()
    variant = with_overrides(base, "scheduler=static,max_num_seqs=32,num_kv_blocks=none,model=123,swap-space=1GiB")
    assert (variant.scheduler, variant.max_num_seqs, variant.num_kv_blocks) == ("static", 32, None)
    assert variant.model == "123" and variant.swap_space == 2**30
    with pytest.raises(ValueError, match="--compare: max_num_seqs must be an integer"):
        with_overrides(base, "max_num_seqs=lots")
    with pytest.raises(ValueError, match="--compare"):
        with_overrides(base, "no_such_option=1")


def test_the_default_kv_pool_is_sized_to_the_model_and_bounded_by_free_memory():
    from conveyor.core.engine_core import DEFAULT_TOKENS_PER_SEQUENCE, plan_kv_cache

    per_token = 64 * 1024  # a Llama 3.2 1B shape's K and V in float32
    config = EngineConfig()
    plan = plan_kv_cache(config, per_token, 131072, free_bytes=20 * 2**30)
    assert plan.num_blocks * config.block_size == config.max_num_seqs * DEFAULT_TOKENS_PER_SEQUENCE >= 64 * 512
    small = plan_kv_cache(config, per_token, 131072, free_bytes=2**30)  # half the free memory at most
    assert small.num_blocks * small.block_bytes <= 2**29 < plan.num_blocks * plan.block_bytes
    given = plan_kv_cache(EngineConfig(kv_cache_memory="4GiB"), per_token, 131072, free_bytes=2**30)
    assert given.num_blocks * given.block_bytes == 4 * 2**30  # a size given is a size kept
    assert plan_kv_cache(EngineConfig(max_num_seqs=8), per_token, 131072).num_blocks * 16 == 8 * 256
