"""Guarantee 5: tracing a model compiled with ``torch.compile`` gives eager results.

What PyTorch does (checked by ``test_pytorch_ignores_hooks_added_after_compilation``): with
``torch._dynamo.config.skip_nnmodule_hook_guards = True`` (the default) compiled code does not
notice plain hooks added or removed after compilation. pyhook's tracers therefore register
through a persistent dispatcher on each traced module of a compiled model (see
:mod:`pyhook._compiled`), which compiled code does see; they give eager values with the default
setting (tests/test_compiled.py covers every tool) and with ``skip_nnmodule_hook_guards = False``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from pyhook import Trace, TraceDict
from pyhook._compiled import active_entries
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
def test_tracing_a_compiled_model_with_default_settings_sees_every_tracer(how):
    """Formerly refused with CompiledModelError: now each tracer's values are fresh and exact."""
    net = mlp()
    x = torch.randn(3, 4)
    if how == "torch.compile":
        runner = torch.compile(net, backend="eager")
    else:
        net.compile(backend="eager")
        runner = net
    runner(x)
    with torch.no_grad():
        h0, h2 = net[0](x), net(x)
    with Trace(net, "0") as t:
        runner(x)
    assert torch.allclose(t.output, h0)
    with Trace(net, "2", stop=True) as t:
        runner(x)
    assert torch.allclose(t.output, h2)
    with TraceDict(net, ["0", "2"]) as td:
        runner(x)
    assert torch.allclose(td["0"].output, h0) and torch.allclose(td["2"].output, h2)
    with capture(net, ["0"]) as rec:
        runner(x)
    assert torch.allclose(rec["0"], h0)
    if how == "torch.compile":
        with Trace(runner, "0") as t:
            runner(x)
        assert torch.allclose(t.output, h0)
    # only the persistent dispatchers remain; no tracer entry is left in them
    assert active_entries(net) == 0
    assert all(len(m._forward_hooks) <= 1 for m in net.modules())


def test_a_compiled_submodule_is_detected_on_the_path_to_the_layer():
    outer = nn.Sequential(mlp(), nn.Linear(2, 2))
    outer[0].compile(backend="eager")
    x = torch.randn(1, 4)
    outer(x)
    with Trace(outer, "0.2") as t:  # inside the compiled submodule: dispatched, still exact
        y = outer(x)
    with torch.no_grad():
        assert torch.allclose(t.output, outer[0](x)) and torch.allclose(outer[1](t.output), y)
    # a sibling branch that is not compiled gets a plain hook
    with Trace(outer, "1") as t:
        y = outer(x)
    assert torch.equal(t.output, y)
    assert "_pyhook_dispatch" not in outer[1].__dict__


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
    assert active_entries(net) == 0  # only the persistent dispatchers remain


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


def test_fullgraph_traces_pyhook_hooks(hook_guards):
    """fullgraph=True used to fail on the thread guard of a hook; dispatched hooks trace."""
    net = mlp()
    x = torch.randn(2, 4)
    compiled = torch.compile(net, backend="eager", fullgraph=True)
    compiled(x)
    with Trace(net, "0", clone=True) as t:
        compiled(x)
    with torch.no_grad():
        assert torch.allclose(t.output, net[0](x))


def test_deephook_trace_on_compiled_model_matches_eager():
    net = mlp()
    x = torch.randn(1, 4)
    compiled = torch.compile(net, backend="eager")
    compiled(x)
    with DeepTrace(compiled, "0") as t:
        compiled(x)
    with torch.no_grad():
        assert torch.allclose(t.output, net[0](x))
