"""Faults on purpose, for the tests of fault containment: an executor that raises on a chosen step.

Test-only, and off unless the environment variable ``CONVEYOR_FAULT_INJECTION`` is set (no flag sets it).
The real executor still does every other step; nothing of the engine is replaced. The value is
``MODE:TOKEN``, TOKEN a token id that marks the request to fail on:

* ``step:TOKEN``: a step that computes a prompt chunk holding TOKEN raises. The engine ends that step's
  requests with an error and goes on with the others.
* ``device:TOKEN``: from the first such step on, every step raises, as when the device itself is gone. The
  engine gives up after a few failed steps in a row; the server then fails every open request and exits
  non-zero, for its supervisor to restart it.
* ``grammar-hang:MARKER``: a grammar compile whose source (schema, regex or choices) holds MARKER never ends,
  as a compile bomb that slips past the size limits would not; the compile's time budget must abandon it (see
  conveyor.executor.grammar_compilers). The steps are left alone.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from conveyor.core.engine_core import Executor
from conveyor.core.scheduler.output import SchedulerOutput

ENV = "CONVEYOR_FAULT_INJECTION"
MODES = ("step", "device")
logger = logging.getLogger("conveyor.executor.faults")


class InjectedFault(RuntimeError):
    """The failure a test asked for."""


class FaultInjectingExecutor:
    def __init__(self, executor: Executor, mode: str, token: int) -> None:
        self.executor, self.mode, self.token = executor, mode, token
        self.broken = False  # device mode, once triggered

    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        marked = any(s.num_output_tokens == 0 and self.token in s.token_ids for s in output.scheduled)
        if marked or self.broken:
            self.broken = self.mode == "device"
            raise InjectedFault(f"fault injected in step {output.step} ({ENV})")
        return self.executor.execute(output)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.executor, name)


def with_injected_faults(executor: Executor) -> Executor:
    """``executor`` itself, or wrapped to fail as ``CONVEYOR_FAULT_INJECTION`` asks."""
    spec = os.environ.get(ENV, "").strip()
    if not spec:
        return executor
    mode, _, token = spec.partition(":")
    if mode == "grammar-hang" and token:
        return executor
    if mode not in MODES or not token.isdigit():
        raise ValueError(f"{ENV} must be step:TOKEN or device:TOKEN (a token id), or grammar-hang:MARKER, "
                         f"got {spec!r}")
    logger.warning("%s=%s: steps will fail on purpose (a test hook)", ENV, spec)
    return FaultInjectingExecutor(executor, mode, int(token))


def grammar_hang_marker() -> str | None:
    """With ``grammar-hang:MARKER``: the MARKER whose compiles never end; None otherwise."""
    mode, _, marker = os.environ.get(ENV, "").strip().partition(":")
    return marker if mode == "grammar-hang" and marker else None
