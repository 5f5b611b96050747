"""Shard files written with O_DIRECT (pyhook/pipeline/_directio.py): the same bytes and checksum
as the buffered writer over odd sizes, unaligned and aligned pieces, many pieces and empty ones;
the page cache left empty by a capture; the fallback to buffered writes when the file system
refuses direct I/O; the PYHOOK_DIRECT_IO switch."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

import pytest
import safetensors.torch
import torch

import pyhook
from pyhook.pipeline import _directio
from pyhook.pipeline import format as fmt

PAGE = 4096


def _supports_direct(directory: str) -> bool:
    if not hasattr(os, "O_DIRECT"):
        return False
    path = os.path.join(directory, "probe")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        buf = mmap.mmap(-1, PAGE)
        try:
            os.pwrite(fd, buf, 0)
        except OSError:
            return False
        return True
    finally:
        os.close(fd)
        os.remove(path)


def _aligned(nbytes: int, offset: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor of ``nbytes`` random bytes that starts ``offset`` bytes past a page boundary."""
    keep = mmap.mmap(-1, nbytes + offset + PAGE)
    whole = torch.frombuffer(keep, dtype=torch.uint8)
    whole.copy_(torch.randint(0, 256, whole.shape, dtype=torch.uint8))
    t = whole[offset : offset + nbytes].view(dtype)
    t._keep = keep  # type: ignore[attr-defined]
    return t


def _resident_pages(path: str) -> int:
    """How many of the file's pages are in the page cache (``mincore`` of a private mapping)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        buf = (ctypes.c_char * size).from_buffer(mm)
        n = (size + PAGE - 1) // PAGE
        vec = (ctypes.c_ubyte * n)()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        if libc.mincore(ctypes.addressof(buf), size, vec) != 0:
            pytest.skip(f"mincore failed: {os.strerror(ctypes.get_errno())}")
        del buf
        return sum(v & 1 for v in vec)
    finally:
        mm.close()


@pytest.fixture
def direct_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(_directio, "_refused", set())
    if not _supports_direct(str(tmp_path)):
        pytest.skip("this file system refuses O_DIRECT")
    return tmp_path


def _cases() -> dict[str, dict[str, list[torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(1000, 769, generator=g)  # odd width: rows of 3076 bytes
    return {
        "aligned pieces": {"a": [_aligned(3 << 20, 0), _aligned(2 << 20, 0)]},
        "aligned pieces, odd tail": {
            "a": [_aligned((1 << 20) + 12, 0)],
            "b": [_aligned(5 * 2, 0, torch.int16)],
        },
        "unaligned addresses": {"a": [_aligned(1 << 20, 8), _aligned(1 << 20, 100)]},
        "address lines up after the header": {"a": [_aligned(3 << 20, PAGE - 16)]},
        "odd sizes, slices": {"a": [big[1:], big[3:400], big[:0]], "b": [big[:5, :7].contiguous()]},
        "many small pieces": {"a": [torch.randn(3, 33, generator=g) for _ in range(2000)]},
        "empty tail": {"a": [_aligned(1 << 20, 0)], "e": [torch.zeros(0, 4)]},
        "whole blocks exactly": {"a": [_aligned((1 << 20) - PAGE, 0)]},
        "small file": {"a": [torch.arange(10.0)]},
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_direct_bytes_equal_buffered(direct_dir, monkeypatch, case):
    tensors = _cases()[case]
    meta = {"format": "pyhook", "note": case}
    monkeypatch.setenv("PYHOOK_DIRECT_IO", "0")
    n0, c0 = fmt._write_file(str(direct_dir / "buffered"), tensors, meta)
    before = dict(_directio.counters)
    monkeypatch.setenv("PYHOOK_DIRECT_IO", "1")
    n1, c1 = fmt._write_file(str(direct_dir / "direct"), tensors, meta)
    assert _directio.counters["files"] == before["files"] + 1  # this one went past the cache
    assert (n1, c1) == (n0, c0)
    data = (direct_dir / "direct").read_bytes()
    assert data == (direct_dir / "buffered").read_bytes()
    assert len(data) == n1
    loaded = safetensors.torch.load_file(str(direct_dir / "direct"))
    for name, pieces in tensors.items():
        want = torch.cat(pieces)
        assert loaded[name].shape == want.shape and loaded[name].dtype == want.dtype
        assert torch.equal(
            loaded[name].reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)
        )
    if case == "aligned pieces":  # read from the pieces' own memory, no copy
        assert _directio.counters["direct_bytes"] - before["direct_bytes"] >= 4 << 20


def test_capture_writes_past_the_page_cache(direct_dir, monkeypatch):
    """A capture's shard of 1 MiB or more is written with O_DIRECT (auto): none of its pages
    are left in the page cache, and its rows are the hooked layer's outputs."""
    monkeypatch.setenv("PYHOOK_DIRECT_IO", "auto")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 1024))
    xs = [torch.randn(512, 64) for _ in range(3)]
    want = [net(x).detach() for x in xs]
    before = dict(_directio.counters)
    out = str(direct_dir / "cap")
    with torch.no_grad(), pyhook.capture(net, "0", out=out):
        for x in xs:
            net(x)
    assert _directio.counters["files"] > before["files"]
    shards = sorted(p for p in os.listdir(out) if p.endswith(".safetensors"))
    assert shards
    for s in shards:
        path = os.path.join(out, s)
        if os.path.getsize(path) >= 1 << 20:
            assert _resident_pages(path) <= 1, s  # at most the one read by the close check
    got = pyhook.store.open_capture(out).layer("0")[:]
    assert torch.equal(got, torch.cat(want))


def test_default_is_auto_for_pieces_that_line_up(direct_dir, monkeypatch):
    """Unset, the switch means ``auto``: a shard whose rows lie page-aligned in memory (as the
    pool's capture buffers do) goes past the page cache; one whose rows would all be copied
    through the staging buffer (torch's own allocations: cast, encoded rows) is written buffered,
    and so is everything with ``0``."""
    monkeypatch.delenv("PYHOOK_DIRECT_IO", raising=False)
    assert _directio.mode() == "auto"
    before = _directio.counters["files"]
    fmt._write_file(str(direct_dir / "big"), {"a": [_aligned(2 << 20, 0)]})
    assert _directio.counters["files"] == before + 1
    fmt._write_file(str(direct_dir / "unaligned"), {"a": [_aligned(2 << 20, 64)]})
    assert _directio.counters["files"] == before + 1
    # 80% of the bytes line up: under the 90% rule, buffered
    mixed = {"a": [_aligned(4 << 20, 0)], "b": [_aligned(1 << 20, 64)]}
    fmt._write_file(str(direct_dir / "mixed"), mixed)
    assert _directio.counters["files"] == before + 1
    monkeypatch.setenv("PYHOOK_DIRECT_IO", "1")  # forced: the same shard goes direct
    fmt._write_file(str(direct_dir / "mixed1"), mixed)
    assert _directio.counters["files"] == before + 2
    assert (direct_dir / "mixed").read_bytes() == (direct_dir / "mixed1").read_bytes()
    monkeypatch.setenv("PYHOOK_DIRECT_IO", "0")
    fmt._write_file(str(direct_dir / "big0"), {"a": [_aligned(2 << 20, 0)]})
    assert _directio.counters["files"] == before + 2


@pytest.mark.parametrize("seed", range(6))
def test_direct_share_is_what_the_writer_writes_directly(direct_dir, monkeypatch, seed):
    """``direct_share`` (the ``auto`` rule's estimate, made before the file is opened) equals the
    share of bytes the writer then really writes from the pieces' own memory, over random
    layouts of aligned, unaligned, small and odd-sized pieces."""
    monkeypatch.setenv("PYHOOK_DIRECT_IO", "1")
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, list[torch.Tensor]] = {}
    for i in range(int(torch.randint(1, 6, (1,), generator=g))):
        pieces = []
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            size = int(torch.randint(1, 3 << 20, (1,), generator=g)) // 4 * 4 + 4
            offset = [0, 0, 64, 4096 - 16][int(torch.randint(0, 4, (1,), generator=g))]
            pieces.append(_aligned(size, offset))
        tensors[f"t{i}"] = pieces
    before = dict(_directio.counters)
    n, _ = fmt._write_file(str(direct_dir / "x"), tensors)
    data_bytes = sum(p.nbytes for ps in tensors.values() for p in ps)
    head = n - data_bytes  # the header's bytes come first
    layout = [(p.nbytes, p.data_ptr()) for ps in tensors.values() for p in ps]
    share = _directio.direct_share(head, layout)
    assert _directio.counters["direct_bytes"] - before["direct_bytes"] == round(share * data_bytes)


def test_capture_defaults_write_direct_and_encoded_stores_buffered(direct_dir, monkeypatch):
    """With the switch unset a capture's shards go past the page cache, while a compressed
    store (rows that are encoded first, so copied) is written through it."""
    monkeypatch.delenv("PYHOOK_DIRECT_IO", raising=False)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 1024))
    xs = [torch.randn(512, 64) for _ in range(3)]
    want = torch.cat([net(x).detach() for x in xs])
    for opts, direct in (({}, True), ({"compress": "zstd"}, False)):
        before = dict(_directio.counters)
        out = str(direct_dir / f"cap-{bool(opts)}")
        with torch.no_grad(), pyhook.capture(net, "0", out=out, **opts):
            for x in xs:
                net(x)
        assert (_directio.counters["files"] > before["files"]) is direct, opts
        got = pyhook.store.open_capture(out).layer("0")[:]
        assert torch.equal(got, want)


def test_auto_keeps_small_files_buffered(direct_dir, monkeypatch):
    monkeypatch.setenv("PYHOOK_DIRECT_IO", "auto")
    before = _directio.counters["files"]
    fmt._write_file(str(direct_dir / "small"), {"a": [torch.ones(3, 4)]})
    assert _directio.counters["files"] == before
    monkeypatch.setenv("PYHOOK_DIRECT_IO", "0")
    fmt._write_file(str(direct_dir / "big"), {"a": [_aligned(2 << 20, 0)]})
    assert _directio.counters["files"] == before


@pytest.mark.parametrize("where", ["open", "write"])
def test_refused_direct_io_falls_back_to_buffered(tmp_path, monkeypatch, where):
    """EINVAL at the open (tmpfs) or at the first write (some overlay file systems): the shard
    is written buffered, the same bytes, and later shards on that device skip the attempt."""
    monkeypatch.setattr(_directio, "_refused", set())
    monkeypatch.setenv("PYHOOK_DIRECT_IO", "1")
    calls = {"direct": 0}
    real_open, real_pwrite = os.open, os.pwrite

    def fake_open(path, flags, *a, **k):
        if flags & getattr(os, "O_DIRECT", 0):
            calls["direct"] += 1
            if where == "open":
                raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *a, **k)

    def fake_pwrite(fd, data, offset):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(_directio.os, "open", fake_open)
    if where == "write":
        monkeypatch.setattr(_directio.os, "pwrite", fake_pwrite)
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    tensors = {"a": [_aligned((2 << 20) + 4, 0)], "b": [torch.arange(5)]}
    n, c = fmt._write_file(str(tmp_path / "x"), tensors, {"k": "v"})
    monkeypatch.setattr(_directio.os, "open", real_open)
    monkeypatch.setattr(_directio.os, "pwrite", real_pwrite)
    assert calls["direct"] == 1
    monkeypatch.setenv("PYHOOK_DIRECT_IO", "0")
    n0, c0 = fmt._write_file(str(tmp_path / "y"), tensors, {"k": "v"})
    assert (n, c) == (n0, c0)
    assert (tmp_path / "x").read_bytes() == (tmp_path / "y").read_bytes()
    monkeypatch.setattr(_directio.os, "open", fake_open)
    monkeypatch.setenv("PYHOOK_DIRECT_IO", "1")
    fmt._write_file(str(tmp_path / "z"), tensors)  # the device is known to refuse: no attempt
    assert calls["direct"] == 1


def test_bad_switch_value_is_refused_before_writing(tmp_path, monkeypatch):
    monkeypatch.setenv("PYHOOK_DIRECT_IO", "yes")
    with pytest.raises(ValueError, match="PYHOOK_DIRECT_IO must be 0, 1 or auto"):
        fmt._write_file(str(tmp_path / "x"), {"a": [torch.ones(3)]})
    assert not (tmp_path / "x").exists()
