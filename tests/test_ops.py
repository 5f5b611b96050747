"""The native ops against their reference (pyhook/_reference.py), plus the buffer pool."""

from __future__ import annotations

import gc
import os
import shutil
import textwrap

import pytest
import torch
from conftest import ROOT, run_python
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyhook import _backend, _reference

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
] + [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


def make(shape, dtype, device, requires_grad=False):
    if dtype == torch.bool:
        t = torch.rand(shape, device=device) > 0.5
    elif dtype.is_floating_point and dtype.itemsize == 1:  # float8: no randn kernel
        t = torch.randn(shape, device=device).to(dtype)
    elif dtype.is_floating_point or dtype.is_complex:
        t = torch.randn(shape, device=device, dtype=dtype)
    else:
        t = torch.randint(0, 100, shape, device=device, dtype=dtype)
    return t.requires_grad_(requires_grad)


def layouts(dtype, device):
    """Representative layouts: contiguous, transposed, sliced, expanded, 0-dim, empty..."""
    base = make((6, 5), dtype, device)
    x4 = make((2, 3, 4, 5), dtype, device)
    return [
        base,
        base.t(),
        base[1:5:2, ::2],
        base[:, 1],
        make((6, 1), dtype, device).expand(6, 4),
        make((), dtype, device),
        make((0,), dtype, device),
        make((0, 3), dtype, device).t(),
        x4.contiguous(memory_format=torch.channels_last),
        x4.contiguous(memory_format=torch.channels_last)[:, :2],
        x4.permute(3, 1, 0, 2),
        x4[..., ::2].transpose(0, 2),
    ]


def equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_floating_point and a.dtype.itemsize == 1:  # float8: no eq kernel
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def storage_range(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def check_same_as_reference(inputs, outputs):
    expected = _reference.clone_tensors(inputs)
    assert len(outputs) == len(expected)
    for i, (x, y, e) in enumerate(zip(inputs, outputs, expected)):
        msg = f"tensor {i}: {x.dtype} {tuple(x.shape)} stride {x.stride()}"
        assert type(y) is type(e), msg
        assert y.dtype == e.dtype and y.shape == e.shape and y.device == e.device, msg
        assert y.stride() == e.stride(), f"{msg}: {y.stride()} != {e.stride()}"
        assert y.requires_grad == e.requires_grad, msg
        assert y.is_conj() == e.is_conj() and y.is_neg() == e.is_neg(), msg
        assert equal(y.detach(), e.detach()), msg
        # A fresh copy: no memory shared with any input.
        if y.numel() and y.untyped_storage().nbytes():
            lo, hi = storage_range(y)
            for x2 in inputs:
                if x2.untyped_storage().nbytes():
                    xlo, xhi = storage_range(x2)
                    assert hi <= xlo or xhi <= lo, f"{msg}: output overlaps an input"


# ---------------------------------------------------------------- parity


def test_empty_list(device, backend):
    assert _backend.clone_tensors([]) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layouts_per_dtype(device, backend, dtype):
    xs = layouts(dtype, device)
    check_same_as_reference(xs, _backend.clone_tensors(xs))


def test_mixed_dtypes_one_call(device, backend):
    xs = [t for d in DTYPES for t in layouts(d, device)[:3]]
    check_same_as_reference(xs, _backend.clone_tensors(xs))


def test_conj_neg_views(device, backend):
    z = torch.randn(4, 3, dtype=torch.complex64, device=device)
    xs = [z.conj(), torch._neg_view(z), z.conj().t()]
    check_same_as_reference(xs, _backend.clone_tensors(xs))


def test_requires_grad_mixed(device, backend):
    xs = [
        make((3, 4), torch.float32, device, requires_grad=True),
        make((3, 4), torch.float32, device),
        make((5,), torch.int64, device),
        make((2, 2), torch.float64, device, requires_grad=True),
    ]
    xs[3] = xs[3].t()  # a non-leaf view
    leaf = xs[3]._base
    ys = _backend.clone_tensors(xs)
    check_same_as_reference(xs, ys)
    (ys[0].sum() + ys[3].sum() * 2).backward()
    assert torch.equal(xs[0].grad, torch.ones(3, 4, device=device))
    assert torch.equal(leaf.grad, torch.full((2, 2), 2.0, dtype=torch.float64, device=device))
    assert ys[1].grad_fn is None


def test_mutating_input_leaves_copy(device, backend):
    xs = [make((64, 64), torch.float32, device), make((3,), torch.int32, device)]
    before = [x.clone() for x in xs]
    ys = _backend.clone_tensors(xs)
    for x in xs:
        x.add_(1)
    assert all(torch.equal(y, b) for y, b in zip(ys, before))
    ys[0].zero_()  # and outputs are independent of each other
    assert torch.equal(ys[1], before[1])


def test_mixed_devices_and_subclasses(backend):
    class Sub(torch.Tensor):
        pass

    xs = [
        torch.randn(3),
        torch.randn(2, 2).as_subclass(Sub),
        torch.empty(2, 3, device="meta"),
        torch.randn(4, 4).to_sparse(),
        torch.nn.Parameter(torch.randn(2)),
        torch.randn(3, 3).t(),
    ]
    ys = _backend.clone_tensors(xs)
    assert [type(y) for y in ys] == [type(x.clone()) for x in xs]
    for x, y in zip(xs, ys):
        assert y.shape == x.shape and y.device == x.device and y.layout == x.layout
        if x.device.type != "meta":
            assert torch.equal(y.to_dense(), x.to_dense())


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    specs=st.lists(
        st.tuples(shapes, st.sampled_from(DTYPES[:11]), st.integers(0, 3), st.booleans()),
        max_size=6,
    )
)
def test_random_lists_match_reference(native, specs):
    xs = []
    for shape, dtype, view, rg in specs:
        t = make(tuple(shape), dtype, "cpu")
        if view == 1 and t.dim() >= 2:
            t = t.transpose(0, -1)
        elif view == 2 and t.dim() >= 1:
            t = t[::2]
        elif view == 3 and t.dim() >= 1:
            t = t.unsqueeze(0).expand(2, *t.shape)
        if rg and (dtype.is_floating_point or dtype.is_complex):
            t = t.detach().requires_grad_()
        xs.append(t)
    with _backend.use_backend("native"):
        check_same_as_reference(xs, _backend.clone_tensors(xs))


# ---------------------------------------------------------------- op-level checks


def test_outputs_do_not_share_storage(native):
    ys = torch.ops.pyhook.clone_many([torch.randn(100), torch.randn(10, 10)])
    assert ys[0].untyped_storage().data_ptr() != ys[1].untyped_storage().data_ptr()
    assert ys[0].untyped_storage().nbytes() == 400
    # One pooled allocation, 64-byte aligned slices.
    assert (ys[1].data_ptr() - ys[0].data_ptr()) % 64 == 0
    assert ys[0].data_ptr() % 64 == 0


@pytest.mark.cuda
def test_device_mismatch_is_reported(native):
    if not torch.cuda.is_available():
        pytest.skip("needs a second device kind with a kernel")
    with pytest.raises(RuntimeError, match="tensor 1 is on cuda"):
        torch.ops.pyhook.clone_many([torch.randn(2), torch.randn(2, device="cuda")])


def test_resize_output(native):
    (y,) = torch.ops.pyhook.clone_many([torch.arange(4.0)])
    y.resize_(100)  # storage is resizable like a clone's
    assert torch.equal(y[:4], torch.arange(4.0))


OPCHECK_ARGS = [
    ([],),
    ([torch.randn(3, 4)],),
    ([torch.randn(3, 4, requires_grad=True), torch.randn(4, 3).t(), torch.tensor(2.0)],),
    ([torch.randint(0, 9, (5,)), torch.zeros(0, 2), torch.randn(2, 1).expand(2, 3)],),
    ([torch.randn(2, 3, dtype=torch.complex64), torch.ones(3, dtype=torch.bool)],),
]


@pytest.mark.parametrize("args", OPCHECK_ARGS, ids=[f"case{i}" for i in range(len(OPCHECK_ARGS))])
def test_opcheck_clone_many(native, device, args):
    args = tuple([t.to(device).detach().requires_grad_(t.requires_grad) for t in a] for a in args)
    torch.library.opcheck(torch.ops.pyhook.clone_many.default, args)


@pytest.mark.parametrize(
    "op,args",
    [
        ("pool_stats", ()),
        ("pool_set_limit", (1 << 30,)),
        ("pool_empty", ()),
        ("thread_id", ()),
        ("autograd_node_thread_id", ()),
    ],
)
def test_opcheck_pool_ops(native, op, args):
    torch.library.opcheck(getattr(torch.ops.pyhook, op).default, args)


def test_gradcheck(device, backend):
    a = torch.randn(3, 4, dtype=torch.float64, device=device, requires_grad=True)
    b = torch.randn(4, 2, dtype=torch.float64, device=device, requires_grad=True)

    def f(a, b):
        ys = _backend.clone_tensors([a, b.t(), a[:, ::2]])
        return tuple(y * (i + 1) for i, y in enumerate(ys))

    assert torch.autograd.gradcheck(f, (a, b))
    assert torch.autograd.gradgradcheck(f, (a, b))


def test_torch_compile(native):
    def f(x, y):
        a, b = torch.ops.pyhook.clone_many([x * 2, y.t()])
        return a + 1, b

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 3, requires_grad=True)
    y = torch.randn(3, 5)
    a, b = compiled(x, y)
    ea, eb = f(x, y)
    assert torch.equal(a, ea) and torch.equal(b, eb) and b.stride() == eb.stride()
    a.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


# ---------------------------------------------------------------- pool


@pytest.fixture
def pool(native):
    old = _backend.pool_stats()["limit_bytes"]
    _backend.set_pool_limit(1 << 30)
    _backend.empty_pool()
    yield
    _backend.set_pool_limit(old)
    _backend.empty_pool()


def _clone_native(xs):
    with _backend.use_backend("native"):
        return _backend.clone_tensors(xs)


def test_pool_reuses_buffer(pool):
    xs = [torch.randn(256, 1024), torch.randn(1024)]
    ys = _clone_native(xs)
    ptr = ys[0].data_ptr()
    s0 = _backend.pool_stats()
    assert s0["live_buffers"] >= 1
    del ys
    s1 = _backend.pool_stats()
    assert s1["cached_buffers"] == s0["cached_buffers"] + 1
    ys = _clone_native(xs)
    s2 = _backend.pool_stats()
    assert s2["hits"] == s1["hits"] + 1
    assert ys[0].data_ptr() == ptr
    assert torch.equal(ys[0], xs[0]) and torch.equal(ys[1], xs[1])


def test_live_tensor_and_views_keep_buffer(pool):
    xs = [torch.randn(128, 128), torch.randn(64)]
    ys = _clone_native(xs)
    view = ys[1][10:20]
    expected = xs[1][10:20].clone()
    base = _backend.pool_stats()["cached_buffers"]
    del ys
    gc.collect()
    assert _backend.pool_stats()["cached_buffers"] == base  # the view still pins it
    others = _clone_native([torch.ones(128, 128), torch.ones(64)])  # must not reuse it
    assert torch.equal(view, expected)
    del others
    del view
    assert _backend.pool_stats()["cached_buffers"] == base + 2


def test_pool_limit_zero_disables_caching(pool):
    _backend.set_pool_limit(0)
    ys = _clone_native([torch.randn(1000)])
    del ys
    s = _backend.pool_stats()
    assert s["cached_buffers"] == 0 and s["cached_bytes"] == 0 and s["limit_bytes"] == 0


def test_set_pool_limit_evicts_and_validates(pool):
    ys = _clone_native([torch.randn(1 << 16)])
    del ys
    assert _backend.pool_stats()["cached_bytes"] > 0
    _backend.set_pool_limit(1024)
    assert _backend.pool_stats()["cached_bytes"] <= 1024
    with pytest.raises(ValueError):
        _backend.set_pool_limit(-1)


def test_empty_pool(pool):
    del _clone_native([torch.randn(1000), torch.randn(10)])[:]
    gc.collect()
    assert _backend.pool_stats()["cached_buffers"] >= 1
    _backend.empty_pool()
    s = _backend.pool_stats()
    assert s["cached_buffers"] == 0 and s["cached_bytes"] == 0


def test_pool_limit_from_env(native):
    proc = run_python(
        "from pyhook import _backend; print(_backend.pool_stats()['limit_bytes'])",
        env={"PYHOOK_POOL_LIMIT": "12345"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "12345"


def test_pool_buffers_freed_at_exit(native):
    # Tensors outliving the module's globals are freed during interpreter teardown.
    proc = run_python(
        "import torch\nfrom pyhook import _backend\n"
        "import builtins\n_backend.NATIVE_MIN_BYTES = 0\n"
        "builtins.KEEP = _backend.clone_tensors([torch.randn(1 << 20), torch.randn(5)])\n"
        "_backend.clone_tensors([torch.randn(1 << 20)])\n"
    )
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------- backend selection


def test_backend_env_reference():
    proc = run_python(
        "from pyhook import _backend; print(_backend.get_backend())",
        env={"PYHOOK_BACKEND": "reference"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "reference"


def test_backend_env_invalid_warns():
    proc = run_python(
        "import warnings; warnings.simplefilter('error')\nfrom pyhook import _backend",
        env={"PYHOOK_BACKEND": "fast"},
    )
    assert proc.returncode != 0
    assert "PYHOOK_BACKEND='fast'" in proc.stderr and "native, reference, auto" in proc.stderr


def test_set_backend_validates():
    with pytest.raises(ValueError, match="'native', 'reference', 'auto'"):
        _backend.set_backend("gpu")
    before = _backend.get_backend()
    with _backend.use_backend("reference"):
        assert _backend.get_backend() == "reference"
    assert _backend.get_backend() == before


def test_broken_native_module_warns_once_and_falls_back(tmp_path):
    # A temp copy of the package with a corrupt _C*.so in it.
    pkg = tmp_path / "pyhook"
    shutil.copytree(
        os.path.join(ROOT, "pyhook"), pkg, ignore=shutil.ignore_patterns("_C*", "__pycache__")
    )
    (pkg / "_C.abi3.so").write_bytes(b"this is not an ELF file")
    code = textwrap.dedent(
        """
        import warnings, torch
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            from pyhook import _backend
            assert _backend.get_backend() == "reference"
            assert not _backend.native_available()
            ys = _backend.clone_tensors([torch.ones(3)])
            _backend.pool_stats()
        msgs = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
        assert len(msgs) == 1, msgs
        print(msgs[0])
        print(_backend.native_load_error())
        try:
            _backend.set_backend("native")
        except RuntimeError as e:
            print("RAISED", e)
        """
    )
    proc = run_python(code, cwd=str(tmp_path), env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert "failed to load" in proc.stdout
    assert "ImportError" in proc.stdout and "_C.abi3.so" in proc.stdout
    assert "RAISED pyhook native backend unavailable" in proc.stdout


def test_missing_native_module_is_quiet(tmp_path):
    shutil.copytree(
        os.path.join(ROOT, "pyhook"),
        tmp_path / "pyhook",
        # (a checkout built in place has a build record saying "built": a pure-Python install
        # has none, and the import would warn that _C is missing)
        ignore=shutil.ignore_patterns("_C*", "_build_info.json", "__pycache__"),
    )
    proc = run_python(
        "import warnings; warnings.simplefilter('error')\n"
        "import torch\nfrom pyhook import _backend\n"
        "assert _backend.get_backend() == 'reference'\n"
        "assert _backend.clone_tensors([torch.ones(2)])[0].sum() == 2\n"
        "assert _backend.pool_stats()['hits'] == 0\n"
        "print(_backend.native_load_error())",
        cwd=str(tmp_path),
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr
    assert "not built" in proc.stdout


def test_small_captures_take_reference_path(native, monkeypatch):
    monkeypatch.setattr(_backend, "NATIVE_MIN_BYTES", 1 << 20)
    misses = _backend.pool_stats()["misses"] + _backend.pool_stats()["hits"]
    with _backend.use_backend("native"):
        ys = _backend.clone_tensors([torch.randn(10)])
        big = _backend.clone_tensors([torch.randn(1 << 18)])
    assert torch.equal(big[0], big[0]) and ys[0].shape == (10,)
    s = _backend.pool_stats()
    assert s["misses"] + s["hits"] == misses + 1  # only the 1 MiB capture went native


def test_thread_ops_name_the_thread_whose_forward_made_the_running_node(native):
    """pyhook::thread_id is the engine's id of the calling thread (distinct per thread, never
    0); pyhook::autograd_node_thread_id is, during a backward, that id of the thread whose
    forward created the node being run (0 outside a backward) -- as a thread-guarded hook uses
    them for checkpoint recomputations."""
    import threading

    ops = torch.ops.pyhook
    mine = ops.thread_id()
    other: dict[str, int] = {}
    x = torch.randn(3, requires_grad=True)
    y = (x * 2).sum()  # forward on this thread
    seen: list[int] = []
    y.grad_fn.register_prehook(lambda grads: seen.append(ops.autograd_node_thread_id()))

    def worker() -> None:
        other["id"] = ops.thread_id()
        y.backward()  # run on the worker thread: the node is still this thread's

    th = threading.Thread(target=worker)
    th.start()
    th.join()
    assert mine != 0 and other["id"] not in (0, mine)
    assert seen == [mine] and ops.autograd_node_thread_id() == 0
