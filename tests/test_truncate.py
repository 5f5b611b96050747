"""TruncatedModule: the Stained Glass seed contract, hook lifetime, real early stop, GPT-2."""

from __future__ import annotations

import doctest

import pytest
import torch
from _models import Counting, all_hooks, gpt2, mlp
from torch import nn

import pyhook.truncate as truncate_mod
from pyhook._hooks import StopForward
from pyhook.truncate import HookNotCalledError, TruncatedModule, TruncationExecutionFinished

# The doctest of the seed document (stainedglass_core.model.truncated_module), verbatim.
SEED_DOCTEST = """
>>> model = torch.nn.Sequential(
... torch.nn.Linear(10, 20),
... torch.nn.ReLU(),
... torch.nn.Linear(20, 30),
... torch.nn.ReLU(),
... torch.nn.Linear(30, 40),
... torch.nn.ReLU(),
... torch.nn.Linear(40, 2),
... )
>>> truncation_layer = model[1]
>>> truncated_model = TruncatedModule(model, truncation_layer)
>>> input = torch.randn(1, 10)
>>> output = truncated_model(input)
>>> # Note that shape of the output has the output_shape of the truncation point, not the full model
>>> assert output.shape == (1, 20)
>>> base_output = model(input)
>>> assert base_output.shape == (1, 2) # Binary classification output shape
>>> base_output = truncated_model.module(input)
>>> assert base_output.shape == (1, 2) # Binary classification output shape
>>> sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
0
"""


def _run_doctest(text: str, globs: dict) -> doctest.TestResults:
    test = doctest.DocTestParser().get_doctest(text, globs, "seed", None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    return runner.summarize(verbose=False)


def test_seed_doctest_verbatim():
    result = _run_doctest(SEED_DOCTEST, {"torch": torch, "TruncatedModule": TruncatedModule})
    assert result.attempted == 11 and result.failed == 0


@pytest.mark.parametrize("module", ["pyhook.truncate", "pyhook.extend", "pyhook.deephook"])
def test_module_doctests(module):
    import importlib

    mod = importlib.import_module(module)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_returns_the_output_of_the_truncation_point_like_a_hand_hook():
    net, x = mlp(), torch.randn(5, 4)
    seen = {}
    h = net[2].register_forward_hook(lambda m, a, o: seen.setdefault("out", o))
    net(x)
    h.remove()
    assert torch.equal(TruncatedModule(net, net[2])(x), seen["out"])
    assert torch.equal(TruncatedModule(net, "2")(x), seen["out"])  # a dotted name works too
    assert all_hooks(net) == 0


def test_layers_after_the_truncation_point_do_not_run():
    net, x = mlp(), torch.randn(5, 4)
    counter: Counting = net[3]
    TruncatedModule(net, net[2])(x)
    assert counter.calls == 0
    TruncatedModule(net, net[3])(x)
    assert counter.calls == 1
    last = nn.Linear(2, 2)
    net.append(last)
    ran = []
    last.register_forward_pre_hook(lambda m, a: ran.append(1))
    TruncatedModule(net, net[3])(x)
    assert ran == [] and counter.calls == 2
    last._forward_pre_hooks.clear()
    assert all_hooks(net) == 0


def test_hook_exists_only_during_the_call():
    net, x = mlp(), torch.randn(2, 4)
    during = []
    net[3].register_forward_pre_hook(lambda m, a: during.append(len(net[3]._forward_hooks)))
    tm = TruncatedModule(net, net[3])
    assert all_hooks(net) == 1  # only the probe above: construction registers nothing
    tm(x)
    assert during == [1]
    net[3]._forward_pre_hooks.clear()
    assert all_hooks(net) == 0
    handler = tm.lazy_register_truncation_hook()
    assert all_hooks(net) == 0 and not handler.active
    with handler:
        assert len(net[3]._forward_hooks) == 1
    assert all_hooks(net) == 0


def test_not_a_submodule_raises_value_error_before_registering():
    net = mlp()
    with pytest.raises(ValueError, match="Linear"):
        TruncatedModule(net, nn.Linear(4, 8))
    with pytest.raises(ValueError, match="'7'"):
        TruncatedModule(net, "7")
    with pytest.raises(TypeError, match="truncation_point"):
        TruncatedModule(net, 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="module"):
        TruncatedModule("net", net[0])  # type: ignore[arg-type]
    assert all_hooks(net) == 0


def test_hook_not_called_error_when_point_is_not_reached():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x, use_b=False):
            return self.b(x) if use_b else self.a(x)

    model, x = Branchy(), torch.randn(2, 3)
    tm = TruncatedModule(model, model.b)
    with pytest.raises(HookNotCalledError, match="'b'"):
        tm(x)
    assert all_hooks(model) == 0
    assert torch.equal(tm(x, use_b=True), model.b(x))  # kwargs are passed through
    assert all_hooks(model) == 0


def test_exception_in_model_propagates_and_leaves_no_hook():
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    net = nn.Sequential(nn.Linear(2, 2), Boom(), nn.ReLU())
    with pytest.raises(RuntimeError, match="boom"):
        TruncatedModule(net, net[2])(torch.randn(1, 2))
    assert all_hooks(net) == 0


def test_gpt2_block_k_equals_full_forward_hidden_states():
    model = gpt2(n_layer=3)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        full = model(ids, output_hidden_states=True)
        before = all_hooks(model)  # transformers installs its own output-capturing hooks
        lm_head_runs = []
        h = model.lm_head.register_forward_pre_hook(lambda m, a: lm_head_runs.append(1))
        for k in range(2):  # the last hidden state has ln_f applied, so stop before it
            out = TruncatedModule(model, f"transformer.h.{k}")(ids)
            assert torch.equal(out, full.hidden_states[k + 1])
        out = TruncatedModule(model, model.transformer.ln_f)(ids)
        assert torch.equal(out, full.hidden_states[-1])
        h.remove()
    assert lm_head_runs == []
    assert all_hooks(model) == before


def test_no_grad_and_autograd():
    net, x = mlp(), torch.randn(3, 4)
    tm = TruncatedModule(net, net[2])
    with torch.no_grad():
        assert not tm(x).requires_grad
    out = tm(x)
    out.pow(2).sum().backward()
    got = net[0].weight.grad.clone()
    net.zero_grad()
    net[2](net[1](net[0](x))).pow(2).sum().backward()  # independent reference
    assert torch.allclose(got, net[0].weight.grad)
    assert all_hooks(net) == 0


def test_own_stops_only_nested_truncations():
    net, x = mlp(), torch.randn(3, 4)
    inner = TruncatedModule(net, "2")
    # The outer point runs before the inner one: the outer stop passes through the inner wrapper.
    outer = TruncatedModule(inner, "module.0")
    assert torch.equal(outer(x), net[0](x))
    # The inner point runs first: the inner wrapper returns normally, the outer point never runs.
    late = TruncatedModule(TruncatedModule(net, "0"), "module.4")
    with pytest.raises(HookNotCalledError):
        late(x)
    assert all_hooks(net) == 0


def test_someone_elses_stop_is_not_swallowed():
    net, x = mlp(), torch.randn(3, 4)
    h = net[0].register_forward_hook(TruncatedModule.truncation_hook)  # unowned
    with pytest.raises(TruncationExecutionFinished) as info:
        TruncatedModule(net, "2")(x)
    h.remove()
    assert torch.equal(info.value.intercepted_output, net[0](x))
    assert all_hooks(net) == 0


def test_concurrent_truncations_in_threads_do_not_see_each_other():
    import threading

    net = mlp()
    x = torch.randn(4, 4)
    with torch.no_grad():
        refs = {"0": net[0](x), "2": net[2](net[1](net[0](x)))}
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def work(point):
        tm = TruncatedModule(net, point)
        try:
            barrier.wait()
            for _ in range(50):
                with torch.no_grad():
                    assert torch.equal(tm(x), refs[point])
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(p,)) for p in refs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all_hooks(net) == 0


def test_exception_types():
    e = TruncationExecutionFinished("msg", intercepted_output=[1])
    assert isinstance(e, StopForward) and e.payload == [1] and e.intercepted_output == [1]
    assert str(e) == "msg"
    assert issubclass(HookNotCalledError, RuntimeError)


def test_module_properties_generic_and_state_dict():
    net = mlp()
    tm = TruncatedModule[nn.Sequential](net, net[1])
    assert tm.module is net and tm.truncation_point is net[1]
    assert tm.truncation_point_name == "1"
    assert list(tm.state_dict()) == ["module." + k for k in net.state_dict()]
    assert sum(1 for _ in tm.parameters()) == sum(1 for _ in net.parameters())
    tm.to(torch.float64)
    assert tm(torch.randn(1, 4, dtype=torch.float64)).dtype == torch.float64
    assert "truncation_point='1'" in repr(tm)


def test_truncate_at_root_returns_full_output():
    net, x = mlp(), torch.randn(2, 4)
    assert torch.equal(TruncatedModule(net, net)(x), net(x))
    assert all_hooks(net) == 0


def test_module_docstring_is_an_index():
    assert "TruncatedModule" in truncate_mod.__doc__
