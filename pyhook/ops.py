"""Python-side registrations for the ``torch.ops.pyhook`` custom ops.

The schemas and device kernels live in ``csrc/``; this module adds what PyTorch needs to
trace them (fake/meta implementations for ``torch.compile`` and ``FakeTensorMode``) and to
differentiate them (autograd formulas). It is imported by :mod:`pyhook._backend` right after
the native module loads, and by PyTorch itself (``set_python_module``) when fake tracing
reaches an op first.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

__all__: list[str] = []


@torch.library.register_fake("pyhook::clone_many")
def _clone_many_fake(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    # Same metadata as clone(preserve_format); every output is a fresh allocation.
    return [torch.empty_like(t) for t in tensors]


def _clone_many_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    (tensors,) = inputs
    # An output that no loss used gives its input no gradient (None, as clone() does), not a
    # tensor of zeros: optimisers skip a parameter whose .grad is None.
    ctx.set_materialize_grads(False)
    # clone() gives requires_grad=False to copies of tensors that do not require
    # grad; a list-returning autograd.Function would mark every output otherwise.
    frozen = [o for t, o in zip(tensors, output) if not t.requires_grad]
    if frozen:
        ctx.mark_non_differentiable(*frozen)


def _clone_many_backward(ctx: Any, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    # d(clone)/dx is the identity; a missing grad stays missing.
    return list(grads)


torch.library.register_autograd(
    "pyhook::clone_many", _clone_many_backward, setup_context=_clone_many_setup_context
)


@torch.library.register_fake("pyhook::gather_rows")
def _gather_rows_fake(parts: Sequence[torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
    # One fresh contiguous tensor of len(idx) rows shaped like the parts' rows.
    first = parts[0]
    return first.new_empty((idx.shape[0], *first.shape[1:]))


@torch.library.register_fake("pyhook::gather_rows_into")
def _gather_rows_into_fake(
    parts: Sequence[torch.Tensor], idx: torch.Tensor, out: torch.Tensor
) -> None:
    return None


def _first_parts(parts: Sequence[torch.Tensor], counts: Sequence[int]) -> list[torch.Tensor]:
    """The first part of each layer, where layer ``l`` is the next ``counts[l]`` parts."""
    starts = itertools.accumulate(counts, initial=0)
    return [parts[s] for s, _ in zip(starts, counts)]


@torch.library.register_fake("pyhook::gather_rows_many")
def _gather_rows_many_fake(
    parts: Sequence[torch.Tensor], counts: Sequence[int], idx: torch.Tensor
) -> list[torch.Tensor]:
    # One fresh tensor per layer: the first part of each layer gives its row shape and dtype.
    return [p.new_empty((idx.shape[0], *p.shape[1:])) for p in _first_parts(parts, counts)]


@torch.library.register_fake("pyhook::gather_rows_many_into")
def _gather_rows_many_into_fake(
    parts: Sequence[torch.Tensor],
    counts: Sequence[int],
    idx: torch.Tensor,
    outs: Sequence[torch.Tensor],
) -> None:
    return None


@torch.library.register_fake("pyhook::dequant_rows")
def _dequant_rows_fake(
    parts: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    idx: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    first = parts[0]
    return first.new_empty((idx.shape[0], *first.shape[1:]), dtype=dtype)


@torch.library.register_fake("pyhook::dequant_rows_into")
def _dequant_rows_into_fake(
    parts: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    idx: torch.Tensor,
    out: torch.Tensor,
) -> None:
    return None


@torch.library.register_fake("pyhook::dequant_rows_many")
def _dequant_rows_many_fake(
    parts: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    counts: Sequence[int],
    idx: torch.Tensor,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    # One fresh tensor per layer: the first part of each layer gives its row shape.
    return [
        p.new_empty((idx.shape[0], *p.shape[1:]), dtype=dtype) for p in _first_parts(parts, counts)
    ]


@torch.library.register_fake("pyhook::dequant_rows_many_into")
def _dequant_rows_many_into_fake(
    parts: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    counts: Sequence[int],
    idx: torch.Tensor,
    outs: Sequence[torch.Tensor],
) -> None:
    return None
