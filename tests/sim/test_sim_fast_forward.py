"""The simulator's fast-forward (decodes advanced as a group) against stepping one request at a time.

Identical means identical: every finished request's TTFT, latency, tokens and preemptions, in the order
they finished, every figure of the run, and every step of the trace, on random workloads and settings that
force preemption, swap, prefix sharing, chunked prompts and long queues.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.core.config import EngineConfig
from conveyor.observe.trace import step_as_dict
from conveyor.sim.cluster import simulate_cluster
from conveyor.sim.cost import CostModel, StepWork
from conveyor.sim.hardware import load_hardware, load_model_config
from conveyor.sim.simulator import Simulation
from conveyor.sim.workload import ConversationShape, WorkloadRequest


class SharedBlocksPriced(CostModel):
    """The roofline, plus a price on each block a decode reads that an earlier decode of its step read (a
    measured profile prices those keys apart): a block miscounted anywhere changes the figures."""

    def step_time(self, work: StepWork, block_size: int = 16) -> float:
        return super().step_time(work, block_size) + 1e-4 * work.shared_decode_blocks


SMALL = SharedBlocksPriced(load_model_config("SmolLM2-135M"), load_hardware("A100-80GB"), "float16")
# How it ran, not what it found.
RUN_ONLY = ("fast_forward", "decodes_fast_forwarded", "steps_fast_forwarded", "simulation_wall_s")


def _workload(rng: random.Random, num: int, max_prompt: int, max_output: int) -> list[WorkloadRequest]:
    """Bursts and gaps, short and long requests, priorities, some over shared prefixes."""
    clock, requests = 0.0, []
    for _ in range(num):
        clock += rng.choice([0.0, 0.0, rng.expovariate(20.0), rng.uniform(0.0, 0.5)])
        prompt = rng.randint(1, max_prompt)
        shared = rng.choice([0, 0, rng.randint(0, prompt)])
        requests.append(WorkloadRequest(clock, prompt, rng.randint(1, max_output), rng.randint(0, 2),
                                        rng.randint(0, 2), shared, rng.choice(["", "a", "b"])))
    return requests


def _conversations(rng: random.Random, num: int) -> list[ConversationShape]:
    return [ConversationShape(rng.randint(0, 40), tuple(rng.randint(1, 30) for _ in range(3)), rng.randint(1, 40),
                              rng.uniform(0, 0.3), rng.choice([None, 0])) for _ in range(num)]


def _run(config: EngineConfig, workload, conversations, fast_forward: bool, trace: bool):
    simulation = Simulation(config, SMALL, workload, trace, conversations, fast_forward=fast_forward)
    figures = simulation.run()
    steps = [step_as_dict(step) for step in simulation.trace.steps] if trace else None
    # NaN (a figure of no request, such as TPOT when every output is one token) equals itself here.
    return simulation, {k: "nan" if v != v else v for k, v in figures.items() if k not in RUN_ONLY}, steps


def _assert_identical(config: EngineConfig, workload, conversations=None) -> Simulation:
    plain, plain_figures, plain_steps = _run(config, workload, conversations, False, True)
    fast, fast_figures, fast_steps = _run(config, workload, conversations, True, True)
    untraced, untraced_figures, _ = _run(config, workload, conversations, True, False)
    for other, figures in ((fast, fast_figures), (untraced, untraced_figures)):
        assert other.finished == plain.finished  # per request: lengths, TTFT, latency, arrival, finish, preemptions
        assert figures == plain_figures
    assert len(fast_steps) == len(plain_steps)
    for index, (got, want) in enumerate(zip(fast_steps, plain_steps)):
        assert got == want, f"step {index + 1} differs"
    return fast


CONFIGS = st.fixed_dictionaries({
    "scheduling_policy": st.sampled_from(["fcfs", "fcfs", "lpm", "priority", "fair"]),
    "preemption_mode": st.sampled_from(["recompute", "swap"]),
    "kv_layout": st.sampled_from(["paged", "paged", "contiguous"]),
    "enable_prefix_caching": st.booleans(),
    "block_size": st.sampled_from([1, 2, 4, 8, 16]),
    "max_num_seqs": st.integers(1, 12),
    "max_num_batched_tokens": st.sampled_from([8, 16, 64, 256]),
    "num_kv_blocks": st.integers(8, 160),
    "max_num_partial_prefills": st.sampled_from([1, 1, 1, 2]),
})


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(CONFIGS, st.integers(0, 10**6), st.booleans())
def test_fast_forward_gives_the_same_requests_figures_and_trace_as_stepping(options, seed, conversing):
    _assert_identical(*random_case(options, seed, conversing))


def random_case(options: dict, seed: int, conversing: bool):
    """A drawn configuration (``CONFIGS``) with swap space and a model length its pool holds, and a random
    workload (and conversations) for it."""
    block_size, blocks = options["block_size"], options["num_kv_blocks"]
    if options["kv_layout"] == "contiguous":
        options["enable_prefix_caching"] = False
    max_model_len = min(block_size * blocks, 160)
    config = EngineConfig(**options, max_model_len=max_model_len,
                          swap_space=blocks // 2 * block_size * SMALL.kv_bytes_per_token)
    rng = random.Random(seed)
    workload = _workload(rng, rng.randint(1, 30), max_model_len - 1, 120)
    conversations = _conversations(rng, rng.randint(1, 4)) if conversing else None
    return config, workload, conversations


def test_a_long_run_is_advanced_as_a_group_and_passes_every_kind_of_event():
    """Steady decodes over many blocks, arrivals between them, chunked prompts beside the group, a pool that
    runs short (the group leaves, requests are preempted, then join again), prefix caching indexing output."""
    rng = random.Random(3)
    workload = _workload(rng, 120, 300, 400)
    config = EngineConfig(block_size=4, max_num_seqs=24, max_num_batched_tokens=64, num_kv_blocks=600,
                          max_model_len=1200)
    fast = _assert_identical(config, workload)
    assert fast.core.scheduler.fast_forward
    assert fast.finished.preemptions > 0  # the pool ran short
    scheduler = fast.core.scheduler
    assert scheduler.num_grouped_decodes > 2 * scheduler.num_listed_decodes


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**6), st.sampled_from(["round-robin", "least-loaded", "cache-aware"]), st.booleans())
def test_a_cluster_of_fast_forwarding_replicas_gives_the_same_figures(seed, router, conversing):
    """Each replica advances its own group; the router reads every replica's queues, pool and finished prompts."""
    rng = random.Random(seed)
    config = EngineConfig(block_size=4, max_num_seqs=6, max_num_batched_tokens=64, num_kv_blocks=60,
                          max_model_len=200)
    workload = _workload(rng, rng.randint(5, 40), 150, 120)
    conversations = _conversations(rng, 3) if conversing else None
    figures = [simulate_cluster(config, SMALL, workload, 3, router, conversations, seed, fast_forward=fast)
               for fast in (False, True)]
    plain, fast = ({k: "nan" if v != v else v for k, v in f.items() if k not in RUN_ONLY} for f in figures)
    assert fast == plain
    assert figures[1]["steps_fast_forwarded"] > 0 and figures[0]["steps_fast_forwarded"] == 0
