"""The eager capture path: hooks in Python, each layer's rows leave as soon as they exist.

One batch = one call of the model: a pre-hook on the model starts it (mask, token ids), each
layer hook reduces its output and starts the copy of the rows (to the host, pooled for the disk
writer), and a hook after the model hands the batch to the :class:`~pyhook.capture.Recorder`.
A forward that raises hands over nothing. Used by :class:`~pyhook.capture.Recorder` for models
without compiled parts (see :mod:`pyhook._record_compiled` for the others).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import _backend
from .._hooks import HookSet
from ..offload import PendingCopy
from ._record import (
    RecorderState,
    Reduction,
    _Note,
    batch_stats,
    check_guard,
    check_mask_tensor,
    first_input,
    forward_grid,
    input_token_ids,
    layer_rows,
    stats_later,
    token_layout,
)

# A layer's statistics left to the writer thread (see make_hook).
LATER: Any = object()


class EagerPath:
    """Hooks and per-forward state of an eager capture (made and driven by the Recorder)."""

    def __init__(self, rec: RecorderState) -> None:
        self.rec = rec
        self.reduction: Reduction = rec._reduction
        self.pending: dict[str, Any] = {}  # layer -> rows being copied (never rebound)
        # copy=False: (tensor, version) of each kept reference, checked at commit and on read
        self.pending_guard: dict[str, tuple[torch.Tensor, int]] = {}
        self.pending_stats: dict[str, torch.Tensor] = {}
        self.grid: dict[str, tuple[int, ...] | None] = {}  # layer -> [batch, tokens] of its output
        self.mask: torch.Tensor | None = None
        self.examples: int | None = None
        self.note: _Note | None = None
        self.token_ids: torch.Tensor | None = None
        self.track = False  # this batch's rows get token annotations (token ids or a note)
        self.in_forward = False  # a forward began and has not committed (yet, or it raised)
        self.first: torch.Tensor | None = None  # the forward's first tensor input
        self._sig: inspect.Signature | None = None

    def install(self, hooks: HookSet) -> None:
        rec = self.rec
        hooks.forward_pre(rec.model, self.begin, with_kwargs=True, prepend=True)
        for name, module in rec._modules:
            hooks.forward(
                module, self.make_hook(name, flat=getattr(module, "flat", False)), name=name
            )
        grads = getattr(rec, "_grads", None)
        if grads is not None:  # gradient layers: the backward runs after the forward, before commit
            grads.install(hooks, self, {n: getattr(m, "flat", False) for n, m in rec._modules})
        hooks.forward(rec.model, self.commit)

    # -- one forward -----------------------------------------------------------------------
    def discard_pending(self) -> None:
        rec = self.rec
        for p in self.pending.values():
            if isinstance(p, PendingCopy) and rec.to == "disk":
                rec._offloader.release(p.wait())
        # Cleared in place: the layer hooks hold these dicts.
        self.pending.clear()
        self.pending_guard.clear()
        self.pending_stats.clear()
        self.grid.clear()

    def begin(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        rec = self.rec
        self.discard_pending()  # leftovers of a forward that raised
        if self.in_forward:  # the previous forward raised, and the caller went on
            rec._skip(self.examples or 0)
        self.mask = None
        self.note = note = rec._take_note()
        # Examples come from the inputs: the first captured layer may broadcast over the batch
        # (a position embedding's [1, tokens, hidden]); a layer's dim 0 is the fallback.
        self.first = first = first_input(args, kwargs)
        self.examples = int(first.shape[0]) if first is not None and first.dim() else None
        self.token_ids = note.token_ids if note is not None else None
        if self.token_ids is None and rec._tokens:
            self.token_ids = input_token_ids(args, kwargs)
        self.track = note is not None or self.token_ids is not None
        self.in_forward = True
        m = self._call_mask(args, kwargs) if rec.mask is not None else None
        if m is not None:
            self.mask = check_mask_tensor(rec.mask, m)
            self.examples = int(m.shape[0])
        if note is not None:
            self.examples = int(note.token_ids.shape[0])
            if note.keep is not None:
                keep = note.keep
                if self.mask is not None:
                    keep = keep.to(self.mask.device) & self.mask
                self.mask = keep

    def _call_mask(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        rec = self.rec
        if callable(rec.mask):
            return rec.mask(args, kwargs)
        m = kwargs.get(rec.mask)
        if m is None and args:
            if self._sig is None:
                self._sig = inspect.signature(rec.model.forward)
            try:
                m = self._sig.bind_partial(*args, **kwargs).arguments.get(rec.mask)
            except TypeError:
                m = None
        if m is None and rec._mask_unlisted:
            rec._mask_unlisted = False  # warn once: maybe a misspelling
            warnings.warn(
                f"mask {rec.mask!r} was not among the arguments of this call of "
                f"{type(rec.model).__name__} ({', '.join(kwargs) or 'positional only'}); "
                "its tokens are not masked",
                stacklevel=3,
            )
        return m

    def make_hook(self, name: str, *, flat: bool = False) -> Callable[..., None]:
        # Everything that does not change between calls is read once here: the hook runs once
        # per layer per forward, and at a few microseconds of Python it is most of the cost of
        # capturing a small activation.
        rec = self.rec
        select = rec.select
        reduction = self.reduction
        reduces = not (reduction.identity and rec.mask is None)
        by_reference = not rec.copy
        to = rec.to
        stats = rec._stats
        pending = self.pending  # never rebound: cleared in place
        pending_guard = self.pending_guard
        pending_stats = self.pending_stats
        grid = self.grid
        clone_one = _backend.clone_one
        kept_min = _backend.KEPT_MIN_BYTES
        native_stats = _backend.get_backend() == "native"
        lease = rec._lease if to == "host" else None
        # A tensor-parallel rank that is not its group's writer: its group's writer stores the
        # same (whole) rows, so they are not copied or summarised here; the gathers that made
        # them whole still ran on every rank (they are collective).
        discard = to == "disk" and not rec.layout.writer

        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            raw = layer_rows(name, output, select)
            if flat:  # [batch*tokens, ...] as the model computes it: its tokens, told apart
                raw = token_layout(
                    name,
                    raw,
                    forward_grid(self.mask, self.token_ids, self.first),
                    self.mask is not None or reduction.positions is not None or self.track,
                )
            if self.examples is None:
                self.examples = int(raw.shape[0]) if raw.dim() else 1
            if reduces or self.note is not None:
                # reduce starts from a detached tensor, so nothing in it is recorded by autograd.
                t = reduction.reduce(name, raw, self.mask)
                # Copy only when t may alias memory the model owns (an un-reduced output or a
                # view), unless copy=False: then keep the reference, check its version later.
                needs_copy = t.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
            else:
                t = raw.detach()
                needs_copy = True
            if t.dim() == 0:
                t = t.reshape(1)  # a scalar output (a loss, a score): one row per forward
            if self.track:
                grid[name] = tuple(raw.shape[:2]) if reduction.token_rows(raw.shape) else None
            if by_reference:
                if needs_copy and not t.is_inference():
                    needs_copy = False
                    pending_guard[name] = (t, t._version)
                else:
                    pending_guard.pop(name, None)
            if discard:
                # shape and dtype only: no reference to the model's tensor, no copy
                shape = torch.empty(t.shape, dtype=t.dtype, device="meta")
                pending[name] = PendingCopy([shape], None, None, t.nbytes)
                return
            if to == "disk":
                old = pending.pop(name, None)
                if old is not None:  # the layer ran twice in this forward: the last call is kept
                    rec._offloader.release(old.wait())
                pending[name] = rec._offloader.submit([t], copy=needs_copy, pooled=True)
            elif lease is not None:
                # Into the capture's reusable host buffers (pyhook.HostBuffers): the rows of
                # every batch back to back, so that rec[layer] is a view, not a join.
                pending[name] = lease.put(name, t, snapshot=needs_copy)
            elif to == "device" or t.is_cpu:
                # Host memory already (or staying on the device): a synchronous copy, nothing
                # to overlap and no engine to go through.
                # Every batch's copy is kept, so malloc would hand out fresh (faulting)
                # pages: the native pool recycles mapped buffers from a smaller size on.
                pending[name] = clone_one(t, kept_min) if needs_copy else t
            else:
                pending[name] = rec._offloader.submit([t], copy=needs_copy, pooled=False)
            if stats and not t.is_complex():
                if to == "disk" and t.is_cpu and not native_stats:
                    # Without the native kernel the float64 pass (numpy) is slow enough to be
                    # left to the writer thread, which computes it from the copy.
                    pending_stats[name] = LATER
                else:
                    # Here, on the forward's thread and cores, right after the copy read the
                    # rows (still in cache): one blocked pass (pyhook._backend.row_stats),
                    # no work left for a thread that would compete with the forward's.
                    pending_stats[name] = batch_stats(t)

        return hook

    def commit(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        rec = self.rec
        self.in_forward = False
        self.first = None  # not kept past its forward
        guards = dict(self.pending_guard)
        self.pending_guard.clear()
        for name, guard in guards.items():
            check_guard(name, guard, "before the forward returned")
        pending = dict(self.pending)
        stats = dict(self.pending_stats)
        grids = dict(self.grid)
        self.pending.clear()
        self.pending_stats.clear()
        self.grid.clear()
        examples = self.examples or 0
        extra = (
            rec._annotations(
                self.note, self.token_ids, self.mask, examples, grids, _row_counts(pending)
            )
            if self.track
            else {}
        )
        if rec.to == "disk":
            batch = {name: p._host[0] for name, p in pending.items()}  # shapes only until waited
            waits: list[PendingCopy] = list(pending.values())
            fill: Callable[[], None] | None = None
            if stats:
                later_rows = {name: batch[name] for name, s in stats.items() if s is LATER}
                later: dict[str, torch.Tensor] = {}
                if later_rows:
                    later, fill = stats_later(later_rows)
                host_stats = rec._stats_to_host(
                    {name: s for name, s in stats.items() if s is not LATER}
                )
                waits += [p for p in host_stats.values() if isinstance(p, PendingCopy)]
                for name in stats:
                    s = later[name] if name in later else host_stats[name]
                    extra[f"__stats__.{name}"] = s._host[0] if isinstance(s, PendingCopy) else s

            def wait() -> None:
                for p in waits:
                    p.wait()
                if fill is not None:
                    fill()

            try:
                rec._add(batch, examples, extra, wait=wait)
            except BaseException:
                for p in pending.values():  # refused (e.g. a shape change): nothing is counted
                    rec._offloader.release(p.wait())
                raise
            return
        for name, s in stats.items():
            extra[f"__stats__.{name}"] = s
        rec._add(pending, examples, extra, guards=guards)

    def finish(self, exc_type: Any) -> None:
        """The ``with`` block ends: drop a batch left half-done by a forward that raised."""
        self.discard_pending()
        if self.in_forward:
            self.in_forward = False
            if exc_type is None:
                # The last forward raised and the loop went on: its examples were consumed.
                self.rec._skip(self.examples or 0)

    def retry(self) -> None:
        self.in_forward = False


def _row_counts(pending: dict[str, Any]) -> dict[str, int]:
    return {
        name: int(p.shapes[0][0] if isinstance(p, PendingCopy) else p.shape[0])
        for name, p in pending.items()
    }
