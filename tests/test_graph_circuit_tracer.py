"""AttributionGraph.to_json against circuit-tracer's own code (circuit-tracer 0.5.0, installed
with ``--no-deps``: its graph, pruning, graph-file and viewer modules need only torch, pydantic
and transformers).

The reference: the same graph as circuit-tracer's ``Graph`` (its node order, its square adjacency
with all-zero rows for errors and tokens, ``active_features`` and ``activation_values`` of every
active feature found here with plain hooks and the transcoders' ``encode``, ``selected_features``
the kept ones, as its ``attribute`` leaves them with ``max_feature_nodes``), written by its
``create_graph_files`` (its ``prune_graph``, ``create_nodes``, ``create_used_nodes_and_edges``,
``build_model``) with a tokenizer saved beside the model; then its local server, fetched over
HTTP as its viewer fetches.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

pytest.importorskip("circuit_tracer")
T = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from circuit_tracer.attribution.targets import LogitTarget  # noqa: E402
from circuit_tracer.frontend import local_server  # noqa: E402
from circuit_tracer.frontend.graph_models import Model, Node  # noqa: E402
from circuit_tracer.graph import Graph  # noqa: E402
from circuit_tracer.utils.create_graph_files import (  # noqa: E402
    build_model,
    create_graph_files,
    create_nodes,
    create_used_nodes_and_edges,
)
from circuit_tracer.utils.tl_nnsight_mapping import UnifiedConfig  # noqa: E402
from test_graph import IDS, VOCAB, _parts, make, transcoders  # noqa: E402

from pyhook.graph import AttributionGraph, GraphNode, attribution_graph  # noqa: E402

ASSETS = Path(str(local_server.DEFAULT_FRONTEND_DIR))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A word-level tokenizer of the test models' vocabulary, saved as a model's tokenizer is
    (circuit-tracer loads it by ``cfg.tokenizer_name``): tokens with a leading space, a newline
    and a quote among them."""
    words = {i: f"w{i}" for i in range(VOCAB)} | {3: " the", 7: "\n", 9: '"q'}
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in words.items()}, unk_token="w0")
    )
    path = tmp_path_factory.mktemp("tokenizer")
    T.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(path)
    return path


@contextmanager
def default_dtype(dtype: torch.dtype):
    """circuit-tracer's pruning makes its logit weights in the default dtype: the graph's."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@pytest.fixture
def fixed_error_ids(monkeypatch):
    """circuit-tracer 0.5.0 with its issue #78 fixed as upstream fixed it (error nodes
    ``{layer}_-1_{pos}``): the one place pyhook's file differs on purpose (see
    test_circuit_tracer_0_5_error_ids_collide_and_ours_do_not)."""
    orig = Node.error_node.__func__

    def error_node(cls, layer, pos, influence=None):
        node = orig(cls, layer, pos, influence=influence)
        node.node_id = f"{layer}_-1_{pos}"
        return node

    monkeypatch.setattr(Node, "error_node", classmethod(error_node))


def their_graph(g: AttributionGraph, model, tcs, tokenizer, tok_dir, scan="tiny") -> Graph:
    """``g`` as circuit-tracer's Graph, built from plain hooks and node identities."""
    blocks, _ = _parts(model)
    n_layers, n_pos = len(blocks), len(IDS)
    mlp_in: dict[int, torch.Tensor] = {}
    handles = [
        b.mlp.register_forward_pre_hook(lambda m, a, i=i: mlp_in.__setitem__(i, a[0][0]))
        for i, b in enumerate(blocks)
    ]
    try:
        with torch.no_grad():
            logits = model(IDS[None]).logits[0, -1]
    finally:
        for h in handles:
            h.remove()
    # every active feature, in the order of circuit-tracer's sparse activation matrix
    active, acts = [], []
    with torch.no_grad():
        for i in range(n_layers):
            a = tcs[(f"mlp_in.{i}", f"mlp_out.{i}")].encode(mlp_in[i])
            for p, f in torch.nonzero(a).tolist():
                active.append((i, p, f))
                acts.append(float(a[p, f]))
    assert g.n_active_features == len(active)
    kept = {(n.layer, n.position, n.index) for n in g.nodes if n.kind == "feature"}
    selected = [k for k, a in enumerate(active) if a in kept]
    assert len(selected) == len(kept)  # every kept feature is an active one
    order = [GraphNode("feature", *active[k][:2], active[k][2]) for k in selected]
    order += [GraphNode("error", layer, p, -1) for layer in range(n_layers) for p in range(n_pos)]
    order += [GraphNode("token", -1, p, int(IDS[p])) for p in range(n_pos)]
    order += [GraphNode("logit", n_layers, n_pos - 1, int(t)) for t in g.logit_tokens]
    # the square adjacency (rows targets, columns sources): zero rows for errors and tokens,
    # zero columns for the logits
    n = len(order)
    adj = torch.zeros(n, n, dtype=g.adjacency.dtype)
    row_of = {int(t): r for r, t in enumerate(g.targets)}
    col = [g.nodes.index(node) for node in order]
    n_src = g.adjacency.shape[1]
    src = [k for k in range(n) if col[k] < n_src]
    for k in range(n):
        if col[k] in row_of:
            adj[k, src] = g.adjacency[row_of[col[k]], [col[s] for s in src]]
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(g.logit_probabilities.double(), probs[g.logit_tokens].double())
    c = model.config
    cfg = UnifiedConfig(
        n_layers=n_layers,
        d_model=c.hidden_size,
        d_head=c.hidden_size // c.num_attention_heads,
        n_heads=c.num_attention_heads,
        d_mlp=getattr(c, "intermediate_size", None) or 4 * c.hidden_size,
        d_vocab=c.vocab_size,
        tokenizer_name=str(tok_dir),
        model_name="test",
        original_architecture=type(model).__name__,
    )
    return Graph(
        input_string=tokenizer.decode(IDS),
        input_tokens=IDS,
        active_features=torch.tensor(active),
        adjacency_matrix=adj,
        cfg=cfg,
        selected_features=torch.tensor(selected),
        activation_values=torch.tensor(acts, dtype=adj.dtype),
        logit_targets=[LogitTarget(tokenizer.decode(int(t)), int(t)) for t in g.logit_tokens],
        logit_probabilities=probs[g.logit_tokens].to(adj.dtype),
        scan=scan,
    )


def assert_same_graph_file(ours: dict, theirs: dict, rel: float) -> None:
    """The same metadata and qParams, the same nodes (fields and order) and links (order and
    weights), floats to ``rel``."""
    assert ours["metadata"] == theirs["metadata"]
    assert ours["qParams"] == theirs["qParams"]
    assert [n["node_id"] for n in ours["nodes"]] == [n["node_id"] for n in theirs["nodes"]]
    for a, b in zip(ours["nodes"], theirs["nodes"]):
        assert list(a) == list(b), a["node_id"]  # the same fields in the same order
        for k in a:
            if isinstance(b[k], float):
                assert a[k] == pytest.approx(b[k], rel=rel, abs=1e-12), (a["node_id"], k)
            else:
                assert a[k] == b[k], (a["node_id"], k)
    key = [(lk["source"], lk["target"]) for lk in ours["links"]]
    assert key == [(lk["source"], lk["target"]) for lk in theirs["links"]]
    for a, b in zip(ours["links"], theirs["links"]):
        assert a["weight"] == pytest.approx(b["weight"], rel=1e-6, abs=1e-12)


CASES = [  # arch, dtype, max_feature_nodes, node_threshold, edge_threshold
    ("gpt2", torch.float64, None, 0.8, 0.98),
    ("llama", torch.float64, 8, 0.8, 0.98),
    ("llama", torch.float64, None, 0.5, 0.9),
    ("gpt2", torch.float32, 10, 0.9, 0.99),
]


@pytest.mark.parametrize(("arch", "dtype", "max_feat", "nt", "et"), CASES)
def test_graph_file_equals_circuit_tracers(
    arch, dtype, max_feat, nt, et, tmp_path, tokenizer_dir, fixed_error_ids
):
    model = make(arch).to(dtype)
    tcs = {k: v.to(dtype) for k, v in transcoders().items()}
    g = attribution_graph(
        model, tcs, IDS, max_n_logits=4, max_feature_nodes=max_feat, rerank_every=4
    )
    if max_feat is not None:
        assert g.n_features == max_feat < g.n_active_features
    tok = T.AutoTokenizer.from_pretrained(tokenizer_dir)
    ref = their_graph(g, model, tcs, tok, tokenizer_dir)
    with default_dtype(dtype):
        create_graph_files(ref, "demo", tmp_path / "theirs", node_threshold=nt, edge_threshold=et)
    theirs = json.loads((tmp_path / "theirs" / "demo.json").read_text())
    data = g.to_json(
        tmp_path / "ours", slug="demo", scan="tiny", tokenizer=tok, node_threshold=nt,
        edge_threshold=et,
    )  # fmt: skip
    ours = json.loads((tmp_path / "ours" / "demo.json").read_text())
    assert ours == data
    # to float32 rounding: pyhook keeps the logit probabilities (the influence's weights) in
    # float32; circuit-tracer's are here the float64 softmax of the plain forward
    assert_same_graph_file(ours, theirs, 1e-6)
    # the pruning kept some of every kind, and dropped some
    kinds = {n["feature_type"] for n in ours["nodes"]}
    assert kinds == {"cross layer transcoder", "mlp reconstruction error", "embedding", "logit"}
    assert len(ours["nodes"]) < len(g.nodes)
    # the viewer's index, as circuit-tracer writes it
    index = json.loads((tmp_path / "ours" / "graph-metadata.json").read_text())
    assert index == json.loads((tmp_path / "theirs" / "graph-metadata.json").read_text())
    # and circuit-tracer's own model of the file reads it
    model_ = Model.model_validate(ours)
    assert len(model_.nodes) == len(ours["nodes"]) and model_.metadata.slug == "demo"


def test_prompt_tokens_and_scan_lists_as_circuit_tracers_build_model(
    tokenizer_dir, fixed_error_ids
):
    """The three steps of create_graph_files called directly: ``scan`` as a list of per-layer
    transcoder ids gives ``custom-<hash>`` and the list; the hash is a stable one (circuit-
    tracer's is Python's ``hash``, which changes from one process to the next)."""
    model, tcs = make("llama"), transcoders()
    g = attribution_graph(model, tcs, IDS, max_n_logits=3)
    tok = T.AutoTokenizer.from_pretrained(tokenizer_dir)
    scan = ["tc-layer-0", "tc-layer-1"]
    ref = their_graph(g, model, tcs, tok, tokenizer_dir, scan=scan)
    from circuit_tracer.graph import prune_graph

    with default_dtype(torch.float64):
        node_mask, edge_mask, cumulative = prune_graph(ref, 0.8, 0.98)
    nodes = create_nodes(ref, node_mask, tok, cumulative)
    used_nodes, used_edges = create_used_nodes_and_edges(ref, nodes, edge_mask)
    theirs = build_model(ref, used_nodes, used_edges, "demo", scan, 0.8, tok).model_dump()
    ours = g.to_json(slug="demo", scan=scan, tokenizer=tok)
    assert ours["metadata"]["transcoder_list"] == theirs["metadata"]["transcoder_list"] == scan
    assert ours["metadata"]["scan"].startswith("custom-")
    assert theirs["metadata"]["scan"].startswith("custom-")
    assert g.to_json(slug="demo", scan=scan)["metadata"]["scan"] == ours["metadata"]["scan"]
    assert g.to_json(slug="demo", scan=scan[::-1])["metadata"]["scan"] != ours["metadata"]["scan"]
    ours["metadata"]["scan"] = theirs["metadata"]["scan"]
    # prompt tokens decoded one by one (spaces and newlines kept), the prompt decoded whole
    assert ours["metadata"]["prompt_tokens"] == [tok.decode(int(t)) for t in IDS]
    assert ours["metadata"]["prompt"] == tok.decode(IDS.tolist())
    assert_same_graph_file(ours, theirs, 1e-6)


def test_circuit_tracer_0_5_error_ids_collide_and_ours_do_not(tokenizer_dir):
    """circuit-tracer 0.5.0 names the error node of layer L at position p "0_L_p": the id of
    layer 0's feature L at p (its issue #78; fixed upstream as "L_-1_p", which pyhook writes).
    On this prompt such a feature is active and kept, so 0.5.0's file holds one id twice."""
    # feature_node(layer, pos, feature), error_node(layer, pos)
    assert Node.error_node(1, 6).node_id == Node.feature_node(0, 6, 1).node_id == "0_1_6"
    model, tcs = make("gpt2"), transcoders()
    g = attribution_graph(model, tcs, IDS, max_n_logits=3)
    tok = T.AutoTokenizer.from_pretrained(tokenizer_dir)
    ref = their_graph(g, model, tcs, tok, tokenizer_dir)
    from circuit_tracer.graph import prune_graph

    with default_dtype(torch.float64):
        node_mask, edge_mask, cumulative = prune_graph(ref, 0.8, 0.98)
    nodes = create_nodes(ref, node_mask, tok, cumulative)
    used, _ = create_used_nodes_and_edges(ref, nodes, edge_mask)
    their_ids = [n.node_id for n in used]
    assert len(set(their_ids)) < len(their_ids)  # the collision, on a real graph
    ours = g.to_json(tokenizer=tok)
    our_ids = [n["node_id"] for n in ours["nodes"]]
    assert len(set(our_ids)) == len(our_ids) == len(their_ids)
    for n in ours["nodes"]:
        if n["feature_type"] == "mlp reconstruction error":
            assert n["node_id"] == f"{n['layer']}_-1_{n['ctx_idx']}"
            assert n["jsNodeId"] == f"{n['layer']}_{n['ctx_idx']}-0"  # as 0.5.0 writes it


# -- circuit-tracer's viewer ------------------------------------------------------------------
# What its JavaScript reads from a graph file (attribution_graph/*.js, util.js, index.html)
VIEWER_NODE_FIELDS = (
    "node_id", "feature", "layer", "ctx_idx", "feature_type", "clerp", "influence", "activation",
)  # fmt: skip
VIEWER_METADATA_FIELDS = ("slug", "scan", "prompt_tokens", "schema_version", "transcoder_list")
VIEWER_INDEX_FIELDS = ("slug", "scan", "prompt", "node_threshold")
VIEWER_LINK_FIELDS = ("source", "target", "weight")


def _js() -> str:
    files = sorted((ASSETS / "attribution_graph").glob("*.js"))
    return "\n".join(p.read_text() for p in [*files, ASSETS / "util.js", ASSETS / "index.html"])


def test_the_viewer_reads_every_field_it_needs_from_our_file(tokenizer_dir):
    js = _js()
    for field in (
        *VIEWER_NODE_FIELDS,
        *VIEWER_METADATA_FIELDS,
        *VIEWER_INDEX_FIELDS,
        *VIEWER_LINK_FIELDS,
    ):
        assert re.search(rf"\.{field}\b", js), f"the viewer no longer reads {field!r}"
    assert "./graph_data/${slug}.json" in js and "./data/graph-metadata.json" in js
    g = attribution_graph(make("llama"), transcoders(), IDS, max_n_logits=3)
    tok = T.AutoTokenizer.from_pretrained(tokenizer_dir)
    data = g.to_json(tokenizer=tok, slug="viewer")
    meta = data["metadata"]
    assert all(f in meta for f in VIEWER_METADATA_FIELDS)
    assert meta["schema_version"] == 1  # the viewer then reads `feature` as Cantor pairs
    ids = {n["node_id"] for n in data["nodes"]}
    for n in data["nodes"]:
        assert all(f in n for f in VIEWER_NODE_FIELDS), n
        assert n["feature_type"] in (
            "cross layer transcoder", "mlp reconstruction error", "embedding", "logit",
        )  # fmt: skip
        assert isinstance(n["layer"], str) and 0 <= n["ctx_idx"] < len(meta["prompt_tokens"])
        if n["feature_type"] == "cross layer transcoder":
            assert isinstance(n["activation"], float)  # shown as "Act:" and in the histogram
            layer, index = map(int, n["node_id"].split("_")[:2])
            z = n["feature"]
            w = int(((8 * z + 1) ** 0.5 - 1) // 2)  # the viewer's util.cantorUnpair
            y = z - w * (w + 1) // 2
            assert (w - y, y) == (layer, index)
        if n["feature_type"] == "logit":
            # the viewer parses the token and the probability out of the clerp
            token = n["clerp"].split('"')[1]
            assert token == tok.decode(int(n["feature"]))
            p = float(n["clerp"].split("(p=")[1].split(")")[0])
            assert p == pytest.approx(n["token_prob"], abs=5e-4)
        else:
            assert isinstance(n["influence"], float)  # the pruning slider filters on it
    for lk in data["links"]:
        assert lk["source"] in ids and lk["target"] in ids
        assert isinstance(lk["weight"], float)
    assert sum(n["is_target_logit"] for n in data["nodes"]) == 1


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.status, r.read()


def test_circuit_tracers_server_serves_our_graphs_as_the_viewer_asks(tmp_path, tokenizer_dir):
    """Two graphs written to one directory with to_json; circuit-tracer's server over it (its
    request handler and Server, on a free 127.0.0.1 port); the index page, the scripts it loads
    from the server, the graph listing and each listed graph at the path the viewer requests."""
    tok = T.AutoTokenizer.from_pretrained(tokenizer_dir)
    out = tmp_path / "graphs"
    written = {}
    for slug, arch in (("gpt2-demo", "gpt2"), ("llama-demo", "llama")):
        g = attribution_graph(make(arch), transcoders(), IDS, max_n_logits=3)
        written[slug] = g.to_json(f"{out}/", slug=slug, scan="tiny", tokenizer=tok)
    # rewriting one graph replaces its entry in the listing
    written["gpt2-demo"] = g.to_json(out, slug="gpt2-demo", scan="tiny", tokenizer=tok)
    handler = functools.partial(
        local_server.CircuitGraphHandler,
        frontend_dir=local_server.DEFAULT_FRONTEND_DIR,
        data_dir=str(out),
    )
    httpd = local_server.ReusableTCPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    server = local_server.Server(httpd, thread)
    try:
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        status, page = _get(f"{base}/")
        assert status == 200 and b"./data/graph-metadata.json" in page
        scripts = re.findall(r"src='\./([^']+)'", page.decode())
        assert "attribution_graph/init-cg.js" in scripts
        for src in scripts:
            assert _get(f"{base}/{src}")[0] == 200, src
        status, body = _get(f"{base}/data/graph-metadata.json")
        listing = json.loads(body)["graphs"]
        assert sorted(x["slug"] for x in listing) == ["gpt2-demo", "llama-demo"]
        for entry in listing:
            assert all(f in entry for f in VIEWER_INDEX_FIELDS)
            assert entry == written[entry["slug"]]["metadata"]
            # the viewer's request for the graph (init-cg.js), with its query string
            status, body = _get(f"{base}/graph_data/{entry['slug']}.json?v=1")
            assert status == 200 and json.loads(body) == written[entry["slug"]]
        assert any("graph_data/llama-demo.json" in line for line in server.get_logs())
    finally:
        server.stop()


def test_bad_slug_scan_and_index_are_refused_by_name(tmp_path):
    g = attribution_graph(make("gpt2"), transcoders(), IDS, max_n_logits=2)
    for slug in ("", "a/b", "my graph", "graph-metadata", "-x"):
        with pytest.raises(ValueError, match="slug"):
            g.to_json(tmp_path, slug=slug)
    with pytest.raises(ValueError, match="scan is an empty list"):
        g.to_json(scan=[])
    (tmp_path / "graph-metadata.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"graph-metadata\.json is not a viewer index"):
        g.to_json(tmp_path, slug="ok")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["graph-metadata.json"]  # nothing written
