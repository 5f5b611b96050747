"""Issue 19 item 5 (the writer's part): the host memory a disk capture holds is bounded.

The writer holds the rows buffered for the next shard, the shards waiting for the disk and the
one being written; ``max_buffer_bytes`` (default 256 MiB) bounds their sum whatever the size of
the capture or of ``shard_bytes``. A slow disk (the real writer, each file write delayed) makes
the producer wait instead of memory growing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import weakref

import pytest
import torch

import pyhook
from pyhook.store import ShardWriter, open_capture, writer

MB = 1 << 20


def _slow_disk(monkeypatch, seconds=0.02):
    real = writer._write_file

    def slow(*a, **k):
        time.sleep(seconds)
        return real(*a, **k)

    monkeypatch.setattr(writer, "_write_file", slow)


def test_buffered_bytes_stay_under_the_limit(tmp_path, monkeypatch):
    _slow_disk(monkeypatch)
    batch = 256 * 1024 // 4  # 256 KB of float32 rows a batch
    xs = [torch.full((batch // 64, 64), float(i)) for i in range(48)]  # 12 MB in all
    with ShardWriter(tmp_path, shard_bytes=64 * MB, max_pending=8, max_buffer_bytes=2 * MB) as w:
        for x in xs:
            w.add({"h": x}, examples=1)
    # before the limit, shard_bytes=64 MB kept the whole capture (12 MB) in memory
    assert w.peak_buffer_bytes <= 2 * MB, w.peak_buffer_bytes
    assert w.peak_buffer_bytes >= MB  # the writer did use its budget (double buffering)
    sizes = [os.path.getsize(p) for p in sorted(tmp_path.glob("shard-*.safetensors"))]
    assert len(sizes) >= 12 and max(sizes) <= MB + 4096  # shards of half the budget
    assert torch.equal(open_capture(tmp_path)["h"][:], torch.cat(xs))


def test_default_budget_is_256_mb(tmp_path):
    w = ShardWriter(tmp_path)
    try:
        assert w.max_buffer_bytes == 256 * MB
        assert w._shard_limit == 128 * MB
    finally:
        w.close()


def test_a_batch_larger_than_the_budget_is_still_taken(tmp_path):
    big = torch.ones(3 * MB // 4 // 16, 16)  # 3 MB, budget 1 MB
    with ShardWriter(tmp_path, shard_bytes=1, max_buffer_bytes=MB) as w:
        w.add({"h": big}, examples=1)
        w.add({"h": big}, examples=1)
    assert torch.equal(open_capture(tmp_path)["h"][:], torch.cat([big, big]))


# Issue 23 item 2: a disk capture whose forward allocates nothing (one nn.Identity layer), so
# that every byte the process grows by is pyhook's own. Measured in a fresh process: the peak
# resident anonymous memory (sampled every 2 ms) over that before the capture, and what is left
# after close.
_IDENTITY_CHILD = r"""
import json, os, sys, tempfile, threading, time
import torch
from pyhook.capture import capture
from pyhook.offload import trim_host_memory

page = os.sysconf("SC_PAGE_SIZE")
def rss():
    # resident anonymous memory (resident less file-backed pages): the process's own bytes,
    # without the library code pages a busy machine evicts and faults back in at any time
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * page

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.id = torch.nn.Identity()
    def forward(self, x):
        return self.id(x)

opts = json.loads(sys.argv[1])
batches = int(sys.argv[2])
net = Net()
x = torch.randn(4096, 768)  # 12.6 MB a batch, the same input every time: no new memory
peak = [0]
stop = threading.Event()
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.002)
with torch.inference_mode():
    net(x)
    trim_host_memory()
    before = rss()
    peak[0] = before
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    with capture(net, "id", out=tempfile.mkdtemp(dir=sys.argv[3]), **opts) as rec:
        for _ in range(batches):
            net(x)
    time.sleep(0.05)
    stop.set()
    t.join()
    after = rss()
from pyhook import _backend
print(json.dumps({"peak": peak[0] - before, "left": after - before, "rows": rec.rows["id"],
                  "backend": _backend.get_backend()}))
"""


def _identity_capture(tmp_path, opts, batches=40):
    # -I and a cwd outside the checkout: the child measures the installed package. Run from
    # the checkout, `python -c` put the source tree (no native core: the reference backend)
    # first on sys.path, and the test measured that instead (204-288 MB: the +264 MB failure
    # of a CI run); the installed native build peaks at 106-178 MB in the same runs.
    done = subprocess.run(
        [
            sys.executable,
            "-I",
            "-c",
            _IDENTITY_CHILD,
            json.dumps(opts),
            str(batches),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["rows"] == 4096 * batches
    return got


@pytest.mark.parametrize(
    "opts",
    [{}, {"stats": False, "tokens": False}, {"fsync": False}],
    ids=["defaults", "lean", "nofsync"],
)
def test_disk_capture_host_memory_stays_within_the_default_budget(tmp_path, opts):
    # 40 batches of 12.6 MB (504 MB, twice the budget): the writer's rows, the pool's idle
    # buffers and the statistics' temporaries together stay within max_host_bytes (256 MiB),
    # and close gives back all but 64 MB. Before: +318 MB peak with the defaults (the
    # statistics' float64 copy of every batch was outside the budget).
    from pyhook import _backend

    if not _backend.native_available():
        pytest.skip(
            "the budget holds for the native core's buffers; the reference backend's come "
            "from malloc, whose free heap stays resident (docs/store-format.md, Host memory)"
        )
    got = _identity_capture(tmp_path, opts)
    assert got["backend"] == "native", got
    assert got["peak"] <= 256 * MB, f"peak +{got['peak'] / MB:.0f} MB"
    assert got["left"] <= 64 * MB, f"left +{got['left'] / MB:.0f} MB after close"


def _fake_malloc_trim(monkeypatch) -> list[int]:
    """Replace glibc's malloc_trim for pyhook.offload by a recorder: the pads it was called with."""
    from pyhook import offload

    calls: list[int] = []

    class Libc:
        def malloc_trim(self, pad: int) -> int:
            calls.append(pad)
            return 0

    monkeypatch.setattr(offload, "_libc", Libc())
    return calls


def test_close_trims_the_heap_only_when_the_capture_left_memory_behind(tmp_path, monkeypatch):
    # malloc_trim also unmaps the free pages the model's forward reuses batch after batch, so
    # the forward after a capture faulted them in again: a disk capture that leaves the process
    # at its size before does not trim; an explicit trim_host_memory() still does.
    from pyhook import offload
    from pyhook.capture import capture

    calls = _fake_malloc_trim(monkeypatch)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with torch.no_grad(), capture(net, "0", out=tmp_path):
        for _ in range(3):
            net(torch.randn(4, 8))
    assert calls == []
    offload.trim_host_memory(above=offload.resident_bytes() + (1 << 30))
    assert calls == []
    offload.trim_host_memory()
    assert calls == [0]


# The trim decision at close compares the process's size with its size when the capture began,
# so these scenarios run each in a fresh process: in the suite's workers, memory that earlier
# tests left to others (reference cycles the collector frees, a stream's kept producer thread
# retiring with its last pass, a pool full of their batches) could be freed during the capture
# and hide its growth (the CI flakes of these tests, three times so far).
_TRIM_CHILD = """
import json, sys, torch, pyhook
from pyhook import offload
from pyhook.capture import capture
from pyhook.pipeline import capture as capmod
from pyhook.store import open_capture

rows, slack, backend, prefill, out = json.loads(sys.argv[1])
MB = 1 << 20


class Grows(torch.nn.Module):
    # A Linear whose forward also keeps 36 MB of its own a call (the process grows during the
    # capture by memory that is the model's, not pyhook's; above glibc's largest mmap threshold,
    # 32 MB, so it is always new memory whatever the heap holds).
    def __init__(self, width):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.kept = []

    def forward(self, x):
        self.kept.append(torch.ones(36 * MB // 4))
        return self.lin(x)


calls = []


class Libc:  # glibc's malloc_trim, recorded: the pads it was called with
    def malloc_trim(self, pad):
        calls.append(pad)
        return 0


if prefill:  # the pool full of earlier batches' buffers when the capture begins
    assert pyhook.native_available()  # (loads the native core's operators)
    xs = [torch.ops.pyhook.gather_rows([torch.randn(5000, 768)], torch.arange(4096))]
    xs += [torch.ops.pyhook.gather_rows([xs[0]], torch.arange(4096)) for _ in range(19)]
    for x in xs:
        x.fill_(1.0)  # resident
    del xs
    assert pyhook.pool_stats()["cached_bytes"] >= 200 << 20
offload._libc = Libc()
if slack is not None:
    capmod._TRIM_SLACK = slack
net = Grows(256)
x = torch.randn(rows, 256)
with pyhook.use_backend(backend), torch.no_grad(), capture(net, "lin", out=out) as rec:
    for _ in range(4):
        net(x)
assert torch.equal(open_capture(out)["lin"][:rows], net.lin(x).detach())
assert rec.rows["lin"] == 4 * rows
print(json.dumps({"calls": calls, "cached": pyhook.pool_stats()["cached_bytes"]}))
"""


def _trim_calls(tmp_path, rows: int, *, slack=None, backend="native", prefill=False):
    """A disk capture of 4 batches of ``rows`` rows of 256 floats by a model that keeps 144 MB
    of its own, in a fresh process: ``(malloc_trim calls, the pool's cached bytes after)``."""
    args = json.dumps([rows, slack, backend, prefill, str(tmp_path / "acts")])
    proc = subprocess.run(
        [sys.executable, "-I", "-c", _TRIM_CHILD, args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return got["calls"], got["cached"]


@pytest.mark.skipif(not pyhook.native_available(), reason="the native pool maps the rows")
def test_close_leaves_the_forwards_heap_alone_when_the_rows_were_mapped(tmp_path):
    # Issue 23 item 1 ("no slower forward after the capture"): the process grew by the model's
    # own 144 MB, and every row buffer (2 MiB a batch) was one of the pool's mappings, unmapped
    # at close. A malloc_trim would only have unmapped the forward's free heap pages, which the
    # next forward faults back in (GPT-2 small: ~57,000 faults after each close); before, close
    # trimmed here.
    calls, cached = _trim_calls(tmp_path, 2048)
    assert calls == []
    assert cached == 0  # the pool's idle buffers went back


@pytest.mark.skipif(not pyhook.native_available(), reason="the native backend's small rows")
def test_close_still_trims_when_the_heap_held_the_rows(tmp_path):
    # Rows under 1 MiB come from malloc's heap: once they add up to more than the slack, a
    # capture that left the process bigger trims, as before.
    assert _trim_calls(tmp_path, 32, slack=64 << 10)[0] == [0]  # 4 batches of 32 KiB rows


def test_close_still_trims_when_the_reference_backend_held_the_rows(tmp_path):
    # The reference backend takes every buffer from the heap.
    assert _trim_calls(tmp_path, 2048, slack=32 << 20, backend="reference")[0] == [0]


@pytest.mark.skipif(not pyhook.native_available(), reason="the native pool")
def test_close_still_trims_when_the_pool_was_full_before_the_capture(tmp_path):
    # The pool's idle buffers at the start are not the capture's baseline: the close gives them
    # back anyway. Counted in it, 250 MB of batches freed by earlier work hid the capture's
    # growth (the CI flake of the test above, which ran after other tests in its process).
    assert _trim_calls(tmp_path, 32, slack=64 << 10, prefill=True)[0] == [0]


def _add_with_a_closure(w: ShardWriter, i: int) -> None:
    t = torch.full((256, 64), float(i))  # no reference outlives this call but the writer's
    w.add({"h": t}, examples=1, wait=lambda: t.sum())  # the wait closure holds the rows too
    w.flush()


def test_written_rows_are_freed_before_the_producer_is_told(tmp_path):
    # The capture counts a batch's bytes as free when on_release returns. If the writer thread
    # still held the rows then (its queue item, the batch tuples and their wait closures), a
    # writer preempted before dropping them let a shard's worth of rows stay allocated while
    # the producer filled the budget again. (With write_inline=True the producer itself writes,
    # its own frames hold the rows, and nothing runs meanwhile: no such window.)
    freed: list[bool] = []

    def on_release(batch: dict[str, torch.Tensor]) -> None:
        refs = [weakref.ref(t) for t in batch.values()]
        batch.clear()  # what the capture does once it gave pooled buffers back
        freed.append(bool(refs) and all(r() is None for r in refs))

    with ShardWriter(tmp_path, on_release=on_release) as w:
        for i in range(3):
            _add_with_a_closure(w, i)
    assert freed == [True, True, True]
    want = torch.cat([torch.full((256, 64), float(i)) for i in range(3)])
    assert torch.equal(open_capture(tmp_path)["h"][:], want)
