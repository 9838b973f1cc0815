"""Speculative decoding in the torch-free core: proposers, the config, and the scheduler with drafts in flight.

The property test runs random workloads (``tests/harness.py``: every kind of stop rule, aborts before and in
the middle of steps, small pools that force preemption, tiny token budgets that chunk prompts) through a
scheduler that carries drafts, with recompute or swap, paged or contiguous, prefix caching on or off. Its
executor keeps a shadow of what every KV slot holds (drafts written into slots included, as a real model
writes them), checks that every step reads the true tokens at every position it attends to (so no rejected
draft's KV is ever read, from a request's own table or from the prefix cache), and accepts a draft exactly
when it is the true next token. Every request must then finish with the output a lone run without drafts
gives, and the pools must come back empty.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.core.kv import ContiguousKVCacheManager, PagedKVCacheManager, PrefixCachingKVCacheManager
from conveyor.core.request import FinishReason, Request
from conveyor.core.sampling import SamplingParams
from conveyor.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from conveyor.core.spec import NgramProposer, SpeculativeConfig, Speculator, SuffixProposer
from conveyor.core.spec.step_cost import STALE_STEPS, StepCost, bucket_of
from tests.harness import FakeClock, RequestSpec, StepDriver, Workload, check_pool, reference_output, workloads

MAX_STEPS = 20_000
DRAFTS_SEEN: Counter[str] = Counter()  # over the property test's examples: proposed and accepted drafts


def _request(request_id: str, tokens: list[int], output: list[int] = (), max_tokens: int = 50) -> Request:
    request = Request(request_id, list(tokens), SamplingParams(max_tokens=max_tokens), arrival_time=0.0)
    request.output_token_ids = list(output)
    return request


# ----- proposers ------------------------------------------------------------------


def _brute_force_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Prompt lookup written the obvious way: longest suffix first, its most recent earlier occurrence."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 4), st.integers(0, 3),
       st.integers(1, 6), st.lists(st.integers(1, 8), max_size=6))
@settings(max_examples=300, deadline=None)
def test_ngram_proposer_matches_a_brute_force_lookup(tokens, min_n, extra_n, k, growth):
    """The incremental index, fed the request's tokens a few at a time, proposes what a full scan would."""
    proposer = NgramProposer(min_n, min_n + extra_n)
    num_prompt = max(1, len(tokens) // 2)
    request = _request("r", tokens[:num_prompt])
    seen = num_prompt
    for added in [*growth, len(tokens)]:
        seen = min(len(tokens), seen + added)
        request.output_token_ids = tokens[num_prompt:seen]
        expected = _brute_force_lookup(tokens[:seen], min_n, min_n + extra_n, k)
        assert proposer.propose(request, k) == expected


def test_ngram_proposer_prefers_the_longest_and_most_recent_match():
    proposer = NgramProposer(1, 3)
    # "7 5 6" ends the prompt and occurs once before, followed by 1 2 ("5 6" alone was last followed by 9 9).
    request = _request("r", [7, 5, 6, 1, 2, 5, 6, 9, 9, 3, 7, 5, 6])
    assert proposer.propose(request, 2) == [1, 2]
    # Now the tokens end in "4 5 6", never seen; "5 6" was most recently followed by the output's 4 5 6.
    request.output_token_ids = [4, 5, 6]
    assert proposer.propose(request, 3) == [4, 5, 6]
    proposer.finished(request)


def test_suffix_proposer_learns_from_finished_requests_and_forgets_the_oldest():
    proposer = SuffixProposer(1, 3, window=2)
    done = _request("a", [1, 2], [10, 11, 12, 13])
    proposer.finished(done)
    fresh = _request("b", [7, 8, 10])  # nothing of its own repeats; the learned output continues "10"
    assert proposer.propose(fresh, 3) == [11, 12, 13]
    proposer.finished(_request("c", [1], [30, 31]))
    proposer.finished(_request("d", [1], [40, 41]))  # the window holds 2: "a" is forgotten
    assert proposer.propose(_request("e", [7, 8, 10]), 3) == []


# ----- config ------------------------------------------------------------------------


@pytest.mark.parametrize("text, message", [
    ("{not json", "not JSON"),
    ("[1, 2]", "JSON object"),
    ('{"method": "eagle"}', "method must be one of"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be an integer from 1"),
    ('{"num_speculative_tokens": true}', "num_speculative_tokens must be an integer"),
    ('{"prompt_lookup_min": 5, "prompt_lookup_max": 3}', "prompt_lookup_min (5) is more than"),
    ('{"draft_length": "sometimes"}', "draft_length must be auto or fixed"),
    ('{"model": "x"}', "unknown key(s) ['model']"),
])
def test_bad_speculative_configs_are_refused_by_name(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        SpeculativeConfig.parse(text)


def test_speculative_config_follows_vllms_shape():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 6}')
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max,
            config.draft_length) == ("ngram", 5, 2, 6, "auto")
    assert SpeculativeConfig.parse('{"prompt_lookup_min": 6}').prompt_lookup_max == 6
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    assert SpeculativeConfig.parse(config.to_json()) == config


# ----- the auto draft length -----------------------------------------------------------


def test_step_cost_interpolates_between_measured_sizes_and_is_flat_above():
    cost = StepCost()
    assert cost.seconds(5) is None
    cost.record(1, 0.010)
    cost.record(64, 0.050)
    assert cost.seconds(1) == 0.010 and cost.seconds(64) == 0.050 and cost.seconds(0) == 0.010
    assert 0.010 < cost.seconds(32) < 0.050
    assert cost.seconds(500) == 0.050
    assert [bucket_of(n) for n in (16, 17, 18, 100, 1000)] == [16, 16, 18, 96, 960]


def test_step_cost_shrugs_off_a_slow_step_and_forgets_sizes_not_seen_for_a_while():
    cost = StepCost()
    for seconds in (0.010, 0.011, 0.500, 0.010):  # one step slowed by something else on the machine
        cost.record(5, seconds)
    assert cost.seconds(5) < 0.012
    for _ in range(STALE_STEPS):
        cost.record(1, 0.004)
    assert cost.seconds(5) == 0.004  # 5 tokens not seen for STALE_STEPS steps: priced flat again, to be tried


def _drafting_requests(count: int) -> list[Request]:
    """Requests of 14 tokens whose output repeats the start of the prompt: each has 10 drafts to propose."""
    requests = []
    for i in range(count):
        request = _request(f"r{i}", list(range(5, 17)), [5, 6])
        request.num_computed_tokens = request.num_tokens - 1
        requests.append(request)
    return requests


def test_auto_carries_drafts_where_a_step_costs_the_same_and_none_where_rows_cost_their_share():
    config = SpeculativeConfig(num_speculative_tokens=4)
    cheap = Speculator(config, max_model_len=1000)
    for tokens in range(1, 20):  # one request's step: the weights, whatever the rows
        cheap.record_step(tokens, 0.010)
    one = _drafting_requests(1)
    assert len(cheap.drafts(one, 2048)["r0"]) == 4
    dear = Speculator(config, max_model_len=1000)
    for tokens in range(64, 400, 8):  # 64 requests: every row is compute
        dear.record_step(tokens, 0.001 * tokens)
    for _ in range(50):  # half the drafts are accepted: a draft is worth 0.5, 0.25, ... of a token
        dear.verified("r0", 2, 1)
    assert dear.drafts(_drafting_requests(64), 2048) == {}


def test_drafts_stop_short_of_max_tokens_and_the_models_length():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=8, draft_length="fixed"), max_model_len=20)
    request = _drafting_requests(1)[0]  # 14 tokens: 5 drafts fit under 20 with the token drawn after them
    assert len(speculator.drafts([request], 2048)["r0"]) == 5
    request.sampling_params = SamplingParams(max_tokens=4)  # 2 out: a third and fourth may come, one a draft
    assert len(speculator.drafts([request], 2048)["r0"]) == 1
    request.sampling_params = SamplingParams(max_tokens=50, logprobs=1)  # logprobs: no drafts
    assert speculator.drafts([request], 2048) == {}


# ----- the scheduler with drafts in flight ------------------------------------------------


class ShadowKVExecutor:
    """Plays the model: writes every scheduled token (drafts too) into a shadow of its KV slot, checks that each
    step attends to the true tokens only, and accepts a draft exactly when it is the true next token."""

    def __init__(self, driver: SpeculativeDriver) -> None:
        self.driver = driver
        self.prompts: dict[str, list[int]] = {}
        self.device: dict[tuple[int, int], int] = {}  # (block, offset) -> the token whose KV it holds
        self.cpu: dict[tuple[int, int], int] = {}
        self.accepted_drafts: dict[str, int] = {}

    def true_token(self, request_id: str, position: int) -> int:
        prompt = self.prompts[request_id]
        return prompt[position] if position < len(prompt) else self.driver.token_fn(request_id, position)

    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        block_size = self.driver.scheduler.kv_manager.block_size
        self._copy(output.blocks_to_swap_in, self.cpu, self.device, block_size)
        self._copy(output.blocks_to_swap_out, self.device, self.cpu, block_size)
        sampled: dict[str, int] = {}
        self.accepted_drafts = {}
        for item in output.scheduled:
            rid, start, table = item.request_id, item.start_position, item.block_ids
            for position in range(start):  # what the step attends to: only true tokens' KV
                held = self.device.get((table[position // block_size], position % block_size))
                assert held == self.true_token(rid, position), f"{rid} reads a wrong KV at {position}"
            num_known = item.num_scheduled_tokens - item.num_draft_tokens
            assert item.token_ids[:num_known] == [self.true_token(rid, p) for p in range(start, start + num_known)]
            for offset, token in enumerate(item.token_ids):
                position = start + offset
                self.device[table[position // block_size], position % block_size] = token
            if item.num_draft_tokens:
                DRAFTS_SEEN["proposed"] += item.num_draft_tokens
                accepted = 0
                for offset, draft in enumerate(item.token_ids[num_known:]):
                    if draft != self.true_token(rid, start + num_known + offset):
                        break
                    accepted += 1
                DRAFTS_SEEN["accepted"] += accepted
                self.accepted_drafts[rid] = accepted
                sampled[rid] = self.true_token(rid, start + num_known + accepted)
            elif item.samples_token:
                sampled[rid] = self.true_token(rid, item.context_len)
        return sampled

    @staticmethod
    def _copy(pairs: list[tuple[int, int]], source: dict, dest: dict, block_size: int) -> None:
        for src, dst in pairs:
            for offset in range(block_size):
                dest.pop((dst, offset), None)
                if (src, offset) in source:
                    dest[dst, offset] = source[src, offset]


class SpeculativeDriver(StepDriver):
    def __init__(self, workload: Workload, spec: SpeculativeConfig, kv_kind: str, preemption_mode: str) -> None:
        max_model_len = workload.max_model_len
        cpu_blocks = workload.num_blocks if preemption_mode == "swap" else 0
        if kv_kind == "contiguous":
            kv = ContiguousKVCacheManager(workload.num_blocks, workload.block_size, max_model_len, cpu_blocks)
        else:
            kind = PrefixCachingKVCacheManager if kv_kind == "prefix" else PagedKVCacheManager
            kv = kind(workload.num_blocks, workload.block_size, workload.watermark, cpu_blocks)
        config = SchedulerConfig(workload.max_num_seqs, workload.max_num_batched_tokens, max_model_len,
                                 preemption_mode=preemption_mode)
        scheduler = Scheduler(config, kv, clock=FakeClock(), speculator=Speculator(spec, max_model_len))
        super().__init__(workload, scheduler, max_steps=MAX_STEPS)
        self.executor = ShadowKVExecutor(self)

    def after_update(self, output: SchedulerOutput, returned: list[Request]) -> None:
        kv = self.scheduler.kv_manager
        check_pool(kv.pool, kv.block_tables, "device")
        paged = not isinstance(kv, ContiguousKVCacheManager)
        for request in self.scheduler.running:  # rejected drafts are not computed, and their blocks are given back
            assert request.num_computed_tokens <= request.num_tokens - 1
            if paged:
                assert len(kv.block_ids(request.request_id)) == -(-request.num_computed_tokens // kv.block_size)
        assert output.num_batched_tokens <= self.scheduler.config.max_num_batched_tokens

    def at_end(self) -> None:
        kv = self.scheduler.kv_manager
        assert not kv.block_tables and kv.num_free_blocks + kv.num_cached_free_blocks >= 0
        assert kv.pool.num_free == kv.num_blocks, "blocks left held after every request ended"
        for request_id, request in self.all_requests.items():
            if request_id in self.aborted:
                continue
            tokens, reason, stop = reference_output(request, self.workload.max_model_len, self.token_fn)
            assert (request.output_token_ids, request.finish_reason, request.stop_reason) == (tokens, reason, stop)
            assert request.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


speculative_configs = st.builds(
    SpeculativeConfig,
    method=st.sampled_from(["ngram", "suffix"]),
    num_speculative_tokens=st.integers(1, 5),
    prompt_lookup_min=st.integers(1, 2),
    prompt_lookup_max=st.integers(2, 3),
    draft_length=st.sampled_from(["auto", "fixed"]),
)


@given(workloads(vocabs=(2, 3, 16)), speculative_configs, st.sampled_from(["paged", "prefix", "contiguous"]),
       st.sampled_from(["recompute", "swap"]))
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_drafts_never_change_the_output_nor_leak_kv(workload, spec, kv_kind, preemption_mode):
    if kv_kind == "contiguous" and workload.max_model_len > workload.num_blocks * workload.block_size:
        return
    SpeculativeDriver(workload, spec, kv_kind, preemption_mode).run()


def test_the_property_test_sees_drafts_accepted_and_rejected():
    """The workloads above must exercise acceptance and rejection both (a small vocabulary repeats itself)."""
    requests = tuple(RequestSpec(prompt_len=8, max_tokens=24, arrival_step=i, use_eos=False, ignore_eos=True,
                                 stop_token_ids=()) for i in range(6))
    workload = Workload(num_blocks=40, block_size=4, watermark=0.0, max_num_seqs=4, max_num_batched_tokens=32,
                        max_model_len=96, vocab=3, requests=requests, aborts=())
    before = Counter(DRAFTS_SEEN)
    SpeculativeDriver(workload, SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, draft_length="fixed"),
                      "prefix", "recompute").run()
    proposed = DRAFTS_SEEN["proposed"] - before["proposed"]
    accepted = DRAFTS_SEEN["accepted"] - before["accepted"]
    assert 0 < accepted < proposed
