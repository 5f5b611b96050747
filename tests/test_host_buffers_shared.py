"""Issue 49 item 1: ``HostBuffers`` never writes rows that somebody still holds, however held.

The set counted the tensors of this process on a buffer's storage. Rows held only through their
storage (``t.untyped_storage()``) were not counted, and rows sent to another process (a
``torch.multiprocessing`` queue, or returned by a DataLoader worker that captures) move the
buffer into shared memory in place, where nothing this process counts says the other process
still reads them: the next capture wrote into them. Now references to the storage count too,
and a buffer that went to shared memory is retired.

Reference: a copy of every held result taken when its capture ended; every later capture must
leave what is held (in this process or in a consumer process) equal to that copy.
"""

from __future__ import annotations

import pickle
import queue as _queue

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from _hygiene import bounded
from hypothesis import given
from hypothesis import strategies as st
from pyhook.capture import capture
from torch import nn
from torch.utils.data import DataLoader, Dataset

from pyhook.offload import HostBuffers

D_IN, D_OUT = 4, 6


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, D_OUT), nn.Tanh())


def _capture(net: nn.Module, bufs: HostBuffers, batches: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad(), capture(net, ["0"], buffers=bufs) as rec:
        for _ in range(batches):
            net(torch.randn(2, 3, D_IN, generator=g))
    return rec["0"]


# -- a consumer in another process: keeps what it is sent, sends back copies on request --------
def _consumer(inbox, outbox) -> None:
    kept: dict[int, torch.Tensor] = {}
    while True:
        msg = inbox.get()
        if msg is None:
            return
        if msg[0] == "keep":
            kept[msg[1]] = msg[2]
            outbox.put(("kept", msg[1]))
        else:  # ("show", k): the values the consumer reads now, as a plain list (no sharing)
            outbox.put(("shown", msg[1], kept[msg[1]].tolist()))


@pytest.fixture(scope="module")
def consumer():
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_consumer, args=(inbox, outbox), daemon=True)
    proc.start()

    def ask(msg, timeout=60):
        inbox.put(msg)
        try:
            return outbox.get(timeout=timeout)
        except _queue.Empty:  # pragma: no cover - reported
            raise AssertionError(f"consumer process did not answer {msg[:2]!r}") from None

    yield ask
    inbox.put(None)
    proc.join(timeout=30)
    if proc.is_alive():  # pragma: no cover
        proc.kill()


# -- the ways a result can be held: (hold, read back) -----------------------------------------
def _hold(mode: str, t: torch.Tensor, key: int, ask):
    """Hold ``t`` (a capture's rows) as ``mode``; returns (holder, what it reads now, as a
    function of the holder)."""
    if mode == "rec":
        return t, lambda h: h
    if mode == "slice":
        return t[1:-1], lambda h: h
    if mode == "view":  # a strided view of another shape
        return t.t()[::2], lambda h: h
    if mode == "storage":  # only the storage, with where the rows are in it
        where = (t.storage_offset(), t.shape, t.stride(), t.dtype)
        return (t.untyped_storage(), where), lambda h: torch.empty(0, dtype=h[1][3]).set_(
            h[0], h[1][0], h[1][1], h[1][2]
        )
    if mode == "numpy":
        return t.numpy(), lambda h: torch.from_numpy(np.array(h))
    if mode == "dlpack":
        return [torch.utils.dlpack.to_dlpack(t)], lambda h: _from_capsule(h)
    if mode == "shared":  # moved to shared memory in place, still held here
        t.share_memory_()
        return t, lambda h: h
    if mode == "queue":  # sent to another process, which keeps it; nothing held here
        assert ask(("keep", key, t)) == ("kept", key)
        return key, lambda k: torch.tensor(ask(("show", k))[2], dtype=torch.float32)
    raise AssertionError(mode)


def _from_capsule(h: list) -> torch.Tensor:
    if not isinstance(h[0], torch.Tensor):  # a capsule is read once: keep the tensor it gave
        h[0] = torch.utils.dlpack.from_dlpack(h[0])
    return h[0]


MODES = ["rec", "slice", "view", "storage", "numpy", "dlpack", "shared", "queue", "drop"]

steps = st.lists(
    st.tuples(st.sampled_from(MODES), st.integers(1, 4), st.booleans()), min_size=2, max_size=7
)


@bounded(25)
@given(steps=steps, depth=st.integers(1, 3))
def test_rows_held_any_way_are_never_overwritten(consumer, steps, depth):
    """Each step captures (1-4 batches: sizes change, so buffers are joined and outgrown), holds
    the result one way (or drops it), and may let go of the oldest holder; after every capture,
    everything still held reads what its capture wrote."""
    net = _net()
    bufs = HostBuffers(pin=False, depth=depth)
    held: list[tuple[str, object, object, torch.Tensor]] = []
    for i, (mode, batches, release) in enumerate(steps):
        key = id(bufs) * 100 + i
        rows = _capture(net, bufs, batches, seed=1000 * i + batches)
        if mode != "drop":
            h, read = _hold(mode, rows, key, consumer)
            held.append((mode, h, read, read(h).clone()))
        del rows
        if release and held:
            held.pop(0)
        for m, h, read, expect in held:
            got = read(h)
            assert torch.equal(got, expect), f"rows held as {m!r} were overwritten by capture {i}"


def test_rows_sent_through_a_queue_survive_later_captures_in_the_sender(consumer):
    """The plain case of the issue: send ``rec[layer]`` to a consumer, drop it, capture again."""
    net = _net()
    bufs = HostBuffers(pin=False)
    expect = []
    for i in range(4):
        rows = _capture(net, bufs, 3, seed=i)
        expect.append(rows.clone())
        assert consumer(("keep", -1 - i, rows)) == ("kept", -1 - i)
        del rows
    for i in range(4):
        got = torch.tensor(consumer(("show", -1 - i))[2])
        assert torch.equal(got, expect[i]), f"capture {i}'s rows, held by the consumer, changed"
    assert bufs.stats()["reuses"] == 0  # every buffer went to the consumer: none written again


class _CapturingDataset(Dataset):
    """Each item is the output rows of ``net`` on inputs drawn from the index, captured with
    the dataset's ``HostBuffers`` (in the DataLoader worker)."""

    def __init__(self) -> None:
        self.net = _net()
        self.bufs = HostBuffers(pin=False)

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> torch.Tensor:
        return _capture(self.net, self.bufs, 2, seed=i)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_dataloader_worker_capturing_with_host_buffers_keeps_the_rows_it_returned(context):
    ds = _CapturingDataset()
    expect = [_capture(ds.net, HostBuffers(pin=False), 2, seed=i).clone() for i in range(len(ds))]
    loader = DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context=context)
    got = list(loader)  # all held while the worker captures the rest
    for i, (g, e) in enumerate(zip(got, expect)):
        assert torch.equal(g, e), f"item {i} changed after the worker captured later items"


def test_a_set_sent_to_another_process_arrives_empty():
    net = _net()
    bufs = HostBuffers(pin=False, depth=3)
    _capture(net, bufs, 2, seed=0)
    copy = pickle.loads(pickle.dumps(bufs))
    assert (copy.pin, copy.depth) == (False, 3)
    assert copy.stats()["buffers"] == 0 and bufs.stats()["buffers"] >= 1
