"""hybrid_learning's model extension family: contracts of the original tests, and its bugs fixed."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from _models import Counting, all_hooks, gpt2, mlp
from torch import nn

from pyhook.extend import (
    ActivationMapGrabber,
    ExtendedModelStump,
    HooksHandle,
    ModelExtender,
    ModelStump,
    dummy_output,
    output_size,
    output_sizes,
)
from pyhook.truncate import HookNotCalledError


def hand_outputs(model, names, *args, **kwargs):
    """Reference: outputs seen by plain register_forward_hook hooks, plus the model output."""
    seen = {}
    handles = [
        model.get_submodule(n).register_forward_hook(lambda m, a, o, n=n: seen.__setitem__(n, o))
        for n in names
    ]
    try:
        y = model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return y, seen


class SampleNN(nn.Module):
    """hybrid_learning's user-guide example: l1 (w=1, b=2) then l2 (w=3, b=0)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(1, 1), nn.Linear(1, 1)
        with torch.no_grad():
            (
                self.l1.weight.fill_(1),
                self.l1.bias.fill_(2),
                self.l2.weight.fill_(3),
                self.l2.bias.fill_(0),
            )

    def forward(self, x):
        return self.l2(self.l1(x))


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x, use_b=False):
        return self.b(x) if use_b else self.a(x)


# -- ActivationMapGrabber ----------------------------------------------------------------
def test_grabber_registering():
    net = mlp()
    g = ActivationMapGrabber(net, ["2", "0"])
    assert g.registered_submodules == ["2", "0"]
    g.register_submodule("2")  # already registered: no reordering
    assert g.registered_submodules == ["2", "0"]
    g.unregister_submodule("2")
    assert g.registered_submodules == ["0"] and len(net[2]._forward_hooks) == 0
    g.register_submodule("2")
    assert g.registered_submodules == ["0", "2"]
    with pytest.raises(ValueError, match="None"):
        g.register_submodule(None)  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="'9'"):
        g.unregister_submodule("9")
    with pytest.raises(KeyError, match="'9'"):
        g.register_submodule("9")
    assert set(g.hook_handles) == {"0", "2"}
    assert g.get_module_by_id("2") is net[2]
    g.close()
    assert all_hooks(net) == 0 and g.registered_submodules == []


def test_grabber_init_with_unknown_id_registers_nothing():
    net = mlp()
    with pytest.raises(KeyError, match="nope"):
        ActivationMapGrabber(net, ["0", "nope"])
    gc.collect()
    assert all_hooks(net) == 0


def test_grabber_outputs_match_hand_hooks():
    net, x = mlp(), torch.randn(5, 4)
    ref_y, ref = hand_outputs(net, ["0", "2"], x)
    y, acts = ActivationMapGrabber(net, ["2", "0", ""])(x)
    assert list(acts) == ["2", "0", ""]
    assert torch.equal(y, ref_y) and torch.equal(acts[""], ref_y)
    assert torch.equal(acts["0"], ref["0"]) and torch.equal(acts["2"], ref["2"])


def test_fresh_dict_and_no_stale_values():
    model, x = Branchy(), torch.randn(2, 3)
    g = ActivationMapGrabber(model, ["a", "b"])
    out1, acts1 = g(x, use_b=True)
    assert acts1["a"] is None and torch.equal(acts1["b"], out1)
    out2, acts2 = g(x)
    assert acts2 is not acts1
    assert torch.equal(acts2["a"], out2) and acts2["b"] is None  # not the stale value of call 1
    assert torch.equal(acts1["b"], out1) and acts1["a"] is None  # call 1's result unchanged


def test_direct_model_calls_are_not_recorded():
    net, x = mlp(), torch.randn(2, 4)
    g = ActivationMapGrabber(net, ["0"])
    _, acts = g(x)
    kept = acts["0"]
    net(torch.randn(2, 4))  # outside the grabber's forward
    assert acts["0"] is kept
    assert len(g._frames) == 0


# -- ModelStump --------------------------------------------------------------------------
def test_stump_registering():
    net = mlp()
    stump = ModelStump(net, "2")
    assert stump.stump_head == "2" and stump.registered_submodules == ["2"]
    stump.unregister_submodule("2")
    assert stump.stump_head is None and all_hooks(net) == 0
    with pytest.raises(ValueError, match="stump_head"):
        stump(torch.randn(1, 4))
    stump.register_submodule("0")
    assert stump.stump_head == "0"
    stump.stump_head = "2"  # replaces the old head's hook instead of accumulating
    assert stump.registered_submodules == ["2"] and all_hooks(net) == 1
    with pytest.raises(KeyError, match="'zz'"):
        stump.stump_head = "zz"
    assert stump.stump_head == "2" and all_hooks(net) == 1
    with pytest.raises(KeyError):
        ModelStump(net, "zz")
    stump.close()
    assert all_hooks(net) == 0


def test_stump_output_and_early_stop():
    net, x = mlp(), torch.randn(5, 4)
    _, ref = hand_outputs(net, ["2"], x)
    counter: Counting = net[3]
    out = ModelStump(net, "2")(x)
    assert torch.equal(out, ref["2"])
    assert counter.calls == 1  # only the reference run: the stump stopped at its head
    assert ModelStump(net, "3")(x) is not None and counter.calls == 2


class _Looped(nn.Module):
    """One block called three times by the model's own code."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = self.block(x)
        return x


def test_stump_head_reused_under_several_names_returns_its_last_call():
    """hybrid_learning keeps the last call of the head (its hook overwrites the stored output):
    with one ReLU object at indices 1 and 3, ModelStump(net, "1") and (net, "3") both give the
    output of index 3, as ActivationMapGrabber does."""
    torch.manual_seed(0)
    relu = nn.ReLU()
    net = nn.Sequential(nn.Linear(4, 4), relu, nn.Linear(4, 4), relu, nn.Linear(4, 2))
    x = torch.randn(3, 4)
    last = relu(net[2](relu(net[0](x))))  # the second (last) call of the shared ReLU
    _, grabbed = ActivationMapGrabber(net, ["1"])(x)
    assert torch.equal(grabbed["1"], last)
    for name in ("1", "3"):
        stump = ModelStump(net, name)
        assert torch.equal(stump(x), last), name
        assert torch.equal(ExtendedModelStump(net, name, torch.neg)(x), -last), name
        stump.close()


def test_stump_early_stop_choice_for_a_head_called_in_a_loop():
    """A head called several times by the model's code: early_stop=False gives hybrid_learning's
    last call; the default stops at (and returns) the first call."""
    torch.manual_seed(0)
    model, x = _Looped(), torch.randn(2, 4)
    first = model.block(x)
    last = model.block(model.block(first))
    assert torch.equal(ModelStump(model, "block", early_stop=False)(x), last)
    assert torch.equal(ModelStump(model, "block")(x), first)
    with pytest.raises(TypeError, match="early_stop"):
        ModelStump(model, "block", early_stop="yes")  # type: ignore[arg-type]


def test_stump_head_not_run_raises():
    model = Branchy()
    stump = ModelStump(model, "b")
    with pytest.raises(HookNotCalledError, match="'b'"):
        stump(torch.randn(2, 3))
    x = torch.randn(2, 3)
    assert torch.equal(stump(x, use_b=True), model.b(x))


def test_stump_eval_mode_does_not_flip_the_shared_model():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 2))
    net.train()
    x = torch.randn(8, 4)
    stump = ModelStump(net, "1")
    assert not stump.training and net.training and net[1].training
    assert torch.equal(stump(x), net[0](x))  # dropout inactive in the stump's forward
    assert net.training and net[1].training  # restored
    net[1].eval()
    stump.train()
    assert net.training and not net[1].training  # the stump's mode is its own
    y = stump(x)
    assert (y == 0).any() and not net[1].training  # dropout active during the call, then restored
    grabbed = ActivationMapGrabber(net, ["1"]).stump("1")
    assert not grabbed.training and net.training


def test_extended_stump():
    net, x = mlp(), torch.randn(3, 4)
    with pytest.raises(ValueError, match="callable"):
        ExtendedModelStump(net, "2", "not callable")  # type: ignore[arg-type]
    assert all_hooks(net) == 0
    out = ExtendedModelStump(net, "2", lambda t: t.sum(-1))(x)
    assert torch.allclose(out, net[2](net[1](net[0](x))).sum(-1))
    head = nn.Dropout(0.5)
    stump = ExtendedModelStump(net, "2", head)
    assert not stump.training and head.training and net.training  # as hybrid_learning
    stump.eval()
    assert not head.training and net.training
    stump.train()
    assert head.training and net.training
    stump.eval()
    assert not head.training and net.training


def test_grabber_stump_unknown_id():
    g = ActivationMapGrabber(mlp(), ["0"])
    with pytest.raises(KeyError, match="'2'"):
        g.stump("2")


# -- ModelExtender -----------------------------------------------------------------------
def test_sample_nn_contract():
    extended = ModelExtender(SampleNN(), extensions={"l1": {"l1": nn.Identity()}})
    with torch.no_grad():
        out = extended(torch.tensor([[1.0]]))
    assert isinstance(out, tuple) and torch.equal(out[0], torch.tensor([[9.0]]))
    assert list(out[1]) == ["l1"] and torch.equal(out[1]["l1"], torch.tensor([[3.0]]))


def test_extender_formats_and_forward():
    net, x = mlp(), torch.randn(5, 4)
    p0, p2, q2 = nn.Linear(8, 1), nn.Linear(6, 3), nn.Identity()
    ext = ModelExtender(net, {"0": {"p0": p0}, "2": {"p2": p2, "q2": q2}})
    assert ext.extensions == {"0": {"p0": p0}, "2": {"p2": p2, "q2": q2}}
    assert isinstance(ext.extension_models, nn.ModuleDict)
    assert dict(ext.extension_models) == {"p0": p0, "p2": p2, "q2": q2}
    assert ext.name_registrations == {"0": ["p0"], "2": ["p2", "q2"]}
    assert ext.extension_names == ["p0", "p2", "q2"] and ext.registered_submodules == ["0", "2"]
    ref_y, ref = hand_outputs(net, ["0", "2"], x)
    y, outs = ext(x)
    assert torch.equal(y, ref_y)
    assert list(outs) == ["p0", "p2", "q2"]
    assert torch.equal(outs["p0"], p0(ref["0"])) and torch.equal(outs["p2"], p2(ref["2"]))
    assert torch.equal(outs["q2"], ref["2"])
    stump = ext.stump("2")
    assert torch.equal(outs["p2"], p2(stump(x)))
    ext.return_orig_out = False
    only = ext(x)
    assert isinstance(only, dict) and list(only) == ["p0", "p2", "q2"]
    assert {k for k in ext.state_dict() if k.startswith("extension_models.")} == {
        "extension_models.p0.weight",
        "extension_models.p0.bias",
        "extension_models.p2.weight",
        "extension_models.p2.bias",
    }
    assert all(k.startswith(("wrapped_model.", "extension_models.")) for k in ext.state_dict())


def test_unregister_last_extension_of_a_layer_then_forward():
    net, x = mlp(), torch.randn(2, 4)
    ext = ModelExtender(net, {"0": {"a": nn.Identity()}, "2": {"b": nn.Identity()}})
    ext.unregister_extension("a")  # hybrid_learning: every later forward raised KeyError('0')
    assert ext.registered_submodules == ["2"] and len(net[0]._forward_hooks) == 0
    y, outs = ext(x)
    assert list(outs) == ["b"] and torch.equal(y, net(x))
    with pytest.raises(KeyError, match="unknown name a"):
        ext.unregister_extension("a")
    ext.register_extension("a", "0", nn.Identity())
    assert list(ext(x)[1]) == ["b", "a"] or list(ext(x)[1]) == ["a", "b"]
    assert ext.name_registrations == {"2": ["b"], "0": ["a"]}


def test_unregister_submodule_with_extensions_refuses():
    net = mlp()
    ext = ModelExtender(net, {"0": {"a": nn.Identity()}})
    with pytest.raises(ValueError, match="unregister_extension"):
        ext.unregister_submodule("0")
    assert ext.registered_submodules == ["0"]


@pytest.mark.parametrize(
    "extensions, error, match",
    [
        ({"nope": {"a": nn.Identity()}}, KeyError, "nope"),
        ({"0": {"a": nn.Identity()}, "2": {"a": nn.Identity()}}, ValueError, "existing name: a"),
        ({"0": {"a.b": nn.Identity()}}, ValueError, "'a.b'"),
        ({"0": {"": nn.Identity()}}, ValueError, "ModuleDict key"),
        ({"0": {"keys": nn.Identity()}}, ValueError, "'keys'"),
        (
            {"0": {"a": nn.Identity(), "b": lambda t: t}},
            ValueError,
            "name b .* not of type torch.nn.Module",
        ),
        ({"0": {1: nn.Identity()}}, TypeError, "1"),
        ({"0": nn.Identity()}, TypeError, "extensions\\['0'\\]"),
        ([("0", {"a": nn.Identity()})], TypeError, "extensions must be a dict"),
    ],
)
def test_bad_extensions_raise_before_registering(extensions, error, match):
    net = mlp()
    with pytest.raises(error, match=match):
        ModelExtender(net, extensions)
    gc.collect()
    assert all_hooks(net) == 0


def test_bad_register_extension_changes_nothing():
    net = mlp()
    ext = ModelExtender(net, {"0": {"a": nn.Identity()}})
    cases = [
        (("a", "2", nn.Identity()), ValueError),
        (("b", "nope", nn.Identity()), KeyError),
        (("b.c", "2", nn.Identity()), ValueError),
        (("b", "2", "module"), ValueError),
    ]
    for args, error in cases:
        with pytest.raises(error):
            ext.register_extension(*args)
        assert ext.name_registrations == {"0": ["a"]} and ext.extension_names == ["a"]
        assert all_hooks(net) == 1
    with pytest.raises(ValueError, match="existing name: c"):
        ext.register_extensions({"2": {"c": nn.Identity()}, "4": {"c": nn.Identity()}})
    with pytest.raises(ValueError, match="existing name: a"):
        ext.register_extensions({"2": {"c": nn.Identity()}, "4": {"a": nn.Identity()}})
    assert ext.name_registrations == {"0": ["a"]} and all_hooks(net) == 1
    ext.register_extensions({"2": {"c": nn.Identity()}, "4": {"d": nn.Identity()}})
    assert ext.name_registrations == {"0": ["a"], "2": ["c"], "4": ["d"]} and all_hooks(net) == 3


def test_extension_of_a_layer_that_did_not_run_gives_none():
    model, x = Branchy(), torch.randn(2, 3)
    ext = ModelExtender(model, {"b": {"probe": nn.Linear(3, 1)}})
    _, outs = ext(x)
    assert outs == {"probe": None}
    _, outs = ext(x, use_b=True)
    assert torch.equal(outs["probe"], ext.extension_models["probe"](model.b(x)))


def test_linear_probe_trains_through_the_extender():
    model = gpt2(n_layer=2)
    model.requires_grad_(False)
    torch.manual_seed(1)
    ids = torch.randint(0, 100, (8, 12))
    with torch.no_grad():  # labels linearly readable from block 0's output, by construction
        hidden = model(ids, output_hidden_states=True).hidden_states[1]
        direction = torch.randn(32)
        direction -= direction.mean()  # so that the probe's normalisation keeps the labels' sign
        target = (hidden @ direction > 0).long()
    # a linear probe on normalised features (GPT-2's residual stream is tiny at init)
    probe = nn.Sequential(nn.LayerNorm(32, elementwise_affine=False), nn.Linear(32, 2))
    ext = ModelExtender(model, {"transformer.h.0": {"probe": probe}}, return_orig_out=False)
    opt = torch.optim.Adam(ext.extension_models.parameters(), lr=0.1)
    losses = []
    for _ in range(20):
        logits = ext(ids)["probe"]
        loss = nn.functional.cross_entropy(logits.reshape(-1, 2), target.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert probe[1].weight.grad is not None
    assert all(p.grad is None for p in model.parameters())
    with torch.no_grad():
        assert torch.allclose(ext(ids)["probe"], probe(hidden))


def test_kwargs_reach_the_model():
    model = gpt2(n_layer=2)
    ids = torch.tensor([[1, 2, 3, 4]])
    mask = torch.tensor([[1, 1, 1, 0]])
    ext = ModelExtender(model, {"transformer.h.1": {"id": nn.Identity()}})
    with torch.no_grad():
        out, outs = ext(input_ids=ids, attention_mask=mask)
        ref, seen = hand_outputs(model, ["transformer.h.1"], input_ids=ids, attention_mask=mask)
        unmasked = model(input_ids=ids)
    assert torch.equal(out.logits, ref.logits)
    assert torch.equal(outs["id"], seen["transformer.h.1"])
    assert not torch.equal(out.logits, unmasked.logits)  # the mask did reach the model
    ext.close()


# -- lifetime ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        lambda net: ModelExtender(net, {"0": {"a": nn.Identity()}, "2": {"b": nn.Identity()}}),
        lambda net: ActivationMapGrabber(net, ["0", "2"]),
        lambda net: ModelStump(net, "2"),
        lambda net: ExtendedModelStump(net, "2", torch.sum),
        lambda net: ActivationMapGrabber(net, ["2"]).stump("2"),
    ],
)
def test_dropped_wrapper_leaves_no_hook(make):
    net, x = mlp(), torch.randn(2, 4)
    wrapper = make(net)
    wrapper(x)
    assert all_hooks(net) > 0
    ref = weakref.ref(wrapper)
    del wrapper
    # no reference cycle through the hooks: reference counting alone frees the wrapper
    assert ref() is None
    assert all_hooks(net) == 0
    wrapper = make(net)
    ref = weakref.ref(wrapper)
    cycle = [wrapper]
    cycle.append(cycle)
    del wrapper, cycle
    gc.collect()
    assert ref() is None and all_hooks(net) == 0


def test_close_context_and_explicit_del():
    net, x = mlp(), torch.randn(2, 4)
    with ModelExtender(net, {"0": {"a": nn.Identity()}}) as ext:
        ext(x)
        assert all_hooks(net) == 1
    assert all_hooks(net) == 0 and ext.registered_submodules == []
    with pytest.raises(RuntimeError, match="closed"):
        ext(x)
    stump = ModelStump(net, "2")
    stump.__del__()  # hybrid_learning's own idiom (dummy_output, test_del)
    assert all_hooks(net) == 0
    stump.close()  # idempotent


@pytest.mark.parametrize(
    "make, read",
    [
        (
            lambda net: ModelExtender(net, {"0": {"a": nn.Identity()}, "2": {"b": nn.Identity()}}),
            lambda out, ref: ((out[1]["a"], out[1]["b"]), (ref["0"], ref["2"])),
        ),
        (lambda net: ActivationMapGrabber(net, ["0", "2"]), lambda out, ref: (out[1], ref)),
        (lambda net: ModelStump(net, "2"), lambda out, ref: (out, ref["2"])),
        (
            lambda net: ExtendedModelStump(net, "2", lambda a: a * 2),
            lambda out, ref: (out, ref["2"] * 2),
        ),
    ],
)
def test_deepcopy_gives_a_working_wrapper_of_the_copied_model(make, read):
    # hybrid_learning's hooks are copied along with the model (its _HookFor points to the
    # copied wrapper), so a deep copy captures from its own copy of the model
    net, x = mlp(), torch.randn(2, 4)
    wrapper = make(net)
    twin = copy.deepcopy(wrapper)
    assert twin.wrapped_model is not net
    assert twin.registered_submodules == wrapper.registered_submodules
    assert all_hooks(twin.wrapped_model) == all_hooks(net) > 0
    with torch.no_grad():
        for p in twin.wrapped_model.parameters():
            p.add_(1)  # the copy's captures must come from the copy's own model
    for w in (twin, wrapper):
        _, ref = hand_outputs(w.wrapped_model, ["0", "2"], x)
        got, want = read(w(x), ref)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    twin_ref = weakref.ref(twin)
    del twin
    gc.collect()
    assert twin_ref() is None  # the copy's hooks go with it; the original's stay
    assert all_hooks(net) > 0


def test_hooks_handle_is_abstract():
    with pytest.raises(TypeError):
        HooksHandle(mlp())  # type: ignore[abstract]


# -- sizes -------------------------------------------------------------------------------
def test_dummy_output_and_sizes():
    net = mlp()
    net.train()
    outs = dummy_output(net, (2, 4))
    assert list(outs) == ["", "0", "1", "2", "3", "4"]
    assert torch.equal(outs["0"], net[0](torch.zeros(2, 4)).detach())
    assert net.training and all(m.training for m in net.modules())
    assert all_hooks(net) == 0
    assert output_sizes(net, (4,), ["0", "2", ""]) == {
        "0": torch.Size([8]),
        "2": torch.Size([6]),
        "": torch.Size([2]),
    }
    assert output_sizes(net, (3, 4), ["0"], has_batch_dim=True) == {"0": torch.Size([8])}
    assert output_size(net, (4,)) == torch.Size([2])
    assert output_size(net, (4,), layer_id="2") == torch.Size([6])
    with pytest.raises(ValueError, match="empty"):
        output_sizes(net, ())
    with pytest.raises(AttributeError, match="batch"):
        output_sizes(nn.Sequential(nn.Linear(4, 1), nn.Flatten(0)), (4,), ["1"])
    assert all_hooks(net) == 0


def test_output_sizes_non_tensor_outputs():
    class TupleOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            return self.lin(x), "tag"

    model = TupleOut()
    assert output_sizes(model, (4,)) == {"lin": torch.Size([3])}
    with pytest.raises(AttributeError, match="tuple"):
        output_sizes(model, (4,), ignore_non_tensor_outs=False)
    assert all_hooks(model) == 0


# -- name_registrations is the live registry (issue 12, item 11) -----------------------------------


def _probe_net():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3))
    exts = {"0": {"a": nn.Linear(4, 1), "b": nn.Linear(4, 2)}, "2": {"c": nn.Linear(3, 1)}}
    return net, ModelExtender(net, exts, return_orig_out=False)


def test_name_registrations_is_the_live_registry():
    """hybrid_learning returns its registry itself: reordering a layer's names reorders the
    outputs, as in the original's forward loop."""
    net, ext = _probe_net()
    reg = ext.name_registrations
    assert reg is ext.name_registrations and reg == {"0": ["a", "b"], "2": ["c"]}
    ext.register_extension("d", "1", nn.Identity())
    assert reg == {"0": ["a", "b"], "2": ["c"], "1": ["d"]}  # the same object, updated
    reg["0"].reverse()
    x = torch.randn(2, 4)
    assert list(ext(x)) == ["b", "a", "c", "d"]
    ext.close()
    assert all_hooks(net) == 0


def test_mutating_name_registrations_keeps_hooks_consistent():
    """Moving an extension to another layer, or dropping a name, is applied at the next
    forward: hooks follow the layers listed (none left on a layer no longer listed)."""
    net, ext = _probe_net()
    reg = ext.name_registrations
    x = torch.randn(2, 4)
    reg["1"] = [reg["0"].pop()]  # feed "b" from layer 1 (the ReLU) instead of layer 0
    out = ext(x)
    assert torch.allclose(out["b"], ext.extension_models["b"](net[1](net[0](x))))
    assert torch.allclose(out["a"], ext.extension_models["a"](net[0](x)))
    assert ext.registered_submodules == ["0", "2", "1"] and all_hooks(net) == 3
    reg["2"].remove("c")  # not run any more; its module stays until unregistered
    assert list(ext(x)) == ["a", "b"] and "c" in ext.extension_names
    assert ext.registered_submodules == ["0", "1"] and all_hooks(net) == 2
    ext.unregister_extension("c")
    assert "c" not in ext.extension_names
    reg["0"].clear()
    assert list(ext(x)) == ["b"]
    assert ext.registered_submodules == ["1"] and all_hooks(net) == 1
    assert reg == {"1": ["b"]}
    ext.close()
    assert all_hooks(net) == 0


def test_bad_mutation_of_name_registrations_raises_naming_it_and_adds_no_hook():
    net, ext = _probe_net()
    reg = ext.name_registrations
    reg["zz"] = ["a"]
    with pytest.raises(KeyError, match="'zz'"):
        ext(torch.randn(2, 4))
    del reg["zz"]
    reg["2"].append("nope")
    with pytest.raises(KeyError, match="'nope'"):
        ext(torch.randn(2, 4))
    reg["2"].remove("nope")
    reg["2"].append("a")  # listed under two layers
    with pytest.raises(ValueError, match="'a'"):
        ext(torch.randn(2, 4))
    reg["2"].remove("a")
    assert ext.registered_submodules == ["0", "2"] and all_hooks(net) == 2
    assert set(ext(torch.randn(2, 4))) == {"a", "b", "c"}
    ext.close()
    assert all_hooks(net) == 0


def test_a_plain_string_of_ids_is_refused_not_iterated():
    # hybrid_learning takes a list of IDs: "02" must not register layers '0' and '2'
    from pyhook.extend import ActivationMapGrabber

    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"module_ids.*'02'.*\['02'\]"):
        ActivationMapGrabber(net, "02")
    assert all(not m._forward_hooks for m in net.modules())
    with ActivationMapGrabber(net, ["0", "2"]) as grabber:  # the list form works
        _, acts = grabber(torch.ones(1, 2))
    assert list(acts) == ["0", "2"]


@pytest.mark.parametrize("head", ["", "1"])
def test_stump_hook_handle_is_a_removable_handle_removed_on_del(head):
    # hybrid_learning's own test_del: stump.hook_handles[head].hooks_dict_ref() holds the id
    # while the stump lives, and not once it is deleted
    from torch.utils.hooks import RemovableHandle

    net = mlp()
    stump = ModelStump(net, head)
    handle = stump.hook_handles[head]
    assert isinstance(handle, RemovableHandle)
    hooks_dict = handle.hooks_dict_ref()
    assert hooks_dict is net.get_submodule(head)._forward_hooks
    assert handle.id in hooks_dict
    del stump
    gc.collect()
    assert handle.id not in hooks_dict and all_hooks(net) == 0


def test_grabber_hook_handles_are_removable_handles():
    from torch.utils.hooks import RemovableHandle

    net = mlp()
    with ActivationMapGrabber(net, ["0", "2"]) as g:
        handles = g.hook_handles
        assert all(isinstance(h, RemovableHandle) for h in handles.values())
        assert all(h.id in h.hooks_dict_ref() for h in handles.values())
    assert not any(h.id in h.hooks_dict_ref() for h in handles.values())
