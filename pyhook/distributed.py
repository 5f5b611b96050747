"""Parallel layout and activation routing for :class:`pyhook.FlexModel` under ``torch.distributed``.

* :func:`parallel_layout` lays ranks out as flex_model (and Megatron) do: ``arange(world)``
  reshaped to ``(pp, dp, tp)``, so tensor-parallel groups are runs of consecutive ranks,
  data-parallel groups stride by ``tp`` and pipeline groups by ``tp * dp``.
* :class:`ParallelState` creates this rank's tensor-, data- and pipeline-parallel groups with the
  backend of the default process group (gloo on CPU, NCCL on GPU: never hard-coded) and an
  optional ``timeout``, so that a rank that fails makes the others fail instead of hang.
* :func:`gather_activation` assembles the full activation: all-gather (or gather to the saving
  rank, when nothing is edited) across tensor-parallel ranks along the dimension that
  ``expected_shape`` reveals, then along the batch across data-parallel ranks; ``DTensor``
  activations are gathered with ``full_tensor()`` and need no hint. The ranks first exchange
  their shapes, so shards may differ in size along the gathered dimension and shapes that
  cannot be concatenated raise the same error on every rank. It returns a function that
  re-shards an edited full tensor so that each rank keeps its own slice.
* :func:`layout_hook` is the layout layer under every tracer: the hooks pyhook registers on a
  tensor-parallel model (transformers' ``tp_plan``, torch's parallel styles, DTensors), forward
  and full backward ones, see and return whole tensors and gradients; :func:`module_layout`
  tells how a module's tensors are sharded, and :class:`LayoutError` refuses, by name, a
  layout that cannot be gathered exactly.
* :class:`DistributedHookError` is raised, naming the module and the group, when a collective
  fails (typically because another rank failed or never reached the layer).

Nothing here is needed in a single process: with every parallel size 1 no group is created and
``torch.distributed`` need not be initialised.
"""

from __future__ import annotations

import datetime
import functools
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DistributedHookError",
    "LayoutError",
    "ModuleLayout",
    "ParallelState",
    "gather_activation",
    "gathered_first",
    "is_dtensor",
    "layout_hook",
    "module_layout",
    "parallel_layout",
    "tensor_parallel_ranks",
]


class DistributedHookError(RuntimeError):
    """A collective run by a :class:`~pyhook.FlexModel` hook failed or timed out.

    The message names the module, the hook type and the process group; the original error is
    chained as ``__cause__``. The usual cause is another rank that raised (or skipped the layer)
    before reaching the same collective; how long a rank waits is the ``timeout`` given to
    :class:`~pyhook.FlexModel` (the process group's timeout when none was given).

    Example::

        >>> from pyhook.distributed import DistributedHookError
        >>> issubclass(DistributedHookError, RuntimeError)
        True
    """


def parallel_layout(
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    data_parallel_size: int = 1,
    ranks: Sequence[int] | None = None,
) -> dict[str, list[list[int]]]:
    """The rank groups of each parallel axis, as flex_model lays them out.

    ``ranks`` are the global ranks of the process group to lay out (default
    ``range(tp * pp * dp)``); the result maps ``"tp"``, ``"dp"`` and ``"pp"`` to lists of
    groups of global ranks.

    Example::

        >>> from pyhook.distributed import parallel_layout
        >>> lay = parallel_layout(2, 2, 2)
        >>> lay["tp"], lay["dp"], lay["pp"]
        ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2], [1, 3], [4, 6], [5, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])
    """
    tp, pp, dp = tensor_parallel_size, pipeline_parallel_size, data_parallel_size
    for name, v in (
        ("tensor_parallel_size", tp),
        ("pipeline_parallel_size", pp),
        ("data_parallel_size", dp),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    world = tp * pp * dp
    ranks = list(range(world)) if ranks is None else list(ranks)
    if len(ranks) != world:
        raise ValueError(
            f"tensor_parallel_size * pipeline_parallel_size * data_parallel_size = {tp}*{pp}*{dp} "
            f"= {world} "
            f"but the process group has {len(ranks)} ranks"
        )
    mesh = torch.tensor(ranks).reshape(pp, dp, tp)
    return {
        "tp": mesh.reshape(-1, tp).tolist(),
        "dp": mesh.permute(0, 2, 1).reshape(-1, dp).tolist(),
        "pp": mesh.permute(1, 2, 0).reshape(-1, pp).tolist(),
    }


@dataclass
class _Axis:
    name: str  # "tensor" / "data" / "pipeline"
    ranks: list[int]  # global ranks of this rank's group on the axis
    rank: int  # this rank's index in the group
    group: Any  # ProcessGroup, or None when the group has one rank

    @property
    def size(self) -> int:
        return len(self.ranks)


class ParallelState:
    """This rank's tensor-, data- and pipeline-parallel groups.

    Created by :class:`~pyhook.FlexModel`; with all sizes 1 it is a no-op and needs no
    ``torch.distributed``. Otherwise ``torch.distributed`` must be initialised (with any
    backend) or initialisable from the ``env://`` variables; the groups use the default group's
    backend and ``timeout`` (a ``datetime.timedelta`` or seconds) when given. Only the ranks of
    a group create it (``use_local_synchronization``), so ``process_group`` may be a subset of
    the world.

    Example::

        >>> from pyhook.distributed import ParallelState
        >>> st = ParallelState()  # one process: no torch.distributed needed
        >>> st.distributed, st.tensor_parallel_world_size, st.tensor_parallel_rank
        (False, 1, 0)
    """

    def __init__(
        self,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: int = 1,
        process_group: Any = None,
        *,
        timeout: datetime.timedelta | float | None = None,
    ) -> None:
        if timeout is not None and not isinstance(timeout, datetime.timedelta):
            if not isinstance(timeout, (int, float)) or timeout <= 0:
                raise ValueError(
                    f"timeout must be a datetime.timedelta or positive seconds, got {timeout!r}"
                )
            timeout = datetime.timedelta(seconds=float(timeout))
        self.timeout: datetime.timedelta | None = timeout
        sizes = (tensor_parallel_size, pipeline_parallel_size, data_parallel_size)
        parallel_layout(*sizes)  # validates the sizes
        world = tensor_parallel_size * pipeline_parallel_size * data_parallel_size
        self.distributed = world > 1 or process_group is not None
        if not self.distributed:
            self.tp = _Axis("tensor", [0], 0, None)
            self.dp = _Axis("data", [0], 0, None)
            self.pp = _Axis("pipeline", [0], 0, None)
            return
        if not dist.is_available():
            raise RuntimeError(
                "FlexModel: parallel sizes > 1 need torch.distributed, which this torch lacks"
            )
        if not dist.is_initialized():
            if "MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ and "RANK" in os.environ:
                dist.init_process_group()  # backend chosen by torch for the devices present
            else:
                raise RuntimeError(
                    "FlexModel: tensor/pipeline/data parallel sizes > 1 need torch.distributed; "
                    "call "
                    "torch.distributed.init_process_group(...) (any backend) first, or launch "
                    "with torchrun"
                )
        ranks = (
            dist.get_process_group_ranks(process_group)
            if process_group is not None
            else list(range(dist.get_world_size()))
        )
        me = dist.get_rank()
        if me not in ranks:
            raise ValueError(f"FlexModel: rank {me} is not a member of the process_group given")
        layout = parallel_layout(*sizes, ranks=ranks)
        axes = {}
        for key, name in (("tp", "tensor"), ("dp", "data"), ("pp", "pipeline")):
            mine = next(g for g in layout[key] if me in g)
            group = None
            if len(mine) > 1:
                group = dist.new_group(mine, timeout=timeout, use_local_synchronization=True)
            axes[key] = _Axis(name, mine, mine.index(me), group)
        self.tp, self.dp, self.pp = axes["tp"], axes["dp"], axes["pp"]

    # flex_model's _ParallelStateAPI names
    @property
    def tensor_parallel_group(self) -> Any:
        return self.tp.group

    @property
    def data_parallel_group(self) -> Any:
        return self.dp.group

    @property
    def pipeline_parallel_group(self) -> Any:
        return self.pp.group

    @property
    def tensor_parallel_rank(self) -> int:
        return self.tp.rank

    @property
    def data_parallel_rank(self) -> int:
        return self.dp.rank

    @property
    def pipeline_parallel_rank(self) -> int:
        return self.pp.rank

    @property
    def tensor_parallel_world_size(self) -> int:
        return self.tp.size

    @property
    def data_parallel_world_size(self) -> int:
        return self.dp.size

    @property
    def pipeline_parallel_world_size(self) -> int:
        return self.pp.size

    def __repr__(self) -> str:
        return (
            f"ParallelState(tp={self.tp.rank}/{self.tp.size}, dp={self.dp.rank}/{self.dp.size}, "
            f"pp={self.pp.rank}/{self.pp.size})"
        )


def is_dtensor(x: Any) -> bool:
    """Whether ``x`` is a ``torch.distributed.tensor.DTensor`` (False when unavailable)."""
    if not isinstance(x, torch.Tensor) or type(x) is torch.Tensor:
        return False
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # pragma: no cover - builds without distributed
        return False
    return isinstance(x, DTensor)


def _collective(fn: Callable[[], Any], what: str, axis: _Axis, timeout: Any) -> Any:
    try:
        return fn()
    except RuntimeError as e:
        limit = (
            f"{timeout.total_seconds():g} s"
            if timeout is not None
            else "the process group's timeout"
        )
        raise DistributedHookError(
            f"{what}: collective over the {axis.name}-parallel group (global ranks {axis.ranks}) "
            "failed on "
            f"this rank (index {axis.rank}): {e}. Another rank probably failed or never reached "
            "this layer; "
            f"the wait is bounded by {limit}. The ranks' collectives are out of step after "
            "this: restart the ranks (or destroy and re-create the process group) before "
            "running the model again."
        ) from e


# Slots for a shape in the size exchange (torch tensors have at most 64 dimensions); slot 0
# holds the number of dimensions, so ranks whose activations differ in rank are told apart.
_SHAPE_SLOTS = 65


def _exchange_sizes(t: torch.Tensor, dim: int, axis: _Axis, what: str, timeout: Any) -> list[int]:
    """The sizes along ``dim`` of every rank's ``t`` (in group order), after checking that the
    other dimensions agree. Every rank of the group sees the same shapes, so a mismatch raises
    the same error on all of them: none is left waiting in the gather, and no rank receives
    data of another size than it allocated (gloo aborts the process or delivers garbage)."""
    mine = torch.full((_SHAPE_SLOTS,), -1, dtype=torch.int64)
    mine[0] = t.dim()
    mine[1 : t.dim() + 1] = torch.tensor(t.shape, dtype=torch.int64)
    mine = mine.to(t.device)  # the data gather's device (NCCL only sends device tensors)
    every = [torch.empty_like(mine) for _ in range(axis.size)]
    _collective(lambda: dist.all_gather(every, mine, group=axis.group), what, axis, timeout)
    shapes = [tuple(e[1 : int(e[0]) + 1].tolist()) for e in every]
    if any(
        len(s) != t.dim() or any(s[i] != t.shape[i] for i in range(t.dim()) if i != dim)
        for s in shapes
    ):
        raise ValueError(
            f"{what}: the {axis.name}-parallel ranks (global ranks {axis.ranks}) hold activations "
            f"of shapes {[list(s) for s in shapes]}; they are gathered along dimension {dim}, so "
            "every other dimension must be the same on all of them"
        )
    return [s[dim] for s in shapes]


def _padded(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``t`` (contiguous) grown with zeros to ``size`` along ``dim``: all-gather needs one size."""
    t = t.contiguous()
    if t.shape[dim] == size:
        return t
    pad = list(t.shape)
    pad[dim] = size - t.shape[dim]
    return torch.cat([t, t.new_zeros(pad)], dim)


def _gather_cat(t: torch.Tensor, dim: int, group: Any, sizes: list[int]) -> torch.Tensor:
    """Every rank's ``t`` (``sizes[r]`` long along ``dim``), padded to one size for
    ``all_gather`` and concatenated along ``dim`` without the padding."""
    src = _padded(t, dim, max(sizes))
    parts = [torch.empty_like(src) for _ in sizes]
    dist.all_gather(parts, src, group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim)


class _AllGatherCat(torch.autograd.Function):
    """All-gather + concatenate, differentiable: the gradient of this rank's slice is the sum
    over ranks of their gradients for it (an all-reduce, which every backend has)."""

    @staticmethod
    def forward(
        ctx: Any, t: torch.Tensor, dim: int, group: Any, rank: int, sizes: list[int]
    ) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.rank, ctx.sizes = dim, group, rank, sizes
        return _gather_cat(t, dim, group, sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        mine = torch.split(grad, ctx.sizes, ctx.dim)[ctx.rank]
        return mine.contiguous(), None, None, None, None


def _gather_dim(
    t: torch.Tensor,
    dim: int,
    axis: _Axis,
    sizes: list[int],
    everywhere: bool,
    differentiable: bool,
    what: str,
    timeout: Any,
) -> torch.Tensor | None:
    """Concatenate the ranks' ``t`` along ``dim``; ``sizes`` from :func:`_exchange_sizes`."""
    if everywhere and differentiable:
        return _collective(
            lambda: _AllGatherCat.apply(t, dim, axis.group, axis.rank, sizes),
            what,
            axis,
            timeout,
        )
    src = _padded(t, dim, max(sizes))
    if everywhere:
        parts = [torch.empty_like(src) for _ in sizes]
        _collective(lambda: dist.all_gather(parts, src, group=axis.group), what, axis, timeout)
    elif axis.rank == 0:
        parts = [torch.empty_like(src) for _ in sizes]
        _collective(
            lambda: dist.gather(src, parts, group=axis.group, group_dst=0), what, axis, timeout
        )
    else:
        _collective(
            lambda: dist.gather(src, None, group=axis.group, group_dst=0), what, axis, timeout
        )
        return None
    parts = [p.narrow(dim, 0, n) for p, n in zip(parts, sizes)]
    parts[axis.rank] = t  # keeps the autograd link to this rank's slice
    return torch.cat(parts, dim)


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def gather_activation(
    t: torch.Tensor,
    state: ParallelState | None,
    *,
    expected_shape: Sequence[int | None] | None,
    what: str,
    everywhere: bool,
    gather_data_parallel: bool = True,
    batch_dim: int = 0,
) -> tuple[torch.Tensor | None, Callable[[torch.Tensor], torch.Tensor] | None, bool]:
    """Assemble the full activation ``t`` (see the module docstring).

    Returns ``(full, reshard, is_saver_candidate)``: ``full`` is None on ranks that do not
    receive it (``everywhere=False`` gathers only to rank 0 of each group); ``reshard(edited)``
    gives this rank's slice of an edited full tensor (None when no gathering happened, so the
    edited tensor is used as it is); the last flag tells whether this rank holds the
    assembled tensor as rank 0 of the groups it was gathered over.
    """
    if is_dtensor(t):
        return _gather_dtensor(t, what)
    ndim = t.dim()
    if expected_shape is not None:
        if len(expected_shape) != ndim:
            raise ValueError(
                f"{what}: expected_shape {tuple(expected_shape)} has {len(expected_shape)} "
                "dimensions but the "
                f"activation has {ndim} (shape {tuple(t.shape)})"
            )
        full_shape = [t.shape[i] if e is None else int(e) for i, e in enumerate(expected_shape)]
        diff = [i for i in range(ndim) if full_shape[i] != t.shape[i]]
    else:
        full_shape, diff = list(t.shape), []
    tp = state.tp if state is not None else None
    dp = state.dp if state is not None else None
    timeout = state.timeout if state is not None else None
    tp_size = tp.size if tp is not None else 1
    if len(diff) > 1:
        raise NotImplementedError(
            f"{what}: expected_shape {tuple(expected_shape or ())} differs from the local "
            "activation shape "
            f"{tuple(t.shape)} in dimensions {diff}; tensor-parallel gathering supports one "
            "sharded dimension"
        )
    if diff:
        d = diff[0]
        if tp_size == 1:  # the same on every rank (a check that may differ waits for the exchange)
            raise ValueError(
                f"{what}: expected_shape {tuple(expected_shape or ())} gives size {full_shape[d]} "
                f"for dimension {d} "
                f"but the activation has {t.shape[d]} there (shape {tuple(t.shape)}) with "
                "tensor_parallel_size="
                f"{tp_size}; the full size must be the local size times the tensor-parallel size"
            )
    do_dp = dp is not None and dp.size > 1 and gather_data_parallel
    if not diff and not do_dp:
        saver = (tp is None or tp.rank == 0) and (
            dp is None or dp.rank == 0 or not gather_data_parallel
        )
        return t, None, saver
    bdim = _norm_dim(batch_dim, ndim) if do_dp else 0
    if do_dp and not 0 <= bdim < ndim:
        raise ValueError(
            f"{what}: batch_dim {batch_dim} is out of range for an activation of shape "
            f"{tuple(t.shape)}"
        )
    differentiable = everywhere and torch.is_grad_enabled() and t.requires_grad
    full: torch.Tensor | None = t
    tp_sizes: list[int] = []
    dp_sizes: list[int] = []
    if diff:
        assert tp is not None
        d = diff[0]
        tp_sizes = _exchange_sizes(t, d, tp, what, timeout)
        if sum(tp_sizes) != full_shape[d]:
            raise ValueError(
                f"{what}: expected_shape {tuple(expected_shape or ())} gives size {full_shape[d]} "
                f"for dimension {d} but the tensor-parallel ranks (global ranks {tp.ranks}) hold "
                f"{tp_sizes} there (sum {sum(tp_sizes)}); the full size must be the sum of the "
                "local sizes"
            )
        full = _gather_dim(t, d, tp, tp_sizes, everywhere, differentiable, what, timeout)
    if do_dp and full is not None:
        assert dp is not None
        dp_sizes = _exchange_sizes(full, bdim, dp, what, timeout)
        full = _gather_dim(full, bdim, dp, dp_sizes, everywhere, differentiable, what, timeout)
    tp_rank = tp.rank if tp is not None else 0
    dp_rank = dp.rank if dp is not None else 0
    saver = tp_rank == 0 and (dp_rank == 0 or not do_dp)

    def reshard(edited: torch.Tensor) -> torch.Tensor:
        out = edited
        if do_dp:
            assert dp is not None
            out = torch.split(out, dp_sizes, bdim)[dp.rank]
        if diff:
            assert tp is not None
            out = torch.split(out, tp_sizes, diff[0])[tp.rank]
        return out.contiguous()

    return full, reshard, saver


def _gather_dtensor(
    t: Any, what: str
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor], bool]:
    from torch.distributed.tensor import DTensor, Replicate

    mesh, placements = t.device_mesh, tuple(t.placements)
    try:
        full = t.full_tensor()
    except RuntimeError as e:
        raise DistributedHookError(
            f"{what}: gathering the DTensor activation (placements {placements}) over {mesh} "
            f"failed: {e}. "
            "Another rank probably failed or never reached this layer."
        ) from e
    coord = mesh.get_coordinate()
    saver = coord is not None and all(c == 0 for c in coord)

    # A Partial placement is a pending reduction, which full_tensor() has just done: the edit
    # goes back Replicate on those mesh dimensions (reducing again would be wasted traffic).
    target = tuple(Replicate() if p.is_partial() else p for p in placements)

    def reshard(edited: torch.Tensor) -> Any:
        rep = DTensor.from_local(edited, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return rep.redistribute(mesh, target)

    return full, reshard, saver


# -- the layout layer: what is the whole tensor at a module? ----------------------------------
#
# Every pyhook tracer registers its forward hooks through pyhook._hooks.HookSet, which asks
# layout_hook() here for the hook to register: on a process without torch.distributed the hook
# itself; on a sharded model a wrapper that hands the hook the whole tensor (gathered from the
# tensor-parallel ranks) and re-shards what the hook returns. One place knows the layouts:
#
# * transformers' tensor parallelism (``from_pretrained(..., tp_plan=...)``) replaces a
#   module's ``forward`` with a closure over its style (ColwiseParallel, RowwiseParallel, ...)
#   and its device mesh: hooks see the local tensors the style leaves (a column-parallel
#   layer's output is this rank's slice of the features; a row-parallel layer's input too);
# * torch's ``parallelize_module`` styles register hooks holding the style's layouts: inputs
#   reach later hooks as DTensors, outputs as local shards or ``AsyncCollectiveTensor`` s;
# * DTensor outputs of any module are gathered with ``full_tensor()``;
# * FSDP2 and accelerate's offloading compute whole activations: nothing to do.
#
# A layout not known here is refused by name (LayoutError) when the hook is registered.


class LayoutError(ValueError):
    """A traced module's tensor is sharded in a way pyhook cannot gather exactly.

    Raised when a hook is registered on such a module (so no hook stays registered), naming the
    module and its parallel style: pyhook never hands out a shard as if it were the whole tensor.

    Example::

        >>> from pyhook.distributed import LayoutError
        >>> issubclass(LayoutError, ValueError)
        True
    """


@dataclass(frozen=True)
class _Sharded:
    """A local tensor that is this rank's slice along ``dim`` of a whole of size ``full``
    (None: unknown, the ranks exchange their sizes), split over ``axis`` as torch.chunk does."""

    dim: int
    full: int | None
    axis: _Axis
    style: str


@dataclass(frozen=True)
class ModuleLayout:
    """How a module's output and first input reach hooks on this rank.

    ``output``/``input`` are None when hooks see them whole (replicated, or DTensors, which are
    gathered whatever their placements); ``style`` names the parallel style, for messages.

    Example::

        >>> from pyhook.distributed import ModuleLayout
        >>> ModuleLayout("transformers EmbeddingParallel").output is None  # whole on every rank
        True
    """

    style: str
    output: _Sharded | None = None
    input: _Sharded | None = None


_GATHERED = threading.local()  # .first: see gathered_first


def gathered_first() -> bool | None:
    """Inside a hook wrapped by :func:`layout_hook`: whether this rank is the first of every
    group the hook's tensors were gathered over (the rank that saves one copy), None when
    nothing was gathered for it.

    Example::

        >>> from pyhook.distributed import gathered_first
        >>> gathered_first() is None  # not inside a hook on a sharded model
        True
    """
    return getattr(_GATHERED, "first", None)


def _note_gathered(first: bool) -> None:
    prev = getattr(_GATHERED, "first", None)
    _GATHERED.first = first if prev is None else (prev and first)


_DIST_AVAILABLE = dist.is_available()  # fixed for the process (is_available looks it up each call)


def _layouts_active() -> bool:
    """Whether sharded layouts can exist in this process (torch.distributed is initialised)."""
    return _DIST_AVAILABLE and dist.is_initialized()


def _mesh_axis(mesh: Any, what: str) -> _Axis:
    if mesh.ndim == 1:
        group = mesh.get_group()
    elif "tp" in (mesh.mesh_dim_names or ()):
        group = mesh.get_group("tp")
    else:
        raise LayoutError(
            f"{what}: the device mesh {mesh} has {mesh.ndim} dimensions and none named 'tp'; "
            "pyhook gathers tensor-parallel shards over a 1-D mesh or the 'tp' dimension"
        )
    return _Axis("tensor", dist.get_process_group_ranks(group), dist.get_rank(group), group)


def _shard_dim(placement: Any) -> int | None:
    """The dimension of a ``Shard`` placement, None for ``Replicate``; raises for others."""
    if placement.is_shard():
        return int(placement.dim)
    if placement.is_replicate():
        return None
    raise LayoutError(f"placement {placement}")


def _cell_values(fn: Any) -> list[Any]:
    out = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    return out


# transformers styles (by class name) whose hooks see whole tensors on both sides
_HF_WHOLE = frozenset(
    {
        "TensorParallelLayer",  # "replicate": every rank keeps the whole parameter
        "EmbeddingParallel",  # the ranks' lookups are reduced or gathered inside the style
        "AllReduceParallel",
        "LocalParamsParallel",  # local heads inside; the owner's output is reduced by its children
    }
)


def _hf_layout(module: torch.nn.Module, style: Any, mesh: Any, what: str) -> ModuleLayout:
    name = type(style).__name__
    desc = f"transformers {name}"
    if name in _HF_WHOLE:
        return ModuleLayout(desc)
    where = f"{what} (tensor-parallel style {desc})"
    axis = _mesh_axis(mesh, where)
    if name == "ColwiseParallel" and not style.input_layouts.is_replicate():
        # transformers' inference path uses such an input as if it were replicated, its
        # training path as the shard it is: the layout depends on the grad mode
        raise LayoutError(
            f"{where}: its input layout {style.input_layouts!r} is read as a shard with grad "
            "enabled and as the whole tensor without, so pyhook cannot tell what the whole "
            "tensor is; only Replicate inputs of column-parallel layers are gathered"
        )
    try:
        if name == "ColwiseParallel":
            d = _shard_dim(style.output_layouts) if style.use_local_output else None
            full = getattr(module, "out_features", None) if d in (-1,) else None
            return ModuleLayout(desc, output=None if d is None else _Sharded(d, full, axis, desc))
        if name == "RowwiseParallel":
            d_in = _shard_dim(style.input_layouts)
            full_in = getattr(module, "in_features", None) if d_in == -1 else None
            d_out = _shard_dim(style.output_layouts) if style.use_local_output else None
            return ModuleLayout(
                desc,
                output=None if d_out is None else _Sharded(d_out, None, axis, desc),
                input=None if d_in is None else _Sharded(d_in, full_in, axis, desc),
            )
        if name == "SequenceParallel":
            d = int(style.sequence_dim)
            out = _Sharded(d, None, axis, desc) if style.use_local_output else None
            return ModuleLayout(desc, output=out, input=_Sharded(d, None, axis, desc))
    except LayoutError as e:
        raise LayoutError(f"{where}: pyhook cannot gather the {e} exactly") from None
    raise _hf_unknown(where, name)


def _hf_installer(fwd: Any) -> str | None:
    """The transformers style whose ``install_forward`` made ``fwd`` (a module's forward), if
    one did: the class name its qualified name starts with."""
    qual = getattr(fwd, "__qualname__", "") or ""
    if ".install_forward.<locals>." in qual and (getattr(fwd, "__module__", "") or "").startswith(
        "transformers"
    ):
        return qual.split(".")[0]
    return None


def _hf_unknown(where: str, name: str) -> LayoutError:
    if name == "ReplicatedWithGradAllReduce":
        return LayoutError(
            f"{where}: the module's tensors are this rank's share of the heads (it sits between "
            "a column- and a row-parallel layer, e.g. a per-head q_norm) along a dimension the "
            "plan does not say, so pyhook cannot give the whole tensor there; trace the layer "
            "after it (e.g. the row-parallel o_proj's input) or the module that holds it"
        )
    return LayoutError(
        f"{where}: pyhook does not know how this style lays out the module's tensors, so it "
        "cannot give the whole tensor there (it never hands out a shard as if it were whole); "
        "trace the module that holds it (its output is whole) or a module with a known style"
    )


# torch.distributed.tensor.parallel styles whose layouts pyhook reads off their hooks
_TORCH_STYLES = ("ColwiseParallel", "RowwiseParallel", "SequenceParallel")


def _torch_style_hooks(module: torch.nn.Module) -> list[tuple[str, str, Any, Any]]:
    """``(kind, style, fn, mesh)`` for each hook a torch parallel style registered on ``module``
    (kind "input"/"output"; ``fn`` the partial of the style's ``_prepare_*_fn``, or the style's
    bound method), read off the hook's closure."""
    from torch.distributed.tensor.parallel import ParallelStyle

    found = []
    for kind, hooks in (("input", module._forward_pre_hooks), ("output", module._forward_hooks)):
        for hook in hooks.values():
            cells = _cell_values(hook)
            meshes = [c for c in cells if type(c).__name__ == "DeviceMesh"]
            before = len(found)
            for c in cells:
                target = c.func if isinstance(c, functools.partial) else c
                owner = c if isinstance(c, ParallelStyle) else getattr(target, "__self__", None)
                if isinstance(owner, ParallelStyle):
                    found.append((kind, type(owner).__name__, c, meshes[0] if meshes else None))
                elif (getattr(target, "__module__", None) or "").startswith(
                    "torch.distributed.tensor.parallel"
                ) and "._prepare_" in getattr(target, "__qualname__", ""):
                    style = target.__qualname__.split(".")[0]
                    found.append((kind, style, c, meshes[0] if meshes else None))
            if len(found) == before and (meshes or _from_distribute_module(hook)):
                # distribute_module's hook around a function of the user's (input_fn,
                # output_fn): what it hands on is unknown, so it is refused by name
                user = next((c for c in cells if callable(c) and c not in meshes), hook)
                label = getattr(user, "__name__", None) or type(user).__name__
                fn_kind = "input_fn" if kind == "input" else "output_fn"
                mesh = meshes[0] if meshes else None
                found.append((kind, f"distribute_module({fn_kind}={label})", user, mesh))
    return found


def _from_distribute_module(hook: Any) -> bool:
    """Whether ``hook`` is one of the lambdas ``torch.distributed.tensor.distribute_module``
    registers for an ``input_fn``/``output_fn``."""
    code = getattr(hook, "__code__", None)
    path = (getattr(code, "co_filename", "") or "").replace(os.sep, "/")
    return path.endswith("torch/distributed/tensor/_api.py")


def _torch_layout(
    module: torch.nn.Module, found: list[tuple[str, str, Any, Any]], what: str
) -> ModuleLayout:
    out: _Sharded | None = None
    desc = f"torch {'+'.join(sorted({style for _, style, _, _ in found}))}"
    where = f"{what} (parallel style {desc})"
    for kind, style, fn, mesh in found:
        if style not in _TORCH_STYLES or not isinstance(fn, functools.partial) or mesh is None:
            raise LayoutError(
                f"{where}: pyhook does not know how {style} lays out the module's tensors, so it "
                "cannot give the whole tensor there (it never hands out a shard as if it were "
                "whole); trace the module that holds it or a module with a known style"
            )
        if kind != "output":
            continue  # inputs reach later hooks as DTensors, gathered whatever their placements
        if style == "SequenceParallel":
            (use_local,) = fn.args
            placements: tuple[Any, ...] = ()
        else:
            layouts, use_local = fn.args
            placements = tuple(layouts) if isinstance(layouts, (tuple, list)) else (layouts,)
        if not use_local:
            continue  # DTensor outputs
        try:
            d = 1 if style == "SequenceParallel" else _shard_dim(placements[0])
        except LayoutError as e:
            raise LayoutError(f"{where}: pyhook cannot gather the {e} exactly") from None
        if d is not None:
            full = getattr(module, "out_features", None) if d == -1 else None
            out = _Sharded(d, full, _mesh_axis(mesh, where), desc)
    return ModuleLayout(desc, output=out)


def module_layout(module: torch.nn.Module, what: str | None = None) -> ModuleLayout | None:
    """How ``module``'s output and first input are sharded across tensor-parallel ranks.

    None when its hooks see whole tensors without help (an unsharded module, FSDP2,
    accelerate's offloading; DTensors anywhere are gathered by :func:`layout_hook` at run
    time). Raises :class:`LayoutError`, naming the module (``what``) and its style, for a
    style pyhook does not know.

    Example::

        >>> import torch
        >>> from pyhook.distributed import module_layout
        >>> module_layout(torch.nn.Linear(2, 2)) is None
        True
    """
    what = what or type(module).__name__
    own = _own_layout(module, what)
    if own is None:
        _check_not_between_shards(module, what)
    return own


def tensor_parallel_ranks(model: torch.nn.Module) -> list[int] | None:
    """The global ranks of this rank's tensor-parallel group, read off the parallel styles of
    ``model``'s modules (transformers' ``tp_plan``, torch's ``parallelize_module``, whatever
    set them up), or None when no module is tensor-parallel (an unsharded model, FSDP2,
    accelerate's offloading, or no ``torch.distributed``).

    The ranks of a group hold the same rows (each runs the whole batch), so a capture stores
    them once: :mod:`pyhook.pipeline.ranks` asks this when the model does not record its
    ``tp_size``. A module whose distributed hooks pyhook does not know
    (``distribute_module`` with functions of the user's) says nothing of which ranks hold the
    same rows: :class:`LayoutError` names it and asks for ``tp_size=``, as do styles over
    several different groups.

    Example::

        >>> import torch
        >>> from pyhook.distributed import tensor_parallel_ranks
        >>> tensor_parallel_ranks(torch.nn.Linear(2, 2)) is None  # no process group
        True
    """
    axis = _tensor_parallel_axis(model)
    return None if axis is None else list(axis.ranks)


def _tensor_parallel_axis(
    model: torch.nn.Module, ask: str = "give the capture tp_size= (ranks per tensor-parallel group)"
) -> _Axis | None:
    """:func:`tensor_parallel_ranks`' group, with its process group (None: no TP module);
    ``ask`` ends the message of a :class:`LayoutError`: what the caller can do instead."""
    if not _layouts_active() or not isinstance(model, torch.nn.Module):
        return None
    groups: dict[tuple[int, ...], tuple[str, _Axis]] = {}
    for name, m in model.named_modules():
        meshes = []
        fwd = _own_forward(m)
        if fwd is not None and getattr(fwd, "__closure__", None):
            cells = _cell_values(fwd)
            if any(_is_hf_style(c) for c in cells):
                meshes += [c for c in cells if type(c).__name__ == "DeviceMesh"]
        if m._forward_hooks or m._forward_pre_hooks:
            for _kind, style, _fn, mesh in _torch_style_hooks(m):
                if style.startswith("distribute_module(") or mesh is None:
                    raise LayoutError(
                        f"{name!r} (parallel style torch {style}): pyhook cannot tell from its "
                        f"hooks which ranks hold the same rows; {ask}"
                    )
                meshes.append(mesh)
        for mesh in meshes:
            axis = _mesh_axis(mesh, f"{name!r}")
            groups.setdefault(tuple(axis.ranks), (name, axis))
    if not groups:
        return None
    if len(groups) > 1:
        seen = "; ".join(f"{n!r}: ranks {list(g)}" for g, (n, _a) in groups.items())
        raise LayoutError(
            f"the model's parallel styles use several tensor-parallel groups ({seen}); {ask}"
        )
    return next(iter(groups.values()))[1]


# module -> the module that holds it, for every model a tracer resolved names in while
# torch.distributed was initialised (see note_model): what _check_not_between_shards reads.
_PARENTS: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = weakref.WeakKeyDictionary()
_NOTED: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()  # children


def note_model(model: torch.nn.Module, *, again: bool = False) -> None:
    """Remember which module holds which in ``model`` (where ``torch.distributed`` is
    initialised; once per model, and ``again`` after a change such as ``replace_module``'s),
    so that a module without a parallel style of its own that sits between a column- and a
    row-parallel layer is refused by name instead of handing out its shard
    (:func:`module_layout`). :class:`pyhook._hooks.HookSet`, through which every tracer
    registers, calls it with the tracer's model when it wraps a hook for the layout layer (so
    it costs nothing without a process group); ``replace_module`` calls it ``again``.

    Example::

        >>> import torch
        >>> from pyhook.distributed import note_model
        >>> note_model(torch.nn.Sequential(torch.nn.Linear(2, 2)))  # no-op without a process group
    """
    if not _layouts_active() or not isinstance(model, torch.nn.Module):
        return
    if not again and _NOTED.get(model) == len(model._modules):  # seen already
        return
    for parent in model.modules():
        for child in parent._modules.values():
            if child is not None:
                _PARENTS[child] = parent
    _NOTED[model] = len(model._modules)


def _check_not_between_shards(module: torch.nn.Module, what: str) -> None:
    """A module with no parallel style of its own whose holder (or an outer holder) also holds
    a layer that shards its output (column-parallel) and one that takes a sharded input
    (row-parallel): it runs on this rank's slice between the two (an activation between the
    projections of an MLP), which nothing on the module itself tells apart from the whole."""
    inner = module
    while (holder := _PARENTS.get(inner)) is not None:
        splits = joins = None
        for name, child in holder._modules.items():
            if child is None or child is inner:
                continue
            try:
                lay = _own_layout(child, name)
            except LayoutError:
                continue
            if lay is None:
                continue
            if lay.output is not None and splits is None:
                splits = name
            if (lay.input is not None or _torch_split_input(child)) and joins is None:
                joins = name
        if splits is not None and joins is not None:
            raise LayoutError(
                f"{what}: has no tensor-parallel style of its own, but sits in "
                f"{type(holder).__name__} between {splits!r}, whose output is split across the "
                f"ranks, and {joins!r}, which takes a split input: its tensors are this rank's "
                f"slice, and nothing says how to gather them. Trace {splits!r} (its output) or "
                f"{joins!r} (its input; a standard point such as mlp_hidden.L does), which "
                "pyhook gathers whole"
            )
        inner = holder


def _torch_split_input(module: torch.nn.Module) -> bool:
    """Whether a torch parallel style on ``module`` takes its input as this rank's shard
    (``input_layouts`` a ``Shard``: RowwiseParallel's default, sequence parallelism's)."""
    for kind, _style, fn, _mesh in _torch_style_hooks(module):
        if kind != "input" or not isinstance(fn, functools.partial) or not fn.args:
            continue
        layouts = fn.args[0]
        for p in layouts if isinstance(layouts, (tuple, list)) else (layouts,):
            if getattr(p, "is_shard", None) is not None and p.is_shard():
                return True
    return False


def _own_layout(module: torch.nn.Module, what: str) -> ModuleLayout | None:
    """module_layout from what the module itself holds (its forward, its hooks)."""
    fwd = _own_forward(module)
    if fwd is not None and getattr(fwd, "__closure__", None):
        cells = _cell_values(fwd)
        styles = [c for c in cells if _is_hf_style(c)]
        if styles:
            meshes = [c for c in cells if type(c).__name__ == "DeviceMesh"]
            if not meshes:
                raise LayoutError(f"{what}: transformers {type(styles[0]).__name__} without a mesh")
            return _hf_layout(module, styles[0], meshes[0], what)
        installer = _hf_installer(fwd)
        if installer is not None:  # a style whose forward does not hold the style itself
            raise _hf_unknown(f"{what} (tensor-parallel style transformers {installer})", installer)
    if module._forward_hooks or module._forward_pre_hooks:
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for hook in hooks.values():
                installer = _hf_installer(hook)  # a transformers style's hook (a per-head norm's)
                if installer is not None and installer not in _HF_WHOLE:
                    where = f"{what} (tensor-parallel style transformers {installer})"
                    raise _hf_unknown(where, installer)
        found = _torch_style_hooks(module)
        if found:
            return _torch_layout(module, found, what)
    return None


def _own_forward(module: torch.nn.Module) -> Any:
    """The forward patched into ``module``'s ``__dict__`` (a style's closure), seen through the
    ``functools.partial`` a compiled model's dispatcher wraps it in (pyhook._compiled)."""
    fwd = module.__dict__.get("forward")
    return fwd.func if type(fwd) is functools.partial else fwd


def _is_hf_style(obj: Any) -> bool:
    for cls in type(obj).__mro__:
        if cls.__name__ == "TensorParallelLayer" and cls.__module__.startswith("transformers"):
            return True
    return False


def _chunk_sizes(full: int, n: int) -> list[int]:
    """The sizes torch.chunk (and DTensor's Shard) gives ``n`` ranks of a dimension ``full``."""
    q = -(-full // n)
    return [max(0, min(q, full - i * q)) for i in range(n)]


class _GatherWhole(torch.autograd.Function):
    """All-gather + concatenate, whose gradient is this rank's slice of the whole's gradient:
    the whole is replicated (every rank's hooks run the same code on it), so its gradient is
    the same on every rank (Megatron's gather_from_tensor_model_parallel_region)."""

    @staticmethod
    def forward(
        ctx: Any, t: torch.Tensor, dim: int, group: Any, rank: int, sizes: list[int]
    ) -> torch.Tensor:
        ctx.dim, ctx.rank, ctx.sizes = dim, rank, sizes
        return _gather_cat(t, dim, group, sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        mine = torch.split(grad, ctx.sizes, ctx.dim)[ctx.rank]
        return mine.contiguous(), None, None, None, None


class _ScatterWhole(torch.autograd.Function):
    """This rank's slice of a whole tensor, whose gradient is all-gathered: the adjoint of
    :class:`_GatherWhole`, so a whole tensor a hook keeps gets the whole gradient."""

    @staticmethod
    def forward(
        ctx: Any, whole: torch.Tensor, dim: int, group: Any, rank: int, sizes: list[int]
    ) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.sizes = dim, group, sizes
        return torch.split(whole, sizes, dim)[rank].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        src = _padded(grad, ctx.dim, max(ctx.sizes))
        parts = [torch.empty_like(src) for _ in ctx.sizes]
        dist.all_gather(parts, src, group=ctx.group)
        whole = torch.cat([p.narrow(ctx.dim, 0, n) for p, n in zip(parts, ctx.sizes)], ctx.dim)
        return whole, None, None, None, None


class _Waited(torch.autograd.Function):
    """An ``AsyncCollectiveTensor`` as the plain tensor it stands for (waited for), keeping
    the autograd link (native copies need a plain tensor's storage)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t.trigger_wait().view_as(t.elem)  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _is_async(x: Any) -> bool:
    return type(x).__name__ == "AsyncCollectiveTensor" and hasattr(x, "trigger_wait")


def _gather_sharded(t: torch.Tensor, side: _Sharded, what: str) -> tuple[torch.Tensor, Callable]:
    """The whole tensor from this rank's slice ``t``, and the function that re-shards an
    edited whole tensor (checked for shape) into this rank's slice."""
    axis = side.axis
    if _is_async(t):
        t = _Waited.apply(t)
    elif is_dtensor(t):  # a style configured to hand out DTensors after all
        whole, reshard_dt, first = _gather_dtensor(t, what)
        _note_gathered(first)
        return whole, reshard_dt
    d = _norm_dim(side.dim, t.dim())
    where = f"{what} ({side.style})"
    sizes = _chunk_sizes(side.full, axis.size) if side.full is not None else []
    if not sizes or t.shape[d] != sizes[axis.rank]:  # unknown, or not torch.chunk's split
        sizes = _exchange_sizes(t, d, axis, where, None)
    whole = _collective(
        lambda: _GatherWhole.apply(t, d, axis.group, axis.rank, sizes), where, axis, None
    )
    _note_gathered(axis.rank == 0)
    shape = whole.shape

    def reshard(new: Any) -> torch.Tensor:
        if not isinstance(new, torch.Tensor) or new.shape != shape:
            got = tuple(new.shape) if isinstance(new, torch.Tensor) else type(new).__name__
            raise ValueError(
                f"{where}: a hook must return the whole tensor, shape {tuple(shape)}, to be "
                f"re-sharded over the tensor-parallel ranks; got {got}"
            )
        return _ScatterWhole.apply(new, d, axis.group, axis.rank, sizes)

    return whole, reshard


def _whole_leaf(x: Any, what: str) -> tuple[Any, Callable | None]:
    """A run-time layout: a DTensor gathered, an AsyncCollectiveTensor waited for."""
    if is_dtensor(x):
        whole, reshard, first = _gather_dtensor(x, what)
        _note_gathered(first)
        return whole, reshard
    if _is_async(x):
        return _Waited.apply(x), None
    return x, None


def _whole_tree(value: Any, side: _Sharded | None, what: str) -> tuple[Any, Callable | None]:
    """``value`` (a tensor, or a structure whose first tensor ``side`` describes) with every
    sharded leaf made whole, and a function mapping an edited whole structure back to the local
    layout (None when nothing was changed: the edited value is used as it is)."""
    if type(value) is torch.Tensor and side is None:
        return value, None
    from . import _tree

    leaves, spec = _tree.flatten(value)
    firsts = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    if not firsts:
        return value, None
    whole_leaves = list(leaves)
    fix: dict[int, Callable | None] = {}
    for i in firsts:
        if side is not None and i == firsts[0]:
            whole_leaves[i], fix[i] = _gather_sharded(leaves[i], side, what)
        else:
            whole_leaves[i], fix[i] = _whole_leaf(leaves[i], what)
    changed = [i for i in firsts if whole_leaves[i] is not leaves[i]]
    if not changed:
        return value, None
    whole = _tree.unflatten(whole_leaves, spec)
    versions = {i: whole_leaves[i]._version for i in changed}

    def back(new: Any) -> Any:
        """The local layout of ``new`` (None: the hook returned nothing; in-place edits of the
        whole tensors are written back into the local ones)."""
        if new is None or new is whole:
            for i in changed:
                w = whole_leaves[i]
                if w._version != versions[i] and fix[i] is not None:
                    with torch.no_grad():
                        leaves[i].copy_(fix[i](w))
            return None
        if isinstance(value, torch.Tensor):
            f = fix[0]
            return f(new) if f is not None else new
        new_leaves, new_spec = _tree.flatten(new)
        if len(new_leaves) != len(leaves):
            raise ValueError(
                f"{what}: a hook on a sharded module must return the structure it was given "
                f"({len(leaves)} leaves), got {len(new_leaves)}"
            )
        out = []
        for i, x in enumerate(new_leaves):
            if i in fix and x is whole_leaves[i]:
                out.append(leaves[i])  # unchanged: the model goes on with its own local tensor
            elif i in fix and fix[i] is not None:
                out.append(fix[i](x))
            else:
                out.append(x)
        return _tree.unflatten(out, new_spec)

    return whole, back


def _input_key(kwargs: dict[str, Any]) -> str | None:
    """The keyword a module's input came in when it was called without positional arguments:
    ``hidden_states``, else the first keyword holding a tensor (pyhook.points uses it too)."""
    if "hidden_states" in kwargs:
        return "hidden_states"
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            return k
    return None


def _first_input(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> str | int | None:
    """Where a module's first input is: 0 (positional), a keyword, or None (no tensor)."""
    return 0 if args else _input_key(kwargs or {})


def _whole_grads(
    grads: Any, side: _Sharded | None, what: str
) -> tuple[Any, Callable[[Any], Any] | None]:
    """A backward hook's ``grad_output`` or ``grad_input`` (a tuple, one entry per output or
    positional input, None where no gradient flows) with every sharded gradient made whole:
    entry 0 is the gradient of the module's output or first input, sharded as ``side`` says
    (the tensor it is the gradient of is sharded so); DTensor gradients are gathered whatever
    their placements (a ``Partial`` one is summed). Returns it and the function mapping an
    edited whole tuple back to the local layout (None when nothing was gathered)."""
    if not isinstance(grads, tuple):
        return grads, None
    whole = list(grads)
    fix: dict[int, Callable | None] = {}
    for i, g in enumerate(grads):
        if not isinstance(g, torch.Tensor):
            continue
        if i == 0 and side is not None:
            whole[i], fix[i] = _gather_sharded(g, side, what)
        else:
            whole[i], fix[i] = _whole_leaf(g, what)
    changed = [i for i in fix if whole[i] is not grads[i]]
    if not changed:
        return grads, None  # replicated gradients: nothing sent
    whole_t = tuple(whole)
    versions = {i: whole[i]._version for i in changed}

    def back(new: Any) -> Any:
        """The local layout of the gradients ``new`` a hook returned (None: it returned nothing;
        whole gradients it edited in place go on as if returned, as they do unsharded)."""
        if new is None or new is whole_t:
            if all(whole[i]._version == versions[i] for i in changed):
                return None
            new = whole_t
        if isinstance(new, torch.Tensor) or len(new) != len(grads):
            got = "a tensor" if isinstance(new, torch.Tensor) else f"{len(new)} entries"
            raise ValueError(
                f"{what}: a backward hook on a sharded module must return a tuple of "
                f"{len(grads)} whole gradients (or None), got {got}"
            )
        out = []
        for i, x in enumerate(new):
            if i in fix and x is whole[i] and whole[i]._version == versions.get(i):
                out.append(grads[i])  # unchanged: the backward goes on with its own gradient
            elif x is not None and fix.get(i) is not None:
                if not isinstance(x, torch.Tensor) or x.shape != whole[i].shape:
                    got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                    raise ValueError(
                        f"{what}: a backward hook must return whole gradients, to be re-sharded "
                        f"over the tensor-parallel ranks: entry {i} should have shape "
                        f"{tuple(whole[i].shape)}, got {got}"
                    )
                out.append(fix[i](x))  # type: ignore[misc]
            else:
                out.append(x)
        return tuple(out)

    return whole_t, back


def layout_hook(
    module: torch.nn.Module,
    fn: Callable[..., Any],
    *,
    post: bool,
    with_kwargs: bool = False,
    inputs: bool = False,
    name: str | None = None,
    backward: bool = False,
    compiled: bool = False,
) -> Callable[..., Any]:
    """``fn`` as the forward hook (``post``) or pre-hook to register on ``module``, seeing and
    returning whole tensors whatever the model's layout; with ``backward=True``, as the full
    backward hook (``post``: ``fn(module, grad_input, grad_output)``) or full backward pre-hook
    (``fn(module, grad_output)``), seeing and returning whole gradients.

    Without ``torch.distributed`` initialised this is ``fn`` itself. Otherwise the wrapper
    hands ``fn`` the whole output (a forward hook; its inputs too when ``inputs``) or the
    whole first input (a pre-hook), gathered from the tensor-parallel ranks per
    :func:`module_layout` (DTensors with ``full_tensor()``, ``AsyncCollectiveTensor`` s waited
    for), and re-shards what ``fn`` returns, or edits in place, into this rank's layout: the
    model goes on exactly as if the whole tensor had been edited. Only modules that are hooked
    are gathered, and a replicated tensor is never sent. A layout it cannot gather exactly
    raises :class:`LayoutError` naming ``name`` (the layer), before anything is registered.

    A gradient is sharded as the tensor it is the gradient of: ``grad_output`` as the output,
    ``grad_input[0]`` as the first input (a column-parallel layer's ``grad_output``, a
    row-parallel layer's ``grad_input``). The gradient of a replicated tensor is whole on every
    rank (the known styles all-reduce it inside the module's backward: replicated inputs enter
    as ``Replicate`` DTensors, whose partial gradients are summed there), so it is passed as it
    is; DTensor gradients (torch's styles) are gathered, ``Partial`` ones summed. Gradients a
    backward hook returns, or edits in place, are re-sharded into this rank's layout.

    ``compiled=True``: the hook is an entry of a compiled model's dispatcher
    (:mod:`pyhook._compiled`). Where the module's tensors are sharded, the wrapper runs in
    eager Python (``torch._dynamo.disable``: one graph break there, exact collectives); where
    they are whole, ``fn`` itself is returned and compiled code inlines it as usual.

    Every pyhook tracer registers through :class:`pyhook._hooks.HookSet`, which calls this.

    Example::

        >>> import torch
        >>> from pyhook.distributed import layout_hook
        >>> lin = torch.nn.Linear(2, 2)
        >>> hook = lambda m, args, out: out * 0
        >>> layout_hook(lin, hook, post=True, with_kwargs=False) is hook  # no torch.distributed
        True
        >>> grad_hook = lambda m, grad_output: (grad_output[0] * 2,)
        >>> layout_hook(lin, grad_hook, post=False, backward=True) is grad_hook
        True
    """
    if not _layouts_active():
        return fn
    what = name if name is not None else type(module).__name__
    layout = module_layout(module, repr(what) if name is not None else what)
    out_side = layout.output if layout is not None else None
    in_side = layout.input if layout is not None else None
    label = f"layer {what!r}" if name is not None else what
    if compiled:
        sharded = (out_side or (in_side if inputs else None)) if post else in_side
        if sharded is None:
            return fn  # whole on both sides: compiled code inlines the hook itself
        wrapped = layout_hook(
            module, fn, post=post, with_kwargs=with_kwargs, inputs=inputs, name=name
        )
        import torch._dynamo

        return torch._dynamo.disable(wrapped, recursive=True)

    if backward:
        if post:

            def whole_backward(mod: Any, grad_input: Any, grad_output: Any) -> Any:
                _GATHERED.first = None
                try:
                    whole_in, back = _whole_grads(grad_input, in_side, label)
                    whole_out = _whole_grads(grad_output, out_side, label)[0]
                    res = fn(mod, whole_in, whole_out)
                finally:
                    _GATHERED.first = None
                return res if back is None else back(res)

            return whole_backward

        def whole_backward_pre(mod: Any, grad_output: Any) -> Any:
            _GATHERED.first = None
            try:
                whole_out, back = _whole_grads(grad_output, out_side, label)
                res = fn(mod, whole_out)
            finally:
                _GATHERED.first = None
            return res if back is None else back(res)

        return whole_backward_pre

    if post:

        def whole_post(mod: Any, args: Any, *rest: Any) -> Any:
            output = rest[-1]
            _GATHERED.first = None
            whole, back = _whole_tree(output, out_side, label)
            if inputs and args:
                args = _whole_tree(args, in_side, label)[0]
            try:
                res = fn(mod, args, *rest[:-1], whole)
            finally:
                _GATHERED.first = None
            if back is None:
                return res
            return back(res)

        if with_kwargs:

            def post4(mod: Any, args: Any, kwargs: Any, output: Any) -> Any:
                return whole_post(mod, args, kwargs, output)

            return post4

        def post3(mod: Any, args: Any, output: Any) -> Any:
            return whole_post(mod, args, output)

        return post3

    def whole_pre(mod: Any, args: Any, kwargs: Any) -> Any:
        where = _first_input(args, kwargs)
        if where is None:
            return fn(mod, args, kwargs) if with_kwargs else fn(mod, args)
        value = args[0] if where == 0 else kwargs[where]
        _GATHERED.first = None
        whole, back = _whole_tree(value, in_side, label)
        if back is None:
            _GATHERED.first = None
            return fn(mod, args, kwargs) if with_kwargs else fn(mod, args)
        if where == 0:
            args = (whole, *args[1:])
        else:
            kwargs = {**kwargs, where: whole}
        try:
            res = fn(mod, args, kwargs) if with_kwargs else fn(mod, args)
        finally:
            _GATHERED.first = None
        if res is None:
            back(None)  # in-place edits of the whole input go into the local one
            return None
        if with_kwargs:
            new_args, new_kwargs = res
        else:
            new_args, new_kwargs = (res if isinstance(res, tuple) else (res,)), kwargs
        new = new_args[0] if where == 0 else new_kwargs.get(where)
        local = value if new is whole else back(new)
        if where == 0:
            new_args = (local, *new_args[1:])
        else:
            new_kwargs = {**new_kwargs, where: local}
        return (new_args, new_kwargs) if with_kwargs else new_args

    if with_kwargs:
        return whole_pre

    def pre2(mod: Any, args: Any) -> Any:
        return whole_pre(mod, args, None)

    return pre2
