"""The compute threads' runtime: one OpenMP pool in the process, that of the thread which steps the model.

torch's parallel loops and the native kernels are OpenMP (torch's own libgomp).
libgomp gives every thread that opens a parallel region a pool of workers of its
own, kept until that thread ends, and once all the pools together hold more
threads than the process has cores it throttles every wait: a thread at a
barrier spins about a hundred times, then sleeps on a futex. A step of the
native stack opens about 180 parallel regions, so each then pays a sleep, a
wake-up and a context switch.

That is what a server did: the model was loaded on its main thread (a pool of
``num_threads``) and stepped on the engine loop's thread (a second pool). On a
2-core Zen 4 EPYC, the default model's Q4_1 file at one request: 70-88 tok/s
through the server against 183-193 for the same engine stepped on the thread
that loaded it; with the loading thread's pool given back, 189-240
(``conveyor bench compare --in-process``, 2026-12-03). So the thread that hands
the engine to a step loop of its own gives its pool back first.
"""

from __future__ import annotations

import ctypes
import functools
import logging

logger = logging.getLogger("conveyor.executor.compute_threads")
OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: the pool's threads end; the next parallel region starts a new one


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """torch's libgomp, already loaded under its soname (None where torch runs on another OpenMP)."""
    try:
        library = ctypes.CDLL("libgomp.so.1")
    except OSError:
        return None
    return library if hasattr(library, "omp_pause_resource_all") else None


def release_openmp_pool() -> bool:
    """End the calling thread's OpenMP workers, if it has any, so that only the stepping thread's pool counts;
    True where libgomp did. A parallel region on this thread later simply starts a new pool."""
    library = _libgomp()
    if library is None:
        logger.info("no libgomp with omp_pause_resource_all: the loading thread's OpenMP pool stays")
        return False
    return library.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
