"""Edits made inside activation-checkpointed layers, until a backward has gone through them.

A tracer's edit also applies when autograd recomputes a checkpointed layer during a backward,
but only while the tracer's hook is registered: a backward after the hooks are gone recomputes
the layer without the edit (same loss, the parameter gradients of the unedited model). Every
editing tracer reports each run of its edit with :func:`note_edit`, and when its hooks go it
asks :func:`take_lost` for the edits no backward went through, then :func:`refuse_lost` raises
naming them. Both forms of ``torch.utils.checkpoint`` are recognised:

* non-reentrant (``use_reentrant=False``, transformers' default): the layer runs with autograd
  on, under the checkpoint's saved-tensor hooks (:func:`in_checkpoint`). The edit is pending
  until the gradient reaches the edited tensor (a tensor hook).
* reentrant (``use_reentrant=True``): the layer runs inside the forward of an autograd
  ``Function`` (torch's ``CheckpointFunction``), with autograd and forward-mode AD off. The
  edit is pending until that Function's backward recomputes the layer with the hook in place
  (the engine is then running the Function's node). A Function counts as a checkpoint when
  its class name contains ``checkpoint`` and it is part of a graph (one of its inputs requires
  grad): under ``torch.no_grad()`` or ``inference_mode()`` nothing is pending.

Forwards without an edit, or without checkpointing, pay nothing here beyond a few flag reads.
"""

from __future__ import annotations

import sys
import weakref
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.function import BackwardCFunction

if TYPE_CHECKING:
    from ._hooks import HookSet

__all__ = ["in_checkpoint", "note_edit", "refuse_lost", "take_lost"]

_ATTR = "_pyhook_checkpointed_edits"  # on the owner: its list of pending edits
_APPLY = torch.autograd.Function.apply.__func__.__code__  # type: ignore[attr-defined]
_PRUNE_AT = 256  # from this length on, settled edits are dropped at each power of two
# bound once: note_edit runs on every call of an editing hook
_graph_task = torch._C._current_graph_task_id
_grad_enabled = torch.is_grad_enabled
_top_saved_hooks = torch._C._autograd._top_saved_tensors_default_hooks


class _Edit:
    """One edit in a checkpointed layer: pending until a backward has gone through it."""

    __slots__ = ("name", "nodes", "pending")

    def __init__(self, name: str | None, nodes: tuple[weakref.ref[Any], ...] | None) -> None:
        self.name = name
        self.nodes = nodes  # reentrant: the checkpoint nodes whose backward recomputes it
        self.pending = True


def in_checkpoint() -> bool:
    """Whether this forward runs inside ``torch.utils.checkpoint``'s non-reentrant checkpoint
    (transformers' ``gradient_checkpointing_enable()`` default): its saved-tensor hooks are the
    innermost ones, and its layers are recomputed during the backward.

    >>> in_checkpoint()
    False
    """
    top = _top_saved_hooks(False)
    return top is not None and "_checkpoint_hook" in getattr(top[0], "__qualname__", "")


def _reentrant_nodes() -> tuple[weakref.ref[Any], ...]:
    """The nodes of the reentrant checkpoints this forward runs in that are part of a graph
    (innermost first; empty outside any). A custom Function's forward is called by
    ``Function.apply`` (whose frame holds the class as ``cls``), its node being the forward's
    first argument."""
    found = []
    frame: FrameType | None = sys._getframe(1)
    callee: FrameType | None = None
    while frame is not None:
        if frame.f_code is _APPLY and callee is not None:
            cls = frame.f_locals.get("cls")
            code = callee.f_code
            if "checkpoint" in getattr(cls, "__name__", "").lower() and code.co_argcount:
                node = callee.f_locals.get(code.co_varnames[0])
                if isinstance(node, BackwardCFunction) and any(
                    fn is not None for fn, _ in node.next_functions
                ):
                    found.append(weakref.ref(node))
        frame, callee = frame.f_back, frame
    return tuple(found)


def _backward_reached(edit: _Edit, _grad: Any) -> None:
    edit.pending = False


def note_edit(
    owner: object,
    name: str | None,
    output: Any,
    hooks: HookSet,
) -> None:
    """Called by a tracer's hook each time its edit function ran on ``name``; ``output`` is
    the edited output (None: the edit function kept the output as it was). ``owner`` holds the
    pending edits until :func:`take_lost` (in its ``__dict__``); ``hooks`` is the tracer's
    :class:`~pyhook._hooks.HookSet`, which removes the gradient hook put here with the rest."""
    if _graph_task() != -1:
        # A forward during a backward: a checkpoint's recomputation, run with the hook (so
        # with the edit). For a reentrant checkpoint that settles the edit made in its forward.
        edits = owner.__dict__.get(_ATTR)
        if edits:
            node = torch._C._current_autograd_node()
            if node is not None:
                for e in edits:
                    if (
                        e.pending
                        and e.nodes is not None
                        and e.name == name
                        and any(r() is node for r in e.nodes)
                    ):
                        e.pending = False
                        break
        return
    if output is None:
        return
    if _grad_enabled():
        if not in_checkpoint():
            return
        nodes = None
    elif torch._C._is_fwd_grad_enabled() or torch.is_inference_mode_enabled():
        return  # torch.no_grad() or inference_mode(): no backward will come
    else:
        nodes = _reentrant_nodes()  # autograd off inside some custom Function's forward
        if not nodes:
            return
    edits = owner.__dict__.setdefault(_ATTR, [])
    if len(edits) >= _PRUNE_AT and not len(edits) & (len(edits) - 1):  # at powers of two
        edits[:] = [e for e in edits if e.pending]
    edit = _Edit(name, nodes)
    edits.append(edit)
    if nodes is None:
        first = output
        while isinstance(first, (tuple, list)) and first:
            first = first[0]
        if isinstance(first, torch.Tensor) and first.requires_grad:
            hooks.tensor(first, lambda grad: _backward_reached(edit, grad))


def take_lost(owner: object) -> list[str]:
    """The names of the edits ``owner`` made in checkpointed layers that no backward went
    through (each once, in order); forgets them all."""
    edits = owner.__dict__.pop(_ATTR, None)
    if not edits:
        return []
    return list(dict.fromkeys(str(e.name) for e in edits if e.pending))


def refuse_lost(lost: list[str], what: str, hint: str) -> None:
    """Raise for edits (``what``: the option that made them) lost to a later backward."""
    if lost:
        raise RuntimeError(
            f"{what} edited {', '.join(map(repr, lost[:4]))}"
            f"{f' (and {len(lost) - 4} more)' if len(lost) > 4 else ''} inside an activation-"
            "checkpointed layer (gradient_checkpointing_enable() or torch.utils.checkpoint, "
            "train mode), and no backward ran before the hooks were removed: a backward now "
            "would recompute those layers without the edit (same loss, wrong parameter "
            f"gradients). {hint}, or edit with checkpointing off, the model in eval(), or "
            "under torch.no_grad()"
        )
