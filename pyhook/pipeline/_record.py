"""What the eager and the compiled capture paths share: the row reduction and its checks.

:mod:`pyhook.capture` is the face (:class:`~pyhook.capture.Recorder`); it hands the work to one
of two paths, :mod:`pyhook._record_eager` (hooks run in Python, rows leave at once) and
:mod:`pyhook._record_compiled` (hooks traced by dynamo, rows finished later in eager Python).
Both reduce a layer's output to rows with :class:`Reduction` (positions, mask, flatten, dtype),
check outputs with :func:`layer_rows`, and turn the batch's token ids into row annotations with
:func:`row_annotations` and rows into per-batch statistics with :func:`batch_stats`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, Union

import numpy as np
import torch
from torch import nn

from .. import _backend
from .._tree import tensor_leaves

Positions = Union[int, Literal["last"], slice, Sequence[int], None]  # noqa: UP007 (runtime alias on 3.10)
MaskSpec = Union[str, Callable[[tuple[Any, ...], dict[str, Any]], Any], None]  # noqa: UP007


class CaptureModifiedError(RuntimeError):
    """A tensor kept by reference (``copy=False``) was modified in place after it was captured.

    Example::

        >>> import torch
        >>> from pyhook.capture import capture, CaptureModifiedError
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(inplace=True))
        >>> with capture(net, "0", copy=False) as rec:
        ...     try:
        ...         _ = net(torch.randn(3, 2))  # ReLU(inplace=True) overwrites layer 0's output
        ...     except CaptureModifiedError as e:
        ...         print(e.layer)
        0
    """

    def __init__(self, layer: str, message: str) -> None:
        super().__init__(message)
        self.layer = layer


def check_guard(name: str, guard: tuple[torch.Tensor, int] | None, when: str) -> None:
    """Raise :class:`CaptureModifiedError` if a by-reference row changed since it was kept."""
    if guard is not None and guard[0]._version != guard[1]:
        raise CaptureModifiedError(
            name,
            f"layer {name!r}: its output was modified in place {when}, after it was captured "
            "with copy=False (kept by reference), so the captured values are gone; capture "
            "with copy=True (the default) for this model",
        )


# -- inputs of a call -------------------------------------------------------------------------
def batch_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """Examples in a call: dim 0 of its first tensor argument (None if it has none)."""
    t = first_input(args, kwargs)
    if t is None:
        return None
    return int(t.shape[0]) if t.dim() else None


def first_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v
    return None


def input_token_ids(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The call's token ids: an integer ``input_ids`` argument, else an integer ``[batch,
    tokens]`` first positional argument (None when the call has neither)."""
    t = kwargs.get("input_ids")
    if t is None and args:
        t = args[0]
    if (
        isinstance(t, torch.Tensor)
        and t.dim() == 2
        and not t.is_floating_point()
        and not t.is_complex()
        and t.dtype != torch.bool
    ):
        return t
    return None


def check_mask_name(model: nn.Module, mask: str) -> bool:
    """A misspelled mask name would silently keep every token: refuse names that the model's
    forward cannot take. True when only a ``**kwargs`` could take it (checked per call)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    if mask in params:
        return False
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return True
    names = [n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    raise ValueError(
        f"mask {mask!r} is not an argument of {type(model).__name__}.forward; its arguments "
        f"are: {', '.join(names) or '(none)'}"
    )


def positional_index(model: nn.Module, mask: Any) -> int | None:
    """Where a mask named ``mask`` sits among ``model.forward``'s positional parameters."""
    if not isinstance(mask, str):
        return None
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    for i, p in enumerate(params):
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return None
        if p.name == mask:
            return i
    return None


def check_mask_tensor(mask: Any, m: Any) -> torch.Tensor:
    if not isinstance(m, torch.Tensor) or m.dim() != 2:
        raise ValueError(
            f"mask {mask!r} must be a tensor [batch, tokens], got {getattr(m, 'shape', m)!r}"
        )
    return m.detach().bool()


def positions_repr(p: Positions) -> Any:
    if isinstance(p, slice):
        return {"slice": [p.start, p.stop, p.step]}
    if isinstance(p, (list, tuple)):
        return list(p)
    return p


# -- a layer's output -> rows -----------------------------------------------------------------
def first_tensor(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if type(output) is tuple and output and isinstance(output[0], torch.Tensor):
        return output[0]  # the usual (hidden_states, ...) block output: skip the tree walk
    leaves = tensor_leaves(output)
    if not leaves:
        raise TypeError(f"the layer output ({type(output).__name__}) holds no tensor")
    return leaves[0]


def layer_rows(name: str, output: Any, select: Callable[[Any], Any] | None) -> torch.Tensor:
    """The tensor capture stores for layer ``name`` (``select(output)``, or the output's first
    tensor), checked: a dense tensor with values. Shared by the eager and the compiled hooks."""
    if select is not None:
        raw = select(output)
        if not isinstance(raw, torch.Tensor):
            raise TypeError(
                f"layer {name!r}: select returned {type(raw).__name__}, expected a tensor"
            )
    else:
        if output is None:
            raise TypeError(
                f"layer {name!r} returned None, so there is nothing to capture; capture a "
                "layer that returns a tensor (or pass select=...)"
            )
        try:
            raw = first_tensor(output)
        except TypeError as e:
            raise TypeError(f"layer {name!r}: {e}; capture another layer or pass select=") from None
    if raw.is_nested:
        raise TypeError(
            f"layer {name!r}: its output is a nested (ragged) tensor; capture stores dense rows "
            "(pass select=lambda out: out.to_padded_tensor(0.0), or capture another layer)"
        )
    if raw.layout != torch.strided:
        raise TypeError(
            f"layer {name!r}: its output is a {raw.layout} tensor; capture stores dense "
            "rows (pass select=lambda out: out.to_dense(), or capture another layer)"
        )
    if raw.is_meta:
        raise TypeError(
            f"layer {name!r}: its output is on the meta device and holds no values; run the "
            "model on a real device (cpu, cuda) to capture it"
        )
    return raw


def forward_grid(
    mask: torch.Tensor | None, ids: torch.Tensor | None, first: torch.Tensor | None
) -> tuple[int, int] | None:
    """A forward's ``[batch, tokens]``: its mask's, its token ids', or its first input's when
    that is token ids or ``[batch, tokens, ...]`` embeddings; None when none of them says.
    (The grid :func:`token_layout` views a flat point in, on the eager and compiled paths.)"""
    for t in (mask, ids):
        if t is not None:
            return (int(t.shape[0]), int(t.shape[1]))
    if first is not None and (first.dim() >= 3 or input_token_ids((first,), {}) is not None):
        return (int(first.shape[0]), int(first.shape[1]))
    return None


def token_layout(
    name: str, raw: torch.Tensor, grid: tuple[int, int] | None, needed: bool
) -> torch.Tensor:
    """A point the model computes as ``[batch*tokens, ...]`` (:attr:`pyhook.points.Point.flat`,
    OPT's MLP) viewed as ``[batch, tokens, ...]``, the ``grid`` of this forward's input, so that
    masks, positions and token ids apply to its rows as to the other layers'. Left as it is when
    it is not flat; a ``ValueError`` naming the layer when the rows cannot be told apart and the
    capture ``needed`` them (a mask, positions or token annotations)."""
    if raw.dim() < 2 or grid is None or raw.shape[0] != grid[0] * grid[1]:
        if needed and raw.dim() < 3:
            raise ValueError(
                f"layer {name!r}: the model computes it as [batch*tokens, ...] "
                f"(shape {tuple(raw.shape)}), which does not match this forward's "
                f"[batch, tokens] {list(grid) if grid is not None else '(not known: no input_ids, mask or [batch, tokens, ...] input)'}"
            )
        return raw
    return raw.unflatten(0, grid)


class Reduction:
    """Positions, token mask, flatten and dtype: how a ``[batch, tokens, ...]`` output becomes
    rows. The same object reduces layer outputs and the batch's token annotations, so they stay
    aligned row for row."""

    def __init__(self, positions: Positions, flatten: bool, dtype: torch.dtype | None) -> None:
        self.positions = positions
        self.flatten = flatten
        self.dtype = dtype
        self.identity = positions is None and dtype is None and not flatten

    def select_positions(
        self, name: str, t: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows of ``positions`` (eager and compiled captures alike): ``t`` reduced to them
        and the mask of the tokens kept (None once positions picked one token per example)."""
        has_tokens = t.dim() >= 3
        if has_tokens and mask is not None and tuple(t.shape[:2]) != tuple(mask.shape):
            raise ValueError(
                f"layer {name!r}: output shape {tuple(t.shape)} does not start with the mask's "
                f"[batch, tokens] {tuple(mask.shape)}"
            )
        if mask is not None and mask.device != t.device:
            mask = mask.to(t.device, non_blocking=True)
        p = self.positions
        if has_tokens and p is not None:
            if p == "last":
                if mask is not None:
                    # Last valid token, for left or right padding alike.
                    steps = torch.arange(1, mask.shape[1] + 1, device=t.device)
                    idx = (mask * steps).argmax(dim=1)
                    t = t[torch.arange(t.shape[0], device=t.device), idx]
                else:
                    t = t[:, -1]
                mask = None
            elif isinstance(p, int):
                self._check_positions(name, t, [p])
                t = t[:, p]
                mask = None
            else:
                if not isinstance(p, slice):
                    self._check_positions(name, t, p)
                sel = p if isinstance(p, slice) else torch.tensor(list(p), device=t.device)
                t = t[:, sel]
                if mask is not None:
                    mask = mask[:, sel]
        return t, mask

    def _check_positions(self, name: str, t: torch.Tensor, positions: Sequence[int]) -> None:
        tokens = int(t.shape[1])
        bad = [q for q in positions if not -tokens <= q < tokens]
        if bad:
            raise ValueError(
                f"layer {name!r}: positions={self.positions!r} reaches token {bad[0]}, but this "
                f"batch has {tokens} tokens (output shape {tuple(t.shape)})"
            )

    def keeps_tokens(self, t: torch.Tensor) -> bool:
        """Whether ``t`` still has its tokens dimension after :meth:`select_positions` (not when
        positions picked one token per example): then flatten makes its tokens the rows."""
        p = self.positions
        return t.dim() >= 3 and not (isinstance(p, int) or (isinstance(p, str) and p == "last"))

    def reduce(self, name: str, t: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Eager reduction: positions, then the masked (or all) tokens as rows, then the cast."""
        tokens = self.keeps_tokens(t)
        t, mask = self.select_positions(name, t.detach(), mask)
        if tokens and self.flatten:
            t = t[mask] if mask is not None else t.reshape(-1, *t.shape[2:])
        if self.dtype is not None and t.dtype != self.dtype:
            t = t.to(self.dtype)
        return t

    def reduce_static(
        self, name: str, t: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`reduce` without the data-dependent step (for compiled graphs): rows selected
        by a mask are left to the caller (the returned mask), so shapes stay static."""
        tokens = self.keeps_tokens(t)
        t, mask = self.select_positions(name, t, mask)
        if tokens and self.flatten:
            if mask is None:
                t = t.reshape(-1, *t.shape[2:])
        else:
            mask = None
        if self.dtype is not None and t.dtype != self.dtype:
            t = t.to(self.dtype)
        return t, mask

    def token_rows(self, shape: Sequence[int]) -> bool:
        """True when a layer output of ``shape`` gives one row per selected token (or per
        example at its selected position), i.e. rows that token annotations describe."""
        return len(shape) >= 3 and (self.flatten or self.positions is not None)


def row_annotations(
    reduction: Reduction,
    token_ids: torch.Tensor | None,
    mask: torch.Tensor | None,
    examples: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(token ids [rows], row index [rows, 2])`` of the rows a token-shaped layer output of
    this batch gives, by the same reduction as the layer rows (on the host, int64).

    ``token_ids``/``mask`` are ``[batch, tokens]`` (token ids may be None: positions only);
    ``examples`` ``[batch]`` the example index of each batch row.
    """
    b, n = token_ids.shape if token_ids is not None else mask.shape  # type: ignore[union-attr]
    pos = torch.arange(n, dtype=torch.long).expand(b, n)
    ex = examples.to(torch.long).reshape(b, 1).expand(b, n)
    cols = [ex, pos]
    if token_ids is not None:
        cols.append(token_ids.detach().to("cpu", torch.long))
    grid = torch.stack(cols, dim=-1)  # [batch, tokens, 2 or 3]: reduced like a layer output
    rows = Reduction(reduction.positions, reduction.flatten, None).reduce(
        "(token annotations)", grid, None if mask is None else mask.to("cpu")
    )
    rows = rows.reshape(-1, grid.shape[-1])
    ids = rows[:, 2].contiguous() if token_ids is not None else None
    return ids, rows[:, :2].contiguous()


# -- statistics -------------------------------------------------------------------------------
def batch_stats(t: torch.Tensor) -> torch.Tensor:
    """One batch's statistics row, float64 ``[1, 2 + 2*D]`` on ``t``'s device:
    ``[count, sum of row L2 norms, mean (D), M2 (D)]`` (M2: the sum of squared deviations from
    this batch's mean), for rows ``t`` ``[rows, ...]`` (D = numel of one row).

    Example::

        >>> import torch
        >>> from pyhook._record import batch_stats
        >>> batch_stats(torch.tensor([[3.0, 0.0], [0.0, 4.0]])).tolist()
        [[2.0, 7.0, 1.5, 2.0, 4.5, 8.0]]
    """
    n = int(t.shape[0])
    x = t.detach().reshape(n, math.prod(t.shape[1:]))
    if n == 0:
        return torch.zeros(1, 2 + 2 * x.shape[1], dtype=torch.float64, device=t.device)
    if x.is_cpu and not x.is_complex():
        native = _backend.row_stats(x)
        if native is not None:  # one cached pass per block, on the calling thread's cores
            return native
        out = torch.empty(1, 2 + 2 * x.shape[1], dtype=torch.float64)
        _host_stats(x, out.numpy()[0])
        return out
    # Two passes over one float64 copy: the column sums, then the squared deviations from their
    # mean, in place. As exact as var_mean (more, for a large mean), and ~6x faster than it.
    x = x.to(torch.float64, copy=True)
    norms = torch.linalg.vector_norm(x, dim=1).sum()
    mean = x.sum(0).div_(n)
    m2 = x.sub_(mean).square_().sum(0)
    head = torch.stack([norms.new_full((), float(n)), norms])
    return torch.cat([head, mean, m2]).unsqueeze(0)


# Float64 elements per block of rows in _host_stats: 512 KiB, so a block stays in cache.
_STATS_BLOCK = 1 << 16


def _host_stats(x: torch.Tensor, out: np.ndarray) -> None:
    """:func:`batch_stats` of host rows ``x`` ``[n, D]`` (n > 0) into ``out`` ``[2 + 2*D]``.

    numpy, one block of rows at a time, blocks merged with Chan's formula (exact to float64
    rounding, like the two-pass reduction): the temporaries are one cached block, not a float64
    copy of the batch (host memory stays within the capture's budget), and numpy runs on the
    calling thread with the GIL released, never in torch's OpenMP pool, so the writer thread
    that runs it does not wake a second team of threads against the forward's.
    """
    n, d = x.shape
    convert = x.dtype not in _NUMPY_EXACT
    src = None if convert else x.contiguous().numpy()
    step = max(1, _STATS_BLOCK // max(d, 1))
    mean = out[2 : 2 + d]
    m2 = out[2 + d :]
    mean.fill(0.0)
    m2.fill(0.0)
    norms = 0.0
    done = 0
    block = np.empty((min(step, n), d), dtype=np.float64)
    col = np.empty(d, dtype=np.float64)
    for start in range(0, n, step):
        k = min(step, n - start)
        b = block[:k]
        if convert:  # bfloat16 and other dtypes numpy lacks: a small block, serial in torch
            b[...] = x[start : start + k].to(torch.float64).numpy()
        else:
            b[...] = src[start : start + k]  # type: ignore[index]
        norms += float(np.sqrt(np.einsum("ij,ij->i", b, b)).sum())
        np.add.reduce(b, axis=0, out=col)
        col /= k
        b -= col
        np.multiply(b, b, out=b)
        if done == 0:
            mean[...] = col
            np.add.reduce(b, axis=0, out=m2)
        else:
            total = done + k
            # An infinite mean stays infinite (inf - inf would make it NaN): the sum of the
            # two means has the mean's value where either is inf or NaN.
            odd = ~(np.isfinite(col) & np.isfinite(mean))
            summed = (mean + col)[odd] if odd.any() else None
            col -= mean  # the block's mean minus the running mean
            m2 += np.add.reduce(b, axis=0)
            m2 += col * col * (done * k / total)
            mean += col * (k / total)
            if summed is not None:
                mean[odd] = summed
        done += k
    out[0] = float(n)
    out[1] = norms


_NUMPY_EXACT = {
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
}


def stats_later(
    rows: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    """Statistics of host rows computed later, off the forward's path: empty float64 rows
    (``[1, 2 + 2*D]`` each, stored like :func:`batch_stats`'s) and the function that fills
    them, which a disk capture's writer thread calls once the rows are copied and before it
    writes the batch. The rows must not change in between (they are the capture's own copies).

    Example::

        >>> import torch
        >>> from pyhook._record import batch_stats, stats_later
        >>> x = torch.randn(5, 3)
        >>> out, fill = stats_later({"x": x})
        >>> fill()
        >>> torch.equal(out["x"], batch_stats(x))
        True
    """
    out = {
        name: torch.empty(1, 2 + 2 * math.prod(t.shape[1:]), dtype=torch.float64)
        for name, t in rows.items()
    }

    def fill() -> None:
        # Rows and placeholders made under inference_mode are inference tensors, which only
        # inference mode may update in place (this runs on another thread, outside it).
        with torch.inference_mode():
            for name, t in rows.items():
                out[name].copy_(batch_stats(t))

    return out, fill


class _Note:
    """What :meth:`Recorder.annotate` says about the next forward."""

    __slots__ = ("examples", "keep", "texts", "token_ids")

    def __init__(
        self,
        token_ids: torch.Tensor,
        keep: torch.Tensor | None,
        examples: torch.Tensor | None,
        texts: list[str] | None,
    ) -> None:
        self.token_ids = token_ids
        self.keep = keep
        self.examples = examples
        self.texts = texts


class RecorderState(Protocol):
    """What the eager and compiled paths (:mod:`._record_eager`, :mod:`._record_compiled`) use
    of the :class:`~pyhook.capture.Recorder` that made them. Written out here so that those
    modules need not import ``capture``, which imports them."""

    model: nn.Module
    to: str
    mask: Any
    copy: bool
    select: Any
    _modules: dict[str, nn.Module]
    _reduction: Reduction
    _stats: bool
    _tokens: bool
    _mask_unlisted: bool
    _lease: Any  # a HostBuffers lease (pyhook.offload._Lease) or None
    layout: Any  # this rank's place (pyhook.pipeline.ranks.RankLayout)

    @property
    def _offloader(self) -> Any: ...

    @property
    def _stats_to_host(self) -> bool: ...

    @property
    def _annotations(self) -> bool: ...

    def _take_note(self, number: int | None = None) -> _Note | None: ...

    def _skip(self, examples: int) -> None: ...

    def _add(
        self,
        rows: dict[str, Any],
        examples: int,
        extra: dict[str, torch.Tensor],
        *,
        wait: Callable[[], Any] | None = None,
        guards: dict[str, tuple[torch.Tensor, int]] | None = None,
    ) -> None: ...
