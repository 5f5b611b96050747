"""Copies to host memory that overlap the model's compute: pooled buffers, side stream, events.

:class:`Offloader` copies lists of tensors to host memory and hands back a :class:`PendingCopy`
(read the host tensors with :meth:`PendingCopy.wait`; nobody reads a buffer before its copy has
finished):

* **CUDA**: copies are issued on a side stream that first waits for the producing stream (so they
  read finished values), into page-locked host buffers from a pool that is reused across
  batches, and complete with an event. Sources and destinations are kept alive until the event,
  so the caching allocator cannot recycle a source that is still being read. With
  ``copy=True`` (the tensor may alias memory the model updates in place later, e.g. an
  un-reduced layer output) a device-side snapshot is taken first on the current stream: an
  in-place update queued after :meth:`Offloader.submit` returns cannot race the asynchronous
  read. At most ``max_inflight_bytes`` are in flight: past that, ``submit`` waits for the
  oldest copies (back-pressure; bounded pinned and device memory).
* **CPU**: tensors are already in host memory; a copy is made only with ``copy=True``, with the
  pooled native copy (:func:`pyhook._backend.clone_tensors`; its pool recycles a buffer once
  the last tensor in it is dropped). The engines below also take CPU tensors (a list mixing
  devices), copying them into the offloader's own pool with ``pooled=True``.

The engine is the native ``torch.classes.pyhook.Offloader`` (``csrc/offload.cpp``,
``csrc/cuda/offload_cuda.cu``) when the native core is built and the backend is ``native``;
otherwise :class:`ReferenceOffloader`, the pure-PyTorch specification it is tested against.
Both give identical results (values, shapes, dtypes, strides, buffer reuse).

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

__all__ = [
    "Offloader",
    "PendingCopy",
    "PinnedPool",
    "ReferenceOffloader",
    "resident_bytes",
    "trim_host_memory",
]

_STATS_KEYS = (
    "inflight_bytes",
    "inflight_jobs",
    "bytes_submitted",
    "stalls",
    "pool_idle_bytes",
    "pool_lent",
    "pool_hits",
    "pool_misses",
)


def _bucket(nbytes: int) -> int:
    # Power-of-two buckets from 64 KiB: a handful of sizes recur batch after batch, so after the
    # first few batches every request is a pool hit (at most 2x the bytes).
    size = 1 << 16
    while size < nbytes:
        size <<= 1
    return size


_libc: Any = None


def resident_bytes() -> int:
    """This process's resident set size in bytes (0 where ``/proc`` is missing).

    Example::

        >>> from pyhook.offload import resident_bytes
        >>> resident_bytes() >= 0
        True
    """
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


_PAGE = 4096
try:
    import os as _os

    _PAGE = _os.sysconf("SC_PAGE_SIZE")
except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
    pass


def trim_host_memory(*, above: int | None = None) -> None:
    """Give idle host memory back to the operating system: the native capture-buffer pool's
    idle buffers, then the C allocator's free heap pages (``malloc_trim(0)`` on glibc).

    Freed capture buffers otherwise stay in the process (pooled for reuse, or kept by glibc's
    heap), so its resident size would stay at the capture's peak. :class:`~pyhook.capture.
    Recorder` calls this after :meth:`~pyhook.capture.Recorder.results` joined a host
    capture's batches, and when a disk capture closes whose heap-sized buffers could account
    for what the process grew by (docs/store-format.md, "Host memory").

    Example::

        >>> import torch
        >>> from pyhook.offload import trim_host_memory
        >>> x = torch.ones(1 << 22); del x
        >>> trim_host_memory()  # never raises; a no-op where there is nothing to trim

    ``above``: trim the C allocator's heap only when the process is still resident beyond
    ``above`` bytes once the pool is empty (a trim also returns the free pages the model's
    own forward reuses batch after batch, which the next forward then faults in again).
    """
    global _libc
    _backend.empty_pool()
    if above is not None and resident_bytes() <= above:
        return
    if _libc is None:
        _libc = False
        try:
            import ctypes
            import ctypes.util

            name = ctypes.util.find_library("c")
            lib = ctypes.CDLL(name) if name else None
            if lib is not None and hasattr(lib, "malloc_trim"):  # glibc only
                _libc = lib
        except OSError:
            pass
    if _libc:
        _libc.malloc_trim(0)


def check_byte_count(name: str, value: object, low: int) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int (not a bool) >= ``low``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low} (bytes), got {value!r}")


def _check_copyable(i: int, t: torch.Tensor) -> None:
    # Same messages as the native engine's checks (csrc/offload.cpp).
    if t.layout != torch.strided:
        raise RuntimeError(
            f"Offloader.submit: tensor {i} has layout {t.layout}; only strided (dense) "
            "tensors can be copied to host memory"
        )
    if t.is_meta:
        raise RuntimeError(
            f"Offloader.submit: tensor {i} is on the meta device and has no values to copy"
        )
    if t.is_quantized:
        raise RuntimeError(
            f"Offloader.submit: tensor {i} is quantized; dequantize it (or capture its "
            "int_repr()) first"
        )


def _dense_view(buf: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return buf[: like.nbytes].view(like.dtype).view(like.shape)


class PinnedPool:
    """A pool of host buffers (page-locked ones kept apart), reused across batches.

    ``get(nbytes, pinned)`` returns a ``uint8`` tensor of at least ``nbytes`` (from the pool when
    an idle buffer of that bucket exists); ``put(tensor)`` gives back the buffer behind
    ``tensor`` (any view of it). ``limit_bytes`` caps the idle bytes kept. Thread-safe: the
    writer thread gives buffers back while the main thread takes them. The native engine has
    the same pool in C++.

    Example::

        >>> from pyhook.offload import PinnedPool
        >>> pool = PinnedPool()
        >>> a = pool.get(1000); pool.put(a); b = pool.get(900)
        >>> a.data_ptr() == b.data_ptr(), pool.stats()["hits"]
        (True, 1)
    """

    def __init__(self, *, limit_bytes: int = 4 << 30) -> None:
        self.limit_bytes = limit_bytes
        self._free: dict[tuple[bool, int], list[torch.Tensor]] = collections.defaultdict(list)
        self._lent: dict[int, tuple[torch.Tensor, bool]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, nbytes: int, pinned: bool = False) -> torch.Tensor:
        size = _bucket(nbytes)
        buf = None
        with self._lock:
            free = self._free.get((pinned, size))
            if free:
                buf = free.pop()
                self._idle_bytes -= size
                self.hits += 1
            else:
                self.misses += 1
        if buf is None:  # allocated outside the lock: page-locking is slow
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        with self._lock:
            self._lent[buf.data_ptr()] = (buf, pinned)
        return buf

    def put(self, tensor: torch.Tensor) -> None:
        key = tensor.untyped_storage().data_ptr()
        with self._lock:
            lent = self._lent.pop(key, None)
            if lent is None:
                return  # not ours (or already given back)
            buf, pinned = lent
            if self._idle_bytes + buf.numel() <= self.limit_bytes:
                self._free[(pinned, buf.numel())].append(buf)
                self._idle_bytes += buf.numel()

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
    """Host copies of a list of tensors, possibly still in flight. Read them with :meth:`wait`.

    Example::

        >>> import torch
        >>> from pyhook.offload import Offloader
        >>> p = Offloader().submit([torch.ones(3)], copy=True)
        >>> p.wait()[0].tolist(), p.ready(), p.nbytes
        ([1.0, 1.0, 1.0], True, 12)
    """

    __slots__ = ("_done", "_engine", "_host", "_ticket", "nbytes")

    def __init__(self, host: list[torch.Tensor], engine: Any, ticket: Any, nbytes: int) -> None:
        self._host = host
        self._engine = engine  # has ready(ticket) / wait(ticket); None when already complete
        self._ticket = ticket
        self.nbytes = nbytes
        self._done = engine is None

    @property
    def shapes(self) -> list[torch.Size]:
        """The host tensors' shapes (readable before the copies finish)."""
        return [t.shape for t in self._host]

    def ready(self) -> bool:
        """True once the copies have finished (never blocks)."""
        if not self._done and self._engine.ready(self._ticket):
            self._done = True
        return self._done

    def wait(self) -> list[torch.Tensor]:
        """Block until the copies are complete and return the host tensors."""
        if not self._done:
            self._engine.wait(self._ticket)
            self._done = True
        return self._host


class _Job:
    __slots__ = ("event", "keep", "nbytes", "ticket", "to_pool")

    def __init__(self, ticket: int, event: Any, keep: list[torch.Tensor], nbytes: int) -> None:
        self.ticket = ticket
        self.event = event
        self.keep = keep
        self.nbytes = nbytes
        self.to_pool: list[torch.Tensor] = []  # released before the copy landed


class ReferenceOffloader:
    """Pure-PyTorch implementation of the offloader (the specification of the native one).

    Same constructor and methods as the native ``torch.classes.pyhook.Offloader``:
    ``submit(tensors, copy, pooled) -> (ticket, host)``, ``ready(ticket)``, ``wait(ticket)``,
    ``synchronize()``, ``release(tensors)``, ``empty_pool()``, ``stats()``. Use it through
    :class:`Offloader`.

    Example::

        >>> import torch
        >>> from pyhook.offload import ReferenceOffloader
        >>> ref = ReferenceOffloader(1 << 20, True, 1 << 30)
        >>> ticket, (host,) = ref.submit([torch.ones(2)], True, True)
        >>> ref.ready(ticket), host.tolist()
        (True, [1.0, 1.0])
    """

    def __init__(self, max_inflight_bytes: int, pin: bool, pool_limit_bytes: int) -> None:
        self.pin = pin
        self.max_inflight_bytes = max_inflight_bytes
        self.pool = PinnedPool(limit_bytes=pool_limit_bytes)
        self._streams: dict[torch.device, Any] = {}
        self._jobs: collections.deque[_Job] = collections.deque()
        self._lock = threading.Lock()
        # notified when a reservation becomes a job or is given back (see submit)
        self._changed = threading.Condition(self._lock)
        self._inflight_bytes = 0
        self._next_ticket = 1
        self._bytes_submitted = 0
        self._stalls = 0

    def _side_stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    def _erase(self, job: _Job) -> None:
        with self._lock:
            try:
                self._jobs.remove(job)
            except ValueError:
                return
            self._retired_locked(job)

    def _retired_locked(self, job: _Job) -> None:
        self._inflight_bytes -= job.nbytes
        for buf in job.to_pool:
            self.pool.put(buf)
        job.to_pool = []

    def submit(
        self, tensors: Sequence[torch.Tensor], copy: bool, pooled: bool
    ) -> tuple[int, list[torch.Tensor]]:
        tensors = [t.detach() for t in tensors]
        for i, t in enumerate(tensors):
            _check_copyable(i, t)
        total = sum(t.nbytes for t in tensors)
        is_async = [t.is_cuda and t.numel() > 0 for t in tensors]
        async_bytes = sum(t.nbytes for t, a in zip(tensors, is_async) if a)
        if async_bytes:
            # Back-pressure: retire finished copies, then wait for the oldest until this fits;
            # the bytes are reserved under the same lock (concurrent submitters see them).
            with self._lock:
                while self._jobs and self._jobs[0].event.query():
                    self._retired_locked(self._jobs.popleft())
            # Bytes reserved by a submitter that has not enqueued its job yet count too: with
            # no job to wait on, wait until it is enqueued or given back.
            while True:
                with self._lock:
                    if (
                        self._inflight_bytes == 0
                        or self._inflight_bytes + async_bytes <= self.max_inflight_bytes
                    ):
                        self._inflight_bytes += async_bytes
                        break
                    self._stalls += 1
                    if not self._jobs:
                        self._changed.wait()
                        continue
                    oldest = self._jobs[0]
                oldest.event.synchronize()
                self._erase(oldest)

        lent: list[torch.Tensor] = []  # pool buffers taken by this call
        jobs: list[_Job] = []
        try:
            return self._submit_reserved(tensors, copy, pooled, total, is_async, lent, jobs)
        except BaseException:
            # Let the copies already enqueued finish (also those of a device whose enqueueing
            # failed half-way), then give back what this call took.
            for stream in list(self._streams.values()):
                stream.synchronize()
            for job in jobs:
                self._erase(job)
            with self._lock:
                self._inflight_bytes -= async_bytes - sum(j.nbytes for j in jobs)
                self._changed.notify_all()
            for buf in lent:
                self.pool.put(buf)
            raise

    def _submit_reserved(
        self,
        tensors: list[torch.Tensor],
        copy: bool,
        pooled: bool,
        total: int,
        is_async: list[bool],
        lent: list[torch.Tensor],
        jobs: list[_Job],
    ) -> tuple[int, list[torch.Tensor]]:
        def pooled_dst(like: torch.Tensor, pinned: bool) -> torch.Tensor:
            lent.append(self.pool.get(like.nbytes, pinned))
            return _dense_view(lent[-1], like)

        host: list[Any] = [None] * len(tensors)
        clone_idx = []
        groups: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for i, t in enumerate(tensors):
            if t.is_cpu:
                if not copy:
                    host[i] = t
                elif pooled and t.numel() > 0:
                    dst = pooled_dst(t, False)
                    dst.copy_(t)
                    host[i] = dst
                else:
                    clone_idx.append(i)
                continue
            if not is_async[i]:
                host[i] = t.to("cpu")
                continue
            # Snapshot on the current stream when t may alias memory updated in place later.
            # (copy_ below resolves lazy conjugate/negative bits and zero tensors.)
            src = (t.clone() if copy else t) if t.is_contiguous() else t.contiguous()
            if pooled:
                dst = pooled_dst(t, self.pin)
            else:
                dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)
            srcs, dsts = groups.setdefault(t.device, ([], []))
            srcs.append(src)
            dsts.append(dst)
            host[i] = dst
        if clone_idx:
            copies = _backend.clone_tensors([tensors[i] for i in clone_idx])
            for i, c in zip(clone_idx, copies):
                host[i] = c

        with self._lock:
            ticket = self._next_ticket
            self._next_ticket += 1
            self._bytes_submitted += total
        for device, (srcs, dsts) in groups.items():
            side = self._side_stream(device)
            # The side stream must not read before the producing stream has written the values.
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for s, d in zip(srcs, dsts):
                    d.copy_(s, non_blocking=True)
                event = torch.cuda.Event()
                event.record(side)
            job = _Job(ticket, event, srcs + dsts, sum(s.nbytes for s in srcs))
            with self._lock:
                self._jobs.append(job)  # its bytes were reserved before
                self._changed.notify_all()
            jobs.append(job)
        return ticket, host

    def ready(self, ticket: int) -> bool:
        with self._lock:
            jobs = [j for j in self._jobs if j.ticket == ticket]
        if not all(j.event.query() for j in jobs):
            return False
        for j in jobs:
            self._erase(j)
        return True

    def wait(self, ticket: int) -> None:
        with self._lock:
            jobs = [j for j in self._jobs if j.ticket == ticket]
        for j in jobs:
            j.event.synchronize()
            self._erase(j)

    def synchronize(self) -> None:
        with self._lock:
            jobs = list(self._jobs)
        for j in jobs:
            j.event.synchronize()
            self._erase(j)

    def release(self, tensors: Sequence[torch.Tensor]) -> None:
        with self._lock:
            for t in tensors:
                # A buffer whose copy has not landed goes back when its job retires.
                ptr = t.untyped_storage().data_ptr()
                owner = next(
                    (
                        j
                        for j in self._jobs
                        if any(k.untyped_storage().data_ptr() == ptr for k in j.keep)
                    ),
                    None,
                )
                if owner is not None:
                    owner.to_pool.append(t)
                else:
                    self.pool.put(t)

    def empty_pool(self) -> None:
        self.pool.empty()

    def stats(self) -> list[int]:
        with self._lock:
            head = [self._inflight_bytes, len(self._jobs), self._bytes_submitted, self._stalls]
        p = self.pool.stats()
        return [*head, p["idle_bytes"], p["lent"], p["hits"], p["misses"]]


def _native_engine_for_cuda() -> bool:
    return "cuda" in torch.ops.pyhook.offload_async_devices()


class Offloader:
    """Copy tensors to host memory, asynchronously on CUDA, with bounded memory in flight.

    Example (CPU; on CUDA the same calls overlap the copy with the model)::

        >>> import torch
        >>> from pyhook.offload import Offloader
        >>> off = Offloader(max_inflight_bytes=1 << 20)
        >>> p = off.submit([torch.ones(2, 2)])
        >>> p.wait()[0].sum().item()
        4.0

    ``submit(tensors, copy=..., pooled=...)``: on CUDA every tensor is copied, and ``copy=True``
    additionally snapshots it on the device first (pass it when the tensor may alias memory
    the model overwrites later, e.g. an un-reduced layer output); on the CPU a tensor is copied
    only with ``copy=True``. ``pooled=True`` takes host buffers from the pool; give them back
    with :meth:`release` once consumed (the disk writer does), or keep them (host destination).
    ``max_inflight_bytes`` bounds the bytes of asynchronous copies not yet finished;
    ``pool_limit_bytes`` the idle pooled bytes kept for reuse. The engine is native when the
    native core is built (and, for CUDA tensors, built with CUDA) and the backend is
    ``native`` at construction; otherwise :class:`ReferenceOffloader`.
    """

    def __init__(
        self,
        *,
        max_inflight_bytes: int = 1 << 30,
        pin: bool = True,
        pool_limit_bytes: int = 4 << 30,
    ) -> None:
        check_byte_count("max_inflight_bytes", max_inflight_bytes, 1)
        check_byte_count("pool_limit_bytes", pool_limit_bytes, 0)
        self.max_inflight_bytes = max_inflight_bytes
        self.pin = bool(pin)
        self.pool_limit_bytes = pool_limit_bytes
        self._native: Any = None
        self._native_cuda = False
        if _backend.get_backend() == "native":
            self._native = torch.classes.pyhook.Offloader(
                max_inflight_bytes, self.pin, pool_limit_bytes
            )
            self._native_cuda = _native_engine_for_cuda()
        self._reference: ReferenceOffloader | None = None
        self._cpu_bytes = 0

    @property
    def backend(self) -> str:
        """``'native'`` or ``'reference'``: the engine CPU tensors go to."""
        return "native" if self._native is not None else "reference"

    def _ref(self) -> ReferenceOffloader:
        if self._reference is None:
            self._reference = ReferenceOffloader(
                self.max_inflight_bytes, self.pin, self.pool_limit_bytes
            )
        return self._reference

    def _engine_for(self, tensors: Sequence[torch.Tensor]) -> Any:
        if self._native is None:
            return self._ref()
        if not self._native_cuda and any(t.is_cuda for t in tensors):
            return self._ref()  # native core built without CUDA: Python streams and events
        return self._native

    def submit(
        self, tensors: Sequence[torch.Tensor], *, copy: bool = False, pooled: bool = True
    ) -> PendingCopy:
        """Start copying ``tensors`` to host memory; returns a :class:`PendingCopy`."""
        tensors = [t.detach() for t in tensors]
        nbytes = 0
        for i, t in enumerate(tensors):
            if not t.is_cpu:
                break
            _check_copyable(i, t)
            nbytes += t.nbytes
        else:
            # All in host memory already: nothing is asynchronous, and a Python call into the
            # engine would cost more than the copy of a small activation. Copies go through
            # the pooled native clone (large) or clone (small), whatever ``pooled`` says: the
            # native pool recycles a buffer once its last tensor is dropped.
            if copy:
                tensors = _backend.clone_tensors(tensors)
            self._cpu_bytes += nbytes
            return PendingCopy(tensors, None, None, nbytes)
        engine = self._engine_for(tensors)
        ticket, host = engine.submit(tensors, bool(copy), bool(pooled))
        return PendingCopy(list(host), engine, ticket, sum(t.nbytes for t in tensors))

    def release(self, tensors: Sequence[torch.Tensor]) -> None:
        """Give the pooled buffers behind ``tensors`` back for reuse (after they were consumed)."""
        tensors = list(tensors)
        if self._native is not None:
            self._native.release(tensors)
        if self._reference is not None:
            self._reference.release(tensors)

    def synchronize(self) -> None:
        """Wait for every copy in flight."""
        for engine in (self._native, self._reference):
            if engine is not None:
                engine.synchronize()

    def empty_pool(self) -> None:
        """Free the idle pooled host buffers."""
        for engine in (self._native, self._reference):
            if engine is not None:
                engine.empty_pool()

    def stats(self) -> dict[str, int]:
        """Counters summed over the engines in use.

        ``inflight_bytes``/``inflight_jobs``: asynchronous copies not yet retired;
        ``bytes_submitted``; ``stalls``: times ``submit`` waited for copies to fit the budget;
        ``pool_idle_bytes``, ``pool_lent``, ``pool_hits``, ``pool_misses``: the host buffer pool.
        """
        total = [0] * len(_STATS_KEYS)
        for engine in (self._native, self._reference):
            if engine is not None:
                total = [a + b for a, b in zip(total, engine.stats())]
        total[2] += self._cpu_bytes
        return dict(zip(_STATS_KEYS, total))
