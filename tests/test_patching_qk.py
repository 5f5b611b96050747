"""AtP*'s QK fix and the per-head query/key/value points, against plain-torch references.

The references hook the models' own modules by their Hugging Face paths (c_attn on GPT-2,
q_proj/k_proj/v_proj and the rotary (cos, sin) the attention receives on Llama, rotated with
transformers' own apply_rotary_pos_emb), recompute the attention pattern with plain torch, take
d metric / d pattern with torch.autograd.grad through a leaf pattern put in place of the heads'
output, and patch one (position, head) at a time. Float64, norms with random weights and biases.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

T = pytest.importorskip("transformers")

import pyhook  # noqa: E402
from pyhook.patching import activation_patch, attribution_patch  # noqa: E402
from pyhook.points import PointUnavailableError, expand_points  # noqa: E402

TOL = dict(rtol=1e-8, atol=1e-10)


def _randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name or "ln" in name):
                p.copy_(
                    1 + 0.3 * torch.randn(p.shape, generator=g)
                    if name.endswith("weight")
                    else 0.2 * torch.randn(p.shape, generator=g)
                )
    return model.eval().double()


def _gpt2(layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    cfg = T.GPT2Config(n_embd=16, n_layer=layers, n_head=2, vocab_size=32, n_positions=16)
    return _randomize(T.GPT2LMHeadModel(cfg))


def _llama() -> nn.Module:
    torch.manual_seed(1)
    cfg = T.LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=32,
        attn_implementation="eager",
    )
    return _randomize(T.LlamaForCausalLM(cfg))


def _blocks(model: nn.Module) -> nn.ModuleList:
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def _attn(model: nn.Module, layer: int) -> nn.Module:
    b = _blocks(model)[layer]
    return b.attn if hasattr(b, "attn") else b.self_attn


def _qkv(model: nn.Module, layer: int, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v of ``layer`` ([b, s, heads, d_head], q and k after rotary) by plain hooks."""
    attn, got = _attn(model, layer), {}
    hs = []
    if hasattr(attn, "c_attn"):
        hs.append(attn.c_attn.register_forward_hook(lambda m, a, o: got.__setitem__("qkv", o)))
    else:
        hs.append(
            attn.register_forward_pre_hook(
                lambda m, a, kw: got.__setitem__("pe", kw["position_embeddings"]),
                with_kwargs=True,
            )
        )
        for w in "qkv":
            hs.append(
                getattr(attn, f"{w}_proj").register_forward_hook(
                    lambda m, a, o, w=w: got.__setitem__(w, o)
                )
            )
    with torch.no_grad():
        model(ids)
    for h in hs:
        h.remove()
    b, s = ids.shape
    if "qkv" in got:
        n = attn.num_heads
        return tuple(
            t.reshape(b, s, n, -1) for t in got["qkv"].split(got["qkv"].shape[-1] // 3, -1)
        )
    cfg = attn.config
    q = got["q"].view(b, s, cfg.num_attention_heads, -1)
    k = got["k"].view(b, s, cfg.num_key_value_heads, -1)
    v = got["v"].view(b, s, cfg.num_key_value_heads, -1)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    qr, kr = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), *got["pe"])
    return qr.transpose(1, 2), kr.transpose(1, 2), v


def _pattern(q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    rep = q.shape[2] // k.shape[2]
    s = torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(rep, 2)) * scaling
    causal = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    return torch.softmax(s.masked_fill(~causal, float("-inf")), -1)


def _d_pattern(model, layer, ids, metric, pattern, v, drop=None):
    """d metric / d pattern by autograd: the pattern, a leaf, gives the heads' output of
    ``layer`` (the input of the output projection); ``drop``: a block whose attention and MLP
    outputs pass no gradient (GradDrop)."""
    attn = _attn(model, layer)
    proj = attn.c_proj if hasattr(attn, "c_proj") else attn.o_proj
    leaf = pattern.detach().clone().requires_grad_(True)
    rep = pattern.shape[1] // v.shape[2]

    def put(m, args):
        z = torch.einsum("bhij,bjhd->bihd", leaf, v.repeat_interleave(rep, 2))
        # (Llama's eager attention takes the softmax in float32)
        assert torch.allclose(z.flatten(-2), args[0], rtol=1e-6, atol=1e-8)
        return (z.flatten(-2),)

    def stop(m, a, o):
        t = o[0] if isinstance(o, tuple) else o
        t.register_hook(lambda g: torch.zeros_like(g))

    hs = [proj.register_forward_pre_hook(put)]
    if drop is not None:
        b = _blocks(model)[drop]
        hs += [_attn(model, drop).register_forward_hook(stop), b.mlp.register_forward_hook(stop)]
    try:
        with torch.enable_grad():
            (g,) = torch.autograd.grad(metric(model(ids)).sum(), leaf)
    finally:
        for h in hs:
            h.remove()
    return g


def _qk_fixed_reference(model, layer, clean, corrupt, metric, which, drop=None):
    """[pos, head] QK-fixed estimates (denoising), summed over the batch: the exact pattern with
    one (position, head) of the corrupt run's query/key set to the clean one, times d metric /
    d pattern."""
    return _qk_fixed_pairs(model, layer, clean, corrupt, metric, which, drop).sum(0)


def _qk_fixed_pairs(model, layer, clean, corrupt, metric, which, drop=None):
    """The same per prompt pair: [batch, pos, head]."""
    q, k, v = _qkv(model, layer, corrupt)
    qc, kc, _ = _qkv(model, layer, clean)
    scaling = float(_attn(model, layer).scaling)
    base = _pattern(q, k, scaling)
    g = _d_pattern(model, layer, corrupt, metric, base, v, drop)
    src, mine = (qc, q) if which == "q" else (kc, k)
    out = torch.zeros(mine.shape[0], mine.shape[1], mine.shape[2], dtype=torch.float64)
    for s in range(mine.shape[1]):
        for h in range(mine.shape[2]):
            x = mine.clone()
            x[:, s, h] = src[:, s, h]
            new = _pattern(x, k, scaling) if which == "q" else _pattern(q, x, scaling)
            out[:, s, h] = ((new - base) * g).sum((1, 2, 3))
    return out


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_qkv_points_are_the_query_key_value_used(family):
    model = _gpt2() if family == "gpt2" else _llama()
    ids = torch.tensor([[1, 5, 2, 7, 3], [4, 4, 9, 1, 0]])
    q, k, v = _qkv(model, 1, ids)
    with pyhook.TraceDict(model, ["attn_q.1", "attn_k.1", "attn_v.1"]) as ret:
        model(ids)
    torch.testing.assert_close(ret["attn_q.1"].output, q, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret["attn_k.1"].output, k, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret["attn_v.1"].output, v, rtol=0, atol=0)
    # named explicitly only: ranges and negative layers, not in point_names() nor in *.L globs
    assert [n for n, _ in expand_points(model, "attn_k.*")] == ["attn_k.0", "attn_k.1"]
    assert [n for n, _ in expand_points(model, "attn_q.-1")] == ["attn_q.-1"]
    assert not any(
        n.startswith(("attn_q", "attn_k", "attn_v")) for n, _ in expand_points(model, "*.1")
    )
    # an edit of the (rotated) key reaches the scores: the same as editing by hand
    new_k = k.clone()
    new_k[:, 2] *= -3.0
    with pyhook.TraceDict(model, ["attn_k.1"], edit_output=lambda o, layer: new_k):
        edited = model(ids).logits
    attn = _attn(model, 1)
    z = torch.einsum(
        "bhij,bjhd->bihd",
        _pattern(q, new_k, float(attn.scaling)),
        v.repeat_interleave(q.shape[2] // k.shape[2], 2),
    )
    proj = attn.c_proj if hasattr(attn, "c_proj") else attn.o_proj
    with torch.no_grad():
        h = proj.register_forward_pre_hook(lambda m, a: (z.flatten(-2),))
        try:
            by_hand = model(ids).logits
        finally:
            h.remove()
    # (1e-6: Llama's eager attention takes the softmax in float32, the hand computation not)
    tol = 1e-9 if family == "gpt2" else 1e-7
    torch.testing.assert_close(edited, by_hand, rtol=tol, atol=tol)
    assert (edited - model(ids).logits).abs().max() > 1e-4  # the edit mattered


def test_qkv_points_refused_by_name_elsewhere():
    cfg = T.GPTNeoXConfig(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        vocab_size=32,
    )
    model = T.GPTNeoXForCausalLM(cfg).eval()
    with pytest.raises(PointUnavailableError, match=r"'attn_k\.0'.*gpt2, llama"):
        expand_points(model, "attn_k.0")
    with pytest.raises(PointUnavailableError, match="attn_q"):
        attribution_patch(
            model,
            torch.tensor([[1, 2]]),
            torch.tensor([[1, 3]]),
            lambda o: o.logits[:, -1, 0],
            "attn_q.*",
        )
    assert not any(h._forward_hooks or h._forward_pre_hooks for h in model.modules())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_qk_fix_matches_hand_computation(family):
    model = _gpt2() if family == "gpt2" else _llama()
    clean = torch.tensor([[1, 5, 2, 7, 3], [4, 4, 9, 1, 2]])
    corrupt = torch.tensor([[1, 6, 2, 8, 3], [4, 11, 9, 1, 5]])

    def metric(o):
        return o.logits[:, -1, 3] - o.logits[:, -1, 6]

    n = len(_blocks(model))
    r0 = attribution_patch(model, clean, corrupt, metric, "attn_q.0", method="atp*")
    for layer in range(n):
        r = attribution_patch(
            model, clean, corrupt, metric, [f"attn_q.{layer}", f"attn_k.{layer}"], method="atp*"
        )
        signed = attribution_patch(
            model,
            clean,
            corrupt,
            metric,
            [f"attn_q.{layer}", f"attn_k.{layer}"],
            method="atp*",
            signed=True,
        )
        for which in "qk":
            # per pair: AtP with the QK fix under each block's drop; a query/key of block
            # `layer` is cut by its own block's drop, so L - 1 terms (the paper's 1/(L-1))
            copies = [_qk_fixed_pairs(model, layer, clean, corrupt, metric, which)]
            copies += [
                _qk_fixed_pairs(model, layer, clean, corrupt, metric, which, drop=d)
                for d in range(n)
            ]
            assert float(copies[1 + layer].abs().max()) == 0.0
            want = (sum(c.abs() for c in copies[1:]) / (n - 1)).sum(0)
            torch.testing.assert_close(r[f"attn_{which}.{layer}"], want, **TOL)
            torch.testing.assert_close(
                signed[f"attn_{which}.{layer}"], torch.sign(copies[0].sum(0)) * want, **TOL
            )
    # per_head=False sums the heads; one_batch gives the same scores
    r1 = attribution_patch(model, clean, corrupt, metric, "attn_k.1", method="atp*", one_batch=True)
    torch.testing.assert_close(r1["attn_k.1"], r["attn_k.1"], **TOL)
    want_k = _qk_fixed_reference(model, 1, clean, corrupt, metric, "k")
    flat = attribution_patch(
        model, clean, corrupt, metric, "attn_k.1", method="atp*", per_head=False
    )
    # (a node is the whole point at a position: the absolute value of the heads' sum, per pair)
    drops = [_qk_fixed_pairs(model, 1, clean, corrupt, metric, "k", drop=d) for d in range(n)]
    want_flat = (sum(d.sum(-1).abs() for d in drops) / (n - 1)).sum(0)
    torch.testing.assert_close(flat["attn_k.1"], want_flat, **TOL)
    off = attribution_patch(model, clean, corrupt, metric, "attn_q.0", method="atp*", offload=True)
    torch.testing.assert_close(off["attn_q.0"], r0["attn_q.0"], **TOL)
    if n == 2:  # layer n-1: GradDrop's copies reduce to the plain gradient, per pair
        pairs = _qk_fixed_pairs(model, 1, clean, corrupt, metric, "k")
        torch.testing.assert_close(r["attn_k.1"], pairs.abs().sum(0), **TOL)
        assert not torch.allclose(pairs.abs().sum(0), want_k.abs())  # the pairs' signs differ


def test_atp_on_qk_points_stays_linear():
    model = _llama()
    clean, corrupt = torch.tensor([[1, 5, 2, 7]]), torch.tensor([[1, 6, 2, 8]])

    def metric(o):
        return o.logits[:, -1, 3]

    _, k, _ = _qkv(model, 1, corrupt)
    _, kc, _ = _qkv(model, 1, clean)
    leaf = k.clone().requires_grad_(True)
    # gradient wrt the rotated key by autograd, the key put in through pyhook's edit
    with pyhook.TraceDict(model, ["attn_k.1"], edit_output=lambda o, layer: leaf):
        (g,) = torch.autograd.grad(metric(model(corrupt)).sum(), leaf)
    r = attribution_patch(model, clean, corrupt, metric, "attn_k.1")
    torch.testing.assert_close(r["attn_k.1"], ((kc - k) * g).sum((0, 3)), **TOL)


def test_qk_fix_is_closer_to_activation_patching_when_softmax_saturates():
    model = _gpt2(2)
    with torch.no_grad():  # large queries and keys in block 1: a saturated softmax
        w = model.transformer.h[1].attn.c_attn.weight
        w[:, :32] *= 6.0
    clean = torch.tensor([[1, 5, 2, 7, 3, 9]])
    corrupt = torch.tensor([[1, 6, 2, 8, 3, 9]])

    def metric(o):
        return o.logits[:, -1, 3] - o.logits[:, -1, 6]

    points = ["attn_q.1", "attn_k.1"]
    exact = activation_patch(model, clean, corrupt, metric, points)
    atp = attribution_patch(model, clean, corrupt, metric, points, method="atp")
    # (signed: the paper's AtP* is a magnitude; the signed variant compares with the effects)
    fixed = attribution_patch(model, clean, corrupt, metric, points, method="atp*", signed=True)
    err_atp = sum(float((atp[p] - exact[p]).abs().sum()) for p in points)
    err_fix = sum(float((fixed[p] - exact[p]).abs().sum()) for p in points)
    total = sum(float(exact[p].abs().sum()) for p in points)
    assert total > 1e-3  # the patches matter
    assert err_fix < 0.5 * err_atp, (err_fix, err_atp, total)
    # for query patches in the last block, the QK fix is exact (the pattern is the only path)
    torch.testing.assert_close(fixed["attn_q.1"], exact["attn_q.1"], rtol=1e-6, atol=1e-8)


def test_qk_fix_refuses_an_attention_it_does_not_recompute():
    model = _gpt2(2)
    # the heads' output is no longer pattern @ v (as a soft-capped or windowed attention's)
    model.transformer.h[1].attn.c_proj.register_forward_pre_hook(lambda m, a: (a[0] * 1.5,))
    clean, corrupt = torch.tensor([[1, 5, 2]]), torch.tensor([[1, 6, 2]])
    with pytest.raises(ValueError, match=r"block 1's attention.*attn_z\.1"):
        attribution_patch(
            model, clean, corrupt, lambda o: o.logits[:, -1, 3], "attn_k.1", method="atp*"
        )
    assert not any(m._forward_hooks for m in model.modules())
    assert [len(m._forward_pre_hooks) for m in model.modules() if m._forward_pre_hooks] == [1]


def test_qk_fix_noising_and_padding():
    model = _gpt2(2)
    clean = torch.tensor([[1, 5, 2, 7, 3], [4, 4, 9, 1, 2]])
    corrupt = torch.tensor([[1, 6, 2, 8, 3], [4, 11, 9, 1, 5]])

    def metric(o):
        return o.logits[:, -1, 3] - o.logits[:, -1, 6]

    # noising: the clean run is the base, the corrupt run the source (last block: no GradDrop
    # distortion, see above)
    r = attribution_patch(
        model, clean, corrupt, metric, ["attn_q.1", "attn_k.1"], method="atp*", noising=True
    )
    for which in "qk":
        want = _qk_fixed_pairs(model, 1, corrupt, clean, metric, which).abs().sum(0)
        torch.testing.assert_close(r[f"attn_{which}.1"], want, **TOL)
    # padding: the pattern is recomputed with the 2-D attention mask (ignoring it, the check
    # against the model's attn_z would refuse the layer)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 1, 1]])
    r = attribution_patch(
        model,
        {"input_ids": clean, "attention_mask": mask},
        {"input_ids": corrupt, "attention_mask": mask},
        metric,
        "attn_k.*",
        method="atp*",
    )
    assert r["attn_k.1"].shape == (5, 2) and bool(torch.isfinite(r["attn_k.1"]).all())


def _saturated_gpt2() -> nn.Module:
    """A float32 GPT-2 whose block-1 queries and keys are scaled x100: most rows of its
    attention put a weight that rounds to 1 on one key."""
    torch.manual_seed(2)
    cfg = T.GPT2Config(
        n_embd=16, n_layer=2, n_head=2, vocab_size=32, bos_token_id=0, eos_token_id=0
    )
    model = T.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        model.transformer.h[1].attn.c_attn.weight[:, :32] *= 100
    return model


def _key_fix_float64(model32, layer, base_ids, src_ids, metric):
    """[batch, pos, head]: the key points' QK-fixed estimates by explicit recomputation in
    float64: the float32 model's queries and keys in float64, the pattern with one key patched
    as a softmax of the patched scores, times d metric / d pattern from a float64 copy of the
    model (the pattern, a leaf, gives the heads' output of ``layer``)."""
    model64 = copy.deepcopy(model32).double()
    q, k, _ = (t.double() for t in _qkv(model32, layer, base_ids))
    kc = _qkv(model32, layer, src_ids)[1].double()
    v = _qkv(model64, layer, base_ids)[2]
    attn = _attn(model64, layer)
    scaling = float(attn.scaling)
    base = _pattern(q, k, scaling)
    leaf = base.clone().requires_grad_(True)
    put = attn.c_proj.register_forward_pre_hook(
        lambda m, a: (torch.einsum("bhij,bjhd->bihd", leaf, v).flatten(-2),)
    )
    try:
        (g,) = torch.autograd.grad(metric(model64(base_ids)).sum(), leaf)
    finally:
        put.remove()
    out = torch.zeros(k.shape[:3], dtype=torch.float64)
    for s in range(k.shape[1]):
        for h in range(k.shape[2]):
            x = k.clone()
            x[:, s, h] = kc[:, s, h]
            out[:, s, h] = ((_pattern(q, x, scaling) - base) * g).sum((1, 2, 3))
    return out, base


@pytest.mark.parametrize("noising", [False, True])
def test_qk_key_fix_on_a_saturated_softmax_in_float32(noising):
    """A key whose weight rounds to 1 in float32: patching it sends the row's attention to the
    other keys, whose renormalised weights the closed form 1 - a lost (it gave 100% error or
    NaN here). Against the explicit recomputation in float64."""
    model = _saturated_gpt2()
    clean = torch.tensor([[1, 5, 2, 7, 3, 9], [1, 4, 2, 3, 8, 9]])
    corrupt = torch.tensor([[1, 6, 2, 8, 3, 9], [1, 4, 11, 3, 2, 9]])

    def metric(o):
        return o.logits[:, -1, 3] - o.logits[:, -1, 6]

    base_ids, src_ids = (clean, corrupt) if noising else (corrupt, clean)
    want, _ = _key_fix_float64(model, 1, base_ids, src_ids, metric)
    q, k, _ = _qkv(model, 1, base_ids)
    a32 = _pattern(q, k, float(_attn(model, 1).scaling))
    patched = (src_ids != base_ids).view(2, 1, 1, 6)  # keys the patch changes
    assert bool(((a32 == 1.0) & patched).any())  # a saturated weight on a patched key
    assert model.dtype == torch.float32
    # last block of 2: GradDrop's one surviving copy is the plain gradient, |.| per pair
    for i in range(2):  # each pair alone, then the batch
        one = attribution_patch(
            model,
            clean[i : i + 1],
            corrupt[i : i + 1],
            metric,
            "attn_k.1",
            method="atp*",
            noising=noising,
        )["attn_k.1"]
        ref = want[i].abs()
        assert float(ref.max()) > 1e-3
        tol = 1e-4 * float(ref.max())
        torch.testing.assert_close(one.double().abs(), ref, rtol=0, atol=tol)
    got = attribution_patch(
        model, clean, corrupt, metric, "attn_k.1", method="atp*", noising=noising
    )
    ref = want.abs().sum(0)
    torch.testing.assert_close(got["attn_k.1"].double(), ref, rtol=0, atol=1e-4 * float(ref.max()))


def test_qk_fix_on_a_left_padded_batch():
    """Left padding under eager attention: the padding query rows (every key masked) are
    computed by the model as it likes (GPT-2's eager attention: finite values) and read by no
    real token. Each example's scores are those of the example alone, without padding."""
    torch.manual_seed(0)
    cfg = T.GPT2Config(
        n_embd=16, n_layer=2, n_head=2, vocab_size=32, n_positions=16, attn_implementation="eager"
    )
    model = _randomize(T.GPT2LMHeadModel(cfg))
    clean = torch.tensor([[1, 5, 2, 7, 3], [0, 0, 9, 2, 4]])
    corrupt = torch.tensor([[1, 6, 2, 8, 3], [0, 0, 9, 5, 4]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    pos = (mask.cumsum(1) - 1).clamp(min=0)

    def metric(o):
        return o.logits[:, -1, 3] - o.logits[:, -1, 6]

    def inputs(ids):
        return {"input_ids": ids, "attention_mask": mask, "position_ids": pos}

    points = ["attn_q.0", "attn_k.0", "attn_q.1", "attn_k.1"]
    got = attribution_patch(model, inputs(clean), inputs(corrupt), metric, points, method="atp*")
    alone = [
        attribution_patch(model, clean[:1], corrupt[:1], metric, points, method="atp*"),
        attribution_patch(model, clean[1:, 2:], corrupt[1:, 2:], metric, points, method="atp*"),
    ]
    for p in points:
        want = alone[0][p].clone()
        want[2:] += alone[1][p]
        torch.testing.assert_close(got[p], want, rtol=1e-7, atol=1e-10)
    assert float(alone[1]["attn_k.1"].abs().max()) > 1e-6  # the padded example counts
