"""Standard points on a model loaded with a ``device_map`` that offloads a block to disk
(accelerate's hooks move the weights in and out around each call; pyhook's hooks still act on
the hidden states, exactly)."""

from __future__ import annotations

import pytest
import torch

T = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from _models import offloaded_llama  # noqa: E402

import pyhook  # noqa: E402


def test_points_through_a_disk_offloaded_device_map(tmp_path):
    cfg = T.LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "ckpt")
    ids = torch.randint(2, 60, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
        with pyhook.Trace(model, "resid_pre.1", edit_output=lambda output: output + 1):
            ref_edited = model(ids).logits
    offloaded = offloaded_llama(tmp_path / "ckpt", tmp_path / "offload")
    assert hasattr(offloaded.model.layers[1], "_hf_hook")  # accelerate manages block 1
    with torch.no_grad():
        with pyhook.TraceDict(offloaded, ["resid_pre.*", "mlp_out.1", "final"]) as ret:
            out = offloaded(ids, output_hidden_states=True)
        with pyhook.Trace(offloaded, "resid_pre.1", edit_output=lambda output: output + 1):
            edited = offloaded(ids).logits
    assert torch.equal(out.logits, ref.logits)
    for i in range(2):
        assert torch.equal(ret[f"resid_pre.{i}"].output, ref.hidden_states[i])
    assert torch.equal(ret["final"].output, ref.hidden_states[2])
    assert ret["mlp_out.1"].output.shape == (2, 5, 16)
    assert torch.equal(edited, ref_edited)
