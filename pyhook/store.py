"""On-disk activation store: crash-safe safetensors shards, a JSON index, a memory-mapped reader.

Layout of a capture directory::

    out/
      shard-r000-000000.safetensors   # rank 0, shard 0: one tensor per layer, rows along dim 0
      shard-r000-000001.safetensors
      shard-r001-000000.safetensors   # rank 1 (torchrun), same output directory
      index-r000.json                 # rank 0's part of the index (source of truth, crash-consistent)
      index-r001.json
      index.json                      # all ranks merged, written when the capture closes

* :class:`ShardWriter` buffers rows in host memory and hands full shards to a background
  thread (a bounded queue: when the disk is slower than the model, the model waits instead of
  memory growing). A shard is written to ``*.tmp``, fsynced and renamed, and only then listed in
  the index (itself replaced atomically), so after a crash every listed shard is complete and
  unlisted debris is removed on the next open. The index records each shard's size, CRC32C
  checksum and example range. Reopening with the same settings resumes
  (:attr:`ShardWriter.examples_done` says how many examples to skip) after checking every listed
  shard (size, header, checksum); different settings raise :class:`CaptureExistsError`, a
  damaged shard :class:`CaptureDamagedError` naming it.
* :class:`CaptureReader` (:func:`open_capture`) merges the per-rank index files, checks every
  shard's size and header against them (``verify=True``: the checksums too), maps each shard
  into memory without reading it, and returns per-layer :class:`LayerData` (reads are copies the
  caller owns) or iterates in sequential or shuffled row batches. :func:`verify_capture`
  (``pyhook verify``) lists every problem of a directory.

The shard files are plain safetensors (``safetensors.torch.load_file`` reads them); pyhook writes
them itself so that the pieces of a shard go to the file without being concatenated first.
"""

from __future__ import annotations

import contextlib
import glob
import json
import mmap
import os
import queue
import re
import secrets
import struct
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ._version import __version__

__all__ = [
    "CHECKSUM",
    "FORMAT_VERSION",
    "CaptureDamagedError",
    "CaptureExistsError",
    "CaptureReader",
    "CaptureWriteError",
    "LayerData",
    "ShardWriter",
    "open_capture",
    "verify_capture",
]

FORMAT_VERSION = 1

_DTYPE_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _DTYPE_TO_ST[getattr(torch, _name)] = _code
_ST_TO_DTYPE = {v: k for k, v in _DTYPE_TO_ST.items()}

# -- checksums ---------------------------------------------------------------------------------
# The index records each shard's size and a checksum of its bytes, "<algorithm>:<8 hex digits>".
# CRC32C (hardware-accelerated by the ``crc32c`` package, ~14 GB/s on one core, GIL released) is
# computed by the writer thread while the bytes are in cache; zlib's CRC32 (~3 GB/s) is the
# fallback when the package is missing. Either is read back by :func:`verify_capture`.
_CHECKSUM_FUNCS: dict[str, Callable[..., int]] = {"crc32": zlib.crc32}
try:
    import crc32c as _crc32c

    _CHECKSUM_FUNCS["crc32c"] = _crc32c.crc32c
    CHECKSUM = "crc32c"
except ImportError:  # pragma: no cover - crc32c is a dependency; the fallback still verifies
    CHECKSUM = "crc32"

#: Called with the name of each step of the writer (``"shard.open"``, ``"index.replaced"``, ...)
#: when set; the fault-injection tests use it to kill the process at an exact point.
_fault_hook: Callable[[str], None] | None = None


def _fault(step: str) -> None:
    if _fault_hook is not None:
        _fault_hook(step)


_SHARD_NAME = re.compile(r"shard-r(\d{3,})-(\d{6,})\.safetensors\Z")


class CaptureExistsError(FileExistsError):
    """The output directory already holds a capture made with different settings.

    The message names the settings that differ; pass ``overwrite=True`` (``--overwrite``) to
    replace it, or choose another directory.

    Example::

        >>> import tempfile, torch, pyhook
        >>> net, out = torch.nn.Sequential(torch.nn.Linear(4, 3)), tempfile.mkdtemp()
        >>> with pyhook.capture(net, "0", out=out):
        ...     _ = net(torch.randn(2, 4))
        >>> try:
        ...     with pyhook.capture(net, "0", out=out, dtype="float16"):
        ...         pass
        ... except pyhook.CaptureExistsError:
        ...     print("refused")
        refused
    """


class CaptureDamagedError(ValueError):
    """A capture directory does not match its index: a shard is missing, truncated, swapped,
    listed twice, has another header or other bytes than the index records, or an index file
    is damaged.

    The message names the file and what differs. Reading, :func:`verify_capture` and resuming
    raise it instead of returning wrong rows; restore the file, or start the capture again with
    ``overwrite=True`` (``--overwrite``). ``path`` is the damaged file.

    Example::

        >>> import os, tempfile, torch, pyhook.store as store
        >>> out = tempfile.mkdtemp()
        >>> with store.ShardWriter(out) as w:
        ...     w.add({"x": torch.ones(3, 4)}, examples=3)
        >>> os.remove(os.path.join(out, "shard-r000-000000.safetensors"))
        >>> try:
        ...     store.open_capture(out)
        ... except store.CaptureDamagedError as e:
        ...     print(os.path.basename(e.path))
        shard-r000-000000.safetensors
    """

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class CaptureWriteError(OSError):
    """Writing a shard or the index failed (disk full, permission denied, ...).

    Shards written before the failure are intact and listed in the index; the shard being
    written is removed, so the directory can be resumed once the cause is fixed.

    Example::

        >>> import os, tempfile, torch, pyhook
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 3))
        >>> not_a_dir = tempfile.NamedTemporaryFile(delete=False).name  # a file, not a folder
        >>> try:
        ...     with pyhook.capture(net, "0", out=os.path.join(not_a_dir, "sub")):
        ...         _ = net(torch.randn(2, 4))
        ... except pyhook.CaptureWriteError as e:
        ...     print("cannot write" in str(e))
        True
    """


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``'float32'``."""
    return str(dtype).replace("torch.", "")


_STORABLE = ", ".join(dtype_name(d) for d in _DTYPE_TO_ST)  # for messages


def parse_dtype(name: str | torch.dtype | None, what: str = "dtype") -> torch.dtype | None:
    """``'bf16'``/``'bfloat16'``/``torch.bfloat16`` -> ``torch.bfloat16``; ``None`` passes."""
    if name is None:
        return None
    if isinstance(name, torch.dtype):
        if name not in _DTYPE_TO_ST:
            raise ValueError(f"{what} must be a dtype the store can hold ({_STORABLE}), got {name}")
        return name
    aliases = {
        "fp32": "float32",
        "fp16": "float16",
        "half": "float16",
        "bf16": "bfloat16",
        "float": "float32",
        "double": "float64",
        "fp64": "float64",
    }
    key = str(name).lower().removeprefix("torch.")
    key = aliases.get(key, key)
    dtype = getattr(torch, key, None)
    if not isinstance(dtype, torch.dtype) or dtype not in _DTYPE_TO_ST:
        raise ValueError(
            f"{what} must be one of {_STORABLE} "
            f"(a name such as 'bf16', or a torch.dtype), got {name!r}"
        )
    return dtype


# -- safetensors, written piecewise --------------------------------------------------------------
def _as_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def write_safetensors(
    path: str,
    tensors: Mapping[str, Sequence[torch.Tensor]],
    metadata: dict[str, str] | None = None,
    *,
    fsync: bool = True,
) -> int:
    """Write a safetensors file whose tensor ``name`` is the row-concatenation of its pieces.

    The pieces are streamed to the file one after another (no concatenated copy is made).
    Returns the number of bytes written.

    Example::

        >>> import torch, tempfile, os, safetensors.torch
        >>> from pyhook.store import write_safetensors
        >>> p = os.path.join(tempfile.mkdtemp(), "x.safetensors")
        >>> _ = write_safetensors(p, {"a": [torch.ones(2, 3), torch.zeros(1, 3)]})
        >>> safetensors.torch.load_file(p)["a"].tolist()
        [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    """
    return _write_file(path, tensors, metadata, fsync=fsync)[0]


def _write_file(
    path: str,
    tensors: Mapping[str, Sequence[torch.Tensor]],
    metadata: dict[str, str] | None = None,
    *,
    fsync: bool = True,
) -> tuple[int, str]:
    """:func:`write_safetensors`, returning ``(bytes, checksum)`` of the whole file."""
    crc = _CHECKSUM_FUNCS[CHECKSUM]
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    order: list[tuple[str, Sequence[torch.Tensor]]] = []
    for name, pieces in tensors.items():
        if not pieces:
            raise ValueError(f"tensor {name!r} has no pieces")
        first = pieces[0]
        tail = tuple(first.shape[1:])
        for p in pieces:
            if tuple(p.shape[1:]) != tail or p.dtype != first.dtype:
                raise ValueError(
                    f"pieces of {name!r} disagree: {tuple(p.shape)} {p.dtype} vs (*, {tail}) {first.dtype}"
                )
        rows = sum(int(p.shape[0]) for p in pieces)
        nbytes = sum(p.numel() for p in pieces) * first.element_size()
        header[name] = {
            "dtype": _DTYPE_TO_ST[first.dtype],
            "shape": [rows, *tail],
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
        order.append((name, pieces))
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned, as safetensors does
    with open(path, "wb") as f:
        _fault("shard.open")
        head = struct.pack("<Q", len(raw)) + raw
        f.write(head)
        value = crc(head)
        _fault("shard.header")
        for _name, pieces in order:
            for p in pieces:
                data = _as_bytes(p)
                f.write(data)
                value = crc(data, value)  # while the bytes are still in cache
                _fault("shard.data")
        f.flush()
        _fault("shard.written")
        if fsync:
            os.fsync(f.fileno())
    _fault("shard.fsynced")
    return 8 + len(raw) + offset, f"{CHECKSUM}:{value & 0xFFFFFFFF:08x}"


def _read_header(path: str) -> tuple[dict[str, Any], int]:
    """``(header, data_start)`` of a safetensors file; :class:`CaptureDamagedError` naming the
    file when it is not one (too short, a directory, unreadable, a header that is not JSON)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise CaptureDamagedError(
                    f"{path}: only {size} bytes, shorter than a safetensors header", path
                )
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise CaptureDamagedError(
                    f"{path}: header length {n} exceeds the file's {size} bytes", path
                )
            header = json.loads(f.read(n))
    except IsADirectoryError:
        raise CaptureDamagedError(f"{path}: is a directory, not a shard file", path) from None
    except FileNotFoundError:
        raise CaptureDamagedError(f"{path}: missing", path) from None
    except OSError as e:
        raise CaptureDamagedError(f"{path}: cannot be read: {e.strerror or e}", path) from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CaptureDamagedError(f"{path}: the header is not valid JSON ({e})", path) from None
    if not isinstance(header, dict):
        raise CaptureDamagedError(f"{path}: the header is not a JSON object", path)
    return header, 8 + n


def _file_checksum(path: str, algorithm: str) -> str:
    crc = _CHECKSUM_FUNCS[algorithm]
    value = 0
    with open(path, "rb") as f:
        buf = bytearray(8 << 20)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            value = crc(view[:n], value)
    return f"{algorithm}:{value & 0xFFFFFFFF:08x}"


def _check_shard(
    out: str,
    entry: dict[str, Any],
    layers: dict[str, Any],
    *,
    checksum: bool = False,
    notes: list[str] | None = None,
) -> tuple[dict[str, Any], int]:
    """Check one listed shard against its index entry; returns its ``(header, data_start)``.

    Always (cheap: one stat and one small read): the file exists, is a regular file of the
    recorded size, and its header holds each listed layer with the index's dtype and
    ``[rows, *row_shape]``, at offsets inside the file, and (stores written since checksums
    exist) names this shard and its first example. With ``checksum``: the bytes' checksum.
    Raises :class:`CaptureDamagedError` naming the file and what differs.
    """
    path = os.path.join(out, entry["file"])
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CaptureDamagedError(f"{path}: missing (listed in the index)", path) from None
    except OSError as e:
        raise CaptureDamagedError(f"{path}: cannot be read: {e.strerror or e}", path) from e
    if os.path.isdir(path):
        raise CaptureDamagedError(f"{path}: is a directory, not a shard file", path)
    want = entry.get("bytes")
    if isinstance(want, int) and st.st_size != want:
        raise CaptureDamagedError(
            f"{path}: size {st.st_size} bytes, the index records {want} (truncated or replaced)",
            path,
        )
    header, data_start = _read_header(path)
    meta = header.get("__metadata__") or {}
    if "shard" in meta and meta["shard"] != os.path.basename(path):
        raise CaptureDamagedError(
            f"{path}: holds {meta['shard']} (shards swapped or renamed on disk)", path
        )
    if (
        "first_example" in meta
        and "first_example" in entry
        and str(meta["first_example"]) != str(entry["first_example"])
    ):
        raise CaptureDamagedError(
            f"{path}: starts at example {meta['first_example']}, the index says "
            f"{entry['first_example']} (shards swapped on disk)",
            path,
        )
    for name, rows in entry["rows"].items():
        info = layers.get(name)
        if not isinstance(info, dict):
            raise CaptureDamagedError(
                f"{path}: the index lists rows of layer {name!r}, which its layer list lacks", path
            )
        h = header.get(name)
        if not isinstance(h, dict):
            raise CaptureDamagedError(f"{path}: no tensor {name!r} in its header", path)
        dtype = getattr(torch, str(info.get("dtype")), None)
        code = _DTYPE_TO_ST.get(dtype) if isinstance(dtype, torch.dtype) else None
        if code is None:
            raise CaptureDamagedError(
                f"{path}: the index records dtype {info.get('dtype')!r} for layer {name!r}, "
                "which a capture cannot hold",
                path,
            )
        if h.get("dtype") != code:
            raise CaptureDamagedError(
                f"{path}: layer {name!r} has dtype {h.get('dtype')} in the header, the index "
                f"records {info.get('dtype')} ({code})",
                path,
            )
        shape = [rows, *info.get("row_shape", [])]
        if h.get("shape") != shape:
            raise CaptureDamagedError(
                f"{path}: layer {name!r} has shape {h.get('shape')} in the header, the index "
                f"records {shape}",
                path,
            )
        nbytes = _ST_TO_DTYPE[code].itemsize
        for d in shape:
            nbytes *= d
        off = h.get("data_offsets")
        if (
            not isinstance(off, list)
            or len(off) != 2
            or off[1] - off[0] != nbytes
            or off[0] < 0
            or data_start + off[1] > st.st_size
        ):
            raise CaptureDamagedError(
                f"{path}: layer {name!r} has data offsets {off} that do not fit {shape} "
                f"{code} inside the file",
                path,
            )
    extra = sorted(set(header) - set(entry["rows"]) - {"__metadata__"})
    if extra:
        raise CaptureDamagedError(f"{path}: tensors {extra} are not listed in the index", path)
    if checksum:
        recorded = entry.get("checksum")
        algorithm = str(recorded).partition(":")[0]
        if recorded is None:
            if notes is not None:
                notes.append(f"{path}: no checksum recorded (older store); size and header checked")
        elif algorithm not in _CHECKSUM_FUNCS:
            raise CaptureDamagedError(
                f"{path}: checksum {recorded!r} uses an unknown algorithm "
                f"(known: {', '.join(_CHECKSUM_FUNCS)}; pip install crc32c)",
                path,
            )
        else:
            try:
                got = _file_checksum(path, algorithm)
            except OSError as e:
                raise CaptureDamagedError(f"{path}: cannot be read: {e.strerror or e}", path) from e
            if got != recorded:
                raise CaptureDamagedError(
                    f"{path}: checksum {got} differs from the index's {recorded} "
                    "(its bytes changed on disk)",
                    path,
                )
    return header, data_start


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):  # not supported everywhere (e.g. Windows)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _atomic_write_json(path: str, obj: Any, step: str = "index") -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1, sort_keys=False)
            f.flush()
            _fault(f"{step}.tmp-written")
            os.fsync(f.fileno())
        _fault(f"{step}.fsynced")
        os.replace(tmp, path)
        _fault(f"{step}.replaced")
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_dir(os.path.dirname(path) or ".")


def _load_json(path: str) -> Any:
    """The JSON in ``path``; :class:`CaptureDamagedError` naming the file when it is not JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CaptureDamagedError(f"{path}: not valid JSON ({e})", path) from None
    except IsADirectoryError:
        raise CaptureDamagedError(f"{path}: is a directory, not an index file", path) from None
    except FileNotFoundError:
        raise
    except OSError as e:
        raise CaptureDamagedError(f"{path}: cannot be read: {e.strerror or e}", path) from e


def _load_part(path: str) -> dict[str, Any]:
    """A per-rank index file, checked for the structure the reader and the writer rely on."""
    part = _load_json(path)
    if not isinstance(part, dict):
        raise CaptureDamagedError(
            f"{path}: the index is a JSON {type(part).__name__}, not an object", path
        )
    m = re.search(r"index-r(\d+)\.json\Z", path)
    rank = int(m.group(1)) if m else part.get("rank")
    for key, kind in (("layers", dict), ("shards", list), ("settings", dict)):
        if not isinstance(part.get(key), kind):
            raise CaptureDamagedError(
                f"{path}: the index has no {key!r} {'list' if kind is list else 'table'}", path
            )
    if part.get("rank") != rank or not isinstance(part.get("world_size"), int):
        raise CaptureDamagedError(
            f"{path}: rank {part.get('rank')!r} / world_size {part.get('world_size')!r} do not "
            "match the file name",
            path,
        )
    seen: set[str] = set()
    for s in part["shards"]:
        name = s.get("file") if isinstance(s, dict) else None
        m = _SHARD_NAME.match(name) if isinstance(name, str) else None
        if m is None or int(m.group(1)) != rank or not isinstance(name, str):
            raise CaptureDamagedError(
                f"{path}: {name!r} is not a shard file name of rank {rank} "
                "(shard-rRRR-NNNNNN.safetensors in the capture directory itself)",
                path,
            )
        if name in seen:
            raise CaptureDamagedError(
                f"{os.path.join(os.path.dirname(path), name)}: listed twice in {path}",
                os.path.join(os.path.dirname(path), name),
            )
        seen.add(name)
        if not isinstance(s.get("rows"), dict) or not isinstance(s.get("examples"), int):
            raise CaptureDamagedError(
                f"{path}: the entry of {name} has no 'rows' table or 'examples' count", path
            )
    return part


def _part_path(out: str, rank: int) -> str:
    return os.path.join(out, f"index-r{rank:03d}.json")


def _settings_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    keys = sorted(set(old) | set(new))
    return [
        f"{k}: {old.get(k)!r} (stored) != {new.get(k)!r} (now)"
        for k in keys
        if old.get(k) != new.get(k)
    ]


def _directory_arg(name: str, value: Any) -> str:
    """``os.fspath(value)``, with an error that names the argument."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"{name} must be a directory path (str or os.PathLike), got {type(value).__name__}: {value!r}"
        )
    return os.fspath(value)


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
    resumed capture skips). Batches are packed into shards of about ``shard_bytes``; a batch is
    never split across shards, so a shard always covers whole examples. ``max_pending`` bounds
    the number of shards waiting for the disk (back-pressure). ``on_release(batch)`` is called
    once a batch has been written (used to give pooled buffers back).

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
        rank: int = 0,
        world_size: int = 1,
        overwrite: bool = False,
        fsync: bool = True,
        on_release: Any = None,
    ) -> None:
        if not isinstance(shard_bytes, int) or shard_bytes <= 0:
            raise ValueError(f"shard_bytes must be a positive int, got {shard_bytes!r}")
        if not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be an int >= 1, got {max_pending!r}")
        if not (0 <= rank < world_size):
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.out = _directory_arg("out", out)
        self.settings = json.loads(json.dumps(settings or {}))  # normalise (tuples -> lists)
        self.meta = dict(meta or {})
        self.shard_bytes = shard_bytes
        self.rank = rank
        self.world_size = world_size
        self.fsync = fsync
        self.on_release = on_release
        self._part = _part_path(self.out, rank)
        self._open_dir(overwrite)
        # State that the writer thread owns after start; the main thread only reads it.
        self._buffer: list[tuple[dict[str, torch.Tensor], int, Any, bool]] = []
        self._buffer_bytes = 0
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._closed = False
        self.bytes_written = 0
        self.write_seconds = 0.0
        self._thread = threading.Thread(
            target=self._run, name=f"pyhook-writer-r{rank}", daemon=True
        )
        self._thread.start()

    # -- opening, resuming -----------------------------------------------------------------
    def _open_dir(self, overwrite: bool) -> None:
        try:
            os.makedirs(self.out, exist_ok=True)
            probe = os.path.join(self.out, f".pyhook-probe-{os.getpid()}-{self.rank}")
            with open(probe, "wb") as f:
                f.write(b"x")
            os.remove(probe)
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
        fd = os.open(os.path.join(self.out, f".lock-r{self.rank:03d}"), os.O_RDWR | os.O_CREAT)
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
        doomed: list[str] = []
        if overwrite:
            # Each rank deletes only its own files (another rank may already be writing its
            # new ones); rank 0 also the merged index and the files of ranks beyond this
            # world (a previous run with more processes).
            doomed += [f"shard-{own}-*.safetensors*", f"index-{own}.json*"]
            if self.rank == 0:
                doomed.append("index.json*")
                for p in glob.glob(os.path.join(self.out, "index-r*.json*")) + glob.glob(
                    os.path.join(self.out, "shard-r*.safetensors*")
                ):
                    m = re.match(r"(?:index|shard)-r(\d+)", os.path.basename(p))
                    if m and int(m.group(1)) >= self.world_size:
                        doomed.append(os.path.basename(p))
        # Debris of a crash in the middle of a shard or index write: never listed, removable.
        doomed += [f"shard-{own}-*.tmp*", f"index-{own}.json.tmp*"]
        if self.rank == 0:
            doomed.append("index.json.tmp*")
        for pattern in doomed:
            for p in glob.glob(os.path.join(self.out, pattern)):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(p)
        # The settings to compare with: this rank's index, another rank's, else the merged one
        # (the per-rank files are the source of truth; a damaged merged index is rewritten).
        # (With overwrite this rank's files are gone; the others' are not compared.)
        part = _load_part(self._part) if os.path.exists(self._part) else None
        existing: dict[str, Any] | None = part
        if existing is None and not overwrite:
            for p in sorted(glob.glob(os.path.join(self.out, "index-r*.json"))):
                existing = _load_part(p)
                break
        if existing is None and not overwrite and os.path.exists(merged):
            with contextlib.suppress(CaptureDamagedError):
                existing = _load_json(merged)
        if (
            existing is not None
            and not existing.get("shards")
            and not existing.get("examples")
            and not glob.glob(os.path.join(self.out, "shard-r*.safetensors"))
        ):
            existing = None  # an index of a capture that stored nothing: nothing to protect
        if existing is not None and not overwrite:
            diff = _settings_diff(existing.get("settings", {}), self.settings)
            old_world = existing.get("world_size", 1)
            if old_world != self.world_size:
                diff.append(f"world_size: {old_world} (stored) != {self.world_size} (now)")
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
                    _check_shard(self.out, s, part["layers"], checksum=True)
                except CaptureDamagedError as e:
                    raise CaptureDamagedError(
                        f"cannot resume the capture in {self.out!r}: {e}. Restore the file, or "
                        "start again with overwrite=True (--overwrite)",
                        e.path,
                    ) from None
            self.shards = list(part["shards"])
            self.layers = part["layers"]
        listed = {s["file"] for s in self.shards}
        for p in glob.glob(os.path.join(self.out, f"shard-r{self.rank:03d}-*.safetensors")):
            if os.path.basename(p) not in listed:  # renamed but not yet indexed when it crashed
                os.remove(p)
        self._next_index = 1 + max(
            (int(s["file"].split("-")[-1].split(".")[0]) for s in self.shards), default=-1
        )
        self.examples_done = sum(s["examples"] for s in self.shards)
        self._examples_written = self.examples_done  # the writer thread's position
        self.resumed = bool(self.shards)

    def _check_foreign_index(self, merged: str) -> None:
        """Refuse (even with ``overwrite``) to replace an ``index.json`` that pyhook did not write."""
        if not os.path.exists(merged):
            return
        try:
            obj = _load_json(merged)
        except CaptureDamagedError as e:
            if glob.glob(os.path.join(self.out, "index-r*.json")):
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
                getattr(err, "errno", None) or 0,
                f"writing the capture to {self.out!r} failed: {err}. Shards written before the "
                "failure are intact and indexed; fix the cause and run again to resume.",
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
        for name, t in batch.items():
            if t.dtype not in _DTYPE_TO_ST:
                raise ValueError(
                    f"layer {name!r}: rows of dtype {dtype_name(t.dtype)} cannot be stored in "
                    f"safetensors shards; supported: {_STORABLE} "
                    "(pass dtype= to cast when capturing)"
                )
            info = {"dtype": dtype_name(t.dtype), "row_shape": list(t.shape[1:])}
            known = self.layers.get(name)
            if known is None:
                self.layers[name] = info
            elif known != info:
                raise ValueError(
                    f"layer {name!r}: rows of shape {info['row_shape']} {info['dtype']} do not match "
                    f"the earlier {known['row_shape']} {known['dtype']}; rows of one layer must share "
                    "their shape (flatten tokens, or pad to a fixed max_length)"
                )
        if skipped and batch:
            raise ValueError("a skipped batch has no rows: pass batch={}")
        self._buffer.append((batch, int(examples), wait, skipped))
        self._buffer_bytes += sum(t.numel() * t.element_size() for t in batch.values())
        if self._buffer_bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        """Hand the buffered batches to the writer thread as one shard (no-op when empty)."""
        if not self._buffer:
            return
        batches, self._buffer, self._buffer_bytes = self._buffer, [], 0
        index = self._next_index
        self._next_index += 1
        while True:  # bounded queue: wait for the disk, but notice a dead writer
            self._check_error()
            try:
                self._queue.put((index, batches), timeout=0.1)
                return
            except queue.Full:
                continue

    # -- the writer thread -----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None:
                    self._write_shard(*item)
            except BaseException as e:  # reported to the main thread on its next call
                self._error = e
            finally:
                if item is not None and self.on_release is not None:
                    for batch, *_ in item[1]:
                        with contextlib.suppress(Exception):
                            self.on_release(batch)
                self._queue.task_done()

    def _write_shard(
        self, index: int, batches: list[tuple[dict[str, torch.Tensor], int, Any, bool]]
    ) -> None:
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
        examples = at - first
        meta = {"format": "pyhook", "rank": str(self.rank), "shard": name}
        meta["first_example"] = str(first)
        try:
            nbytes, checksum = _write_file(tmp, pieces, meta, fsync=self.fsync)
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
        self._examples_written = at
        self._write_part()
        self.bytes_written += nbytes
        self.write_seconds += time.perf_counter() - t0

    def _part_dict(self) -> dict[str, Any]:
        return {
            "format": "pyhook-capture",
            "format_version": FORMAT_VERSION,
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
        _atomic_write_json(self._part, self._part_dict())

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
                self._write_part()
                _fault("close.part-written")
                if barrier is not None:
                    barrier()
                if merge and self.rank == 0:
                    _atomic_write_json(
                        os.path.join(self.out, "index.json"), merged_index(self.out), "merged"
                    )
            except OSError as e:
                raise CaptureWriteError(
                    e.errno or 0, f"writing the index of {self.out!r} failed: {e}"
                ) from e
        finally:
            self._drop_lock()

    def abort(self) -> None:
        """Stop without writing the buffered rows (what a crash leaves: listed shards only)."""
        if self._closed:
            return
        self._closed = True
        self._buffer = []
        self._queue.put(None)
        self._thread.join()
        self._drop_lock()

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


def merged_index(out: str) -> dict[str, Any]:
    """Merge the per-rank index files of a capture directory into one index dict."""
    parts = [_load_part(p) for p in sorted(glob.glob(os.path.join(out, "index-r*.json")))]
    if not parts:
        raise FileNotFoundError(f"{out!r} holds no pyhook capture (no index-r*.json files)")
    first = parts[0]
    layers: dict[str, dict[str, Any]] = {}
    for part in parts:
        for name, info in part["layers"].items():
            layers.setdefault(name, dict(info))
    shards = [s for part in sorted(parts, key=lambda p: p["rank"]) for s in part["shards"]]
    for name, info in layers.items():
        info["rows"] = sum(s["rows"].get(name, 0) for s in shards)
        info["shape"] = [info["rows"], *info["row_shape"]]
    return {
        "format": "pyhook-capture",
        "format_version": FORMAT_VERSION,
        "pyhook_version": first["pyhook_version"],
        "torch_version": first.get("torch_version"),
        "world_size": first["world_size"],
        "ranks": sorted(p["rank"] for p in parts),
        # ranks whose index is absent (crashed, interrupted before their first shard, or still
        # running): their rows are not part of this index
        "missing_ranks": sorted(set(range(first["world_size"])) - {p["rank"] for p in parts}),
        "settings": first["settings"],
        "meta": first.get("meta", {}),
        "examples": sum(s["examples"] for s in shards),
        # example ranges without rows (forwards that failed and were skipped), per rank
        "skipped": [r for s in shards for r in s.get("skipped", [])],
        "bytes": sum(s.get("bytes", 0) for s in shards),
        "layers": layers,
        "shards": shards,
    }


# -- reading ---------------------------------------------------------------------------------
class _MappedShard:
    def __init__(self, path: str, header: dict[str, Any], data_start: int) -> None:
        self.path = path
        self.header, self.data_start = header, data_start
        self._mm: mmap.mmap | None = None

    def tensor(self, name: str) -> torch.Tensor:
        info = self.header[name]
        dtype = _ST_TO_DTYPE[info["dtype"]]
        begin, end = info["data_offsets"]
        shape = info["shape"]
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        if self._mm is None:
            with open(self.path, "rb") as f:
                # Copy-on-write mapping: pages are read lazily and the file is never modified.
                # These views stay inside LayerData, which hands out copies.
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        flat = torch.frombuffer(
            self._mm, dtype=torch.uint8, count=end - begin, offset=self.data_start + begin
        )
        return flat.view(dtype).view(shape)


class LayerData:
    """The rows of one layer across all shards: memory-mapped parts, indexed like a tensor.

    Every read (indexing, :meth:`to_tensor`, :attr:`parts`, :meth:`CaptureReader.batches`)
    returns tensors the caller owns: the rows are copied out of the memory map, so editing a
    batch in place never changes what a later read returns. Nothing is read until indexed.

    Example::

        >>> import torch, tempfile
        >>> from pyhook.store import ShardWriter, open_capture
        >>> out = tempfile.mkdtemp()
        >>> with ShardWriter(out, shard_bytes=1) as w:  # one shard per batch
        ...     w.add({"h": torch.arange(4.).reshape(2, 2)}, examples=2)
        ...     w.add({"h": torch.arange(4., 8.).reshape(2, 2)}, examples=2)
        >>> h = open_capture(out)["h"]
        >>> len(h), len(h.parts), h[1:3].tolist()
        (4, 2, [[2.0, 3.0], [4.0, 5.0]])
        >>> h[0].zero_().tolist(), h[0].tolist()  # a copy: the stored rows are unchanged
        ([0.0, 0.0], [0.0, 1.0])
    """

    def __init__(
        self, name: str, parts: list[torch.Tensor], row_shape: Sequence[int], dtype: torch.dtype
    ) -> None:
        self.name = name
        self._parts = parts  # views of the memory maps: never handed out
        self.dtype = dtype
        self.row_shape = tuple(row_shape)
        sizes = [int(p.shape[0]) for p in parts]
        self._starts = [0]
        for s in sizes:
            self._starts.append(self._starts[-1] + s)

    @property
    def shape(self) -> torch.Size:
        return torch.Size([len(self), *self.row_shape])

    def __len__(self) -> int:
        return self._starts[-1]

    @property
    def parts(self) -> list[torch.Tensor]:
        """The rows of each shard, one tensor per shard (copies, made on each access)."""
        return [p.clone() for p in self._parts]

    def to_tensor(self) -> torch.Tensor:
        """All rows as one tensor (a copy the caller owns)."""
        if len(self._parts) == 1:
            return self._parts[0].clone()
        if not self._parts:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.cat(self._parts)

    def __getitem__(self, index: int | slice | torch.Tensor | Sequence[int]) -> torch.Tensor:
        n = len(self)
        if not isinstance(index, (int, slice)):
            if (
                not isinstance(index, torch.Tensor)
                and not hasattr(index, "__len__")
                and hasattr(index, "__index__")
            ):
                index = int(index.__index__())  # numpy integers
            else:
                idx = torch.as_tensor(index)
                if idx.numel() == 0 and idx.dtype != torch.bool:
                    idx = idx.long()  # [] is a float tensor: no rows, not a float index
                if idx.dim() == 0 and not idx.is_floating_point() and idx.dtype != torch.bool:
                    index = int(idx)
                elif idx.dtype == torch.bool:
                    if idx.shape != (n,):
                        raise IndexError(
                            f"a boolean mask over layer {self.name!r} must have shape ({n},), "
                            f"got {tuple(idx.shape)}"
                        )
                    return self._gather(idx.nonzero().squeeze(1))
                elif idx.is_floating_point() or idx.is_complex():
                    raise IndexError(
                        f"rows of layer {self.name!r} are indexed by ints, slices, int sequences "
                        f"or boolean masks, got a {idx.dtype} index"
                    )
        if isinstance(index, int):
            if index < 0:
                index += n
            if not 0 <= index < n:
                raise IndexError(f"row {index} out of range for layer {self.name!r} with {n} rows")
            import bisect

            i = bisect.bisect_right(self._starts, index) - 1
            return self._parts[i][index - self._starts[i]].clone()
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            if step == 1:
                out = []
                for i, p in enumerate(self._parts):
                    lo, hi = max(start, self._starts[i]), min(stop, self._starts[i + 1])
                    if lo < hi:
                        out.append(p[lo - self._starts[i] : hi - self._starts[i]])
                if len(out) == 1:
                    return out[0].clone()
                return (
                    torch.cat(out) if out else torch.empty((0, *self.row_shape), dtype=self.dtype)
                )
            if not range(start, stop, step):  # e.g. [22:6:2]: no rows
                return torch.empty((0, *self.row_shape), dtype=self.dtype)
            index = torch.arange(start, stop, step)
        return self._gather(torch.as_tensor(index, dtype=torch.long))

    def _gather(self, idx: torch.Tensor) -> torch.Tensor:
        n = len(self)
        idx = torch.where(idx < 0, idx + n, idx)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise IndexError(f"row index out of range for layer {self.name!r} with {n} rows")
        out = torch.empty((idx.numel(), *self.row_shape), dtype=self.dtype)
        starts = torch.tensor(self._starts)
        part_of = torch.bucketize(idx, starts[1:], right=True)
        for i in part_of.unique().tolist():
            sel = (part_of == i).nonzero().squeeze(1)
            out[sel] = self._parts[i][idx[sel] - self._starts[i]]
        return out

    def __repr__(self) -> str:
        return f"<LayerData {self.name!r} shape={tuple(self.shape)} dtype={dtype_name(self.dtype)} parts={len(self._parts)}>"


class CaptureReader:
    """Read a capture directory: the merged index, memory-mapped per-layer rows, row batches.

    Example::

        >>> import torch, tempfile
        >>> from pyhook.store import ShardWriter, CaptureReader
        >>> out = tempfile.mkdtemp()
        >>> with ShardWriter(out) as w:
        ...     w.add({"a": torch.arange(10.).reshape(5, 2), "b": torch.zeros(5, 1)}, examples=5)
        >>> r = CaptureReader(out)
        >>> r.layers, r.rows("a")
        (['a', 'b'], 5)
        >>> [b["a"].shape[0] for b in r.batches(2)]
        [2, 2, 1]

    The per-rank index files are merged on open (so a capture is readable even if it was
    interrupted before ``index.json`` was written); shards are ordered by rank, then by number,
    which under torchrun with contiguous per-rank shares is the original data order.

    Opening checks every listed shard against the index (present, a regular file of the
    recorded size, a header with the recorded dtypes and shapes, naming this shard): one stat
    and one small read per shard. ``verify=True`` also compares each shard's checksum (reads
    every byte). A mismatch raises :class:`CaptureDamagedError` naming the file.
    """

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = False) -> None:
        self.path = _directory_arg("path", path)
        if not os.path.isdir(self.path):
            raise FileNotFoundError(f"capture directory {self.path!r} does not exist")
        self.index = merged_index(self.path)
        if self.index["missing_ranks"]:
            warnings.warn(
                f"capture {self.path!r} has no index for rank(s) {self.index['missing_ranks']} of "
                f"{self.index['world_size']} (crashed, interrupted or still running): their rows "
                "are not read; rerun the same command with the same number of processes to "
                "complete it",
                stacklevel=2,
            )
        self._shards = []
        for s in self.index["shards"]:
            try:
                header, start = _check_shard(self.path, s, self.index["layers"], checksum=verify)
            except CaptureDamagedError as e:
                raise CaptureDamagedError(
                    f"capture {self.path!r} is damaged: {e} (pyhook verify lists every problem)",
                    e.path,
                ) from None
            self._shards.append(_MappedShard(os.path.join(self.path, s["file"]), header, start))
        self._cache: dict[str, LayerData] = {}

    @property
    def layers(self) -> list[str]:
        """Layer names, in capture order."""
        return list(self.index["layers"])

    @property
    def settings(self) -> dict[str, Any]:
        return self.index["settings"]

    @property
    def examples(self) -> int:
        return self.index["examples"]

    def rows(self, layer: str) -> int:
        return self._info(layer)["rows"]

    def _info(self, layer: str) -> dict[str, Any]:
        try:
            return self.index["layers"][layer]
        except KeyError:
            raise KeyError(
                f"layer {layer!r} is not in this capture; it holds {self.layers}"
            ) from None

    def layer(self, name: str) -> LayerData:
        """The rows of layer ``name`` (memory-mapped, nothing read until indexed)."""
        if name not in self._cache:
            info = self._info(name)
            dtype = parse_dtype(info["dtype"])
            assert dtype is not None
            parts = [m.tensor(name) for m in self._shards if name in m.header]
            self._cache[name] = LayerData(name, parts, info["row_shape"], dtype)
        return self._cache[name]

    __getitem__ = layer

    def __contains__(self, name: object) -> bool:
        return name in self.index["layers"]

    def __iter__(self) -> Iterator[str]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def batches(
        self,
        batch_size: int,
        *,
        layers: Sequence[str] | None = None,
        shuffle: bool = False,
        seed: int | None = None,
        drop_last: bool = False,
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Yield ``{layer: rows}`` batches of ``batch_size`` rows, in order or shuffled.

        Every requested layer must have the same number of rows (the same row ``i`` of each layer
        comes from the same token or example). Shuffling is a permutation of all rows drawn from
        ``seed`` (reproducible), gathered shard by shard from the memory maps.
        """
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        names = list(layers) if layers is not None else self.layers
        if isinstance(layers, str):
            names = [layers]
        data = [self.layer(n) for n in names]
        counts = {n: len(d) for n, d in zip(names, data)}
        if len(set(counts.values())) > 1:
            raise ValueError(
                f"layers have different row counts {counts}; ask for them separately (layers=[...])"
            )
        n = next(iter(counts.values()), 0)
        if shuffle:
            # Without a seed: a fresh one that leaves torch's global generator alone.
            gen = torch.Generator().manual_seed(seed if seed is not None else secrets.randbits(63))
            order: torch.Tensor | None = torch.randperm(n, generator=gen)
        else:
            order = None
        stop = (n // batch_size) * batch_size if drop_last else n
        for start in range(0, stop, batch_size):
            end = min(start + batch_size, n)
            if order is None:
                yield {name: d[start:end] for name, d in zip(names, data)}
            else:
                idx = order[start:end]
                yield {name: d[idx] for name, d in zip(names, data)}

    def __repr__(self) -> str:
        return f"<CaptureReader {self.path!r} layers={len(self.layers)} examples={self.examples}>"


def open_capture(path: str | os.PathLike[str], *, verify: bool = False) -> CaptureReader:
    """Open a capture directory for reading (see :class:`CaptureReader`).

    Every shard's size and header are checked against the index; ``verify=True`` also checks
    every shard's checksum (reads all the data once).

    Example::

        >>> import torch, tempfile, pyhook.store as store
        >>> out = tempfile.mkdtemp()
        >>> with store.ShardWriter(out) as w:
        ...     w.add({"x": torch.ones(3, 4)}, examples=3)
        >>> store.open_capture(out, verify=True)["x"].shape
        torch.Size([3, 4])
    """
    return CaptureReader(path, verify=verify)


def verify_capture(path: str | os.PathLike[str]) -> tuple[list[str], list[str]]:
    """Check a capture directory completely: ``(problems, notes)``, one line each.

    Every index file is read and checked, and every listed shard against its entry: present,
    a regular file, the recorded size, a header with the recorded dtypes and shapes naming this
    shard, and the recorded checksum of its bytes. A problem names the file and what differs;
    a note says what could not be checked (a shard of an older store has no checksum).

    Example::

        >>> import tempfile, torch, pyhook.store as store
        >>> out = tempfile.mkdtemp()
        >>> with store.ShardWriter(out) as w:
        ...     w.add({"x": torch.ones(3, 4)}, examples=3)
        >>> store.verify_capture(out)
        ([], [])
    """
    out = _directory_arg("path", path)
    if not os.path.isdir(out):
        return [f"{out}: no such capture directory"], []
    problems: list[str] = []
    notes: list[str] = []
    parts = sorted(glob.glob(os.path.join(out, "index-r*.json")))
    if not parts:
        return [f"{out}: holds no pyhook capture (no index-r*.json files)"], []
    seen: set[str] = set()
    for p in parts:
        try:
            part = _load_part(p)
        except CaptureDamagedError as e:
            problems.append(str(e))
            continue
        for s in part["shards"]:
            seen.add(s["file"])
            try:
                _check_shard(out, s, part["layers"], checksum=True, notes=notes)
            except CaptureDamagedError as e:
                problems.append(str(e))
    for p in sorted(glob.glob(os.path.join(out, "shard-r*.safetensors"))):
        if os.path.basename(p) not in seen and not problems:
            notes.append(f"{p}: not listed in the index (debris, removed on the next resume)")
    return problems, notes


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"
