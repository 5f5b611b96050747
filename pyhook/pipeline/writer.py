"""The crash-safe writer: :class:`ShardWriter` streams batches into shards from a background
thread, lists each completed shard in its rank's index file, and resumes an interrupted capture.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import stat
import tempfile
import threading
import time
from typing import Any

import torch

from .._version import __version__
from .encoding import ENCODED_FORMAT_VERSION
from .format import (
    _DTYPE_TO_ST,
    _NOFOLLOW,
    _SHARD_NAME,
    _STORABLE,
    FORMAT_VERSION,
    CaptureDamagedError,
    CaptureExistsError,
    CaptureWriteError,
    _atomic_write_json,
    _directory_arg,
    _fault,
    _fsync_dir,
    _glob,
    _is_int,
    _journal_path,
    _load_json,
    _load_part,
    _open_new,
    _part_path,
    _refuse_link,
    _settings_diff,
    _with_checksum,
    _write_file,
    check_merged,
    dtype_name,
    index_files,
    journal_line,
    json_depth_error,
    merged_index,
    name_number,
    refuse_links,
)
from .transport import Remote, Uploader, is_url
from .verify import _check_shard


def _model_name(name: Any) -> Any:
    """The model class an index's ``meta.model`` names, without a wrapper's class: FSDP2's
    ``fully_shard`` gives a module the class ``FSDP<its class>`` (transformers does it under
    ``tp_size`` with data-parallel replicas), the same model as ``<its class>`` unwrapped."""
    if isinstance(name, str) and name.startswith("FSDP") and len(name) > 4:
        return name[4:]
    return name


def _json_arg(name: str, value: Any) -> Any:
    """``value`` through JSON (tuples become lists), or a TypeError naming the argument: the
    index stores it, and a failure there would come after shards were written."""
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a dict, got {type(value).__name__}: {value!r}")
    try:
        value = json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError, RecursionError) as e:
        raise TypeError(
            f"{name} must hold only JSON values (str, int, float, bool, None, lists, dicts with "
            f"str keys): {e}"
        ) from None
    why = json_depth_error(value)
    if why is not None:  # no reader would read the index (format.MAX_JSON_DEPTH)
        raise TypeError(f"{name} is {why}: the store's index could not be read back")
    return value


def _errno_of(err: BaseException) -> tuple[int, ...]:
    """``(errno,)`` for an error that has one, else ``()``: ``OSError(0, msg)`` would print
    "[Errno 0]" in front of a network error's message."""
    code = getattr(err, "errno", None)
    return (code,) if isinstance(code, int) and code else ()


def _open_journal(path: str, flags: int, *, create: bool = True) -> int:
    """The journal, the one file of the store written in place (appended, its torn tail cut),
    opened without following a link, and refused when it is a hard link too: either would
    make the writer change a file outside the store. FileNotFoundError passes through."""
    flags |= _NOFOLLOW | getattr(os, "O_CLOEXEC", 0) | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o644)
    except FileNotFoundError:
        raise
    except OSError as e:
        _refuse_link(path, e)
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        os.close(fd)
        what = "has other hard links" if stat.S_ISREG(st.st_mode) else "is not a regular file"
        raise CaptureDamagedError(
            f"{path}: {what}; pyhook writes the journal in place and will not change a file "
            "outside the capture directory: remove it, or copy the file in its place",
            path,
        )
    return fd


def shard_limit(shard_bytes: int, max_buffer_bytes: int) -> int:
    """The most bytes of rows a shard gets (a batch is never split, so one batch may exceed
    it): ``shard_bytes``, but at most half the writer's buffer (a shard fills while the one
    before it is written). What :class:`ShardWriter` does and a job's plan counts."""
    return max(1, min(shard_bytes, max_buffer_bytes // 2))


class ShardWriter:
    """Streams rows of several layers into safetensors shards from a background thread.

    Example::

        >>> import torch, tempfile
        >>> from pyhook.store import ShardWriter, open_capture
        >>> out = tempfile.mkdtemp()
        >>> with ShardWriter(out, settings={"layers": ["a"]}) as w:
        ...     w.add({"a": torch.arange(6.).reshape(3, 2)}, examples=3)
        ...     w.add({"a": torch.ones(1, 2)}, examples=1)
        >>> open_capture(out)["a"].to_tensor().shape
        torch.Size([4, 2])

    ``add`` takes one batch: a dict layer -> host tensor whose dim 0 are rows (every layer of a
    batch may have its own row count) and the number of ``examples`` the batch covers (what a
    resumed capture skips). Batches are packed into shards of about ``shard_bytes`` (at most
    half of ``max_buffer_bytes``); a batch is never split across shards, so a shard always
    covers whole examples. ``max_buffer_bytes`` (default 256 MiB) bounds the host memory the
    writer holds: the rows buffered, waiting for the disk and being written; ``add`` waits for
    the disk beyond it (raise it for speed on a fast disk). ``max_pending`` bounds
    the number of shards waiting for the disk (back-pressure). ``on_release(batch)`` is called
    once a batch has been written (used to give pooled buffers back), after the writer dropped
    every reference of its own to the batch's rows: the dict it is given holds the last ones
    the writer knows of, so a callback that clears it frees them before it returns.

    ``write_inline=True`` moves the CPU work of writing a shard (the copy into the page cache and
    its checksum) onto the thread that calls :meth:`flush` (or fills a shard with :meth:`add`):
    what a capture whose forward runs on every core wants, since a background thread that takes
    a core stalls the forward's thread team for longer than the write itself takes. The
    background thread still fsyncs, renames and lists each shard, so a crash at any point leaves
    the same states as the default.

    ``thread_cpu_seconds`` is the writer thread's CPU time (user + system) once it ended.

    ``settings`` is a JSON-able dict describing the capture; reopening a directory whose stored
    settings equal these resumes it, otherwise :class:`CaptureExistsError` is raised (unless
    ``overwrite=True``, which deletes the previous capture's files).
    """

    def __init__(
        self,
        out: str | os.PathLike[str],
        *,
        settings: dict[str, Any] | None = None,
        meta: dict[str, Any] | None = None,
        shard_bytes: int = 256 << 20,
        max_pending: int = 2,
        max_buffer_bytes: int = 256 << 20,
        rank: int = 0,
        world_size: int = 1,
        overwrite: bool = False,
        fsync: bool = True,
        on_release: Any = None,
        encoding: Any = None,
        write_inline: bool = False,
    ) -> None:
        if not isinstance(shard_bytes, int) or shard_bytes <= 0:
            raise ValueError(f"shard_bytes must be a positive int, got {shard_bytes!r}")
        if not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be an int >= 1, got {max_pending!r}")
        if not _is_int(max_buffer_bytes) or max_buffer_bytes < 1:
            raise ValueError(f"max_buffer_bytes must be an int >= 1, got {max_buffer_bytes!r}")
        if not _is_int(world_size) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not _is_int(rank) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
        if not isinstance(overwrite, bool):
            raise TypeError(
                f"overwrite must be a bool (True replaces the previous capture), got "
                f"{type(overwrite).__name__}: {overwrite!r}"
            )
        # Compact stores (pipeline/encoding.py): quantised / compressed layers, or None.
        self.encoding = encoding if encoding else None
        self.settings = _json_arg("settings", settings or {})  # normalise (tuples -> lists)
        self.meta = _json_arg("meta", dict(meta or {}))
        self.url: str | None = None
        self._remote: Remote | None = None
        self._uploader: Uploader | None = None
        self._listing: dict[str, int] = {}
        if is_url(out):
            # Object storage: the writer works in a local staging directory; each completed
            # shard is uploaded by a background thread, then deleted locally.
            self.url = str(out).rstrip("/")
            self._remote = Remote(self.url)
            self._remote.check_bucket()
            out = tempfile.mkdtemp(prefix="pyhook-stage-")
        self.out = _directory_arg("out", out)
        self.shard_bytes = shard_bytes
        self.max_buffer_bytes = max_buffer_bytes
        # A shard fills while the one before it is written: each at most half the budget.
        self._shard_limit = shard_limit(shard_bytes, max_buffer_bytes)
        self._pending_bytes = 0  # handed to the writer thread, not yet written
        self._room = threading.Condition()
        self.peak_buffer_bytes = 0  # the most bytes of rows the writer held at once
        self.rank = rank
        self.world_size = world_size
        self.fsync = fsync
        self.on_release = on_release
        # write_inline: the caller's thread writes each shard's bytes when it flushes (and gives
        # the rows back at once); the background thread only makes them durable and lists them
        # (fsync, rename, index), which waits for the disk but takes no CPU from the caller.
        self.write_inline = bool(write_inline)
        self._part = _part_path(self.out, rank)
        self._journal = _journal_path(self._part)
        self._journal_fd: int | None = None
        try:
            if self._remote is not None:
                self._listing = self._remote.listing()
                if not overwrite:  # overwrite: this rank's files go, the others' are not read
                    # This rank's complete index (to resume); of the other ranks only their
                    # index files, to compare settings: never their journals, which they
                    # compact and remove when they close, whenever that is.
                    self._remote.pull_indexes(self.out, self._listing, own=self.rank)
            self._open_dir(overwrite)
            if self._remote is not None:
                self._open_remote(overwrite)
        except BaseException:
            self._drop_staging()
            raise
        # State that the writer thread owns after start; the main thread only reads it.
        self._buffer: list[tuple[dict[str, torch.Tensor], int, Any, bool]] = []
        self._buffer_bytes = 0
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._closed = False
        self.bytes_written = 0
        self.write_seconds = 0.0
        self.thread_cpu_seconds = 0.0  # set when the writer thread ends
        self._thread = threading.Thread(
            target=self._run, name=f"pyhook-writer-r{rank}", daemon=True
        )
        self._thread.start()

    # -- opening, resuming -----------------------------------------------------------------
    def _open_dir(self, overwrite: bool) -> None:
        try:
            os.makedirs(self.out, exist_ok=True)
            # Never follow a link in the store: a received store's journal or lock file linked
            # elsewhere would have that file truncated and written (docs/integrity.md).
            refuse_links(self.out)
            probe = os.path.join(self.out, f".pyhook-probe-{os.getpid()}-{self.rank}")
            with contextlib.suppress(FileNotFoundError):
                os.remove(probe)
            os.close(_open_new(probe, os.O_EXCL))
            os.remove(probe)
        except CaptureDamagedError as e:
            raise CaptureDamagedError(
                f"cannot write the capture in {self.out!r}: {e}", e.path
            ) from None
        except OSError as e:
            raise CaptureWriteError(
                e.errno, f"cannot write to the capture directory {self.out!r}: {e.strerror or e}"
            ) from e
        self._lock_fd = self._take_lock()
        try:
            self._open_locked(overwrite)
        except BaseException:
            self._drop_lock()
            raise

    def _take_lock(self) -> int | None:
        """One writer per rank and directory: a second one (a nested capture, another process)
        would overwrite the first one's shards and index."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX: no lock
            return None
        path = os.path.join(self.out, f".lock-r{self.rank:03d}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            _refuse_link(path, e)
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise CaptureExistsError(
                f"{self.out!r} is being written (rank {self.rank}) by another capture that is "
                "still open; close it first, or use another output directory"
            ) from None
        return fd

    def _drop_lock(self) -> None:
        fd, self._lock_fd = getattr(self, "_lock_fd", None), None
        if fd is not None:
            os.close(fd)  # releases the flock

    def _open_locked(self, overwrite: bool) -> None:
        own = f"r{self.rank:03d}"
        merged = os.path.join(self.out, "index.json")
        self._check_foreign_index(merged)
        index_files(self.out)  # a second index claiming a rank: refused before anything changes
        doomed: list[str] = []
        if overwrite:
            # Each rank deletes only its own files (another rank may already be writing its
            # new ones); rank 0 also the merged index and the files of ranks beyond this
            # world (a previous run with more processes).
            doomed += [f"shard-{own}-*.safetensors*", f"index-{own}.json*", f"index-{own}.journal"]
            if self.rank == 0:
                doomed.append("index.json*")
                for p in _glob(self.out, "index-r*.j*") + _glob(self.out, "shard-r*.safetensors*"):
                    m = re.match(r"(?:index|shard)-r(\d+)", os.path.basename(p))
                    if m and name_number(m.group(1)) >= self.world_size:
                        doomed.append(os.path.basename(p))
        # Debris of a crash in the middle of a shard or index write: never listed, removable.
        doomed += [f"shard-{own}-*.tmp*", f"index-{own}.json.tmp*"]
        if self.rank == 0:
            doomed.append("index.json.tmp*")
        for pattern in doomed:
            for p in _glob(self.out, pattern):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(p)
        # The settings to compare with: this rank's index, another rank's, else the merged one
        # (the per-rank files are the source of truth; a damaged merged index is rewritten).
        # (With overwrite this rank's files are gone; the others' are not compared.)
        part = _load_part(self._part) if os.path.exists(self._part) else None
        existing: dict[str, Any] | None = part
        if existing is None and not overwrite:
            for p in index_files(self.out):
                existing = _load_part(p)
                break
        if existing is None and not overwrite and os.path.exists(merged):
            with contextlib.suppress(CaptureDamagedError):
                obj = _load_json(merged)
                check_merged(merged, obj)  # the fields compared below, with their types
                existing = obj
        if (
            existing is not None
            and not existing.get("shards")
            and not existing.get("examples")
            and not _glob(self.out, "shard-r*.safetensors")
        ):
            existing = None  # an index of a capture that stored nothing: nothing to protect
        if existing is not None and not overwrite:
            diff = _settings_diff(existing.get("settings", {}), self.settings)
            old_world = existing.get("world_size", 1)
            if old_world != self.world_size:
                diff.append(f"world_size: {old_world} (stored) != {self.world_size} (now)")
            # Another model whose layers happen to have the same names and widths would add
            # its rows to this one's silently.
            old_model = (existing.get("meta") or {}).get("model")
            new_model = self.meta.get("model")
            if (
                old_model is not None
                and new_model is not None
                and _model_name(old_model) != _model_name(new_model)
            ):
                diff.append(f"model: {old_model!r} (stored) != {new_model!r} (now)")
            if diff:
                raise CaptureExistsError(
                    f"{self.out!r} already holds a different capture; differences: "
                    + "; ".join(diff)
                    + ". Use another output directory, or overwrite=True (--overwrite) to replace it."
                )
        self.shards: list[dict[str, Any]] = []
        self.layers: dict[str, dict[str, Any]] = {}
        if part is not None and not overwrite:
            # A resume builds on every listed shard: each must be there, complete and
            # unchanged (size, header and checksum as recorded). Never recount from the
            # survivors: the caller's data position (examples_done) would shift.
            for s in part["shards"]:
                try:
                    self._check_listed(s, part["layers"])
                except CaptureDamagedError as e:
                    raise CaptureDamagedError(
                        f"cannot resume the capture in {self.out!r}: {e}. Restore the file, or "
                        "start again with overwrite=True (--overwrite)",
                        e.path,
                    ) from None
            self.shards = list(part["shards"])
            self.layers = part["layers"]
        listed = {s["file"] for s in self.shards}
        for p in _glob(self.out, f"shard-r{self.rank:03d}-*.safetensors"):
            name = os.path.basename(p)  # (a copy, "shard-r000-000000 (1).safetensors": kept)
            if name not in listed and _SHARD_NAME.match(name):  # renamed, not yet indexed
                os.remove(p)
        self._next_index = 1 + max(
            (int(s["file"].split("-")[-1].split(".")[0]) for s in self.shards), default=-1
        )
        self.examples_done = sum(s["examples"] for s in self.shards)
        self._part_on_disk = part is not None and not overwrite
        self._journal_layers = json.loads(json.dumps(self.layers))
        self._examples_written = self.examples_done  # the writer thread's position
        self.resumed = bool(self.shards)
        self._trim_journal()

    def _check_listed(self, entry: dict[str, Any], layers: dict[str, Any]) -> None:
        """A shard the index lists, checked before a resume builds on it: the whole file
        (size, header, checksum); on object storage its size in the bucket (its checksum is
        checked whenever it is read)."""
        if self._remote is None:
            _check_shard(self.out, entry, layers, checksum=True)
            return
        url = self._remote.url_of(entry["file"])
        size = self._listing.get(entry["file"])
        if size is None:
            raise CaptureDamagedError(f"{url}: missing (listed in the index)", url)
        if size != entry.get("bytes"):
            raise CaptureDamagedError(
                f"{url}: size {size} bytes, the index records {entry.get('bytes')} (truncated "
                "or replaced)",
                url,
            )

    def _open_remote(self, overwrite: bool) -> None:
        """Make the bucket match the opened state: remove this rank's previous capture
        (``overwrite``) or its unlisted shards (debris), then start the uploader."""
        assert self._remote is not None
        own = f"r{self.rank:03d}"
        listed = {s["file"] for s in self.shards}
        doomed = []
        for name in self._listing:
            m = re.match(r"(?:index|shard)-r(\d+)", name)
            mine = name.startswith((f"shard-{own}-", f"index-{own}."))
            if overwrite and (
                mine
                or (self.rank == 0 and name == "index.json")
                or (self.rank == 0 and m is not None and name_number(m.group(1)) >= self.world_size)
            ):
                doomed.append(name)
            elif (
                name.startswith(f"shard-{own}-") and name not in listed and _SHARD_NAME.match(name)
            ):
                doomed.append(name)  # uploaded, never listed (killed in between)
        self._remote.rm(sorted(doomed))
        self._uploader = Uploader(self._remote, self.rank)

    def _drop_staging(self) -> None:
        if self._remote is not None:
            if self._uploader is not None:
                self._uploader.stop()
            shutil.rmtree(self.out, ignore_errors=True)

    def _check_foreign_index(self, merged: str) -> None:
        """Refuse (even with ``overwrite``) to replace an ``index.json`` that pyhook did not write."""
        if not os.path.exists(merged):
            return
        try:
            obj = _load_json(merged)
        except CaptureDamagedError as e:
            if _glob(self.out, "index-r*.json"):
                return  # our own merged index, damaged: the per-rank files rebuild it on close
            raise CaptureExistsError(
                f"{merged!r} is not a pyhook capture index ({e}); pyhook will not overwrite it. "
                "Choose another output directory, or move the file away."
            ) from None
        if not isinstance(obj, dict) or obj.get("format") != "pyhook-capture":
            what = (
                "has no 'format': 'pyhook-capture'"
                if isinstance(obj, dict)
                else (f"is a JSON {type(obj).__name__}")
            )
            raise CaptureExistsError(
                f"{merged!r} is not a pyhook capture index (it {what}); pyhook will not "
                "overwrite it. Choose another output directory, or move the file away."
            )

    # -- feeding ---------------------------------------------------------------------------
    def _check_error(self) -> None:
        if self._error is not None:
            err = self._error
            raise CaptureWriteError(
                *_errno_of(err),
                f"writing the capture to {self.url or self.out!r} failed: {err}. Shards written "
                "before the failure are intact and indexed; fix the cause and run again to resume.",
            ) from err

    def add(
        self,
        batch: dict[str, torch.Tensor],
        examples: int,
        *,
        wait: Any = None,
        skipped: bool = False,
    ) -> None:
        """Queue one batch (layer -> rows); blocks only when ``max_pending`` shards are waiting.

        ``wait``, if given, is called on the writer thread before the batch is read (e.g. to
        wait for the asynchronous device-to-host copies that fill its tensors). ``skipped=True``
        records ``examples`` that have no rows (a batch whose forward failed and was skipped):
        they count toward :attr:`examples_done`, and the index lists their range under
        ``"skipped"``.
        """
        if self._closed:
            raise RuntimeError("ShardWriter is closed")
        self._check_error()
        new: dict[str, dict[str, Any]] = {}  # checked for every layer first: all or nothing
        for name, t in batch.items():
            if t.dtype not in _DTYPE_TO_ST:
                raise ValueError(
                    f"layer {name!r}: rows of dtype {dtype_name(t.dtype)} cannot be stored in "
                    f"safetensors shards; supported: {_STORABLE} "
                    "(pass dtype= to cast when capturing)"
                )
            info = {"dtype": dtype_name(t.dtype), "row_shape": list(t.shape[1:])}
            if self.encoding is not None:
                info = self.encoding.layer_info(name, t.dtype, info)
            known = self.layers.get(name)
            if known is None:
                new[name] = info
                if self.encoding is not None:
                    new.update(self.encoding.reserved(info))
            elif known != info:
                old, now = known.get("encoding"), info.get("encoding")
                if old != now and {**known, "encoding": None} == {**info, "encoding": None}:
                    raise ValueError(
                        f"layer {name!r}: the capture stores its rows with encoding "
                        f"{old or 'none (plain rows)'}, this writer's is {now or 'none'}; "
                        "write them with the same encoding (quantize=, compress=), or to "
                        "another directory"
                    )
                raise ValueError(
                    f"layer {name!r}: rows of shape {info['row_shape']} {info['dtype']} do not match "
                    f"the earlier {known['row_shape']} {known['dtype']}; rows of one layer must share "
                    "their shape (flatten tokens, or pad to a fixed max_length)"
                )
        if skipped and batch:
            raise ValueError("a skipped batch has no rows: pass batch={}")
        self.layers.update(new)
        nbytes = sum(t.numel() * t.element_size() for t in batch.values())
        self._wait_for_room(nbytes)
        self._buffer.append((batch, int(examples), wait, skipped))
        self._buffer_bytes += nbytes
        with self._room:
            held = self._pending_bytes + self._buffer_bytes
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, held)
        if self._buffer_bytes >= self._shard_limit:
            self.flush()

    def _wait_for_room(self, nbytes: int) -> None:
        """Block while the rows held (buffered + waiting for the disk + being written) would
        exceed ``max_buffer_bytes`` and the disk still has some to write (host memory stays
        bounded whatever the capture's size; a single larger batch is still taken)."""
        with self._room:
            while (
                self._pending_bytes
                and self._pending_bytes + self._buffer_bytes + nbytes > self.max_buffer_bytes
            ):
                self._check_error()
                self._room.wait(0.1)

    def flush(self) -> None:
        """Hand the buffered batches to the writer thread as one shard (no-op when empty)."""
        if not self._buffer:
            return
        batches, nbytes = self._buffer, self._buffer_bytes
        self._buffer, self._buffer_bytes = [], 0
        index = self._next_index
        self._next_index += 1
        item: tuple[int, Any, int, Any]
        if self.write_inline:
            self._check_error()
            written = None
            try:
                written = self._write_data(index, batches, durable=False)
            except Exception as e:  # reported as the writer thread's errors are
                self._error = e
            except BaseException as e:  # Ctrl-C: stop writing, and say so
                self._error = e
                raise
            finally:
                dicts = [batch for batch, *_ in batches]
                del batches  # (the tuples' `wait` closures hold the rows too)
                self._release_all(dicts)  # the bytes are in the file (or it failed)
            self._check_error()
            item = (index, [], 0, written)
        else:
            with self._room:
                self._pending_bytes += nbytes
            item = (index, batches, nbytes, None)
        while True:  # bounded queue: wait for the disk, but notice a dead writer
            self._check_error()
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _release_all(self, dicts: list[dict[str, torch.Tensor]]) -> None:
        """Hand each written batch to ``on_release``, its dict emptied of the writer's hold:
        by then the caller has dropped every other reference the writer had (the shard's
        tuples, whose ``wait`` closures hold the rows too), so the bytes the callback counts
        as released are free once it lets go of them, not when this thread next runs."""
        while dicts:
            batch = dicts.pop(0)
            if self.on_release is not None:
                with contextlib.suppress(Exception):
                    self.on_release(batch)
            del batch

    # -- the writer thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self.thread_cpu_seconds = time.thread_time()  # the writer thread's CPU, user + sys

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None:
                    if item[3] is not None:  # written by the caller (write_inline)
                        self._publish(item[3], synced=False)
                    else:
                        self._write_shard(item[0], item[1])
            except BaseException as e:  # reported to the main thread on its next call
                self._error = e
            finally:
                if item is not None:
                    # Drop the written shard's rows now, not when the next shard arrives: their
                    # pooled buffers go back to the pool for the batches being captured
                    # meanwhile, before the producer is told the bytes are free (a writer
                    # preempted between the two would otherwise let a shard's worth of rows
                    # stay allocated beyond the budget).
                    dicts = [batch for batch, *_ in item[1]]
                    nbytes = item[2]
                    item = None
                    self._release_all(dicts)
                    with self._room:
                        self._pending_bytes -= nbytes
                        self._room.notify_all()
                self._queue.task_done()

    def _write_shard(
        self, index: int, batches: list[tuple[dict[str, torch.Tensor], int, Any, bool]]
    ) -> None:
        self._publish(self._write_data(index, batches, durable=self.fsync), synced=True)

    def _write_data(
        self,
        index: int,
        batches: list[tuple[dict[str, torch.Tensor], int, Any, bool]],
        *,
        durable: bool,
    ) -> dict[str, Any]:
        """Write the shard's temporary file (fsynced when ``durable``); what
        :meth:`_publish` needs to rename and list it. Shards are written in index order."""
        for _, _, wait, _ in batches:
            if wait is not None:
                wait()
        t0 = time.perf_counter()
        name = f"shard-r{self.rank:03d}-{index:06d}.safetensors"
        path = os.path.join(self.out, name)
        tmp = f"{path}.tmp"
        pieces: dict[str, list[torch.Tensor]] = {}
        first = self._examples_written
        skipped: list[list[int]] = []
        at = first
        for batch, n, _, skip in batches:
            for layer, t in batch.items():
                pieces.setdefault(layer, []).append(t)
            if skip and n:
                if skipped and skipped[-1][1] == at:
                    skipped[-1][1] = at + n
                else:
                    skipped.append([at, at + n])
            at += n
        rows = {layer: sum(int(p.shape[0]) for p in ps) for layer, ps in pieces.items()}
        if self.encoding is not None:  # after the statistics (taken in `wait`) saw the rows
            pieces, rows = self.encoding.encode(pieces, rows, self.layers)
        examples = at - first
        meta = {"format": "pyhook", "rank": str(self.rank), "shard": name}
        meta["first_example"] = str(first)
        try:
            nbytes, checksum = _write_file(tmp, pieces, meta, fsync=durable)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        self._examples_written = at  # the next shard starts here
        return {
            "name": name,
            "path": path,
            "tmp": tmp,
            "first": first,
            "rows": rows,
            "examples": examples,
            "skipped": skipped,
            "nbytes": nbytes,
            "checksum": checksum,
            "seconds": time.perf_counter() - t0,
        }

    def _publish(self, w: dict[str, Any], *, synced: bool) -> None:
        """Make a written shard durable (unless ``synced``), rename it to its final name and
        list it in the index: only a complete, fsynced shard is ever listed."""
        t0 = time.perf_counter()
        name, path, tmp = w["name"], w["path"], w["tmp"]
        nbytes, checksum, first = w["nbytes"], w["checksum"], w["first"]
        rows, examples, skipped = w["rows"], w["examples"], w["skipped"]
        try:
            if not synced and self.fsync:
                fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        _fault("shard.renamed")
        if self.fsync:
            _fsync_dir(self.out)
        _fault("shard.dir-synced")
        entry: dict[str, Any] = {
            "file": name,
            "rank": self.rank,
            "first_example": first,
            "examples": examples,
            "rows": rows,
            "bytes": nbytes,
            "checksum": checksum,
        }
        if skipped:
            entry["skipped"] = skipped
        self.shards.append(entry)
        line = None
        if self._part_on_disk:
            # O(1) in the number of shards: one line appended to the journal, not a new index
            changed = self.layers != self._journal_layers
            line = journal_line(entry, dict(self.layers) if changed else None)
            self._append_journal(line)
            if changed:
                self._journal_layers = json.loads(json.dumps(self.layers))
        else:
            self._write_part()
        if self._uploader is not None:
            self._uploader.shard_done(self.out, name, line, self._part)
        self.bytes_written += nbytes
        self.write_seconds += w["seconds"] + time.perf_counter() - t0

    def _part_dict(self) -> dict[str, Any]:
        return {
            "format": "pyhook-capture",
            "format_version": FORMAT_VERSION if self.encoding is None else ENCODED_FORMAT_VERSION,
            "pyhook_version": __version__,
            "torch_version": torch.__version__,
            "rank": self.rank,
            "world_size": self.world_size,
            "settings": self.settings,
            "meta": self.meta,
            "layers": self.layers,
            "shards": self.shards,
        }

    def _write_part(self) -> None:
        _atomic_write_json(self._part, _with_checksum(self._part_dict()))
        self._part_on_disk = True
        self._journal_layers = json.loads(json.dumps(self.layers))

    def _append_journal(self, line: bytes) -> None:
        if self._journal_fd is None:
            new = not os.path.exists(self._journal)
            self._journal_fd = _open_journal(self._journal, os.O_WRONLY | os.O_APPEND)
            if new and self.fsync:
                _fsync_dir(self.out)
        os.write(self._journal_fd, line)
        _fault("journal.written")
        if self.fsync:
            os.fsync(self._journal_fd)
        _fault("journal.fsynced")

    def _trim_journal(self) -> None:
        """Cut a torn last line (a crash in the middle of an append) off the journal, so that
        the next line starts on a line of its own."""
        try:
            fd = _open_journal(self._journal, os.O_RDWR, create=False)
        except FileNotFoundError:
            return
        with os.fdopen(fd, "rb+") as f:
            data = f.read()
            end = data.rfind(b"\n") + 1
            if end < len(data):
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())

    def _close_journal(self) -> None:
        fd, self._journal_fd = self._journal_fd, None
        if fd is not None:
            os.close(fd)

    def wait(self) -> None:
        """Block until every shard handed to the writer thread (by :meth:`flush` or a full
        buffer) is on disk and listed; raises :class:`CaptureWriteError` if writing failed."""
        self._queue.join()
        self._check_error()

    # -- closing -----------------------------------------------------------------------------
    def close(self, *, merge: bool = True, barrier: Any = None) -> None:
        """Write what is buffered, wait for the disk, and write the index.

        With several ranks, ``barrier`` (e.g. ``torch.distributed.barrier``) is called before
        rank 0 merges the per-rank index files into ``index.json``.
        """
        if self._closed:
            return
        try:
            try:
                self.flush()
            finally:
                self._closed = True
                self._queue.put(None)
                self._thread.join()
            self._check_error()
            try:
                self._write_part()  # the journal compacted into the index
                _fault("close.part-written")
                self._close_journal()
                if os.path.exists(self._journal):
                    os.remove(self._journal)
                    if self.fsync:
                        _fsync_dir(self.out)
                    _fault("close.journal-removed")
                if self._uploader is not None:
                    self._finish_remote()
                if barrier is not None:
                    barrier()
                if merge and self.rank == 0:
                    if self._remote is not None:
                        self._merge_remote()
                    else:
                        _atomic_write_json(
                            os.path.join(self.out, "index.json"),
                            _with_checksum(merged_index(self.out)),
                            "merged",
                        )
            except OSError as e:
                raise CaptureWriteError(
                    *_errno_of(e), f"writing the index of {self.url or self.out!r} failed: {e}"
                ) from e
        finally:
            self._close_journal()
            self._drop_lock()
            self._drop_staging()

    def _finish_remote(self) -> None:
        """Closing on object storage: every upload done, the compacted index uploaded, then
        the per-shard entry objects removed."""
        assert self._remote is not None and self._uploader is not None
        self._uploader.drain()
        own = f"index-r{self.rank:03d}"
        self._remote.put(self._part, f"{own}.json")
        _fault("upload.index")
        entries = f"{own}.d/"
        self._remote.rm(sorted(n for n in self._remote.listing() if n.startswith(entries)))

    def _merge_remote(self) -> None:
        """Rank 0 merges every rank's index as the bucket holds it, and writes index.json last."""
        assert self._remote is not None
        tmp = tempfile.mkdtemp(prefix="pyhook-merge-")
        try:
            self._remote.pull_indexes(tmp, self._remote.listing())
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(tmp, "index.json"))
            path = os.path.join(tmp, "index.json")
            _atomic_write_json(path, _with_checksum(merged_index(tmp)), "merged")
            self._remote.put(path, "index.json")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def abort(self) -> None:
        """Stop without writing the buffered rows (what a crash leaves: listed shards only)."""
        if self._closed:
            return
        self._closed = True
        self._buffer = []
        self._queue.put(None)
        self._thread.join()
        self._close_journal()
        self._drop_lock()
        self._drop_staging()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            # Keep every complete shard (the capture can be resumed) but do not hide the error.
            try:
                self.close(merge=False)
            except Exception:
                pass
