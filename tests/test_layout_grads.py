"""One gradient meaning per name: a standard point's gradient is the one through what an edit
there changes (the module's argument, for an input point that other modules read too), in
every tool; a module name keeps nethook's meaning (the gradient of the tensor itself).

OLMo 2 (whose attention and MLP read the residual stream itself) and Cohere (whose attention
and MLP read one norm's output) from configs, float64, norms far from 1 and 0; the references
are plain torch pre-hooks and autograd, no pyhook.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")
import transformers as T
from _models import randomise_norms

import pyhook
from pyhook.points import resolve_targets

IDS = torch.tensor([[3, 17, 5, 60, 22, 9], [8, 8, 30, 2, 55, 13]])
# input points whose tensor another module reads too (the skip connection, a sibling branch,
# the sibling projections)
SHARED = [
    "attn_in.0",
    "mlp_in.1",
    "model.layers.0.self_attn.q_proj:in",
    "model.layers.1.mlp.up_proj:in",
]


@functools.cache
def build(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    kw = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=32,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    cfg = T.Olmo2Config(**kw) if arch == "olmo2" else T.CohereConfig(**kw)
    cls = T.Olmo2ForCausalLM if arch == "olmo2" else T.CohereForCausalLM
    return randomise_norms(cls(cfg)).double().eval()


def _metric(out) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return (logits * torch.linspace(-1, 1, logits.shape[-1], dtype=logits.dtype)).sum()


def _plain_input_grad(model, name: str, own: bool, ids=IDS, metric=_metric) -> torch.Tensor:
    """The gradient at a module's first input, with a plain pre-hook: through the module's
    argument alone (``own``: the module is given a node of its own) or the tensor's total."""
    (point,) = [p for _, p in resolve_targets(model, name)]
    kept = {}

    def pre(_mod, args, kwargs):
        key = None if args else "hidden_states"
        x = args[0] if args else kwargs[key]
        if own:
            x = x.view_as(x)
        x.retain_grad()
        kept["x"] = x
        if not own:
            return None
        return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, key: x})

    handle = point.module.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        metric(model(ids)).backward()
    finally:
        handle.remove()
    model.zero_grad()
    return kept["x"].grad


@pytest.mark.parametrize("arch", ["olmo2", "cohere"])
def test_input_point_gradient_is_the_modules_argument_in_every_tool(arch):
    model = build(arch)
    want = {n: _plain_input_grad(model, n, own=True) for n in SHARED}
    total = {n: _plain_input_grad(model, n, own=False) for n in SHARED}
    for n in SHARED:  # the two meanings differ here, so the test tells them apart
        assert (want[n] - total[n]).abs().max() > 1e-3 * total[n].abs().max(), n

    for n in SHARED:
        with pyhook.Trace(model, n, retain_grad=True) as t:
            _metric(model(IDS)).backward()
        model.zero_grad()
        torch.testing.assert_close(t.output.grad, want[n], msg=f"Trace {n}")

    with pyhook.TraceDict(model, SHARED, retain_grad=True) as td:
        _metric(model(IDS)).backward()
    model.zero_grad()
    for n in SHARED:
        torch.testing.assert_close(td[n].output.grad, want[n], msg=f"TraceDict {n}")

    _, cache = pyhook.run_with_cache(model, IDS, names_filter=SHARED, incl_bwd=True, metric=_metric)
    model.zero_grad()
    for n in SHARED:
        torch.testing.assert_close(cache[f"{n}_grad"], want[n], msg=f"run_with_cache {n}")

    # and the forward is unchanged (the argument is the same values)
    with torch.no_grad(), pyhook.TraceDict(model, SHARED):
        traced = model(IDS).logits
    with torch.no_grad():
        torch.testing.assert_close(traced, model(IDS).logits, rtol=0, atol=0)


def test_a_module_name_keeps_the_tensors_gradient():
    """Cohere's attention and MLP both read input_layernorm's output: the module name's
    gradient (nethook's meaning) is the tensor's, the sum of the two points' gradients."""
    model = build("cohere")
    with pyhook.Trace(model, "model.layers.0.input_layernorm", retain_grad=True) as t:
        _metric(model(IDS)).backward()
    model.zero_grad()
    branches = _plain_input_grad(model, "attn_in.0", own=True) + _plain_input_grad(
        model, "mlp_in.0", own=True
    )
    torch.testing.assert_close(t.output.grad, branches)
    with pyhook.TraceDict(model, ["attn_in.0", "mlp_in.0"], retain_grad=True) as td:
        _metric(model(IDS)).backward()
    model.zero_grad()
    torch.testing.assert_close(td["attn_in.0"].output.grad + td["mlp_in.0"].output.grad, branches)
