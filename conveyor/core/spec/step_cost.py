"""What a step of each size costs, measured as the engine runs: the auto draft length prices drafts by it.

A step's time is far from linear in its tokens on a CPU: at one request a decode step reads every weight
and a few more rows cost little (the seed's roofline: bound by bytes), while at 64 requests the same rows are
compute and cost nearly their share. So the cost is kept as a table of seconds by the step's batched tokens,
in buckets (exact up to 16 tokens, then eight per doubling), each the median of its last few steps (a step
slowed by something else on the machine does not move it) at their mean size. Between measured buckets it is
interpolated; above the largest one it is taken as flat, which is optimistic on purpose: drafts are then
tried, and the step that carries them measures what they cost. A bucket not measured for a while is forgotten,
so a size that once looked dear (the machine was busy, or acceptance was low) is tried again.

Pure Python, the core's.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque

EXACT_UP_TO = 16  # token counts up to this are buckets of their own
FRACTION_BITS = 3  # above, buckets keep the top 1 + 3 bits: eight per doubling
SAMPLES = 8  # steps a bucket keeps: its cost is their median
STALE_STEPS = 256  # a bucket not measured in this many steps is forgotten


def bucket_of(num_tokens: int) -> int:
    """The token count that stands for ``num_tokens``'s bucket (the lowest count in it)."""
    if num_tokens <= EXACT_UP_TO:
        return num_tokens
    shift = num_tokens.bit_length() - 1 - FRACTION_BITS
    return num_tokens >> shift << shift


class StepCost:
    """Per bucket of batched tokens, the last SAMPLES steps (tokens, seconds); ``curve`` reads them."""

    def __init__(self) -> None:
        self._samples: dict[int, deque[tuple[int, float]]] = {}
        self._last_seen: dict[int, int] = {}  # bucket -> the step it was last measured in
        self._steps = 0

    def record(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or not seconds > 0:
            return
        self._steps += 1
        bucket = bucket_of(num_tokens)
        samples = self._samples.get(bucket)
        if samples is None:
            samples = self._samples[bucket] = deque(maxlen=SAMPLES)
        samples.append((num_tokens, seconds))
        self._last_seen[bucket] = self._steps

    def curve(self) -> StepCurve | None:
        """The measured points that are fresh, for pricing one step's choices; None before any was measured."""
        fresh = sorted(b for b, seen in self._last_seen.items() if self._steps - seen < STALE_STEPS)
        for bucket in set(self._samples) - set(fresh):  # forgotten (see the module's doc)
            del self._samples[bucket], self._last_seen[bucket]
        if not fresh:
            return None
        tokens = [sum(n for n, _ in self._samples[b]) / len(self._samples[b]) for b in fresh]
        seconds = [statistics.median(t for _, t in self._samples[b]) for b in fresh]
        return StepCurve(tokens, seconds)

    def seconds(self, num_tokens: int) -> float | None:
        """The expected seconds of a step of ``num_tokens`` tokens; None before any step was measured."""
        curve = self.curve()
        return None if curve is None else curve.seconds(num_tokens)


class StepCurve:
    """Seconds over tokens through measured points: interpolated between them, flat beyond the ends."""

    __slots__ = ("_seconds", "_tokens")

    def __init__(self, tokens: list[float], seconds: list[float]) -> None:
        self._tokens, self._seconds = tokens, seconds

    def seconds(self, num_tokens: float) -> float:
        tokens, seconds = self._tokens, self._seconds
        at = bisect.bisect_left(tokens, num_tokens)
        if at == len(tokens):
            return seconds[-1]
        if at == 0 or tokens[at] == num_tokens:
            return seconds[at]
        low, high = tokens[at - 1], tokens[at]
        return seconds[at - 1] + (num_tokens - low) / (high - low) * (seconds[at] - seconds[at - 1])
