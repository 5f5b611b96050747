"""deephook's tracers: ``from pyhook.deephook import Trace, TraceMultiple`` replaces
``from DeepHook import Trace, TraceMultiple``.

* :class:`Trace` hooks one layer: ``Trace(model, layer_name, retain_output=True,
  retain_input=False, edit_output=None)``; it keeps ``.output`` and ``.input``.
* :class:`TraceMultiple` hooks several: ``TraceMultiple(model, {name: (retain_output,
  retain_input, edit_fn)})``; ``tm[name]`` is that layer's :class:`Trace`.

Two tracers are called ``Trace`` in the tools pyhook replaces. ``pyhook.Trace`` is nethook's
(``Trace(module, layer, retain_output, retain_input, clone, detach, retain_grad, edit_output,
stop)``, raw outputs by default); deephook's, whose 4th positional argument is ``edit_output``
and which always keeps detached clones, lives here as ``pyhook.deephook.Trace``.
:class:`TraceMultiple` has no nethook namesake and is also exported as ``pyhook.TraceMultiple``.

Differences from deephook (its bugs, fixed):

* retained values are detached clones of *every* tensor, whatever the container (lists, dicts,
  namedtuples, dataclasses, ``ModelOutput``; containers keep their type);
* a :class:`TraceMultiple` registers its hooks on entry and removes them on exit, so it can be
  entered, or used as a decorator, any number of times; nothing is registered before entry, and
  a failure while registering leaves nothing registered;
* settings tuples longer than 3, bad flags, non-callable or wrongly shaped edit functions and
  unknown layer names raise at construction, naming the layer;
* ``retain_input`` on a call with keyword arguments only gives ``input = None`` (deephook raised
  ``IndexError`` inside the forward); keyword arguments are kept in ``input_kw``.

``edit_output`` is called as ``edit_output(output, layer_name)`` (as deephook does; deephook's
README shows a one-argument function, which deephook itself cannot call); returning ``None``
keeps the output unchanged. The retained output is the edited one.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from ._checkpointing import note_edit, refuse_lost, take_lost
from ._compiled import copy_tree, dispatcher_of, unwrap_compiled
from ._copy import recursive_copy
from ._hooks import HookSet, check_not_compiled
from .modules import resolve_module
from .trace import _Entries

__all__ = ["Trace", "TraceMultiple"]

EditFn = Callable[[Any, str], Any]


def _check_flag(name: str, value: Any, layer: str) -> bool:
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise TypeError(
        f"{name} for layer {layer!r} must be a bool, got {type(value).__name__}: {value!r}"
    )


def _check_edit(edit_output: Any, layer: str) -> None:
    if edit_output is None:
        return
    if not callable(edit_output):
        raise TypeError(
            f"edit_output for layer {layer!r} must be callable or None, "
            f"got {type(edit_output).__name__}"
        )
    try:
        sig = inspect.signature(edit_output)
    except (TypeError, ValueError):  # builtins without a signature: trust them
        return
    try:
        sig.bind(None, None)
    except TypeError:
        name = getattr(edit_output, "__name__", type(edit_output).__name__)
        raise TypeError(
            f"edit_output for layer {layer!r} is called as edit_output(output, layer_name), "
            f"but {name}{sig} does not take two positional arguments"
        ) from None


def _refuse_lost(traces: Iterable[Trace], exc_type: Any, what: str) -> None:
    """After the hooks of ``traces`` are removed: refuse their edits made in activation-
    checkpointed layers that no backward went through (unless the block ends by an error)."""
    lost = [name for trace in traces for name in take_lost(trace)]
    if exc_type is None:
        refuse_lost(lost, what, "Run the backward inside the block")


def _copy(x: Any) -> Any:
    return recursive_copy(x, clone=True, detach=True)


class Trace(contextlib.AbstractContextManager):
    """deephook's single-layer tracer: keep (and optionally edit) one layer's output and input.

    Example::

        >>> import torch
        >>> from pyhook.deephook import Trace
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
        >>> def zero(output, layer_name):
        ...     return output * 0
        >>> with Trace(net, "0", retain_input=True, edit_output=zero) as t:
        ...     y = net(torch.randn(2, 4))
        >>> float(y.detach().abs().sum()), t.output.requires_grad, t.input.shape
        (0.0, False, torch.Size([2, 4]))

    As in deephook, the hook is registered when the Trace is made and removed on exit; entering
    a closed Trace registers it again. Nested entries of one Trace keep the hook until the
    outermost exits (entering it on another thread meanwhile raises ``RuntimeError``). ``.output`` is a detached clone of the (edited) output,
    ``.input`` a detached clone of the first positional argument (``None`` if there is none),
    ``.input_kw`` a detached clone of the keyword arguments. ``layer_name`` is a dotted name
    (a submodule object is accepted too). ``any_thread=True`` (keyword-only) also records
    forwards run on other threads than the one that registered the hook.
    """

    def __init__(
        self,
        model: nn.Module,
        layer_name: str | nn.Module,
        retain_output: bool = True,
        retain_input: bool = False,
        edit_output: EditFn | None = None,
        *,
        any_thread: bool = False,
        _register: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(layer_name, (str, nn.Module)):
            raise TypeError(
                "layer_name must be a dotted module name (str), "
                f"got {type(layer_name).__name__}: {layer_name!r}"
            )
        model = unwrap_compiled(model)  # names resolve as in the eager model
        name, layer = resolve_module(model, layer_name)
        check_not_compiled(model, name, who="deephook.Trace")
        self.model = model
        self.layer_name = layer_name if isinstance(layer_name, str) else name
        self.layer = layer
        self.retain_output = _check_flag("retain_output", retain_output, self.layer_name)
        self.retain_input = _check_flag("retain_input", retain_input, self.layer_name)
        _check_edit(edit_output, self.layer_name)
        self.edit_output = edit_output
        self.output: Any = None
        self.input: Any = None
        self.input_kw: dict[str, Any] | None = None
        self.hook: RemovableHandle | None = None
        self._any_thread = any_thread
        self._hooks = HookSet(any_thread=any_thread, model=model)
        self._entries = _Entries(self)
        if _register:
            self._open()

    def get_layer(self) -> nn.Module:
        """The hooked layer."""
        return self.layer

    def _open(self) -> None:
        with self._hooks.registering():
            hook = self._hook_compiled if dispatcher_of(self.layer) is not None else self._hook
            self.hook = self._hooks.forward(self.layer, hook, with_kwargs=True)

    def _hook_compiled(
        self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        # _hook with copies dynamo traces (a layer of a compiled model)
        if self.retain_input:
            self.input = copy_tree(args[0], True, True) if args else None
            self.input_kw = copy_tree(kwargs, True, True)
        if self.edit_output is not None:
            edited = self.edit_output(output, self.layer_name)
            if edited is not None:
                output = edited
        if self.retain_output:
            self.output = copy_tree(output, True, True)
        return output

    def _hook(
        self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        if self.retain_input:
            self.input = _copy(args[0]) if args else None
            self.input_kw = _copy(kwargs)
        if self.edit_output is not None:
            edited = self.edit_output(output, self.layer_name)
            if edited is not None:
                output = edited
            note_edit(self, self.layer_name, edited, self._hooks)
        if self.retain_output:
            self.output = _copy(output)
        return output

    def hook_fn(self, module: nn.Module, input: tuple[Any, ...], output: Any) -> Any:
        """deephook's hook body, callable directly: retain, edit, return the (edited) output."""
        return self._hook(module, input, {}, output)

    @staticmethod
    def clone_detach(x: Any) -> Any:
        """Detached clone of every tensor in ``x`` (containers keep their type)."""
        return _copy(x)

    def __enter__(self) -> Trace:
        # Nested entries on one thread keep the hook until the outermost exit (as nethook's
        # Trace in pyhook); an outermost entry re-registers a hook another thread registered.
        if self._entries.enter():
            if self._hooks.active and not self._hooks.owned_by_caller:
                self._hooks.remove()
            if not self._hooks.active:
                self.output = self.input = self.input_kw = None
                self._open()
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if self._entries.exit():
            self.close()
            _refuse_lost([self], exc_type, "edit_output")

    def close(self) -> None:
        """Remove the hook (idempotent), whatever the nesting of ``with`` blocks."""
        self._entries.reset()
        self._hooks.remove()

    @property
    def active(self) -> bool:
        """Whether the hook is registered."""
        return self._hooks.active

    def __repr__(self) -> str:
        state = "registered" if self._hooks.active else "closed"
        return f"<pyhook.deephook.Trace layer_name={self.layer_name!r} {state}>"


class TraceMultiple(contextlib.ContextDecorator):
    """deephook's multi-layer tracer, a context manager and a decorator.

    ``layer_settings`` maps layer names to tuples ``(retain_output, retain_input, edit_fn)``
    of 0 to 3 items (missing items take the defaults ``True, False, None``). ``tm[name]`` is the
    :class:`Trace` of that layer, with ``.output`` and ``.input``.

    Example::

        >>> import torch
        >>> from pyhook.deephook import TraceMultiple
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
        >>> def plus_one(output, layer_name):
        ...     return output + 1
        >>> with TraceMultiple(net, {"0": (True, False, plus_one), "2": (True, True)}) as tm:
        ...     y = net(torch.randn(5, 4))
        >>> torch.equal(tm["2"].input, torch.relu(tm["0"].output)), torch.equal(tm["2"].output, y)
        (True, True)

    Hooks are registered on entry (in settings order, all or none) and removed on exit, so a
    TraceMultiple can be entered, or used as a decorator, any number of times; each entry starts
    with empty ``.output``/``.input``, and the values of the last forward stay readable after
    exit. Nested entries of the same object on one thread register once (the hooks go when the
    outermost exits).

    Entries on several threads at once (e.g. a decorated function called from a thread pool)
    are independent: each thread registers its own hooks, which act on its own forwards, and
    while it is inside, ``tm[name]`` is its own :class:`Trace`. After the last exit, ``tm[name]``
    shows the captures of the entry that exited last.
    """

    def __init__(
        self,
        model: nn.Module,
        layer_settings: Mapping[str, tuple[Any, ...]],
        *,
        any_thread: bool = False,
    ) -> None:
        if not isinstance(layer_settings, Mapping):
            raise TypeError(
                "layer_settings must be a dict "
                "{layer name: (retain_output, retain_input, edit_fn)}, "
                f"got {type(layer_settings).__name__}"
            )
        traces: dict[str, Trace] = {}
        for name, settings in layer_settings.items():
            if isinstance(settings, (str, bytes)) or not isinstance(settings, (tuple, list)):
                raise TypeError(
                    f"settings for layer {name!r} must be a tuple "
                    "(retain_output, retain_input, edit_fn), "
                    f"got {type(settings).__name__}: {settings!r}"
                )
            if len(settings) > 3:
                raise TypeError(
                    f"settings for layer {name!r} must have 0 to 3 items "
                    "(retain_output, retain_input, "
                    f"edit_fn), got {len(settings)}: {settings!r}"
                )
            traces[name] = Trace(model, name, *settings, any_thread=any_thread, _register=False)
        self.model = model
        self._settings = dict(layer_settings)
        self._any_thread = any_thread
        self._primary = traces  # the first thread inside uses these; others get their own
        self._last = traces  # shown to threads that are not inside
        # thread ident -> (nesting depth, that thread's traces), for threads inside a block
        self._inside: dict[int, tuple[int, dict[str, Trace]]] = {}
        self._lock = threading.Lock()

    @property
    def traces(self) -> dict[str, Trace]:
        """``{layer name: Trace}`` of the calling thread's entry (or of the last entry)."""
        entry = self._inside.get(threading.get_ident())
        return self._last if entry is None else entry[1]

    def _own_traces(self) -> dict[str, Trace]:
        """Traces for a thread entering while another thread is inside (same settings)."""
        return {
            name: Trace(self.model, name, *settings, any_thread=self._any_thread, _register=False)
            for name, settings in self._settings.items()
        }

    def __enter__(self) -> TraceMultiple:
        tid = threading.get_ident()
        with self._lock:
            depth, traces = self._inside.get(tid, (0, self._primary))
            if depth == 0 and any(t is self._primary for _, t in self._inside.values()):
                traces = self._own_traces()
            self._inside[tid] = (depth + 1, traces)
        if depth == 0:
            try:
                for trace in traces.values():
                    trace.output = trace.input = trace.input_kw = None
                    trace._open()  # the hooks are owned by (act on) this thread
            except BaseException:
                self._leave(tid, closing=True)
                raise
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self._leave(threading.get_ident(), closing=False, exc_type=exc_type)

    def _leave(self, tid: int, closing: bool, exc_type: Any = None) -> None:
        with self._lock:
            entry = self._inside.pop(tid, None)
            if entry is None:
                return
            depth, traces = entry
            if depth > 1 and not closing:
                self._inside[tid] = (depth - 1, traces)
                return
            self._last = traces
        for trace in reversed(list(traces.values())):
            trace.close()
        _refuse_lost(traces.values(), BaseException if closing else exc_type, "edit_fn")

    def close(self) -> None:
        """Remove every hook of every thread's entry, newest first (idempotent)."""
        with self._lock:
            entries = [traces for _, traces in self._inside.values()]
            self._inside.clear()
        for traces in [*entries, self._primary]:
            for trace in reversed(list(traces.values())):
                trace.close()

    def __getitem__(self, layer_name: str) -> Trace:
        return self.traces[layer_name]

    def __contains__(self, layer_name: object) -> bool:
        return layer_name in self.traces

    def __iter__(self) -> Iterator[str]:
        return iter(self.traces)

    def __len__(self) -> int:
        return len(self.traces)

    def keys(self) -> Any:
        """The traced layer names."""
        return self.traces.keys()

    def values(self) -> Any:
        """The :class:`Trace` objects."""
        return self.traces.values()

    def items(self) -> Any:
        """``(layer name, Trace)`` pairs."""
        return self.traces.items()

    def __repr__(self) -> str:
        return f"<pyhook.deephook.TraceMultiple layers={list(self.traces)!r}>"
