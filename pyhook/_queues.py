"""A bounded queue hand-over that gives up when its consumer has left (the pipeline's producer
threads: the corpus prefetch and the stream's forward loop)."""

from __future__ import annotations

import queue
import threading
from typing import Any


def put_unless_stopped(q: queue.Queue[Any], item: Any, stop: threading.Event, poll: float) -> bool:
    """Put ``item`` into ``q``, waiting while it is full, unless ``stop`` is set first: True when
    it was queued, False when the consumer left. A plain ``q.put`` would block forever on a full
    queue nobody reads any more.

    Example::

        >>> import queue, threading
        >>> q, stop = queue.Queue(maxsize=1), threading.Event()
        >>> put_unless_stopped(q, 1, stop, 0.01)
        True
        >>> stop.set()
        >>> put_unless_stopped(q, 2, stop, 0.01)  # full, and nobody reads: gives up
        False
    """
    while not stop.is_set():
        try:
            q.put(item, timeout=poll)
            return True
        except queue.Full:
            continue
    return False
