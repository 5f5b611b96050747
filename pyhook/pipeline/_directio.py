"""Shard files written with ``O_DIRECT``: the bytes go from the capture's buffers to the disk
without passing through the page cache.

The kernel's buffered write path copies every byte into the page cache and writes it back
later: on the 2-core test VM 151 MB of shards cost 52 ms of system time buffered against 12 ms
direct (more under memory pressure). Direct I/O needs the buffer address, the file offset and
the length to be multiples of the block size (4096 here). The writer (:class:`DirectFile`) writes a piece straight from its
memory when it lines up (the pool's buffers are 2 MiB-aligned and the data region of a shard of
1 MiB or more starts at a page boundary), and copies the rest through one reused page-aligned
staging buffer (a user-space ``memcpy``, far cheaper than the kernel's path). The last partial
block is written padded with zeros and the file then truncated to its exact size, so the file's
bytes are exactly those a buffered write gives.

``PYHOOK_DIRECT_IO``: unset or ``0`` (default): never (buffered writes); ``auto``: shards of
1 MiB or more, when the file system takes ``O_DIRECT``; ``1``: every shard, small ones too, when
the file system takes it. A file system that refuses it (``EINVAL`` at the open or at a write:
tmpfs, some overlay file systems) gets buffered writes, for that shard and the later ones on the
same device. Not the default: each direct write waits for the disk, and in ``bench_compact.py``
the writes of small and encoded stores (staged, 4 MiB a wait) took longer than buffered ones,
while a GPT-2-small capture's wall time did not resolve the CPU saved.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading

BLOCK = 4096
#: With ``PYHOOK_DIRECT_IO=auto``, shards below this many bytes are written buffered.
MIN_BYTES = 1 << 20
#: The staging buffer's size (one per writing thread, reused).
STAGE_BYTES = 4 << 20
#: A piece is written from its own memory only when at least this much of it lines up;
#: shorter ones are copied (one write call instead of three).
_DIRECT_MIN = 64 << 10

ENV = "PYHOOK_DIRECT_IO"

#: Devices (``st_dev``) whose file system refused ``O_DIRECT``: buffered from then on.
_refused: set[int] = set()
_local = threading.local()

#: Bytes written by each path since the process started (tests and benchmarks read these).
counters = {"files": 0, "direct_bytes": 0, "staged_bytes": 0, "fallbacks": 0}


def mode() -> str:
    """``"0"`` (unset: the default), ``"auto"`` or ``"1"`` from ``PYHOOK_DIRECT_IO`` (anything else
    is an error)."""
    value = os.environ.get(ENV, "").strip().lower() or "0"
    if value not in ("auto", "0", "1"):
        raise ValueError(f"{ENV} must be 0, 1 or auto, got {os.environ.get(ENV)!r}")
    return value


def wanted(path: str, nbytes: int) -> bool:
    """Whether a file of ``nbytes`` at ``path`` is to be written with ``O_DIRECT``."""
    if not hasattr(os, "O_DIRECT"):
        return False
    m = mode()
    if m == "0" or (m == "auto" and nbytes < MIN_BYTES):
        return False
    try:
        dev = os.stat(os.path.dirname(os.path.abspath(path))).st_dev
    except OSError:
        return False
    return dev not in _refused


def refused(path: str) -> None:
    """Remember that ``path``'s file system refused ``O_DIRECT``."""
    counters["fallbacks"] += 1
    try:
        _refused.add(os.stat(os.path.dirname(os.path.abspath(path))).st_dev)
    except OSError:
        pass


def _stage() -> memoryview:
    mv = getattr(_local, "stage", None)
    if mv is None:
        mv = _local.stage = memoryview(mmap.mmap(-1, STAGE_BYTES))  # page-aligned
    return mv


class Refused(OSError):
    """The file system refused ``O_DIRECT`` (``EINVAL``); the caller writes buffered instead."""


def _is_refusal(e: OSError) -> bool:
    return e.errno == errno.EINVAL


class DirectFile:
    """A file opened with ``O_DIRECT`` and written sequentially from memoryviews.

    ``write(data, address)`` appends ``data`` (``address`` is where its bytes lie in memory, or
    ``None`` when not known: then it is copied); ``finish()`` writes the tail and truncates the
    file to the bytes written (then ``fileno()`` can be fsynced); ``close()`` closes it. Raises
    :class:`Refused` when the file system refuses direct I/O.
    """

    def __init__(self, path: str) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0)
        try:
            self.fd = os.open(path, flags, 0o666)
        except OSError as e:
            if _is_refusal(e):
                raise Refused(e.errno, e.strerror, path) from e
            raise
        self.path = path
        self.stage = _stage()
        self.fill = 0  # bytes in the staging buffer
        self.pos = 0  # file offset of the staging buffer's first byte (block-aligned)
        self.size = 0  # bytes appended so far

    def fileno(self) -> int:
        return self.fd

    def _pwrite(self, data: memoryview, offset: int) -> None:
        done, n = 0, len(data)
        while done < n:
            try:
                k = os.pwrite(self.fd, data[done:], offset + done)
            except OSError as e:
                if _is_refusal(e):
                    raise Refused(e.errno, e.strerror, self.path) from e
                raise
            if k <= 0:  # pragma: no cover - a regular file never writes 0 bytes
                raise OSError(errno.EIO, "short write", self.path)
            done += k

    def _flush(self) -> None:
        """Write the staging buffer's whole blocks; keep the partial one at its front."""
        whole = self.fill - self.fill % BLOCK
        if whole:
            self._pwrite(self.stage[:whole], self.pos)
            counters["staged_bytes"] += whole
            rest = self.fill - whole
            if rest:
                self.stage[:rest] = self.stage[whole : self.fill]
            self.pos += whole
            self.fill = rest

    def _copy(self, data: memoryview) -> None:
        stage, cap = self.stage, len(self.stage)
        at = 0
        while at < len(data):
            k = min(cap - self.fill, len(data) - at)
            stage[self.fill : self.fill + k] = data[at : at + k]
            self.fill += k
            at += k
            if self.fill == cap:
                self._flush()

    def write(self, data: memoryview, address: int | None) -> None:
        n = len(data)
        if not n:
            return
        self.size += n
        if address is not None and n >= _DIRECT_MIN:
            cur = self.pos + self.fill
            head = -cur % BLOCK  # bytes that complete the current block
            body = (n - head) - (n - head) % BLOCK
            if (address + head) % BLOCK == 0 and body >= _DIRECT_MIN:
                self._copy(data[:head])
                self._flush()  # the staging buffer now ends at a block boundary: empty
                self._pwrite(data[head : head + body], self.pos)
                counters["direct_bytes"] += body
                self.pos += body
                self._copy(data[head + body :])
                return
        self._copy(data)

    def finish(self) -> None:
        """Write the last partial block (padded with zeros) and truncate to the exact size."""
        self._flush()
        if self.fill:
            pad = -self.fill % BLOCK
            self.stage[self.fill : self.fill + pad] = bytes(pad)
            self._pwrite(self.stage[: self.fill + pad], self.pos)
            counters["staged_bytes"] += self.fill
            os.ftruncate(self.fd, self.size)
            self.pos += self.fill
            self.fill = 0
        counters["files"] += 1

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)
