"""TransformerLens-shaped hooks over any ``transformers`` model: one face for forward and backward.

* :func:`run_with_cache` runs the model and returns ``(output, cache)``, the cache keyed by the
  names asked for (``incl_bwd=True``: also the gradients, under ``"<name>_grad"``);
* :func:`run_with_hooks` runs the model with forward and backward hook functions;
* :func:`hooks` is the context manager both are built on.

Names are standard points (``resid_pre.3``, ``attn_z.3``, ``mlp_hidden.3``, ...), TransformerLens'
names (``blocks.3.hook_resid_pre``, ``blocks.3.attn.hook_z``: see :mod:`pyhook.points`), module
names, ``"<module>:in"``, or globs of any of these. Hook functions are called as
``fn(tensor, hook)`` (``hook.name`` is the name the tensor was asked under). A forward hook may
return a replacement activation; a backward hook sees the gradient at that point and may return a
replacement, which is what flows upstream. Per-head points are ``[batch, pos, head, d_head]``.

It is built on :class:`~pyhook.TraceDict` (the points, edits and thread guards every tracer
uses): a backward hook is a tensor hook on the point's activation, registered by the point's
forward hook. Every hook is removed when the call or the ``with`` block ends, whatever happened.

Example::

    >>> import torch, transformers, pyhook
    >>> cfg = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=64)
    >>> model = transformers.GPT2LMHeadModel(cfg).eval()
    >>> ids = torch.tensor([[1, 2, 3, 4]])
    >>> out, cache = pyhook.run_with_cache(model, ids, labels=ids, incl_bwd=True,
    ...                                   names_filter=["blocks.1.attn.hook_z", "resid_post.0"])
    >>> sorted(cache), tuple(cache["blocks.1.attn.hook_z_grad"].shape)
    (['blocks.1.attn.hook_z', 'blocks.1.attn.hook_z_grad', 'resid_post.0', 'resid_post.0_grad'], (1, 4, 2, 8))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ._hooks import HookSet, StopForward, is_own_stop
from .modules import LayerNotFoundError, glob_regex
from .points import Point, point_names, resolve_point, resolve_targets
from .trace import TraceDict

__all__ = ["LensHook", "hooks", "run_with_cache", "run_with_hooks"]

HookFn = Callable[..., Any]
HookList = Sequence[tuple[str | Callable[[str], bool], HookFn]]
_GLOB_CHARS = frozenset("*?[")


class LensHook:
    """What a hook function gets as its second argument: ``name`` (the name the tensor was asked
    under, after expanding globs), ``point`` (the :class:`~pyhook.points.Point`, None for a module
    name) and ``ctx``, a dict that lives as long as the ``hooks`` block (TransformerLens'
    ``hook.ctx``).

    Example::

        >>> import torch, pyhook
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> names = []
        >>> _ = pyhook.run_with_hooks(net, torch.ones(1, 2), fwd_hooks=[("0", lambda t, hook: names.append(hook.name))])
        >>> names
        ['0']
    """

    __slots__ = ("_hooked", "ctx", "name", "point")

    def __init__(self, name: str, point: Point | None) -> None:
        self.name = name
        self.point = point
        self.ctx: dict[str, Any] = {}
        self._hooked = False  # a gradient hook was put on this point's tensor in a forward

    def __repr__(self) -> str:
        return f"<pyhook.LensHook {self.name!r}>"


def _expand(model: nn.Module, name: Any, where: str) -> list[tuple[str, Point | None]]:
    """``[(name, Point or None), ...]`` for one name, point glob or module glob."""
    if not isinstance(name, str):
        raise TypeError(
            f"{where}: hook names must be str (a point, TransformerLens or module name, or a "
            f"glob), got {type(name).__name__}: {name!r}"
        )
    hits = resolve_targets(model, name)
    if hits is not None:
        return [(n, p if type(p) is Point else None) for n, p in hits]
    if _GLOB_CHARS.intersection(name):
        rx = glob_regex(name)
        found = [(n, None) for n, _ in model.named_modules() if n and rx.match(n)]
        if not found:
            raise LookupError(
                f"{where}: {name!r} matches no standard point and no module of "
                f"{type(model).__name__}"
            )
        return found
    return [(name, None)]


def _names_of(model: nn.Module, names_filter: Any, where: str) -> list[str]:
    """The names a ``names_filter`` stands for (TransformerLens' forms); a callable that
    matches no name is refused (a filter that hooks nothing is a mistake, not a request)."""
    if names_filter is None:
        return point_names(model)
    if isinstance(names_filter, str):
        return [names_filter]
    if callable(names_filter):
        pool = list(dict.fromkeys(point_names(model) + point_names(model, tl=True)))
        names = [n for n in pool if names_filter(n)]
        if not names:
            raise LookupError(
                f"{where}: the callable {getattr(names_filter, '__name__', names_filter)!r} "
                f"matches none of the {len(pool)} point names of {type(model).__name__} "
                f"(e.g. {', '.join(repr(n) for n in pool[:2] + pool[-2:])})"
            )
        return names
    if isinstance(names_filter, Iterable):
        return list(names_filter)
    raise TypeError(
        "names_filter must be None (every standard point), a name, a list of names or a "
        f"callable(name) -> bool, got {type(names_filter).__name__}: {names_filter!r}"
    )


def _by_name(model: nn.Module, pairs: Any, where: str) -> dict[str, list[HookFn]]:
    if pairs is None:
        return {}
    if isinstance(pairs, tuple) and len(pairs) == 2 and not isinstance(pairs[0], tuple):
        pairs = [pairs]
    out: dict[str, list[HookFn]] = {}
    for item in pairs:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise TypeError(f"{where} must be a list of (name, fn) pairs, got {item!r}")
        name, fn = item
        if not callable(fn):
            raise TypeError(f"{where}: the hook for {name!r} must be callable, got {fn!r}")
        names = _names_of(model, name, where) if callable(name) else [name]
        for n in names:
            out.setdefault(n, []).append(fn)
    return out


def _first_tensor(output: Any) -> tuple[torch.Tensor | None, Callable[[Any], Any]]:
    """(the tensor a module name hands hooks, a function putting a replacement back)."""
    if isinstance(output, torch.Tensor):
        return output, lambda new: new
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        kind = type(output)

        def rebuild(new: Any) -> Any:
            rest = list(output[1:])
            if kind is tuple or kind is list:
                return kind([new, *rest])
            return kind(new, *rest)  # a namedtuple

        return output[0], rebuild
    first = getattr(output, "to_tuple", None)
    if callable(first):  # a ModelOutput: its first field
        key = next(iter(output.keys()), None)
        if key is not None and isinstance(output[key], torch.Tensor):

            def put(new: Any) -> Any:
                output[key] = new
                return output

            return output[key], put
    return None, lambda new: new


@contextlib.contextmanager
def hooks(
    model: nn.Module,
    fwd_hooks: HookList | None = None,
    bwd_hooks: HookList | None = None,
    *,
    _stop_at: int | None = None,
    _stop_owner: object = None,
) -> Iterator[dict[str, LensHook]]:
    """Hook functions on ``model`` while the block runs: ``fwd_hooks`` / ``bwd_hooks`` are lists
    of ``(name, fn)`` (a name, a glob, or a ``callable(name) -> bool`` over the model's point
    names), each called as ``fn(tensor, hook)``. A forward hook's return value (not None)
    replaces the activation; a backward hook sees the gradient at the point and its return value
    (not None) is the gradient that flows upstream. Backward hooks act on backward passes run
    inside the block. Every hook is gone when the block exits, however it exits. Yields
    ``{name: LensHook}``.

    Example::

        >>> import torch, transformers, pyhook
        >>> cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        ...                                num_attention_heads=2, vocab_size=64)
        >>> model = transformers.LlamaForCausalLM(cfg)
        >>> ids = torch.tensor([[1, 2, 3]])
        >>> grads = {}
        >>> with pyhook.hooks(model, fwd_hooks=[("blocks.0.attn.hook_z", lambda z, hook: z * 0)],
        ...                   bwd_hooks=[("resid_pre.1", lambda g, hook: grads.setdefault(hook.name, g))]):
        ...     model(ids, labels=ids).loss.backward()
        >>> tuple(grads["resid_pre.1"].shape), len(model.model.layers[0]._forward_pre_hooks)
        ((1, 3, 16), 0)
    """
    fwd = _by_name(model, fwd_hooks, "fwd_hooks")
    bwd = _by_name(model, bwd_hooks, "bwd_hooks")
    targets: dict[str, Point | None] = {}
    for name in (*fwd, *bwd):
        for n, p in _expand(model, name, "fwd_hooks" if name in fwd else "bwd_hooks"):
            targets.setdefault(n, p)
    per_fwd: dict[str, list[HookFn]] = {n: [] for n in targets}
    per_bwd: dict[str, list[HookFn]] = {n: [] for n in targets}
    for src, dst in ((fwd, per_fwd), (bwd, per_bwd)):
        for name, fns in src.items():
            for n, _ in _expand(model, name, "hooks"):
                dst[n].extend(fns)
    refs = {n: LensHook(n, p) for n, p in targets.items()}
    grads = HookSet(model=model)  # the tensor (gradient) hooks registered during forwards

    def make_edit(name: str) -> Callable[[Any], Any]:
        ref, f_fns, b_fns = refs[name], per_fwd[name], per_bwd[name]
        point = targets[name]
        inplace = point is not None and point.inplace

        def on_backward(grad: torch.Tensor) -> torch.Tensor | None:
            g = grad
            for fn in b_fns:
                new = fn(g, ref)
                if new is not None:
                    g = new
            return None if g is grad else g

        def edit(output: Any) -> Any:
            value, rebuild = (output, None) if point is not None else _first_tensor(output)
            if value is None:
                raise TypeError(
                    f"hook {name!r}: the output of the module is a {type(output).__name__}, "
                    "with no tensor to hand a hook"
                )
            orig = value
            if (
                b_fns
                and not inplace
                and not value.requires_grad
                and torch.is_grad_enabled()
                and (value.is_floating_point() or value.is_complex())
            ):
                # Nothing upstream requires grad (frozen embeddings, a frozen model): the model
                # goes on from a leaf here, so the gradient at this point still exists.
                value = value.detach().requires_grad_()
            v = value
            for fn in f_fns:
                new = fn(v, ref)
                if new is not None:
                    v = new
            if (
                b_fns
                and inplace
                and isinstance(v, torch.Tensor)
                and not value.requires_grad
                and torch.is_grad_enabled()
                and value.is_floating_point()
            ):
                # read in place by several modules, with nothing upstream requiring grad: the
                # model's own tensor (a leaf) becomes one requiring grad, for every reader
                if v is not value:
                    value.copy_(v)
                    v = value
                value.requires_grad_()
            if b_fns and isinstance(v, torch.Tensor) and v.requires_grad:
                if inplace:  # every reader of the tensor has it: edit it there, hook it there
                    if v is not value:
                        value.copy_(v)
                    grads.tensor(value, on_backward)
                    ref._hooked = True
                    return None
                if v is value:  # a node of its own, so the hook sees this branch's gradient
                    v = value.view_as(value)
                grads.tensor(v, on_backward)
                ref._hooked = True
            if v is orig:
                return None
            return v if rebuild is None else rebuild(v)

        return edit

    stops = HookSet(model=model)
    td = TraceDict(
        model,
        list(targets),
        retain_output=False,
        edit_output={n: make_edit(n) for n in targets},
    )
    # An edit in a checkpointed layer that no backward in the block went through is refused
    # when the block ends, as every tracer's (pyhook._checkpointing), in the face's words.
    td.__dict__["_edit_what"] = "fwd_hooks"
    td.__dict__["_edit_hint"] = (
        "Run the backward inside the block (run_with_hooks does with bwd_hooks=)"
    )
    try:
        if _stop_at is not None:
            if isinstance(_stop_at, bool) or not isinstance(_stop_at, int):
                raise TypeError(f"stop_at_layer must be a block number (int), got {_stop_at!r}")
            try:
                at = resolve_point(model, f"resid_pre.{_stop_at}")
            except LookupError as e:
                raise LayerNotFoundError(
                    f"stop_at_layer={_stop_at}", f"stop_at_layer={_stop_at}: {e}"
                ) from None

            def stop(_module: nn.Module, _args: Any, value: Any) -> None:
                raise StopForward(owner=_stop_owner, payload=value)

            with stops.registering():
                stops.forward(at, stop)
        with td:
            yield refs
    finally:
        td.close()
        stops.remove()
        grads.remove()


def _pos_index(pos_slice: Any) -> Any:
    """TransformerLens' ``Slice`` as an index (checked before the forward)."""
    if pos_slice is None or isinstance(pos_slice, slice):
        return pos_slice
    if isinstance(pos_slice, int) and not isinstance(pos_slice, bool):
        return pos_slice
    if isinstance(pos_slice, tuple) and 1 <= len(pos_slice) <= 3:
        return slice(*pos_slice)
    if isinstance(pos_slice, list) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in pos_slice
    ):
        return torch.tensor(pos_slice, dtype=torch.long)
    if (
        isinstance(pos_slice, torch.Tensor)
        and pos_slice.dim() <= 1
        and not (pos_slice.dtype.is_floating_point or pos_slice.dtype.is_complex)
        and pos_slice.dtype != torch.bool
    ):
        return pos_slice
    raise TypeError(
        "pos_slice must be None, an int, a slice, a (start, stop[, step]) tuple or a list / "
        f"tensor of positions, got {type(pos_slice).__name__}: {pos_slice!r}"
    )


def _check_positions(index: Any, pos_slice: Any, tokens: int) -> None:
    """An ``IndexError`` naming ``pos_slice`` when a position it names is not one of ``tokens``."""
    if isinstance(index, int):
        bad = [index] if not -tokens <= index < tokens else []
    elif isinstance(index, torch.Tensor) and index.numel():
        bad = [int(i) for i in index.flatten() if not -tokens <= int(i) < tokens][:3]
    else:
        return  # a slice selects what exists, as in Python and TransformerLens
    if bad:
        raise IndexError(
            f"pos_slice={pos_slice!r}: position {bad[0]} is out of range for this forward's "
            f"{tokens} positions (valid: {-tokens} to {tokens - 1})"
        )


def _forward_grid(inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int] | None:
    """``(batch, tokens)`` of a forward, from its token ids or ``[batch, tokens, d]``
    embeddings (the first argument, ``input_ids=`` or ``inputs_embeds=``); None if unknown."""
    first = inputs[0] if inputs else kwargs.get("input_ids")
    if first is None:
        first = kwargs.get("inputs_embeds")
    if not isinstance(first, torch.Tensor):
        return None
    ids = not (first.dtype.is_floating_point or first.dtype.is_complex)
    if (ids and first.dim() == 2) or (not ids and first.dim() == 3):
        return int(first.shape[0]), int(first.shape[1])
    return None


def _slice_pos(
    tensor: torch.Tensor,
    index: Any,
    pos_slice: Any,
    point: Point | None,
    name: str,
    grid: tuple[int, int] | None,
) -> torch.Tensor:
    """TransformerLens' ``Slice`` (``index``, from :func:`_pos_index`) on the position dimension
    (-3 for per-head values, else -2). A point the model computes as ``[batch*tokens, ...]``
    (:attr:`~pyhook.points.Point.flat`) is sliced per example and stays flat: ``[batch*k, ...]``
    (``[batch, ...]`` for one position)."""
    if index is None:
        return tensor
    if point is not None and point.flat:
        if grid is None or tensor.dim() < 2 or tensor.shape[0] != grid[0] * grid[1]:
            raise ValueError(
                f"pos_slice={pos_slice!r}: point {name!r} is computed as [batch*tokens, ...] "
                f"(shape {tuple(tensor.shape)}), and this forward's [batch, tokens] is "
                + (
                    f"{list(grid)}"
                    if grid is not None
                    else "not known (no input_ids, inputs_embeds or token ids as the first input)"
                )
            )
        _check_positions(index, pos_slice, grid[1])
        picked = tensor.unflatten(0, grid)[:, _device_index(index, tensor)]
        return picked if isinstance(index, int) else picked.flatten(0, 1)
    dim = -3 if point is not None and point.heads is not None else -2
    if tensor.dim() < -dim:
        return tensor
    _check_positions(index, pos_slice, tensor.shape[dim])
    where: list[Any] = [slice(None)] * tensor.dim()
    where[dim] = _device_index(index, tensor)
    return tensor[tuple(where)]


def _device_index(index: Any, tensor: torch.Tensor) -> Any:
    return index.to(tensor.device) if isinstance(index, torch.Tensor) else index


def _scalar(output: Any, metric: Callable[[Any], Any] | None, who: str) -> torch.Tensor:
    value = metric(output) if metric is not None else getattr(output, "loss", None)
    what = "metric(output)" if metric is not None else "output.loss"
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise ValueError(
            f"{who}: the backward needs a scalar tensor; {what} is "
            f"{type(value).__name__ if not isinstance(value, torch.Tensor) else tuple(value.shape)}"
            + ("" if metric is not None else " (pass metric=fn(output) -> scalar, or labels=)")
        )
    if not value.requires_grad:
        raise ValueError(
            f"{who}: {what} does not require grad, so no gradient can be taken: run outside "
            "torch.no_grad()/torch.inference_mode(), and return a tensor computed from the "
            "model's output (not a Python number or a detached tensor)"
        )
    return value


def run_with_hooks(
    model: nn.Module,
    *inputs: Any,
    fwd_hooks: HookList | None = None,
    bwd_hooks: HookList | None = None,
    metric: Callable[[Any], Any] | None = None,
    **model_kwargs: Any,
) -> Any:
    """``model(*inputs, **model_kwargs)`` with hook functions (see :func:`hooks`) and their
    output. With ``bwd_hooks`` the backward of ``metric(output)`` (or of ``output.loss``) runs
    before the hooks are removed (TransformerLens removes them before any backward could run).
    Parameter gradients accumulate as with any backward.

    Example::

        >>> import torch, transformers, pyhook
        >>> cfg = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=64)
        >>> model = transformers.GPT2LMHeadModel(cfg).eval()
        >>> ids = torch.tensor([[1, 2, 3]])
        >>> ablated = pyhook.run_with_hooks(model, ids, fwd_hooks=[("mlp_out.*", lambda t, hook: t * 0)])
        >>> torch.equal(ablated.logits, model(ids).logits)
        False
    """
    with hooks(model, fwd_hooks, bwd_hooks):
        output = model(*inputs, **model_kwargs)
        if bwd_hooks:
            _scalar(output, metric, "run_with_hooks(bwd_hooks=...)").backward()
    return output


def run_with_cache(
    model: nn.Module,
    *inputs: Any,
    names_filter: Any = None,
    incl_bwd: bool = False,
    metric: Callable[[Any], Any] | None = None,
    stop_at_layer: int | None = None,
    pos_slice: Any = None,
    **model_kwargs: Any,
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Run ``model`` and return ``(output, cache)``, TransformerLens' ``run_with_cache``.

    ``names_filter``: None (every standard point), a name, a list of names (points,
    TransformerLens names, module names, globs) or a ``callable(name) -> bool`` over the model's
    point names (canonical and TransformerLens'); the cache is keyed by the names given (globs
    expanded), values detached. ``incl_bwd=True`` also runs the backward of ``metric(output)``
    (or of ``output.loss``) and stores each gradient under ``"<name>_grad"``. ``stop_at_layer=L``
    stops the forward before block ``L`` (negative counts from the end) and returns the residual
    stream there as the output. ``pos_slice`` (an int, a slice, a tuple or a list of positions)
    slices the position dimension of every cached value and gradient.

    Example::

        >>> import torch, transformers, pyhook
        >>> cfg = transformers.GPT2Config(n_embd=16, n_layer=3, n_head=2, vocab_size=64)
        >>> model = transformers.GPT2LMHeadModel(cfg).eval()
        >>> ids = torch.tensor([[1, 2, 3, 4]])
        >>> resid, cache = pyhook.run_with_cache(model, ids, names_filter=lambda n: n.endswith("hook_resid_post"),
        ...                                     stop_at_layer=2, pos_slice=-1)
        >>> list(cache), tuple(cache["blocks.1.hook_resid_post"].shape), torch.equal(resid[:, -1], cache["blocks.1.hook_resid_post"])
        (['blocks.0.hook_resid_post', 'blocks.1.hook_resid_post'], (1, 16), True)
    """
    if metric is not None and not incl_bwd:
        raise ValueError(
            "run_with_cache: metric= is the scalar whose backward gives the gradients, and is "
            "only used with incl_bwd=True; pass incl_bwd=True, or leave metric out"
        )
    names = _names_of(model, names_filter, "run_with_cache(names_filter=...)")
    index = _pos_index(pos_slice)
    grid = _forward_grid(inputs, model_kwargs) if index is not None else None
    if grid is not None:
        _check_positions(index, pos_slice, grid[1])
    cache: dict[str, torch.Tensor] = {}

    def saver(suffix: str) -> HookFn:
        def save(tensor: torch.Tensor, hook: LensHook) -> None:
            cache[hook.name + suffix] = _slice_pos(
                tensor.detach(), index, pos_slice, hook.point, hook.name, grid
            )

        return save

    fwd = [(n, saver("")) for n in names]
    bwd = [(n, saver("_grad")) for n in names] if incl_bwd else None
    owner = object()
    with hooks(model, fwd, bwd, _stop_at=stop_at_layer, _stop_owner=owner) as refs:
        try:
            output = model(*inputs, **model_kwargs)
        except StopForward as e:
            if not is_own_stop(e, owner):
                raise
            output = e.payload
        if incl_bwd:
            _scalar(output, metric, "run_with_cache(incl_bwd=True)").backward()
            for n, ref in refs.items():
                if n in cache and n + "_grad" not in cache:
                    if not ref._hooked:
                        raise ValueError(
                            f"run_with_cache(incl_bwd=True): no gradient can be taken at {n!r}: "
                            "its value does not require grad and the model reads it in place "
                            "(ask for a point upstream of it too, or unfreeze a parameter there)"
                        )
                    # hooked, but the metric does not depend on it: its gradient is zero
                    cache[n + "_grad"] = torch.zeros_like(cache[n])
    return output, cache
