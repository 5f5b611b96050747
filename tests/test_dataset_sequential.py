"""shuffle=False batches read with preadv when cold (pyhook/pipeline/_seqread.py): the same
rows as the memory-mapped gather, across shard boundaries, for every key, and a named error
for a shard truncated under the reader."""

from __future__ import annotations

import mmap
import os

import pytest
import torch

from pyhook.dataset import CaptureDataset
from pyhook.pipeline import _seqread
from pyhook.store import CaptureDamagedError, ShardWriter, open_capture


@pytest.fixture
def capture(tmp_path):
    out = tmp_path / "cap"
    g = torch.Generator().manual_seed(0)
    with ShardWriter(out, shard_bytes=1) as w:  # one shard per add: batches cross shards
        for s in range(0, 70, 10):
            w.add(
                {
                    "a": torch.randn(10, 24, generator=g),
                    "b": torch.randn(10, 2, 3, generator=g).bfloat16(),
                    "__token_ids__": torch.arange(s, s + 10),
                },
                examples=10,
            )
    return str(out)


def _spec(path, names):
    r = open_capture(path)
    return {n: r[n].to_tensor() for n in names}


@pytest.mark.parametrize("batch_size", [1, 7, 25, 70])
def test_cold_sequential_batches_equal_the_rows(capture, batch_size, monkeypatch):
    calls = []
    real = _seqread.SequentialReader.read

    def read(self, start, stop):
        calls.append((start, stop))
        return real(self, start, stop)

    # Every batch looks cold: the preadv path serves all of them.
    monkeypatch.setattr(_seqread.SequentialReader, "resident", lambda self, a, b: False)
    monkeypatch.setattr(_seqread.SequentialReader, "read", read)
    want = _spec(capture, ["a", "b", "__token_ids__"])
    ds = CaptureDataset(
        capture, ["a", "b"], batch_size=batch_size, shuffle=False, tokens=True, with_index=True
    )
    batches = list(ds)
    assert len(calls) == len(batches) == -(-70 // batch_size)
    got_a = torch.cat([b["a"] for b in batches])
    assert torch.equal(got_a, want["a"])
    assert torch.equal(torch.cat([b["b"] for b in batches]), want["b"])
    assert torch.equal(torch.cat([b["tokens"] for b in batches]), want["__token_ids__"])
    assert torch.equal(torch.cat([b["index"] for b in batches]), torch.arange(70))
    assert all(b["b"].dtype == torch.bfloat16 and b["tokens"].dtype == torch.int64 for b in batches)
    # Fresh memory the caller owns: editing a batch changes no later read.
    batches[0]["a"].zero_()
    assert torch.equal(next(iter(ds))["a"], want["a"][:batch_size])


def test_warm_batches_keep_the_mapped_gather(capture, monkeypatch):
    monkeypatch.setattr(_seqread.SequentialReader, "resident", lambda self, a, b: True)
    monkeypatch.setattr(
        _seqread.SequentialReader, "read", lambda *a: pytest.fail("read a warm batch")
    )
    ds = CaptureDataset(capture, "a", batch_size=16, shuffle=False)
    assert torch.equal(torch.cat([b["a"] for b in ds]), _spec(capture, ["a"])["a"])


def test_resident_tells_a_dropped_file(capture):
    if not hasattr(os, "posix_fadvise"):
        pytest.skip("needs posix_fadvise")
    ds = CaptureDataset(capture, "a", batch_size=70, shuffle=False)
    list(ds)
    seq = ds._seq
    assert isinstance(seq, _seqread.SequentialReader)
    assert seq.resident(0, 70)  # just read through the maps
    paths = {s.path for s in seq._layers["a"][0]}
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    # Mapped pages may stay cached while mapped; where the kernel dropped them, it is told.
    first = seq._layers["a"][0][0]
    page = mmap.PAGESIZE
    import ctypes

    vec = (ctypes.c_ubyte * 1)()
    addr = first.view.data_ptr() // page * page
    if ctypes.CDLL(None).mincore(ctypes.c_void_p(addr), ctypes.c_size_t(page), vec) != 0:
        pytest.skip("mincore failed")
    assert seq.resident(0, 1) == bool(vec[0] & 1)


def test_a_shard_truncated_under_the_reader_is_named(capture, monkeypatch):
    monkeypatch.setattr(_seqread.SequentialReader, "resident", lambda self, a, b: False)
    ds = CaptureDataset(capture, "a", batch_size=10, shuffle=False)
    it = iter(ds)
    next(it)
    victim = ds._seq._layers["a"][0][3].path
    with open(victim, "r+b") as f:
        f.truncate(ds._seq._layers["a"][0][3].offset + 100)
    with pytest.raises(CaptureDamagedError, match=os.path.basename(victim)):
        for _ in range(6):
            next(it)


def test_the_shuffled_and_worker_paths_do_not_use_it(capture, monkeypatch):
    monkeypatch.setattr(
        _seqread.SequentialReader, "create", lambda *a: pytest.fail("preadv for a shuffle")
    )
    ds = CaptureDataset(capture, "a", batch_size=16, shuffle=True)
    assert sorted(torch.cat([b["a"] for b in ds])[:, 0].tolist()) == sorted(
        _spec(capture, ["a"])["a"][:, 0].tolist()
    )


def test_batches_after_a_cold_one_stay_on_preadv_even_when_resident(capture, monkeypatch):
    # The kernel's read-ahead on the descriptor often has the next batch in the page cache by
    # the time it is asked for: it must still be read with preadv (as readinto would go on),
    # not through the memory maps (regression: 9 of 32 cold batches took the mapped path).
    asked = []
    monkeypatch.setattr(
        _seqread.SequentialReader,
        "resident",
        lambda self, a, b: asked.append(a) or a >= 20,  # the first two batches are cold
    )
    real = _seqread.SequentialReader.read
    reads = []
    monkeypatch.setattr(
        _seqread.SequentialReader, "read", lambda self, a, b: reads.append(a) or real(self, a, b)
    )
    ds = CaptureDataset(capture, "a", batch_size=10, shuffle=False)
    got = torch.cat([b["a"] for b in ds])
    assert torch.equal(got, _spec(capture, ["a"])["a"])
    assert reads == [0, 10, 20, 30, 40, 50, 60]
    assert asked == [0]  # only the first batch of the iteration is checked
    # A new iteration starts over: warm from its first batch, the mapped gather serves all.
    asked.clear(), reads.clear()
    monkeypatch.setattr(_seqread.SequentialReader, "resident", lambda self, a, b: True)
    assert torch.equal(torch.cat([b["a"] for b in ds]), got) and reads == []


def test_cold_batches_take_their_memory_from_the_host_pool(capture, monkeypatch, host_allocations):
    """The preadv path allocates its batch tensors through ``_backend.empty_host`` (the one
    place host memory for reads comes from), and the rows still equal the capture's."""
    shapes = host_allocations
    monkeypatch.setattr(_seqread.SequentialReader, "resident", lambda self, a, b: False)
    ds = CaptureDataset(capture, ["a", "b"], batch_size=25, shuffle=False)
    batches = list(ds)
    want = _spec(capture, ["a", "b"])
    assert torch.equal(torch.cat([b["a"] for b in batches]), want["a"])
    assert torch.equal(torch.cat([b["b"] for b in batches]), want["b"])
    assert ((25, 24), torch.float32) in shapes and ((25, 2, 3), torch.bfloat16) in shapes
