"""Patching and attribution over the standard points: which components carry a behaviour.

Index:

* :func:`activation_patch` puts one activation of one run into another run, one (point,
  position[, head]) at a time, and measures the metric: by default it *denoises* (the clean
  activation goes into the corrupt run), ``noising=True`` does the reverse. Many patches share
  one forward along the batch dimension; the results are those of one patch per forward.
* :func:`attribution_patch` estimates all of those effects at once from one backward pass:
  AtP, ``(clean - corrupt) . d metric / d activation`` at the corrupt run (Nanda 2022), and
  ``method="atp*"``, AtP* (Kramár et al. 2024): GradDrop (unsigned, per prompt pair, as the
  paper defines it), and the QK fix for the query and key points ``attn_q.L``/``attn_k.L``
  (the attention pattern under the patch computed exactly).
* :func:`edge_attribution` scores the edges between components: EAP (Syed et al. 2023), the
  upstream output's change times the gradient at the downstream component's residual read
  (``noising=True``: hannamw/EAP-IG's convention), and EAP-IG (Hanna et al. 2024) with
  ``steps`` integrated-gradient interpolations of the input embeddings.
* :class:`PatchResult` (scores keyed by point name, ``[position]`` or ``[position, head]``,
  with :meth:`~PatchResult.top` and a heatmap :meth:`~PatchResult.plot`) and
  :class:`EdgeResult` hold the results.

Every function takes ``clean`` and ``corrupt`` inputs of equal shape (``input_ids`` tensors, or
dicts of model keyword arguments), a ``metric(output)`` returning a scalar or one value per
example (summed over the batch), and standard point names or globs (``"resid_pre.*"``,
``"attn_z.3"``). Effects are differences from the unpatched run (``metric(patched) -
metric(base)``, summed over the batch). A model whose dropout is active is refused
(:class:`DropoutActiveError`): its effects would be noise. The functions that differentiate
the metric need it to return a tensor computed from the output; they work inside
``torch.no_grad()`` and refuse ``torch.inference_mode()``.

Example::

    >>> import torch, transformers
    >>> from pyhook.patching import activation_patch, attribution_patch
    >>> cfg = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=32)
    >>> model = transformers.GPT2LMHeadModel(cfg).eval()
    >>> clean, corrupt = torch.tensor([[1, 2, 3]]), torch.tensor([[1, 5, 3]])
    >>> metric = lambda out: out.logits[:, -1, 7]
    >>> exact = activation_patch(model, clean, corrupt, metric, "resid_pre.*")
    >>> atp = attribution_patch(model, clean, corrupt, metric, "resid_pre.*")
    >>> exact["resid_pre.1"].shape, atp["resid_pre.1"].shape
    (torch.Size([3]), torch.Size([3]))
    >>> abs(float(exact["resid_pre.1"][0])) < 1e-6  # the same token in both runs: no effect
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ._compiled import CompiledModelError, unwrap_compiled
from ._hooks import compiled_path
from .points import Point, resolve_targets
from .trace import TraceDict

__all__ = [
    "Component",
    "DropoutActiveError",
    "Edge",
    "EdgeResult",
    "PatchResult",
    "activation_patch",
    "attribution_patch",
    "edge_attribution",
]

Metric = Callable[[Any], torch.Tensor]


class DropoutActiveError(RuntimeError):
    """The model has dropout active (a module in training mode that drops): patching results
    would be random. The message names the module; call ``model.eval()``.

    Example::

        >>> import torch, pyhook.patching as P
        >>> net = torch.nn.Sequential(torch.nn.Dropout(0.1))
        >>> try:
        ...     P._check_no_dropout(net)
        ... except P.DropoutActiveError as e:
        ...     print(str(e).split(":")[0])
        dropout is active in module '0' (Dropout, p=0.1)
    """


class Component(NamedTuple):
    """One scored component: a point, a position, a head (None for points without heads)."""

    point: str
    position: int
    head: int | None
    score: float


class Edge(NamedTuple):
    """One scored edge from an upstream component's output to a downstream component's input."""

    upstream: str
    downstream: str
    score: float


# -- results ----------------------------------------------------------------------------------
@dataclass
class PatchResult:
    """Scores of one patching or attribution run, keyed by point name.

    ``scores[name]`` is ``[position]`` (``[position, head]`` for per-head points such as
    ``attn_z.3``): the effect on the metric of patching that component (``method="activation"``,
    exact) or its estimate (``"atp"``, ``"atp*"``), relative to the unpatched base run (the
    corrupt run when denoising, the clean run when noising). ``clean_metric`` and
    ``corrupt_metric`` are the metric of the unpatched runs (summed over the batch).

    Example::

        >>> import torch
        >>> r = PatchResult({"resid_pre.0": torch.tensor([0.5, -2.0])}, "activation", 1.0, 0.0)
        >>> r.top(1)
        [Component(point='resid_pre.0', position=1, head=None, score=-2.0)]
    """

    scores: dict[str, torch.Tensor]
    method: str
    clean_metric: float
    corrupt_metric: float
    noising: bool = False

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self.scores[name]
        except KeyError:
            raise KeyError(f"no scores for {name!r}; scored points: {list(self.scores)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self.scores

    def __iter__(self) -> Any:
        return iter(self.scores)

    def components(self) -> list[Component]:
        """Every scored component, in point order, then position, then head."""
        out = []
        for name, s in self.scores.items():
            s = s.detach().cpu()
            if s.dim() == 1:
                out.extend(Component(name, p, None, float(v)) for p, v in enumerate(s.tolist()))
            else:
                for p, row in enumerate(s.tolist()):
                    out.extend(Component(name, p, h, float(v)) for h, v in enumerate(row))
        return out

    def flat(self) -> torch.Tensor:
        """All scores as one vector, in the order of :meth:`components` (for correlations)."""
        return torch.cat([s.detach().reshape(-1).cpu() for s in self.scores.values()])

    def top(self, k: int = 10, *, absolute: bool = True) -> list[Component]:
        """The ``k`` components with the largest scores (by magnitude unless ``absolute=False``)."""
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"top: k must be a non-negative int, got {k!r}")
        key = (lambda c: abs(c.score)) if absolute else (lambda c: c.score)
        return sorted(self.components(), key=key, reverse=True)[:k]

    def plot(
        self,
        path: str | None = None,
        *,
        title: str | None = None,
        labels: Sequence[str] | None = None,
    ) -> Any:
        """A heatmap (rows: points, per-head points one row per head; columns: positions),
        saved to ``path`` when given. Returns the matplotlib ``Figure``. ``labels`` names the
        positions (e.g. the tokens)."""
        rows, names = [], []
        for name, s in self.scores.items():
            s = s.detach().float().cpu()
            if s.dim() == 1:
                rows.append(s)
                names.append(name)
            else:
                for h in range(s.shape[1]):
                    rows.append(s[:, h])
                    names.append(f"{name}.h{h}")
        if not rows:
            raise ValueError("plot: this result holds no scores")
        width = max(len(r) for r in rows)
        grid = torch.full((len(rows), width), float("nan"))
        for i, r in enumerate(rows):
            grid[i, : len(r)] = r
        title = title or f"{self.method} patching ({'noising' if self.noising else 'denoising'})"
        return _heatmap(grid, names, labels, title, path, xlabel="position")


@dataclass
class EdgeResult:
    """Edge scores: ``scores[i, j]`` for the edge from ``upstream[i]`` to ``downstream[j]``.

    Upstream components are ``embed``, ``attn.L.hH`` (head ``H`` of block ``L``) and ``mlp.L``;
    downstream ones ``attn.L`` and ``mlp.L`` (their residual reads) and ``logits`` (the final
    read of the residual stream). ``valid[i, j]`` is False where no edge exists (a component
    never reads a later one); those scores are 0.

    Example::

        >>> import torch
        >>> r = EdgeResult(torch.tensor([[1.0, -3.0]]), ["embed"], ["attn.0", "logits"],
        ...                torch.tensor([[True, True]]), "eap", 0.0, 1.0)
        >>> r.top(1)
        [Edge(upstream='embed', downstream='logits', score=-3.0)]
    """

    scores: torch.Tensor
    upstream: list[str]
    downstream: list[str]
    valid: torch.Tensor
    method: str
    clean_metric: float
    corrupt_metric: float
    noising: bool = False
    steps: int = 1

    def __getitem__(self, edge: tuple[str, str]) -> float:
        up, down = edge
        return float(self.scores[self.upstream.index(up), self.downstream.index(down)])

    def edges(self) -> list[Edge]:
        """Every existing edge with its score."""
        s = self.scores.detach().cpu()
        v = self.valid.cpu()
        return [
            Edge(u, d, float(s[i, j]))
            for i, u in enumerate(self.upstream)
            for j, d in enumerate(self.downstream)
            if v[i, j]
        ]

    def top(self, k: int = 10, *, absolute: bool = True) -> list[Edge]:
        """The ``k`` edges with the largest scores (by magnitude unless ``absolute=False``)."""
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"top: k must be a non-negative int, got {k!r}")
        key = (lambda e: abs(e.score)) if absolute else (lambda e: e.score)
        return sorted(self.edges(), key=key, reverse=True)[:k]

    def plot(self, path: str | None = None, *, title: str | None = None) -> Any:
        """A heatmap of the edge scores (rows upstream, columns downstream); see
        :meth:`PatchResult.plot`."""
        grid = self.scores.detach().float().cpu().clone()
        grid[~self.valid.cpu()] = float("nan")
        return _heatmap(
            grid,
            self.upstream,
            self.downstream,
            title or f"{self.method} edge scores",
            path,
            xlabel="downstream",
        )


def _heatmap(
    grid: torch.Tensor,
    rows: Sequence[str],
    cols: Sequence[str] | None,
    title: str,
    path: str | None,
    *,
    xlabel: str,
) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plot() needs matplotlib: pip install matplotlib") from None
    finite = grid[torch.isfinite(grid)]
    lim = float(finite.abs().max()) if finite.numel() else 1.0
    lim = lim or 1.0
    fig = Figure(figsize=(max(4.0, 0.35 * grid.shape[1] + 2.5), max(2.5, 0.22 * len(rows) + 1.5)))
    ax = fig.add_subplot()
    im = ax.imshow(
        grid.numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto", interpolation="nearest"
    )
    ax.set_yticks(range(len(rows)), list(rows), fontsize=7)
    if cols is not None:
        ax.set_xticks(range(len(cols)), list(cols), fontsize=7, rotation=90)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


# -- checks and inputs -------------------------------------------------------------------------
def _check_no_dropout(model: nn.Module) -> None:
    """Refuse a model with active dropout, naming the first module that would drop.

    Dropout is active when a module is in training mode and holds a non-zero dropout
    probability in any form the model applies it from: a dropout module, a number attribute
    whose name says so (BLOOM's ``hidden_dropout``, applied with ``dropout_add``), or its
    config (Falcon reads ``config.hidden_dropout`` in the forward)."""
    training = [(name, mod) for name, mod in model.named_modules() if mod.training]
    for name, mod in training:
        if isinstance(mod, nn.modules.dropout._DropoutNd) and mod.p > 0:
            _refuse_dropout(name, mod, "p", mod.p)
        for attr, v in vars(mod).items():
            if _is_drop_rate(attr, v):
                _refuse_dropout(name, mod, attr, v)
    seen: set[int] = set()
    for name, mod in training:
        config = vars(mod).get("config")
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        for attr, v in vars(config).items():
            if _is_drop_rate(attr, v):
                _refuse_dropout(name, mod, f"config.{attr}", v)


def _is_drop_rate(attr: str, v: object) -> bool:
    return (
        "drop" in attr.lower() and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
    )


def _refuse_dropout(name: str, mod: nn.Module, what: str, p: object) -> None:
    raise DropoutActiveError(
        f"dropout is active in module {name or '(the model)'!r} ({type(mod).__name__}, "
        f"{what}={p}): patching a model in training mode measures random masks; call "
        "model.eval() first"
    )


def _check_eager(model: nn.Module, who: str) -> None:
    how = compiled_path(model)
    if how is None:
        for name, mod in model.named_modules():
            how = compiled_path(mod)
            if how is not None:
                how = f"{how} at {name!r}"
                break
    if how is not None:
        raise CompiledModelError(
            f"{who} differentiates with respect to activations inside the model, which compiled "
            f"code does not expose to autograd; the model was compiled ({how}): pass the eager "
            "model (model._orig_mod for torch.compile(model))"
        )


def _as_kwargs(x: Any, what: str) -> dict[str, Any]:
    if isinstance(x, torch.Tensor):
        if x.dim() < 1:
            raise ValueError(f"{what} must have a batch dimension, got a 0-dim tensor")
        return {"input_ids": x}
    if isinstance(x, Mapping):
        if not all(isinstance(k, str) for k in x):
            raise TypeError(f"{what}: a dict of model keyword arguments must have str keys")
        return dict(x)
    raise TypeError(
        f"{what} must be an input_ids tensor or a dict of model keyword arguments, got "
        f"{type(x).__name__}"
    )


def _pair(clean: Any, corrupt: Any) -> tuple[dict[str, Any], dict[str, Any], int]:
    c, r = _as_kwargs(clean, "clean"), _as_kwargs(corrupt, "corrupt")
    if set(c) != set(r):
        raise ValueError(
            f"clean and corrupt must have the same keys, got {sorted(c)} and {sorted(r)}"
        )
    batch = None
    for k in c:
        a, b = c[k], r[k]
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            raise ValueError(f"clean[{k!r}] and corrupt[{k!r}]: one is a tensor, the other is not")
        if isinstance(a, torch.Tensor):
            if a.shape != b.shape:
                raise ValueError(
                    f"clean[{k!r}] and corrupt[{k!r}] must have equal shapes, got "
                    f"{tuple(a.shape)} and {tuple(b.shape)}"
                )
            if a.dim() >= 1 and batch is None:
                batch = a.shape[0]
    if batch is None:
        raise ValueError("clean and corrupt hold no tensor with a batch dimension")
    return c, r, batch


def _tile(kw: Mapping[str, Any], batch: int, n: int) -> dict[str, Any]:
    """``kw`` with every batch tensor repeated ``n`` times along the batch (group-major)."""
    if n == 1:
        return dict(kw)
    return {
        k: v.repeat(n, *([1] * (v.dim() - 1)))
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == batch
        else v
        for k, v in kw.items()
    }


def _cat(a: Mapping[str, Any], b: Mapping[str, Any], batch: int) -> dict[str, Any]:
    return {
        k: torch.cat([v, b[k]])
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == batch
        else v
        for k, v in a.items()
    }


def _rows(output: Any, start: int, stop: int, total: int) -> Any:
    """``output`` with every tensor whose first dimension is ``total`` cut to rows start:stop."""

    def cut(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == total:
            return x[start:stop]
        return x

    return pytree.tree_map(cut, output)


def _call_metric(metric: Metric, output: Any, who: str | None) -> torch.Tensor:
    """``metric(output)`` as a tensor; ``who``: a function that differentiates it, for which
    a Python number (no gradient) is refused."""
    v = metric(output)
    if isinstance(v, torch.Tensor):
        return v
    if who is not None:
        raise TypeError(
            f"{who}: metric(output) must return a torch.Tensor computed from the output (its "
            f"gradient is taken), got {type(v).__name__}: return the tensor itself, not "
            ".item() or float(...)"
        )
    return torch.as_tensor(v)


def _differentiable(value: torch.Tensor, who: str) -> None:
    """Refuse a metric value that autograd cannot differentiate, saying why."""
    if value.requires_grad:
        return
    raise ValueError(
        f"{who}: metric(output) returned a tensor cut from the model's graph (it does not "
        "require grad): compute it from the output with torch operations, without .detach(), "
        "torch.no_grad() or a round trip through NumPy/Python numbers"
    )


def _check_grad_mode(who: str) -> None:
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"{who} takes gradients, and no gradient can be taken inside torch.inference_mode(): "
            "call it outside that block (inside torch.no_grad() it works)"
        )


def _metric_value(metric: Metric, output: Any, batch: int, who: str | None = None) -> torch.Tensor:
    """The metric of one group of ``batch`` examples, as a 0-dim tensor (summed over them)."""
    v = _call_metric(metric, output, who)
    if v.dim() == 0:
        return v
    if v.dim() == 1 and v.shape[0] == batch:
        return v.sum()
    raise ValueError(
        f"metric(output) must return a scalar or one value per example (shape [{batch}]), "
        f"got shape {tuple(v.shape)}"
    )


def _metric_groups(
    metric: Metric, output: Any, batch: int, groups: int, who: str | None = None
) -> torch.Tensor:
    """The metric of each of ``groups`` consecutive groups of ``batch`` rows: ``[groups]``
    (``who``: see :func:`_call_metric`)."""
    total = batch * groups
    v = _call_metric(metric, output, who)
    if v.dim() == 1 and v.shape[0] == total:
        return v.reshape(groups, batch).sum(1)
    if v.dim() == 0 and groups == 1:
        return v.reshape(1)
    if v.dim() == 0:  # a metric that sums over the batch: evaluate it on each group's rows
        return torch.stack(
            [
                _metric_value(metric, _rows(output, g * batch, (g + 1) * batch, total), batch, who)
                for g in range(groups)
            ]
        )
    raise ValueError(
        f"metric(output) must return a scalar or one value per example (shape [{total}] for "
        f"this batch of {groups} x {batch}), got shape {tuple(v.shape)}"
    )


def _resolve(model: nn.Module, points: str | Iterable[str], who: str) -> list[tuple[str, Point]]:
    if isinstance(points, str):
        points = [points]
    try:
        items = list(points)
    except TypeError:
        raise TypeError(
            f"{who}: points must be a point name, glob or list of them, got {type(points).__name__}"
        ) from None
    out: dict[str, Point] = {}
    for p in items:
        if not isinstance(p, str):
            raise TypeError(
                f"{who}: points must be str names or globs, got {type(p).__name__}: {p!r}"
            )
        hits = resolve_targets(model, p)
        if hits is None:
            raise ValueError(
                f"{who}: {p!r} is not a standard point of {type(model).__name__}; patching takes "
                "standard points and globs ('resid_pre.*', 'attn_z.3', 'mlp_out.2:5', ...)"
            )
        for name, point in hits:
            if point.flat:
                raise ValueError(
                    f"{who}: point {name!r} is computed as [batch*tokens, ...] on this "
                    "architecture; patch a [batch, tokens, ...] point instead (resid_*, attn_out, mlp_out)"
                )
            out.setdefault(name, point)
    if not out:
        raise ValueError(f"{who}: no points given")
    return list(out.items())


def _run(model: nn.Module, kw: Mapping[str, Any]) -> Any:
    return model(**kw)


def _record(
    model: nn.Module, kw: Mapping[str, Any], names: list[str]
) -> tuple[Any, dict[str, torch.Tensor]]:
    """One forward without gradients: the output and a copy of each point's tensor."""
    with torch.no_grad(), TraceDict(model, names, clone=True, detach=True) as ret:
        out = _run(model, kw)
    return out, {n: ret[n].output for n in names}


def _check_shape(name: str, act: torch.Tensor, batch: int, per_head: bool) -> None:
    want = 4 if per_head else 3
    if act.dim() != want or act.shape[0] != batch:
        shape = "[batch, position, head, d_head]" if per_head else "[batch, position, d]"
        raise ValueError(
            f"point {name!r} holds a tensor of shape {tuple(act.shape)}, expected {shape} "
            f"with batch {batch}"
        )


# -- activation patching ----------------------------------------------------------------------
def activation_patch(
    model: nn.Module,
    clean: Any,
    corrupt: Any,
    metric: Metric,
    points: str | Iterable[str],
    *,
    noising: bool = False,
    positions: Sequence[int] | None = None,
    per_head: bool = True,
    batch_size: int = 32,
) -> PatchResult:
    """Patch each (point, position[, head]) alone and measure the metric: the exact effects.

    Denoising (the default) runs the corrupt input with one clean activation put in;
    ``noising=True`` runs the clean input with one corrupt activation. Per-head points
    (``attn_z.L``, ``[batch, pos, head, d_head]``) are patched one head at a time unless
    ``per_head=False``. ``batch_size`` patches run in one forward along the batch dimension
    (each patch gets its own copy of the batch); the results equal one patch per forward (up to
    the rounding of a larger matrix product). ``positions`` limits the positions patched (the
    others get 0).

    Example::

        >>> import torch, transformers
        >>> from pyhook.patching import activation_patch
        >>> cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        ...                                num_attention_heads=2, vocab_size=32)
        >>> model = transformers.LlamaForCausalLM(cfg).eval()
        >>> clean, corrupt = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 9, 3, 4]])
        >>> r = activation_patch(model, clean, corrupt, lambda o: o.logits[:, -1, 5], ["resid_pre.0", "attn_z.1"])
        >>> r["resid_pre.0"].shape, r["attn_z.1"].shape
        (torch.Size([4]), torch.Size([4, 2]))
        >>> abs(float(r["resid_pre.0"][0])) < 1e-6  # position 0 is the same token in both runs
        True
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"activation_patch: batch_size must be a positive int, got {batch_size!r}")
    _check_no_dropout(model)
    c_kw, r_kw, batch = _pair(clean, corrupt)
    resolved = _resolve(model, points, "activation_patch")
    names = [n for n, _ in resolved]
    clean_out, clean_acts = _record(model, c_kw, names)
    corrupt_out, corrupt_acts = _record(model, r_kw, names)
    with torch.no_grad():
        clean_m = _metric_value(metric, clean_out, batch).detach()
        corrupt_m = _metric_value(metric, corrupt_out, batch).detach()
    base_kw, src_acts, base_m = (
        (c_kw, corrupt_acts, clean_m) if noising else (r_kw, clean_acts, corrupt_m)
    )
    del clean_out, corrupt_out

    patches: list[tuple[str, int, int | None]] = []
    scores: dict[str, torch.Tensor] = {}
    for name, point in resolved:
        heads = point.heads is not None and per_head
        act = src_acts[name]
        if point.heads is not None and not per_head:
            act = src_acts[name] = act.flatten(-2)
        _check_shape(name, act, batch, heads)
        n_pos = act.shape[1]
        pos = range(n_pos) if positions is None else _positions(positions, n_pos, name)
        scores[name] = torch.zeros(
            (n_pos, act.shape[2]) if heads else (n_pos,), dtype=base_m.dtype, device=base_m.device
        )
        for s in pos:
            if heads:
                patches.extend((name, s, h) for h in range(act.shape[2]))
            else:
                patches.append((name, s, None))

    heads_of = {n: (p.heads is not None and per_head) for n, p in resolved}
    for start in range(0, len(patches), batch_size):
        chunk = patches[start : start + batch_size]
        n = len(chunk)
        by_point: dict[str, list[tuple[int, int, int | None]]] = {}
        for i, (name, s, h) in enumerate(chunk):
            by_point.setdefault(name, []).append((i, s, h))
        edits = {
            name: _patcher(
                src_acts[name],
                items,
                n,
                batch,
                heads_of[name],
                flat=not heads_of[name] and src_acts[name].dim() == 3 and _is_split(resolved, name),
            )
            for name, items in by_point.items()
        }
        kw = _tile(base_kw, batch, n)
        with torch.no_grad(), TraceDict(model, list(edits), retain_output=False, edit_output=edits):
            out = _run(model, kw)
            values = _metric_groups(metric, out, batch, n).detach()
        for (name, s, h), v in zip(chunk, values.tolist()):
            if h is None:
                scores[name][s] = v - float(base_m)
            else:
                scores[name][s, h] = v - float(base_m)
    return PatchResult(scores, "activation", float(clean_m), float(corrupt_m), bool(noising))


def _is_split(resolved: list[tuple[str, Point]], name: str) -> bool:
    return dict(resolved)[name].heads is not None


def _positions(positions: Sequence[int], n_pos: int, name: str) -> list[int]:
    out = []
    for p in positions:
        if not isinstance(p, int) or isinstance(p, bool) or not -n_pos <= p < n_pos:
            raise ValueError(
                f"positions: {p!r} is not a position of point {name!r} ({n_pos} positions)"
            )
        out.append(p % n_pos)
    return sorted(set(out))


def _patcher(
    src: torch.Tensor,
    items: list[tuple[int, int, int | None]],
    n: int,
    batch: int,
    heads: bool,
    *,
    flat: bool,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """An edit writing ``src`` (``[batch, pos, ...]``) into group ``i`` of the tiled batch at
    position ``s`` (head ``h``), for each ``(i, s, h)`` in ``items``."""
    gi = torch.tensor([i for i, _, _ in items])
    si = torch.tensor([s for _, s, _ in items])
    hi = torch.tensor([h for _, _, h in items]) if heads else None

    def edit(output: torch.Tensor) -> torch.Tensor:
        x = output.flatten(-2) if flat else output  # attn_z patched whole (per_head=False)
        x = x.clone()
        grouped = x.unflatten(0, (n, batch))
        dev = x.device
        g, s = gi.to(dev), si.to(dev)
        value = src.to(device=dev, dtype=x.dtype)
        if hi is None:
            grouped[g, :, s] = value[:, s].transpose(0, 1)
        else:
            h = hi.to(dev)
            grouped[g, :, s, h] = value[:, s, h].transpose(0, 1)
        return x.unflatten(-1, output.shape[-2:]) if flat else x

    return edit


# -- gradients at the points ------------------------------------------------------------------
class _Sites:
    """Edits that put each point's tensor on the autograd path as ``t = value + sink`` (sink: a
    zero scalar that requires grad, so frozen models work and the value is unchanged), with a
    gradient hook per point. One backward with respect to ``sink`` fires every hook, so each
    point's gradient is used (reduced, or moved to the host) as it arrives and never all at
    once."""

    def __init__(self, dtype: torch.dtype, device: torch.device | None = None) -> None:
        self.sink = torch.zeros((), dtype=dtype, device=device, requires_grad=True)
        self.values: dict[str, torch.Tensor] = {}
        self.on_grad: dict[str, list[Callable[[torch.Tensor], torch.Tensor | None]]] = {}
        self.edits: dict[str, Callable[..., Any]] = {}
        #: per point, a function of the value applied before it enters the graph (EAP-IG)
        self.modify: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}

    def add(
        self, name: str, fn: Callable[[torch.Tensor], torch.Tensor | None], *, first: bool = False
    ) -> None:
        hooks = self.on_grad.setdefault(name, [])
        if first:
            hooks.insert(0, fn)
        else:
            hooks.append(fn)
        if name in self.edits:
            return
        sites = self

        def edit(output: torch.Tensor) -> torch.Tensor:
            mod = sites.modify.get(name)
            value = mod(output) if mod is not None else output
            t = value + sites.sink.to(value.device)
            sites.values[name] = t
            for hook in sites.on_grad[name]:
                t.register_hook(hook)
            return t

        self.edits[name] = edit

    def backward(self, values: torch.Tensor, retain_graph: bool = False) -> None:
        """The backward pass of ``values.sum()`` (summed under enable_grad: callers may run
        inside torch.no_grad())."""
        with torch.enable_grad():
            total = values.sum()
            torch.autograd.grad(total, [self.sink], retain_graph=retain_graph, allow_unused=True)


def _sink_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()


def attribution_patch(
    model: nn.Module,
    clean: Any,
    corrupt: Any,
    metric: Metric,
    points: str | Iterable[str],
    *,
    method: str = "atp",
    noising: bool = False,
    per_head: bool = True,
    one_batch: bool = False,
    offload: bool = False,
    signed: bool = False,
) -> PatchResult:
    """Estimate every (point, position[, head]) patching effect from one backward pass (AtP).

    The estimate is ``(source - base) . d metric / d activation`` at the base run, summed over
    the batch and the features: denoising (default) takes the gradient in the corrupt run with
    ``source`` the clean activation; ``noising=True`` the reverse.

    ``method="atp*"`` is AtP* (Kramár et al. 2024). GradDrop (section 3.1.2, equation 11): for
    each prompt pair ``x`` and block ``l``, ``AtP_l(n; x)`` is AtP with block ``l``'s branch
    outputs (``attn_out.l``, ``mlp_out.l``) passing no gradient, and the score is
    ``sum_l |AtP_l(n; x)| / terms``, the absolute value taken per pair, summed over the pairs
    (the paper averages them). ``terms`` is the number of drops the point survives: ``L - 1``
    for the paper's nodes, which sit inside a block and are cut by its own drop (the paper's
    ``1/(L-1)``), ``L`` for residual-stream points that no drop cuts. The score is unsigned;
    ``signed=True`` multiplies it by the sign of AtP summed over the batch (pyhook's variant,
    not the paper's). The ``L`` extra gradients come from ``L`` more copies of the base batch
    in the same forward and backward (memory: ``L + 1`` times the base run's). For query and
    key points (``attn_q.L``, ``attn_k.L``) ``"atp*"`` also applies the paper's QK fix
    (section 3.1.1): the attention pattern under the patched query (or key) is computed
    exactly, and only the rest is linearised: ``sum (pattern_patched - pattern_base) . d
    metric / d pattern``, with ``d metric / d pattern`` from the gradient at ``attn_z.L`` and
    the values (each GradDrop copy gets the same treatment, and GradDrop's absolute values are
    taken on these estimates). A patched key's rows are renormalised in the logit domain, exact
    however saturated the softmax. The pattern is recomputed from the captured query, key and
    the causal (and 2-D ``attention_mask``) mask, and checked against the model's own
    ``attn_z.L`` on the query rows of real tokens: an attention that computes it otherwise (a
    sliding window, soft-capping) is refused, naming the layer.

    ``one_batch=True`` runs clean and corrupt as one forward of twice the batch (the metric sees
    the base rows only; each half gets its own gradient). ``offload=True`` keeps the source
    activations in host memory and reduces each point's gradient as the backward produces it,
    so device memory holds no per-point copies beyond the model's own graph.

    Example::

        >>> import torch, transformers
        >>> from pyhook.patching import attribution_patch
        >>> cfg = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=32)
        >>> model = transformers.GPT2LMHeadModel(cfg).eval()
        >>> r = attribution_patch(model, torch.tensor([[1, 2, 3]]), torch.tensor([[1, 7, 3]]),
        ...                       lambda o: o.logits[:, -1, 4], ["resid_pre.*", "attn_z.1"])
        >>> r["attn_z.1"].shape, r.method
        (torch.Size([3, 2]), 'atp')
    """
    if method not in ("atp", "atp*"):
        raise ValueError(f"attribution_patch: method must be 'atp' or 'atp*', got {method!r}")
    _check_grad_mode("attribution_patch")
    model = unwrap_compiled(model)
    _check_eager(model, "attribution_patch")
    _check_no_dropout(model)
    c_kw, r_kw, batch = _pair(clean, corrupt)
    resolved = _resolve(model, points, "attribution_patch")
    names = [n for n, _ in resolved]
    heads_of = {n: p.heads is not None and per_head for n, p in resolved}
    store = torch.device("cpu") if offload else None
    blocks = _block_count(model) if method == "atp*" else 0
    # AtP* runs 1 + L copies of the base rows in one forward: copy 0 gives AtP, copy l + 1 the
    # gradient with block l's branches dropped (rows are independent, so each copy's gradient
    # is that of its own backward; one batched pass is several times cheaper than L passes)
    groups = 1 + blocks
    if one_batch:
        kw1 = _cat(c_kw, r_kw, batch)
        width = 2 * batch  # rows per copy: [clean; corrupt]
        base_rows = slice(0, batch) if noising else slice(batch, 2 * batch)
        src_rows = slice(batch, 2 * batch) if noising else slice(0, batch)
        src_acts: dict[str, torch.Tensor] = {}
        other_out = None
    else:
        src_kw, kw1 = (r_kw, c_kw) if noising else (c_kw, r_kw)
        width = batch
        base_rows = src_rows = slice(0, batch)
        other_out, src_acts = _record(model, src_kw, names)
        if offload:
            src_acts = {n: _to_host(a) for n, a in src_acts.items()}
    kw = _tile(kw1, width, groups)
    sites = _Sites(_sink_dtype(model))
    # per point, [copies, batch, pos(, head)]: each pair's estimate under each copy's gradient
    partial: dict[str, torch.Tensor] = {}
    # per point, [copies]: whether the copy's gradient reaches the point at all
    reached: dict[str, torch.Tensor] = {}

    def site_hook(name: str) -> Callable[[torch.Tensor], None]:
        heads = heads_of[name]

        def on_grad(grad: torch.Tensor) -> None:
            t = sites.values[name].detach().unflatten(0, (groups, width))
            g = grad.unflatten(0, (groups, width))[:, base_rows]
            base = t[:, base_rows]
            src = t[:1, src_rows] if one_batch else src_acts[name].unsqueeze(0)
            if g.dim() == 5 and not heads:
                g, base = g.flatten(-2), base.flatten(-2)
            if src.dim() == 5 and not heads:
                src = src.flatten(-2)
            prod = (src.to(g.device, g.dtype) - base) * g  # [groups, batch, pos, ...]
            s = prod.sum(dim=4) if heads else prod.flatten(3).sum(-1)
            partial[name] = s.detach().to(store) if store is not None else s.detach()
            if groups > 1:
                reached[name] = g.flatten(1).ne(0).any(1).cpu()

        return on_grad

    # AtP*'s QK fix: query and key points are scored from the gradient at the attention
    # pattern (from attn_z's gradient and the values) and the exact patched pattern
    qk_fixed = [
        n for n, p in resolved if method == "atp*" and p.qkv is not None and p.qkv[1] in "qk"
    ]
    for name in names:
        if name not in qk_fixed:
            sites.add(name, site_hook(name))
    by_layer: dict[int, list[str]] = {}
    for name in qk_fixed:
        by_layer.setdefault(int(name.rsplit(".", 1)[1]), []).append(name)
    for layer, qk_names in by_layer.items():
        attn = dict(resolved)[qk_names[0]].qkv[2]  # type: ignore[index]
        for kind in ("attn_q", "attn_k", "attn_v"):
            sites.add(f"{kind}.{layer}", _no_grad_hook)
        sites.add(
            f"attn_z.{layer}",
            _qk_fix_hook(
                layer,
                qk_names,
                attn,
                sites,
                partial,
                reached,
                groups,
                width,
                base_rows,
                src_rows,
                src_acts,
                one_batch,
                heads_of,
                store,
                kw.get("attention_mask"),
            ),
        )
    for layer in range(blocks):

        def dropper(grad: torch.Tensor, copy: int = layer + 1) -> torch.Tensor:
            grad = grad.clone()
            grad.unflatten(0, (groups, width))[copy] = 0
            return grad

        for kind in ("attn_out", "mlp_out"):
            sites.add(f"{kind}.{layer}", dropper, first=True)

    total = groups * width
    rows = torch.cat(
        [
            torch.arange(k * width + base_rows.start, k * width + base_rows.stop)
            for k in range(groups)
        ]
    )
    with torch.enable_grad():  # the metric too: it is differentiated
        with TraceDict(model, list(sites.edits), retain_output=False, edit_output=sites.edits):
            out = _run(model, kw)
        values = _metric_groups(metric, _take(out, rows, total), batch, groups, "attribution_patch")
    _differentiable(values, "attribution_patch")
    if one_batch:
        other_out = _rows(out, src_rows.start, src_rows.stop, total)
    with torch.no_grad():
        other_m = _metric_value(metric, other_out, batch).detach()
    sites.backward(values)
    base_m = values[0].detach()
    shapes = {
        n: _zero_shape(sites.values[n][:batch], heads_of[n]) for n in names if n in sites.values
    }
    del out, other_out

    result: dict[str, torch.Tensor] = {}
    for name in names:
        per_copy = partial.get(name)
        if per_copy is None:  # the point does not reach the metric
            per_copy = torch.zeros((groups, batch, *shapes.get(name, (0,))), dtype=base_m.dtype)
        atp = per_copy[0].sum(0)
        if method == "atp":
            result[name] = atp
            continue
        # GradDrop (Kramár et al. 2024, section 3.1.2): per pair, the mean of |AtP with block
        # l dropped| over the drops that leave the point a gradient (L - 1 for a component
        # inside a block, whose own block's drop cuts it; L for the residual stream), then
        # summed over the pairs
        kept = reached.get(name)
        terms = max(int(kept[1:].sum()) if kept is not None else blocks - 1, 1)
        score = (per_copy[1:].abs().sum(0) / terms).sum(0)
        result[name] = torch.sign(atp) * score if signed else score
    clean_m, corrupt_m = (base_m, other_m) if noising else (other_m, base_m)
    return PatchResult(result, method, float(clean_m), float(corrupt_m), bool(noising))


def _no_grad_hook(grad: torch.Tensor) -> None:
    return None


def _qk_fix_hook(
    layer: int,
    qk_names: list[str],
    attn: nn.Module,
    sites: _Sites,
    partial: dict[str, torch.Tensor],
    reached: dict[str, torch.Tensor],
    groups: int,
    width: int,
    base_rows: slice,
    src_rows: slice,
    src_acts: dict[str, torch.Tensor],
    one_batch: bool,
    heads_of: dict[str, bool],
    store: torch.device | None,
    attention_mask: Any,
) -> Callable[[torch.Tensor], None]:
    """The gradient hook at ``attn_z.layer`` that scores the query/key points of the layer
    with AtP*'s QK fix, one score per GradDrop copy (``partial[name]``: ``[groups, pos,
    head]``)."""

    def base(kind: str) -> torch.Tensor:
        t = sites.values[f"{kind}.{layer}"].detach().unflatten(0, (groups, width))
        return t[0, base_rows]

    def source(name: str) -> torch.Tensor:
        if one_batch:
            t = sites.values[name].detach().unflatten(0, (groups, width))
            return t[0, src_rows]
        return src_acts[name]

    def on_grad(grad: torch.Tensor) -> None:
        with torch.no_grad():
            q, k, v, z = base("attn_q"), base("attn_k"), base("attn_v"), base("attn_z")
            dtype = grad.dtype
            q, k, v, z = (t.to(grad.device, dtype) for t in (q, k, v, z))
            b, s, n_heads = q.shape[:3]
            rep = n_heads // k.shape[2]
            kq, vq = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
            scaling = float(getattr(attn, "scaling", q.shape[-1] ** -0.5))
            mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
            mask = mask.expand(b, 1, s, s)
            real = None  # query rows of real tokens (a 2-D attention mask's ones)
            if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
                rows = attention_mask.unflatten(0, (groups, width))[0, base_rows]
                real = rows.to(q.device).bool()
                mask = mask & real.view(b, 1, 1, s)
            scores = torch.einsum("bihd,bjhd->bhij", q, kq) * scaling
            logits = scores.masked_fill(~mask, float("-inf"))
            pattern = torch.nan_to_num(torch.softmax(logits, -1))  # a row with every key masked
            recomputed = torch.einsum("bhij,bjhd->bihd", pattern, vq)
            # rows no real token reads (a padding query, all of whose keys are masked: the
            # model's own softmax gives them any finite values) are not compared
            diff = (recomputed - z).abs()
            if real is not None:
                diff = torch.where(real.view(b, s, 1, 1), diff, torch.zeros_like(diff))
            # (models that take the softmax in float32 agree to float32's precision only)
            tol = max(torch.finfo(dtype).eps ** 0.5, 3.5e-4) * max(float(z.abs().max()), 1e-12)
            if float(diff.max()) > tol:
                raise ValueError(
                    f"attribution_patch(method='atp*'): the QK fix recomputes block {layer}'s "
                    f"attention pattern as softmax(q k^T * {scaling:g} + causal/padding mask), "
                    f"but pattern @ v differs from attn_z.{layer} by {float(diff.max()):.3g} "
                    f"({type(attn).__name__} computes it otherwise: a sliding window, "
                    "soft-capping, ...); score attn_q/attn_k with method='atp' instead"
                )
            g = grad.unflatten(0, (groups, width))[:, base_rows].to(dtype)  # [G, b, s, H, dh]
            reach = g.flatten(1).ne(0).any(1)  # [G]: the copy's gradient reaches the block
            for name in qk_names:
                which = name.split(".")[0][-1]
                src = source(name).to(q.device, dtype)
                if which == "q":
                    new_logits = torch.einsum("bihd,bjhd->bhij", src, kq) * scaling
                    new_logits = new_logits.masked_fill(~mask, float("-inf"))
                    new_pattern = torch.nan_to_num(torch.softmax(new_logits, -1))
                else:
                    new_logits = torch.einsum("bihd,bjhd->bhij", q, src.repeat_interleave(rep, 2))
                    new_logits = (new_logits * scaling).masked_fill(~mask, float("-inf"))
                    fix = _key_fix(pattern, logits, new_logits)
                per = []
                # one GradDrop copy at a time: a few [batch, heads, pos, pos] tensors at once
                for copy in range(groups):
                    d_pattern = torch.einsum("bihd,bjhd->bhij", g[copy], vq)  # d metric / d A
                    if which == "q":  # row i of the pattern, exactly, under the source query
                        eff = ((new_pattern - pattern) * d_pattern).sum(-1)  # [b, h, i]
                        per.append(eff.transpose(1, 2))  # [b, pos, head]
                    else:  # column j under the source key: every row renormalised exactly
                        eff = _key_effect(fix, pattern, d_pattern)  # [b, h, i, j]
                        eff = eff.sum(2).unflatten(1, (k.shape[2], rep)).sum(2)  # [b, kv, j]
                        per.append(eff.transpose(1, 2))  # [b, pos, kv head]
                out = torch.stack(per)  # [G, b, pos, head]
                if not heads_of[name]:
                    out = out.sum(-1)
                partial[name] = out.to(store) if store is not None else out
                reached[name] = reach.cpu()

    return on_grad


class _KeyFix(NamedTuple):
    """What AtP*'s key fix needs of one layer's rows, independent of ``dM/dA`` (so computed
    once for every GradDrop copy); see :func:`_key_fix`."""

    valid: torch.Tensor  # [b, h, i, j]: the key is read by the row
    keep: torch.Tensor  # the other keys' factor 1 / (1 - a + a e^shift)
    move: torch.Tensor  # the key's new weight a e^shift / (1 - a + a e^shift)
    top: torch.Tensor  # [b, h, i, 1]: each row's dominant key
    rest: torch.Tensor  # [b, h, i, j]: softmax of the row without its dominant key
    kept_top: torch.Tensor  # [b, h, i, 1]: the others' total new weight when top is patched
    moved_top: torch.Tensor  # [b, h, i, 1]: top's new weight when it is patched


def _key_fix(pattern: torch.Tensor, logits: torch.Tensor, new_logits: torch.Tensor) -> _KeyFix:
    """Row ``i`` with key ``j`` alone patched (its logit replaced by ``new_logits[..., i, j]``;
    ``logits``: ``-inf`` where masked) renormalises the other keys by ``1 - a + a e^shift``,
    with ``log a`` taken from the logits (a weight that underflowed to 0 still moves). That
    closed form holds while ``1 - a`` does, for every key below 1/2; the row's dominant key
    (the only one that can reach 1/2) is taken in the logit domain instead: the other keys'
    new weights are ``softmax(row without it) * exp(LSE(row without it) - LSE')``, ``LSE' =
    logaddexp(LSE(row without it), its new logit)``. Exact however saturated the row: where a
    weight rounds to 1, ``1 - a`` and ``dot - a dM/dA`` lose every other key."""
    valid = torch.isfinite(logits) & torch.isfinite(new_logits)
    zero = torch.zeros((), dtype=logits.dtype, device=logits.device)
    lse = torch.logsumexp(logits, -1, keepdim=True)
    log_a = torch.where(valid, logits - lse, float("-inf"))
    shift = torch.where(valid, new_logits - logits, zero)
    lognorm = torch.logaddexp(torch.log1p(-pattern), log_a + shift)
    top = logits.argmax(-1, keepdim=True)
    others = logits.scatter(-1, top, float("-inf"))
    rest_lse = torch.logsumexp(others, -1, keepdim=True)
    rest = torch.nan_to_num(torch.exp(others - rest_lse))  # a row with one key: no others
    t = new_logits.gather(-1, top)
    lse_new = torch.logaddexp(rest_lse, t)
    return _KeyFix(
        valid,
        torch.exp(-lognorm),
        torch.exp(log_a + shift - lognorm),
        top,
        rest,
        torch.exp(rest_lse - lse_new),
        torch.exp(t - lse_new),
    )


def _key_effect(fix: _KeyFix, pattern: torch.Tensor, d_pattern: torch.Tensor) -> torch.Tensor:
    """``[b, h, i, j]``: ``sum_k (A'_ik - A_ik) dM/dA_ik`` for row ``i`` with key ``j`` alone
    patched (see :func:`_key_fix`), for one ``dM/dA`` (``[b, h, i, j]``)."""
    dot = (pattern * d_pattern).sum(-1, keepdim=True)
    eff = fix.keep * (dot - pattern * d_pattern) + fix.move * d_pattern - dot
    exact = (
        fix.kept_top * (fix.rest * d_pattern).sum(-1, keepdim=True)
        + fix.moved_top * d_pattern.gather(-1, fix.top)
        - dot
    )
    eff = eff.scatter(-1, fix.top, exact)
    return torch.where(fix.valid, eff, torch.zeros((), dtype=eff.dtype, device=eff.device))


def _take(output: Any, index: torch.Tensor, total: int) -> Any:
    """``output`` with every tensor whose first dimension is ``total`` cut to rows ``index``."""

    def cut(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == total:
            return x.index_select(0, index.to(x.device))
        return x

    return pytree.tree_map(cut, output)


def _zero_shape(act: torch.Tensor, heads: bool) -> tuple[int, ...]:
    return (act.shape[1], act.shape[2]) if heads and act.dim() == 4 else (act.shape[1],)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
    host.copy_(t, non_blocking=False)
    return host


def _block_count(model: nn.Module) -> int:
    from .points import _layout

    return _layout(model).n


# -- edge attribution -------------------------------------------------------------------------
def edge_attribution(
    model: nn.Module,
    clean: Any,
    corrupt: Any,
    metric: Metric,
    *,
    steps: int = 1,
    noising: bool = False,
    tolerance: float = 1e-4,
) -> EdgeResult:
    """Score every edge between components: EAP (``steps=1``) or EAP-IG (``steps > 1``).

    Upstream components are the input embedding (``embed``), each attention head
    (``attn.L.hH``: its output ``z_h @ W_O[h]``, through the block's output projection) and each
    MLP (``mlp.L``); downstream components are each attention and MLP (``attn.L``, ``mlp.L``:
    the residual stream as that branch reads it) and ``logits`` (the last block's output, as the
    final norm reads it). The score of an edge is ``(source - base upstream output) . d metric /
    d (downstream input)`` at the base run, summed over batch and positions. Denoising
    (default): ``(clean - corrupt) . gradient in the corrupt run``, the convention of Syed et
    al. (2023) and of attribution patching; ``noising=True``: ``(corrupt - clean) . gradient
    in the clean run``, hannamw/EAP-IG's EAP (which averages over the pairs, and keeps an
    attention's q/k/v inputs apart where ``attn.L`` is their sum). With ``steps > 1`` the
    gradient is averaged over ``steps`` runs whose input embedding goes from the base run's
    towards the source run's (``base + k/steps (source - base)``, ``k = 0..steps-1``; EAP-IG,
    Hanna et al. 2024), all in one forward: with ``noising=True``, hannamw/EAP-IG's 2024 grid
    (``corrupt + k/steps (clean - corrupt)``, ``k = 1..steps``), not its 2025 one.

    It needs a residual stream that the branches add to: ``resid_mid = resid_pre + attn_out``,
    ``resid_post = resid_mid + mlp_out`` and ``attn_out`` the sum of the heads' projected
    outputs (checked on the base run, to ``tolerance`` relative to the residual's scale); a
    post-norm encoder (BERT), parallel-attention blocks or post-branch norms are refused, naming
    the block and the sum that does not hold.

    Example::

        >>> import torch, transformers
        >>> from pyhook.patching import edge_attribution
        >>> cfg = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=32)
        >>> model = transformers.GPT2LMHeadModel(cfg).eval()
        >>> r = edge_attribution(model, torch.tensor([[1, 2, 3]]), torch.tensor([[1, 7, 3]]),
        ...                      lambda o: o.logits[:, -1, 4])
        >>> r.upstream[:3], r.downstream[-2:], r.scores.shape
        (['embed', 'attn.0.h0', 'attn.0.h1'], ['mlp.1', 'logits'], torch.Size([7, 5]))
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"edge_attribution: steps must be a positive int, got {steps!r}")
    _check_grad_mode("edge_attribution")
    model = unwrap_compiled(model)
    _check_eager(model, "edge_attribution")
    _check_no_dropout(model)
    c_kw, r_kw, batch = _pair(clean, corrupt)
    n_blocks = _block_count(model)
    resolved = _resolve(
        model,
        [
            "embed",
            "attn_z.*",
            "attn_out.*",
            "mlp_out.*",
            "resid_pre.*",
            "resid_mid.*",
            "resid_post.*",
        ],
        "edge_attribution",
    )
    points = dict(resolved)
    names = list(points)
    src_kw, base_kw = (r_kw, c_kw) if noising else (c_kw, r_kw)
    src_out, src_acts = _record(model, src_kw, names)
    base_out, base_acts = _record(model, base_kw, names)
    with torch.no_grad():
        src_m = _metric_value(metric, src_out, batch).detach()
    del src_out, base_out
    _check_residual(model, points, base_acts, n_blocks, tolerance)

    # upstream outputs' changes, [n_up, batch, pos, d]
    ups = ["embed"]
    deltas = [src_acts["embed"] - base_acts["embed"]]
    with torch.no_grad():
        for layer in range(n_blocks):
            name = f"attn_z.{layer}"
            dz = src_acts[name] - base_acts[name]  # [b, s, H, dh]
            heads = dz.shape[2]
            per = _per_head_out(points[name].module, dz, points[name].module_name)
            deltas.extend(per[h] for h in range(heads))
            ups.extend(f"attn.{layer}.h{h}" for h in range(heads))
            deltas.append(src_acts[f"mlp_out.{layer}"] - base_acts[f"mlp_out.{layer}"])
            ups.append(f"mlp.{layer}")
    up_delta = torch.stack([d.to(deltas[0].dtype) for d in deltas])
    up_layer = [-1] + [int(u.split(".")[1]) for u in ups[1:]]
    up_is_mlp = [u.startswith("mlp") for u in ups]

    # gradients at the residual stream, averaged over the IG steps
    grads: dict[str, torch.Tensor] = {}
    sites = _Sites(_sink_dtype(model))
    resid = (
        [f"resid_pre.{i}" for i in range(n_blocks)]
        + [f"resid_mid.{i}" for i in range(n_blocks)]
        + [f"resid_post.{n_blocks - 1}"]
    )

    def keep(name: str) -> Callable[[torch.Tensor], None]:
        def on_grad(grad: torch.Tensor) -> None:
            g = grad.detach().unflatten(0, (steps, batch)).sum(0) / steps
            grads[name] = g

        return on_grad

    for name in resid:
        sites.add(name, keep(name))
    embed_src, embed_base = src_acts["embed"], base_acts["embed"]
    if steps > 1:
        alphas = torch.arange(steps, dtype=embed_base.dtype) / steps

        def interpolate(output: torch.Tensor) -> torch.Tensor:
            a = alphas.to(output.device).view(steps, 1, 1, 1)
            mixed = embed_base.to(output.device) + a * (embed_src - embed_base).to(output.device)
            return mixed.reshape(output.shape).to(output.dtype)

        # embed is resid_pre.0's tensor: the interpolation is an edit at resid_pre.0
        sites.modify["resid_pre.0"] = interpolate
    kw = _tile(base_kw, batch, steps)
    with torch.enable_grad():  # the metric too: it is differentiated
        with TraceDict(model, list(sites.edits), retain_output=False, edit_output=sites.edits):
            out = _run(model, kw)
        groups = _metric_groups(metric, out, batch, steps, "edge_attribution")
    _differentiable(groups, "edge_attribution")
    base_m = groups[0].detach()
    sites.backward(groups)
    del out

    downs: list[str] = []
    reads: list[torch.Tensor] = []
    down_layer: list[int] = []
    down_is_mlp: list[bool] = []
    for layer in range(n_blocks):
        post = (
            grads[f"resid_pre.{layer + 1}"]
            if layer + 1 < n_blocks
            else grads[f"resid_post.{n_blocks - 1}"]
        )
        reads.append(grads[f"resid_pre.{layer}"] - grads[f"resid_mid.{layer}"])
        downs.append(f"attn.{layer}")
        down_layer.append(layer)
        down_is_mlp.append(False)
        reads.append(grads[f"resid_mid.{layer}"] - post)
        downs.append(f"mlp.{layer}")
        down_layer.append(layer)
        down_is_mlp.append(True)
    reads.append(grads[f"resid_post.{n_blocks - 1}"])
    downs.append("logits")
    down_layer.append(n_blocks)
    down_is_mlp.append(False)
    read = torch.stack(reads)  # [n_down, b, s, d]
    scores = torch.einsum("ubsd,vbsd->uv", up_delta.to(read.dtype), read)
    valid = torch.zeros(scores.shape, dtype=torch.bool)
    for i, (ul, um) in enumerate(zip(up_layer, up_is_mlp)):
        for j, (dl, dm) in enumerate(zip(down_layer, down_is_mlp)):
            # a component reads every earlier one; an MLP reads its own block's attention
            valid[i, j] = dl > ul or (dl == ul and dm and not um and ul >= 0)
    scores = torch.where(
        valid.to(scores.device), scores, torch.zeros((), dtype=scores.dtype, device=scores.device)
    )
    clean_m, corrupt_m = (base_m, src_m) if noising else (src_m, base_m)
    return EdgeResult(
        scores.detach().cpu(),
        ups,
        downs,
        valid,
        "eap-ig" if steps > 1 else "eap",
        float(clean_m),
        float(corrupt_m),
        bool(noising),
        steps,
    )


def _per_head_out(proj: nn.Module, dz: torch.Tensor, what: str) -> torch.Tensor:
    """``[heads, b, s, d]``: each head's part of the projection of ``dz`` (``[b, s, H, dh]``),
    ``proj(only head h) - proj(0)``, through the projection module itself (any linear layer:
    nn.Linear, GPT-2's Conv1D, offloaded ones, tensor-parallel ones: see :func:`_project`)."""
    heads = dz.shape[2]
    eye = torch.eye(heads, dtype=dz.dtype, device=dz.device)
    masked = dz.unsqueeze(0) * eye.view(heads, 1, 1, heads, 1)  # [H, b, s, H, dh]
    flat = masked.flatten(-2)
    with torch.no_grad():
        out = _project(proj, flat.flatten(0, 1), what).unflatten(0, (heads, dz.shape[0]))
        return out - _project(proj, torch.zeros_like(flat[0]), what)


def _project(proj: nn.Module, x: torch.Tensor, what: str) -> torch.Tensor:
    """``proj`` applied to the whole tensor ``x`` (the heads' output, as the layout layer
    hands it to hooks), whatever the layout of ``proj``: a row-parallel projection (tensor
    parallelism) takes this rank's slice of ``x``'s last dimension and gives the whole output
    (its ranks' parts reduced), so every rank calls it with its own slice, in the same order.
    A layout that gives no whole output, or whose input layout pyhook does not know, is
    refused by name (:class:`~pyhook.distributed.LayoutError`)."""
    from .distributed import _HF_WHOLE, LayoutError, _chunk_sizes, module_layout

    layout = module_layout(proj, what)
    if layout is None:
        return proj(x)
    if layout.output is not None:
        raise LayoutError(
            f"edge_attribution: {what} ({layout.style}) hands each rank a shard of its output, "
            "and edges need each head's whole contribution to the residual stream"
        )
    if layout.input is None:
        if layout.style.rsplit(" ", 1)[-1] in _HF_WHOLE:
            return proj(x)
        raise LayoutError(
            f"edge_attribution: {what} ({layout.style}) takes an input laid out by its parallel "
            "style, which pyhook does not know how to slice; edges need each head's whole "
            "contribution to the residual stream (use transformers' tp_plan, or an unsharded "
            "output projection)"
        )
    sharded = layout.input
    dim = sharded.dim % x.dim()
    full = x.shape[dim]
    if sharded.full is not None and sharded.full != full:
        raise LayoutError(
            f"edge_attribution: {what} ({layout.style}) takes {sharded.full} features whole, "
            f"but the heads' output has {full}"
        )
    sizes = _chunk_sizes(full, sharded.axis.size)
    start = sum(sizes[: sharded.axis.rank])
    return proj(x.narrow(dim, start, sizes[sharded.axis.rank]))


def _check_residual(
    model: nn.Module, points: dict[str, Point], acts: dict[str, torch.Tensor], n: int, tol: float
) -> None:
    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        scale = max(float(a.abs().max()), float(b.abs().max()), 1e-12)
        return float((a - b).abs().max()) <= tol * scale

    kind = type(model).__name__
    for i in range(n):
        pre, mid, post = acts[f"resid_pre.{i}"], acts[f"resid_mid.{i}"], acts[f"resid_post.{i}"]
        attn, mlp = acts[f"attn_out.{i}"], acts[f"mlp_out.{i}"]
        if not close(mid, pre + attn):
            raise ValueError(
                f"edge_attribution needs a residual stream: on {kind}, block {i}'s resid_mid.{i} "
                f"is not resid_pre.{i} + attn_out.{i} (a post-norm block, or norms after the "
                "branches); edges are defined for pre-norm residual models (GPT-2, Llama, ...)"
            )
        if not close(post, mid + mlp):
            raise ValueError(
                f"edge_attribution needs a residual stream: on {kind}, block {i}'s resid_post.{i} "
                f"is not resid_mid.{i} + mlp_out.{i}"
            )
        z = acts[f"attn_z.{i}"]
        proj = points[f"attn_z.{i}"].module
        with torch.no_grad():
            whole = _project(proj, z.flatten(-2), points[f"attn_z.{i}"].module_name)
        if not close(whole, attn):
            raise ValueError(
                f"edge_attribution needs attn_out to be the output projection of the heads: on "
                f"{kind}, block {i}'s attn_out.{i} is not {points[f'attn_z.{i}'].module_name}(attn_z.{i})"
            )
