"""Steering: add, ablate, cap or set a direction at chosen positions of chosen rows, in every
forward and ``generate`` of a block, each batch row with its own specs.

* :class:`Steer` -- what to do (``op``, ``vector``, ``scale``), where (``point``: a standard
  point, TransformerLens name or module), at which positions (``prompt``, ``generated``), and
  on what condition (``when``, a :class:`Probe`).
* :class:`Probe` -- a condition each row decides once, on its own unsteered prompt, and holds
  for its whole generation (the decision stays on the device: no synchronisation per step).
* :func:`steering` -- ``with steering(model, specs):`` steers every forward in the block; one
  spec (or ``None``) for every row, or a list with one entry per batch row (a spec, a list of
  specs, or ``None``).

Positions come from :mod:`pyhook.positions` (which row and which absolute position of its
unpadded sequence each column of a forward is: prefill or decode step, KV cache or not, left
padding), and the edits go through the hook layer every tool uses (:class:`~pyhook._hooks.HookSet`
on :class:`~pyhook.points.Point`), so an offloaded or tensor-parallel model sees whole vectors.
See docs/steering.md for the position picture and the peers' semantics.

>>> import torch, transformers, pyhook
>>> gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config(
...     n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=32)).eval()
>>> v = torch.randn(16)
>>> ids = torch.tensor([[0, 0, 5, 6], [1, 2, 3, 4]])
>>> am = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
>>> with pyhook.steering(gpt, [pyhook.Steer("resid_post.0", v, scale=4.0), None]):
...     out = gpt.generate(ids, attention_mask=am, max_new_tokens=3, do_sample=False,
...                        pad_token_id=0)
>>> out.shape
torch.Size([2, 7])
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._hooks import HookSet
from .modules import LayerNotFoundError, get_module, module_name_of
from .points import Point, resolve_targets
from .positions import PositionTracker, Where

__all__ = ["OPS", "Probe", "Steer", "SteeringError", "Steering", "match_norm", "steering"]

#: The operations of a :class:`Steer`.
OPS = ("add", "ablate", "cap", "replace")
_REDUCE = ("mean", "last")
# points whose tensor is the residual stream's width (checked against the config up front)
_RESID_KINDS = ("embed", "resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "final")


class SteeringError(ValueError):
    """A steering spec that cannot be honoured as given: one line naming the spec and what
    was expected, raised before any token is generated (nothing is left registered).

    >>> issubclass(SteeringError, ValueError)
    True
    """


def _vector(v: Any, who: str) -> torch.Tensor:
    try:
        t = torch.as_tensor(v).detach()
    except (TypeError, ValueError, RuntimeError) as e:
        raise SteeringError(f"{who}: the vector must be a tensor of numbers, got {e}") from None
    if t.is_complex() or t.dtype == torch.bool:
        raise SteeringError(
            f"{who}: the vector must hold real numbers (cast to the activation's dtype), got "
            f"dtype {t.dtype}"
        )
    if t.dim() not in (1, 2) or t.numel() == 0:
        raise SteeringError(
            f"{who}: the vector must be [width] (or [heads, d_head] at a per-head point), got "
            f"shape {tuple(t.shape)}"
        )
    if not t.is_floating_point():
        t = t.to(torch.get_default_dtype())
    return t


def _point_text(point: Any) -> str:
    return point if isinstance(point, str) else type(point).__name__


@dataclass(frozen=True, eq=False)
class Probe:
    """A condition for a :class:`Steer` (``when=``): each row computes
    ``activation · direction`` at ``point`` over its real prompt tokens, reduces it
    (``"mean"`` over them, or the ``"last"`` one), and steers iff the result is above
    ``threshold``. The row decides once, on its own unsteered prompt (the generation's first
    forward), and holds that decision for its whole generation.

    >>> p = Probe("resid_post.0", torch.ones(16), threshold=0.5, reduce="last")
    >>> p.reduce, p.threshold
    ('last', 0.5)
    """

    point: str | nn.Module
    direction: Any
    threshold: float = 0.0
    reduce: str = "mean"

    def __post_init__(self) -> None:
        who = f"Probe({_point_text(self.point)!r})"
        object.__setattr__(self, "direction", _vector(self.direction, who))
        if self.reduce not in _REDUCE:
            raise SteeringError(f"{who}: reduce must be 'mean' or 'last', got {self.reduce!r}")
        if not isinstance(self.threshold, numbers.Real) or isinstance(self.threshold, bool):
            raise SteeringError(f"{who}: threshold must be a number, got {self.threshold!r}")

    def describe(self) -> dict[str, Any]:
        """A JSON-able description (stored in a capture's metadata)."""
        return {
            "point": _point_text(self.point),
            "threshold": float(self.threshold),
            "reduce": self.reduce,
            "direction_norm": float(self.direction.double().norm()),
        }


@dataclass(frozen=True, eq=False)
class Steer:
    """One steering spec: at ``point`` (a standard point such as ``"resid_post.6"``, a
    TransformerLens name such as ``"blocks.6.hook_resid_post"``, ``"attn_z.3"`` with a
    ``[heads, d_head]`` vector, a module name or a module), on the positions chosen by
    ``prompt`` and ``generated``:

    * ``op="add"``: add ``scale * vector``;
    * ``op="ablate"``: remove ``scale`` times the component along ``vector`` (1: all of it);
    * ``op="cap"``: clamp the projection on ``vector``'s direction to at most ``scale``;
    * ``op="replace"``: set the projection on ``vector``'s direction to ``scale``.

    ``prompt``: ``"all"`` (every real prompt token), ``None``, or indices into the row's real
    prompt tokens (padding excluded; ``-1`` is the last real prompt token of each row).
    ``generated``: ``"all"``, ``None``, or ``(start, stop)``: the positions holding generated
    tokens ``start .. stop-1`` (0 is the first generated token, which first runs through the
    model in the step that predicts token 1). ``when``: a :class:`Probe` (steer only the rows
    whose prompt passes it). ``scale=0`` with ``add`` or ``ablate`` leaves the row untouched.

    >>> s = Steer("resid_post.0", [1.0, 0.0], scale=2.0, prompt=[-1], generated=(0, 4))
    >>> s.op, s.prompt, s.generated
    ('add', (-1,), (0, 4))
    """

    point: str | nn.Module
    vector: Any
    scale: float = 1.0
    op: str = "add"
    prompt: Any = "all"
    generated: Any = "all"
    when: Probe | None = None

    def __post_init__(self) -> None:
        who = self.label
        object.__setattr__(self, "vector", _vector(self.vector, who))
        if self.op not in OPS:
            raise SteeringError(f"{who}: op must be one of {', '.join(OPS)}, got {self.op!r}")
        if not isinstance(self.scale, numbers.Real) or isinstance(self.scale, bool):
            raise SteeringError(f"{who}: scale must be a number, got {self.scale!r}")
        if not math.isfinite(float(self.scale)):
            raise SteeringError(f"{who}: scale must be finite, got {self.scale!r}")
        p = self.prompt
        if isinstance(p, str) and p != "all":
            raise SteeringError(
                f"{who}: prompt must be 'all', None or a list of token indices, got {p!r}"
            )
        if p is not None and not isinstance(p, str):
            if isinstance(p, (str, bytes)) or not isinstance(p, (Sequence, torch.Tensor)):
                raise SteeringError(
                    f"{who}: prompt must be 'all', None or a list of token indices, got {p!r}"
                )
            idx = [int(i) for i in (p.tolist() if isinstance(p, torch.Tensor) else p)]
            object.__setattr__(self, "prompt", tuple(idx))
        g = self.generated
        if g is not None and not (isinstance(g, str) and g == "all"):
            ok = isinstance(g, (tuple, list)) and len(g) == 2
            ok = ok and all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in g)
            if not ok:
                raise SteeringError(
                    f"{who}: generated must be 'all', None or (start, stop), got {g!r}"
                )
            start, stop = int(g[0]), int(g[1])
            if start < 0 or start > stop:
                raise SteeringError(
                    f"{who}: generated=({start}, {stop}) must have 0 <= start <= stop "
                    "(generated tokens start..stop-1)"
                )
            object.__setattr__(self, "generated", (start, stop))
        if self.when is not None and not isinstance(self.when, Probe):
            raise SteeringError(f"{who}: when must be a pyhook.Probe, got {self.when!r}")

    @property
    def label(self) -> str:
        return f"Steer({_point_text(self.point)!r}, op={self.op!r})"

    @property
    def noop(self) -> bool:
        """Whether the spec leaves every value as it is (``scale=0`` with add or ablate)."""
        return self.op in ("add", "ablate") and float(self.scale) == 0.0

    def describe(self) -> dict[str, Any]:
        """A JSON-able description of the spec (stored in a capture's metadata).

        >>> Steer("resid_post.0", [3.0, 4.0]).describe()["vector_norm"]
        5.0
        """
        return {
            "point": _point_text(self.point),
            "op": self.op,
            "scale": float(self.scale),
            "prompt": self.prompt if self.prompt in (None, "all") else list(self.prompt),
            "generated": self.generated
            if self.generated in (None, "all")
            else list(self.generated),
            "vector_shape": list(self.vector.shape),
            "vector_norm": float(self.vector.double().norm()),
            "when": None if self.when is None else self.when.describe(),
        }


def match_norm(vector: Any, rows: Any) -> torch.Tensor:
    """``vector`` rescaled to the mean norm of ``rows`` (``[n, *vector.shape]`` activations,
    e.g. the target point's rows from a store): the norm matching of activation injection
    (activation oracles, patchscopes), where a vector read from one model or layer is added to
    another whose activations have another scale.

    >>> match_norm(torch.tensor([3.0, 4.0]), torch.tensor([[0.0, 10.0], [6.0, 8.0]])).tolist()
    [6.0, 8.0]
    """
    v = _vector(vector, "match_norm")
    try:
        r = torch.as_tensor(rows).detach()
    except (TypeError, ValueError, RuntimeError) as e:
        raise SteeringError(
            f"match_norm: rows must be a tensor of activations [n, *vector.shape], got "
            f"{type(rows).__name__} ({e})"
        ) from None
    if r.dim() < 1 or tuple(r.shape[1:]) != tuple(v.shape):
        raise SteeringError(
            f"match_norm: rows must be [n, {', '.join(map(str, v.shape))}], got {list(r.shape)}"
        )
    target = r.double().reshape(r.shape[0], -1).norm(dim=1).mean()
    norm = v.double().norm()
    if float(norm) == 0.0:
        raise SteeringError("match_norm: the vector is zero (no direction to rescale)")
    return (v.double() * (target / norm)).to(v.dtype)


# -- the machinery ------------------------------------------------------------------------------


class _Target:
    """One place hooked: a resolved point (or a module's output), the probes that read it and
    the steering groups that edit it, in the order the specs came."""

    def __init__(self, key: Any, name: str, point: Point) -> None:
        self.key = key
        self.name = name
        self.point = point
        self.probes: list[_ProbeState] = []
        self.groups: list[_Group] = []


class _ProbeState:
    def __init__(self, probe: Probe, target: _Target, rows: list[int]) -> None:
        self.probe = probe
        self.target = target
        self.rows = rows
        self.decision: torch.Tensor | None = None  # [batch] bool, on the device
        self.fired = False  # in this forward
        self._dir: dict[tuple[Any, Any], torch.Tensor] = {}

    def direction(self, like: torch.Tensor) -> torch.Tensor:
        key = (like.device, like.dtype)
        d = self._dir.get(key)
        if d is None:
            d = self._dir[key] = self.probe.direction.to(device=like.device, dtype=like.dtype)
        return d


class _Group:
    """The k-th spec of each row at one target, as per-row tensors (one edit for the batch)."""

    def __init__(self, specs: list[Steer | None], probes: dict[int, _ProbeState]) -> None:
        self.specs = specs
        self.batch = len(specs)
        live = [s for s in specs if s is not None and not s.noop]
        self.on_rows = [i for i, s in enumerate(specs) if s is not None and not s.noop]
        self.shape = tuple(live[0].vector.shape) if live else ()
        self.proj = any(s.op != "add" for s in live)
        self.simple_sel = all(s.prompt == "all" and s.generated == "all" for s in live)
        self.any_idx = any(isinstance(s.prompt, tuple) for s in live)
        conds: dict[int, tuple[_ProbeState, list[int]]] = {}
        for i, s in enumerate(specs):
            if s is not None and not s.noop and s.when is not None:
                conds.setdefault(id(s.when), (probes[id(s.when)], []))[1].append(i)
        # (probe, its rows in this group), applied as one [batch] mask each
        self.conds = list(conds.values())
        self.prompt_rows = [i for i in self.on_rows if specs[i].prompt is not None]  # type: ignore[union-attr]
        self._dev: dict[tuple[Any, Any], dict[str, torch.Tensor]] = {}

    def tensors(self, like: torch.Tensor) -> dict[str, torch.Tensor]:
        key = (like.device, like.dtype)
        got = self._dev.get(key)
        if got is not None:
            return got
        dev, dt = like.device, like.dtype
        b = self.batch
        w = torch.zeros((b, *self.shape), dtype=dt, device=dev)
        a = torch.zeros(b, dtype=dt)
        bc = torch.zeros(b, dtype=dt)
        cc = torch.zeros(b, dtype=dt)
        th = torch.zeros(b, dtype=dt)
        on = torch.zeros(b, dtype=torch.bool)
        p_all = torch.zeros(b, dtype=torch.bool)
        g_lo = torch.zeros(b, dtype=torch.long)
        g_hi = torch.zeros(b, dtype=torch.long)
        width = max([len(s.prompt) for s in self._live() if isinstance(s.prompt, tuple)] or [0])
        p_idx = torch.full((b, max(width, 1)), 1 << 40, dtype=torch.long)
        for i in self.on_rows:
            s = self.specs[i]
            assert s is not None
            v = s.vector.to(device=dev, dtype=dt)
            on[i] = True
            scale = float(s.scale)
            if s.op == "add":
                w[i] = v
                a[i] = scale
            else:
                w[i] = v / v.norm()
                if s.op == "ablate":
                    bc[i] = -scale
                elif s.op == "replace":
                    a[i], bc[i] = scale, -1.0
                else:  # cap
                    cc[i], th[i] = 1.0, scale
            if s.prompt == "all":
                p_all[i] = True
            elif isinstance(s.prompt, tuple):
                p_idx[i, : len(s.prompt)] = torch.tensor(s.prompt, dtype=torch.long)
            if s.generated == "all":
                g_hi[i] = 1 << 40
            elif s.generated is not None:
                g_lo[i], g_hi[i] = s.generated
        vd = (1,) * len(self.shape)
        got = {
            "w": w.reshape(b, 1, *self.shape),
            # add's edit, computed as the reference computes it (scale * vector)
            "delta": (a.to(dev).reshape(b, 1, *vd) * w.reshape(b, 1, *self.shape)),
            "a": a.to(dev).reshape(b, 1, *vd),
            "bc": bc.to(dev).reshape(b, 1, *vd),
            "cc": cc.to(dev).reshape(b, 1, *vd),
            "th": th.to(dev).reshape(b, 1, *vd),
            "on": on.to(dev),
            "p_all": p_all.to(dev),
            "p_idx": p_idx.to(dev),
            "g_lo": g_lo.to(dev),
            "g_hi": g_hi.to(dev),
        }
        for k, (_, rows) in enumerate(self.conds):
            flags = torch.zeros(b, dtype=torch.bool)
            flags[rows] = True
            got[f"cond{k}"] = flags.to(dev)
        self._dev[key] = got
        return got

    def _live(self) -> list[Steer]:
        return [s for s in self.specs if s is not None and not s.noop]

    def mask(self, where: Where, t: dict[str, torch.Tensor], dev: Any) -> torch.Tensor:
        """``[batch, tokens]`` bool: the columns this group edits in this forward."""
        real = where.real if where.real.device == dev else where.real.to(dev)
        if self.simple_sel:
            m = real & t["on"][:, None]
        else:
            pos = where.positions.to(dev)
            lengths = where.prompt_lengths.to(dev)
            is_p = real & (pos < lengths[:, None])
            gen = pos - lengths[:, None]
            m = is_p & t["p_all"][:, None]
            if self.any_idx:
                idx = t["p_idx"]
                idx = torch.where(idx < 0, idx + lengths[:, None], idx)
                m = m | (is_p & (pos[:, :, None] == idx[:, None, :]).any(-1))
            m = m | (real & (gen >= t["g_lo"][:, None]) & (gen < t["g_hi"][:, None]))
            m = m & t["on"][:, None]
        for k, (state, _) in enumerate(self.conds):  # on the device: no host read
            rows = t[f"cond{k}"]
            keep = ~rows if state.decision is None else state.decision.to(dev) | ~rows
            m = m & keep[:, None]  # undecided rows are not steered
        return m

    def apply(self, x: torch.Tensor, where: Where) -> torch.Tensor:
        t = self.tensors(x)
        m = self.mask(where, t, x.device)
        m = m.reshape(*m.shape, *(1,) * (x.dim() - 2))
        if not self.proj:
            return torch.where(m, x + t["delta"], x)
        dims = tuple(range(x.dim() - len(self.shape), x.dim()))
        w = t["w"]
        proj = (x * w).sum(dims, keepdim=True)
        coef = t["a"] + t["bc"] * proj - t["cc"] * torch.relu(proj - t["th"])
        return torch.where(m, x + coef * w, x)


class Steering:
    """What :func:`steering` returns: the block's :class:`~pyhook.positions.PositionTracker`
    (``tracker.where`` is the last forward's) and the probes' decisions.

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4))
    >>> with steering(net, Steer("0", torch.ones(4), scale=0.0)) as st:
    ...     _ = net(torch.zeros(1, 3, 4))
    >>> st.decisions()
    [None]
    """

    def __init__(self, model: nn.Module, specs: Any) -> None:
        self.model = model
        # a list: one entry per batch row; a tuple: several specs for every row
        self.per_row = isinstance(specs, list)
        self._specs = specs
        self.hooks = HookSet(model=model)
        self._targets: dict[Any, _Target] = {}
        self._by_batch: dict[int, list[list[Steer]]] = {}
        self._rows: list[list[Steer]] = []
        self._probes: list[_ProbeState] = []
        self._built_for: int | None = None
        self.tracker: PositionTracker | None = None
        self._steered_prompt: set[int] = set()  # rows whose prompt was steered this forward

    # -- setting up ---------------------------------------------------------------------------
    def _entries(self) -> list[list[Steer]]:
        specs = self._specs
        if not self.per_row:
            if specs is None:
                return [[]]
            if isinstance(specs, tuple) and all(isinstance(s, Steer) for s in specs):
                return [list(specs)]
            if not isinstance(specs, Steer):
                raise SteeringError(
                    "steering: specs must be a pyhook.Steer, None, a tuple of specs (each row "
                    "all of them) or a list with one entry per batch row, got "
                    f"{type(specs).__name__}"
                )
            return [[specs]]
        rows = []
        for r, e in enumerate(specs):
            if e is None:
                rows.append([])
            elif isinstance(e, Steer):
                rows.append([e])
            elif isinstance(e, (list, tuple)) and all(isinstance(s, Steer) for s in e):
                rows.append(list(e))
            else:
                raise SteeringError(
                    f"steering: entry {r} of specs must be a pyhook.Steer, a list of them or "
                    f"None, got {e!r}"
                )
        return rows

    def _target(self, point: Any, who: str) -> _Target:
        key = point if isinstance(point, str) else id(point)
        got = self._targets.get(key)
        if got is not None:
            return got
        model = self.model
        if isinstance(point, nn.Module):
            try:
                name = module_name_of(model, point)
            except ValueError:
                raise SteeringError(f"{who}: the module is not inside the steered model") from None
            p = Point(
                name=name or type(point).__name__, module_name=name, module=point, kind="output"
            )
        elif isinstance(point, str):
            try:
                hits = resolve_targets(model, point)
                if hits is None:
                    module = get_module(model, point)
                    p = Point(name=point, module_name=point, module=module, kind="output")
                elif len(hits) != 1 or type(hits[0][1]) is not Point:
                    raise SteeringError(
                        f"{who}: point must name one place, {point!r} names {len(hits)}"
                    )
                else:
                    p = hits[0][1]
            except LayerNotFoundError as e:
                msg = e.args[-1] if e.args else str(e)
                raise SteeringError(f"{who}: unknown point: {msg}") from None
        else:
            raise SteeringError(
                f"{who}: point must be a point name or a module, got {type(point).__name__}"
            )
        if p.flat:
            raise SteeringError(
                f"{who}: point {p.name!r} is computed as [batch*tokens, ...] on this "
                "architecture; steer a [batch, tokens, ...] point (resid_*, attn_out, mlp_out)"
            )
        t = self._targets[key] = _Target(key, p.name, p)
        return t

    def _check_width(self, spec: Steer | Probe, t: _Target, vec: torch.Tensor) -> None:
        who = spec.label if isinstance(spec, Steer) else f"Probe({_point_text(spec.point)!r})"
        p = t.point
        if p.heads is not None:
            cfg = getattr(self.model, "config", None)
            d = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
            want = (p.heads, d // p.heads) if d else None
            if vec.dim() != 2 or (want is not None and tuple(vec.shape) != want):
                raise SteeringError(
                    f"{who}: per-head point {p.name!r} takes a [heads, d_head] vector"
                    + (f" {list(want)}" if want else "")
                    + f", got shape {list(vec.shape)}"
                )
            return
        kind = p.kind_name
        cfg = getattr(self.model, "config", None)
        d = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
        if vec.dim() != 1:
            raise SteeringError(
                f"{who}: point {p.name!r} takes a [width] vector, got shape {list(vec.shape)}"
            )
        if kind in _RESID_KINDS and isinstance(d, int) and vec.shape[0] != d:
            raise SteeringError(
                f"{who}: the vector has width {vec.shape[0]}, point {p.name!r} is {d} wide"
            )

    def _setup(self) -> None:
        rows = self._entries()
        self._rows = rows
        for specs in rows:
            for s in specs:
                t = self._target(s.point, s.label)
                self._check_width(s, t, s.vector)
                if s.when is not None:
                    pt = self._target(s.when.point, f"Probe({_point_text(s.when.point)!r})")
                    self._check_width(s.when, pt, s.when.direction)
        self.tracker = PositionTracker(self.model, self.hooks)
        self.tracker.listeners.append(self._on_forward)
        for t in self._targets.values():
            # before other hooks on the module: observers (a Trace, a capture) see the steered value
            t.point.register(self.hooks, self._make_hook(t), prepend=True)

    def _build(self, batch: int) -> None:
        """Per-row groups and probe states for a batch of ``batch`` rows."""
        if self._built_for == batch:
            return
        rows = self._rows if self.per_row else self._rows * batch
        for t in self._targets.values():
            t.probes, t.groups = [], []
        self._probes = []
        probes: dict[int, _ProbeState] = {}
        for r, specs in enumerate(rows):
            for s in specs:
                if s.when is not None and id(s.when) not in probes:
                    pt = self._targets[
                        s.when.point if isinstance(s.when.point, str) else id(s.when.point)
                    ]
                    st = probes[id(s.when)] = _ProbeState(s.when, pt, [])
                    pt.probes.append(st)
                    self._probes.append(st)
                if s.when is not None:
                    probes[id(s.when)].rows.append(r)
        for t in self._targets.values():
            per_row = [[s for s in specs if self._targets_key(s.point) == t.key] for specs in rows]
            depth = max((len(x) for x in per_row), default=0)
            for k in range(depth):
                g = _Group([x[k] if k < len(x) else None for x in per_row], probes)
                if g.on_rows:
                    t.groups.append(g)
        self._built_for = batch

    def _targets_key(self, point: Any) -> Any:
        return point if isinstance(point, str) else id(point)

    # -- per forward --------------------------------------------------------------------------
    def _on_forward(self, where: Where) -> None:
        b = where.batch
        if self.per_row and len(self._rows) != b:
            raise SteeringError(
                f"steering: specs has {len(self._rows)} entries (one per batch row), the batch "
                f"has {b} rows"
            )
        self._build(b)
        self._steered_prompt = set()
        for st in self._probes:
            st.fired = False
        if where.step == 0:
            for st in self._probes:
                st.decision = None
            self._check_prompt_indices(where)

    def _check_prompt_indices(self, where: Where) -> None:
        rows = self._rows if self.per_row else self._rows * where.batch
        if not any(isinstance(s.prompt, tuple) for specs in rows for s in specs):
            return
        lengths = where.prompt_lengths.tolist()  # once per generation
        for r, specs in enumerate(rows):
            n = int(lengths[r])
            for s in specs:
                if isinstance(s.prompt, tuple):
                    bad = [i for i in s.prompt if not -n <= i < n]
                    if bad:
                        raise SteeringError(
                            f"{s.label}: prompt index {bad[0]} is outside row {r}'s prompt "
                            f"({n} real tokens: indices {-n}..{n - 1})"
                        )

    def _make_hook(self, t: _Target) -> Any:
        def hook(_module: nn.Module, _args: Any, value: Any) -> Any:
            where = self.tracker.where if self.tracker is not None else None
            if where is None or not isinstance(value, torch.Tensor):
                return None
            if value.dim() < 2 or value.shape[0] != where.batch or value.shape[1] != where.tokens:
                raise SteeringError(
                    f"steering at {t.name!r}: expected a [batch, tokens, ...] tensor "
                    f"[{where.batch}, {where.tokens}, ...], got shape {list(value.shape)}"
                )
            first = where.step == 0
            for st in t.probes:
                if first:
                    self._probe(st, value, where)
                st.fired = True
            x = value
            for g in t.groups:
                if len(g.shape) and tuple(value.shape[2:]) != g.shape:
                    s = next(s for s in g.specs if s is not None and not s.noop)
                    raise SteeringError(
                        f"{s.label}: the vector has shape {list(g.shape)}, point {t.name!r} "
                        f"holds [{', '.join(str(d) for d in value.shape[2:])}] a token"
                    )
                if first:
                    self._check_order(g, t)
                x = g.apply(x, where)
            if first:
                for g in t.groups:
                    self._steered_prompt.update(g.prompt_rows)
            return None if x is value else x

        return hook

    def _check_order(self, g: _Group, t: _Target) -> None:
        for st, rows in g.conds:
            for row in rows:
                s = g.specs[row]
                assert s is not None
                if not st.fired and s.prompt is not None:
                    raise SteeringError(
                        f"{s.label}: its Probe at {st.target.name!r} runs after {t.name!r}, so "
                        f"the prompt of row {row} cannot be steered on a decision made on it: "
                        "probe a point that runs earlier, or steer generated tokens only "
                        "(prompt=None)"
                    )

    def _probe(self, st: _ProbeState, x: torch.Tensor, where: Where) -> None:
        hit = sorted(set(st.rows) & self._steered_prompt)
        if hit:
            raise SteeringError(
                f"Probe({st.probe.point!r}): row {hit[0]}'s prompt is steered at a point that "
                "runs before the probe, so it cannot decide on its unsteered prompt: probe an "
                "earlier point, or steer that row's generated tokens only (prompt=None)"
            )
        d = st.direction(x)
        if tuple(x.shape[2:]) != tuple(d.shape):
            raise SteeringError(
                f"Probe({_point_text(st.probe.point)!r}): the direction has shape "
                f"{list(d.shape)}, point {st.target.name!r} holds "
                f"[{', '.join(str(n) for n in x.shape[2:])}] a token"
            )
        dims = tuple(range(2, x.dim()))
        with torch.no_grad():
            score = (x.detach() * d).sum(dims) if dims else x.detach() * d
            dev = x.device
            pos = where.positions.to(dev)
            lengths = where.prompt_lengths.to(dev)
            is_p = where.real.to(dev) & (pos < lengths[:, None])
            if st.probe.reduce == "mean":
                red = torch.where(is_p, score, 0).sum(1) / is_p.sum(1).clamp(min=1)
            else:
                red = torch.where(is_p & (pos == lengths[:, None] - 1), score, 0).sum(1)
            st.decision = red > float(st.probe.threshold)

    # -- the block ----------------------------------------------------------------------------
    def decisions(self) -> list[bool | None]:
        """Each row's decision in the last generation (None: the row has no probe; reading
        them synchronises with the device)."""
        rows = self._rows if self.per_row else self._rows * (self._built_for or 1)
        out: list[bool | None] = [None] * len(rows)
        for st in self._probes:
            if st.decision is None:
                continue
            flags = st.decision.tolist()
            for r in st.rows:
                out[r] = bool(flags[r]) and bool(out[r] if out[r] is not None else True)
        return out


@contextlib.contextmanager
def steering(model: nn.Module, specs: Any) -> Iterator[Steering]:
    """Steer every forward of ``model`` (and every ``model.generate``) inside the block.

    ``specs``: one :class:`Steer` for every row (or ``None``; a tuple of specs: all of them on
    every row, in order), or a list with one entry per batch row: a :class:`Steer`, a list of
    them (applied in order), or ``None`` (that row is not steered). Positions are each row's own (left padding and the KV cache accounted for,
    see :mod:`pyhook.positions`). Bad specs raise :class:`SteeringError` before any token is
    generated; nothing stays registered after the block, whatever happened in it.

    >>> import torch, transformers, pyhook
    >>> gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config(
    ...     n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=32)).eval()
    >>> probe = pyhook.Probe("resid_post.0", torch.ones(16), threshold=0.0)
    >>> spec = pyhook.Steer("resid_post.1", torch.ones(16), scale=3.0, prompt=None, when=probe)
    >>> with pyhook.steering(gpt, spec) as st:
    ...     _ = gpt.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False,
    ...                      pad_token_id=0)
    >>> len(st.decisions())
    1
    """
    st = Steering(model, specs)
    with st.hooks.registering():
        st._setup()
    try:
        yield st
    finally:
        st.hooks.remove()
