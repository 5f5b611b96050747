"""Checking a whole capture against its index (:func:`verify_capture`, ``pyhook verify``),
local or remote; one shard's check (``_check_shard``, also used by the reader, the writer's resume
and the remote shard cache) is the format's, in :mod:`.format`.
"""

from __future__ import annotations

import os
import re
from typing import Any

from .format import (
    _LINK_ADVICE,
    CaptureDamagedError,
    _check_shard,
    _directory_arg,
    _glob,
    _load_json,
    _load_part,
    check_merged,
    check_same_capture,
    name_number,
    rank_indexes,
    store_links,
    stray_indexes,
)
from .transport import is_url

#: Missing ranks named one per line, at most (an index may record a world of a million ranks).
_SHOWN = 20


def verify_capture(path: str | os.PathLike[str]) -> tuple[list[str], list[str]]:
    """Check a capture directory completely: ``(problems, notes)``, one line each.

    Every index file is read and checked, and every listed shard against its entry: present,
    a regular file, the recorded size, a header with the recorded dtypes and shapes naming this
    shard, and the recorded checksum of its bytes; then the capture as a whole: every rank's
    index file there, all of one capture, each row stored once (:func:`duplicate_rows`). A
    URL (``s3://...``) gets the same checks, its shards downloaded one at a time. A problem
    names the file (or URL) and what differs; a note says what could not be checked (a shard
    of an older store has no checksum).

    Example::

        >>> import tempfile, torch, pyhook.store as store
        >>> out = tempfile.mkdtemp()
        >>> with store.ShardWriter(out) as w:
        ...     w.add({"x": torch.ones(3, 4)}, examples=3)
        >>> store.verify_capture(out)
        ([], [])
    """
    if is_url(path):
        from .transport import verify_remote

        held: list[tuple[str, Any]] = []  # (shard, its row index), read while it is downloaded

        def check(shard: str, entry: dict, layers: dict, header: dict) -> None:
            check_decodable(shard, entry, layers, header)
            held.append((entry["file"], _row_keys(shard)))

        def finish(
            local: str, names: list[str], loaded: list[tuple[str, dict]], problems: list[str]
        ) -> list[str]:
            return _across_ranks(local, names, loaded, problems, held)

        return verify_remote(str(path), check=check, finish=finish)
    out = _directory_arg("path", path)
    if not os.path.isdir(out):
        return [f"{out}: no such capture directory"], []
    problems: list[str] = []
    notes: list[str] = []
    # A link in place of a store's file: never followed (named, whether or not it is read).
    problems += [f"{p}: is a symbolic link; {_LINK_ADVICE}" for p in store_links(out)]
    names, errors = rank_indexes(os.listdir(out), out)
    problems += [str(e) for e in errors]
    parts = [os.path.join(out, n) for n in names]
    if not parts and not errors:
        return [f"{out}: holds no pyhook capture (no index-r*.json files)"], []
    notes += stray_indexes(out, os.listdir(out), names, errors)
    seen: set[str] = set()
    loaded: list[tuple[str, dict]] = []
    for p in parts:
        try:
            part = _load_part(p)
        except CaptureDamagedError as e:
            problems.append(str(e))
            continue
        loaded.append((p, part))
        for s in part["shards"]:
            seen.add(s["file"])
            try:
                header, _ = _check_shard(out, s, part["layers"], checksum=True, notes=notes)
                check_decodable(os.path.join(out, s["file"]), s, part["layers"], header)
            except CaptureDamagedError as e:
                problems.append(str(e))
    problems += _across_ranks(out, parts, loaded, problems)
    merged = os.path.join(out, "index.json")
    if os.path.exists(merged):
        try:
            check_merged(merged, _load_json(merged))
        except CaptureDamagedError as e:
            problems.append(f"{e} (rewritten from the per-rank index files on the next close)")
    for p in sorted(_glob(out, "shard-r*.safetensors")):
        if os.path.basename(p) not in seen and not problems:
            notes.append(f"{p}: not listed in the index (debris, removed on the next resume)")
    return list(dict.fromkeys(problems)), notes  # (a linked index file: named once)


def _across_ranks(
    out: str,
    names: list[str],
    loaded: list[tuple[str, dict]],
    problems: list[str],
    held: list[tuple[str, Any]] | None = None,
) -> list[str]:
    """The checks of a capture as a whole, after each index file and shard was checked alone
    (``problems``: what those found), alike for a directory and a URL (whose index files are
    in the temporary directory ``out``): every rank's index file is there (``names``: the
    paths of those present, even if damaged), all ``loaded`` ``(path, index)`` are of one
    capture, and each (example, position) is stored once (:func:`duplicate_rows`; ``held``:
    the ``(shard, row index)`` of each shard when they were read as they were checked)."""
    found: list[str] = []
    ranks = set()
    for p in names:
        m = re.fullmatch(r"index-r(\d+)\.json", os.path.basename(p))
        if m:
            ranks.add(name_number(m.group(1)))
    world = max((part["world_size"] for _, part in loaded), default=0)
    missing = sorted(set(range(world)) - ranks)  # ranks whose rows the reader would not read
    for r in missing[:_SHOWN]:
        found.append(
            f"{os.path.join(out, f'index-r{r:03d}.json')}: missing (rank {r} of {world}: its "
            "rows are not read; deleted, or that rank crashed or is still running)"
        )
    if len(missing) > _SHOWN:
        found.append(
            f"{out}: the index files of {len(missing) - _SHOWN} more of the {world} ranks are "
            "missing too"
        )
    if not problems and not found:
        try:  # the ranks' indexes belong together (the ones read above, not read again)
            check_same_capture([p for p, _ in loaded], [part for _, part in loaded])
        except CaptureDamagedError as e:
            found.append(str(e))
    if not problems and not found:  # each (example, position) once across every rank's shards
        found += duplicate_rows(out, loaded) if held is None else _repeated(out, held)
    return found


def check_decodable(path: str, entry: dict, layers: dict, header: dict) -> None:
    """What the readers rely on beyond a shard's header and checksum, for the shard at
    ``path`` (its index ``entry``, the index's ``layers``, its checked ``header``): each
    compressed layer's zstd frame table tiles its bytes and each frame decodes to its chunk's
    rows (:func:`.encoding.check_frames`, from the frames' headers), and the texts' lengths
    are >= 0 and add up to the shard's text bytes, each text valid utf-8. Raises
    :class:`CaptureDamagedError` naming the file. A received store is untrusted input: what
    verify passes, the readers read (docs/integrity.md).

    Example (a store whose text is not utf-8, its checksums right)::

        >>> import tempfile, torch, pyhook.store as store
        >>> out = tempfile.mkdtemp()
        >>> with store.ShardWriter(out) as w:
        ...     w.add({"x": torch.zeros(1, 1), "__text_lengths__": torch.tensor([3]),
        ...            "__text_bytes__": torch.tensor([104, 255, 33], dtype=torch.uint8)},
        ...           examples=1)
        >>> (problem,), _ = store.verify_capture(out)
        >>> problem.split(": ", 1)[1]
        "text 0 in '__text_bytes__' is not utf-8 (invalid start byte)"
    """
    import numpy as np
    from safetensors import safe_open

    from . import encoding
    from .annotations import TEXT_BYTES, TEXT_LENGTHS

    def fail(what: str) -> CaptureDamagedError:
        return CaptureDamagedError(f"{path}: {what}", path)

    def load(f, name: str) -> np.ndarray:
        return f.get_tensor(name).numpy()

    names = entry["rows"]
    compressed = [
        n
        for n in names
        if isinstance(layers.get(n), dict) and (layers[n].get("encoding") or {}).get("compress")
    ]
    texts = TEXT_LENGTHS in names or TEXT_BYTES in names
    if not compressed and not texts:
        return
    try:
        with safe_open(path, framework="pt") as f:
            for n in compressed:
                info = layers[n]
                problem = encoding.check_frames(
                    info, int(names[n]), load(f, n), load(f, info["encoding"]["chunks"])
                )
                if problem:
                    raise fail(f"layer {n!r} {problem} (the reader could not decode it)")
            if texts:
                if TEXT_LENGTHS not in names or TEXT_BYTES not in names:
                    raise fail(f"holds only one of {TEXT_LENGTHS!r} and {TEXT_BYTES!r}")
                lengths = load(f, TEXT_LENGTHS).astype(np.int64, copy=False).reshape(-1)
                raw = load(f, TEXT_BYTES).reshape(-1)
                if lengths.size and int(lengths.min()) < 0:
                    i = int(np.argmin(lengths))
                    raise fail(f"text {i} has length {int(lengths[i])} in {TEXT_LENGTHS!r}")
                total = int(lengths.sum())
                if (lengths.size and int(lengths.max()) > raw.size) or total != raw.size:
                    raise fail(
                        f"its texts' lengths ({TEXT_LENGTHS!r}) add up to {int(lengths.sum())} "
                        f"bytes, {TEXT_BYTES!r} holds {raw.size}"
                    )
                ends = np.cumsum(lengths)
                for i, (a, b) in enumerate(zip(ends - lengths, ends)):
                    try:
                        raw[a:b].tobytes().decode("utf-8")
                    except UnicodeDecodeError as e:
                        what = f"text {i} in {TEXT_BYTES!r} is not utf-8 ({e.reason})"
                        raise fail(what) from None
    except CaptureDamagedError:
        raise
    except Exception as e:  # safetensors, numpy: bytes the header promised, not there
        raise fail(f"cannot be decoded: {e}") from None


def duplicate_rows(
    out: str, parts: list[tuple[str, dict]] | None = None, *, show: int = 3
) -> list[str]:
    """Rows stored more than once: the same (example, position) of the row index
    (``__row_index__``) in two places of the store, e.g. written by both ranks of a
    tensor-parallel group, or by data-parallel ranks that each counted examples from 0. One
    problem line naming how many rows repeat and the first ``show`` of them with their shards;
    ``[]`` when every row is there once (or the store keeps no row index: ``tokens=False``).
    ``parts`` are the ``(path, index)`` of the per-rank index files (read here when not given).
    Only each shard's row index is read, not its layers' rows; :func:`verify_capture` of a URL
    reads it from the copy of each shard it downloads for the checksum.

    Example::

        >>> import tempfile, torch, pyhook.store as store
        >>> out = tempfile.mkdtemp()
        >>> rows = torch.tensor([[0, 0], [0, 1]])
        >>> with store.ShardWriter(out) as w:
        ...     w.add({"x": torch.ones(2, 4), "__row_index__": rows}, examples=1)
        ...     w.add({"x": torch.ones(2, 4), "__row_index__": rows}, examples=1)
        >>> (problem,) = duplicate_rows(out)
        >>> print(problem.split(": ", 1)[1].split(". ")[0])
        2 row(s) are stored more than once (the same example and position): example 0 position 0 in shard-r000-000000.safetensors (twice); example 0 position 1 in shard-r000-000000.safetensors (twice)
    """
    if parts is None:
        parts = []
        for p in (os.path.join(out, n) for n in rank_indexes(os.listdir(out), out)[0]):
            try:
                parts.append((p, _load_part(p)))
            except CaptureDamagedError:
                continue
    held = [
        (s["file"], _row_keys(os.path.join(out, s["file"]))) for _, p in parts for s in p["shards"]
    ]
    return _repeated(out, held, show)


def _row_keys(path: str) -> Any:
    """The row index (``__row_index__``, an ``(n, 2)`` long tensor) of the shard at ``path``,
    read alone (not the layers' rows); None when it keeps none, or cannot be read (damage
    is the shard check's to report)."""
    import torch
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            if "__row_index__" not in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
                return None
            index = f.get_tensor("__row_index__")
    except Exception:
        return None
    if index.dim() != 2 or index.shape[1] != 2 or index.numel() == 0:
        return None
    return index.to(torch.long)


def _repeated(out: str, held: list[tuple[str, Any]], show: int = 3) -> list[str]:
    """:func:`duplicate_rows`' problem line for the capture ``out`` from each shard's file name
    and row index (``held``, None: it keeps none)."""
    import torch

    kept = [(name, index) for name, index in held if index is not None]
    if not kept:
        return []
    rows = torch.cat([index for _, index in kept])
    # each row's shard, as the shard's position in ``kept`` (one integer a row, not a name)
    where = torch.repeat_interleave(torch.tensor([index.shape[0] for _, index in kept]))
    uniq, inverse, counts = torch.unique(rows, dim=0, return_inverse=True, return_counts=True)
    repeated = counts > 1
    if not bool(repeated.any()):
        return []
    extra = int((counts[repeated] - 1).sum())
    shown = []
    for k in torch.nonzero(repeated).flatten()[:show].tolist():
        files = [kept[i][0] for i in where[inverse == k].tolist()]
        ex, pos = uniq[k].tolist()
        names = sorted(set(files))
        if len(names) == 1:
            there = f"{names[0]} ({'twice' if len(files) == 2 else f'{len(files)} times'})"
        else:
            there = " and ".join(names)
        shown.append(f"example {ex} position {pos} in {there}")
    more = f"; and {int(repeated.sum()) - len(shown)} more" if int(repeated.sum()) > show else ""
    return [
        f"{out}: {extra} row(s) are stored more than once (the same example and position): "
        + "; ".join(shown)
        + more
        + ". Ranks that each wrote the same rows (every rank of a tensor-parallel group, or "
        "data-parallel ranks that all counted their examples from 0); capture again with the "
        "ranks' layout known (pyhook.pipeline.ranks)"
    ]
