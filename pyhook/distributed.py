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
* :class:`DistributedHookError` is raised, naming the module and the group, when a collective
  fails (typically because another rank failed or never reached the layer).

Nothing here is needed in a single process: with every parallel size 1 no group is created and
``torch.distributed`` need not be initialised.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DistributedHookError",
    "ParallelState",
    "gather_activation",
    "is_dtensor",
    "parallel_layout",
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


class _AllGatherCat(torch.autograd.Function):
    """All-gather + concatenate, differentiable: the gradient of this rank's slice is the sum
    over ranks of their gradients for it (an all-reduce, which every backend has)."""

    @staticmethod
    def forward(
        ctx: Any, t: torch.Tensor, dim: int, group: Any, rank: int, sizes: list[int]
    ) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.rank, ctx.sizes = dim, group, rank, sizes
        src = _padded(t, dim, max(sizes))
        parts = [torch.empty_like(src) for _ in sizes]
        dist.all_gather(parts, src, group=group)
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim)

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
