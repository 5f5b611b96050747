"""The one mechanism every pyhook tracer uses to register hooks, stop a forward and copy outputs.

* :class:`HookSet` registers hooks as a unit: if anything fails while a set is being built,
  everything registered so far is removed (``with hooks.registering(): ...``), and
  :meth:`HookSet.remove` removes them all, in reverse order, exactly once.
* Forward hooks of a set only act on the forwards of the thread that created the set, so two
  threads tracing one model each see their own forward (``any_thread=True`` lifts this, e.g.
  for ``nn.DataParallel`` replicas that run in worker threads). A forward that autograd
  recomputes during a backward (activation checkpointing) belongs to the thread whose forward
  is being recomputed, whichever thread runs the backward: see :func:`forward_owner_matches`.
* :class:`StopForward` carries the identity of the tracer that raised it (``owner``) and an
  optional ``payload``: a tracer swallows only its own stop; anyone else's propagates.
* Forward hooks go straight into the module's hook dicts (torch's order and semantics, a
  cheaper handle, bulk registration and removal), and every module lists pyhook's keys so that
  ``copy.deepcopy`` of a model inside a tracer's block gives a copy without them.
"""

from __future__ import annotations

import inspect
import itertools
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ._compiled import COMPILED_MARK, CompiledModelError
from .distributed import _layouts_active, layout_hook, note_model
from .points import Point

__all__ = [
    "CompiledModelError",
    "HookSet",
    "StopForward",
    "check_not_compiled",
    "compiled_path",
    "is_own_stop",
]


class StopForward(Exception):
    """Raised from a hook to end a forward pass early, once the wanted layer has run.

    A tracer created with ``stop=True`` raises it after its layer(s) ran and catches it on exit
    of its ``with`` block, so the code after ``model(x)`` inside the block is skipped:

    Example::

        >>> import torch, pyhook
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
        >>> with pyhook.Trace(net, "0", stop=True) as tr:
        ...     net(torch.randn(1, 4))  # runs only up to layer '0'
        >>> tr.output.shape
        torch.Size([1, 3])

    ``owner`` identifies the tracer that raised it (a tracer swallows only its own stops; a
    ``StopForward()`` raised by user code, with no owner, is swallowed by the innermost tracer
    that has ``stop=True``, as in nethook) and ``payload`` may carry the intercepted value.
    """

    def __init__(self, *args: Any, owner: object = None, payload: Any = None) -> None:
        super().__init__(*args)
        self.owner = owner
        self.payload = payload


def is_own_stop(exc: BaseException | None, owner: object, accept_unowned: bool = False) -> bool:
    """True when ``exc`` is a :class:`StopForward` raised by ``owner`` (or unowned, if accepted)."""
    if not isinstance(exc, StopForward):
        return False
    return exc.owner is owner or (accept_unowned and exc.owner is None)


def _compile_marker(module: nn.Module) -> str | None:
    """How ``module`` was compiled, or None (no import of torch._dynamo: markers imply it)."""
    # __dict__ lookups: a missing attribute through nn.Module.__getattr__ costs microseconds
    d = module.__dict__
    if d.get("_compiled_call_impl") is not None:
        return "module.compile()"
    if (
        d.get("_is_torch_compile", False)
        or COMPILED_MARK in d  # unwrapped from a wrapper (pyhook._compiled.unwrap_compiled)
        or (type(module).__name__ == "OptimizedModule" and "_orig_mod" in module._modules)
    ):
        return "torch.compile(module)"
    return None


def _dispatcher_for(module: nn.Module) -> Any:
    """The dispatcher hooks on ``module`` go through: installed on a compiled module, or None."""
    dispatch = module.__dict__.get("_pyhook_dispatch")
    if dispatch is None and _compile_marker(module) is not None:
        from . import _compiled

        dispatch = _compiled.prepare(module)
    return dispatch


def compiled_path(root: nn.Module, name: str | None = None) -> str | None:
    """How ``root`` or a module on the dotted path to ``name`` was compiled (None: eager).

    >>> import torch
    >>> compiled_path(torch.nn.Sequential(torch.nn.Linear(2, 2)), "0") is None  # eager
    True
    """
    if "torch._dynamo" not in sys.modules:
        return None  # nothing in this process was compiled (runs for every traced layer: keep it cheap)
    how = _compile_marker(root)
    if how is None and name:
        mod: nn.Module | None = root
        for part in name.split("."):
            mod = mod._modules.get(part)  # type: ignore[union-attr]
            if mod is None:
                break
            how = _compile_marker(mod)
            if how is not None:
                break
    return how


def check_not_compiled(root: nn.Module, name: str | None = None, *, who: str = "pyhook") -> None:
    """Make hooks on ``root``'s submodule ``name`` visible to compiled code, if it is compiled.

    ``root`` and every module on the dotted path to ``name`` (``None``/``''``: ``root`` itself)
    are checked for the marks ``torch.compile(m)`` and ``m.compile()`` leave; if one is found,
    the target module gets its persistent dispatcher (:func:`pyhook._compiled.prepare`), through
    which :class:`HookSet` then registers. (The name is historical: compiled models used to be
    refused.)

    >>> import torch
    >>> check_not_compiled(torch.nn.Sequential(torch.nn.Linear(2, 2)), "0")  # eager: nothing to do
    """
    if compiled_path(root, name) is None:
        return
    target: nn.Module | None = root
    for part in name.split(".") if name else ():
        target = target._modules.get(part)  # type: ignore[union-attr]
        if target is None:
            return  # the caller resolves names and reports bad ones
    from . import _compiled

    _compiled.prepare(target)  # type: ignore[arg-type]


# -- whose forward is this? -------------------------------------------------------------------
# During a backward, a module's forward runs again when activation checkpointing recomputes it
# (torch.utils.checkpoint, reentrant or not), on whichever thread runs the backward: the one
# that called .backward(), or on CUDA one of autograd's device threads. The thread running it
# says nothing about whose forward it is. The autograd graph does: every autograd Node records
# the id of the thread whose forward created it (``Node::thread_id``, what the profiler uses to
# pair backward ops with forward ops), and during a recomputation the engine is running a node
# of the forward being recomputed (the reentrant CheckpointFunction's node, or the node whose
# saved tensors the non-reentrant checkpoint is unpacking). The native module reads both ids.

_engine_ids = threading.local()


def _engine_thread_id() -> int:
    """The autograd engine's id of the calling thread, or 0 without the native module."""
    try:
        value: int = _engine_ids.value
        return value
    except AttributeError:
        from . import _backend

        value = int(torch.ops.pyhook.thread_id()) if _backend.native_available() else 0
        _engine_ids.value = value
        return value


def _running_node_thread_id() -> int:
    """The engine's id of the thread whose forward created the node being run here, or 0."""
    return int(torch.ops.pyhook.autograd_node_thread_id()) if _engine_thread_id() else 0


# Per thread: the owners whose forward this thread is recomputing right now (engine ids). A
# nested checkpoint's inner node is created during the outer recomputation, on the thread
# running it, so it names that thread rather than the owner of the forward.
_recomputing = threading.local()


def _recomputing_for() -> set[int]:
    try:
        owners: set[int] = _recomputing.owners
    except AttributeError:
        owners = _recomputing.owners = set()
    return owners


def forward_owner_matches(owner_ident: int, owner_engine_id: int) -> bool:
    """Whether the forward running on this thread *during a backward* is the owner's.

    ``owner_ident`` is the owner's :func:`threading.get_ident`, ``owner_engine_id`` its
    :func:`_engine_thread_id`. A forward run during a backward is a recomputation (activation
    checkpointing) of the forward that created the autograd node being run, so it is the
    owner's iff that node was created by the owner's thread -- or, for checkpoints nested in
    checkpoints, by this thread while it was recomputing the owner's forward. When no node is
    running (e.g. a forward called from a backward hook) the running thread decides. Without
    the native module, which alone can read a node's thread, every recomputation is taken as
    the owner's (edits then also apply to other threads' checkpointed recomputations).

    >>> forward_owner_matches(threading.get_ident(), _engine_thread_id())  # no backward: ours
    True
    """
    if not owner_engine_id:
        return True
    node_thread = _running_node_thread_id()
    if not node_thread:
        return threading.get_ident() == owner_ident
    owners = _recomputing_for()
    if node_thread == owner_engine_id:
        owners.add(owner_engine_id)
        return True
    if owner_engine_id in owners and node_thread == _engine_thread_id():
        return True  # created here while recomputing the owner's forward: a nested checkpoint
    owners.discard(owner_engine_id)
    return False


def forget_recomputation(owner_engine_id: int) -> None:
    """This thread runs a forward of its own: it no longer recomputes the owner's forward."""
    owners = _recomputing_for()
    if owners:
        owners.discard(owner_engine_id)


# -- eager registrations ------------------------------------------------------------------
# pyhook's hooks go straight into a module's hook dicts (what ``register_forward_hook`` does,
# without the three weak references its RemovableHandle makes: registering and removing many
# hooks per ``with`` block is the tracers' hot path). Their keys are negative, so they never
# collide with torch's handle ids (0, 1, 2, ...). Every key is also listed in the module's
# ``_Registry`` (``module.__dict__['_pyhook_hooks']``, present only while pyhook has hooks on
# the module): ``copy.deepcopy`` copies it after the hook dicts (it is the last entry of the
# module's ``__dict__``), and it takes pyhook's hooks out of the copies, so a model deep-copied
# inside a tracer's block comes without the tracer's hooks.

_REGISTRY = "_pyhook_hooks"
_next_key = itertools.count(-1, -1).__next__  # C-level, so safe without a lock
_registry_lock = threading.Lock()  # adds/drops the per-module registry entry atomically


class _Registry(dict):  # type: ignore[type-arg]
    """pyhook's hook keys on one module -> the hook dicts holding them."""

    __slots__ = ()

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        # The module's hook dicts were copied before this entry (see above): drop our keys
        # from the copies. The copy's entry is None (inert, and pickles without pyhook).
        for key, dicts in list(self.items()):
            for d in dicts:
                copied = memo.get(id(d))
                if copied is not None and copied is not d:
                    copied.pop(key, None)

    def __reduce__(self) -> Any:
        return (dict, ())  # pickled models hold no pyhook hooks, and load without pyhook


class _Handle(RemovableHandle):
    """Removes one hook pyhook put into a module's hook dicts: a ``RemovableHandle`` (``id``,
    ``hooks_dict_ref()``, ``extra_dict_ref``, ``remove()``, a context manager) made without the
    weak references torch's constructor makes; they are made only when asked for."""

    __slots__ = ("_dicts", "_hooks", "_module_dict", "id")

    def __init__(self, module_dict: dict[str, Any], key: int, dicts: tuple[Any, ...]) -> None:
        self._module_dict = module_dict
        self.id = key
        self._dicts = dicts  # the dicts holding the key; emptied by remove()
        self._hooks = dicts[0]  # the hooks dict (kept after remove())

    @property
    def hooks_dict_ref(self) -> weakref.ReferenceType[Any]:  # type: ignore[override]
        """A weak reference to the hooks dict (``handle.id in handle.hooks_dict_ref()`` while
        the hook is registered), as ``RemovableHandle.hooks_dict_ref``."""
        return weakref.ref(self._hooks)

    @property
    def extra_dict_ref(self) -> tuple[weakref.ReferenceType[Any], ...]:  # type: ignore[override]
        """Weak references to the module's other dicts of the hook's kind: the ones torch's
        ``register_forward_hook``/``register_forward_pre_hook`` handle lists."""
        md = self._module_dict
        if self._hooks is md.get("_forward_hooks"):
            names: tuple[str, ...] = ("_forward_hooks_with_kwargs", "_forward_hooks_always_called")
        elif self._hooks is md.get("_forward_pre_hooks"):
            names = ("_forward_pre_hooks_with_kwargs",)
        else:
            names = ()
        return tuple(weakref.ref(md[n]) for n in names if n in md)

    @property
    def alive(self) -> bool:
        """Whether the hook is still registered (through this handle)."""
        return bool(self._dicts)

    def remove(self) -> None:
        _remove_all((self,))

    def __enter__(self) -> _Handle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __reduce__(self) -> Any:
        # A copy is a plain RemovableHandle, as torch's own handle copies (the same dicts) and
        # pickles (copies of the dicts).
        extra = tuple(r() for r in self.extra_dict_ref)
        return (_removable_handle, (self._hooks, self.id, extra))


def _removable_handle(hooks: Any, key: int, extra: tuple[Any, ...]) -> RemovableHandle:
    handle = RemovableHandle.__new__(RemovableHandle)
    handle.__setstate__((hooks, key, extra))
    return handle


class _TorchHandle(_Handle):
    """A hook registered through torch's API (backward hooks), listed in the registry too."""

    __slots__ = ("_inner",)

    def __init__(self, module_dict: dict[str, Any], inner: RemovableHandle, dicts: Any) -> None:
        super().__init__(module_dict, inner.id, dicts)
        self._inner = inner

    @property
    def hooks_dict_ref(self) -> weakref.ReferenceType[Any]:  # type: ignore[override]
        return self._inner.hooks_dict_ref

    @property
    def extra_dict_ref(self) -> tuple[weakref.ReferenceType[Any], ...]:  # type: ignore[override]
        return self._inner.extra_dict_ref

    def remove(self) -> None:
        if self._dicts:
            self._inner.remove()
            _remove_all((self,))


def _remove_all(handles: Any) -> None:
    """Remove the hooks of ``handles`` (eager ones; each once), then unlist their keys."""
    removed = []
    for h in handles:
        dicts = h._dicts
        if dicts:
            h._dicts = ()
            key = h.id
            for d in dicts:
                d.pop(key, None)
            removed.append(h)
    if not removed:
        return
    with _registry_lock:
        for h in removed:
            md = h._module_dict
            reg = md.get(_REGISTRY)
            if reg is not None:
                reg.pop(h.id, None)
                if not reg:
                    del md[_REGISTRY]


_GONE = object()  # see HookSet._guard


def _add_hooks(
    items: Any,
    post: bool,
    with_kwargs: bool,
    prepend: bool = False,
    always_call: bool = False,
) -> list[_Handle]:
    """``register_forward_hook``/``register_forward_pre_hook`` for each ``(module.__dict__, fn)``
    of ``items``: the same dicts and order as torch's, a cheaper handle, one lock for all."""
    handles = []
    for md, fn in items:
        key = _next_key()
        if post:
            hooks = md["_forward_hooks"]
            kw = md["_forward_hooks_with_kwargs"]
        else:
            hooks = md["_forward_pre_hooks"]
            kw = md["_forward_pre_hooks_with_kwargs"]
        hooks[key] = fn
        if with_kwargs:
            kw[key] = True
            dicts: tuple[Any, ...] = (hooks, kw)
        else:
            dicts = (hooks,)
        if always_call:
            always = md["_forward_hooks_always_called"]
            always[key] = True
            dicts = (*dicts, always)
        if prepend:
            hooks.move_to_end(key, last=False)
        handles.append(_Handle(md, key, dicts))
    with _registry_lock:
        for h in handles:
            md = h._module_dict
            reg = md.get(_REGISTRY)
            if type(reg) is not _Registry:  # absent, or None in a deep copy
                reg = md[_REGISTRY] = _Registry()
            reg[h.id] = h._dicts
    return handles


def _plain(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a plain function, which ``copy.deepcopy`` shares (a bound method's owner
    would be deep-copied along with a module holding the hook)."""
    if inspect.isfunction(fn):
        return fn

    def plain(*args: Any) -> Any:
        return fn(*args)

    plain.__wrapped__ = fn  # type: ignore[attr-defined]
    return plain


def _torch_handle(module: nn.Module, inner: RemovableHandle, attr: str) -> _TorchHandle:
    md = module.__dict__
    dicts = (md[attr],)
    with _registry_lock:
        reg = md.get(_REGISTRY)
        if type(reg) is not _Registry:
            reg = md[_REGISTRY] = _Registry()
        reg[inner.id] = dicts
    return _TorchHandle(md, inner, dicts)


class HookSet:
    """A group of hook registrations added and removed as one unit.

    Example::

        >>> import torch
        >>> from pyhook._hooks import HookSet
        >>> lin = torch.nn.Linear(2, 2)
        >>> hooks = HookSet()
        >>> with hooks.registering():
        ...     _ = hooks.forward(lin, lambda m, args, out: out * 0)
        >>> bool(lin(torch.ones(2)).abs().sum())
        False
        >>> hooks.remove(); len(lin._forward_hooks)
        0
    """

    __slots__ = (
        "__weakref__",
        "_engine_thread",
        "_handles",
        "_model",
        "_prune_at",
        "_thread",
        "any_thread",
    )

    # ``with hooks.registering(): ...`` is the hot path of every tracer's construction, so the
    # set is its own (cheap) context manager rather than a contextlib generator.

    def __init__(self, *, any_thread: bool = False, model: nn.Module | None = None) -> None:
        self._handles: list[Any] = []  # RemovableHandle, or a dispatcher entry's handle
        self._prune_at = 64  # see tensor()
        self.any_thread = any_thread
        # The tracer's model, shown to the layout layer on a sharded model (which module holds
        # which: see pyhook.distributed.note_model); nothing is done with it otherwise.
        self._model = weakref.ref(model) if model is not None else None
        self._own_thread()

    def _note_model(self) -> None:
        model = self._model() if self._model is not None else None
        if model is not None:
            note_model(model)

    # -- registration -------------------------------------------------------------------
    def registering(self) -> HookSet:
        """Context in which hooks are added atomically: any exception removes them all."""
        self._own_thread()
        return self

    def _own_thread(self) -> None:
        """The calling thread becomes the owner whose forwards the guarded hooks act on."""
        self._thread = threading.get_ident()
        self._engine_thread = 0 if self.any_thread else _engine_thread_id()

    def __enter__(self) -> HookSet:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc_type is not None:
            self.remove()

    def _guard(self, fn: Callable[..., Any], nargs: int = 0) -> Callable[..., Any]:
        """``fn`` as a plain function (a deep copy of the module shares it rather than copying
        its tracer), acting only on the owner thread's forwards unless ``any_thread``.
        ``nargs``: how many arguments torch passes (4: a forward hook with kwargs), so that
        the guard takes them without packing (0: any)."""
        if self.any_thread:
            return _plain(fn)
        owner, owner_engine = self._thread, self._engine_thread
        get_ident = threading.get_ident
        in_backward = torch._C._current_graph_task_id

        def ours() -> bool:
            # Outside a backward, only the owner thread's forwards are ours. During a backward
            # a forward is a checkpoint recomputation, whoever runs it: ours iff it recomputes
            # the owner's forward (skipping it would corrupt the owner's grads, acting on
            # another thread's would corrupt that thread's grads and our captures).
            if in_backward() == -1:
                if get_ident() == owner:
                    return True
                forget_recomputation(owner_engine)
                return False
            return forward_owner_matches(owner, owner_engine)

        # The common case, the owner's own forward, is tested inline first.
        if nargs == 4:
            # ``output`` missing: another thread's forward took a snapshot of the module's hooks
            # while this one was being added or removed, and torch saw no kwargs flag for it
            # (torch reads the two dicts separately). That forward is not ours: do nothing.
            def guarded4(module: Any, args: Any, kwargs: Any, output: Any = _GONE) -> Any:
                if (get_ident() == owner and in_backward() == -1) or (
                    output is not _GONE and ours()
                ):
                    return fn(module, args, kwargs, output)
                return None

            guarded: Callable[..., Any] = guarded4
        else:

            def guarded_any(*args: Any) -> Any:
                if (get_ident() == owner and in_backward() == -1) or ours():
                    return fn(*args)
                return None

            guarded = guarded_any
        guarded.__wrapped__ = fn  # type: ignore[attr-defined]
        return guarded

    def _keep(self, handle: Any) -> Any:
        self._handles.append(handle)
        return handle

    def _dispatched(
        self,
        module: nn.Module,
        fn: Callable[..., Any],
        post: bool,
        with_kwargs: bool,
        prepend: bool,
        inputs: bool = False,
        name: str | None = None,
    ) -> Any:
        """The hook as an entry of ``module``'s persistent dispatcher when ``module`` belongs to
        a compiled model (see :mod:`pyhook._compiled`), else None (a plain hook is wanted).
        On a sharded model the entry sees whole tensors, as a plain hook does."""
        dispatch = _dispatcher_for(module)
        if dispatch is None:
            return None
        if _layouts_active():  # a sharded compiled model: the hook sees whole tensors too
            self._note_model()
            fn = layout_hook(
                module,
                fn,
                post=post,
                with_kwargs=with_kwargs,
                inputs=inputs,
                name=name,
                compiled=True,
            )
        return self._keep(
            dispatch.add(
                fn, post=post, with_kwargs=with_kwargs, prepend=prepend, any_thread=self.any_thread
            )
        )

    def forward(
        self,
        module: nn.Module,
        fn: Callable[..., Any],
        *,
        with_kwargs: bool = False,
        prepend: bool = False,
        always_call: bool = False,
        checked: bool = False,
        inputs: bool = False,
        name: str | None = None,
    ) -> Any:
        """``module.register_forward_hook(fn)``, thread-guarded, owned by this set.

        On a module of a compiled model the hook goes into the module's persistent dispatcher
        instead (see :mod:`pyhook._compiled`), which compiled code sees without recompiling.
        ``checked=True``: the caller ran :func:`check_not_compiled` on ``module`` (which installs
        the dispatcher where one is needed), so its compile marks are not looked at again.
        The returned handle has ``remove()`` and ``id``, as a ``RemovableHandle``.

        On a sharded model (``torch.distributed`` initialised) ``fn`` sees and returns whole
        tensors (see :func:`pyhook.distributed.layout_hook`): its output always, its inputs when
        ``inputs=True``; ``name`` (the layer's name) is what a refused layout is reported as.
        """
        if type(module) is Point:  # a standard hook point (pyhook.points) registers itself
            return module.register(
                self,
                fn,
                with_kwargs=with_kwargs,
                prepend=prepend,
                always_call=always_call,
                inputs=inputs,
            )
        md = module.__dict__
        if "_pyhook_dispatch" in md or not (checked or "torch._dynamo" not in sys.modules):
            handle = self._dispatched(module, fn, True, with_kwargs, prepend, inputs, name)
            if handle is not None:
                return handle
        if _layouts_active():  # a sharded model: the hook sees and returns whole tensors
            self._note_model()
            fn = layout_hook(
                module, fn, post=True, with_kwargs=with_kwargs, inputs=inputs, name=name
            )
        guarded = self._guard(fn, 4 if with_kwargs else 3)
        (handle,) = _add_hooks(((md, guarded),), True, with_kwargs, prepend, always_call)
        self._handles.append(handle)
        return handle

    def forward_pre(
        self,
        module: nn.Module,
        fn: Callable[..., Any],
        *,
        with_kwargs: bool = False,
        prepend: bool = False,
        checked: bool = False,
        name: str | None = None,
    ) -> Any:
        """``module.register_forward_pre_hook(fn)``, thread-guarded, owned by this set
        (dispatched on compiled models, as :meth:`forward`; whole first input on a sharded
        model, as :meth:`forward`'s output)."""
        if type(module) is Point:
            raise TypeError(
                f"standard point {module.name!r} takes forward hooks only (a point that is a "
                "module's input is hooked with a pre-hook by pyhook itself)"
            )
        md = module.__dict__
        if "_pyhook_dispatch" in md or not (checked or "torch._dynamo" not in sys.modules):
            handle = self._dispatched(module, fn, False, with_kwargs, prepend, name=name)
            if handle is not None:
                return handle
        if _layouts_active():  # a sharded model: the hook sees and returns whole inputs
            self._note_model()
            fn = layout_hook(module, fn, post=False, with_kwargs=with_kwargs, name=name)
        (handle,) = _add_hooks(((md, self._guard(fn)),), False, with_kwargs, prepend)
        self._handles.append(handle)
        return handle

    # Backward hooks run on autograd's threads, so they are never thread-guarded.
    def full_backward(
        self,
        module: nn.Module,
        fn: Callable[..., Any],
        *,
        prepend: bool = False,
        name: str | None = None,
    ) -> Any:
        """``module.register_full_backward_hook(fn)``, owned by this set.

        On a sharded model ``fn`` sees the whole ``grad_input`` and ``grad_output`` and returns
        whole gradients, re-sharded for this rank (see :func:`pyhook.distributed.layout_hook`);
        a layout that cannot be gathered exactly raises ``LayoutError`` naming ``name``.
        """
        if _layouts_active():
            self._note_model()
            fn = layout_hook(module, fn, post=True, backward=True, name=name)
        inner = module.register_full_backward_hook(_plain(fn), prepend=prepend)
        return self._keep(_torch_handle(module, inner, "_backward_hooks"))

    def full_backward_pre(
        self,
        module: nn.Module,
        fn: Callable[..., Any],
        *,
        prepend: bool = False,
        name: str | None = None,
    ) -> Any:
        """``module.register_full_backward_pre_hook(fn)``, owned by this set (whole
        ``grad_output`` on a sharded model, as :meth:`full_backward`)."""
        if _layouts_active():
            self._note_model()
            fn = layout_hook(module, fn, post=False, backward=True, name=name)
        inner = module.register_full_backward_pre_hook(_plain(fn), prepend=prepend)
        return self._keep(_torch_handle(module, inner, "_backward_pre_hooks"))

    def tensor(self, tensor: torch.Tensor, fn: Callable[..., Any]) -> RemovableHandle:
        """``tensor.register_hook(fn)`` (gradient hook), owned by this set.

        A set that lives over many forwards (a training loop inside one ``with`` block) drops
        the handles of hooks whose tensor and graph are gone (nothing is left to remove), each
        time it doubles: it holds what is alive, not one handle per forward ever run."""
        if len(self._handles) >= self._prune_at:
            self._handles = [
                h
                for h in self._handles
                if not (type(h) is RemovableHandle and h.hooks_dict_ref() is None)
            ]
            self._prune_at = max(64, 2 * len(self._handles))
        return self._keep(tensor.register_hook(fn))

    # -- removal ------------------------------------------------------------------------
    def forward_shared(
        self,
        modules: list[nn.Module],
        fn: Callable[..., Any],
        *,
        with_kwargs: bool = False,
        inputs: bool = False,
        names: list[str | None] | None = None,
    ) -> list[Any]:
        """:meth:`forward` with the same ``fn`` on each of ``modules`` (which must be eager
        modules checked with :func:`check_not_compiled`, and distinct), registered in bulk.

        ``fn`` tells the modules apart by its first argument; one thread guard serves them all
        (a tracer's hundreds of layers: no function made per layer).
        """
        if _layouts_active():  # each module's hook is wrapped for its own layout
            self._note_model()
            names = [None] * len(modules) if names is None else names
            return [
                self.forward(m, fn, with_kwargs=with_kwargs, checked=True, inputs=inputs, name=n)
                for m, n in zip(modules, names)
            ]
        guarded = self._guard(fn, 4 if with_kwargs else 3)
        handles = _add_hooks([(m.__dict__, guarded) for m in modules], True, with_kwargs)
        self._handles.extend(handles)
        return handles

    def remove(self) -> None:
        """Remove every hook of the set, newest first; safe to call more than once."""
        handles, self._handles = self._handles, []
        handles.reverse()
        if all(type(h) is _Handle for h in handles):
            _remove_all(handles)  # the common case, in bulk
        else:
            for handle in handles:
                handle.remove()

    @property
    def active(self) -> bool:
        """Whether any hook of this set is registered."""
        return bool(self._handles)

    @property
    def owned_by_caller(self) -> bool:
        """Whether the guarded hooks act on the calling thread's forwards."""
        return self.any_thread or self._thread == threading.get_ident()

    def __len__(self) -> int:
        return len(self._handles)
