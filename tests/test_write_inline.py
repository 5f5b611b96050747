"""Issue 23 item 1: a disk capture whose forward uses every core writes its shards inline.

``ShardWriter(write_inline=True)`` writes each shard's bytes (copy into the page cache, checksum)
on the thread that fills it, gives the rows back at once, and leaves only the fsync, rename and
index to its background thread. The store must be byte-for-byte the one the background writer
makes, crash-safe at every step, and the capture must choose it for a CPU forward on every core.
"""

from __future__ import annotations

import collections
import os
import signal
import sys
import threading

import pytest
import torch
from torch import nn

from pyhook.capture import capture
from pyhook.store import ShardWriter, open_capture, writer
from pyhook.store import format as store_format

SETTINGS = {"what": "inline writes"}
PER_BATCH = 3
N_BATCHES = 8
SHARD_BYTES = 150  # two batches a shard (as in test_faults.py)


def _batches():
    g = torch.Generator().manual_seed(1)
    return [
        {
            "a": torch.randn(PER_BATCH, 4, generator=g),
            "b": torch.randn(PER_BATCH + 1, 2, 3, generator=g).to(torch.bfloat16),
        }
        for _ in range(N_BATCHES)
    ]


BATCHES = _batches()


# Batches of rows, and between them the examples of a forward that failed (skipped).
ITEMS = [(b, PER_BATCH) for b in BATCHES[:3]] + [(None, 2)] + [(b, PER_BATCH) for b in BATCHES[3:]]


def _capture(out, inline):
    """Open (resuming if there is a capture), skip what is stored, add the rest."""
    with ShardWriter(out, settings=SETTINGS, shard_bytes=SHARD_BYTES, write_inline=inline) as w:
        done = w.examples_done
        for b, n in ITEMS:
            if done >= n:
                done -= n
                continue
            assert done == 0  # shards hold whole batches
            if b is None:
                w.add({}, examples=n, skipped=True)
            else:
                w.add(b, examples=n)


def _snapshot(out):
    files = {}
    for name in sorted(os.listdir(out)):
        if not name.startswith(".lock"):
            with open(os.path.join(out, name), "rb") as f:
                files[name] = f.read()
    return files


def test_inline_and_background_writers_make_identical_stores(tmp_path):
    _capture(tmp_path / "bg", inline=False)
    _capture(tmp_path / "inline", inline=True)
    bg, inline = _snapshot(tmp_path / "bg"), _snapshot(tmp_path / "inline")
    assert len([n for n in bg if n.startswith("shard-")]) == 4
    assert inline == bg
    r = open_capture(tmp_path / "inline", verify=True)
    assert torch.equal(r["a"][:], torch.cat([b["a"] for b in BATCHES]))


def test_inline_writes_on_the_caller_and_syncs_in_the_background(tmp_path, monkeypatch):
    calls = []
    real_write, real_fsync = writer._write_file, os.fsync

    def write(*a, **k):
        calls.append(("write", threading.current_thread().name, k.get("fsync")))
        return real_write(*a, **k)

    def fsync(fd):
        calls.append(("fsync", threading.current_thread().name, None))
        return real_fsync(fd)

    monkeypatch.setattr(writer, "_write_file", write)
    monkeypatch.setattr(os, "fsync", fsync)
    released = []
    me = threading.current_thread().name
    with ShardWriter(
        tmp_path,
        shard_bytes=SHARD_BYTES,
        write_inline=True,
        on_release=lambda b: released.append(threading.current_thread().name),
    ) as w:
        for b in BATCHES[:4]:
            w.add(b, examples=PER_BATCH)
        # the two full shards are written and their rows given back, by this thread
        assert [c for c in calls if c[0] == "write"] == [("write", me, False)] * 2
        assert released == [me] * 4
        w.wait()
    fsyncs = {name for kind, name, _ in calls if kind == "fsync"}
    assert fsyncs and all(n.startswith("pyhook-writer") for n in fsyncs - {me}), calls
    assert any(n.startswith("pyhook-writer") for n in fsyncs)  # each shard's own fsync


def test_an_inline_write_error_is_a_capture_write_error(tmp_path, monkeypatch):
    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "_write_file", full)
    released = []
    w = ShardWriter(
        tmp_path, shard_bytes=SHARD_BYTES, write_inline=True, on_release=released.append
    )
    w.add(BATCHES[0], examples=PER_BATCH)
    with pytest.raises(store_format.CaptureWriteError, match="No space left"):
        w.add(BATCHES[1], examples=PER_BATCH)  # fills the shard: written now
    assert len(released) == 2  # the rows went back to their owner all the same
    w.abort()
    assert not [n for n in os.listdir(tmp_path) if ".tmp" in n or n.startswith("shard-")]


KILL_POINTS = [
    ("shard.open", 1),
    ("shard.data", 3),
    ("shard.written", 2),
    ("shard.fsynced", 2),
    ("shard.renamed", 1),
    ("shard.renamed", 3),
    ("journal.written", 2),
    ("journal.fsynced", 1),
    ("close.part-written", 1),
    ("merged.tmp-written", 1),
]


@pytest.mark.skipif(
    not hasattr(os, "fork") or sys.platform == "darwin", reason="needs os.fork (Linux)"
)
@pytest.mark.parametrize("step, k", KILL_POINTS, ids=[f"{s}#{k}" for s, k in KILL_POINTS])
def test_inline_kill_then_resume_is_bit_identical(tmp_path, step, k):
    ref = tmp_path / "ref"
    _capture(ref, inline=True)
    out = tmp_path / "killed"
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
            _capture(out, inline=True)
            code = 4
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    _capture(out, inline=True)  # resume
    assert _snapshot(out) == _snapshot(ref)


def test_capture_writes_on_the_background_thread(tmp_path, monkeypatch):
    # A capture's shards are written by the writer thread, also when the forward uses every
    # core (measured faster there: benchmarks/RESULTS.md); write_inline is ShardWriter's option.
    net = nn.Sequential(nn.Linear(4, 4))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    monkeypatch.setattr(torch, "get_num_threads", lambda: cores)
    with capture(net, "0", out=tmp_path / "b") as rec:
        assert not rec._writer.write_inline
        net(torch.randn(2, 4))
    assert open_capture(tmp_path / "b")["0"][:].shape == (2, 4)
