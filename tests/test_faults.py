"""Fault injection on the capture store: kills at every writer step, every corruption kind.

* Kills: a forked child writes a capture and SIGKILLs itself at the k-th time the writer reaches
  a given step (``pyhook.store.format._fault_hook``, deterministic, no timing); the parent resumes the
  capture the way the README says (skip ``examples_done``) and the directory must be
  byte-for-byte the one an uninterrupted run writes. ``KILL_POINTS`` lists every point.
* Corruptions: each kind of damage in ``CORRUPTIONS`` must be detected by opening (the cheap
  checks, or ``verify=True`` for changed data bytes), by ``pyhook verify``, and by a resume,
  each naming the damaged file; the refused resume must leave the directory as it was.

docs/integrity.md states the counts ("kills at N points: N/N identical; K corruption kinds:
K/K detected"); ``test_docs_state_the_counts`` checks them against these lists.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import struct
import sys

import pytest
import torch

from pyhook.cli import main
from pyhook.store import CaptureDamagedError, ShardWriter, open_capture, verify_capture
from pyhook.store import format as store_format

pytestmark = pytest.mark.skipif(
    not hasattr(os, "fork") or sys.platform == "darwin", reason="needs os.fork (Linux)"
)

SETTINGS = {"what": "fault injection"}
PER_BATCH = 3  # examples per batch
N_BATCHES = 8
# Two batches per shard: a shard holds 2 x (3x4 float32 + 4x2x3 bfloat16) = 2 x 96 bytes.
SHARD_BYTES = 150


def _batches():
    g = torch.Generator().manual_seed(0)
    return [
        {
            "a": torch.randn(PER_BATCH, 4, generator=g),
            "b": torch.randn(PER_BATCH + 1, 2, 3, generator=g).to(torch.bfloat16),
        }
        for _ in range(N_BATCHES)
    ]


BATCHES = _batches()


def _capture(out):
    """The README's loop: open (resuming if there is a capture), skip what is stored, add the rest."""
    with ShardWriter(out, settings=SETTINGS, shard_bytes=SHARD_BYTES) as w:
        assert w.examples_done % PER_BATCH == 0
        for b in BATCHES[w.examples_done // PER_BATCH :]:
            w.add(b, examples=PER_BATCH)


def _snapshot(out):
    """Every file of the directory (not the lock files) with its bytes."""
    files = {}
    for name in sorted(os.listdir(out)):
        if name.startswith(".lock"):
            continue
        path = os.path.join(out, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                files[name] = f.read()
        else:
            files[name] = "<dir>"
    return files


def _count_steps(out):
    seen: collections.Counter[str] = collections.Counter()
    store_format._fault_hook = lambda step: seen.update([step])
    try:
        _capture(out)
    finally:
        store_format._fault_hook = None
    return seen


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    steps = _count_steps(out)
    return _snapshot(out), steps


# Every step at which the writer can be killed, in the order it reaches them for one shard
# (the shard file, then the per-rank index), then those of closing (the last per-rank index,
# the merged index). test_kill_points_cover_every_step checks this list against the steps the
# writer reports.
WRITER_STEPS = [
    "shard.open",  # the .tmp file exists, empty
    "shard.header",  # header written, no data
    "shard.data",  # after each tensor piece (a partial shard)
    "shard.written",  # all bytes written, not fsynced
    "shard.fsynced",  # fsynced, not renamed
    "shard.renamed",  # renamed to its final name, not listed in the index
    "shard.dir-synced",  # directory fsynced, not listed
    "index.tmp-written",  # per-rank index written to its temp file (first shard, and closing)
    "index.fsynced",
    "index.replaced",  # the index lists the shard; directory not yet fsynced
    "journal.written",  # later shards: one line appended to the journal, not fsynced
    "journal.fsynced",  # the journal lists the shard
    "close.part-written",  # closing: the journal compacted into the per-rank index ...
    "close.journal-removed",  # ... and the journal removed; the merged index not written
    "merged.tmp-written",
    "merged.fsynced",
    "merged.replaced",
]
# Each step at its first and its last occurrence in an uninterrupted run (the ones between
# repeat the same states), the partial shard also in the middle of a later shard; closing and
# merging happen once.
KILL_POINTS: list[tuple[str, int | str]] = []
for _step in WRITER_STEPS:
    if _step.startswith(("close.", "merged.")):
        KILL_POINTS.append((_step, 1))
    else:
        KILL_POINTS += [(_step, 1), (_step, "last")]
KILL_POINTS.append(("shard.data", 6))  # second shard, second piece


def test_kill_points_cover_every_step(reference):
    _, steps = reference
    assert set(steps) == set(WRITER_STEPS)
    assert steps["shard.open"] == N_BATCHES // 2  # four shards: two batches each


def _kill_at(out, step, k):
    """Fork a child that runs the capture and SIGKILLs itself at the k-th ``step``."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns to pytest
        code = 3
        try:
            seen: collections.Counter[str] = collections.Counter()

            def hook(s):
                seen[s] += 1
                if s == step and seen[s] == k:
                    os.kill(os.getpid(), signal.SIGKILL)

            store_format._fault_hook = hook
            _capture(out)
            code = 4  # finished without reaching the kill point
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


@pytest.mark.parametrize("step, k", KILL_POINTS, ids=[f"{s}#{k}" for s, k in KILL_POINTS])
def test_kill_then_resume_is_bit_identical(tmp_path, reference, step, k):
    ref, steps = reference
    k = steps[step] if k == "last" else k
    status = _kill_at(tmp_path, step, k)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    _capture(tmp_path)  # resume
    assert _snapshot(tmp_path) == ref
    assert torch.equal(
        open_capture(tmp_path, verify=True)["a"][:], torch.cat([b["a"] for b in BATCHES])
    )


# -- corruptions ----------------------------------------------------------------------------------
def _shard(out, i):
    return os.path.join(out, f"shard-r000-{i:06d}.safetensors")


def _rewrite_header(path, old, new):
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        raw = f.read(n)
        assert old in raw and len(old) == len(new)
        f.seek(8)
        f.write(raw.replace(old, new, 1))


def _edit_index(out, fn):
    path = os.path.join(out, "index-r000.json")
    with open(path) as f:
        idx = json.load(f)
    with open(path, "w") as f:
        json.dump(fn(idx), f)


def _truncate(out):
    path = _shard(out, 1)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 7)


def _flip_data_byte(out):
    with open(_shard(out, 1), "r+b") as f:
        f.seek(-3, os.SEEK_END)
        b = f.read(1)[0]
        f.seek(-3, os.SEEK_END)
        f.write(bytes([b ^ 0x01]))


def _swap(out):
    a, b = _shard(out, 0), _shard(out, 2)
    os.rename(a, a + ".x")
    os.rename(b, a)
    os.rename(a + ".x", b)


def _listed_twice(idx):
    idx["shards"].append(dict(idx["shards"][1]))
    return idx


def _path(file):
    def edit(idx):
        idx["shards"][0]["file"] = file
        return idx

    return edit


def _dir_in_place(out):
    os.remove(_shard(out, 1))
    os.mkdir(_shard(out, 1))


def _short(out):
    with open(_shard(out, 1), "wb") as f:
        f.write(b"\x10\x00")


def _header_garbage(out):
    with open(_shard(out, 1), "r+b") as f:
        f.seek(8)
        f.write(b"\xff\xfe{{")


def _fifo(out):
    os.remove(_shard(out, 1))
    os.mkfifo(_shard(out, 1))


def _reversed(idx):
    idx["shards"].reverse()
    return idx


def _examples_edited(idx):
    idx["shards"][1]["examples"] = 54
    return idx


def _size_nan(idx):
    idx["shards"][1]["bytes"] = float("nan")
    return idx


def _write_text(path, text):
    with open(path, "w") as f:
        f.write(text)


S0, S1, IDX = "shard-r000-000000.safetensors", "shard-r000-000001.safetensors", "index-r000.json"
# kind -> (damage(out), the file the error must name, detected without reading the data)
CORRUPTIONS = {
    "truncated shard": (_truncate, S1, True),
    "shard shorter than 8 bytes": (_short, S1, True),
    "header dtype byte changed (F32 -> I32)": (
        lambda out: _rewrite_header(_shard(out, 1), b'"F32"', b'"I32"'),
        S1,
        True,
    ),
    "header shape changed": (
        lambda out: _rewrite_header(_shard(out, 1), b'"shape":[6,4]', b'"shape":[4,6]'),
        S1,
        True,
    ),
    "header not JSON": (_header_garbage, S1, True),
    "data byte flipped": (_flip_data_byte, S1, False),
    "shard listed twice": (lambda out: _edit_index(out, _listed_twice), S1, True),
    "../ path in the index": (
        lambda out: _edit_index(out, _path("../other/" + S0)),
        IDX,
        True,
    ),
    "absolute path in the index": (
        lambda out: _edit_index(out, _path(os.path.abspath(_shard(out, 0)))),
        IDX,
        True,
    ),
    "shards swapped on disk": (_swap, S0, True),
    "missing shard": (lambda out: os.remove(_shard(out, 1)), S1, True),
    "directory in place of a shard": (_dir_in_place, S1, True),
    "index not a dict": (lambda out: _edit_index(out, lambda i: [i]), IDX, True),
    "index without its layer list": (
        lambda out: _edit_index(out, lambda i: {k: v for k, v in i.items() if k != "layers"}),
        IDX,
        True,
    ),
    "index not JSON": (lambda out: _write_text(os.path.join(out, IDX), '{"shards": ['), IDX, True),
    "FIFO in place of a shard": (_fifo, S1, True),
    "shard list reversed": (lambda out: _edit_index(out, _reversed), IDX, True),
    "a shard's example count edited": (lambda out: _edit_index(out, _examples_edited), IDX, True),
    "a shard's size NaN in the index": (lambda out: _edit_index(out, _size_nan), IDX, True),
}


def _damaged(tmp_path, kind):
    out = tmp_path / "cap"
    other = tmp_path / "other"
    # equal batches: the shards have equal sizes, so a swap is not caught by the size alone
    with ShardWriter(other, settings=SETTINGS, shard_bytes=1) as w:
        w.add({"a": torch.zeros(6, 4)}, examples=6)
    with ShardWriter(out, settings=SETTINGS, shard_bytes=1) as w:
        for i in range(4):
            w.add({"a": torch.full((6, 4), float(i))}, examples=6)
    damage, file, _cheap = CORRUPTIONS[kind]
    damage(str(out))
    return str(out), file


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corruption_is_detected_by_open_verify_and_resume(tmp_path, capsys, kind):
    out, file = _damaged(tmp_path, kind)
    cheap = CORRUPTIONS[kind][2]
    # open: always for the cheap kinds; changed data bytes need verify=True
    if cheap:
        with pytest.raises(CaptureDamagedError, match=re.escape(file)):
            open_capture(out)
    else:
        open_capture(out)
    with pytest.raises(CaptureDamagedError, match=re.escape(file)):
        open_capture(out, verify=True)
    # verify: exit 2, one line per problem naming the file
    problems, _ = verify_capture(out)
    assert problems and all(file in p or IDX in p for p in problems), problems
    assert main(["verify", out]) == 2
    err = capsys.readouterr().err
    assert file in err and "Traceback" not in err
    # resume: refuses, naming the file, and changes nothing
    before = _snapshot(out)
    with pytest.raises(CaptureDamagedError, match=re.escape(file)):
        ShardWriter(out, settings=SETTINGS, shard_bytes=1)
    assert _snapshot(out) == before


def test_docs_state_the_counts():
    docs = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "integrity.md")
    if not os.path.exists(docs):
        pytest.skip("docs/ is not part of this checkout")
    with open(docs, encoding="utf-8") as f:
        text = " ".join(f.read().split())  # line breaks inside a sentence do not matter
    n = len(KILL_POINTS)
    k = len(CORRUPTIONS)
    assert f"kills at {n} points: {n}/{n} identical" in text
    assert f"{k} corruption kinds: {k}/{k} detected" in text
