"""recursive_copy: structures, pass-through leaves and flags, under both backends."""

from __future__ import annotations

import collections

import pytest
import torch

import pyhook
from _models import DataOut, Pair


def test_no_flag_returns_the_object_itself(backend):
    x = (torch.ones(2), [torch.zeros(1)])
    assert pyhook.recursive_copy(x) is x


@pytest.mark.parametrize("leaf", [None, "text", 3, 2.5, object()])
def test_non_tensor_leaves_pass_through(leaf, backend):
    y = pyhook.recursive_copy((torch.ones(2), leaf), clone=True, detach=True)
    assert y[1] is leaf


def test_containers_keep_types_and_fields(backend):
    od = collections.OrderedDict(a=torch.ones(2), b=None)
    dd = collections.defaultdict(list, {"k": torch.ones(1)})
    x = {
        "pair": Pair(torch.randn(2, 3), None),
        "dc": DataOut(torch.randn(3), "n"),
        "od": od,
        "dd": dd,
        "list": [torch.arange(4), (torch.ones(1, dtype=torch.bool), "s")],
    }
    y = pyhook.recursive_copy(x, clone=True)
    assert isinstance(y["pair"], Pair) and y["pair"].aux is None
    assert isinstance(y["dc"], DataOut) and y["dc"].note == "n"
    assert type(y["od"]) is collections.OrderedDict and list(y["od"]) == ["a", "b"]
    assert type(y["dd"]) is collections.defaultdict and y["dd"].default_factory is list
    assert y["list"][1][1] == "s"
    for a, b in [(x["pair"].hidden, y["pair"].hidden), (x["dc"].hidden, y["dc"].hidden),
                 (x["list"][0], y["list"][0]), (x["od"]["a"], y["od"]["a"])]:
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()


def test_model_output_and_cache_objects():
    from transformers import DynamicCache
    from transformers.modeling_outputs import BaseModelOutputWithPast

    cache = DynamicCache()
    out = BaseModelOutputWithPast(last_hidden_state=torch.randn(1, 2, 3), past_key_values=cache)
    y = pyhook.recursive_copy(out, clone=True, detach=True)
    assert type(y) is BaseModelOutputWithPast
    assert y.past_key_values is cache
    assert torch.equal(y.last_hidden_state, out.last_hidden_state)
    assert y.last_hidden_state.data_ptr() != out.last_hidden_state.data_ptr()


def test_detach_and_clone_flags(backend):
    w = torch.randn(3, requires_grad=True)
    h = w * 2
    d = pyhook.recursive_copy([h], detach=True)[0]
    assert not d.requires_grad and d.data_ptr() == h.data_ptr()
    c = pyhook.recursive_copy([h], clone=True)[0]
    assert c.requires_grad and c.data_ptr() != h.data_ptr()
    c.sum().backward()
    assert torch.equal(w.grad, torch.full((3,), 2.0))  # the clone stays on the graph


def test_retain_grad_with_clone_fills_the_copy(backend):
    w = torch.randn(3, requires_grad=True)
    h = w * 2
    c = pyhook.recursive_copy(h, clone=True, retain_grad=True)
    (c * 3).sum().backward()
    assert torch.equal(c.grad, torch.full((3,), 3.0))


def test_retain_grad_ignores_detach_and_skips_integer_tensors(backend):
    x = torch.ones(2)
    n = torch.ones(2, dtype=torch.long)
    y, m = pyhook.recursive_copy((x, n), detach=True, retain_grad=True)
    assert y is x and x.requires_grad
    assert m is n and not n.requires_grad


def test_backends_agree(backend):
    torch.manual_seed(0)
    base = torch.randn(6, 5)
    x = {"t": base.t(), "s": base[::2], "z": torch.empty(0, 3), "c": torch.randn(2, dtype=torch.complex64)}
    y = pyhook.recursive_copy(x, clone=True)
    with pyhook.use_backend("reference"):
        ref = pyhook.recursive_copy(x, clone=True)
    for k in x:
        assert torch.equal(y[k], ref[k]) and y[k].stride() == ref[k].stride(), k
