"""The dictionary protocol: sparse autoencoders, transcoders and cross-layer transcoders.

A *dictionary* is any module with ``encode(x) -> features`` and ``decode(features) -> x_hat``.
SAELens' ``SAE`` (and its ``Transcoder``) and dictionary_learning's autoencoders fit as they
are; sparsify's ``SparseCoder`` decodes from two tensors (``decode(top_acts, top_indices)``) and
is wrapped by :func:`as_dictionary` so that its features are one :class:`SparseFeatures`.

Where a dictionary sits is its *key*:

* an SAE reads and writes one point: ``"resid_post.3"``;
* a transcoder reads one point and writes another: ``("mlp_in.3", "mlp_out.3")``;
* a cross-layer transcoder (CLT) reads one point and writes several:
  ``("mlp_in.3", ["mlp_out.3", "mlp_out.4"])``; its ``decode`` returns one tensor per output.

* :func:`as_dictionary` gives the protocol's face of a module (adapting sparsify's decoder);
* :func:`linear_parts` gives an encoder that is linear + activation as weights
  (:class:`LinearParts`), checked against the dictionary's own ``encode`` / ``decode`` on probe
  inputs, and refuses by name a dictionary that is not of that form;
* :func:`parse_key` splits a key into its input point and output point(s);
* :class:`SparseFeatures` holds top-k features as values and indices.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

__all__ = [
    "DictionaryError",
    "LinearParts",
    "SparseFeatures",
    "as_dictionary",
    "dense_features",
    "linear_parts",
    "parse_key",
]


class DictionaryError(ValueError):
    """A dictionary that does not fit the protocol, or a key that names no site.

    >>> import torch
    >>> try:
    ...     linear_parts(torch.nn.Linear(2, 2))
    ... except DictionaryError as e:
    ...     print(str(e).split(":")[0])
    Linear is not a dictionary
    """


class SparseFeatures(NamedTuple):
    """Top-k features as values and indices over the last dimension (``size`` features).

    >>> import torch
    >>> f = SparseFeatures(torch.tensor([[2.0]]), torch.tensor([[1]]), 3)
    >>> f.dense()
    tensor([[0., 2., 0.]])
    """

    values: Tensor
    indices: Tensor
    size: int

    def dense(self) -> Tensor:
        """The features as a dense ``[..., size]`` tensor (differentiable in ``values``)."""
        out = self.values.new_zeros((*self.values.shape[:-1], self.size))
        return out.scatter(-1, self.indices.long(), self.values)


def dense_features(features: Any) -> Tensor:
    """A dense tensor of features, whatever form ``encode`` gave them in.

    >>> import torch
    >>> dense_features(torch.ones(2))
    tensor([1., 1.])
    """
    if isinstance(features, Tensor):
        return features.to_dense() if features.layout != torch.strided else features
    if isinstance(features, SparseFeatures):
        return features.dense()
    raise DictionaryError(
        f"features of type {type(features).__name__} are neither a tensor nor SparseFeatures"
    )


def _linear(m: Any, name: str) -> nn.Linear | None:
    sub = getattr(m, name, None)
    return sub if isinstance(sub, nn.Linear) else None


def _cfg(m: Any, name: str, default: Any = None) -> Any:
    """An attribute of the module or of its ``cfg`` (SAELens and sparsify keep settings there)."""
    for where in ("_parameters", "_buffers", "__dict__"):
        found = getattr(m, where, {})
        if name in found:
            return found[name]
    if hasattr(type(m), name):
        return getattr(m, name)
    cfg = getattr(m, "cfg", None)
    return getattr(cfg, name, default) if cfg is not None else default


def _two_argument_decode(m: Any) -> bool:
    try:
        params = list(inspect.signature(m.decode).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    return len(required) == 2


class _TopKCoder(nn.Module):
    """sparsify's ``SparseCoder`` under the protocol: ``encode`` gives :class:`SparseFeatures`
    (its ``EncoderOutput`` without the dense pre-activations), ``decode`` takes them back."""

    def __init__(self, coder: Any) -> None:
        super().__init__()
        self.coder: Any = coder

    def encode(self, x: Tensor) -> SparseFeatures:
        lead = x.shape[:-1]
        out = self.coder.encode(x.reshape(-1, x.shape[-1]))
        values, indices = out[0], out[1]
        n = int(self.coder.encoder.out_features)
        return SparseFeatures(
            values.reshape(*lead, values.shape[-1]),
            indices.reshape(*lead, indices.shape[-1]),
            n,
        )

    def decode(self, f: Any) -> Tensor:
        if not isinstance(f, SparseFeatures):  # dense features (an edit may switch on any)
            dense = dense_features(f)
            y: Tensor = dense.to(self.coder.W_dec.dtype) @ self.coder.W_dec + self.coder.b_dec
            return y
        lead = f.values.shape[:-1]
        k = f.values.shape[-1]
        y = self.coder.decode(f.values.reshape(-1, k), f.indices.reshape(-1, k))
        return y.reshape(*lead, y.shape[-1])

    def forward(self, x: Tensor) -> Tensor:
        return self.decode(self.encode(x))


def as_dictionary(d: Any) -> Any:
    """The protocol's face of ``d``: ``d`` itself when its ``encode(x)`` and ``decode(f)`` fit,
    an adapter for sparsify's ``SparseCoder`` (whose ``decode`` takes values and indices).
    Anything without ``encode`` and ``decode`` is refused by name.

    >>> import torch
    >>> class SAE(torch.nn.Module):
    ...     def encode(self, x): return torch.relu(x)
    ...     def decode(self, f): return f
    >>> sae = SAE()
    >>> as_dictionary(sae) is sae
    True
    """
    if isinstance(d, _TopKCoder):
        return d
    if not (callable(getattr(d, "encode", None)) and callable(getattr(d, "decode", None))):
        raise DictionaryError(
            f"{type(d).__name__} is not a dictionary: expected a module with encode(x) -> "
            "features and decode(features) -> x (an SAE, a transcoder or a CLT)"
        )
    if _two_argument_decode(d) and _linear(d, "encoder") is not None:
        return _TopKCoder(d)
    return d


def module_of(d: Any) -> Any:
    """The user's module behind a (possibly adapted) dictionary.

    >>> import torch
    >>> lin = torch.nn.Linear(2, 2)
    >>> module_of(lin) is lin
    True
    """
    return d.coder if isinstance(d, _TopKCoder) else d


@dataclasses.dataclass
class LinearParts:
    """A dictionary whose encoder is linear + activation, as weights:
    ``features = pre_to_post((x - input_bias) @ W_enc + b_enc)`` and
    ``x_hat = features @ W_dec + b_dec`` (for a CLT, ``W_dec`` and ``b_dec`` are lists, one per
    output point, in the key's order).

    >>> import torch
    >>> parts = LinearParts(torch.eye(2), torch.zeros(2), torch.eye(2), torch.zeros(2), torch.relu, None)
    >>> parts.encode(torch.tensor([1.0, -1.0]))
    tensor([1., 0.])
    """

    W_enc: Tensor
    b_enc: Tensor
    W_dec: Tensor | list[Tensor]
    b_dec: Tensor | list[Tensor]
    pre_to_post: Callable[[Tensor], Tensor]
    input_bias: Tensor | None = None

    def pre(self, x: Tensor) -> Tensor:
        """The pre-activations of ``x``."""
        if self.input_bias is not None:
            x = x - self.input_bias
        return x @ self.W_enc + self.b_enc

    def encode(self, x: Tensor) -> Tensor:
        """Dense features of ``x``."""
        return self.pre_to_post(self.pre(x))

    def decode(self, f: Tensor) -> Tensor | list[Tensor]:
        """The reconstruction(s) of dense features ``f``."""
        if isinstance(self.W_dec, list):
            return [f @ w + b for w, b in zip(self.W_dec, self.b_dec)]
        b_dec: Any = self.b_dec
        return f @ self.W_dec + b_dec


def _relu(pre: Tensor) -> Tensor:
    return torch.relu(pre)


def _jumprelu(threshold: Tensor) -> Callable[[Tensor], Tensor]:
    def post(pre: Tensor) -> Tensor:
        return torch.relu(pre) * (pre > threshold).to(pre.dtype)

    return post


def _topk(k: int) -> Callable[[Tensor], Tensor]:
    def post(pre: Tensor) -> Tensor:
        values, indices = pre.topk(k, dim=-1)
        return torch.zeros_like(pre).scatter(-1, indices, torch.relu(values))

    return post


def _activations(m: Any, who: str) -> list[Callable[[Tensor], Tensor]]:
    """The activations the module's settings allow, most specific first (the probe picks)."""
    arch = _cfg(m, "architecture")
    arch = arch() if callable(arch) else arch
    if isinstance(arch, str) and arch.lower() not in ("standard", "relu", "jumprelu", "topk"):
        raise DictionaryError(
            f"{who}: its encoder ({arch!r}) is not linear + an elementwise or top-k activation"
        )
    act = _cfg(m, "activation")
    if isinstance(act, str) and act.lower() not in ("topk", "relu", "jumprelu"):
        raise DictionaryError(f"{who}: activation {act!r} is not ReLU, JumpReLU or top-k")
    out: list[Callable[[Tensor], Tensor]] = []
    k = _cfg(m, "k")
    if isinstance(k, Tensor) and k.numel() == 1:
        k = int(k)
    if isinstance(k, (int, float)) and not isinstance(k, bool):
        out.append(_topk(int(k)))
    threshold = _cfg(m, "threshold")
    if isinstance(threshold, Tensor):
        out.append(_jumprelu(threshold.detach()))
    out.append(_relu)
    return out


def _as_list(w: Any) -> list[Tensor] | None:
    if isinstance(w, (list, tuple, nn.ParameterList)):
        return [t for t in w]
    if isinstance(w, Tensor) and w.dim() == 3:
        return list(w.unbind(0))
    return None


def _gather_parts(m: Any, who: str) -> LinearParts:
    if getattr(m, "W_skip", None) is not None:
        raise DictionaryError(
            f"{who} has a skip connection (W_skip): its decoder is not features @ W_dec + b_dec"
        )
    W_enc, b_enc = getattr(m, "W_enc", None), getattr(m, "b_enc", None)
    enc = _linear(m, "encoder")
    if isinstance(W_enc, Tensor):  # SAELens, dictionary_learning's JumpReLU, circuit-tracer
        if W_enc.dim() != 2:
            raise DictionaryError(
                f"{who}: W_enc has shape {tuple(W_enc.shape)}, expected [d_in, n]"
            )
        if not isinstance(b_enc, Tensor):
            b_enc = W_enc.new_zeros(W_enc.shape[1])
        W_dec, b_dec = getattr(m, "W_dec", None), getattr(m, "b_dec", None)
        applies = _cfg(m, "apply_b_dec_to_input", False)
        input_bias = b_dec if applies and isinstance(b_dec, Tensor) else None
    elif enc is not None:  # sparsify, dictionary_learning's AutoEncoder / AutoEncoderTopK
        W_enc = enc.weight.T
        b_enc = enc.bias if enc.bias is not None else enc.weight.new_zeros(enc.out_features)
        dec = _linear(m, "decoder")
        if dec is not None:
            W_dec = dec.weight.T
            b_dec = dec.bias
            pre_bias = getattr(m, "bias", None)
            if not isinstance(pre_bias, Tensor):
                pre_bias = getattr(m, "b_dec", None)
            if isinstance(pre_bias, Tensor):
                b_dec = pre_bias if b_dec is None else b_dec + pre_bias
            input_bias = pre_bias if isinstance(pre_bias, Tensor) else None
            if b_dec is None:
                b_dec = W_enc.new_zeros(dec.out_features)
        else:
            W_dec, b_dec = getattr(m, "W_dec", None), getattr(m, "b_dec", None)
            input_bias = None if _cfg(m, "transcode", False) else b_dec
    else:
        raise DictionaryError(
            f"{who}: no linear encoder (W_enc/b_enc, or an nn.Linear 'encoder'): its encoder "
            "is not linear + activation, which this needs"
        )
    dec_list = _as_list(W_dec)
    if dec_list is not None:
        b_list = _as_list(b_dec) if b_dec is not None else None
        if b_dec is not None and isinstance(b_dec, Tensor) and b_dec.dim() == 2:
            b_list = list(b_dec.unbind(0))
        if b_list is None:
            b_list = [w.new_zeros(w.shape[-1]) for w in dec_list]
        W_dec, b_dec = dec_list, b_list
    elif not isinstance(W_dec, Tensor):
        raise DictionaryError(f"{who}: no decoder weight (W_dec, or an nn.Linear 'decoder')")
    elif b_dec is None:
        b_dec = W_dec.new_zeros(W_dec.shape[-1])
    return LinearParts(W_enc, b_enc, W_dec, b_dec, _relu, input_bias)


def _probe(parts: LinearParts, n_random: int = 4, n_aligned: int = 8) -> Tensor:
    """Inputs that switch features on: random rows and rows along encoder directions."""
    W = parts.W_enc.detach()
    g = torch.Generator(device="cpu").manual_seed(0)
    d_in, n = W.shape
    rand = torch.randn(n_random, d_in, generator=g, dtype=torch.float64).to(W)
    cols = W[:, : min(n, n_aligned)].T
    norm2 = (cols * cols).sum(-1, keepdim=True).clamp_min(1e-12)
    lift = 2.0 * (parts.b_enc.detach()[: cols.shape[0]].abs() + 1.0).unsqueeze(-1)
    aligned = cols / norm2 * lift
    x = torch.cat([rand, aligned, rand + aligned[:1]], 0)
    if parts.input_bias is not None:
        x = x + parts.input_bias.detach()
    return x


def _close(a: Tensor, b: Tensor) -> bool:
    tol = 1e-3 if a.dtype in (torch.float16, torch.bfloat16) else 1e-4
    scale = max(float(b.abs().max()) if b.numel() else 0.0, 1.0)
    return bool((a - b).abs().max() <= tol * scale) if a.numel() else True


def linear_parts(d: Any) -> LinearParts:
    """The weights of a dictionary whose encoder is linear + activation (ReLU, JumpReLU with
    ``threshold``, or top-k), and whose decoder is ``features @ W_dec + b_dec``.

    Reads SAELens' ``W_enc, b_enc, W_dec, b_dec`` (``threshold`` for JumpReLU,
    ``cfg.apply_b_dec_to_input`` for ``input_bias``, ``cfg.k`` for top-k), sparsify's
    ``encoder`` (an ``nn.Linear``), ``W_dec``, ``b_dec`` and ``cfg.k`` (``b_dec`` subtracted from
    the input unless ``cfg.transcode``), dictionary_learning's ``encoder`` / ``decoder``
    ``nn.Linear`` and ``bias`` (or ``b_dec``, ``k``). A CLT's ``W_dec`` is a list (or a
    ``[n_out, n, d_out]`` tensor) with ``b_dec`` likewise. The result is checked against the
    dictionary's own ``encode`` and ``decode`` on probe inputs; a dictionary whose encoder is
    anything else (gated, a skip connection, features scaled by decoder norms) is refused with a
    :class:`DictionaryError` naming its class.

    >>> import torch
    >>> class SAE(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.W_enc = torch.nn.Parameter(torch.randn(4, 6)); self.b_enc = torch.nn.Parameter(torch.zeros(6))
    ...         self.W_dec = torch.nn.Parameter(torch.randn(6, 4)); self.b_dec = torch.nn.Parameter(torch.zeros(4))
    ...     def encode(self, x): return torch.relu(x @ self.W_enc + self.b_enc)
    ...     def decode(self, f): return f @ self.W_dec + self.b_dec
    >>> parts = linear_parts(SAE())
    >>> tuple(parts.W_enc.shape), tuple(parts.W_dec.shape), parts.input_bias is None
    ((4, 6), (6, 4), True)
    """
    dic = as_dictionary(d)
    m = module_of(dic)
    who = f"dictionary {type(m).__name__}"
    parts = _gather_parts(m, who)
    W_dec = parts.W_dec
    n = parts.W_enc.shape[1]
    first_dec = W_dec[0] if isinstance(W_dec, list) else W_dec
    if first_dec.shape[0] != n or parts.b_enc.shape != (n,):
        raise DictionaryError(
            f"{who}: W_enc {tuple(parts.W_enc.shape)}, b_enc {tuple(parts.b_enc.shape)} and "
            f"W_dec {tuple(first_dec.shape)} do not fit [d_in, n], [n] and [n, d_out]"
        )
    with torch.no_grad():
        x = _probe(parts)
        want = dense_features(dic.encode(x))
        pre = parts.pre(x)
        for post in _activations(m, who):
            got = post(pre)
            if got.shape == want.shape and _close(got, want):
                parts.pre_to_post = post
                break
        else:
            raise DictionaryError(
                f"{who}: encode(x) is not pre_to_post((x - input_bias) @ W_enc + b_enc) as its "
                "parameters say; its encoder is not linear + ReLU / JumpReLU / top-k"
            )
        x_hat = dic.decode(dic.encode(x))
        mine = parts.decode(want)
        outs = list(x_hat) if isinstance(x_hat, (list, tuple)) else [x_hat]
        refs = mine if isinstance(mine, list) else [mine]
        if isinstance(x_hat, Tensor) and isinstance(mine, list) and x_hat.dim() == 3:
            outs = list(x_hat.unbind(-2))
        if len(outs) != len(refs) or not all(
            a.shape == b.shape and _close(b, a) for a, b in zip(outs, refs)
        ):
            raise DictionaryError(
                f"{who}: decode(f) is not f @ W_dec + b_dec as its parameters say"
            )
    return parts


def parse_key(key: Any) -> tuple[str, list[str], bool]:
    """``(input point, output points, is_clt)`` of a key: ``"resid_post.3"`` (an SAE),
    ``("mlp_in.3", "mlp_out.3")`` (a transcoder) or ``("mlp_in.3", ["mlp_out.3", ...])`` (a CLT).

    >>> parse_key(("mlp_in.3", "mlp_out.3"))
    ('mlp_in.3', ['mlp_out.3'], False)
    """
    if isinstance(key, str):
        return key, [key], False
    if isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str):
        src, dst = key
        if isinstance(dst, str):
            return src, [dst], False
        if isinstance(dst, Sequence) and dst and all(isinstance(s, str) for s in dst):
            return src, list(dst), True
    raise DictionaryError(
        f"dictionary key {key!r}: expected a point name ('resid_post.3'), a pair "
        "('mlp_in.3', 'mlp_out.3') or a point and a list of points ('mlp_in.3', "
        "('mlp_out.3', 'mlp_out.4'))"
    )
