"""Where Conveyor keeps what it builds once: converted models, compiled kernels, machine figures.

Torch-free, so that the simulator finds the same folder as the engine.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$CONVEYOR_CACHE_DIR``, else ``$XDG_CACHE_HOME/conveyor``, else ``~/.cache/conveyor``."""
    root = os.environ.get("CONVEYOR_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "conveyor"
    )
    return Path(root)
