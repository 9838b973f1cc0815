"""The simulator against the real engine, workload by workload, each run through both with the same seed.

The workloads are :mod:`conveyor.sim.validation`'s. The simulator runs the same scheduler on the same
requests (the same lengths, arrival times, priorities and shared prefixes), its steps priced by this
machine's measured step profile (``conveyor simulate calibrate``) when there is a current one.
This module imports torch (through the engine); the simulator itself does not.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from typing import Any

from conveyor.benchmarks.calibrate import Probe, time_probe, timed_step
from conveyor.benchmarks.report import format_table
from conveyor.core.burst import burst_end
from conveyor.core.config import EngineConfig
from conveyor.core.sampling import SamplingParams
from conveyor.engine import Engine, RequestOutput
from conveyor.observe.figures import request_figures
from conveyor.sim.cost import CostModel, StepWork, with_pace
from conveyor.sim.hardware import load_hardware
from conveyor.sim.profile import ProfiledCostModel, step_cost_model
from conveyor.sim.simulator import simulate
from conveyor.sim.validation import CASE_NAMES, FIGURES, ValidationCase, error, validation_cases


def real_prompts(case: ValidationCase, vocab_size: int, seed: int) -> list[list[int]]:
    """Token ids for each request: a shared prefix is the same ids in every request that shares it."""
    rng = random.Random(f"{seed}:{case.name}:tokens")
    prefixes: dict[int, list[int]] = {}
    prompts = []
    for request in case.requests:
        shared = request.shared_prefix_len
        if shared and request.shared_prefix_id not in prefixes:
            prefixes[request.shared_prefix_id] = [rng.randrange(vocab_size // 8, vocab_size) for _ in range(shared)]
        own = [rng.randrange(vocab_size // 8, vocab_size) for _ in range(request.prompt_len - shared)]
        prompts.append((prefixes[request.shared_prefix_id] if shared else []) + own)
    return prompts


# A real run's step: its work, its wall seconds, and when it started (seconds since the run's start).
TimedStep = tuple[StepWork, float, float]
PACE_WINDOW_S = 1.0  # the windows of a run over which its pace's variation is measured (run_pace)
# Steps of decodes alone, split by their rows (run_pace): a few rows read the weights (memory-bound), many rows
# compute (compute-bound), and a machine whose memory changes speed moves one against the other.
FEW_DECODE_ROWS, MANY_DECODE_ROWS = 3, 16


def run_real(engine: Engine, case: ValidationCase,
             prompts: list[list[int]]) -> tuple[dict[str, Any], list[TimedStep]]:
    """Requests join as the wall clock passes their arrival; the engine steps while it has work, its first step
    after a pause once the burst that woke it has come (as the server's loop: conveyor.core.burst). The run's
    figures, and each step's work, wall seconds and start (those that compute or copy something)."""
    order = sorted(range(len(prompts)), key=lambda i: case.requests[i].arrival_time)
    times = [case.requests[i].arrival_time for i in order]
    wait_s = engine.config.burst_wait_ms / 1000
    start = engine.clock()
    done: list[RequestOutput] = []
    timed: list[TimedStep] = []
    steps, taken, idle = 0, 0, True
    while order or engine.has_unfinished_requests():
        now = engine.clock() - start
        woken_by = taken
        while order and case.requests[order[0]].arrival_time <= now:
            index = order.pop(0)
            taken += 1
            request = case.requests[index]
            params = SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)
            engine.add_request(prompts[index], params,
                               arrival_time=start + request.arrival_time, priority=request.priority)
        if not engine.has_unfinished_requests():
            time.sleep(max(case.requests[order[0]].arrival_time - now, 0.0))
            idle = True
            continue
        if idle:  # the rest of the burst joins the first step
            idle = False
            time.sleep(max(burst_end(times[woken_by], times, woken_by + 1, wait_s) - now, 0.0))
            continue
        started = engine.clock() - start
        outputs, work, seconds = timed_step(engine)
        done.extend(o for o in outputs if o.finished)
        steps += 1
        if work.num_tokens or work.swap_blocks:
            timed.append((work, seconds, started))
    elapsed = engine.clock() - start
    figures = request_figures([len(o.prompt_token_ids) for o in done], [len(o.token_ids) for o in done],
                              [o.metrics.time_to_first_token for o in done], [o.metrics.latency for o in done],
                              elapsed, steps)
    return {**figures, "preemptions": sum(o.metrics.num_preemptions for o in done)}, timed


def run_case(config: EngineConfig, engine: Engine, cost: CostModel, case: ValidationCase, seed: int,
             repeats: int = 1) -> tuple[dict[str, Any], dict[str, Any]]:
    """The case through the real engine ``repeats`` times, and through the simulator once per real run, at the
    pace the machine had during that run (``run_pace``). The figures of both are the medians of their runs, each
    run kept under ``runs``: on a shared machine one run of a workload whose requests queue can move by a fifth
    on its own. Each real run has prompt tokens of its own (the same lengths and shared prefixes), so none
    finds another's in the cache."""
    runs, predictions = [], []
    case_config = dataclasses.replace(config, **case.overrides)
    for r in range(repeats):
        figures, timed = run_real(engine, case, real_prompts(case, engine.model_config.vocab_size, seed + 1000 * r))
        runs.append({**figures, **run_pace(timed, cost, engine.config.block_size)})
        predictions.append(simulate(case_config, with_pace(cost, runs[-1]["pace"]), list(case.requests))[0])
    measured = {key: median_of([run[key] for run in runs]) for key in runs[0]} | {"runs": runs}
    predicted = {key: median_of([run[key] for run in predictions]) for key in predictions[0]}
    return measured, predicted


def run_pace(timed: list[TimedStep], cost: CostModel, block_size: int) -> dict[str, float]:
    """How much longer than their price the run's own steps took: the machine's pace during the run, which the
    simulator's run beside it takes. This machine's speed moves by a quarter from one minute to the next, and
    within a run of a few seconds; a probe timed before and after a run read it 0.8-0.9 where the run's own
    steps took 1.03-1.09 of their price, and a queue near capacity magnifies that tenfold. Taken over every step
    of the run, the pace leaves the simulator's decisions (what each step holds, when requests wait, whom a
    preemption hits) and the relative price of one kind of step against another to be checked, not the
    machine's speed; the latter is reported per kind: ``decodes`` (steps of decodes alone) and ``with prompts``
    (steps with a prompt chunk), each over the pace, and the decodes again by their rows: ``few decodes`` (up to
    FEW_DECODE_ROWS) and ``many decodes`` (MANY_DECODE_ROWS or more). Those two part when the machine's memory
    and its arithmetic no longer stand as they did when the profile was measured (this machine's memory read
    moves between about 46 and 80 GB/s): with a profile measured four hours before, steps of one decode took
    0.87-0.92 of the pace and steps of 16-31 decodes 1.07-1.08, and the simulator, faster than the machine
    exactly where a queue forms, put poisson-high's mean TTFT up to 36% short; calibrated again, 0.88-0.96 and
    0.96-0.98, and 1-6% short (docs/benchmarks/simulator.md). ``variation``: how much the pace moved within
    the run, the coefficient of variation of its pace over windows of PACE_WINDOW_S: one pace for the whole run
    leaves that out, and a queue near capacity grows in the slow moments more than it drains in the fast ones
    (on this machine, 5-14% at 1 s; the same runs' pace replayed window by window took the simulator's mean
    latency from 8-19% short to within 3%: docs/benchmarks/simulator.md)."""
    priced = [(work, seconds, started, cost.step_time(work, block_size)) for work, seconds, started in timed]

    def pace(steps: list[tuple[StepWork, float, float, float]]) -> float | None:
        price = sum(step[3] for step in steps)
        return sum(step[1] for step in steps) / price if steps and price else None

    whole = pace(priced) or 1.0
    alone = [step for step in priced if step[0].num_tokens and step[0].decode_rows == step[0].num_tokens]
    kinds = {"decodes": alone, "with prompts": [step for step in priced if step[0].num_tokens > step[0].decode_rows],
             "few decodes": [step for step in alone if step[0].decode_rows <= FEW_DECODE_ROWS],
             "many decodes": [step for step in alone if step[0].decode_rows >= MANY_DECODE_ROWS]}
    windows: dict[int, list[tuple[StepWork, float, float, float]]] = {}
    for step in priced:
        windows.setdefault(int(step[2] // PACE_WINDOW_S), []).append(step)
    paces = [p for p in map(pace, windows.values()) if p is not None]
    by_kind = {kind: (kind_pace / whole if (kind_pace := pace(steps)) else float("nan"))
               for kind, steps in kinds.items()}
    return {"pace": whole, **by_kind,
            "variation": statistics.pstdev(paces) / statistics.fmean(paces) if len(paces) > 1 else 0.0}


def median_of(values: list[Any]) -> Any:
    return statistics.median(values) if all(isinstance(v, int | float) for v in values) else values[0]


def validate_suite(config: EngineConfig, num: int = 48, seed: int = 0, names: tuple[str, ...] = CASE_NAMES,
                   step_profile: str = "auto", repeats: int = 3) -> list[dict[str, Any]]:
    """Every case in turn; prints each case's table as it ends, then the table of errors. Returns the rows.

    The Poisson rates are shares of the rate the engine sustained on the first case, so the suite means the
    same on a slow machine and a fast one.
    """
    engines: dict[str, Engine] = {}
    first = validation_cases(num, seed, 1.0, config.max_num_seqs)[0]
    base = _engine(engines, config, first.overrides)
    cost, priced_by = step_cost_model(base.model_config, load_hardware("cpu-local"), config.dtype,
                                      step_profile=step_profile, threads=base.runner.num_threads,
                                      kv_element_bytes=base.runner.kv_itemsize)
    print(f"validation, steps priced by the {priced_by}{_measured_ago(cost)}", flush=True)
    print(f"{first.name}: {first.description} ...", flush=True)
    measured, predicted = run_case(config, base, cost, first, seed, repeats)
    results = []
    for case in validation_cases(num, seed, measured["requests_per_s"], config.max_num_seqs):
        if case.name not in names:
            continue
        if case.name != first.name:
            print(f"{case.name}: {case.description} ...", flush=True)
            measured, predicted = run_case(config, _engine(engines, config, case.overrides), cost, case, seed,
                                           repeats)
        results.append({"case": case.name, "description": case.description, "priced_by": priced_by,
                        "measured": measured, "predicted": predicted})
        print_case(results[-1])
    print_errors(results)
    return results


def _measured_ago(cost: CostModel) -> str:
    """How long ago the step profile was measured: the machine it describes may have changed since (run_pace
    tells by how much; `conveyor simulate calibrate` measures it again)."""
    age = cost.profile.age_s() if isinstance(cost, ProfiledCostModel) else None
    return "" if age is None else f", measured {age / 60:.0f} min ago"


def _engine(engines: dict[str, Engine], config: EngineConfig, overrides: dict[str, Any]) -> Engine:
    """One engine per distinct configuration: the cases that share one share its loaded model."""
    key = repr(sorted(overrides.items()))
    if key not in engines:
        engines.clear()  # one loaded model at a time
        engine = engines[key] = Engine(dataclasses.replace(config, **overrides))
        # The simulator prices a warm engine: a first request pays for thread pools and first touches.
        time_probe(engine, Probe("warm-up", ((0, 64, 4),)), random.Random(0))
    return engines[key]


def print_case(result: dict[str, Any]) -> None:
    measured, predicted = result["measured"], result["predicted"]
    runs = measured["runs"]
    rows = [[label, measured[key], _spread([run[key] for run in runs]), predicted[key],
             f"{error(measured[key], predicted[key]):+.1%}"] for label, key, _ in FIGURES]
    print(f"\n{result['case']}: {result['description']}")
    print(format_table(["figure", f"real engine (median of {len(runs)})", "real runs", "simulator", "error"], rows))
    print(f"the machine's pace in each real run (its steps' time over the profile's price, which the simulator's "
          f"run beside it takes): {_paces(runs)}; over it, steps of decodes alone: {_paces(runs, 'decodes')} "
          f"(of 1-{FEW_DECODE_ROWS} rows: {_paces(runs, 'few decodes')}; of {MANY_DECODE_ROWS} or more: "
          f"{_paces(runs, 'many decodes')}), steps with a prompt: {_paces(runs, 'with prompts')}; "
          f"its variation within the run (the coefficient of "
          f"variation of the pace over {PACE_WINDOW_S:g} s windows): {_percents(runs, 'variation')}")


def _spread(values: list[float]) -> str:
    return f"{min(values):.3g} - {max(values):.3g}" if len(values) > 1 else ""


def print_errors(results: list[dict[str, Any]]) -> None:
    """One row per workload: the simulator's error on each figure, marked where the simulator's figure lies
    within the real runs' own range, and whether every bound holds."""
    rows = []
    for result in results:
        errors = [error(result["measured"][key], result["predicted"][key]) for _, key, _ in FIGURES]
        within = all(abs(e) <= bound for e, (_, _, bound) in zip(errors, FIGURES) if bound is not None)
        cells = [f"{e:+.1%}{' *' if _among_the_runs(result, key) else ''}" for e, (_, key, _) in zip(errors, FIGURES)]
        rows.append([result["case"], *cells[:5],
                     f"{result['measured']['preemptions']} / {result['predicted']['preemptions']}",
                     f"{result['measured']['steps']} / {result['predicted']['steps']}",
                     _paces(result["measured"]["runs"]), "yes" if within else "NO"])
    print("\n" + format_table(["workload", "tok/s", "mean TTFT", "p90 TTFT", "mean latency", "p90 latency",
                               "preemptions real / sim", "steps real / sim", "pace", "within 10% / 15%"], rows))
    print("*: the simulator's figure lies within the range of the real runs' figures: it is no further from their "
          "median than one of the real runs is")


def _among_the_runs(result: dict[str, Any], key: str) -> bool:
    """Whether the simulator's figure lies within the real runs' range (two runs or more): an error the size of
    the real engine's own spread, which more runs would be needed to tell from the simulator's."""
    runs = [run[key] for run in result["measured"]["runs"]]
    return len(runs) > 1 and min(runs) <= result["predicted"][key] <= max(runs)


def _paces(runs: list[dict[str, Any]], key: str = "pace") -> str:
    return ", ".join(f"{run[key]:.2f}" for run in runs)


def _percents(runs: list[dict[str, Any]], key: str) -> str:
    return ", ".join(f"{run[key]:.0%}" for run in runs)
