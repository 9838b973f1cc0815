"""The router, with fake replicas (the router sees replicas only through what it is told of them)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.entrypoints.cli import main
from conveyor.router import (
    POLICY_NAMES,
    CacheAwareSettings,
    NoHealthyReplica,
    PrefixIndex,
    Router,
    block_hashes,
)

BLOCK = 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def conversation_prompt(conversation: int, turns: int) -> list[int]:
    """A chat's prompt after ``turns`` turns: the previous turn's prompt plus one more exchange."""
    system = [1000 + conversation] * 3 * BLOCK
    return system + [conversation * 100 + t for t in range(turns * 2 * BLOCK)]


def test_block_hashes_key_the_whole_prefix():
    a, b = [1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 2, 3, 4, 5, 6, 7, 8]
    assert len(block_hashes(a, 4)) == 2  # the partial block is left out
    assert block_hashes(a, 4)[1] != block_hashes(b, 4)[1]  # same second block, different first: different keys
    assert block_hashes(a, 4)[:2] == block_hashes(a[:8], 4)


def test_prefix_index_evicts_least_recent_and_keeps_roots_longest():
    index = PrefixIndex(capacity_blocks=3, ttl=100)
    first = block_hashes(list(range(12)), 4)
    index.insert(first, now=0)
    assert index.match_length(first, now=1) == 3
    other = block_hashes([99] * 4, 4)
    index.insert(other, now=2)  # over capacity: the oldest leaf of ``first`` leaves, its root stays
    assert index.match_length(first, now=3) == 2
    assert index.match_length(other, now=3) == 1
    assert index.match_length(first, now=200) == 0  # past the TTL


def test_round_robin_cycles_and_skips_unhealthy():
    router = Router(3, "round-robin")
    assert [router.route([1]) for _ in range(4)] == [0, 1, 2, 0]
    router.set_healthy(1, False)
    assert [router.route([1]) for _ in range(3)] == [2, 0, 2]


def test_least_loaded_picks_fewest_requests_then_lowest_kv_usage():
    router = Router(3, "least-loaded")
    router.report_load(0, num_waiting=2, num_running=3, kv_usage=0.1)
    router.report_load(1, num_waiting=0, num_running=1, kv_usage=0.9)
    router.report_load(2, num_waiting=1, num_running=0, kv_usage=0.2)
    # Replica 2 reported 1 request; once the router has sent it 2, its count is the router's, and 2.2 > 1.9.
    assert [router.route([1]) for _ in range(3)] == [2, 2, 1]


def test_cache_aware_keeps_conversations_on_their_replica():
    router = Router(2, "cache-aware", block_size=BLOCK)
    homes = {}
    for conversation in range(6):
        homes[conversation] = router.route(conversation_prompt(conversation, 0))
    assert sorted(homes.values()) == [0, 0, 0, 1, 1, 1]  # new prefixes spread by load
    for turn in range(1, 4):
        for conversation, home in homes.items():
            assert router.route(conversation_prompt(conversation, turn)) == home
            router.finished(home)


def test_cache_aware_follows_the_answer_a_replica_cached_not_only_the_prompt():
    """A turn whose last answer is longer than the history before it: the prompt alone matches under half
    of the next prompt, the prompt and the cached answer match most of it."""
    system, answer, question = [7] * BLOCK, list(range(100, 100 + 3 * BLOCK + 1)), [8] * BLOCK
    for remembered in (False, True):
        router = Router(2, "cache-aware", block_size=BLOCK)
        home = router.route(system)
        router.finished(home)
        if remembered:
            router.remember(home, system + answer[:-1])  # the last token was sampled, never computed
        router.report_load(home, num_waiting=0, num_running=3, kv_usage=0.5)  # busier, within the thresholds
        router.report_load(1 - home, num_waiting=0, num_running=0, kv_usage=0.0)
        assert router.route(system + answer + question) == (home if remembered else 1 - home)


def test_remember_fills_only_a_cache_aware_router_and_only_a_healthy_replica():
    tokens = list(range(4 * BLOCK))
    blind = Router(2, "round-robin", block_size=BLOCK)
    blind.remember(0, tokens)
    assert len(blind.indexes[0]) == 0
    aware = Router(2, "cache-aware", block_size=BLOCK)
    aware.set_healthy(1, False)  # a finish reported after the replica went down fills nothing
    aware.remember(1, tokens)
    aware.remember(0, tokens)
    assert (len(aware.indexes[0]), len(aware.indexes[1])) == (4, 0)


def test_cache_aware_falls_back_to_least_loaded_under_imbalance():
    router = Router(2, "cache-aware", block_size=BLOCK, settings=CacheAwareSettings(balance_abs_threshold=4))
    home = router.route(conversation_prompt(0, 0))
    other = 1 - home
    router.report_load(home, num_waiting=10, num_running=8, kv_usage=0.9)
    router.report_load(other, num_waiting=0, num_running=2, kv_usage=0.1)
    assert router.route(conversation_prompt(0, 1)) == other
    router.report_load(home, num_waiting=0, num_running=5, kv_usage=0.9)  # within the thresholds again
    # The conversation's longest prefix is now on ``other``, though ``home`` holds its start and is idler.
    router.report_load(other, num_waiting=0, num_running=8, kv_usage=0.5)
    assert router.route(conversation_prompt(0, 2)) == other


def test_a_replica_down_is_routed_around_and_a_restarted_one_is_forgotten():
    router = Router(2, "cache-aware", block_size=BLOCK)
    home = router.route(conversation_prompt(0, 0))
    router.set_healthy(home, False)
    assert router.route(conversation_prompt(0, 1)) == 1 - home
    router.set_healthy(home, True)  # back without a restart (it was only slow): its cache is still there
    assert router.indexes[home].match_length(block_hashes(conversation_prompt(0, 0), BLOCK), now=0) == 3
    router.forget(home)
    assert router.indexes[home].match_length(block_hashes(conversation_prompt(0, 0), BLOCK), now=0) == 0


def test_no_healthy_replica_is_a_clear_error():
    router = Router(2, "least-loaded")
    router.set_healthy(0, False)
    with pytest.raises(NoHealthyReplica):
        router.route([1], exclude=[1])


@pytest.mark.parametrize("bad", [dict(num_replicas=0), dict(policy="fastest"), dict(block_size=0)])
def test_bad_settings_are_refused(bad):
    options = dict(num_replicas=2, policy="round-robin", block_size=16) | bad
    with pytest.raises(ValueError, match=r"router|block_size|num_replicas"):
        Router(options.pop("num_replicas"), options.pop("policy"), block_size=options["block_size"])


@pytest.mark.parametrize("flags", [["--data-parallel-size", "0"], ["--data-parallel-size", "2", "--num-threads", "0"],
                                   ["--max-replica-restarts", "-1"]])
def test_serve_refuses_bad_replica_flags_before_starting_anything(flags, capsys):
    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert flags[-2] in err or flags[-2].lstrip("-").replace("-", "_") in err  # engine flags name the field


operations = st.lists(
    st.one_of(
        st.tuples(st.just("route"), st.integers(0, 5), st.integers(0, 4), st.lists(st.integers(0, 3), max_size=2)),
        st.tuples(st.just("finish"), st.integers(0, 3)),
        st.tuples(st.just("health"), st.integers(0, 3), st.booleans()),
        st.tuples(st.just("load"), st.integers(0, 3), st.integers(0, 80), st.floats(0, 1)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(policy=st.sampled_from(POLICY_NAMES), ops=operations)
def test_never_routes_to_an_unhealthy_or_excluded_replica(policy, ops):
    router = Router(4, policy, block_size=BLOCK)
    for op in ops:
        if op[0] == "route":
            _, conversation, turns, exclude = op
            allowed = [i for i in router.healthy_replicas() if i not in exclude]
            if not allowed:
                with pytest.raises(NoHealthyReplica):
                    router.route(conversation_prompt(conversation, turns), exclude)
                continue
            assert router.route(conversation_prompt(conversation, turns), exclude) in allowed
        elif op[0] == "finish":
            router.finished(op[1])
        elif op[0] == "health":
            router.set_healthy(op[1], op[2])
        else:
            router.report_load(op[1], op[2], 0, op[3])


@settings(max_examples=100, deadline=None)
@given(
    num_replicas=st.integers(1, 6),
    conversations=st.integers(1, 12),
    turns=st.integers(1, 5),
    loads=st.lists(st.integers(0, 20), min_size=6, max_size=6),
)
def test_cache_aware_repeats_a_prefix_on_its_replica_while_balanced(num_replicas, conversations, turns, loads):
    """Loads within the thresholds (here: any difference under 32): every later turn follows its first."""
    router = Router(num_replicas, "cache-aware", block_size=BLOCK)
    for replica in range(num_replicas):
        router.report_load(replica, loads[replica], 0, 0.5)
    homes = [router.route(conversation_prompt(c, 0)) for c in range(conversations)]
    for turn in range(1, turns + 1):
        for conversation, home in enumerate(homes):
            assert router.route(conversation_prompt(conversation, turn)) == home
            router.finished(home)
