"""glibc's heap thresholds for a capture's forward loop: the heap stops being given back and
faulted in again inside every forward.

Why: glibc's ``malloc`` gives the free memory at the top of its heap back to the kernel
whenever it exceeds a *trim threshold*, which by default follows the largest block freed so far
(twice the largest mapped block freed, at most 64 MiB). A CPU forward of a transformer frees tens
of MB of temporaries at a time, so the heap is given back and faulted in again many times a
forward: GPT-2 small on 8 x 128 tokens, in a fresh process, faulted 172,000 pages (670 MB) a
forward, 12 heap trims of about 50 MB each, and its 6-batch loop took 7.0-7.6 s against 6.0-6.3 s
with the trims off (2 cores, `benchmarks/RESULTS.md`). Whether a process lands in that state
depends on its history (what was freed first), so the same forward costs 0 or 172,000 faults a
batch from one process to the next, and a capture that allocates or frees a few blocks moves it
from one state to the other.

:func:`tune` (called when a capture starts) fixes the two thresholds at glibc's own maximum for
the mapping threshold (32 MiB: blocks below it come from the heap, as the dynamic rule lets them
once such a block was freed) and 256 MiB for the trim threshold: free memory at the heap's top is
kept for the next forward up to that size. What it costs: up to 256 MiB of free heap may stay
resident between forwards (it is the memory the next forward takes again), and glibc's dynamic
rule stays off for the rest of the process (``mallopt`` cannot turn it back on). A capture that
closes with the process bigger than it found it still trims the heap (``trim_host_memory``).

Left alone: ``PYHOOK_MALLOC=0`` in the environment; a process whose environment sets glibc's
own malloc settings (``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TOP_PAD_``,
``GLIBC_TUNABLES`` with ``glibc.malloc.``); another allocator preloaded (jemalloc, tcmalloc,
mimalloc); a C library that is not glibc.
"""

from __future__ import annotations

import ctypes
import os
import threading

ENV = "PYHOOK_MALLOC"
#: glibc's own upper bound for the dynamic mapping threshold (64-bit).
MMAP_THRESHOLD = 32 << 20
#: Free memory at the heap's top kept for the next forward.
TRIM_THRESHOLD = 256 << 20
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_GLIBC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc", "hoard", "scudo")

_lock = threading.Lock()
#: What :func:`tune` did in this process: ``None`` until it ran, then ``(applied, why)``.
state: tuple[bool, str] | None = None


def mode() -> str:
    """``"auto"`` (unset: the default) or ``"0"`` from ``PYHOOK_MALLOC``; anything else is an
    error naming the variable."""
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value not in ("auto", "0"):
        raise ValueError(f"{ENV} must be auto or 0, got {os.environ.get(ENV)!r}")
    return value


def _left_alone() -> str | None:
    """Why the heap's settings are not pyhook's to change here (``None``: they are)."""
    if mode() == "0":
        return f"{ENV}=0"
    for name in _GLIBC_ENV:
        if name in os.environ:
            return f"{name} is set in the environment"
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc.*"
    preload = os.environ.get("LD_PRELOAD", "").lower()
    for name in _OTHER_ALLOCATORS:
        if name in preload:
            return f"{name} is preloaded (LD_PRELOAD)"
    return None


def tune() -> bool:
    """Fix glibc's heap thresholds for the forward loop (once per process); True when they are
    pyhook's (set now or before), False when left alone (:data:`state` says why).

    Example::

        >>> from pyhook import _malloc
        >>> applied = _malloc.tune()  # what every capture does when it starts
        >>> _malloc.state is not None and _malloc.state[0] == applied
        True
    """
    global state
    with _lock:
        if state is not None and (state[0] or mode() == "0"):
            return state[0]
        why = _left_alone()
        if why is None:
            try:
                libc = ctypes.CDLL(None)
                libc.gnu_get_libc_version  # noqa: B018 - glibc only
                mallopt = libc.mallopt
            except (OSError, AttributeError):
                why = "the C library is not glibc"
            else:
                mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
                mallopt.restype = ctypes.c_int
                if (
                    mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
                    and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
                ):
                    state = (
                        True,
                        f"mapping threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold "
                        f"{TRIM_THRESHOLD >> 20} MiB (set by pyhook; {ENV}=0 leaves them)",
                    )
                    return True
                why = "mallopt refused the thresholds"
        state = (False, f"left alone: {why}")
        return False
