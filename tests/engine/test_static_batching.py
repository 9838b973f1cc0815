"""Static (request-level) batching against continuous batching, and the trace that shows the difference."""

from __future__ import annotations

import random

import pytest

from conveyor import LLM, SamplingParams
from conveyor.core.scheduler.output import SchedulerOutput
from conveyor.entrypoints.cli import main
from conveyor.observe.trace import Trace


def _workload(n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 40000) for _ in range(rng.randrange(1, 80))] for _ in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 40), ignore_eos=True) for _ in range(n)]
    return prompts, params


def _run(tiny_model_dir, scheduler: str, **options):
    llm = LLM(str(tiny_model_dir), scheduler=scheduler, max_num_seqs=4, **options)
    trace = llm.engine.start_trace()
    prompts, params = _workload(14, seed=11)
    return llm.generate(prompts, params, use_tqdm=False), trace


@pytest.mark.parametrize("options", [dict(num_kv_blocks=512), dict(num_kv_blocks=24, block_size=4)],
                         ids=["roomy", "tiny-pool"])
def test_static_and_continuous_give_the_same_tokens(tiny_model_dir, options):
    continuous, _ = _run(tiny_model_dir, "continuous", **options)
    static, trace = _run(tiny_model_dir, "static", **options)
    assert [o.token_ids for o in static] == [o.token_ids for o in continuous]
    if options["num_kv_blocks"] == 24:
        assert any(step.preempted for step in trace.steps), "the tiny pool should force preemption"


def test_static_batch_admits_nobody_until_its_last_request_finishes(tiny_model_dir):
    outputs, trace = _run(tiny_model_dir, "static", num_kv_blocks=512)
    batches: list[set[str]] = []
    previous: set[str] = set()
    for step in trace.steps:
        current = set(step.slots)
        if current - previous:
            assert not previous & current, f"step {step.step}: a request joined a batch still in progress"
            batches.append(current)
        previous = current
    assert len(batches) == -(-14 // 4)  # 14 requests in batches of 4
    # Results are delivered together, when the batch completes.
    by_id = {o.request_id: o for o in outputs}
    for batch in batches:
        assert len({by_id[i].metrics.finish_time for i in batch}) == 1


def test_continuous_fills_a_freed_slot_on_the_next_step(tiny_model_dir):
    _, trace = _run(tiny_model_dir, "continuous", num_kv_blocks=512)
    refills = 0
    for before, after in zip(trace.steps, trace.steps[1:]):
        if before.finished and before.num_waiting:
            assert set(after.scheduled) - set(before.slots), f"step {after.step}: nobody joined after a finish"
            refills += 1
    assert refills > 0


def test_idle_fraction_of_a_hand_made_trace(tmp_path):
    """Two slots, three steps: a works 3 steps, b works 1 then is held idle 2 steps -> 2 of 6 idle."""
    trace = Trace({"scheduler": "static", "max_num_seqs": 2, "max_num_batched_tokens": 8}, origin=0.0)
    for step, scheduled in enumerate([{"a": 3, "b": 2}, {"a": 1}, {"a": 1}], start=1):
        output = SchedulerOutput(step=step, scheduled=[])
        trace.record(output, ["a", "b"], [], float(step), float(step) + 1)
        trace.steps[-1].scheduled = scheduled
    grid, idle = trace.slot_fill()
    assert idle == pytest.approx(2 / 6)
    assert sorted(grid, key=lambda row: row.count(True)) == [[True, False, False], [True, True, True]]
    trace.write(tmp_path / "t.jsonl")
    again = Trace.read(tmp_path / "t.jsonl")
    assert again.config == trace.config and again.steps == trace.steps


def test_bench_compare_and_timeline_plot(tiny_model_dir, tmp_path, capsys):
    traces = tmp_path / "traces"
    code = main(["bench", "throughput", "--model", str(tiny_model_dir), "--num-prompts", "12", "--max-num-seqs", "4",
                 "--output-len", "2,40", "--num-kv-blocks", "256", "--trace", str(traces),
                 "--compare", "scheduler=continuous", "scheduler=static"])
    assert code == 0
    table = capsys.readouterr().out
    assert "scheduler=static" in table and "idle slots" in table
    png = tmp_path / "timeline.png"
    assert main(["plot", "timeline", *map(str, sorted(traces.glob("*.jsonl"))), "-o", str(png)]) == 0
    assert png.stat().st_size > 10_000
    assert "of slot-steps idle" in capsys.readouterr().out


def test_compare_rejects_an_unknown_option(tiny_model_dir, capsys):
    code = main(["bench", "throughput", "--model", str(tiny_model_dir), "--compare", "schedular=static"])
    assert code == 2
    assert "schedular" in capsys.readouterr().err
