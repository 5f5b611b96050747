"""pyhook.store: safetensors shards, index, crash safety, resume, memory-mapped reader."""

from __future__ import annotations

import errno
import glob
import json
import os
import threading

import pytest
import safetensors.torch
import torch

from pyhook import store
from pyhook.store import CaptureExistsError, CaptureWriteError, ShardWriter, open_capture, writer


def _batches(n: int = 5, rows: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        r = rows + (i % 2)  # row counts differ between batches and layers
        out.append(
            (
                {
                    "a": torch.randn(r, 4, generator=g),
                    "b": torch.randn(r + 1, 2, 3, generator=g).to(torch.bfloat16),
                    "c": torch.randint(0, 100, (2,), generator=g),
                },
                r,
            )
        )
    return out


def _write(out, batches, **kw):
    with ShardWriter(out, settings={"k": 1}, **kw) as w:
        for b, n in batches:
            w.add(b, examples=n)
    return w


@pytest.mark.parametrize("shard_bytes", [1, 200, 1 << 20])
def test_roundtrip_matches_concatenation(tmp_path, shard_bytes):
    batches = _batches()
    _write(tmp_path, batches, shard_bytes=shard_bytes)
    r = open_capture(tmp_path)
    assert r.layers == ["a", "b", "c"]
    assert r.examples == sum(n for _, n in batches)
    for name in r.layers:
        want = torch.cat([b[name] for b, _ in batches])
        got = r[name].to_tensor()
        assert got.dtype == want.dtype and torch.equal(got, want)
        assert r.index["layers"][name]["shape"] == list(want.shape)
    if shard_bytes == 1:
        assert len(r.index["shards"]) == len(batches)
    # merged index.json on disk equals the reader's view, and carries versions/settings
    with open(tmp_path / "index.json") as f:
        idx = json.load(f)
    assert idx["shards"] == r.index["shards"] and idx["settings"] == {"k": 1}
    assert idx["pyhook_version"] == __import__("pyhook").__version__


def test_shards_are_plain_safetensors(tmp_path):
    batches = _batches(2)
    _write(tmp_path, batches, shard_bytes=1)
    files = sorted(glob.glob(str(tmp_path / "shard-r000-*.safetensors")))
    assert len(files) == 2
    for f, (b, _) in zip(files, batches):
        loaded = safetensors.torch.load_file(f)
        assert set(loaded) == set(b)
        for k in b:
            assert torch.equal(loaded[k], b[k])


def test_large_shards_start_their_data_at_a_page_boundary(tmp_path):
    # A cold read of rows maps whole pages: an unaligned start makes a 3 KB row span two pages
    # in 3 of 4 positions instead of 2 of 4 (more disk reads for the same rows).
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 768, generator=g)  # 3 MiB: one large shard
    tok = torch.arange(1024)
    with ShardWriter(tmp_path, settings={"k": 1}) as w:
        w.add({"h": x, "__token_ids__": tok}, examples=1024)
    small = tmp_path / "small"
    with ShardWriter(small, settings={"k": 1}) as w:
        w.add({"h": x[:4]}, examples=4)
    (big,) = glob.glob(str(tmp_path / "*.safetensors"))
    (little,) = glob.glob(str(small / "*.safetensors"))
    with open(big, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    assert (8 + n) % 4096 == 0
    # Still a plain safetensors file, read back exactly by safetensors and by the reader.
    loaded = safetensors.torch.load_file(big)
    assert torch.equal(loaded["h"], x) and torch.equal(loaded["__token_ids__"], tok)
    assert set(header) >= {"h", "__token_ids__"}
    assert torch.equal(open_capture(tmp_path).layer("h")[:], x)
    # Small shards keep safetensors' 8-byte alignment (no page of padding per tiny shard).
    with open(little, "rb") as f:
        m = int.from_bytes(f.read(8), "little")
    assert (8 + m) % 8 == 0 and m < 4096 - 8
    assert torch.equal(safetensors.torch.load_file(little)["h"], x[:4])


def test_layerdata_indexing_across_shards(tmp_path):
    batches = _batches(4)
    _write(tmp_path, batches, shard_bytes=1)
    a = open_capture(tmp_path)["a"]
    full = torch.cat([b["a"] for b, _ in batches])
    assert len(a.parts) == 4 and len(a) == len(full) and a.shape == full.shape
    assert torch.equal(a[2:11], full[2:11]) and torch.equal(a[::3], full[::3])
    assert torch.equal(a[-1], full[-1]) and torch.equal(a[5], full[5])
    idx = torch.tensor([13, 0, 7, 3, 3, -2])
    assert torch.equal(a[idx], full[idx])
    # an index of several dims gives [*idx.shape, *row], as a tensor (and a compact layer)
    # does; it was "gather_rows: idx must be 1-D"
    grid = torch.tensor([[13, 0], [7, -2], [3, 3]])
    assert torch.equal(a[grid], full[grid]) and a[grid].shape == (3, 2, *full.shape[1:])
    assert a[[[1, 2], [3, 4]]].shape == (2, 2, *full.shape[1:])
    assert a[torch.zeros(2, 0, dtype=torch.long)].shape == (2, 0, *full.shape[1:])
    with pytest.raises(IndexError):
        a[len(full)]


def test_reader_is_memory_mapped_and_never_writes(tmp_path):
    _write(tmp_path, _batches(1))
    f = glob.glob(str(tmp_path / "*.safetensors"))[0]
    with open(f, "rb") as fh:
        before = fh.read()
    t = open_capture(tmp_path)["a"].to_tensor()
    t += 1  # copy-on-write mapping: the file stays as it was
    with open(f, "rb") as fh:
        assert fh.read() == before


def test_batches_sequential_and_shuffled(tmp_path):
    g = torch.Generator().manual_seed(1)
    data = [
        {"x": torch.randn(7, 3, generator=g), "y": torch.arange(7.0).unsqueeze(1)} for _ in range(3)
    ]
    with ShardWriter(tmp_path, shard_bytes=1) as w:
        for d in data:
            w.add(d, examples=7)
    r = open_capture(tmp_path)
    full = torch.cat([d["x"] for d in data])
    seq = list(r.batches(4))
    assert [len(b["x"]) for b in seq] == [4, 4, 4, 4, 4, 1]
    assert torch.equal(torch.cat([b["x"] for b in seq]), full)
    assert [len(b["x"]) for b in r.batches(4, drop_last=True)] == [4] * 5
    sh1 = list(r.batches(5, shuffle=True, seed=3))
    sh2 = list(r.batches(5, shuffle=True, seed=3))
    cat1 = torch.cat([b["x"] for b in sh1])
    assert torch.equal(cat1, torch.cat([b["x"] for b in sh2]))  # reproducible
    assert not torch.equal(cat1, full)  # really shuffled
    assert torch.equal(cat1.sort(0).values, full.sort(0).values)  # a permutation
    # rows stay aligned across layers: x and y rows come from the same index
    ys = torch.cat([b["y"] for b in sh1]).squeeze(1)
    order = torch.cat([torch.arange(7.0)] * 3)
    assert torch.equal(ys, order[torch.randperm(21, generator=torch.Generator().manual_seed(3))])


def test_batches_refuses_layers_with_different_row_counts(tmp_path):
    _write(tmp_path, _batches(2))
    with pytest.raises(ValueError, match="different row counts"):
        next(open_capture(tmp_path).batches(2))
    assert len(next(open_capture(tmp_path).batches(2, layers=["a"]))["a"]) == 2


def test_row_shape_change_is_a_clear_error(tmp_path):
    with ShardWriter(tmp_path) as w:
        w.add({"a": torch.zeros(2, 3)}, examples=2)
        with pytest.raises(ValueError, match=r"'a'.*rows of shape \[4\]"):
            w.add({"a": torch.zeros(2, 4)}, examples=2)


def test_a_resume_by_another_model_with_the_same_layers_is_refused(tmp_path):
    """Two model classes with layers of the same names and widths: the second capture into the
    directory is refused naming the models (it appended its rows to the first's before); the
    same model resumes, also through torch.compile's wrapper."""
    from pyhook.capture import capture

    class NetA(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    class NetB(NetA):
        pass

    a, b = NetA(), NetB()
    with capture(a, ["lin"], out=tmp_path / "a"):
        a(torch.randn(3, 4))
    with (
        pytest.raises(CaptureExistsError, match="model: 'NetA' \\(stored\\) != 'NetB' \\(now\\)"),
        capture(b, ["lin"], out=tmp_path / "a"),
    ):
        b(torch.randn(3, 4))
    assert not b.lin._forward_hooks and not b._forward_pre_hooks
    wrapped = type("OptimizedModule", (torch.nn.Module,), {})()
    wrapped._orig_mod = a  # what torch.compile's wrapper holds
    with capture(a, ["lin"], out=tmp_path / "a") as rec:
        assert rec.examples_done == 3
    assert open_capture(tmp_path / "a").index["meta"]["model"] == "NetA"
    from pyhook.pipeline.capture import _unwrapped

    assert _unwrapped(wrapped) is a


def test_different_settings_refused_same_settings_resume(tmp_path):
    batches = _batches(6)
    # "crash" after 3 batches: abort leaves only the listed (complete) shards
    w = ShardWriter(tmp_path, settings={"k": 1}, shard_bytes=1)
    for b, n in batches[:3]:
        w.add(b, examples=n)
    w.flush()
    w._queue.join()
    w.abort()
    assert not (tmp_path / "index.json").exists()
    # debris of an interrupted write and a renamed-but-unlisted shard
    (tmp_path / "shard-r000-000003.safetensors.tmp").write_bytes(b"half")
    (tmp_path / "shard-r000-000009.safetensors").write_bytes(b"unlisted")

    with pytest.raises(CaptureExistsError, match="k: 1 \\(stored\\) != 2 \\(now\\)"):
        ShardWriter(tmp_path, settings={"k": 2})

    w2 = ShardWriter(tmp_path, settings={"k": 1}, shard_bytes=1)
    assert w2.resumed and w2.examples_done == sum(n for _, n in batches[:3])
    assert (
        not glob.glob(str(tmp_path / "*.tmp"))
        and not (tmp_path / "shard-r000-000009.safetensors").exists()
    )
    for b, n in batches[3:]:
        w2.add(b, examples=n)
    w2.close()
    r = open_capture(tmp_path)
    assert r.examples == sum(n for _, n in batches)
    assert torch.equal(r["a"].to_tensor(), torch.cat([b["a"] for b, _ in batches]))

    # overwrite=True replaces the previous capture
    with ShardWriter(tmp_path, settings={"k": 2}, overwrite=True) as w3:
        w3.add({"z": torch.ones(1, 1)}, examples=1)
    r = open_capture(tmp_path)
    assert r.layers == ["z"] and r.examples == 1


def test_full_disk_leaves_complete_shards_and_consistent_index(tmp_path, monkeypatch):
    batches = _batches(4)
    real = writer._write_file  # what the writer thread calls: returns (bytes, checksum)
    calls = {"n": 0}

    def flaky(path, tensors, metadata=None, *, fsync=True):
        calls["n"] += 1
        if calls["n"] == 3:
            with open(path, "wb") as f:
                f.write(b"partial bytes")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, tensors, metadata, fsync=fsync)

    monkeypatch.setattr(writer, "_write_file", flaky)
    w = ShardWriter(tmp_path, settings={"k": 1}, shard_bytes=1, max_pending=1)
    with pytest.raises(CaptureWriteError, match=r"No space left on device.*resume"):
        for b, n in batches:
            w.add(b, examples=n)
        w.close()
    w.abort()
    assert not glob.glob(str(tmp_path / "*.tmp"))
    r = open_capture(tmp_path)
    assert len(r.index["shards"]) == 2
    assert torch.equal(r["a"].to_tensor(), torch.cat([b["a"] for b, _ in batches[:2]]))
    # once the disk has room again, the same settings resume after the 2 good shards
    monkeypatch.setattr(writer, "_write_file", real)
    with ShardWriter(tmp_path, settings={"k": 1}, shard_bytes=1) as w2:
        assert w2.examples_done == batches[0][1] + batches[1][1]
        for b, n in batches[2:]:
            w2.add(b, examples=n)
    assert torch.equal(
        open_capture(tmp_path)["a"].to_tensor(), torch.cat([b["a"] for b, _ in batches])
    )


def test_unwritable_path_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(CaptureWriteError, match="cannot write to the capture directory"):
        ShardWriter(blocker / "out")


def test_back_pressure_blocks_the_producer(tmp_path, monkeypatch):
    gate = threading.Event()
    real = writer._write_file

    def slow(*a, **k):
        gate.wait()
        return real(*a, **k)

    monkeypatch.setattr(writer, "_write_file", slow)
    w = ShardWriter(tmp_path, shard_bytes=1, max_pending=1)
    added = []

    def producer():
        for i in range(5):
            w.add({"a": torch.full((1, 2), float(i))}, examples=1)
            added.append(i)

    t = threading.Thread(target=producer)
    t.start()
    t.join(timeout=1.0)
    # one shard being written + one waiting in the queue; the third add must wait for the disk
    assert t.is_alive() and len(added) == 2
    gate.set()
    t.join()
    w.close()
    assert open_capture(tmp_path)["a"].to_tensor()[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_reader_merges_rank_files_without_index_json(tmp_path):
    for rank in (1, 0):
        with ShardWriter(tmp_path, rank=rank, world_size=2, settings={"s": 1}) as w:
            w.add({"a": torch.full((2, 1), float(rank))}, examples=2)
    os.remove(tmp_path / "index.json")
    r = open_capture(tmp_path)
    assert r.index["ranks"] == [0, 1] and r["a"].to_tensor().squeeze(1).tolist() == [
        0.0,
        0.0,
        1.0,
        1.0,
    ]


def test_open_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError):
        open_capture(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no pyhook capture"):
        open_capture(tmp_path)


def test_one_writer_per_rank_and_directory(tmp_path):
    # A second writer on the same directory (a nested capture, another process) would overwrite
    # the first one's shards and index: refused while the first is open, fine after.
    first = ShardWriter(tmp_path, settings={"k": 1})
    with pytest.raises(
        CaptureExistsError, match="is being written \\(rank 0\\) by another capture"
    ):
        ShardWriter(tmp_path, settings={"k": 1})
    ShardWriter(tmp_path, settings={"k": 1}, rank=1, world_size=2).abort()  # another rank: fine
    first.add({"a": torch.ones(2, 3)}, examples=2)
    first.close()
    with ShardWriter(tmp_path, settings={"k": 1}) as again:
        assert again.examples_done == 2


def test_missing_rank_is_warned_and_index_debris_removed(tmp_path):
    # rank 1 of 3 never wrote its index (it crashed): the reader says so instead of silently
    # returning rows with a hole in the input order; rank debris of a killed index write
    # (index-rNNN.json.tmpPID) is removed when that rank reopens the directory.
    for rank in (0, 2):
        with ShardWriter(tmp_path, settings={"k": 1}, rank=rank, world_size=3) as w:
            w.add({"a": torch.full((2, 3), float(rank))}, examples=2)
    (tmp_path / "index-r001.json.tmp4242").write_text("{")
    with pytest.warns(UserWarning, match=r"no index for rank\(s\) \[1\] of 3"):
        r = store.open_capture(tmp_path)
    assert r.index["missing_ranks"] == [1] and r.examples == 4
    with ShardWriter(tmp_path, settings={"k": 1}, rank=1, world_size=3) as w:
        w.add({"a": torch.ones(2, 3)}, examples=2)
    assert not list(tmp_path.glob("*.tmp*"))
    r = store.open_capture(tmp_path)  # complete now
    assert r.index["missing_ranks"] == [] and r["a"].to_tensor()[:, 0].tolist() == [
        0,
        0,
        1,
        1,
        2,
        2,
    ]
