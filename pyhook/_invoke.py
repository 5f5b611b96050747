"""``invoke_with_optional_args``: call a function with only the arguments it is written to take."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["accepts_argument", "invoke_with_optional_args"]

_P = inspect.Parameter


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(
            fn
        )  # binds `self` of methods and callable objects, unwraps partials
    except (TypeError, ValueError):  # builtins without a signature
        return None


def accepts_argument(fn: Callable[..., Any], name: str) -> bool:
    """True when ``fn`` declares a parameter called ``name`` (not merely ``**kwargs``)."""
    sig = _signature(fn)
    return (
        sig is not None
        and name in sig.parameters
        and sig.parameters[name].kind
        not in (
            _P.VAR_POSITIONAL,
            _P.VAR_KEYWORD,
        )
    )


def invoke_with_optional_args(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Invoke ``fn`` with only the arguments it accepts, preferring matches by name.

    Rules (nethook's, with its bugs fixed):

    1. a positional parameter whose name matches a caller keyword gets that value;
    2. the remaining positional parameters take the caller's positional arguments in order;
    3. positional parameters still unfilled take the unused keywords, in the caller's order;
    4. keyword-only parameters take matching keywords; ``**kwargs`` takes every keyword left;
       ``*args`` takes every positional value left (including leftover keywords when the
       function has no ``**kwargs``);
    5. a required parameter the caller cannot provide raises ``TypeError``.

    Bound methods, callable objects and ``functools.partial`` work; so does ``**kwargs``.

    Example::

        >>> from pyhook import invoke_with_optional_args
        >>> invoke_with_optional_args(lambda layer, output: (layer, output), output=1, layer="h.0")
        ('h.0', 1)
        >>> invoke_with_optional_args(lambda x: x, output=1, layer="h.0", inputs=())
        1
    """
    sig = _signature(fn)
    if sig is None:
        return fn(*args, **kwargs)
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)]
    kwonly = [p for p in params if p.kind == _P.KEYWORD_ONLY]
    has_varargs = any(p.kind == _P.VAR_POSITIONAL for p in params)
    has_varkw = any(p.kind == _P.VAR_KEYWORD for p in params)

    positional_names = {p.name for p in positional}
    used: set[str] = set()
    values: list[Any] = []
    pending_args = list(args)
    missing: list[str] = []
    for p in positional:
        if p.name in kwargs:
            values.append(kwargs[p.name])
            used.add(p.name)
        elif pending_args:
            values.append(pending_args.pop(0))
        else:
            unused = [k for k in kwargs if k not in used and k not in positional_names]
            if unused:
                values.append(kwargs[unused[0]])
                used.add(unused[0])
            elif p.default is not _P.empty:
                break  # leave this and later defaulted parameters at their defaults
            else:
                missing.append(p.name)
                continue
    if missing:
        name = getattr(fn, "__name__", type(fn).__name__)
        raise TypeError(f"{name}() cannot be passed {', '.join(missing)}.")
    call_kwargs: dict[str, Any] = {}
    for p in kwonly:
        if p.name in kwargs and p.name not in used:
            call_kwargs[p.name] = kwargs[p.name]
            used.add(p.name)
    leftover = {k: v for k, v in kwargs.items() if k not in used}
    if has_varargs:
        values.extend(pending_args)
        if not has_varkw:
            values.extend(leftover.values())
            leftover = {}
    if has_varkw:
        call_kwargs.update(leftover)
    return fn(*values, **call_kwargs)
