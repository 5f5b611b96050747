"""Standard points on a compiled model (a separate file: importing dynamo costs ~10 s)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from test_points import H, build, ids

import pyhook
from pyhook.capture import capture


def test_points_on_a_compiled_model():
    model = build("gpt2")
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        ref = model(ids(), output_hidden_states=True)
        with pyhook.TraceDict(
            compiled,
            ["resid_pre.1", "attn_out.1"],
            edit_output={"attn_out.1": lambda output: output * 0},
        ) as ret:
            out = compiled(ids())
        with pyhook.Trace(model, "attn_out.1", edit_output=lambda output: output * 0):
            expected = model(ids())
        with capture(compiled, "resid_post.*", to="host") as rec:
            compiled(ids())
    assert torch.equal(ret["resid_pre.1"].output, ref.hidden_states[1])
    assert torch.equal(out.logits, expected.logits)
    assert torch.equal(rec["resid_post.0"], ref.hidden_states[1].reshape(-1, H))


def test_opt_flat_sites_on_a_compiled_model_are_masked_like_the_eager_ones():
    """OPT's [batch*tokens, ...] MLP sites through the compiled capture path: the same rows as
    the eager capture (one per valid token), a hand-written hook being the eager reference's."""
    import transformers as T

    torch.manual_seed(0)
    cfg = T.OPTConfig(
        num_hidden_layers=1,
        hidden_size=16,
        ffn_dim=32,
        num_attention_heads=2,
        vocab_size=64,
        word_embed_proj_dim=16,
        max_position_embeddings=32,
    )
    model = T.OPTForCausalLM(cfg).eval()
    x = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    am = torch.ones(2, 6, dtype=torch.long)
    am[1, 4:] = 0
    seen = []
    h = model.model.decoder.layers[0].fc1.register_forward_pre_hook(
        lambda m, a: seen.append(a[0].clone())
    )
    try:
        with torch.no_grad():
            model(input_ids=x, attention_mask=am)
    finally:
        h.remove()
    want = seen[0].reshape(2, 6, -1)[am.bool()]
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad(), capture(compiled, ["mlp_in.0"], mask="attention_mask") as rec:
        compiled(input_ids=x, attention_mask=am)
    assert torch.equal(rec["mlp_in.0"], want)
