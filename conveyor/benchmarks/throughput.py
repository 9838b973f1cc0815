"""``conveyor bench throughput``: a seeded workload run to the end, lengths exact (ignore_eos): long-tailed
requests at once, requests over shared prefixes, or multi-turn conversations."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from conveyor.benchmarks.report import format_table
from conveyor.benchmarks.workload import (
    WORKLOADS,
    Conversation,
    SyntheticRequest,
    long_tail_workload,
    multi_turn_workload,
    shared_prefix_workload,
)
from conveyor.core.sampling import SamplingParams
from conveyor.engine import Engine, RequestOutput
from conveyor.observe.figures import config_figures, request_figures


def run_all_at_once(engine: Engine, requests: list[SyntheticRequest]) -> tuple[list[RequestOutput], int]:
    """Submit every request at once (greedy, ignore_eos: exactly ``output_len`` tokens each) and step until all
    have finished. Returns their outputs in submit order and the number of steps."""
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    return run_together(engine, [r.prompt_token_ids for r in requests], params, engine.clock())


def run_together(engine: Engine, prompts: list[list[int]], params: list[SamplingParams],
                 arrival_time: float | None = None) -> tuple[list[RequestOutput], int]:
    """Submit every prompt at once, each with its params, and step until all have finished: their outputs in
    submit order, and the number of steps."""
    ids = [engine.add_request(prompt, p, arrival_time=arrival_time) for prompt, p in zip(prompts, params, strict=True)]
    done: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        steps += 1
    return [done[i] for i in ids], steps


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Which seeded workload ``bench throughput`` runs, and its shape.

    ``longtail``: ``num_prompts`` requests at once, long-tailed prompt and output lengths.
    ``shared-prefix``: ``num_prompts`` requests at once over ``num_prefixes`` shared prefixes of
    ``prefix_range`` tokens, each with a short question of its own and ``output_range[1]`` output tokens.
    ``multi-turn``: ``num_prompts`` conversations of ``num_turns`` turns, all started at once; each turn is sent
    when the previous one is answered and resends the whole history (system prompt, questions, answers).
    """

    kind: str = "longtail"
    num_prompts: int = 128
    seed: int = 0
    output_range: tuple[int, int] = (8, 512)
    prompt_range: tuple[int, int] = (16, 512)
    num_prefixes: int = 8
    prefix_range: tuple[int, int] = (400, 800)
    num_turns: int = 6

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}, got {self.kind!r}")
        if self.num_prompts < 1 or self.num_prefixes < 1 or self.num_turns < 1:
            raise ValueError("--num-prompts, --num-prefixes and --num-turns must be >= 1")


def run_throughput(engine: Engine, spec: WorkloadSpec, outputs: list[list[int]] | None = None) -> dict[str, Any]:
    """Run the workload to the end; the engine's trace is recorded too (``engine.trace``). ``outputs``, if given,
    receives every request's output token ids, in the workload's order (to compare configurations)."""
    vocab = engine.model_config.vocab_size
    trace = engine.start_trace()
    start = time.monotonic()
    if spec.kind == "multi-turn":
        conversations = multi_turn_workload(spec.num_prompts, spec.seed, vocab, spec.num_turns, spec.output_range[1])
        finished, steps = run_conversations(engine, conversations)
    else:
        finished, steps = run_all_at_once(engine, _requests(spec, vocab))
    elapsed = time.monotonic() - start
    if outputs is not None:
        outputs.extend(o.token_ids for o in finished)
    _, idle_fraction = trace.slot_fill()
    stats = engine.stats()
    return {
        **config_figures(engine.config),
        "workload": spec.kind,
        "seed": spec.seed,
        **request_figures(
            [len(o.prompt_token_ids) for o in finished],
            [len(o.token_ids) for o in finished],
            [o.metrics.time_to_first_token for o in finished],
            [o.metrics.latency for o in finished],
            elapsed,
            steps,
        ),
        **_prefix_cache_figures(finished),
        "preemptions": sum(o.metrics.num_preemptions for o in finished),
        "swaps_out": stats.num_swaps_out,
        "swap_fallbacks_to_recompute": stats.num_swap_fallbacks,
        "peak_running": trace.peak_running(),
        "kv_waste_fraction": trace.mean_kv_waste(),
        "idle_slot_fraction": idle_fraction,
    }


def _requests(spec: WorkloadSpec, vocab_size: int) -> list[SyntheticRequest]:
    if spec.kind == "shared-prefix":
        return shared_prefix_workload(spec.num_prompts, spec.seed, vocab_size, spec.num_prefixes, spec.prefix_range,
                                      spec.output_range[1])
    return long_tail_workload(spec.num_prompts, spec.seed, vocab_size, prompt_range=spec.prompt_range,
                              output_range=spec.output_range)


def _prefix_cache_figures(finished: list[RequestOutput]) -> dict[str, Any]:
    """Prompt tokens sent, and how many of them were computed (the rest came from the prefix cache)."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in finished)
    cached = sum(o.num_cached_tokens for o in finished)
    return {
        "prompt_tokens_computed": prompt_tokens - cached,
        "prefix_cache_hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
    }


def run_conversations(engine: Engine, conversations: list[Conversation]) -> tuple[list[RequestOutput], int]:
    """Start every conversation at once; send each next turn as soon as the previous one is answered (no think
    time), with the answer's tokens in its history. Returns every turn's output (conversation by conversation,
    turn by turn) and the number of steps."""
    answers: list[list[list[int]]] = [[] for _ in conversations]
    owner: dict[str, int] = {}
    place: dict[str, tuple[int, int]] = {}  # request id -> (conversation, turn)

    def send(index: int) -> None:
        conversation = conversations[index]
        prompt = conversation.prompt(len(answers[index]), answers[index])
        params = SamplingParams(temperature=0.0, max_tokens=conversation.output_len, ignore_eos=True)
        request_id = engine.add_request(prompt, params)
        owner[request_id], place[request_id] = index, (index, len(answers[index]))

    for index in range(len(conversations)):
        send(index)
    finished, steps = [], 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished.append(output)
                index = owner.pop(output.request_id)
                answers[index].append(output.token_ids)
                if len(answers[index]) < len(conversations[index].questions):
                    send(index)
        steps += 1
    return sorted(finished, key=lambda o: place[o.request_id]), steps


def print_throughput(result: dict[str, Any]) -> None:
    print(format_table(["figure", "value"], [[name, value] for name, value in result.items()]))


COMPARE_COLUMNS = {
    "output tok/s": "output_tokens_per_s",
    "req/s": "requests_per_s",
    "mean latency s": "latency_mean_s",
    "p99 latency s": "latency_p99_s",
    "mean TTFT s": "ttft_mean_s",
    "p50 TTFT s": "ttft_p50_s",
    "p99 TTFT s": "ttft_p99_s",
    "prompt tokens computed": "prompt_tokens_computed",
    "idle slots": "idle_slot_fraction",
    "preemptions": "preemptions",
    "swaps": "swaps_out",
    "peak running": "peak_running",
    "KV waste": "kv_waste_fraction",
}


def print_comparison(labels: list[str], results: list[dict[str, Any]], outputs: list[list[list[int]]]) -> None:
    """One row per configuration, and each one's output tokens/s relative to the first."""
    base = results[0]["output_tokens_per_s"]
    rows = [
        [label, *(result[key] for key in COMPARE_COLUMNS.values()), f"{result['output_tokens_per_s'] / base:.2f}x"]
        for label, result in zip(labels, results)
    ]
    print(format_table(["configuration", *COMPARE_COLUMNS, "vs first"], rows))
    for label, run in zip(labels[1:], outputs[1:]):
        same = sum(a == b for a, b in zip(run, outputs[0]))
        print(f"{label}: {same} of {len(run)} requests' output tokens equal to {labels[0]}'s")


def write_json(results: Any, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
