"""Gradient layers of a capture: the gradient of a per-example metric at captured points.

``capture(model, layers, gradients=[...], metric=...)`` stores, beside each named layer, a layer
``"<layer>_grad"`` (TransformerLens' naming): the gradient of ``metric`` at that layer's output,
one row per stored row, reduced exactly as the activation is (positions, mask, flatten, dtype),
so that readers, :class:`~pyhook.pipeline.dataset.CaptureDataset`, ``pyhook verify`` and
``pyhook inspect`` treat it as any other layer.

How: the backward hooks of :mod:`pyhook.lens` (a tensor hook on the point's activation,
registered by the point's forward hook) collect the gradients; a hook after the model's forward
(before the recorder commits the batch) computes ``metric(output, batch)`` (a ``[batch]``
tensor: one value per example) and runs the backward of its sum with
:func:`torch.autograd.grad` towards the captured activations (parameters' ``.grad`` are left
alone). Each example's gradient rows are then that example's own gradient, because in a model
that does not mix examples (no BatchNorm in training mode, no other batch statistic) an
example's metric depends on its own activations only. BatchNorm in training mode and active
dropout (random, so no gradient of a fixed function) are refused by name.

The metric is a callable ``metric(output, batch) -> [batch]`` (``batch``: the call's arguments
by name, plus ``"keep"``, the ``[batch, tokens]`` bool mask of stored positions or None), or one
of the named metrics a job file can give as data (:data:`METRICS`): ``"loss"`` (each example's
mean next-token loss over its kept positions) and ``"logit:<token id>"`` (the logit of that
token at each example's last kept position).

Example::

    >>> import torch, transformers
    >>> from pyhook.capture import capture
    >>> cfg = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=64, bos_token_id=0,
    ...                               eos_token_id=0)
    >>> model = transformers.GPT2LMHeadModel(cfg).eval()
    >>> ids = torch.randint(0, 64, (2, 5))
    >>> with capture(model, "resid_post.0", gradients=True, metric="loss") as rec:
    ...     _ = model(input_ids=ids)
    >>> rec.layers, rec["resid_post.0_grad"].shape
    (['resid_post.0', 'resid_post.0_grad'], torch.Size([10, 16]))
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..modules import glob_regex

__all__ = ["METRICS", "GradientLayers", "grad_name", "named_metric"]

GRAD_SUFFIX = "_grad"

#: The named metrics (what a job file or ``--metric`` may give).
METRICS = ("loss", "logit:<token id>")

Metric = Callable[[Any, dict[str, Any]], torch.Tensor]


def grad_name(layer: str) -> str:
    """The stored name of ``layer``'s gradient: ``"<layer>_grad"``."""
    return layer + GRAD_SUFFIX


# -- the named metrics ---------------------------------------------------------------------------
def _logits(output: Any, who: str) -> torch.Tensor:
    t = getattr(output, "logits", None)
    if t is None and isinstance(output, torch.Tensor):
        t = output
    if t is None and isinstance(output, (tuple, list)) and output:
        t = output[0] if isinstance(output[0], torch.Tensor) else None
    if not isinstance(t, torch.Tensor) or t.dim() != 3:
        raise ValueError(
            f"metric {who!r} needs the model's logits [batch, tokens, vocab]; its output "
            f"({type(output).__name__}) has none: capture a model with a language-model head "
            "(e.g. AutoModelForCausalLM; a job: model_class=...) or pass metric=fn(output, batch)"
        )
    return t


def _ids(batch: dict[str, Any], who: str) -> torch.Tensor:
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        raise ValueError(
            f"metric {who!r} needs the call's input_ids (the tokens it predicts); the call has "
            f"arguments {sorted(k for k in batch if k != 'keep')}"
        )
    return ids


def _kept(batch: dict[str, Any], like: torch.Tensor) -> torch.Tensor:
    """The positions a named metric counts: the stored ones (the capture's mask and
    annotate's keep), else the attention mask, else every position."""
    keep = batch.get("keep")
    if keep is None:
        keep = batch.get("attention_mask")
    if keep is None:
        return torch.ones(like.shape[:2], dtype=torch.bool, device=like.device)
    return keep.to(like.device).bool()


def lm_loss(output: Any, batch: dict[str, Any]) -> torch.Tensor:
    """Each example's mean next-token loss (``-log p(x[t+1] | x[..t])``, float32) over the
    predictions whose position and target are both kept; 0 for an example with none."""
    logits = _logits(output, "loss")
    ids = _ids(batch, "loss").to(logits.device)
    keep = _kept(batch, ids)
    valid = keep[:, :-1] & keep[:, 1:]
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -logp.gather(-1, ids[:, 1:, None].long()).squeeze(-1)
    return (nll * valid).sum(1) / valid.sum(1).clamp(min=1)


def _logit_of(token: int) -> Metric:
    def logit(output: Any, batch: dict[str, Any]) -> torch.Tensor:
        logits = _logits(output, f"logit:{token}")
        if not 0 <= token < logits.shape[-1]:
            raise ValueError(
                f"metric 'logit:{token}': token id {token} is outside the model's vocabulary "
                f"(its logits have {logits.shape[-1]} entries)"
            )
        keep = _kept(batch, logits)
        # the last kept position of each example (position 0 when none is kept)
        at = torch.arange(keep.shape[1], device=keep.device)
        last = (keep * (at + 1)).argmax(1)
        rows = torch.arange(logits.shape[0], device=logits.device)
        return logits[rows, last.to(logits.device), token].float()

    logit.__name__ = f"logit:{token}"
    return logit


def named_metric(name: str) -> Metric:
    """The metric a name stands for (:data:`METRICS`); a ``ValueError`` naming the choices
    otherwise.

    Example::

        >>> from pyhook.pipeline._record_grad import named_metric
        >>> named_metric("logit:7").__name__
        'logit:7'
    """
    if name == "loss":
        return lm_loss
    m = re.fullmatch(r"logit:(\d+)", name.strip()) if isinstance(name, str) else None
    if m:
        return _logit_of(int(m.group(1)))
    raise ValueError(
        f"metric {name!r} is not a named metric; the named metrics are: 'loss' (each example's "
        "next-token loss over its kept positions), 'logit:<token id>' (that token's logit at "
        "the last kept position); from Python, metric may also be a callable "
        "(output, batch) -> [batch] tensor"
    )


# -- the checks -----------------------------------------------------------------------------------
# float attributes by which attention modules (transformers') apply dropout in training mode
_DROPOUT_ATTRS = ("attention_dropout", "dropout", "dropout_p", "dropout_prob", "attn_pdrop")


def _float_attr(m: nn.Module, attr: str) -> float:
    v = m.__dict__.get(attr)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def _mixing_modules(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """``[(name, module, kind)]`` of the modules that make a gradient not per example (or not
    a function) in training mode: BatchNorm, dropout modules, attention with dropout."""
    found = []
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            found.append((name, m, "batchnorm"))
        elif isinstance(m, nn.modules.dropout._DropoutNd) or any(
            _float_attr(m, a) > 0 for a in _DROPOUT_ATTRS
        ):
            found.append((name, m, "dropout"))
    return found


def check_mode(model: nn.Module, found: list[tuple[str, nn.Module, str]]) -> None:
    """Refuse (by module name) BatchNorm in training mode and active dropout."""
    for name, m, kind in found:
        if not m.training:
            continue
        if kind == "batchnorm":
            raise ValueError(
                f"gradients: {name or type(model).__name__} ({type(m).__name__}) is in training "
                "mode: its batch statistics mix the examples of a batch, so no row's gradient "
                "would be its example's own; call model.eval() first"
            )
        p = getattr(m, "p", None)
        p = p if isinstance(p, float) else max(_float_attr(m, a) for a in _DROPOUT_ATTRS)
        if p > 0:
            raise ValueError(
                f"gradients: dropout is active in {name or type(model).__name__} "
                f"({type(m).__name__}, p={p}): the gradient would be of a random function; call "
                "model.eval() first"
            )


# -- the gradient layers ------------------------------------------------------------------------
class GradientLayers:
    """Which captured layers get a gradient layer, the metric, and (while a capture records)
    the hooks that compute the gradients of each forward. Made by the Recorder."""

    def __init__(
        self,
        model: nn.Module,
        layers: list[str],
        gradients: bool | str | Iterable[str],
        metric: str | Metric | None,
        *,
        select: Any = None,
        compiled: bool = False,
    ) -> None:
        if metric is None:
            raise ValueError(
                "gradients= needs metric=: a named metric ('loss', 'logit:<token id>') or a "
                "callable (output, batch) -> [batch] tensor, whose gradient is stored"
            )
        if isinstance(metric, str):
            self.metric: Metric = named_metric(metric)
            self.metric_name = metric
        elif callable(metric):
            self.metric = metric
            self.metric_name = getattr(metric, "__name__", type(metric).__name__)
        else:
            raise TypeError(
                "metric must be a named metric ('loss', 'logit:<token id>') or a callable "
                f"(output, batch) -> [batch] tensor, got {type(metric).__name__}: {metric!r}"
            )
        if compiled:
            raise ValueError(
                "gradients= runs a backward after each forward, which the compiled capture "
                "path does not: capture the eager model (not torch.compile's)"
            )
        if select is not None:
            raise ValueError(
                "gradients= stores the gradient at each layer's output tensor, select= picks "
                "another tensor: use one or the other (or a standard point for that tensor)"
            )
        if getattr(model, "_pyhook_resolve_layers", None) is not None:
            raise ValueError("gradients= is for one model, not several models as one (paired)")
        if gradients is True:
            chosen = list(layers)
        elif gradients is False or gradients is None:
            chosen = []
        else:
            names = [gradients] if isinstance(gradients, str) else gradients
            if not isinstance(names, Iterable):
                raise TypeError(
                    "gradients must be True (every captured layer) or captured layer names / "
                    f"globs, got {type(gradients).__name__}: {gradients!r}"
                )
            chosen = []
            for entry in names:
                if not isinstance(entry, str):
                    raise TypeError(f"gradients must hold layer names, got {entry!r}")
                rx = glob_regex(entry) if any(c in entry for c in "*?[") else None
                hits = [n for n in layers if (rx.match(n) if rx else n == entry)]
                if not hits:
                    raise ValueError(
                        f"gradients: {entry!r} is not a captured layer (a gradient layer sits "
                        f"beside its activation layer); the captured layers are: "
                        f"{', '.join(layers)}"
                    )
                chosen += [n for n in hits if n not in chosen]
        if not chosen:
            raise ValueError("gradients= names no layer: pass True or captured layer names")
        clash = [grad_name(n) for n in chosen if grad_name(n) in layers]
        if clash:
            raise ValueError(
                f"gradients: {clash[0]!r} is already a captured layer's name, where the "
                "gradient layer would be stored"
            )
        self.layers = [n for n in layers if n in chosen]  # in capture order
        self.names = [grad_name(n) for n in self.layers]
        self._mixing = _mixing_modules(model)
        check_mode(model, self._mixing)
        self.model = model
        self._sig: inspect.Signature | None = None
        self.values: dict[str, torch.Tensor] = {}  # this forward's activations
        self.grads: dict[str, torch.Tensor] = {}  # their gradients, from the lens hooks

    def settings(self) -> dict[str, Any]:
        """What the store's settings record (compared on resume)."""
        return {"gradients": self.layers, "metric": self.metric_name}

    def install(self, hooks: Any, path: Any, flat: dict[str, bool]) -> None:
        """Register the hooks of a capture (``hooks``: the Recorder's HookSet, which removes
        the lens hooks with its own): lens' forward/backward hooks on the chosen layers, a
        check before each forward, the backward after it (before ``path.commit``)."""
        from ..lens import hooks as lens_hooks

        model = self.model
        values, grads = self.values, self.grads

        def keep_value(t: torch.Tensor, hook: Any) -> None:
            if not t.requires_grad:
                raise RuntimeError(
                    f"gradients: the output of layer {hook.name!r} does not require grad: run "
                    "the forward with autograd on (not under torch.no_grad() or "
                    "torch.inference_mode()) and the parameters requiring grad"
                )
            if hook.name in values:
                raise RuntimeError(
                    f"gradients: layer {hook.name!r} ran twice in one forward; its gradient "
                    "rows would not be one call's"
                )
            values[hook.name] = t

        def keep_grad(g: torch.Tensor, hook: Any) -> None:
            grads[hook.name] = g

        stack = contextlib.ExitStack()
        stack.enter_context(
            lens_hooks(
                model,
                fwd_hooks=[(n, keep_value) for n in self.layers],
                bwd_hooks=[(n, keep_grad) for n in self.layers],
            )
        )
        hooks._keep(_Closing(stack))
        rows = {n: path.make_hook(grad_name(n), flat=flat.get(n, False)) for n in self.layers}

        def before(_module: nn.Module, _args: Any) -> None:
            values.clear()
            grads.clear()
            check_mode(model, self._mixing)

        def after(_module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            try:
                self._backward(path, args, kwargs, output, rows)
            finally:
                values.clear()
                grads.clear()

        hooks.forward_pre(model, before)
        hooks.forward(model, after, with_kwargs=True)

    def _batch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        if args:
            if self._sig is None:
                self._sig = inspect.signature(self.model.forward)
            try:
                batch = dict(self._sig.bind_partial(*args, **kwargs).arguments)
            except TypeError:
                batch = {"args": args, **kwargs}
        else:
            batch = dict(kwargs)
        return batch

    def _backward(
        self, path: Any, args: Any, kwargs: Any, output: Any, rows: dict[str, Any]
    ) -> None:
        values = dict(self.values)
        if not values:
            return  # none of the layers ran: no rows (the activation layers have none either)
        batch = self._batch(args, kwargs)
        batch["keep"] = path.mask
        m = self.metric(output, batch)
        n = path.examples
        if not isinstance(m, torch.Tensor) or m.dim() != 1 or (n is not None and m.shape[0] != n):
            got = tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__
            raise ValueError(
                f"metric {self.metric_name!r} must return one value per example, a [{n}] "
                f"tensor, got {got}"
            )
        if not m.requires_grad:
            raise RuntimeError(
                f"metric {self.metric_name!r}: its value does not depend (differentiably) on "
                "the model's activations"
            )
        torch.autograd.grad(m.sum(), list(values.values()), allow_unused=True)
        for name, v in values.items():
            g = self.grads.get(name)
            rows[name](None, None, torch.zeros_like(v) if g is None else g.detach())


class _Closing:
    """A HookSet entry whose ``remove()`` leaves the lens hooks' ``with`` block."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self._stack = stack

    def remove(self) -> None:
        self._stack.close()
