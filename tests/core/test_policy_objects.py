"""Policies and preemption modes are objects chosen once: the scheduler's body names none of them.

The behaviour of fcfs, priority and lpm is held by the property tests (test_scheduler_properties.py,
test_policies_property.py, test_prefix_caching_properties.py) and the greedy equality test
(test_policy_matrix.py); these check the seams: every flag value has its object, a policy handed to the
scheduler is the one it runs, and a new policy is a subclass, not an edit of the scheduler.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conveyor.core.config import engine_option
from conveyor.core.kv import PagedKVCacheManager
from conveyor.core.request import Request
from conveyor.core.scheduler import Scheduler, SchedulerConfig
from conveyor.core.scheduler.policies import POLICY_CLASSES, SchedulingPolicy, make_policy
from conveyor.core.scheduler.preemption import PREEMPTION_CLASSES, RecomputePreemption, SwapPreemption
from tests.harness import FakeClock, Harness, make_scheduler

SCHEDULER_DIR = Path(__file__).resolve().parents[2] / "conveyor" / "core" / "scheduler"


def test_every_flag_value_has_its_object() -> None:
    assert set(POLICY_CLASSES) == set(engine_option("scheduling_policy").choices)
    assert set(PREEMPTION_CLASSES) == set(engine_option("preemption_mode").choices)
    kv = PagedKVCacheManager(8, 4)
    for name, cls in POLICY_CLASSES.items():
        policy = make_policy(name, kv)
        assert type(policy) is cls and policy.name == name


def test_the_scheduler_runs_the_objects_its_config_names() -> None:
    scheduler = make_scheduler(8, 4, policy="priority", preemption_mode="swap", num_cpu_blocks=4)
    assert scheduler.policy.name == "priority" and isinstance(scheduler.preemption, SwapPreemption)
    assert isinstance(make_scheduler(8, 4).preemption, RecomputePreemption)


def test_no_policy_or_mode_is_named_in_the_schedulers_code() -> None:
    """What differs between policies lives in their objects: no comparison with a policy's or mode's name."""
    names = set(POLICY_CLASSES) | set(PREEMPTION_CLASSES)
    for path in (SCHEDULER_DIR / "continuous.py", SCHEDULER_DIR / "static.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                constants = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant)}
                assert not constants & names, f"{path.name}:{node.lineno} compares with a policy or mode name"


class ShortestPromptFirst(SchedulingPolicy):
    """A policy the scheduler has never heard of: the shortest waiting prompt first."""

    name = "shortest-prompt-first"

    def next_to_admit(self, waiting: list[Request], passed_over: set[str]) -> Request | None:
        candidates = [r for r in waiting if r.request_id not in passed_over]
        return min(candidates, key=lambda r: (r.num_prompt_tokens, *self.order(r)), default=None)


def test_a_new_policy_is_an_object_handed_to_the_scheduler() -> None:
    kv = PagedKVCacheManager(64, 4)
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=256)
    h = Harness(Scheduler(config, kv, clock=FakeClock(), policy=ShortestPromptFirst(kv)))
    for name, length in [("long", 30), ("mid", 12), ("short", 3)]:
        h.add(name, length, max_tokens=2, ignore_eos=True)
    first_seen: list[str] = []
    for output in h.run_to_end():
        first_seen += [s.request_id for s in output.scheduled if s.request_id not in first_seen]
    assert first_seen == ["short", "mid", "long"]


def test_a_swap_that_finds_no_room_is_counted_by_its_mode() -> None:
    kv = PagedKVCacheManager(4, 4, num_cpu_blocks=1)
    mode = SwapPreemption()
    h = Harness(Scheduler(SchedulerConfig(8, 64, 16, preemption_mode="swap"), kv, clock=FakeClock(),
                          preemption=mode))
    h.add("first", 6, max_tokens=6, ignore_eos=True)
    h.add("second", 6, max_tokens=6, ignore_eos=True)
    h.run_to_end()
    assert mode.num_fallbacks == h.scheduler.num_swap_fallbacks == h.scheduler.stats().num_swap_fallbacks >= 1
