"""Where Conveyor keeps what it builds once: converted models, compiled kernels, machine figures.

Torch-free, so that the simulator finds the same folder as the engine.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "CONVEYOR_CACHE_DIR"


class CacheDirError(OSError):
    """A folder of Conveyor's cache cannot be created; the message names it and how to choose another."""


def cache_dir() -> Path:
    """``$CONVEYOR_CACHE_DIR``, else ``$XDG_CACHE_HOME/conveyor``, else ``~/.cache/conveyor``."""
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "conveyor"
    )
    return Path(root)


def make_cache_folder(folder: Path) -> Path:
    """Create ``folder`` if it is missing. One that cannot be (a file in the way, a read-only disk, no
    permission) raises CacheDirError naming the folder, and CONVEYOR_CACHE_DIR where it lies in the cache,
    rather than a bare OSError from deep inside whatever was being cached."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        message = f"cannot create the folder {folder} ({error.strerror or error})"
        if folder.is_relative_to(cache_dir()):
            message += (f"; Conveyor keeps its converted models, compiled kernels and measured figures under "
                        f"{cache_dir()}: set {CACHE_ENV} to a folder it can write")
        raise CacheDirError(message) from error
    return folder


def write_cache_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, creating its folder (make_cache_folder), through a file of this process's
    renamed into place: a concurrent reader sees the old file or the new one, never half of either."""
    make_cache_folder(path.parent)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    partial.write_text(text)
    partial.replace(path)
