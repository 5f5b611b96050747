"""How pyhook's hooks reach code compiled by ``torch.compile`` (dynamo's default settings).

With ``torch._dynamo.config.skip_nnmodule_hook_guards = True`` (PyTorch's default) dynamo does
not guard the *empty* hook dicts of a module: a hook added to such a module after compilation is
silently ignored. It does guard what the hooks present at compile time read. So, for a module of
a compiled model, pyhook keeps one *dispatcher* installed (a forward pre-hook and a forward hook,
added once, on first use) and never touches the module's hook dicts again: a tracer's hooks are
entries in the dispatcher's per-thread table, and entering or leaving a tracer only changes that
table. Compiled code inlines the dispatcher and guards the table (the type of each entry and the
values its code reads), so:

* a tracer entered on a compiled model is seen by the compiled code, and leaving it restores the
  previous compiled code (no stale hook either way);
* entering again with the same layers and options reuses the compiled code (no recompilation);
  new layers or options compile once (dynamo's usual cache, up to its ``recompile_limit``);
* the table is a :class:`threading.local`, so each calling thread's compiled code specialises on
  that thread's tracers (thread isolation without ``threading.get_ident()`` in the graph).

When a dispatcher is installed on a module after dynamo already compiled code (which could have
inlined the module without it), dynamo's in-memory code caches are dropped once
(``torch._dynamo.reset_code_caches()``), so the next call recompiles with the dispatcher.

This module also holds the traceable helpers the tools use on this path.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

__all__ = ["Dispatcher", "active_entries", "dispatcher_of", "prepare", "release"]

_ATTR = "_pyhook_dispatch"
_lock = threading.Lock()  # tables may be changed from several threads (any_thread, remove)


class _Entry:
    """One tracer hook in a dispatcher table (what ``register_forward_hook`` would have held)."""

    __slots__ = ("fn", "with_kwargs")

    def __init__(self, fn: Callable[..., Any], with_kwargs: bool) -> None:
        self.fn = fn
        self.with_kwargs = with_kwargs


class _Table:
    """The hooks of one thread (or the any-thread hooks) on one module, as immutable tuples."""

    __slots__ = ("__weakref__", "post", "pre")

    def __init__(self) -> None:
        self.pre: tuple[_Entry, ...] = ()
        self.post: tuple[_Entry, ...] = ()


def _put(table: _Table, kind: str, entry: _Entry, prepend: bool) -> None:
    current = getattr(table, kind)
    setattr(table, kind, (entry, *current) if prepend else (*current, entry))


def _drop(table: _Table, kind: str, entry: _Entry) -> None:
    setattr(table, kind, tuple(e for e in getattr(table, kind) if e is not entry))


class _Handle:
    """Removes one entry from the table it was added to (any thread may call :meth:`remove`)."""

    __slots__ = ("entry", "kind", "table")

    def __init__(self, table: _Table, kind: str, entry: _Entry) -> None:
        self.table: _Table | None = table
        self.kind = kind
        self.entry = entry

    @property
    def alive(self) -> bool:
        """Whether the entry is still in its table (through this handle)."""
        return self.table is not None

    def remove(self) -> None:
        table, self.table = self.table, None
        if table is not None:
            if torch.compiler.is_compiling():  # traced (TruncatedModule): no lock in a graph
                _drop(table, self.kind, self.entry)
                return
            with _lock:
                _drop(table, self.kind, self.entry)


class Dispatcher:
    """The persistent pre-hook and forward hook pyhook keeps on a module of a compiled model.

    Its hooks run the entries of the calling thread's table, then the any-thread entries, in
    registration order (``prepend=True`` entries first), with the semantics of plain hooks:
    a pre-hook's non-``None`` result replaces the arguments, a forward hook's the output.

    Example::

        >>> import torch
        >>> from pyhook._compiled import prepare, release
        >>> lin = torch.nn.Linear(2, 2)
        >>> d = prepare(lin)
        >>> h = d.add(lambda m, args, out: out * 0, post=True)
        >>> float(lin(torch.ones(2)).detach().abs().sum())
        0.0
        >>> h.remove(); release(lin); len(lin._forward_hooks)
        0
    """

    def __init__(self, module: nn.Module) -> None:
        self._local = threading.local()
        self.shared = _Table()
        self._handles: tuple[Any, ...] = (
            module.register_forward_pre_hook(self._pre, with_kwargs=True, prepend=True),
            module.register_forward_hook(self._post, with_kwargs=True),
        )

    def table(self, any_thread: bool) -> _Table:
        """The calling thread's table (created on first use), or the any-thread one."""
        if any_thread:
            return self.shared
        table = getattr(self._local, "table", None)
        if table is None:
            table = self._local.table = _Table()
        return table

    def add(
        self,
        fn: Callable[..., Any],
        *,
        post: bool,
        with_kwargs: bool = False,
        prepend: bool = False,
        any_thread: bool = False,
    ) -> _Handle:
        """Add ``fn`` as a forward hook (``post=True``) or pre-hook; returns a handle."""
        table = self.table(any_thread)
        kind = "post" if post else "pre"
        entry = _Entry(fn, with_kwargs)
        if torch.compiler.is_compiling():  # traced (TruncatedModule): no lock in a graph
            _put(table, kind, entry, prepend)
        else:
            with _lock:  # tables are replaced, never mutated: a running forward keeps its own
                _put(table, kind, entry, prepend)
        return _Handle(table, kind, entry)

    def remove(self, module: nn.Module) -> None:
        """Take this dispatcher's two hooks off ``module`` (also on a copy of the module)."""
        for h in self._handles:
            h.remove()
        for hooks, extra in (
            (module._forward_pre_hooks, module._forward_pre_hooks_with_kwargs),
            (module._forward_hooks, module._forward_hooks_with_kwargs),
        ):
            for key, fn in list(hooks.items()):
                if getattr(fn, "__self__", None) is self:
                    del hooks[key]
                    extra.pop(key, None)

    # A model holding a dispatcher can be deep-copied and pickled (torch.save): the copy gets
    # an empty dispatcher (tracers are never copied along with a model).
    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._local = threading.local()
        self.shared = _Table()
        self._handles = ()

    def _pre(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        table = getattr(self._local, "table", None)
        entries = self.shared.pre if table is None else table.pre + self.shared.pre
        if not entries:
            return None
        changed = False
        for e in entries:
            if e.with_kwargs:
                r = e.fn(module, args, kwargs)
                if r is not None:
                    args, kwargs = r
                    changed = True
            else:
                r = e.fn(module, args)
                if r is not None:
                    args = r if isinstance(r, tuple) else (r,)
                    changed = True
        return (args, kwargs) if changed else None

    def _post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        table = getattr(self._local, "table", None)
        entries = self.shared.post if table is None else table.post + self.shared.post
        if not entries:
            return None
        for e in entries:
            r = e.fn(module, args, kwargs, output) if e.with_kwargs else e.fn(module, args, output)
            if r is not None:
                output = r
        return output


def dispatcher_of(module: nn.Module) -> Dispatcher | None:
    """The dispatcher installed on ``module``, if any (a ``__dict__`` lookup: cheap)."""
    return module.__dict__.get(_ATTR)


def _invalidate() -> None:
    """Drop dynamo's compiled code once, if any exists (it may have inlined a hook-less module)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    seen = getattr(getattr(convert_frame, "input_codes", None), "seen", None)
    if seen is not None and not any(ref() is not None for ref in seen):
        return  # nothing compiled yet in this process
    dynamo.reset_code_caches()


def prepare(module: nn.Module) -> Dispatcher:
    """Install (once) the dispatcher on ``module``; compiled code made before is dropped."""
    d = dispatcher_of(module)
    if d is None:
        d = Dispatcher(module)
        module.__dict__[_ATTR] = d
        _invalidate()
    d.table(False)  # the calling thread's table exists before any compiled code reads it
    return d


def active_entries(module: nn.Module) -> int:
    """How many tracer hooks the calling thread (and any thread) has in ``module``'s dispatchers.

    Zero once every tracer has exited: the dispatchers themselves stay installed.

    >>> active_entries(torch.nn.Linear(2, 2))
    0
    """
    if type(module).__name__ == "OptimizedModule":
        module = unwrap_compiled(module)
    n = 0
    for m in module.modules():
        d = dispatcher_of(m)
        if d is not None:
            local = getattr(d._local, "table", None)
            for t in (local, d.shared):
                if t is not None:
                    n += len(t.pre) + len(t.post)
    return n


def release(module: nn.Module) -> None:
    """Remove the dispatchers pyhook installed on ``module`` and its submodules.

    Compiled code that inlined them is dropped (it recompiles on the next call). Tracers still
    active on these modules stop seeing their forwards.

    Example::

        >>> import torch, pyhook
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> compiled = torch.compile(net, backend="eager")
        >>> with pyhook.Trace(compiled, "0") as t:
        ...     _ = compiled(torch.ones(1, 2))
        >>> len(net[0]._forward_hooks)  # the dispatcher stays installed for the next tracer
        1
        >>> pyhook.release_compiled(net); len(net[0]._forward_hooks)
        0
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    module = unwrap_compiled(module)
    found = False
    for m in module.modules():
        d = m.__dict__.pop(_ATTR, None)
        if d is not None:
            d.remove(m)
            found = True
    if found:
        _invalidate()


class _Token:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def call_plan(fn: Callable[..., Any], names: tuple[str, ...]) -> Any:
    """How :func:`~pyhook.invoke_with_optional_args` would pass the keywords ``names`` to ``fn``.

    Returns ``(positional names, ((parameter, name), ...))``, computed once so that the call
    itself traces (``inspect.signature`` does not), or ``False`` when ``fn`` cannot be planned
    (its signature is unreadable or it needs an argument that is not offered).

    >>> call_plan(lambda output, layer: None, ("output", "layer", "inputs"))
    (('output', 'layer'), ())
    >>> call_plan(lambda out, *, layer: None, ("output", "layer", "inputs"))
    (('output',), (('layer', 'layer'),))
    """
    import inspect

    from ._invoke import invoke_with_optional_args

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    got: list[Any] = []

    def spy(*args: Any, **kwargs: Any) -> None:
        got.append((args, kwargs))

    spy.__signature__ = sig  # type: ignore[attr-defined]
    spy.__name__ = getattr(fn, "__name__", type(fn).__name__)
    try:
        invoke_with_optional_args(spy, **{n: _Token(n) for n in names})
    except TypeError:
        return False
    args, kwargs = got[0]
    if not all(isinstance(a, _Token) for a in (*args, *kwargs.values())):
        return False
    return tuple(a.name for a in args), tuple((k, v.name) for k, v in kwargs.items())


# -- traceable helpers ------------------------------------------------------------------------
def copy_tree(x: Any, clone: bool, detach: bool) -> Any:
    """``recursive_copy(x, clone, detach)`` written with ops dynamo traces (no native call).

    >>> t = torch.ones(2, requires_grad=True)
    >>> y = copy_tree({"a": t}, clone=True, detach=True)
    >>> y["a"].requires_grad, y["a"] is t
    (False, False)
    """
    if not clone and not detach:
        return x

    def one(t: torch.Tensor) -> torch.Tensor:
        if detach:
            t = t.detach()
        return t.clone() if clone else t

    if isinstance(x, torch.Tensor):
        return one(x)
    return pytree.tree_map_only(torch.Tensor, one, x)


def unwrap_compiled(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) compiled; others unchanged.

    Layer names then resolve as in the eager model (``'h.0'``, not ``'_orig_mod.h.0'``).

    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> unwrap_compiled(torch.compile(net, backend="eager")) is net
    True
    """
    inner = module._modules.get("_orig_mod")
    if type(module).__name__ == "OptimizedModule" and isinstance(inner, nn.Module):
        return inner
    return module


def _raise(exc: BaseException) -> None:
    raise exc


def _call(fn: Callable[[], Any]) -> Any:
    return fn()


_raise_outside: Callable[[BaseException], None] | None = None
_call_outside: Callable[[Callable[[], Any]], Any] | None = None


def call_outside(fn: Callable[[], Any]) -> Any:
    """Call ``fn()`` in eager Python (a graph break when reached from compiled code).

    >>> call_outside(lambda: 3)
    3
    """
    global _call_outside
    if _call_outside is None:
        import torch._dynamo

        _call_outside = torch._dynamo.disable(_call)
    return _call_outside(fn)


def raise_outside(exc: BaseException) -> None:
    """Raise ``exc`` in eager Python: a stop inside compiled code ends the graph here.

    An exception escaping a frame makes dynamo give up on the whole frame (no graph at all);
    raising from a ``torch._dynamo.disable``-d function instead compiles the forward up to this
    point (one graph break, at the stop) and skips the layers after it, as in eager.

    >>> try:
    ...     raise_outside(KeyError("x"))
    ... except KeyError:
    ...     print("raised")
    raised
    """
    global _raise_outside
    if _raise_outside is None:
        import torch._dynamo

        _raise_outside = torch._dynamo.disable(_raise)
    _raise_outside(exc)
