"""nethook's module helpers and invoke_with_optional_args, against known values (api-notes 1.6-1.8)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import pyhook as nethook
from _models import gpt2


def nested():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.Linear(2, 2), nn.ReLU()), nn.Linear(2, 2))


def test_get_module_and_parameter():
    net = nested()
    assert nethook.get_module(net, "") is net
    assert nethook.get_module(net, "1.1") is net[1][1]
    assert nethook.get_parameter(net, "1.1.weight") is net[1][1].weight
    with pytest.raises(LookupError, match="closest names"):
        nethook.get_module(net, "1.5")
    with pytest.raises(LookupError, match="1.1.weight"):
        nethook.get_parameter(net, "1.1.wieght")
    with pytest.raises(TypeError, match="str"):
        nethook.get_module(net, 1)  # type: ignore[arg-type]


def test_unknown_name_error_is_keyerror_attributeerror_and_lookuperror():
    with pytest.raises(KeyError):
        nethook.get_module(nested(), "x")
    with pytest.raises(AttributeError):
        nethook.get_module(nested(), "x")


def test_shared_submodule_found_under_every_name():
    lin = nn.Linear(2, 2)
    net = nn.Sequential(lin, nn.ReLU(), lin)
    assert nethook.get_module(net, "2") is lin  # nethook only finds the first alias


def test_names_lists():
    net = nested()
    assert nethook.module_names(net) == [n for n, _ in net.named_modules()]
    assert nethook.parameter_names(net) == [n for n, _ in net.named_parameters()]


def test_replace_module_top_level_and_dotted():
    net = nested()
    nethook.replace_module(net, "0", nn.Identity())
    nethook.replace_module(net, "1.0", nn.Tanh())
    assert isinstance(net[0], nn.Identity) and isinstance(net[1][0], nn.Tanh)
    with pytest.raises(LookupError):
        nethook.replace_module(net, "7", nn.Tanh())
    with pytest.raises(TypeError, match="nn.Module"):
        nethook.replace_module(net, "0", "relu")  # type: ignore[arg-type]


def test_set_requires_grad():
    net = nested()
    t = torch.zeros(2)
    nethook.set_requires_grad(False, net)
    assert not any(p.requires_grad for p in net.parameters())
    nethook.set_requires_grad(True, net[0], t)
    assert net[0].weight.requires_grad and t.requires_grad and not net[2].weight.requires_grad
    with pytest.raises(TypeError, match="modules, parameters or tensors"):
        nethook.set_requires_grad(True, "net")  # type: ignore[arg-type]


def test_set_requires_grad_with_a_bad_argument_changes_nothing():
    net, t = nested(), torch.zeros(2)
    with pytest.raises(TypeError, match=r"got str as argument 4"):
        nethook.set_requires_grad(False, net, t, "net")  # type: ignore[arg-type]
    assert all(p.requires_grad for p in net.parameters()) and not t.requires_grad


def keys(seq):
    return [(n, type(m).__name__) for n, m in seq.named_modules() if n]


def test_subsequence_known_results():
    net = nested()
    assert keys(nethook.subsequence(net, first_layer="1.1")) == [
        ("1", "Sequential"), ("1.1", "Linear"), ("1.2", "ReLU"), ("2", "Linear")
    ]
    assert keys(nethook.subsequence(net, after_layer="0", upto_layer="2")) == [
        ("1", "Sequential"), ("1.0", "ReLU"), ("1.1", "Linear"), ("1.2", "ReLU")
    ]
    assert keys(nethook.subsequence(net, single_layer="1.1")) == [("1", "Sequential"), ("1.1", "Linear")]
    assert keys(nethook.subsequence(net, last_layer="0")) == [("0", "Linear")]


def test_subsequence_copies_unless_sharing_and_computes_the_same():
    net = nested()
    x = torch.randn(3, 2)
    head = nethook.subsequence(net, upto_layer="2")
    tail = nethook.subsequence(net, first_layer="2")
    assert torch.allclose(tail(head(x)), net(x))
    assert head[0].weight is not net[0].weight
    shared = nethook.subsequence(net, upto_layer="2", share_weights=True)
    assert shared[0] is net[0]
    net.eval()
    assert not nethook.subsequence(net, first_layer="0").training


def test_subsequence_errors():
    net = nested()
    with pytest.raises(ValueError, match="not found"):
        nethook.subsequence(net, first_layer="9")
    with pytest.raises(ValueError):
        nethook.subsequence(net, first_layer="0", after_layer="1")
    with pytest.raises(ValueError):
        nethook.subsequence(net, single_layer="0", last_layer="1")
    with pytest.raises(ValueError, match="not Sequential"):
        nethook.subsequence(nn.Sequential(nn.Linear(2, 2)), first_layer="0.weight")


def test_hierarchical_subsequence_direct():
    net = nested()
    sub = nethook.hierarchical_subsequence(net, first=["1", "1"], last=None, after=None, upto=None)
    assert keys(sub)[0] == ("1", "Sequential")


# --- invoke_with_optional_args: the matrix of api-notes 1.6, with nethook's bugs fixed ----------

K = dict(output="O", layer="L", inputs="I")


class Callable2:
    def __call__(self, a, b):
        return a, b

    def method(self, output):
        return output


@pytest.mark.parametrize(
    "fn, expected",
    [
        (lambda output: output, "O"),
        (lambda x: x, "O"),
        (lambda x, layer: (x, layer), ("O", "L")),
        (lambda a, b: (a, b), ("O", "L")),
        (lambda a, b, c: (a, b, c), ("O", "L", "I")),
        (lambda layer, output: (layer, output), ("L", "O")),
        (lambda a, b, c, d=5: (a, b, c, d), ("O", "L", "I", 5)),
        (lambda output, *, layer: (output, layer), ("O", "L")),
        (lambda output, **kw: (output, kw), ("O", {"layer": "L", "inputs": "I"})),  # fixed
        (lambda *args: args, ("O", "L", "I")),  # fixed (nethook: TypeError)
        (lambda *args, **kw: (args, kw), ((), K)),
        (lambda: "nothing", "nothing"),
        (Callable2(), ("O", "L")),  # fixed (nethook: TypeError)
        (Callable2().method, "O"),  # fixed
        (functools.partial(lambda z, output: (z, output), 1), (1, "O")),
    ],
)
def test_invoke_with_optional_args_matrix(fn, expected):
    assert nethook.invoke_with_optional_args(fn, **K) == expected


def test_invoke_with_optional_args_errors_and_positional():
    with pytest.raises(TypeError, match="cannot be passed d"):
        nethook.invoke_with_optional_args(lambda a, b, c, d: 0, **K)
    with pytest.raises(TypeError):
        nethook.invoke_with_optional_args(lambda output, *, foo: 0, **K)
    assert nethook.invoke_with_optional_args(lambda a, b: (a, b), 1, 2, 3) == (1, 2)
    assert nethook.invoke_with_optional_args(lambda a, layer: (a, layer), 1, layer=2) == (1, 2)


def test_gpt2_names_resolve_fast_path_equals_named_modules():
    model = gpt2()
    for name, module in model.named_modules():
        assert nethook.get_module(model, name) is module
