"""HookFunction / FlexModel (flex_model) in one process: each hook type against the equivalent
hand-written PyTorch hook on a tiny OPT model, groups, lifetime, and bad input."""

from __future__ import annotations

import collections
import copy
import gc
import io
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pyhook import LayerNotFoundError
from pyhook.flex import DummyModule, FlexModel, HookFunction, default_editing_function

transformers = pytest.importorskip("transformers")

LAYER = "model.decoder.layers.1.fc2"


def make_opt() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.OPTConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        ffn_dim=64,
        num_attention_heads=2,
        max_position_embeddings=64,
        word_embed_proj_dim=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    return transformers.OPTForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def opt():
    return make_opt()


@pytest.fixture(scope="module")
def ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 100, (2, 7), generator=g)


def assert_no_hooks(model: nn.Module) -> None:
    for name, m in model.named_modules():
        for attr in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_backward_hooks",
            "_backward_pre_hooks",
        ):
            assert not getattr(m, attr), f"{attr} left on {name!r}"
    for name, p in model.named_parameters():
        assert not p._backward_hooks, f"tensor hook left on parameter {name!r}"


def run(model, ids, backward=False):
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    grads = {}
    if backward:
        (logits.float() ** 2).mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def times2(current_module, inputs, save_ctx, modules):
    return inputs * 2


# ------------------------------------------------------------------------- hook types vs PyTorch
HAND_WRITTEN = {
    "forward": lambda mod, p: mod.register_forward_hook(lambda m, a, out: out * 2),
    "forward_pre": lambda mod, p: mod.register_forward_pre_hook(lambda m, a: (a[0] * 2,)),
    "full_backward": lambda mod, p: mod.register_full_backward_hook(lambda m, gi, go: (gi[0] * 2,)),
    "full_backward_pre": lambda mod, p: mod.register_full_backward_pre_hook(
        lambda m, go: (go[0] * 2,)
    ),
    "tensor": lambda mod, p: p.register_hook(lambda g: g * 2),
}
REGISTER = {
    "forward": "register_forward_hook",
    "forward_pre": "register_forward_pre_hook",
    "full_backward": "register_full_backward_hook",
    "full_backward_pre": "register_full_backward_pre_hook",
    "tensor": "register_hook",
}


@pytest.mark.parametrize("hook_type", list(HAND_WRITTEN))
def test_hook_type_matches_hand_written_pytorch_hook(opt, ids, hook_type):
    module = opt.get_submodule(LAYER)
    param = module.weight
    base_logits, base_grads = run(opt, ids, backward=True)

    handle = HAND_WRITTEN[hook_type](module, param)
    ref_logits, ref_grads = run(opt, ids, backward=True)
    handle.remove()
    assert_no_hooks(opt)
    if hook_type in ("forward", "forward_pre"):
        assert not torch.equal(ref_logits, base_logits)  # the edit matters
    else:
        assert any(
            not torch.equal(ref_grads[n], base_grads[n]) for n in base_grads
        )  # the edit matters

    out: dict = {}
    fm = FlexModel(opt, out)
    name = LAYER + ".weight" if hook_type == "tensor" else LAYER
    hf = HookFunction(name, editing_function=times2)
    getattr(fm, REGISTER[hook_type])(hf)
    assert (
        hf.hook_type == hook_type
        and hf.save_ctx is fm.save_ctx
        and hf.modules is fm.trainable_modules
    )
    fm.zero_grad(set_to_none=True)
    logits = fm(ids).logits
    (logits.float() ** 2).mean().backward()
    grads = {n: p.grad.clone() for n, p in opt.named_parameters() if p.grad is not None}

    assert torch.equal(logits.detach(), ref_logits)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        assert torch.equal(grads[n], ref_grads[n]), n
    if hook_type == "tensor":
        assert torch.equal(grads[name], base_grads[name] * 2)
    assert len(out[name]) == 1 and out[name][0].device.type == "cpu"
    assert fm.restore() is opt
    assert_no_hooks(opt)
    assert not dist.is_initialized()


def test_forward_saves_pre_edit_copy_per_call(opt, ids):
    module = opt.get_submodule(LAYER)
    seen = []
    h = module.register_forward_hook(lambda m, a, o: seen.append(o.detach().clone()))
    opt(ids)
    h.remove()

    def inplace(current_module, inputs, save_ctx, modules):
        assert current_module is module
        return inputs.mul_(3)  # an in-place edit must not change the saved copy

    out: dict = {}
    fm = FlexModel(opt, out)
    fm.register_forward_hook(HookFunction(LAYER, editing_function=inplace))
    with torch.no_grad():
        fm(ids)
        fm(ids)
    assert len(out[LAYER]) == 2
    for saved in out[LAYER]:
        assert torch.equal(saved, seen[0])
    assert out[LAYER][0].data_ptr() != out[LAYER][1].data_ptr()
    fm.restore()
    assert_no_hooks(opt)


def test_module_called_twice_per_forward_keeps_both_calls():
    lin = nn.Linear(3, 3)
    net = nn.Sequential(lin, nn.Tanh(), lin)
    out: dict = {}
    fm = FlexModel(net, out)
    fm.register_forward_hook(HookFunction("0"))
    x = torch.randn(2, 3)
    fm(x)
    assert len(out["0"]) == 2
    assert torch.equal(out["0"][0], lin(x).detach())
    assert torch.equal(out["0"][1], lin(torch.tanh(lin(x))).detach())
    fm.restore()


# ------------------------------------------------------------------------------- nested outputs
Pair = collections.namedtuple("Pair", ["hidden", "aux"])


class PairBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return Pair(self.lin(x), None)


class DictBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return {"hidden": h, "pair": (h + 1, "tag"), "cache": object()}


def test_dict_and_namedtuple_outputs_are_unpacked():
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    block = DictBlock()
    ref = block(x)
    out: dict = {}
    fm = FlexModel(block, out)
    fm.register_forward_hook(
        HookFunction("", editing_function=lambda m, t, c, mods: -t, unpack_idx=1)
    )
    got = fm(x)
    assert isinstance(got, dict) and got["pair"][1] == "tag" and got["cache"] is not ref["cache"]
    assert torch.equal(got["hidden"], ref["hidden"])
    assert torch.equal(got["pair"][0], -ref["pair"][0])
    assert torch.equal(out[""][0], ref["pair"][0])
    fm.restore()

    nt = PairBlock()
    ref = nt(x)
    fm = FlexModel(nt, out)
    fm.register_forward_hook(HookFunction("", editing_function=times2))
    got = fm(x)
    assert type(got) is Pair and got.aux is None and torch.equal(got.hidden, ref.hidden * 2)
    fm.restore()
    assert_no_hooks(nt)


# ---------------------------------------------------------------------- save_ctx, trainable modules
def test_save_ctx_shared_and_trainable_modules(opt, ids):
    out: dict = {}
    fm = FlexModel(opt, out)

    def write(m, t, ctx, mods):
        ctx.layer0 = t.detach().clone()
        return t

    def read(m, t, ctx, mods):
        return t + mods["probe"](ctx.layer0)  # trainable module registered after this hook function

    fm.register_forward_hook(HookFunction("model.decoder.layers.0.fc2", editing_function=write))
    fm.register_forward_hook(HookFunction("model.decoder.layers.1.fc2", editing_function=read))
    probe = nn.Linear(32, 32)
    fm.register_trainable_module("probe", probe)
    params = list(fm.parameters())
    assert any(p is probe.weight for p in params) and any(p is probe.bias for p in params)
    assert len(params) == len(list(opt.parameters())) + 2
    names = dict(fm.named_parameters())
    assert (
        "trainable_modules.probe.weight" in names and "model.decoder.layers.0.fc2.weight" in names
    )
    assert fm.trainable_modules_names == ["probe"]
    assert fm.all_modules_names == fm.wrapped_module_names + ["probe"]

    opt.zero_grad(set_to_none=True)
    logits = fm(ids).logits
    logits.sum().backward()
    assert probe.weight.grad is not None and probe.weight.grad.abs().sum() > 0
    fm.restore()
    assert_no_hooks(opt)
    # reference with hand-written hooks
    ctx = {}
    h0 = opt.get_submodule("model.decoder.layers.0.fc2").register_forward_hook(
        lambda m, a, o: ctx.__setitem__("h", o.detach().clone())
    )
    h1 = opt.get_submodule("model.decoder.layers.1.fc2").register_forward_hook(
        lambda m, a, o: o + probe(ctx["h"])
    )
    ref = opt(ids).logits
    h0.remove(), h1.remove()
    assert torch.equal(logits, ref)
    opt.zero_grad(set_to_none=True)


# ------------------------------------------------------------------------------------------ groups
def test_groups_disable_reenable_and_complement(opt, ids):
    with torch.no_grad():
        base = opt(ids).logits
    out: dict = {}
    fm = FlexModel(opt, out)
    created = fm.create_hook_group("fc2s", "fc2", editing_function=times2)
    assert [hf.module_name for hf in created] == [
        "model.decoder.layers.0.fc2",
        "model.decoder.layers.1.fc2",
    ]
    exact = fm.create_hook_group("one", "model.decoder.layers.0.fc1")  # an exact name works too
    assert len(exact) == 1
    assert fm.get_hook_function_groups(created[0]) == ["all", "fc2s"]
    assert set(fm.get_group_hook_functions("all")) == set(created + exact)

    with torch.no_grad():
        edited = fm(ids).logits  # all enabled
        off = fm(ids, groups="fc2s", complement=True).logits  # only fc1 capture: no edit
        again = fm(ids, groups="fc2s").logits  # re-enabled (flex_model raised TypeError here)
        none = fm(ids, groups="all", complement=True).logits
    assert torch.equal(off, base) and torch.equal(none, base)
    assert torch.equal(edited, again) and not torch.equal(edited, base)
    assert len(out["model.decoder.layers.0.fc1"]) == 2
    assert len(out["model.decoder.layers.0.fc2"]) == 2

    fm.update_hook_groups("layers.1", "late")
    assert [hf.module_name for hf in fm.get_group_hook_functions("late")] == [
        "model.decoder.layers.1.fc2"
    ]
    fm.update_hook_groups(created[0], "late")
    fm.remove_hook_groups([created[1]], "late")
    assert fm.get_group_hook_functions("late") == [created[0]]
    with pytest.raises(ValueError, match="'all'"):
        fm.remove_hook_groups(created[0], "all")
    with pytest.raises(KeyError, match="nope"):
        fm(ids, groups="nope")
    with pytest.raises(KeyError):
        fm.update_hook_groups("no_such_module", "g")

    # garbage collection with disabled hooks: no crash, no hooks left
    with torch.no_grad():
        fm(ids, groups="one")
    del fm, created, exact
    gc.collect()
    assert_no_hooks(opt)


def test_create_hook_group_is_atomic(opt):
    fm = FlexModel(opt, {})
    with pytest.raises(LookupError, match="closest"):
        fm.create_hook_group("g", "no_such_layer")
    with pytest.raises(ValueError):
        fm.create_hook_group("g", "fc2", hook_type="sideways")
    assert fm.hook_functions == [] and fm.hook_groups == ["all"]
    assert_no_hooks(opt)


# ------------------------------------------------------------------------------------- lifetime
def test_restore_and_reregister(opt, ids):
    hf = HookFunction(LAYER, editing_function=times2)
    fm = FlexModel(opt, {})
    fm.register_forward_hook(hf)
    with pytest.raises(RuntimeError, match="already registered"):
        fm.register_forward_hook(hf)
    with pytest.raises(RuntimeError, match="already registered"):
        FlexModel(opt, {}).register_full_backward_hook(hf)
    assert len(opt.get_submodule(LAYER)._forward_hooks) == 1
    model = fm.restore()
    assert model is opt
    assert_no_hooks(opt)
    assert not hf.registered
    fm2 = FlexModel(opt, {})
    fm2.register_forward_pre_hook(hf)  # allowed again after restore (flex_model asserted)
    assert hf.hook_type == "forward_pre"
    del fm2
    gc.collect()
    assert_no_hooks(opt)


# ------------------------------------------------------------------------------------- bad input
def test_unknown_names_list_close_matches(opt):
    fm = FlexModel(opt, {})
    with pytest.raises(LayerNotFoundError, match=r"model\.decoder\.layers\.1\.fc2"):
        fm.register_forward_hook(HookFunction("model.decoder.layers.1.fc3"))
    with pytest.raises(LayerNotFoundError, match=r"fc2\.weight"):
        fm.register_hook(HookFunction("model.decoder.layers.1.fc2.weigth"))
    with pytest.raises(LayerNotFoundError):
        fm.register_hook(HookFunction(LAYER))  # a module, not a parameter
    assert fm.hook_functions == []
    assert_no_hooks(opt)


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        (dict(expected_shape=(None, None, 32)), ValueError, "expected_shape .* 3 dimensions .* 2"),
        (dict(expected_shape=(None, 99)), ValueError, "expected_shape .* size 99"),
        (dict(editing_function=lambda m, t, c, mods: t[:, :1]), ValueError, "changed the shape"),
        (dict(editing_function=lambda m, t, c, mods: None), TypeError, "must return a tensor"),
        (
            dict(editing_function=lambda m, t, c, mods: t.tolist()),
            TypeError,
            "must return a tensor",
        ),
        (dict(unpack_idx=1), IndexError, "unpack_idx=1 .* only 1 tensor"),
    ],
)
def test_runtime_errors_name_the_module_and_leave_nothing(opt, ids, kwargs, err, match):
    out: dict = {}
    fm = FlexModel(opt, out)
    fm.register_forward_hook(HookFunction(LAYER, **kwargs))
    with pytest.raises(err, match=match) as info:
        fm(ids)
    assert LAYER in str(info.value)
    assert out == {}  # a failed call saves nothing
    fm.restore()
    assert_no_hooks(opt)


def test_hook_function_argument_types():
    with pytest.raises(TypeError, match="module_name"):
        HookFunction(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected_shape"):
        HookFunction("a", expected_shape=(None, "x"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="editing_function"):
        HookFunction("a", editing_function=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unpack_idx"):
        HookFunction("a", unpack_idx="0")  # type: ignore[arg-type]
    assert HookFunction("a").editing_function is default_editing_function
    with pytest.raises(ValueError, match="save_on"):
        FlexModel(nn.Linear(2, 2), {}, save_on="some")


def test_parallel_sizes_without_distributed_is_a_clear_error():
    with pytest.raises(RuntimeError, match="init_process_group"):
        FlexModel(nn.Linear(2, 2), {}, tensor_parallel_size=2)
    assert not dist.is_initialized()


# ------------------------------------------------------------------------------------ helpers
def test_dummy_module_and_get_module_parameter():
    net = nn.Sequential(nn.Linear(3, 3), DummyModule())
    out: dict = {}
    fm = FlexModel(net, out)
    fm.register_forward_hook(HookFunction("1", editing_function=lambda m, t, c, mods: t + 1))
    x = torch.randn(2, 3)
    assert torch.equal(fm(x), net[0](x) + 1)
    w = fm.get_module_parameter("0.weight")
    assert (
        torch.equal(w, net[0].weight)
        and w.data_ptr() != net[0].weight.data_ptr()
        and not w.requires_grad
    )
    fm.restore()


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_backward_hook_without_gradient_is_skipped():
    # grad_input of the first layer is None when the input does not require grad
    net = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    out: dict = {}
    fm = FlexModel(net, out)
    fm.register_full_backward_hook(HookFunction("0", editing_function=times2))
    fm.register_full_backward_pre_hook(HookFunction("1"))
    fm(torch.randn(2, 3)).sum().backward()
    assert "0" not in out and len(out["1"]) == 1
    fm.restore()
    assert_no_hooks(net)


def test_deepcopy_is_refused_and_the_model_copies_cleanly():
    # A deep copy used to list the hook functions while none ran on the copied model.
    net = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    out: dict = {}
    fm = FlexModel(net, out)
    fm.register_forward_hook(HookFunction("0", editing_function=lambda m, x, ctx, mods: x * 0))
    with pytest.raises(TypeError, match=r"FlexModel cannot be deep-copied.*flex_model\.module"):
        copy.deepcopy(fm)
    x = torch.randn(2, 3)
    assert torch.equal(fm(x), torch.zeros(2, 3)) and len(out["0"]) == 1  # the original is intact
    twin = copy.deepcopy(fm.module)  # the documented way: a copy without the hooks
    plain = torch.relu(torch.nn.functional.linear(x, net[0].weight, net[0].bias))
    assert torch.equal(twin(x), plain) and len(out["0"]) == 1
    fm2 = FlexModel(twin, {})
    fm2.register_forward_hook(HookFunction("0", editing_function=lambda m, x, ctx, mods: x * 0))
    assert torch.equal(fm2(x), torch.zeros(2, 3)) and len(out["0"]) == 1
    # pickling (torch.save of the wrapper) is refused by name, not with a hook's closure
    for save in (lambda: pickle.dumps(fm), lambda: torch.save(fm, io.BytesIO())):
        with pytest.raises(TypeError, match=r"FlexModel cannot be pickled.*state_dict"):
            save()
    shallow = copy.copy(fm)  # shares the model and its hooks, as nn.Module's copy does
    assert torch.equal(shallow(x), torch.zeros(2, 3)) and len(out["0"]) == 2
    assert shallow.hook_functions == fm.hook_functions
