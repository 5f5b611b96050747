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


def opt(pre_norm: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = T.OPTConfig(
        num_hidden_layers=2,
        hidden_size=D,
        ffn_dim=32,
        num_attention_heads=4,
        vocab_size=64,
        word_embed_proj_dim=D,
        max_position_embeddings=32,
        do_layer_norm_before=pre_norm,
    )
    return T.OPTForCausalLM(cfg).eval()


@pytest.mark.parametrize("pre_norm", [True, False], ids=["opt", "opt-350m-post-norm"])
def test_opt_sites_computed_flat_are_masked_and_annotated_like_the_others(pre_norm, tmp_path):
    """OPT computes its MLP on [batch*tokens, hidden]: a masked capture must still store one row
    per valid token there (no padding rows), aligned with resid_post and with token ids; the
    reference is a hand-written hook on fc1 / fc2 with the padding rows removed by hand."""
    model = opt(pre_norm)
    ids = torch.randint(3, 64, (3, 7), generator=torch.Generator().manual_seed(2))
    am = torch.ones(3, 7, dtype=torch.long)
    am[1, 4:] = 0  # right padding
    am[2, :2] = 0  # left padding
    keep = am.bool()
    hand: dict[str, torch.Tensor] = {}
    layer = model.model.decoder.layers[1]
    handles = [
        layer.fc1.register_forward_pre_hook(lambda m, a: hand.__setitem__("in", a[0].clone())),
        layer.fc2.register_forward_pre_hook(lambda m, a: hand.__setitem__("hid", a[0].clone())),
        layer.fc2.register_forward_hook(lambda m, a, o: hand.__setitem__("out", o.clone())),
    ]
    sites = ["mlp_in.1", "mlp_hidden.1", "mlp_out.1", "resid_mid.1", "resid_post.1"]
    try:
        with torch.no_grad(), capture(model, sites, out=tmp_path / "a", mask="attention_mask"):
            model(input_ids=ids, attention_mask=am)
    finally:
        for h in handles:
            h.remove()
    reader = open_capture(tmp_path / "a")
    n = int(keep.sum())
    assert {k: reader[k].shape[0] for k in sites} == dict.fromkeys(sites, n)
    for key, site in (("in", "mlp_in.1"), ("hid", "mlp_hidden.1"), ("out", "mlp_out.1")):
        want = hand[key].reshape(3, 7, -1)[keep]  # [batch*tokens] as OPT computes it
        assert torch.equal(reader[site].to_tensor(), want), site
    assert torch.equal(reader.tokens, ids[keep])
    # Rows of the same tokens together, through the dataset; the MLP maps mlp_in to mlp_out.
    with torch.no_grad():
        for batch in reader.dataset(["mlp_in.1", "mlp_out.1"], batch_size=5, seed=0):
            y = layer.fc2(layer.activation_fn(layer.fc1(batch["mlp_in.1"])))  # fc1's input
            torch.testing.assert_close(y, batch["mlp_out.1"])
    # positions: the last valid token of each example, as for the other layers
    with torch.no_grad(), capture(model, sites, positions="last", mask="attention_mask") as rec:
        model(input_ids=ids, attention_mask=am)
    last = torch.tensor([6, 3, 6])
    want = hand["in"].reshape(3, 7, -1)[torch.arange(3), last] if pre_norm else None
    assert all(rec[s].shape[0] == 3 for s in sites)
    if want is not None:  # hand["in"] is the masked capture's forward: the same inputs
        assert torch.equal(rec["mlp_in.1"], want)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_opt_flat_sites_without_token_annotations_take_the_grid_from_input_ids():
    """tokens=False keeps no token ids, but the input_ids still say [batch, tokens]: the flat
    sites are captured (they were refused as "not known"), and positions apply to them."""
    model = opt()
    ids = torch.randint(3, 64, (3, 7), generator=torch.Generator().manual_seed(5))
    seen: list[torch.Tensor] = []
    fc1 = model.model.decoder.layers[1].fc1
    h = fc1.register_forward_pre_hook(lambda m, a: seen.append(a[0].clone()))
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        h.remove()
    flat = seen[0]
    sites = ["mlp_in.1", "resid_post.1"]
    with torch.no_grad(), capture(model, sites, tokens=False) as rec:
        model(input_ids=ids)
    assert torch.equal(rec["mlp_in.1"], flat)
    with torch.no_grad(), capture(model, sites, tokens=False, positions="last") as rec:
        model(input_ids=ids)
    assert torch.equal(rec["mlp_in.1"], flat.reshape(3, 7, -1)[:, -1])
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_a_flat_site_that_does_not_match_the_batch_is_refused_by_name():
    """A point registered as flat whose tensor is not [batch*tokens, ...] of this forward, in
    a masked capture: one error naming the layer, and no hook left behind."""
    from pyhook import points
    from pyhook.points import register_architecture

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn, self.norm, self.mlp = (
                torch.nn.Identity(),
                torch.nn.Identity(),
                torch.nn.Linear(4, 4),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(x)
            return x + self.mlp(self.norm(x))

    class FlatNet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block()])

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.blocks[0](x[:, 0])  # the first token only: [batch, 4], not [batch*tokens]

    register_architecture(
        FlatNet, blocks="blocks", attn="attn", mlp="mlp", mid="norm", flat=["mlp_out"]
    )
    try:
        net = FlatNet()
        x = torch.randn(2, 3, 4)
        with (
            pytest.raises(ValueError, match=r"layer 'mlp_out\.0'.*\[batch\*tokens, \.\.\.\]"),
            torch.no_grad(),
            capture(net, ["mlp_out.0"], mask="mask"),
        ):
            net(x, mask=torch.ones(2, 3))
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in net.modules())
        with pytest.raises(ValueError, match="flat: 'mlp_z' is not a per-layer point kind"):
            register_architecture(
                FlatNet, blocks="blocks", attn="attn", mlp="mlp", mid="norm", flat=["mlp_z"]
            )
    finally:
        points._USER_ROWS.clear()
        points._CACHE.clear()


@pytest.mark.parametrize("positions", ["last", -1, 0])
def test_one_position_keeps_attn_z_heads_in_each_row(positions, tmp_path):
    """positions that pick one token per example give one row per example: attn_z's row is
    [heads, d_head] (not one row per head), aligned with the other layers and their token ids;
    the reference is Trace of the point at that token."""
    import pyhook

    model = gpt2()
    ids = torch.randint(2, 60, (3, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), pyhook.Trace(model, "attn_z.1") as t:
        model(ids)
    pos = 7 if positions == "last" else positions
    want = t.output[:, pos]
    assert tuple(want.shape) == (3, 4, D // 4)
    with torch.no_grad(), capture(model, ["attn_z.1", "resid_post.1"], positions=positions) as rec:
        model(ids)
    assert torch.equal(rec["attn_z.1"], want)
    with (
        torch.no_grad(),
        capture(model, ["attn_z.1", "resid_post.1"], positions=positions, out=tmp_path / "a"),
    ):
        model(ids)
    reader = open_capture(tmp_path / "a")
    assert torch.equal(reader["attn_z.1"].to_tensor(), want)
    assert torch.equal(reader.tokens, ids[:, pos])
    batch = next(iter(reader.dataset(["attn_z.1", "resid_post.1"], batch_size=3)))
    assert tuple(batch["attn_z.1"].shape) == (3, 4, D // 4)
