"""Edits inside activation-checkpointed layers, with every editing tracer and both forms of
``torch.utils.checkpoint`` (issue 49, item 5): a backward inside the block recomputes the layer
with the edit (the gradients of the edited model without checkpointing, the edit applied by a
hand-written hook); a backward after the hooks are gone would recompute it without the edit,
so the block refuses to end quietly, naming the layer, and leaves no hook behind."""

from __future__ import annotations

import copy

import pytest
import torch
from _models import all_hooks, checkpointed_copy, randomise_norms
from torch import nn
from torch.utils.checkpoint import checkpoint

import pyhook
from pyhook import deephook

REFUSED = (
    r"edited 'block\.0' inside an activation-checkpointed layer .*no backward ran before the "
    r"hooks were removed: a backward now would recompute those layers without the edit"
)


class Checkpointed(nn.Module):
    """An input layer, a block run under ``checkpoint`` (``nested``: inside a second, outer
    checkpoint), a head; ``ckpt=None`` runs the same weights without checkpointing."""

    def __init__(self, ckpt: str | None = "reentrant", nested: bool = False) -> None:
        super().__init__()
        self.ckpt, self.nested = ckpt, nested
        self.inp = nn.Linear(4, 4)
        self.block = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
        self.head = nn.Linear(4, 1)

    def _inner(self, h: torch.Tensor) -> torch.Tensor:
        if self.ckpt is None:
            return self.block(h)
        return checkpoint(self.block, h, use_reentrant=self.ckpt == "reentrant")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)  # requires grad: the reentrant checkpoint is part of the graph
        if self.nested and self.ckpt is not None:
            h = checkpoint(self._inner, h, use_reentrant=self.ckpt == "reentrant")
        else:
            h = self._inner(h)
        return self.head(torch.tanh(h))


def _double(output):
    return output * 2


# Every editing tracer, each doubling the output of block.0 (the first layer of the block).
TRACERS = {
    "nethook.Trace": lambda m: pyhook.Trace(m, "block.0", edit_output=_double),
    "nethook.TraceDict": lambda m: pyhook.TraceDict(m, ["block.0"], edit_output=_double),
    "deephook.Trace": lambda m: deephook.Trace(
        m, "block.0", edit_output=lambda output, layer_name: output * 2
    ),
    "deephook.TraceMultiple": lambda m: deephook.TraceMultiple(
        m, {"block.0": (True, False, lambda output, layer_name: output * 2)}
    ),
    "lens.hooks": lambda m: pyhook.hooks(m, fwd_hooks=[("block.0", lambda t, hook: t * 2)]),
}


def _models(ckpt="reentrant", nested=False, seed=0):
    """The checkpointed model, and the reference: the same weights without checkpointing,
    the edit applied by a hand-written forward hook."""
    torch.manual_seed(seed)
    model = Checkpointed(ckpt, nested)
    ref = copy.deepcopy(model)
    ref.ckpt = None
    ref.block[0].register_forward_hook(lambda m, a, o: o * 2)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed + 1))
    return model, ref, x


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads(got, want):
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.parametrize("nested", [False, True], ids=["one", "nested"])
@pytest.mark.parametrize("ckpt", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize("tracer", list(TRACERS))
def test_an_edit_is_kept_by_a_backward_inside_the_block_and_refused_after(tracer, ckpt, nested):
    model, ref, x = _models(ckpt, nested)
    ref(x).pow(2).sum().backward()
    want = _grads(ref)
    # backward inside the block: the recomputation runs with the edit
    with TRACERS[tracer](model):
        model(x).pow(2).sum().backward()
    _assert_grads(_grads(model), want)
    assert all_hooks(model) == 0
    model.zero_grad()
    # backward after the block: refused when the block ends, with no hook left
    with pytest.raises(RuntimeError, match=REFUSED), TRACERS[tracer](model):
        loss = model(x).pow(2).sum()
    assert all_hooks(model) == 0
    # (why: that backward recomputes the block without the edit: the loss is the edited
    # model's, the block's gradients are not)
    loss.backward()
    torch.testing.assert_close(loss, ref(x).pow(2).sum())
    got = _grads(model)
    assert not torch.allclose(got["block.0.weight"], want["block.0.weight"], rtol=1e-3)


@pytest.mark.parametrize("ckpt", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize("tracer", list(TRACERS))
def test_each_forward_needs_its_own_backward(tracer, ckpt):
    """Two forwards in one block, a backward of the second only: the first one's edit is
    still pending (a backward settles the forward it goes through, no other)."""
    model, _, x = _models(ckpt)
    with pytest.raises(RuntimeError, match=REFUSED), TRACERS[tracer](model):
        first = model(x).sum()
        model(x + 1).sum().backward()
    assert all_hooks(model) == 0
    first.backward()  # (now without the edit: the hooks are gone)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")  # no_grad
def test_nothing_is_refused_without_an_edit_or_a_backward_to_come():
    model, _, x = _models()
    with pyhook.TraceDict(model, ["block.0", "block.2"]) as td:  # retain_output only
        loss = model(x).sum()
    with pyhook.Trace(model, "block.0", retain_input=True, keep_calls=True):
        model(x).sum()
    with pyhook.Trace(model, "block.0", edit_output=lambda output: None):  # keeps the output
        model(x).sum()
    with deephook.TraceMultiple(model, {"block.0": (True, True)}):
        model(x).sum()
    with torch.no_grad(), pyhook.TraceDict(model, ["block.0"], edit_output=_double):
        model(x)  # no backward can come
    with torch.inference_mode(), pyhook.Trace(model, "block.0", edit_output=_double):
        model(x)
    assert all_hooks(model) == 0
    # the captures are the checkpointed forward's own
    assert torch.equal(td["block.0"].output, model.block[0](model.inp(x)))
    loss.backward()


@pytest.mark.parametrize("ckpt", ["reentrant", "non-reentrant"])
def test_a_flex_model_edit_is_kept_by_a_backward_before_restore_and_refused_after(ckpt):
    model, ref, x = _models(ckpt)
    ref(x).pow(2).sum().backward()
    fm = pyhook.FlexModel(model, {})
    fm.register_forward_hook(
        pyhook.HookFunction("block.0", editing_function=lambda m, t, ctx, mods: t * 2)
    )
    fm(x).pow(2).sum().backward()
    _assert_grads(_grads(model), _grads(ref))
    loss = fm(x).pow(2).sum()
    with pytest.raises(RuntimeError, match="editing_function " + REFUSED):
        fm.restore()
    assert all_hooks(model) == 0
    fm.restore()  # nothing pending any more
    loss.backward()  # (without the edit: the hooks are gone)


def _hf(arch: str, reentrant: bool):
    """A two- or three-layer GPT-2 or Llama (no dropout, float32) in train mode, twice: with
    transformers' gradient checkpointing, and without."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(
            n_embd=16, n_layer=3, n_head=2, vocab_size=64, attn_pdrop=0, resid_pdrop=0,
            embd_pdrop=0,
        )  # fmt: skip
        plain = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, vocab_size=64, attention_dropout=0.0,
        )  # fmt: skip
        plain = transformers.LlamaForCausalLM(cfg)
    return checkpointed_copy(randomise_norms(plain), reentrant)


# Layers inside the checkpointed decoder layers; transformers checkpoints a decoder layer's
# forward, not its __call__, so the layer's own hooks (and edits) run outside the checkpoint.
HF_LAYERS = {
    "gpt2": ["transformer.h.1.mlp.c_fc", "transformer.h.1.attn", "transformer.h.1"],
    "llama": ["model.layers.1.mlp.up_proj", "model.layers.1.self_attn", "model.layers.1"],
}
OUTSIDE = ("transformer.h.1", "model.layers.1")


def _edit_first(output):
    return (output[0] * 2, *output[1:]) if isinstance(output, tuple) else output * 2


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize(
    ("arch", "layer"), [(a, n) for a, names in HF_LAYERS.items() for n in names]
)
def test_transformers_checkpointing_keeps_or_refuses_an_edit(arch, layer, reentrant):
    ckpt, plain = _hf(arch, reentrant)
    x = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    handle = plain.get_submodule(layer).register_forward_hook(lambda m, a, o: _edit_first(o))
    plain(x, labels=x).loss.backward()  # the reference: a hand-written hook, no checkpointing
    handle.remove()
    want = _grads(plain)
    before = all_hooks(ckpt)  # transformers' own output-capturing hooks
    with pyhook.TraceDict(ckpt, [layer], edit_output=_edit_first):
        ckpt(x, labels=x).loss.backward()
    _assert_grads(_grads(ckpt), want)
    ckpt.zero_grad()
    for make in (pyhook.Trace, pyhook.TraceDict):
        tracer = make(ckpt, layer if make is pyhook.Trace else [layer], edit_output=_edit_first)
        if layer in OUTSIDE:  # not recomputed: a backward after the block keeps the edit
            with tracer:
                loss = ckpt(x, labels=x).loss
            loss.backward()
            _assert_grads(_grads(ckpt), want)
            ckpt.zero_grad()
        else:
            match = rf"edit_output edited '{layer}' inside an activation-checkpointed layer"
            with pytest.raises(RuntimeError, match=match), tracer:
                loss = ckpt(x, labels=x).loss
        assert all_hooks(ckpt) == before
    with pyhook.TraceDict(ckpt, [layer]) as td:  # no edit: nothing refused
        loss = ckpt(x, labels=x).loss
    loss.backward()
    assert td[layer].output is not None and all_hooks(ckpt) == before
