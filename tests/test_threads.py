"""--num-threads: the engine runs its kernels on the threads asked for, else on the cores it may use."""

from __future__ import annotations

import logging
import os

import torch

from conveyor.core.config import EngineConfig, usable_cores
from conveyor.engine import Engine


def test_the_engine_uses_the_threads_asked_for_and_by_default_the_cores_it_may_use(tiny_model_dir) -> None:
    before = torch.get_num_threads()
    try:
        Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, num_threads=1))
        assert torch.get_num_threads() == 1
        Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64))
        assert torch.get_num_threads() == usable_cores()
    finally:
        torch.set_num_threads(before)
    if hasattr(os, "sched_getaffinity"):
        assert usable_cores() == len(os.sched_getaffinity(0))


def test_more_threads_than_cores_runs_with_a_warning(tiny_model_dir, caplog) -> None:
    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.WARNING, logger="conveyor"):
            engine = Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, num_threads=usable_cores() + 1,
                                         kernels="torch"))
        assert torch.get_num_threads() == usable_cores() + 1 and engine.num_threads == usable_cores() + 1
        assert f"more than the {usable_cores()} cores this process may use" in caplog.text
    finally:
        torch.set_num_threads(before)
