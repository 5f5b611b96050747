"""Ctrl-C while the ``pyhook`` command starts: one line and exit status 130, not a traceback.

Importing pyhook imports torch, which takes seconds, before :func:`pyhook.cli.main` (which
handles ``KeyboardInterrupt`` itself) runs. This module is imported first by ``pyhook/__init__``
and, only when the process is the ``pyhook`` command (``pyhook ...`` or ``python -m pyhook``),
turns SIGINT into that one line until ``main`` restores Python's default handler. Importing
pyhook from any other program leaves SIGINT alone. (:mod:`pyhook._precheck`, imported next,
checks the command's arguments before torch is imported.)
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
from typing import Any


def launched_as_command() -> bool:
    """True when this process is the ``pyhook`` console script or ``python -m pyhook``."""
    argv = getattr(sys, "argv", None) or [""]
    name = os.path.basename(argv[0] or "")
    if name in ("pyhook", "pyhook.exe", "pyhook-script.py"):
        return True
    orig = list(getattr(sys, "orig_argv", []))
    return any(a == "-m" and b == "pyhook" for a, b in itertools.pairwise(orig))


def interrupted(_signum: int, _frame: Any) -> None:
    # Nothing has been opened or written yet, so ending at once is safe; an exception raised
    # here could be swallowed by an import's bare ``except:`` and the command would go on.
    sys.stderr.write("pyhook: interrupted while starting; nothing was written\n")
    sys.stderr.flush()
    os._exit(130)


def restore() -> None:
    """Give SIGINT back to Python's default handler (``KeyboardInterrupt``)."""
    if signal.getsignal(signal.SIGINT) is interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)


if launched_as_command() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, interrupted)
