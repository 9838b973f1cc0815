"""A snapshot of the engine's state between steps: what callers outside the core may read.

Servers, metrics, benchmarks and the simulator read these figures instead of
the scheduler's queues or the KV manager's tables. A snapshot is frozen, so
the loop thread can publish one after each step and any other thread can read
the latest without a lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class EngineStats:
    step: int  # scheduler steps taken so far
    num_waiting: int  # requests waiting to be admitted (new or preempted by recompute)
    num_running: int  # requests in the running batch
    num_swapped: int  # requests whose KV is swapped out to CPU memory
    num_kv_blocks: int
    num_free_kv_blocks: int
    kv_usage: float  # share of KV blocks held by requests, 0..1
    num_cpu_blocks: int  # swap space, in blocks
    num_free_cpu_blocks: int
    num_preemptions: int  # since start, recompute and swap
    num_swaps_out: int
    num_swap_fallbacks: int  # swaps that found the CPU pool full and recomputed instead
    num_cached_free_kv_blocks: int = 0  # free blocks that still hold a cached prefix (part of num_free_kv_blocks)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, since start (vLLM's name)
    prefix_cache_hits: int = 0  # of those, tokens found: their KV was not computed again
    prompt_tokens: int = 0  # prompt tokens of the sequences that got a first token, since start
    generation_tokens: int = 0  # tokens drawn, since start
    num_failed_steps: int = 0  # steps whose execution raised; their requests ended with an error
    # Speculative decoding, since start (vLLM's names): request-steps that carried drafts, drafts, drafts
    # accepted, and accepted drafts by position in the draft (0: the first); zeros and () without it.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_position: tuple[int, ...] = ()
    spec_decode_carried_per_position: tuple[int, ...] = ()  # drafts carried, by position
    spec_decode_proposal_lengths: tuple[int, ...] = ()  # decoding request-steps offered 0, 1, ... drafts
    # The fair policy's accounts, tenant -> figures (virtual_tokens, weight, num_waiting, num_swapped,
    # prompt_tokens, output_tokens); empty under the other policies.
    tenants: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def num_unfinished(self) -> int:
        return self.num_waiting + self.num_running + self.num_swapped
