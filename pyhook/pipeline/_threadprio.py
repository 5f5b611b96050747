"""The CPU priority of a disk capture's writer thread.

A disk capture's forward runs on every core (torch's OpenMP team), and the writer thread's work
(the write system calls, the checksum, fsync) then takes a core from one of the team's workers
while the others spin at the team's barrier. :func:`lower_this_thread` (called by the writer
thread itself when it starts) gives the thread the lowest CPU priority, so the kernel runs it
only on a core the forward leaves idle: between the forward's parallel regions, while the forward
runs single-threaded Python, while the main thread waits for the writer (``max_buffer_bytes``,
``close``). The main thread never waits on a lock the writer holds for long (the writer's
condition variable and the index are held for microseconds, and the write system calls release
the GIL), so a preempted writer delays nothing but its own writes; when the writer falls behind,
the budget's back-pressure stops the main thread and the writer then has a core to itself.

``PYHOOK_WRITER_PRIORITY``: ``idle`` (``SCHED_IDLE``), ``nice`` (nice 19, the lowest ordinary
priority), or ``normal`` / ``0`` (unset: the thread keeps the priority it was started with).
Where the platform has neither (not Linux), nothing changes. Opt-in, not the default: in paired
rounds of ``benchmarks/bench_capture.py`` (d) on the 2-core VM (GPT-2 small, torch's 2 threads)
the lowered writer made the capture dearer (12 hooked modules, load 1.7-2.1: 1.21x the bare
forward against 1.10x, process CPU 1.18x against 1.08x; ``benchmarks/RESULTS.md``, "cap, issue
23 item 1, 2026-11-25 (day)"), while the writer's own CPU is ~2% of the capture's. On a machine
whose other processes keep every core busy, ``idle`` would also let them starve the writer
(``close`` waits for it).
"""

from __future__ import annotations

import os
import threading

ENV = "PYHOOK_WRITER_PRIORITY"
#: What an unset ``PYHOOK_WRITER_PRIORITY`` means.
DEFAULT = "normal"
_MODES = ("idle", "nice", "normal")


def mode() -> str:
    """``"idle"``, ``"nice"`` or ``"normal"`` from ``PYHOOK_WRITER_PRIORITY`` (unset:
    :data:`DEFAULT`; ``0`` is ``normal``; anything else is an error)."""
    raw = os.environ.get(ENV, "")
    value = raw.strip().lower() or DEFAULT
    if value == "0":
        value = "normal"
    if value not in _MODES:
        raise ValueError(f"{ENV} must be idle, nice, normal or 0, got {raw!r}")
    return value


def lower_this_thread(choice: str | None = None) -> str:
    """Give the calling thread the priority ``choice`` (default: :func:`mode`) names; returns
    what was applied: ``"idle"``, ``"nice"`` or ``"normal"`` (unchanged: asked for, or the
    platform refused both)."""
    choice = mode() if choice is None else choice
    if choice == "idle" and hasattr(os, "SCHED_IDLE"):
        try:
            # pid 0 is the calling thread (Linux schedules threads, not processes).
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return "idle"
        except OSError:
            choice = "nice"  # a sandbox that refuses the policy: the lowest nice value instead
    if choice == "nice" and hasattr(os, "setpriority") and hasattr(threading, "get_native_id"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            return "nice"
        except OSError:
            pass
    return "normal"
