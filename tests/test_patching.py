"""pyhook.patching against references written with plain PyTorch hooks and torch.autograd.grad.

The references hook the models' own modules by their Hugging Face paths (not through pyhook's
points), patch one (position, head) per forward, and differentiate with autograd.grad. Models
run in float64, so batched and looped patching agree to 1e-9, and norms get random weights and
biases (gamma=1, beta=0 would hide a wrong tensor).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

T = pytest.importorskip("transformers")

from _models import offloaded_llama  # noqa: E402

import pyhook  # noqa: E402
from pyhook.patching import (  # noqa: E402
    DropoutActiveError,
    EdgeResult,
    PatchResult,
    activation_patch,
    attribution_patch,
    edge_attribution,
)

TOL = dict(rtol=1e-9, atol=1e-9)


def _randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name or "ln" in name or "LayerNorm" in name):
                p.copy_(
                    1 + 0.3 * torch.randn(p.shape, generator=g)
                    if name.endswith("weight")
                    else 0.2 * torch.randn(p.shape, generator=g)
                )
    return model.eval().double()


def gpt2(layers: int = 2, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    cfg = T.GPT2Config(
        n_embd=16,
        n_layer=layers,
        n_head=2,
        vocab_size=32,
        n_positions=16,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=0,
        eos_token_id=0,
    )
    return _randomize(T.GPT2LMHeadModel(cfg))


def llama(layers: int = 2) -> nn.Module:
    torch.manual_seed(1)
    cfg = T.LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
    )
    return _randomize(T.LlamaForCausalLM(cfg))


def bert(layers: int = 2) -> nn.Module:
    torch.manual_seed(2)
    cfg = T.BertConfig(
        hidden_size=16,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=32,
        vocab_size=32,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return _randomize(T.BertModel(cfg))


# Hand-written module paths per architecture: (block, attention output, o_proj, mlp)
PATHS = {
    "gpt2": (
        "transformer.h.{}",
        "transformer.h.{}.attn",
        "transformer.h.{}.attn.c_proj",
        "transformer.h.{}.mlp",
    ),
    "llama": (
        "model.layers.{}",
        "model.layers.{}.self_attn",
        "model.layers.{}.self_attn.o_proj",
        "model.layers.{}.mlp",
    ),
    "bert": (
        "encoder.layer.{}",
        "encoder.layer.{}.attention.output.dropout",  # dense -> dropout, before the LayerNorm
        "encoder.layer.{}.attention.output.dense",
        "encoder.layer.{}.output.dropout",
    ),
}
KIND = {"resid_pre": 0, "resid_post": 0, "attn_out": 1, "attn_z": 2, "mlp_out": 3}


def _arch(model: nn.Module) -> str:
    return model.config.model_type


def _metric_for(model: nn.Module):
    if _arch(model) == "bert":
        w = torch.linspace(-1, 1, 16, dtype=torch.float64)
        return lambda out: out.last_hidden_state[:, 0] @ w  # one value per example
    return lambda out: out.logits[:, -1, 5] - out.logits[:, -1, 7]


def _ref_hook(model: nn.Module, point: str, fn):
    """Register fn(tensor) -> tensor|None on the tensor of ``point`` with plain torch hooks."""
    kind, layer = point.split(".")
    path = PATHS[_arch(model)][KIND[kind]].format(layer)
    mod = model.get_submodule(path)
    if kind in ("resid_pre", "attn_z"):

        def pre(_m, args, kwargs):
            if args:
                new = fn(args[0])
                return None if new is None else ((new, *args[1:]), kwargs)
            new = fn(kwargs["hidden_states"])
            return None if new is None else (args, {**kwargs, "hidden_states": new})

        return mod.register_forward_pre_hook(pre, with_kwargs=True)

    def post(_m, _args, out):
        t = out[0] if isinstance(out, tuple) else out
        new = fn(t)
        if new is None:
            return None
        return (new, *out[1:]) if isinstance(out, tuple) else new

    return mod.register_forward_hook(post)


def _ref_record(model, ids, points):
    acts = {}
    handles = [
        _ref_hook(model, p, lambda t, p=p: acts.__setitem__(p, t.detach().clone())) for p in points
    ]
    try:
        with torch.no_grad():
            out = model(ids)
    finally:
        for h in handles:
            h.remove()
    return out, acts


def _heads(model):
    return model.config.num_attention_heads if _arch(model) != "gpt2" else model.config.n_head


def _ref_activation_patch(model, clean, corrupt, metric, points, noising=False):
    base, src = (clean, corrupt) if noising else (corrupt, clean)
    _, src_acts = _ref_record(model, src, points)
    with torch.no_grad():
        base_m = float(metric(model(base)).sum())
    H = _heads(model)
    out = {}
    for p in points:
        a = src_acts[p]
        S = a.shape[1]
        per_head = p.startswith("attn_z")
        res = torch.zeros((S, H) if per_head else (S,), dtype=torch.float64)
        for s in range(S):
            for h in range(H) if per_head else [None]:

                def patch(t, s=s, h=h, a=a):
                    t = t.clone()
                    if h is None:
                        t[:, s] = a[:, s]
                    else:
                        dh = t.shape[-1] // H
                        t[:, s, h * dh : (h + 1) * dh] = a[:, s, h * dh : (h + 1) * dh]
                    return t

                handle = _ref_hook(model, p, patch)
                try:
                    with torch.no_grad():
                        v = float(metric(model(base)).sum())
                finally:
                    handle.remove()
                if h is None:
                    res[s] = v - base_m
                else:
                    res[s, h] = v - base_m
        out[p] = res
    return out


def _ref_grads(model, ids, points, metric, block_grad=None):
    """Gradients of metric(model(ids)).sum() at each point; block_grad: a layer whose attention
    and MLP outputs pass no gradient (GradDrop)."""
    kept = {}

    def keep(p):
        def fn(t):
            t = t.clone()
            kept[p] = t
            return t

        return fn

    handles = [_ref_hook(model, p, keep(p)) for p in points]
    if block_grad is not None:
        for kind in ("attn_out", "mlp_out"):
            handles.append(_ref_hook(model, f"{kind}.{block_grad}", lambda t: t.detach()))
    try:
        with torch.enable_grad():
            value = metric(model(ids)).sum()
            grads = torch.autograd.grad(value, [kept[p] for p in points], allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    return {
        p: (g if g is not None else torch.zeros_like(kept[p])) for p, g in zip(points, grads)
    }, kept


def _ref_atp(model, clean, corrupt, metric, points, noising=False, block_grad=None, pairs=False):
    """AtP per point, summed over the batch ([pos] or [pos, head]); ``pairs``: one per prompt
    pair ([batch, pos(, head)])."""
    base, src = (clean, corrupt) if noising else (corrupt, clean)
    _, src_acts = _ref_record(model, src, points)
    grads, base_acts = _ref_grads(model, base, points, metric, block_grad)
    H = _heads(model)
    out = {}
    for p in points:
        prod = (src_acts[p] - base_acts[p].detach()) * grads[p]
        if p.startswith("attn_z"):
            out[p] = prod.unflatten(-1, (H, -1)).sum(dim=3)
        else:
            out[p] = prod.sum(dim=2)
        if not pairs:
            out[p] = out[p].sum(0)
    return out


def _pair(model, batch=2, seq=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(2, 30, (batch, seq), generator=g)
    corrupt = clean.clone()
    corrupt[:, 1] = torch.randint(2, 30, (batch,), generator=g)
    corrupt[:, 3] = torch.randint(2, 30, (batch,), generator=g)
    return clean, corrupt


MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert}
POINTS = ["resid_pre.0", "resid_pre.1", "attn_out.0", "attn_z.1", "mlp_out.1"]


@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize("noising", [False, True])
def test_activation_patch_equals_one_patch_per_forward(arch, noising):
    model = MODELS[arch]()
    clean, corrupt = _pair(model)
    metric = _metric_for(model)
    ref = _ref_activation_patch(model, clean, corrupt, metric, POINTS, noising)
    for batch_size in (1, 7):
        got = activation_patch(
            model, clean, corrupt, metric, POINTS, noising=noising, batch_size=batch_size
        )
        assert isinstance(got, PatchResult) and list(got) == POINTS
        for p in POINTS:
            assert got[p].shape == ref[p].shape, p
            torch.testing.assert_close(got[p], ref[p], **TOL)
    # the patches are not all zero (a test that cannot fail would pass on zeros)
    assert max(float(ref[p].abs().max()) for p in POINTS) > 1e-3


def test_activation_patch_scalar_metric_and_globs():
    """A metric that sums over the batch itself, globs, per_head=False and positions."""
    model = gpt2()
    clean, corrupt = _pair(model)
    per_example = _metric_for(model)
    ref = _ref_activation_patch(model, clean, corrupt, per_example, ["resid_pre.0", "resid_pre.1"])
    got = activation_patch(
        model, clean, corrupt, lambda o: per_example(o).sum(), "resid_pre.*", batch_size=4
    )
    for p in ref:
        torch.testing.assert_close(got[p], ref[p], **TOL)
    whole = activation_patch(
        model, clean, corrupt, per_example, ["attn_z.1"], per_head=False, positions=[1, -2]
    )
    ref_whole = _ref_activation_patch(
        model, clean, corrupt, per_example, ["attn_out.1"]
    )  # z whole == attn_out
    assert whole["attn_z.1"].shape == (5,)
    torch.testing.assert_close(whole["attn_z.1"][[1, 3]], ref_whole["attn_out.1"][[1, 3]], **TOL)
    assert float(whole["attn_z.1"][0]) == 0.0 and float(whole["attn_z.1"][2]) == 0.0


@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize("noising", [False, True])
def test_attribution_patch_equals_autograd_reference(arch, noising):
    model = MODELS[arch]()
    clean, corrupt = _pair(model)
    metric = _metric_for(model)
    ref = _ref_atp(model, clean, corrupt, metric, POINTS, noising)
    for opts in ({}, {"one_batch": True}, {"offload": True}):
        got = attribution_patch(model, clean, corrupt, metric, POINTS, noising=noising, **opts)
        for p in POINTS:
            assert got[p].shape == ref[p].shape, (p, opts)
            torch.testing.assert_close(got[p], ref[p], **TOL)
    assert max(float(ref[p].abs().max()) for p in POINTS) > 1e-3


def test_one_batch_slices_get_their_own_gradient():
    """Clean and corrupt in one forward: each example's row of the base half gets the gradient of
    its own metric, and the source half none (a mix-up of halves or rows changes the scores)."""
    model = llama()
    clean, corrupt = _pair(model, batch=3)
    metric = _metric_for(model)
    got = attribution_patch(
        model, clean, corrupt, metric, ["resid_pre.1", "attn_z.0"], one_batch=True
    )
    ref = _ref_atp(model, clean, corrupt, metric, ["resid_pre.1", "attn_z.0"])
    for p in ref:
        torch.testing.assert_close(got[p], ref[p], **TOL)
    # per example: a batch of one, summed, gives the same (no row sees another's gradient)
    summed = {
        p: sum(
            _ref_atp(model, clean[i : i + 1], corrupt[i : i + 1], metric, [p])[p] for i in range(3)
        )
        for p in ref
    }
    for p in ref:
        torch.testing.assert_close(got[p], summed[p], **TOL)


@pytest.mark.parametrize("opts", [{}, {"one_batch": True}, {"offload": True}])
def test_atp_star_graddrop_is_the_papers(opts):
    """GradDrop as Kramár et al. (2024), section 3.1.2, write it: for each prompt pair x and
    each layer l, AtP_l(n; x) is AtP with the gradient through layer l's residual-stream
    contribution (its attention and MLP outputs) set to zero; the score of a node is
    1/(L-1) sum_l |AtP_l(n; x)|, the absolute value taken per pair, unsigned. The paper's nodes
    sit inside a block, whose own drop cuts them (L - 1 terms survive); a residual-stream
    point survives all L drops and is divided by L. Summed over the pairs (as every score)."""
    model = gpt2(layers=3)
    L = 3
    clean, corrupt = _pair(model, batch=3)
    metric = _metric_for(model)
    inside = ["attn_z.1", "attn_out.0", "mlp_out.1"]
    residual = ["resid_pre.0", "resid_pre.2", "resid_post.2"]
    points = inside + residual
    per_pair = [
        _ref_atp(model, clean, corrupt, metric, points, block_grad=layer, pairs=True)
        for layer in range(L)
    ]
    atp = _ref_atp(model, clean, corrupt, metric, points)
    got = attribution_patch(model, clean, corrupt, metric, points, method="atp*", **opts)
    assert got.method == "atp*"
    want = {}
    for p in points:
        terms = L - 1 if p in inside else L
        want[p] = (sum(d[p].abs() for d in per_pair) / terms).sum(0)
        torch.testing.assert_close(got[p], want[p], **TOL)
        assert float(want[p].abs().max()) > 1e-5
    signed = attribution_patch(
        model, clean, corrupt, metric, points, method="atp*", signed=True, **opts
    )
    for p in points:
        torch.testing.assert_close(signed[p], torch.sign(atp[p]) * want[p], **TOL)
    # per pair, not after summing the batch: the pairs' signs differ here
    summed_first = sum(d["attn_z.1"].sum(0).abs() for d in per_pair) / (L - 1)
    assert not torch.allclose(got["attn_z.1"], summed_first)


def test_atp_star_scale_of_the_last_residual():
    """The last residual is never cut by a drop: its score is the plain per-pair |AtP|, not
    L/(L-1) of it."""
    model = gpt2(layers=3)
    clean, corrupt = _pair(model, batch=2)
    metric = _metric_for(model)
    got = attribution_patch(model, clean, corrupt, metric, "resid_post.2", method="atp*")
    pairs = _ref_atp(model, clean, corrupt, metric, ["resid_post.2"], pairs=True)["resid_post.2"]
    torch.testing.assert_close(got["resid_post.2"], pairs.abs().sum(0), **TOL)


def _ref_edges(model, clean, corrupt, metric, steps=1, convention="attribution patching"):
    """Edge scores from a convention's own definition, summed over the pairs:

    * "attribution patching" (Syed et al. 2023, the denoising convention of Nanda's AtP):
      (clean - corrupt upstream output) . d metric / d (downstream input) in the corrupt run;
      EAP-IG: the corrupt run's input embedding moved to corrupt + k/N (clean - corrupt),
      k = 0..N-1, the gradients averaged;
    * "hannamw 2024" (hannamw/EAP-IG, eap/attribute.py): (corrupted - clean) . gradient in the
      clean run; EAP-IG's input corrupted + k/N (clean - corrupted) for k = 1..N; the gradient of
      an attention's q, k and v inputs of every head summed (their sum is the residual read);
    * "hannamw 2025": the same with k = 0..N-1.
    """
    arch = _arch(model)
    n = model.config.num_hidden_layers
    H = _heads(model)
    if arch == "gpt2":
        reads = [f"transformer.h.{i}.ln_{k}" for i in range(n) for k in (1, 2)] + [
            "transformer.ln_f"
        ]
        o_w = lambda i: model.transformer.h[i].attn.c_proj.weight  # noqa: E731  [in, out]
    else:
        reads = [
            f"model.layers.{i}.{k}"
            for i in range(n)
            for k in ("input_layernorm", "post_attention_layernorm")
        ] + ["model.norm"]
        o_w = lambda i: model.model.layers[i].self_attn.o_proj.weight.T  # noqa: E731
    points = (
        ["resid_pre.0"] + [f"attn_z.{i}" for i in range(n)] + [f"mlp_out.{i}" for i in range(n)]
    )
    _, ca = _ref_record(model, clean, points)
    _, ra = _ref_record(model, corrupt, points)
    if convention == "attribution patching":
        run, ks = corrupt, range(steps)
        ups_of = lambda p: ca[p] - ra[p]  # noqa: E731
    else:
        run = clean
        ks = range(1, steps + 1) if convention == "hannamw 2024" else range(steps)
        ups_of = lambda p: ra[p] - ca[p]  # noqa: E731
    ups = [ups_of("resid_pre.0")]
    names = ["embed"]
    for i in range(n):
        dz = ups_of(f"attn_z.{i}")
        dh = dz.shape[-1] // H
        for h in range(H):
            ups.append(dz[..., h * dh : (h + 1) * dh] @ o_w(i)[h * dh : (h + 1) * dh])
            names.append(f"attn.{i}.h{h}")
        ups.append(ups_of(f"mlp_out.{i}"))
        names.append(f"mlp.{i}")
    grads = {r: 0 for r in reads}
    for k in ks:
        kept = {}
        handles = []
        for r in reads:

            def pre(_m, args, kwargs, r=r, kept=kept):
                x = (args[0] if args else kwargs["hidden_states"]).clone()
                kept[r] = x
                return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

            handles.append(model.get_submodule(r).register_forward_pre_hook(pre, with_kwargs=True))
        alpha = k / steps  # the input embedding: corrupt + k/N (clean - corrupt)
        handles.append(
            _ref_hook(
                model,
                "resid_pre.0",
                lambda t, a=alpha: (
                    ra["resid_pre.0"] + a * (ca["resid_pre.0"] - ra["resid_pre.0"])
                ).requires_grad_(),
            )
        )
        try:
            value = metric(model(run)).sum()
            gs = torch.autograd.grad(value, [kept[r] for r in reads])
        finally:
            for h in handles:
                h.remove()
        for r, g in zip(reads, gs):
            grads[r] = grads[r] + g / steps
    downs = [f"{k}.{i}" for i in range(n) for k in ("attn", "mlp")] + ["logits"]
    scores = {}
    for u, d in zip(names, ups):
        for name, r in zip(downs, reads):
            scores[(u, name)] = float((d * grads[r]).sum().detach())
    return scores


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("steps", [1, 3])
def test_edge_attribution_equals_reference(arch, steps):
    model = MODELS[arch]()
    clean, corrupt = _pair(model)
    metric = _metric_for(model)
    got = edge_attribution(model, clean, corrupt, metric, steps=steps)
    assert isinstance(got, EdgeResult) and got.method == ("eap" if steps == 1 else "eap-ig")
    ref = _ref_edges(model, clean, corrupt, metric, steps)
    checked = 0
    for e in got.edges():
        assert e.score == pytest.approx(ref[(e.upstream, e.downstream)], rel=1e-7, abs=1e-9), e
        checked += 1
    n, H = 2, _heads(model)
    # edges: embed -> 2n+1, heads of block l -> the rest, mlps -> later ones
    assert checked == (2 * n + 1) + sum(H * (2 * (n - b) - 1 + 1) for b in range(n)) + sum(
        2 * (n - b - 1) + 1 for b in range(n)
    )
    assert got[("attn.1.h0", "attn.0")] == 0.0  # not an edge
    assert got.top(1)[0].score == max((e.score for e in got.edges()), key=abs)


@pytest.mark.parametrize("steps", [1, 3])
def test_edge_attribution_conventions(steps):
    """The default is attribution patching's denoising convention (clean - corrupt, gradient
    in the corrupt run); noising=True is hannamw/EAP-IG's EAP, and with steps its 2024 EAP-IG
    grid (k = 1..N from the corrupted input), not its 2025 one (k = 0..N-1). hannamw averages
    over the pairs where pyhook sums: the reference is divided by the batch size here."""
    model = gpt2()
    clean, corrupt = _pair(model, batch=3)
    metric = _metric_for(model)
    default = edge_attribution(model, clean, corrupt, metric, steps=steps)
    noising = edge_attribution(model, clean, corrupt, metric, steps=steps, noising=True)
    refs = {
        c: _ref_edges(model, clean, corrupt, metric, steps, c)
        for c in ("attribution patching", "hannamw 2024", "hannamw 2025")
    }
    for e in default.edges():
        want = refs["attribution patching"][(e.upstream, e.downstream)]
        assert e.score == pytest.approx(want, rel=1e-7, abs=1e-9), e
    for e in noising.edges():
        mean = refs["hannamw 2024"][(e.upstream, e.downstream)] / 3  # hannamw: / total_items
        assert e.score / 3 == pytest.approx(mean, rel=1e-7, abs=1e-9), e
    if steps > 1:  # not the 2025 grid
        assert any(
            e.score != pytest.approx(refs["hannamw 2025"][(e.upstream, e.downstream)], rel=1e-3)
            for e in noising.edges()
        )
    assert max(abs(e.score) for e in noising.edges()) > 1e-3


def test_edge_attribution_refuses_post_norm_models():
    model = bert()
    clean, corrupt = _pair(model)
    with pytest.raises(ValueError, match=r"resid_mid\.0 is not resid_pre\.0 \+ attn_out\.0"):
        edge_attribution(model, clean, corrupt, _metric_for(model))


def test_dropout_is_refused_by_name_and_nothing_stays_registered():
    model = gpt2(dropout=0.1).train()
    clean, corrupt = _pair(model)
    for fn in (activation_patch, attribution_patch):
        with pytest.raises(
            DropoutActiveError, match=r"'transformer\.drop' \(Dropout, p=0\.1\).*model\.eval\(\)"
        ):
            fn(model, clean, corrupt, _metric_for(model), "resid_pre.*")
    with pytest.raises(DropoutActiveError):
        edge_attribution(model, clean, corrupt, _metric_for(model))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    model.eval()  # the same model in eval mode runs
    activation_patch(model, clean, corrupt, _metric_for(model), "resid_pre.0")


@pytest.mark.parametrize("family", ["bloom", "falcon"])
def test_dropout_held_as_a_number_or_in_the_config_is_refused(family):
    """BLOOM keeps its residual dropout as a float (``hidden_dropout``), Falcon reads it from
    its config; both apply it with ``dropout_add``, no dropout module. In training mode two
    identical calls differ, so both are refused; with every probability 0, training mode runs."""
    torch.manual_seed(0)
    if family == "bloom":
        cfg = T.BloomConfig(
            hidden_size=16,
            n_layer=2,
            n_head=2,
            vocab_size=32,
            hidden_dropout=0.3,
            attention_dropout=0.0,
        )
        model = T.BloomForCausalLM(cfg).double()
        where = r"'transformer\.h\.0' \(BloomBlock, hidden_dropout=0\.3\)"
    else:
        cfg = T.FalconConfig(
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            vocab_size=32,
            hidden_dropout=0.3,
            attention_dropout=0.0,
        )
        model = T.FalconForCausalLM(cfg).double()
        # Falcon's forward reads config.hidden_dropout; its modules' copies are unused: without
        # them the dropout still runs, from the config alone
        for m in model.modules():
            vars(m).pop("hidden_dropout", None)
        where = r"'\(the model\)' \(FalconForCausalLM, config\.hidden_dropout=0\.3\)"
    clean, corrupt = _pair(model)
    metric = _metric_for(model)
    model.train()
    with torch.no_grad():  # the dropout runs: training-mode forwards differ
        assert not torch.equal(model(clean).logits, model(clean).logits)
    for fn in (activation_patch, attribution_patch):
        with pytest.raises(DropoutActiveError, match=where + r".*model\.eval\(\)"):
            fn(model, clean, corrupt, metric, "resid_pre.*")
    with pytest.raises(DropoutActiveError, match=where):
        edge_attribution(model, clean, corrupt, metric)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    model.eval()
    a = activation_patch(model, clean, corrupt, metric, "resid_pre.1")
    b = activation_patch(model, clean, corrupt, metric, "resid_pre.1")
    torch.testing.assert_close(a["resid_pre.1"], b["resid_pre.1"], rtol=0, atol=0)
    # training mode with every dropout probability 0: nothing drops, nothing refused
    model.config.hidden_dropout = 0.0
    for m in model.modules():
        if "hidden_dropout" in vars(m):
            m.hidden_dropout = 0.0
    with torch.no_grad():
        assert torch.equal(model.train()(clean).logits, model(clean).logits)
    model.train()
    c = activation_patch(model, clean, corrupt, metric, "resid_pre.1")
    torch.testing.assert_close(c["resid_pre.1"], a["resid_pre.1"], rtol=1e-12, atol=1e-12)


def test_gradient_functions_under_no_grad_and_metrics_without_a_graph():
    """Inside torch.no_grad() the gradient functions give the same scores as outside (the
    metric, too, is differentiated under enable_grad); inside inference_mode, and with a
    metric that returns a number or a tensor cut from the graph, a named error says why."""
    model = gpt2()
    clean, corrupt = _pair(model)
    metric = _metric_for(model)
    want_atp = attribution_patch(model, clean, corrupt, metric, "resid_pre.*", method="atp*")
    want_eap = edge_attribution(model, clean, corrupt, metric)
    with torch.no_grad():
        atp = attribution_patch(model, clean, corrupt, metric, "resid_pre.*", method="atp*")
        eap = edge_attribution(model, clean, corrupt, metric)
    for p in ("resid_pre.0", "resid_pre.1"):
        torch.testing.assert_close(atp[p], want_atp[p], rtol=0, atol=0)
    torch.testing.assert_close(eap.scores, want_eap.scores, rtol=0, atol=0)
    calls = (
        lambda m: attribution_patch(model, clean, corrupt, m, "resid_pre.*"),
        lambda m: attribution_patch(model, clean, corrupt, m, "resid_pre.*", one_batch=True),
        lambda m: edge_attribution(model, clean, corrupt, m),
    )
    for call in calls:
        with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
            call(metric)
        with pytest.raises(TypeError, match=r"must return a torch\.Tensor.*got float"):
            call(lambda o: metric(o).detach().sum().item())
        with pytest.raises(ValueError, match=r"cut from the model's graph.*detach"):
            call(lambda o: metric(o).detach())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_bad_input_is_named():
    model = gpt2()
    clean, corrupt = _pair(model)
    metric = _metric_for(model)
    with pytest.raises(ValueError, match="equal shapes"):
        activation_patch(model, clean, corrupt[:, :4], metric, "resid_pre.0")
    with pytest.raises(ValueError, match="not a standard point"):
        activation_patch(model, clean, corrupt, metric, "transformer.h.0")
    with pytest.raises(
        ValueError, match=r"metric\(output\) must return a scalar or one value per example"
    ):
        attribution_patch(model, clean, corrupt, lambda o: o.logits[:, -1], "resid_pre.0")
    with pytest.raises(ValueError, match="method must be 'atp' or 'atp\\*'"):
        attribution_patch(model, clean, corrupt, metric, "resid_pre.0", method="atp+")
    with pytest.raises(TypeError, match="corrupt must be an input_ids tensor or a dict"):
        activation_patch(model, clean, [1, 2], metric, "resid_pre.0")
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_dict_inputs_with_attention_mask():
    model = llama()
    clean, corrupt = _pair(model)
    mask = torch.ones_like(clean)
    metric = _metric_for(model)
    got = activation_patch(
        model,
        {"input_ids": clean, "attention_mask": mask},
        {"input_ids": corrupt, "attention_mask": mask},
        metric,
        ["resid_pre.1"],
        batch_size=3,
    )
    ref = _ref_activation_patch(model, clean, corrupt, metric, ["resid_pre.1"])
    torch.testing.assert_close(got["resid_pre.1"], ref["resid_pre.1"], **TOL)


def test_compiled_model():
    """activation_patch works on torch.compile(model) (edits through pyhook's dispatchers);
    the gradient methods refuse it by name."""
    model = gpt2()
    clean, corrupt = _pair(model)
    metric = _metric_for(model)
    want = activation_patch(model, clean, corrupt, metric, ["resid_pre.1"], batch_size=16)
    compiled = torch.compile(model, backend="eager")
    try:
        got = activation_patch(compiled, clean, corrupt, metric, ["resid_pre.1"], batch_size=16)
        torch.testing.assert_close(got["resid_pre.1"], want["resid_pre.1"], **TOL)
        with pytest.raises(
            pyhook.CompiledModelError, match=r"attribution_patch .*compiled.*_orig_mod"
        ):
            attribution_patch(compiled, clean, corrupt, metric, ["resid_pre.1"])
        with pytest.raises(pyhook.CompiledModelError, match="edge_attribution"):
            edge_attribution(compiled, clean, corrupt, metric)
    finally:
        pyhook.release_compiled(model)
        torch._dynamo.reset()


def test_offloaded_model(tmp_path):
    """accelerate device_map with a block on disk: the same results as the model in memory."""
    pytest.importorskip("accelerate")
    model = llama()
    clean, corrupt = _pair(model)
    metric = _metric_for(model)
    model.save_pretrained(tmp_path / "ckpt")
    off = offloaded_llama(tmp_path / "ckpt", tmp_path / "off", dtype=torch.float64)
    assert hasattr(off.model.layers[1], "_hf_hook")
    pts = ["resid_pre.1", "attn_z.1", "mlp_out.1"]
    for fn in (activation_patch, attribution_patch):
        want, got = fn(model, clean, corrupt, metric, pts), fn(off, clean, corrupt, metric, pts)
        for p in pts:
            torch.testing.assert_close(got[p], want[p], **TOL)
    want, got = (
        edge_attribution(model, clean, corrupt, metric),
        edge_attribution(off, clean, corrupt, metric),
    )
    torch.testing.assert_close(got.scores, want.scores, **TOL)


def test_result_top_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    model = gpt2()
    clean, corrupt = _pair(model)
    r = activation_patch(model, clean, corrupt, _metric_for(model), ["resid_pre.1", "attn_z.0"])
    top = r.top(3)
    allc = r.components()
    assert len(allc) == 5 + 5 * 2
    assert [abs(c.score) for c in top] == sorted((abs(c.score) for c in allc), reverse=True)[:3]
    best = top[0]
    want = (
        r[best.point][best.position]
        if best.head is None
        else r[best.point][best.position, best.head]
    )
    assert best.score == float(want)
    fig = r.plot(tmp_path / "p.png", labels=[str(t) for t in clean[0].tolist()])
    assert (tmp_path / "p.png").stat().st_size > 1000
    assert len(fig.axes[0].get_yticklabels()) == 1 + 2  # resid_pre.1, attn_z.0.h0, attn_z.0.h1
    e = edge_attribution(model, clean, corrupt, _metric_for(model))
    e.plot(tmp_path / "e.png")
    assert (tmp_path / "e.png").stat().st_size > 1000
