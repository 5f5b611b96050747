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

``PYHOOK_DIRECT_IO``: unset or ``auto`` (the default): a shard of 1 MiB or more whose data lies
in memory the way direct I/O needs it (at least 90% of its bytes written straight from the
pieces' own memory: a capture's rows in the pool's buffers), when the file system takes
``O_DIRECT``; ``0``: never (buffered writes); ``1``: every shard, small and staged ones too, when
the file system takes it. A file system that refuses it (``EINVAL`` at the open or at a write:
tmpfs, some overlay file systems) gets buffered writes, for that shard and the later ones on the
same device.

Why the rule: a background writer that writes straight from the capture's buffers saves the
kernel's copy into the page cache and its write-back, which on a machine whose cores the forward
uses take their time from the forward (GPT-2 small, 2 cores, 7 paired rounds: 12 hooked blocks
1.074x the bare forward buffered, 1.037x direct; 48 modules 1.202x against 1.103x). A shard
whose bytes must be copied first (encoded, quantized or cast rows in torch's own allocations)
would go through the staging buffer one 4 MiB write and wait at a time, and in
``bench_compact.py`` such writes took longer than buffered ones: those stay buffered.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Iterable

BLOCK = 4096
#: With ``PYHOOK_DIRECT_IO=auto``, shards below this many bytes are written buffered.
MIN_BYTES = 1 << 20
#: The staging buffer's size (one per writing thread, reused).
STAGE_BYTES = 4 << 20
#: A piece is written from its own memory only when at least this much of it lines up;
#: shorter ones are copied (one write call instead of three).
_DIRECT_MIN = 64 << 10
#: With ``auto``, the share of a shard's bytes that must go from the pieces' own memory.
AUTO_SHARE = 0.9

ENV = "PYHOOK_DIRECT_IO"

#: Devices (``st_dev``) whose file system refused ``O_DIRECT``: buffered from then on.
_refused: set[int] = set()
_local = threading.local()

#: Bytes written by each path since the process started (tests and benchmarks read these).
counters = {"files": 0, "direct_bytes": 0, "staged_bytes": 0, "fallbacks": 0}


def mode() -> str:
    """``"auto"`` (unset: the default), ``"0"`` or ``"1"`` from ``PYHOOK_DIRECT_IO`` (anything else
    is an error)."""
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value not in ("auto", "0", "1"):
        raise ValueError(f"{ENV} must be 0, 1 or auto, got {os.environ.get(ENV)!r}")
    return value


def _lined_up(cur: int, n: int, address: int | None) -> tuple[int, int] | None:
    """``(head, body)`` of a piece of ``n`` bytes at ``address`` appended at file offset ``cur``:
    its first ``head`` bytes complete the current block and the next ``body`` bytes (whole
    blocks) go to the disk from the piece's own memory; ``None`` when it is to be copied."""
    if address is None or n < _DIRECT_MIN:
        return None
    head = -cur % BLOCK
    body = (n - head) - (n - head) % BLOCK
    if (address + head) % BLOCK or body < _DIRECT_MIN:
        return None
    return head, body


def direct_share(start: int, pieces: Iterable[tuple[int, int | None]]) -> float:
    """The share of the bytes of ``pieces`` (``(nbytes, address or None)``, appended from file
    offset ``start``) that :class:`DirectFile` would write from their own memory."""
    cur = start
    total = direct = 0
    for n, address in pieces:
        split = _lined_up(cur, n, address)
        if split is not None:
            direct += split[1]
        total += n
        cur += n
    return direct / total if total else 0.0


def wanted(
    path: str,
    nbytes: int,
    start: int = 0,
    pieces: Iterable[tuple[int, int | None]] | None = None,
) -> bool:
    """Whether a file of ``nbytes`` at ``path`` is to be written with ``O_DIRECT``: with
    ``auto``, ``pieces`` (``(nbytes, address)`` of the data appended from offset ``start``) must
    line up for at least :data:`AUTO_SHARE` of their bytes."""
    if not hasattr(os, "O_DIRECT"):
        return False
    m = mode()
    if m == "0" or (m == "auto" and nbytes < MIN_BYTES):
        return False
    if m == "auto" and (pieces is None or direct_share(start, pieces) < AUTO_SHARE):
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

    def __init__(self, path: str, *, follow: bool = False) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0)
        if not follow:  # a link in place of a store's file is never written through
            flags |= getattr(os, "O_NOFOLLOW", 0)
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
        split = _lined_up(self.pos + self.fill, n, address)
        if split is None:
            self._copy(data)
            return
        head, body = split
        self._copy(data[:head])
        self._flush()  # the staging buffer now ends at a block boundary: empty
        self._pwrite(data[head : head + body], self.pos)
        counters["direct_bytes"] += body
        self.pos += body
        self._copy(data[head + body :])

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
