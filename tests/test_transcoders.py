"""Transcoder / CLT / attention-SAE datasets: the sites inside a block, all layers from one
forward, read back as aligned rows through ``reader.dataset([...])`` (issue 25 item 3).

The reference for alignment is the model itself: in every shuffled batch, the block's own MLP
applied to the ``mlp_in.L`` rows must give the ``mlp_out.L`` rows of the same batch, and the
output projection applied to the ``attn_z.L`` rows the ``attn_out.L`` rows.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
import transformers as T

from pyhook.capture import capture
from pyhook.store import open_capture

L = 3
D = 16


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = T.GPT2Config(n_embd=D, n_layer=L, n_head=4, vocab_size=64, n_positions=32)
    return T.GPT2LMHeadModel(cfg).eval()


def gemma2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = T.Gemma2Config(
        hidden_size=D,
        intermediate_size=32,
        num_hidden_layers=L,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=64,
        max_position_embeddings=32,
    )
    return T.Gemma2ForCausalLM(cfg).eval()


def batches(n: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, 60, (4, 8), generator=g) for _ in range(n)]


@pytest.mark.parametrize("build", [gpt2, gemma2], ids=["gpt2", "gemma2"])
def test_all_transcoder_sites_from_one_forward_read_as_aligned_rows(build, tmp_path):
    model = build()
    blocks = model.get_submodule(
        "transformer.h" if hasattr(model, "transformer") else "model.layers"
    )
    calls = []
    hand: dict[int, list[torch.Tensor]] = {i: [] for i in range(L)}
    handles = [blocks[0].register_forward_hook(lambda *a: calls.append(1))]
    for i in range(L):  # the MLP's input, by hand
        handles.append(
            blocks[i].mlp.register_forward_pre_hook(
                lambda m, a, i=i: hand[i].append(a[0].reshape(-1, D).clone())
            )
        )
    sites = [f"mlp_in.{i}" for i in range(L)] + [f"mlp_out.{i}" for i in range(L)]
    try:
        with (
            torch.no_grad(),
            capture(model, ["mlp_in.*", "mlp_out.*"], out=tmp_path / "acts") as rec,
        ):
            for b in batches():
                model(b)
    finally:
        for h in handles:
            h.remove()
    assert len(calls) == len(batches())  # every site of every layer from one forward a batch
    reader = open_capture(tmp_path / "acts", verify=True)
    assert sorted(reader.layers) == sorted(sites) and sorted(rec.layers) == sorted(sites)
    for i in range(L):
        assert torch.equal(reader[f"mlp_in.{i}"].to_tensor(), torch.cat(hand[i]))
    ds = reader.dataset(sites, batch_size=48, seed=3)
    seen = 0
    with torch.no_grad():
        for batch in ds:
            assert set(batch) == set(sites)
            for i in range(L):
                block = blocks[i]
                out = block.mlp(batch[f"mlp_in.{i}"])
                if hasattr(block, "post_feedforward_layernorm"):  # sandwich norms
                    out = block.post_feedforward_layernorm(out)
                torch.testing.assert_close(out, batch[f"mlp_out.{i}"])
            seen += batch["mlp_in.0"].shape[0]
    assert seen == 5 * 4 * 8


def test_attention_sae_sites_attn_z_rows_per_head(tmp_path):
    """attn_z is stored as [rows, heads, d_head]; the output projection applied to a shuffled
    batch of it (flattened) gives the attn_out rows of the same batch."""
    model = gpt2()
    with torch.no_grad(), capture(model, ["attn_z.1", "attn_out.1"], out=tmp_path / "acts"):
        for b in batches(3):
            model(b)
    reader = open_capture(tmp_path / "acts")
    assert tuple(reader["attn_z.1"].to_tensor().shape) == (3 * 32, 4, D // 4)
    with torch.no_grad():
        for batch in reader.dataset(["attn_z.1", "attn_out.1"], batch_size=40, seed=0):
            proj = model.transformer.h[1].attn.c_proj(batch["attn_z.1"].flatten(-2))
            torch.testing.assert_close(proj, batch["attn_out.1"])
