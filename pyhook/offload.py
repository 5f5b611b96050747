"""Device-to-host copies that overlap the model's compute: pinned buffer pool, side stream, events.

:class:`Offloader` copies lists of tensors to host memory:

* **CUDA**: each copy is issued on a side stream (which first waits for the producing stream, so
  it reads finished values) into a pinned host buffer taken from a :class:`PinnedPool` that is
  reused across batches; the source tensor is ``record_stream``-ed on the side stream so its
  memory is not reused by the caching allocator before the copy has read it; an event marks
  completion, and :meth:`PendingCopy.wait` is the only way to get the host tensors (nobody reads a
  buffer before its event). At most ``max_inflight_bytes`` may be in flight: past that,
  :meth:`Offloader.submit` waits for the oldest copies (back-pressure, bounded pinned memory).
* **CPU**: the tensors are already in host memory; a copy is made only when the caller says the
  tensor aliases live model memory, with :func:`pyhook._backend.clone_tensors` (the native
  pooled batched copy when it is built).

Example::

    >>> import torch
    >>> from pyhook.offload import Offloader
    >>> off = Offloader()
    >>> x = torch.arange(6.)
    >>> pending = off.submit([x], copy=True)
    >>> host, = pending.wait()
    >>> torch.equal(host, x), host.data_ptr() != x.data_ptr()
    (True, True)
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import Any

import torch

from . import _backend

__all__ = ["Offloader", "PendingCopy", "PinnedPool"]


def _bucket(nbytes: int) -> int:
    # Power-of-two buckets from 64 KiB: a handful of sizes recur batch after batch, so after the
    # first few batches every request is a pool hit.
    size = 1 << 16
    while size < nbytes:
        size <<= 1
    return size


class PinnedPool:
    """A pool of page-locked host buffers, reused across batches.

    ``get(nbytes)`` returns a ``uint8`` tensor of at least ``nbytes`` (from the pool when a free
    buffer of that bucket exists); ``put(tensor)`` gives back the buffer behind ``tensor`` (any
    view of it). ``limit_bytes`` caps the idle bytes kept. Thread-safe: the writer thread gives
    buffers back while the main thread takes them.

    Example::

        >>> from pyhook.offload import PinnedPool
        >>> pool = PinnedPool(pin=False)
        >>> a = pool.get(1000); pool.put(a); b = pool.get(900)
        >>> a.data_ptr() == b.data_ptr(), pool.stats()["hits"]
        (True, 1)
    """

    def __init__(self, *, pin: bool = True, limit_bytes: int = 4 << 30) -> None:
        self.pin = pin
        self.limit_bytes = limit_bytes
        self._free: dict[int, list[torch.Tensor]] = collections.defaultdict(list)
        self._lent: dict[int, torch.Tensor] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, nbytes: int) -> torch.Tensor:
        size = _bucket(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                buf = free.pop()
                self._idle_bytes -= size
                self.hits += 1
            else:
                buf = None
                self.misses += 1
        if buf is None:
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        with self._lock:
            self._lent[buf.data_ptr()] = buf
        return buf

    def put(self, tensor: torch.Tensor) -> None:
        key = tensor.untyped_storage().data_ptr()
        with self._lock:
            buf = self._lent.pop(key, None)
            if buf is None:
                return  # not ours (or already given back)
            if self._idle_bytes + buf.numel() <= self.limit_bytes:
                self._free[buf.numel()].append(buf)
                self._idle_bytes += buf.numel()

    def take(self, tensor: torch.Tensor) -> None:
        """Hand the buffer behind ``tensor`` to the caller for good (it never returns)."""
        with self._lock:
            self._lent.pop(tensor.untyped_storage().data_ptr(), None)

    def empty(self) -> None:
        with self._lock:
            self._free.clear()
            self._idle_bytes = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "idle_bytes": self._idle_bytes,
                "lent": len(self._lent),
                "hits": self.hits,
                "misses": self.misses,
            }


class PendingCopy:
    """Host copies of a list of tensors, possibly still in flight. Read them with :meth:`wait`."""

    __slots__ = ("_done", "_event", "_host", "nbytes")

    def __init__(self, host: list[torch.Tensor], event: Any, nbytes: int) -> None:
        self._host = host
        self._event = event
        self.nbytes = nbytes
        self._done = event is None

    def ready(self) -> bool:
        """True once the copies have finished (never blocks)."""
        if not self._done and self._event.query():
            self._done = True
        return self._done

    def wait(self) -> list[torch.Tensor]:
        """Block until the copies are complete and return the host tensors."""
        if not self._done:
            self._event.synchronize()
            self._done = True
        return self._host


class Offloader:
    """Copy tensors to host memory, asynchronously on CUDA, with bounded memory in flight.

    Example (CPU; on CUDA the same calls overlap the copy with the model)::

        >>> import torch
        >>> from pyhook.offload import Offloader
        >>> off = Offloader(max_inflight_bytes=1 << 20)
        >>> p = off.submit([torch.ones(2, 2)])
        >>> p.wait()[0].sum().item()
        4.0

    ``submit(tensors, copy=...)``: on CUDA every tensor is copied (``copy`` is ignored); on the
    CPU a tensor is copied only with ``copy=True`` (pass it when the tensor may alias memory the
    model will overwrite, e.g. an un-reduced layer output), via the pooled native copy.
    ``pooled=True`` takes the pinned buffers from :attr:`pool`; give them back with
    :meth:`release` once consumed (the disk writer does), or keep them (host destination).
    """

    def __init__(self, *, max_inflight_bytes: int = 1 << 30, pin: bool = True) -> None:
        if not isinstance(max_inflight_bytes, int) or max_inflight_bytes <= 0:
            raise ValueError(
                f"max_inflight_bytes must be a positive int, got {max_inflight_bytes!r}"
            )
        self.max_inflight_bytes = max_inflight_bytes
        self.pool = PinnedPool(pin=pin and torch.cuda.is_available())
        self._streams: dict[torch.device, Any] = {}
        self._inflight: collections.deque[PendingCopy] = collections.deque()
        self._inflight_bytes = 0
        self.bytes_copied = 0

    def _stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    def _reserve(self, nbytes: int) -> None:
        # Retire finished copies; if still over budget, wait for the oldest (back-pressure).
        while self._inflight and (
            self._inflight[0].ready() or self._inflight_bytes + nbytes > self.max_inflight_bytes
        ):
            oldest = self._inflight.popleft()
            oldest.wait()
            self._inflight_bytes -= oldest.nbytes

    def submit(
        self, tensors: Sequence[torch.Tensor], *, copy: bool = False, pooled: bool = True
    ) -> PendingCopy:
        """Start copying ``tensors`` to host memory; returns a :class:`PendingCopy`."""
        tensors = [t.detach() for t in tensors]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.bytes_copied += nbytes
        cuda = [t for t in tensors if t.device.type == "cuda"]
        if not cuda:
            if any(t.device.type not in ("cpu",) for t in tensors):
                return PendingCopy([t.to("cpu") for t in tensors], None, nbytes)
            return PendingCopy(_backend.clone_tensors(tensors) if copy else tensors, None, nbytes)
        self._reserve(nbytes)
        device = cuda[0].device
        side = self._stream(device)
        # The side stream must not read before the producing stream has written the values.
        side.wait_stream(torch.cuda.current_stream(device))
        host: list[torch.Tensor] = []
        with torch.cuda.stream(side):
            for t in tensors:
                size = t.numel() * t.element_size()
                if size == 0:
                    dst = torch.empty(t.shape, dtype=t.dtype)
                else:
                    if pooled:
                        buf = self.pool.get(size)[:size]
                    else:
                        buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pool.pin)
                    dst = buf.view(t.dtype).view(t.shape)
                if t.device.type == "cuda":
                    dst.copy_(t, non_blocking=True)
                    # Keep the caching allocator from handing t's memory to the main stream
                    # before the side stream has finished reading it.
                    t.record_stream(side)
                else:
                    dst.copy_(t)
                host.append(dst)
            event = torch.cuda.Event()
            event.record(side)
        pending = PendingCopy(host, event, nbytes)
        self._inflight.append(pending)
        self._inflight_bytes += nbytes
        return pending

    def release(self, tensors: Sequence[torch.Tensor]) -> None:
        """Give the pooled buffers behind ``tensors`` back for reuse (after they were consumed)."""
        for t in tensors:
            self.pool.put(t)

    def synchronize(self) -> None:
        """Wait for every copy in flight."""
        while self._inflight:
            p = self._inflight.popleft()
            p.wait()
        self._inflight_bytes = 0
