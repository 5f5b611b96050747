"""Pure-PyTorch implementations of pyhook's native ops: the specification.

Every native op in ``csrc/`` must give results identical to the function of the same name
here (values, dtype, shape, strides, device, autograd), whichever backend is active.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "clone_tensors",
    "gather_rows",
    "gather_rows_into",
    "dequant_rows",
    "dequant_rows_into",
]


def clone_tensors(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Return ``[t.clone() for t in tensors]``.

    >>> a, b = torch.ones(2), torch.zeros(3, 4).t()
    >>> [c.stride() for c in clone_tensors([a, b])]
    [(1,), (1, 4)]
    """
    return [t.clone() for t in tensors]


# Unsigned dtypes gathered as the signed dtype of their size (the same bits).
_SIGNED_OF = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def gather_rows(parts: Sequence[torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` of ``torch.cat(parts)``, without concatenating: a fresh contiguous tensor.

    ``idx`` is a 1-D int64 tensor with ``0 <= idx < total rows``; an index out of range
    raises :class:`IndexError` naming it and its position (the native kernel's message).

    >>> parts = [torch.arange(6.0).reshape(3, 2), torch.arange(6.0, 10.0).reshape(2, 2)]
    >>> gather_rows(parts, torch.tensor([4, 0, 3])).tolist()
    [[8.0, 9.0], [0.0, 1.0], [6.0, 7.0]]
    """
    first = parts[0]
    if first.dtype in _SIGNED_OF:  # index_select has no kernel for 1-D unsigned parts
        signed = _SIGNED_OF[first.dtype]
        return gather_rows([p.view(signed) for p in parts], idx).view(first.dtype)
    row_shape = tuple(first.shape[1:])
    starts = [0]
    for p in parts:
        starts.append(starts[-1] + int(p.shape[0]))
    total = starts[-1]
    bad = ((idx < 0) | (idx >= total)).nonzero()
    if bad.numel():
        k = int(bad[0, 0])
        raise IndexError(
            f"gather_rows: index {int(idx[k])} (at position {k} of idx) is out of range for "
            f"{total} rows; valid indices are 0..{total - 1}"
        )
    if not idx.numel():
        return torch.empty((0, *row_shape), dtype=first.dtype)
    # index_select only, never ``out=`` (no autograd through it) nor ``out[sel] = ...``
    # (index_put has no uint16/uint32/uint64 kernel): each part's rows, then back in idx order.
    if len(parts) == 1:
        return first.index_select(0, idx)
    part_of = torch.bucketize(idx.contiguous(), torch.tensor(starts[1:]), right=True)
    order, pieces = [], []
    for i in part_of.unique().tolist():
        sel = (part_of == i).nonzero().squeeze(1)
        order.append(sel)
        pieces.append(parts[i].index_select(0, idx[sel] - starts[i]))
    perm = torch.cat(order)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel())
    return torch.cat(pieces).index_select(0, inverse)


def gather_rows_into(parts: Sequence[torch.Tensor], idx: torch.Tensor, out: torch.Tensor) -> None:
    """:func:`gather_rows` written into ``out`` (contiguous, of the result's shape and dtype).

    >>> out = torch.empty(2, 2)
    >>> gather_rows_into([torch.eye(2)], torch.tensor([1, 0]), out); out.tolist()
    [[0.0, 1.0], [1.0, 0.0]]
    """
    out.copy_(gather_rows(parts, idx))


def dequant_rows(
    parts: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    idx: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Rows ``idx`` of quantised parts (float8_e4m3fn or int8, one float32 scale per row in
    ``scales``), dequantised: ``dtype(float32(row) * scale)``, computed in float32 and rounded
    once to ``dtype`` (the rows of a compact store, see :mod:`pyhook.pipeline.encoding`).

    >>> q = [torch.tensor([[2, -4], [1, 0]], dtype=torch.int8)]
    >>> dequant_rows(q, [torch.tensor([0.5, 2.0])], torch.tensor([1, 0]), torch.float32).tolist()
    [[2.0, 0.0], [1.0, -2.0]]
    """
    # Gathered as bytes (index_select has no float8 kernel), then widened: exact.
    try:
        raw = gather_rows([p.view(torch.uint8) for p in parts], idx).view(parts[0].dtype)
    except IndexError as e:  # named as the native kernel names it
        raise IndexError(str(e).replace("gather_rows:", "dequant_rows:", 1)) from None
    scale = gather_rows([s.reshape(-1, 1) for s in scales], idx)
    scale = scale.reshape(-1, *([1] * (raw.dim() - 1)))
    return (raw.to(torch.float32) * scale).to(dtype)


def dequant_rows_into(
    parts: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    idx: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """:func:`dequant_rows` written into ``out`` (contiguous, the result's shape; its dtype
    is the one dequantised into).

    >>> out = torch.empty(1, 2)
    >>> q = [torch.tensor([[3, 1]], dtype=torch.int8)]
    >>> dequant_rows_into(q, [torch.tensor([0.25])], torch.tensor([0]), out); out.tolist()
    [[0.75, 0.25]]
    """
    out.copy_(dequant_rows(parts, scales, idx, out.dtype))
