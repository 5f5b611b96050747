"""Dictionaries (SAEs, transcoders, CLTs) spliced into a model at standard points.

* :func:`splice` runs the model with dictionaries at points while a ``with`` block lasts: each
  dictionary encodes its input site once per forward, ``features`` holds what it read, ``edit``
  changes features and moves the output site by exactly the decoded change; with
  ``error=False`` the output sites are replaced by the reconstructions.
* :func:`evaluate_dictionaries` measures dictionaries over batches of token ids (or a store's):
  FVU, L0, dead features, and the KL / cross-entropy increase with one, some or all of them
  spliced in (SAEBench's core metrics).

Keys and the protocol are those of :mod:`pyhook.dictionaries`. Hooks are registered through
:class:`pyhook._hooks.HookSet` on :class:`pyhook.points.Point` s, so the sites mean the same
tensor on every architecture pyhook names, and on offloaded and tensor-parallel models each
hook sees the whole tensor (:func:`pyhook.distributed.layout_hook`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ._hooks import HookSet
from .dictionaries import (
    DictionaryError,
    SparseFeatures,
    as_dictionary,
    dense_features,
    module_of,
    parse_key,
)
from .points import resolve_point

__all__ = ["DictionaryEval", "Splice", "evaluate_dictionaries", "splice"]


def _param(d: Any) -> Tensor | None:
    m = module_of(d)
    if isinstance(m, nn.Module):
        for p in m.parameters():
            if p.is_floating_point():
                return p
    return None


def _devices(key: Any, d: Any) -> set[torch.device]:
    """The devices of a dictionary's parameters and buffers; one on the meta device (made
    without data) is refused by name, before any forward."""
    m = module_of(d)
    if not isinstance(m, nn.Module):
        return set()
    devices = {t.device for t in itertools.chain(m.parameters(), m.buffers())}
    if any(dev.type == "meta" for dev in devices):
        raise DictionaryError(
            f"splice: the dictionary at {key!r} ({type(m).__name__}) has tensors on the meta "
            "device (made without data, e.g. under init_empty_weights or device='meta'): load "
            "its weights onto a real device before splicing it in"
        )
    return devices


def _clone(f: Any) -> Any:
    if isinstance(f, SparseFeatures):
        return SparseFeatures(f.values.clone(), f.indices.clone(), f.size)
    return f.clone()


def _leaf(f: Any) -> Any:
    """Features as a leaf that collects its gradient (``.grad`` after a backward)."""
    if isinstance(f, SparseFeatures):
        return SparseFeatures(f.values.detach().requires_grad_(), f.indices, f.size)
    if isinstance(f, Tensor) and f.is_floating_point():
        return f.detach().requires_grad_()
    return f


def _retain(f: Any) -> None:
    t = f.values if isinstance(f, SparseFeatures) else f
    if isinstance(t, Tensor) and t.requires_grad and not t.is_leaf:
        t.retain_grad()


class _Site:
    """One dictionary in a splice: where it reads and writes, and this forward's state."""

    __slots__ = ("clt", "dictionary", "edit", "key", "outputs", "pending", "single", "source")

    def __init__(self, key: Any, dictionary: Any, edit: Callable[[Any], Any] | None) -> None:
        self.key = key
        self.source, self.outputs, self.clt = parse_key(key)
        self.dictionary = as_dictionary(dictionary)
        # parameters on one device: the dictionary runs there; on several (a CLT whose decoders
        # sit beside their layers): its own code places its inputs, handed the site as it is
        self.single = len(_devices(key, self.dictionary)) == 1
        self.edit = edit
        # the deltas (or reconstructions) for the output points, set by the read, used by writes
        self.pending: dict[str, Tensor] = {}

    def place(self, x: Tensor) -> Tensor:
        """The site's tensor where the dictionary computes: on the device of its parameters
        (the result goes back to each output site's device in :meth:`Splice._write`; both moves
        are differentiable, so gradients reach the dictionary's own parameters) and in their
        dtype. A dictionary without parameters reads the site as it is."""
        p = _param(self.dictionary)
        if p is None:
            return x
        if self.single and p.device != x.device:
            return x.to(device=p.device, dtype=p.dtype)
        return x.to(p.dtype)


def _prompt_sel(p: Any) -> Any:
    if p is None or (isinstance(p, str) and p == "all"):
        return p
    if isinstance(p, (str, bytes)) or not isinstance(p, (Sequence, Tensor)):
        raise DictionaryError(f"splice: prompt must be 'all', None or token indices, got {p!r}")
    return tuple(int(i) for i in (p.tolist() if isinstance(p, Tensor) else p))


def _generated_sel(g: Any) -> Any:
    if g is None or (isinstance(g, str) and g == "all"):
        return g
    ok = isinstance(g, (tuple, list)) and len(g) == 2
    if not ok or not all(isinstance(x, int) and not isinstance(x, bool) for x in g):
        raise DictionaryError(f"splice: generated must be 'all', None or (start, stop), got {g!r}")
    if not 0 <= g[0] <= g[1]:
        raise DictionaryError(f"splice: generated={tuple(g)!r} must have 0 <= start <= stop")
    return (int(g[0]), int(g[1]))


def _position_mask(where: Any, prompt: Any, generated: Any, device: torch.device) -> Tensor:
    """``[batch, tokens]`` bool: the columns of this forward the splice acts on."""
    pos = where.positions.to(device)
    real = where.real.to(device)
    lengths = where.prompt_lengths.to(device)[:, None]
    is_prompt = real & (pos < lengths)
    m = torch.zeros_like(real)
    if isinstance(prompt, str):
        m = m | is_prompt
    elif prompt:
        idx = torch.tensor(prompt, device=device)
        idx = torch.where(idx < 0, idx + lengths, idx)  # [batch, k]: -1 is each row's last
        m = m | (is_prompt & (pos[:, :, None] == idx[:, None, :]).any(-1))
    gen = pos - lengths
    if isinstance(generated, str):
        m = m | (real & (gen >= 0))
    elif generated is not None:
        m = m | (real & (gen >= generated[0]) & (gen < generated[1]))
    return m


def _broadcast(m: Tensor, y: Tensor, name: str) -> Tensor:
    b, t = m.shape
    if y.dim() >= 2 and y.shape[0] == b and y.shape[1] == t:
        return m.reshape(b, t, *(1,) * (y.dim() - 2))
    if y.shape[0] == b * t:  # a point the model computes as [batch*tokens, ...]
        return m.reshape(b * t, *(1,) * (y.dim() - 1))
    raise DictionaryError(
        f"splice: {name!r} has shape {tuple(y.shape)}, which is not [batch, tokens, ...] of "
        f"this forward ({b}, {t}): positions cannot be chosen there"
    )


class Splice:
    """What :func:`splice` returns: a context manager holding the hooks while its block runs.

    ``features[key]`` holds the features each dictionary read in the last forward (a tensor, or
    :class:`~pyhook.dictionaries.SparseFeatures` for a top-k coder); with autograd on they
    collect their gradient (``features[key].grad`` after a backward). ``edited[key]`` holds the
    features after ``edit``. ``dictionaries[key]`` is each dictionary under the protocol.

    >>> import torch, transformers, pyhook
    >>> cfg = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=64)
    >>> model = transformers.GPT2LMHeadModel(cfg).eval()
    >>> class SAE(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.W = torch.nn.Parameter(torch.randn(16, 32) / 4)
    ...     def encode(self, x): return torch.relu(x @ self.W)
    ...     def decode(self, f): return f @ self.W.T
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> with torch.no_grad(), pyhook.splice(model, {"resid_post.0": SAE()}) as sp:
    ...     out = model(ids).logits
    >>> torch.equal(out, model(ids).logits), tuple(sp.features["resid_post.0"].shape)
    (True, (1, 3, 32))
    """

    def __init__(
        self,
        model: nn.Module,
        dictionaries: Mapping[Any, Any],
        *,
        error: bool = True,
        edit: Mapping[Any, Callable[[Any], Any]] | None = None,
        prompt: Any = "all",
        generated: Any = "all",
    ) -> None:
        if not isinstance(dictionaries, Mapping) or not dictionaries:
            raise DictionaryError(
                "splice: dictionaries must be a non-empty dict {point or (input, output): "
                f"dictionary}}, got {type(dictionaries).__name__}"
            )
        edit = dict(edit or {})
        unknown = [k for k in edit if k not in dictionaries]
        if unknown:
            raise DictionaryError(
                f"splice: edit names {unknown!r}, which are not keys of the dictionaries "
                f"({list(dictionaries)!r})"
            )
        for k, fn in edit.items():
            if not callable(fn):
                raise DictionaryError(
                    f"splice: edit[{k!r}] must be a function of the features, got "
                    f"{type(fn).__name__}"
                )
        self.model = model
        self.error = bool(error)
        self.prompt = _prompt_sel(prompt)
        self.generated = _generated_sel(generated)
        # every position (padding too: no bookkeeping), or those chosen through pyhook.positions
        self._everywhere = self.prompt == "all" and self.generated == "all"
        self._tracker: Any = None
        self.sites = [_Site(k, d, edit.get(k)) for k, d in dictionaries.items()]
        self.dictionaries = {s.key: s.dictionary for s in self.sites}
        self.features: dict[Any, Any] = {}
        self.edited: dict[Any, Any] = {}
        self._points: dict[str, Any] = {}
        writers: dict[str, list[Any]] = {}
        for s in self.sites:
            for name in (s.source, *s.outputs):
                if name not in self._points:
                    self._points[name] = resolve_point(model, name)
            if s.clt and len(set(s.outputs)) != len(s.outputs):
                raise DictionaryError(f"splice: {s.key!r} writes one point twice")
            for name in s.outputs:
                writers.setdefault(name, []).append(s.key)
        if not self.error:
            shared = {n: ks for n, ks in writers.items() if len(ks) > 1}
            if shared:
                raise DictionaryError(
                    "splice(error=False): several dictionaries replace the same point "
                    f"({shared!r}); give each point one writer, or keep the error term"
                )
        self._hooks: HookSet | None = None

    # -- the forward ------------------------------------------------------------------------
    def _read(self, site: _Site, x: Tensor) -> None:
        """Encode the input site once; leave per-output deltas (or reconstructions) pending."""
        dictionary = site.dictionary
        grad = torch.is_grad_enabled()
        # error=True: the model is unchanged, so the encoder reads x outside the graph (every
        # gradient upstream is the model's own) and the features are leaves of the dictionary
        # branch; error=False: the site *is* the reconstruction, gradients run through it.
        xin = site.place(x.detach() if self.error else x)
        try:
            f = dictionary.encode(xin)
        except Exception as e:
            raise DictionaryError(
                f"splice: the dictionary at {site.key!r} ({type(module_of(dictionary)).__name__}) "
                f"failed to encode {site.source!r}, a tensor of shape {tuple(x.shape)} and dtype "
                f"{x.dtype} on {x.device}: {e}"
            ) from e
        if self.error and grad:
            f = _leaf(f)
        elif grad:
            _retain(f)
        self.features[site.key] = f
        new = f
        if site.edit is not None:
            g = site.edit(_clone(f))
            new = g if g is not None else new
            self.edited[site.key] = new
        site.pending = {}
        if self.error and site.edit is None and not grad:
            return  # the site is unchanged and nothing needs the decoder: skip it
        wants = _decode(dictionary, new, site)
        if not self.error:
            site.pending = dict(zip(site.outputs, wants))
            return
        base = wants if site.edit is None else _decode(dictionary, f, site)
        if site.edit is None:  # value 0, gradient through the features
            site.pending = {n: w - w.detach() for n, w in zip(site.outputs, wants)}
        else:
            site.pending = {n: w - b for n, w, b in zip(site.outputs, wants, base)}

    def _write(self, site: _Site, name: str, y: Tensor) -> Tensor | None:
        delta = site.pending.pop(name, None)
        if delta is None:
            if self.error and site.edit is None and not torch.is_grad_enabled():
                return None  # nothing to add: the decoder was skipped
            raise DictionaryError(
                f"splice: {name!r} ran before {site.source!r} in this forward; the dictionary "
                f"at {site.key!r} has no features to decode there"
            )
        if delta.shape != y.shape:
            raise DictionaryError(
                f"splice: the dictionary at {site.key!r} decodes to shape {tuple(delta.shape)}, "
                f"but {name!r} has shape {tuple(y.shape)}"
            )
        # from the dictionary's device (or a CLT's read site's) to this site's
        delta = delta.to(device=y.device, dtype=y.dtype)
        if self._everywhere:
            return delta if not self.error else y + delta
        where = self._tracker.where if self._tracker is not None else None
        if where is None:
            raise DictionaryError(
                f"splice: positions were chosen (prompt={self.prompt!r}, "
                f"generated={self.generated!r}) but the forward writing {name!r} was called "
                "without token ids [batch, tokens] to place them"
            )
        m = _broadcast(_position_mask(where, self.prompt, self.generated, y.device), y, name)
        if not self.error:
            return torch.where(m, delta, y)
        return y + torch.where(m, delta, torch.zeros_like(delta))

    def _per_head(self, name: str) -> bool:
        """Whether ``name`` is a per-head point (attn_z), handed ``[..., heads, d_head]``:
        dictionaries read and write it as ``[..., heads * d_head]``, as SAELens' attention
        SAEs do (the splice's hooks and :func:`evaluate_dictionaries` alike)."""
        return getattr(self._points[name], "heads", None) is not None

    def _hook_for(self, name: str) -> Callable[..., Any]:
        reads = [s for s in self.sites if s.source == name]
        writes = [s for s in self.sites if name in s.outputs]
        heads = self._per_head(name)

        def hook(_module: nn.Module, _args: Any, value: Any) -> Any:
            if not isinstance(value, Tensor):
                raise DictionaryError(f"splice: point {name!r} handed no tensor")
            flat = value.flatten(-2) if heads else value
            for s in reads:
                self._read(s, flat)
            out = flat
            for s in writes:
                new = self._write(s, name, out)
                if new is not None:
                    out = new
            if out is flat:
                return None
            return out.reshape(value.shape) if heads else out

        return hook

    # -- the block -----------------------------------------------------------------------------
    def __enter__(self) -> Splice:
        if self._hooks is not None:
            raise RuntimeError("splice: this splice is already active (its block is open)")
        hooks = HookSet(model=self.model)
        with hooks.registering():
            # a forward starts with nothing pending (a write never uses an earlier forward's)
            hooks.forward_pre(self.model, self._forward_starts)
            if not self._everywhere:
                from .positions import PositionTracker

                self._tracker = PositionTracker(self.model, hooks)
            for name, point in self._points.items():
                point.register(hooks, self._hook_for(name))
        self._hooks = hooks
        return self

    def _forward_starts(self, _module: nn.Module, _args: Any) -> None:
        for s in self.sites:
            if s.pending:
                s.pending = {}

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Remove every hook (idempotent); the features of the last forward stay."""
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.remove()
        self._tracker = None
        for s in self.sites:
            s.pending = {}


def _decode(dictionary: Any, f: Any, site: _Site) -> list[Tensor]:
    out = dictionary.decode(f)
    if isinstance(out, Tensor):
        if site.clt:
            if out.dim() >= 2 and out.shape[-2] == len(site.outputs):
                return list(out.unbind(-2))
            raise DictionaryError(
                f"splice: the CLT at {site.key!r} decoded one tensor of shape "
                f"{tuple(out.shape)}; expected a list with one per output point "
                f"({len(site.outputs)}), or [..., {len(site.outputs)}, d]"
            )
        return [out]
    outs = list(out)
    if len(outs) != len(site.outputs):
        raise DictionaryError(
            f"splice: the dictionary at {site.key!r} decoded {len(outs)} tensors for "
            f"{len(site.outputs)} output points"
        )
    return outs


def splice(
    model: nn.Module,
    dictionaries: Mapping[Any, Any],
    *,
    error: bool = True,
    edit: Mapping[Any, Callable[[Any], Any]] | None = None,
    prompt: Any = "all",
    generated: Any = "all",
) -> Splice:
    """Splice dictionaries into ``model`` while the returned context's block runs.

    ``dictionaries`` maps keys to dictionaries (see :mod:`pyhook.dictionaries`): an SAE at a
    point (``"resid_post.3"``), a transcoder reading one point and writing another
    (``("mlp_in.3", "mlp_out.3")``), a CLT reading one and writing several
    (``("mlp_in.3", ("mlp_out.3", "mlp_out.4"))``).

    * ``error=True``: each dictionary encodes its input once per forward, the model's output is
      unchanged (bitwise: the output site becomes ``y + (x_hat - x_hat.detach())``, which is
      ``y`` plus an exact zero) and so is every gradient upstream of the site; the features
      are leaves whose gradient is the gradient at the output site through the decoder. Without
      autograd and without an edit, the decoder does not run at all.
    * ``edit={key: fn}``: ``fn(features) -> features`` (it gets a copy; returning None keeps the
      copy as edited in place), and the output site moves by exactly
      ``decode(edited) - decode(features)``, the error term kept.
    * ``error=False``: each output site is replaced by the reconstruction ``decode(features)``
      (of the edited features with ``edit``), gradients running through the dictionary.

    Each dictionary runs where its parameters are: a site on another device (a model on the
    GPU, a dictionary in host memory, or the reverse) is moved to the dictionary's device and
    the decoded change back to each output site's device, both moves differentiable, so
    ``features`` live on the dictionary's device and gradients reach its own parameters. A
    dictionary with tensors on the meta device is refused by name when the splice is made.
    Works during ``generate``: by default every position
    is spliced (each position's features depend on that position alone, so the KV cache and
    padding change nothing); ``prompt`` (``"all"``, None, or indices into each row's real
    prompt tokens, ``-1`` its last) and ``generated`` (``"all"``, None, or ``(start, stop)``:
    generated tokens ``start .. stop-1``) choose the positions whose sites change, as
    :class:`~pyhook.Steer` does, from :mod:`pyhook.positions` (each row's absolute positions
    under left padding and the KV cache); elsewhere the sites stay the model's own. Features
    are read at every position.

    >>> import torch, transformers, pyhook
    >>> cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    ...                                num_attention_heads=2, vocab_size=64)
    >>> model = transformers.LlamaForCausalLM(cfg).eval()
    >>> class SAE(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.W = torch.nn.Parameter(torch.randn(16, 32) / 4)
    ...     def encode(self, x): return torch.relu(x @ self.W)
    ...     def decode(self, f): return f @ self.W.T
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> with pyhook.splice(model, {"resid_post.0": SAE()}, edit={"resid_post.0": lambda f: f * 0}) as sp:
    ...     out = model(ids).logits
    >>> bool((out != model(ids).logits).any())  # the edit moved the output
    True
    """
    return Splice(model, dictionaries, error=error, edit=edit, prompt=prompt, generated=generated)


# -- evaluation ----------------------------------------------------------------------------------


@dataclasses.dataclass
class DictionaryEval:
    """What :func:`evaluate_dictionaries` measured.

    ``per_dictionary[key]``: ``fvu`` (fraction of variance unexplained over all tokens,
    1 - SAEBench's explained variance; per output point for a CLT: a list), ``mse``,
    ``cossim`` and ``l2_ratio`` (token means of the reconstruction's cosine with and norm over
    the target), ``l0`` (mean active features per token), ``l1``, ``dead`` (features never
    active), ``dead_fraction``, ``tokens``. ``spliced[name]`` for each set of keys spliced in
    with ``error=False`` (``name`` is the key for one, ``"all"`` for all, or the tuple of keys
    given): ``kl`` (mean over tokens of KL(clean || spliced) of the next-token
    distributions), ``ce_clean``, ``ce_spliced``, ``ce_increase``, and with ``ablation`` the
    same with the set's output points zeroed (``kl_ablation``, ``ce_ablation``) and
    SAEBench's ``kl_div_score`` and ``ce_loss_score``.

    >>> DictionaryEval({}, {}).spliced
    {}
    """

    per_dictionary: dict[Any, dict[str, Any]]
    spliced: dict[Any, dict[str, float]]


def _batches_of(source: Any, batch_size: int) -> Iterable[tuple[Tensor, Tensor | None]]:
    """``(input_ids, attention_mask)`` batches of token ids, a store's or given."""
    if hasattr(type(source), "row_index") and hasattr(type(source), "tokens"):  # a store
        ids, where = source.tokens, source.row_index
        if ids is None or where is None:
            raise DictionaryError(
                "evaluate_dictionaries: this store keeps no token ids and row index (capture "
                "with token annotations to evaluate on its tokens)"
            )
        examples: dict[int, list[tuple[int, int]]] = {}
        for tok, (ex, pos) in zip(ids.tolist(), where.tolist()):
            examples.setdefault(ex, []).append((pos, tok))
        seqs = [[t for _, t in sorted(v)] for _, v in sorted(examples.items())]
        for i in range(0, len(seqs), batch_size):
            chunk = seqs[i : i + batch_size]
            width = max(len(s) for s in chunk)
            batch = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for r, s in enumerate(chunk):
                batch[r, : len(s)] = torch.tensor(s)
                mask[r, : len(s)] = 1
            yield batch, mask
        return
    for b in source:
        if isinstance(b, Tensor):
            yield (b if b.dim() == 2 else b.unsqueeze(0)), None
        elif isinstance(b, Mapping) and "input_ids" in b:
            yield b["input_ids"], b.get("attention_mask")
        else:
            raise DictionaryError(
                "evaluate_dictionaries: batches must be token-id tensors [batch, tokens], dicts "
                f"with 'input_ids' (and 'attention_mask'), or a store; got {type(b).__name__}"
            )


class _Acc:
    """Running sums for FVU, L0 and dead features of one dictionary."""

    def __init__(self, n_out: int) -> None:
        self.n = 0
        self.sq_err = [0.0] * n_out
        self.sum = [None] * n_out  # type: list[Any]
        self.sum_sq = [0.0] * n_out
        self.l0 = 0.0
        self.l1 = 0.0
        self.cos = [0.0] * n_out
        self.l2_ratio = [0.0] * n_out
        self.fired: Tensor | None = None

    def add(self, f: Tensor, targets: list[Tensor], recons: list[Tensor]) -> None:
        self.n += f.shape[0]
        active = f != 0
        self.l0 += float(active.sum())
        self.l1 += float(f.double().abs().sum())
        fired = active.any(0)
        self.fired = fired if self.fired is None else self.fired | fired
        for j, (y, y_hat) in enumerate(zip(targets, recons)):
            y64, e = y.double(), (y.double() - y_hat.double())
            self.sq_err[j] += float((e * e).sum())
            s = y64.sum(0)
            self.sum[j] = s if self.sum[j] is None else self.sum[j] + s
            self.sum_sq[j] += float((y64 * y64).sum())
            h64 = y_hat.double()
            self.cos[j] += float(torch.nn.functional.cosine_similarity(y64, h64, dim=-1).sum())
            self.l2_ratio[j] += float((h64.norm(dim=-1) / y64.norm(dim=-1)).sum())

    def result(self) -> dict[str, Any]:
        fvu, mse = [], []
        for j in range(len(self.sq_err)):
            mean = self.sum[j] / self.n
            var = self.sum_sq[j] - self.n * float((mean * mean).sum())
            fvu.append(self.sq_err[j] / var if var > 0 else float("nan"))
            mse.append(self.sq_err[j] / (self.n * mean.numel()))
        dead = int((~self.fired).sum()) if self.fired is not None else 0
        size = int(self.fired.numel()) if self.fired is not None else 0
        one = len(fvu) == 1
        n = max(self.n, 1)
        cos = [c / n for c in self.cos]
        l2 = [r / n for r in self.l2_ratio]
        return {
            "fvu": fvu[0] if one else fvu,
            "mse": mse[0] if one else mse,
            "cossim": cos[0] if one else cos,
            "l2_ratio": l2[0] if one else l2,
            "l0": self.l0 / self.n if self.n else float("nan"),
            "l1": self.l1 / n,
            "dead": dead,
            "dead_fraction": dead / size if size else float("nan"),
            "tokens": self.n,
        }


def _rows(t: Tensor, keep: Tensor) -> Tensor:
    """The rows ``[tokens, d]`` of ``t`` that ``keep`` (a flat mask) keeps, on its device."""
    return t.reshape(-1, t.shape[-1]).to(keep.device)[keep]


def _zero(_module: nn.Module, _args: Any, value: Tensor) -> Tensor:
    return torch.zeros_like(value)


def _next_token_stats(
    logits: Tensor, clean_logp: Tensor, ids: Tensor, keep: Tensor
) -> tuple[float, float]:
    """(sum of KL(clean || this), sum of cross-entropy) over the kept next-token positions."""
    logp = torch.log_softmax(logits[:, :-1].double(), -1)
    kl = (clean_logp.exp() * (clean_logp - logp)).sum(-1)
    ce = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    return float(kl[keep].sum()), float(ce[keep].sum())


def evaluate_dictionaries(
    model: nn.Module,
    dictionaries: Mapping[Any, Any],
    batches: Any,
    *,
    spliced: Sequence[Any] | None = None,
    batch_size: int = 8,
    ablation: bool = True,
) -> DictionaryEval:
    """FVU, L0, dead features of each dictionary and the KL / cross-entropy increase with
    dictionaries spliced in (``error=False``), over ``batches`` of token ids: tensors
    ``[batch, tokens]``, dicts with ``input_ids`` and ``attention_mask``, or a store
    (:class:`~pyhook.CaptureReader` with token ids; its examples are batched ``batch_size`` at
    a time). Padding (``attention_mask == 0``) is left out of every statistic.

    ``spliced``: the sets of keys to splice in, each a key or a tuple of keys, or ``"all"``;
    by default each dictionary alone and all together. Each batch costs one clean forward
    (which reads every site; each dictionary encodes once) and one forward per set, plus one
    per set with its output points zeroed when ``ablation`` (SAEBench's normalisation:
    ``kl_div_score = (kl_ablation - kl) / kl_ablation`` and ``ce_loss_score = (ce_ablation -
    ce_spliced) / (ce_ablation - ce_clean)``, 1 for a perfect dictionary, 0 for one no better
    than zeros).

    >>> import torch, transformers, pyhook
    >>> cfg = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=64)
    >>> model = transformers.GPT2LMHeadModel(cfg).eval()
    >>> class SAE(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.W = torch.nn.Parameter(torch.randn(16, 32) / 4)
    ...     def encode(self, x): return torch.relu(x @ self.W)
    ...     def decode(self, f): return f @ self.W.T
    >>> ev = pyhook.evaluate_dictionaries(model, {"resid_post.0": SAE()}, [torch.randint(0, 64, (2, 8))])
    >>> list(ev.spliced), ev.per_dictionary["resid_post.0"]["tokens"]
    (['resid_post.0'], 16)
    """
    keys = list(dictionaries)
    if spliced is None:
        sets: list[Any] = [*keys, "all"] if len(keys) > 1 else [keys[0]]
    else:
        sets = list(spliced)
    plan: dict[Any, list[Any]] = {}
    for s in sets:
        if isinstance(s, str) and s == "all" and s not in dictionaries:
            plan["all"] = keys
        elif s in dictionaries:
            plan[s] = [s]
        elif isinstance(s, tuple) and all(k in dictionaries for k in s):
            plan[s] = list(s)
        else:
            raise DictionaryError(
                f"evaluate_dictionaries: spliced names {s!r}, which is not 'all', a key of the "
                "dictionaries or a tuple of them"
            )
    probe = Splice(model, dictionaries)  # validates every key and dictionary once
    accs = {s.key: _Acc(len(s.outputs)) for s in probe.sites}
    sums = {name: [0.0, 0.0, 0.0, 0.0] for name in plan}
    outputs_of = {s.key: s.outputs for s in probe.sites}
    clean_ce, count = 0.0, 0
    grabbed: dict[str, Tensor] = {}

    def grab(name: str) -> Callable[..., None]:
        heads = probe._per_head(name)

        def hook(_m: nn.Module, _a: Any, value: Tensor) -> None:
            grabbed[name] = (value.flatten(-2) if heads else value).detach()

        return hook

    with torch.no_grad():
        for ids, mask in _batches_of(batches, batch_size):
            device = next(model.parameters()).device
            ids = ids.to(device)
            kwargs: dict[str, Any] = {}
            valid = torch.ones_like(ids, dtype=torch.bool)
            if mask is not None:
                mask = mask.to(device)
                kwargs["attention_mask"] = mask
                valid = mask.bool()
            hooks = HookSet(model=model)
            try:
                with hooks.registering():
                    for name, point in probe._points.items():
                        point.register(hooks, grab(name))
                clean = model(ids, **kwargs).logits
            finally:
                hooks.remove()
            flat = valid.reshape(-1)
            for s in probe.sites:
                f = s.dictionary.encode(s.place(grabbed[s.source]))
                recons = _decode(s.dictionary, f, s)
                dense = _rows(dense_features(f), flat)
                targets = [_rows(grabbed[o], flat) for o in s.outputs]
                rec = [_rows(r, flat) for r in recons]
                accs[s.key].add(dense, targets, rec)
            grabbed.clear()
            keep = valid[:, 1:] & valid[:, :-1]
            clean_logp = torch.log_softmax(clean[:, :-1].double(), -1)
            _, ce = _next_token_stats(clean, clean_logp, ids, keep)
            clean_ce += ce
            count += int(keep.sum())
            for name, members in plan.items():
                with Splice(model, {k: dictionaries[k] for k in members}, error=False):
                    logits = model(ids, **kwargs).logits
                kl, ce = _next_token_stats(logits, clean_logp, ids, keep)
                sums[name][0] += kl
                sums[name][1] += ce
                if ablation:
                    zeroed = dict.fromkeys(o for k in members for o in outputs_of[k])
                    hooks = HookSet(model=model)
                    try:
                        with hooks.registering():
                            for o in zeroed:
                                probe._points[o].register(hooks, _zero)
                        logits = model(ids, **kwargs).logits
                    finally:
                        hooks.remove()
                    kl, ce = _next_token_stats(logits, clean_logp, ids, keep)
                    sums[name][2] += kl
                    sums[name][3] += ce
    spliced_out: dict[Any, dict[str, float]] = {}
    for name, (kl, ce, kl_ab, ce_ab) in sums.items():
        c = max(count, 1)
        spliced_out[name] = {
            "kl": kl / c,
            "ce_clean": clean_ce / c,
            "ce_spliced": ce / c,
            "ce_increase": (ce - clean_ce) / c,
        }
        if ablation:
            spliced_out[name].update(
                kl_ablation=kl_ab / c,
                ce_ablation=ce_ab / c,
                kl_div_score=(kl_ab - kl) / kl_ab if kl_ab else float("nan"),
                ce_loss_score=(ce_ab - ce) / (ce_ab - clean_ce)
                if ce_ab != clean_ce
                else float("nan"),
            )
    return DictionaryEval({k: a.result() for k, a in accs.items()}, spliced_out)
