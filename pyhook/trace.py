"""nethook's tracers: :class:`Trace` hooks one layer, :class:`TraceDict` several.

Both are drop-in replacements for baukit's (``import pyhook as nethook``), with these fixes:

* exiting a ``stop=True`` block when the layer never ran is clean (no ``TypeError``);
* a tracer swallows only its own :class:`StopForward`;
* ``TraceDict(stop=True)`` stops once *every* listed layer has run, whatever the order;
* registration is atomic: a bad name or option raises before any hook stays registered;
* ``edit_output`` returning ``None`` means "unchanged" (the output is still retained);
* keyword arguments are captured (``input_kw``); ``edit_output`` may declare ``inputs_kw``;
* ``keep_calls=True`` keeps every call of the layer in order (``.calls``), not only the last.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ._checkpointing import note_edit, refuse_lost, take_lost
from ._compiled import call_plan, copy_tree, dispatcher_of, raise_outside, unwrap_compiled
from ._copy import recursive_copy
from ._hooks import HookSet, StopForward, check_not_compiled, is_own_stop
from ._invoke import accepts_argument, invoke_with_optional_args
from .modules import resolve_module
from .points import Point, module_path, resolve_targets

__all__ = ["CallRecord", "Trace", "TraceDict"]

_MISSING = object()


@dataclass
class CallRecord:
    """One call of a traced layer, kept when the tracer was made with ``keep_calls=True``.

    ``step`` counts the calls of that layer since the tracer was entered (0, 1, 2, ...), so a
    ``generate`` loop gives one record per decoding step, in order.

    Example::

        >>> import torch, pyhook
        >>> lin = torch.nn.Linear(2, 2)
        >>> with pyhook.Trace(lin, keep_calls=True) as t:
        ...     _ = lin(lin(torch.ones(1, 2)))
        >>> [c.step for c in t.calls], torch.equal(t.calls[1].output, t.output)
        ([0, 1], True)
    """

    step: int
    output: Any = None
    input: Any = None
    input_kw: dict[str, Any] = field(default_factory=dict)


def _weak_callable(fn: Callable[..., Any]) -> Callable[[], Callable[..., Any] | None]:
    if inspect.ismethod(fn):
        return weakref.WeakMethod(fn)
    return lambda: fn


def _check_flag(name: str, value: Any, layer: str | None = None) -> bool:
    if value is None or isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    where = f" for layer {layer!r}" if layer is not None else ""
    raise TypeError(f"{name}{where} must be a bool, got {type(value).__name__}: {value!r}")


def _lost_edits(owner: Any, exc_type: Any) -> None:
    """At a block's end: refuse edits made in a checkpointed layer that no backward in the block
    went through (a later backward recomputes the layer with the hooks gone: without the edit)."""
    lost = take_lost(owner)
    if exc_type is None:
        refuse_lost(
            lost,
            owner.__dict__.get("_edit_what", "edit_output"),
            owner.__dict__.get("_edit_hint", "Run the backward inside the block"),
        )


class _Entries:
    """Nesting depth of a tracer's ``with`` blocks, and the thread that entered them.

    Nested entries of one tracer on its thread are counted, so its hooks stay until the
    outermost block exits (as :class:`~pyhook.TraceMultiple`'s); an entry from another thread
    while it is entered is refused, since its hooks act on the entering thread's forwards.
    """

    __slots__ = ("depth", "thread", "tracer")

    def __init__(self, tracer: object) -> None:
        self.tracer = weakref.ref(tracer)
        self.depth = 0
        self.thread: int | None = None

    def enter(self) -> bool:
        """Count an entry; True for the outermost one."""
        tid = threading.get_ident()
        if self.depth:
            tracer = self.tracer()
            if self.thread != tid and not getattr(tracer, "_any_thread", False):
                raise RuntimeError(
                    f"{tracer!r} is already entered on another thread, and its hooks act on "
                    "that thread's forwards only: make one tracer per thread (or pass "
                    "any_thread=True to record every thread's forwards)"
                )
            self.depth += 1
            return False
        self.depth, self.thread = 1, tid
        return True

    def exit(self) -> bool:
        """Count an exit; True for the outermost one (then the hooks must go)."""
        self.depth = max(self.depth - 1, 0)
        return self.depth == 0

    def reset(self) -> None:
        self.depth, self.thread = 0, None


class Trace(contextlib.AbstractContextManager):
    """Retain (and optionally edit) the output of one named layer during a forward pass.

    Example::

        >>> import torch, pyhook
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
        >>> x = torch.randn(5, 4)
        >>> with pyhook.Trace(net, "1", retain_input=True, clone=True) as ret:
        ...     _ = net(x)
        >>> torch.equal(ret.output, torch.relu(ret.input))
        True

    Arguments (nethook's): ``layer`` is a dotted name (``''`` is ``module`` itself; a submodule
    object is accepted too), ``retain_output``/``retain_input`` choose what is kept, ``clone``,
    ``detach`` and ``retain_grad`` are applied to what is kept (see :func:`recursive_copy`),
    ``edit_output`` is called as ``fn(output, layer, inputs)`` with only the arguments it declares
    (and ``inputs_kw`` when it declares it) and its return value replaces the output (``None``
    keeps it), and ``stop=True`` ends the forward right after this layer.

    Keyword-only extras: ``keep_calls=True`` keeps every call in ``.calls`` (a list of
    :class:`CallRecord`); ``any_thread=True`` also records forwards run on other threads.

    The hook is registered on construction (as in nethook: a Trace used without ``with`` stays
    registered until :meth:`close`) and removed on exit; entering a closed Trace registers it
    again, so one Trace object can be reused. Entering it again inside its own block (nested,
    same thread) is allowed: the hook stays until the outermost block exits. While it is
    entered on one thread, entering it on another raises ``RuntimeError`` (its hook acts on
    the first thread's forwards only: make one Trace per thread, or pass ``any_thread=True``).
    """

    # Class-level defaults: a TraceDict's layers keep in their own __dict__ only what differs
    # (a small dict per layer is cheaper to make; see TraceDict._make_traces).
    retain_output = True
    retain_input = False
    clone = False
    detach = False
    retain_grad = False
    stop = False
    keep_calls = False
    edit_output: Callable[..., Any] | None = None
    registered_hook: Any = None
    _edit_takes_kw = False
    _edit_plan: Any = None
    _plain = True
    _copies = False
    _on_call: Any = None
    _owner_ref: Any = None
    _any_thread = False
    _handle: Any = None
    _entries: _Entries | None = None
    _parent: Any = None

    def __init__(
        self,
        module: nn.Module,
        layer: str | nn.Module | None = None,
        retain_output: bool = True,
        retain_input: bool = False,
        clone: bool = False,
        detach: bool = False,
        retain_grad: bool = False,
        edit_output: Callable[..., Any] | None = None,
        stop: bool = False,
        *,
        keep_calls: bool = False,
        any_thread: bool = False,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        module = unwrap_compiled(module)
        if layer is None:
            self.layer: str | None = None
            target = module
        elif isinstance(layer, (str, nn.Module)):
            hits = resolve_targets(module, layer)  # a standard point (pyhook.points), or None
            if hits is None:
                self.layer, target = resolve_module(module, layer)
            elif len(hits) == 1:
                self.layer, target = hits[0]
            else:
                raise ValueError(
                    f"layer {layer!r} names {len(hits)} standard points; Trace takes one "
                    "(use TraceDict for several)"
                )
        else:
            raise TypeError(
                f"layer must be a dotted module name (str), a submodule or None, "
                f"got {type(layer).__name__}: {layer!r}"
            )
        if edit_output is not None and not callable(edit_output):
            where = f" for layer {self.layer!r}" if self.layer is not None else ""
            raise TypeError(
                f"edit_output{where} must be callable or None, got {type(edit_output).__name__}"
            )
        flags = {
            opt: _check_flag(opt, value, self.layer)
            for opt, value in (
                ("retain_output", retain_output),
                ("retain_input", retain_input),
                ("clone", clone),
                ("detach", detach),
                ("retain_grad", retain_grad),
                ("stop", stop),
                ("keep_calls", keep_calls),
            )
        }
        # Options are validated first: a compiled model gets its dispatcher only for a tracer
        # that will run (installing one may drop dynamo's compiled code).
        check_not_compiled(module, module_path(self.layer, target), who="Trace")
        self._setup(target, flags, edit_output, any_thread, None, None, model=module)

    def _setup(
        self,
        target: nn.Module,
        flags: dict[str, bool],
        edit_output: Any,
        any_thread: bool,
        on_call: Any,
        stop_owner: object,
        *,
        model: nn.Module | None = None,
    ) -> None:
        self._settings(flags, edit_output, any_thread, on_call, stop_owner)
        self.module = target
        self._hooks = HookSet(any_thread=any_thread, model=model)
        self._register(checked=True)

    def _settings(
        self,
        flags: dict[str, bool],
        edit_output: Any,
        any_thread: bool,
        on_call: Any,
        stop_owner: object,
    ) -> None:
        """The state every layer with these settings shares (TraceDict copies it per layer)."""
        self.retain_output = flags["retain_output"]
        self.retain_input = flags["retain_input"]
        self.clone = flags["clone"]
        self.detach = flags["detach"]
        self.retain_grad = flags["retain_grad"]
        self.stop = flags["stop"]
        self.keep_calls = flags["keep_calls"]
        self.edit_output = edit_output
        self._edit_takes_kw = edit_output is not None and accepts_argument(edit_output, "inputs_kw")
        self._edit_plan = None  # made on the compiled path (see _register)
        # Only the output is kept, as it is or copied: one short hook (the common case).
        self._plain = self.retain_output and not (
            self.retain_input
            or self.retain_grad
            or self.keep_calls
            or self.stop
            or edit_output is not None
            or on_call is not None
        )
        self._copies = self.clone or self.detach
        self.calls: list[CallRecord] = []
        # Weak references to a TraceDict that owns this Trace: no reference cycle, so dropping
        # a closed tracer frees its activations at once (without waiting for the gc).
        self._on_call = None if on_call is None else _weak_callable(on_call)
        self._owner_ref = None if stop_owner is None else weakref.ref(stop_owner)
        self._any_thread = any_thread
        self._handle = None  # the registered hook's handle (None: never registered)
        self._entries = None  # made on first entry (TraceDict counts its own)
        self._parent = None  # a TraceDict's weak reference, for its layers

    # -- hook -----------------------------------------------------------------------------
    def _register(self, checked: bool = False) -> None:
        self.calls = []
        hook = self._hook_plain if self._plain else self._hook
        if dispatcher_of(self.module) is not None and not (self.retain_grad or self.keep_calls):
            # A module of a compiled model: the hook is inlined by dynamo, so it must trace
            # without breaks (retain_grad and keep_calls keep the eager hook: exact, not fast).
            if self.edit_output is not None and self._edit_plan is None:
                names = (
                    "output",
                    "layer",
                    "inputs",
                    *(("inputs_kw",) if self._edit_takes_kw else ()),
                )
                self._edit_plan = call_plan(self.edit_output, names)
            if self.edit_output is None or self._edit_plan is not False:
                hook = self._hook_compiled
        self._handle = self._hooks.forward(
            self.module,
            hook,
            with_kwargs=True,
            checked=checked,
            inputs=self.retain_input or self.edit_output is not None,
            name=self.layer,
        )
        self.registered_hook = self._handle

    @property
    def _active(self) -> bool:
        handle = self._handle
        return handle is not None and handle.alive

    def _hook_plain(
        self, _module: nn.Module, _args: tuple[Any, ...], _kwargs: dict[str, Any], output: Any
    ) -> None:
        """:meth:`_hook` when only the output is kept (returns None: the output is unchanged)."""
        if self._copies:
            output = recursive_copy(output, self.clone, self.detach, False)
        self.output = output

    def _hook_compiled(
        self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        """:meth:`_hook` in code dynamo traces without graph breaks (compiled models)."""
        if self.edit_output is not None:
            positional, keywords = self._edit_plan
            values = {"output": output, "layer": self.layer, "inputs": args, "inputs_kw": kwargs}
            edited = self.edit_output(
                *[values[n] for n in positional], **{k: values[n] for k, n in keywords}
            )
            if edited is not None:
                output = edited
        if self.retain_input:
            self.input = copy_tree(args[0] if len(args) == 1 else args, self.clone, self.detach)
            self.input_kw = copy_tree(kwargs, self.clone, self.detach)
        if self.retain_output:
            self.output = copy_tree(output, self.clone, self.detach)
        if self._on_call is not None:
            on_call = self._on_call()
            if on_call is not None:
                on_call(self.layer)
        if self.stop:
            raise_outside(StopForward(owner=self._stop_owner))
        return output

    def _hook(
        self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        if self.edit_output is not None:
            extra = {"inputs_kw": kwargs} if self._edit_takes_kw else {}
            edited = invoke_with_optional_args(
                self.edit_output, output=output, layer=self.layer, inputs=args, **extra
            )
            if edited is not None:
                output = edited
            owner = None if self._parent is None else self._parent()  # a TraceDict's layer
            note_edit(self if owner is None else owner, self.layer, edited, self._hooks)
        record = CallRecord(len(self.calls)) if self.keep_calls else None
        if self.retain_input:
            self.input = recursive_copy(
                args[0] if len(args) == 1 else args, self.clone, self.detach, False
            )
            self.input_kw = recursive_copy(kwargs, self.clone, self.detach, False)
            if record is not None:
                record.input, record.input_kw = self.input, self.input_kw
        if self.retain_output:
            self.output = recursive_copy(output, self.clone, self.detach, self.retain_grad)
            if self.retain_grad:
                # Continue downstream with a copy, so later in-place ops cannot corrupt the
                # retained tensor and its .grad is filled by backward().
                output = recursive_copy(self.output, clone=True, detach=False)
            if record is not None:
                record.output = self.output
        if record is not None:
            self.calls.append(record)
        if self._on_call is not None:
            on_call = self._on_call()
            if on_call is not None:
                on_call(self.layer)
        if self.stop:
            raise StopForward(owner=self._stop_owner)
        return output

    @property
    def _stop_owner(self) -> object:
        return self if self._owner_ref is None else self._owner_ref()

    # -- lifetime -------------------------------------------------------------------------
    def __enter__(self) -> Trace:
        entries = self._entries
        if entries is None:
            entries = self._entries = _Entries(self)
        if entries.enter():
            # Outermost entry: the hook acts on the entering thread's forwards (re-registered
            # if it was registered, at construction, by another thread).
            try:
                if self._active and not self._hooks.owned_by_caller:
                    self._handle.remove()
                if not self._active:
                    with self._hooks.registering():
                        self._register()
            except BaseException:
                self.close()  # a failed entry leaves no hook behind (nor an entry counted)
                raise
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if self._entries is None or self._entries.exit():
            self.close()
            _lost_edits(self, exc_type)
        return self.stop and is_own_stop(exc, self._stop_owner, accept_unowned=True)

    def close(self) -> None:
        """Remove the hook (idempotent), whatever the nesting of ``with`` blocks."""
        if self._entries is not None:
            self._entries.reset()
        if self._handle is not None:
            self._handle.remove()
        if self._parent is not None:
            parent = self._parent()
            if parent is not None:
                parent._intact = False  # its next entry re-registers this layer

    def __repr__(self) -> str:
        state = "registered" if self._active else "closed"
        return f"<pyhook.Trace layer={self.layer!r} {state}>"


def _group_hook(by_module: dict[nn.Module, Trace], like: Trace) -> Callable[..., Any]:
    """One forward hook for the layers ``by_module`` (settings all like ``like``'s): it finds
    the layer's Trace from the module it is called with, so entering a block makes no
    function per layer, and keeping the output runs no method call."""
    if like._plain and not like._copies:

        def keep(module: nn.Module, _args: Any, _kwargs: Any, output: Any) -> None:
            by_module[module].output = output

        return keep
    if like._plain:
        clone, detach = like.clone, like.detach

        def keep_copy(module: nn.Module, _args: Any, _kwargs: Any, output: Any) -> None:
            by_module[module].output = recursive_copy(output, clone, detach, False)

        return keep_copy

    def run(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        return by_module[module]._hook(module, args, kwargs, output)

    return run


class TraceDict(OrderedDict, contextlib.AbstractContextManager):
    """Retain (and optionally edit) the outputs of several named layers; maps name -> Trace.

    Example::

        >>> import torch, pyhook
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
        >>> with pyhook.TraceDict(net, ["0", "2"], edit_output={"0": lambda output: output * 0}) as ret:
        ...     y = net(torch.randn(2, 4))
        >>> float(ret["0"].output.abs().sum().detach()), torch.equal(ret["2"].output, y)
        (0.0, True)

    Options are those of :class:`Trace`; any option may instead be a ``dict`` keyed by layer
    name (layers left out get ``None``, i.e. off), and keys that are not listed layers raise.
    ``stop=True`` ends the forward once every listed layer has run, whatever their order.
    Duplicate names are traced once. Hooks run in list order; :meth:`close` removes them in
    reverse order. Nested entries of one TraceDict follow :class:`Trace`'s rule: the hooks stay
    until the outermost block exits; entering it on another thread meanwhile raises.
    """

    def __init__(
        self,
        module: nn.Module,
        layers: Iterable[str | nn.Module] | None = None,
        retain_output: bool | dict[str, bool] = True,
        retain_input: bool | dict[str, bool] = False,
        clone: bool | dict[str, bool] = False,
        detach: bool | dict[str, bool] = False,
        retain_grad: bool | dict[str, bool] = False,
        edit_output: Callable[..., Any] | dict[str, Callable[..., Any]] | None = None,
        stop: bool = False,
        *,
        keep_calls: bool | dict[str, bool] = False,
        any_thread: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        module = unwrap_compiled(module)
        if layers is None or isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
            raise TypeError(
                "layers must be a list of dotted layer names, e.g. ['transformer.h.0'], "
                f"got {type(layers).__name__}: {layers!r}"
            )
        unique: dict[str, nn.Module] = {}  # ordered and deduplicated, name -> module
        for layer in layers:
            if not isinstance(layer, (str, nn.Module)):
                raise TypeError(
                    f"layers must hold layer names (str), got {type(layer).__name__}: {layer!r}"
                )
            hits = resolve_targets(module, layer)  # standard points (pyhook.points), or None
            if hits is None:
                name, target = resolve_module(module, layer)
                unique.setdefault(name, target)
            else:
                for name, target in hits:
                    unique.setdefault(name, target)
        names = list(unique)
        self.stop = _check_flag("stop", stop)
        flag_options = {
            "retain_output": retain_output,
            "retain_input": retain_input,
            "clone": clone,
            "detach": detach,
            "retain_grad": retain_grad,
            "keep_calls": keep_calls,
        }
        for opt, value in (*flag_options.items(), ("edit_output", edit_output)):
            if isinstance(value, dict):
                unknown = [k for k in value if k not in unique]
                if unknown:
                    raise KeyError(
                        f"{opt} names layers that are not traced: {unknown}; traced layers: {names}"
                    )

        def flag_for(opt: str, name: str) -> bool:
            value = flag_options[opt]
            return _check_flag(opt, value.get(name) if isinstance(value, dict) else value, name)

        def edit_for(name: str) -> Any:
            fn = edit_output.get(name) if isinstance(edit_output, dict) else edit_output
            if fn is not None and not callable(fn):
                raise TypeError(
                    f"edit_output for layer {name!r} must be callable or None, got {type(fn).__name__}"
                )
            return fn

        scalar = {o: _check_flag(o, v) for o, v in flag_options.items() if not isinstance(v, dict)}
        shared = {**scalar, "stop": False} if len(scalar) == len(flag_options) else None
        settings = []
        for name in names:  # everything is validated before the first hook is registered
            if shared is not None:
                flags = shared
            else:
                flags = {o: scalar[o] if o in scalar else flag_for(o, name) for o in flag_options}
                flags["stop"] = False
            settings.append((name, flags, edit_for(name)))
        # Only now (options valid) may compiled modules get their dispatchers (see Trace).
        for name in names:
            check_not_compiled(module, module_path(name, unique[name]), who="TraceDict")
        self._pending: set[str] = set()
        self._any_thread = any_thread
        self._entries = _Entries(self)
        self._intact = False  # every layer's hook registered, by this set's owner thread
        self._hooks = HookSet(any_thread=any_thread, model=module)
        self.module = module
        self._names = names
        try:
            self._make_traces(settings, unique, any_thread)
            if self.stop:
                self._hooks.forward_pre(module, self._forward_starts, prepend=True)
        except BaseException:
            self.close()
            raise
        self._intact = True
        self._pending = set(names)

    def _make_traces(
        self,
        settings: list[tuple[str, dict[str, bool], Any]],
        modules: dict[str, nn.Module],
        any_thread: bool,
    ) -> None:
        """One Trace per layer, registered through this TraceDict's HookSet.

        Layers with the same settings share one prototype of the per-layer state, copied with
        one ``dict.update`` (entering a block with hundreds of layers is the hot path).
        """
        on_call = self._layer_ran if self.stop else None
        parent = weakref.ref(self)
        protos: dict[tuple[int, int], tuple[dict[str, Any], list[Any]]] = {}
        new = Trace.__new__
        # One module under two names: each Trace gets its own hook (one shared hook per group
        # finds its Trace by module, see _group_hook).
        aliased = len({id(m) for m in modules.values()}) != len(modules)
        for name, flags, edit in settings:
            key = (id(flags), id(edit))  # the dicts stay alive here: ids are not reused
            group = protos.get(key)
            if group is None:
                first = new(Trace)
                first._settings(flags, edit, any_thread, on_call, self)
                first._hooks = self._hooks
                first._parent = parent
                proto = {
                    k: v
                    for k, v in first.__dict__.items()
                    if k != "calls" and getattr(Trace, k, _MISSING) is not v
                }
                group = protos[key] = (proto, [])
            trace = new(Trace)
            state = trace.__dict__
            state.update(group[0])
            state["layer"] = name
            state["module"] = module = modules[name]
            state["calls"] = []
            self[name] = trace
            if aliased or type(module) is Point or "_pyhook_dispatch" in module.__dict__:
                # (a standard point registers itself; a compiled model's module: its dispatcher)
                trace._register(checked=True)
            else:
                group[1].append(trace)
        for _proto, members in protos.values():
            if not members:
                continue
            try:
                by_module = {t.module: t for t in members}
            except TypeError:  # a module class that is not hashable
                by_module = {}
            if len(by_module) != len(members):  # (or one whose __eq__ says two are equal)
                for trace in members:
                    trace._register(checked=True)
                continue
            like = members[0]
            handles = self._hooks.forward_shared(
                list(by_module),
                _group_hook(by_module, like),
                with_kwargs=True,
                inputs=like.retain_input or like.edit_output is not None,
                names=[t.layer for t in by_module.values()],
            )
            for trace, handle in zip(members, handles):
                trace._handle = trace.registered_hook = handle

    def _forward_starts(self, _module: nn.Module, _args: Any) -> None:
        self._pending = set(self._names)

    def _layer_ran(self, name: str | None) -> None:
        self._pending.discard(name)
        if not self._pending:
            self._pending = set(self._names)
            raise StopForward(owner=self)

    def __enter__(self) -> TraceDict:
        if not self._entries.enter():
            return self  # nested entry: the hooks stay until the outermost block exits
        hooks = self._hooks
        if not (self._intact and hooks.owned_by_caller):
            # Closed before, a layer closed on its own, or registered (at construction) by
            # another thread: register every hook again, acting on this thread's forwards.
            hooks.remove()
            try:
                with hooks.registering():
                    for trace in self.values():
                        trace._register()
                    if self.stop:
                        hooks.forward_pre(self.module, self._forward_starts, prepend=True)
            except BaseException:
                self.close()
                raise
            self._intact = True
        self._pending = set(self._names)
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if self._entries.exit():
            self.close()
            _lost_edits(self, exc_type)
        return self.stop and is_own_stop(exc, self, accept_unowned=True)

    def close(self) -> None:
        """Remove every hook, in reverse order of registration (idempotent)."""
        self._entries.reset()
        self._intact = False
        self._hooks.remove()  # the layers' hooks are in this set

    def __repr__(self) -> str:
        return f"<pyhook.TraceDict layers={list(self.keys())!r}>"

    # OrderedDict pickles/copies by calling type(self)(); keep the dict behaviour for copies.
    def __reduce__(self) -> Any:  # pragma: no cover - rarely used
        return (OrderedDict, (list(self.items()),))
