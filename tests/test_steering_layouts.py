"""Steering through the layout layer: an accelerate-offloaded model with a block on disk, and a
2-rank gloo tensor-parallel Llama; each must generate what the plain model generates, steered
by plain hooks on each row alone (test_steering's reference)."""

from __future__ import annotations

import os

import _steering_workers as W
import pytest
import torch
from _models import all_hooks, offloaded_llama
from test_steering import PROMPTS, _model, _reference, _row_specs, _steered

import pyhook

T = pytest.importorskip("transformers")


def test_offloaded_block_on_disk_steers_like_the_plain_model(tmp_path):
    pytest.importorskip("accelerate")
    model = _model("llama")
    model.save_pretrained(tmp_path / "ckpt")
    off = offloaded_llama(tmp_path / "ckpt", tmp_path / "offload", dtype=torch.float64)
    off.generation_config.pad_token_id = 0
    assert hasattr(off.model.layers[1], "_hf_hook")  # accelerate manages block 1
    specs = _row_specs()
    tokens, logits = _steered(off, PROMPTS, specs)
    want_tokens, want_logits = _steered(model, PROMPTS, specs)
    assert torch.equal(tokens, want_tokens)
    assert torch.equal(logits, want_logits)
    for row, prompt in enumerate(PROMPTS):
        spec = specs[row]
        spec = [] if spec is None else [spec] if isinstance(spec, pyhook.Steer) else spec
        ref_tokens, _ = _reference(model, prompt, spec)
        assert tokens[row].tolist() == ref_tokens
    assert all_hooks(off) == 0


@pytest.mark.distributed
def test_tensor_parallel_steering_gets_the_whole_vector(tmp_path):
    from test_distributed import _spawn

    W.save_llama(os.path.join(tmp_path, "llama"))
    ranks = _spawn(W.worker, 2, str(tmp_path))
    plain = T.AutoModelForCausalLM.from_pretrained(os.path.join(tmp_path, "llama")).eval()
    want_tokens, want_logits = W.steered_generate(plain)
    specs = W.specs()
    for rank, res in enumerate(ranks):
        assert torch.equal(res["tokens"], want_tokens), rank
        torch.testing.assert_close(res["logits"], want_logits, rtol=1e-4, atol=1e-5)
    # the unsharded model's steered rows are each row alone with plain hooks
    for row, prompt in enumerate(W.PROMPTS):
        spec = specs[row]
        spec = [] if spec is None else [spec] if isinstance(spec, pyhook.Steer) else spec
        ref_tokens, _ = _reference(plain, prompt, spec, new=W.NEW)
        assert want_tokens[row].tolist() == ref_tokens, row
