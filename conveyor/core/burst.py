"""Bursts: requests sent together, taken into one first step.

Requests a client sends at once reach an idle engine over a few milliseconds, one at a time, as the server
handles each. An engine that steps at the first would compute its prompt alone and the others' in the next
step, and on a mixture of experts a step of one or two prompts reads most experts' weights for a handful of
tokens. So an idle engine, woken by a request, waits until none has come for ``--burst-wait-ms`` (at most
BURST_WAIT_CAP times that after the first) and then steps. A lone request waits that once; a busy engine never
waits (a request arriving during a step joins the next, as continuous batching has it). The server's loop
(:mod:`conveyor.engine.async_engine`) waits in real time and the simulator on its clock, by the same rule.
"""

from __future__ import annotations

from collections.abc import Sequence

BURST_WAIT_CAP = 10  # a burst's first step comes at most this many waits after its first request


def first_step_at(first: float, latest: float, wait_s: float) -> float:
    """When an idle engine takes its first step: ``wait_s`` after the latest request (``latest``), and at most
    BURST_WAIT_CAP times ``wait_s`` after the first (``first``), so that a steady stream cannot hold it."""
    return min(latest + wait_s, first + BURST_WAIT_CAP * wait_s)


def burst_end(start: float, arrival_times: Sequence[float], index: int, wait_s: float) -> float:
    """When an idle engine takes its first step, woken at ``start`` by a request, the ones after it arriving at
    ``arrival_times[index:]`` (sorted): each that comes before that moment puts it later (:func:`first_step_at`)."""
    latest = start
    while index < len(arrival_times) and arrival_times[index] <= first_step_at(start, latest, wait_s):
        latest = arrival_times[index]
        index += 1
    return first_step_at(start, latest, wait_s)
