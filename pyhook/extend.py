"""hybrid_learning's model extension family: grab intermediate outputs, feed them to extra models.

* :class:`HooksHandle` (abstract): an ``nn.Module`` wrapping a model, with one hook per
  registered sub-module ID (``register_submodule`` / ``unregister_submodule``).
* :class:`ActivationMapGrabber`: ``forward`` returns ``(model_out, {module_id: output})``.
* :class:`ModelStump`: ``forward`` returns the output of one sub-module, the *stump head*, and
  stops the wrapped model there. :class:`ExtendedModelStump` applies a function to it.
* :class:`ModelExtender`: feeds intermediate outputs to extension models (probes, concept
  models) and returns ``(model_out, {extension_name: extension_out})``.
* :func:`dummy_output`, :func:`output_sizes`, :func:`output_size`: outputs and sizes of layers
  for a zero input.

Drop-in for ``hybrid_learning.concepts.models.model_extension`` (same names, arguments, return
formats and errors), with its bugs fixed:

* every forward starts from empty outputs and returns a fresh dict: no stale values from an
  earlier call, and earlier results are not changed by later calls;
* unregistering the last extension of a sub-module works (no ``KeyError`` on the next forward);
* hooks are removed by :meth:`HooksHandle.close`, by leaving a ``with`` block, and when the
  wrapper is garbage collected: the hooks hold only a weak reference to the wrapper, so dropping
  the last reference to it really removes them;
* a deep copy (``copy.deepcopy``) hooks its own copy of the model, as the original's copies do;
* bad extensions (unknown sub-module IDs, duplicate or invalid names, non-modules) raise before
  anything is registered;
* a :class:`ModelStump` stops the forward at its head instead of running the whole model, and its
  eval mode does not switch the shared wrapped model to eval for good;
* keyword arguments are passed to the wrapped model.

Intermediate outputs are captured only during the wrapper's own forward (calling the wrapped
model directly records nothing), and are kept as they are: no copy, autograd graph attached, so
extensions can be trained through them. A sub-module called several times keeps its last call.
"""

from __future__ import annotations

import abc
import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ._compiled import unwrap_compiled
from ._hooks import HookSet, StopForward, check_not_compiled, is_own_stop
from .modules import get_module
from .truncate import HookNotCalledError

__all__ = [
    "ActivationMapGrabber",
    "ExtendedModelStump",
    "HooksHandle",
    "ModelExtender",
    "ModelStump",
    "dummy_output",
    "output_size",
    "output_sizes",
]

_NOT_RUN = object()
_MODULEDICT_ATTRS = frozenset(dir(nn.ModuleDict()))


class _Frame:
    """The state of one forward of a wrapper: what its hooks captured, and its stop token."""

    __slots__ = ("outs", "stop_at", "token")

    def __init__(self, stop_at: str | None) -> None:
        self.outs: dict[str, Any] = {}
        self.token = object()
        self.stop_at = stop_at


def _make_hook(
    handle_ref: weakref.ReferenceType[HooksHandle], module_id: str
) -> Callable[..., None]:
    # Only a weak reference to the wrapper: a hook must not keep its wrapper alive, or the
    # wrapper could never be collected and its hooks would stay on the model forever.
    get_ident = threading.get_ident

    def hook(_module: nn.Module, _args: Any, output: Any) -> None:
        handle = handle_ref()
        if handle is None:
            return
        frame = handle._frames.get(get_ident())
        if frame is None:  # the model was called outside the wrapper's forward
            return
        frame.outs[module_id] = output
        if frame.stop_at == module_id:
            raise StopForward(
                f"reached stump head {module_id!r}", owner=frame.token, payload=output
            )

    return hook


def _remove_all(hook_sets: dict[str, HookSet]) -> None:
    for hooks in reversed(list(hook_sets.values())):
        hooks.remove()
    hook_sets.clear()


@contextlib.contextmanager
def _in_mode(model: nn.Module, training: bool) -> Iterator[None]:
    """Run with ``model`` (and all submodules) in the given mode; restore every flag afterwards."""
    flags = [(m, m.training) for m in model.modules()]
    if all(flag == training for _, flag in flags):
        yield
        return
    model.train(training)
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def _check_module_id(model: nn.Module, module_id: Any) -> nn.Module:
    if module_id is None:
        raise ValueError("Tried to register a module_id which was None")
    # names as in the eager model, also for a torch.compile wrapper (no '_orig_mod.' prefix)
    return get_module(unwrap_compiled(model), module_id)  # LayerNotFoundError naming close names


class HooksHandle(nn.Module, abc.ABC):
    """Base class of wrappers that grab the outputs of sub-modules of a model by hooks.

    ``wrapped_model`` is a registered child (``state_dict`` keys start with
    ``wrapped_model.``; ``.to()``, ``.train()``, ``.eval()`` act on the shared model). One hook is
    registered per sub-module ID (a dotted name as in ``named_modules()``, ``''`` for the model
    itself). Hooks stay registered until :meth:`unregister_submodule`, :meth:`close`, the end of a
    ``with`` block, or the garbage collection of the wrapper, whichever comes first.

    Example::

        >>> import torch
        >>> from pyhook.extend import ActivationMapGrabber
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
        >>> with ActivationMapGrabber(net, ["0"]) as grabber:
        ...     grabber.registered_submodules, len(net[0]._forward_hooks)
        (['0'], 1)
        >>> len(net[0]._forward_hooks)
        0
    """

    def __init__(self, model: nn.Module, module_ids: Iterable[str] | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(module_ids, (str, bytes)):
            # hybrid_learning takes a list of IDs; a str would be iterated character by character
            raise TypeError(
                f"module_ids must be a list of sub-module IDs, got the str {module_ids!r}: "
                f"pass [{module_ids!r}] to register that one sub-module"
            )
        ids = [] if module_ids is None else list(module_ids)
        for module_id in ids:  # validate all before registering anything
            _check_module_id(model, module_id)
        super().__init__()
        self.wrapped_model: nn.Module = model
        # One HookSet per sub-module ID, in registration order. The same dict object lives as
        # long as the wrapper: the finalizer below removes whatever it holds at collection time.
        self._hook_sets: dict[str, HookSet] = {}
        self._frames: dict[int, _Frame] = {}
        self._closed = False
        # Copies sharing this __dict__ (DataParallel replicas) must not remove our hooks in
        # their __del__; garbage collection of this wrapper is handled by the finalizer.
        self._owner_id = id(self)
        weakref.finalize(self, _remove_all, self._hook_sets)
        try:
            for module_id in ids:
                self.register_submodule(module_id)
        except BaseException:
            self.close()
            raise

    # -- registration ---------------------------------------------------------------------------
    @property
    def registered_submodules(self) -> list[str]:
        """List of IDs of the registered sub-modules, in registration order."""
        return list(self._hook_sets)

    @property
    def hook_handles(self) -> dict[str, RemovableHandle]:
        """The hook handle of each registered sub-module ID (read-only view; use the methods)."""
        return {module_id: hooks._handles[0] for module_id, hooks in self._hook_sets.items()}

    def get_module_by_id(self, m_id: str) -> nn.Module:
        """Get actual sub-module object within wrapped model by module ID.

        Example::

            >>> import torch
            >>> from pyhook.extend import ActivationMapGrabber
            >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
            >>> ActivationMapGrabber(net).get_module_by_id("1")
            ReLU()
        """
        return get_module(unwrap_compiled(self.wrapped_model), m_id)

    def register_submodule(self, module_id: str) -> None:
        """Register further submodule of to extract intermediate output from.

        Does nothing if ``module_id`` is already registered. ``None`` gives ``ValueError``; an
        unknown ID gives a ``KeyError`` (:class:`~pyhook.LayerNotFoundError`) naming it.

        Example::

            >>> import torch
            >>> from pyhook.extend import ActivationMapGrabber
            >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
            >>> grabber = ActivationMapGrabber(net)
            >>> grabber.register_submodule("1"); grabber.registered_submodules
            ['1']
        """
        if module_id in self._hook_sets:
            return
        self._check_open()
        module = _check_module_id(self.wrapped_model, module_id)
        # a module of a compiled model gets its dispatcher (compiled code then sees the hook)
        check_not_compiled(unwrap_compiled(self.wrapped_model), module_id)
        # threads are told apart by _frames
        hooks = HookSet(any_thread=True, model=unwrap_compiled(self.wrapped_model))
        with hooks.registering():
            hooks.forward(module, _make_hook(weakref.ref(self), module_id))
        self._hook_sets[module_id] = hooks

    def unregister_submodule(self, module_id: str) -> None:
        """Unregister a submodule for intermediate output retrieval.

        ``KeyError`` if ``module_id`` is not registered.

        Example::

            >>> import torch
            >>> from pyhook.extend import ActivationMapGrabber
            >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
            >>> grabber = ActivationMapGrabber(net, ["0", "1"])
            >>> grabber.unregister_submodule("0")
            >>> grabber.registered_submodules, len(net[0]._forward_hooks)
            (['1'], 0)
        """
        if module_id not in self._hook_sets:
            raise KeyError(f"Tried to remove unknown submodule of ID {module_id!r}")
        self._hook_sets.pop(module_id).remove()

    # -- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        """Remove every hook of this wrapper (idempotent). A closed wrapper can not run."""
        self._closed = True
        _remove_all(self._hook_sets)

    def __enter__(self) -> HooksHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        """Unregister all hooks held by this handle on handle delete."""
        if self.__dict__.get("_owner_id") == id(self):
            # no module globals here: at interpreter exit they may already be None
            try:
                self.close()
            except Exception:
                pass

    # A deep copy of the wrapper copies the model without pyhook's hooks (see pyhook._hooks):
    # the copy registers its sub-modules again on its own model, as hybrid_learning's copies
    # (whose hooks are copied along with the model) capture from the copied model.
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_hook_sets"] = list(self._hook_sets)  # the IDs; the hooks stay with this wrapper
        state["_frames"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        module_ids = state.pop("_hook_sets")
        super().__setstate__(state)
        self._hook_sets = {}
        self._owner_id = id(self)
        weakref.finalize(self, _remove_all, self._hook_sets)
        if not self._closed:
            for module_id in module_ids:
                HooksHandle.register_submodule(self, module_id)

    def _check_open(self) -> None:
        if self.__dict__.get("_closed", False):
            raise RuntimeError(f"this {type(self).__name__} was closed: its hooks are removed")

    # -- running --------------------------------------------------------------------------------
    def _run(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], stop_at: str | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Run the wrapped model; return its output (``_NOT_RUN`` when stopped) and the captures."""
        self._check_open()
        tid = threading.get_ident()
        frame = _Frame(stop_at)
        previous = self._frames.get(tid)  # a re-entrant call (the wrapper inside its own model)
        self._frames[tid] = frame
        try:
            try:
                out = self.wrapped_model(*args, **kwargs)
            except StopForward as stop:
                if not is_own_stop(stop, frame.token):
                    raise
                out = _NOT_RUN
        finally:
            if previous is None:
                self._frames.pop(tid, None)
            else:
                self._frames[tid] = previous
        return out, frame.outs

    @abc.abstractmethod
    def forward(self, *inps: Any, **kwargs: Any) -> Any:
        """Pytorch forward method."""

    def extra_repr(self) -> str:
        return f"registered_submodules={self.registered_submodules!r}"


class ActivationMapGrabber(HooksHandle):
    """Wrap a model and return the outputs of registered sub-modules along with its output.

    ``forward(*inps, **kwargs)`` returns ``(model_output, {module_id: output})``, a new dict per
    call holding every registered ID in registration order; an ID whose sub-module did not run
    in this forward maps to ``None``. Outputs are the sub-modules' own objects (no copy).

    Example::

        >>> import torch
        >>> from pyhook.extend import ActivationMapGrabber
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        >>> grabber = ActivationMapGrabber(net, ["1", "0"])
        >>> out, acts = grabber(torch.randn(5, 3))
        >>> list(acts), torch.equal(acts["1"], torch.relu(acts["0"])), out.shape
        (['1', '0'], True, torch.Size([5, 2]))
    """

    def forward(self, *inps: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        """Pytorch forward method: ``(model_out, {module_id: intermediate_out})``."""
        out, outs = self._run(inps, kwargs)
        return out, {module_id: outs.get(module_id) for module_id in self._hook_sets}

    def stump(self, module_id: str) -> ModelStump:
        """Provide a :class:`ModelStump` (in eval mode) which yields act maps of given sub-module.

        ``KeyError`` if ``module_id`` is not registered here. The stump's eval mode applies to
        its own forwards only (see :class:`ModelStump`): the shared model keeps its mode.

        Example::

            >>> import torch
            >>> from pyhook.extend import ActivationMapGrabber
            >>> net = torch.nn.Sequential(
            ...     torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)
            ... )
            >>> stump = ActivationMapGrabber(net, ["1"]).stump("1")
            >>> stump(torch.randn(5, 3)).shape, stump.training, net.training
            (torch.Size([5, 4]), False, True)
        """
        if module_id not in self._hook_sets:
            raise KeyError(f"Submodule {module_id!r} is not registered")
        return ModelStump(self.wrapped_model, module_id).eval()


class ModelStump(HooksHandle):
    """Run a model only up to the sub-module ``stump_head`` and return that sub-module's output.

    The output is that of the head's **last** call in the forward, as in hybrid_learning (whose
    hook overwrites the stored output at each call) and :class:`ActivationMapGrabber`. A module
    object reached under several names (one ``nn.ReLU`` at indices 1 and 3) is one hooked
    module: ``ModelStump(net, "1")`` and ``ModelStump(net, "3")`` both give the output of its
    last call (index 3's).

    Unlike hybrid_learning's, the forward **stops at the head** when that can not change the
    result: sub-modules that would run after it are skipped, so no compute is wasted on them
    (a :class:`~pyhook.StopForward` owned by the stump ends the forward; it never reaches the
    caller). ``early_stop`` (keyword-only) chooses: ``None`` (default) stops right after the
    head's first call unless the head module is registered under several names in the model
    (then the full forward runs); ``False`` always runs the full forward (hybrid_learning's
    behaviour, also for a head the model's own code calls several times, e.g. in a loop, which
    the default would stop at its first call); ``True`` always stops at the first call. The
    names are counted when the head is set. If the head did not run,
    :class:`~pyhook.HookNotCalledError` is raised.

    A stump is in eval mode after construction, as in hybrid_learning, but its mode is its own:
    ``stump.eval()``/``stump.train()`` do **not** change the shared wrapped model. During each of
    the stump's forwards the model runs in the stump's mode, and every sub-module's previous mode
    is restored afterwards, so the model is never switched to eval for good.

    Example::

        >>> import torch
        >>> from pyhook.extend import ModelStump
        >>> net = torch.nn.Sequential(
        ...     torch.nn.Linear(3, 4), torch.nn.Dropout(0.9), torch.nn.Linear(4, 2)
        ... )
        >>> stump = ModelStump(net, "1")
        >>> x = torch.randn(5, 3)
        >>> torch.equal(stump(x), net[0](x)), net.training  # dropout in eval mode, net unchanged
        (True, True)
    """

    def __init__(
        self, model: nn.Module, stump_head: str, *, early_stop: bool | None = None
    ) -> None:
        if early_stop is not None and not isinstance(early_stop, bool):
            raise TypeError(
                f"early_stop must be None, True or False, got {type(early_stop).__name__}: "
                f"{early_stop!r}"
            )
        _check_module_id(model, stump_head)
        super().__init__(model)
        self._stump_head: str | None = None
        self._stop_at_head = early_stop is not False
        self.early_stop = early_stop
        self.training = False
        self.stump_head = stump_head

    @property
    def stump_head(self) -> str | None:
        """ID of the sub-module whose output is returned (``None`` once unregistered)."""
        return self._stump_head

    @stump_head.setter
    def stump_head(self, stump_head: str | None) -> None:
        old = self._stump_head
        if stump_head is not None:
            self._stump_head = stump_head  # set first: register_submodule only fills a missing head
            try:
                self.register_submodule(stump_head)
            except BaseException:
                self._stump_head = old
                raise
        self._stump_head = stump_head
        self._stop_at_head = self._may_stop_at(stump_head)
        # A new head replaces the old one: its hook goes (hybrid_learning let hooks accumulate).
        if old is not None and old != stump_head and old in self._hook_sets:
            self._hook_sets.pop(old).remove()

    def _may_stop_at(self, head: str | None) -> bool:
        """Whether stopping at the head's first call gives the chosen result (see class doc)."""
        if self.early_stop is not None or head is None:
            return self.early_stop is not False
        module = self.get_module_by_id(head)
        root = unwrap_compiled(self.wrapped_model)
        names = (m for _, m in root.named_modules(remove_duplicate=False))
        return sum(m is module for m in names) == 1

    def register_submodule(self, module_id: str) -> None:
        """Register a sub-module; it becomes the stump head if there is none."""
        super().register_submodule(module_id)
        if self._stump_head is None:
            self._stump_head = module_id
            self._stop_at_head = self._may_stop_at(module_id)

    def unregister_submodule(self, module_id: str) -> None:
        """Unregister a sub-module; unregistering the head leaves the stump without a head."""
        super().unregister_submodule(module_id)
        if module_id == self._stump_head:
            self._stump_head = None

    def train(self, mode: bool = True) -> ModelStump:
        """Set the stump's own mode (the wrapped model runs in it during the stump's forwards).

        Other children (e.g. an ``nn.Module`` given as ``modification``) follow as usual.
        """
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        self.training = mode
        for child in self.children():
            if child is not self.wrapped_model:
                child.train(mode)
        return self

    def forward(self, *inps: Any, **kwargs: Any) -> Any:
        """Pytorch forward method: the output of the stump head."""
        head = self._stump_head
        if head is None:
            raise ValueError(f"this {type(self).__name__} has no stump_head (it was unregistered)")
        with _in_mode(self.wrapped_model, self.training):
            _, outs = self._run(inps, kwargs, stop_at=head if self._stop_at_head else None)
        if head not in outs:
            raise HookNotCalledError(
                f"the forward of {type(self.wrapped_model).__name__} finished without running "
                f"the stump head {head!r}"
            )
        return outs[head]

    def extra_repr(self) -> str:
        return f"stump_head={self._stump_head!r}"


class ExtendedModelStump(ModelStump):
    """A :class:`ModelStump` whose output is passed through ``modification``.

    Example::

        >>> import torch
        >>> from pyhook.extend import ExtendedModelStump
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        >>> ExtendedModelStump(net, "1", lambda act: act.sum(-1))(torch.randn(5, 3)).shape
        torch.Size([5])
    """

    def __init__(
        self,
        model: nn.Module,
        stump_head: str,
        modification: Callable[[Any], Any],
        *,
        early_stop: bool | None = None,
    ) -> None:
        if not callable(modification):
            raise ValueError("modification function for model intermediate out must be callable!")
        super().__init__(model, stump_head, early_stop=early_stop)
        self.modification = modification

    def forward(self, *inps: Any, **kwargs: Any) -> Any:
        """``modification(stump head output)``."""
        return self.modification(super().forward(*inps, **kwargs))


class ModelExtender(ActivationMapGrabber):
    """Wrap a model and feed intermediate outputs to extension models.

    ``extensions`` is ``{<sub-module ID>: {<name>: <model>}}``: each ``<model>`` (an
    ``nn.Module``) receives the output of that sub-module. Names are unique over all sub-modules
    and must be valid ``nn.ModuleDict`` keys (non-empty, no ``.``, not a ``ModuleDict``
    attribute). ``forward(*inps, **kwargs)`` returns ``(model_out, {name: extension_out})``, or
    only the dict when ``return_orig_out`` is False (the attribute may be changed at any time).
    An extension whose sub-module did not run in that forward gives ``None``.

    Extensions live in the ``extension_models`` ``ModuleDict``, so they appear in
    ``parameters()`` and ``state_dict()`` and can be trained through the wrapper.

    Example (hybrid_learning's user-guide model)::

        >>> import torch
        >>> from pyhook.extend import ModelExtender
        >>> class SampleNN(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.l1, self.l2 = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
        ...     def forward(self, x):
        ...         return self.l2(self.l1(x))
        >>> nn_model = SampleNN()
        >>> with torch.no_grad():
        ...     _ = nn_model.l1.weight.fill_(1), nn_model.l1.bias.fill_(2)
        ...     _ = nn_model.l2.weight.fill_(3), nn_model.l2.bias.fill_(0)
        >>> extended = ModelExtender(nn_model, extensions={"l1": {"l1": torch.nn.Identity()}})
        >>> with torch.no_grad():
        ...     extended(torch.tensor([[1.]]))
        (tensor([[9.]]), {'l1': tensor([[3.]])})
    """

    def __init__(
        self,
        model: nn.Module,
        extensions: Mapping[str, Mapping[str, nn.Module]],
        return_orig_out: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self._validate_extensions(model, extensions, taken=())
        super().__init__(model)
        self.return_orig_out: bool = return_orig_out
        self.extension_models: nn.ModuleDict = nn.ModuleDict()
        self._name_registrations: dict[str, list[str]] = {}
        self._ext_layers: set[str] = set()  # layers hooked for extensions, as last synced
        try:
            self._register_validated(extensions)
        except BaseException:
            self.close()
            raise

    # -- validation -----------------------------------------------------------------------------
    @staticmethod
    def _check_name(name: Any, module_id: Any, taken: Iterable[str]) -> None:
        if not isinstance(name, str):
            raise TypeError(
                f"extension names must be str, got {type(name).__name__}: {name!r} "
                f"(at sub-module {module_id!r})"
            )
        if not name or "." in name or name in _MODULEDICT_ATTRS:
            raise ValueError(
                f"extension name {name!r} (at sub-module {module_id!r}) is not a valid "
                "torch.nn.ModuleDict key: it must be non-empty, contain no '.', and not be an "
                "attribute of ModuleDict"
            )
        if name in taken:
            raise ValueError(f"Tried to overwrite module under existing name: {name}")

    @classmethod
    def _validate_extensions(cls, model: nn.Module, extensions: Any, taken: Iterable[str]) -> None:
        if not isinstance(extensions, Mapping):
            raise TypeError(
                "extensions must be a dict {sub-module ID: {extension name: nn.Module}}, "
                f"got {type(extensions).__name__}"
            )
        seen = set(taken)
        for module_id, named in extensions.items():
            _check_module_id(model, module_id)
            if not isinstance(named, Mapping):
                raise TypeError(
                    f"extensions[{module_id!r}] must be a dict {{extension name: nn.Module}}, "
                    f"got {type(named).__name__}"
                )
            for name, ext in named.items():
                cls._check_name(name, module_id, seen)
                if not isinstance(ext, nn.Module):
                    raise ValueError(
                        f"Extension item of name {name} to be registered at sub-module {module_id} "
                        f"not of type torch.nn.Module, but of type {type(ext)}"
                    )
                seen.add(name)

    def _register_validated(self, extensions: Mapping[str, Mapping[str, nn.Module]]) -> None:
        for module_id, named in extensions.items():
            for name, ext in named.items():
                self._add(name, module_id, ext)

    def _add(self, name: str, module_id: str, model: nn.Module) -> None:
        new_layer = module_id not in self._hook_sets
        self.register_submodule(module_id)
        try:
            self.extension_models[name] = model
        except BaseException:
            if new_layer:
                super().unregister_submodule(module_id)
            raise
        self._name_registrations.setdefault(module_id, []).append(name)
        self._ext_layers.add(module_id)

    def _sync_registry(self) -> None:
        """Make the hooks follow the live ``name_registrations`` (which users may mutate).

        Everything is checked before anything changes: a listed name that is no registered
        extension, or one listed under two layers, or an unknown layer, raises naming it.
        Then emptied layers are dropped from the registry, listed layers get a hook, and layers
        hooked for extensions that are no longer listed lose theirs.
        """
        registry = self._name_registrations
        where: dict[str, str] = {}
        for module_id, names in registry.items():
            if names and module_id not in self._hook_sets:
                try:
                    _check_module_id(self.wrapped_model, module_id)
                except KeyError as e:
                    raise KeyError(
                        f"name_registrations lists extensions at sub-module {module_id!r}, "
                        f"which does not exist: {e}"
                    ) from None
            for name in names:
                if name not in self.extension_models:
                    raise KeyError(
                        f"name_registrations[{module_id!r}] lists {name!r}, which is not a "
                        f"registered extension (registered: {self.extension_names})"
                    )
                if name in where:
                    raise ValueError(
                        f"extension {name!r} is listed under two sub-modules in "
                        f"name_registrations: {where[name]!r} and {module_id!r}"
                    )
                where[name] = module_id
        for module_id in [m for m, names in registry.items() if not names]:
            del registry[module_id]
        for module_id in registry:
            self.register_submodule(module_id)  # no-op when already hooked
        for module_id in self._ext_layers - set(registry):
            if module_id in self._hook_sets:
                super().unregister_submodule(module_id)
        self._ext_layers = set(registry)

    # -- registration ---------------------------------------------------------------------------
    def register_extension(self, name: str, module_id: str, model: nn.Module) -> None:
        """Register a new extension model as ``name``, fed with the output of ``module_id``.

        ``ValueError`` if an extension is already registered under ``name``, if ``name`` is not
        a valid ``ModuleDict`` key, or if ``model`` is not an ``nn.Module``; ``KeyError`` for an
        unknown sub-module. Nothing is registered when it raises.

        Example::

            >>> import torch
            >>> from pyhook.extend import ModelExtender
            >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
            >>> ext = ModelExtender(net, {}, return_orig_out=False)
            >>> ext.register_extension("probe", "0", torch.nn.Linear(4, 1))
            >>> ext(torch.randn(2, 3))["probe"].shape
            torch.Size([2, 1])
        """
        self._check_open()
        self._sync_registry()
        self._validate_extensions(
            self.wrapped_model, {module_id: {name: model}}, self.extension_names
        )
        self._add(name, module_id, model)

    def register_extensions(self, new_extensions: Mapping[str, Mapping[str, nn.Module]]) -> None:
        """Register all specified new extensions: ``{module_id: {ext_name: ext_module}}``.

        Everything is checked first (``ValueError`` for a name already registered, etc.), so
        either all extensions are registered or none.
        """
        self._check_open()
        self._sync_registry()
        self._validate_extensions(self.wrapped_model, new_extensions, self.extension_names)
        done: list[str] = []
        try:
            for module_id, named in new_extensions.items():
                for name, ext in named.items():
                    self._add(name, module_id, ext)
                    done.append(name)
        except BaseException:
            for name in reversed(done):
                self.unregister_extension(name)
            raise

    def unregister_extension(self, name: str) -> None:
        """Unregister an existing extension by name (``KeyError`` if unknown).

        Removing the last extension of a sub-module also removes that sub-module's hook.

        Example::

            >>> import torch
            >>> from pyhook.extend import ModelExtender
            >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
            >>> ext = ModelExtender(net, {"0": {"probe": torch.nn.Linear(4, 1)}})
            >>> ext.unregister_extension("probe")
            >>> ext.registered_submodules, ext(torch.randn(2, 3))[1]
            ([], {})
        """
        module_id = next((m for m, ns in self._name_registrations.items() if name in ns), None)
        if module_id is None:
            if name not in self.extension_models:
                raise KeyError(f"Tried to unregister extension of unknown name {name}")
            del self.extension_models[name]  # dropped from name_registrations by the user
            return
        names = self._name_registrations[module_id]
        names.remove(name)
        del self.extension_models[name]
        if not names:
            del self._name_registrations[module_id]
            self._ext_layers.discard(module_id)
            if module_id in self._hook_sets:
                super().unregister_submodule(module_id)

    def unregister_submodule(self, module_id: str) -> None:
        """Unregister a sub-module; ``ValueError`` while extensions are registered at it."""
        if self._name_registrations.get(module_id):
            raise ValueError(
                f"sub-module {module_id!r} still feeds extensions "
                f"{self._name_registrations[module_id]}; "
                "unregister them with unregister_extension() first"
            )
        super().unregister_submodule(module_id)

    # -- views ----------------------------------------------------------------------------------
    @property
    def name_registrations(self) -> dict[str, list[str]]:
        """Dict mapping main model sub-modules to their registered extension model names:
        ``{<sub-module ID>: [<extension name>, ...]}``.

        As in hybrid_learning, this is the live registry the forward runs by, not a copy. It
        may be edited: reorder a layer's names (outputs follow that order), move a name to
        another layer's list, or remove it (the extension is then not run; its module stays in
        ``extension_models`` until :meth:`unregister_extension`). Edits are applied at the next
        forward or (un)registration call: hooks follow the layers listed (a layer no longer
        listed loses the hook added for its extensions, a newly listed one gets one), and a
        name that is no registered extension, is listed twice, or sits under an unknown layer
        raises there, naming it, before any hook changes. :meth:`close` removes every hook
        whatever the registry holds.

        Example::

            >>> import torch
            >>> from pyhook.extend import ModelExtender
            >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
            >>> ext = ModelExtender(net, {"0": {"a": torch.nn.Linear(4, 1)}}, return_orig_out=False)
            >>> ext.name_registrations["1"] = ext.name_registrations.pop("0")  # feed "a" from "1"
            >>> sorted(ext(torch.randn(2, 3))), ext.registered_submodules
            (['a'], ['1'])
        """
        return self._name_registrations

    @property
    def extensions(self) -> dict[str, dict[str, nn.Module]]:
        """Nested dict holding all extension modules indexed by ID and layer:
        ``{<sub-module ID>: {<ext name>: <registered ext model>}}``."""
        return {
            module_id: {name: self.extension_models[name] for name in names}
            for module_id, names in self._name_registrations.items()
        }

    @property
    def extension_names(self) -> list[str]:
        """List of the names of all registered extensions."""
        return list(self.extension_models.keys())

    # -- running --------------------------------------------------------------------------------
    # hybrid_learning's signature: only the dict when return_orig_out is False.
    def forward(  # type: ignore[override]
        self, *inps: Any, **kwargs: Any
    ) -> tuple[Any, dict[str, Any]] | dict[str, Any]:
        """Pytorch forward method: ``(<main model out>, {<ext name>: <ext out>})`` (or the dict)."""
        self._check_open()
        self._sync_registry()
        main_out, outs = self._run(inps, kwargs)
        ext_outs: dict[str, Any] = {}
        for module_id, names in self._name_registrations.items():
            act = outs.get(module_id, _NOT_RUN)
            for name in names:
                ext_outs[name] = None if act is _NOT_RUN else self.extension_models[name](act)
        return (main_out, ext_outs) if self.return_orig_out else ext_outs

    def extra_repr(self) -> str:
        return f"return_orig_out={self.return_orig_out}"


# -- sizes ----------------------------------------------------------------------------------
def dummy_output(
    model: nn.Module, input_size: Sequence[int], layer_ids: Iterable[str] | None = None
) -> dict[str, Any]:
    """Outputs of the given layers (all named modules by default) for a zero input.

    ``torch.zeros(input_size)`` (batch dimension included) is fed on the device of the model's
    first parameter, without gradients and in eval mode; the model's modes are restored
    afterwards and no hook stays registered.

    Example::

        >>> import torch
        >>> from pyhook.extend import dummy_output
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
        >>> {k: tuple(v.shape) for k, v in dummy_output(net, (2, 3)).items()}
        {'': (2, 4), '0': (2, 4), '1': (2, 4)}
    """
    ids = [name for name, _ in model.named_modules()] if layer_ids is None else list(layer_ids)
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    grabber = ActivationMapGrabber(model, ids)
    try:
        with torch.no_grad(), _in_mode(model, False):
            _, outs = grabber(torch.zeros(tuple(input_size), device=device))
    finally:
        grabber.close()
    return outs


def output_sizes(
    model: nn.Module,
    input_size: Sequence[int],
    layer_ids: Iterable[str] | None = None,
    has_batch_dim: bool = False,
    ignore_non_tensor_outs: bool = True,
) -> dict[str, torch.Size]:
    """Output sizes (batch dimension stripped) of the given layers for an input of ``input_size``.

    A batch dimension of 1 is added unless ``has_batch_dim``. Non-tensor outputs are skipped, or
    raise ``AttributeError`` with ``ignore_non_tensor_outs=False``; a tensor output without a
    batch dimension raises ``AttributeError``.

    Example::

        >>> import torch
        >>> from pyhook.extend import output_sizes
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
        >>> output_sizes(net, (3,), ["0"])
        {'0': torch.Size([4])}
    """
    size = tuple(input_size)
    if len(size) == 0:
        raise ValueError("input_size must not be empty")
    if not has_batch_dim:
        size = (1, *size)
    sizes: dict[str, torch.Size] = {}
    for layer_id, out in dummy_output(model, size, layer_ids).items():
        if not isinstance(out, torch.Tensor):
            if ignore_non_tensor_outs:
                continue
            raise AttributeError(
                f"output of layer {layer_id!r} is a {type(out).__name__}, not a tensor"
            )
        if out.dim() <= 1:
            raise AttributeError(
                f"output of layer {layer_id!r} has size {tuple(out.shape)}: "
                "no batch dimension to strip"
            )
        sizes[layer_id] = out.size()[1:]
    return sizes


def output_size(
    model: nn.Module,
    input_size: Sequence[int],
    has_batch_dim: bool = False,
    layer_id: str | None = None,
) -> torch.Size:
    """Output size (batch dimension stripped) of ``layer_id`` (default ``''``, the model itself).

    Example::

        >>> import torch
        >>> from pyhook.extend import output_size
        >>> output_size(torch.nn.Linear(3, 4), (3,))
        torch.Size([4])
    """
    layer_id = "" if layer_id is None else layer_id
    return output_sizes(
        model, input_size, [layer_id], has_batch_dim=has_batch_dim, ignore_non_tensor_outs=False
    )[layer_id]
