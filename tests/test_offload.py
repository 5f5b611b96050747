"""pyhook.offload: the native offloader against the reference one, and the CUDA semantics."""

from __future__ import annotations

import threading

import pytest
import torch
from _hygiene import run_in_threads

from pyhook import _backend
from pyhook.offload import Offloader, PinnedPool, ReferenceOffloader


def _inputs(device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 48, generator=g)
    return [
        t.to(device)
        for t in (
            base,
            base.t(),  # non-contiguous
            base[::2, 1:7],  # strided view
            torch.arange(24, dtype=torch.int16).view(2, 3, 4).permute(2, 0, 1),
            torch.tensor(3.5, dtype=torch.float64),  # 0-dim
            torch.empty(0, 5),  # zero-size
            torch.tensor([True, False, True]),
            torch.randn(3, 2, generator=g).to(torch.bfloat16),
        )
    ]


def _signature(ts: list[torch.Tensor]) -> list[tuple]:
    return [(t.shape, t.dtype, t.stride(), t.device.type) for t in ts]


@pytest.fixture(params=["native", "reference"])
def engine(request):
    """An offload engine on its own: the native class or the reference (same methods)."""
    if request.param == "native":
        if not _backend.native_available():
            pytest.skip(f"native backend not built: {_backend.native_load_error()}")
        return lambda limit=1 << 30, pool=1 << 30: torch.classes.pyhook.Offloader(limit, False, pool)
    return lambda limit=1 << 30, pool=1 << 30: ReferenceOffloader(limit, False, pool)


def _stats(eng) -> dict[str, int]:
    keys = ["inflight_bytes", "inflight_jobs", "bytes_submitted", "stalls"]
    keys += ["pool_idle_bytes", "pool_lent", "pool_hits", "pool_misses"]
    return dict(zip(keys, eng.stats()))


@pytest.mark.parametrize("copy", [False, True])
@pytest.mark.parametrize("pooled", [False, True])
def test_engines_agree_on_cpu(engine, copy, pooled):
    xs = _inputs(torch.device("cpu"))
    eng = engine()
    ticket, host = eng.submit(xs, copy, pooled)
    assert eng.ready(ticket)
    _, want = ReferenceOffloader(1 << 30, False, 1 << 30).submit(xs, copy, pooled)
    assert _signature(host) == _signature(want)
    for h, w, x in zip(host, want, xs):
        assert torch.equal(h, w) and torch.equal(h, x)
        if x.numel():
            # copies never share memory with the source; non-copies are the source itself
            assert (h.data_ptr() == x.data_ptr()) == (not copy)
    if copy and not pooled:  # clone's strides
        assert [h.stride() for h in host] == [x.clone().stride() for x in xs]
    if copy and pooled:  # dense, row-major, in buffers the pool lends out
        assert all(h.is_contiguous() for h in host)
        assert _stats(eng)["pool_lent"] == sum(1 for x in xs if x.numel())
    assert _stats(eng)["bytes_submitted"] == sum(x.nbytes for x in xs)


def test_pooled_buffers_are_reused_after_release(engine):
    eng = engine()
    x = torch.randn(256, 256)  # 256 KiB: exactly one bucket
    _, first = eng.submit([x], True, True)
    ptr = first[0].data_ptr()
    eng.release(first)
    eng.release(first)  # twice is harmless
    _, again = eng.submit([x[:200]], True, True)  # a smaller request, same bucket
    assert again[0].data_ptr() == ptr and torch.equal(again[0], x[:200])
    s = _stats(eng)
    assert (s["pool_hits"], s["pool_misses"], s["pool_lent"]) == (1, 1, 1)
    eng.release(again)
    assert _stats(eng)["pool_idle_bytes"] == 256 << 10
    eng.empty_pool()
    assert _stats(eng)["pool_idle_bytes"] == 0


def test_pool_limit_drops_idle_buffers(engine):
    eng = engine(pool=0)
    _, host = eng.submit([torch.ones(1000)], True, True)
    eng.release(host)
    s = _stats(eng)
    assert s["pool_idle_bytes"] == 0 and s["pool_lent"] == 0
    assert torch.equal(host[0], torch.ones(1000))  # the caller's tensor is still valid


def test_release_from_another_thread(engine):
    # The disk writer gives buffers back from its own thread while the model submits.
    eng = engine()
    xs = [torch.full((1000,), float(i)) for i in range(200)]
    done = []

    def consumer(jobs):
        for ticket, host in jobs:
            eng.wait(ticket)
            done.append(host[0][0].item())
            eng.release(host)

    jobs = [eng.submit([x], True, True) for x in xs[:100]]
    th = threading.Thread(target=consumer, args=(jobs,))
    th.start()
    more = [eng.submit([x], True, True) for x in xs[100:]]
    th.join()
    consumer(more)
    assert done == [float(i) for i in range(200)]
    s = _stats(eng)
    assert s["pool_lent"] == 0 and s["pool_hits"] + s["pool_misses"] == 200


def test_front_end_on_cpu_copies_like_clone(backend):
    off = Offloader()
    assert off.backend == backend
    xs = _inputs(torch.device("cpu"))
    for pooled in (False, True):
        same = off.submit(xs, pooled=pooled).wait()
        assert all(h is not x and h.data_ptr() == x.data_ptr() for h, x in zip(same, xs) if x.numel())
        copies = off.submit(xs, copy=True, pooled=pooled).wait()
        assert _signature(copies) == _signature([x.clone() for x in xs])
        assert all(torch.equal(c, x) for c, x in zip(copies, xs))
        assert all(c.data_ptr() != x.data_ptr() for c, x in zip(copies, xs) if x.numel())
    assert off.stats()["bytes_submitted"] == 4 * sum(x.nbytes for x in xs)


def test_bad_input_is_named(backend, engine):
    off = Offloader()
    with pytest.raises(RuntimeError, match="tensor 1 is on the meta device"):
        off.submit([torch.ones(2), torch.ones(2, device="meta")])
    with pytest.raises(RuntimeError, match="tensor 0 has layout"):
        off.submit([torch.eye(3).to_sparse()])
    eng = engine()
    with pytest.raises(RuntimeError, match="tensor 1 is on the meta device"):
        eng.submit([torch.ones(2), torch.ones(2, device="meta")], True, True)
    with pytest.raises(RuntimeError, match="tensor 0 has layout"):
        eng.submit([torch.eye(3).to_sparse()], True, True)
    assert _stats(eng)["pool_lent"] == 0
    with pytest.raises(ValueError, match="max_inflight_bytes must be an int >= 1"):
        Offloader(max_inflight_bytes=0)
    with pytest.raises(ValueError, match="pool_limit_bytes"):
        Offloader(pool_limit_bytes=-1)
    assert off.stats()["inflight_jobs"] == 0


class _FailsOnCopy(torch.Tensor):
    """A CPU tensor whose values cannot be read: any op but detach raises."""

    @staticmethod
    def __new__(cls, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return args[0]
        raise RuntimeError(f"cannot read this tensor ({func})")


def test_failed_submit_gives_pool_buffers_back(engine):
    # The first tensor takes a pooled buffer and is copied; reading the second one fails. The
    # buffer taken for the first must go back to the pool (nobody will ever release it).
    eng = engine()
    good = torch.randn(1 << 16)
    with pytest.raises(RuntimeError, match="cannot read this tensor"):
        eng.submit([good, _FailsOnCopy((1 << 16,))], True, True)
    s = _stats(eng)
    assert s["pool_lent"] == 0 and s["pool_idle_bytes"] >= good.nbytes
    assert s["inflight_bytes"] == 0 and s["inflight_jobs"] == 0
    # and the engine keeps working, reusing that buffer
    ticket, host = eng.submit([good], True, True)
    assert eng.ready(ticket) and torch.equal(host[0], good)
    assert _stats(eng)["pool_hits"] >= 1


def test_quantized_tensors_are_refused_by_name(engine):
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with pytest.raises(RuntimeError, match="tensor 1 is quantized; dequantize it"):
        engine().submit([torch.ones(2), q], True, True)
    with pytest.raises(RuntimeError, match="tensor 0 is quantized"):
        Offloader().submit([q])


def test_pinned_pool_reference():
    pool = PinnedPool()
    a = pool.get(100_000)
    assert a.numel() >= 100_000 and a.dtype == torch.uint8
    pool.put(a[:10].view(torch.float16))  # any view gives the buffer back
    assert pool.get(70_000).data_ptr() == a.data_ptr()
    assert pool.stats() == {"idle_bytes": 0, "lent": 1, "hits": 1, "misses": 1}


def test_native_engine_reports_async_devices(native):
    devices = torch.ops.pyhook.offload_async_devices()
    assert ("cuda" in devices) == torch._C._dispatch_has_kernel_for_dispatch_key(
        "pyhook::clone_many", "CUDA"
    )


# -- CUDA -----------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("pooled", [False, True])
def test_cuda_copies_are_exact_and_pinned(backend, pooled):
    off = Offloader(max_inflight_bytes=1 << 20)  # small: exercises back-pressure
    xs = _inputs(torch.device("cuda"))
    want = [x.cpu() for x in xs]
    pend = [off.submit(xs, pooled=pooled) for _ in range(6)]
    for p in pend:
        host = p.wait()
        assert p.ready()
        for h, w in zip(host, want):
            assert torch.equal(h, w) and h.shape == w.shape and h.dtype == w.dtype
            assert h.device.type == "cpu" and h.is_contiguous()
            if h.numel():
                assert h.is_pinned()
        off.release(host)
    s = off.stats()
    assert s["inflight_jobs"] == 0 and s["inflight_bytes"] == 0
    if pooled:
        # Every buffer is back; the six submissions ran before any release, so each took a
        # fresh one. The next submission reuses them.
        assert s["pool_lent"] == 0 and s["pool_hits"] == 0
        again = off.submit(xs, pooled=True).wait()
        assert all(torch.equal(h, w) for h, w in zip(again, want))
        after = off.stats()
        assert after["pool_hits"] > 0 and after["pool_misses"] == s["pool_misses"]
        off.release(again)
        assert off.stats()["pool_lent"] == 0


@cuda
@pytest.mark.cuda
def test_cuda_backpressure_bounds_bytes_in_flight(backend):
    chunk = torch.randn(1 << 20, device="cuda")  # 4 MiB
    off = Offloader(max_inflight_bytes=3 * chunk.nbytes)
    pend = []
    for i in range(12):
        pend.append(off.submit([chunk * i]))
        assert off.stats()["inflight_bytes"] <= 3 * chunk.nbytes
    for i, p in enumerate(pend):
        assert torch.equal(p.wait()[0], (chunk * i).cpu())
    off.synchronize()
    assert off.stats()["inflight_jobs"] == 0


@cuda
@pytest.mark.cuda
def test_cuda_copy_snapshot_wins_against_a_later_inplace_update(backend):
    # copy=True: the model may update the captured memory in place after the hook returns.
    # The update is queued on the compute stream right after submit; the host copy must still
    # hold the values at submit time (a plain side-stream read of x could see the update).
    off = Offloader()
    x = torch.randn(8 << 20, device="cuda")
    want = x.cpu()
    torch.cuda._sleep(50_000_000)  # keep the compute stream busy so the copy queues behind it
    p = off.submit([x], copy=True)
    x.add_(1.0)
    assert torch.equal(p.wait()[0], want)


@cuda
@pytest.mark.cuda
def test_cuda_source_memory_is_not_recycled_while_read(backend):
    off = Offloader()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x = torch.randn(4 << 20, device="cuda")
        want = x.cpu()
        torch.cuda._sleep(50_000_000)
        p = off.submit([x])  # no snapshot: the engine must keep x alive
        del x
        junk = torch.full((4 << 20,), 7.0, device="cuda")  # would take x's block if freed
    assert torch.equal(p.wait()[0], want)
    del junk


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("pooled", [False, True])
def test_cuda_lazy_conj_neg_and_zero_tensors_are_resolved(backend, pooled):
    # A raw byte copy would ignore the conjugate / negative bits (and a zero tensor has no
    # data): the host copy must hold the values the tensor means.
    z = torch.randn(64, 32, dtype=torch.complex64, device="cuda")
    xs = [z.conj(), z.conj().imag, torch._efficientzerotensor(8, 4, device="cuda")]
    assert xs[0].is_conj() and xs[1].is_neg() and xs[2]._is_zerotensor()
    want = [x.resolve_conj().resolve_neg().cpu() for x in xs]
    for copy in (False, True):
        got = Offloader().submit(xs, copy=copy, pooled=pooled).wait()
        for g, w in zip(got, want):
            assert not g.is_conj() and not g.is_neg() and torch.equal(g, w)


@cuda
@pytest.mark.cuda
def test_cuda_concurrent_submitters_share_one_budget(backend):
    chunk = torch.randn(1 << 20, device="cuda")  # 4 MiB
    budget = 3 * chunk.nbytes
    off = Offloader(max_inflight_bytes=budget)
    seen: list[int] = []

    def worker(k: int) -> None:
        for i in range(8):
            torch.cuda._sleep(1_000_000)
            p = off.submit([chunk * (k + i)])
            seen.append(off.stats()["inflight_bytes"])
            assert torch.equal(p.wait()[0], (chunk * (k + i)).cpu())

    run_in_threads(worker, 4)
    assert max(seen) <= budget


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("which", ["native", "reference"])
def test_cuda_early_release_waits_for_the_copy(which):
    # Releasing a pooled buffer before its copy landed (a caller's mistake) must not lend it
    # again while the copy still writes into it: it returns to the pool when the job retires.
    if which == "native":
        if not _backend.native_available() or "cuda" not in torch.ops.pyhook.offload_async_devices():
            pytest.skip("native core built without the CUDA engine")
        eng = torch.classes.pyhook.Offloader(1 << 30, True, 1 << 30)
    else:
        eng = ReferenceOffloader(1 << 30, True, 1 << 30)
    x = torch.randn(4 << 20, device="cuda")
    torch.cuda._sleep(200_000_000)  # the copy queues behind this
    _, host = eng.submit([x], False, True)
    eng.release(host)  # before wait()
    s = _stats(eng)
    if s["inflight_jobs"]:  # still in flight (the usual case): not lent again yet
        assert s["pool_lent"] == 1 and s["pool_idle_bytes"] == 0
    eng.synchronize()
    s = _stats(eng)
    assert s["pool_lent"] == 0 and s["pool_idle_bytes"] >= x.nbytes


@cuda
@pytest.mark.cuda
def test_cuda_reference_and_native_agree(native):
    xs = _inputs(torch.device("cuda"))
    got = Offloader().submit(xs, copy=True).wait()
    with _backend.use_backend("reference"):
        want = Offloader().submit(xs, copy=True).wait()
    assert _signature(got) == _signature(want)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_reference_offloader_api_matches_native(native):
    # Same methods (the Offloader front end calls either interchangeably).
    nat = torch.classes.pyhook.Offloader(1 << 20, False, 1 << 20)
    ref = ReferenceOffloader(1 << 20, False, 1 << 20)
    x = torch.randn(5, 3)
    for eng in (nat, ref):
        ticket, host = eng.submit([x, x.t()], True, True)
        assert eng.ready(ticket)
        eng.wait(ticket)
        eng.synchronize()
        eng.release(host)
        eng.empty_pool()
    assert list(nat.stats()) == list(ref.stats())
