"""Stained Glass's ``TruncatedModule``: run a model only up to a submodule and return its output.

* :class:`TruncatedModule` wraps a model; calling it runs the model until the *truncation point*
  (a submodule, given as the object or as its dotted name) has produced its output, then stops
  the forward and returns that output. Layers after the truncation point never run.
* :class:`TruncationExecutionFinished` is the :class:`~pyhook.StopForward` that carries the
  intercepted output out of the model; a :class:`TruncatedModule` catches its own and never lets
  it reach the caller.
* :class:`HookNotCalledError` is raised when the wrapped model finished without ever running the
  truncation point.

The hook on the truncation point exists only while :meth:`TruncatedModule.forward` runs: after
success, after :class:`HookNotCalledError` and after any exception raised by the model, the
model carries no hook of ours.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import torch
from torch import nn

from ._compiled import dispatcher_of, raise_outside, unwrap_compiled
from ._hooks import HookSet, StopForward, check_not_compiled, compiled_path, is_own_stop
from .modules import module_name_of, resolve_module
from .points import module_path, resolve_targets

__all__ = ["HookNotCalledError", "TruncatedModule", "TruncationExecutionFinished"]

ModuleT = TypeVar("ModuleT", bound=nn.Module)


class HookNotCalledError(RuntimeError):
    """The forward pass finished without reaching the layer a hook was waiting for.

    Example::

        >>> import torch
        >>> from pyhook.truncate import TruncatedModule, HookNotCalledError
        >>> class Skip(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.used, self.unused = torch.nn.Identity(), torch.nn.ReLU()
        ...     def forward(self, x):
        ...         return self.used(x)
        >>> try:
        ...     TruncatedModule(Skip(), "unused")(torch.ones(1))
        ... except HookNotCalledError as e:
        ...     print(e)
        the forward of Skip finished without reaching the truncation point 'unused'
    """


class TruncationExecutionFinished(StopForward):
    """Raised by a :class:`TruncatedModule`'s hook when the truncation point has run.

    It carries the truncation point's output (``intercepted_output``) out of the wrapped model
    and is caught by the :class:`TruncatedModule` that raised it; it never reaches the user. It is
    a :class:`~pyhook.StopForward` (its ``payload`` is the intercepted output), so other pyhook
    tracers around the same model let it pass through untouched.

    Example::

        >>> import torch
        >>> from pyhook.truncate import TruncatedModule, TruncationExecutionFinished
        >>> try:
        ...     TruncatedModule.truncation_hook(torch.nn.ReLU(), (), torch.zeros(2))
        ... except TruncationExecutionFinished as e:
        ...     print(e.intercepted_output)
        tensor([0., 0.])
    """

    def __init__(self, message: str, intercepted_output: object, *, owner: object = None) -> None:
        super().__init__(message, owner=owner, payload=intercepted_output)

    @property
    def intercepted_output(self) -> object:
        """The output of the truncation point."""
        return self.payload


class _HandlerWrapper:
    """The lazily registered truncation hook: registered on ``with`` entry, removed on exit.

    ``owner`` is the token stamped on the :class:`TruncationExecutionFinished` the hook raises,
    so that only the call that registered the hook catches it.
    """

    __slots__ = ("_hook_fn", "_hooks", "_point", "owner")

    def __init__(
        self, point: nn.Module, hook_fn: Any, owner: object, model: nn.Module | None = None
    ) -> None:
        self._hooks = HookSet(model=model)
        self._point = point
        self._hook_fn = hook_fn
        self.owner = owner

    def __enter__(self) -> _HandlerWrapper:
        if not self._hooks.active:
            with self._hooks.registering():
                self._hooks.forward(self._point, self._hook)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def _hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        try:
            self._hook_fn(module, args, output)
        except TruncationExecutionFinished as stop:
            stop.owner = self.owner
            raise
        # A subclass whose truncation_hook does not raise: stop anyway, it is the contract.
        raise TruncationExecutionFinished("truncation point reached", output, owner=self.owner)

    def remove(self) -> None:
        """Remove the hook (idempotent)."""
        self._hooks.remove()

    @property
    def active(self) -> bool:
        """Whether the hook is currently registered."""
        return self._hooks.active


class _Truncated(Exception):
    """The stop of a TruncatedModule on a compiled model (plain, so that dynamo traces it)."""


class _Slot:
    """Where one compiled-path call of a TruncatedModule keeps the truncation point's output."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: Any = None

    def hook(self, module: nn.Module, args: Any, output: Any) -> None:
        self.value = output
        raise _Truncated

    def hook_outside(self, module: nn.Module, args: Any, output: Any) -> None:
        self.value = output
        raise_outside(_Truncated())


class TruncatedModule(nn.Module, Generic[ModuleT]):
    """A module that wraps another module that interrupts the forward pass when a specified
    truncation point is reached.

    This truncation happens by temporarily adding a hook to the truncation point that raises a
    :class:`TruncationExecutionFinished` exception which is then caught by the
    :class:`TruncatedModule` forward and the output of the truncation point is returned.

    Examples:
        Instantiating a TruncatedModule with a Binary Classification model and a truncation point:

        >>> model = torch.nn.Sequential(
        ...     torch.nn.Linear(10, 20),
        ...     torch.nn.ReLU(),
        ...     torch.nn.Linear(20, 30),
        ...     torch.nn.ReLU(),
        ...     torch.nn.Linear(30, 40),
        ...     torch.nn.ReLU(),
        ...     torch.nn.Linear(40, 2),
        ... )
        >>> truncation_layer = model[1]
        >>> truncated_model = TruncatedModule(model, truncation_layer)

        Using the TruncatedModule to get the output of the truncation point:

        >>> input = torch.randn(1, 10)
        >>> output = truncated_model(input)
        >>> # Note that shape of the output has the output_shape of the truncation point, not the full model
        >>> assert output.shape == (1, 20)

        The base model of the TruncatedModule is completely unaffected by the truncation:

        >>> base_output = model(input)
        >>> assert base_output.shape == (1, 2)  # Binary classification output shape

        The base model is also accessible directly through the module attribute of the
        TruncatedModule:

        >>> base_output = truncated_model.module(input)
        >>> assert base_output.shape == (1, 2)  # Binary classification output shape

        The truncation point may also be given by its dotted name (pyhook extension):

        >>> TruncatedModule(model, "2")(input).shape
        torch.Size([1, 30])

    The truncation point's *output* is returned (the hook is a forward hook, registered only for
    the duration of each call). Layers after it do not run, so truncation saves their compute.
    Gradients flow back from the returned output as from any intermediate tensor. ``module`` is
    a registered child, so ``.to()``, ``.eval()``, ``parameters()`` and ``state_dict()`` (keys
    prefixed ``module.``) act on the wrapped model; the truncation point is *not* registered a
    second time.
    """

    module: ModuleT

    def __init__(self, module: ModuleT, truncation_point: nn.Module | str) -> None:
        """Initialize the TruncatedModule with the provided module and truncation point.

        Raises ``ValueError`` if the truncation point is not a submodule of ``module``
        (``TypeError`` if it is neither a module nor a dotted name).
        """
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        inner = unwrap_compiled(module)  # names resolve as in the eager model
        if isinstance(truncation_point, nn.Module):
            try:
                name = module_name_of(inner, truncation_point)
            except ValueError:
                raise ValueError(
                    f"truncation_point {type(truncation_point).__name__} is not a submodule of the "
                    f"{type(module).__name__} given"
                ) from None
            point = truncation_point
        elif isinstance(truncation_point, str):
            try:
                hits = resolve_targets(inner, truncation_point)  # a standard point, or None
                if hits is not None and len(hits) != 1:
                    raise LookupError(f"it names {len(hits)} standard points, not one")
                name, point = hits[0] if hits else resolve_module(inner, truncation_point)
            except LookupError as e:
                raise ValueError(
                    f"truncation_point {truncation_point!r} is not a submodule: {e}"
                ) from None
        else:
            raise TypeError(
                "truncation_point must be a submodule of module or its dotted name, "
                f"got {type(truncation_point).__name__}: {truncation_point!r}"
            )
        super().__init__()
        self.module = module
        # Kept out of _modules: the truncation point is already inside `module`, registering it
        # again would duplicate its parameters in state_dict().
        self.__dict__["_truncation_point"] = point
        self.truncation_point_name = name
        # Compiled model: the stop goes through the point's dispatcher (see _forward_compiled).
        self.__dict__["_inner"] = inner
        self.__dict__["_compiled_run"] = None
        if compiled_path(inner, module_path(name, point)) is not None:
            check_not_compiled(inner, module_path(name, point), who="TruncatedModule")
            if inner is not module:  # torch.compile(model): our call compiles with its settings
                ctx: Any = module.dynamo_ctx
                self.__dict__["_compiled_run"] = ctx(self._forward_compiled)

    @property
    def truncation_point(self) -> nn.Module:
        """The submodule at which the forward pass is interrupted."""
        return self.__dict__["_truncation_point"]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Forward pass of the TruncatedModule that interrupts the forward pass when the
        truncation point is reached.

        All arguments are passed to the wrapped module; the output of the truncation point
        submodule is returned. Raises :class:`HookNotCalledError` if the truncation point was not
        reached, i.e. the wrapped module finished its forward without running it.
        """
        if dispatcher_of(self.truncation_point) is not None:
            run = self.__dict__["_compiled_run"]
            if run is not None and not torch.compiler.is_compiling():
                dispatcher_of(self.truncation_point).table(False)  # type: ignore[union-attr]
                return run(args, kwargs)  # (made first: compiled code then never sees it missing)
            return self._forward_compiled(args, kwargs)
        handler = self.lazy_register_truncation_hook()
        try:
            with handler:
                self.module(*args, **kwargs)
        except TruncationExecutionFinished as stop:
            if is_own_stop(stop, handler.owner):
                return stop.intercepted_output
            raise
        raise HookNotCalledError(
            f"the forward of {type(self.module).__name__} finished without reaching the "
            f"truncation point {self.truncation_point_name!r}"
        )

    def _forward_compiled(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The forward on a compiled model, in code dynamo traces as one graph up to the stop.

        The truncation point's dispatcher gets an entry for this call that keeps the output in
        a fresh slot and raises a plain exception, caught right here: when this runs inside
        dynamo (``torch.compile`` of this module, or of the wrapped model's settings for a
        ``torch.compile(model)`` wrapper), the graph simply ends at the truncation point, with
        no graph break and none of the later layers. Compiled with ``model.compile()`` instead,
        the wrapped model's compiled forward stops from eager Python (one graph break).
        """
        slot = _Slot()
        handle = dispatcher_of(self.truncation_point).add(  # type: ignore[union-attr]
            slot.hook if torch.compiler.is_compiling() else slot.hook_outside, post=True
        )
        try:
            try:
                inner: Any = self.__dict__["_inner"]
                inner(*args, **kwargs)
            except _Truncated:
                return slot.value
        finally:
            handle.remove()
        raise HookNotCalledError(
            f"the forward of {type(self._inner).__name__} finished without reaching the "
            f"truncation point {self.truncation_point_name!r}"
        )

    def lazy_register_truncation_hook(self) -> _HandlerWrapper:
        """Create the hook that interrupts the forward pass when the truncation point is reached.

        Returns a handler wrapper: a context manager that registers the hook on the truncation
        point on entry and removes it on exit, so the hook exists only while it is entered.
        Nothing is registered by this call itself.

        Example::

            >>> import torch
            >>> from pyhook.truncate import TruncatedModule
            >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
            >>> handler = TruncatedModule(net, net[0]).lazy_register_truncation_hook()
            >>> with handler:
            ...     len(net[0]._forward_hooks)
            1
            >>> len(net[0]._forward_hooks)
            0
        """
        return _HandlerWrapper(
            self.truncation_point,
            type(self).truncation_hook,
            owner=object(),
            model=unwrap_compiled(self.module),
        )

    @staticmethod
    def truncation_hook(module: nn.Module, args: Any, output: Any) -> None:
        """Intercept the output of the truncation point and raise a
        :class:`TruncationExecutionFinished` exception containing that output.

        ``module`` and ``args`` are unused. Always raises, in order to interrupt the wrapped
        model's forward.

        Example::

            >>> import torch
            >>> from pyhook.truncate import TruncatedModule, TruncationExecutionFinished
            >>> try:
            ...     TruncatedModule.truncation_hook(None, (), "out")
            ... except TruncationExecutionFinished as e:
            ...     e.intercepted_output
            'out'
        """
        raise TruncationExecutionFinished("truncation point reached", output)

    def extra_repr(self) -> str:
        return f"truncation_point={self.truncation_point_name!r}"
