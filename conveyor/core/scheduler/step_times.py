"""What a step costs and how fast the queue drains, measured as the engine runs: the slo policy and admission
control predict from it.

Two figures, both kept with old steps fading out (``HALF_LIFE_STEPS``), so they follow a machine that warms
up, a batch that grows, or a load that shifts:

* a least-squares line of step seconds over the step's batched tokens: ``seconds(tokens)``, what a step of
  that size takes (the real engine's clock, or the simulator's virtual one, so the simulator predicts as the
  engine does);
* the drain rates: tokens and requests taken in from the waiting queue per second, over the steps that
  ended with a backlog (a request still waiting). Those are the steps whose admissions something limited
  (the token budget, ``max_num_seqs``, memory), so their rates are what the engine can take in under the load
  of the moment, seats and memory included, which no step-time line knows.

Pure Python, no torch: the core's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

HALF_LIFE_STEPS = 256  # a step's weight halves after this many more steps
MIN_STEPS = 8  # no prediction before this many steps were timed (a cold engine's first steps say little)


@dataclass(slots=True)
class StepTimes:
    """Weighted sums of the steps seen; ``seconds`` and ``drain_rate`` read them."""

    decay: float = 0.5 ** (1 / HALF_LIFE_STEPS)
    num_steps: int = 0
    _w: float = 0.0  # sum of weights
    _t: float = 0.0  # of weight * tokens
    _tt: float = 0.0  # of weight * tokens^2
    _y: float = 0.0  # of weight * seconds
    _ty: float = 0.0  # of weight * tokens * seconds
    _drained_tokens: float = 0.0  # backlogged steps only: tokens and requests admitted, and their seconds
    _drained_requests: float = 0.0
    _drained_seconds: float = 0.0

    def record(self, num_tokens: int, seconds: float, admitted_tokens: int, backlogged: bool,
               admitted_requests: int = 0) -> None:
        """One step: its batched tokens and duration, and the tokens and requests it took in from the queue,
        which count toward the drain rates only if requests were still waiting after it."""
        if num_tokens <= 0 or not seconds >= 0:
            return  # an empty step (nothing to run) or a clock that went backwards: no sample
        d = self.decay
        self.num_steps += 1
        self._w = self._w * d + 1
        self._t = self._t * d + num_tokens
        self._tt = self._tt * d + num_tokens * num_tokens
        self._y = self._y * d + seconds
        self._ty = self._ty * d + num_tokens * seconds
        if backlogged:
            self._drained_tokens = self._drained_tokens * d + admitted_tokens
            self._drained_requests = self._drained_requests * d + admitted_requests
            self._drained_seconds = self._drained_seconds * d + seconds

    @property
    def ready(self) -> bool:
        return self.num_steps >= MIN_STEPS

    def line(self) -> tuple[float, float] | None:
        """(seconds per step, seconds per token) of the fitted line, neither negative; None before MIN_STEPS."""
        if not self.ready:
            return None
        mean_t, mean_y = self._t / self._w, self._y / self._w
        variance = self._tt / self._w - mean_t * mean_t
        if variance <= 1e-9 * max(1.0, mean_t * mean_t):
            return 0.0, mean_y / mean_t  # one step size only: no intercept to fit, a cost per token
        slope = (self._ty / self._w - mean_t * mean_y) / variance
        if slope < 0:
            return mean_y, 0.0  # noise larger than the trend: a flat cost
        intercept = mean_y - slope * mean_t
        if intercept < 0:
            return 0.0, mean_y / mean_t
        return intercept, slope

    def seconds(self, num_tokens: int) -> float | None:
        """Predicted duration of a step of ``num_tokens`` batched tokens; None until enough steps were timed."""
        fitted = self.line()
        return None if fitted is None else fitted[0] + fitted[1] * num_tokens

    def tokens_within(self, seconds: float) -> int | None:
        """The most batched tokens a step may hold and still end within ``seconds``; None when unknown (not
        enough steps timed, or a cost that does not grow with tokens)."""
        fitted = self.line()
        if fitted is None or fitted[1] <= 0:
            return None
        return max(0, math.floor((seconds - fitted[0]) / fitted[1]))

    @property
    def drain_rate(self) -> float | None:
        """Queued prompt tokens admitted per second while a backlog lasted (0: none got in for a while); None
        before any such step."""
        if self._drained_seconds <= 0:
            return None
        return self._drained_tokens / self._drained_seconds

    @property
    def request_drain_rate(self) -> float | None:
        """Queued requests admitted per second while a backlog lasted: where seats, not tokens, limit admission
        (short prompts waiting for a request to finish), the wait ahead is in requests."""
        if self._drained_seconds <= 0:
            return None
        return self._drained_requests / self._drained_seconds
