"""pyhook.splice against plain torch hooks and autograd, on GPT-2, Llama and Qwen3 built from
configs (float64, norm weights far from 1): identities, replacement, edits, transcoders, a CLT,
gradients through features, many dictionaries at once, and bad input."""

from __future__ import annotations

import pytest
import torch
from _dicts import CLT, SAELensSAE, SparsifyCoder
from _models import all_hooks, randomise_norms

import pyhook
from pyhook.dictionaries import DictionaryError, as_dictionary, dense_features

T = pytest.importorskip("transformers")


def _model(family: str):
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = T.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=64)
        m = T.GPT2LMHeadModel(cfg)
    elif family == "llama":
        cfg = T.LlamaConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=64,
        )
        m = T.LlamaForCausalLM(cfg)
    else:
        cfg = T.Qwen3Config(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            vocab_size=64,
        )
        m = T.Qwen3ForCausalLM(cfg)
    return randomise_norms(m.double().eval())


def _blocks(model):
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def _mlp(model, i):
    return _blocks(model)[i].mlp


FAMILIES = ["gpt2", "llama", "qwen3"]
IDS = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))


def _dicts(d=16):
    torch.manual_seed(2)
    return {
        "resid_post.0": SAELensSAE(d, 40, arch="jumprelu").double(),
        ("mlp_in.1", "mlp_out.1"): SAELensSAE(d, 40, apply_b_dec=False).double(),
        "attn_out.1": SparsifyCoder(d, 40, 6).double(),
    }


class _Plain:
    """The same sites with plain torch hooks: block outputs, MLP inputs and outputs,
    attention outputs (per family), each replaced by ``fn(key, x, y)``."""

    def __init__(self, model, fn):
        self.model, self.fn, self.handles, self.inputs = model, fn, [], {}

    def __enter__(self):
        m = self.model
        blocks = _blocks(m)

        def block_out(_mod, _args, out):
            y = out[0] if isinstance(out, tuple) else out
            new = self.fn("resid_post.0", y, y)
            return (new, *out[1:]) if isinstance(out, tuple) else new

        def mlp_in(_mod, args):
            self.inputs["mlp_in.1"] = args[0]

        def mlp_out(_mod, _args, out):
            return self.fn(("mlp_in.1", "mlp_out.1"), self.inputs["mlp_in.1"], out)

        attn = blocks[1].attn if hasattr(blocks[1], "attn") else blocks[1].self_attn

        def attn_out(_mod, _args, out):
            y = out[0]
            return (self.fn("attn_out.1", y, y), *out[1:])

        self.handles = [
            blocks[0].register_forward_hook(block_out),
            _mlp(m, 1).register_forward_pre_hook(mlp_in),
            _mlp(m, 1).register_forward_hook(mlp_out),
            attn.register_forward_hook(attn_out),
        ]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("family", FAMILIES)
def test_error_term_keeps_output_bitwise_and_encodes_once(family):
    model = _model(family)
    dicts = _dicts()
    calls = {k: 0 for k in dicts}
    for k, d in dicts.items():
        enc = d.encode

        def counted(x, _k=k, _enc=enc):
            calls[_k] += 1
            return _enc(x)

        d.encode = counted
    with torch.no_grad():
        ref = model(IDS).logits
        with pyhook.splice(model, dicts) as sp:
            out = model(IDS).logits
    # bitwise: without an edit and without autograd the sites are handed back untouched
    assert torch.equal(out, ref)
    assert calls == {k: 1 for k in dicts}  # one encode per dictionary per forward
    assert all_hooks(model) == 0
    # the features are the dictionaries' own encodings of the plain sites
    seen = {}
    with torch.no_grad(), _Plain(model, lambda k, x, y: seen.setdefault(k, x)):
        model(IDS)
    for k, d in dicts.items():
        want = dense_features(as_dictionary(d).encode(seen[k]))
        assert torch.equal(dense_features(sp.features[k]), want)


@pytest.mark.parametrize("family", FAMILIES)
def test_replacement_equals_a_hand_written_hook(family):
    model = _model(family)
    dicts = _dicts()
    adapted = {k: as_dictionary(d) for k, d in dicts.items()}
    with torch.no_grad():
        with _Plain(model, lambda k, x, y: adapted[k].decode(adapted[k].encode(x))):
            ref = model(IDS).logits
        with pyhook.splice(model, dicts, error=False):
            out = model(IDS).logits
        plain = model(IDS).logits
    assert torch.equal(out, ref)
    assert not torch.allclose(out, plain)  # the reconstructions do change the model


def _scale_feature(f):
    if isinstance(f, pyhook.SparseFeatures):
        return f._replace(values=f.values * 3)
    f = f.clone()
    f[..., :5] = f[..., :5] * 4 + 0.5
    return f


@pytest.mark.parametrize("family", FAMILIES)
def test_edit_moves_the_site_by_the_decoded_change(family):
    model = _model(family)
    dicts = _dicts()
    adapted = {k: as_dictionary(d) for k, d in dicts.items()}

    def by_hand(k, x, y):
        d = adapted[k]
        f = d.encode(x)
        return y + (d.decode(_scale_feature(f)) - d.decode(f))

    edits = {k: _scale_feature for k in dicts}
    with torch.no_grad():
        with _Plain(model, by_hand):
            ref = model(IDS).logits
        with pyhook.splice(model, dicts, edit=edits):
            out = model(IDS).logits
        plain = model(IDS).logits
        # error=False with an edit: the site is decode(edited)
        with _Plain(model, lambda k, x, y: adapted[k].decode(_scale_feature(adapted[k].encode(x)))):
            ref_replaced = model(IDS).logits
        with pyhook.splice(model, dicts, edit=edits, error=False):
            replaced = model(IDS).logits
    assert torch.equal(out, ref)
    assert not torch.allclose(out, plain)
    assert torch.equal(replaced, ref_replaced)


@pytest.mark.parametrize("family", ["gpt2", "qwen3"])
def test_gradients_unchanged_and_features_get_the_site_gradient(family):
    model = _model(family)
    dicts = _dicts()
    params = [p for p in model.parameters()]
    # plain: the model's gradients, and the gradients at each output site
    site_grads = {}

    def keep(k, x, y):
        y.register_hook(lambda g, _k=k: site_grads.__setitem__(_k, g))
        return y

    with _Plain(model, keep):
        loss = model(IDS, labels=IDS).loss
    ref = torch.autograd.grad(loss, params)
    with pyhook.splice(model, dicts) as sp:
        loss2 = model(IDS, labels=IDS).loss
        feats = {k: sp.features[k] for k in dicts}
        leaves = [f.values if isinstance(f, pyhook.SparseFeatures) else f for f in feats.values()]
        got = torch.autograd.grad(loss2, params + leaves)
    assert torch.equal(loss2, loss)
    for a, b in zip(got[: len(params)], ref):
        assert torch.equal(a, b)  # every model gradient bitwise the plain one
    for (k, d), g in zip(dicts.items(), got[len(params) :]):
        W = d.W_dec
        want = site_grads[k] @ W.T  # d loss / d f = g_site @ W_dec^T
        f = feats[k]
        if isinstance(f, pyhook.SparseFeatures):
            want = want.gather(-1, f.indices)
        torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-12)


def test_backward_hooks_through_a_splice_see_the_plain_gradients():
    model = _model("llama")
    grads, ref = {}, {}
    bwd = [("resid_pre.1", lambda g, hook: grads.setdefault("r", g))]
    with pyhook.hooks(model, bwd_hooks=[("resid_pre.1", lambda g, hook: ref.setdefault("r", g))]):
        model(IDS, labels=IDS).loss.backward()
    with pyhook.splice(model, _dicts()), pyhook.hooks(model, bwd_hooks=bwd):
        model(IDS, labels=IDS).loss.backward()
    assert torch.equal(grads["r"], ref["r"])


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_clt_writes_every_output(family):
    model = _model(family)
    torch.manual_seed(3)
    clt = CLT(16, 30, 16, 2).double()
    key = ("mlp_in.0", ("mlp_out.0", "mlp_out.1"))
    store = {}

    def hooks(fn):
        def pre(_m, args):
            store["x"] = args[0]

        def out0(_m, _a, y):
            return fn(0, y)

        def out1(_m, _a, y):
            return fn(1, y)

        return [
            _mlp(model, 0).register_forward_pre_hook(pre),
            _mlp(model, 0).register_forward_hook(out0),
            _mlp(model, 1).register_forward_hook(out1),
        ]

    def edit(f):
        return f * 2

    with torch.no_grad():
        hs = hooks(lambda j, y: clt.decode(clt.encode(store["x"]))[j])
        ref = model(IDS).logits
        for h in hs:
            h.remove()
        with pyhook.splice(model, {key: clt}, error=False) as sp:
            out = model(IDS).logits
        assert torch.equal(out, ref)
        assert torch.equal(sp.features[key], clt.encode(store["x"]))

        def moved(j, y):
            f = clt.encode(store["x"])
            return y + (clt.decode(edit(f))[j] - clt.decode(f)[j])

        hs = hooks(moved)
        ref_edit = model(IDS).logits
        for h in hs:
            h.remove()
        with pyhook.splice(model, {key: clt}, edit={key: edit}):
            out_edit = model(IDS).logits
    assert torch.equal(out_edit, ref_edit)


def test_moe_points_are_spliced_as_any_point():
    cfg = T.MixtralConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    model = randomise_norms(T.MixtralForCausalLM(cfg).eval())  # float32: grouped_mm
    torch.manual_seed(2)
    sae = SAELensSAE(16, 40)
    store = {}

    def pre(_m, args):
        store["x"] = args[0]

    mlp = model.model.layers[1].mlp
    with torch.no_grad():
        hs = [
            mlp.register_forward_pre_hook(pre),
            mlp.register_forward_hook(
                lambda _m, _a, y: (
                    (sae.decode(sae.encode(store["x"])), *y[1:])
                    if isinstance(y, tuple)
                    else sae.decode(sae.encode(store["x"]))
                )
            ),
        ]
        ref = model(IDS).logits
        for h in hs:
            h.remove()
        with pyhook.splice(model, {("mlp_in.1", "mlp_out.1"): sae}, error=False):
            out = model(IDS).logits
    assert torch.equal(out, ref)


def test_dictionary_on_another_dtype_and_many_forwards():
    model = _model("gpt2")
    sae = SAELensSAE(16, 40).float()  # float32 dictionary on a float64 model
    with torch.no_grad(), pyhook.splice(model, {"resid_post.0": sae}, error=False) as sp:
        a = model(IDS).logits
        b = model(IDS[:1]).logits
    assert sp.features["resid_post.0"].shape == (1, 6, 40)  # the last forward's
    assert sp.features["resid_post.0"].dtype == torch.float32
    torch.testing.assert_close(a[:1], b)


def test_bad_input_is_refused_by_name_and_leaves_no_hooks():
    model = _model("gpt2")
    sae = SAELensSAE(16, 40).double()
    with pytest.raises(pyhook.LayerNotFoundError, match=r"resid_post\.9"):
        pyhook.splice(model, {"resid_post.9": sae})
    with pytest.raises(DictionaryError, match="edit names"):
        pyhook.splice(model, {"resid_post.0": sae}, edit={"resid_post.1": lambda f: f})
    with pytest.raises(DictionaryError, match="several dictionaries replace"):
        pyhook.splice(model, {"mlp_out.1": sae, ("mlp_in.1", "mlp_out.1"): sae}, error=False)
    with pytest.raises(DictionaryError, match="not a dictionary"):
        pyhook.splice(model, {"resid_post.0": torch.nn.Linear(16, 16)})
    with pytest.raises(DictionaryError, match="dictionary key"):
        pyhook.splice(model, {3: sae})
    wrong = SAELensSAE(8, 40).double()
    with (
        pytest.raises(DictionaryError, match=r"'resid_post.0'.*shape \(2, 6, 16\)"),
        pyhook.splice(model, {"resid_post.0": wrong}),
    ):
        model(IDS)
    assert all_hooks(model) == 0


def test_attention_sae_at_a_per_head_point_reads_heads_flattened():
    model = _model("llama")
    torch.manual_seed(4)
    sae = SAELensSAE(16, 40).double()  # trained on attn_z as [..., heads * d_head], as SAELens'
    o_proj = model.model.layers[1].self_attn.o_proj

    def replace(_m, args):
        return (sae.decode(sae.encode(args[0])),)

    with torch.no_grad():
        h = o_proj.register_forward_pre_hook(replace)
        ref = model(IDS).logits
        h.remove()
        with pyhook.splice(model, {"attn_z.1": sae}, error=False) as sp:
            out = model(IDS).logits
        plain = model(IDS).logits
    assert torch.equal(out, ref) and not torch.allclose(out, plain)
    assert sp.features["attn_z.1"].shape == (2, 6, 40)


def test_an_edit_that_raises_leaves_no_hook():
    model = _model("gpt2")
    sae = SAELensSAE(16, 40).double()

    def broken(f):
        raise ValueError("edit failed")

    with torch.no_grad():
        ref = model(IDS).logits
        with (
            pytest.raises(ValueError, match="edit failed"),
            pyhook.splice(model, {"resid_post.0": sae}, edit={"resid_post.0": broken}),
        ):
            model(IDS)
        assert all_hooks(model) == 0
        assert torch.equal(model(IDS).logits, ref)


def test_a_dictionary_on_the_meta_device_is_refused_by_name_before_any_forward():
    """A dictionary made without data (``device="meta"``, accelerate's init_empty_weights) is
    refused when the splice is made, naming its key, its class and the device; before, the
    forward failed inside the hook copying it to the site's device ("Cannot copy out of meta
    tensor")."""
    model = _model("gpt2")
    with torch.device("meta"):
        empty = SAELensSAE(16, 40).double()
    forwards = []
    h = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        for make in (
            lambda: pyhook.splice(model, {"resid_post.0": empty}),
            lambda: pyhook.splice(model, {("mlp_in.1", "mlp_out.1"): empty}, error=False),
            lambda: pyhook.evaluate_dictionaries(model, {"resid_post.0": empty}, [IDS]),
        ):
            with pytest.raises(DictionaryError, match=r"'resid_post\.0'|'mlp_in\.1'") as e:
                make()
            assert "(SAELensSAE) has tensors on the meta device" in str(e.value)
    finally:
        h.remove()
    assert forwards == []  # refused before any forward
    assert all_hooks(model) == 0
