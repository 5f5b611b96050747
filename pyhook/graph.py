"""Attribution graphs (circuit tracing) on any architecture pyhook names.

:func:`attribution_graph` builds the graph of direct, linear effects between transcoder
features, error terms, token embeddings and the next-token logits of one prompt, as
circuit-tracer does (Ameisen et al., 2025, "Circuit Tracing"), through the standard points:

* the *replacement model*: each layer's MLP is a transcoder (keys ``("mlp_in.L",
  "mlp_out.L")``, or a cross-layer transcoder ``("mlp_in.L", ["mlp_out.L", ...])``) plus an
  *error node* (what the transcoder misses at that layer and position); every norm's scale and
  every attention pattern is held at its value on the prompt (the queries and keys are taken
  as constants, which freezes the pattern under any attention kernel). What is left between the
  nodes is linear, so an edge is a gradient times an activation, and the edges into a node plus
  its ``constant`` (the biases: what comes from no node) add up to its value;
* many targets per backward pass (a batch of injected gradients, ``batch_size`` rows), the edges
  written into a buffer on the device, in host memory or in a file (``offload``), and pruning by
  influence on the logits (``max_feature_nodes``);
* :class:`AttributionGraph` holds the nodes and edges; :meth:`AttributionGraph.to_json` writes
  circuit-tracer's graph file, which its viewer and Neuronpedia read.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import tempfile
import threading
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor, nn

from .dictionaries import LinearParts, linear_parts, parse_key
from .distributed import LayoutError, _tensor_parallel_axis, is_dtensor
from .lens import hooks
from .modules import LayerNotFoundError
from .points import (
    PointUnavailableError,
    _norm_rule,
    architecture_of,
    expand_points,
    resolve_point,
)

__all__ = ["AttributionGraph", "GraphNode", "attribution_graph"]

KINDS = ("feature", "error", "token", "logit")


@dataclasses.dataclass(frozen=True)
class GraphNode:
    """One node of an :class:`AttributionGraph`.

    ``kind`` is ``"feature"`` (``index``: the feature of the transcoder at ``layer``),
    ``"error"`` (the transcoder's error at ``layer``; ``index`` -1), ``"token"`` (the input
    embedding at ``position``, token and position embeddings together; ``layer`` -1, ``index``
    the token id) or ``"logit"`` (``layer`` the number of layers, ``index`` the token id).

    >>> GraphNode("feature", 2, 5, 117)
    GraphNode(kind='feature', layer=2, position=5, index=117)
    """

    kind: str
    layer: int
    position: int
    index: int


@dataclasses.dataclass
class AttributionGraph:
    """The nodes and direct edges of an attribution graph (see :func:`attribution_graph`).

    Nodes are ordered as circuit-tracer orders them: the kept features (by layer, position,
    feature), the error nodes (by layer, then position), the token nodes, the logit nodes.
    ``adjacency[i, j]`` is the direct effect of node ``j`` on target ``targets[i]``: its rows are
    the nodes with incoming edges (the kept features, then the logits), its columns the nodes that
    can be sources (features, errors, tokens: ``nodes[:adjacency.shape[1]]``).
    ``values`` holds a feature's activation and a logit's value (the logit minus the mean logit,
    scaled as the model scales its logits, before any soft-capping); for error and token nodes
    the norm of the vector they write.
    ``constant`` holds what reaches a node from no node (encoder and model biases), and
    ``pruned`` what reaches it from features left out by ``max_feature_nodes``, so that for
    every target ``adjacency[i].sum() + constant + pruned == values`` (completeness).
    ``logit_tokens`` are the logit nodes' token ids; a custom target (a direction of the
    unembedding's input, see :func:`attribution_graph`'s ``attribution_targets``) has the
    index ``vocabulary size + k`` there, as in circuit-tracer, and its label in
    ``logit_labels`` (None for a token).

    >>> import torch
    >>> g = AttributionGraph(nodes=[GraphNode("token", -1, 0, 5), GraphNode("logit", 1, 0, 3)],
    ...     adjacency=torch.tensor([[2.0]]), targets=torch.tensor([1]), values=torch.tensor([1.0, 2.5]),
    ...     constant=torch.tensor([0.0, 0.5]), pruned=torch.zeros(2), input_ids=torch.tensor([5]),
    ...     logit_tokens=torch.tensor([3]), logit_probabilities=torch.tensor([0.9]), n_layers=1)
    >>> g.completeness_error()
    0.0
    """

    nodes: list[GraphNode]
    adjacency: Tensor
    targets: Tensor
    values: Tensor
    constant: Tensor
    pruned: Tensor
    input_ids: Tensor
    logit_tokens: Tensor
    logit_probabilities: Tensor
    n_layers: int
    n_active_features: int = 0
    logit_labels: list[str | None] | None = None

    @property
    def n_features(self) -> int:
        """The number of feature nodes kept."""
        return sum(1 for n in self.nodes if n.kind == "feature")

    def node_index(self, kind: str, layer: int, position: int, index: int = -1) -> int:
        """The index in :attr:`nodes` of a node (``ValueError`` when it is not in the graph)."""
        return self.nodes.index(GraphNode(kind, layer, position, index))

    def completeness_error(self) -> float:
        """The largest ``|edges in + constant + pruned - value|`` over the targets."""
        t = self.targets
        got = self.adjacency.sum(1).to(self.values.dtype) + self.constant[t] + self.pruned[t]
        return float((got - self.values[t]).abs().max()) if len(t) else 0.0

    def influence(self) -> Tensor:
        """Every node's influence on the logits: the logit probabilities propagated back through
        the row-normalised absolute edges, summed over path lengths (circuit-tracer's node
        influence)."""
        n_src = self.adjacency.shape[1]
        weights = torch.zeros(len(self.nodes), dtype=torch.float64)
        weights[self.targets[self.n_features :]] = self.logit_probabilities.double()
        return _influence(self.adjacency, self.targets, weights, n_src)

    def strongest_paths(
        self, k: int = 5, start: Sequence[str] = ("token",)
    ) -> list[tuple[list[GraphNode], float]]:
        """The ``k`` paths to the top logit with the largest product of edge weights in absolute
        value, each from a node of a kind in ``start`` (a widest-path search over the graph's
        layers), each with that product: one path per start node, the strongest first."""
        n_src = self.adjacency.shape[1]
        n_feat = self.n_features
        if len(self.targets) <= n_feat:
            return []
        top = int(self.targets[n_feat])
        best = torch.zeros(len(self.nodes), dtype=torch.float64)  # best |product| to the logit
        nxt = torch.full((len(self.nodes),), -1, dtype=torch.long)  # the next node on it
        best[top] = 1.0
        # sources always sit in earlier layers than their targets: visit targets top down
        rows = [n_feat, *sorted(range(n_feat), key=lambda r: -self.nodes[r].layer)]
        for r in rows:
            t = int(self.targets[r])
            if best[t] == 0:
                continue
            cand = self.adjacency[r].double().abs() * best[t]
            better = cand > best[:n_src]
            best[:n_src] = torch.where(better, cand, best[:n_src])
            nxt[:n_src] = torch.where(better, torch.full_like(nxt[:n_src], t), nxt[:n_src])
        starts = [j for j in range(n_src) if best[j] > 0 and self.nodes[j].kind in start]
        starts.sort(key=lambda j: -float(best[j]))
        paths: list[tuple[list[GraphNode], float]] = []
        for j in starts[:k]:
            path, cur = [self.nodes[j]], j
            while int(nxt[cur]) != -1:
                cur = int(nxt[cur])
                path.append(self.nodes[cur])
            paths.append((path, float(best[j])))
        return paths

    def to_json(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        slug: str = "pyhook-graph",
        scan: str | Sequence[str] = "pyhook",
        tokenizer: Any = None,
        prompt: str | None = None,
        node_threshold: float = 0.8,
        edge_threshold: float = 0.98,
    ) -> dict[str, Any]:
        """circuit-tracer's graph file (``metadata``, ``qParams``, ``nodes``, ``links``), pruned as
        its ``create_graph_files`` prunes (nodes and edges kept up to ``node_threshold`` /
        ``edge_threshold`` of the total influence on the logits).

        ``path`` a ``.json`` file: the graph is written there. ``path`` a directory (any other
        name; made if missing): the graph is written to ``<path>/<slug>.json`` and its metadata
        added to ``<path>/graph-metadata.json`` (replacing an entry with the same slug), the
        index circuit-tracer's viewer lists, as its ``create_graph_files`` writes them:
        ``python -m circuit_tracer start-server --graph_file_dir <path>`` shows every graph
        written there.
        ``tokenizer`` (anything with ``decode``, e.g. a ``transformers`` tokenizer) turns the
        prompt's tokens and the logits' tokens into text, as circuit-tracer does; without one
        they are the token ids as text. ``prompt`` is the prompt as text (by default the
        tokenizer's ``decode`` of the prompt). ``scan`` names the transcoder set (Neuronpedia
        reads it as the model's id), or is a list of one transcoder id per layer (then written
        as circuit-tracer writes one: ``metadata.scan`` ``"custom-<hash>"`` and the list in
        ``transcoder_list``). ``slug`` names the graph (and its file): letters, digits, ``.``,
        ``_`` and ``-``.

        >>> import torch
        >>> g = AttributionGraph(nodes=[GraphNode("token", -1, 0, 5), GraphNode("logit", 1, 0, 3)],
        ...     adjacency=torch.tensor([[2.0]]), targets=torch.tensor([1]), values=torch.ones(2),
        ...     constant=torch.zeros(2), pruned=torch.zeros(2), input_ids=torch.tensor([5]),
        ...     logit_tokens=torch.tensor([3]), logit_probabilities=torch.tensor([1.0]), n_layers=1)
        >>> [(n["node_id"], n["feature_type"]) for n in g.to_json()["nodes"]]
        [('E_5_0', 'embedding'), ('2_3_0', 'logit')]
        """
        ok = slug.isascii() and slug[:1].isalnum() and all(c.isalnum() or c in "._-" for c in slug)
        if not ok or slug == "graph-metadata":
            raise ValueError(
                "to_json: slug names the graph's file and its address in the viewer: letters, "
                "digits, '.', '_' and '-', starting with a letter or digit, and not "
                f"'graph-metadata' (the viewer's index); got {slug!r}"
            )
        if isinstance(scan, str):
            scan_id, transcoder_list = scan, []
        else:
            transcoder_list = [str(s) for s in scan]
            if not transcoder_list:
                raise ValueError("to_json: scan is an empty list; give a name or one id per layer")
            # circuit-tracer writes "custom-" + hash(...) (Python's hash of a str changes from
            # one process to the next): a stable hash of the same string instead
            import hashlib

            digest = hashlib.sha256("-".join(transcoder_list).encode()).digest()
            scan_id = f"custom-{int.from_bytes(digest[:8], 'big', signed=True)}"
        ids = [int(t) for t in self.input_ids]

        def text(t: int | list[int]) -> str:
            if tokenizer is not None:
                return str(tokenizer.decode(t))
            return str(t) if isinstance(t, int) else " ".join(map(str, t))

        prompt_tokens = [text(t) for t in ids]
        custom = self.logit_labels or [None] * len(self.logit_tokens)
        labels = [
            text(int(t)) if lbl is None else lbl
            for t, lbl in zip(self.logit_tokens, custom, strict=True)
        ]
        node_mask, edge_mask, cumulative = self._prune(node_threshold, edge_threshold)
        n_src = self.adjacency.shape[1]
        out_nodes: dict[int, dict[str, Any]] = {}
        for i in torch.nonzero(node_mask).flatten().tolist():
            out_nodes[i] = self._json_node(i, float(cumulative[i]), labels)
        rows, cols = torch.nonzero(edge_mask, as_tuple=True)
        links = []
        used: set[str] = set()
        for r, c in zip(rows.tolist(), cols.tolist()):
            t = int(self.targets[r])
            if c in out_nodes and t in out_nodes and c < n_src:
                s_id, t_id = out_nodes[c]["node_id"], out_nodes[t]["node_id"]
                links.append(
                    {"source": s_id, "target": t_id, "weight": float(self.adjacency[r, c])}
                )
                used.update((s_id, t_id))
        nodes = [
            n
            for n in out_nodes.values()
            if n["node_id"] in used or n["feature_type"] in ("embedding", "logit")
        ]
        metadata = {
            "slug": slug,
            "scan": scan_id,
            "transcoder_list": transcoder_list,
            "prompt_tokens": prompt_tokens,
            "prompt": text(ids) if prompt is None else prompt,
            "node_threshold": node_threshold,
            "schema_version": 1,
        }
        data = {
            "metadata": metadata,
            "qParams": {
                "pinnedIds": [],
                "supernodes": [],
                "linkType": "both",
                "clickedId": "",
                "sg_pos": "",
            },
            "nodes": nodes,
            "links": links,
        }
        if path is not None:
            _write_graph_files(os.fspath(path), slug, data)
        return data

    def _json_node(
        self, i: int, influence: float, labels: Sequence[str] | None = None
    ) -> dict[str, Any]:
        """Node ``i`` as circuit-tracer's ``Node`` (its fields, in its order); ``labels``: the
        logit tokens as text."""
        n = self.nodes[i]
        token_prob, is_target, clerp, activation = 0.0, False, "", None
        inf: float | None = influence
        if n.kind == "feature":
            x, y = n.layer, n.index
            node_id = f"{n.layer}_{n.index}_{n.position}"
            feature = (x + y) * (x + y + 1) // 2 + y  # circuit-tracer's Cantor pairing
            layer = str(n.layer)
            kind = "cross layer transcoder"
            js_id = f"{n.layer}_{n.index}-0"
            activation = float(self.values[i])
        elif n.kind == "error":
            # circuit-tracer 0.5.0 writes "0_{layer}_{pos}", the id of layer 0's feature `layer`
            # at the same position (its issue #78, fixed upstream as this one)
            node_id = f"{n.layer}_-1_{n.position}"
            feature, layer, kind = -1, str(n.layer), "mlp reconstruction error"
            js_id = f"{n.layer}_{n.position}-0"
        elif n.kind == "token":
            node_id = f"E_{n.index}_{n.position}"
            feature, layer, kind = n.position, "E", "embedding"
            js_id = f"E_{n.index}-{n.position}"
        else:
            k = i - (len(self.nodes) - len(self.logit_tokens))
            token_prob = float(self.logit_probabilities[k])
            layer = str(self.n_layers + 1)
            node_id = f"{layer}_{n.index}_{n.position}"
            feature, kind, is_target = n.index, "logit", k == 0
            js_id = f"L_{n.index}-{n.position}"
            label = labels[k] if labels is not None else str(n.index)
            clerp = f'Output "{label}" (p={token_prob:.3f})'
            inf = None  # circuit-tracer gives a logit node no influence
        return {
            "node_id": node_id,
            "feature": feature,
            "layer": layer,
            "ctx_idx": n.position,
            "feature_type": kind,
            "token_prob": token_prob,
            "is_target_logit": is_target,
            "run_idx": 0,
            "reverse_ctx_idx": 0,
            "jsNodeId": js_id,
            "clerp": clerp,
            "influence": inf,
            "activation": activation,
        }

    def _prune(self, node_threshold: float, edge_threshold: float) -> tuple[Tensor, Tensor, Tensor]:
        """circuit-tracer's pruning: (node mask over nodes, edge mask over adjacency, each
        node's cumulative influence rank)."""
        for name, v in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1, got {v}")
        n = len(self.nodes)
        n_src = self.adjacency.shape[1]
        n_logits = len(self.logit_tokens)
        n_tokens = len(self.input_ids)
        n_feat = self.n_features
        adj = self.adjacency.double()
        weights = torch.zeros(n, dtype=torch.float64)
        weights[n - n_logits :] = self.logit_probabilities.double()
        influence = _influence(adj, self.targets, weights, n_src)
        node_mask = influence >= _threshold(influence, node_threshold)
        node_mask[n - n_logits - n_tokens :] = True
        keep_rows = node_mask[self.targets]
        pruned = adj.clone()
        pruned[~keep_rows] = 0
        pruned[:, ~node_mask[:n_src]] = 0
        norm = _normalise(pruned)
        node_inf = _influence(pruned, self.targets, weights, n_src) + weights
        edge_scores = norm * node_inf[self.targets][:, None]
        edge_mask = edge_scores >= _threshold(edge_scores.flatten(), edge_threshold)
        while True:
            old = node_mask.clone()
            edge_mask[~node_mask[self.targets]] = False
            edge_mask[:, ~node_mask[:n_src]] = False
            has_out = torch.zeros(n, dtype=torch.bool)
            has_out[:n_src] = edge_mask.any(0)
            node_mask[: n - n_logits - n_tokens] &= has_out[: n - n_logits - n_tokens]
            has_in = torch.zeros(n, dtype=torch.bool)
            has_in[self.targets] = edge_mask.any(1)
            node_mask[:n_feat] &= has_in[:n_feat]
            if torch.equal(old, node_mask):
                break
        scores, order = torch.sort(influence, descending=True)
        cumulative = torch.zeros_like(influence)
        total = scores.sum()
        cumulative[order] = torch.cumsum(scores, 0) / (total if total > 0 else 1.0)
        return node_mask, edge_mask, cumulative


def _write_graph_files(path: str, slug: str, data: dict[str, Any]) -> None:
    """``data`` to the file ``path`` (a ``.json`` name); or, ``path`` a directory (any other
    name), to ``<path>/<slug>.json`` with
    its metadata in the directory's ``graph-metadata.json`` (what circuit-tracer's
    ``create_graph_files`` writes and its viewer lists)."""
    if path.endswith(".json") and not os.path.isdir(path):
        with open(path, "w") as f:
            json.dump(data, f)
        return
    index = os.path.join(path, "graph-metadata.json")
    graphs: list[Any] = []
    if os.path.exists(index):  # read (and refuse) the index before writing anything
        with open(index) as f:
            try:
                old = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"to_json: {index} is not JSON ({e})") from None
        if not (isinstance(old, dict) and isinstance(old.get("graphs"), list)):
            raise ValueError(f'to_json: {index} is not a viewer index ({{"graphs": [...]}})')
        graphs = [g for g in old["graphs"] if not (isinstance(g, dict) and g.get("slug") == slug)]
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, f"{slug}.json"), "w") as f:
        json.dump(data, f)
    graphs.append(data["metadata"])
    tmp = f"{index}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"graphs": graphs}, f, indent=2)
    os.replace(tmp, index)


def _normalise(adj: Tensor) -> Tensor:
    a = adj.abs()
    return a / a.sum(1, keepdim=True).clamp_min(1e-10)


def _influence(adj: Tensor, targets: Tensor, weights: Tensor, n_src: int) -> Tensor:
    """Influence of every node on the weighted targets: ``w A + w A^2 + ...`` over the
    row-normalised absolute adjacency (rows ``targets``, columns the first ``n_src`` nodes)."""
    norm = _normalise(adj.double())
    n = weights.shape[0]
    total = torch.zeros(n, dtype=torch.float64)
    cur = weights.clone()
    for _ in range(4 * n + 8):
        nxt = torch.zeros(n, dtype=torch.float64)
        nxt[:n_src] = cur[targets] @ norm
        if not bool(nxt.any()):
            return total
        total += nxt
        cur = nxt
    raise RuntimeError("influence did not converge: the graph has a cycle")


def _threshold(scores: Tensor, fraction: float) -> Tensor:
    s = torch.sort(scores, descending=True).values
    total = s.sum()
    if total <= 0:
        return s[-1] if len(s) else torch.tensor(0.0)
    cum = torch.cumsum(s, 0) / total
    i = min(int(torch.searchsorted(cum, torch.tensor(fraction, dtype=cum.dtype))), len(s) - 1)
    return s[i]


# -- the replacement model ---------------------------------------------------------------------
class _Layer(NamedTuple):
    """A transcoder: the layer it reads, the layers it writes, and its weights."""

    key: Any
    layer: int
    outs: list[int]
    parts: LinearParts


def _layer_of(model: nn.Module, name: str, kind: str, n_layers: int, key: Any) -> int:
    head, _, idx = name.partition(".")
    if head != kind or not idx.lstrip("-").isdigit():
        raise ValueError(
            f"transcoder key {key!r}: expected ('mlp_in.L', 'mlp_out.L') or ('mlp_in.L', "
            f"['mlp_out.L', ...]), got {name!r} where a {kind}.L point belongs"
        )
    layer = int(idx)
    if not -n_layers <= layer < n_layers:
        raise LayerNotFoundError(
            name, f"transcoder key {key!r}: {name!r} is not one of {n_layers} layers"
        )
    return layer % n_layers


def _transcoders(model: nn.Module, transcoders: Mapping[Any, Any], n_layers: int) -> list[_Layer]:
    if not isinstance(transcoders, Mapping) or not transcoders:
        raise TypeError(
            "transcoders must be a dict {('mlp_in.L', 'mlp_out.L'): transcoder, ...} with one "
            f"per layer, got {type(transcoders).__name__}"
        )
    out: list[_Layer] = []
    for key, d in transcoders.items():
        src, dsts, _clt = parse_key(key)
        layer = _layer_of(model, src, "mlp_in", n_layers, key)
        outs = [_layer_of(model, s, "mlp_out", n_layers, key) for s in dsts]
        if any(o < layer for o in outs):
            raise ValueError(f"transcoder key {key!r}: writes a layer before the one it reads")
        parts = linear_parts(d)
        w_dec = parts.W_dec if isinstance(parts.W_dec, list) else [parts.W_dec]
        if len(w_dec) != len(outs):
            raise ValueError(
                f"transcoder key {key!r}: {len(outs)} output point(s) but its decoder has "
                f"{len(w_dec)}"
            )
        out.append(_Layer(key, layer, outs, parts))
    read = sorted(t.layer for t in out)
    if read != list(range(n_layers)):
        missing = sorted(set(range(n_layers)) - set(read))
        twice = sorted({r for r in read if read.count(r) > 1})
        raise ValueError(
            f"transcoders: an attribution graph needs one transcoder reading mlp_in.L at every "
            f"layer 0..{n_layers - 1}; missing {missing}, read twice {twice}"
        )
    return sorted(out, key=lambda t: t.layer)


def _parts_list(x: Tensor | list[Tensor]) -> list[Tensor]:
    return x if isinstance(x, list) else [x]


class _Freeze:
    """The frozen parts of the replacement model: every norm's scale and every attention's
    queries and keys, recorded on the prompt (``mode="record"``), detached (``"detach"``: the
    forward is the model's, the gradient sees constants) or replayed (``"replay"``: the recorded
    values, whatever the input)."""

    def __init__(self, model: nn.Module, n_layers: int) -> None:
        self.model = model
        self.norms: list[tuple[nn.Module, Any]] = []
        self.whole: dict[int, Any] = {}  # norms whose weights are DTensors: the whole weights
        for name, m in model.named_modules():
            rule = _norm_rule(m)
            if rule is not None:
                self.norms.append((m, rule))
                if any(is_dtensor(p) for p in m.parameters(recurse=False)):
                    self.whole[id(m)] = _whole(m)
            elif "Norm" in type(m).__name__ and any(True for _ in m.parameters(recurse=False)):
                raise PointUnavailableError(
                    name,
                    f"attribution graph: {name!r} ({type(m).__name__}) is a norm pyhook does not "
                    "know, so its scale cannot be held constant",
                )
        # the queries and keys, found (in this order) as the attention's q_proj/k_proj, as the
        # attn_q/attn_k points (GPT-2's fused c_attn), or where the attention hands them to
        # transformers' attention functions (after rotary and any q/k norm: fused projections)
        self.qk_modules: list[nn.Module] = []
        self.qk_points: list[str] = []
        self.fused: list[tuple[nn.Module, Tensor]] = []  # (projection, query and key features)
        self.attentions: dict[int, tuple[int, nn.Module]] = {}  # id -> (layer, module)
        for layer in range(n_layers):
            attn = resolve_point(model, f"attn_in.{layer}").module
            proj = _qk_projections(attn)
            if proj is not None:
                self.qk_modules += proj
                continue
            try:
                resolve_point(model, f"attn_q.{layer}")
                resolve_point(model, f"attn_k.{layer}")
            except LookupError:
                pass
            else:
                self.qk_points += [f"attn_q.{layer}", f"attn_k.{layer}"]
                continue
            fused = _fused_qk(attn, layer)
            if fused is not None:
                self.fused.append(fused)
                continue
            if _attention_functions() is None:
                raise PointUnavailableError(
                    f"attn_q.{layer}",
                    f"attribution graph: layer {layer}'s attention ({type(attn).__name__}) has "
                    "no q_proj/k_proj and no attn_q/attn_k points, and this transformers has no "
                    "AttentionInterface.get_interface, so its pattern cannot be held constant",
                )
            self.attentions[id(attn)] = (layer, attn)
        self.called: set[int] = set()
        self.scales: dict[int, list[Tensor]] = {}
        self.qk: dict[Any, list[Tensor]] = {}

    def check_attention(self) -> None:
        """After the recording pass: refuse, by layer, an attention that did not hand its
        queries and keys to transformers' attention functions (it computes its pattern itself,
        so the pattern could not be held)."""
        for layer, attn in sorted(self.attentions.values(), key=lambda t: t[0]):
            if id(attn) not in self.called:
                raise PointUnavailableError(
                    f"attn_q.{layer}",
                    f"attribution graph: layer {layer}'s attention ({type(attn).__name__}) has "
                    "no q_proj/k_proj, no attn_q/attn_k points, and computes its attention "
                    "itself (not through transformers' attention functions), so its pattern "
                    "cannot be held constant",
                )

    @contextmanager
    def active(self, mode: str) -> Iterator[None]:
        handles = []
        calls: dict[Any, int] = {}

        def take(store: dict[Any, list[Tensor]], key: Any, value: Tensor) -> Tensor:
            i = calls.get(key, 0)
            calls[key] = i + 1
            if mode == "record":
                store.setdefault(key, []).append(value.detach())
                return value
            if mode == "detach":
                return value.detach()
            saved = store[key][i]
            return saved.expand_as(value) if saved.shape != value.shape else saved

        for m, rule in self.norms:

            def on_norm(
                mod: nn.Module, args: Any, kwargs: Any, output: Any, rule: Any = rule
            ) -> Any:
                x = args[0] if args else next(v for v in kwargs.values() if isinstance(v, Tensor))
                centred, scale = rule.parts(x)
                scale = take(self.scales, id(mod), scale)
                if mode == "record":  # the model's own output (its own rounding)
                    return None
                weights = self.whole.get(id(mod)) or _in_memory(mod, x.device)
                out = rule.affine(weights, centred / scale, x.dtype)
                if isinstance(output, tuple):
                    return (out, *output[1:])
                return out

            handles.append(m.register_forward_hook(on_norm, with_kwargs=True))
        for m in self.qk_modules:

            def on_qk(mod: nn.Module, args: Any, output: Tensor) -> Tensor:
                return take(self.qk, id(mod), output)

            handles.append(m.register_forward_hook(on_qk))
        for m, idx in self.fused:

            def on_fused(mod: nn.Module, args: Any, output: Tensor, idx: Tensor = idx) -> Any:
                i = idx.to(output.device)
                held = take(self.qk, id(mod), output.index_select(-1, i))
                return None if mode == "record" else output.index_copy(-1, i, held)

            handles.append(m.register_forward_hook(on_fused))
        fwd: list[tuple[str, Callable[..., Any]]] = [
            (name, lambda t, hook: take(self.qk, hook.name, t)) for name in self.qk_points
        ]

        def hold(module: nn.Module, query: Tensor, key: Tensor) -> tuple[Tensor, Tensor]:
            if mode == "record":
                self.called.add(id(module))
            return take(self.qk, (id(module), "q"), query), take(self.qk, (id(module), "k"), key)

        held = dict.fromkeys(self.attentions, hold)
        try:
            with (
                hooks(self.model, fwd_hooks=fwd) if fwd else _nothing(),
                _held_attention(held) if held else _nothing(),
            ):
                yield
        finally:
            for h in handles:
                h.remove()


def _qk_projections(attn: nn.Module) -> list[nn.Module] | None:
    """The query and key projections of an attention module: its ``q_proj``/``k_proj``, or
    the one pair of them among its submodules (GPT-Neo's ``attention.q_proj``)."""
    q, k = getattr(attn, "q_proj", None), getattr(attn, "k_proj", None)
    if isinstance(q, nn.Module) and isinstance(k, nn.Module):
        return [q, k]
    found: dict[str, list[nn.Module]] = {"q_proj": [], "k_proj": []}
    for name, m in attn.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in found:
            found[leaf].append(m)
    if len(found["q_proj"]) == 1 and len(found["k_proj"]) == 1:
        return [found["q_proj"][0], found["k_proj"][0]]
    return None


def _fused_qk(attn: nn.Module, layer: int) -> tuple[nn.Module, Tensor] | None:
    """The fused query/key/value projection of an attention that computes its pattern itself
    (not through transformers' attention functions), and which of its output features are the
    queries and keys: BLOOM's per-head ``[q | k | v]``, MPT's ``[q | k | v]``."""
    cls = type(attn).__name__
    if cls == "BloomAttention":
        heads, hd = int(attn.num_heads), int(attn.head_dim)
        idx = torch.arange(heads * 3 * hd).view(heads, 3, hd)[:, :2].flatten()
        return attn.query_key_value, idx
    if cls == "MptAttention":
        if getattr(attn, "clip_qkv", None):
            raise PointUnavailableError(
                f"attn_v.{layer}",
                f"attribution graph: layer {layer}'s attention (MptAttention) clips its values "
                f"(clip_qkv={attn.clip_qkv}), which is not linear in the residual stream",
            )
        return attn.Wqkv, torch.arange(2 * int(attn.hidden_size))
    return None


# -- queries and keys where attentions hand them to transformers' attention functions --------
_HELD: dict[int, Callable[[nn.Module, Tensor, Tensor], tuple[Tensor, Tensor]]] = {}
_HELD_LOCK = threading.Lock()
_HELD_USERS = [0]


def _attention_functions() -> Any:
    """transformers' ``ALL_ATTENTION_FUNCTIONS`` (through whose ``get_interface`` its
    attentions pick their kernel), or None where there is none."""
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except Exception:
        return None
    fn = getattr(type(ALL_ATTENTION_FUNCTIONS), "get_interface", None)
    return ALL_ATTENTION_FUNCTIONS if callable(fn) else None


def _call_held(fn: Callable[..., Any], module: Any, *args: Any, **kwargs: Any) -> Any:
    hold = _HELD.get(id(module))
    if hold is not None:
        if len(args) >= 2:
            query, key = hold(module, args[0], args[1])
            args = (query, key, *args[2:])
        else:
            kwargs["query"], kwargs["key"] = hold(module, kwargs["query"], kwargs["key"])
    return fn(module, *args, **kwargs)


@contextmanager
def _held_attention(
    entries: dict[int, Callable[[nn.Module, Tensor, Tensor], tuple[Tensor, Tensor]]],
) -> Iterator[None]:
    """While active, the attention modules in ``entries`` (by id) hand their queries and keys
    to ``entries[id](module, query, key)`` before transformers' attention function (any
    kernel) sees them; every other module's attention is untouched. The kernel lookup is
    wrapped once per process however many graphs are being built (threads)."""
    registry = _attention_functions()
    with _HELD_LOCK:
        if _HELD_USERS[0] == 0:
            own = registry.__dict__.get("get_interface")
            pick = (
                own if own is not None else types.MethodType(type(registry).get_interface, registry)
            )

            def get_interface(attn_implementation: Any, default: Any) -> Any:
                return functools.partial(_call_held, pick(attn_implementation, default))

            get_interface._pyhook_previous = own  # type: ignore[attr-defined]
            registry.get_interface = get_interface
        _HELD_USERS[0] += 1
        _HELD.update(entries)
    try:
        yield
    finally:
        with _HELD_LOCK:
            for k in entries:
                _HELD.pop(k, None)
            _HELD_USERS[0] -= 1
            if _HELD_USERS[0] == 0:
                previous = registry.get_interface._pyhook_previous
                if previous is None:
                    del registry.get_interface
                else:
                    registry.get_interface = previous


def _offload_map(mod: nn.Module) -> Any:
    """accelerate's map of an offloaded module's weights (None when it has none)."""
    return getattr(getattr(mod, "_hf_hook", None), "weights_map", None)


def _in_memory(mod: nn.Module, device: Any = None) -> Any:
    """``mod`` itself, or, when accelerate has offloaded its weights (they are on the meta
    device outside its forward), an object with its ``weight`` and ``bias`` read from
    accelerate's map of offloaded weights."""
    w = getattr(mod, "weight", None)
    if not (isinstance(w, Tensor) and w.device.type == "meta"):
        return mod
    wm = _offload_map(mod)
    out = {}
    for name in ("weight", "bias"):
        p = getattr(mod, name, None)
        if isinstance(p, Tensor):
            p = wm[name] if p.device.type == "meta" else p
            out[name] = p.to(device) if device is not None else p
        else:
            out[name] = None
    return types.SimpleNamespace(**out)


def _whole(mod: nn.Module) -> Any:
    """``mod``'s ``weight`` and ``bias`` whole, where they are DTensors (a tensor-parallel
    model's sharded or replicated parameters: ``full_tensor()``, a collective every rank of the
    group makes in the same order)."""
    out = {}
    for name in ("weight", "bias"):
        p = getattr(mod, name, None)
        out[name] = p.full_tensor() if is_dtensor(p) else p
    return types.SimpleNamespace(**out)


def _check_same(tp: Any, what: str, value: Any) -> None:
    """Refuse, on every rank of the tensor-parallel group, a ``value`` that is not the same
    on all of them (the graph's shapes, which every rank's collectives depend on)."""
    if tp is None or tp.group is None:
        return
    import torch.distributed as dist

    seen: list[Any] = [None] * len(tp.ranks)
    dist.all_gather_object(seen, value, group=tp.group)
    if any(v != seen[0] for v in seen):
        raise RuntimeError(
            f"attribution graph: the ranks {tp.ranks} of the tensor-parallel group found "
            f"different {what} ({', '.join(f'rank {r}: {v}' for r, v in zip(tp.ranks, seen))}); "
            "their activations differ by more than the rounding the graph tolerates"
        )


def _agreed(tp: Any, value: list[Any]) -> list[Any]:
    """``value`` as the first rank of the tensor-parallel group has it: the choices that decide
    which backward passes run (which features, in which order) must be the same on every rank,
    or their collectives would not pair up."""
    if tp is None or tp.group is None:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=tp.ranks[0], group=tp.group)
    return box[0]


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _logit_scale(logits: Tensor, unembedded: Tensor) -> float:
    """The factor between the model's logits and its unembedding's output, where one is a
    multiple of the other (1.0 where they differ otherwise: a soft-cap)."""
    if torch.equal(logits, unembedded):
        return 1.0
    norm = float((unembedded * unembedded).sum())
    if norm == 0.0:
        return 1.0
    s = float((logits * unembedded).sum()) / norm
    err = float((logits - s * unembedded).abs().max())
    return s if err <= 1e-5 * float(logits.abs().max()) else 1.0


class _Targets(NamedTuple):
    """The logit nodes: token ids (custom targets: vocabulary size + k), weights in the
    influence, directions injected at the unembedding's input (float64), labels (None: a
    token), and the model's logit scale."""

    tokens: Tensor
    weights: Tensor
    vectors: Tensor
    labels: list[str | None]
    scale: float

    def value(self, unembedded: Tensor, final: Tensor) -> Tensor:
        """Each target's value, from the unembedding's output and input at the last position:
        a token's logit minus the mean logit (times the model's logit scale), a custom
        target's direction dotted with the input."""
        out = torch.empty(len(self.tokens), dtype=torch.float64, device=final.device)
        for k, (t, lbl) in enumerate(zip(self.tokens.tolist(), self.labels, strict=True)):
            if lbl is None:
                out[k] = self.scale * (unembedded[t] - unembedded.mean())
            else:
                out[k] = final @ self.vectors[k].to(final.device, torch.float64)
        return out


def _logit_targets(
    spec: Sequence[Any] | Tensor | None,
    probs: Tensor,
    W_U: Tensor,
    scale: float,
    max_n_logits: int,
    desired_logit_prob: float,
) -> _Targets:
    vocab, d_model = W_U.shape
    mean = W_U.double().mean(0)
    if spec is None:
        top_p, top_i = probs.sort(descending=True)
        n = int((top_p.cumsum(0) < desired_logit_prob).sum()) + 1
        n = max(1, min(n, max_n_logits, top_p.numel()))
        tokens = top_i[:n].cpu()
        vectors = scale * (W_U[tokens.to(W_U.device)].double() - mean)
        return _Targets(tokens, top_p[:n].cpu(), vectors.cpu(), [None] * n, scale)
    entries = spec.tolist() if isinstance(spec, Tensor) else list(spec)
    if isinstance(spec, (str, bytes)) or not entries:
        raise ValueError(
            "attribution_targets: expected token ids or (label, weight, vector) custom targets, "
            f"got {spec!r}"
        )
    tokens, weights, vectors, labels = [], [], [], []
    for k, e in enumerate(entries):
        if isinstance(e, (int,)) and not isinstance(e, bool):
            if not 0 <= e < vocab:
                raise ValueError(
                    f"attribution_targets[{k}]: token id {e} is outside the vocabulary "
                    f"(0..{vocab - 1})"
                )
            tokens.append(e)
            weights.append(float(probs[e]))
            vectors.append(scale * (W_U[e].double() - mean).cpu())
            labels.append(None)
            continue
        if not (isinstance(e, (tuple, list)) and len(e) == 3):
            raise TypeError(
                f"attribution_targets[{k}]: expected a token id or a (label, weight, vector) "
                f"custom target, got {type(e).__name__}"
            )
        label, weight, vec = e
        vec = torch.as_tensor(vec)
        ok = isinstance(weight, (int, float)) and not isinstance(weight, bool)
        if not isinstance(label, str) or not ok or not (weight >= 0 and weight < float("inf")):
            raise TypeError(
                f"attribution_targets[{k}]: a custom target is (label: str, weight: a finite "
                f"number >= 0, vector), got ({label!r}, {weight!r}, ...)"
            )
        if tuple(vec.shape) != (d_model,) or not vec.is_floating_point():
            raise ValueError(
                f"attribution_targets[{k}] ({label!r}): the vector must be a float tensor of "
                f"shape [{d_model}] (the unembedding's input), got {tuple(vec.shape)} {vec.dtype}"
            )
        tokens.append(vocab + k)
        weights.append(float(weight))
        vectors.append(vec.detach().double().cpu())
        labels.append(label)
    return _Targets(
        torch.tensor(tokens, dtype=torch.long),
        torch.tensor(weights, dtype=torch.float64),
        torch.stack(vectors),
        labels,
        scale,
    )


def _logits_kwargs(model: nn.Module) -> dict[str, Any]:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"logits_to_keep": 1} if "logits_to_keep" in params else {}


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: Any, offload: str | None) -> Tensor:
    """A zeroed buffer on ``device``, in host memory (``"cpu"``) or in a file mapped into memory
    (``"disk"``: the file is unlinked at once, so it goes with the last view of it)."""
    if offload is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    if offload == "cpu":
        return torch.zeros(shape, dtype=dtype)
    fd, path = tempfile.mkstemp(prefix="pyhook-graph-", suffix=".bin")
    os.close(fd)
    n = 1
    for s in shape:
        n *= s
    try:
        t = torch.from_file(path, shared=True, size=n, dtype=dtype)
    finally:
        os.unlink(path)
    return t.view(shape)


def attribution_graph(
    model: nn.Module,
    transcoders: Mapping[Any, Any],
    input_ids: Tensor | Sequence[int],
    max_n_logits: int = 10,
    desired_logit_prob: float = 0.95,
    max_feature_nodes: int | None = None,
    batch_size: int = 32,
    offload: Literal["cpu", "disk"] | None = None,
    *,
    attribution_targets: Sequence[Any] | Tensor | None = None,
    rerank_every: int = 256,
    feature_chunk: int = 8192,
) -> AttributionGraph:
    """The attribution graph of the next token after ``input_ids`` (one prompt, ``[T]`` or
    ``[1, T]``) through the replacement model of ``model`` with ``transcoders``
    (``{("mlp_in.L", "mlp_out.L"): transcoder}`` at every layer, or cross-layer transcoders
    ``("mlp_in.L", ["mlp_out.L", "mlp_out.L+1", ...])``; anything :func:`~pyhook.dictionaries.linear_parts`
    reads). Norm scales and attention patterns are held at their values on the
    prompt; see :class:`AttributionGraph` for what the graph holds.

    The logit nodes are the most likely next tokens until their probabilities add up to
    ``desired_logit_prob`` (at most ``max_n_logits``), each as its logit minus the mean logit.
    ``attribution_targets`` chooses the logit nodes instead, as circuit-tracer's does: token
    ids (each its logit minus the mean logit, weighted by its probability), or custom targets
    ``(label, weight, vector)``: ``vector`` a direction of the unembedding's input (``[d_model]``;
    ``W_U[a] - W_U[b]`` attributes a logit difference), the node's value the last position's
    final residual (after the final norm) dotted with it, ``weight`` its share in the influence
    that ranks and prunes features. They can be mixed.
    ``batch_size`` targets share one backward pass. With ``max_feature_nodes`` only that many
    features get incoming edges and are kept: the ones with the most influence on the logits,
    re-estimated from the rows computed so far every ``rerank_every`` features (so the graph
    does not depend on ``batch_size``); the buffer of edges then has ``max_feature_nodes +
    logits`` rows, and lives on the model's device, in host memory (``offload="cpu"``) or in a
    temporary file mapped into memory (``offload="disk"``). The graph is returned in host
    memory (its adjacency in such a file with ``offload="disk"``). Models offloaded by
    accelerate and tensor-parallel models (transformers' ``tp_plan``, torch's
    ``parallelize_module``; every rank calls this with the same arguments) give the graph of
    the model in memory, unsharded, on every rank.

    >>> import torch, transformers, pyhook
    >>> cfg = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=32)
    >>> model = transformers.GPT2LMHeadModel(cfg).eval()
    >>> class Transcoder(torch.nn.Module):
    ...     def __init__(self, d=16, n=24):
    ...         super().__init__()
    ...         self.W_enc = torch.nn.Parameter(torch.randn(d, n) / 4); self.b_enc = torch.nn.Parameter(torch.zeros(n))
    ...         self.W_dec = torch.nn.Parameter(torch.randn(n, d) / 4); self.b_dec = torch.nn.Parameter(torch.zeros(d))
    ...     def encode(self, x): return torch.relu(x @ self.W_enc + self.b_enc)
    ...     def decode(self, f): return f @ self.W_dec + self.b_dec
    >>> tcs = {(f"mlp_in.{i}", f"mlp_out.{i}"): Transcoder() for i in range(2)}
    >>> g = pyhook.attribution_graph(model, tcs, torch.tensor([1, 5, 7, 2]), max_n_logits=3)
    >>> sorted({n.kind for n in g.nodes})
    ['error', 'feature', 'logit', 'token']
    >>> g.completeness_error() < 1e-3
    True
    """
    if offload not in (None, "cpu", "disk"):
        raise ValueError(f"offload must be None, 'cpu' or 'disk', got {offload!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype not in (torch.long, torch.int, torch.int32):
        raise ValueError(
            f"input_ids must be one prompt of token ids, [T] or [1, T], got {tuple(ids.shape)}"
        )
    architecture_of(model)  # a model without standard points is refused by name, first
    can_generate = getattr(model, "can_generate", None)
    if callable(can_generate) and not can_generate():
        raise ValueError(
            f"attribution graph: {type(model).__name__} is not a causal language model (it "
            "cannot generate): the graph attributes the next token after the prompt"
        )
    tp = _tensor_parallel_axis(
        model,
        "an attribution graph runs on models sharded by transformers' tp_plan or by "
        "torch's parallelize_module with its standard styles",
    )
    for mname, mod in model.named_modules():
        for pname, prm in mod.named_parameters(recurse=False):
            offloaded = prm.device.type == "meta" and _offload_map(mod) is None
            if offloaded or (tp is None and is_dtensor(prm)):
                raise LayoutError(
                    f"attribution graph: '{mname}.{pname}' is offloaded or sharded "
                    f"({prm.device.type}, {type(prm).__name__}) in a way the graph cannot "
                    "read (it reads norm and unembedding weights in hooks): accelerate's "
                    "offloading, tensor parallelism and unsharded models are supported"
                )
    if model.training:
        raise RuntimeError("attribution graph: put the model in eval() mode (dropout is active)")
    n_layers = len(expand_points(model, "mlp_out.*"))
    tcs = _transcoders(model, transcoders, n_layers)
    get_out = getattr(model, "get_output_embeddings", None)
    lm_head = get_out() if callable(get_out) else None
    if not isinstance(lm_head, nn.Linear):
        raise LayerNotFoundError(
            "lm_head", f"attribution graph: {type(model).__name__} has no linear output embedding"
        )
    freeze = _Freeze(model, n_layers)
    W_U = (_whole(lm_head) if tp is not None else _in_memory(lm_head)).weight.detach()
    device = W_U.device
    dtype = W_U.dtype
    buf_dtype = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    ids = ids.to(device).long()
    T = ids.numel()
    kw = _logits_kwargs(model)

    # 1. the prompt: every point the graph needs, norm scales, queries and keys
    rec: dict[str, Tensor] = {}
    names = [
        "embed",
        *(f"mlp_in.{i}" for i in range(n_layers)),
        *(f"mlp_out.{i}" for i in range(n_layers)),
    ]
    # points the model computes as [batch * tokens, d] (OPT's MLP): seen here as [batch, T, d]
    flat = {n for n in [*names, "final"] if resolve_point(model, n).flat}

    def tokens(t: Tensor, name: str) -> Tensor:
        return t.unflatten(0, (-1, T)) if name in flat else t

    def keep(t: Tensor, hook: Any) -> None:
        rec[hook.name] = tokens(t.detach(), hook.name)

    lm_out: dict[str, Tensor] = {}

    def on_lm(mod: nn.Module, args: Any, output: Tensor) -> None:
        lm_out["x"] = output.detach()[:, -1]
        lm_out["in"] = args[0].detach()[:, -1]

    h = lm_head.register_forward_hook(on_lm)
    try:
        with (
            torch.no_grad(),
            freeze.active("record"),
            hooks(model, fwd_hooks=[(n, keep) for n in names]),
        ):
            out = model(ids[None], **kw)
    finally:
        h.remove()
    freeze.check_attention()
    # the graph's buffers go where the activations are: an offloaded model runs its layers on
    # its execution device while the weights read above stay in accelerate's map (host memory)
    device = rec["embed"].device
    for t in tcs:  # before any transcoder computes: each beside the activations it reads
        at = rec[f"mlp_in.{t.layer}"].device
        p = t.parts
        held = [p.W_enc, p.b_enc, *_parts_list(p.W_dec), *_parts_list(p.b_dec)]
        held += [p.input_bias] if p.input_bias is not None else []
        devices = sorted({str(w.device) for w in held})
        if devices != [str(at)]:
            raise ValueError(
                f"attribution graph: the transcoder at {t.key!r} is on {', '.join(devices)}, "
                f"but mlp_in.{t.layer} runs on {at}: move the transcoders beside the model "
                f"(.to('{at}'))"
            )
    logits = (out.logits if hasattr(out, "logits") else out[0])[0, -1].double()
    probs = torch.softmax(logits, -1)
    lm_real = lm_out["x"][0].double()
    final_real = lm_out["in"][0].double()
    # a model that scales its unembedding's output (Cohere's logit_scale, Granite's
    # logits_scaling) has logit nodes on its own scale; a soft-cap (not linear) is left out
    scale = _logit_scale(logits, lm_real)
    tgt = _logit_targets(attribution_targets, probs, W_U, scale, max_n_logits, desired_logit_prob)
    n_logits = len(tgt.tokens)
    logit_tokens, logit_probs = tgt.tokens.to(device), tgt.weights.to(device)
    logit_vecs = tgt.vectors.to(device=device, dtype=buf_dtype)
    logit_values = tgt.value(lm_real, final_real)

    # 2. features, reconstructions and errors
    embed = rec["embed"][0].to(buf_dtype)
    recon = [
        torch.zeros(T, embed.shape[-1], dtype=buf_dtype, device=device) for _ in range(n_layers)
    ]
    b_dec = [torch.zeros(embed.shape[-1], dtype=buf_dtype, device=device) for _ in range(n_layers)]
    feat_layer, feat_pos, feat_idx, feat_act = [], [], [], []
    enc_in: list[Tensor] = []
    with torch.no_grad():
        for t in tcs:
            p = t.parts
            x = rec[f"mlp_in.{t.layer}"][0].to(p.W_enc.dtype)
            act = p.pre_to_post(p.pre(x))
            pos, idx = torch.nonzero(act, as_tuple=True)
            feat_layer.append(torch.full_like(pos, t.layer))
            feat_pos.append(pos)
            feat_idx.append(idx)
            feat_act.append(act[pos, idx].to(buf_dtype))
            for o, w, b in zip(t.outs, _parts_list(p.W_dec), _parts_list(p.b_dec)):
                recon[o] += (act @ w + b).to(buf_dtype)
                b_dec[o] += b.detach().to(buf_dtype)
            enc_in.append(x)
    f_layer = torch.cat(feat_layer)
    f_pos = torch.cat(feat_pos)
    f_idx = torch.cat(feat_idx)
    f_act = torch.cat(feat_act)
    n_active = len(f_act)
    if tp is not None:
        key = (f_layer * 1_000_003 + f_pos) * 7_919 + f_idx
        _check_same(
            tp,
            "active features or logit nodes",
            (n_active, int(key.sum()), int((key * key % 65_521).sum()), logit_tokens.tolist()),
        )
    errors = [rec[f"mlp_out.{i}"][0].to(buf_dtype) - recon[i] for i in range(n_layers)]
    starts = [0]
    for a in feat_act:
        starts.append(starts[-1] + len(a))

    # 3. the constants: the frozen model with every node's contribution at zero
    zero: dict[str, Tensor] = {}
    lm_out.clear()

    def zero_embed(t: Tensor, hook: Any) -> Tensor:
        return torch.zeros_like(t)

    def zero_mlp(t: Tensor, hook: Any) -> Tensor:
        return b_dec[int(hook.name.split(".")[1])].to(t.dtype).expand_as(t).clone()

    def keep_zero(t: Tensor, hook: Any) -> None:
        zero[hook.name] = tokens(t.detach(), hook.name)

    fwd: list[tuple[str, Callable[..., Any]]] = [("embed", zero_embed)]
    fwd += [(f"mlp_out.{i}", zero_mlp) for i in range(n_layers)]
    fwd += [(f"mlp_in.{i}", keep_zero) for i in range(n_layers)]
    h = lm_head.register_forward_hook(on_lm)
    try:
        with torch.no_grad(), freeze.active("replay"), hooks(model, fwd_hooks=fwd):
            model(ids[None], **kw)
    finally:
        h.remove()
    logit_const = tgt.value(lm_out["x"][0].double(), lm_out["in"][0].double())
    feat_const = torch.empty(n_active, dtype=torch.float64, device=device)
    with torch.no_grad():
        for j, t in enumerate(tcs):
            s, e = starts[j], starts[j + 1]
            pre0 = t.parts.pre(zero[f"mlp_in.{t.layer}"][0].to(t.parts.W_enc.dtype))
            feat_const[s:e] = pre0[f_pos[s:e], f_idx[s:e]].double()

    # decoder rows of the active features, scaled by their activations, per output layer
    writes: list[list[tuple[int, Tensor, Tensor]]] = [[] for _ in range(n_layers)]  # by source
    for j, t in enumerate(tcs):
        s, e = starts[j], starts[j + 1]
        for o, w in zip(t.outs, _parts_list(t.parts.W_dec)):
            vec = w.detach()[f_idx[s:e]].to(buf_dtype) * f_act[s:e, None]
            writes[j].append((o, vec, f_pos[s:e]))
    enc_vecs_by_layer = {t.layer: t.parts.W_enc.detach().to(buf_dtype) for t in tcs}

    # 4. the backward passes: one forward of batch_size copies, many injected gradients
    n_err = n_layers * T
    n_cols = n_active + n_err + T
    max_feat = (
        n_active if max_feature_nodes is None else max(0, min(int(max_feature_nodes), n_active))
    )
    buf = _alloc((max_feat + n_logits, n_cols), buf_dtype, device, offload)
    row_node = torch.zeros(max_feat + n_logits, dtype=torch.long)

    B = batch_size
    leaves: dict[str, Tensor] = {}
    kept: dict[str, Tensor] = {}

    def leaf(name: str, value: Tensor) -> Any:
        def fn(t: Tensor, hook: Any) -> Tensor:
            v = value.to(t.dtype).expand(B, -1, -1).clone().requires_grad_(True)
            leaves[name] = v
            return v.reshape(t.shape)

        return fn

    def keep_grad(t: Tensor, hook: Any) -> Tensor:
        kept[hook.name] = tokens(t, hook.name)
        return t.detach()  # the MLP runs on a constant: it is replaced by its transcoder

    def keep_final(t: Tensor, hook: Any) -> None:
        kept["final"] = tokens(t, "final")

    fwd = [("embed", leaf("embed", rec["embed"][0]))]
    fwd += [(f"mlp_out.{i}", leaf(f"mlp_out.{i}", rec[f"mlp_out.{i}"][0])) for i in range(n_layers)]
    fwd += [(f"mlp_in.{i}", keep_grad) for i in range(n_layers)]
    fwd += [("final", keep_final)]
    inputs_names = ["embed", *(f"mlp_out.{i}" for i in range(n_layers))]

    def rows_for(kinds: list[tuple[int, int]], vecs: Tensor) -> Tensor:
        """Edge rows of targets: ``kinds[b] = (layer, position)`` (layer ``n_layers``: the
        logits), each with the gradient ``vecs[b]`` injected there."""
        nb = len(kinds)
        grads_out: dict[str, Tensor] = {}
        for b, (layer, pos) in enumerate(kinds):
            name = "final" if layer == n_layers else f"mlp_in.{layer}"
            g = grads_out.get(name)
            if g is None:
                ref = kept[name]
                g = grads_out[name] = torch.zeros_like(ref)
            g[b, pos] = vecs[b].to(g.dtype)
        outs = list(grads_out)
        got = torch.autograd.grad(
            [kept[n] for n in outs],
            [leaves[n] for n in inputs_names],
            grad_outputs=[grads_out[n] for n in outs],
            retain_graph=True,
            allow_unused=True,
        )
        g_embed = got[0]
        g_mlp = got[1:]
        rows = torch.zeros(nb, n_cols, dtype=buf_dtype, device=device)
        with torch.no_grad():
            for j in range(n_layers):
                s = starts[j]
                for o, vec, at in writes[j]:
                    gm = g_mlp[o]
                    if gm is None:
                        continue
                    gm = gm[:nb].to(buf_dtype)
                    for c in range(0, len(at), feature_chunk):
                        sl = slice(c, c + feature_chunk)
                        rows[:, s + c : s + c + len(at[sl])] += torch.einsum(
                            "bnd,nd->bn", gm[:, at[sl]], vec[sl]
                        )
            for o in range(n_layers):
                gm = g_mlp[o]
                if gm is not None:
                    rows[:, n_active + o * T : n_active + (o + 1) * T] = (
                        gm[:nb].to(buf_dtype) * errors[o]
                    ).sum(-1)
            if g_embed is not None:
                rows[:, n_active + n_err :] = (g_embed[:nb].to(buf_dtype) * embed).sum(-1)
        return rows

    try:
        with torch.enable_grad(), freeze.active("detach"), hooks(model, fwd_hooks=fwd):
            model(ids[None].expand(B, T), **kw)
        for name in inputs_names:
            if name not in leaves:
                raise RuntimeError(f"attribution graph: the point {name!r} did not run")

        # the logits first
        for i in range(0, n_logits, B):
            sl = slice(i, min(i + B, n_logits))
            rows = rows_for([(n_layers, T - 1)] * (sl.stop - sl.start), logit_vecs[sl])
            buf[sl] = rows.to(buf.device)
            row_node[sl] = torch.arange(sl.start, sl.stop) + n_active + n_err + T
        # then the features, the most influential first
        st = n_logits
        visited = torch.zeros(n_active, dtype=torch.bool)
        n_vis = 0
        while n_vis < max_feat:
            if max_feat == n_active:
                pending = torch.arange(n_active)
            else:
                weights = torch.zeros(n_cols + n_logits, dtype=torch.float64)
                weights[n_cols:] = logit_probs.double().cpu()
                inf = _influence(buf[:st].cpu(), row_node[:st], weights, n_cols)
                rank = torch.argsort(inf[:n_active], descending=True, stable=True)
                pending = rank[~visited[rank]][: min(rerank_every, max_feat - n_vis)]
                pending = torch.as_tensor(_agreed(tp, pending.tolist()), dtype=torch.long)
            for i in range(0, len(pending), B):
                idx = pending[i : i + B]
                kinds = [(int(f_layer[k]), int(f_pos[k])) for k in idx]
                vecs = torch.stack(
                    [enc_vecs_by_layer[int(f_layer[k])][:, int(f_idx[k])] for k in idx]
                )
                rows = rows_for(kinds, vecs)
                buf[st : st + len(idx)] = rows.to(buf.device)
                row_node[st : st + len(idx)] = idx
                visited[idx] = True
                st += len(idx)
                n_vis += len(idx)
    finally:
        leaves.clear()
        kept.clear()

    # 5. the graph: kept features (in node order), errors, tokens, logits
    selected = torch.nonzero(visited).flatten()
    order = torch.argsort(row_node[:st])  # features (ascending index) then logits
    n_kept = len(selected)
    n_src = n_kept + n_err + T
    col_keep = torch.cat([selected, torch.arange(n_active, n_cols)])
    dropped = torch.ones(n_active, dtype=torch.bool)
    dropped[selected] = False
    adjacency = _alloc((n_kept + n_logits, n_src), buf_dtype, "cpu", offload)  # host or file
    pruned_rows = torch.zeros(n_kept + n_logits, dtype=torch.float64)
    col_keep_d = col_keep.to(buf.device)
    drop_d = torch.nonzero(dropped).flatten().to(buf.device)
    for r0 in range(0, st, 1024):
        rsel = order[r0 : r0 + 1024].to(buf.device)
        block = buf[rsel]
        adjacency[r0 : r0 + len(rsel)] = block[:, col_keep_d].to(adjacency.device)
        if len(drop_d):
            pruned_rows[r0 : r0 + len(rsel)] = block[:, drop_d].double().sum(1).cpu()
    del buf
    nodes: list[GraphNode] = []
    sel_l, sel_p, sel_i = (
        f_layer[selected].tolist(),
        f_pos[selected].tolist(),
        f_idx[selected].tolist(),
    )
    nodes += [GraphNode("feature", a, b, c) for a, b, c in zip(sel_l, sel_p, sel_i)]
    nodes += [GraphNode("error", layer, p, -1) for layer in range(n_layers) for p in range(T)]
    tok = ids.tolist()
    nodes += [GraphNode("token", -1, p, tok[p]) for p in range(T)]
    nodes += [GraphNode("logit", n_layers, T - 1, int(t)) for t in logit_tokens.tolist()]
    n_nodes = len(nodes)
    values = torch.zeros(n_nodes, dtype=torch.float64)
    constant = torch.zeros(n_nodes, dtype=torch.float64)
    pruned = torch.zeros(n_nodes, dtype=torch.float64)
    values[:n_kept] = f_act[selected].double().cpu()
    values[n_kept : n_kept + n_err] = (
        torch.stack([e.double().norm(dim=-1) for e in errors]).flatten().cpu()
    )
    values[n_kept + n_err : n_src] = embed.double().norm(dim=-1).cpu()
    values[n_src:] = logit_values.cpu()
    constant[:n_kept] = feat_const[selected.to(device)].cpu()
    constant[n_src:] = logit_const.cpu()
    targets = torch.cat([torch.arange(n_kept), torch.arange(n_src, n_nodes)])
    pruned[targets] = pruned_rows
    graph = AttributionGraph(
        nodes=nodes,
        adjacency=adjacency,
        targets=targets,
        values=values,
        constant=constant,
        pruned=pruned,
        input_ids=ids.cpu(),
        logit_tokens=logit_tokens.cpu(),
        logit_probabilities=logit_probs.float().cpu(),
        n_layers=n_layers,
        n_active_features=n_active,
        logit_labels=tgt.labels if any(x is not None for x in tgt.labels) else None,
    )
    return graph
