"""Scheduling policies: which requests run each step, and with how many tokens (no torch here)."""

from conveyor.core.scheduler.continuous import Scheduler, SchedulerConfig
from conveyor.core.scheduler.output import ScheduledRequest, SchedulerOutput
from conveyor.core.scheduler.static import StaticScheduler

SCHEDULERS: dict[str, type[Scheduler]] = {"continuous": Scheduler, "static": StaticScheduler}

__all__ = ["SCHEDULERS", "ScheduledRequest", "Scheduler", "SchedulerConfig", "SchedulerOutput", "StaticScheduler"]
