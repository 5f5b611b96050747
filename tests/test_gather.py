"""pyhook::gather_rows / gather_rows_into (csrc/cpu/gather.cpp) against the reference
(pyhook/_reference.py) and against an independent spec: ``torch.cat(parts)[idx]``."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from pyhook import _backend, _reference
from pyhook._backend import gather_rows, gather_rows_into

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64]


def make_parts(dtype, sizes=(5, 0, 7, 3), row_shape=(6,), seed=0):
    g = torch.Generator().manual_seed(seed)
    parts = []
    for n in sizes:
        t = torch.randn((n, *row_shape), generator=g) * 100
        parts.append(t.to(dtype))
    return parts


def spec(parts, idx):
    """The definition, written independently of both backends."""
    return torch.cat(parts)[idx]


def run_script(script, *args, timeout=120, env=None):
    """``script`` run by a fresh interpreter (``-I``: the installed pyhook) with ``args``."""
    return subprocess.run(
        [sys.executable, "-I", "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("row_shape", [(6,), (), (2, 3)])
def test_matches_cat_index(backend, dtype, row_shape):
    parts = make_parts(dtype, row_shape=row_shape)
    total = sum(len(p) for p in parts)
    idx = torch.randint(0, total, (40,), generator=torch.Generator().manual_seed(1))
    out = gather_rows(parts, idx)
    want = spec(parts, idx)
    assert out.dtype == dtype and out.shape == want.shape and out.is_contiguous()
    assert torch.equal(out, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_equals_reference(native, dtype):
    parts = make_parts(dtype, sizes=(300, 1, 0, 450), row_shape=(768,))
    # Large enough for the parallel path (> 1 MB), with repeats and a shuffled order.
    idx = torch.randint(0, 751, (3000,), generator=torch.Generator().manual_seed(2))
    native_out = gather_rows(parts, idx)
    with _backend.use_backend("reference"):
        reference_out = gather_rows(parts, idx)
    assert torch.equal(native_out, reference_out)
    assert torch.equal(native_out, _reference.gather_rows(parts, idx))


def test_sorted_and_reversed_orders(backend):
    parts = make_parts(torch.float32, sizes=(4, 9, 2))
    for idx in (torch.arange(15), torch.arange(14, -1, -1), torch.tensor([3, 3, 3, 0])):
        assert torch.equal(gather_rows(parts, idx), spec(parts, idx))


def test_empty_idx(backend):
    parts = make_parts(torch.float16)
    out = gather_rows(parts, torch.empty(0, dtype=torch.long))
    assert out.shape == (0, 6) and out.dtype == torch.float16
    assert gather_rows(parts, []).shape == (0, 6)
    out = torch.empty(0, 6, dtype=torch.float16)
    assert gather_rows_into(parts, torch.empty(0, dtype=torch.long), out) is out


def test_part_without_rows_gives_shape(backend):
    empty = torch.empty(0, 3, 4, dtype=torch.bfloat16)
    assert gather_rows([empty], []).shape == (0, 3, 4)
    with pytest.raises(IndexError, match=r"index 0 .* out of range for 0 rows"):
        gather_rows([empty], [0])


@pytest.mark.parametrize("bad", [-1, 15, 10**12])
def test_out_of_range_is_named(backend, bad):
    parts = make_parts(torch.float32, sizes=(5, 10))
    idx = torch.tensor([0, 3, bad, 1])
    with pytest.raises(
        IndexError, match=rf"index {bad} \(at position 2 of idx\) is out of range for 15 rows"
    ):
        gather_rows(parts, idx)
    out = torch.full((4, 6), 7.0)
    with pytest.raises(IndexError, match="out of range"):
        gather_rows_into(parts, idx, out)
    assert (out == 7.0).all()  # nothing written


def test_non_contiguous_parts_and_idx(backend):
    parts = [
        torch.randn(20, 8, 3)[:, :, 1],  # element stride 3: rows are not dense
        torch.randn(8, 7).t(),  # transposed
        torch.randn(10, 8)[::2],  # every other row: dense rows, row stride 16
        torch.randn(4, 8),
    ]
    assert not any(p.is_contiguous() for p in parts[:3])
    total = sum(len(p) for p in parts)
    idx = torch.randint(0, total, (64,), generator=torch.Generator().manual_seed(3))[::2]
    assert not idx.is_contiguous()
    assert torch.equal(gather_rows(parts, idx), spec(parts, idx))


def test_expanded_and_conj_parts(backend):
    expanded = torch.arange(4.0).expand(5, 4)  # row stride 0
    assert torch.equal(gather_rows([expanded], [4, 0]), expanded[[4, 0]])
    z = torch.randn(6, 3, dtype=torch.complex64).conj()
    assert torch.equal(gather_rows([z], [5, 1]), z[[5, 1]].resolve_conj())


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_unsigned_rows_of_several_parts(backend, dtype):
    # The reference wrote each part's rows with out[sel] = ..., and index_put has no kernel
    # for these dtypes: NotImplementedError where the native kernel gave the rows.
    parts = [torch.arange(6).reshape(3, 2).to(dtype), torch.arange(6, 10).reshape(2, 2).to(dtype)]
    idx = torch.tensor([4, 0, 3, 0])
    out = gather_rows(parts, idx)
    assert out.dtype == dtype
    assert torch.equal(out.to(torch.int64), torch.tensor([[8, 9], [0, 1], [6, 7], [0, 1]]))


@pytest.mark.parametrize("nparts", [1, 2])
def test_parts_that_require_grad_give_a_differentiable_gather(backend, nparts):
    # One part went to index_select(out=...), which refuses autograd: a RuntimeError, where
    # two parts gave rows that backpropagate.
    w = torch.randn(4, 3, requires_grad=True)
    parts = [w[:2], w[2:]] if nparts == 2 else [w]
    out = gather_rows(parts, [3, 0, 3])
    assert torch.equal(out, w.detach()[[3, 0, 3]])
    out.sum().backward()
    assert torch.equal(w.grad, torch.tensor([1.0, 0.0, 0.0, 2.0]).unsqueeze(1).expand(4, 3))


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
@pytest.mark.parametrize("nparts", [1, 2])
def test_unsigned_parts_without_a_row_shape(backend, dtype, nparts):
    # index_select has no kernel for 1-D uint16/uint32/uint64 tensors: the reference raised
    # NotImplementedError where the native kernel gave the values.
    x = torch.tensor([7, 65535, 0, 3]).to(dtype)
    parts = [x[:1], x[1:]] if nparts == 2 else [x]
    out = gather_rows(parts, [1, 3, 1, 0])
    assert out.dtype == dtype
    assert out.to(torch.int64).tolist() == [65535, 3, 65535, 7]


def test_into_a_part_is_refused_by_either_backend(backend):
    # The native kernel refuses an `out` that shares memory with a part; the reference wrote
    # the rows into it (x reversed in place).
    x = torch.arange(10.0).reshape(5, 2)
    with pytest.raises(RuntimeError, match=r"`out` .* shares memory with a part"):
        gather_rows_into([x[:2], x[2:]], [4, 3, 2, 1, 0], x)
    assert torch.equal(x, torch.arange(10.0).reshape(5, 2))
    with pytest.raises(RuntimeError, match=r"`out` .* shares memory with a part"):
        gather_rows_into([x], [4, 3], x[3:])


def test_output_is_owned(backend):
    parts = make_parts(torch.float32, sizes=(6,))
    before = parts[0].clone()
    out = gather_rows(parts, torch.arange(6))
    out.zero_()
    assert torch.equal(parts[0], before)
    for p in parts:
        assert out.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()


def test_from_memory_map(backend, tmp_path):
    rows = torch.randn(100, 16)
    path = tmp_path / "rows.bin"
    path.write_bytes(rows.numpy().tobytes())
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    mapped = torch.frombuffer(mm, dtype=torch.float32).view(100, 16)
    parts = [mapped[:40], mapped[40:]]
    idx = torch.randperm(100)
    out = gather_rows(parts, idx)
    assert torch.equal(out, rows[idx])
    del parts, mapped, out


def test_into_matches(backend):
    parts = make_parts(torch.bfloat16, sizes=(3, 4))
    idx = torch.tensor([6, 0, 2])
    out = torch.empty(3, 6, dtype=torch.bfloat16)
    gather_rows_into(parts, idx, out)
    assert torch.equal(out, spec(parts, idx))


@pytest.mark.parametrize(
    ("parts", "idx", "err", "match"),
    [
        ([], [0], ValueError, "`parts` is empty"),
        (
            [torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float16)],
            [0],
            TypeError,
            "part 1 has dtype",
        ),
        ([torch.zeros(2, 3), torch.zeros(2, 4)], [0], ValueError, "part 1 has shape"),
        ([torch.zeros(())], [0], ValueError, "part 0 must have a row dimension"),
        # a sparse part raised "Cannot access data pointer of Tensor that doesn't have storage"
        ([torch.zeros(2, 3), torch.eye(2, 3).to_sparse()], [0], TypeError, "part 1 has layout"),
        ([torch.zeros(2, 3)], torch.tensor([0.0]), TypeError, "`idx` must hold integers"),
        ([torch.zeros(2, 3)], torch.zeros(1, 1, dtype=torch.long), ValueError, "`idx` must be 1-D"),
    ],
)
def test_bad_arguments_are_named(backend, parts, idx, err, match):
    with pytest.raises(err, match=match):
        gather_rows(parts, idx)


def test_bad_out_is_named(backend):
    parts = [torch.zeros(4, 3)]
    with pytest.raises(
        ValueError, match=r"`out` must be a contiguous torch.float32 tensor of shape \(2, 3\)"
    ):
        gather_rows_into(parts, [0, 1], torch.empty(3, 2))
    with pytest.raises(ValueError, match="`out`"):
        gather_rows_into(parts, [0, 1], torch.empty(3, 2).t())


def test_native_checks_without_wrapper(native):
    """The op itself (what torch.compile or another caller reaches) names bad input too."""
    op = torch.ops.pyhook.gather_rows.default
    with pytest.raises(IndexError, match=r"index 9 .* out of range for 4 rows"):
        op([torch.zeros(4, 2)], torch.tensor([9]))
    with pytest.raises(RuntimeError, match="`idx` must be an int64 tensor"):
        op([torch.zeros(4, 2)], torch.tensor([0], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="part 1 has dtype"):
        op([torch.zeros(4, 2), torch.zeros(4, 2, dtype=torch.float64)], torch.tensor([0]))
    with pytest.raises(RuntimeError, match="`parts` is empty"):
        op([], torch.tensor([0]))


def test_pool_reuses_buffers(native):
    parts = make_parts(torch.float32, sizes=(2048,), row_shape=(256,))
    idx = torch.randperm(2048)
    before = _backend.pool_stats()["hits"]
    for _ in range(3):
        out = gather_rows(parts, idx)
        del out
    assert _backend.pool_stats()["hits"] >= before + 2


def test_runs_without_the_gil(native):
    """Another Python thread keeps running while a large gather is in the kernel."""
    parts = [torch.randn(8192, 1024)]
    idx = torch.randint(0, 8192, (8192 * 4,))
    ticks = []
    stop = threading.Event()

    def count():
        while not stop.is_set():
            ticks.append(time.perf_counter())

    t = threading.Thread(target=count)
    t.start()
    try:
        time.sleep(0.01)
        start = time.perf_counter()
        gather_rows(parts, idx)
        end = time.perf_counter()
    finally:
        stop.set()
        t.join()
    during = [x for x in ticks if start < x < end]
    # Holding the GIL for the whole copy would leave no ticks inside it (the interpreter
    # switches threads every 5 ms only between bytecodes).
    assert end - start > 0.02 and len(during) > 100


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(native, dtype):
    parts = make_parts(dtype, sizes=(3, 5))
    idx = torch.tensor([7, 0, 4, 4])
    torch.library.opcheck(torch.ops.pyhook.gather_rows.default, (parts, idx))
    torch.library.opcheck(
        torch.ops.pyhook.gather_rows.default, (parts, torch.empty(0, dtype=torch.long))
    )
    out = torch.empty(4, 6, dtype=dtype)
    torch.library.opcheck(torch.ops.pyhook.gather_rows_into.default, (parts, idx, out))


def test_compile(native):
    parts = make_parts(torch.float32, sizes=(3, 5))

    @torch.compile(backend="eager", fullgraph=True)
    def f(a, b, idx):
        return torch.ops.pyhook.gather_rows([a, b], idx) * 2

    idx = torch.tensor([1, 7])
    assert torch.equal(f(*parts, idx), spec(parts, idx) * 2)


def test_reference_backend_forced_by_env():
    """PYHOOK_BACKEND=reference gives the same rows (the backend is chosen per call)."""
    if os.environ.get("PYHOOK_BACKEND"):
        pytest.skip("backend forced by the environment")
    parts = make_parts(torch.int64, sizes=(4, 4))
    with _backend.use_backend("reference"):
        a = gather_rows(parts, [7, 1])
    assert torch.equal(a, gather_rows(parts, [7, 1]))


def _resident(t: torch.Tensor) -> list[bool]:
    """Whether each 4 KiB page under tensor ``t``'s memory is in the page cache (mincore)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    first = t.data_ptr() // page * page
    length = t.data_ptr() + t.nbytes - first
    vec = (ctypes.c_ubyte * ((length + page - 1) // page))()
    if libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(length), vec) != 0:
        pytest.skip(f"mincore failed: errno {ctypes.get_errno()}")
    return [bool(v & 1) for v in vec]


def _cold_mapping(tmp_path, data):
    """``data`` written to a file whose pages are then dropped from the page cache, mapped
    read-only: (the mmap, a tensor of ``data``'s shape over it)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "rows.bin"
    path.write_bytes(data.numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # clean pages: DONTNEED can drop them
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only memory, only read here
        return mm, torch.frombuffer(mm, dtype=data.dtype).view(data.shape)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise and mincore")
def test_a_sequential_batch_from_a_cold_file_reads_the_next_batch_ahead(native, tmp_path):
    rows, n = 4096, 512  # 1.5 MiB rows of 768 bytes; batches of 384 KiB
    data = torch.randn(rows, 192)
    mm, mapped = _cold_mapping(tmp_path, data)
    parts = [mapped[:1000], mapped[1000:]]  # the next batch crosses into the second part
    if any(_resident(mapped[n : 3 * n])):
        pytest.skip("the file system keeps the file in memory (tmpfs?): no cold read to test")
    # Rows 2n..3n are asked for ahead (the 8 sampled rows find them cold), across the parts.
    # The kernel may drop advice under memory pressure (its read-ahead allocations do not wait
    # for reclaim; seen once on a loaded machine), so the batch is read up to 3 times: each
    # read advises again while the next rows are still cold. Without read-ahead, none would be.
    for _ in range(3):
        out = gather_rows(parts, torch.arange(n, 2 * n))
        assert torch.equal(out, data[n : 2 * n])
        if all(_resident(mapped[2 * n : 3 * n])):
            break
    assert all(_resident(mapped[2 * n : 3 * n]))
    del out, parts, mapped
    mm.close()


@pytest.mark.parametrize(
    ("dtype", "row_shape"),
    [
        (torch.float32, (75,)),
        (torch.float16, (129,)),
        (torch.float32, (768,)),
        (torch.int64, (8, 9)),
    ],
)
def test_shuffled_rows_of_odd_sizes_across_pieces_are_exact(native, dtype, row_shape):
    # Rows of 300, 258, 3072 and 576 bytes (prefetched a page at a time, ahead of the copy and
    # past the end of each piece of work), a batch that is not a multiple of the piece size,
    # repeats and rows of every part, on one thread and (above 1 MiB) on several.
    parts = make_parts(dtype, sizes=(700, 3, 0, 1300), row_shape=row_shape, seed=3)
    for n in (5, 4099):
        idx = torch.randint(0, 2003, (n,), generator=torch.Generator().manual_seed(n))
        assert torch.equal(gather_rows(parts, idx), spec(parts, idx))
        out = torch.empty((n, *row_shape), dtype=dtype)
        assert torch.equal(gather_rows_into(parts, idx, out), spec(parts, idx))


def _layers():
    # Three layers as a dataset batch has them: different dtypes, row shapes and shard splits
    # (one layer in a single part, token ids as int64 scalars per row).
    g = torch.Generator().manual_seed(5)
    a = (torch.randn(2003, 768, generator=g), (700, 3, 0, 1300))
    b = ((torch.randn(2003, 2, 9, generator=g) * 50).to(torch.bfloat16), (2003,))
    t = (torch.randint(0, 50_000, (2003,), generator=g), (1000, 1003))
    return [list(x.split(list(sizes))) for x, sizes in (a, b, t)]


@pytest.mark.parametrize("n", [0, 1, 37, 4099])
def test_many_layers_in_one_call_match_the_spec(native, n):
    layers = _layers()
    flat = [p for parts in layers for p in parts]
    counts = [len(parts) for parts in layers]
    idx = torch.randint(0, 2003, (n,), generator=torch.Generator().manual_seed(n))
    got = torch.ops.pyhook.gather_rows_many(flat, counts, idx)
    assert len(got) == 3
    outs = [torch.full_like(spec(parts, idx), 7) for parts in layers]
    torch.ops.pyhook.gather_rows_many_into(flat, counts, idx, outs)
    for parts, g, o in zip(layers, got, outs):
        want = spec(parts, idx)
        assert g.dtype == want.dtype and torch.equal(g, want) and torch.equal(o, want)
        assert g.is_contiguous() and not any(g.numel() and g.is_set_to(p) for p in parts)
    # Outputs are separate tensors: writing one leaves the others and the parts alone.
    if n:
        got[0].zero_()
        assert torch.equal(got[1], spec(layers[1], idx)) and torch.equal(got[0], got[0] * 0)
        assert torch.equal(torch.cat(layers[0])[idx[:1]], spec(layers[0], idx[:1]))


def test_many_layers_bad_arguments_are_named_and_write_nothing(native):
    layers = _layers()
    flat = [p for parts in layers for p in parts]
    counts = [len(parts) for parts in layers]
    op, into = torch.ops.pyhook.gather_rows_many, torch.ops.pyhook.gather_rows_many_into
    with pytest.raises(RuntimeError, match=r"`counts` adds up to 6 parts, but 7 were given"):
        op(flat, [4, 1, 1], torch.tensor([0]))
    with pytest.raises(RuntimeError, match=r"counts\[1\] is 0"):
        op(flat, [4, 0, 3], torch.tensor([0]))
    with pytest.raises(RuntimeError, match="part 4 has dtype BFloat16, part 0 has Float"):
        op(flat, [5, 1, 1], torch.tensor([0]))  # layer 0 would mix float32 and bfloat16 parts
    idx = torch.tensor([3, 2003, 5])
    outs = [torch.full((3, *parts[0].shape[1:]), 7, dtype=parts[0].dtype) for parts in layers]
    with pytest.raises(IndexError, match=r"index 2003 \(at position 1 of idx\) is out of range"):
        into(flat, counts, idx, outs)
    assert all(bool((o == 7).all()) for o in outs)  # checked before any copy
    with pytest.raises(RuntimeError, match=r"2 outputs for 3 layers"):
        into(flat, counts, idx[:1], outs[:2])
    with pytest.raises(RuntimeError, match=r"`out` \(layer 1\) must be a CPU tensor of dtype"):
        into(flat, counts, idx[:1], [outs[0][:1], outs[0][:1], outs[2][:1]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_opcheck(native, dtype):
    a, b = make_parts(dtype, sizes=(3, 5)), make_parts(torch.int64, sizes=(8,), row_shape=())
    idx = torch.tensor([7, 0, 4, 4])
    torch.library.opcheck(torch.ops.pyhook.gather_rows_many.default, ([*a, *b], [2, 1], idx))
    outs = [torch.empty(4, 6, dtype=dtype), torch.empty(4, dtype=torch.int64)]
    torch.library.opcheck(
        torch.ops.pyhook.gather_rows_many_into.default, ([*a, *b], [2, 1], idx, outs)
    )


@pytest.mark.parametrize("n", [0, 1, 37, 4099])
def test_a_gather_plan_gives_what_gather_rows_many_gives(native, n):
    # A dataset's training loop passes its parts once (gather_plan) and then only the plan's
    # number and the rows: every layer's rows equal the spec and gather_rows_many's.
    layers = _layers()
    flat = [p for parts in layers for p in parts]
    counts = [len(parts) for parts in layers]
    plan = _backend._GatherPlan(flat, counts)
    for seed in range(3):  # the plan is reused
        idx = torch.randint(0, 2003, (n,), generator=torch.Generator().manual_seed(n + seed))
        got = plan(idx)
        many = torch.ops.pyhook.gather_rows_many(flat, counts, idx)
        assert len(got) == 3
        for parts, g, m in zip(layers, got, many):
            want = spec(parts, idx)
            assert g.dtype == want.dtype and g.shape == want.shape and g.is_contiguous()
            assert torch.equal(g, want) and torch.equal(g, m)
            assert not any(g.numel() and g.is_set_to(p) for p in parts)


def test_a_gather_plan_checks_its_parts_once_and_its_rows_every_call(native):
    layers = _layers()
    flat = [p for parts in layers for p in parts]
    make, rows = torch.ops.pyhook.gather_plan, torch.ops.pyhook.gather_plan_rows
    with pytest.raises(RuntimeError, match=r"`counts` adds up to 6 parts, but 7 were given"):
        make(flat, [4, 1, 1])
    with pytest.raises(RuntimeError, match="part 4 has dtype BFloat16, part 0 has Float"):
        make(flat, [5, 1, 1])
    plan = _backend._GatherPlan(flat, [len(parts) for parts in layers])
    with pytest.raises(IndexError, match=r"index 2003 \(at position 1 of idx\) is out of range"):
        plan(torch.tensor([3, 2003, 5]))
    with pytest.raises(RuntimeError, match="`idx` must be an int64 tensor, got Int"):
        plan(torch.tensor([3], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="`idx` must be 1-D"):
        plan(torch.tensor([[3]]))
    # The plan keeps its parts: dropping the caller's references changes nothing.
    want = [spec(parts, torch.tensor([2002, 0])) for parts in layers]
    del flat, layers
    assert all(torch.equal(g, w) for g, w in zip(plan(torch.tensor([2002, 0])), want))
    number = plan.id
    del plan  # released with its object
    with pytest.raises(RuntimeError, match=f"no gather plan {number} \\(released already"):
        rows(number, torch.tensor([0]))
    torch.ops.pyhook.gather_plan_release(number)  # a number no plan has: nothing happens


FORKED_GATHER = """
import os, sys
import numpy as np
import torch
from pyhook import _backend
from pyhook._backend import gather_rows
assert _backend.native_available()
torch.ops.pyhook._test_gather_settings(0, 0, 0)  # the helpers (a test setting)
# numpy, not torch, for the data and the spec: a forked child of a process that ran an
# OpenMP parallel region hangs in its own first one (libgomp), whatever pyhook does.
rng = np.random.default_rng(0)
a, b = rng.standard_normal((3000, 768), np.float32), rng.standard_normal((2000, 768), np.float32)
parts = [torch.from_numpy(a), torch.from_numpy(b)]
ix = rng.integers(0, 5000, 4096)
want = np.concatenate([a, b])[ix]
idx = torch.from_numpy(ix)
assert np.array_equal(gather_rows(parts, idx).numpy(), want)  # the parent's helpers started
pid = os.fork()
if pid == 0:
    threads = len(os.listdir("/proc/self/task"))  # the forking thread alone
    ok = all(np.array_equal(gather_rows(parts, idx).numpy(), want) for _ in range(20))
    os._exit(4 if len(os.listdir("/proc/self/task")) <= threads else 0 if ok else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs fork and /proc")
def test_a_forked_child_starts_its_own_helpers(native):
    # The process id is read once, and again in a forked child (pthread_atfork), not at every
    # call. A child that kept its parent's id would take the parent's helpers for its own:
    # threads that do not exist in the child, so it would copy every batch alone (the caller
    # takes the pieces no helper claimed). Exit 4: no helper thread started in the child.
    if torch.get_num_threads() < 2 or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two torch threads on two CPUs")
    r = run_script(FORKED_GATHER)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])


@pytest.fixture
def gather_settings(native):
    """Sets the native gathers' test settings (csrc/cpu/gather.cpp, ``gather_test_settings``):
    torch's team never (0), always (1) or when it spins (-1, the default), the helpers or the
    caller started late; each call also clears the one-thread back-off period an earlier call
    may have started. Reset to the defaults after the test."""

    def settings(team: int = -1, helper_delay_us: int = 0, caller_delay_us: int = 0) -> None:
        torch.ops.pyhook._test_gather_settings(team, helper_delay_us, caller_delay_us)

    settings()
    yield settings
    settings()


@pytest.mark.parametrize("late", ["helper", "caller"])
def test_a_thread_that_starts_late_leaves_its_pieces_to_the_other(gather_settings, late):
    # A large gather splits its pieces into one range per thread: each thread copies its own
    # range front to back, then takes what is left of the other's from the back. A helper (or
    # the caller) made to start 300 ms late (a test hook in csrc/cpu/gather.cpp) finds its range
    # done by the other thread; the output is exact either way, and the caller never waits for
    # a helper that has not claimed a piece.
    if torch.get_num_threads() < 2 or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two torch threads on two CPUs")
    gather_settings(team=0)  # the helpers, even if torch's workers spin
    parts = make_parts(torch.float32, sizes=(700, 3, 0, 1300), row_shape=(768,), seed=4)
    idx = torch.randint(0, 2003, (4099,), generator=torch.Generator().manual_seed(4))
    want = spec(parts, idx)
    gather_rows(parts, idx)  # helpers started
    gather_settings(team=0, **{f"{late}_delay_us": 300000})
    t0 = time.perf_counter()
    got = gather_rows(parts, idx)
    took = time.perf_counter() - t0
    gather_settings(team=0)
    assert torch.equal(got, want)
    if late == "helper":
        assert took < 0.25, f"the caller waited {took:.3f} s for a helper that had not started"
    else:
        assert took >= 0.3  # the delay ran: the helper copied every piece meanwhile
    out = torch.full_like(want, 7)
    assert torch.equal(gather_rows_into(parts, idx, out), want)


def test_a_large_call_that_fails_its_index_check_leaves_the_helpers_usable(native):
    # A large gather wakes the helpers before it checks the indices (so that they are running
    # when the work is published); a call that then fails its check publishes no work. The
    # helpers must go back to sleep and serve the next calls, now and after they slept.
    parts = make_parts(torch.float32, sizes=(700, 3, 0, 1300), row_shape=(768,), seed=5)
    good = torch.randint(0, 2003, (4099,), generator=torch.Generator().manual_seed(5))
    bad = good.clone()
    bad[-1] = 2003
    for _ in range(3):
        with pytest.raises(IndexError, match="2003"):
            gather_rows(parts, bad)
        assert torch.equal(gather_rows(parts, good), spec(parts, good))
        time.sleep(0.01)  # past the helpers' spin: asleep again


def _helper_threads():
    tids = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                if f.read().strip() == "pyhook-gather":
                    tids.append(int(t))
        except OSError:  # the thread ended
            pass
    return tids


def _my_cpu():
    with open("/proc/thread-self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


def test_helpers_are_kept_off_the_callers_cpu(gather_settings):
    # Woken while the other CPU is held (by torch's OpenMP workers spinning after a training
    # step), a helper was put on the caller's own CPU, preempted the caller and copied while it
    # waited. A large gather sets the helpers' affinity to the caller's CPUs but the one it
    # runs on; the helpers are named threads ("pyhook-gather", as top and py-spy show them).
    if torch.get_num_threads() < 2 or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two torch threads on two CPUs")
    if not os.path.exists("/proc/thread-self/stat"):
        pytest.skip("needs /proc")
    parts = make_parts(torch.float32, sizes=(700, 3, 0, 1300), row_shape=(768,), seed=6)
    idx = torch.randint(0, 2003, (4099,), generator=torch.Generator().manual_seed(6))
    want = spec(parts, idx)
    allowed = os.sched_getaffinity(0)
    seen = []
    for _ in range(10):
        gather_settings(team=0)  # the helpers, even if torch's workers spin; no back-off
        assert torch.equal(gather_rows(parts, idx), want)
        cpu = _my_cpu()  # where the call ran, unless the scheduler moved this thread since
        helpers = _helper_threads()
        assert helpers, "no pyhook-gather thread"
        masks = [os.sched_getaffinity(t) for t in helpers]
        seen.append((cpu, masks))
        if all(m == allowed - {cpu} for m in masks):
            break
    else:
        pytest.fail(f"the helpers were not kept off the caller's CPU: {seen}")


def test_the_datasets_batch_op_has_no_autograd_step(native):
    # gather_rows_many (CaptureDataset's batch) skips the Autograd key (a fallthrough: a
    # capture's memory maps never need gradients, and autograd's fallback cost every batch
    # 6-8 us). Its output is plainly not differentiable, instead of carrying a graph whose
    # backward gave the parts no gradient; the public gather_rows is unchanged.
    part = torch.randn(5, 3, requires_grad=True)
    idx = torch.tensor([4, 1])
    (out,) = torch.ops.pyhook.gather_rows_many.default([part], [1], idx)
    assert not out.requires_grad and out.grad_fn is None
    assert torch.equal(out, part.detach()[idx])


# -- torch's own team, while its workers spin ------------------------------------------------------
@pytest.mark.parametrize("rows", [100, 4099])  # 300 KB: the team alone splits it; 12 MB: both
def test_a_gather_on_torchs_team_is_exact(gather_settings, rows):
    # team=1 (a test setting) runs every call of 256 KB or more on torch's OpenMP team (by
    # default only a call made while its workers spin does), with the pieces claimed as with
    # the helpers: every layer and row exact, into a new output or a given one.
    parts = make_parts(torch.float32, sizes=(700, 3, 0, 1300), row_shape=(768,), seed=7)
    ids = [torch.arange(n) for n in (700, 3, 0, 1300)]
    idx = torch.randint(0, 2003, (rows,), generator=torch.Generator().manual_seed(7))
    many = torch.ops.pyhook.gather_rows_many.default
    for _ in range(3):
        gather_settings(team=1)  # (and no one-thread period from the call before)
        got = many([*parts, *ids], [4, 4], idx)
        assert torch.equal(got[0], spec(parts, idx)) and torch.equal(got[1], spec(ids, idx))
        out = torch.full((rows, 768), 7.0)
        assert torch.equal(gather_rows_into(parts, idx, out), spec(parts, idx))


TEAM_CHOICE = r"""
import os, sys, time, torch
from pyhook import _backend
from pyhook._backend import gather_rows
assert _backend.native_available()
torch.set_num_threads(2)
parts = [torch.randn(3000, 768), torch.randn(1000, 768)]
whole = torch.cat(parts)
a = torch.randn(384, 384)


def helpers():
    # (state, CPU time in ns) of each of pyhook's helper threads (/proc/<tid>/stat, schedstat)
    out = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                if f.read().strip() != "pyhook-gather":
                    continue
            with open(f"/proc/self/task/{t}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/self/task/{t}/schedstat") as f:
                out.append((state, int(f.read().split()[0])))
        except OSError:
            pass
    return out


def woken(before):
    # Whether a helper was woken since `before`: it ran (its CPU time grew), or it waits to
    # run; False once every helper has stayed asleep, with no CPU time gained, for 3 looks.
    asleep = 0
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        now = helpers()
        if sum(ns for _, ns in now) != sum(ns for _, ns in before):
            return True
        asleep = asleep + 1 if all(st == "S" for st, _ in now) else 0
        if asleep == 3:
            return False
        time.sleep(0.002)
    return True


idx = torch.randint(0, 4000, (4096,), generator=torch.Generator().manual_seed(0))
assert torch.equal(gather_rows(parts, idx), whole[idx])  # finds the team; helpers start
assert helpers()
time.sleep(0.02)
team = 0
for _ in range(40):
    # the team rule asked for (argv: -1 the default, 0 never), no one-thread back-off period
    torch.ops.pyhook._test_gather_settings(int(sys.argv[1]), 0, 0)
    float((a @ a).sum())  # a parallel region of torch's: its workers ran just now
    before = helpers()
    got = gather_rows(parts, idx)
    team += not woken(before)
    assert torch.equal(got, whole[idx])
print(team)
"""


@pytest.mark.parametrize(
    "policy, team, expect",
    [("ACTIVE", None, "some"), ("ACTIVE", "0", "none"), ("PASSIVE", None, "none")],
)
def test_a_call_right_after_torchs_work_runs_on_its_spinning_team(native, policy, team, expect):
    # With OMP_WAIT_POLICY=ACTIVE torch's workers spin between parallel regions: a gather made
    # then copies on them and leaves pyhook's helper threads asleep (they gain no CPU time).
    # With PASSIVE the workers sleep at once, and team=0 (a test setting) forbids the team: the
    # helpers copy. (Run in a child: the wait policy is read when OpenMP starts.)
    if len(os.sched_getaffinity(0)) < 2 or not os.path.exists("/proc/self/task"):
        pytest.skip("needs two CPUs and /proc")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    env.update(OMP_WAIT_POLICY=policy, OMP_NUM_THREADS="2")
    # "some" depends on torch's workers still spinning when the gather starts, which a loaded
    # machine (the suite's own workers on 2 cores) can deschedule for a whole child: up to 3
    # children of 40 calls each; a gather that never uses the team fails all 3. "none" is
    # strict in the first child.
    runs = []
    for _ in range(3 if expect == "some" else 1):
        r = run_script(TEAM_CHOICE, "-1" if team is None else team, timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        runs.append(int(r.stdout.split()[-1]))
        if expect == "some" and runs[-1] >= 1:
            break
    if expect == "some":
        assert runs[-1] >= 1, f"no call ran on torch's spinning team in {len(runs)} children"
    else:
        assert runs[0] == 0, f"{runs[0]} of 40 calls ran on a team that was not spinning"


# -- a part whose file became shorter than its mapping (SIGBUS) -----------------------------------
# Run in a child process: if the guard failed, the child, not the suite, would die of SIGBUS.
SHORTER_FILE = r"""
import faulthandler, mmap, os, sys, warnings
import torch
from pyhook import _backend
from pyhook._backend import gather_rows
if sys.argv[2] == "faulthandler-first":
    faulthandler.enable()  # installed before pyhook's handler: chained to
assert _backend.native_available()
warnings.simplefilter("ignore")  # read-only mapping
path = os.path.join(sys.argv[1], "rows.bin")
x = torch.arange(4096 * 256, dtype=torch.float32).reshape(4096, 256)
x.numpy().tofile(path)
with open(path, "rb") as f:
    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
part = torch.frombuffer(mm, dtype=torch.float32).reshape(4096, 256)
idx = torch.randperm(4096, generator=torch.Generator().manual_seed(0))
assert torch.equal(gather_rows([part], idx), x[idx])
if sys.argv[2] == "faulthandler-after":
    faulthandler.enable()  # replaces pyhook's handler: the next gather installs it again
os.truncate(path, 2048 * 1024)  # rows 2048.. are gone
first_half = idx[idx < 2048]
for team, threads in (("0", 2), ("1", 2), ("0", 1)):  # helpers, torch's team, one thread
    torch.ops.pyhook._test_gather_settings(int(team), 0, 0)
    torch.set_num_threads(threads)
    for rows in (idx, idx[-8:], torch.tensor([4095])):  # several threads, one thread, one row
        try:
            gather_rows([part], rows)
        except RuntimeError as e:
            assert "SIGBUS" in str(e), e
        else:
            raise SystemExit(f"no error for {len(rows)} rows on {threads} threads")
        # the rows still in the file read exactly, on the same threads
        assert torch.equal(gather_rows([part], first_half), x[first_half])
torch.set_num_threads(2)
print("raised", flush=True)
if sys.argv[3] == "touch":
    print(float(part[4000].sum()))  # outside pyhook's copy: SIGBUS as before
"""


def _shorter_file(tmp_path, order, then):
    """SHORTER_FILE run in a child process (the suite's own process must not risk a SIGBUS)."""
    return run_script(SHORTER_FILE, str(tmp_path), order, then)


@pytest.mark.parametrize("order", ["alone", "faulthandler-first", "faulthandler-after"])
def test_a_part_whose_file_became_shorter_raises_instead_of_sigbus(native, tmp_path, order):
    # A memory-mapped part whose file was cut after it was mapped: reading its lost pages
    # raises SIGBUS, which used to end the process (readers checked every shard's size before
    # each read instead, one fstat a shard a batch). The copy now turns it into an error, on
    # the helpers and on the calling thread, and leaves the threads usable.
    p = _shorter_file(tmp_path, order, "-")
    assert p.returncode == 0 and p.stdout.strip() == "raised", (p.returncode, p.stderr[-3000:])


@pytest.mark.parametrize("order", ["alone", "faulthandler-first"])
def test_a_sigbus_outside_the_copy_still_ends_the_process(native, tmp_path, order):
    # pyhook's handler only catches what its own copy raises: any other SIGBUS goes to the
    # handler before it (Python's faulthandler prints the traceback) or ends the process.
    import signal

    p = _shorter_file(tmp_path, order, "touch")
    assert p.stdout.splitlines()[:1] == ["raised"], (p.stdout, p.stderr[-3000:])
    assert p.returncode == -signal.SIGBUS, (p.returncode, p.stderr[-3000:])
    if order == "faulthandler-first":
        assert "Bus error" in p.stderr and "line " in p.stderr, p.stderr[-3000:]


@pytest.mark.parametrize(
    "sizes",
    [(64, 64, 64), (100, 64, 200, 65, 1), (1000, 70, 0), (127, 129, 4096, 64), (64, 5000)],
)
@pytest.mark.parametrize("row_shape", [(6,), (768,)])
def test_every_row_of_parts_long_enough_for_the_part_table(native, sizes, row_shape):
    # Parts of 64 rows or more (but the last) are found by a table of blocks of rows (one lookup
    # and one compare) instead of a binary search: every row, at every part boundary, in a
    # shuffled order and in order, on one thread and (768-wide rows: MBs) with the helpers.
    parts = make_parts(torch.float32, sizes=sizes, row_shape=row_shape, seed=7)
    total = sum(sizes)
    g = torch.Generator().manual_seed(7)
    for idx in (
        torch.randperm(total, generator=g),
        torch.arange(total),
        torch.arange(total).flip(0),
    ):
        assert torch.equal(gather_rows(parts, idx), spec(parts, idx))
        out = torch.empty(total, *row_shape)
        assert torch.equal(gather_rows_into(parts, idx, out), spec(parts, idx))


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise and mincore")
def test_a_cold_batch_after_many_warm_calls_is_still_announced(native, tmp_path):
    # After 64 calls in a row found every sampled row resident, a call samples 1 row instead of
    # 8. A batch from a file that is not in the page cache must still be found cold and its
    # rows announced (MADV_WILLNEED: just their pages are read), not faulted in one at a time
    # (each fault reads a whole read-around window: thousands of pages for 64 rows).
    warm = [torch.randn(3000, 768), torch.randn(2000, 768)]
    for k in range(100):
        idx = torch.randint(0, 5000, (64,), generator=torch.Generator().manual_seed(k))
        assert torch.equal(gather_rows(warm, idx), spec(warm, idx))
    rows = 16384
    data = torch.randn(rows, 768)
    mm, mapped = _cold_mapping(tmp_path, data)
    if any(_resident(mapped)):
        pytest.skip("the file system keeps the file in memory (tmpfs?): no cold read to test")
    idx = torch.randperm(rows, generator=torch.Generator().manual_seed(1))[:64]
    parts = [mapped[:8000], mapped[8000:]]
    assert torch.equal(gather_rows(parts, idx), data[idx])
    read = sum(_resident(mapped))
    assert read <= 4 * 2 * len(idx), f"{read} pages read for {len(idx)} rows of 3 KB"
    del parts, mapped
    mm.close()


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise and mincore")
def test_a_cold_batch_of_several_layers_is_announced_for_every_layer(native, tmp_path):
    # Each layer samples its own rows of the batch, and one cold sample announces the rows of
    # every layer. Before, every layer sampled the same positions and was announced on its own:
    # here the sampled rows of the first layer are resident (read with pread), so it was
    # faulted in, a read-around window a row (the whole 6 MB file with this disk's 8 MiB).
    rows, n = 2048, 8
    idx = torch.randperm(rows, generator=torch.Generator().manual_seed(3))[:n]
    maps, datas = [], []
    for layer in range(4):
        data = torch.randn(rows, 768)
        mm, mapped = _cold_mapping(tmp_path / f"l{layer}", data)
        maps.append((mm, mapped))
        datas.append(data)
        fd = os.open(tmp_path / f"l{layer}" / "rows.bin", os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead for the preads
            for k in (0, n // 2):  # the rows a layer sampled at every position, before
                os.pread(fd, 3072, int(idx[k]) * 3072)
        finally:
            os.close(fd)
    if sum(sum(_resident(m)) for _, m in maps) > 4 * 2 * 2 * 2:
        pytest.skip("the file system keeps the files in memory (tmpfs?): no cold read to test")
    parts = [m for _, m in maps]
    out = torch.ops.pyhook.gather_rows_many.default(parts, [1] * 4, idx)
    for got, data in zip(out, datas):
        assert torch.equal(got, data[idx])
    read = [sum(_resident(m)) for _, m in maps]
    assert max(read) <= 4 * 2 * n, f"pages read per layer: {read} for {n} rows of 3 KB"
    del out, parts, maps
