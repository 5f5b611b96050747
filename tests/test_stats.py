"""Per-layer statistics computed while capturing, against statistics of the stored rows.

The reference is ``torch.var_mean`` in float64 over every stored row (read back from the store
or the recorder), and the mean L2 norm of those rows: the capture-time statistics must agree
after several batches, masks, a dtype cast, a resume and two gloo ranks.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from _models import gpt2
from torch import nn

from pyhook import annotations
from pyhook.capture import capture
from pyhook.store import open_capture


def reference(rows: torch.Tensor) -> dict[str, torch.Tensor]:
    x = rows.reshape(rows.shape[0], -1).double()
    var, mean = torch.var_mean(x, dim=0, correction=0)
    return {
        "count": torch.tensor(float(x.shape[0]), dtype=torch.float64),
        "mean": mean,
        "var": var,
        "norm_mean": torch.linalg.vector_norm(x, dim=1).mean(),
    }


def assert_stats(got: dict[str, torch.Tensor], rows: torch.Tensor) -> None:
    want = reference(rows)
    assert set(got) == {"count", "mean", "var", "norm_mean"}
    for k, v in want.items():
        assert got[k].dtype == torch.float64, k
        torch.testing.assert_close(got[k], v, rtol=1e-9, atol=1e-9, msg=k)


class Offset(nn.Module):
    """Activations far from zero (mean ~1000, unit variance): a naive sum of squares would
    lose the variance; a stable merge keeps it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)
        self.out = nn.Linear(5, 3)
        with torch.no_grad():
            self.lin.bias.fill_(1000.0)

    def forward(self, x, attention_mask=None):
        return self.out(self.lin(x))


def data(n: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randn(3 + i, 5, 6, generator=g)
        am = (torch.rand(3 + i, 5, generator=g) > 0.3).long()
        out.append((x, am))
    return out


def test_disk_stats_equal_the_stored_rows(tmp_path):
    torch.manual_seed(0)
    net = Offset()
    with torch.no_grad(), capture(net, ["lin", "out"], out=tmp_path, mask="attention_mask") as rec:
        for x, am in data():
            net(x, attention_mask=am)
    r = open_capture(tmp_path)
    for layer in ("lin", "out"):
        assert_stats(annotations.stats(r, layer), r[layer].to_tensor())
    assert int(annotations.stats(r, "lin")["count"]) == rec.rows["lin"]
    table = annotations.format_stats(r)
    assert "lin" in table and "out" in table and str(rec.rows["lin"]) in table


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_disk_stats_are_computed_on_the_forward_thread(tmp_path, monkeypatch, mode):
    # Issue 23 item 1: a writer thread that computes the float64 pass competes with the
    # forward's thread team for the cores; the native kernel does it in the layer hook instead,
    # on the forward's thread, right after the copy (one cached pass per block of rows).
    import threading

    from pyhook import _backend

    if not _backend.native_available():
        pytest.skip("needs the native kernel")
    threads: list[str] = []
    real = _backend.row_stats

    def spy(t):
        threads.append(threading.current_thread().name)
        return real(t)

    monkeypatch.setattr(_backend, "row_stats", spy)
    torch.manual_seed(0)
    net = Offset()
    with mode(), capture(net, ["lin", "out"], out=tmp_path, mask="attention_mask"):
        for x, am in data(3):
            net(x, attention_mask=am)
    assert threads == [threading.current_thread().name] * 6, threads
    r = open_capture(tmp_path)
    for layer in ("lin", "out"):
        assert_stats(annotations.stats(r, layer), r[layer].to_tensor())


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_reference_backend_leaves_disk_stats_to_the_writer_thread(tmp_path, monkeypatch, mode):
    # Without the native kernel the numpy pass is slow: a background writer computes it from
    # the capture's copy, off the forward (and the values still agree with the stored rows).
    import threading

    import pyhook._record as record
    from pyhook import _backend

    threads: list[str] = []
    real = record._host_stats

    def spy(x, out):
        threads.append(threading.current_thread().name)
        return real(x, out)

    monkeypatch.setattr(record, "_host_stats", spy)
    torch.manual_seed(0)
    net = Offset()
    with _backend.use_backend("reference"):
        with mode(), capture(net, ["lin", "out"], out=tmp_path, mask="attention_mask"):
            for x, am in data(3):
                net(x, attention_mask=am)
    assert len(threads) == 6 and all(n.startswith("pyhook-writer") for n in threads), threads
    r = open_capture(tmp_path)
    for layer in ("lin", "out"):
        assert_stats(annotations.stats(r, layer), r[layer].to_tensor())


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.bool]
)
@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (300, 70), (1000, 257)])
def test_native_row_stats_against_float64_reference(dtype, shape):
    # The native kernel (column ranges per thread, cached blocks merged with Chan's formula)
    # against torch.var_mean in float64 over the same rows, far from zero (mean ~1000).
    from pyhook import _backend

    if not _backend.native_available():
        pytest.skip("needs the native kernel")
    g = torch.Generator().manual_seed(shape[0])
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * 3 + 1000
    if dtype == torch.bool:
        x = x > 1000
    rows = x.to(dtype)
    got = annotations.merge_stats(_backend.row_stats(rows))
    assert_stats(got, rows.to(torch.float64))
    # a strided view (a column slice) is read as its values
    view = rows[:, ::2]
    assert_stats(annotations.merge_stats(_backend.row_stats(view)), view.to(torch.float64))
    assert _backend.row_stats(rows[:0]).tolist() == [[0.0] * (2 + 2 * shape[1])]


@pytest.mark.parametrize("backend_name", ["native", "reference"])
def test_an_infinite_column_mean_stays_infinite_in_a_batch_of_many_blocks(backend_name):
    # Blocks of rows were merged with mean += (block mean - mean) * share: an inf in an
    # earlier block made inf - inf, a NaN mean, where one block (or the float64 mean) gives inf.
    from pyhook import _backend
    from pyhook.pipeline._record import batch_stats

    if backend_name == "native" and not _backend.native_available():
        pytest.skip("needs the native kernel")
    x = torch.zeros(300, 700)  # 93 rows a block
    x[150, 0] = float("inf")  # block 2 of 4
    x[10, 1] = -float("inf")  # block 1
    x[5, 2], x[250, 2] = float("inf"), float("inf")
    x[5, 3], x[250, 3] = float("inf"), -float("inf")
    x[5, 4] = float("nan")
    with _backend.use_backend(backend_name):
        mean = batch_stats(x)[0, 2 : 2 + 700]
    want = x.double().mean(0)
    assert want[:3].tolist() == [float("inf"), -float("inf"), float("inf")]
    torch.testing.assert_close(mean, want, rtol=0, atol=0, equal_nan=True)


def test_stats_are_of_the_stored_dtype(tmp_path):
    torch.manual_seed(0)
    net = Offset()
    with torch.no_grad(), capture(net, "lin", out=tmp_path, dtype="float16"):
        for x, _ in data(2):
            net(x)
    r = open_capture(tmp_path)
    stored = r["lin"].to_tensor()
    assert stored.dtype == torch.float16
    assert_stats(annotations.stats(r, "lin"), stored)


def test_host_capture_stats(tmp_path):
    torch.manual_seed(0)
    net = Offset()
    with torch.no_grad(), capture(net, ["lin", "out"], mask="attention_mask", stats=True) as rec:
        for x, am in data():
            net(x, attention_mask=am)
    for layer in ("lin", "out"):
        assert_stats(rec.stats(layer), rec[layer])
    with capture(net, "lin") as plain:  # host captures compute none unless asked
        net(torch.randn(2, 6))
    with pytest.raises(LookupError, match="stats=True"):
        plain.stats("lin")


def test_rows_that_are_examples_flatten_each_row():
    model = gpt2()
    ids = torch.randint(0, 100, (4, 6))
    with torch.no_grad(), capture(model, "transformer.h.0", flatten=False, stats=True) as rec:
        model(input_ids=ids[:2])
        model(input_ids=ids[2:])
    s = rec.stats("transformer.h.0")
    assert s["mean"].shape == (6 * 32,)
    assert_stats(s, rec["transformer.h.0"])


def test_stats_survive_a_resume(tmp_path):
    torch.manual_seed(0)
    net = Offset()
    batches = data(4)
    for part in (batches[:2], batches[2:]):
        with torch.no_grad(), capture(net, "lin", out=tmp_path, mask="attention_mask") as rec:
            for x, am in part:
                net(x, attention_mask=am)
    assert rec.examples_done == 3 + 4
    r = open_capture(tmp_path)
    assert r.examples == 3 + 4 + 5 + 6
    assert_stats(annotations.stats(r, "lin"), r["lin"].to_tensor())


def test_partial_stats_are_refused(tmp_path):
    net = Offset()
    with capture(net, "lin", out=tmp_path):
        net(torch.randn(2, 6))
    with capture(net, "lin", out=tmp_path, stats=False):  # resumed without statistics
        net(torch.randn(2, 6))
    with pytest.raises(annotations.AnnotationMissingError, match="cover 2 of its 4 rows"):
        annotations.stats(open_capture(tmp_path), "lin")


def test_compiled_model_stats(tmp_path):
    torch.manual_seed(0)
    net = Offset()
    compiled = torch.compile(net, backend="eager")
    with torch.no_grad(), capture(compiled, "lin", out=tmp_path, mask="attention_mask"):
        for x, am in data(2):
            compiled(x, attention_mask=am)
    r = open_capture(tmp_path)
    assert_stats(annotations.stats(r, "lin"), r["lin"].to_tensor())


def test_merge_is_exact_for_any_split():
    from pyhook._record import batch_stats

    g = torch.Generator().manual_seed(0)
    x = torch.randn(101, 4, generator=g, dtype=torch.float64) * 3 + 1e4
    for cuts in ([50], [1, 2, 3], [0, 0, 100], list(range(1, 101, 7))):
        edges = [0, *cuts, 101]
        rows = torch.cat([batch_stats(x[a:b]) for a, b in itertools.pairwise(edges)])
        assert_stats(annotations.merge_stats(rows), x)


# -- two gloo ranks ------------------------------------------------------------------------------
def _rank_worker(rank: int, world: int, init_file: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        net = Offset()
        batches = data(4)
        share = batches[rank * 2 : (rank + 1) * 2]  # contiguous shares keep the data order
        first = sum(x.shape[0] for x, _ in batches[: rank * 2])
        with torch.no_grad(), capture(net, ["lin", "out"], out=out, mask="attention_mask") as rec:
            for x, am in share:
                ids = torch.arange(x.shape[0] * 5).reshape(x.shape[0], 5)  # stand-in token ids
                rec.annotate(ids, examples=torch.arange(first, first + x.shape[0]))
                first += x.shape[0]
                net(x, attention_mask=am)
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_give_the_single_process_stats(tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "ranks")
    mp.spawn(_rank_worker, args=(2, str(tmp_path / "init"), out), nprocs=2, join=True)
    torch.manual_seed(0)
    net = Offset()
    with torch.no_grad(), capture(net, ["lin", "out"], out=tmp_path / "one", mask="attention_mask"):
        for x, am in data(4):
            net(x, attention_mask=am)
    multi, single = open_capture(out), open_capture(tmp_path / "one")
    assert multi.index["ranks"] == [0, 1]
    for layer in ("lin", "out"):
        rows = single[layer].to_tensor()
        assert torch.equal(multi[layer].to_tensor(), rows)
        assert_stats(annotations.stats(multi, layer), rows)
        s, m = annotations.stats(single, layer), annotations.stats(multi, layer)
        for k in s:
            torch.testing.assert_close(m[k], s[k], rtol=1e-12, atol=1e-12)
    # the annotated global example index runs across both ranks' shards
    want = torch.cat([am.nonzero()[:, 0] for _, am in data(4)])
    offsets = torch.cat(
        [
            torch.full((int(am.sum()),), sum(x.shape[0] for x, _ in data(4)[:i]))
            for i, (x, am) in enumerate(data(4))
        ]
    )
    assert torch.equal(annotations.row_index(multi)[:, 0], want + offsets)


def test_a_batch_without_kept_rows_counts_nothing(tmp_path):
    torch.manual_seed(0)
    net = Offset()
    x, am = data(1)[0]
    with torch.no_grad(), capture(net, "lin", out=tmp_path, mask="attention_mask") as rec:
        net(x, attention_mask=torch.zeros_like(am))  # every token masked: no rows
        net(x, attention_mask=am)
    r = open_capture(tmp_path)
    assert r.rows("lin") == int(am.sum()) and rec.batches == 2
    assert_stats(annotations.stats(r, "lin"), r["lin"].to_tensor())


def _all_real_dtypes():
    return sorted(
        {
            v
            for v in vars(torch).values()
            if isinstance(v, torch.dtype)
            and not v.is_complex
            and v != torch.quint8
            and not str(v).startswith(("torch.q", "torch.bits"))
        },
        key=str,
    )


@pytest.mark.parametrize("dtype", _all_real_dtypes(), ids=str)
def test_row_stats_dtype_set_is_the_kernel_dispatch(dtype):
    # _backend._ROW_STATS_DTYPES mirrors the kernel's AT_DISPATCH list by hand: call the op
    # itself on every real dtype torch has and require the set to say exactly where it works, so
    # a change to either side fails here instead of a capture raising inside the hook.
    from pyhook import _backend

    if not _backend.native_available():
        pytest.skip("needs the native kernel")
    try:
        rows = torch.zeros(2, 3, dtype=dtype)
    except (RuntimeError, TypeError):
        pytest.skip(f"torch cannot make a CPU {dtype} tensor")
    try:
        torch.ops.pyhook.row_stats(rows)
        works = True
    except RuntimeError:
        works = False
    assert works == (dtype in _backend._ROW_STATS_DTYPES), dtype
    if not works:
        assert _backend.row_stats(rows) is None
