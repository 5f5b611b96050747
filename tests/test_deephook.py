"""deephook compatibility: Trace / TraceMultiple against hand-written hooks, with its bugs fixed."""

from __future__ import annotations

import pytest
import torch
from _models import DictBlock, NamedTupleBlock, Pair, ResidualBlock, all_hooks, gpt2, mlp
from torch import nn

from pyhook.deephook import Trace, TraceMultiple


def hand_run(model, layer, x, edit=None, **kwargs):
    """Reference: a plain register_forward_hook (optionally editing), and the model output."""
    seen = {}

    def hook(_m, args, out):
        seen["in"] = args[0] if args else None
        if edit is not None:
            out = edit(out)
        seen["out"] = out
        return out

    h = model.get_submodule(layer).register_forward_hook(hook)
    try:
        y = model(x, **kwargs)
    finally:
        h.remove()
    return seen, y


def test_readme_example_on_gpt2():
    model = gpt2(n_layer=2)
    encoded_input = {
        "input_ids": torch.tensor([[5, 6, 7, 8]]),
        "attention_mask": torch.ones(1, 4, dtype=torch.long),
    }

    def edit_fn(output, layer_name):  # deephook calls edit functions with (output, layer_name)
        return output + 1  # a simple function that adds 1 to the output

    layer_settings = {
        "transformer.wpe": (
            True,
            False,
            None,
        ),  # retain output, don't retain input, no edit function
        "transformer.h.0": (
            True,
            True,
            edit_fn,
        ),  # retain output and input, use edit_fn to edit output
        "transformer.h.0.mlp.c_fc": (True, False, None),
        "transformer.h.0.mlp.c_proj": (True, True, None),
    }
    with torch.no_grad():
        seen_wpe, _ = hand_run(model, "transformer.wpe", encoded_input["input_ids"])
        seen_h0, ref_y = hand_run(
            model,
            "transformer.h.0",
            encoded_input["input_ids"],
            edit=lambda o: o + 1,
            attention_mask=encoded_input["attention_mask"],
        )
        before = all_hooks(model)  # transformers may install its own hooks on first use
        with TraceMultiple(model, layer_settings) as tm:
            out = model(**encoded_input)

    wpe_output = tm["transformer.wpe"].output
    h0_input = tm["transformer.h.0"].input
    h0_output = tm["transformer.h.0"].output
    assert torch.equal(wpe_output, seen_wpe["out"])
    assert torch.equal(h0_input, seen_h0["in"])
    assert torch.equal(h0_output, seen_h0["out"])  # the retained output is the edited one
    assert torch.equal(out.logits, ref_y.logits)  # the edit reached the rest of the model
    assert (
        tm["transformer.h.0.mlp.c_fc"].output.shape == tm["transformer.h.0.mlp.c_proj"].input.shape
    )
    assert tm["transformer.h.0.mlp.c_proj"].input.shape[-1] == 4 * 32
    assert all_hooks(model) == before


def test_retained_values_are_detached_clones():
    net, x = mlp(), torch.randn(3, 4)
    seen, _ = hand_run(net, "0", x)
    with TraceMultiple(net, {"0": (True, True)}) as tm:
        y = net(x)
    out = tm["0"].output
    assert torch.equal(out, seen["out"]) and not out.requires_grad and y.requires_grad
    assert out.data_ptr() != seen["out"].data_ptr()
    assert torch.equal(tm["0"].input, x) and tm["0"].input.data_ptr() != x.data_ptr()
    x.add_(1)  # the retained input does not alias the live tensor
    assert not torch.equal(tm["0"].input, x)


def test_edit_fn_returning_none_keeps_output_and_gets_layer_name():
    net, x = mlp(), torch.randn(3, 4)
    calls = []

    def watch(output, layer_name):
        calls.append(layer_name)

    with TraceMultiple(net, {"2": (True, False, watch)}) as tm:
        y = net(x)
    assert calls == ["2"]
    assert torch.equal(y, net(x)) and torch.equal(tm["2"].output, net[2](net[1](net[0](x))))


@pytest.mark.parametrize(
    "settings, retain_output, retain_input",
    [
        ((), True, False),
        ((True,), True, False),
        ((False, True), False, True),
        ([True, True, None], True, True),
    ],
)
def test_short_settings_tuples_take_defaults(settings, retain_output, retain_input):
    net, x = mlp(), torch.randn(2, 4)
    with TraceMultiple(net, {"2": settings}) as tm:
        net(x)
    assert (tm["2"].output is not None) == retain_output
    assert (tm["2"].input is not None) == retain_input


@pytest.mark.parametrize(
    "settings, error, match",
    [
        ({"0": (True, False, None, "x")}, TypeError, "'0'.*0 to 3 items"),
        ({"0": True}, TypeError, "'0'.*tuple"),
        ({"0": ("yes",)}, TypeError, "retain_output for layer '0'"),
        ({"0": (True, False, 3)}, TypeError, "edit_output for layer '0'.*callable"),
        (
            {"0": (True, False, lambda output: output)},
            TypeError,
            "edit_output for layer '0'.*two positional",
        ),
        ({"0": (), "nope": ()}, AttributeError, "nope"),
        ([("0", ())], TypeError, "layer_settings must be a dict"),
    ],
)
def test_bad_settings_raise_naming_the_layer(settings, error, match):
    net = mlp()
    with pytest.raises(error, match=match):
        TraceMultiple(net, settings)
    assert all_hooks(net) == 0


def test_hooks_registered_on_entry_and_reusable_as_decorator():
    net = mlp()
    tm = TraceMultiple(net, {"0": (), "2": (True, True)})
    assert all_hooks(net) == 0  # nothing before entry
    seen_during = []

    @tm
    def run(x):
        seen_during.append(all_hooks(net))
        return net(x)

    for _ in range(3):
        x = torch.randn(2, 4)
        run(x)
        assert torch.equal(tm["0"].output, net[0](x).detach())
        assert all_hooks(net) == 0
    assert seen_during == [2, 2, 2]
    with tm:
        with tm:  # nested entry of the same object registers once
            assert all_hooks(net) == 2
        assert all_hooks(net) == 2
        assert tm["0"].output is None  # each entry starts empty
    assert all_hooks(net) == 0


def test_failure_while_registering_leaves_nothing(monkeypatch):
    net = mlp()
    tm = TraceMultiple(net, {"0": (), "2": (), "4": ()})
    original = Trace._open

    def flaky(self):
        if self.layer_name == "4":
            raise RuntimeError("registration failed")
        original(self)

    monkeypatch.setattr(Trace, "_open", flaky)
    with pytest.raises(RuntimeError, match="registration failed"), tm:
        pass
    assert all_hooks(net) == 0


def test_exception_in_forward_removes_hooks():
    net = mlp()
    with pytest.raises(RuntimeError), TraceMultiple(net, {"0": ()}):
        net(torch.randn(2, 5))  # wrong width
    assert all_hooks(net) == 0


def test_containers_are_copied_whatever_their_type():
    model = nn.Sequential(DictBlock(4))
    x = torch.randn(2, 4, requires_grad=True)
    with TraceMultiple(model, {"0": ()}) as tm:
        live = model(x)
    kept = tm["0"].output
    assert isinstance(kept, dict) and kept is not live
    assert torch.equal(kept["hidden"], live["hidden"]) and not kept["hidden"].requires_grad
    assert kept["hidden"].data_ptr() != live["hidden"].data_ptr()
    assert kept["pair"][1] == "tag" and not kept["pair"][0].requires_grad
    assert kept["cache"] is live["cache"]  # unknown objects pass through

    nt_model = nn.Sequential(NamedTupleBlock(4))
    with TraceMultiple(nt_model, {"0": ()}) as tm:
        live = nt_model(x)
    assert type(tm["0"].output) is Pair and tm["0"].output.aux is None  # deephook made it a tuple
    assert (
        torch.equal(tm["0"].output.hidden, live.hidden) and not tm["0"].output.hidden.requires_grad
    )

    lst = nn.Module()
    lst.forward = lambda t: [t * 2, t * 3]  # type: ignore[method-assign]
    holder = nn.Sequential(lst)
    with TraceMultiple(holder, {"0": ()}) as tm:
        live = holder(x)
    assert isinstance(tm["0"].output, list) and not tm["0"].output[0].requires_grad


def test_keyword_only_call_with_retain_input():
    block = ResidualBlock(8)
    model = nn.Module()
    model.block = block
    x = torch.randn(2, 8)
    with TraceMultiple(model, {"block": (True, True)}) as tm:
        y = block(hidden_states=x, scale_factor=0.5)  # deephook: IndexError inside the forward
    assert tm["block"].input is None
    assert torch.equal(tm["block"].input_kw["hidden_states"], x)
    assert tm["block"].input_kw["scale_factor"] == 0.5
    assert torch.equal(tm["block"].output, y)


def test_aliases_compose_edits_in_order():
    model = nn.Module()
    lin = nn.Linear(3, 3)
    model.first, model.second = lin, lin
    x = torch.randn(2, 3)

    def add1(output, layer_name):
        return output + 1

    def double(output, layer_name):
        return output * 2

    with TraceMultiple(
        model, {"first": (True, False, add1), "second": (True, False, double)}
    ) as tm:
        y = lin(x)
    ref = lin(x)
    assert torch.allclose(tm["first"].output, ref + 1)
    assert torch.allclose(y, (ref + 1) * 2) and torch.allclose(tm["second"].output, y)


def test_single_trace_registers_on_construction_and_reenters():
    net = mlp()
    t = Trace(net, "2", True, True)
    assert all_hooks(net) == 1 and t.active and t.get_layer() is net[2]
    x = torch.randn(2, 4)
    with t:
        net(x)
    assert all_hooks(net) == 0
    assert torch.equal(t.output, net[2](net[1](net[0](x))).detach())
    x2 = torch.randn(2, 4)
    with t:  # entering a closed Trace registers it again
        assert t.output is None
        net(x2)
    assert torch.equal(t.input, net[1](net[0](x2)).detach()) and all_hooks(net) == 0
    with pytest.raises(AttributeError, match="nope"):
        Trace(net, "nope")
    assert all_hooks(net) == 0


def test_single_trace_positional_signature_is_deephooks():
    net, x = mlp(), torch.randn(2, 4)

    def zero(output, layer_name):
        return output * 0

    with Trace(
        net, "4", False, False, zero
    ) as t:  # (model, layer_name, retain_output, retain_input, edit_output)
        y = net(x)
    assert t.output is None and t.input is None and float(y.detach().abs().sum()) == 0.0
    assert all_hooks(net) == 0


def test_mapping_helpers():
    tm = TraceMultiple(mlp(), {"0": (), "2": ()})
    assert list(tm) == ["0", "2"] and len(tm) == 2 and "0" in tm and "1" not in tm
    assert set(tm.traces) == {"0", "2"} and [n for n, _ in tm.items()] == ["0", "2"]
    with pytest.raises(KeyError):
        tm["1"]


def test_top_level_export_is_the_deephook_class():
    import pyhook
    import pyhook.deephook

    assert pyhook.TraceMultiple is pyhook.deephook.TraceMultiple
    assert pyhook.Trace is not pyhook.deephook.Trace  # pyhook.Trace stays nethook's


def test_trace_hook_is_a_removable_handle():
    from torch.utils.hooks import RemovableHandle

    net = mlp()
    with Trace(net, "0") as t:
        h = t.hook
        assert isinstance(h, RemovableHandle) and h.hooks_dict_ref() is net[0]._forward_hooks
        assert h.id in h.hooks_dict_ref() and net[0]._forward_hooks_with_kwargs.get(h.id)
    assert h.id not in h.hooks_dict_ref() and all_hooks(net) == 0
