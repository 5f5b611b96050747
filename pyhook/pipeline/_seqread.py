"""Consecutive rows of a local capture read with ``preadv`` instead of page faults on the memory
maps: what :class:`~pyhook.dataset.CaptureDataset` does for a sequential batch
(``shuffle=False``) whose rows are not in the page cache.

Why: a cold sequential batch through the memory map costs page-table work for every 4 KiB page
(mapping, then copying), on top of the read itself; ``read`` copies from the page cache with
the kernel's read-ahead and no mapping. Measured in ``bench_read.py`` (c2), with the other core
busy, the mapped path took 1.3-1.6x the CPU time of a ``readinto`` of the same bytes. Warm
batches keep the mapped path (a ``memcpy`` from mapped pages beats a ``read`` from the page
cache). One file descriptor per shard stays open, so the kernel's read-ahead grows from batch
to batch as it does for one long ``read`` (with its default window: advising
``POSIX_FADV_SEQUENTIAL``, which doubles it, was slower on a quiet machine).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any

import torch

from .. import _backend
from .format import CaptureDamagedError

_PAGE = mmap.PAGESIZE
_libc: Any = None


def _mincore() -> Any:
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(None, use_errno=True)
            fn = lib.mincore
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            _libc = fn
        except (OSError, AttributeError):
            _libc = False
    return _libc


class _Span:
    """Rows ``[start, stop)`` of one layer in one shard file: byte ``offset`` holds row ``start``."""

    __slots__ = ("offset", "path", "row_bytes", "start", "stop", "view")

    def __init__(
        self, start: int, stop: int, path: str, offset: int, row_bytes: int, view: torch.Tensor
    ) -> None:
        self.start, self.stop, self.path = start, stop, path
        self.offset, self.row_bytes, self.view = offset, row_bytes, view


class SequentialReader:
    """``preadv`` reads of rows ``[start, stop)`` of several layers of a local capture.

    Built by :meth:`create` (``None`` when a layer is not plain mapped rows of local shard
    files). Not shared across processes: a forked copy opens its own descriptors.
    """

    def __init__(self, layers: dict[str, tuple[list[_Span], tuple[int, ...], torch.dtype]]) -> None:
        self._layers = layers
        self._fds: dict[str, int] = {}
        self._pid = os.getpid()

    @classmethod
    def create(cls, reader: Any, names: list[str]) -> SequentialReader | None:
        layers = {}
        for name in names:
            data = reader.layer(name)
            spans = []
            for i, src in enumerate(data._sources):
                # Remote shards (fetched into a cache) and in-memory parts keep the gather.
                if getattr(src, "fetch", 1) is not None or getattr(src, "header", None) is None:
                    return None
                view = src.tensor(name)
                info = src.header[name]
                if (
                    view.dtype != data.dtype
                    or tuple(view.shape[1:]) != tuple(data.row_shape)
                    or not view.is_contiguous()
                ):
                    return None  # rows stored in another form (an encoding): not raw bytes
                lo, hi = data._starts[i], data._starts[i + 1]
                row_bytes = view.element_size() * view[0].numel() if hi > lo else 0
                offset = src.data_start + int(info["data_offsets"][0])
                spans.append(_Span(lo, hi, src.path, offset, row_bytes, view))
            layers[name] = (spans, tuple(data.row_shape), data.dtype)
        return cls(layers)

    def resident(self, start: int, stop: int) -> bool:
        """Whether the first and the last row of ``[start, stop)`` of the first layer are in the
        page cache (two ``mincore`` calls; ``True`` when that cannot be told)."""
        fn = _mincore()
        if not fn or stop <= start:
            return True
        spans = next(iter(self._layers.values()))[0]
        vec = (ctypes.c_ubyte * 2)()
        for row in (start, stop - 1):
            for s in spans:
                if s.start <= row < s.stop and s.row_bytes:
                    addr = s.view.data_ptr() + (row - s.start) * s.row_bytes
                    first = addr // _PAGE * _PAGE
                    if fn(first, min(2 * _PAGE, addr + s.row_bytes - first), vec) != 0:
                        return True
                    if not vec[0] & 1:
                        return False
        return True

    def _fd(self, path: str) -> int:
        if self._pid != os.getpid():  # a forked copy: the parent's offsets and read-ahead
            self._fds, self._pid = {}, os.getpid()
        fd = self._fds.get(path)
        if fd is None:
            try:
                flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
                fd = os.open(path, flags)  # (never through a link: docs/integrity.md)
            except OSError as e:
                raise CaptureDamagedError(f"{path}: cannot be read: {e.strerror or e}", path) from e
            # No POSIX_FADV_SEQUENTIAL: doubling the read-ahead window made 16 cold 12.6 MB
            # batches 0.85-0.91x as fast as a plain readinto in quiet paired runs
            # (bench_read.py c2, 2026-11-27); the kernel's own window keeps up.
            self._fds[path] = fd
        return fd

    def read(self, start: int, stop: int) -> dict[str, torch.Tensor]:
        """Rows ``[start, stop)`` of every layer, as fresh tensors the caller owns."""
        out = {}
        for name, (spans, row_shape, dtype) in self._layers.items():
            t = _backend.empty_host((stop - start, *row_shape), dtype)
            if t.numel():
                buf = memoryview(t.view(-1).view(torch.uint8).numpy())
                at = 0
                for s in spans:
                    lo, hi = max(start, s.start), min(stop, s.stop)
                    if lo >= hi or not s.row_bytes:
                        continue
                    want = (hi - lo) * s.row_bytes
                    fd, pos = self._fd(s.path), s.offset + (lo - s.start) * s.row_bytes
                    done = 0
                    while done < want:
                        got = os.preadv(fd, [buf[at + done : at + want]], pos + done)
                        if got <= 0:
                            raise CaptureDamagedError(
                                f"{s.path}: ends before row {lo + done // s.row_bytes} of layer "
                                f"{name!r} (truncated or rewritten while being read); reopen "
                                "the capture (pyhook verify lists every problem)",
                                s.path,
                            )
                        done += got
                    at += want
            out[name] = t
        return out

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        if self._pid == os.getpid():
            for fd in fds.values():
                os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass
