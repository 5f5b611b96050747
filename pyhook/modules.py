"""Resolving, listing, replacing and slicing submodules by dotted name (nethook's helpers).

Names are resolved by walking ``_modules`` one dotted part at a time, so a lookup costs the
depth of the name rather than a scan of every module (nethook scans ``named_modules()``, which
is slow on models with hundreds of layers). An unknown name raises :class:`LayerNotFoundError`,
which lists the closest real names.
"""

from __future__ import annotations

import copy
import difflib
import re
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .distributed import _layouts_active, note_model

__all__ = [
    "LayerNotFoundError",
    "get_module",
    "get_parameter",
    "hierarchical_subsequence",
    "module_name_of",
    "module_names",
    "parameter_names",
    "replace_module",
    "resolve_module",
    "set_requires_grad",
    "subsequence",
]


class LayerNotFoundError(KeyError, AttributeError):
    """An unknown module or parameter name.

    It is a ``LookupError`` (what nethook raises), a ``KeyError`` (hybrid_learning) and an
    ``AttributeError`` (deephook), so code written against any of them catches it. The message
    lists the closest real names.

    Example::

        >>> import torch, pyhook
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> try:
        ...     pyhook.get_module(net, "1")
        ... except LookupError as e:
        ...     print(e)
        no module named '1' in Sequential; closest names: '' (the root), '0'
    """

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name
        self.message = message

    def __str__(self) -> str:
        return self.message


def _describe(name: str) -> str:
    return "'' (the root)" if name == "" else repr(name)


def _not_found(
    model: nn.Module, name: Any, kind: str, candidates: Iterable[str]
) -> LayerNotFoundError:
    names = list(candidates)
    close = difflib.get_close_matches(str(name), names, n=5, cutoff=0.5)
    if not close:
        close = [n for n in names if str(name) and (str(name) in n or n.endswith(str(name)))][:5]
    if not close:
        close = names[:5]
    hint = ", ".join(_describe(n) for n in close) if close else "none"
    return LayerNotFoundError(
        str(name), f"no {kind} named {name!r} in {type(model).__name__}; closest names: {hint}"
    )


def get_module(model: nn.Module, name: str) -> nn.Module:
    """Find the named module within ``model`` (``''`` is the model itself).

    Example::

        >>> import torch, pyhook
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sequential(torch.nn.ReLU()))
        >>> pyhook.get_module(net, "1.0")
        ReLU()
    """
    if not isinstance(name, str):
        raise TypeError(
            f"layer name must be a str (a dotted module name), got {type(name).__name__}: {name!r}"
        )
    module = model
    if name:
        for part in name.split("."):
            child = module._modules.get(part) if isinstance(module, nn.Module) else None
            if child is None:
                raise _not_found(model, name, "module", (n for n, _ in model.named_modules()))
            module = child
    return module


def resolve_module(model: nn.Module, layer: str | nn.Module) -> tuple[str, nn.Module]:
    """``(name, module)`` for a dotted name or a module object that lives inside ``model``."""
    if isinstance(layer, nn.Module):
        return module_name_of(model, layer), layer
    return layer, get_module(model, layer)


def module_name_of(model: nn.Module, module: nn.Module) -> str:
    """The (first) dotted name of ``module`` inside ``model``; ``ValueError`` when it is not in it."""
    for n, m in model.named_modules(remove_duplicate=False):
        if m is module:
            return n
    raise ValueError(
        f"{type(module).__name__} object is not a submodule of the {type(model).__name__} given"
    )


def get_parameter(model: nn.Module, name: str) -> nn.Parameter:
    """Find the named parameter within ``model``.

    Example::

        >>> import torch, pyhook
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 3))
        >>> pyhook.get_parameter(net, "0.weight").shape
        torch.Size([3, 2])
    """
    if not isinstance(name, str):
        raise TypeError(f"parameter name must be a str, got {type(name).__name__}: {name!r}")
    owner_name, _, attr = name.rpartition(".")
    try:
        owner = get_module(model, owner_name)
    except LookupError:
        owner = None
    param = owner._parameters.get(attr) if owner is not None else None
    if param is None:
        raise _not_found(model, name, "parameter", (n for n, _ in model.named_parameters()))
    return param


def replace_module(model: nn.Module, name: str, new_module: nn.Module) -> None:
    """Replace the named module within ``model`` (top-level and dotted names both work).

    Example::

        >>> import torch, pyhook
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> pyhook.replace_module(net, "1", torch.nn.Tanh())
        >>> net[1]
        Tanh()
    """
    if not isinstance(new_module, nn.Module):
        raise TypeError(f"new_module must be an nn.Module, got {type(new_module).__name__}")
    parent_name, _, attr_name = name.rpartition(".")
    parent = get_module(model, parent_name)
    if attr_name not in parent._modules:
        raise _not_found(model, name, "module", (n for n, _ in model.named_modules()))
    setattr(parent, attr_name, new_module)
    if _layouts_active():  # the new module's place, for the layout layer's checks
        note_model(parent, again=True)


def module_names(model: nn.Module) -> list[str]:
    """All module names of ``model`` (``''`` first, for the model itself).

    Example::

        >>> import torch, pyhook
        >>> pyhook.module_names(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
        ['', '0', '1']
    """
    return [n for n, _ in model.named_modules()]


def parameter_names(model: nn.Module) -> list[str]:
    """All parameter names of ``model``.

    Example::

        >>> import torch, pyhook
        >>> pyhook.parameter_names(torch.nn.Sequential(torch.nn.Linear(2, 2)))
        ['0.weight', '0.bias']
    """
    return [n for n, _ in model.named_parameters()]


def set_requires_grad(requires_grad: bool, *models: nn.Module | torch.Tensor) -> None:
    """Set ``requires_grad`` on every parameter of the modules (or on the tensors) passed.

    Example::

        >>> import torch, pyhook
        >>> net = torch.nn.Linear(2, 2)
        >>> pyhook.set_requires_grad(False, net)
        >>> net.weight.requires_grad
        False
    """
    for i, model in enumerate(models, 2):  # all checked first: a bad one changes nothing
        if not isinstance(model, (nn.Module, torch.Tensor)):
            raise TypeError(
                "set_requires_grad takes modules, parameters or tensors, got "
                f"{type(model).__name__} as argument {i} (requires_grad is argument 1)"
            )
    for model in models:
        if isinstance(model, nn.Module):
            for param in model.parameters():
                param.requires_grad = requires_grad
        else:
            model.requires_grad = requires_grad


def subsequence(
    sequential: nn.Sequential,
    first_layer: str | None = None,
    last_layer: str | None = None,
    after_layer: str | None = None,
    upto_layer: str | None = None,
    single_layer: str | None = None,
    share_weights: bool = False,
) -> nn.Sequential:
    """Slice a (nested) ``nn.Sequential``: ``first_layer..last_layer`` inclusive, or
    ``after_layer..upto_layer`` exclusive; dotted names descend into nested Sequentials.

    The result is a deep copy unless ``share_weights=True``.

    Example::

        >>> import torch, pyhook
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
        >>> pyhook.subsequence(net, after_layer="0")
        Sequential(
          (1): ReLU()
          (2): Linear(in_features=2, out_features=1, bias=True)
        )
    """
    if single_layer is not None and any(
        x is not None for x in (first_layer, last_layer, after_layer, upto_layer)
    ):
        raise ValueError("subsequence: single_layer cannot be combined with other bounds")
    if first_layer is not None and after_layer is not None:
        raise ValueError("subsequence: give first_layer or after_layer, not both")
    if last_layer is not None and upto_layer is not None:
        raise ValueError("subsequence: give last_layer or upto_layer, not both")
    if single_layer is not None:
        first_layer = last_layer = single_layer
    first, last, after, upto = (
        None if d is None else d.split(".")
        for d in (first_layer, last_layer, after_layer, upto_layer)
    )
    result = hierarchical_subsequence(
        sequential, first=first, last=last, after=after, upto=upto, share_weights=share_weights
    )
    return result  # type: ignore[return-value]  # a Sequential whenever a bound is given


def hierarchical_subsequence(
    sequential: nn.Module,
    first: list[str] | None,
    last: list[str] | None,
    after: list[str] | None,
    upto: list[str] | None,
    share_weights: bool = False,
    depth: int = 0,
) -> nn.Module:
    """Recursive helper of :func:`subsequence`; ``first`` etc. are dotted names split on dots.

    At each level a bound names the child where it applies (``bound[depth]``); a bound with
    more parts continues inside that child, which is then sliced recursively.

    Example::

        >>> import torch, pyhook
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Tanh()))
        >>> pyhook.hierarchical_subsequence(net, first=["1", "1"], last=None, after=None, upto=None)
        Sequential(
          (1): Sequential(
            (1): Tanh()
          )
        )
    """
    if (first is not None and after is not None) or (last is not None and upto is not None):
        raise ValueError("hierarchical_subsequence: first/after and last/upto are exclusive")
    if first is None and last is None and after is None and upto is None:
        return sequential if share_weights else copy.deepcopy(sequential)
    if not isinstance(sequential, nn.Sequential):
        bound = next(b for b in (first, last, after, upto) if b is not None)
        raise ValueError(f"{'.'.join(bound[:depth]) or 'model'} not Sequential")

    def here(bound: list[str] | None, name: str) -> bool:
        return bound is not None and bound[depth] == name

    def inner(bound: list[str] | None) -> list[str] | None:
        return bound if bound is not None and len(bound) > depth + 1 else None

    kept: OrderedDict[str, nn.Module] = OrderedDict()
    including = first is None and after is None
    unmatched = {id(b): b for b in (first, last, after, upto) if b is not None}
    for name, child in sequential._modules.items():
        child_bounds: dict[str, list[str] | None] = {}
        stop_after = start_after = False
        if here(first, name):
            unmatched.pop(id(first), None)
            including = True
            child_bounds["first"] = inner(first)
        if here(after, name):
            unmatched.pop(id(after), None)
            if inner(after) is None:
                start_after = True  # exclusive: begin with the next child
            else:
                including = True
                child_bounds["after"] = inner(after)
        if here(upto, name):
            unmatched.pop(id(upto), None)
            if inner(upto) is None:
                including = False  # exclusive: end before this child
            else:
                child_bounds["upto"] = inner(upto)
                stop_after = True
        if here(last, name):
            unmatched.pop(id(last), None)
            child_bounds["last"] = inner(last)
            stop_after = True
        if including:
            sub = hierarchical_subsequence(
                child,
                first=child_bounds.get("first"),
                last=child_bounds.get("last"),
                after=child_bounds.get("after"),
                upto=child_bounds.get("upto"),
                share_weights=share_weights,
                depth=depth + 1,
            )
            if sub is not None:
                kept[name] = sub
        if stop_after:
            including = False
        if start_after:
            including = True
    for bound in unmatched.values():
        raise ValueError("Layer {} not found".format(".".join(bound)))
    if not kept and depth > 0:
        return None  # type: ignore[return-value]  # empty nested slices are dropped
    result = nn.Sequential(kept)
    result.training = sequential.training
    return result


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A layer-name glob as a regex: ``*`` and ``?`` stay within one dotted component, ``**``
    crosses dots (the globs of ``capture`` layers and of standard points)."""
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^.]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^.]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")
