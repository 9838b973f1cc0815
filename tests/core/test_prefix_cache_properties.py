"""Prefix caching's promises, on random workloads with heavy sharing (hypothesis, a fake model):

- a block is held exactly by the requests whose tables name it (reference counts), never free while held;
- a cached block is evicted only when no never-cached free block is left, least recently freed first;
- when every request has ended, every block is free (cached or not) and no reference is left;
- a cached block holds what computing it again would write (the fake model's KV is a digest of every token
  up to its position, checked on every read), so outputs equal those of a run without caching.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.core.kv import PagedKVCacheManager, PrefixCachingKVCacheManager, prefix_cache
from conveyor.core.kv.prefix_cache import RefCountedBlockPool
from conveyor.core.request import Request
from conveyor.core.sampling import SamplingParams
from conveyor.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tests.harness import FakeClock, check_pool

VOCAB = 50


class CheckedPool(RefCountedBlockPool):
    """The pool, checking each ``take``: cached blocks are evicted only past the never-cached free ones, LRU."""

    def take(self, n: int) -> list[int]:
        free = self.free_block_ids()  # never-cached first, then the evictable ones, least recently freed first
        taken = super().take(n)
        assert taken == free[:n], "blocks must be taken never-cached first, then least recently used"
        assert not any(self.is_cached(block) for block in taken), "a taken block is still indexed"
        return taken


class ContentExecutor:
    """A fake model whose KV at a position is a digest of every token up to it, as a real model's KV is.

    It checks that the positions a request skips (cached, or computed in earlier steps) are in its blocks with
    the digests a fresh computation would give, writes the new ones, and samples from the content alone.
    """

    def __init__(self, block_size: int, requests: dict[str, Request]) -> None:
        self.block_size = block_size
        self.requests = requests
        self.device: dict[int, list[int | None]] = {}
        self.cpu: dict[int, list[int | None]] = {}

    def digests(self, request: Request, end: int) -> list[int]:
        tokens = request.token_ids(0, end)
        out, digest = [], 17
        for token in tokens:
            digest = hash((digest, token))
            out.append(digest)
        return out

    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        bs = self.block_size
        for cpu, device in output.blocks_to_swap_in:
            self.device[device] = list(self.cpu[cpu])
        for device, cpu in output.blocks_to_swap_out:
            self.cpu[cpu] = list(self.device.get(device, [None] * bs))
        sampled = {}
        for item in output.scheduled:
            request = self.requests[item.request_id]
            assert item.token_ids, "a step computes at least one token: a real model needs it for logits"
            digests = self.digests(request, item.context_len)
            assert item.token_ids == request.token_ids(item.start_position, item.context_len)
            table = item.block_ids
            for position in range(item.start_position):
                held = self.device.get(table[position // bs], [None] * bs)[position % bs]
                assert held == digests[position], f"{item.request_id}: position {position} holds other KV"
            for position in range(item.start_position, item.context_len):
                self.device.setdefault(table[position // bs], [None] * bs)[position % bs] = digests[position]
            if item.samples_token:
                sampled[item.request_id] = digests[-1] % VOCAB
        return sampled


@dataclass(frozen=True)
class Spec:
    prefix: int  # which shared prefix, or -1 for none
    suffix_len: int
    max_tokens: int
    arrival_step: int


@dataclass(frozen=True)
class Sharing:
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    preemption_mode: str
    policy: str
    prefixes: tuple[tuple[int, ...], ...]
    requests: tuple[Spec, ...]


@st.composite
def sharing_workloads(draw: st.DrawFn) -> Sharing:
    block_size = draw(st.integers(1, 4))
    num_blocks = draw(st.integers(12, 40))
    capacity = block_size * num_blocks
    rng = random.Random(draw(st.integers(0, 1000)))
    prefixes = tuple(
        tuple(rng.randrange(VOCAB) for _ in range(draw(st.integers(1, min(24, capacity // 3)))))
        for _ in range(draw(st.integers(1, 3)))
    )
    specs = draw(st.lists(st.builds(
        Spec, prefix=st.integers(-1, len(prefixes) - 1), suffix_len=st.integers(0, 8),
        max_tokens=st.integers(1, 12), arrival_step=st.integers(0, 12),
    ), min_size=1, max_size=10))
    return Sharing(block_size, num_blocks, draw(st.integers(1, 5)), draw(st.integers(4, 48)),
                   draw(st.sampled_from(["recompute", "swap"])), draw(st.sampled_from(["fcfs", "lpm"])), prefixes,
                   tuple(specs))


def make_prompt(work: Sharing, index: int) -> list[int]:
    spec = work.requests[index]
    prefix = list(work.prefixes[spec.prefix]) if spec.prefix >= 0 else []
    rng = random.Random(index)
    return prefix + [rng.randrange(VOCAB) for _ in range(spec.suffix_len if prefix else spec.suffix_len + 1)]


def run(work: Sharing, caching: bool) -> tuple[dict[str, list[int]], Scheduler, list[str]]:
    """Run the workload to the end; each request's output tokens, the scheduler, and the order of admission."""
    num_cpu = work.num_blocks if work.preemption_mode == "swap" else 0
    if caching:
        kv = PrefixCachingKVCacheManager(work.num_blocks, work.block_size, 0.0, num_cpu)
        kv.pool = CheckedPool(work.num_blocks)
    else:
        kv = PagedKVCacheManager(work.num_blocks, work.block_size, 0.0, num_cpu)
    capacity = work.num_blocks * work.block_size
    config = SchedulerConfig(work.max_num_seqs, work.max_num_batched_tokens, capacity, work.policy,
                             work.preemption_mode)
    scheduler = Scheduler(config, kv, clock=FakeClock())
    requests: dict[str, Request] = {}
    executor = ContentExecutor(work.block_size, requests)
    pending = sorted(range(len(work.requests)), key=lambda i: work.requests[i].arrival_step)
    admitted: list[str] = []
    step = 0
    while pending or scheduler.has_unfinished_requests():
        while pending and work.requests[pending[0]].arrival_step <= step:
            index = pending.pop(0)
            prompt = make_prompt(work, index)[: capacity - 1]
            params = SamplingParams(max_tokens=work.requests[index].max_tokens, ignore_eos=True)
            requests[f"r{index}"] = Request(f"r{index}", prompt, params, arrival_time=float(step))
            scheduler.add_request(requests[f"r{index}"])
        output = scheduler.schedule()
        admitted += [s.request_id for s in output.scheduled if s.request_id not in admitted]
        check_references(scheduler)
        scheduler.update(output, executor.execute(output))
        check_references(scheduler)
        step += 1
        assert step < 2000, "the scheduler livelocks"
    return {rid: r.output_token_ids for rid, r in requests.items()}, scheduler, admitted


def check_references(scheduler: Scheduler) -> None:
    kv = scheduler.kv_manager
    check_pool(kv.cpu_pool, kv.cpu_block_tables, "cpu")
    if not isinstance(kv, PrefixCachingKVCacheManager):
        check_pool(kv.pool, kv.block_tables, "device")
        return
    pool = kv.pool
    held = Counter(block for table in kv.block_tables.values() for block in table)
    assert all(pool.ref_counts[b] == held[b] for b in range(pool.num_blocks)), "reference counts != holders"
    free = pool.free_block_ids()
    assert len(free) == len(set(free)) == pool.num_free and set(free).isdisjoint(held), "a held block is free"
    assert len(free) + len(held) == pool.num_blocks, "a block is lost"
    for request in scheduler.running:
        assert all(pool.ref_counts[b] > 0 for b in kv.block_tables[request.request_id])


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(sharing_workloads())
def test_shared_prefixes_are_reused_safely_and_change_no_output(work: Sharing) -> None:
    cached_outputs, scheduler, _ = run(work, caching=True)
    plain_outputs, _, _ = run(work, caching=False)
    assert cached_outputs == plain_outputs
    kv = scheduler.kv_manager
    assert all(count == 0 for count in kv.pool.ref_counts), "a reference outlived its request"
    assert kv.num_free_blocks == kv.num_blocks, "every block ends free or cached"
    assert kv.pool.num_shared_refs == 0


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(sharing_workloads())
def test_contents_whose_digests_collide_are_still_told_apart(work: Sharing) -> None:
    """The index is keyed by a digest of each block's content; with every digest the same (one chain of nodes),
    the same requests find the same blocks cached and evictions take the same ones out."""
    expected, scheduler, _ = run(work, caching=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prefix_cache, "content_digest", lambda content: 7)
        colliding, colliding_scheduler, _ = run(work, caching=True)
    assert colliding == expected
    kv, plain = colliding_scheduler.kv_manager, scheduler.kv_manager
    assert (kv.num_hits, kv.pool.num_evictions, kv.pool.num_cached) == (
        plain.num_hits, plain.pool.num_evictions, plain.pool.num_cached)
    assert kv.pool.free_block_ids() == plain.pool.free_block_ids()


def test_a_repeated_prefix_is_found_and_counted() -> None:
    work = Sharing(4, 40, 4, 64, "recompute", "fcfs", ((1, 2, 3, 4, 5, 6, 7, 8, 9),),
                   (Spec(0, 3, 2, 0), Spec(0, 5, 2, 5), Spec(0, 0, 2, 10)))
    outputs, scheduler, _ = run(work, caching=True)
    stats = scheduler.stats()
    assert stats.prefix_cache_hits == 8 + 8, "two full blocks of the prefix, found by each later request"
    assert stats.prefix_cache_queries == sum(len(make_prompt(work, i)) for i in range(3))
    assert outputs == run(work, caching=False)[0]


def test_lpm_admits_the_longest_cached_prefix_first_and_fcfs_by_arrival() -> None:
    """One slot: a request warms the cache; then one with nothing cached and two over the cached prefix wait."""
    prefix = tuple(range(1, 17))
    requests = (Spec(0, 2, 1, 0), Spec(-1, 20, 1, 3), Spec(0, 4, 1, 3), Spec(0, 6, 1, 3))
    orders = {}
    for policy in ("fcfs", "lpm"):
        work = Sharing(4, 40, 1, 64, "recompute", policy, (prefix,), requests)
        outputs, _, orders[policy] = run(work, caching=True)
        assert outputs == run(work, caching=False)[0]
    assert orders["fcfs"] == ["r0", "r1", "r2", "r3"]
    assert orders["lpm"] == ["r0", "r2", "r3", "r1"]


@pytest.mark.parametrize("budget", [64, 8])
def test_requests_arriving_with_a_prefix_in_flight_wait_for_it_instead_of_computing_it_again(budget: int) -> None:
    """Four requests on one 16-token prefix arrive together. The first computes it (in one step, or in two chunks
    of 8); the others are passed over until its blocks are indexed, then find all four blocks cached."""
    prefix = tuple(range(1, 17))
    work = Sharing(4, 40, 4, budget, "recompute", "fcfs", (prefix,),
                   (*(Spec(0, 2, 3, 0) for _ in range(4)), Spec(-1, 5, 3, 0)))
    outputs, scheduler, order = run(work, caching=True)
    assert scheduler.stats().prefix_cache_hits == 3 * 16, "the prefix is computed once"
    if budget == 64:  # room for more in the first step: the request that shares nothing goes ahead
        assert order == ["r0", "r4", "r1", "r2", "r3"]
    assert outputs == run(work, caching=False)[0]
