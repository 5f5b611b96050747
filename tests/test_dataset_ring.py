"""CaptureDataset in DataLoader workers: batches sent through reused shared-memory slots
(pyhook._ring) and through torch's path (the fallback): the same batches as in-process, kept
batches intact, slots actually reused, the bad cases (killed worker, several loaders,
persistent workers, spawn) handled."""

from __future__ import annotations

import gc
import os
import pickle
import signal
import warnings

import pytest
import torch
from test_dataset import check_rows, collect, write_capture
from torch.utils.data import DataLoader, IterableDataset

from pyhook import _ring
from pyhook.dataset import CaptureDataset

pytestmark = pytest.mark.skipif(not _ring.available(), reason="the ring needs Linux memfd")

CONTEXTS = ["fork", "spawn"]


@pytest.fixture
def capture(tmp_path):
    return write_capture(tmp_path / "cap", tokens=True)


def in_process(ds):
    return list(ds)


def assert_same_batches(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert type(g) is dict
        assert list(g) == list(w)
        for key in w:
            assert g[key].dtype == w[key].dtype and torch.equal(g[key], w[key]), key


def rebuilt():
    return _ring.stats["rebuilt"]


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize(
    "kwargs",
    [
        {"shuffle": True, "with_index": True, "tokens": True},
        {"shuffle": "chunks", "chunk_rows": 4, "buffer_chunks": 2},
        {"shuffle": False, "drop_last": True, "rank": 1, "world_size": 2, "with_index": True},
    ],
)
def test_worker_batches_equal_in_process(capture, context, kwargs):
    """Bitwise the batches of num_workers=0, in the same order, as plain dicts, all of them
    delivered through the slots (a consumer that drops each batch never runs out)."""
    path, *_ = capture
    ds = CaptureDataset(path, ["a", "b"], batch_size=3, seed=5, **kwargs)
    before = rebuilt()
    got = [
        b for b in DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=context)
    ]
    assert_same_batches(got, in_process(ds))
    assert rebuilt() - before == len(got)


@pytest.mark.parametrize("persistent", [False, True])
def test_kept_batches_stay_intact(capture, persistent):
    """Keep every batch of 3 epochs (9 batches a worker an epoch, 2 slots a worker): the slots
    run out, later batches take torch's path, and no kept batch is ever overwritten."""
    path, a, b, t = capture
    ds = CaptureDataset(
        path, ["a", "b"], batch_size=2, seed=1, tokens=True, with_index=True, worker_slots=2
    )
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=persistent)
    kept, before = [], rebuilt()
    for epoch in range(3):
        ds.set_epoch(epoch)
        batches = list(loader)
        assert sorted(collect(batches).tolist()) == list(range(31))
        kept.append(batches)
    assert 0 < rebuilt() - before <= (2 if persistent else 6) * 2  # slots are never freed here
    for epoch, batches in enumerate(kept):  # checked after all three epochs ran
        ds.set_epoch(epoch)
        assert_same_batches(batches, in_process(ds))
        for batch in batches:
            check_rows(batch, a, b)
            assert torch.equal(batch["tokens"], t[batch["index"]])


def test_slots_are_reused(capture):
    """A consumer that drops each batch: 31 batches from 1 worker come from at most 3 slots
    (at most 3 distinct addresses), not 31 fresh buffers."""
    path, a, b, _ = capture
    ds = CaptureDataset(path, ["a", "b"], batch_size=1, with_index=True, worker_slots=3)
    before, arenas = rebuilt(), _ring.stats["arenas"]
    ptrs, n = set(), 0
    for batch in DataLoader(ds, batch_size=None, num_workers=1, prefetch_factor=1):
        check_rows(batch, a, b)
        ptrs.add(batch["a"].data_ptr())
        n += 1
    assert n == 31
    assert rebuilt() - before >= 28  # (a slot may be busy at a race: that batch falls back)
    assert len(ptrs) <= 3 + (31 - (rebuilt() - before))
    assert _ring.stats["arenas"] - arenas == 1


def test_slot_is_released_when_the_last_view_dies():
    """In one process (the rebuild opens /proc/self/fd): the slot stays taken while the batch,
    or any view of it, is alive, and is free as soon as the last one is gone."""
    ring = _ring.WorkerRing([("x", torch.float32, (4,)), ("i", torch.int64, ())], 2, 1)
    slot = ring.acquire()
    batch = ring.batch(slot, 2)
    batch["x"].copy_(torch.arange(8.0).reshape(2, 4))
    batch["i"].copy_(torch.tensor([7, 9]))
    got = pickle.loads(pickle.dumps(batch))
    assert type(got) is dict and got["x"].data_ptr() != batch["x"].data_ptr()
    del batch
    gc.collect()
    assert ring.acquire() is None  # sent: the receiver owns it
    view = got["x"][1, 2:]
    del got
    gc.collect()
    assert ring.acquire() is None  # a view is still alive
    assert view.tolist() == [6.0, 7.0]
    del view
    assert ring.acquire() == slot


def test_unsent_batch_frees_its_slot():
    """A batch used inside the worker and never sent frees its slot with its last view."""
    ring = _ring.WorkerRing([("x", torch.float32, (4,))], 2, 1)
    batch = ring.batch(ring.acquire(), 2)
    assert ring.acquire() is None
    del batch
    assert ring.acquire() == 0


@pytest.mark.parametrize("how", ["worker_slots=0", "unavailable"])
def test_fallback_path(capture, monkeypatch, how):
    """worker_slots=0, or a platform without memfd (simulated; fork workers inherit the patch):
    torch's shared-memory path, the same batches, no slot rebuilt."""
    path, *_ = capture
    slots = 0 if how == "worker_slots=0" else 8
    if how == "unavailable":
        monkeypatch.setattr(_ring, "available", lambda: False)
    ds = CaptureDataset(path, ["a", "b"], batch_size=4, with_index=True, worker_slots=slots)
    before = rebuilt()
    got = list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork"))
    assert rebuilt() == before
    assert_same_batches(got, in_process(ds))


def test_pin_memory(capture):
    """pin_memory=True copies the batches in the main process (without CUDA torch warns and
    returns them as they are): still the in-process batches."""
    path, *_ = capture
    ds = CaptureDataset(path, ["a", "b"], batch_size=4, with_index=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = list(DataLoader(ds, batch_size=None, num_workers=2, pin_memory=True))
    assert_same_batches(got, in_process(ds))


def test_persistent_workers_across_epochs(capture):
    """persistent_workers=True with set_epoch: each epoch equals in-process, the same two
    arenas serve every epoch."""
    path, *_ = capture
    ds = CaptureDataset(path, ["a", "b"], batch_size=3, tokens=True, with_index=True)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    arenas = _ring.stats["arenas"]
    for epoch in range(3):
        ds.set_epoch(epoch)
        got = list(loader)
        assert_same_batches(got, in_process(ds))
        del got
    assert _ring.stats["arenas"] - arenas == 2


def test_several_loaders_at_once(capture):
    """Two datasets, three iterators (one loader iterated twice) at the same time."""
    path, *_ = capture
    d1 = CaptureDataset(path, ["a", "b"], batch_size=3, seed=1, with_index=True)
    d2 = CaptureDataset(path, "a", batch_size=5, seed=2, tokens=True)
    l1 = DataLoader(d1, batch_size=None, num_workers=2)
    got1, got2, got3 = [], [], []
    for x, y, z in zip(l1, DataLoader(d2, batch_size=None, num_workers=2), l1):
        got1.append(x), got2.append(y), got3.append(z)
    n = min(len(in_process(d1)), len(in_process(d2)))
    assert_same_batches(got1, in_process(d1)[:n])
    assert_same_batches(got3, in_process(d1)[:n])
    assert_same_batches(got2, in_process(d2)[:n])


def test_killed_worker_raises(capture):
    """A worker killed mid-epoch: the DataLoader raises its own error instead of hanging, and
    a batch already received from that worker stays readable."""
    path, a, b, _ = capture
    ds = CaptureDataset(path, ["a", "b"], batch_size=1, with_index=True)
    it = iter(DataLoader(ds, batch_size=None, num_workers=2, timeout=60))
    first = next(it)
    os.kill(it._workers[0].pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="DataLoader worker"):
        for _ in range(40):
            next(it)
    del it
    check_rows(first, a, b)


class _Doubled(IterableDataset):
    """Uses the batches inside the worker and yields new tensors."""

    def __init__(self, ds):
        self.ds = ds

    def __iter__(self):
        for batch in self.ds:
            yield {key: value * 2 for key, value in batch.items()}


def test_batches_used_inside_the_worker(capture):
    """A wrapping dataset that consumes the batches in the worker gets the right rows (slots
    freed in the worker, never sent)."""
    path, *_ = capture
    ds = CaptureDataset(path, ["a", "b"], batch_size=2, with_index=True, worker_slots=1)
    got = list(DataLoader(_Doubled(ds), batch_size=None, num_workers=2))
    want = [{k: v * 2 for k, v in batch.items()} for batch in in_process(ds)]
    assert_same_batches(got, want)


def ring_fds():
    """This process's descriptors of arenas (memfd files named pyhook-ring), as (descriptor,
    inode) pairs: a descriptor number freed by an earlier test's arena and reused by a new one
    is a new pair."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "pyhook-ring" in os.readlink(f"/proc/self/fd/{fd}"):
                out.add((fd, os.stat(f"/proc/self/fd/{fd}").st_ino))
        except OSError:  # the descriptor listdir itself used
            pass
    return out


def test_no_files_left_in_dev_shm_and_no_fds(capture):
    """memfd arenas have no name in /dev/shm; the main process holds one descriptor per mapped arena (not
    one per tensor as torch's path: here 8 slots a worker hold the 4 batches each worker
    makes), and none once the workers are gone and the batches freed."""
    path, *_ = capture
    ds = CaptureDataset(path, ["a", "b"], batch_size=4, worker_slots=8)
    gc.collect()  # arenas of earlier tests' batches closed now, not in the middle of this one
    fds = ring_fds()
    before, arenas = rebuilt(), set(_ring._arenas)
    kept = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert rebuilt() - before == len(kept) == 8
    assert len(ring_fds() - fds) == 2
    del kept
    gc.collect()
    assert ring_fds() <= fds
    assert set(_ring._arenas) <= arenas
    # (torch's own files come and go in /dev/shm, also from other tests running in parallel)
    if os.path.isdir("/dev/shm"):
        assert not [name for name in os.listdir("/dev/shm") if "pyhook" in name]


def test_worker_slots_argument_is_checked(capture):
    path, *_ = capture
    for bad in (-1, _ring.MAX_SLOTS + 1, True, 2.0):
        with pytest.raises(ValueError, match="worker_slots"):
            CaptureDataset(path, "a", worker_slots=bad)
