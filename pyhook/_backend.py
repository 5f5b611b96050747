"""Backend selection and the native-module loader.

Index:

* :func:`clone_tensors` - copy a flat list of tensors, exactly like ``[t.clone() for t in ...]``;
* :func:`gather_rows`, :func:`gather_rows_into` - rows ``idx`` of a list of ``[rows, ...]`` parts
  (the memory-mapped shards of a captured layer), like ``torch.cat(parts)[idx]`` without the cat;
* :func:`get_backend`, :func:`set_backend`, :func:`use_backend` - choose ``native``,
  ``reference`` or ``auto`` (the initial choice comes from ``PYHOOK_BACKEND``);
* :func:`native_available`, :func:`native_load_error` - did ``pyhook._C`` load, and if not, why;
* :func:`pool_stats`, :func:`set_pool_limit`, :func:`empty_pool` - the native CPU buffer pool.

The native module is loaded once, on first use, by importing ``pyhook._C`` (which registers
``torch.ops.pyhook.*``) and then :mod:`pyhook.ops`. Loading it never initialises CUDA. A
missing ``.so`` is silent here (``import pyhook`` already warned if the build failed, see
:mod:`pyhook._build`); a ``.so`` that exists but fails to load warns once with the real error
and the fix. Either way :mod:`pyhook._reference` takes over.

Per call, a tensor goes to the native kernel only when it is a plain strided tensor (no
subclass, no functorch wrapper, not meta/sparse/quantized/nested) on a device the build has a
kernel for; every other tensor takes the reference path, and results come back in input order.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.autograd import forward_ad

from . import _reference

__all__ = [
    "clone_one",
    "clone_tensors",
    "empty_pool",
    "gather_rows",
    "gather_rows_into",
    "dequant_rows",
    "dequant_rows_into",
    "get_backend",
    "native_available",
    "native_load_error",
    "pool_stats",
    "row_stats",
    "set_backend",
    "set_pool_limit",
    "use_backend",
]

_BACKENDS = ("native", "reference", "auto")
_ENV_VAR = "PYHOOK_BACKEND"

_lock = threading.Lock()
_loaded = False
_native_ok = False
_load_error: str | None = None
_cuda_kernels = False
_requested = "auto"

# Per-device batches with fewer bytes than this go to the reference path. Below
# it the native call's fixed cost (~7 us of dispatch and pool lookup) exceeds
# what it saves: malloc serves such blocks from warm heap memory. Above it, as
# soon as a few captures are kept at once (a TraceDict's layers, a Recorder's
# batches), malloc's freed memory goes back to the OS and every new capture
# pays a page fault per 4 KiB page, which the pool avoids. Measured on a 2-core
# VM, clone of one tensor, keeping the last N copies alive (us, torch / native):
#            keep 1       keep 12       keep 72
#   64 KB   3.7 / 10.6    4.0 / 10.8   38 / 12
#  256 KB   8.0 / 15.5    123 / 20     168 / 25
#    1 MB    28 / 34      574 / 71     661 / 110
# Tests set it to 0 to exercise the kernel on small inputs.
NATIVE_MIN_BYTES = 256 << 10

# The same threshold for copies that are kept by the dozen (each batch of a
# Recorder): from here the pool wins (table above, keep 72).
KEPT_MIN_BYTES = 64 << 10

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _load() -> None:
    """Import ``pyhook._C`` once; record why it is unavailable otherwise."""
    global _loaded, _native_ok, _load_error, _cuda_kernels
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        try:
            spec = importlib.util.find_spec("pyhook._C")
        except (ImportError, ValueError) as e:  # pragma: no cover - broken package layout
            spec = None
            _load_error = f"cannot look up pyhook._C: {e}"
        if spec is None:
            _load_error = _load_error or (
                "pyhook._C is not built (pure-Python install); using the reference backend"
            )
        else:
            try:
                importlib.import_module("pyhook._C")
                importlib.import_module("pyhook.ops")
            except Exception as e:
                _load_error = f"{type(e).__name__}: {e}"
                global build_warned
                if not build_warned:  # import already warned (e.g. built for another torch)
                    build_warned = True
                    warnings.warn(
                        f"pyhook: the native module {spec.origin} exists but failed to load "
                        f"({_load_error}); falling back to the reference backend. Rebuild it "
                        f"against this torch: `{REINSTALL}` from the pyhook source "
                        "(`pyhook info` shows what was built)",
                        RuntimeWarning,
                        stacklevel=3,
                    )
            else:
                _native_ok = True
                # Asking the dispatcher does not touch the CUDA runtime.
                _cuda_kernels = torch._C._dispatch_has_kernel_for_dispatch_key(
                    "pyhook::clone_many", "CUDA"
                )
        _loaded = True


#: How to rebuild the native module (quoted by this loader's warning and by :mod:`pyhook._build`).
REINSTALL = "pip install --force-reinstall --no-deps ."

#: Set once pyhook warned about its native build (by this loader, or by
#: :func:`pyhook._build.check_build` at import), so that the problem is told once. The build
#: report depends on this module, never the reverse.
build_warned = False


def native_available() -> bool:
    """Whether the native module ``pyhook._C`` is built and loaded.

    Example::

        >>> import pyhook
        >>> pyhook.native_available() in (True, False)
        True
    """
    _load()
    return _native_ok


def native_load_error() -> str | None:
    """Why the native module is unavailable (``None`` when it loaded)."""
    _load()
    return None if _native_ok else _load_error


def _check_name(name: str) -> str:
    if name not in _BACKENDS:
        raise ValueError(
            f"backend name must be one of {', '.join(map(repr, _BACKENDS))}, got {name!r}"
        )
    return name


def set_backend(name: str) -> None:
    """Choose the backend: ``'native'``, ``'reference'`` or ``'auto'`` (native when built).

    >>> set_backend("reference"); get_backend()
    'reference'
    >>> set_backend("auto")  # back to the default
    """
    global _requested
    _check_name(name)
    if name == "native" and not native_available():
        raise RuntimeError(f"pyhook native backend unavailable: {_load_error}")
    _requested = name


def get_backend() -> str:
    """The effective backend, ``'native'`` or ``'reference'``.

    Example::

        >>> import pyhook
        >>> pyhook.get_backend() == ("native" if pyhook.native_available() else "reference")
        True
    """
    if _requested == "reference":
        return "reference"
    return "native" if native_available() else "reference"


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Use backend ``name`` inside a ``with`` block, then restore the previous choice.

    >>> with use_backend("reference"):
    ...     get_backend()
    'reference'
    """
    global _requested
    previous = _requested
    set_backend(name)
    try:
        yield
    finally:
        _requested = previous


def _init_from_env() -> None:
    global _requested
    value = os.environ.get(_ENV_VAR, "").strip().lower()
    if not value:
        return
    if value not in _BACKENDS:
        warnings.warn(
            f"{_ENV_VAR}={value!r} is not one of {', '.join(_BACKENDS)}; using 'auto'",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    # 'native' from the environment is a request, not a hard requirement at import:
    # get_backend() reports 'reference' (and native_load_error() says why) if it is absent.
    _requested = value


_init_from_env()


def _native_group(t: torch.Tensor) -> torch.device | str | None:
    """The batch a tensor joins for the native kernel, or None for the reference path.

    Uses the cheap ``is_cpu``/``is_cuda`` flags: this runs once per captured tensor.
    """
    if (
        type(t) not in _PLAIN_TYPES
        or t.layout != torch.strided
        or t.is_quantized
        or t.is_nested
        or torch._C._functorch.is_functorch_wrapped_tensor(t)
    ):
        return None
    if t.is_cpu:  # False for meta tensors
        return "cpu"
    if t.is_cuda and _cuda_kernels:
        return t.device
    return None


def _clone_native(batch: list[torch.Tensor], *, size_checked: bool = False) -> list[torch.Tensor]:
    """One native call for tensors on one device (reference below NATIVE_MIN_BYTES, unless the
    caller already checked the batch's size)."""
    if not size_checked and NATIVE_MIN_BYTES and sum(t.nbytes for t in batch) < NATIVE_MIN_BYTES:
        return _reference.clone_tensors(batch)
    op = torch.ops.pyhook.clone_many.default
    if _skip_autograd(batch):
        # Nothing to differentiate: go straight to the device kernel. The Python
        # autograd wrapper of register_autograd costs ~10 us per call for nothing.
        with torch._C._AutoDispatchBelowADInplaceOrView():
            return op(batch)
    return op(batch)


def _skip_autograd(batch: list[torch.Tensor]) -> bool:
    if torch.is_grad_enabled() and any(t.requires_grad for t in batch):
        return False
    return not torch.compiler.is_compiling()  # a tracer should see the plain op call


def clone_one(t: torch.Tensor, min_bytes: int | None = None) -> torch.Tensor:
    """``clone_tensors([t])[0]``, with the routing of small tensors kept off the hot path
    (every traced layer that clones a tensor output comes here). ``min_bytes`` replaces
    :data:`NATIVE_MIN_BYTES` as the size from which the native kernel is used.

    >>> x = torch.arange(3.0)
    >>> y = clone_one(x); torch.equal(x, y) and y.data_ptr() != x.data_ptr()
    True
    """
    limit = NATIVE_MIN_BYTES if min_bytes is None else min_bytes
    # Only a strided tensor has a byte size to compare (sparse ones raise on ``nbytes``); any
    # other layout is routed by _clone_list, to the reference path.
    checked = bool(limit) and type(t) is torch.Tensor and t.layout == torch.strided
    if _requested == "reference" or (checked and not t.is_nested and t.nbytes < limit):
        return t.clone()
    return _clone_list([t], size_checked=checked or min_bytes is not None)[0]


def row_stats(rows: torch.Tensor) -> torch.Tensor | None:
    """The native statistics row of host rows ``[n, D]`` (float64 ``[1, 2 + 2*D]``: count, sum
    of row L2 norms, column means, column M2), or None where the native kernel does not apply
    (not built, the reference backend chosen, not a plain CPU tensor of a real dtype).

    >>> x = torch.tensor([[3.0, 0.0], [0.0, 4.0]])
    >>> s = row_stats(x)
    >>> s is None or s.tolist() == [[2.0, 7.0, 1.5, 2.0, 4.5, 8.0]]
    True
    """
    if (
        _requested == "reference"
        or type(rows) is not torch.Tensor
        or rows.dim() != 2
        or not rows.is_cpu
        or rows.layout != torch.strided
        or rows.is_complex()
        or rows.is_quantized
        or rows.dtype not in _ROW_STATS_DTYPES
        or not native_available()
    ):
        return None
    return torch.ops.pyhook.row_stats(rows)


# What the kernel dispatches on (AT_DISPATCH_ALL_TYPES_AND3 with half, bfloat16 and bool); any
# other dtype (uint16, float8, ...) takes the Python path, whose callers name what they refuse.
_ROW_STATS_DTYPES = frozenset(
    {
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.bool,
    }
)


def clone_tensors(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copy every tensor exactly like ``t.clone()``, using the native kernel where it applies.

    >>> xs = [torch.arange(4.0), torch.ones(2, 3).t()]
    >>> [torch.equal(a, b) and a.stride() == b.stride() for a, b in zip(xs, clone_tensors(xs))]
    [True, True]
    """
    return _clone_list(list(tensors))


def _clone_list(tensors: list[torch.Tensor], size_checked: bool = False) -> list[torch.Tensor]:
    if not tensors:
        return []
    if get_backend() != "native" or _dual_level_active():
        return _reference.clone_tensors(tensors)
    if NATIVE_MIN_BYTES and not size_checked:
        # Small captures: the reference path is the faster one; decide before any per-tensor
        # routing so that they pay (almost) nothing for the native backend being on.
        try:
            small = sum(t.nbytes for t in tensors) < NATIVE_MIN_BYTES
            size_checked = True
        except (RuntimeError, NotImplementedError):  # layouts without nbytes (nested, ...)
            small = False
        if small:
            return _reference.clone_tensors(tensors)

    # Partition by device so each native call sees one device; everything the
    # kernels cannot take goes through the reference path.
    groups: dict[torch.device | str, list[int]] = {}
    fallback: list[int] = []
    for i, t in enumerate(tensors):
        key = _native_group(t)
        if key is None:
            fallback.append(i)
        else:
            groups.setdefault(key, []).append(i)
    if not groups:
        return _reference.clone_tensors(tensors)
    if not fallback and len(groups) == 1:  # the common case: one device, all native
        # whole list = this batch: its size was checked above (when the sum could be taken)
        return _clone_native(tensors, size_checked=size_checked)

    out: list[torch.Tensor | None] = [None] * len(tensors)
    for idx in groups.values():
        copies = _clone_native([tensors[i] for i in idx])
        for i, c in zip(idx, copies):
            out[i] = c
    if fallback:
        for i, c in zip(fallback, _reference.clone_tensors([tensors[i] for i in fallback])):
            out[i] = c
    return out  # type: ignore[return-value]


_POOL_KEYS = (
    "cached_bytes",
    "cached_buffers",
    "limit_bytes",
    "hits",
    "misses",
    "live_bytes",
    "live_buffers",
)


def pool_stats() -> dict[str, int]:
    """Counters of the native CPU capture-buffer pool (all zero without the native module).

    ``cached_*``: idle buffers kept for reuse; ``limit_bytes``: cap on ``cached_bytes``;
    ``hits``/``misses``: allocations served from the pool / from the system;
    ``live_*``: pooled buffers still referenced by some output tensor.

    Example::

        >>> import torch, pyhook
        >>> before = pyhook.pool_stats()
        >>> sorted(before)[:3]
        ['cached_buffers', 'cached_bytes', 'hits']
        >>> for _ in range(3):  # capture, use, drop: the same buffer comes back from the pool
        ...     out = pyhook.recursive_copy([torch.ones(1 << 20)], clone=True)
        ...     del out
        >>> pyhook.pool_stats()["hits"] >= before["hits"] + (2 if pyhook.native_available() else 0)
        True
    """
    if not native_available():
        return dict.fromkeys(_POOL_KEYS, 0)
    return dict(zip(_POOL_KEYS, torch.ops.pyhook.pool_stats()))


def set_pool_limit(nbytes: int) -> None:
    """Cap the bytes of idle buffers the pool keeps; ``0`` disables caching.

    The default is 1 GiB, or ``PYHOOK_POOL_LIMIT`` (bytes) from the environment.

    Example::

        >>> import pyhook
        >>> pyhook.set_pool_limit(256 << 20)  # keep at most 256 MiB of idle capture buffers
        >>> pyhook.pool_stats()["limit_bytes"] in (256 << 20, 0)  # 0 without the native core
        True
        >>> pyhook.set_pool_limit(1 << 30)
    """
    if not isinstance(nbytes, int) or isinstance(nbytes, bool):
        raise TypeError(f"nbytes must be an int (bytes), got {type(nbytes).__name__}: {nbytes!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if native_available():
        torch.ops.pyhook.pool_set_limit(int(nbytes))


def empty_pool() -> None:
    """Free every idle buffer the pool holds (buffers still in use are unaffected).

    Example::

        >>> import pyhook
        >>> pyhook.empty_pool()
        >>> pyhook.pool_stats()["cached_bytes"]
        0
    """
    if native_available():
        torch.ops.pyhook.pool_empty()


def empty_host(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor, over a pooled buffer when the native core is built (the
    memory of buffers freed earlier, already mapped: no page fault per 4 KiB on reuse; a fresh
    12 MB allocation costs a fault per 4 KiB). The one place the pipeline's readers and
    generate's step buffers take host memory from."""
    if native_available():
        return torch.ops.pyhook.empty_pooled([int(s) for s in shape], dtype)
    return torch.empty(tuple(shape), dtype=dtype)


def _gather_args(
    parts: Sequence[torch.Tensor], idx: torch.Tensor | Sequence[int]
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Check and normalise the arguments of :func:`gather_rows` (named errors)."""
    parts = list(parts)
    if not parts:
        raise ValueError(
            "gather_rows: `parts` is empty; pass at least one part (an empty [0, ...] tensor "
            "gives the row shape and dtype of a layer without rows)"
        )
    first = parts[0]
    for i, p in enumerate(parts):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"gather_rows: part {i} must be a tensor, got {type(p).__name__}")
        if p.layout != torch.strided:
            raise TypeError(
                f"gather_rows: part {i} has layout {p.layout}; parts must be strided (dense) "
                "tensors"
            )
        if p.dim() < 1:
            raise ValueError(f"gather_rows: part {i} must have a row dimension, got a 0-d tensor")
        if p.dtype != first.dtype:
            raise TypeError(
                f"gather_rows: part {i} has dtype {p.dtype}, part 0 has {first.dtype}; all "
                "parts must share one dtype"
            )
        if p.shape[1:] != first.shape[1:]:
            raise ValueError(
                f"gather_rows: part {i} has shape {tuple(p.shape)}, part 0 has rows of shape "
                f"{tuple(first.shape[1:])}; all parts must share one row shape"
            )
        if p.device != first.device:
            raise ValueError(
                f"gather_rows: part {i} is on {p.device}, part 0 on {first.device}; all parts "
                "must be on one device"
            )
    if not isinstance(idx, torch.Tensor):
        idx = torch.as_tensor(idx) if len(idx) else torch.empty(0, dtype=torch.long)
    if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
        raise TypeError(f"gather_rows: `idx` must hold integers, got a {idx.dtype} tensor")
    if idx.dim() != 1:
        raise ValueError(f"gather_rows: `idx` must be 1-D, got shape {tuple(idx.shape)}")
    return parts, idx.to(device=first.device, dtype=torch.long)


def _dual_level_active() -> bool:
    """Whether forward-mode AD is on (a ``forward_ad.dual_level``): the native ops have no
    forward formula and would drop the tangents, so the reference path runs."""
    return forward_ad._current_level >= 0


def _gather_native(parts: list[torch.Tensor], idx: torch.Tensor) -> bool:
    return (
        get_backend() == "native"
        and not _dual_level_active()
        and idx.is_cpu
        and all(_native_group(p) == "cpu" for p in parts)
        and not (torch.is_grad_enabled() and any(p.requires_grad for p in parts))
    )


def _direct_gather_ok(parts: Sequence[torch.Tensor]) -> bool:
    """Whether ``parts`` (kept and reused by a caller, e.g. a dataset's memory maps) may skip
    :func:`gather_rows`' per-call checks: plain strided CPU tensors of one dtype and row shape
    that need no autograd. The caller still checks ``get_backend() == "native"`` per call."""
    parts = list(parts)
    return (
        bool(parts)
        and native_available()
        and all(
            isinstance(p, torch.Tensor)
            and p.dim() >= 1
            and p.dtype == parts[0].dtype
            and p.shape[1:] == parts[0].shape[1:]
            and _native_group(p) == "cpu"
            and not p.requires_grad
            for p in parts
        )
    )


def _gather_direct(parts: list[torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
    """:func:`gather_rows` for parts that passed :func:`_direct_gather_ok` and a 1-D int64 CPU
    ``idx`` (the kernel still checks every index and the parts' memory)."""
    return torch.ops.pyhook.gather_rows.default(parts, idx)


def _gather_direct_into(parts: list[torch.Tensor], idx: torch.Tensor, out: torch.Tensor) -> None:
    """:func:`gather_rows_into` for parts that passed :func:`_direct_gather_ok` (the kernel
    checks ``out``'s dtype, shape and contiguity)."""
    torch.ops.pyhook.gather_rows_into.default(parts, idx, out)


def _gather_many_direct(
    parts: list[torch.Tensor], counts: list[int], idx: torch.Tensor
) -> list[torch.Tensor]:
    """Rows ``idx`` of several layers in one native call (layer ``l``'s parts are the next
    ``counts[l]`` entries of ``parts``, each layer's parts passed :func:`_direct_gather_ok`):
    one index check, one residency check and one work list for the whole batch.

    Like the other ``_direct`` calls, without ``_AutoDispatchBelowADInplaceOrView``: the
    guard's context manager cost more than it saved (18 us of a batch whose CPU caches a
    training step had overwritten). This operator has no autograd step at all (a fallthrough
    for the Autograd key, csrc/cpu/gather.cpp): no part of a capture needs gradients, and
    autograd's boxed fallback cost 6-8 us a call after a training step."""
    return torch.ops.pyhook.gather_rows_many.default(parts, counts, idx)


class _GatherPlan:
    """Parts of several layers (as for :func:`_gather_many_direct`, each layer's parts passed
    :func:`_direct_gather_ok`) checked and looked up once by the native core
    (``pyhook::gather_plan``), for the batches of a training loop: ``rows(id, idx)`` then
    returns each layer's rows ``idx`` (a 1-D int64 CPU tensor; the kernel checks every index),
    as :func:`_gather_many_direct` of those parts would.

    Right after a training step, with the CPU caches cold, passing a number and an index cost
    22 us a call where the list of a dozen shard tensors cost 41 us, and the parts were checked
    again on each call (6 us). The native plan holds the parts until this object is freed.
    """

    __slots__ = ("id", "rows")

    def __init__(self, parts: list[torch.Tensor], counts: list[int]) -> None:
        self.id: int = torch.ops.pyhook.gather_plan.default(parts, counts)
        op = torch.ops.pyhook.gather_plan_rows.default
        # The operator's own callable: one Python frame fewer than the OpOverload.
        self.rows: Callable[[int, torch.Tensor], list[torch.Tensor]] = getattr(op, "_op", op)

    def __call__(self, idx: torch.Tensor) -> list[torch.Tensor]:
        return self.rows(self.id, idx)

    def __del__(self) -> None:
        try:
            torch.ops.pyhook.gather_plan_release.default(self.id)
        except Exception:  # interpreter shutdown: the operator registry is gone, as is the plan
            pass


def _gather_many_direct_into(
    parts: list[torch.Tensor], counts: list[int], idx: torch.Tensor, outs: list[torch.Tensor]
) -> None:
    """:func:`_gather_many_direct` written into ``outs`` (one per layer; the kernel checks
    their dtype, shape and contiguity)."""
    torch.ops.pyhook.gather_rows_many_into.default(parts, counts, idx, outs)


def gather_rows(parts: Sequence[torch.Tensor], idx: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Rows ``idx`` of ``torch.cat(parts)`` (without concatenating), as a fresh tensor.

    ``parts`` are the per-shard tensors of one layer, in order (row-major ``[rows, ...]``, e.g.
    memory-mapped shards); ``idx`` holds global row numbers, ``0 <= idx < sum of rows``, in any
    order (an index out of range raises :class:`IndexError` naming it). The result is
    contiguous, ``[len(idx), *row_shape]``, and owned by the caller: it never shares memory
    with the parts. The native kernel copies the rows in ascending source order on all
    intra-op threads, without the GIL, into a pooled buffer; the reference backend gives the
    same values (see :func:`pyhook._reference.gather_rows`).

    >>> parts = [torch.arange(6.0).reshape(3, 2), torch.arange(6.0, 10.0).reshape(2, 2)]
    >>> gather_rows(parts, torch.tensor([4, 0, 3])).tolist()
    [[8.0, 9.0], [0.0, 1.0], [6.0, 7.0]]
    """
    parts, idx = _gather_args(parts, idx)
    if _gather_native(parts, idx):
        with torch._C._AutoDispatchBelowADInplaceOrView():
            return torch.ops.pyhook.gather_rows.default(parts, idx)
    return _reference.gather_rows(parts, idx)


def gather_rows_into(
    parts: Sequence[torch.Tensor], idx: torch.Tensor | Sequence[int], out: torch.Tensor
) -> torch.Tensor:
    """:func:`gather_rows` written into ``out`` (e.g. shared memory); returns ``out``.

    ``out`` must be a contiguous CPU tensor of shape ``[len(idx), *row_shape]`` and the parts'
    dtype; on a bad index nothing is written.

    >>> out = torch.empty(2, 2)
    >>> gather_rows_into([torch.eye(2)], [1, 0], out).tolist()
    [[0.0, 1.0], [1.0, 0.0]]
    """
    parts, idx = _gather_args(parts, idx)
    shape = (idx.numel(), *parts[0].shape[1:])
    if (
        not isinstance(out, torch.Tensor)
        or out.dtype != parts[0].dtype
        or tuple(out.shape) != shape
        or not out.is_contiguous()
        or out.device != parts[0].device
    ):
        got = (
            f"{out.dtype} {tuple(out.shape)} on {out.device}"
            if isinstance(out, torch.Tensor)
            else type(out).__name__
        )
        raise ValueError(
            f"gather_rows_into: `out` must be a contiguous {parts[0].dtype} tensor of shape "
            f"{shape} on {parts[0].device}, got {got}"
        )
    # As the native kernel checks (its message): writing into a part would make the result
    # depend on the copy order.
    if out.numel() and any(p.numel() and torch._C._is_alias_of(p, out) for p in parts):
        raise RuntimeError("gather_rows_into: `out` (layer 0) shares memory with a part")
    if _gather_native(parts, idx) and out.is_cpu:
        torch.ops.pyhook.gather_rows_into.default(parts, idx, out)
    else:
        _reference.gather_rows_into(parts, idx, out)
    return out


_QUANTISED = (getattr(torch, "float8_e4m3fn", None), torch.int8)
_DEQUANT_OUT = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _dequant_args(
    parts: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], idx: Any
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    parts, idx = _gather_args(parts, idx)
    scales = list(scales)
    if parts[0].dtype not in _QUANTISED:
        raise TypeError(f"dequant_rows: parts must be float8_e4m3fn or int8, got {parts[0].dtype}")
    if len(scales) != len(parts):
        raise ValueError(
            f"dequant_rows: {len(parts)} parts but {len(scales)} scale tensors; pass one per part"
        )
    for i, (p, s) in enumerate(zip(parts, scales)):
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.shape != p.shape[:1]:
            got = f"{s.dtype} {tuple(s.shape)}" if isinstance(s, torch.Tensor) else type(s).__name__
            raise ValueError(
                f"dequant_rows: scales {i} must be a float32 tensor [{p.shape[0]}] (one per row "
                f"of part {i}), got {got}"
            )
    return parts, scales, idx


def _dequant_native(parts: list[torch.Tensor], scales: list[torch.Tensor], idx: Any) -> bool:
    return (
        _gather_native(parts, idx)
        and all(_native_group(s) == "cpu" for s in scales)
        # the kernel has no autograd: scales that need gradients take the reference path
        and not (torch.is_grad_enabled() and any(s.requires_grad for s in scales))
        and hasattr(torch.ops.pyhook, "dequant_rows")  # a build older than the op: reference
    )


def dequant_rows(
    parts: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    idx: torch.Tensor | Sequence[int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rows ``idx`` of quantised ``parts`` (float8_e4m3fn or int8, one float32 scale per row
    in ``scales``, one tensor per part), dequantised into ``dtype``: ``dtype(float32(row) *
    scale)``, a fresh tensor. How a compact store's rows are read (:mod:`pyhook.pipeline.encoding`):
    the native kernel reads the 1-byte rows straight from the memory maps, without the GIL;
    the reference backend gives the same values (:func:`pyhook._reference.dequant_rows`).

    >>> q = [torch.tensor([[2, -4], [1, 0]], dtype=torch.int8)]
    >>> dequant_rows(q, [torch.tensor([0.5, 2.0])], [1, 0]).tolist()
    [[2.0, 0.0], [1.0, -2.0]]
    """
    parts, scales, idx = _dequant_args(parts, scales, idx)
    if dtype not in _DEQUANT_OUT:
        raise TypeError(
            f"dequant_rows: dtype must be float32, float64, bfloat16 or float16, got {dtype}"
        )
    if _dequant_native(parts, scales, idx):
        with torch._C._AutoDispatchBelowADInplaceOrView():
            return torch.ops.pyhook.dequant_rows.default(parts, scales, idx, dtype)
    return _reference.dequant_rows(parts, scales, idx, dtype)


def dequant_rows_into(
    parts: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    idx: torch.Tensor | Sequence[int],
    out: torch.Tensor,
) -> torch.Tensor:
    """:func:`dequant_rows` written into ``out`` (a contiguous CPU tensor of the result's shape,
    in the dtype to dequantise into, e.g. shared memory); returns ``out``.

    >>> out = torch.empty(1, 2, dtype=torch.bfloat16)
    >>> q = [torch.tensor([[3, 1]], dtype=torch.int8)]
    >>> dequant_rows_into(q, [torch.tensor([0.25])], [0], out).tolist()
    [[0.75, 0.25]]
    """
    parts, scales, idx = _dequant_args(parts, scales, idx)
    shape = (idx.numel(), *parts[0].shape[1:])
    if (
        not isinstance(out, torch.Tensor)
        or out.dtype not in _DEQUANT_OUT
        or tuple(out.shape) != shape
        or not out.is_contiguous()
        or not out.is_cpu
    ):
        raise ValueError(
            f"dequant_rows_into: `out` must be a contiguous CPU float tensor of shape {shape}"
        )
    if _dequant_native(parts, scales, idx):
        with torch._C._AutoDispatchBelowADInplaceOrView():
            torch.ops.pyhook.dequant_rows_into.default(parts, scales, idx, out)
    else:
        _reference.dequant_rows_into(parts, scales, idx, out)
    return out


def _dequant_many_ok() -> bool:
    """Whether the fused batch decode (``pyhook::dequant_rows_many``) is there to call: the
    native backend, and a build that has the op."""
    return (
        get_backend() == "native"
        and native_available()
        and hasattr(torch.ops.pyhook, "dequant_rows_many")
    )


def _dequant_many_direct(
    parts: list[torch.Tensor],
    scales: list[torch.Tensor],
    counts: list[int],
    idx: torch.Tensor,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Rows ``idx`` of several quantised layers in one native call, each dequantised into
    ``dtype`` (layer ``l``'s parts and scales are the next ``counts[l]`` entries of ``parts``
    and ``scales``; the kernel checks them and every index). For a caller that keeps the
    parts, e.g. a dataset's memory maps; :func:`dequant_rows` per layer gives the same values.
    """
    with torch._C._AutoDispatchBelowADInplaceOrView():
        return torch.ops.pyhook.dequant_rows_many.default(parts, scales, counts, idx, dtype)


def _dequant_many_direct_into(
    parts: list[torch.Tensor],
    scales: list[torch.Tensor],
    counts: list[int],
    idx: torch.Tensor,
    outs: list[torch.Tensor],
) -> None:
    """:func:`_dequant_many_direct` written into ``outs`` (one per layer, each in the dtype
    to dequantise into; the kernel checks their shape and contiguity)."""
    with torch._C._AutoDispatchBelowADInplaceOrView():
        torch.ops.pyhook.dequant_rows_many_into.default(parts, scales, counts, idx, outs)
