"""pyhook.attribution_graph against references written with plain PyTorch hooks and autograd.

The reference replacement model hooks the models' own modules by their Hugging Face paths (not
through pyhook's points): each norm recomputed with its scale detached, the queries and keys
detached, each MLP replaced by its transcoder's decoder applied to a leaf tensor of features plus
a leaf error term, the hidden state entering block 0 a leaf. An edge is then
``torch.autograd.grad`` of the target times the source's activation. Models run in float64 with
norm weights and biases far from 1 and 0 (``randomise_norms``).
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from torch import nn

T = pytest.importorskip("transformers")

from _models import all_hooks, offloaded_llama, randomise_norms  # noqa: E402

import pyhook  # noqa: E402
from pyhook.graph import AttributionGraph, GraphNode, attribution_graph  # noqa: E402
from pyhook.points import PointUnavailableError  # noqa: E402

D, N_FEAT, VOCAB = 16, 24, 40
IDS = torch.tensor([3, 7, 1, 9, 4, 22, 5])


class Transcoder(nn.Module):
    """A ReLU transcoder; with ``n_out > 1`` a cross-layer transcoder (decode returns a list)."""

    def __init__(self, seed: int, n_out: int = 1, d: int = D, n: int = N_FEAT) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        kw = dict(generator=g, dtype=torch.float64)
        self.W_enc = nn.Parameter(torch.randn(d, n, **kw) / d**0.5)
        self.b_enc = nn.Parameter(torch.randn(n, **kw) * 0.2)
        if n_out == 1:
            self.W_dec = nn.Parameter(torch.randn(n, d, **kw) / n**0.5)
            self.b_dec = nn.Parameter(torch.randn(d, **kw) * 0.2)
        else:
            self.W_dec = nn.ParameterList(torch.randn(n, d, **kw) / n**0.5 for _ in range(n_out))
            self.b_dec = nn.ParameterList(torch.randn(d, **kw) * 0.2 for _ in range(n_out))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.W_enc + self.b_enc)

    def decode(self, f: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        if isinstance(self.W_dec, nn.ParameterList):
            return [f @ w + b for w, b in zip(self.W_dec, self.b_dec)]
        return f @ self.W_dec + self.b_dec


def make(name: str, n_layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    if name == "gpt2":
        cfg = T.GPT2Config(
            n_embd=D, n_layer=n_layers, n_head=2, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0
        )
        model = T.GPT2LMHeadModel(cfg)
    elif name == "llama":
        cfg = T.LlamaConfig(
            hidden_size=D,
            intermediate_size=32,
            num_hidden_layers=n_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
        )
        model = T.LlamaForCausalLM(cfg)
    elif name == "qwen3":
        cfg = T.Qwen3Config(
            hidden_size=D,
            intermediate_size=32,
            num_hidden_layers=n_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            vocab_size=VOCAB,
        )
        model = T.Qwen3ForCausalLM(cfg)
    elif name == "gemma2":  # sandwich norms, (1 + w) RMSNorm, attention soft-capping
        cfg = T.Gemma2Config(
            hidden_size=D,
            intermediate_size=32,
            num_hidden_layers=n_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            vocab_size=VOCAB,
            final_logit_softcapping=None,
        )
        model = T.Gemma2ForCausalLM(cfg)
    else:
        raise ValueError(name)
    return randomise_norms(model.double().eval())


def transcoders(n_layers: int = 2) -> dict:
    return {(f"mlp_in.{i}", f"mlp_out.{i}"): Transcoder(10 + i) for i in range(n_layers)}


# -- the reference: a frozen replacement model from plain hooks --------------------------------
def _parts(model: nn.Module) -> tuple[list[nn.Module], nn.Module]:
    if hasattr(model, "transformer"):
        return list(model.transformer.h), model.transformer.ln_f
    return list(model.model.layers), model.model.norm


def _frozen_norm(mod: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    x = args[0]
    if isinstance(mod, nn.LayerNorm):
        c = x - x.mean(-1, keepdim=True)
        s = (c.pow(2).mean(-1, keepdim=True) + mod.eps).sqrt().detach()
        return c / s * mod.weight + mod.bias
    eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
    s = (x.pow(2).mean(-1, keepdim=True) + eps).sqrt().detach()
    w = 1 + mod.weight if type(mod).__name__.startswith("Gemma") else mod.weight
    return x / s * w


def reference(model: nn.Module, tcs: dict, ids: torch.Tensor, logit_ids=None, custom=()) -> dict:
    """{(target node, source node): edge} for every feature and logit target, by autograd.grad
    through the replacement model built here, with the feature activations and logits of a plain
    forward. The logit targets are ``logit_ids`` (default: the 3 most likely tokens), then the
    ``custom`` directions ``(label, vector)`` of the final norm's output (index vocab + k)."""
    blocks, final_norm = _parts(model)
    n = len(blocks)
    tc, writers = [], [[] for _ in range(n)]  # writers[k]: (transcoder, which of its outputs)
    for i in range(n):
        key, d = next((k, d) for k, d in tcs.items() if k[0] == f"mlp_in.{i}")
        tc.append(d)
        outs = [key[1]] if isinstance(key[1], str) else list(key[1])
        for j, o in enumerate(outs):
            writers[int(o.split(".")[1])].append((i, j))

    def write(k, feats):  # what the transcoders write to layer k's MLP output
        total = 0
        for i, j in writers[k]:
            dec = tc[i].decode(feats[i])
            total = total + (dec[j] if isinstance(dec, list) else dec)
        return total

    mlp_in, mlp_out, embed = {}, {}, {}
    handles = []
    for i, b in enumerate(blocks):
        handles.append(
            b.mlp.register_forward_pre_hook(lambda m, a, i=i: mlp_in.__setitem__(i, a[0]))
        )
        handles.append(b.mlp.register_forward_hook(lambda m, a, o, i=i: mlp_out.__setitem__(i, o)))
    handles.append(
        blocks[0].register_forward_pre_hook(
            lambda m, a, k: embed.__setitem__(0, a[0] if a else k["hidden_states"]),
            with_kwargs=True,
        )
    )
    plain_final = {}
    handles.append(final_norm.register_forward_hook(lambda m, a, o: plain_final.__setitem__(0, o)))
    with torch.no_grad():
        logits = model(ids[None]).logits[0, -1]
    for h in handles:
        h.remove()
    acts = [tc[i].encode(mlp_in[i][0]).detach() for i in range(n)]
    errs = [(mlp_out[i][0] - write(i, acts)).detach() for i in range(n)]
    emb = embed[0][0].detach()

    # the replacement model
    F = [a.clone().requires_grad_(True) for a in acts]
    Err = [e.clone().requires_grad_(True) for e in errs]
    E = emb.clone().requires_grad_(True)
    live_in, live_final = {}, {}
    handles = []
    for m in model.modules():
        if "Norm" in type(m).__name__:
            handles.append(m.register_forward_hook(_frozen_norm))
    for i, b in enumerate(blocks):
        attn = b.attn if hasattr(b, "attn") else b.self_attn
        if hasattr(attn, "c_attn"):  # GPT-2: q, k, v side by side

            def qk(m, a, o):
                return torch.cat([o[..., : 2 * D].detach(), o[..., 2 * D :]], -1)

            handles.append(attn.c_attn.register_forward_hook(qk))
        else:
            handles.append(attn.q_proj.register_forward_hook(lambda m, a, o: o.detach()))
            handles.append(attn.k_proj.register_forward_hook(lambda m, a, o: o.detach()))
        handles.append(
            b.mlp.register_forward_pre_hook(lambda m, a, i=i: live_in.__setitem__(i, a[0]))
        )
        handles.append(
            b.mlp.register_forward_hook(lambda m, a, o, i=i: (write(i, F) + Err[i])[None])
        )

    def new_embed(m, a, k):
        if a:
            return (E[None], *a[1:]), k
        return a, {**k, "hidden_states": E[None]}

    handles.append(blocks[0].register_forward_pre_hook(new_embed, with_kwargs=True))
    handles.append(final_norm.register_forward_hook(lambda m, a, o: live_final.__setitem__(0, o)))
    try:
        model(ids[None])
    finally:
        for h in handles:
            h.remove()

    W_U = model.get_output_embeddings().weight
    probs = torch.softmax(logits, -1)
    sources = [F[i] for i in range(n)] + [Err[i] for i in range(n)] + [E]

    def edges_of(target_value: torch.Tensor) -> dict:
        grads = torch.autograd.grad(target_value, sources, retain_graph=True, allow_unused=True)
        out = {}
        for i in range(n):
            g = grads[i]
            if g is not None:
                for p, f in torch.nonzero(acts[i]).tolist():
                    out[GraphNode("feature", i, p, f)] = float(g[p, f] * acts[i][p, f])
            g = grads[n + i]
            for p in range(len(ids)):
                out[GraphNode("error", i, p, -1)] = (
                    0.0 if g is None else float((g[p] * errs[i][p]).sum())
                )
        g = grads[2 * n]
        for p in range(len(ids)):
            out[GraphNode("token", -1, p, int(ids[p]))] = float((g[p] * emb[p]).sum())
        return out

    result = {"values": {}, "edges": {}, "probs": probs}
    for i in range(n):
        p_ = tc[i]
        pre = live_in[i][0] @ p_.W_enc + p_.b_enc
        for p, f in torch.nonzero(acts[i]).tolist():
            node = GraphNode("feature", i, p, f)
            result["values"][node] = float(acts[i][p, f])
            result["edges"][node] = edges_of(pre[p, f])
    top = probs.sort(descending=True).indices[:3] if logit_ids is None else logit_ids
    for t in list(top.tolist() if torch.is_tensor(top) else top):
        node = GraphNode("logit", n, len(ids) - 1, t)
        vec = W_U[t] - W_U.mean(0)
        result["values"][node] = float(logits[t] - logits.mean())
        result["edges"][node] = edges_of(live_final[0][0, -1] @ vec)
    k0 = len(top)
    for k, (_label, vec) in enumerate(custom):
        node = GraphNode("logit", n, len(ids) - 1, W_U.shape[0] + k0 + k)
        result["values"][node] = float(plain_final[0][0, -1] @ vec)
        result["edges"][node] = edges_of(live_final[0][0, -1] @ vec)
    return result


def _edges(g: AttributionGraph) -> dict:
    out = {}
    n_src = g.adjacency.shape[1]
    for r, t in enumerate(g.targets.tolist()):
        out[g.nodes[t]] = {g.nodes[j]: float(g.adjacency[r, j]) for j in range(n_src)}
    return out


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen3"])
def test_edges_equal_autograd_through_the_frozen_replacement_model(arch):
    model, tcs = make(arch), transcoders()
    before = all_hooks(model)
    g = attribution_graph(model, tcs, IDS, max_n_logits=3, desired_logit_prob=1.0, batch_size=7)
    assert all_hooks(model) == before
    ref = reference(model, tcs, IDS)
    mine = _edges(g)
    assert set(mine) == set(ref["edges"])  # every active feature, the 3 top logits
    for target, row in ref["edges"].items():
        for src, want in row.items():
            assert mine[target][src] == pytest.approx(want, rel=1e-8, abs=1e-10), (target, src)
    # the values come from the plain model (activations, logits minus their mean)
    for node, want in ref["values"].items():
        assert float(g.values[g.nodes.index(node)]) == pytest.approx(want, rel=1e-10, abs=1e-12)


def _complete_against_plain(g, model, tcs, ids, tol) -> int:
    """Assert, for every feature and logit node, edges + constant == the value computed without
    the graph: the transcoder's encoder on a plain forward's MLP input, the plain logits minus
    their mean (before a soft-cap, which is undone); returns how many nodes were checked."""
    inputs = sorted({f"mlp_in.{node.layer}" for node in g.nodes if node.kind == "feature"})
    with torch.no_grad(), pyhook.TraceDict(model, inputs) as ret:
        logits = model(ids[None]).logits[0, -1]
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:  # logit nodes are before the soft-cap (Gemma 2): undo it
        logits = cap * torch.atanh(logits / cap)
    checked = 0
    for i, node in enumerate(g.nodes):
        if node.kind == "feature":
            out = ret[f"mlp_in.{node.layer}"].output  # [1, T, d], or [T, d] (OPT)
            x = out.reshape(-1, len(ids), out.shape[-1])[0, node.position]
            with torch.no_grad():
                want = tcs[(f"mlp_in.{node.layer}", f"mlp_out.{node.layer}")].encode(x)[node.index]
        elif node.kind == "logit":
            want = logits[node.index] - logits.mean()
        else:
            continue
        row = int((g.targets == i).nonzero())
        got = g.adjacency[row].sum() + g.constant[i]
        assert float(got) == pytest.approx(float(want), rel=tol, abs=tol), node
        checked += 1
    return checked


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen3", "gemma2"])
def test_completeness_edges_plus_constant_are_the_value(arch):
    model, tcs = make(arch), transcoders()
    g = attribution_graph(model, tcs, IDS, batch_size=4)
    # RMSNorm models compute their norm in float32 even in a float64 model: the frozen
    # (linear) model is float64 throughout, so it differs from the model by that rounding
    tol = 1e-9 if arch == "gpt2" else 1e-6
    _complete_against_plain(g, model, tcs, IDS, tol)
    assert g.n_features == g.n_active_features > 10
    assert g.completeness_error() < tol  # against the graph's own values (the model's)


def test_norm_scales_must_be_frozen_for_completeness(monkeypatch):
    """The check above can fail: with the norms left live, edges plus constant miss the values."""
    import pyhook.graph as G

    orig = G._Freeze.__init__

    def no_norms(self, model, n):
        orig(self, model, n)
        self.norms = []

    monkeypatch.setattr(G._Freeze, "__init__", no_norms)
    g = attribution_graph(make("llama"), transcoders(), IDS)
    assert g.completeness_error() > 1e-3


def test_cross_layer_transcoder_completeness_and_edges():
    model = make("llama", n_layers=3)
    tcs = {
        ("mlp_in.0", ("mlp_out.0", "mlp_out.1", "mlp_out.2")): Transcoder(1, n_out=3),
        ("mlp_in.1", ("mlp_out.1", "mlp_out.2")): Transcoder(2, n_out=2),
        ("mlp_in.2", "mlp_out.2"): Transcoder(3),
    }
    g = attribution_graph(model, tcs, IDS, batch_size=16, max_n_logits=3, desired_logit_prob=1.0)
    assert g.completeness_error() < 1e-6  # Llama's RMSNorm rounds to float32: see above
    # a layer-0 feature's edge into a layer-2 feature sums its decoders to layers 0, 1 and 2
    ref, mine = reference(model, tcs, IDS), _edges(g)
    assert set(mine) == set(ref["edges"])
    assert {t.layer for t in mine} == {0, 1, 2, 3}
    for target, row in ref["edges"].items():
        for src, want in row.items():
            assert mine[target][src] == pytest.approx(want, rel=1e-8, abs=1e-10), (target, src)


def test_graph_does_not_depend_on_batch_size_and_offload():
    model, tcs = make("llama"), transcoders()
    kw = dict(max_feature_nodes=12, rerank_every=5)
    graphs = [
        attribution_graph(model, tcs, IDS, batch_size=1, **kw),
        attribution_graph(model, tcs, IDS, batch_size=4, offload="cpu", **kw),
        attribution_graph(model, tcs, IDS, batch_size=64, offload="disk", **kw),
    ]
    ref = graphs[0]
    assert ref.n_features == 12 < ref.n_active_features
    for g in graphs[1:]:
        assert g.nodes == ref.nodes
        torch.testing.assert_close(g.adjacency, ref.adjacency, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(g.constant, ref.constant)
        torch.testing.assert_close(g.pruned, ref.pruned, rtol=1e-10, atol=1e-12)
    assert graphs[2].adjacency.device.type == "cpu"


def test_pruning_keeps_the_most_influential_features_and_their_exact_rows():
    model, tcs = make("gpt2"), transcoders()
    full = attribution_graph(model, tcs, IDS)
    part = attribution_graph(model, tcs, IDS, max_feature_nodes=10, rerank_every=10**6)
    # completeness still holds with what the left-out features sent counted in `pruned`
    assert part.completeness_error() < 1e-9
    assert part.pruned.abs().sum() > 0
    # kept rows are the full graph's rows (kept columns), the dropped columns summed in `pruned`
    fidx = {n: i for i, n in enumerate(full.nodes)}
    cols = [fidx[n] for n in part.nodes[: part.adjacency.shape[1]]]
    dropped = [i for i in range(full.n_features) if full.nodes[i] not in set(part.nodes)]
    for r, t in enumerate(part.targets.tolist()):
        fr = int((full.targets == fidx[part.nodes[t]]).nonzero())
        torch.testing.assert_close(part.adjacency[r], full.adjacency[fr, cols])
        want = full.adjacency[fr, dropped].sum().double()
        assert float(part.pruned[t]) == pytest.approx(float(want), abs=1e-10)
    # with one ranking after the logits' rows, the kept features are the 10 most influential on
    # the logits through those rows alone (direct effects on the logits)
    n_logit = len(full.logit_tokens)
    direct = full.adjacency[-n_logit:, : full.n_features].abs()
    direct = (
        direct / full.adjacency[-n_logit:].abs().sum(1, keepdim=True)
    ).T @ full.logit_probabilities.double()
    top = set(torch.argsort(direct, descending=True, stable=True)[:10].tolist())
    assert {full.nodes[i] for i in top} == {n for n in part.nodes if n.kind == "feature"}


def test_json_export_has_circuit_tracers_structure(tmp_path):
    model, tcs = make("gpt2"), transcoders()
    g = attribution_graph(model, tcs, IDS, max_n_logits=3)
    data = g.to_json(tmp_path / "g.json", slug="demo", scan="tiny", node_threshold=0.9)
    assert json.loads((tmp_path / "g.json").read_text()) == data
    assert set(data) == {"metadata", "qParams", "nodes", "links"}
    meta = data["metadata"]
    assert (
        meta["slug"] == "demo" and meta["scan"] == "tiny" and len(meta["prompt_tokens"]) == len(IDS)
    )
    assert set(data["qParams"]) == {"pinnedIds", "supernodes", "linkType", "clickedId", "sg_pos"}
    want_keys = {
        "node_id",
        "feature",
        "layer",
        "ctx_idx",
        "feature_type",
        "token_prob",
        "is_target_logit",
        "run_idx",
        "reverse_ctx_idx",
        "jsNodeId",
        "clerp",
        "influence",
        "activation",
    }
    ids = set()
    for n in data["nodes"]:
        assert set(n) == want_keys
        ids.add(n["node_id"])
        kind = n["feature_type"]
        assert kind in ("cross layer transcoder", "mlp reconstruction error", "embedding", "logit")
        if kind == "cross layer transcoder":
            layer, feat, pos = map(int, n["node_id"].split("_"))
            node = GraphNode("feature", layer, pos, feat)
            assert n["activation"] == pytest.approx(float(g.values[g.nodes.index(node)]))
            assert n["feature"] == (layer + feat) * (layer + feat + 1) // 2 + feat
        if kind == "logit":
            assert n["layer"] == str(g.n_layers + 1) and n["ctx_idx"] == len(IDS) - 1
    kinds = [n["feature_type"] for n in data["nodes"]]
    assert kinds.count("embedding") == len(IDS)  # tokens and logits are always kept
    assert kinds.count("logit") == len(g.logit_tokens)
    assert sum(n["is_target_logit"] for n in data["nodes"]) == 1
    assert data["links"] and all(
        lk["source"] in ids and lk["target"] in ids for lk in data["links"]
    )
    # a link's weight is the graph's edge
    lk = max(data["links"], key=lambda x: abs(x["weight"]))
    src = next(i for i, n in enumerate(g.nodes) if g._json_node(i, 0.0)["node_id"] == lk["source"])
    tgt = next(i for i, n in enumerate(g.nodes) if g._json_node(i, 0.0)["node_id"] == lk["target"])
    assert lk["weight"] == pytest.approx(float(g.adjacency[int((g.targets == tgt).nonzero()), src]))


def test_refusals_name_the_problem_and_leave_no_hook():
    bert = T.BertForMaskedLM(
        T.BertConfig(
            hidden_size=D,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            vocab_size=VOCAB,
        )
    ).eval()
    # an encoder: not a causal language model, no next token to attribute
    with pytest.raises(ValueError, match=r"BertForMaskedLM is not a causal language model"):
        attribution_graph(bert, transcoders(), IDS)
    assert all_hooks(bert) == 0
    model = make("llama")
    with pytest.raises(ValueError, match=r"every layer 0..1; missing \[1\]"):
        attribution_graph(model, {("mlp_in.0", "mlp_out.0"): Transcoder(0)}, IDS)
    with pytest.raises(ValueError, match=r"'resid_post\.0' where a mlp_in\.L point belongs"):
        attribution_graph(model, {("resid_post.0", "mlp_out.0"): Transcoder(0)}, IDS)
    with pytest.raises(ValueError, match="one prompt"):
        attribution_graph(model, transcoders(), IDS[None].expand(2, -1))
    with pytest.raises(ValueError, match="offload"):
        attribution_graph(model, transcoders(), IDS, offload="gpu")  # type: ignore[arg-type]
    assert all_hooks(model) == 0


def test_strongest_paths_end_at_the_top_logit():
    g = attribution_graph(make("gpt2"), transcoders(), IDS)
    paths = g.strongest_paths(3)
    assert len(paths) == 3
    top = GraphNode("logit", g.n_layers, len(IDS) - 1, int(g.logit_tokens[0]))
    for path, w in paths:
        assert path[-1] == top and w > 0
        prod = 1.0
        for a, b in itertools.pairwise(path):
            prod *= abs(
                float(g.adjacency[int((g.targets == g.nodes.index(b)).nonzero()), g.nodes.index(a)])
            )
        assert prod == pytest.approx(w)
    assert [w for _, w in paths] == sorted((w for _, w in paths), reverse=True)


def test_streamed_buffer_grows_with_kept_nodes_not_active_features(monkeypatch):
    """With max_feature_nodes=K the edge buffer has K + logits rows (one per computed target),
    however many features are active; without, one row per active feature."""
    import pyhook.graph as G

    shapes = []
    real = G._alloc

    def spy(shape, *a, **k):
        shapes.append(tuple(shape))
        return real(shape, *a, **k)

    monkeypatch.setattr(G, "_alloc", spy)
    model, tcs = make("gpt2"), transcoders()
    g = attribution_graph(
        model, tcs, IDS, max_feature_nodes=5, max_n_logits=2, desired_logit_prob=1.0
    )
    n_cols = g.n_active_features + (g.n_layers + 1) * len(IDS)
    assert shapes[0] == (5 + 2, n_cols)  # the edge buffer
    assert tuple(g.adjacency.shape) == (5 + 2, 5 + (g.n_layers + 1) * len(IDS))
    shapes.clear()
    g = attribution_graph(model, tcs, IDS, max_n_logits=2, desired_logit_prob=1.0)
    assert shapes[0] == (g.n_active_features + 2, n_cols)


def test_a_cpu_and_disk_offloaded_model_gives_the_same_graph(tmp_path):
    """accelerate's device_map with a block and the unembedding on disk: the same graph, bitwise
    (the frozen norms and the logit directions read the offloaded weights from accelerate's map)."""
    pytest.importorskip("accelerate")
    model, tcs = make("llama"), transcoders()
    want = attribution_graph(model, tcs, IDS, batch_size=8, max_feature_nodes=20)
    model.save_pretrained(tmp_path / "ckpt")
    off = offloaded_llama(
        tmp_path / "ckpt", tmp_path / "off", disk=("model.layers.1", "lm_head"), dtype=torch.float64
    )
    assert off.model.layers[1].input_layernorm.weight.device.type == "meta"
    assert off.lm_head.weight.device.type == "meta"
    before = all_hooks(off)
    got = attribution_graph(off, tcs, IDS, batch_size=8, max_feature_nodes=20)
    assert all_hooks(off) == before
    assert got.nodes == want.nodes
    for field in ("adjacency", "values", "constant", "pruned"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field


def _tp_model(kind: str, outdir: str, world: int) -> nn.Module:
    """A float64 model sharded over the ranks: transformers' ``tp_plan`` (Llama; Qwen3, whose
    per-head q/k norms run on each rank's heads) or torch's ``parallelize_module`` (Llama)."""
    import os

    if kind != "torch":
        return T.AutoModelForCausalLM.from_pretrained(
            os.path.join(outdir, kind), tp_plan="auto", dtype=torch.float64
        ).eval()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = T.AutoModelForCausalLM.from_pretrained(
        os.path.join(outdir, "llama"), dtype=torch.float64
    ).eval()
    plan = {}
    for i in range(len(model.model.layers)):
        at, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        plan |= {f"{at}.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
        plan |= {f"{mlp}.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")}
        plan |= {f"{at}.o_proj": RowwiseParallel(), f"{mlp}.down_proj": RowwiseParallel()}
    parallelize_module(model, init_device_mesh("cpu", (world,)), plan)
    return model


TP_KINDS = ("llama", "qwen3", "torch")
PRUNED = dict(batch_size=4, max_feature_nodes=12, offload="disk")
WHOLE = dict(batch_size=7, max_n_logits=3, desired_logit_prob=1.0)


def _tp_transcoders(seed: int = 10) -> dict:
    return {(f"mlp_in.{i}", f"mlp_out.{i}"): Transcoder(seed + i, d=32) for i in range(2)}


def _tp_worker(rank: int, world: int, port: int, outdir: str) -> None:
    import os
    import traceback

    import _layout_workers as W

    results: dict = {}
    try:
        W._init(rank, world, port)
        for kind in TP_KINDS:
            model = _tp_model(kind, outdir, world)
            assert any("DTensor" in type(p).__name__ for p in model.parameters()), (
                "the model is not sharded"
            )
            before = all_hooks(model)
            results[kind] = {
                "pruned": attribution_graph(model, _tp_transcoders(), IDS, **PRUNED),
                "whole": attribution_graph(model, _tp_transcoders(), IDS, **WHOLE),
                "hooks_left": all_hooks(model) - before,
            }
        # ranks whose transcoders differ find different features: refused on every rank (no hang)
        model = _tp_model("llama", outdir, world)
        before = all_hooks(model)
        try:
            attribution_graph(model, _tp_transcoders(10 + 5 * rank), IDS)
            results["different"] = None
        except Exception as e:
            results["different"] = (type(e).__name__, str(e))
        results["different_hooks_left"] = all_hooks(model) - before
        # FSDP2 (parameters sharded between forwards, no tensor-parallel style): refused by name
        from torch.distributed.fsdp import fully_shard

        model = T.AutoModelForCausalLM.from_pretrained(
            os.path.join(outdir, "llama"), dtype=torch.float64
        ).eval()
        for block in model.model.layers:
            fully_shard(block)
        fully_shard(model)
        before = all_hooks(model)
        try:
            attribution_graph(model, _tp_transcoders(), IDS)
            results["fsdp"] = None
        except Exception as e:
            results["fsdp"] = (type(e).__name__, str(e))
        results["fsdp_hooks_left"] = all_hooks(model) - before
        torch.distributed.barrier()
    except BaseException:
        results["exception"] = traceback.format_exc()
    finally:
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _same_graph(got: AttributionGraph, want: AttributionGraph, what: str) -> None:
    assert got.nodes == want.nodes, what
    assert torch.equal(got.targets, want.targets), what
    assert torch.equal(got.logit_tokens, want.logit_tokens), what
    for field in ("adjacency", "values", "constant", "pruned"):
        a, b = getattr(got, field).double(), getattr(want, field).double()
        scale = float(b.abs().max())
        # the ranks' partial sums reduce in another order: float64 rounding of the largest entry
        assert float((a - b).abs().max()) <= 1e-12 * scale, (what, field)


@pytest.mark.distributed
def test_a_tensor_parallel_model_gives_the_unsharded_graph(tmp_path):
    """Two gloo ranks, transformers' tp_plan (Llama; Qwen3 with per-head q/k norms) and torch's
    parallelize_module (Llama): every rank's graph is the unsharded model's (pruned and streamed
    to disk, and whole), and the whole one's edges equal autograd through the frozen replacement
    model written with plain hooks on the unsharded model. Ranks whose transcoders differ are
    refused on every rank instead of hanging; FSDP2 is refused by name. No hook is left."""
    import _layout_workers as W
    from test_distributed import _spawn

    W.save_llama(str(tmp_path / "llama"))
    torch.manual_seed(0)
    cfg = T.Qwen3Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=64,
    )
    randomise_norms(T.Qwen3ForCausalLM(cfg)).save_pretrained(tmp_path / "qwen3")
    results = _spawn(_tp_worker, 2, str(tmp_path))
    for kind in TP_KINDS:
        plain = T.AutoModelForCausalLM.from_pretrained(
            tmp_path / ("llama" if kind == "torch" else kind), dtype=torch.float64
        ).eval()
        want = {
            "pruned": attribution_graph(plain, _tp_transcoders(), IDS, **PRUNED),
            "whole": attribution_graph(plain, _tp_transcoders(), IDS, **WHOLE),
        }
        ref = reference(plain, _tp_transcoders(), IDS)
        for r, res in enumerate(results):
            assert res[kind]["hooks_left"] == 0, (kind, r)
            for which in ("pruned", "whole"):
                _same_graph(res[kind][which], want[which], f"{kind} rank {r} {which}")
            assert res[kind]["pruned"].n_features == 12
            mine = _edges(res[kind]["whole"])
            assert set(mine) == set(ref["edges"])
            for target, row in ref["edges"].items():
                for src, value in row.items():
                    assert mine[target][src] == pytest.approx(value, rel=1e-8, abs=1e-10)
    for res in results:
        name, msg = res["different"]
        assert name == "RuntimeError" and "ranks [0, 1]" in msg and "different" in msg, msg
        assert res["different_hooks_left"] == 0
        name, msg = res["fsdp"]
        assert name == "LayoutError" and "offloaded or sharded" in msg, msg
        assert "model.embed_tokens.weight" in msg and res["fsdp_hooks_left"] == 0


# -- every architecture pyhook names -------------------------------------------------------------
def _arch_models():
    import test_points as P

    return P, [a for a in P.ALL_ARCHS if a not in P.ENCODERS]


_P, ARCH_SWEEP = _arch_models()


def _sweep_model(arch: str) -> nn.Module:
    model = _P.build(arch).eval()
    # float64, except mixtures of experts (torch's grouped matmul has no float64 kernel)
    moe = pyhook.points.architecture_of(model).moe
    return randomise_norms(model if moe else model.double())


def _sweep_transcoders(model: nn.Module, ids: torch.Tensor) -> dict:
    n = len(pyhook.points.expand_points(model, "mlp_out.*"))
    with torch.no_grad(), pyhook.TraceDict(model, ["mlp_in.0"]) as ret:
        model(ids[None])
    x = ret["mlp_in.0"].output
    return {
        (f"mlp_in.{i}", f"mlp_out.{i}"): Transcoder(10 + i, d=x.shape[-1]).to(x.dtype)
        for i in range(n)
    }


def _registry_patched() -> bool:
    from pyhook.graph import _attention_functions

    registry = _attention_functions()
    return registry is not None and "get_interface" in registry.__dict__


@pytest.mark.parametrize("arch", ARCH_SWEEP)
def test_every_architecture_gives_a_complete_graph(arch):
    """Every decoder pyhook names (the table of tests/test_points.py): fused query/key/value
    projections (NeoX, Falcon, BLOOM, MPT, Phi-3, CodeGen, StarCoder), parallel blocks, post-norm
    OPT (whose MLP works on [batch*tokens, d]), q/k norms, sandwich norms, mixtures of experts
    (the transcoder replaces the whole routed MLP). The edges into every feature and logit plus
    its constant are its value, computed here without the graph: the transcoder's encoder on a
    plain forward's MLP input, the plain logits minus their mean (completeness holds only if
    every norm scale and attention pattern is held). No hook is left, and transformers'
    attention lookup is as it was."""
    model = _sweep_model(arch)
    ids = _P.ids()[0]
    tcs = _sweep_transcoders(model, ids)
    before = all_hooks(model)
    g = attribution_graph(model, tcs, ids, batch_size=8)
    assert all_hooks(model) == before and not _registry_patched()
    # float64 models whose norms compute in float32: that rounding (see the Limits); the
    # float32 mixtures of experts: float32 sums of a few hundred terms
    tol = 1e-6 if g.adjacency.dtype == torch.float64 else 2e-5 * float(g.values.abs().max())
    assert _complete_against_plain(g, model, tcs, ids, tol) == g.n_features + len(g.logit_tokens)
    assert g.n_features > 20


@pytest.mark.parametrize("arch", ["gpt_neox", "bloom"])
def test_attention_left_live_breaks_completeness(arch, monkeypatch):
    """The check above can fail: with the queries and keys of the fused projections (BLOOM) or
    of transformers' attention functions (NeoX) left live, edges plus constant miss the values."""
    import pyhook.graph as G

    model = _sweep_model(arch)
    ids = _P.ids()[0]
    tcs = _sweep_transcoders(model, ids)
    good = attribution_graph(model, tcs, ids, batch_size=8)
    assert good.completeness_error() < 1e-9
    if arch == "bloom":
        real = G._fused_qk

        def live(attn, layer):
            proj, _idx = real(attn, layer)
            return proj, torch.zeros(0, dtype=torch.long)  # hold no feature

        monkeypatch.setattr(G, "_fused_qk", live)
    else:

        def leaky(fn, module, *a, **k):  # the queries and keys recorded, but handed on live
            G._HELD[id(module)](module, a[0], a[1])
            return fn(module, *a, **k)

        monkeypatch.setattr(G, "_call_held", leaky)
    bad = attribution_graph(model, tcs, ids, batch_size=8)
    assert bad.completeness_error() > 1e-4


def test_an_attention_that_computes_its_pattern_itself_is_refused_by_layer():
    """An attention with no q_proj/k_proj that does not go through transformers' attention
    functions (here: a fused projection pyhook has no layout for) is refused by name, after
    one forward, with no hook left and the attention lookup restored."""
    import pyhook.graph as G

    model = _sweep_model("bloom")
    ids = _P.ids()[0]
    tcs = _sweep_transcoders(model, ids)
    before = all_hooks(model)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(G, "_fused_qk", lambda attn, layer: None)
        with pytest.raises(PointUnavailableError, match=r"layer 0's attention \(BloomAttention\)"):
            attribution_graph(model, tcs, ids)
    assert all_hooks(model) == before and not _registry_patched()


# -- chosen targets: tokens and directions (circuit-tracer's attribution_targets) -----------------
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_chosen_tokens_and_a_logit_difference_equal_autograd(arch):
    """Token targets that are not the most likely ones, and a custom target (a logit
    difference W_U[a] - W_U[b], and a random direction): their edges equal autograd through
    the frozen model written with plain hooks, their values the plain forward's; the logit
    difference's row is the difference of the two tokens' rows (the mean cancels)."""
    model, tcs = make(arch), transcoders()
    with torch.no_grad():
        order = model(IDS[None]).logits[0, -1].sort(descending=True).indices
    a, b = int(order[4]), int(order[9])
    W_U = model.get_output_embeddings().weight.detach()
    rand = torch.randn(D, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    custom = [("a - b", W_U[a] - W_U[b]), ("random", rand)]
    spec = [a, b, *((lbl, w, v) for (lbl, v), w in zip(custom, (0.5, 0.25)))]
    before = all_hooks(model)
    g = attribution_graph(model, tcs, IDS, batch_size=5, attribution_targets=spec)
    assert all_hooks(model) == before
    assert g.logit_tokens.tolist() == [a, b, VOCAB + 2, VOCAB + 3]
    assert g.logit_labels == [None, None, "a - b", "random"]
    assert g.logit_probabilities[2:].tolist() == [0.5, 0.25]
    probs = torch.softmax(model(IDS[None]).logits[0, -1].detach(), -1)
    assert g.logit_probabilities[:2].double().tolist() == pytest.approx(probs[[a, b]].tolist())
    ref = reference(model, tcs, IDS, logit_ids=[a, b], custom=custom)
    mine = _edges(g)
    assert set(mine) == set(ref["edges"])
    for target, row in ref["edges"].items():
        for src, want in row.items():
            assert mine[target][src] == pytest.approx(want, rel=1e-8, abs=1e-10), (target, src)
    for node, want in ref["values"].items():
        assert float(g.values[g.nodes.index(node)]) == pytest.approx(want, rel=1e-9, abs=1e-12)
    rows = {int(t): r for r, t in enumerate(g.targets.tolist())}
    ia, ib, idiff = (len(g.nodes) - 4 + k for k in range(3))
    diff = g.adjacency[rows[ia]] - g.adjacency[rows[ib]]
    assert torch.allclose(g.adjacency[rows[idiff]], diff, rtol=1e-9, atol=1e-12)
    assert float(g.values[idiff]) == pytest.approx(float(g.values[ia] - g.values[ib]))
    tol = 1e-9 if arch == "gpt2" else 1e-6
    assert g.completeness_error() < tol
    # the file circuit-tracer's viewer reads: the custom target's label, its virtual index
    data = g.to_json()
    logit_nodes = [n for n in data["nodes"] if n["feature_type"] == "logit"]
    assert any(n["clerp"].startswith('Output "a - b"') for n in logit_nodes)
    assert any(n["feature"] == VOCAB + 2 for n in logit_nodes)


def test_bad_attribution_targets_are_refused_by_entry():
    model, tcs = make("llama"), transcoders()
    before = all_hooks(model)
    cases = [
        ([3, VOCAB], r"attribution_targets\[1\]: token id 40 is outside the vocabulary"),
        ([("x", 1.0, torch.zeros(D + 1))], r"attribution_targets\[0\] \('x'\).*shape \[16\]"),
        ([("x", -1.0, torch.zeros(D))], r"attribution_targets\[0\]: a custom target is"),
        ([3.5], r"attribution_targets\[0\]: expected a token id"),
        ("the", r"attribution_targets: expected token ids"),
        ([], r"attribution_targets: expected token ids"),
    ]
    for spec, match in cases:
        with pytest.raises((ValueError, TypeError), match=match):
            attribution_graph(model, tcs, IDS, attribution_targets=spec)
        assert all_hooks(model) == before
