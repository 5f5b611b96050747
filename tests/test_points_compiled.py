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
