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


def test_forward_mode_ad_tangents_survive_a_copy(backend):
    # The native op has no forward-mode formula: its copies of dual tensors came back
    # without their tangents, where clone() (the reference) keeps them.
    import torch.autograd.forward_ad as fwad

    from pyhook import _backend

    x, t = torch.randn(3, 4), torch.randn(3, 4)
    with fwad.dual_level():
        dual = fwad.make_dual(x, t)
        out = pyhook.recursive_copy({"h": dual, "p": (dual.t(),)}, clone=True)
        rows = _backend.gather_rows([dual[:1], dual[1:]], [2, 0])
        got = [fwad.unpack_dual(o).tangent for o in (out["h"], out["p"][0], rows)]
    assert all(g is not None for g in got)
    assert torch.equal(got[0], t) and torch.equal(got[1], t.t())
    assert torch.equal(got[2], t[[2, 0]])


def test_an_unused_copy_gives_its_input_no_gradient(backend):
    # The native op's backward got zeros for the copies no loss used and gave them to their
    # inputs: .grad became a zero tensor where clone() leaves it None (optimisers skip None).
    from pyhook import _backend

    used, unused = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    out = _backend.clone_tensors([used, unused])
    out[0].sum().backward()
    assert used.grad.tolist() == [1.0, 1.0, 1.0]
    assert unused.grad is None


def test_backends_agree(backend):
    torch.manual_seed(0)
    base = torch.randn(6, 5)
    x = {"t": base.t(), "s": base[::2], "z": torch.empty(0, 3), "c": torch.randn(2, dtype=torch.complex64)}
    y = pyhook.recursive_copy(x, clone=True)
    with pyhook.use_backend("reference"):
        ref = pyhook.recursive_copy(x, clone=True)
    for k in x:
        assert torch.equal(y[k], ref[k]) and y[k].stride() == ref[k].stride(), k


# -- layouts the native kernel does not take (issue 12, item 9) ------------------------------------


def _layouts() -> dict[str, object]:
    """name -> function making a tensor of that layout from a dense float (rows, 4) tensor."""
    makers = {
        "dense": lambda x: x,
        "transposed": lambda x: x.t(),
        "expanded": lambda x: x[:1].expand(len(x), 4),
        "sparse_coo": lambda x: x.relu().to_sparse(),
        "sparse_coo_uncoalesced": lambda x: torch.sparse_coo_tensor(
            torch.tensor([[0, 0, 1], [1, 1, 2]]), x[0, :3], (len(x), 4)
        ),
        "sparse_csr": lambda x: x.relu().to_sparse_csr(),
        "sparse_csc": lambda x: x.relu().to_sparse_csc(),
        "sparse_bsr": lambda x: x.relu().to_sparse_bsr((2, 2)),
        "sparse_bsc": lambda x: x.relu().to_sparse_bsc((2, 2)),
        "nested": lambda x: torch.nested.nested_tensor([x[:1], x[1:]]),
        "nested_jagged": lambda x: torch.nested.nested_tensor(
            [x[:1], x[1:]], layout=torch.jagged
        ),
        "quantized": lambda x: torch.quantize_per_tensor(x, 0.1, 0, torch.qint8),
        "meta": lambda x: torch.empty(x.shape, device="meta"),
        "conj": lambda x: torch.complex(x, -x).conj(),
        "neg_view": lambda x: torch.complex(x, x).conj().imag,
        "zerotensor": lambda x: torch._efficientzerotensor(x.shape),
    }
    return makers


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same layout, dtype, device, shape and values (values through a dense copy)."""
    if (a.layout, a.dtype, a.device, a.is_nested) != (b.layout, b.dtype, b.device, b.is_nested):
        return False
    if a.device.type == "meta":
        return a.shape == b.shape
    if a.is_nested:
        return all(torch.equal(u, v) for u, v in zip(a.unbind(), b.unbind(), strict=True))
    if a.is_quantized:
        return torch.equal(a.int_repr(), b.int_repr()) and a.q_scale() == b.q_scale()
    if a.layout != torch.strided:
        return torch.equal(a.to_dense(), b.to_dense())
    return a.shape == b.shape and torch.equal(a, b)


class _Emit(torch.nn.Module):
    def __init__(self, make) -> None:
        super().__init__()
        self.make = make

    def forward(self, x: torch.Tensor) -> object:
        return self.make(x)


@pytest.mark.parametrize("min_bytes", ["default", 0])
@pytest.mark.parametrize("layout", sorted(_layouts()))
def test_trace_clone_agrees_with_tensor_clone_for_every_layout(layout, min_bytes, backend,
                                                               monkeypatch):
    """Trace(clone=True), TraceDict and recursive_copy give ``t.clone()`` whatever the layout,
    on both backends, with and without the small-capture shortcut (which asked sparse tensors
    for ``nbytes``)."""
    from pyhook import _backend

    if min_bytes == "default":
        monkeypatch.setattr(_backend, "NATIVE_MIN_BYTES", 256 << 10)
    make = _layouts()[layout]
    torch.manual_seed(7)
    x = torch.randn(4, 4)
    want = make(x).clone()
    net = torch.nn.Sequential(torch.nn.Identity(), _Emit(make))
    with pyhook.Trace(net, "1", clone=True, detach=True) as t:
        out = net(x)
    assert _same(t.output, want) and t.output is not out
    with pyhook.TraceDict(net, ["0", "1"], clone=True) as td:
        net(x)
    assert _same(td["1"].output, want) and torch.equal(td["0"].output, x)
    big = torch.randn(512, 256)  # above the shortcut's size: the native kernel takes it
    copies = pyhook.recursive_copy([big, make(x), big.t()], clone=True)
    assert _same(copies[1], want)
    assert torch.equal(copies[0], big) and torch.equal(copies[2], big.t())
    assert copies[0].data_ptr() != big.data_ptr()


def test_sparse_capture_does_not_alias_the_layer_output(backend):
    sparse = torch.randn(3, 4).relu().to_sparse()
    copy = pyhook.recursive_copy(sparse, clone=True)
    assert copy.values().data_ptr() != sparse.values().data_ptr()
    sparse.values().mul_(0)
    assert copy.to_dense().abs().sum() > 0
