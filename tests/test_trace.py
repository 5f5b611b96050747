"""nethook compatibility: Trace / TraceDict against hand-written hooks and known values."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import pyhook as nethook
from _models import DataOut, DictBlock, DummyModel, NamedTupleBlock, Pair, all_hooks, gpt2, mlp


def hand_hook_output(model, layer, x, edit=None):
    """Reference: what a plain register_forward_hook sees (and the model output with an edit)."""
    seen = {}

    def hook(_m, _args, out):
        if edit is not None:
            out = edit(out)
        seen["out"] = out
        return out

    h = model.get_submodule(layer).register_forward_hook(hook)
    try:
        y = model(x)
    finally:
        h.remove()
    return seen["out"], y


def test_retains_output_like_hand_written_hook(backend):
    net, x = mlp(), torch.randn(5, 4)
    ref, _ = hand_hook_output(net, "2", x)
    with nethook.Trace(net, "2") as t:
        net(x)
    assert torch.equal(t.output, ref)
    assert all_hooks(net) == 0


def test_retain_input_positional_and_kwargs(backend):
    model = DummyModel(use_kwargs=False)
    x = torch.randn(3, 8)
    with nethook.Trace(model, "layers.block_1", retain_input=True) as t:
        model(x)
    assert torch.equal(t.input, model.layers.block_0(x))
    assert t.input_kw == {}
    kw_model = DummyModel(use_kwargs=True)
    with nethook.Trace(kw_model, "layers.block_1", retain_input=True, clone=True) as t:
        kw_model(x)
    assert t.input == ()
    assert set(t.input_kw) == {"hidden_states", "scale_factor"}
    assert t.input_kw["scale_factor"] == 0.5
    expected = kw_model.layers.block_0(hidden_states=x, scale_factor=0.5)
    assert torch.equal(t.input_kw["hidden_states"], expected)


def test_several_positional_inputs_give_a_tuple():
    class Two(nn.Module):
        def forward(self, a, b):
            return a + b

    outer = nn.Sequential()
    outer.add_module("two", Two())
    a, b = torch.ones(2), torch.zeros(2)
    with nethook.Trace(outer, "two", retain_input=True) as t:
        outer.two(a, b)
    assert isinstance(t.input, tuple) and t.input[0] is a and t.input[1] is b


def test_clone_and_detach(backend):
    net, x = mlp(), torch.randn(5, 4)
    with nethook.Trace(net, "0", clone=True, detach=True) as t:
        y = net(x)
    raw, _ = hand_hook_output(net, "0", x)
    assert torch.equal(t.output, raw)
    assert t.output.grad_fn is None and not t.output.requires_grad
    assert t.output.untyped_storage().data_ptr() != raw.untyped_storage().data_ptr()
    with nethook.Trace(net, "0") as t2:
        net(x)
    assert t2.output.grad_fn is not None  # default: a direct reference, attached to the graph
    assert y.shape == (5, 2)


def test_clone_protects_against_later_inplace_ops(backend):
    class InPlace(nn.Module):
        def forward(self, x):
            return x.mul_(3)

    net = nn.Sequential(nn.Linear(3, 3), InPlace())
    x = torch.randn(2, 3)
    with torch.no_grad(), nethook.Trace(net, "0", clone=True) as t, nethook.Trace(net, "0") as raw:
        y = net(x)
    assert torch.allclose(t.output * 3, y)
    assert raw.output is y  # the reference was modified in place; the clone was not


@pytest.mark.parametrize(
    "edit",
    [
        lambda output: output * 2,
        lambda output, layer: output * 2 if layer == "2" else None,
        lambda x, layer, inputs: x * 2 + 0 * inputs[0].sum(),
        lambda layer, output: output * 2,
    ],
)
def test_edit_output_signatures(edit, backend):
    net, x = mlp(), torch.randn(5, 4)
    ref_out, ref_y = hand_hook_output(net, "2", x, edit=lambda o: o * 2)
    with nethook.Trace(net, "2", edit_output=edit) as t:
        y = net(x)
    assert torch.allclose(y, ref_y)
    assert torch.allclose(t.output, ref_out)  # retained output is the post-edit output


def test_edit_output_none_means_unchanged_and_is_still_retained():
    net, x = mlp(), torch.randn(5, 4)
    ref, ref_y = hand_hook_output(net, "2", x)
    with nethook.Trace(net, "2", edit_output=lambda output: None) as t:
        y = net(x)
    assert torch.equal(y, ref_y) and torch.equal(t.output, ref)


def test_edit_output_can_read_kwargs():
    model = DummyModel(use_kwargs=True)
    x = torch.randn(2, 8)
    seen = {}

    def edit(output, inputs_kw):
        seen.update(inputs_kw)
        return output

    with nethook.Trace(model, "layers.block_0", edit_output=edit):
        model(x)
    assert seen["scale_factor"] == 0.5


def test_stop_skips_the_rest_of_the_model_and_the_block():
    net, x = mlp(), torch.randn(5, 4)
    after = []
    with nethook.Trace(net, "2", stop=True) as t:
        net(x)
        after.append(1)
    assert after == [] and net[3].calls == 0
    assert torch.equal(t.output, net[2](net[1](net[0](x))))
    assert all_hooks(net) == 0


def test_stop_without_forward_or_unreached_layer_exits_cleanly():
    net = mlp()
    with nethook.Trace(net, "2", stop=True):
        pass
    with nethook.Trace(net, "2", stop=True) as t:
        net[0](torch.randn(1, 4))  # the traced layer never runs
    assert not hasattr(t, "output")
    assert all_hooks(net) == 0


def test_a_tracer_only_swallows_its_own_stop():
    net, x = mlp(), torch.randn(2, 4)
    order = []
    with nethook.Trace(net, "0", stop=True) as outer:
        with nethook.Trace(net, "2", stop=True):
            net(x)
        order.append("after inner")  # outer's stop must not be swallowed by the inner tracer
    assert order == [] and outer.output.shape == (2, 8)
    with pytest.raises(nethook.StopForward):
        with nethook.Trace(net, "4"):  # a non-stopping tracer lets another's stop through
            with nethook.Trace(net, "0", stop=True) as inner:
                pass
            raise nethook.StopForward(owner=inner)
    assert all_hooks(net) == 0


def test_unowned_stopforward_is_swallowed_by_stop_tracer():
    net = mlp()
    with nethook.Trace(net, "0", stop=True):
        raise nethook.StopForward()
    with pytest.raises(nethook.StopForward):
        with nethook.Trace(net, "0"):
            raise nethook.StopForward()


def test_tracedict_stops_after_every_layer_whatever_the_order():
    net, x = mlp(), torch.randn(3, 4)
    with nethook.TraceDict(net, ["2", "0"], stop=True) as td:
        net(x)
        pytest.fail("forward should have stopped")
    assert list(td) == ["2", "0"]
    assert td["0"].output.shape == (3, 8) and td["2"].output.shape == (3, 6)
    assert net[3].calls == 0
    assert all_hooks(net) == 0


def test_tracedict_dedup_order_and_per_layer_options():
    net, x = mlp(), torch.randn(3, 4)
    with nethook.TraceDict(
        net,
        ["0", "2", "0"],
        retain_output={"2": True},
        edit_output={"0": lambda output: output * 0},
    ) as td:
        y = net(x)
    assert list(td.keys()) == ["0", "2"]
    assert not hasattr(td["0"], "output")  # omitted from the dict -> None -> not retained
    h = net[2](net[1](torch.zeros(3, 8)))
    assert torch.allclose(td["2"].output, h)
    assert torch.allclose(y, net[4](net[3](h)))


def test_tracedict_option_dict_with_unknown_layer_raises_before_registering():
    net = mlp()
    with pytest.raises(KeyError, match="not traced"):
        nethook.TraceDict(net, ["0"], clone={"1": True})
    assert all_hooks(net) == 0


def test_tracedict_missing_name_is_atomic_and_lists_close_names():
    model = gpt2()
    with pytest.raises(LookupError) as err:
        nethook.TraceDict(model, ["transformer.h.0", "transformer.h.1.mpl"])
    assert "transformer.h.1.mlp" in str(err.value)
    assert all_hooks(model) == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"clone": "yes"}, "clone"),
        ({"retain_output": 2}, "retain_output"),
        ({"edit_output": 3}, "edit_output"),
        ({"stop": [1]}, "stop"),
    ],
)
def test_wrong_option_types_raise_and_leave_nothing(kwargs, match):
    net = mlp()
    with pytest.raises(TypeError, match=match):
        nethook.Trace(net, "0", **kwargs)
    with pytest.raises(TypeError, match=match):
        nethook.TraceDict(net, ["0", "2"], **kwargs)
    assert all_hooks(net) == 0


@pytest.mark.parametrize("layers", [None, "0", 5, [0]])
def test_bad_layers_argument(layers):
    net = mlp()
    with pytest.raises((TypeError, LookupError)):
        nethook.TraceDict(net, layers)
    assert all_hooks(net) == 0


def test_layer_given_as_module_object_and_layer_none():
    net, x = mlp(), torch.randn(2, 4)
    with nethook.Trace(net, net[2]) as t:
        net(x)
    assert t.layer == "2" and t.output.shape == (2, 6)
    seen = []
    with nethook.Trace(net[2], edit_output=lambda output, layer: seen.append(layer)) as t2:
        net(x)
    assert seen == [None] and t2.layer is None
    with pytest.raises(ValueError, match="not a submodule"):
        nethook.Trace(net, nn.Linear(1, 1))
    with pytest.raises(TypeError, match="layer must be"):
        nethook.Trace(net, 3.5)  # type: ignore[arg-type]
    assert all_hooks(net) == 0


def test_retain_grad_then_backward(backend):
    net, x = mlp(), torch.randn(4, 4)
    for clone in (False, True):
        with nethook.Trace(net, "2", retain_grad=True, clone=clone) as t:
            y = net(x)
        assert t.output.grad is None
        y.sum().backward()
        # reference: d(sum y)/d(layer-2 output) by a hand-written hook
        grads = {}

        def grad_hook(_m, _a, o):
            o.register_hook(lambda g: grads.setdefault("g", g))

        h = net[2].register_forward_hook(grad_hook)
        net(x).sum().backward()
        h.remove()
        assert torch.allclose(t.output.grad, grads["g"])


def test_retain_grad_under_no_grad_marks_output():
    net = mlp()
    with torch.no_grad(), nethook.Trace(net, "0", retain_grad=True) as t:
        net(torch.randn(1, 4))
    assert t.output.requires_grad


def test_repeated_calls_last_wins_and_keep_calls():
    lin = nn.Linear(3, 3)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(self.lin(x))

    model, x = Twice(), torch.randn(2, 3)
    with nethook.Trace(model, "lin") as t:
        y = model(x)
    assert torch.equal(t.output, y)
    with nethook.Trace(model, "lin", keep_calls=True, retain_input=True) as t:
        y = model(x)
    assert [c.step for c in t.calls] == [0, 1]
    assert torch.equal(t.calls[0].input, x) and torch.equal(t.calls[1].output, y)
    assert torch.equal(t.calls[1].input, t.calls[0].output)


def test_structured_outputs_keep_their_types(backend):
    model = nn.Sequential(NamedTupleBlock())
    x = torch.randn(2, 4)
    with nethook.Trace(model, "0", clone=True, detach=True) as t:
        out = model(x)
    assert isinstance(t.output, Pair) and t.output.aux is None
    assert torch.equal(t.output.hidden, out.hidden) and t.output.hidden is not out.hidden
    dmodel = nn.Sequential(DictBlock())
    with nethook.Trace(dmodel, "0", clone=True) as td:
        dout = dmodel(x)
    assert td.output["pair"][1] == "tag" and td.output["cache"] is dout["cache"]
    assert torch.equal(td.output["pair"][0], dout["pair"][0])


def test_dataclass_output_keeps_type(backend):
    class DC(nn.Module):
        def forward(self, x):
            return DataOut(x * 2, "n")

    model = nn.Sequential(DC())
    with nethook.Trace(model, "0", clone=True) as t:
        out = model(torch.ones(2))
    assert isinstance(t.output, DataOut) and t.output.note == "n"
    assert torch.equal(t.output.hidden, out.hidden) and t.output.hidden is not out.hidden


def test_trace_is_reusable_and_close_is_idempotent():
    net, x = mlp(), torch.randn(2, 4)
    t = nethook.Trace(net, "0")
    assert all_hooks(net) == 1  # registered on construction, as nethook
    with t:
        net(x)
    assert all_hooks(net) == 0
    t.close()
    with t:
        y1 = net[0](x)
    assert torch.equal(t.output, y1) and all_hooks(net) == 0


def test_exception_in_model_or_edit_leaves_no_hook():
    net = mlp()
    with pytest.raises(RuntimeError):
        with nethook.TraceDict(net, ["0", "2"], clone=True):
            net(torch.randn(2, 5))  # wrong width
    with pytest.raises(ZeroDivisionError):
        with nethook.Trace(net, "2", edit_output=lambda output: 1 / 0):
            net(torch.randn(2, 4))
    assert all_hooks(net) == 0


def test_two_threads_each_see_their_own_forward():
    model = gpt2()
    ids = [
        torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(i)) for i in range(2)
    ]
    with torch.no_grad():
        refs = [model(i, output_hidden_states=True).hidden_states[1] for i in ids]
    before = all_hooks(model)  # transformers installs its own output-capturing hooks
    results: dict[int, list] = {0: [], 1: []}
    barrier = threading.Barrier(2)

    def work(k):
        barrier.wait()
        for _ in range(10):
            with torch.no_grad(), nethook.Trace(model, "transformer.h.0", clone=True) as t:
                model(ids[k])
            results[k].append(t.output)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for k in range(2):
        assert len(results[k]) == 10
        for out in results[k]:
            assert torch.equal(out, refs[k])
    assert all_hooks(model) == before


# --- ROME-style usage on a transformers GPT-2 built from a config ---------------------------


def test_rome_style_edit_retain_stop_and_grad_match_hand_written_hooks(backend):
    model = gpt2()
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    layer = "transformer.h.1.mlp"
    delta = torch.randn(32, generator=torch.Generator().manual_seed(2))

    def edit(cur_out, cur_layer):  # ROME's compute_v edit signature
        if cur_layer == layer:
            cur_out[:, -1] += delta
        return cur_out

    # reference with a hand-written hook
    ref = {}

    def hook(_m, args, out):
        out = out.clone()
        out[:, -1] += delta
        ref["in"], ref["out"] = args[0], out
        return out

    h = model.get_submodule(layer).register_forward_hook(hook)
    ref_logits = model(ids).logits
    h.remove()

    with nethook.TraceDict(
        model, [layer, "transformer.h.0"], retain_input=True, edit_output=edit
    ) as tr:
        logits = model(ids).logits
    assert torch.allclose(logits, ref_logits, atol=1e-6)
    assert torch.allclose(tr[layer].output, ref["out"]) and torch.allclose(
        tr[layer].input, ref["in"]
    )

    # stop=True: the hidden state of block 0, equal to output_hidden_states[1]
    with torch.no_grad():
        expect = model(ids, output_hidden_states=True).hidden_states[1]
    before = all_hooks(model)  # transformers installs its own output-capturing hooks
    with torch.no_grad():
        with nethook.Trace(model, "transformer.h.0", stop=True, clone=True) as t:
            model(ids)
    assert torch.allclose(t.output, expect, atol=1e-6)

    # retain_grad then backward: the gradient at block 0's output
    grads = {}

    def grad_hook(_m, _a, o):
        o.register_hook(lambda g: grads.setdefault("g", g))

    h = model.transformer.h[0].register_forward_hook(grad_hook)
    model(ids).logits.logsumexp(-1).sum().backward()
    h.remove()
    model.zero_grad()
    with nethook.Trace(model, "transformer.h.0", retain_grad=True) as t:
        out = model(ids).logits.logsumexp(-1).sum()
    out.backward()
    assert torch.allclose(t.output.grad, grads["g"], atol=1e-6)
    assert all_hooks(model) == before


def test_import_as_nethook_exposes_every_name():
    for name in [
        "Trace",
        "TraceDict",
        "StopForward",
        "recursive_copy",
        "subsequence",
        "hierarchical_subsequence",
        "set_requires_grad",
        "get_module",
        "get_parameter",
        "replace_module",
        "invoke_with_optional_args",
        "module_names",
        "parameter_names",
    ]:
        assert hasattr(nethook, name), name


def test_trace_on_each_device_matches_hand_written_hook(device, backend):
    net = mlp().to(device)
    x = torch.randn(5, 4, device=device)
    ref, ref_y = hand_hook_output(net, "2", x, edit=lambda o: o + 1)
    with nethook.TraceDict(
        net, ["0", "2"], clone=True, detach=True, edit_output={"2": lambda output: output + 1}
    ) as td:
        y = net(x)
    assert td["2"].output.device == x.device
    assert torch.equal(td["2"].output, ref) and torch.equal(y, ref_y)
    assert all_hooks(net) == 0


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_edit_applies_when_autograd_recomputes_on_another_thread(use_reentrant):
    """Activation checkpointing recomputes the forward during backward, on CUDA in autograd's
    own threads: the thread guard must not skip the edit there (silently wrong gradients)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
            self.head = nn.Linear(4, 1)

        def forward(self, x):
            return self.head(checkpoint(self.block, x, use_reentrant=use_reentrant))

    model, x = Checkpointed(), torch.randn(3, 4, requires_grad=use_reentrant)
    h = model.block[0].register_forward_hook(lambda m, a, o: o * 2)  # reference: plain hook
    model.head(model.block(x)).sum().backward()
    h.remove()
    expected = model.block[2].weight.grad.clone()
    model.zero_grad()
    with nethook.Trace(model, "block.0", edit_output=lambda output: output * 2):
        loss = model(x).sum()
        worker = threading.Thread(target=loss.backward)  # the recomputation runs on this thread
        worker.start()
        worker.join()
    assert torch.allclose(model.block[2].weight.grad, expected)
    assert all_hooks(model) == 0


# -- hook handles keep torch's RemovableHandle face (issue 23, item 2) ------------------------
def _torch_reference_handle(kind, module, fn, **kw):
    """The handle torch's own API gives for the same registration (the reference)."""
    return {
        "forward": module.register_forward_hook,
        "forward_pre": module.register_forward_pre_hook,
        "full_backward": module.register_full_backward_hook,
        "full_backward_pre": module.register_full_backward_pre_hook,
    }[kind](fn, **kw)


def _dict_names(module, dicts):
    names = {id(v): k for k, v in vars(module).items() if isinstance(v, dict)}
    return sorted(names[id(d)] for d in dicts)


@pytest.mark.parametrize(
    "kind,kw",
    [
        ("forward", {}),
        ("forward", {"with_kwargs": True}),
        ("forward", {"with_kwargs": True, "always_call": True}),
        ("forward", {"always_call": True}),
        ("forward_pre", {}),
        ("forward_pre", {"with_kwargs": True}),
        ("full_backward", {}),
        ("full_backward_pre", {}),
    ],
)
def test_hookset_handles_have_torchs_removable_handle_face(kind, kw):
    import copy
    import gc

    from torch.utils.hooks import RemovableHandle

    from pyhook._hooks import HookSet

    mine, ref = nn.Linear(2, 2), nn.Linear(2, 2)
    fn = lambda *a: None  # noqa: E731
    hooks = HookSet()
    with hooks.registering():
        h = getattr(hooks, kind)(mine, fn, **kw)
    r = _torch_reference_handle(kind, ref, fn, **kw)
    assert isinstance(h, RemovableHandle) and isinstance(h.id, int)
    # the same dicts (by attribute name) as torch's handle for the same registration
    assert _dict_names(mine, [h.hooks_dict_ref()]) == _dict_names(ref, [r.hooks_dict_ref()])
    extras = [w() for w in h.extra_dict_ref]
    assert _dict_names(mine, extras) == _dict_names(ref, [w() for w in r.extra_dict_ref])
    hooks_dict = h.hooks_dict_ref()
    assert h.id in hooks_dict
    # each extra dict holds the key exactly when torch's holds its handle's
    assert [h.id in d for d in extras] == [r.id in w() for w in r.extra_dict_ref]
    # copy.copy: torch's handle copies to a handle over the same dicts
    assert type(copy.copy(h)) is RemovableHandle and copy.copy(h).hooks_dict_ref() is hooks_dict
    with h:  # a context manager that removes on exit
        pass
    gc.collect()
    assert h.id not in hooks_dict and all(h.id not in d for d in extras)
    assert h.hooks_dict_ref() is hooks_dict  # still answers after remove, as torch's
    h.remove()  # twice is fine
    hooks.remove()
    assert all_hooks(mine) == 0


def test_trace_and_tracedict_handles_are_removable_handles():
    from torch.utils.hooks import RemovableHandle

    net = mlp()
    with nethook.TraceDict(net, ["0", "2"]) as td, nethook.Trace(net, "1") as t:
        handles = [t.registered_hook, td["0"].registered_hook, td["2"].registered_hook]
        dicts = [h.hooks_dict_ref() for h in handles]
        assert all(isinstance(h, RemovableHandle) for h in handles)
        assert [d is net[i]._forward_hooks for d, i in zip(dicts, (1, 0, 2))] == [True] * 3
        assert all(h.id in d for h, d in zip(handles, dicts))
    assert not any(h.id in d for h, d in zip(handles, dicts))
    assert all_hooks(net) == 0


def _llama():
    transformers = pytest.importorskip("transformers")
    from _models import randomise_norms

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=64,
    )
    return randomise_norms(transformers.LlamaForCausalLM(cfg)).eval()


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_trace_on_a_query_key_value_point_edits_then_leaves_no_hook(which):
    # attn_q/k/v on Llama register two hooks (the attention's pre-hook for the rotary
    # embedding, the projection's hook): entering such a Trace used to fail after registering
    # them, and the edit stayed on every later forward.
    model, ids = _llama(), torch.tensor([[3, 5, 7, 9]])
    plain = model(ids).logits
    proj = model.model.layers[1].self_attn.get_submodule(f"{which}_proj")
    h = proj.register_forward_hook(lambda _m, _a, out: out * 0)  # zero q/k/v: rotation is linear
    try:
        ref = model(ids).logits
    finally:
        h.remove()
    tr = nethook.Trace(model, f"attn_{which}.1", edit_output=lambda output: output * 0)
    with tr:
        edited = model(ids).logits
    assert torch.allclose(edited, ref, atol=1e-6) and not torch.allclose(edited, plain)
    assert all_hooks(model) == 0
    assert torch.equal(model(ids).logits, plain)


def test_a_failure_while_entering_a_trace_leaves_no_hook(monkeypatch):
    from pyhook.points import _Handles

    model, ids = _llama(), torch.tensor([[3, 5, 7, 9]])
    plain = model(ids).logits

    def broken(self):
        raise RuntimeError("injected")

    monkeypatch.setattr(_Handles, "alive", property(broken))
    tr = nethook.Trace(model, "attn_q.1", edit_output=lambda output: output * 0)
    with pytest.raises(RuntimeError, match="injected"), tr:
        pass
    assert all_hooks(model) == 0
    assert torch.equal(model(ids).logits, plain)


@pytest.mark.parametrize("layer", ["transformer.h.1.mlp.c_fc", "transformer.h.1.attn"])
def test_an_edit_in_a_checkpointed_layer_keeps_its_gradients_or_is_refused(layer):
    """With transformers' gradient checkpointing (non-reentrant), a backward inside the block
    recomputes the layer with the edit (the parameter gradients of the same model without
    checkpointing); a backward after the block would recompute it without the edit, so the
    block refuses to end quietly, naming the layer."""
    import copy
    import warnings

    transformers = pytest.importorskip("transformers")
    from _models import randomise_norms

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_embd=16, n_layer=3, n_head=2, vocab_size=64, attn_pdrop=0, resid_pdrop=0, embd_pdrop=0
    )
    plain = randomise_norms(transformers.GPT2LMHeadModel(cfg)).train()
    ckpt = copy.deepcopy(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ckpt.train()
    x = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    before = all_hooks(ckpt)  # transformers' own output-capturing hooks

    def edit(output):
        return (output[0] * 2, *output[1:]) if isinstance(output, tuple) else output * 2

    grads = []
    for model in (plain, ckpt):
        with nethook.TraceDict(model, [layer], edit_output=edit):
            model(x, labels=x).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-6)
    for make in (nethook.TraceDict, nethook.Trace):  # (a Trace registers when it is made)
        with pytest.raises(RuntimeError, match=rf"edited '{layer}' inside an activation-check"):
            with make(ckpt, [layer] if make is nethook.TraceDict else layer, edit_output=edit):
                ckpt(x, labels=x)
        assert all_hooks(ckpt) == before
    with torch.no_grad(), nethook.TraceDict(ckpt, [layer], edit_output=edit):
        ckpt(x, labels=x)  # no backward to come: nothing refused
