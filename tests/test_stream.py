"""pyhook.stream: live activations to a trainer, checked against `capture` + `run` over the same
packed parquet corpus (the rows a capture keeps, each exactly once; a tee that is the same store),
across 2 gloo ranks with uneven shares, and when the consumer stops (break, exception, Ctrl-C)."""

from __future__ import annotations

import filecmp
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import _stream_workers as W
import pytest
import torch
from _hygiene import diff, hook_snapshot

pytest.importorskip("pyarrow")

import pyhook
from pyhook.capture import capture
from pyhook.modules import LayerNotFoundError
from pyhook.pipeline.stream import Mixer
from pyhook.runner import _Keep, run
from pyhook.source import Batch
from pyhook.store import open_capture

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def tok():
    return W.tokenizer()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return W.write_corpus(str(tmp_path_factory.mktemp("stream") / "c.parquet"))


@pytest.fixture(scope="module")
def net(tok):
    return W.model(len(tok))


def reference(net, src, out=None, **kw):
    """What `capture` keeps: the recorder the command builds, driven by `run`."""
    keep = _Keep()
    rec = capture(net, W.LAYERS, mask=keep, out=out, **kw)
    with rec:
        run(net, src, rec, keep=keep)
    return rec


def joined(batches):
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def by_row_index(rows):
    """Rows sorted by (context, position): the order a capture stores them in."""
    idx = rows["row_index"]
    order = torch.argsort(idx[:, 0] * 10_000 + idx[:, 1])
    return {k: v[order] for k, v in rows.items()}


def store_rows(path):
    r = open_capture(path)
    out = {n: r[n][:] for n in r.layers}
    out["tokens"] = r.tokens
    out["row_index"] = r.row_index
    return r, out


# -- what comes out ---------------------------------------------------------------------------
def test_every_kept_row_exactly_once_equal_to_capture(net, tok, corpus):
    ref = reference(net, W.source(corpus, tok))
    s = pyhook.stream(net, W.source(corpus, tok), W.LAYERS, batch_size=32, buffer_rows=128)
    batches = list(s)
    assert all(len(b["tokens"]) == 32 for b in batches[:-1])
    got = joined(batches)
    idx = got["row_index"]
    assert len(set(map(tuple, idx.tolist()))) == len(idx) == ref.rows["h.0"] == s.rows
    # the stream is mixed: not the capture's order
    assert not torch.equal(idx, ref.row_index)
    got = by_row_index(got)
    assert torch.equal(got["row_index"], ref.row_index)
    assert torch.equal(got["tokens"], ref.tokens)
    for layer in W.LAYERS:  # rows of one token stay together across layers
        assert torch.equal(got[layer], ref[layer]), layer
    # excluded special tokens (BOS/EOS) are not among the rows, as in the capture
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    assert not (got["tokens"] == eot).any()


def test_seeded_and_reproducible(net, tok, corpus):
    def order(seed):
        s = pyhook.stream(
            net, W.source(corpus, tok), "h.1", batch_size=32, buffer_rows=96, seed=seed
        )
        return [b["row_index"] for b in s]

    a, b, c = order(3), order(3), order(4)
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_the_largest_seed_has_a_second_pass(net):
    # pass k draws with seed + k: seed 2**64 - 1 failed in the loop of the second pass
    # ("Overflow when unpacking long long"); the seed wraps as the generator's 64 bits do
    src = [_endless_batch(0)]
    s = pyhook.stream(net, src, "h.0", batch_size=4, buffer_rows=8, seed=2**64 - 1)
    first, second = [torch.cat([b["row_index"] for b in s]) for _ in range(2)]
    assert len(first) == len(second) == 16
    wrapped = torch.cat(
        [b["row_index"] for b in pyhook.stream(net, src, "h.0", batch_size=4, buffer_rows=8)]
    )
    assert torch.equal(second, wrapped)  # seed 2**64 is seed 0


def _endless_batch(i):
    ids = torch.arange(16).reshape(2, 8) + i
    return Batch(
        ids,
        torch.ones_like(ids),
        torch.ones_like(ids, dtype=torch.bool),
        torch.tensor([2 * i, 2 * i + 1]),
        None,
    )


def test_each_iteration_is_a_new_pass(net, tok, corpus):
    s = pyhook.stream(net, W.source(corpus, tok), "h.0", batch_size=64, buffer_rows=128, seed=5)
    a, b = joined(list(s)), joined(list(s))
    assert sorted(map(tuple, a["row_index"].tolist())) == sorted(
        map(tuple, b["row_index"].tolist())
    )
    assert len(a["row_index"]) == s.rows
    assert not torch.equal(a["row_index"], b["row_index"])  # pass k draws with seed + k
    assert torch.equal(by_row_index(a)["h.0"], by_row_index(b)["h.0"])


def test_a_second_pass_over_a_used_up_generator_says_so(net):
    # pass 2 over a generator the first pass used up was an epoch of no batch, silently
    s = pyhook.stream(net, _endless(2, []), "h.0", batch_size=16, buffer_rows=32)
    assert sum(len(b["tokens"]) for b in s) == 32
    with pytest.raises(ValueError, match=r"one-shot iterator .generator. that an earlier pass"):
        list(s)
    again = pyhook.stream(net, list(_endless(2, [])), "h.0", batch_size=16, buffer_rows=32)
    assert [sum(len(b["tokens"]) for b in again) for _ in range(2)] == [32, 32]


def test_mixer_output_does_not_depend_on_chunking():
    x = torch.arange(1000)

    def run_chunks(sizes):
        m = Mixer(256, 64, seed=7)
        out, at = [], 0
        for n in sizes:
            out += list(m.add({"x": x[at : at + n], "y": -x[at : at + n]}))
            at += n
        return out + list(m.finish())

    a = run_chunks([1000])
    b = run_chunks([1, 99, 300, 7, 593])
    assert [len(t["x"]) for t in a] == [64] * 15 + [40]
    assert all(torch.equal(p["x"], q["x"]) for p, q in zip(a, b))
    assert all(torch.equal(p["y"], -p["x"]) for p in a)  # keys move together
    assert sorted(torch.cat([t["x"] for t in a]).tolist()) == list(range(1000))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_mixer_finish_gives_the_concatenation_s_batches_without_copying_the_buffer(
    monkeypatch, dtype
):
    """The end of a pass: the rows held (the buffer's, then the staged ones) come out as the
    batches of their shuffled concatenation (the reference, made here with the same seeded
    draws), without that concatenation: it copied the whole buffer, twice its memory."""
    cap, b, seed = 256, 48, 11
    x = torch.arange(1000 + 30, dtype=torch.float32)
    m = Mixer(cap, b, seed=seed)
    list(m.add({"x": x[:1000].to(dtype), "i": torch.arange(1000)}))
    staged = m._n_staged
    list(m.add({"x": x[1000:].to(dtype), "i": torch.arange(1000, 1030)}))
    assert m._filled == cap and 0 < m._n_staged < b and staged != m._n_staged
    held = {k: v.clone() for k, v in m._buf.items()}
    late = {k: torch.cat([p[k] for p in m._staged]) for k in held}
    gen = torch.Generator().manual_seed(0)
    gen.set_state(m._gen.get_state())
    allocated = []
    real_cat, real_empty = torch.cat, torch.empty
    monkeypatch.setattr(
        torch, "cat", lambda t, *a, **k: allocated.append(real_cat(t, *a, **k)) or allocated[-1]
    )
    monkeypatch.setattr(
        torch, "empty", lambda *a, **k: allocated.append(real_empty(*a, **k)) or allocated[-1]
    )
    got = list(m.finish())
    monkeypatch.undo()
    assert max((len(t) for t in allocated), default=0) <= b  # nothing the size of the buffer
    rest = {k: torch.cat([held[k], late[k]]) for k in held}
    perm = torch.randperm(len(rest["i"]), generator=gen)
    want = [{k: v[perm[i : i + b]] for k, v in rest.items()} for i in range(0, len(perm), b)]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g["x"].dtype == dtype
        assert torch.equal(g["i"], w["i"]) and torch.equal(g["x"].float(), w["x"].float())
    assert torch.equal(got[0]["x"].float(), x.to(dtype).float()[got[0]["i"]])


def test_any_iterable_of_batches_and_dtype(net, tok, corpus):
    batches = list(W.source(corpus, tok).batches())
    ref = reference(net, batches, dtype=torch.float16)
    got = by_row_index(
        joined(list(pyhook.stream(net, batches, W.LAYERS, batch_size=50, dtype="float16")))
    )
    assert got["h.0"].dtype == torch.float16
    assert torch.equal(got["h.0"], ref["h.0"]) and torch.equal(got["row_index"], ref.row_index)


def test_float8_dtype_streams_the_rows_capture_keeps(net, tok, corpus):
    # a dtype a capture stores: the mixing buffer's slot copy had no float8 kernel on the CPU
    batches = list(W.source(corpus, tok, limit=6).batches())
    ref = reference(net, batches, dtype=torch.float8_e4m3fn)
    s = pyhook.stream(net, batches, W.LAYERS, batch_size=8, buffer_rows=16, dtype="float8_e4m3fn")
    got = by_row_index(joined(list(s)))
    assert got["h.0"].dtype == torch.float8_e4m3fn and s.rows == ref.rows["h.0"] > 16
    assert torch.equal(got["row_index"], ref.row_index)
    for layer in W.LAYERS:
        assert torch.equal(got[layer].view(torch.uint8), ref[layer].view(torch.uint8)), layer


# -- the tee -------------------------------------------------------------------------------------
def _same_store(a, b):
    names = sorted(n for n in os.listdir(a) if not n.endswith(".lock"))
    assert names == sorted(n for n in os.listdir(b) if not n.endswith(".lock"))
    for n in names:
        assert filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False), n


def test_tee_is_bit_identical_to_capture(net, tok, corpus, tmp_path):
    reference(net, W.source(corpus, tok), out=tmp_path / "cap", shard_bytes=20_000)
    s = pyhook.stream(
        net,
        W.source(corpus, tok),
        W.LAYERS,
        batch_size=32,
        buffer_rows=128,
        tee=tmp_path / "tee",
        shard_bytes=20_000,
    )
    teed = list(s)
    _same_store(tmp_path / "cap", tmp_path / "tee")
    assert len(open_capture(tmp_path / "tee").index["shards"]) > 2
    # the trainer gets the same batches, in the same order, with or without the tee
    plain = list(
        pyhook.stream(net, W.source(corpus, tok), W.LAYERS, batch_size=32, buffer_rows=128)
    )
    assert len(plain) == len(teed)
    for p, q in zip(plain, teed):
        for k in p:
            assert torch.equal(p[k], q[k]), k


def test_tee_resumes_after_break(net, tok, corpus, tmp_path):
    reference(net, W.source(corpus, tok), out=tmp_path / "cap", shard_bytes=20_000)
    before = hook_snapshot(net)
    kw = dict(batch_size=32, buffer_rows=64, tee=tmp_path / "tee", shard_bytes=20_000)
    first = []
    for b in pyhook.stream(net, W.source(corpus, tok), W.LAYERS, **kw):
        first.append(b)
        if len(first) == 3:
            break
    assert diff(before, hook_snapshot(net)) == []
    partial = open_capture(tmp_path / "tee")  # consistent after the break
    done = partial.examples
    total = open_capture(tmp_path / "cap").examples
    assert 0 < done < total
    s = pyhook.stream(net, W.source(corpus, tok), W.LAYERS, **kw)
    second = list(s)
    assert s.examples_done == done
    # after the resume the trainer gets the rows of the contexts the tee lacked, each once
    idx = joined(second)["row_index"]
    assert set(idx[:, 0].tolist()) == set(range(done, total))
    assert len(set(map(tuple, idx.tolist()))) == len(idx)
    # the rows it saw before the break were of stored contexts
    assert (joined(first)["row_index"][:, 0] < done).all()
    r, rows = store_rows(tmp_path / "tee")
    assert r.examples == total
    c, want = store_rows(tmp_path / "cap")
    for k in want:
        assert torch.equal(rows[k], want[k]), k
    for layer in W.LAYERS:  # per-batch statistics, merged
        sa, sb = pyhook.annotations.stats(r, layer), pyhook.annotations.stats(c, layer)
        for key in sb:
            assert torch.equal(sa[key], sb[key]), (layer, key)


def test_tee_keeps_the_skip_the_source_was_opened_with(net, tok, corpus, tmp_path):
    # open_source(skip=5): the tee started at context 0 (its resume point replaced the skip),
    # so teed and plain passes gave different rows and the tee was not capture's store
    reference(net, W.source(corpus, tok, limit=12, skip=5), out=tmp_path / "cap")
    kw = dict(batch_size=16, buffer_rows=32)
    plain = list(pyhook.stream(net, W.source(corpus, tok, limit=12, skip=5), "h.0", **kw))
    teed = list(
        pyhook.stream(
            net, W.source(corpus, tok, limit=12, skip=5), W.LAYERS, tee=tmp_path / "tee", **kw
        )
    )
    assert set(joined(teed)["row_index"][:, 0].tolist()) == set(range(5, 12))
    assert torch.equal(joined(plain)["row_index"], joined(teed)["row_index"])
    _same_store(tmp_path / "cap", tmp_path / "tee")


def test_overwrite_replaces_the_tee_once_not_every_pass(net, tok, corpus, tmp_path):
    # pass 2 of a stream made with overwrite=True wiped the tee pass 1 had completed, and a
    # break in it left only a part
    reference(net, W.source(corpus, tok, limit=4), out=tmp_path / "tee", dtype=torch.float16)
    s = pyhook.stream(
        net,
        W.source(corpus, tok, limit=30, batch_size=2),
        "h.0",
        batch_size=16,
        buffer_rows=32,
        tee=tmp_path / "tee",
        overwrite=True,
        shard_bytes=2000,
    )
    assert sum(len(b["tokens"]) for b in s) > 0 and open_capture(tmp_path / "tee").examples == 30
    for i, _ in enumerate(s):
        if i == 1:
            break
    assert open_capture(tmp_path / "tee").examples == 30
    # complete: nothing left to write; the pass reads the tee
    third = list(s)
    assert s.examples_done == 30 and s.from_tee and s.examples == 0
    assert sum(len(b["tokens"]) for b in third) == len(open_capture(tmp_path / "tee")["h.0"])


def test_a_complete_tee_is_read_back_shuffled_on_later_passes_without_a_forward(
    net, tok, corpus, tmp_path
):
    # pass 2 over a complete tee gave 0 rows: `for epoch in range(2)` trained one epoch
    from pyhook.dataset import CaptureDataset

    forwards = []
    handle = net.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        s = pyhook.stream(
            net,
            W.source(corpus, tok, limit=40),
            W.LAYERS,
            batch_size=32,
            buffer_rows=64,
            seed=5,
            tee=tmp_path / "tee",
            dtype=torch.float16,
            shard_bytes=4000,
        )
        live = list(s)
        assert forwards and not s.from_tee
        n = len(forwards)
        passes = [list(s), list(s)]
        assert len(forwards) == n  # no forward on the later passes
        assert s.from_tee and s.examples == 0 and s.examples_done == 40
    finally:
        handle.remove()
    want = by_row_index(joined(live))
    for got in passes:
        # the live pass's keys (in its order), dtypes and batch sizes
        assert [list(b) for b in got] == [list(live[0])] * len(got)
        assert [b[k].dtype for b in got for k in b] == [
            live[0][k].dtype for _ in got for k in live[0]
        ]
        assert [len(b["tokens"]) for b in got] == [len(b["tokens"]) for b in live]
        # every row of the live pass once (the same multiset), rows of a token together
        rows = by_row_index(joined(got))
        assert len(set(map(tuple, rows["row_index"].tolist()))) == len(rows["row_index"])
        for k in want:
            assert torch.equal(rows[k], want[k]), k
    # shuffled over the whole store from (seed, pass), as CaptureDataset shuffles it
    for epoch, got in enumerate(passes, start=1):
        ds = CaptureDataset(tmp_path / "tee", W.LAYERS, batch_size=32, seed=5, row_index=True)
        ds.set_epoch(epoch)
        ref = list(ds)
        assert all(torch.equal(a["row_index"], b["row_index"]) for a, b in zip(got, ref))
    assert not torch.equal(joined(passes[0])["row_index"], joined(passes[1])["row_index"])
    # a new stream over the complete tee reads it from its first pass (a rerun)
    again = pyhook.stream(
        net,
        W.source(corpus, tok, limit=40),
        W.LAYERS,
        batch_size=32,
        buffer_rows=64,
        seed=5,
        tee=tmp_path / "tee",
        dtype=torch.float16,
    )
    first = list(again)
    assert again.from_tee and len(forwards) == n
    assert sorted(map(tuple, joined(first)["row_index"].tolist())) == sorted(
        map(tuple, want["row_index"].tolist())
    )


def test_a_complete_tee_is_read_back_on_the_stream_s_device(tok, corpus, tmp_path, device):
    # the live pass's rows are on the model's device: so are the rows read back from the tee
    model = W.model(len(tok)).to(device)
    kw = dict(batch_size=16, buffer_rows=32, tee=tmp_path / "tee")
    s = pyhook.stream(model, W.source(corpus, tok, limit=6), W.LAYERS, **kw)
    live, again = list(s), list(s)
    assert s.from_tee and len(again) == len(live)
    for b in again:
        assert [(k, v.device.type, v.dtype) for k, v in b.items()] == [
            (k, v.device.type, v.dtype) for k, v in live[0].items()
        ]
    want, got = by_row_index(joined(live)), by_row_index(joined(again))
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_tee_holding_another_capture_is_refused_before_a_forward(net, tok, corpus, tmp_path):
    reference(net, W.source(corpus, tok, limit=4), out=tmp_path / "t", dtype=torch.float16)
    calls = []
    h = net.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        before = hook_snapshot(net)
        with pytest.raises(ValueError, match=r"tee .* already holds a different capture.*dtype"):
            pyhook.stream(net, W.source(corpus, tok), W.LAYERS, tee=tmp_path / "t")
        assert calls == [] and diff(before, hook_snapshot(net)) == []
    finally:
        h.remove()


# -- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, err, match",
    [
        ({"layers": "h.9"}, LayerNotFoundError, "h.9"),
        ({"buffer_rows": 8, "batch_size": 16}, ValueError, "buffer_rows"),
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"source": "c.parquet"}, TypeError, "source"),
        ({"layers": "h.0", "tee": 3}, TypeError, "tee"),
        # a tee that cannot be a store was refused only in the loop, after the first forward
        ({"tee": __file__}, ValueError, "tee .*test_stream.py' is a file, not a directory"),
        ({"tee": ""}, ValueError, "tee is an empty path"),
        ({"tee": "/proc/pyhook-tee"}, ValueError, "cannot write to tee '/proc/pyhook-tee'"),
        ({"device": "meta"}, ValueError, "device 'meta'.*no data"),
        ({"device": "no-such-device"}, ValueError, "device must be"),
        ({"drop_last": "no"}, TypeError, "drop_last must be a bool.*'no'"),
        ({"overwrite": 1}, TypeError, "overwrite must be a bool"),
        ({"quantise": "fp8"}, TypeError, "unknown option 'quantise'.*did you mean 'quantize'"),
        ({"quantize": "fp8"}, ValueError, "quantize= chooses how a tee stores .* pass tee="),
        ({"compress": "zstd"}, ValueError, "compress= chooses how a tee stores .* pass tee="),
        ({"rank": 2, "world_size": 2}, ValueError, r"rank must be .*\[0, world_size=2\), got 2"),
        ({"rank": 1}, ValueError, r"rank must be .*\[0, world_size=1\), got 1"),
        ({"rank": "1", "world_size": 2}, ValueError, "rank must be an int"),
        ({"world_size": 0}, ValueError, "world_size must be an int >= 1"),
        ({"seed": 2**64}, ValueError, "seed must be a 64-bit int"),
        (  # no process group: no vote, each rank would run to its own end (DDP then hangs)
            {"rank": 0, "world_size": 2, "even_batches": True},
            ValueError,
            "even_batches=True.*not initialized",
        ),
        ({"batchsize": 8}, TypeError, "unknown option 'batchsize'.*did you mean 'batch_size'"),
        pytest.param(
            {"device": "cuda"},
            ValueError,
            "device 'cuda'.*no usable CUDA",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is usable here"),
        ),
    ],
)
def test_bad_input_named_before_any_forward(net, tok, corpus, kw, err, match):
    calls = []
    h = net.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        before = hook_snapshot(net)
        args = {"source": W.source(corpus, tok), "layers": W.LAYERS, **kw}
        src, layers = args.pop("source"), args.pop("layers")
        with pytest.raises(err, match=match):
            pyhook.stream(net, src, layers, **args)
        assert calls == [] and diff(before, hook_snapshot(net)) == []
    finally:
        h.remove()


@pytest.mark.parametrize("item", [torch.ones(2, 8, dtype=torch.long), {"input_ids": None}])
def test_a_source_that_yields_no_batch_is_named(net, item):
    # token ids alone (or a tokenizer's dict): an AttributeError from the runner's internals
    before = hook_snapshot(net)
    s = pyhook.stream(net, [item], "h.0", batch_size=4, buffer_rows=8)
    with pytest.raises(TypeError, match=r"source must be .*Batch.* yielded a (Tensor|dict)"):
        list(s)
    _no_producer()
    assert diff(before, hook_snapshot(net)) == []


# -- stopping ------------------------------------------------------------------------------------
def _endless(n_forwards, counter):
    g = torch.Generator().manual_seed(0)
    for i in range(n_forwards):
        counter.append(i)
        ids = torch.randint(2, 40, (2, 8), generator=g)
        yield Batch(
            ids,
            torch.ones_like(ids),
            torch.ones(2, 8, dtype=torch.bool),
            torch.tensor([2 * i, 2 * i + 1]),
            None,
        )


def _no_producer():
    deadline = time.monotonic() + 5
    while any(t.name == "pyhook-stream" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the producer thread is still running"
        time.sleep(0.01)


@pytest.mark.parametrize("how", ["break", "raise"])
def test_consumer_stops_producer_within_a_forward(net, how):
    before = hook_snapshot(net)
    taken = []
    got = 0
    with pytest.raises(RuntimeError, match="trainer") if how == "raise" else _nothing():
        for _ in pyhook.stream(
            net, _endless(10_000, taken), "h.0", batch_size=16, buffer_rows=32, prefetch=1
        ):
            got += 1
            if got == 2:
                if how == "raise":
                    raise RuntimeError("trainer failed")
                break
    _no_producer()
    assert diff(before, hook_snapshot(net)) == []
    # 2 batches + the buffer + the queue need ~6 forwards of 16 rows; one more may be running
    assert len(taken) < 20


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_close_and_with_block(net):
    before = hook_snapshot(net)
    taken = []
    with pyhook.stream(net, _endless(10_000, taken), "h.0", batch_size=16, buffer_rows=32) as s:
        it = iter(s)
        next(it)
    _no_producer()
    assert diff(before, hook_snapshot(net)) == []
    assert len(taken) < 30


def test_producer_error_reaches_the_consumer(net):
    def bad():
        yield from _endless(3, [])
        raise OSError("corpus unreadable")

    before = hook_snapshot(net)
    with pytest.raises(OSError, match="corpus unreadable"):
        list(pyhook.stream(net, bad(), "h.0", batch_size=4, buffer_rows=8))
    _no_producer()
    assert diff(before, hook_snapshot(net)) == []


def test_producer_setup_error_reaches_the_consumer(net, monkeypatch):
    # an error while the producer sets its pass up (the mixer, the CUDA stream) is raised in
    # the loop as itself, not as "the producer thread died", and leaves no hook behind
    from pyhook.pipeline import stream as stream_mod

    err = RuntimeError("no generator on this device")

    def broken_mixer(*args, **kwargs):
        raise err

    monkeypatch.setattr(stream_mod, "Mixer", broken_mixer)
    before = hook_snapshot(net)
    taken = []
    s = pyhook.stream(net, _endless(3, taken), "h.0", batch_size=4, buffer_rows=8)
    with pytest.raises(RuntimeError, match="no generator on this device") as raised:
        list(s)
    assert raised.value is err and taken == []
    _no_producer()
    assert diff(before, hook_snapshot(net)) == []


def test_close_in_the_loop_body_ends_the_loop(net):
    before = hook_snapshot(net)
    taken = []
    s = pyhook.stream(net, _endless(10_000, taken), "h.0", batch_size=16, buffer_rows=32)
    got = 0
    for _ in s:  # ends quietly at the step after close(): no batch comes out after it
        got += 1
        if got == 2:
            s.close()
    assert got == s.batches == 2 and s.rows == 32
    _no_producer()
    assert diff(before, hook_snapshot(net)) == []
    assert len(taken) < 30


def test_close_from_another_thread_ends_the_waiting_loop(net):
    # a watchdog closes the stream while the trainer waits for a batch: the producer sits in
    # the corpus until the stop (no timing), the loop then ends without an error
    before = hook_snapshot(net)
    in_corpus, took = threading.Event(), threading.Event()

    def slow():
        yield from _endless(3, [])  # 48 rows: one batch out, 32 held in the buffer
        in_corpus.set()
        s._stop.wait(10)  # the pass's stop event: set by close()
        yield from _endless(3, [])

    s = pyhook.stream(net, slow(), "h.0", batch_size=16, buffer_rows=32)

    def watchdog():
        in_corpus.wait(10)
        took.wait(10)  # the trainer has its batch (close() drops the batches still queued)
        s.close()

    closer = threading.Thread(target=watchdog, daemon=True)
    closer.start()
    rows = []
    for b in s:
        rows.append(b["row_index"])
        took.set()
    closer.join(10)
    assert not closer.is_alive()
    assert len(rows) == s.batches == 1 and len(rows[0]) == 16
    _no_producer()
    assert diff(before, hook_snapshot(net)) == []


def test_an_iterator_never_advanced_starts_nothing(net):
    # zip(range(0), stream) makes an iterator and never advances it: no hook, no thread, no
    # forward, and the stream is not left "being iterated"
    _no_producer()
    before = hook_snapshot(net)
    taken = []
    s = pyhook.stream(net, _endless(6, taken), "h.0", batch_size=16, buffer_rows=32)
    for _step, _batch in zip(range(0), s):
        pass
    it = iter(s)
    del it
    assert taken == []
    assert not any(t.name == "pyhook-stream" for t in threading.enumerate())
    assert diff(before, hook_snapshot(net)) == []
    rows = torch.cat([b["row_index"] for b in s])  # the first pass, all of it
    assert sorted(map(tuple, rows.tolist())) == [(c, p) for c in range(12) for p in range(8)]
    assert taken == list(range(6))
    assert diff(before, hook_snapshot(net)) == []


def _start(mode, corpus, tee):
    env = {**os.environ, "PYTHONPATH": HERE}
    p = subprocess.Popen(
        [sys.executable, "-I", os.path.join(HERE, "_stream_workers.py"), mode, corpus, tee],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=HERE,
    )
    line = p.stdout.readline()
    assert line.strip() == "READY", (line, p.stderr.read() if p.poll() is not None else "")
    return p


def test_ctrl_c_leaves_no_hook_and_a_resumable_tee(net, tok, corpus, tmp_path):
    tee = str(tmp_path / "tee")
    p = _start("sigint", corpus, tee)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "STOPPED" in out and "hooks=[]" in out and "threads=[]" in out, out + err
    done = open_capture(tee).examples  # closed consistent
    total = open_capture(reference(net, W.source(corpus, tok), out=tmp_path / "cap").out).examples
    assert 0 < done < total
    list(
        pyhook.stream(net, W.source(corpus, tok), W.LAYERS, tee=tee, batch_size=16, buffer_rows=32)
    )
    _, rows = store_rows(tee)
    _, want = store_rows(tmp_path / "cap")
    for k in want:
        assert torch.equal(rows[k], want[k]), k


def test_killed_stream_resumes_the_tee(net, tok, corpus, tmp_path):
    tee = str(tmp_path / "tee")
    p = _start("kill", corpus, tee)
    time.sleep(0.5)
    p.kill()
    p.communicate(timeout=60)
    reference(net, W.source(corpus, tok), out=tmp_path / "cap")
    s = pyhook.stream(net, W.source(corpus, tok), W.LAYERS, tee=tee, batch_size=16, buffer_rows=32)
    second = joined(list(s))
    assert s.examples_done > 0
    assert set(second["row_index"][:, 0].tolist()) == set(
        range(s.examples_done, open_capture(tee).examples)
    )
    _, rows = store_rows(tee)
    _, want = store_rows(tmp_path / "cap")
    for k in want:
        assert torch.equal(rows[k], want[k]), k


# -- ranks ---------------------------------------------------------------------------------------
def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
def test_two_gloo_ranks_uneven_shares(net, tok, corpus, tmp_path):
    import torch.multiprocessing as mp

    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    limit = 25  # contexts: 13 on rank 0, 12 on rank 1
    ctx = mp.spawn(
        W.dist_worker, args=(2, _free_port(), str(tmp_path), corpus, limit), nprocs=2, join=False
    )
    deadline = time.monotonic() + 150
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for q in ctx.processes:
                if q.is_alive():
                    q.kill()
            pytest.fail("the ranks did not finish: a hang")
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r, x in enumerate(res):
        assert "exception" not in x, f"rank {r}:\n{x['exception']}"
    ref = reference(net, W.source(corpus, tok, limit=limit))
    for name in ("plain", "tee"):
        shares = [set(x[name]["row_index"][:, 0].tolist()) for x in res]
        assert shares[0] == set(range(0, limit, 2)) and shares[1] == set(range(1, limit, 2))
        got = by_row_index({k: torch.cat([x[name][k] for x in res]) for k in res[0][name]})
        assert torch.equal(got["row_index"], ref.row_index)
        for layer in W.LAYERS:
            assert torch.equal(got[layer], ref[layer])
    # uneven batch counts; with even_batches every rank stops at the shortest, rows counted
    (n0, rows0, _), (n1, rows1, _) = res[0]["even0"], res[1]["even0"]
    assert n0 != n1 and rows0 + rows1 == ref.rows["h.0"]
    (e0, kept0, drop0), (e1, kept1, drop1) = res[0]["even1"], res[1]["even1"]
    assert e0 == e1 == min(n0, n1)
    assert kept0 + drop0 <= rows0 and kept1 + drop1 <= rows1 and kept0 + kept1 < ref.rows["h.0"]
    # the merged tee holds both shares: the single-process capture's rows
    r, rows = store_rows(tmp_path / "tee")
    assert r.examples == limit
    # a second pass read the tee on both ranks (no forward): together every stored row once
    assert [x["tee_again_from_tee"] for x in res] == [(True, 0), (True, 0)]
    again = by_row_index({k: torch.cat([x["tee_again"][k] for x in res]) for k in rows})
    assert torch.equal(again["row_index"], ref.row_index)
    for layer in W.LAYERS:
        assert torch.equal(again[layer], ref[layer])
    got = by_row_index(rows)
    assert torch.equal(got["row_index"], ref.row_index)
    for layer in W.LAYERS:
        assert torch.equal(got[layer], ref[layer])


def test_module_docstring_examples_run():
    import doctest

    import pyhook.pipeline.stream as mod

    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 10 and result.failed == 0
