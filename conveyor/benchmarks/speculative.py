"""``conveyor bench speculative``: output tokens per second with and without speculative decoding, in one sitting.

The workload is one whose answers repeat their input, where draft-free drafts pay: rewrite a function of
Conveyor's own source (a few hundred tokens) with one name changed, or repeat a docstring word for word.
Greedy, each request ending at EOS or ``max_tokens``. It runs one request at a time (every interactive
user's case, where a step is bound by reading the weights and drafts come nearly free) and all at once
(64 requests by default, where rows are compute and ``auto`` must turn drafts down), and W2 (256 long-tailed
random-token requests at once: nothing repeats) as the case where drafts should never cost anything.

Engines with and without drafts are loaded side by side and run in turns (without, with, without, ...), so
both see the same machine; each figure is the median of the repeats. The greedy outputs must be identical;
the acceptance rate and the mean tokens a drafted step yields are reported.
"""

from __future__ import annotations

import dataclasses
import inspect
import statistics
import time
from dataclasses import dataclass

from conveyor.benchmarks.report import format_table
from conveyor.benchmarks.throughput import run_all_at_once, run_together
from conveyor.benchmarks.workload import W2_NUM_REQUESTS, W2_SEED, long_tail_workload
from conveyor.core.config import EngineConfig
from conveyor.core.sampling import SamplingParams
from conveyor.core.spec import SpecDecodeStats
from conveyor.engine import Engine
from conveyor.sim.cost import CostModel
from conveyor.sim.hardware import load_hardware
from conveyor.sim.profile import step_cost_model
from conveyor.sim.simulator import simulate
from conveyor.sim.speculative import AcceptanceProfile
from conveyor.sim.workload import WorkloadRequest

REWRITE_MAX_TOKENS = 320
DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4}'


def _sources() -> list[tuple[str, str, str | None]]:
    """(source, name, docstring) of functions of this package (every install has them): the prompts' texts."""
    from conveyor.core import request, stats
    from conveyor.core.kv import paged
    from conveyor.core.scheduler import step_times
    from conveyor.observe import figures

    functions = [request.Request.token_ids, paged.PagedKVCacheManager.grow_table, step_times.StepTimes.record,
                 step_times.StepTimes.line, figures.percentile, paged.PagedKVCacheManager.trim_table,
                 stats.EngineStats.__dict__["num_unfinished"].fget, request.check_prompt_length]
    sources = []
    for function in functions:
        source = inspect.cleandoc(inspect.getsource(function))
        sources.append((source, function.__name__, inspect.getdoc(function)))
    return sources


def rewrite_prompts(engine: Engine) -> list[list[int]]:
    """Chat prompts whose answers repeat their input: rewrite a function with one name changed, or repeat its
    docstring exactly (token ids in the model's chat template)."""
    tokenizer = engine.tokenizer
    prompts = []
    for source, name, doc in _sources():
        asks = [f"Rewrite this Python function with `{name}` renamed to `{name}_v2`. Output only the code.\n\n{source}"]
        if doc:
            asks.append(f"Repeat the following text exactly, word for word:\n\n{doc}")
        prompts += [tokenizer.apply_chat_template([{"role": "user", "content": ask}]) for ask in asks]
    return prompts


@dataclass(frozen=True, slots=True)
class Run:
    seconds: float
    output_tokens: int
    outputs: list[list[int]]
    shapes: list[tuple[int, int]]  # each request's prompt and output tokens

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def _run(start: float, prompts: list[list[int]], outputs: list[list[int]]) -> Run:
    return Run(time.perf_counter() - start, sum(map(len, outputs)), outputs,
               [(len(p), len(o)) for p, o in zip(prompts, outputs)])


def _one_at_a_time(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> Run:
    start = time.perf_counter()
    outputs = [run_together(engine, [prompt], [params])[0][0].token_ids for prompt in prompts]
    return _run(start, prompts, outputs)


def _at_once(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> Run:
    start = time.perf_counter()
    outputs = [o.token_ids for o in run_together(engine, prompts, [params] * len(prompts))[0]]
    return _run(start, prompts, outputs)


def _w2(engine: Engine) -> Run:
    requests = long_tail_workload(W2_NUM_REQUESTS, W2_SEED, engine.model_config.vocab_size)
    start = time.perf_counter()
    outputs = [o.token_ids for o in run_all_at_once(engine, requests)[0]]
    return _run(start, [r.prompt_token_ids for r in requests], outputs)


def _spec_stats(engine: Engine) -> SpecDecodeStats:
    return SpecDecodeStats.from_engine_stats(engine.stats())


def compare_case(plain: Engine, drafted: Engine, run, repeats: int) -> dict:
    """``run(engine)`` on both engines in turns, ``repeats`` times each: the medians, their ratio, whether the
    outputs agree, and the drafts of the drafted engine's runs."""
    before = _spec_stats(drafted)
    plain_runs, drafted_runs = [], []
    for _ in range(repeats):
        plain_runs.append(run(plain))
        drafted_runs.append(run(drafted))
    counted = _spec_stats(drafted).since(before)
    drafts, draft_tokens, accepted = counted.num_drafts, counted.num_draft_tokens, counted.num_accepted_tokens
    plain_rate = statistics.median(r.tokens_per_s for r in plain_runs)
    drafted_rate = statistics.median(r.tokens_per_s for r in drafted_runs)
    return {
        "plain_tokens_per_s": round(plain_rate, 1),
        "speculative_tokens_per_s": round(drafted_rate, 1),
        "speedup": round(drafted_rate / plain_rate, 3),
        # Run by run: the n-th runs of both engines met the same prefix cache (a cached prompt's last block is
        # computed alone, which may move a near tie either way in both).
        "identical_outputs": all(p.outputs == d.outputs for p, d in zip(plain_runs, drafted_runs)),
        "output_tokens": plain_runs[0].output_tokens,
        "acceptance_rate": round(accepted / draft_tokens, 3) if draft_tokens else None,
        "tokens_per_drafted_step": round(1 + accepted / drafts, 2) if drafts else None,
        "drafted_request_steps": drafts,
        "acceptance_profile": AcceptanceProfile.from_stats(counted).to_json() if sum(counted.proposal_lengths)
        else None,
        "requests": plain_runs[0].shapes,  # [prompt tokens, output tokens]: the simulator's workload
    }


def run_speculative_bench(plain: Engine, drafted: Engine, batch: int, repeats: int, w2: bool) -> dict[str, dict]:
    """Every case of the module's doc; ``batch``: the at-once case's requests (the prompts repeated to fill)."""
    prompts = rewrite_prompts(plain)
    params = SamplingParams(temperature=0.0, max_tokens=REWRITE_MAX_TOKENS)
    batch_prompts = (prompts * (batch // len(prompts) + 1))[:batch]
    cases = {
        "rewrite@1": lambda engine: _one_at_a_time(engine, prompts, params),
        f"rewrite@{batch}": lambda engine: _at_once(engine, batch_prompts, params),
    }
    if w2:
        cases["W2"] = _w2
    _one_at_a_time(plain, prompts[:2], params)  # warm both (kernel caches, first allocations)
    _one_at_a_time(drafted, prompts[:2], params)
    return {name: compare_case(plain, drafted, run, repeats) for name, run in cases.items()}


def print_speculative(results: dict[str, dict]) -> None:
    headers = ["case", "plain tok/s", "speculative tok/s", "speed-up", "identical", "acceptance", "tokens/step",
               "simulated speed-up"]
    rows = [[name, r["plain_tokens_per_s"], r["speculative_tokens_per_s"], f'{r["speedup"]:.2f}x',
             "yes" if r["identical_outputs"] else "NO", r["acceptance_rate"], r["tokens_per_drafted_step"],
             f'{r["predicted_speedup"]:.2f}x' if "predicted_speedup" in r else "-"]
            for name, r in results.items()]
    print(format_table(headers, rows))


def predicted_speedups(engine: Engine, config: EngineConfig, results: dict[str, dict],
                       step_profile: str = "auto") -> str:
    """The simulator's speed-up for each rewrite case, on the case's own requests (lengths measured above) and
    drafts (its acceptance profile), steps priced by this machine's step profile (``conveyor simulate
    calibrate``) where it is current: one at a time as a sum of lone runs, at once as one run. Adds
    ``predicted_speedup`` to each case; returns what priced the steps."""
    cost, priced_by = step_cost_model(engine.model_config, load_hardware("cpu-local"), config.dtype,
                                      step_profile=step_profile, threads=engine.runner.num_threads,
                                      kv_element_bytes=engine.runner.kv_itemsize)
    plain_config = dataclasses.replace(config, speculative_config=None)
    drafted_config = dataclasses.replace(config, speculative_config=config.speculative_config or DEFAULT_SPEC)
    for name, result in results.items():
        if result["acceptance_profile"] is None or not name.startswith("rewrite@"):
            continue
        profile = AcceptanceProfile(tuple(result["acceptance_profile"]["proposal_lengths"]),
                                    tuple(result["acceptance_profile"]["acceptance"]))
        requests = [WorkloadRequest(0.0, prompt, output) for prompt, output in result["requests"]]
        batches = [[r] for r in requests] if name == "rewrite@1" else [requests]
        plain_seconds = _simulated_seconds(plain_config, cost, batches, None)
        drafted_seconds = _simulated_seconds(drafted_config, cost, batches, profile)
        result["predicted_speedup"] = round(plain_seconds / drafted_seconds, 3)
    return priced_by


def _simulated_seconds(config: EngineConfig, cost: CostModel, batches: list[list[WorkloadRequest]],
                       acceptance: AcceptanceProfile | None) -> float:
    """Simulated seconds to run the batches one after another, each all at once."""
    return sum(simulate(config, cost, batch, acceptance=acceptance)[0]["elapsed_s"] for batch in batches)
