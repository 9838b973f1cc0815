"""A mixture of experts' decode steps on the real engine against the simulator's price of the same steps.

For each batch (1, 8 and 32 requests by default) the requests' prompts are computed first, then a number of
decode steps of every request at once are timed around ``Engine.step`` (what the simulator's clock stands
for). Each step's work is priced by the cost model the simulator would use on this machine: the measured step
profile when ``conveyor simulate calibrate`` has fitted a current one of this model, else the roofline. Beside
the times, the distinct experts each step's layers ran (counted as the model ran them) and the count the
simulator expects of uniform routing, E (1 - (1 - k/E)^B). And the machine's read bandwidth before and after
each batch, beside the one read around the profile's calibration: this host's memory changes speed from one
minute to the next, and a memory-bound step with it.

``--prompts w1`` takes the comparison's W1 chat prompts (41 tokens, `conveyor bench compare`) in place of random
ones. On a file of random weights those requests soon decode the same tokens, so their rows choose the same few
experts: the routing that the comparison's steps of 16 actually ran, beside the uniform routing the simulator
assumes.

    .venv/bin/conveyor simulate calibrate --model out/models/olmoe-1b-7b-Q4_K_M.gguf --no-validate
    .venv/bin/python bench/moe_steps.py --model out/models/olmoe-1b-7b-Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import random
import statistics

from conveyor.benchmarks.calibrate import gb_s_readings, read_gb_s, timed_step
from conveyor.benchmarks.decode import add_random_requests
from conveyor.benchmarks.machine import ReadProbe
from conveyor.benchmarks.report import format_table
from conveyor.benchmarks.workload import w1_requests
from conveyor.core.config import EngineConfig
from conveyor.core.sampling import SamplingParams
from conveyor.engine import Engine
from conveyor.sim.cost import CostModel, expected_experts
from conveyor.sim.hardware import load_hardware
from conveyor.sim.profile import ProfiledCostModel, step_cost_model

PROMPT_TOKENS = 64


def add_prompts(engine: Engine, batch: int, prompts: str, params: SamplingParams, seed: int) -> None:
    """``batch`` requests at once: random prompts of PROMPT_TOKENS, or the first of W1's chat prompts."""
    if prompts == "random":
        add_random_requests(engine, batch, PROMPT_TOKENS, params, random.Random(seed))
        return
    w1 = w1_requests(engine.tokenizer)
    if batch > len(w1):
        raise SystemExit(f"W1 has {len(w1)} prompts; a batch of {batch} asks for more")
    for request in w1[:batch]:
        engine.add_request(list(request.prompt_token_ids), params)


def timed_decodes(engine: Engine, cost: CostModel, batch: int, steps: int, seed: int,
                  prompts: str = "random") -> list[tuple[float, float, list[int]]]:
    """``batch`` requests' prompts computed, then ``steps`` decode steps of all of them: each step's wall
    seconds, its price by ``cost`` and its distinct experts per mixture-of-experts layer."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    add_prompts(engine, batch, prompts, params, seed)
    rows = []
    while engine.has_unfinished_requests():
        _, work, seconds = timed_step(engine)
        if work.decode_rows == batch and work.num_tokens == batch and len(rows) < steps:
            rows.append((seconds, cost.step_time(work, engine.config.block_size),
                         engine.executor.model.step_experts()))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--steps", type=int, default=12, help="decode steps timed per batch")
    parser.add_argument("--prompts", choices=("random", "w1"), default="random",
                        help="random prompts of 64 tokens, or the comparison's W1 chat prompts (41 tokens)")
    args = parser.parse_args()
    engine = Engine(EngineConfig(model=args.model, max_model_len=1024))
    config = engine.model_config
    cost, source = step_cost_model(config, load_hardware("cpu-local"), engine.config.dtype,
                                   kv_element_bytes=engine.runner.kv_itemsize)
    timed_decodes(engine, cost, 1, 2, seed=0)  # warm-up
    bandwidth = ReadProbe()
    table = []
    for batch in (int(b) for b in args.batches.split(",")):
        before = bandwidth.measure()[0]
        rows = timed_decodes(engine, cost, batch, args.steps, seed=batch, prompts=args.prompts)
        read = "-".join(map(str, gb_s_readings(before, bandwidth.measure()[0])))
        real = statistics.median(seconds for seconds, _, _ in rows)
        simulated = statistics.median(price for _, price, _ in rows)
        touched = statistics.mean(statistics.mean(counts) for _, _, counts in rows)
        expected = expected_experts(config.num_experts, config.num_experts_per_tok, batch)
        table.append([batch, len(rows), real * 1e3, simulated * 1e3, f"{simulated / real - 1:+.1%}",
                      f"{touched:.1f}", f"{expected:.1f}", read])
    calibrated = ""
    if isinstance(cost, ProfiledCostModel):
        calibrated = f", memory read {read_gb_s(cost.profile)} GB/s around its grid"
    print(f"model {args.model}; {args.prompts} prompts; simulated by the {source}{calibrated}")
    print(format_table(["requests", "steps", "engine ms (median)", "simulator ms", "simulator error",
                        "distinct experts per layer, measured", "expected", "memory read GB/s, before-after"],
                       table))


if __name__ == "__main__":
    main()
