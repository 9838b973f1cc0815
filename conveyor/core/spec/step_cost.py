"""What a step of each size costs, measured as the engine runs: the auto draft length prices drafts by it.

A step's time is far from linear in its tokens on a CPU: at one request a decode step reads every weight
and a few more rows cost almost nothing (the seed's roofline: bound by bytes), while at 64 requests the
same rows are compute and cost nearly their share. So the cost is kept as a table of seconds by the step's
batched tokens, in buckets (exact up to 16 tokens, then eight per doubling), each a running mean that
follows a machine whose speed drifts. Between measured buckets it is interpolated; above the largest one
measured it is taken as flat, which is optimistic on purpose: drafts are then tried, and the step that
carries them measures what they cost.

Pure Python, the core's.
"""

from __future__ import annotations

import bisect

EXACT_UP_TO = 16  # token counts up to this are buckets of their own
FRACTION_BITS = 3  # above, buckets keep the top 1 + 3 bits: eight per doubling
NEW_WEIGHT = 0.2  # a new measurement's weight in its bucket's running mean (older ones fade)


def bucket_of(num_tokens: int) -> int:
    """The token count that stands for ``num_tokens``'s bucket (the lowest count in it)."""
    if num_tokens <= EXACT_UP_TO:
        return num_tokens
    shift = num_tokens.bit_length() - 1 - FRACTION_BITS
    return num_tokens >> shift << shift


class StepCost:
    """Per bucket of batched tokens, the running means of a step's tokens and of its seconds; ``seconds``
    interpolates between those points (by tokens, so a few more rows cost more even within one bucket)."""

    def __init__(self) -> None:
        self._points: dict[int, list[float]] = {}  # bucket -> [mean tokens, mean seconds]
        self._buckets: list[int] = []  # the measured buckets, sorted (their mean tokens are sorted with them)

    def record(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or not seconds > 0:
            return
        bucket = bucket_of(num_tokens)
        point = self._points.get(bucket)
        if point is None:
            bisect.insort(self._buckets, bucket)
            self._points[bucket] = [float(num_tokens), seconds]
        else:
            point[0] += NEW_WEIGHT * (num_tokens - point[0])
            point[1] += NEW_WEIGHT * (seconds - point[1])

    def seconds(self, num_tokens: int) -> float | None:
        """The expected seconds of a step of ``num_tokens`` tokens; None before any step was measured."""
        buckets, points = self._buckets, self._points
        if not buckets:
            return None
        at = bisect.bisect_right(buckets, bucket_of(num_tokens))  # buckets[at - 1] is this one or the one below
        if at and points[buckets[at - 1]][0] > num_tokens:  # inside its bucket, below the bucket's mean
            at -= 1
        if at == len(buckets):  # above every measured point: flat (see the module's doc)
            return points[buckets[-1]][1]
        if at == 0:
            return points[buckets[0]][1]
        (low_tokens, low_seconds), (high_tokens, high_seconds) = points[buckets[at - 1]], points[buckets[at]]
        if high_tokens <= low_tokens:
            return high_seconds
        share = (num_tokens - low_tokens) / (high_tokens - low_tokens)
        return low_seconds + share * (high_seconds - low_seconds)
