"""Reused shared-memory slots that carry :class:`~pyhook.dataset.CaptureDataset` batches from a
``DataLoader`` worker to the main process.

Why: torch sends a worker's tensors through shared memory. Gathering a batch into *fresh* shared
memory costs page faults and zeroing on every batch (measured on a 2-core VM: 12 ms for
4096 x 768 float32 rows, against 1.8 ms for the same gather into memory mapped before), and the
main process then fetches one file descriptor per tensor from the worker (a socket round trip)
and maps new pages. A ring of slots mapped once in both processes removes all three costs.

How (Linux; anything else uses torch's path, see :func:`available`):

* the worker creates an *arena* with ``os.memfd_create`` (an anonymous file: nothing appears in
  ``/dev/shm``, its pages go away with the last mapping): a control page (a random token, then
  one "in use" byte per slot) followed by ``slots`` slots, each large enough for one full batch
  of every key. Only the slots ever used take memory;
* a batch is gathered into a free slot (free = the main process released it *and* no view of it
  is alive in the worker) and travels as a :class:`RingBatch`, which pickles as a reference to
  its slot: (worker pid, fd number, token, slot, offsets, dtypes, shapes), never the rows;
* in the main process :func:`_rebuild` maps the arena once (``/proc/<pid>/fd/<fd>``, checked
  against the token; cached until the worker is gone) and returns a plain ``dict`` of tensors
  over the slot (``torch.frombuffer`` of one numpy view of the slot). The slot is marked free by
  a ``weakref.finalize`` on that view, which runs when torch drops the last storage that uses
  it, i.e. once every tensor and every view of the batch is gone. A batch kept forever keeps
  its slot; when no slot is free the worker uses torch's path for that batch (it never waits).

The main process may only read a slot's memory while the worker is alive to open it, which
holds in a ``DataLoader``: it unpickles a worker's batches before telling it to stop.
"""

from __future__ import annotations

import math
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

_TOKEN = 16  # bytes of the arena's random token, at offset 0
_FLAGS = 64  # offset of the per-slot "in use" bytes
_CONTROL = mmap.PAGESIZE  # the control page; slots start after it
MAX_SLOTS = _CONTROL - _FLAGS

# Counters of this process, for tests and benchmarks: batches sent from a slot / by torch's
# path (worker side), batches rebuilt from a slot and arenas mapped (main side).
stats = {"ring": 0, "fallback": 0, "rebuilt": 0, "arenas": 0}


def available() -> bool:
    """Whether this platform has what the ring needs (``memfd_create`` and ``/proc/<pid>/fd``)."""
    return (
        sys.platform.startswith("linux")
        and hasattr(os, "memfd_create")
        and os.path.isdir(f"/proc/{os.getpid()}/fd")
    )


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class WorkerRing:
    """The worker's arena: ``slots`` slots, each holding ``rows`` rows of every key of ``layout``
    (``[(key, dtype, row_shape)]``), mapped in this process.

    >>> import pickle
    >>> ring = WorkerRing([("x", torch.float32, (2,))], rows=3, slots=2)
    >>> batch = ring.batch(ring.acquire(), 3)
    >>> _ = batch["x"].copy_(torch.arange(6.0).reshape(3, 2))  # a gather writes here
    >>> got = pickle.loads(pickle.dumps(batch))  # what a DataLoader does across processes
    >>> type(got).__name__, got["x"][2].tolist(), ring.acquire()  # slot 0 is taken
    ('dict', [4.0, 5.0], 1)
    """

    def __init__(
        self, layout: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], rows: int, slots: int
    ) -> None:
        if not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"slots must be in 1..{MAX_SLOTS}, got {slots}")
        self.rows, self.slots = rows, slots
        self.layout: list[tuple[str, int, torch.dtype, tuple[int, ...]]] = []
        offset = 0
        for key, dtype, row_shape in layout:
            self.layout.append((key, offset, dtype, tuple(row_shape)))
            nbytes = rows * math.prod(row_shape) * torch.empty(0, dtype=dtype).element_size()
            offset += _round_up(nbytes, mmap.PAGESIZE)
        self.slot_bytes = max(offset, mmap.PAGESIZE)
        self.size = _CONTROL + slots * self.slot_bytes
        self.fd = os.memfd_create("pyhook-ring", getattr(os, "MFD_CLOEXEC", 0))
        try:
            os.ftruncate(self.fd, self.size)  # sparse: a slot takes memory once written
            self.mm = mmap.mmap(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        self.token = os.urandom(_TOKEN)
        self.mm[:_TOKEN] = self.token
        self.pid = os.getpid()
        self._local = [False] * slots  # a view of the slot is alive in this process
        self._sent = [False] * slots  # the slot's batch was pickled (the main process frees it)

    def acquire(self) -> int | None:
        """A free slot, now marked in use, or ``None`` when every slot is taken."""
        for s in range(self.slots):
            if not self._local[s] and self.mm[_FLAGS + s] == 0:
                self.mm[_FLAGS + s] = 1
                self._local[s], self._sent[s] = True, False
                return s
        return None

    def _dropped(self, slot: int) -> None:
        # The worker's last view of the slot is gone. A batch never pickled (consumed inside
        # the worker, or its gather failed) is nobody else's: the slot is free again.
        if not self._sent[slot]:
            self.mm[_FLAGS + slot] = 0
        self._local[slot] = False

    def batch(self, slot: int, rows: int) -> RingBatch:
        """Views of ``rows`` rows of every key in ``slot`` (to gather into), as a :class:`RingBatch`."""
        base = np.frombuffer(self.mm, np.uint8, self.slot_bytes, _CONTROL + slot * self.slot_bytes)
        weakref.finalize(base, self._dropped, slot)
        out = RingBatch(_views(base, self.layout, rows))
        out._ring, out._slot, out._rows, out._tensors = self, slot, rows, tuple(out.values())
        return out


def _views(
    base: np.ndarray, layout: Sequence[tuple[str, int, Any, tuple[int, ...]]], rows: int
) -> dict[str, torch.Tensor]:
    """Tensors over ``base`` (a numpy view of one slot): ``rows`` rows of each key. Each tensor's
    storage keeps ``base`` alive (``torch.frombuffer`` holds the buffer's owner until the storage
    is freed), so ``base`` dies with the last tensor or view of the batch."""
    out = {}
    for key, offset, dtype, row_shape in layout:
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        shape = (rows, *row_shape)
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        if nbytes == 0:  # frombuffer refuses an empty buffer
            out[key] = torch.empty(shape, dtype=dtype)
        else:
            out[key] = torch.frombuffer(base[offset : offset + nbytes], dtype=dtype).view(shape)
    return out


class RingBatch(dict):
    """A worker's batch in a ring slot: a ``dict`` of tensors over the slot that pickles as a
    reference to the slot (the main process rebuilds a plain ``dict`` with :func:`_rebuild`).

    It is a ``dict`` so that code in the worker sees what the dataset yields elsewhere; the
    ``DataLoader``'s ``default_convert`` copies it with ``copy.copy``, which keeps the slot."""

    _ring: WorkerRing
    _slot: int
    _rows: int
    _tensors: tuple[torch.Tensor, ...]

    def __copy__(self) -> RingBatch:
        out = RingBatch(self)
        out.__dict__.update(self.__dict__)
        return out

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        ring = self._ring
        keys = [k for k, *_ in ring.layout]
        if (
            os.getpid() != ring.pid
            or list(self) != keys
            or any(self[k] is not t for k, t in zip(keys, self._tensors))
        ):
            return (dict, (dict(self),))  # changed in the worker: send its tensors as they are
        ring._sent[self._slot] = True
        stats["ring"] += 1
        layout = [(k, o, _dtype_name(d), s) for k, o, d, s in ring.layout]
        where = (ring.pid, ring.fd, ring.token, ring.size, ring.slot_bytes)
        return (_rebuild, (*where, self._slot, self._rows, layout))


# -- the main process ---------------------------------------------------------------------------
class _Arena:
    """A worker's arena mapped in this process (the map holds one descriptor of it)."""

    def __init__(self, mm: mmap.mmap, path: str, inode: int) -> None:
        self.mm, self.path, self.inode = mm, path, inode
        self.live = 0  # batches of this arena alive here

    def release(self, slot: int) -> None:
        self.mm[_FLAGS + slot] = 0
        with _lock:
            self.live -= 1
            if self.live == 0:
                _sweep()

    def alive(self) -> bool:
        try:
            return os.stat(self.path).st_ino == self.inode
        except OSError:
            return False


_arenas: dict[tuple[int, int, bytes], _Arena] = {}
# Reentrant: a garbage collection inside _attach may run a finalizer that releases a slot.
_lock = threading.RLock()


def _sweep() -> None:
    """Forget the arenas of workers that are gone and have no batch alive here (their memory
    is then unmapped). Run when a new arena arrives and when an arena's last batch is freed;
    an arena whose worker exits after its last batch was freed stays mapped until then."""
    for key, arena in list(_arenas.items()):
        if arena.live == 0 and not arena.alive():
            _arenas.pop(key, None)


def _attach(pid: int, fd: int, token: bytes, size: int) -> _Arena:
    key = (pid, fd, token)
    with _lock:
        arena = _arenas.get(key)
        if arena is not None:
            return arena
        _sweep()
        path = f"/proc/{pid}/fd/{fd}"
        try:
            f = os.open(path, os.O_RDWR)
        except OSError as e:
            raise RuntimeError(
                f"cannot open the shared-memory slots of DataLoader worker {pid} ({path}: {e}); "
                "pass worker_slots=0 to CaptureDataset to send batches through torch's shared "
                "memory instead"
            ) from e
        try:
            inode = os.fstat(f).st_ino
            mm = mmap.mmap(f, size)
        finally:
            os.close(f)
        if mm[:_TOKEN] != token:
            mm.close()
            raise RuntimeError(f"DataLoader worker {pid}: its shared-memory slots changed")
        arena = _arenas[key] = _Arena(mm, path, inode)
        stats["arenas"] += 1
        return arena


def _rebuild(
    pid: int,
    fd: int,
    token: bytes,
    size: int,
    slot_bytes: int,
    slot: int,
    rows: int,
    layout: list[tuple[str, int, str, tuple[int, ...]]],
) -> dict[str, torch.Tensor]:
    """The batch in ``slot`` of worker ``pid``'s arena, as a plain ``dict`` of tensors over it;
    the slot is released when the last of them (and of their views) is freed."""
    arena = _attach(pid, fd, token, size)
    base = np.frombuffer(arena.mm, np.uint8, slot_bytes, _CONTROL + slot * slot_bytes)
    with _lock:
        arena.live += 1
    weakref.finalize(base, arena.release, slot)
    stats["rebuilt"] += 1
    return _views(base, layout, rows)
