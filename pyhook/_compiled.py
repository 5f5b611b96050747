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
Code compiled later for another model of the same class, without dispatchers, is kept off the
traced model by the module's own ``forward`` bound in its ``__dict__`` (see ``Dispatcher``).

This module also holds the traceable helpers the tools use on this path.
"""

from __future__ import annotations

import functools
import itertools
import os
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = [
    "Dispatcher",
    "active_entries",
    "dispatcher_of",
    "prepare",
    "prepare_compiled",
    "release",
]


class CompiledModelError(RuntimeError):
    """Raised when a pyhook tool cannot give eager results on a compiled model.

    Tracing models compiled with ``torch.compile(model)`` or ``model.compile()`` works with
    dynamo's default settings (see :mod:`pyhook._compiled`); this error remains for the options
    compiled code cannot honour, and its message names the way out.

    Example::

        >>> import pyhook
        >>> issubclass(pyhook.CompiledModelError, RuntimeError)
        True
    """


_ATTR = "_pyhook_dispatch"
COMPILED_MARK = "_pyhook_compiled"  # set by unwrap_compiled on the module a wrapper compiled
_lock = threading.Lock()  # tables may be changed from several threads (any_thread, remove)
_next_key = itertools.count(-1, -1).__next__  # C-level, so safe without a lock


class _Entry:
    """One tracer hook in a dispatcher table (what ``register_forward_hook`` would have held)."""

    __slots__ = ("fn", "key", "with_kwargs")

    def __init__(self, fn: Callable[..., Any], with_kwargs: bool) -> None:
        self.fn = fn
        self.with_kwargs = with_kwargs
        # its handle's ``id``; none in traced code (TruncatedModule's own call): a counter read
        # there is guarded on its value, so every call would fail the guard and recompile
        self.key = 0 if torch.compiler.is_compiling() else _next_key()


class _Table:
    """The hooks of one thread (or the any-thread hooks) on one module, as immutable tuples."""

    __slots__ = ("__weakref__", "post", "pre")

    def __init__(self) -> None:
        self.pre: tuple[_Entry, ...] = ()
        self.post: tuple[_Entry, ...] = ()


def _put(table: _Table, kind: str, entry: _Entry, prepend: bool) -> None:
    current = getattr(table, kind)
    setattr(table, kind, (entry, *current) if prepend else (*current, entry))
    if not torch.compiler.is_compiling():  # (traced code adds and drops its own entries)
        _live[0] += 1


def _drop(table: _Table, kind: str, entry: _Entry) -> None:
    current = getattr(table, kind)
    setattr(table, kind, tuple(e for e in current if e is not entry))
    if not torch.compiler.is_compiling() and entry in current:
        _live[0] -= 1


# Entries in every table (added outside compiled code): while any is live, frames left skipped
# for the tracers that break them stay skipped (see _unskip_stack and _lift_pending).
_live = [0]


class _TableHooks(Mapping[int, Callable[..., Any]]):
    """One kind (``pre``/``post``) of a table's entries as a hooks dict: handle ``id`` -> hook
    (what a ``RemovableHandle``'s ``hooks_dict_ref()`` returns; a live, read-only view)."""

    __slots__ = ("_kind", "_table")

    def __init__(self, table: _Table, kind: str) -> None:
        self._table = table
        self._kind = kind

    def _entries(self) -> tuple[_Entry, ...]:
        return getattr(self._table, self._kind)

    def __getitem__(self, key: Any) -> Callable[..., Any]:
        for e in self._entries():
            if e.key == key:
                return e.fn
        raise KeyError(key)

    def __iter__(self) -> Iterator[int]:
        return iter([e.key for e in self._entries()])

    def __len__(self) -> int:
        return len(self._entries())


class _Handle(RemovableHandle):
    """Removes one entry from the table it was added to (any thread may call :meth:`remove`).

    A ``RemovableHandle``: ``id``, ``hooks_dict_ref()`` (the table's entries of this kind, a
    read-only mapping that holds ``id`` while the entry is registered), ``extra_dict_ref``."""

    __slots__ = ("_home", "entry", "kind", "table")

    def __init__(self, table: _Table, kind: str, entry: _Entry) -> None:
        self.table: _Table | None = table  # None once removed
        self._home = table
        self.kind = kind
        self.entry = entry

    @property
    def id(self) -> int:  # type: ignore[override]
        return self.entry.key

    @property
    def hooks_dict_ref(self) -> Callable[[], Mapping[int, Any]]:  # type: ignore[override]
        view = _TableHooks(self._home, self.kind)
        return lambda: view

    @property
    def extra_dict_ref(self) -> tuple[Any, ...]:  # type: ignore[override]
        return ()

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

    def __enter__(self) -> _Handle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __reduce__(self) -> Any:
        raise TypeError("a compiled model's hook handle cannot be copied or pickled")


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
        _dispatchers.add(self)
        # Dynamo guards, for each module it inlines, only that 'forward' is absent from the
        # module's __dict__ -- not its hooks when it had none (skip_nnmodule_hook_guards). So
        # code compiled for another model of the same class without dispatchers would match
        # this one and run without its hooks. The module's own forward, bound in its __dict__,
        # fails that guard (dynamo guards this one's function instead).
        func = getattr(type(module), "forward", None)
        own = module.__dict__.get("forward")
        self._own_forward: tuple[Any, Any] | None = None
        if isinstance(func, types.FunctionType) and own is None:
            module.__dict__["forward"] = types.MethodType(func, module)
        elif type(own) is types.FunctionType and own.__closure__:
            # A forward patched in as a closure (transformers' tensor-parallel styles,
            # accelerate's hooks) is guarded by its code, which the same module of every other
            # layer shares: code compiled for one without a dispatcher would serve this one.
            # A partial of it is guarded by identity.
            wrapped = functools.partial(own)
            module.__dict__["forward"] = wrapped
            self._own_forward = (wrapped, own)

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
        bound = module.__dict__.get("forward")
        if self._own_forward is not None and bound is self._own_forward[0]:
            module.__dict__["forward"] = self._own_forward[1]
        elif (
            isinstance(bound, types.MethodType)
            and bound.__self__ is module
            and bound.__func__ is getattr(type(module), "forward", None)
        ):
            del module.__dict__["forward"]
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
        self._own_forward = None
        _dispatchers.add(self)

    def _pre(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        table = getattr(self._local, "table", None)
        entries = self.shared.pre if table is None else table.pre + self.shared.pre
        if not entries:
            if not torch.compiler.is_compiling() and _pending:  # (traced: never read)
                _lift_pending()
            return None
        if not torch.compiler.is_compiling():
            _unskip_stack()
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
        if not torch.compiler.is_compiling():
            _unskip_stack()
        for e in entries:
            r = e.fn(module, args, kwargs, output) if e.with_kwargs else e.fn(module, args, output)
            if r is not None:
                output = r
        return output


def _unskip_stack() -> None:
    """Let dynamo compile again the frames running this (eager) dispatcher call.

    A tracer entry dynamo cannot trace without a break inside a loop (a stop, an edit that
    raises, ``retain_grad``) makes dynamo give up on the frames around it and mark their code
    objects "skip" for good, so that every later call of *any* model sharing that code
    (``nn.Sequential.forward``, transformers' wrappers) runs eagerly or in pieces. Such a
    forward reaches the dispatcher in eager Python: the frames on the stack, up to the
    compiled call's entry, are reset to dynamo's default strategy, which keeps their compiled
    code (the next call runs it again, when its guards hold). Frames that dynamo must skip for
    other reasons are skipped again on their next call.

    A frame on that stack may instead run a compiled version that calls the model eagerly:
    dynamo, unable to resume after a break inside inlined code, moved the break up to the
    model's call in the outermost frame it could compile (for a ``torch.compile``d
    ``nn.Sequential``, the wrapper function all such wrappers share), and that version guards
    only the types of the model and the arguments. Such versions are limited to the tracer
    state they were made under (see :func:`_limit_to_break_state`), so that plain calls, and
    other models sharing the code, run their fully compiled code again.
    """
    from torch._C._dynamo.eval_frame import get_eval_frame_callback, set_code_exec_strategy

    if get_eval_frame_callback() is None:
        return  # not inside a compiled call (e.g. the eager model called directly)
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    default = FrameExecStrategy(FrameAction.DEFAULT, FrameAction.DEFAULT)
    running: list[Any] = []  # frames running code dynamo produced (a compiled version)
    output_codes = getattr(sys.modules.get("torch._dynamo.convert_frame"), "output_codes", None)
    produced = getattr(output_codes, "seen_ids", ())
    state: frozenset[Any] | None = None
    frame = sys._getframe(1)  # the dispatcher's own frame first: its code is shared
    while frame is not None:
        code = frame.f_code
        if code.co_filename.replace("\\", "/").endswith(_EVAL_FRAME):
            break  # the entry of the compiled call: the frames above are not dynamo's
        if id(code) in produced:
            set_code_exec_strategy(code, default)  # (as before: dynamo never retraces these)
            if id(code) not in _limited:
                running.append(frame)
        else:
            seen = _unskipped.get(id(code))
            if seen is not None and seen[0] is not code:
                seen = None  # an id reused by another code object
            if seen is not None and seen[2] == id(frame):
                pass  # this same call, at an earlier hooked module: done then
            else:
                if state is None:
                    state = _break_state()
                if seen is not None and seen[1] == state:
                    # Made compilable under these same tracers before, and dynamo gave it up
                    # again (the same break): compiling it again would be wasted (a stop in a
                    # loop cost ~1 s a call on GPT-2). It stays skipped while these tracers
                    # break it; an eager call under other tracers, or none, lifts the mark.
                    _pending[id(code)] = code
                else:
                    set_code_exec_strategy(code, default)
                    _pending.pop(id(code), None)
                _unskipped[id(code)] = (code, state, id(frame))
        frame = frame.f_back
    if running:
        _limit_to_break_state(running)


# id(code) -> (code, the tracer state it was made compilable under, id of the frame running it)
_unskipped: dict[int, tuple[Any, Any, int]] = {}
# code objects left skipped because their tracers break them every call (see _unskip_stack)
_pending: dict[int, Any] = {}


def _lift_pending() -> None:
    """An eager call with no tracer entries: once no tracer is active anywhere, the frames left
    skipped for the tracers that broke them may compile again (their compiled versions are
    kept)."""
    from torch._C._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    if _live[0]:
        return  # a tracer is active (on some thread): it may be the one that breaks them
    default = FrameExecStrategy(FrameAction.DEFAULT, FrameAction.DEFAULT)
    for code in list(_pending.values()):
        set_code_exec_strategy(code, default)
    _pending.clear()
    _unskipped.clear()


def _entry_key(entry: _Entry) -> tuple[Any, ...]:
    """What a table entry does, without object identities: the hook's code, the type of the
    tracer it belongs to and whether that tracer stops the forward."""
    fn = entry.fn
    owner = getattr(fn, "__self__", None)
    func = getattr(fn, "__func__", fn)
    return (
        getattr(func, "__code__", func),
        type(owner),
        getattr(owner, "stop", None) is True,
        entry.with_kwargs,
    )


def _break_state() -> frozenset[Any]:
    """The calling thread's tracer entries (and the any-thread ones) over every dispatcher."""
    state = []
    for d in list(_dispatchers):
        table = getattr(d._local, "table", None)
        for kind in ("pre", "post"):
            entries = getattr(d.shared, kind)
            if table is not None:
                entries = getattr(table, kind) + entries
            if entries:
                state.append((id(d), kind, tuple(_entry_key(e) for e in entries)))
    return frozenset(state)


_dispatchers: weakref.WeakSet[Dispatcher] = weakref.WeakSet()
_limited: set[int] = set()  # ids of the compiled code objects given the break-state guard
_warned: set[str] = set()


def _limit_to_break_state(frames: list[Any]) -> None:
    """Add, to the compiled versions ``frames`` run, the guard "the tracer state is the one of
    now": with any other state (no tracer: a plain call) dynamo looks further in its cache and
    runs (or compiles once) a version made for that state; with this one (the next stop of the
    same kind) it reuses this version, compiling nothing.

    Changing a version's guards while another thread may be checking them is not safe: with
    other live threads (counted as for dropping compiled code) this warns instead, once per
    model class, and the version stays as dynamo made it.
    """
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    convert_frame = sys.modules["torch._dynamo.convert_frame"]
    wanted = {id(f.f_code): f.f_code for f in frames}
    found = []
    for ref in list(convert_frame.input_codes.seen):
        original = ref()
        if original is None:
            continue
        for entry in _debug_get_cache_entry_list(original):
            if wanted.get(id(entry.code)) is entry.code and hasattr(entry.guard_manager, "root"):
                found.append(entry)
    if not found:
        return
    if _other_threads():
        outer = frames[-1].f_locals  # the compiled call's outermost frame: the model's call
        model = next((v for v in outer.values() if isinstance(v, nn.Module)), None)
        name = type(model).__name__ if model is not None else frames[-1].f_code.co_name
        if name not in _warned:
            _warned.add(name)
            warnings.warn(
                f"pyhook: a tracer broke the compiled forward of a {name} while other threads "
                "were alive; the compiled code dynamo made for that call runs the model "
                f"eagerly and may now serve plain calls of every compiled {name} too (no "
                "graphs, exact results). Call pyhook.release_compiled(model) once from one "
                "thread to compile again, or trace with stop=True when no other thread runs.",
                RuntimeWarning,
                stacklevel=4,
            )
        return
    state = _break_state()
    text = [f"pyhook: same tracers as at the graph break ({len(state)} hook tables)"]
    for entry in found:
        entry.guard_manager.root.add_lambda_guard(
            lambda _frame_locals: _break_state() == state, text, None
        )
        _limited.add(id(entry.code))
        weakref.finalize(entry.code, _limited.discard, id(entry.code))


_EVAL_FRAME = "/".join(("torch", "_dynamo", "eval_frame.py"))


def dispatcher_of(module: nn.Module) -> Dispatcher | None:
    """The dispatcher installed on ``module``, if any (a ``__dict__`` lookup: cheap)."""
    return module.__dict__.get(_ATTR)


def _compiled_code_exists() -> bool:
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    seen = getattr(getattr(convert_frame, "input_codes", None), "seen", None)
    return seen is None or any(ref() is not None for ref in seen)


_IDLE_FILES = ("threading.py", "queue.py", os.path.join("concurrent", "futures", "thread.py"))


def _idle_pool_worker(frame: Any) -> bool:
    """Whether a thread's stack is an executor worker waiting for work: every frame is the
    worker loop or the queue/lock it waits on (e.g. the idle threads of a ThreadPoolExecutor
    that fsspec, datasets or a tokenizer left behind). Such a thread runs no compiled code."""
    worker = False
    while frame is not None:
        code = frame.f_code
        if not code.co_filename.endswith(_IDLE_FILES):
            return False
        worker = worker or code.co_name == "_worker"
        frame = frame.f_back
    return worker


def _other_threads() -> list[str]:
    """Live non-daemon threads other than the caller: they may be running compiled code.

    (Daemon threads -- pyhook's writers, a notebook kernel's own threads -- and executor
    workers idle in their queue are not counted.)
    """
    me = threading.current_thread()
    frames = sys._current_frames()
    return [
        t.name
        for t in threading.enumerate()
        if t is not me
        and not t.daemon
        and t.is_alive()
        and not _idle_pool_worker(frames.get(t.ident or -1))
    ]


def _invalidate(what: str) -> None:
    """Drop dynamo's compiled code once, if any exists (it may have inlined a hook-less module).

    Dropping it while another thread runs compiled code can crash the interpreter (dynamo
    frees the code and guards that thread is using), so with other live threads this refuses,
    before anything is changed, with :class:`~pyhook.CompiledModelError`.
    """
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None or not _compiled_code_exists():
        return  # nothing compiled yet in this process
    others = _other_threads()
    if others:
        raise CompiledModelError(
            f"pyhook must drop dynamo's compiled code to {what}, which is unsafe while other "
            f"threads may run compiled code (live threads: {', '.join(others[:5])}). Call "
            "pyhook.prepare_compiled(model) once, from one thread, before starting the threads "
            "(it installs the hook dispatchers that tracers on any thread then use), or trace "
            "the model before compiling it."
        )
    dynamo.reset_code_caches()


def prepare(module: nn.Module) -> Dispatcher:
    """Install (once) the dispatcher on ``module``; compiled code made before is dropped."""
    d = dispatcher_of(module)
    if d is None:
        with _install_lock:
            d = dispatcher_of(module)
            if d is None:
                _invalidate(f"show hooks on a {type(module).__name__} to compiled code")
                d = Dispatcher(module)
                module.__dict__[_ATTR] = d
    d.table(False)  # the calling thread's table exists before any compiled code reads it
    return d


_install_lock = threading.RLock()


def prepare_compiled(model: nn.Module, layers: Any = None) -> None:
    """Make a compiled model ready to be traced from several threads.

    Installs pyhook's hook dispatchers on ``layers`` (dotted names as in the eager model; every
    submodule when None) of ``model`` (a ``torch.compile`` wrapper or a module compiled with
    ``module.compile()``), and drops dynamo's compiled code once. Call it from one thread
    before other threads trace or run the model: tracers created later on any thread then
    change only per-thread tables, and never need to drop compiled code (which is unsafe while
    another thread runs it, so pyhook refuses to do it then).

    Example::

        >>> import torch, pyhook
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> compiled = torch.compile(net, backend="eager")
        >>> pyhook.prepare_compiled(compiled, ["0"])
        >>> with pyhook.Trace(compiled, "0") as t:
        ...     _ = compiled(torch.ones(1, 2))
        >>> t.output.shape
        torch.Size([1, 2])
    """
    from .modules import get_module

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    root = unwrap_compiled(model)
    if layers is None:
        targets = list(root.modules())
    elif isinstance(layers, str):
        raise TypeError(
            f"layers must be a list of layer names, got the str {layers!r} (use [{layers!r}])"
        )
    else:
        targets = [get_module(root, name) for name in layers]  # names checked before changes
    with _install_lock:
        missing = [m for m in targets if dispatcher_of(m) is None]
        if missing:
            _invalidate("prepare the model's dispatchers")
            for m in missing:
                m.__dict__[_ATTR] = Dispatcher(m)


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
    found = [m for m in module.modules() if dispatcher_of(m) is not None]
    if found:
        _invalidate("remove hook dispatchers from compiled code")  # refuses before any change
        for m in found:
            d = m.__dict__.pop(_ATTR, None)
            if d is not None:
                d.remove(m)
    if _pending:
        _lift_pending()  # frames left skipped for a tracer's breaks compile again


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

    Layer names then resolve as in the eager model (``'h.0'``, not ``'_orig_mod.h.0'``). The
    module it returns is marked as compiled (``_pyhook_compiled`` in its ``__dict__``): torch
    2.13 marks it itself (``_is_torch_compile``, set through the wrapper), but earlier releases
    (2.11 on the GPU machine) mark only the wrapper, and a tool that found no mark on the module
    it unwrapped registered plain hooks, which compiled code ignores (no rows, no output).

    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> unwrap_compiled(torch.compile(net, backend="eager")) is net
    True
    >>> net.__dict__["_pyhook_compiled"]
    'torch.compile(module)'
    """
    inner = module._modules.get("_orig_mod")
    if type(module).__name__ == "OptimizedModule" and isinstance(inner, nn.Module):
        inner.__dict__.setdefault(COMPILED_MARK, "torch.compile(module)")
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
