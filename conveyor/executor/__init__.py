"""Executors carry out a SchedulerOutput: the torch executor runs the real model, the simulated one prices it."""
