"""Preemption modes: what becomes of a victim's KV, chosen once at construction.

``recompute`` drops it (the request is prefilled again when it resumes); ``swap`` copies it to the CPU
pool and back, and falls back to recompute for a victim the CPU pool has no room for. Which victims
and when is the scheduler's and the policy's business; this is only what happens to their blocks.
"""

from __future__ import annotations

import logging

from conveyor.core.kv import PagedKVCacheManager
from conveyor.core.request import Request

logger = logging.getLogger("conveyor.core.scheduler")


class PreemptionMode:
    """What the scheduler asks of a mode when it preempts a request."""

    name: str

    def __init__(self) -> None:
        self.num_fallbacks = 0  # swaps that found the CPU pool full and recomputed instead

    def swap_out(self, kv_manager: PagedKVCacheManager, request: Request) -> list[tuple[int, int]] | None:
        """(device block, CPU block) pairs if the victim's KV was kept on CPU; None: the caller frees it,
        and the request is computed again."""
        raise NotImplementedError


class RecomputePreemption(PreemptionMode):
    """Drop the victim's KV; it is computed again, prompt and output so far, when the request resumes."""

    name = "recompute"

    def swap_out(self, kv_manager: PagedKVCacheManager, request: Request) -> list[tuple[int, int]] | None:
        return None


class SwapPreemption(PreemptionMode):
    """Copy the victim's KV to the CPU pool; when that pool is full, recompute instead (and count it)."""

    name = "swap"

    def swap_out(self, kv_manager: PagedKVCacheManager, request: Request) -> list[tuple[int, int]] | None:
        pairs = kv_manager.swap_out(request.request_id)
        if pairs is None:
            self.num_fallbacks += 1
            logger.warning("swap space full: request %s is preempted by recompute instead", request.request_id)
        return pairs


PREEMPTION_CLASSES: dict[str, type[PreemptionMode]] = {"recompute": RecomputePreemption, "swap": SwapPreemption}


def make_preemption(name: str) -> PreemptionMode:
    """The mode ``--preemption-mode`` names."""
    return PREEMPTION_CLASSES[name]()
