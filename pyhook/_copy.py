"""``recursive_copy``: copy, detach or mark for gradients every tensor in a nested output.

Structures are flattened with :mod:`pyhook._tree` and all tensors are cloned in one call of the
selected backend (the native op allocates one buffer for all of them).
"""

from __future__ import annotations

from typing import Any

import torch

from . import _backend, _tree

__all__ = ["recursive_copy"]


def _prepare(tensors: list[torch.Tensor], detach: bool, retain_grad: bool) -> list[torch.Tensor]:
    out = []
    for t in tensors:
        if retain_grad:
            if not t.requires_grad and (t.is_floating_point() or t.is_complex()):
                t.requires_grad_(True)
            # (retain_grad wins over detach, as in nethook)
        elif detach:
            t = t.detach()
        out.append(t)
    return out


def _mark_retain_grad(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        if t.requires_grad:
            t.retain_grad()


def recursive_copy(
    x: Any, clone: bool | None = None, detach: bool | None = None, retain_grad: bool | None = None
) -> Any:
    """Copy a reference to a tensor, or to a structure holding tensors, optionally detaching
    and cloning every tensor.

    Containers (tuples, lists, dicts, namedtuples, dataclasses, ``transformers`` ``ModelOutput``)
    are rebuilt with their own type; ``None``, strings, numbers and unknown objects (KV caches)
    pass through untouched. With no flag set, ``x`` itself is returned.

    ``retain_grad=True`` makes every floating tensor require grad and retain it; with
    ``clone=True`` too, it is the returned copy whose ``.grad`` is filled by ``backward()``.
    ``detach`` is ignored when ``retain_grad`` is set (nethook's rule).

    Example::

        >>> import torch, pyhook
        >>> x = {"h": torch.ones(2), "mask": None, "pair": (torch.zeros(1), "tag")}
        >>> y = pyhook.recursive_copy(x, clone=True, detach=True)
        >>> y["pair"][1], y["mask"] is None, y["h"] is x["h"]
        ('tag', True, False)
        >>> torch.equal(y["h"], x["h"])
        True
    """
    if not clone and not detach and not retain_grad:
        return x
    detach_b, retain_b, clone_b = bool(detach), bool(retain_grad), bool(clone)
    if isinstance(x, torch.Tensor):  # the common case (a layer returning a tensor), no tree walk
        t = _prepare([x], detach_b, retain_b)[0] if retain_b else (x.detach() if detach_b else x)
        if clone_b:
            t = _backend.clone_one(t)
        if retain_b and t.requires_grad:
            t.retain_grad()
        return t

    def copy_all(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        tensors = _prepare(tensors, detach_b, retain_b)
        if clone_b:
            tensors = _backend.clone_tensors(tensors)
        if retain_b:
            _mark_retain_grad(tensors)
        return tensors

    return _tree.map_tensors(x, copy_all)
