"""The OpenMP runtime's thread teams, for code that moves torch's work to another thread.

GNU OpenMP (``libgomp``, what torch's CPU wheels load) keeps each thread that ran a parallel
region its own team of worker threads, and counts every such worker in the process. Once there
are more than cores (a forward on the main thread, then a forward in a producer thread: 2 + 2
on 2 cores), every team's idle workers stop spinning almost at once and sleep instead, and each
parallel region of the forward then waits for its workers to wake: on a quiet 2-core machine a
GPT-2 forward in a second thread ran 13% slower than on the main thread
(benchmarks/bench_stream.py (a)). :func:`release_thread_team` gives the calling thread's idle
workers back (``omp_pause_resource_all(omp_pause_soft)``), so that a forward in another thread
gets a team of its own under the same rules as the main thread's. The calling thread's next
parallel region starts a new team (microseconds).

Measured the other way on a loaded machine (load 6-8 on 2 cores, other processes on every core):
there the throttled team was the faster one (a forward in a second thread 0.6x the main thread's
wall time; with the main team released first, 0.93x), since spinning workers lose their core to
the other processes. So :func:`pyhook.stream` releases the consumer's team when the load average
says the machine has a core per runnable thread
(:func:`pyhook.pipeline.stream.release_consumer_team`).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

__all__ = ["release_thread_team"]

_OMP_PAUSE_SOFT = 1


@functools.cache
def _pause() -> Any:
    """``omp_pause_resource_all`` of the libgomp this process loaded (None if none is)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line and "/" in line}
    except OSError:  # not Linux
        return None
    for path in sorted(paths):
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):  # an old libgomp (before OpenMP 5.0)
            continue
        fn.argtypes = [ctypes.c_int]
        fn.restype = ctypes.c_int
        return fn
    return None


def release_thread_team() -> bool:
    """Release the OpenMP worker threads of the calling thread's team (libgomp); True if the
    runtime did. Call it outside any parallel region, before handing torch's work to another
    thread. A no-op (False) with another OpenMP runtime or none.

    Example::

        >>> from pyhook._omp import release_thread_team
        >>> release_thread_team() in (True, False)
        True
    """
    fn = _pause()
    if fn is None:
        return False
    return fn(_OMP_PAUSE_SOFT) == 0
