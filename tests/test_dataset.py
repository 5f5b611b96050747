"""CaptureDataset (pyhook/dataset.py): exact coverage per epoch over ranks x workers, shuffling,
batches of several layers of the same tokens, token ids, bad input, and the Hugging Face export.

Every capture here is written with the store's ShardWriter from tensors the test keeps, so each
batch is checked against those tensors (the independent reference), row by row.
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import NEUTRAL_CWD
from torch.utils.data import DataLoader

from pyhook.dataset import CaptureDataset, dataset, shuffle_quality, to_hf_dataset
from pyhook.store import ShardWriter, open_capture

ROWS_PER_BATCH = [7, 5, 9, 4, 6]  # 31 rows in 5 writer batches


def write_capture(path, *, tokens=False, dtype=torch.float32, extra=None, shard_bytes=1):
    """A capture whose rows are known: a[i] = (i, i*10 + j...), b[i] = -i, tokens[i] = 1000 + i."""
    out = str(path)
    a_all, b_all, t_all = [], [], []
    start = 0
    with ShardWriter(out, shard_bytes=shard_bytes) as w:
        for n in ROWS_PER_BATCH:
            i = torch.arange(start, start + n)
            a = torch.stack([i.float(), i.float() * 10 + 1, -i.float()], 1).to(dtype)
            b = (-i.float())[:, None].to(dtype)
            tensors = {"a": a, "b": b}
            if tokens:
                tensors["__token_ids__"] = 1000 + i
            if extra:
                tensors.update(extra(i))
            w.add(tensors, examples=n)
            a_all.append(a)
            b_all.append(b)
            t_all.append(1000 + i)
            start += n
    return out, torch.cat(a_all), torch.cat(b_all), torch.cat(t_all)


@pytest.fixture
def capture(tmp_path):
    return write_capture(tmp_path / "cap", tokens=True)


def collect(batches):
    return torch.cat([b["index"] for b in batches]) if batches else torch.empty(0, dtype=torch.long)


def check_rows(batch, a, b):
    idx = batch["index"]
    assert torch.equal(batch["a"], a[idx])
    assert torch.equal(batch["b"], b[idx])


@pytest.mark.parametrize("shuffle", [True, False, "chunks"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("workers", [0, 2])
def test_every_row_once_per_epoch(capture, shuffle, world_size, workers):
    path, a, b, _ = capture
    seen = []
    for rank in range(world_size):
        ds = CaptureDataset(
            path,
            ["a", "b"],
            batch_size=4,
            shuffle=shuffle,
            seed=3,
            rank=rank,
            world_size=world_size,
            with_index=True,
            chunk_rows=5,
            buffer_chunks=2,
        )
        batches = list(DataLoader(ds, batch_size=None, num_workers=workers))
        assert len(batches) == len(ds)
        for batch in batches:
            assert 1 <= len(batch["index"]) <= 4
            check_rows(batch, a, b)
        seen.append(collect(batches))
    everything = torch.cat(seen)
    assert sorted(everything.tolist()) == list(range(len(a)))


def test_shuffled_order_independent_of_workers(capture):
    path, *_ = capture
    ds = CaptureDataset(path, "a", batch_size=4, seed=1, with_index=True)
    alone = [b["index"] for b in DataLoader(ds, batch_size=None)]
    pooled = [b["index"] for b in DataLoader(ds, batch_size=None, num_workers=2)]
    assert all(torch.equal(x, y) for x, y in zip(alone, pooled)) and len(alone) == len(pooled)
    assert not torch.equal(torch.cat(alone), torch.arange(31))  # it is shuffled


def test_sequential_is_capture_order(capture):
    path, a, b, _ = capture
    ds = dataset(open_capture(path), ["a", "b"], batch_size=8, shuffle=False)
    batches = list(ds)
    assert [len(x["a"]) for x in batches] == [8, 8, 8, 7]
    assert torch.equal(torch.cat([x["a"] for x in batches]), a)
    assert torch.equal(torch.cat([x["b"] for x in batches]), b)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_set_epoch_reaches_persistent_workers(capture, context):
    """Workers kept across epochs (persistent_workers=True) follow set_epoch: every epoch gives
    the batches of that epoch in-process, not the first epoch's again."""
    path, *_ = capture
    ds = CaptureDataset(path, ["a"], batch_size=4, seed=3, with_index=True)
    loader = DataLoader(
        ds, batch_size=None, num_workers=2, persistent_workers=True, multiprocessing_context=context
    )
    for epoch in range(3):
        ds.set_epoch(epoch)
        got = [b["index"] for b in loader]
        want = [b["index"] for b in ds]
        assert len(got) == len(want) and all(map(torch.equal, got, want)), epoch


def test_set_epoch_reshuffles_reproducibly(capture):
    path, *_ = capture

    def order(seed, epoch):
        ds = CaptureDataset(path, "a", batch_size=31, seed=seed, with_index=True)
        ds.set_epoch(epoch)
        return next(iter(ds))["index"]

    assert torch.equal(order(0, 0), order(0, 0))
    assert torch.equal(order(0, 4), order(0, 4))
    assert not torch.equal(order(0, 0), order(0, 1))
    assert not torch.equal(order(0, 0), order(1, 0))
    for e in range(3):
        assert sorted(order(0, e).tolist()) == list(range(31))
    with pytest.raises(ValueError, match="epoch must be a non-negative int"):
        CaptureDataset(path, "a").set_epoch(-1)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_drop_last_gives_equal_full_batches_per_rank(capture, world_size):
    path, *_ = capture
    counts = []
    seen = []
    for rank in range(world_size):
        ds = CaptureDataset(
            path,
            ["a", "b"],
            batch_size=4,
            drop_last=True,
            rank=rank,
            world_size=world_size,
            with_index=True,
        )
        batches = list(ds)
        assert all(len(x["index"]) == 4 for x in batches)
        counts.append(len(batches))
        seen.extend(x["index"] for x in batches)
    assert len(set(counts)) == 1 and counts[0] == (31 // 4) // world_size
    flat = torch.cat(seen).tolist()
    assert len(set(flat)) == len(flat)  # no row twice
    assert 31 - len(flat) < world_size * 4  # only the leftover is skipped


def test_layers_of_the_same_token_come_together(capture):
    path, *_, tokens = capture
    for batch in CaptureDataset(path, ["b", "a"], batch_size=6, tokens=True, with_index=True):
        assert torch.equal(batch["a"][:, 0], -batch["b"][:, 0])
        assert batch["tokens"].dtype == torch.int64
        assert torch.equal(batch["tokens"], tokens[batch["index"]])
        assert list(batch) == ["b", "a", "tokens", "index"]


def test_default_layers_leave_out_reserved_names(capture):
    path, *_ = capture
    assert CaptureDataset(path).layers == ["a", "b"]


def test_tokens_without_token_ids_is_named(tmp_path):
    path, *_ = write_capture(tmp_path / "cap")
    with pytest.raises(ValueError, match="holds no token ids"):
        CaptureDataset(path, "a", tokens=True)


def test_unknown_layer_lists_the_layers(capture):
    path, *_ = capture
    with pytest.raises(KeyError, match=r"layer 'c' is not in the capture .* it holds \['a', 'b'\]"):
        CaptureDataset(path, ["a", "c"])
    with pytest.raises(KeyError, match="tokens=True"):
        CaptureDataset(path, ["__token_ids__"])


def test_different_row_counts_are_named(tmp_path):
    path, *_ = write_capture(tmp_path / "cap", extra=lambda i: {"per_example": i[:1, None].float()})
    with pytest.raises(ValueError, match=r"different row counts \{'a': 31, 'per_example': 5\}"):
        CaptureDataset(path, ["a", "per_example"])
    assert len(list(CaptureDataset(path, "per_example", batch_size=2))) == 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 0}, "batch_size must be a positive int"),
        ({"shuffle": "yes"}, "shuffle must be one of"),
        ({"rank": 2, "world_size": 2}, r"rank must be an int in 0\.\.1"),
        ({"world_size": 0}, "world_size must be a positive int"),
        ({"chunk_rows": 0}, "chunk_rows must be a positive int"),
    ],
)
def test_bad_arguments_are_named(capture, kwargs, match):
    path, *_ = capture
    with pytest.raises(ValueError, match=match):
        CaptureDataset(path, "a", **kwargs)


def test_batches_are_owned(capture):
    path, a, *_ = capture
    ds = CaptureDataset(path, "a", batch_size=31, shuffle=False)
    first = next(iter(ds))["a"]
    first.zero_()
    assert torch.equal(next(iter(ds))["a"], a)


def test_pickled_dataset_reopens_by_path(capture):
    path, *_ = capture
    ds = CaptureDataset(open_capture(path), ["a", "b"], batch_size=5, seed=2)
    state = pickle.dumps(ds)
    assert b"mmap" not in state
    copy = pickle.loads(state)
    for x, y in zip(ds, copy):
        assert torch.equal(x["a"], y["a"]) and torch.equal(x["b"], y["b"])


def test_spawned_workers(capture):
    """Workers started with 'spawn' get a pickled dataset and reopen the capture."""
    path, a, b, _ = capture
    ds = CaptureDataset(path, ["a", "b"], batch_size=8, with_index=True)
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    batches = list(loader)
    for batch in batches:
        check_rows(batch, a, b)
    assert sorted(collect(batches).tolist()) == list(range(31))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dtypes_are_kept(tmp_path, dtype):
    path, a, b, _ = write_capture(tmp_path / "cap", dtype=dtype)
    batch = next(iter(CaptureDataset(path, ["a", "b"], batch_size=31, with_index=True)))
    assert batch["a"].dtype == dtype
    check_rows(batch, a, b)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
def test_ranks_from_torch_distributed(capture, tmp_path):
    """Two gloo ranks build the dataset without rank arguments: together they see every row."""
    path, *_ = capture
    code = textwrap.dedent(
        f"""
        import json, sys, torch, torch.distributed as dist
        from pyhook.dataset import CaptureDataset
        rank = int(sys.argv[1])
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{_free_port()}",
                                rank=rank, world_size=2)
        ds = CaptureDataset({path!r}, "a", batch_size=3, with_index=True, seed=5)
        rows = [b["index"].tolist() for b in ds]
        json.dump({{"rows": rows, "len": len(ds)}}, open(sys.argv[2], "w"))
        dist.destroy_process_group()
        """
    )
    outs = [str(tmp_path / f"r{r}.json") for r in range(2)]
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(r), outs[r]], cwd=NEUTRAL_CWD)
        for r in range(2)
    ]
    for p in procs:
        assert p.wait(timeout=120) == 0
    results = []
    for o in outs:
        with open(o) as f:
            results.append(json.load(f))
    rows = [r for res in results for batch in res["rows"] for r in batch]
    assert sorted(rows) == list(range(31))
    assert [len(res["rows"]) for res in results] == [res["len"] for res in results] == [6, 5]
    # The same batches as rank arguments give (the split is batch b -> rank b % 2).
    mine = [
        b["index"].tolist()
        for b in CaptureDataset(
            path, "a", batch_size=3, with_index=True, seed=5, rank=1, world_size=2
        )
    ]
    assert results[1]["rows"] == mine


def test_shuffle_quality_orders_the_modes(tmp_path):
    """A global permutation mixes like a uniform sample; a shuffle buffer over few chunks less;
    sequential reads not at all."""
    n = 4096
    out = str(tmp_path / "big")
    with ShardWriter(out, shard_bytes=1) as w:
        for _ in range(4):
            w.add({"x": torch.zeros(n // 4, 1)}, examples=n // 4)

    def quality(**kw):
        ds = CaptureDataset(out, "x", batch_size=256, with_index=True, **kw)
        return shuffle_quality([b["index"] for b in ds], n, group_rows=64)

    glob, chunks, seq = (
        quality(shuffle=True),
        quality(shuffle="chunks", chunk_rows=64, buffer_chunks=8),
        quality(shuffle=False),
    )
    assert abs(glob["neighbour_corr"]) < 0.1 and 0.9 < glob["distinct_groups"] < 1.1
    assert chunks["distinct_groups"] < 0.5 * glob["distinct_groups"]
    assert seq["neighbour_corr"] > 0.99 and seq["distinct_groups"] < chunks["distinct_groups"]


# -- Hugging Face export -------------------------------------------------------------------------
def test_hf_dataset_rows_and_tokens(capture, tmp_path):
    path, a, b, tokens = capture
    hf = to_hf_dataset(open_capture(path), ["a", "b"], path=tmp_path / "hf", chunk_rows=8)
    assert hf.num_rows == 31 and hf.column_names == ["a", "b", "token_ids"]
    hf.set_format("torch")
    assert torch.equal(hf["a"][:], a)
    assert torch.equal(hf["b"][:], b)
    assert torch.equal(hf["token_ids"][:], tokens)


def test_hf_dataset_bfloat16(tmp_path):
    path, a, _, _ = write_capture(tmp_path / "cap", dtype=torch.bfloat16)
    as_float = to_hf_dataset(path, "a")
    assert as_float.features["a"].feature.dtype == "float32"
    assert "float32 (exact)" in as_float.info.description
    assert torch.equal(torch.tensor(as_float["a"]).bfloat16(), a)
    bits = to_hf_dataset(path, "a", bfloat16="uint16").with_format("numpy")
    assert bits.features["a"].feature.dtype == "uint16"
    # the Arrow column holds uint16; numpy formatting may widen it: narrow back, then view
    raw = bits["a"][:].astype("uint16")
    assert torch.equal(torch.from_numpy(raw).view(torch.bfloat16), a)
    with pytest.raises(ValueError, match="bfloat16 must be"):
        to_hf_dataset(path, "a", bfloat16="int8")


def test_hf_dataset_in_saelens_cached_layout(tmp_path):
    """SAELens' cached activations: one dataset row per context, the hook's column an Array2D of
    (context_size, d_in), token_ids a length-context_size int32 sequence, saved with
    save_to_disk and read with load_from_disk + set_format("torch")."""
    import datasets

    T, D, contexts = 4, 3, 6
    acts = torch.randn(contexts * T, D)
    ids = torch.randint(0, 50_000, (contexts * T,))
    out = str(tmp_path / "cap")
    with ShardWriter(out, shard_bytes=1) as w:
        for c in range(0, contexts, 2):  # two contexts per writer batch
            sl = slice(c * T, (c + 2) * T)
            w.add({"blocks.0": acts[sl], "__token_ids__": ids[sl]}, examples=2)
    hook = "blocks.0.hook_resid_post"
    hf = to_hf_dataset(out, "blocks.0", context_size=T, columns={"blocks.0": hook})
    hf.save_to_disk(str(tmp_path / "cached"))

    loaded = datasets.load_from_disk(str(tmp_path / "cached"))
    assert loaded.features[hook].shape == (T, D)  # what SAELens checks against (context_size, d_in)
    assert loaded.features["token_ids"].length == T
    loaded.set_format(type="torch", columns=[hook, "token_ids"])
    assert torch.equal(loaded[hook][:], acts.reshape(contexts, T, D))
    assert torch.equal(loaded["token_ids"][:].long(), ids.reshape(contexts, T))
    with pytest.raises(ValueError, match="context_size=5 does not divide the 24 rows"):
        to_hf_dataset(out, "blocks.0", context_size=5)


def test_hf_dataset_bad_layer_is_named(capture):
    path, *_ = capture
    with pytest.raises(KeyError, match="it holds"):
        to_hf_dataset(path, "nope")


def test_dataset_example_in_docs_runs_in_a_fresh_process(capture):
    """The module's documented DataLoader pattern under the default 'fork' start method, with
    pin_memory (a no-op without CUDA) and 2 workers, from a fresh interpreter."""
    path, *_ = capture
    code = (
        "import torch\nfrom torch.utils.data import DataLoader\nfrom pyhook.dataset import CaptureDataset\n"
        f"ds = CaptureDataset({path!r}, 'a', batch_size=4, with_index=True)\n"
        "loader = DataLoader(ds, batch_size=None, num_workers=2, pin_memory=torch.cuda.is_available())\n"
        "print(sorted(torch.cat([b['index'] for b in loader]).tolist()) == list(range(31)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=NEUTRAL_CWD,
        env={**os.environ},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"


def test_shard_deleted_mid_epoch(capture):
    """An open dataset keeps its memory maps (the deleted file's pages stay readable until they
    are unmapped), so the epoch completes with the right rows; a worker or pickled copy, which
    reopens the capture by path, gets the store's error naming the missing shard."""
    path, a, b, _ = capture
    ds = CaptureDataset(path, ["a", "b"], batch_size=4, with_index=True)
    it = iter(ds)
    seen = [next(it)]
    shard = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[1]
    os.remove(os.path.join(path, shard))
    seen.extend(it)
    for batch in seen:
        check_rows(batch, a, b)
    assert sorted(collect(seen).tolist()) == list(range(31))
    with pytest.raises((ValueError, OSError), match=shard):
        list(pickle.loads(pickle.dumps(ds)))
    loader = DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="spawn")
    with pytest.raises((ValueError, OSError), match=shard):
        list(loader)


def test_batches_check_no_shard_sizes_once_open(native, tmp_path, monkeypatch):
    # Each batch used to fstat every shard (the reader's check_mapped) before reading: O(shards)
    # a batch, a third of the Python time of a batch after a training step. The native copy now
    # catches the SIGBUS of a shard cut short (tests/test_store_damage.py names it), so the
    # batches of the fast path (batch() and the iterator) check no sizes.
    x = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
    with ShardWriter(tmp_path, shard_bytes=1) as w:
        for s in range(0, 64, 8):
            w.add({"a": x[s : s + 8]}, examples=8)
    ds = CaptureDataset(str(tmp_path), "a", batch_size=16, shuffle=True, seed=0)
    idx = torch.randperm(64)[:16]
    assert torch.equal(ds.batch(idx)["a"], x[idx])  # opens the reader, maps the shards
    checks = []
    monkeypatch.setattr(type(ds._reader), "check_mapped", lambda self: checks.append(1))
    assert torch.equal(ds.batch(idx)["a"], x[idx])
    got = torch.cat([b["a"] for b in ds])
    assert sorted(got[:, 0].tolist()) == x[:, 0].tolist()
    assert checks == []


def test_batches_go_through_one_native_plan_which_goes_with_the_dataset(native, capture):
    # The batch of a training loop passes the number of a plan made when the shards were
    # mapped (the parts checked and looked up once), not every shard of every layer: the
    # same rows, and the plan, with its hold on the maps, is freed with the dataset.
    path, a, b, t = capture
    ds = CaptureDataset(path, ["a", "b"], batch_size=4, tokens=True)
    idx = torch.tensor([30, 0, 17, 17, 5])
    ds.batch(idx)  # opens the reader, maps the shards, makes the plan
    plan, number, rows, keys = ds._fast
    calls = []

    def counted(n, i):
        calls.append(n)
        return rows(n, i)

    ds._fast = (plan, number, counted, keys)
    for k in range(3):
        i = idx.roll(k)
        got = ds.batch(i)
        assert torch.equal(got["a"], a[i]) and torch.equal(got["b"], b[i])
        assert torch.equal(got["tokens"], t[i])
    assert calls == [number] * 3
    del ds, plan, counted
    gc.collect()
    with pytest.raises(RuntimeError, match=f"no gather plan {number} "):
        torch.ops.pyhook.gather_plan_rows(number, idx)


def test_a_plan_the_native_core_refuses_leaves_the_general_path(native, capture, monkeypatch):
    # If the plan cannot be made, the dataset reads as before it had one (one native call of
    # every part a batch), instead of failing to open.
    from pyhook import _backend

    def refuse(*_args):
        raise RuntimeError("gather_plan: refused")

    monkeypatch.setattr(_backend, "_GatherPlan", refuse)
    path, a, b, t = capture
    ds = CaptureDataset(path, ["a", "b"], batch_size=4, tokens=True)
    idx = torch.tensor([30, 0, 17, 17, 5])
    for _ in range(2):
        got = ds.batch(idx)
        assert torch.equal(got["a"], a[idx]) and torch.equal(got["b"], b[idx])
        assert torch.equal(got["tokens"], t[idx])
    assert ds._fast is None and ds._flat is not None


@pytest.mark.parametrize("drop_last", [False, True])
def test_the_iterator_yields_the_epoch_order_across_conversion_groups(tmp_path, drop_last):
    # The int32 order is converted to int64 a group of batches at a time (256 batches of 3 rows
    # here): every batch, across a group boundary and the last partial one, is the slice of the
    # epoch's order a per-batch conversion gave, in order, each row once.
    x = torch.arange(1000 * 2, dtype=torch.float32).reshape(1000, 2)
    with ShardWriter(tmp_path, shard_bytes=4096) as w:
        for s in range(0, 1000, 100):
            w.add({"a": x[s : s + 100]}, examples=100)
    ds = CaptureDataset(
        str(tmp_path),
        "a",
        batch_size=3,
        shuffle=True,
        seed=5,
        drop_last=drop_last,
        with_index=True,
    )
    order = ds._order()
    count = 1000 // 3 if drop_last else -(-1000 // 3)
    want = [order[b * 3 : (b + 1) * 3].long() for b in range(count)]
    got = list(ds)
    assert len(got) == count
    for g, idx in zip(got, want):
        assert torch.equal(g["index"], idx)
        assert torch.equal(g["a"], x[idx])
