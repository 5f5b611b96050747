"""Checks of a store's place (a folder or a URL) and of a corpus path that need neither torch
nor the store: the job and :func:`pyhook.stream` check ``out`` / ``tee`` / ``input`` with them
before anything runs."""

from __future__ import annotations

import os
import re
import stat


def _is_url(path: str) -> bool:
    # pyhook.store.is_url's test, without importing the store (and torch) to check an argument
    return re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", path) is not None


def check_out_dir(out: str, what: str, error: type[Exception]) -> None:
    """A store's folder ``out`` (the argument ``what``) must be, or be creatable as, a writable
    folder; else ``error`` naming it. A URL passes (the writer checks it, naming what is
    wrong: a missing fsspec backend, credentials, the bucket)."""
    if _is_url(out):
        return
    if not out:
        raise error(f"{what} is an empty path; give the folder of the store")
    if os.path.exists(out) and not os.path.isdir(out):
        raise error(f"{what} {out!r} is a file, not a directory")
    base = _existing_dir(out)
    import tempfile

    try:  # a real write (os.access says yes to root everywhere, /proc included)
        if not os.path.isdir(base):
            raise NotADirectoryError(0, "not a directory")
        with tempfile.TemporaryFile(dir=base, prefix=".pyhook-probe-"):
            pass
    except OSError as e:
        raise error(
            f"cannot write to {what} {out!r}: {base!r} is not a writable directory "
            f"({(e.strerror or str(e)).lower()}); choose a folder you can write to"
        ) from None


def _existing_dir(path: str) -> str:
    """The nearest existing ancestor of ``path`` (itself when it exists)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def input_problem(path: str) -> str | None:
    """Why ``path`` cannot be a corpus (None: it can): a corpus is a regular file or a folder.
    Anything else (``/dev/zero``, a FIFO, a socket) is refused before it is opened: reading
    one may never end, or grow without bound.

    >>> input_problem("/dev/zero")
    'not a regular file or a folder (a character device); give a corpus file or folder'
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "No such file or directory"
    except OSError as e:
        return e.strerror or str(e)
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    what = (
        "a character device"
        if stat.S_ISCHR(mode)
        else "a block device"
        if stat.S_ISBLK(mode)
        else "a FIFO (named pipe)"
        if stat.S_ISFIFO(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "not a file"
    )
    return f"not a regular file or a folder ({what}); give a corpus file or folder"
