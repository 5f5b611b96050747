"""Checking a capture against its index: one shard (:func:`_check_shard`, used by the reader,
the writer's resume and ``pyhook verify``) or a whole directory (:func:`verify_capture`).
"""

from __future__ import annotations

import os
import stat
from typing import Any

import torch

from .format import (
    _CHECKSUM_FUNCS,
    _DTYPE_TO_ST,
    _ST_TO_DTYPE,
    CaptureDamagedError,
    _check_checksum,
    _directory_arg,
    _file_kind,
    _glob,
    _is_int,
    _load_json,
    _load_part,
    _open_regular,
    _read_header,
)
from .remote import is_url


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
        st = os.stat(path)
    except FileNotFoundError:
        raise CaptureDamagedError(f"{path}: missing (listed in the index)", path) from None
    except OSError as e:
        raise CaptureDamagedError(f"{path}: cannot be read: {e.strerror or e}", path) from e
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
    if is_url(path):
        from .remote import verify_remote

        return verify_remote(str(path))
    out = _directory_arg("path", path)
    if not os.path.isdir(out):
        return [f"{out}: no such capture directory"], []
    problems: list[str] = []
    notes: list[str] = []
    parts = sorted(_glob(out, "index-r*.json"))
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
    merged = os.path.join(out, "index.json")
    if os.path.exists(merged):
        try:
            obj = _load_json(merged)
            if not isinstance(obj, dict):
                raise CaptureDamagedError(f"{merged}: the index is not a JSON object", merged)
            _check_checksum(merged, obj, "the merged index")
        except CaptureDamagedError as e:
            problems.append(f"{e} (rewritten from the per-rank index files on the next close)")
    for p in sorted(_glob(out, "shard-r*.safetensors")):
        if os.path.basename(p) not in seen and not problems:
            notes.append(f"{p}: not listed in the index (debris, removed on the next resume)")
    return problems, notes
