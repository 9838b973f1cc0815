"""Scheduling policies: which requests run each step, and with how many tokens (no torch here)."""

from conveyor.scheduler.continuous import Scheduler, SchedulerConfig
from conveyor.scheduler.output import ScheduledRequest, SchedulerOutput

__all__ = ["ScheduledRequest", "Scheduler", "SchedulerConfig", "SchedulerOutput"]
