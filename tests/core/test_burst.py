"""The burst rule (conveyor.core.burst): when an idle engine takes its first step."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conveyor.core.burst import BURST_WAIT_CAP, burst_end, first_step_at


def test_the_first_step_waits_a_quiet_period_after_the_latest_request_up_to_the_cap() -> None:
    assert first_step_at(1.0, 1.0, 0.002) == pytest.approx(1.002)  # a lone request waits once
    assert first_step_at(1.0, 1.005, 0.002) == pytest.approx(1.007)
    # a steady stream cannot hold it:
    assert first_step_at(1.0, 1.5, 0.002) == pytest.approx(1.0 + BURST_WAIT_CAP * 0.002)
    assert first_step_at(1.0, 1.0, 0.0) == 1.0  # no wait: at once


def test_a_burst_ends_at_the_first_gap_longer_than_the_wait() -> None:
    arrivals = [0.0, 0.001, 0.0025, 0.004, 0.0100, 0.0105]
    # the fourth extends it; the fifth comes after the step
    assert burst_end(0.0, arrivals, 1, 0.002) == pytest.approx(0.006)
    assert burst_end(0.0100, arrivals, 5, 0.002) == pytest.approx(0.0125)
    assert burst_end(0.0, arrivals, 1, 0.0) == 0.0


@given(st.lists(st.floats(0, 1, allow_nan=False), min_size=1, max_size=30), st.floats(0, 0.1, allow_nan=False))
def test_every_request_before_the_first_step_came_within_a_wait_of_the_one_before(times, wait) -> None:
    arrivals = sorted(times)
    step = burst_end(arrivals[0], arrivals, 1, wait)
    joined = [t for t in arrivals if t <= step]
    assert arrivals[0] <= step <= arrivals[0] + BURST_WAIT_CAP * wait
    assert all(later - earlier <= wait for earlier, later in itertools.pairwise(joined))
    left = [t for t in arrivals if t > step]
    assert not left or step == arrivals[0] + BURST_WAIT_CAP * wait or left[0] - joined[-1] > wait
