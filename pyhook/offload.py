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
import sys
import threading
from collections.abc import Sequence
from typing import Any

import torch

from . import _backend

__all__ = [
    "HostBuffers",
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


# -- reusable host memory for captures to host ------------------------------------------------
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


class _Slot:
    """One buffer of a :class:`HostBuffers`: its bytes, and the last copy that wrote them.

    Whether anybody else holds the buffer is counted twice: the tensors on its storage (the
    storage's use count: ``rec[layer]``, a slice, a view, a numpy array over one) and the
    references to its one Python storage object (``t.untyped_storage()`` kept alive, a typed
    storage: not tensors). The slot keeps that storage object alive, so that the
    ``untyped_storage()`` of every view of the buffer is that object and a reference to it
    shows. Another process cannot be counted at all: a buffer whose storage went to shared
    memory (a tensor sent through a ``torch.multiprocessing`` queue, out of a DataLoader worker,
    or ``share_memory_()``) is retired, never written again.
    """

    __slots__ = ("base", "buf", "event", "refs", "storage")

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.event: Any = None  # the last asynchronous copy into buf (CUDA), or None
        self.storage = buf.untyped_storage()
        # The counts while nobody but the slot holds buf (None where torch cannot count).
        self.base = (
            None if _storage_use_count is None else int(_storage_use_count(self.storage._cdata))
        )
        self.refs = sys.getrefcount(self.storage)

    @property
    def nbytes(self) -> int:
        return int(self.buf.numel())

    def shared(self) -> bool:
        """The buffer went to shared memory: another process may hold it (retired)."""
        return bool(self.storage.is_shared())

    def idle(self) -> bool:
        """No tensor or storage outside the set refers to the buffer, and no other process can:
        it may be written again."""
        count = _storage_use_count
        return (
            self.base is not None
            and count is not None
            and count(self.storage._cdata) == self.base
            and sys.getrefcount(self.storage) == self.refs
            and not self.storage.is_shared()
        )

    def settle(self) -> None:
        """Wait for the last asynchronous copy into the buffer (one of an earlier capture)."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None


class _EventEngine:
    """The engine of a :class:`PendingCopy` whose ticket is a CUDA event."""

    @staticmethod
    def ready(event: Any) -> bool:
        return bool(event.query())

    @staticmethod
    def wait(event: Any) -> None:
        event.synchronize()


class HostBuffers:
    """Host memory that captures to host write their rows into, kept and reused across captures.

    Pass one to :func:`pyhook.capture` (``capture(model, layers, buffers=bufs)``, destination
    ``to="host"``) and every batch's rows are copied straight into a buffer of the set, one per
    layer: on CUDA a non-blocking copy into **pinned** memory on a side stream, on the CPU one
    copy. ``rec[layer]`` and :meth:`~pyhook.capture.Recorder.results` are then views of that
    buffer: no join, no second copy. The first capture learns how many bytes each layer takes;
    later captures of the same size reuse the same memory, already faulted in (and on CUDA
    already page-locked): no allocation, no page fault, no ``cudaHostAlloc`` in the loop.

    Reuse is safe: a buffer is written again only when nothing outside the set refers to it.
    Results you still hold (``rec[layer]``, a view, a slice, a numpy array over one, their
    ``untyped_storage()``) keep their values; the next capture takes another buffer (up to ``depth`` per layer are kept, so a loop that holds the last
    capture's results while it runs the next one alternates between two) and the memory goes
    back when your tensors and the set are dropped (or on :meth:`clear`). A buffer whose rows
    went to another process (through a ``torch.multiprocessing`` queue, out of a DataLoader
    worker, or by ``share_memory_()``) lives in shared memory, where this process cannot see
    who still reads it: it is never written again (the set forgets it; its holders keep it).
    A set sent to another process arrives empty (buffers belong to the process that made them).

    ``pin`` (default: whether CUDA is available) page-locks the buffers, which only helps copies
    from a GPU. Thread-safe.

    Example::

        >>> import torch, pyhook
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
        >>> bufs = pyhook.HostBuffers(pin=False)
        >>> def run():
        ...     with pyhook.capture(net, ["0"], buffers=bufs) as rec:
        ...         for _ in range(3):
        ...             _ = net(torch.randn(2, 5, 4))
        ...     return rec["0"]
        >>> a = run()  # the first capture learns the size: 3 batches of 10 rows
        >>> b = run()  # a is still held: another buffer
        >>> a_at = a.data_ptr(); del a
        >>> c = run()  # a's buffer again: no allocation, and no join at the end
        >>> c.shape, c.data_ptr() == a_at, b.data_ptr() != a_at
        (torch.Size([30, 8]), True, True)
    """

    def __init__(self, *, pin: bool | None = None, depth: int = 2) -> None:
        if pin is not None and not isinstance(pin, bool):
            raise TypeError(f"HostBuffers: pin must be True, False or None, got {pin!r}")
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(
                f"HostBuffers: depth must be an int >= 1 (buffers kept per layer), got {depth!r}"
            )
        self.pin = torch.cuda.is_available() if pin is None else pin
        if self.pin and not torch.cuda.is_available():
            raise RuntimeError(
                "HostBuffers(pin=True) needs CUDA: page-locked memory is for device copies"
            )
        self.depth = depth
        self._slots: dict[str, list[_Slot]] = {}
        self._want: dict[str, int] = {}  # layer -> bytes its last capture took
        self._streams: dict[torch.device, Any] = {}
        self._lock = threading.Lock()
        self._allocations = 0
        self._reuses = 0
        self._joins = 0

    # -- buffers ---------------------------------------------------------------------------
    def _take(self, key: str, nbytes: int) -> tuple[_Slot, torch.Tensor]:
        """An idle buffer for ``key`` of at least ``nbytes`` and the most bytes a capture of
        ``key`` took so far (the smallest such), or a new one of that size; with a view of it
        that keeps it taken."""
        with self._lock:
            nbytes = max(nbytes, self._want.get(key, 0))
            slots = self._slots.setdefault(key, [])
            if any(s.shared() for s in slots):  # retired: another process may hold them
                slots[:] = [s for s in slots if not s.shared()]
            fits = [s for s in slots if s.nbytes >= nbytes and s.idle()]
            if fits:
                slot = min(fits, key=lambda s: s.nbytes)
                slots.remove(slot)
                slots.append(slot)  # most recently used last
                hold = slot.buf[:0]  # taken: no longer idle for another capture
                self._reuses += 1
                found = True
            else:
                found = False
                size = nbytes
        if found:
            slot.settle()
            return slot, hold
        # Allocated outside the lock: page-locking is slow.
        slot = _Slot(torch.empty(size, dtype=torch.uint8, pin_memory=self.pin))
        hold = slot.buf[:0]
        with self._lock:
            slots = self._slots.setdefault(key, [])
            # Idle buffers too small for what this layer takes now are no use; past the depth,
            # the oldest are forgotten (those still held belong to their holders).
            slots[:] = [s for s in slots if not (s.idle() and s.nbytes < size)]
            while len(slots) >= self.depth:
                slots.pop(0)
            slots.append(slot)
            self._allocations += 1
        return slot, hold

    def _learn(self, key: str, nbytes: int) -> None:
        with self._lock:
            self._want[key] = max(nbytes, self._want.get(key, 0))

    def _side_stream(self, device: torch.device) -> Any:
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device=device)
            return stream

    def clear(self) -> None:
        """Forget every buffer (held results keep theirs) and what each layer took."""
        with self._lock:
            slots = [s for ss in self._slots.values() for s in ss]
            self._slots.clear()
            self._want.clear()
        for s in slots:
            s.settle()

    def stats(self) -> dict[str, int]:
        """``buffers`` kept, their ``bytes``, how many are ``idle``; ``allocations``,
        ``reuses`` (a buffer written again) and ``joins`` (a capture that outgrew its buffer
        and was joined into a larger one, which the next capture reuses)."""
        with self._lock:
            slots = [s for ss in self._slots.values() for s in ss]
            return {
                "buffers": len(slots),
                "bytes": sum(s.nbytes for s in slots),
                "idle": sum(1 for s in slots if s.idle()),
                "allocations": self._allocations,
                "reuses": self._reuses,
                "joins": self._joins,
            }

    def __reduce__(self) -> tuple[Any, ...]:
        # A DataLoader worker started by spawn gets its own, empty set: the lock and the
        # buffers are this process's.
        return (_empty_host_buffers, (self.pin, self.depth))

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"HostBuffers(pin={self.pin}, depth={self.depth}: {s['buffers']} buffers, "
            f"{s['bytes'] / 1e6:.1f} MB, {s['idle']} idle)"
        )

    def _lease(self, max_inflight_bytes: int) -> _Lease:
        return _Lease(self, max_inflight_bytes)


def _empty_host_buffers(pin: bool, depth: int) -> HostBuffers:
    return HostBuffers(pin=pin and torch.cuda.is_available(), depth=depth)


class _Chunk:
    __slots__ = ("hold", "slot", "used")

    def __init__(self, slot: _Slot, hold: torch.Tensor | None) -> None:
        self.slot = slot
        self.hold = hold  # keeps the buffer taken while the capture runs
        self.used = 0


class _Lease:
    """One capture's use of a :class:`HostBuffers`: per layer, the buffers its rows went into,
    in order (one when the layer's rows fit, as they do once the set has learned its size)."""

    def __init__(self, owner: HostBuffers, max_inflight_bytes: int) -> None:
        self.owner = owner
        self.chunks: dict[str, list[_Chunk]] = {}
        self.max_inflight_bytes = max_inflight_bytes
        self._inflight: collections.deque[tuple[Any, int]] = collections.deque()
        self._inflight_bytes = 0

    def _room(self, key: str, t: torch.Tensor) -> tuple[torch.Tensor, _Slot]:
        """Where ``t``'s rows go in ``key``'s buffers (after the rows before them), and the
        buffer."""
        nbytes, size = t.nbytes, t.element_size()
        chunks = self.chunks.setdefault(key, [])
        cur = chunks[-1] if chunks else None
        if cur is None or cur.used % size or cur.used + nbytes > cur.slot.nbytes:
            taken = sum(c.used for c in chunks)
            # The first chunk takes what the layer took last time; one that overflows doubles.
            cur = _Chunk(*self.owner._take(key, max(nbytes, taken)))
            chunks.append(cur)
        dst = cur.slot.buf[cur.used : cur.used + nbytes].view(t.dtype).view(t.shape)
        cur.used += nbytes
        return dst, cur.slot

    def put(self, key: str, t: torch.Tensor, *, snapshot: bool) -> torch.Tensor | PendingCopy:
        """Copy ``t``'s values into ``key``'s buffer. CPU: now. CUDA: non-blocking on the set's
        side stream, after the producing stream (from a device snapshot when ``snapshot``: ``t``
        may be updated in place after this returns); a :class:`PendingCopy` of the host view."""
        t = t.detach()
        if t.numel() == 0:
            return t.to("cpu", copy=True)
        if t.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"HostBuffers: the current CUDA stream is being captured into a CUDA graph "
                f"(layer {key!r}); capture rows after the graph is captured (or replayed), not "
                "inside it"
            )
        dst, slot = self._room(key, t)
        if not t.is_cuda:
            dst.copy_(t)
            return dst
        device = t.device
        current = torch.cuda.current_stream(device)
        src = t.clone() if snapshot else t
        side = self.owner._side_stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        src.record_stream(side)  # the allocator keeps src until the copy has read it
        slot.event = event
        self._inflight.append((event, t.nbytes))
        self._inflight_bytes += t.nbytes
        while self._inflight_bytes > self.max_inflight_bytes and len(self._inflight) > 1:
            old, nb = self._inflight.popleft()
            old.synchronize()  # back-pressure: device snapshots in flight stay bounded
            self._inflight_bytes -= nb
        return PendingCopy([dst], _EventEngine, event, t.nbytes)

    def whole(self, key: str, parts: list[torch.Tensor]) -> torch.Tensor | None:
        """``parts`` (this capture's rows of ``key``, in order) as one tensor: a view when they
        lie back to back in one buffer, else joined into a buffer of the set (which the next
        capture reuses); None when they are not all rows of this lease."""
        chunks = self.chunks.get(key)
        if not chunks or not parts:
            return None
        first = parts[0]
        tail, dtype = first.shape[1:], first.dtype
        if any(p.shape[1:] != tail or p.dtype != dtype or not p.is_contiguous() for p in parts):
            return None
        rows = sum(int(p.shape[0]) for p in parts)
        if len(chunks) == 1:
            buf = chunks[0].slot.buf
            start = buf.data_ptr()
            at = start
            for p in parts:  # back to back from the start of the one buffer
                if p.data_ptr() != at or p.untyped_storage().data_ptr() != start:
                    return None
                at += p.nbytes
            return buf[: at - start].view(dtype).view(rows, *tail)
        nbytes = sum(p.nbytes for p in parts)
        self.owner._learn(key, nbytes)
        slot, _hold = self.owner._take(key, nbytes)
        out = slot.buf[:nbytes].view(dtype).view(rows, *tail)
        torch.cat(parts, out=out)
        joined = _Chunk(slot, None)
        joined.used = nbytes
        self.chunks[key] = [joined]  # the earlier buffers are idle once parts are let go
        with self.owner._lock:
            self.owner._joins += 1
        return out

    def close(self) -> None:
        """The capture ended: the set learns what each layer took; the buffers stay taken
        only as long as its rows are held."""
        for key, chunks in self.chunks.items():
            self.owner._learn(key, sum(c.used for c in chunks))
            for c in chunks:
                c.hold = None
