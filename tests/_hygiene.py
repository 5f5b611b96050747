"""Helpers of the reliability suite: exact snapshots of every hook dictionary of a model."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, settings
from torch import nn
from torch.nn.modules import module as _module_mod

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)

_GLOBAL_DICTS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
    "_global_forward_hooks_always_called",
    "_global_forward_hooks_with_kwargs",
)


def hook_snapshot(model: nn.Module) -> dict[str, Any]:
    """Every hook dictionary of every submodule (and the global ones), by identity of the hooks.

    Two snapshots are equal when exactly the same hook objects sit under the same handle ids,
    in the same order: a hook added, removed, replaced or reordered shows up as a difference.
    """
    snap: dict[str, Any] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        for attr in _HOOK_DICTS:
            d = getattr(mod, attr, None)
            if d is None:
                continue
            snap[f"{name}:{attr}"] = [(k, id(v) if callable(v) else v) for k, v in d.items()]
        snap[f"{name}:_backward_hooks_kind"] = getattr(mod, "_is_full_backward_hook", None)
    for attr in _GLOBAL_DICTS:
        d = getattr(_module_mod, attr, None)
        if d is not None:
            snap[f"<global>:{attr}"] = [(k, id(v) if callable(v) else v) for k, v in d.items()]
    return snap


def diff(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Human-readable differences between two snapshots (empty when equal)."""
    keys = sorted(set(before) | set(after))
    return [
        f"{k}: {before.get(k)!r} -> {after.get(k)!r}" for k in keys if before.get(k) != after.get(k)
    ]


def examples(default: int) -> int:
    """Number of hypothesis examples: bounded in CI, ``PYHOOK_FUZZ_EXAMPLES=N`` for long runs."""
    return int(os.environ.get("PYHOOK_FUZZ_EXAMPLES", default))


def bounded(default: int) -> settings:
    return settings(
        max_examples=examples(default),
        deadline=None,
        derandomize=os.environ.get("PYHOOK_FUZZ_EXAMPLES") is None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        database=None,
    )


def run_in_threads(fn: Callable[[int], Any], n: int) -> list[Any]:
    """``[fn(0), ..., fn(n - 1)]``, each call on its own thread; any exception fails the test."""
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            results[k] = fn(k)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    return results
