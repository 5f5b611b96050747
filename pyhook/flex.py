"""flex_model's hook functions: :class:`HookFunction` and the :class:`FlexModel` wrapper.

A :class:`HookFunction` names a submodule (or a parameter, for gradient hooks), an optional
``expected_shape`` hint for activations sharded across tensor-parallel ranks, and an editing
function called as ``editing_function(current_module, inputs, save_ctx, modules)`` on the
*full* activation tensor. :class:`FlexModel` registers hook functions as forward, forward-pre,
full-backward, full-backward-pre or tensor (gradient) hooks; each call appends a detached copy
of the pre-edit full tensor to ``output_ptr[module_name]`` (a list, one entry per call).

Differences from flex_model 0.1.0 (bugs fixed): works without ``torch.distributed`` and with any
backend; dicts, namedtuples and every ``ModelOutput`` are unpacked; the saved value is a copy,
never an alias; bad names, shapes, ``unpack_idx`` and editing results raise clear errors that
name the module; groups can be disabled and re-enabled across forwards; ``create_hook_group``
matches names; ``parameters()`` includes trainable modules; a hook function can be registered
again after :meth:`FlexModel.restore`; by default only rank 0 of the tensor- and data-parallel
groups keeps the gathered copies (``save_on="all"`` keeps them everywhere); ``DTensor``
activations are gathered without a hint. See :mod:`pyhook.distributed` for the routing.
"""

from __future__ import annotations

import argparse
import datetime
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from . import _backend, _tree
from ._checkpointing import note_edit, refuse_lost, take_lost
from ._compiled import unwrap_compiled
from ._hooks import HookSet, check_not_compiled
from .distributed import ParallelState, gather_activation, gathered_first, is_dtensor
from .modules import _not_found, get_module, get_parameter
from .points import module_path, resolve_targets

__all__ = ["HOOK_TYPES", "DummyModule", "FlexModel", "HookFunction", "default_editing_function"]

#: The hook types a :class:`HookFunction` can be registered as.
HOOK_TYPES = ("forward", "forward_pre", "full_backward", "full_backward_pre", "tensor")

_WHAT = {
    "forward": "output",
    "forward_pre": "positional inputs",
    "full_backward": "grad_input",
    "full_backward_pre": "grad_output",
    "tensor": "gradient",
}
_BACKWARD = ("full_backward", "full_backward_pre", "tensor")
_FORWARD = ("forward", "forward_pre")

EditingFunction = Callable[[Any, torch.Tensor, argparse.Namespace, nn.ModuleDict], torch.Tensor]


def default_editing_function(
    current_module: nn.Module | None,
    inputs: torch.Tensor,
    save_ctx: argparse.Namespace,
    modules: nn.ModuleDict,
) -> torch.Tensor:
    """The identity editing function (used when a :class:`HookFunction` is given none).

    Hook functions with it only save: under tensor parallelism the activation is then gathered
    to the saving rank only, and the model's own tensors are passed on untouched.

    Example::

        >>> import torch, argparse, pyhook
        >>> x = torch.ones(2)
        >>> pyhook.default_editing_function(None, x, argparse.Namespace(), torch.nn.ModuleDict()) is x
        True
    """
    return inputs


class DummyModule(nn.Module):
    """An identity module: insert it where you want a hookable point that has no module.

    Example::

        >>> import torch, pyhook
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), pyhook.DummyModule())
        >>> x = torch.ones(1, 2)
        >>> torch.equal(net(x), net[0](x))
        True
    """

    def forward(self, inputs: Any) -> Any:
        return inputs


class _SharedState:
    """What a FlexModel shares with its hook functions (never the FlexModel itself: no cycle)."""

    __slots__ = (
        "batch_dim",
        "gather_data_parallel",
        "offload_device",
        "output_ptr",
        "parallel",
        "save_ctx",
        "save_on",
        "trainable_modules",
    )
    batch_dim: int
    gather_data_parallel: bool
    offload_device: Any
    output_ptr: dict[str, list[Any]]
    parallel: Any
    save_ctx: Any
    save_on: str
    trainable_modules: Any

    def __init__(self, **kw: Any) -> None:
        for k, v in kw.items():
            setattr(self, k, v)


class HookFunction:
    """Retrieve (and optionally edit) one activation of a submodule, as flex_model's HookFunction.

    ``module_name`` is the dotted name of the submodule (of a parameter, for ``tensor`` hooks)
    inside the model given to :class:`FlexModel`. ``expected_shape`` is the shape of the full
    activation, ``None`` for dimensions that are not sharded; it is only needed when a dimension
    is sharded across tensor-parallel ranks. ``editing_function(current_module, inputs,
    save_ctx, modules)`` receives the full activation (``current_module`` is None for tensor
    hooks), may write to ``save_ctx`` and use the trainable ``modules``, and must return a
    tensor of the same shape. ``unpack_idx`` picks the tensor among the tensors of a nested
    output (tuples, lists, dicts, namedtuples, dataclasses and ``ModelOutput`` objects are unpacked
    in order).

    Example::

        >>> import torch, pyhook
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
        >>> def double(module, x, save_ctx, modules):
        ...     save_ctx.seen = x.shape
        ...     return x * 2
        >>> x = torch.randn(2, 3)
        >>> expected = torch.relu(net[0](x) * 2)
        >>> out = {}
        >>> fm = pyhook.FlexModel(net, out)
        >>> fm.register_forward_hook(pyhook.HookFunction("0", editing_function=double))
        >>> torch.equal(fm(x), expected)
        True
        >>> len(out["0"]), fm.save_ctx.seen
        (1, torch.Size([2, 3]))
        >>> net = fm.restore()
    """

    def __init__(
        self,
        module_name: str,
        expected_shape: Sequence[int | None] | None = None,
        editing_function: EditingFunction | None = None,
        unpack_idx: int = 0,
    ) -> None:
        if not isinstance(module_name, str):
            raise TypeError(
                f"HookFunction: module_name must be a str, got {type(module_name).__name__}"
            )
        if expected_shape is not None:
            if isinstance(expected_shape, torch.Size):
                expected_shape = tuple(expected_shape)
            if not isinstance(expected_shape, (tuple, list)) or not all(
                e is None or (isinstance(e, int) and not isinstance(e, bool) and e >= 0)
                for e in expected_shape
            ):
                raise TypeError(
                    f"HookFunction({module_name!r}): expected_shape must be a tuple of "
                    "non-negative ints or None, "
                    f"got {expected_shape!r}"
                )
            expected_shape = tuple(expected_shape)
        if editing_function is not None and not callable(editing_function):
            raise TypeError(
                f"HookFunction({module_name!r}): editing_function must be callable, got "
                f"{type(editing_function).__name__}"
            )
        if not isinstance(unpack_idx, int) or isinstance(unpack_idx, bool):
            raise TypeError(
                f"HookFunction({module_name!r}): unpack_idx must be an int, got {unpack_idx!r}"
            )
        self.module_name = module_name
        self.expected_shape: tuple[int | None, ...] | None = expected_shape
        self.editing_function: EditingFunction = editing_function or default_editing_function
        self.unpack_idx = unpack_idx
        self.hook_type: str | None = None
        self.module: nn.Module | None = None  # set on the first call, as flex_model does
        self._state: _SharedState | None = None
        self._hooks: HookSet | None = None
        self._enabled = True

    # flex_model exposes these on the hook function once it is registered
    @property
    def save_ctx(self) -> argparse.Namespace | None:
        """The FlexModel's shared ``save_ctx`` (None until registered)."""
        return self._state.save_ctx if self._state is not None else None

    @property
    def modules(self) -> nn.ModuleDict | None:
        """The FlexModel's trainable modules (None until registered)."""
        return self._state.trainable_modules if self._state is not None else None

    @property
    def output_ptr(self) -> dict[str, list[torch.Tensor]] | None:
        """The FlexModel's ``output_ptr`` (None until registered)."""
        return self._state.output_ptr if self._state is not None else None

    @property
    def registered(self) -> bool:
        """Whether the hook function is registered with a FlexModel."""
        return self._state is not None

    def __repr__(self) -> str:
        return (
            f"HookFunction({self.module_name!r}, expected_shape={self.expected_shape}, "
            f"editing_function={getattr(self.editing_function, '__name__', self.editing_function)!r}, "
            f"unpack_idx={self.unpack_idx}, hook_type={self.hook_type!r})"
        )

    # -- the hook -----------------------------------------------------------------------
    def _where(self) -> str:
        return f"HookFunction({self.module_name!r}, {self.hook_type})"

    def _make_hook(self, hook_type: str) -> Callable[..., Any]:
        hf = self
        if hook_type == "forward":

            def hook(module: nn.Module, args: Any, output: Any) -> Any:
                return hf._apply(module, output) if hf._enabled else None

        elif hook_type == "forward_pre":

            def hook(module: nn.Module, args: Any) -> Any:  # type: ignore[misc]
                return hf._apply(module, args) if hf._enabled else None

        elif hook_type == "full_backward":

            def hook(module: nn.Module, grad_input: Any, grad_output: Any) -> Any:  # type: ignore[misc]
                return hf._apply(module, grad_input) if hf._enabled else None

        elif hook_type == "full_backward_pre":

            def hook(module: nn.Module, grad_output: Any) -> Any:  # type: ignore[misc]
                return hf._apply(module, grad_output) if hf._enabled else None

        else:

            def hook(grad: torch.Tensor) -> Any:  # type: ignore[misc]
                return hf._apply(None, grad) if hf._enabled else None

        return hook

    def _apply(self, module: nn.Module | None, obj: Any) -> Any:
        """Unpack ``obj``, process the chosen tensor, repack; None when nothing changed."""
        if module is not None:
            self.module = module
        hook_type = self.hook_type or "forward"
        leaves, spec = _tree.flatten(obj)
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        if not positions:
            if hook_type in _BACKWARD:
                return None  # no gradient flows here (e.g. grad_input of a first layer)
            raise IndexError(
                f"{self._where()}: the module's {_WHAT[hook_type]} holds no tensor (got "
                f"{type(obj).__name__}); "
                + (
                    "was it called with keyword arguments only?"
                    if hook_type == "forward_pre"
                    else ""
                )
            )
        try:
            pos = positions[self.unpack_idx]
        except IndexError:
            raise IndexError(
                f"{self._where()}: unpack_idx={self.unpack_idx} but the module's "
                f"{_WHAT[hook_type]} holds only "
                f"{len(positions)} tensor(s)"
            ) from None
        t = leaves[pos]
        new = self._process(module, t, hook_type)
        if new is t:
            return None
        leaves[pos] = new
        return _tree.unflatten(leaves, spec)

    def _process(self, module: nn.Module | None, t: torch.Tensor, hook_type: str) -> torch.Tensor:
        state = self._state
        if state is None:  # unregistered while a forward that had started runs on: no-op
            return t
        par: ParallelState = state.parallel
        where = self._where()
        is_default = self.editing_function is default_editing_function
        everywhere = (not is_default) or state.save_on == "all"
        full, reshard, saver = gather_activation(
            t,
            par if par.distributed else None,
            expected_shape=self.expected_shape,
            what=where,
            everywhere=everywhere,
            gather_data_parallel=state.gather_data_parallel,
            batch_dim=state.batch_dim,
        )
        if full is None:  # gathered to another rank, which saves it; nothing edited here
            return t
        first = gathered_first()  # gathered by the layout layer (a tensor-parallel model)
        if first is not None:
            saver = saver and first
        dp_scale = (
            hook_type in _BACKWARD
            and par.distributed
            and par.dp.size > 1
            and state.gather_data_parallel
            and not is_dtensor(t)
        )
        # flex_model divides gathered gradients by the data-parallel size (the gradient of the
        # mean over the full batch) and undoes it after the edit.
        work = full / par.dp.size if dp_scale else full
        keep = state.save_on == "all" or saver
        saved = self._copy(work, state.offload_device) if keep else None
        edited = self.editing_function(module, work, state.save_ctx, state.trainable_modules)
        if not isinstance(edited, torch.Tensor):
            raise TypeError(
                f"{where}: the editing function must return a tensor, got {type(edited).__name__}"
            )
        if edited.shape != work.shape:
            raise ValueError(
                f"{where}: the editing function changed the shape of the activation from "
                f"{tuple(work.shape)} "
                f"to {tuple(edited.shape)}; it must return a tensor of the same shape"
            )
        if saved is not None:
            state.output_ptr.setdefault(self.module_name, []).append(saved)
        if hook_type in _FORWARD and self._hooks is not None:
            # an edit in an activation-checkpointed layer: pending until a backward recomputes
            # it with this hook (restore() refuses one still pending)
            kept = edited is work and is_default
            note_edit(self, self.module_name, None if kept else edited, self._hooks)
        if edited is work and is_default:
            return t
        if dp_scale:
            edited = edited * par.dp.size
        if reshard is None:
            return edited
        return reshard(edited)

    @staticmethod
    def _copy(x: torch.Tensor, device: Any) -> torch.Tensor:
        x = x.detach()
        if device is not None and x.device != torch.device(device):
            return x.to(device)  # a copy (synchronous, so it is complete when read)
        return _backend.clone_tensors([x])[0]


class FlexModel(nn.Module):
    """Wrap a model to register :class:`HookFunction` s on it, as flex_model's FlexModel.

    ``output_ptr`` receives, for each hooked module name, a list with one saved copy of the
    full pre-edit activation per call (on ``offload_device``, CPU by default; None keeps the
    activation's device). ``tensor_parallel_size``, ``pipeline_parallel_size`` and
    ``data_parallel_size`` describe how the model is spread over the ranks of
    ``process_group`` (default: the world); with all of them 1 (the default) nothing
    distributed is needed. Keyword-only options: ``save_on`` (``"first"``: rank 0 of the
    tensor- and data-parallel groups keeps the copies; ``"all"``: every rank),
    ``gather_data_parallel`` (gather along ``batch_dim`` across data-parallel ranks),
    ``timeout`` (seconds or ``timedelta`` a rank waits for the others in a gather before
    raising :class:`~pyhook.distributed.DistributedHookError`), ``any_thread`` (default False:
    forward hooks act only on the forwards of the thread that registered them, so one
    FlexModel per thread on a shared model sees its own forwards, as every pyhook tracer;
    True: on every thread's, e.g. ``nn.DataParallel`` replicas).

    ``forward(*args, groups="all", complement=False, **kwargs)`` runs the model with only the
    hook functions of ``groups`` enabled (or all others, with ``complement=True``); the choice
    holds until the next forward, so a ``backward()`` of that output uses it too.
    :meth:`restore` removes every hook and returns the model; hooks are also removed when the
    FlexModel is garbage collected. ``copy.deepcopy`` of a FlexModel raises ``TypeError``: copy
    ``flex_model.module`` (the copy has none of the hooks) and wrap the copy in a new FlexModel;
    so does pickling it (``torch.save``): save ``flex_model.module.state_dict()``.

    Example::

        >>> import torch, pyhook
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
        >>> out = {}
        >>> fm = pyhook.FlexModel(net, out)
        >>> fm.register_forward_hook(pyhook.HookFunction("1"))
        >>> fm.create_hook_group("zero", "2", editing_function=lambda m, x, ctx, mods: x * 0)
        [HookFunction('2', expected_shape=None, editing_function='<lambda>', unpack_idx=0, hook_type='forward')]
        >>> fm(torch.randn(4, 3), groups="zero").abs().sum().item()
        0.0
        >>> fm(torch.randn(4, 3), groups="zero", complement=True).abs().sum().item() > 0
        True
        >>> len(out["1"]), "2" in out  # the hook of '1' ran only in the second forward
        (1, True)
        >>> fm.restore() is net, len(net[1]._forward_hooks)
        (True, 0)
    """

    def __init__(
        self,
        module: nn.Module,
        output_ptr: dict[str, list[torch.Tensor]] | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: int = 1,
        process_group: Any = None,
        *,
        save_on: str = "first",
        gather_data_parallel: bool = True,
        batch_dim: int = 0,
        offload_device: str | torch.device | None = "cpu",
        timeout: datetime.timedelta | float | None = None,
        any_thread: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FlexModel: module must be an nn.Module, got {type(module).__name__}")
        if not isinstance(any_thread, bool):
            raise TypeError(f"FlexModel: any_thread must be a bool, got {any_thread!r}")
        # Forward hooks act on the forwards of the thread that registers them (one FlexModel
        # per thread on a shared model), as every pyhook tracer; any_thread=True: every thread.
        self._any_thread = any_thread
        if output_ptr is None:
            output_ptr = {}
        if not isinstance(output_ptr, dict):
            raise TypeError(
                f"FlexModel: output_ptr must be a dict, got {type(output_ptr).__name__}"
            )
        if save_on not in ("first", "all"):
            raise ValueError(f"FlexModel: save_on must be 'first' or 'all', got {save_on!r}")
        if offload_device is not None:
            offload_device = torch.device(offload_device)
        self.module = module
        self.trainable_modules = nn.ModuleDict()
        self.output_ptr = output_ptr
        self.save_ctx = argparse.Namespace()
        self.tp_size, self.pp_size, self.dp_size = (
            tensor_parallel_size,
            pipeline_parallel_size,
            data_parallel_size,
        )
        self.parallel_state = ParallelState(
            tensor_parallel_size,
            pipeline_parallel_size,
            data_parallel_size,
            process_group,
            timeout=timeout,
        )
        self._state = _SharedState(
            output_ptr=output_ptr,
            save_ctx=self.save_ctx,
            trainable_modules=self.trainable_modules,
            parallel=self.parallel_state,
            save_on=save_on,
            offload_device=offload_device,
            gather_data_parallel=bool(gather_data_parallel),
            batch_dim=batch_dim,
        )
        self._new_registry()

    # -- registry and lifetime ------------------------------------------------------------
    def _new_registry(self) -> None:
        # The registry (hook function -> its HookSet) and the group table hold no reference to
        # the FlexModel, so the finalizer can run when the FlexModel is collected.
        self._registry: dict[HookFunction, HookSet] = {}
        self._groups: dict[str, dict[HookFunction, None]] = {"all": {}}
        self._finalizer = weakref.finalize(self, FlexModel._release, self._registry)

    @staticmethod
    def _release(registry: dict[HookFunction, HookSet]) -> None:
        for hf, hooks in reversed(list(registry.items())):
            hooks.remove()
            take_lost(hf)  # (forgotten: a finalizer cannot refuse)
            hf._state, hf._hooks, hf.hook_type, hf._enabled = None, None, None, True
        registry.clear()

    def restore(self) -> nn.Module:
        """Remove every hook of this FlexModel and return the wrapped model, untouched.

        The hook functions can be registered again afterwards; ``output_ptr``, ``save_ctx`` and
        the trainable modules are kept. An edit made inside an activation-checkpointed layer
        that no backward has gone through yet is refused (``RuntimeError`` naming the module,
        the hooks removed all the same): a backward after ``restore()`` would recompute that
        layer without the edit.

        Example::

            >>> import torch, pyhook
            >>> net = torch.nn.Linear(2, 2)
            >>> fm = pyhook.FlexModel(net, {})
            >>> fm.register_forward_hook(pyhook.HookFunction(""))
            >>> fm.restore() is net, len(net._forward_hooks)
            (True, 0)
        """
        lost = [name for hf in self._registry for name in take_lost(hf)]
        self._finalizer()
        self._new_registry()
        refuse_lost(lost, "editing_function", "Run the backward before restore()")
        return self.module

    def __deepcopy__(self, memo: dict[int, Any]) -> FlexModel:
        # A copy of the wrapped model has none of pyhook's hooks (pyhook._hooks), so a copied
        # FlexModel would list hook functions that never run; flex_model's FlexModel cannot be
        # copied at all (its process groups cannot be). Refuse, and say what works.
        raise TypeError(
            "FlexModel cannot be deep-copied (nor can flex_model's: process groups cannot be "
            "copied); copy the model instead, copy.deepcopy(flex_model.module) (a copy without "
            "the hooks), and wrap the copy in a new FlexModel with its own hook functions"
        )

    def __copy__(self) -> FlexModel:
        # A shallow copy shares the model, its hooks and the hook registry, as nn.Module's own
        # copy would: defined so that pickling alone is refused below
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __reduce_ex__(self, protocol: Any) -> Any:
        # pickle (torch.save of the wrapper) would fail on a hook's closure with an
        # AttributeError that names none of this; flex_model's cannot be pickled either
        raise TypeError(
            "FlexModel cannot be pickled (torch.save of the wrapper; nor can flex_model's: its "
            "process groups cannot be); save the model, torch.save(flex_model.module.state_dict(), "
            "path), and wrap the loaded model in a new FlexModel with its own hook functions"
        )

    @property
    def hook_functions(self) -> list[HookFunction]:
        """The registered hook functions, in registration order."""
        return list(self._registry)

    # -- registration -----------------------------------------------------------------------
    def _register(self, hf: HookFunction, hook_type: str) -> None:
        if not isinstance(hf, HookFunction):
            raise TypeError(
                f"FlexModel.register_*: expected a HookFunction, got {type(hf).__name__}"
            )
        if hf._state is not None:
            raise RuntimeError(
                f"{hf!r} is already registered (as a {hf.hook_type} hook); a HookFunction can be "
                "registered "
                "once at a time: create another one, or restore() its FlexModel first"
            )
        if hook_type == "tensor":
            inner = getattr(self.module, "module", None)
            if (
                type(self.module).__name__
                in ("FullyShardedDataParallel", "DistributedDataParallel")
                and inner is not None
            ):
                raise NotImplementedError(
                    f"tensor hooks are not supported on a {type(self.module).__name__}-wrapped "
                    "model"
                )
            target: Any = get_parameter(self.module, hf.module_name)
        else:
            root = unwrap_compiled(self.module)  # names resolve as in the eager model
            hits = resolve_targets(root, hf.module_name)  # a standard point, or None
            if hits is not None and (len(hits) != 1 or hook_type != "forward"):
                raise ValueError(
                    f"HookFunction {hf.module_name!r}: a standard point takes one forward hook "
                    f"(register_forward_hook); it names {len(hits)} point(s) here"
                )
            target = hits[0][1] if hits else get_module(root, hf.module_name)
            path = module_path(hf.module_name, target)
            check_not_compiled(root, path, who="FlexModel")  # compiled: dispatched
        hooks = HookSet(any_thread=self._any_thread, model=unwrap_compiled(self.module))
        with hooks.registering():
            fn = hf._make_hook(hook_type)
            if hook_type == "forward":
                # A module distributed by torch's parallel styles converts its DTensor output to a
                # local shard in a forward hook; running first lets the hook see the DTensor.
                hooks.forward(target, fn, prepend=_holds_dtensors(target))
            elif hook_type == "forward_pre":
                hooks.forward_pre(target, fn)
            elif hook_type == "full_backward":
                hooks.full_backward(target, fn, name=hf.module_name)
            elif hook_type == "full_backward_pre":
                hooks.full_backward_pre(target, fn, name=hf.module_name)
            else:
                hooks.tensor(target, fn)
        hf._state, hf._hooks, hf.hook_type, hf._enabled = self._state, hooks, hook_type, True
        self._registry[hf] = hooks
        self._groups["all"][hf] = None

    def register_forward_hook(self, hook_function: HookFunction) -> None:  # type: ignore[override]
        """Run ``hook_function`` on the output of its module (``register_forward_hook``)."""
        self._register(hook_function, "forward")

    def register_forward_pre_hook(self, hook_function: HookFunction) -> None:  # type: ignore[override]
        """Run ``hook_function`` on the positional inputs of its module (``register_forward_pre_hook``)."""
        self._register(hook_function, "forward_pre")

    def register_full_backward_hook(self, hook_function: HookFunction) -> None:  # type: ignore[override]
        """Run ``hook_function`` on the ``grad_input`` of its module (``register_full_backward_hook``)."""
        self._register(hook_function, "full_backward")

    def register_full_backward_pre_hook(self, hook_function: HookFunction) -> None:  # type: ignore[override]
        """Run ``hook_function`` on the ``grad_output`` of its module (``register_full_backward_pre_hook``)."""
        self._register(hook_function, "full_backward_pre")

    def register_hook(self, hook_function: HookFunction) -> None:
        """Run ``hook_function`` on the gradient of the *parameter* it names (``Tensor.register_hook``)."""
        self._register(hook_function, "tensor")

    def register_trainable_module(self, name: str, module: nn.Module) -> None:
        """Make ``module`` available to editing functions as ``modules[name]``; its parameters
        are part of ``FlexModel.parameters()`` (so an optimiser built from it trains them).

        Example::

            >>> import torch, pyhook
            >>> fm = pyhook.FlexModel(torch.nn.Linear(2, 2), {})
            >>> fm.register_trainable_module("probe", torch.nn.Linear(2, 1))
            >>> len(list(fm.parameters())), fm.trainable_modules_names
            (4, ['probe'])
        """
        if not isinstance(name, str) or not name or "." in name:
            raise ValueError(
                "register_trainable_module: name must be a non-empty str without dots, got "
                f"{name!r}"
            )
        if not isinstance(module, nn.Module):
            raise TypeError(
                "register_trainable_module: module must be an nn.Module, got "
                f"{type(module).__name__}"
            )
        self.trainable_modules[name] = module

    # -- groups ------------------------------------------------------------------------------
    def create_hook_group(
        self,
        group_name: str,
        group_constructor: str,
        expected_shape: Sequence[int | None] | None = None,
        editing_function: EditingFunction | None = None,
        unpack_idx: int = 0,
        hook_type: str = "forward",
    ) -> list[HookFunction]:
        """Register a hook function on every module (or parameter, for ``hook_type="tensor"``)
        whose name contains ``group_constructor`` and put them in group ``group_name``.

        All are registered or none (a failure removes those already registered). Returns the
        new hook functions.
        """
        if hook_type not in HOOK_TYPES:
            raise ValueError(
                f"create_hook_group: hook_type must be one of {HOOK_TYPES}, got {hook_type!r}"
            )
        self._check_group_name(group_name)
        if not isinstance(group_constructor, str):
            raise TypeError(
                "create_hook_group: group_constructor must be a str, got "
                f"{type(group_constructor).__name__}"
            )
        names = (
            [n for n, _ in self.module.named_parameters()]
            if hook_type == "tensor"
            else [n for n, _ in self.module.named_modules()]
        )
        matched = [n for n in names if group_constructor in n]
        if not matched:
            raise _not_found(
                self.module,
                group_constructor,
                "parameter" if hook_type == "tensor" else "module",
                names,
            )
        hfs = [HookFunction(n, expected_shape, editing_function, unpack_idx) for n in matched]
        done: list[HookFunction] = []
        try:
            for hf in hfs:
                self._register(hf, hook_type)
                done.append(hf)
        except BaseException:
            for hf in reversed(done):
                self._unregister(hf)
            raise
        group = self._groups.setdefault(group_name, {})
        for hf in hfs:
            group[hf] = None
        return hfs

    def _unregister(self, hf: HookFunction) -> None:
        hooks = self._registry.pop(hf, None)
        if hooks is not None:
            hooks.remove()
        take_lost(hf)
        for name in list(self._groups):
            self._groups[name].pop(hf, None)
            if name != "all" and not self._groups[name]:
                del self._groups[name]
        hf._state, hf._hooks, hf.hook_type, hf._enabled = None, None, None, True

    @staticmethod
    def _check_group_name(group_name: Any) -> None:
        if not isinstance(group_name, str) or not group_name:
            raise ValueError(f"group name must be a non-empty str, got {group_name!r}")

    def _match(self, constructor: Any) -> list[HookFunction]:
        if isinstance(constructor, HookFunction):
            constructor = [constructor]
        if isinstance(constructor, str):
            found = [hf for hf in self._registry if constructor in hf.module_name]
            if not found:
                raise KeyError(
                    f"no registered hook function's module name contains {constructor!r}; "
                    "registered: "
                    f"{[hf.module_name for hf in self._registry]}"
                )
            return found
        if isinstance(constructor, (list, tuple)):
            for hf in constructor:
                if not isinstance(hf, HookFunction) or hf not in self._registry:
                    raise KeyError(f"{hf!r} is not a hook function registered with this FlexModel")
            return list(constructor)
        raise TypeError(
            "group constructor must be a str, a HookFunction or a list of them, got "
            f"{type(constructor).__name__}"
        )

    def update_hook_groups(self, group_constructor: Any, group_name: str) -> None:
        """Add hook functions to group ``group_name`` (created if new): a list of hook
        functions, one, or a str matched against their module names."""
        self._check_group_name(group_name)
        hfs = self._match(group_constructor)
        group = self._groups.setdefault(group_name, {})
        for hf in hfs:
            group[hf] = None

    def remove_hook_groups(self, group_constructor: Any, group_name: str) -> None:
        """Take hook functions out of group ``group_name`` (not ``"all"``, which holds every one)."""
        if group_name == "all":
            raise ValueError("hook functions cannot be removed from the 'all' group; use restore()")
        if group_name not in self._groups:
            raise KeyError(f"no hook group named {group_name!r}; groups: {sorted(self._groups)}")
        hfs = self._match(group_constructor)
        group = self._groups[group_name]
        for hf in hfs:
            group.pop(hf, None)
        if not group:
            del self._groups[group_name]

    def get_hook_function_groups(self, hook_function: HookFunction) -> list[str]:
        """The names of the groups ``hook_function`` belongs to (``"all"`` first)."""
        if hook_function not in self._registry:
            raise KeyError(f"{hook_function!r} is not registered with this FlexModel")
        return [name for name, group in self._groups.items() if hook_function in group]

    def get_group_hook_functions(self, group_name: str) -> list[HookFunction]:
        """The hook functions of group ``group_name``."""
        if group_name not in self._groups:
            raise KeyError(f"no hook group named {group_name!r}; groups: {sorted(self._groups)}")
        return list(self._groups[group_name])

    @property
    def hook_groups(self) -> list[str]:
        """The names of the hook groups (``"all"`` first)."""
        return list(self._groups)

    def _select(self, groups: str | Sequence[str], complement: bool) -> set[HookFunction]:
        names = [groups] if isinstance(groups, str) else list(groups)
        selected: set[HookFunction] = set()
        for name in names:
            if name not in self._groups:
                raise KeyError(
                    f"FlexModel.forward: no hook group named {name!r}; groups: "
                    f"{sorted(self._groups)}"
                )
            selected.update(self._groups[name])
        return set(self._registry) - selected if complement else selected

    def forward(
        self,
        *args: Any,
        groups: str | Sequence[str] = "all",
        complement: bool = False,
        **kwargs: Any,
    ) -> Any:
        active = self._select(groups, complement)
        for hf in self._registry:
            hf._enabled = hf in active
        return self.module(*args, **kwargs)

    # -- names, parameters ---------------------------------------------------------------------
    @property
    def wrapped_module_names(self) -> list[str]:
        """Names of the modules of the wrapped model."""
        return [n for n, _ in self.module.named_modules()]

    @property
    def trainable_modules_names(self) -> list[str]:
        """Names of the trainable modules."""
        return list(self.trainable_modules.keys())

    @property
    def all_modules_names(self) -> list[str]:
        """Wrapped module names followed by trainable module names."""
        return self.wrapped_module_names + self.trainable_modules_names

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped model's parameters under their own names (as flex_model), then those of
        the trainable modules as ``trainable_modules.<name>.<param>``."""
        seen: set[int] = set()
        sub = f"{prefix}.trainable_modules" if prefix else "trainable_modules"
        for pfx, mod in ((prefix, self.module), (sub, self.trainable_modules)):
            for n, p in mod.named_parameters(
                prefix=pfx, recurse=recurse, remove_duplicate=remove_duplicate
            ):
                if remove_duplicate:
                    if id(p) in seen:
                        continue
                    seen.add(id(p))
                yield n, p

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The wrapped model's buffers under their own names, then the trainable modules'."""
        sub = f"{prefix}.trainable_modules" if prefix else "trainable_modules"
        for pfx, mod in ((prefix, self.module), (sub, self.trainable_modules)):
            yield from mod.named_buffers(
                prefix=pfx, recurse=recurse, remove_duplicate=remove_duplicate
            )

    def get_module_parameter(
        self, parameter_name: str, expected_shape: Sequence[int | None] | None = None
    ) -> torch.Tensor:
        """The full parameter ``parameter_name`` (gathered across tensor-parallel ranks along the
        dimension ``expected_shape`` reveals), as a detached copy on ``offload_device``.

        Every rank of the tensor-parallel group must call it.

        Example::

            >>> import torch, pyhook
            >>> fm = pyhook.FlexModel(torch.nn.Linear(2, 3), {})
            >>> fm.get_module_parameter("weight").shape
            torch.Size([3, 2])
        """
        param = get_parameter(self.module, parameter_name)
        par = self.parallel_state
        with torch.no_grad():
            data = param.detach()
            if is_dtensor(data):
                full: torch.Tensor | None = data.full_tensor()  # type: ignore[attr-defined]
            else:
                full, _, _ = gather_activation(
                    data,
                    par if par.distributed else None,
                    expected_shape=expected_shape,
                    what=f"get_module_parameter({parameter_name!r})",
                    everywhere=True,
                    gather_data_parallel=False,
                )
        assert full is not None
        return HookFunction._copy(full, self._state.offload_device)

    def extra_repr(self) -> str:
        return f"hook_functions={len(self._registry)}, groups={self.hook_groups}"


def _holds_dtensors(module: Any) -> bool:
    if not isinstance(module, nn.Module):
        return False
    return any(is_dtensor(p) for p in module.parameters(recurse=False))
