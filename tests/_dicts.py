"""Dictionaries shaped like the libraries' own (the attribute names and encode/decode of SAELens'
SAE, sparsify's SparseCoder and dictionary_learning's autoencoders), written here from their
documented maths so the tests need none of those packages installed."""

from __future__ import annotations

import types
from typing import NamedTuple

import torch
from torch import nn


def _rand(*shape: int, scale: float = 1.0) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape) * scale)


class SAELensSAE(nn.Module):
    """SAELens' SAE: W_enc [d_in, n], b_enc, W_dec [n, d_out], b_dec; cfg.apply_b_dec_to_input;
    JumpReLU with ``threshold``, top-k with ``cfg.k``."""

    def __init__(self, d_in, n, d_out=None, *, arch="standard", k=None, apply_b_dec=True):
        super().__init__()
        d_out = d_in if d_out is None else d_out
        self.W_enc = _rand(d_in, n, scale=d_in**-0.5)
        self.b_enc = _rand(n, scale=0.1)
        self.W_dec = _rand(n, d_out, scale=n**-0.5)
        self.b_dec = _rand(d_out, scale=0.1)
        if arch == "jumprelu":
            self.threshold = nn.Parameter(torch.rand(n) * 0.3)
        self.cfg = types.SimpleNamespace(
            apply_b_dec_to_input=apply_b_dec, k=k, architecture=lambda: arch
        )

    def encode(self, x):
        if self.cfg.apply_b_dec_to_input:
            x = x - self.b_dec
        pre = x @ self.W_enc + self.b_enc
        if self.cfg.architecture() == "jumprelu":
            return torch.relu(pre) * (pre > self.threshold)
        if self.cfg.architecture() == "topk":
            top = pre.topk(self.cfg.k, dim=-1)
            return torch.zeros_like(pre).scatter(-1, top.indices, torch.relu(top.values))
        return torch.relu(pre)

    def decode(self, f):
        return f @ self.W_dec + self.b_dec

    def forward(self, x):
        return self.decode(self.encode(x))


class EncoderOutput(NamedTuple):
    top_acts: torch.Tensor
    top_indices: torch.Tensor
    pre_acts: torch.Tensor


class SparsifyCoder(nn.Module):
    """sparsify's SparseCoder: ``encoder`` nn.Linear, W_dec [n, d_in], b_dec, cfg.k, cfg.transcode;
    encode takes rows [N, d] and returns (top_acts, top_indices, pre_acts); decode(acts, idx)."""

    def __init__(self, d_in, n, k, *, transcode=False, d_out=None):
        super().__init__()
        self.cfg = types.SimpleNamespace(k=k, transcode=transcode, activation="topk")
        self.encoder = nn.Linear(d_in, n)
        d_out = d_in if d_out is None else d_out
        self.W_dec = _rand(n, d_out, scale=n**-0.5)
        self.b_dec = _rand(d_out, scale=0.1)
        self.W_skip = None

    def encode(self, x):
        assert x.dim() == 2, "sparsify encodes rows"
        if not self.cfg.transcode:
            x = x - self.b_dec
        pre = torch.relu(self.encoder(x))
        acts, idx = pre.topk(self.cfg.k, dim=-1, sorted=False)
        return EncoderOutput(acts, idx, pre)

    def decode(self, top_acts, top_indices):
        assert top_acts.dim() == 2
        return (top_acts.unsqueeze(-1) * self.W_dec[top_indices]).sum(-2) + self.b_dec


class DLAutoEncoder(nn.Module):
    """dictionary_learning's AutoEncoder: ``bias``, ``encoder`` nn.Linear, ``decoder`` nn.Linear
    without bias; encode(x) = relu(encoder(x - bias)), decode(f) = decoder(f) + bias."""

    def __init__(self, d, n):
        super().__init__()
        self.bias = _rand(d, scale=0.1)
        self.encoder = nn.Linear(d, n, bias=True)
        self.decoder = nn.Linear(n, d, bias=False)

    def encode(self, x):
        return nn.ReLU()(self.encoder(x - self.bias))

    def decode(self, f):
        return self.decoder(f) + self.bias


class DLTopK(nn.Module):
    """dictionary_learning's AutoEncoderTopK: ``encoder``, ``decoder`` (no bias), ``b_dec``, a ``k``
    buffer; BatchTopK's inference path uses a scalar ``threshold`` buffer instead of top-k."""

    def __init__(self, d, n, k, *, threshold=None):
        super().__init__()
        self.encoder = nn.Linear(d, n)
        self.decoder = nn.Linear(n, d, bias=False)
        self.b_dec = _rand(d, scale=0.1)
        self.register_buffer("k", torch.tensor(k))
        self.register_buffer("threshold", torch.tensor(-1.0 if threshold is None else threshold))

    def encode(self, x):
        post = nn.functional.relu(self.encoder(x - self.b_dec))
        if float(self.threshold) >= 0:
            return post * (post > self.threshold)
        top = post.topk(int(self.k), dim=-1)
        return torch.zeros_like(post).scatter(-1, top.indices, top.values)

    def decode(self, f):
        return self.decoder(f) + self.b_dec


class GatedSAE(nn.Module):
    """A gated SAE (dictionary_learning's GatedAutoEncoder): not linear + activation."""

    def __init__(self, d, n):
        super().__init__()
        self.encoder = nn.Linear(d, n, bias=False)
        self.decoder = nn.Linear(n, d, bias=False)
        self.gate_bias = _rand(n, scale=0.1)
        self.mag_bias = _rand(n, scale=0.1)
        self.r_mag = _rand(n, scale=0.1)

    def encode(self, x):
        e = self.encoder(x)
        return (e + self.gate_bias > 0) * torch.relu(self.r_mag.exp() * e + self.mag_bias)

    def decode(self, f):
        return self.decoder(f)


class CLT(nn.Module):
    """A cross-layer transcoder's slice for one input layer: one encoder, one decoder per output
    point (W_dec a ParameterList, b_dec likewise); decode returns a list."""

    def __init__(self, d_in, n, d_out, n_out):
        super().__init__()
        self.W_enc = _rand(d_in, n, scale=d_in**-0.5)
        self.b_enc = _rand(n, scale=0.1)
        self.W_dec = nn.ParameterList([_rand(n, d_out, scale=n**-0.5) for _ in range(n_out)])
        self.b_dec = nn.ParameterList([_rand(d_out, scale=0.1) for _ in range(n_out)])

    def encode(self, x):
        return torch.relu(x @ self.W_enc + self.b_enc)

    def decode(self, f):
        return [f @ w + b for w, b in zip(self.W_dec, self.b_dec)]
