"""pyhook.lens (run_with_cache, run_with_hooks, hooks): TransformerLens-shaped forward and backward
hooks, checked against references written with plain torch hooks and torch.autograd.grad on
GPT-2, Llama and BERT built from configs (random weights, norms with weights far from 1 / 0)."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")
import transformers as T
from _hygiene import diff, hook_snapshot
from _models import checkpointed_copy, randomise_norms

import pyhook

H = 16


@functools.cache
def build(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "gpt2":
        model = T.GPT2LMHeadModel(T.GPT2Config(n_embd=H, n_layer=2, n_head=2, vocab_size=64))
    elif arch == "llama":
        cfg = T.LlamaConfig(
            hidden_size=H,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=64,
        )
        model = T.LlamaForCausalLM(cfg)
    else:
        cfg = T.BertConfig(
            hidden_size=H, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32
        )
        cfg.vocab_size = 64
        model = T.BertModel(cfg)
    return randomise_norms(model).eval()


def ids() -> torch.Tensor:
    return torch.randint(2, 60, (2, 5), generator=torch.Generator().manual_seed(0))


def metric(out):
    return (
        out.loss if getattr(out, "loss", None) is not None else out.last_hidden_state.pow(2).sum()
    )


def run(model, **kw):
    if isinstance(model, T.BertModel):
        return model(ids(), **kw)
    return model(ids(), labels=ids(), **kw)


# Hand-written from the transformers source, not from pyhook's mapping: for each name, the module,
# the side ("pre": its first argument, "out": its output), and how the value is taken:
# "node" (a fresh identity node, so its gradient is this module's alone), "raw" (the tensor itself:
# resid_mid, read by the MLP branch and the skip connection), "heads" (split [head, d_head]),
# "norm" (TransformerLens' normalized value, computed from the norm's input by hand).
REF = {
    "gpt2": {
        "resid_pre.1": ("transformer.h.1", "pre", "node"),
        "blocks.1.attn.hook_z": ("transformer.h.1.attn.c_proj", "pre", "heads"),
        "mlp_hidden.1": ("transformer.h.1.mlp.c_proj", "pre", "node"),
        "resid_mid.1": ("transformer.h.1.ln_2", "pre", "raw"),
        "attn_in.0": ("transformer.h.0.attn", "pre", "node"),
        "mlp_out.0": ("transformer.h.0.mlp", "out", "node"),
        "blocks.1.hook_resid_post": ("transformer.h.1", "out", "node"),
        "blocks.1.ln2.hook_normalized": ("transformer.h.1.ln_2", "out", "norm"),
    },
    "llama": {
        "resid_pre.1": ("model.layers.1", "pre", "node"),
        "attn_z.1": ("model.layers.1.self_attn.o_proj", "pre", "heads"),
        "mlp_hidden.0": ("model.layers.0.mlp.down_proj", "pre", "node"),
        "resid_mid.1": ("model.layers.1.post_attention_layernorm", "pre", "raw"),
        "mlp_in.1": ("model.layers.1.mlp", "pre", "node"),
        "attn_out.0": ("model.layers.0.self_attn", "out", "node"),
        "resid_post.1": ("model.layers.1", "out", "node"),
        "ln_final.hook_normalized": ("model.norm", "out", "norm"),
    },
    "bert": {
        "resid_pre.1": ("encoder.layer.1", "pre", "node"),
        "attn_z.1": ("encoder.layer.1.attention.output.dense", "pre", "heads"),
        "mlp_hidden.1": ("encoder.layer.1.output.dense", "pre", "node"),
        "resid_mid.0": ("encoder.layer.0.intermediate", "pre", "raw"),
        "mlp_out.0": ("encoder.layer.0.output.dropout", "out", "node"),
        "resid_post.1": ("encoder.layer.1", "out", "node"),
    },
}


def _hand_normalized(module, x):
    eps = getattr(module, "eps", None) or getattr(module, "variance_epsilon", None)
    if "RMSNorm" not in type(module).__name__:
        x = x - x.mean(-1, keepdim=True)
    n = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    out = n * module.weight
    return n, out + module.bias if getattr(module, "bias", None) is not None else out


def reference(model, arch, bwd_edit=None):
    """Values and gradients at every REF name from plain torch hooks and torch.autograd.grad;
    ``bwd_edit={name: fn(grad)}`` adds hand-written tensor hooks replacing gradients."""
    kept, handles = {}, []
    bwd_edit = bwd_edit or {}

    def take(name, t, how, module):
        if how == "heads":
            z = t.unflatten(-1, (2, t.shape[-1] // 2))
            z = z.view_as(z)
            kept[name] = z
            back = z.flatten(-2)
        elif how == "raw":
            kept[name] = back = t
        elif how == "norm":
            n, back = _hand_normalized(module, module._lens_in)
            kept[name] = n
        else:
            kept[name] = back = t.view_as(t)
        if name in bwd_edit:
            kept[name].register_hook(bwd_edit[name])
        return back

    for name, (path, side, how) in REF[arch].items():
        mod = model.get_submodule(path)
        if side == "pre":

            def pre(m, args, name=name, how=how):
                return (take(name, args[0], how, m), *args[1:])

            handles.append(mod.register_forward_pre_hook(pre))
        else:
            if how == "norm":
                handles.append(
                    mod.register_forward_pre_hook(lambda m, a: setattr(m, "_lens_in", a[0]))
                )

            def post(m, args, out, name=name, how=how):
                t = out[0] if isinstance(out, tuple) else out
                new = take(name, t, how, m)
                return (new, *out[1:]) if isinstance(out, tuple) else new

            handles.append(mod.register_forward_hook(post))
    try:
        out = run(model)
        loss = metric(out)
        names = list(REF[arch])
        grads = torch.autograd.grad(loss, [kept[n] for n in names], retain_graph=True)
        loss.backward()
    finally:
        for h in handles:
            h.remove()
        for m in model.modules():
            m.__dict__.pop("_lens_in", None)
    return out, {n: kept[n].detach() for n in names}, dict(zip(names, grads))


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert"])
def test_run_with_cache_values_and_gradients_equal_plain_torch(arch):
    """Every cached value and gradient (per-head attn_z included, [batch, pos, head, d_head])
    equals the plain-torch reference; the output is the plain model's."""
    model = build(arch)
    before = hook_snapshot(model)
    model.zero_grad()
    ref_out, ref_vals, ref_grads = reference(model, arch)
    ref_pgrads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    kw = {} if arch == "bert" else {"labels": ids()}
    out, cache = pyhook.run_with_cache(
        model, ids(), names_filter=list(REF[arch]), incl_bwd=True, metric=metric, **kw
    )
    assert diff(before, hook_snapshot(model)) == []
    torch.testing.assert_close(metric(out), metric(ref_out), rtol=1e-6, atol=1e-6)
    assert set(cache) == {*REF[arch], *(n + "_grad" for n in REF[arch])}
    for name in REF[arch]:
        assert cache[name].shape == ref_vals[name].shape, name
        assert not cache[name].requires_grad
        torch.testing.assert_close(cache[name], ref_vals[name], rtol=1e-5, atol=2e-6, msg=name)
        torch.testing.assert_close(
            cache[name + "_grad"], ref_grads[name], rtol=1e-5, atol=2e-6, msg=name
        )
        if "attn" in name and "z" in name:
            assert cache[name].dim() == 4 and cache[name].shape[-2] == 2
    pgrads = [p.grad for p in model.parameters() if p.grad is not None]
    for a, b in zip(pgrads, ref_pgrads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    model.zero_grad()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_backward_hook_replacement_changes_upstream_gradients_as_a_tensor_hook(arch):
    """A gradient returned by a backward hook is what flows upstream: parameter gradients equal
    those of hand-written tensor hooks doing the same (at a per-head point and at resid_mid, a
    tensor read by two branches); the hook sees the gradient before the change."""
    model = build(arch)
    z = "blocks.1.attn.hook_z" if arch == "gpt2" else "attn_z.1"
    mask = torch.zeros(2, 5, 2, H // 2)
    mask[:, :, 1] = 1.0  # head 0's gradient dropped
    edits = {z: lambda g: g * mask, "resid_mid.1": lambda g: g * 3.0}
    model.zero_grad()
    reference(model, arch, bwd_edit=edits)
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    seen = {}

    def hook_fn(g, hook):
        seen[hook.name] = g.clone()
        return edits[hook.name](g)

    pyhook.run_with_hooks(
        model, ids(), labels=ids(), bwd_hooks=[(z, hook_fn), ("resid_mid.1", hook_fn)]
    )
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)
    assert seen[z].shape == (2, 5, 2, H // 2) and seen[z][:, :, 0].abs().sum() > 0
    model.zero_grad()
    reference(model, arch)  # no edits: other upstream gradients
    plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert any(not torch.allclose(plain[n], want[n], atol=1e-6) for n in want)
    model.zero_grad()


def test_forward_hooks_replace_activations_and_names_resolve():
    """A forward hook's return value replaces the activation (the same logits as a plain torch
    hook doing it); TL names, standard points, module names and globs all hook; names_filter as a
    callable; pos_slice; stop_at_layer returns the residual stream before block L."""
    model = build("gpt2")
    with torch.no_grad():
        h = model.transformer.h[0].mlp.register_forward_hook(lambda m, a, o: o * 0)
        want = model(ids()).logits
        h.remove()
        got = pyhook.run_with_hooks(
            model, ids(), fwd_hooks=[("blocks.0.hook_mlp_out", lambda t, hook: t * 0)]
        ).logits
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        got = pyhook.run_with_hooks(
            model, ids(), fwd_hooks=[("transformer.h.*.mlp", lambda t, hook: t * 0)]
        ).logits
        assert not torch.allclose(got, model(ids()).logits)
        hs = model(ids(), output_hidden_states=True).hidden_states
        _, cache = pyhook.run_with_cache(
            model, ids(), names_filter=lambda n: n.startswith("resid_pre")
        )
        assert list(cache) == ["resid_pre.0", "resid_pre.1"]
        assert torch.equal(cache["resid_pre.1"], hs[1])
        _, cache = pyhook.run_with_cache(
            model, ids(), names_filter=["resid_post.*", "attn_z.1"], pos_slice=-1
        )
        assert torch.equal(cache["resid_post.0"], hs[1][:, -1])
        assert cache["attn_z.1"].shape == (2, 2, H // 2)  # [batch, head, d_head] at one position
        _, cache = pyhook.run_with_cache(
            model, ids(), names_filter="resid_post.0", pos_slice=(1, 3)
        )
        assert torch.equal(cache["resid_post.0"], hs[1][:, 1:3])
        resid, cache = pyhook.run_with_cache(
            model, ids(), names_filter=["resid_post.0", "resid_post.1"], stop_at_layer=1
        )
        assert torch.equal(resid, hs[1]) and list(cache) == ["resid_post.0"]


def test_no_hook_left_whatever_happens():
    """Hooks are gone after errors in the model, a forward hook that raises, a backward hook
    that raises, a stop, bad names, and a block whose backward never ran (the gradient hook is
    not called by a later backward)."""
    model = build("gpt2")
    before = hook_snapshot(model)
    calls = []

    def boom(t, hook):
        raise RuntimeError("hook failed")

    with pytest.raises(RuntimeError, match="hook failed"):
        pyhook.run_with_hooks(model, ids(), fwd_hooks=[("resid_mid.1", boom)])
    assert diff(before, hook_snapshot(model)) == []
    with pytest.raises(RuntimeError, match="hook failed"):
        pyhook.run_with_hooks(model, ids(), labels=ids(), bwd_hooks=[("attn_z.0", boom)])
    assert diff(before, hook_snapshot(model)) == []
    with (
        pytest.raises(ValueError, match="in block"),
        pyhook.hooks(model, fwd_hooks=[("attn_z.0", lambda t, h: None)]),
    ):
        raise ValueError("in block")
    assert diff(before, hook_snapshot(model)) == []
    with pytest.raises(LookupError):
        pyhook.run_with_cache(model, ids(), names_filter=["resid_post.0", "resid_psot.1"])
    with pytest.raises(LookupError, match="only ln2 reads"):
        pyhook.run_with_hooks(model, ids(), fwd_hooks=[("blocks.0.hook_mlp_in", boom)])
    with pytest.raises(TypeError, match="callable"):
        pyhook.run_with_hooks(model, ids(), fwd_hooks=[("resid_post.0", 3)])
    assert diff(before, hook_snapshot(model)) == []
    pyhook.run_with_cache(model, ids(), names_filter=["resid_post.0"], stop_at_layer=1)
    with pytest.raises(LookupError, match=r"stop_at_layer=5: .*has 2 blocks"):
        pyhook.run_with_cache(model, ids(), names_filter=["resid_post.0"], stop_at_layer=5)
    assert diff(before, hook_snapshot(model)) == []
    with pyhook.hooks(model, bwd_hooks=[("resid_post.0", lambda g, h: calls.append(h.name))]):
        out = model(ids(), labels=ids())
    out.loss.backward()  # after the block: the gradient hook is gone
    assert calls == []
    assert diff(before, hook_snapshot(model)) == []
    model.zero_grad()


def test_branch_inputs_of_a_parallel_block_get_their_own_gradients():
    """GPT-J's one norm feeds attention and MLP: attn_in.0 and mlp_in.0 hold the same tensor, and
    each backward hook sees its own branch's gradient; together they are the norm output's
    gradient from torch.autograd.grad."""
    torch.manual_seed(0)
    cfg = T.GPTJConfig(n_embd=H, n_layer=1, n_head=2, rotary_dim=4, vocab_size=64, n_positions=32)
    model = randomise_norms(T.GPTJForCausalLM(cfg)).eval()
    kept = {}
    h = model.transformer.h[0].ln_1.register_forward_hook(lambda m, a, o: kept.setdefault("x", o))
    try:
        logits = model(ids()).logits
    finally:
        h.remove()
    (want,) = torch.autograd.grad(logits.pow(2).sum(), [kept["x"]])
    _, cache = pyhook.run_with_cache(
        model,
        ids(),
        names_filter=["attn_in.0", "mlp_in.0"],
        incl_bwd=True,
        metric=lambda out: out.logits.pow(2).sum(),
    )
    assert torch.equal(cache["attn_in.0"], cache["mlp_in.0"])
    torch.testing.assert_close(cache["attn_in.0_grad"] + cache["mlp_in.0_grad"], want)
    assert not torch.allclose(cache["attn_in.0_grad"], want, atol=1e-4)
    model.zero_grad()


def _opt():
    torch.manual_seed(0)
    cfg = T.OPTConfig(
        hidden_size=H,
        num_hidden_layers=2,
        num_attention_heads=2,
        ffn_dim=32,
        vocab_size=64,
        max_position_embeddings=32,
        word_embed_proj_dim=H,
    )
    return randomise_norms(T.OPTForCausalLM(cfg)).eval()


@pytest.mark.parametrize("pos_slice", [-1, 2, (1, 4), [0, 3, -1]])
def test_pos_slice_on_a_flat_point_selects_every_examples_positions(pos_slice):
    """OPT computes its MLP on [batch*tokens, d]: pos_slice picks each example's positions
    (a hand-written hook's tensor, viewed [batch, tokens, d] and sliced), staying flat."""
    model = _opt()
    x = torch.randint(2, 60, (3, 5), generator=torch.Generator().manual_seed(1))
    seen = {}
    h = model.model.decoder.layers[1].fc2.register_forward_hook(
        lambda m, a, o: seen.setdefault("mlp_out", o.detach())
    )
    try:
        with torch.no_grad():
            model(x)
    finally:
        h.remove()
    assert seen["mlp_out"].shape == (15, H)  # flat, as the model computes it
    grid = seen["mlp_out"].unflatten(0, (3, 5))
    if isinstance(pos_slice, int):
        want = grid[:, pos_slice]
    else:
        index = slice(*pos_slice) if isinstance(pos_slice, tuple) else pos_slice
        want = grid[:, index].flatten(0, 1)
    _, cache = pyhook.run_with_cache(
        model, x, names_filter=["mlp_out.1", "resid_post.1"], pos_slice=pos_slice
    )
    torch.testing.assert_close(cache["mlp_out.1"], want, rtol=0, atol=0)
    assert cache["resid_post.1"].shape[0] == 3  # [batch, ...] points keep their batch dim


def test_pos_slice_out_of_range_is_refused_by_name_before_the_forward():
    model = build("gpt2")
    calls = []
    h = model.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        for bad in (5, -6, [0, 7], torch.tensor([1, 5])):
            with pytest.raises(IndexError, match=r"pos_slice=.*out of range.* 5 positions"):
                pyhook.run_with_cache(model, ids(), names_filter=["resid_post.0"], pos_slice=bad)
        assert calls == []  # refused before the forward
        _, cache = pyhook.run_with_cache(model, ids(), names_filter=["resid_post.0"], pos_slice=4)
        assert calls == [1] and cache["resid_post.0"].shape == (2, H)
    finally:
        h.remove()


def test_a_names_filter_that_matches_nothing_and_a_metric_without_incl_bwd_are_refused():
    """An empty cache from a callable that matches no name, and a metric that is never used
    (no backward runs without incl_bwd=True), are mistakes: each is refused, naming the argument."""
    model = build("gpt2")
    before = hook_snapshot(model)
    with pytest.raises(LookupError, match=r"names_filter.*matches none of the"):
        pyhook.run_with_cache(model, ids(), names_filter=lambda n: n.startswith("resid_psot"))
    with pytest.raises(ValueError, match=r"metric=.*incl_bwd=True"):
        pyhook.run_with_cache(model, ids(), labels=ids(), metric=metric)
    with pytest.raises(LookupError, match=r"fwd_hooks.*matches none of the"):
        pyhook.run_with_hooks(model, ids(), fwd_hooks=[(lambda n: False, lambda t, h: t * 0)])
    assert diff(before, hook_snapshot(model)) == []
    _, cache = pyhook.run_with_cache(
        model,
        ids(),
        labels=ids(),
        metric=metric,
        incl_bwd=True,
        names_filter=lambda n: n == "resid_post.0",
    )
    assert sorted(cache) == ["resid_post.0", "resid_post.0_grad"]
    model.zero_grad()


def _gpt2_3():
    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(n_embd=H, n_layer=3, n_head=2, vocab_size=64))
    return randomise_norms(model).eval()


def _tl_norm(module, x, scale_times=1.0, normalized_times=1.0):
    """TransformerLens' norm with hook_scale then hook_normalized edits, written from its
    LayerNorm / RMSNorm: scale = sqrt(mean(centred^2) + eps), normalized = centred / scale,
    then the affine. Returns (output, scale, normalized), the last two in the graph."""
    rms = not isinstance(module, torch.nn.LayerNorm)
    centred = x if rms else x - x.mean(-1, keepdim=True)
    eps = module.variance_epsilon if rms else module.eps
    scale = (centred.pow(2).mean(-1, keepdim=True) + eps).sqrt() * scale_times
    normalized = centred / scale * normalized_times
    out = normalized * module.weight
    if getattr(module, "bias", None) is not None:
        out = out + module.bias
    return out, scale, normalized


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("scale_first", [True, False])
def test_two_edits_on_one_norm_compose_as_transformer_lens(arch, scale_first):
    """hook_scale x2 and hook_normalized x1.5 on one norm give centred / (2 scale) * 1.5, then the
    affine, in either order (each edit used to replace the norm's output alone)."""
    model = build(arch)
    ln = model.transformer.h[1].ln_1 if arch == "gpt2" else model.model.layers[1].input_layernorm
    h = ln.register_forward_hook(lambda m, a, o: _tl_norm(m, a[0], 2.0, 1.5)[0])
    try:
        with torch.no_grad():
            want = model(ids()).logits
    finally:
        h.remove()
    edits = [
        ("blocks.1.ln1.hook_scale", lambda t, hook: t * 2),
        ("blocks.1.ln1.hook_normalized", lambda t, hook: t * 1.5),
    ]
    if not scale_first:
        edits.reverse()
    with torch.no_grad():
        got = pyhook.run_with_hooks(model, ids(), fwd_hooks=edits).logits
        plain = model(ids()).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, plain, atol=1e-3)


def _plain_grads(model, freeze=None):
    """Gradients of the loss at ln_1's scale of block 1, ln_f's output (``final``) and block 0's
    input, by torch.autograd.grad on tensors captured by hand-written hooks (block 0's input made
    a leaf when nothing upstream requires grad)."""
    held = {}

    def scale_hook(m, args, out):
        new, held["scale"], _ = _tl_norm(m, args[0])
        return new

    def final_hook(m, args, out):
        held["final"] = out
        return None

    def pre0(m, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        if not x.requires_grad:
            x = x.detach().requires_grad_()
        held["resid_pre"] = x
        return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

    tr = model.transformer
    hs = [
        tr.h[1].ln_1.register_forward_hook(scale_hook),
        tr.ln_f.register_forward_hook(final_hook),
        tr.h[0].register_forward_pre_hook(pre0, with_kwargs=True),
    ]
    try:
        loss = model(ids(), labels=ids()).loss
    finally:
        for h in hs:
            h.remove()
    names = ["scale", "final", "resid_pre"]
    return dict(zip(names, torch.autograd.grad(loss, [held[n] for n in names])))


@pytest.mark.parametrize("frozen", ["none", "embeddings", "all"])
def test_every_name_asked_gets_its_gradient_equal_to_plain_autograd(frozen):
    """names_filter=lambda n: True on a 3-block GPT-2: every name gets a gradient (hook_scale
    and final used to be missing), with frozen embeddings (resid_pre.0 used to be missing) and a
    fully frozen model (torch's bare autograd error); values equal plain autograd's."""
    model = _gpt2_3()
    if frozen == "embeddings":
        model.transformer.wte.requires_grad_(False)
        model.transformer.wpe.requires_grad_(False)
    elif frozen == "all":
        model.requires_grad_(False)
    want = _plain_grads(model)
    model.zero_grad()
    _, cache = pyhook.run_with_cache(
        model, ids(), labels=ids(), incl_bwd=True, names_filter=lambda n: True
    )
    model.zero_grad()
    values = [n for n in cache if not n.endswith("_grad")]
    assert len(values) > 60
    assert [n for n in values if n + "_grad" not in cache] == []
    for name, key in (
        ("blocks.1.ln1.hook_scale", "scale"),
        ("final", "final"),
        ("resid_pre.0", "resid_pre"),
        ("blocks.0.hook_resid_pre", "resid_pre"),
    ):
        assert want[key].abs().max() > 0
        torch.testing.assert_close(cache[name + "_grad"], want[key], rtol=1e-4, atol=1e-6)
    if frozen == "all":
        assert all(p.grad is None for p in model.parameters())
        _, trained = pyhook.run_with_cache(
            _gpt2_3(), ids(), labels=ids(), incl_bwd=True, names_filter=lambda n: True
        )
        for n in values:  # a point's gradient does not depend on which parameters are frozen
            torch.testing.assert_close(
                cache[n + "_grad"], trained[n + "_grad"], rtol=1e-4, atol=1e-6
            )


def test_a_metric_that_cannot_be_differentiated_is_refused_by_name():
    model = build("gpt2")
    with torch.no_grad(), pytest.raises(ValueError, match=r"output.loss does not require grad"):
        pyhook.run_with_cache(
            model, ids(), labels=ids(), incl_bwd=True, names_filter="resid_post.0"
        )
    with pytest.raises(ValueError, match=r"metric\(output\) does not require grad"):
        pyhook.run_with_cache(
            model, ids(), incl_bwd=True, names_filter="resid_post.0",
            metric=lambda out: out.logits.sum().detach(),
        )  # fmt: skip


def _checkpointed_pair(reentrant):
    """The same GPT-2 (no dropout) twice, in train mode: one with transformers' activation
    checkpointing, one without."""

    torch.manual_seed(0)
    cfg = T.GPT2Config(
        n_embd=H, n_layer=3, n_head=2, vocab_size=64, attn_pdrop=0, resid_pdrop=0, embd_pdrop=0
    )
    return checkpointed_copy(randomise_norms(T.GPT2LMHeadModel(cfg)), reentrant)


def _param_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize(
    "point", ["mlp_hidden.1", "attn_z.1", "resid_mid.1", "blocks.1.ln1.hook_scale"]
)
def test_edits_in_checkpointed_layers_keep_the_gradients_or_are_refused(reentrant, point):
    """With gradient checkpointing, an edit's recomputation must carry the edit: a backward in
    the block gives the parameter gradients of the same model without checkpointing under the
    same edit; a backward after the block (the recomputation would run without the edit: same
    loss, other gradients) is refused by name when the block ends."""
    ckpt, plain = _checkpointed_pair(reentrant)
    x = ids()
    edit = [(point, lambda t, hook: t * 2)]
    with pyhook.hooks(plain, fwd_hooks=edit):
        plain(x, labels=x).loss.backward()
    want = _param_grads(plain)
    with pyhook.hooks(ckpt, fwd_hooks=edit):
        ckpt(x, labels=x).loss.backward()
    got = _param_grads(ckpt)
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6)
    ckpt.zero_grad()
    pyhook.run_with_hooks(
        ckpt, x, labels=x, fwd_hooks=edit, bwd_hooks=[("resid_post.0", lambda g, h: None)]
    )
    got_hooks = _param_grads(ckpt)
    for n in want:
        torch.testing.assert_close(got_hooks[n], want[n], rtol=1e-5, atol=1e-6)
    ckpt.zero_grad()
    before = hook_snapshot(ckpt)
    with pytest.raises(RuntimeError, match=rf"edited '{point}' inside an activation-checkpointed"):
        pyhook.run_with_hooks(ckpt, x, labels=x, fwd_hooks=edit)
    with pytest.raises(RuntimeError, match="no backward ran before the hooks were removed"):
        with pyhook.hooks(ckpt, fwd_hooks=edit):
            ckpt(x, labels=x)
    assert diff(before, hook_snapshot(ckpt)) == []
    # outside the checkpointed layers, or with no backward to come, nothing is refused
    pyhook.run_with_hooks(ckpt, x, labels=x, fwd_hooks=[("final", lambda t, hook: t * 2)])
    with torch.no_grad():
        pyhook.run_with_hooks(ckpt, x, labels=x, fwd_hooks=edit)
    pyhook.run_with_hooks(ckpt.eval(), x, labels=x, fwd_hooks=edit)
