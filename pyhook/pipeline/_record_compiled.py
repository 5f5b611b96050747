"""The compiled capture path: hooks traced by dynamo, batches finished later in eager Python.

The hooks run inside code compiled by ``torch.compile``, so they only use what dynamo traces
without a graph break or a recompilation per batch: tensor ops, attributes set on this object,
a dict made in the same forward, and a new :class:`_Batch` linked in front of the previous one
(a list that grows would be guarded on its length). Everything data-dependent (masked rows,
host copies of device tensors, statistics, token annotations, counters) is finished by
:meth:`CompiledPath.drain`, in eager Python, when results are read or the block exits.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._compiled import call_outside
from .._hooks import HookSet, check_not_compiled
from ..offload import PendingCopy
from ..points import module_path
from ._record import (
    RecorderState,
    Reduction,
    batch_stats,
    check_mask_tensor,
    first_input,
    forward_grid,
    input_token_ids,
    layer_rows,
    positional_index,
    stats_later,
    token_layout,
)


class _Batch:
    """One forward's rows on a compiled model, linked to the batch before it (see drain)."""

    __slots__ = ("first", "ids", "mask", "prev", "rows")

    def __init__(
        self, prev: _Batch | None, rows: dict[str, Any], first: Any, mask: Any, ids: Any
    ) -> None:
        self.prev = prev
        self.rows = rows
        self.first = first
        self.mask = mask
        self.ids = ids


class _AfterCompiledCall:
    """``fn(module, None, None)`` after each call of a ``module.compile()``d module's compiled
    code, in eager Python, on the thread that made it (any thread for an ``any_thread`` hook
    set); ``remove()`` puts the call back.

    ``nn.Module.__call__`` runs ``module._compiled_call_impl`` (set by ``compile()``) outside
    any compiled code, so wrapping it there adds no graph break and no recompilation.
    """

    __slots__ = ("call", "compiled", "module")

    def __init__(
        self, module: nn.Module, fn: Callable[[nn.Module, Any, Any], None], any_thread: bool
    ) -> None:
        compiled = module.__dict__["_compiled_call_impl"]
        owner = threading.get_ident()

        def call(*args: Any, **kwargs: Any) -> Any:
            out = compiled(*args, **kwargs)
            if any_thread or threading.get_ident() == owner:  # as the hook set's other hooks
                fn(module, None, None)
            return out

        self.module, self.compiled, self.call = module, compiled, call
        module.__dict__["_compiled_call_impl"] = call

    def remove(self) -> None:
        md = self.module.__dict__
        if md.get("_compiled_call_impl") is self.call:  # unless compiled again meanwhile
            md["_compiled_call_impl"] = self.compiled


class CompiledPath:
    """Hooks and linked batches of a capture on a compiled model (made by the Recorder)."""

    def __init__(self, rec: RecorderState) -> None:
        self.rec = rec
        self.reduction: Reduction = rec._reduction
        self.head = _Batch(None, {}, None, None, None)
        self.batch: dict[str, Any] = {}
        self.first: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None
        self.ids: torch.Tensor | None = None
        self.mask_pos = positional_index(rec.model, rec.mask)
        # annotate()'s keep mask for the next forward, given to the graph when positions pick
        # tokens by it ("last", a list or slice): drain cannot pick them again from the rows
        self.keep: torch.Tensor | None = None
        self.drained = 0  # batches finished by drain (notes are matched to them by number)
        self.after_wrapper = False  # finish_forward, on the torch.compile wrapper, finishes

    def install(self, hooks: HookSet) -> None:
        rec = self.rec
        for name, module in rec._modules:  # (a standard point: the module it hooks)
            check_not_compiled(rec.model, module_path(name, module), who="capture")
        self.head = _Batch(None, {}, None, None, None)
        hooks.forward_pre(rec.model, self.begin, with_kwargs=True, prepend=True)
        for name, module in rec._modules:
            hooks.forward(
                module, self.make_hook(name, flat=getattr(module, "flat", False)), name=name
            )
        hooks.forward(rec.model, self.commit)
        # Batches that must be finished after each forward (disk, or rows on a GPU) are
        # finished by a hook on the torch.compile wrapper, which runs in eager Python once the
        # compiled forward returns (module.compile(): around the module's compiled call).
        # Without either (the eager module given while its wrapper runs) the traced commit
        # calls out of the graph instead: a graph break inside the hook dispatcher's loop,
        # which dynamo cannot resume, so the frames around it run eagerly (see docs/compile.md).
        if rec._wrapper is not None:
            hooks.forward(rec._wrapper, self.finish_forward, checked=True)
            self.after_wrapper = True
        elif rec.model.__dict__.get("_compiled_call_impl") is not None:  # module.compile()
            hooks._keep(_AfterCompiledCall(rec.model, self.finish_forward, hooks.any_thread))
            self.after_wrapper = True
        else:
            self.after_wrapper = False

    # -- traced ----------------------------------------------------------------------------
    def begin(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.batch = {}
        self.mask = None
        self.first = first_input(args, kwargs)
        self.ids = kwargs.get("input_ids")
        mask = self.rec.mask
        if mask is not None:
            if callable(mask):
                m = mask(args, kwargs)
            else:
                m = kwargs.get(mask)
                pos = self.mask_pos
                if m is None and pos is not None and len(args) > pos:
                    m = args[pos]
            if m is not None:
                self.mask = check_mask_tensor(mask, m)
        keep = self.keep
        if keep is not None:  # as the eager path: the kept tokens among the mask's
            self.keep = None
            self.mask = keep if self.mask is None else keep.to(self.mask.device) & self.mask

    def make_hook(self, name: str, *, flat: bool = False) -> Callable[..., None]:
        select = self.rec.select
        reduction = self.reduction

        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            raw = layer_rows(name, output, select)
            if flat:  # [batch*tokens, ...] as the model computes it: its tokens, told apart
                needed = (
                    self.mask is not None or reduction.positions is not None or self.ids is not None
                )
                raw = token_layout(name, raw, forward_grid(self.mask, self.ids, self.first), needed)
            t, mask = reduction.reduce_static(name, raw.detach(), self.mask)
            if t.dim() == 0:
                t = t.reshape(1)
            grid = tuple(raw.shape[:2]) if reduction.token_rows(raw.shape) else None
            # Always a copy: in a graph the compiler removes it when nothing else could change
            # the values (and copy=False's by-reference rows have no meaning there).
            self.batch[name] = (t.clone(), mask, grid)

        return hook

    def commit(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        batch = self.batch
        self.head = _Batch(self.head, batch, self.first, self.mask, self.ids)
        self.batch = {}
        if self.after_wrapper and torch.compiler.is_compiling():
            return  # finish_forward, in eager Python once the compiled forward returns
        if self.cannot_wait(batch):
            # The writer's hand-off is Python that cannot be traced, and rows on a GPU may sit
            # in a CUDA graph's memory pool that the next replay overwrites: one graph break,
            # at the end of the forward, finishes the batch at once (see docs/compile.md).
            call_outside(self.drain)

    def cannot_wait(self, rows: dict[str, Any]) -> bool:
        """Whether a batch's rows must be finished right after its forward (traced or eager):
        a disk capture's, or rows on a GPU."""
        return self.rec.to == "disk" or any(t.is_cuda for t, _, _ in rows.values())

    # -- eager -----------------------------------------------------------------------------
    def finish_forward(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        """The wrapper's forward hook (eager): finish, at once, a batch that cannot wait."""
        head = self.head
        if head.prev is not None and self.cannot_wait(head.rows):
            self.drain()

    def drain(self) -> None:
        """Finish the batches compiled code linked since the last drain (eager, in order)."""
        rec = self.rec
        node, batches = self.head, []
        while node.prev is not None:
            batches.append(node)
            node = node.prev
        self.head = node
        for b in reversed(batches):
            note = rec._take_note(self.drained)
            self.drained += 1
            mask = b.mask
            if note is not None and note.keep is not None:
                keep = note.keep
                mask = keep if mask is None else keep.to(mask.device) & mask
            examples = None
            if note is not None:
                examples = int(note.token_ids.shape[0])
            elif b.mask is not None:
                examples = int(b.mask.shape[0])
            elif b.first is not None and b.first.dim():
                examples = int(b.first.shape[0])
            elif rec.mask is not None and rec._mask_unlisted:
                rec._mask_unlisted = False
                warnings.warn(
                    f"mask {rec.mask!r} was not among the arguments of a call of "
                    f"{type(rec.model).__name__}; its tokens are not masked",
                    stacklevel=2,
                )
            rows_of: dict[str, torch.Tensor] = {}
            stats: dict[str, torch.Tensor] = {}
            later: dict[str, torch.Tensor] = {}
            grids: dict[str, Any] = {}
            for name, (t, row_mask, grid) in b.rows.items():
                if note is not None and note.keep is not None:
                    # the compiled graph knew no keep mask: rows are re-selected here
                    t, row_mask = self._rekeep(name, t, row_mask, grid, mask)
                if row_mask is not None:
                    t = t[row_mask.to(t.device)]
                if rec._stats and not t.is_complex():
                    if rec.to == "disk" and t.is_cpu:
                        later[name] = t  # computed by the writer thread, off the forward
                    else:
                        stats[name] = batch_stats(t)
                if rec._lease is not None:  # into reusable host buffers (HostBuffers)
                    p = rec._lease.put(name, t, snapshot=False)
                    t = p.wait()[0] if isinstance(p, PendingCopy) else p
                elif rec.to != "device" and not t.is_cpu:
                    t = t.to("cpu")
                elif t.is_cuda:
                    t = t.clone()  # out of a CUDA graph's pool, before the next replay
                if examples is None:
                    examples = int(t.shape[0])
                rows_of[name] = t
                grids[name] = grid
            ids = note.token_ids if note is not None else None
            if ids is None and rec._tokens:
                ids = b.ids if b.ids is not None else None
                if ids is None and b.first is not None:
                    ids = input_token_ids((b.first,), {})
            extra = rec._annotations(
                note,
                ids,
                mask,
                examples or 0,
                grids,
                {n: int(t.shape[0]) for n, t in rows_of.items()},
            )
            if stats:
                for name, s in rec._stats_to_host(stats, wait=True).items():
                    extra[f"__stats__.{name}"] = s
            fill = None
            if later:
                placeholders, fill = stats_later(later)
                for name, s in placeholders.items():
                    extra[f"__stats__.{name}"] = s
            rec._add(rows_of, examples or 0, extra, wait=fill)

    def _rekeep(
        self,
        name: str,
        t: torch.Tensor,
        row_mask: torch.Tensor | None,
        grid: Any,
        keep: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows of a token-shaped output under the annotated keep mask (not known to the graph).

        Only full-token layouts (flatten without positions) can be re-selected after the fact;
        other layouts keep what the graph computed (positions chose rows already, among the
        kept tokens where they depend on them: :attr:`keep`).
        """
        r = self.reduction
        if grid is None or r.positions is not None or not r.flatten:
            return t, row_mask
        if row_mask is None:  # the graph flattened all tokens: select the kept ones
            return t, keep.reshape(-1)
        return t, keep

    def finish(self) -> None:
        self.drain()
