"""Checking a whole capture against its index (:func:`verify_capture`, ``pyhook verify``),
local or remote; one shard's check (``_check_shard``, also used by the reader, the writer's resume
and the remote shard cache) is the format's, in :mod:`.format`.
"""

from __future__ import annotations

import os
import re

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
    store_links,
)
from .transport import is_url

#: Missing ranks named one per line, at most (an index may record a world of a million ranks).
_SHOWN = 20


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
        from .transport import verify_remote

        return verify_remote(str(path))
    out = _directory_arg("path", path)
    if not os.path.isdir(out):
        return [f"{out}: no such capture directory"], []
    problems: list[str] = []
    notes: list[str] = []
    # A link in place of a store's file: never followed (named, whether or not it is read).
    problems += [f"{p}: is a symbolic link; {_LINK_ADVICE}" for p in store_links(out)]
    parts = sorted(_glob(out, "index-r*.json"))
    if not parts:
        return [f"{out}: holds no pyhook capture (no index-r*.json files)"], []
    seen: set[str] = set()
    ranks: set[int] = set()
    world = 0
    loaded: list[tuple[str, dict]] = []
    for p in parts:
        m = re.fullmatch(r"index-r(\d+)\.json", os.path.basename(p))
        if m:
            ranks.add(int(m.group(1)))  # present, even if damaged (named below)
        try:
            part = _load_part(p)
        except CaptureDamagedError as e:
            problems.append(str(e))
            continue
        loaded.append((p, part))
        world = max(world, part["world_size"])
        for s in part["shards"]:
            seen.add(s["file"])
            try:
                _check_shard(out, s, part["layers"], checksum=True, notes=notes)
            except CaptureDamagedError as e:
                problems.append(str(e))
    missing = sorted(set(range(world)) - ranks)  # ranks whose rows the reader would not read
    for r in missing[:_SHOWN]:
        problems.append(
            f"{os.path.join(out, f'index-r{r:03d}.json')}: missing (rank {r} of {world}: its "
            "rows are not read; deleted, or that rank crashed or is still running)"
        )
    if len(missing) > _SHOWN:
        problems.append(
            f"{out}: the index files of {len(missing) - _SHOWN} more of the {world} ranks are "
            "missing too"
        )
    if not problems:
        try:  # the ranks' indexes belong together (the ones read above, not read again)
            check_same_capture([p for p, _ in loaded], [part for _, part in loaded])
        except CaptureDamagedError as e:
            problems.append(str(e))
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
