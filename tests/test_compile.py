"""Guarantee 5: tracing a model compiled with ``torch.compile`` is correct or a clear error.

What PyTorch does (checked by ``test_pytorch_ignores_hooks_added_after_compilation``): with
``torch._dynamo.config.skip_nnmodule_hook_guards = True`` (the default) compiled code does not
notice hooks added or removed after compilation. pyhook's tracers therefore raise
:class:`~pyhook._hooks.CompiledModelError` on a compiled model unless dynamo guards hooks; with
``skip_nnmodule_hook_guards = False`` set before compiling, the tracers give eager values.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from _hygiene import diff, hook_snapshot
from torch import nn

from pyhook import Trace, TraceDict
from pyhook._hooks import CompiledModelError
from pyhook.capture import capture
from pyhook.deephook import Trace as DeepTrace

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.fixture(autouse=True)
def fresh_dynamo(monkeypatch):
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def hook_guards():
    """Make dynamo recompile when hooks change (the documented way to trace compiled models).

    dynamo's own ``config.patch`` restores the setting; pytest's monkeypatch must not be used
    on a config module (newer pytest undoes it with ``delattr``, which removes the option).
    """
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
        yield


def test_pytorch_ignores_hooks_added_after_compilation():
    """The reason for the error: a plain hook added after compiling is silently skipped.

    If a PyTorch release changes this, this test fails and the error can be relaxed.
    """
    net = mlp()
    x = torch.randn(3, 4)
    compiled = torch.compile(net, backend="eager")
    compiled(x)
    seen = []
    h = net[0].register_forward_hook(lambda m, a, o: seen.append(o))
    try:
        compiled(x)
    finally:
        h.remove()
    assert seen == []


@pytest.mark.parametrize("how", ["torch.compile", "module.compile"])
def test_tracing_a_compiled_model_raises_a_clear_error_and_registers_nothing(how):
    net = mlp()
    x = torch.randn(3, 4)
    if how == "torch.compile":
        runner = torch.compile(net, backend="eager")
    else:
        net.compile(backend="eager")
        runner = net
    runner(x)
    before = hook_snapshot(net)
    makers = [
        lambda: Trace(net, "0"),
        lambda: Trace(net, "2", stop=True),
        lambda: TraceDict(net, ["0", "2"]),
        lambda: capture(net, ["0"]).__enter__(),
    ]
    if how == "torch.compile":
        makers.append(lambda: Trace(runner, "0"))
    for make in makers:
        with pytest.raises(CompiledModelError, match="skip_nnmodule_hook_guards = False") as info:
            make()
        assert "uncompiled" in str(info.value)
        assert not diff(before, hook_snapshot(net))


def test_a_compiled_submodule_is_detected_on_the_path_to_the_layer():
    outer = nn.Sequential(mlp(), nn.Linear(2, 2))
    outer[0].compile(backend="eager")
    with pytest.raises(CompiledModelError, match="module '0'"):
        Trace(outer, "0.2")
    # a sibling branch that is not compiled can be traced
    with Trace(outer, "1") as t:
        y = outer(torch.randn(1, 4))
    assert torch.equal(t.output, y)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_with_hook_guards_traces_of_compiled_models_match_eager(hook_guards, backend):
    net = mlp()
    x, x2 = torch.randn(3, 4), torch.randn(3, 4)
    compiled = torch.compile(net, backend=backend)
    compiled(x)  # compiled before any hook exists
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Trace(compiled, "0", edit_output=lambda output: output + 1, clone=True) as t:
            y = compiled(x)
        with torch.no_grad():
            assert torch.allclose(t.output, net[0](x) + 1)
            assert torch.allclose(y, net[2](torch.relu(net[0](x) + 1)))
        # the edit is gone after exit (no stale compiled edit)
        assert torch.allclose(compiled(x), net(x))
        # fresh values for a new input, never the previous capture
        with TraceDict(net, ["0", "2"], stop=True) as td:
            compiled(x2)
        assert torch.allclose(td["0"].output, net[0](x2))
        assert torch.allclose(td["2"].output, net(x2))
        with Trace(net, "1", keep_calls=True) as t:
            compiled(x)
            compiled(x2)
        assert [c.step for c in t.calls] == [0, 1]
        assert torch.allclose(t.calls[1].output, torch.relu(net[0](x2)))
    assert sum(len(m._forward_hooks) for m in net.modules()) == 0


def test_module_compile_with_hook_guards_matches_eager(hook_guards):
    net = mlp()
    x = torch.randn(2, 4)
    net.compile(backend="eager")
    net(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Trace(net, "0", edit_output=lambda output: output * 0) as t:
            y = net(x)
    assert torch.equal(t.output, torch.zeros(2, 8))
    with torch.no_grad():
        assert torch.allclose(y, net[2](torch.zeros(2, 8)))
    assert not torch.allclose(net(x), y)


def test_fullgraph_fails_loudly_rather_than_silently(hook_guards):
    """fullgraph=True cannot inline the thread guard of a hook: dynamo raises (never stale)."""
    net = mlp()
    x = torch.randn(2, 4)
    compiled = torch.compile(net, backend="eager", fullgraph=True)
    compiled(x)
    with pytest.raises(Exception, match="(?i)dynamo|unsupported|graph"), Trace(net, "0"):
        compiled(x)
    assert sum(len(m._forward_hooks) for m in net.modules()) == 0


def test_deephook_trace_on_compiled_model_raises():
    net = mlp()
    compiled = torch.compile(net, backend="eager")
    compiled(torch.randn(1, 4))
    with pytest.raises(CompiledModelError):
        DeepTrace(net, "0").close()
