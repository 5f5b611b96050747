"""pyhook.stream's producer thread is kept between passes (issue 24, the producer-bound
stream): a normal pass hands its thread to the next pass, a pass that stops early or fails
ends it, an idle one ends by itself, and the rows are the same as on a fresh thread."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import pyhook
from pyhook.pipeline import stream as stream_mod
from pyhook.source import Batch


@pytest.fixture
def gpt():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=32)
    return transformers.GPT2Model(cfg).eval()


def _source(n=4):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        ids = torch.randint(0, 50, (2, 8), generator=g)
        keep = torch.ones(2, 8, dtype=torch.bool)
        out.append(Batch(ids, torch.ones_like(ids), keep, torch.tensor([2 * i, 2 * i + 1]), None))
    return out


class _ForwardThreads:
    """A hand-written forward hook: the thread of every forward of ``module``."""

    def __init__(self, module):
        self.idents: list[int] = []
        self.handle = module.register_forward_hook(
            lambda *_: self.idents.append(threading.get_ident())
        )

    def remove(self):
        self.handle.remove()


def _reference_rows(gpt, layer):
    """The rows of every token, from a hand-written hook on the main thread."""
    got = []
    h = gpt.get_submodule(layer).register_forward_hook(
        lambda m, i, o: got.append(o[0] if isinstance(o, tuple) else o)
    )
    try:
        with torch.no_grad():
            for b in _source():
                gpt(input_ids=b.input_ids, attention_mask=b.attention_mask)
    finally:
        h.remove()
    return torch.cat([x.reshape(-1, x.shape[-1]) for x in got])


def _pass(s):
    rows = [(b["row_index"], b["h.1"]) for b in s]
    idx = torch.cat([r for r, _ in rows])
    x = torch.cat([v for _, v in rows])
    return idx, x


@pytest.fixture(autouse=True)
def _no_idle_producer(monkeypatch):
    """Each test starts and ends with no kept producer (idle threads of other tests end)."""
    monkeypatch.setattr(stream_mod, "_IDLE_SECONDS", 0.2)
    _drain_idle()
    yield
    _drain_idle()


def _drain_idle():
    stream_mod._Producer.retire_idle()
    deadline = time.monotonic() + 10
    while any(t.name.startswith("pyhook-stream") for t in threading.enumerate()):
        assert time.monotonic() < deadline, [t.name for t in threading.enumerate()]
        time.sleep(0.02)


def test_normal_passes_share_one_producer_thread_and_rows_stay_exact(gpt, monkeypatch):
    monkeypatch.setattr(stream_mod, "_IDLE_SECONDS", 30.0)
    ref = _reference_rows(gpt, "h.1")
    seen = _ForwardThreads(gpt.h[1])
    s = pyhook.stream(gpt, _source(), "h.1", batch_size=8, buffer_rows=16, seed=3)
    try:
        first = _pass(s)
        n1 = len(seen.idents)
        idle = [t.name for t in threading.enumerate() if t.name.startswith("pyhook-stream")]
        second = _pass(s)
        again = _pass(pyhook.stream(gpt, _source(), "h.1", batch_size=8, buffer_rows=16, seed=3))
    finally:
        seen.remove()
    main = threading.get_ident()
    assert len(set(seen.idents)) == 1 and main not in seen.idents, "one producer for all passes"
    assert n1 == 4 and len(seen.idents) == 12
    assert idle == ["pyhook-stream (idle)"]
    for idx, x in (first, second, again):  # every token exactly once, the hand-hooked rows
        order = torch.argsort(idx[:, 0] * 100 + idx[:, 1])
        assert torch.equal(idx[order][:, 0], torch.arange(8).repeat_interleave(8))
        assert torch.equal(x[order], ref)
    assert torch.equal(first[0], again[0])  # a new stream with the same seed: same draws
    assert not torch.equal(first[0], second[0])  # pass 2 draws with seed + 1


def test_idle_producer_ends_by_itself(gpt):
    list(pyhook.stream(gpt, _source(), "h.1", batch_size=8, buffer_rows=16))
    assert len(stream_mod._Producer._idle) == 1
    deadline = time.monotonic() + 10  # _IDLE_SECONDS = 0.2
    while any(t.name.startswith("pyhook-stream") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the idle producer is still there"
        time.sleep(0.02)
    assert stream_mod._Producer._idle == []


def test_producer_releases_its_openmp_team_after_each_pass(gpt, monkeypatch):
    calls = []
    monkeypatch.setattr(
        stream_mod,
        "_release_producer_team",
        lambda: calls.append(threading.current_thread().name) or True,
    )
    s = pyhook.stream(gpt, _source(), "h.1", batch_size=8, buffer_rows=16)
    list(s)
    list(s)
    assert calls == ["pyhook-stream", "pyhook-stream"]


@pytest.mark.parametrize("how", ["break", "error"])
def test_a_pass_that_stops_early_or_fails_ends_its_thread(gpt, how):
    def bad():
        yield from _source(2)
        raise OSError("corpus unreadable")

    def endless():
        while True:
            yield from _source()

    if how == "break":
        for _ in pyhook.stream(gpt, endless(), "h.1", batch_size=8, buffer_rows=8):
            break
    else:
        with pytest.raises(OSError, match="corpus unreadable"):
            list(pyhook.stream(gpt, bad(), "h.1", batch_size=8, buffer_rows=8))
    assert stream_mod._Producer._idle == []  # not kept at all


def test_two_streams_at_once_each_get_a_producer(gpt, monkeypatch):
    monkeypatch.setattr(stream_mod, "_IDLE_SECONDS", 30.0)
    ref = _reference_rows(gpt, "h.1")
    list(pyhook.stream(gpt, _source(), "h.1", batch_size=8, buffer_rows=16))  # one kept thread
    a = pyhook.stream(gpt, _source(), "h.1", batch_size=8, buffer_rows=16, seed=1)
    b = pyhook.stream(gpt, _source(), "h.0", batch_size=8, buffer_rows=16, seed=2)
    xa, ia = [], []
    n_b = 0
    it_b = iter(b)
    for ba in a:
        bb = next(it_b)
        xa.append(ba["h.1"])
        ia.append(ba["row_index"])
        n_b += len(bb["tokens"])
    assert next(it_b, None) is None
    idx, x = torch.cat(ia), torch.cat(xa)
    order = torch.argsort(idx[:, 0] * 100 + idx[:, 1])
    assert torch.equal(x[order], ref) and n_b == 64
    assert len(stream_mod._Producer._idle) == 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_streams_on_a_producer_of_its_own(gpt, monkeypatch):
    monkeypatch.setattr(stream_mod, "_IDLE_SECONDS", 30.0)
    list(pyhook.stream(gpt, _source(), "h.1", batch_size=8, buffer_rows=16))
    assert len(stream_mod._Producer._idle) == 1  # the parent keeps one; the child has no thread
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a stream must not wait for the parent's thread
        code = 1
        try:
            torch.set_num_threads(1)  # the parent's OpenMP team is not the child's (libgomp)
            stream_mod.release_consumer_team = lambda: False  # keep the child's team as it is
            n = sum(len(b["tokens"]) for b in pyhook.stream(gpt, _source(), "h.1", batch_size=8))
            os.write(w, str(n).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    got = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's stream hung")
    got = os.read(r, 100)
    os.close(r)
    assert status == 0 and got == b"64"


def test_an_idle_producer_keeps_no_stream_alive(gpt, monkeypatch):
    import gc
    import weakref

    monkeypatch.setattr(stream_mod, "_IDLE_SECONDS", 30.0)
    s = pyhook.stream(gpt, _source(), "h.1", batch_size=8, buffer_rows=16)
    list(s)
    assert len(stream_mod._Producer._idle) == 1
    ref = weakref.ref(s)
    del s
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("how", ["close_iterator", "drop_iterator", "close_stream"])
def test_a_stale_iterator_waits_for_its_own_pass_not_the_kept_threads_next(gpt, monkeypatch, how):
    # Stream a's iterator took every batch but not the end of the pass; its producer went idle
    # and now runs stream b's pass. Closing a's iterator (or a, or dropping the iterator) in
    # b's loop must not wait for b's pass: that pass waits for this very loop (a deadlock).
    import gc

    monkeypatch.setattr(stream_mod, "_IDLE_SECONDS", 30.0)
    result = []

    def scenario():
        a = pyhook.stream(gpt, _source(), "h.1", batch_size=8, buffer_rows=8)
        it_a = iter(a)
        for _ in range(8):  # all 64 rows; the end marker stays in the queue
            next(it_a)
        deadline = time.monotonic() + 10
        while not stream_mod._Producer._idle:  # a's pass is over: its thread waits for b's
            assert time.monotonic() < deadline, "a's producer never went idle"
            time.sleep(0.01)
        b = pyhook.stream(gpt, _source(), "h.0", batch_size=8, buffer_rows=8)
        rows = 0
        for batch in b:
            rows += len(batch["tokens"])
            if rows == 8:
                if how == "close_iterator":
                    it_a.close()
                elif how == "drop_iterator":
                    del it_a
                    gc.collect()
                else:
                    a.close()
        result.append(rows)

    def target():
        try:
            scenario()
        except BaseException as e:  # reported by the test, on its own thread
            result.append(e)

    runner = threading.Thread(target=target, name="stale-iterator-scenario", daemon=True)
    runner.start()
    runner.join(30)
    assert not runner.is_alive(), "closing the stale iterator deadlocked the other stream's loop"
    assert result == [64]
