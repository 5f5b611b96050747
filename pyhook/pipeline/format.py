"""The capture format in one place: file names, dtypes, checksums, safetensors writing and
header reading, the index files (per-rank parts and the merged index) and the store's errors.

Everything that knows how bytes are laid out on disk lives here; :mod:`.writer`, :mod:`.reader`
and :mod:`.verify` build on it.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import re
import stat
import struct
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from . import _directio

#: Version of the index layout. 2 added the index's own checksum (``index_checksum``) and the
#: per-rank journal (``index-rNNN.journal``); stores of version 1 still open.
FORMAT_VERSION = 2

#: Names starting with this prefix are reserved for the store's own tensors (token ids, row
#: index, statistics): stored like layers, readable with ``reader.layer(name)``, but not listed.
RESERVED_PREFIX = "__"

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


#: What the shard header of an encoded layer must hold (``(dtype code, shape)``); set by
#: :mod:`.encoding` when it is imported (it sits above the format and never is imported by it).
_encoded_layout: Callable[[dict[str, Any], int, dict[str, Any]], tuple[str, list[Any]]] | None = (
    None
)


#: The schema of a layer's ``encoding`` (what is wrong with it, or None) and the rows of its
#: reserved tensors in a shard; set by :mod:`.encoding` when it is imported, as above.
_encoding_schema: (
    tuple[
        Callable[[str, dict[str, Any], dict[str, Any]], str | None],
        Callable[[dict[str, Any], int], dict[str, int]],
    ]
    | None
) = None


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
    return _as_bytes_at(t)[0]


def _address(t: torch.Tensor) -> int | None:
    """Where a piece's bytes lie in host memory, when :func:`_as_bytes_at` would write them from
    there (a dense CPU tensor); ``None`` when they would be copied first."""
    if t.device.type != "cpu" or t.numel() == 0 or not t.is_contiguous():
        return None
    return t.data_ptr() if t.numel() == 1 or t.reshape(-1).stride(0) == 1 else None


def _as_bytes_at(t: torch.Tensor) -> tuple[memoryview, int | None]:
    """The tensor's bytes and their address in memory (``None`` when empty)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b""), None
    if t.stride(0) != 1:  # e.g. a [1, 1, 1] view with stride 2 counts as contiguous
        t = torch.empty(t.shape, dtype=t.dtype).copy_(t)
    u = t.view(torch.uint8)
    return memoryview(u.numpy()).cast("B"), u.data_ptr()  # type: ignore[arg-type]


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
    return _write_file(path, tensors, metadata, fsync=fsync, follow=True)[0]


_PAGE = 4096


def _write_file(
    path: str,
    tensors: Mapping[str, Sequence[torch.Tensor]],
    metadata: dict[str, str] | None = None,
    *,
    fsync: bool = True,
    follow: bool = False,
) -> tuple[int, str]:
    """:func:`write_safetensors`, returning ``(bytes, checksum)`` of the whole file. A file of
    the store (``follow=False``) is never written through a link in its place."""
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
    # The data starts 8-byte aligned, as safetensors does; in a shard of 1 MiB or more at a page
    # boundary (the header padded with spaces, which safetensors allows): a reader of rows from
    # a cold page cache then reads the pages of the rows and no more (a 3 KB row spans 2 pages
    # in 3 of 4 positions at an unaligned start, against 2 of 4 aligned).
    align = _PAGE if offset >= 1 << 20 else 8
    raw += b" " * (-(8 + len(raw)) % align)
    head = struct.pack("<Q", len(raw)) + raw
    if _directio.wanted(  # past the page cache (_directio.py)
        path,
        len(head) + offset,
        len(head),
        ((p.numel() * p.element_size(), _address(p)) for _name, pieces in order for p in pieces),
    ):
        try:
            return _write_direct(path, head, order, fsync=fsync, follow=follow)
        except _directio.Refused:
            _directio.refused(path)  # tmpfs, some overlay file systems: written buffered
    with open(path, "wb") if follow else os.fdopen(_open_new(path), "wb") as f:
        _fault("shard.open")
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


def _write_direct(
    path: str,
    head: bytes,
    order: list[tuple[str, Sequence[torch.Tensor]]],
    *,
    fsync: bool,
    follow: bool = False,
) -> tuple[int, str]:
    """:func:`_write_file`'s body with ``O_DIRECT`` (:class:`._directio.DirectFile`): the same
    bytes, checksum, fault points and fsync; :class:`._directio.Refused` when the file system
    refuses direct I/O (nothing of the file is kept then: the caller rewrites it buffered)."""
    crc = _CHECKSUM_FUNCS[CHECKSUM]
    f = _directio.DirectFile(path, follow=follow)
    try:
        _fault("shard.open")
        value = crc(head)
        f.write(memoryview(head), None)
        _fault("shard.header")
        for _name, pieces in order:
            for p in pieces:
                data, address = _as_bytes_at(p)
                value = crc(data, value)  # first: the copy to the staging buffer then hits cache
                f.write(data, address)
                _fault("shard.data")
        f.finish()
        _fault("shard.written")
        if fsync:
            os.fsync(f.fileno())
    finally:
        f.close()
    _fault("shard.fsynced")
    return f.size, f"{CHECKSUM}:{value & 0xFFFFFFFF:08x}"


def _open_regular(
    path: str, *, missing: type[Exception] | None = None, what: str = "a shard file"
) -> Any:
    """``open(path, "rb")`` of a file of the store that never blocks and never follows a link:
    a FIFO, a device, a directory or a symbolic link in place of a store file is
    :class:`CaptureDamagedError`, checked on the opened file itself."""
    flags = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except IsADirectoryError:
        raise CaptureDamagedError(f"{path}: is a directory, not {what}", path) from None
    except FileNotFoundError:
        if missing is not None:
            raise
        raise CaptureDamagedError(f"{path}: missing", path) from None
    except OSError as e:
        _refuse_link(path, e)
        raise CaptureDamagedError(f"{path}: cannot be read: {e.strerror or e}", path) from e
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CaptureDamagedError(f"{path}: {_file_kind(mode)}, not {what}", path)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


#: ``O_NOFOLLOW`` where the platform has it: every file of a store is opened without following
#: a symbolic link (a received store's link would make pyhook read or write the file it names).
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

_LINK_ADVICE = (
    "pyhook never follows a link inside a capture directory (it would read or write the file "
    "the link names); put the file itself in its place, or remove the link"
)


def _link_error(path: str) -> CaptureDamagedError:
    return CaptureDamagedError(f"{path}: is a symbolic link; {_LINK_ADVICE}", path)


#: The names of a store's files (and of their temporary files), which must not be links.
_STORE_FILE = re.compile(
    r"(?:shard-r\d+-\d+\.safetensors|index-r\d+\.(?:json|journal)|index\.json)(?:\.tmp.*)?\Z"
    r"|\.lock-r\d+\Z"
)


def store_links(out: str) -> list[str]:
    """The files of the store in directory ``out`` that are symbolic links (what verify names
    and the writer refuses before it touches any file), sorted.

    Example::

        >>> import os, tempfile
        >>> from pyhook.store.format import store_links
        >>> out = tempfile.mkdtemp()
        >>> os.symlink("/etc/hostname", os.path.join(out, "index-r000.journal"))
        >>> [os.path.basename(p) for p in store_links(out)]
        ['index-r000.journal']
    """
    try:
        entries = list(os.scandir(out))
    except OSError:
        return []  # not a directory (yet): the caller's own error says so
    return sorted(
        os.path.join(out, d.name) for d in entries if _STORE_FILE.match(d.name) and d.is_symlink()
    )


def refuse_links(out: str) -> None:
    """:class:`CaptureDamagedError` naming the first file of the store in ``out`` that is a
    symbolic link (:func:`store_links`); ``None`` when there is none.

    Example::

        >>> import tempfile
        >>> from pyhook.store.format import refuse_links
        >>> refuse_links(tempfile.mkdtemp()) is None
        True
    """
    links = store_links(out)
    if links:
        raise _link_error(links[0])


def _open_new(path: str, flags: int = 0) -> int:
    """A file of the store opened for writing (created or truncated) without following a
    link: a link in its place is :class:`CaptureDamagedError` naming it."""
    flags |= os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(path, flags, 0o666)
    except OSError as e:
        _refuse_link(path, e)
        raise


def _refuse_link(path: str, err: OSError) -> None:
    """Raise :func:`_link_error` when ``err`` (from an ``O_NOFOLLOW`` open of ``path``) was
    caused by ``path`` being a symbolic link."""
    if err.errno in (errno.ELOOP, errno.EMLINK) and os.path.islink(path):  # (EMLINK: BSDs)
        raise _link_error(path) from None


def _file_kind(mode: int) -> str:
    for test, what in (
        (stat.S_ISDIR, "is a directory"),
        (stat.S_ISFIFO, "is a FIFO (named pipe)"),
        (stat.S_ISSOCK, "is a socket"),
        (stat.S_ISCHR, "is a character device"),
        (stat.S_ISBLK, "is a block device"),
    ):
        if test(mode):
            return what
    return "is not a regular file"


def _read_header(path: str) -> tuple[dict[str, Any], int]:
    """``(header, data_start)`` of a safetensors file, its header checked by
    :func:`check_header`; :class:`CaptureDamagedError` naming the file when it is not one (too
    short, a directory, a link, unreadable, a header that is not JSON or not a valid header)."""
    try:
        with _open_regular(path) as f:
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
            if n > MAX_HEADER_BYTES:
                raise CaptureDamagedError(
                    f"{path}: header length {n} exceeds the limit of {MAX_HEADER_BYTES} bytes "
                    "(safetensors' own)",
                    path,
                )
            raw = f.read(n)
    except OSError as e:
        raise CaptureDamagedError(f"{path}: cannot be read: {e.strerror or e}", path) from e
    header = _parse_json(raw, path, "the header")
    check_header(path, header, 8 + n, size)
    return header, 8 + n


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):  # not supported everywhere (e.g. Windows)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _checksum_of(obj: dict[str, Any], key: str = "index_checksum", algorithm: str = "") -> str:
    """Checksum of a JSON-able dict: its canonical form without ``key``."""
    algorithm = algorithm or CHECKSUM
    body = {k: v for k, v in obj.items() if k != key}
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return f"{algorithm}:{_CHECKSUM_FUNCS[algorithm](raw) & 0xFFFFFFFF:08x}"


def _check_checksum(path: str, obj: dict[str, Any], what: str = "the index") -> None:
    """:class:`CaptureDamagedError` when ``obj``'s recorded ``index_checksum`` does not match its
    body; a missing one is an error from format version 2 on."""
    recorded = obj.get("index_checksum")
    if recorded is None:
        version = obj.get("format_version", 1)
        if isinstance(version, int) and version >= 2:
            raise CaptureDamagedError(f"{path}: {what} has no 'index_checksum' (edited?)", path)
        return
    algorithm = str(recorded).partition(":")[0]
    if algorithm not in _CHECKSUM_FUNCS:
        raise CaptureDamagedError(
            f"{path}: {what}'s checksum {recorded!r} uses an unknown algorithm", path
        )
    got = _checksum_of(obj, "index_checksum", algorithm)  # (an edited NaN changes it too)
    if got != recorded:
        raise CaptureDamagedError(
            f"{path}: {what}'s checksum {got} differs from the recorded {recorded} "
            "(the file was edited or damaged)",
            path,
        )


def _with_checksum(obj: dict[str, Any]) -> dict[str, Any]:
    return {**obj, "index_checksum": _checksum_of(obj)}


def _atomic_write_json(path: str, obj: Any, step: str = "index") -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with os.fdopen(_open_new(tmp), "w", encoding="utf-8") as f:
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
    """The JSON in ``path`` (at most :data:`MAX_INDEX_BYTES`, nested at most
    :data:`MAX_JSON_DEPTH` deep); :class:`CaptureDamagedError` naming the file when it is not
    JSON, too large, too deep, or not a regular file. A missing file is FileNotFoundError."""
    return _parse_json(_read_small(path), path, "")


def _read_small(path: str) -> bytes:
    """The bytes of an index file or journal of the store, refused past
    :data:`MAX_INDEX_BYTES` before they are read."""
    try:
        with _open_regular(path, missing=FileNotFoundError, what="an index file") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_INDEX_BYTES:
                raise CaptureDamagedError(
                    f"{path}: {size} bytes, more than an index file may hold "
                    f"({MAX_INDEX_BYTES} bytes)",
                    path,
                )
            return f.read(MAX_INDEX_BYTES + 1)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise CaptureDamagedError(f"{path}: cannot be read: {e.strerror or e}", path) from e


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _journal_path(part_path: str) -> str:
    return part_path[: -len(".json")] + ".journal"


def journal_line(entry: dict[str, Any], layers: dict[str, Any] | None) -> bytes:
    """One line of a per-rank journal: a shard's index entry (and the layer table when it
    changed), with its own checksum; appended when the shard is complete."""
    obj: dict[str, Any] = {"entry": entry}
    if layers is not None:
        obj["layers"] = layers
    obj["checksum"] = _checksum_of(obj, "checksum")
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def _read_journal(path: str) -> list[dict[str, Any]]:
    """The complete lines of a journal (a torn last line, without its newline, is ignored:
    its shard was never listed), each checked by :func:`check_journal_line`; a complete line
    that is damaged is :class:`CaptureDamagedError`."""
    try:
        data = _read_small(path)
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")[:-1]  # what follows the last newline is torn
    out = []
    for i, line in enumerate(lines, 1):
        obj = _parse_json(line, path, f"line {i}")
        check_journal_line(path, i, obj)
        out.append(obj)
    return out


def _load_part(path: str) -> dict[str, Any]:
    """A per-rank index file with its journal replayed, checked by :func:`check_part` (the
    structure the reader and the writer rely on, internal consistency, its own checksum) and
    each journal line by :func:`check_journal_line`."""
    part = _load_json(path)
    m = _INDEX_NAME.match(os.path.basename(path))
    check_part(path, part, name_number(m.group(1)) if m else None)
    rank = part["rank"]
    # Shards completed after the index was last written: one journal line each.
    journal = _journal_path(path)
    listed = {s["file"]: s for s in part["shards"]}
    shards, layers = list(part["shards"]), dict(part["layers"])
    for obj in _read_journal(journal):
        entry = obj["entry"]
        name = entry.get("file")
        if isinstance(name, str) and name in listed:  # (any other name: refused below)
            if listed[name] != entry:
                raise CaptureDamagedError(
                    f"{journal}: the entry of {name} differs from the one in {path}", journal
                )
            continue  # compacted into the index already (a crash before the journal was removed)
        if "layers" in obj:
            layers = dict(obj["layers"])
        listed[str(name)] = entry
        shards.append(entry)
    if len(shards) > len(part["shards"]):
        _check_entries(journal, shards, rank, part.get("format_version", 1), layers)
        part = {**part, "shards": shards, "layers": layers}
    return part


# -- the store's JSON documents: untrusted input, one check per kind ----------------------------
# A store may come from someone else (docs/integrity.md, "Received stores: the threat model").
# Every JSON document of it is parsed with bounds (size, nesting) and checked against the one
# schema of its kind below, by the readers, verify and the writer's resume alike: what verify
# passes, every reader reads. The kinds: a rank's index (check_part), a journal line
# (check_journal_line), the merged index (check_merged), a shard's header (check_header).

#: How deep a store's JSON may nest (the index nests 5 deep; ``settings`` and ``meta`` are the
#: caller's, refused deeper than this when written).
MAX_JSON_DEPTH = 64
#: The largest index file (or journal) read: ~4 million shard entries.
MAX_INDEX_BYTES = 1 << 30
#: The largest shard header read (safetensors' own limit).
MAX_HEADER_BYTES = 100_000_000
#: The largest ``world_size`` an index may record.
MAX_WORLD_SIZE = 1 << 20
#: The most dimensions a row shape or a header's tensor may have.
MAX_DIMS = 32
_MAX_ELEMENTS = 1 << 62
_STORABLE_NAMES = {dtype_name(d) for d in _DTYPE_TO_ST}
_CHECKSUM_TEXT = re.compile(r"[a-z0-9]+:[0-9a-f]{8}\Z")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _too_deep(obj: Any, limit: int) -> bool:
    """Whether ``obj`` nests more than ``limit`` containers deep (iterative: no recursion)."""
    if not isinstance(obj, (dict, list)):
        return False
    stack = [(obj, 1)]
    while stack:
        o, depth = stack.pop()
        if depth > limit:
            return True
        items = o.values() if isinstance(o, dict) else o
        stack.extend((c, depth + 1) for c in items if isinstance(c, (dict, list)))
    return False


def json_depth_error(value: Any) -> str | None:
    """Why ``value`` (plain JSON data) cannot go into a store's index (nested more than
    :data:`MAX_JSON_DEPTH` deep), or ``None``; the writer checks ``settings`` and ``meta``.

    Example::

        >>> from pyhook.store.format import json_depth_error
        >>> deep = []
        >>> for _ in range(100):
        ...     deep = [deep]
        >>> json_depth_error({"a": [1, 2]}), json_depth_error(deep)
        (None, 'nested more than 64 levels deep')
    """
    if _too_deep(value, MAX_JSON_DEPTH):
        return f"nested more than {MAX_JSON_DEPTH} levels deep"
    return None


def _parse_json(data: bytes, path: str, what: str) -> Any:
    """``data`` (a store's JSON document ``what`` of ``path``, ``""`` for the whole file)
    parsed, at most :data:`MAX_JSON_DEPTH` deep; anything else (not UTF-8, not JSON, ``NaN``,
    too deep) is :class:`CaptureDamagedError` naming the file, never a RecursionError."""
    where = f"{path}: {what + ' ' if what else ''}"
    try:
        obj = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except RecursionError:
        obj = None  # nested too deep for the parser: said below, without the traceback
        too_deep = True
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, NaN, a 5,000-digit number
        raise CaptureDamagedError(f"{where}is not valid JSON ({e})", path) from None
    else:
        too_deep = _too_deep(obj, MAX_JSON_DEPTH)
    if too_deep:
        raise CaptureDamagedError(
            f"{where}is nested more than {MAX_JSON_DEPTH} levels deep (no pyhook store is)", path
        )
    return obj


def _name_in(value: Any, names: Any) -> bool:
    """``value in names`` for a JSON value of any type (a list is not hashable)."""
    return isinstance(value, str) and value in names


def _fail(path: str, what: str) -> CaptureDamagedError:
    return CaptureDamagedError(f"{path}: {what}", path)


def _count(v: Any) -> bool:
    return _is_int(v) and v >= 0


def _elements(shape: Any) -> int | None:
    """The number of elements of ``shape`` when it is a valid shape (a list of at most
    :data:`MAX_DIMS` non-negative integers, with fewer than 2**62 elements however its zeros
    are placed), else ``None``."""
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(map(_count, shape)):
        return None
    n = nonzero = 1
    for d in shape:
        n *= d
        nonzero *= max(d, 1)
    return n if nonzero < _MAX_ELEMENTS else None


#: The fields of a layer's ``encoding`` (pipeline/encoding.py) and what each must be.
_ENCODING_FIELDS = {
    "quantize": "text",
    "compress": "text",
    "stored": "dtype",
    "scale": "layer",
    "chunks": "layer",
    "level": "int",
    "chunk_rows": "positive",
    "byte_planes": "planes",
}


def check_layers(path: str, layers: Any) -> None:
    """The schema of an index's layer table: layer name -> ``dtype`` (a name the store holds),
    ``row_shape`` (a valid shape), and for a compact store's layer its ``encoding``.

    Example::

        >>> from pyhook.store.format import check_layers
        >>> check_layers("index-r000.json", {"h": {"dtype": "float32", "row_shape": [4]}})
        >>> try:
        ...     check_layers("index-r000.json", {"h": {"dtype": "float32", "row_shape": [-4]}})
        ... except ValueError as e:
        ...     print(e)
        index-r000.json: layer 'h' has row shape [-4], not a list of at most 32 non-negative integers
    """
    if not isinstance(layers, dict):
        raise _fail(path, "the index has no 'layers' table")
    for name, info in layers.items():
        if not name:
            raise _fail(path, "the layer table has a layer without a name")
        if not isinstance(info, dict):
            raise _fail(path, f"layer {name!r} of the layer table is not a table")
        if not _name_in(info.get("dtype"), _STORABLE_NAMES):
            raise _fail(
                path,
                f"layer {name!r} has dtype {info.get('dtype')!r}, which a capture cannot hold",
            )
        if _elements(info.get("row_shape")) is None:
            raise _fail(
                path,
                f"layer {name!r} has row shape {info.get('row_shape')!r}, not a list of at most "
                f"{MAX_DIMS} non-negative integers",
            )
        enc = info.get("encoding")
        if enc is None:
            continue
        if not isinstance(enc, dict):
            raise _fail(path, f"layer {name!r} has an encoding that is not a table: {enc!r}")
        for key, value in enc.items():
            kind = _ENCODING_FIELDS.get(key)
            ok = {
                "text": isinstance(value, str),
                "dtype": _name_in(value, _STORABLE_NAMES),
                "layer": _name_in(value, layers),
                "int": _is_int(value),
                "positive": _is_int(value) and value >= 1,
                "planes": value in (1, 2, 4, 8) and _is_int(value),
                None: False,
            }[kind]
            if not ok:
                raise _fail(
                    path, f"layer {name!r} has encoding field {key!r} = {value!r}, not valid"
                )
        why = _encoding_schema[0](name, info, layers) if _encoding_schema else None
        if why is not None:
            raise _fail(path, f"layer {name!r} {why}")


def check_part(path: str, part: Any, rank: int | None) -> None:
    """The schema of a rank's index file (``index-rNNN.json``, rank ``rank`` by its name), its
    shard list's bookkeeping (:func:`_check_entries`) and its own checksum; what the readers,
    verify and a resume check every rank's index with.

    Example::

        >>> import json, os, tempfile, torch
        >>> from pyhook.store import ShardWriter, CaptureDamagedError
        >>> from pyhook.store.format import check_part
        >>> out = tempfile.mkdtemp()
        >>> with ShardWriter(out) as w:
        ...     w.add({"x": torch.ones(3, 4)}, examples=3)
        >>> part = json.load(open(os.path.join(out, "index-r000.json")))
        >>> check_part("index-r000.json", part, 0)
        >>> part["world_size"] = 1.0
        >>> try:
        ...     check_part("index-r000.json", part, 0)
        ... except CaptureDamagedError as e:
        ...     print(e.path)
        index-r000.json
    """
    if not isinstance(part, dict):
        raise _fail(path, f"the index is a JSON {type(part).__name__}, not an object")
    for key, kind in (("layers", dict), ("shards", list), ("settings", dict)):
        if not isinstance(part.get(key), kind):
            raise _fail(path, f"the index has no {key!r} {'list' if kind is list else 'table'}")
    if rank is None:
        rank = part.get("rank")
    world = part.get("world_size")
    if (
        part.get("rank") != rank
        or not _is_int(rank)
        or not _is_int(world)
        or not 0 <= rank < world <= MAX_WORLD_SIZE
    ):
        raise _fail(
            path,
            f"rank {part.get('rank')!r} / world_size {world!r} do not match the file name "
            f"(a rank of 0 <= rank < world_size <= {MAX_WORLD_SIZE})",
        )
    for key, ok in (
        ("format", lambda v: v == "pyhook-capture"),
        ("format_version", lambda v: _is_int(v) and v >= 1),
        ("pyhook_version", lambda v: isinstance(v, str)),
        ("torch_version", lambda v: v is None or isinstance(v, str)),
        ("meta", lambda v: isinstance(v, dict)),
        ("index_checksum", lambda v: isinstance(v, str)),
    ):
        if key in part and not ok(part[key]):
            raise _fail(path, f"the index's {key!r} is {part[key]!r}, not valid")
    check_layers(path, part["layers"])
    _check_entries(path, part["shards"], rank, part.get("format_version", 1), part["layers"])
    _check_checksum(path, part)


def check_journal_line(path: str, i: int, obj: Any) -> None:
    """The schema of line ``i`` of a rank's journal (its shard entry, the layer table when it
    changed, its checksum); the entries' bookkeeping is checked with the index's.

    Example::

        >>> import json
        >>> from pyhook.store.format import check_journal_line, journal_line
        >>> line = json.loads(journal_line({"file": "shard-r000-000001.safetensors"}, None))
        >>> check_journal_line("index-r000.journal", 1, line)
        >>> line["entry"]["examples"] = 5
        >>> try:
        ...     check_journal_line("index-r000.journal", 1, line)
        ... except ValueError as e:
        ...     print(e)
        index-r000.journal: line 1 does not match its checksum (edited or damaged)
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("entry"), dict):
        raise _fail(path, f"line {i} holds no shard entry")
    if "layers" in obj:
        check_layers(path, obj["layers"])
    algorithm = str(obj.get("checksum")).partition(":")[0]
    if algorithm not in _CHECKSUM_FUNCS or obj["checksum"] != _checksum_of(
        obj, "checksum", algorithm
    ):
        raise _fail(path, f"line {i} does not match its checksum (edited or damaged)")


def check_merged(path: str, obj: Any) -> None:
    """The schema of the merged ``index.json`` (what the writer compares a resume with and
    verify checks): pyhook's format, the settings, meta, world size, shards, examples and
    layers, and its own checksum.

    Example::

        >>> import json, os, tempfile, torch
        >>> from pyhook.store import ShardWriter
        >>> from pyhook.store.format import check_merged
        >>> out = tempfile.mkdtemp()
        >>> with ShardWriter(out) as w:
        ...     w.add({"x": torch.ones(3, 4)}, examples=3)
        >>> check_merged("index.json", json.load(open(os.path.join(out, "index.json"))))
    """
    if not isinstance(obj, dict):
        raise _fail(path, f"the merged index is a JSON {type(obj).__name__}, not an object")
    for key, ok in (
        ("format", lambda v: v == "pyhook-capture"),
        ("settings", lambda v: isinstance(v, dict)),
        ("world_size", lambda v: _is_int(v) and 1 <= v <= MAX_WORLD_SIZE),
        ("shards", lambda v: isinstance(v, list)),
        ("examples", _count),
    ):
        if key not in obj or not ok(obj[key]):
            raise _fail(path, f"the merged index's {key!r} is {obj.get(key)!r}, not valid")
    if not isinstance(obj.get("meta", {}), dict):
        raise _fail(path, f"the merged index's 'meta' is {obj['meta']!r}, not a table")
    check_layers(path, obj.get("layers"))
    _check_checksum(path, obj, "the merged index")


def check_header(path: str, header: Any, data_start: int, size: int) -> None:
    """The schema of a shard's safetensors header (``data_start``: where its data begins in
    the file of ``size`` bytes), what every reader relies on: ``__metadata__`` a table of
    strings; each tensor a dtype pyhook reads, a valid shape, and data offsets holding exactly
    its bytes; the tensors' bytes tile the data (no overlap, no gap, nothing after them), as
    safetensors requires.

    Example::

        >>> from pyhook.store.format import check_header
        >>> a = {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
        >>> b = {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}  # a's bytes again
        >>> check_header("s.safetensors", {"a": a}, 64, 88)
        >>> try:
        ...     check_header("s.safetensors", {"a": a, "b": b}, 64, 88)
        ... except ValueError as e:
        ...     print(e)  # doctest: +ELLIPSIS
        s.safetensors: tensor 'b' has data offsets [0, 24] in the header, which overlap the bytes of tensor 'a' ...
    """
    if not isinstance(header, dict):
        raise _fail(path, "the header is not a JSON object")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _fail(path, "the header's __metadata__ is not a table of strings")
    spans: list[tuple[int, int, str]] = []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(t, dict):
            raise _fail(path, f"tensor {name!r} of the header is not a table")
        code = t.get("dtype")
        if not _name_in(code, _ST_TO_DTYPE):
            raise _fail(
                path,
                f"tensor {name!r} has dtype {code!r} in the header, not one of "
                f"{', '.join(_ST_TO_DTYPE)}",
            )
        n = _elements(t.get("shape"))
        if n is None:
            raise _fail(
                path,
                f"tensor {name!r} has shape {t.get('shape')!r} in the header, not a list of at "
                f"most {MAX_DIMS} non-negative integers",
            )
        off = t.get("data_offsets")
        if not (isinstance(off, list) and len(off) == 2 and all(map(_count, off))):
            raise _fail(
                path,
                f"tensor {name!r} has data offsets {off!r} in the header, not two non-negative "
                "integers",
            )
        nbytes = n * _ST_TO_DTYPE[code].itemsize
        if off[1] - off[0] != nbytes:
            raise _fail(
                path,
                f"tensor {name!r} has data offsets {off} in the header: {off[1] - off[0]} bytes, "
                f"where its shape {t['shape']} {code} takes {nbytes}",
            )
        spans.append((off[0], off[1], name))
    at, last = 0, None
    for begin, end, name in sorted(spans):
        if begin != at:
            what = f"overlap the bytes of tensor {last!r}" if begin < at else "leave a gap before"
            raise _fail(
                path,
                f"tensor {name!r} has data offsets {[begin, end]} in the header, which {what} "
                f"(byte {at} of the data); each tensor must have bytes of its own",
            )
        at, last = end, name
    if data_start + at != size:
        raise _fail(
            path,
            f"the header's tensors end at byte {data_start + at} of the file, which has {size} "
            "bytes (the header does not describe the file)",
        )


def _check_entries(
    path: str, shards: list[Any], rank: Any, version: Any, layers: dict[str, Any]
) -> None:
    """The schema of each shard entry, and the list's bookkeeping: shard numbers increasing,
    examples contiguous from 0 in the order listed (``first_example``), row counts that are
    integers, of layers in the table ``layers``."""
    seen: set[str] = set()
    next_example = 0
    last_number = -1
    for s in shards:
        name = s.get("file") if isinstance(s, dict) else None
        m = _SHARD_NAME.match(name) if isinstance(name, str) else None
        if (
            m is None
            or len(m.group(2)) > 18  # (no shard number has more digits)
            or name_number(m.group(1)) != rank
            or not isinstance(name, str)
        ):
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
        rows, examples = s.get("rows"), s.get("examples")
        if not isinstance(rows, dict) or not _is_int(examples):
            raise CaptureDamagedError(
                f"{path}: the entry of {name} has no 'rows' table or 'examples' count", path
            )
        if examples < 0 or not all(_is_int(r) and r >= 0 for r in rows.values()):
            raise CaptureDamagedError(
                f"{path}: the entry of {name} has counts that are not non-negative integers "
                f"(examples {examples!r}, rows {rows})",
                path,
            )
        for layer, n in rows.items():
            info = layers.get(layer)
            if isinstance(info, dict) and "encoding" in info and _encoding_schema:
                for table, want in _encoding_schema[1](info, n).items():
                    if rows.get(table) != want:
                        raise _fail(
                            path,
                            f"the entry of {name} lists {rows.get(table)!r} rows of {table!r}, "
                            f"where {n} rows of layer {layer!r} need {want}",
                        )
            if layer not in layers:
                raise _fail(
                    path,
                    f"the entry of {name} lists rows of layer {layer!r}, which the layer "
                    "table lacks",
                )
        size = s.get("bytes")
        if (size is not None or (isinstance(version, int) and version >= 2)) and (
            not _is_int(size) or size < 8
        ):
            raise CaptureDamagedError(
                f"{path}: the entry of {name} records a size of {size!r} bytes, not an integer",
                path,
            )
        checksum = s.get("checksum")
        if checksum is not None and not (
            isinstance(checksum, str) and _CHECKSUM_TEXT.match(checksum)
        ):
            raise _fail(path, f"the entry of {name} records a checksum {checksum!r}, not valid")
        if "rank" in s and s["rank"] != rank:
            raise _fail(path, f"the entry of {name} records rank {s['rank']!r}, not {rank}")
        number = name_number(m.group(2))
        if number <= last_number:
            raise CaptureDamagedError(
                f"{path}: {name} is listed after shard {last_number} (the shard list is out of "
                "order)",
                path,
            )
        last_number = number
        if "first_example" in s and s["first_example"] != next_example:
            raise CaptureDamagedError(
                f"{path}: {name} starts at example {s['first_example']!r}, but the shards "
                f"before it end at example {next_example} (the shard list is not "
                "contiguous: reordered, edited, or an entry removed)",
                path,
            )
        skipped = s.get("skipped", [])
        end = next_example + examples
        if not isinstance(skipped, list) or not all(
            isinstance(r, list)
            and len(r) == 2
            and all(map(_count, r))
            and r[0] < r[1]
            and ("first_example" not in s or (next_example <= r[0] and r[1] <= end))
            for r in skipped
        ):
            raise _fail(
                path,
                f"the entry of {name} records skipped examples {skipped!r}, not ranges of "
                "examples inside the shard's",
            )
        next_example = end


def _glob(out: str, pattern: str) -> list[str]:
    """The files of directory ``out`` matching ``pattern`` (``out`` taken literally: a path
    such as ``runs/lr[0.1]`` holds glob characters)."""
    return glob.glob(os.path.join(glob.escape(out), pattern))


def _part_path(out: str, rank: int) -> str:
    return os.path.join(out, f"index-r{rank:03d}.json")


#: A name that claims to be a rank's index file (``index-r000.json`` is rank 0's, the only one).
_INDEX_NAME = re.compile(r"index-r(\d+)\.json\Z")


def name_number(digits: str) -> int:
    """The number ``digits`` (of a store file's name) spells; past 18 digits, which no rank or
    shard number has, 10**18 (Python's ``int`` refuses 4,300 digits with a bare ValueError)."""
    return int(digits) if len(digits) <= 18 else 10**18


def rank_indexes(names: Iterable[str], where: str) -> tuple[list[str], list[CaptureDamagedError]]:
    """The rank index files among the file ``names`` of the store in ``where``, sorted by rank,
    and one error per name that claims a rank without being that rank's index name.

    Only the exact names the writer gives are read: ``index-r000.json`` is rank 0's index, and
    copies beside it (``index-r000 (1).json``, ``index-r000.bak.json``) are not part of the
    store. A name that spells a rank otherwise (``index-r0000.json``: rank 0 again, or a rank
    past any world size) would be a second index of one rank, so it is refused by name.

    Example::

        >>> from pyhook.store.format import rank_indexes
        >>> names, errors = rank_indexes(["index-r001.json", "index-r000 (1).json", "index-r000.json"], "out")
        >>> names, errors
        (['index-r000.json', 'index-r001.json'], [])
        >>> print(rank_indexes(["index-r000.json", "index-r0000.json"], "out")[1][0])
        out/index-r0000.json: claims rank 0, whose index file is index-r000.json (pyhook names it no other way: a copy? remove or rename it)
    """
    found: dict[int, str] = {}
    errors: list[CaptureDamagedError] = []
    for name in names:
        m = _INDEX_NAME.match(name)
        if m is None:
            continue
        path = os.path.join(where, name)
        digits = m.group(1)
        rank = name_number(digits)
        if rank >= MAX_WORLD_SIZE:
            shown = digits if len(digits) <= 12 else f"{digits[:12]}... ({len(digits)} digits)"
            errors.append(
                CaptureDamagedError(
                    f"{path}: claims rank {shown}, past any world size ({MAX_WORLD_SIZE}); not "
                    "an index file pyhook writes",
                    path,
                )
            )
        elif name != f"index-r{rank:03d}.json":
            errors.append(
                CaptureDamagedError(
                    f"{path}: claims rank {rank}, whose index file is index-r{rank:03d}.json "
                    "(pyhook names it no other way: a copy? remove or rename it)",
                    path,
                )
            )
        else:
            found[rank] = name
    return [found[r] for r in sorted(found)], errors


def stray_indexes(
    where: str, listing: Iterable[str], names: list[str], errors: list[CaptureDamagedError]
) -> list[str]:
    """Notes naming the files beside a store's index files that look like copies of one
    (``index-r000 (1).json``): not read, not part of the store."""
    refused = {os.path.basename(e.path) for e in errors if e.path}
    return [
        f"{os.path.join(where, n)}: not a file of the store (only index-rNNN.json is read): "
        "ignored; a copy of an index file?"
        for n in sorted(listing)
        if n.startswith("index-r")
        and n.endswith(".json")
        and "/" not in n
        and n not in names
        and n not in refused
    ]


def index_files(out: str) -> list[str]:
    """The paths of the rank index files in directory ``out`` (:func:`rank_indexes`), sorted by
    rank; :class:`CaptureDamagedError` naming the first file that claims a rank by another
    name."""
    try:
        names = os.listdir(out)
    except OSError:
        return []  # not a directory: the caller's own error says so
    found, errors = rank_indexes(names, out)
    if errors:
        raise errors[0]
    return [os.path.join(out, n) for n in found]


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


def check_same_capture(paths: Sequence[str], parts: Sequence[dict[str, Any]]) -> None:
    """Every rank's index (``parts``, read from ``paths``) of one capture: the same
    ``world_size`` and settings as the first; :class:`CaptureDamagedError` naming the file."""
    first = parts[0]
    for path, part in zip(paths[1:], parts[1:]):
        if part["world_size"] != first["world_size"] or part["settings"] != first["settings"]:
            what = (
                f"world_size {part['world_size']} here, {first['world_size']} there"
                if part["world_size"] != first["world_size"]
                else "other settings"
            )
            raise CaptureDamagedError(
                f"{path}: not an index of the same capture as {os.path.basename(paths[0])} "
                f"({what}); a rank's index from another capture?",
                path,
            )


def merged_index(out: str) -> dict[str, Any]:
    """Merge the per-rank index files of a capture directory into one index dict (for a URL
    too: :func:`pyhook.store.merged_index` is :func:`.transport.merged_index_of`)."""
    paths = index_files(out)
    parts = [_load_part(p) for p in paths]
    if not parts:
        raise FileNotFoundError(f"{out!r} holds no pyhook capture (no index-r*.json files)")
    first = parts[0]
    check_same_capture(paths, parts)
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
        # 3 where a rank stored encoded layers (pipeline/encoding.py), else this version
        "format_version": max([FORMAT_VERSION, *(p.get("format_version", 1) for p in parts)]),
        "pyhook_version": first.get("pyhook_version"),
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


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def _file_checksum(path: str, algorithm: str) -> str:
    crc = _CHECKSUM_FUNCS[algorithm]
    value = 0
    with _open_regular(path) as f:
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
        st = os.lstat(path)
    except FileNotFoundError:
        raise CaptureDamagedError(f"{path}: missing (listed in the index)", path) from None
    except OSError as e:
        raise CaptureDamagedError(f"{path}: cannot be read: {e.strerror or e}", path) from e
    if stat.S_ISLNK(st.st_mode):  # only files in the capture directory itself are read
        raise _link_error(path)
    if not stat.S_ISREG(st.st_mode):  # a FIFO would block the read below forever
        raise CaptureDamagedError(f"{path}: {_file_kind(st.st_mode)}, not a shard file", path)
    want = entry.get("bytes")
    if want is not None and not _is_int(want):
        raise CaptureDamagedError(
            f"{path}: the index records a size of {want!r} bytes, not an integer", path
        )
    if want is not None and st.st_size != want:
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
        if h.get("dtype") != code and "encoding" not in info:
            raise CaptureDamagedError(
                f"{path}: layer {name!r} has dtype {h.get('dtype')} in the header, the index "
                f"records {info.get('dtype')} ({code})",
                path,
            )
        shape = [rows, *info.get("row_shape", [])]
        if "encoding" in info:  # a compact store's layer: its encoded tensor (pipeline/encoding.py)
            if _encoded_layout is None:  # pragma: no cover - set when pyhook is imported
                raise CaptureDamagedError(
                    f"{path}: layer {name!r} is encoded; import pyhook to read it", path
                )
            code, shape = _encoded_layout(info, rows, h)
            if h.get("dtype") != code:
                raise CaptureDamagedError(
                    f"{path}: layer {name!r} is stored as {h.get('dtype')} in the header, its "
                    f"encoding {info['encoding']} stores {code}",
                    path,
                )
        if h.get("shape") != shape:
            raise CaptureDamagedError(
                f"{path}: layer {name!r} has shape {h.get('shape')} in the header, the index "
                f"records {shape}",
                path,
            )
        # (its data offsets: checked with the header, by check_header)
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
