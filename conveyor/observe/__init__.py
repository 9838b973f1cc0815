"""Watching the core run: the step trace (JSON lines), the live dashboard's feed, and the figures both report.

Each watcher attaches to an EngineCore (``EngineCore.watch``) and reads what a step did; the core knows them
only as StepWatchers. Torch-free, like the core, so the engine and the simulator are watched alike.
"""
