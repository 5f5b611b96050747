"""Flattening of nested layer outputs, built on :mod:`torch.utils._pytree`.

What is a container and what is a leaf is decided here, once, for the whole package:

* containers (rebuilt with their own type): ``tuple``, ``list``, ``dict``, ``OrderedDict``,
  ``defaultdict``, ``deque``, namedtuples, ``torch.return_types`` structseqs, dataclass
  instances, ``transformers`` ``ModelOutput`` subclasses (registered by ``transformers``);
* everything else is a leaf: tensors, ``None``, strings, numbers and unknown objects such as
  KV-cache objects, which are passed through untouched.

Dataclass types are registered with pytree the first time one is met, so that a dataclass
output keeps its type and fields instead of being treated as an opaque leaf.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["TreeSpec", "flatten", "map_tensors", "tensor_leaves", "unflatten"]

TreeSpec = pytree.TreeSpec

_register_lock = threading.Lock()
_failed_dataclasses: set[type] = set()


def _register_dataclass(cls: type) -> bool:
    """Register a dataclass type with pytree; False when it cannot be rebuilt from its fields."""
    fields = [f.name for f in dataclasses.fields(cls)]
    if not all(f.init for f in dataclasses.fields(cls)):
        return False

    def flatten_fn(obj: Any) -> tuple[list[Any], Any]:
        return [getattr(obj, name) for name in fields], None

    def unflatten_fn(values: Any, _context: Any) -> Any:
        return cls(**dict(zip(fields, values)))

    def flatten_with_keys_fn(obj: Any) -> tuple[list[tuple[Any, Any]], Any]:
        return [(pytree.GetAttrKey(name), getattr(obj, name)) for name in fields], None

    pytree.register_pytree_node(
        cls,
        flatten_fn,
        unflatten_fn,
        serialized_type_name=f"pyhook.dataclass.{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=flatten_with_keys_fn,
    )
    return True


def _is_leaf(x: Any) -> bool:
    # Called by pytree before it looks a node type up: the one place where an unregistered
    # dataclass can be registered just in time.  Returning False lets pytree decide.
    cls = type(x)
    if cls in pytree.SUPPORTED_NODES or cls in _failed_dataclasses:
        return False
    if dataclasses.is_dataclass(cls) and not isinstance(x, type):
        with _register_lock:
            if cls not in pytree.SUPPORTED_NODES and cls not in _failed_dataclasses:
                try:
                    ok = _register_dataclass(cls)
                except ValueError:  # registered concurrently or by the user
                    ok = cls in pytree.SUPPORTED_NODES
                if not ok:
                    _failed_dataclasses.add(cls)
    return False


def flatten(x: Any) -> tuple[list[Any], TreeSpec]:
    """Flatten ``x`` into its leaves and a spec that rebuilds it with :func:`unflatten`."""
    return pytree.tree_flatten(x, is_leaf=_is_leaf)


def unflatten(leaves: list[Any], spec: TreeSpec) -> Any:
    """Rebuild the structure flattened by :func:`flatten` from (possibly new) leaves."""
    return pytree.tree_unflatten(leaves, spec)


def tensor_leaves(x: Any) -> list[torch.Tensor]:
    """Every tensor inside ``x``, in flattening order."""
    if isinstance(x, torch.Tensor):
        return [x]
    leaves, _ = flatten(x)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def map_tensors(x: Any, fn: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> Any:
    """Rebuild ``x`` with its tensors replaced by ``fn(all_tensors)``.

    ``fn`` receives every tensor leaf at once (so a native op can copy them in one call) and
    must return a list of the same length. Non-tensor leaves are kept as they are.
    """
    if isinstance(x, torch.Tensor):
        (out,) = fn([x])
        return out
    leaves, spec = flatten(x)
    idx = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    if not idx:
        return x if spec.num_leaves == 1 and spec.is_leaf() else unflatten(leaves, spec)
    new = fn([leaves[i] for i in idx])
    if len(new) != len(idx):
        raise RuntimeError(f"map_tensors: expected {len(idx)} tensors back, got {len(new)}")
    for i, t in zip(idx, new):
        leaves[i] = t
    return unflatten(leaves, spec)
