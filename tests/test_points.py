"""Standard hook points (pyhook.points) on real transformers architectures, built from configs.

References are independent of the mapping: HF's ``output_hidden_states``, hand-written hooks on
the modules each architecture's source computes its branches with (the table HAND below, written
from the transformers source, not from pyhook's mapping), and the residual-stream algebra
(``resid_mid = resid_pre + attn_out``, ``resid_post = resid_mid + mlp_out``).
"""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
import transformers as T

import pyhook
from pyhook import points
from pyhook.capture import capture, resolve_layers

H = 16
KW = dict(
    hidden_size=H,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=64,
    max_position_embeddings=32,
)
ENC = dict(
    hidden_size=H,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=32,
    vocab_size=64,
    max_position_embeddings=40,
)

# name -> (config factory, is an encoder)
CONFIGS = {
    "gpt2": lambda: T.GPT2Config(n_embd=H, n_layer=2, n_head=2, vocab_size=64, n_positions=32),
    "gpt_neo": lambda: T.GPTNeoConfig(
        hidden_size=H,
        num_layers=2,
        num_heads=2,
        attention_types=[[["global", "local"], 1]],
        vocab_size=64,
        max_position_embeddings=32,
        window_size=4,
    ),
    "gptj": lambda: T.GPTJConfig(
        n_embd=H, n_layer=2, n_head=2, rotary_dim=4, vocab_size=64, n_positions=32
    ),
    "gpt_neox": lambda: T.GPTNeoXConfig(
        hidden_size=H,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        vocab_size=64,
        max_position_embeddings=32,
    ),
    "gpt_neox_sequential": lambda: T.GPTNeoXConfig(
        hidden_size=H,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        vocab_size=64,
        max_position_embeddings=32,
        use_parallel_residual=False,
    ),
    "opt": lambda: T.OPTConfig(
        hidden_size=H,
        num_hidden_layers=2,
        num_attention_heads=2,
        ffn_dim=32,
        vocab_size=64,
        max_position_embeddings=32,
        word_embed_proj_dim=H,
    ),
    "bloom": lambda: T.BloomConfig(hidden_size=H, n_layer=2, n_head=2, vocab_size=64),
    "falcon": lambda: T.FalconConfig(
        hidden_size=H, num_hidden_layers=2, num_attention_heads=2, vocab_size=64
    ),
    "falcon_sequential": lambda: T.FalconConfig(
        hidden_size=H,
        num_hidden_layers=2,
        num_attention_heads=2,
        vocab_size=64,
        parallel_attn=False,
    ),
    "llama": lambda: T.LlamaConfig(**KW),
    "mistral": lambda: T.MistralConfig(**KW),
    "mixtral": lambda: T.MixtralConfig(**KW, num_local_experts=4, num_experts_per_tok=2),
    "qwen2": lambda: T.Qwen2Config(**KW),
    "qwen2_moe": lambda: T.Qwen2MoeConfig(
        **KW,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    ),
    "qwen3": lambda: T.Qwen3Config(**KW, head_dim=8),
    "gemma": lambda: T.GemmaConfig(**KW, head_dim=8),
    "gemma2": lambda: T.Gemma2Config(**KW, head_dim=8),
    "gemma3_text": lambda: T.Gemma3TextConfig(**KW, head_dim=8),
    "phi": lambda: T.PhiConfig(**{k: v for k, v in KW.items() if k != "num_key_value_heads"}),
    "phi3": lambda: T.Phi3Config(**KW),
    "stablelm": lambda: T.StableLmConfig(**KW),
    "olmo": lambda: T.OlmoConfig(**KW),
    "olmo2": lambda: T.Olmo2Config(**KW),
    "starcoder2": lambda: T.Starcoder2Config(**KW),
    "cohere": lambda: T.CohereConfig(**KW),
    "granite": lambda: T.GraniteConfig(**KW, residual_multiplier=0.5),
    "persimmon": lambda: T.PersimmonConfig(
        **{k: v for k, v in KW.items() if k != "num_key_value_heads"}
    ),
    "gpt_bigcode": lambda: T.GPTBigCodeConfig(
        n_embd=H, n_layer=2, n_head=2, vocab_size=64, n_positions=32
    ),
    "codegen": lambda: T.CodeGenConfig(
        n_embd=32, n_layer=2, n_head=4, rotary_dim=4, vocab_size=64, n_positions=32, n_ctx=32
    ),
    "mpt": lambda: T.MptConfig(d_model=H, n_layers=2, n_heads=2, vocab_size=64, max_seq_len=32),
    "bert": lambda: T.BertConfig(**ENC),
    "roberta": lambda: T.RobertaConfig(**ENC),
    "electra": lambda: T.ElectraConfig(**ENC, embedding_size=H),
    "distilbert": lambda: T.DistilBertConfig(
        dim=H, n_layers=2, n_heads=2, hidden_dim=32, vocab_size=64, max_position_embeddings=32
    ),
}
# The table's other rows (every row of pyhook.points.ARCHITECTURES has a config here or above:
# test_every_table_row_resolves_and_traces checks it); used by the tests that walk every row.
MORE_CONFIGS = {
    "helium": lambda: T.HeliumConfig(**KW, head_dim=8),
    "glm": lambda: T.GlmConfig(**KW, head_dim=8),
    "smollm3": lambda: T.SmolLM3Config(**KW),
    "olmo3": lambda: T.Olmo3Config(**KW),
    "qwen3_moe": lambda: T.Qwen3MoeConfig(
        **KW, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16
    ),
    "granitemoe": lambda: T.GraniteMoeConfig(
        **KW, num_local_experts=4, num_experts_per_tok=2, residual_multiplier=0.5
    ),
    "xlm-roberta": lambda: T.XLMRobertaConfig(**ENC),
    "camembert": lambda: T.CamembertConfig(**ENC),
    "opt_postnorm": lambda: T.OPTConfig(
        hidden_size=H,
        num_hidden_layers=2,
        num_attention_heads=2,
        ffn_dim=32,
        vocab_size=64,
        max_position_embeddings=32,
        word_embed_proj_dim=H,
        do_layer_norm_before=False,
    ),
    "stablelm_parallel": lambda: T.StableLmConfig(**KW, use_parallel_residual=True),
    "falcon_new": lambda: T.FalconConfig(
        hidden_size=H,
        num_hidden_layers=2,
        num_attention_heads=2,
        vocab_size=64,
        new_decoder_architecture=True,
        num_kv_heads=2,
    ),
}
ENCODERS = {"bert", "roberta", "electra", "distilbert", "xlm-roberta", "camembert"}
# parallel attention: attention and MLP read the same input, no resid_mid
PARALLEL = {"gptj", "gpt_neox", "falcon", "phi", "cohere", "codegen"}
POST_NORM = {"bert", "roberta", "electra", "distilbert"}

# Hand-written, from each architecture's modeling code: the module of block 1 whose output is
# the attention / MLP branch as added to the residual stream, and the module whose input is
# resid_mid (None: parallel). Paths relative to block 1.
HAND = {
    "gpt2": ("attn", "mlp", "ln_2"),
    "gpt_neo": ("attn", "mlp", "ln_2"),
    "gptj": ("attn", "mlp", None),
    "gpt_neox": ("post_attention_dropout", "post_mlp_dropout", None),
    "gpt_neox_sequential": (
        "post_attention_dropout",
        "post_mlp_dropout",
        "post_attention_layernorm",
    ),
    "opt": ("self_attn", "fc2", "final_layer_norm"),
    "bloom": ("self_attention.dense", "mlp.dense_4h_to_h", "post_attention_layernorm"),
    "falcon": ("self_attention", "mlp", None),
    "falcon_sequential": ("self_attention", "mlp", "post_attention_layernorm"),
    "gemma2": (
        "post_attention_layernorm",
        "post_feedforward_layernorm",
        "pre_feedforward_layernorm",
    ),
    "gemma3_text": (
        "post_attention_layernorm",
        "post_feedforward_layernorm",
        "pre_feedforward_layernorm",
    ),
    "olmo2": ("post_attention_layernorm", "post_feedforward_layernorm", "mlp"),
    "phi": ("self_attn", "mlp", None),
    "stablelm": ("self_attn", "dropout", "post_attention_layernorm"),
    "persimmon": ("self_attn", "dropout", "post_attention_layernorm"),
    "cohere": ("self_attn", "mlp", None),
    "codegen": ("attn", "mlp", None),
    "gpt_bigcode": ("attn", "mlp", "ln_2"),
    "mpt": ("resid_attn_dropout", "ffn.down_proj", "norm_2"),
    "bert": ("attention.output.dropout", "output.dropout", "intermediate"),
    "roberta": ("attention.output.dropout", "output.dropout", "intermediate"),
    "electra": ("attention.output.dropout", "output.dropout", "intermediate"),
    "distilbert": ("attention", "ffn", "ffn"),
}
for _name in ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "gemma", "phi3"):
    HAND[_name] = ("self_attn", "mlp", "post_attention_layernorm")
for _name in ("olmo", "starcoder2", "granite"):
    HAND[_name] = ("self_attn", "mlp", "post_attention_layernorm")

ARCHS = sorted(CONFIGS)
ALL_ARCHS = sorted({**CONFIGS, **MORE_CONFIGS})
DECODERS = [a for a in ARCHS if a not in ENCODERS]


@functools.cache
def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = {**CONFIGS, **MORE_CONFIGS}[name]()
    cfg.pad_token_id = 0
    for attr in ("bos_token_id", "eos_token_id"):
        if getattr(cfg, attr, None) is not None:
            setattr(cfg, attr, 1)
    auto = T.AutoModel if name in ENCODERS else T.AutoModelForCausalLM
    return auto.from_config(cfg).eval()


def ids(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 60, (2, 5), generator=g)


def blocks_of(model: torch.nn.Module) -> str:
    # independent of the mapping: the model's only ModuleList of 2 blocks
    names = [
        n
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.ModuleList) and len(m) == 2 and n.count(".") <= 2
    ]
    assert len(names) == 1, names
    return names[0]


def first(x):
    return x if isinstance(x, torch.Tensor) else x[0]


def test_at_least_20_architectures():
    assert len({points.architecture_of(build(a)).key for a in ARCHS}) >= 20


@pytest.mark.parametrize("arch", ARCHS)
def test_resid_points_are_hf_hidden_states(arch):
    """resid_pre.L is HF's hidden_states[L] (the very tensor) and resid_post.L is
    hidden_states[L+1], except the last: HF's last entry has the final norm applied, which is
    the ``final`` point (the last block's output on post-norm models without a final norm)."""
    model = build(arch)
    with (
        torch.no_grad(),
        pyhook.TraceDict(model, ["resid_pre.*", "resid_post.*", "final", "embed"]) as ret,
    ):
        hs = model(ids(), output_hidden_states=True).hidden_states
    n = len(hs) - 1
    assert n == 2
    for i in range(n):
        assert torch.equal(ret[f"resid_pre.{i}"].output, hs[i])
    assert torch.equal(ret["embed"].output, hs[0])
    assert torch.equal(ret["resid_post.0"].output, hs[1])
    assert torch.equal(ret["final"].output, hs[n])
    if arch in POST_NORM:
        assert torch.equal(ret["resid_post.1"].output, hs[n])
    else:  # the final norm changes the last entry
        assert not torch.allclose(ret["resid_post.1"].output, hs[n])


@pytest.mark.parametrize("arch", ARCHS)
def test_branches_match_hand_written_hooks(arch):
    model = build(arch)
    block = model.get_submodule(blocks_of(model))[1]
    attn, mlp, mid = HAND[arch]
    seen: dict[str, torch.Tensor] = {}
    handles = [
        block.get_submodule(attn).register_forward_hook(
            lambda m, a, o: seen.__setitem__("attn", first(o).clone())
        ),
        block.get_submodule(mlp).register_forward_hook(
            lambda m, a, o: seen.__setitem__("mlp", first(o).clone())
        ),
    ]
    if mid is not None:
        handles.append(
            block.get_submodule(mid).register_forward_pre_hook(
                lambda m, a: seen.__setitem__("mid", a[0].clone())
            )
        )
    names = ["attn_out.1", "mlp_out.1", "resid_pre.1", "resid_post.1"]
    names += [] if mid is None else ["resid_mid.1"]
    try:
        with torch.no_grad(), pyhook.TraceDict(model, names, clone=True) as ret:
            model(ids())
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(ret["attn_out.1"].output, seen["attn"])
    assert torch.equal(ret["mlp_out.1"].output, seen["mlp"])
    if mid is None:
        assert arch in PARALLEL and points.architecture_of(model).parallel
        with pytest.raises(LookupError, match="parallel"):
            pyhook.Trace(model, "resid_mid.1")
        return
    assert torch.equal(ret["resid_mid.1"].output, seen["mid"])


@pytest.mark.parametrize("arch", ARCHS)
def test_residual_algebra(arch):
    """The points add up: resid_pre + attn_out = resid_mid, resid_mid + mlp_out = resid_post
    (pre-norm); resid_pre + attn_out + mlp_out = resid_post (parallel)."""
    model = build(arch)
    kinds = ["resid_pre", "attn_out", "mlp_out", "resid_post"]
    kinds += [] if arch in PARALLEL else ["resid_mid"]
    with torch.no_grad(), pyhook.TraceDict(model, [f"{k}.1" for k in kinds], clone=True) as ret:
        model(ids())
    v = {k: ret[f"{k}.1"].output for k in kinds}
    shape = v["resid_pre"].shape
    scale = getattr(model.config, "residual_multiplier", 1.0)
    block = model.get_submodule(blocks_of(model))[1]
    if arch in PARALLEL:
        expect = v["resid_pre"] + v["attn_out"] + v["mlp_out"]
        torch.testing.assert_close(v["resid_post"], expect, rtol=1e-5, atol=1e-5)
    elif arch in POST_NORM:
        norm1, norm2 = (
            (block.sa_layer_norm, block.output_layer_norm)
            if arch == "distilbert"
            else (block.attention.output.LayerNorm, block.output.LayerNorm)
        )
        torch.testing.assert_close(v["resid_mid"], norm1(v["attn_out"] + v["resid_pre"]))
        torch.testing.assert_close(v["resid_post"], norm2(v["mlp_out"] + v["resid_mid"]))
    else:
        mid = v["resid_mid"].reshape(shape)  # OPT computes the MLP half on [tokens, hidden]
        torch.testing.assert_close(mid, v["resid_pre"] + v["attn_out"].reshape(shape) * scale)
        torch.testing.assert_close(
            v["resid_post"], mid + v["mlp_out"].reshape(shape) * scale, rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("arch", ARCHS)
def test_edit_at_resid_pre_is_a_pre_hook_edit_of_that_block_only(arch):
    model = build(arch)
    block = model.get_submodule(blocks_of(model))[1]
    delta = torch.randn(H if arch != "codegen" else 32, generator=torch.Generator().manual_seed(1))

    def by_hand(_m, args, kwargs):
        if args:
            return (args[0] + delta, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"] + delta}

    with torch.no_grad():
        plain = model(ids(), output_hidden_states=True)
        # transformers adds its own hooks on a first output_hidden_states forward
        before = (len(block._forward_pre_hooks), len(block._forward_hooks))
        handle = block.register_forward_pre_hook(by_hand, with_kwargs=True)
        try:
            expected = model(ids())
        finally:
            handle.remove()
        with pyhook.TraceDict(
            model,
            ["resid_pre.1", "resid_post.0"],
            edit_output={"resid_pre.1": lambda output: output + delta},
        ) as ret:
            edited = model(ids())
    key = "last_hidden_state" if arch in ENCODERS else "logits"
    assert torch.equal(edited[key], expected[key])
    assert not torch.equal(edited[key], plain[key])
    # block 0's output (the tensor resid_pre.1 replaced) is untouched
    assert torch.equal(ret["resid_post.0"].output, plain.hidden_states[1])
    assert (len(block._forward_pre_hooks), len(block._forward_hooks)) == before


@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in PARALLEL and a not in POST_NORM])
def test_edit_at_resid_mid_reaches_mlp_and_skip_connection(arch):
    """Adding d at resid_mid.1 equals adding d (divided by any residual multiplier) at attn_out.1:
    both the MLP branch and the skip connection see the edit."""
    model = build(arch)
    d = torch.randn(H, generator=torch.Generator().manual_seed(2))
    scale = getattr(model.config, "residual_multiplier", 1.0)
    key = "logits"
    with torch.no_grad():
        with pyhook.Trace(model, "resid_mid.1", edit_output=lambda output: output + d):
            at_mid = model(ids())[key]
        with pyhook.Trace(model, "attn_out.1", edit_output=lambda output: output + d / scale):
            at_attn = model(ids())[key]
        plain = model(ids())[key]
    torch.testing.assert_close(at_mid, at_attn, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(at_mid, plain)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "gpt_neo", "falcon"])
def test_generate_with_kv_cache_captures_each_step(arch):
    model = build(arch)
    block = model.get_submodule(blocks_of(model))[1]
    by_hand: list[torch.Tensor] = []
    handle = block.register_forward_hook(lambda m, a, o: by_hand.append(first(o).clone()))
    prompt = ids()[:, :3]
    try:
        with torch.no_grad(), pyhook.Trace(model, "resid_post.1", keep_calls=True, clone=True) as t:
            out = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=4,
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
            )
    finally:
        handle.remove()
    assert out.shape[1] == 7
    assert len(t.calls) == len(by_hand) == 4
    assert [tuple(c.output.shape) for c in t.calls] == [(2, 3, H)] + [(2, 1, H)] * 3
    for call, ref in zip(t.calls, by_hand):
        assert torch.equal(call.output, ref)


def test_capture_standard_points_matches_tracedict():
    model = build("llama")
    with torch.no_grad(), capture(model, ["resid_pre.1", "resid_mid.1"], to="host") as rec:
        hs = model(ids(), output_hidden_states=True).hidden_states
    assert torch.equal(rec["resid_pre.1"], hs[1].reshape(-1, H))  # input points too
    assert rec["resid_mid.1"].shape == (10, H)
    with torch.no_grad(), capture(model, "resid_post.*", to="host") as rec:
        model(ids())
    with torch.no_grad(), pyhook.TraceDict(model, ["resid_post.0", "resid_post.1"]) as ret:
        model(ids())
    assert rec.layers == ["resid_post.0", "resid_post.1"]
    for name in rec.layers:
        assert torch.equal(rec[name], ret[name].output.reshape(-1, H))


def test_names_globs_ranges_and_transformerlens_aliases():
    model = build("gpt2")
    exp = points.expand_points
    assert [n for n, _ in exp(model, "resid_post.*")] == ["resid_post.0", "resid_post.1"]
    assert [n for n, _ in exp(model, "resid_post.-1:")] == ["resid_post.1"]
    assert [n for n, _ in exp(model, "resid_*.1")] == [
        "resid_pre.1",
        "resid_mid.1",
        "resid_post.1",
    ]
    assert [n for n, _ in exp(model, "blocks.*.hook_resid_post")] == [
        "blocks.0.hook_resid_post",
        "blocks.1.hook_resid_post",
    ]
    pairs = [
        ("blocks.1.hook_resid_pre", "resid_pre.1"),
        ("blocks.-1.hook_mlp_out", "mlp_out.1"),
        ("resid_post.-2", "resid_post.0"),
    ]
    for alias, canon in pairs:
        assert points.resolve_point(model, alias) == points.resolve_point(model, canon)
    with pyhook.TraceDict(model, ["blocks.1.hook_resid_post", "resid_post.1"]) as ret:
        model(ids())
    assert ret["blocks.1.hook_resid_post"].output is ret["resid_post.1"].output
    with pytest.raises(LookupError, match="has 2 blocks"):
        pyhook.Trace(model, "resid_post.2")
    with pytest.raises(LookupError, match="matches no standard point"):
        points.expand_points(model, "resid_post.5:9")
    # a list (as TraceDict takes) was a raw TypeError from the regex ('expected string')
    with pytest.raises(TypeError, match=r"one point name, range or glob \(str\), got list"):
        points.expand_points(model, ["resid_post.0", "resid_post.1"])
    # module names win over point spellings, module globs are unchanged
    assert not points.is_point_name("transformer.h.*", model)
    assert [n for n, _ in resolve_layers(model, "transformer.h.*")] == [
        "transformer.h.0",
        "transformer.h.1",
    ]


def test_every_point_of_a_block_glob_in_every_tool():
    """docs/points.md: ``*.3`` is every point of block 3 wherever a module name is taken; it
    was taken as a module glob (matching nothing) by TraceDict and capture."""
    model = build("gpt2")
    block1 = [n for n, _ in points.expand_points(model, "*.1")]
    assert len(block1) == 9
    assert [n for n, _ in resolve_layers(model, "*.1")] == block1
    assert [n for n, _ in resolve_layers(model, "*.-1")] == block1
    with torch.no_grad(), pyhook.TraceDict(model, ["*.1"]) as ret:
        model(ids())
    assert list(ret) == block1
    with torch.no_grad(), capture(model, "*.0", to="host") as rec:
        model(ids())
    assert rec.layers == [n for n, _ in points.expand_points(model, "*.0")]
    with pytest.raises(LookupError, match="matches no standard point"):
        pyhook.TraceDict(model, ["*.5"])
    # a module glob that matches modules stays one
    assert "transformer.h" in [n for n, _ in resolve_layers(model, "*.*")]


def test_transformerlens_aliases_on_a_model_with_a_blocks_child():
    """MPT's base model (and many models of one's own) keeps its blocks in a child named
    ``blocks``, the first part of TransformerLens' names: ``blocks.1.hook_resid_post`` is no
    module path there, so it is the point (it was taken as a module name, and not found);
    ``blocks.1`` and the module glob ``blocks.*`` stay modules."""
    model = build("mpt").transformer
    assert type(model).__name__ == "MptModel" and "blocks" in model._modules
    with (
        torch.no_grad(),
        pyhook.TraceDict(model, ["blocks.1.hook_resid_post", "resid_post.1"]) as r,
    ):
        model(ids())
    assert r["blocks.1.hook_resid_post"].output is r["resid_post.1"].output
    names = ["blocks.*.hook_mlp_out", "blocks.0.attn.hook_z"]
    with torch.no_grad(), capture(model, names, to="host") as rec:
        model(ids())
    assert rec.layers == ["blocks.0.hook_mlp_out", "blocks.1.hook_mlp_out", "blocks.0.attn.hook_z"]
    assert points.is_point_name("blocks.1.hook_resid_post", model)
    assert not points.is_point_name("blocks.*", model)
    assert [n for n, _ in resolve_layers(model, "blocks.*")] == ["blocks.0", "blocks.1"]
    assert resolve_layers(model, "blocks.1")[0][1] is model.blocks[1]


def test_block_outputs_as_tuple_keep_the_rest_untouched():
    """GPT-Neo's blocks return (hidden, attn_weights): an edit replaces element 0 only."""
    model = build("gpt_neo")
    block = model.get_submodule("transformer.h.1")
    outs: list = []
    handle = block.register_forward_hook(lambda m, a, o: outs.append(o))
    try:
        with (
            torch.no_grad(),
            pyhook.Trace(model, "resid_post.1", edit_output=lambda output: output * 0),
        ):
            model(ids())
    finally:
        handle.remove()
    assert isinstance(outs[0], tuple) and len(outs[0]) == 2
    with torch.no_grad(), pyhook.Trace(model, "resid_post.1") as t:
        model(ids())
    assert isinstance(t.output, torch.Tensor)  # users get the hidden state, not the tuple


def test_truncated_module_stops_at_an_input_point():
    model = build("llama")
    calls = []
    handle = model.model.layers[1].register_forward_hook(lambda *a: calls.append(1))
    try:
        with torch.no_grad():
            got = pyhook.TruncatedModule(model, "resid_pre.1")(ids())
            hs = model(ids(), output_hidden_states=True).hidden_states
    finally:
        handle.remove()
    assert torch.equal(got, hs[1])
    assert len(calls) == 1  # block 1 ran in the plain forward only, not in the truncated one


def test_flexmodel_hook_function_on_a_point():
    model = build("qwen2")
    out: dict = {}
    fm = pyhook.FlexModel(model, out)
    fm.register_forward_hook(
        pyhook.HookFunction("resid_post.0", editing_function=lambda m, x, ctx, mods: x * 0)
    )
    try:
        with torch.no_grad():
            fm(ids())
    finally:
        fm.restore()
    with torch.no_grad(), pyhook.Trace(model, "resid_post.0") as t:
        model(ids())
    assert torch.equal(out["resid_post.0"][0], t.output)


def test_a_point_on_a_module_that_runs_in_several_blocks_is_refused():
    """A block listed twice (a looped model) or a module shared by two blocks runs at each: a
    point on it held the last call's tensor (resid_post.0 was block 2's output), silently.
    Refused by name, before any hook; the points of the other blocks stay."""
    model = copy.deepcopy(build("llama"))
    layers = model.model.layers
    model.model.layers = torch.nn.ModuleList([layers[0], layers[1], layers[0]])
    model.config.num_hidden_layers = 3
    before = _hooks_of(model)
    for name in ("resid_post.0", "embed", "mlp_out.2", "attn_z.0"):
        with pytest.raises(points.PointUnavailableError, match="runs in blocks 0, 2"):
            pyhook.TraceDict(model, [name])
        with pytest.raises(points.PointUnavailableError, match="runs in blocks 0, 2"):
            capture(model, ["resid_post.1", name], to="host")
    assert _hooks_of(model) == before
    with torch.no_grad(), pyhook.Trace(model, "resid_post.1") as t:
        out = model(ids(), output_hidden_states=True)
    assert torch.equal(t.output, out.hidden_states[2])
    shared = copy.deepcopy(build("llama"))
    shared.model.layers[1].mlp = shared.model.layers[0].mlp
    with pytest.raises(points.PointUnavailableError, match="runs in blocks 0, 1"):
        pyhook.Trace(shared, "mlp_out.1")
    assert points.resolve_point(shared, "resid_post.1").module is shared.model.layers[1]
    # a block replaced in place after the points were first resolved
    looped = copy.deepcopy(build("llama"))
    assert points.resolve_point(looped, "resid_post.1").module is looped.model.layers[1]
    looped.model.layers[1] = looped.model.layers[0]
    with pytest.raises(points.PointUnavailableError, match="runs in blocks 0, 1"):
        pyhook.Trace(looped, "resid_post.1")


def test_a_feed_forward_point_of_a_chunked_feed_forward_is_refused():
    """BERT-like blocks with config.chunk_size_feed_forward > 0 run their feed-forward once a
    chunk of tokens: resid_mid, mlp_in, mlp_hidden and mlp_out held the last chunk's tokens
    (2 of 6), silently, in Trace and in capture. Refused by name, before any hook; the points
    outside the feed-forward stay exact."""
    cfg = T.BertConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        vocab_size=50, chunk_size_feed_forward=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = T.BertModel(cfg).eval()
    x = torch.randint(0, 50, (2, 6))
    before = _hooks_of(model)
    for name in ("resid_mid.1", "mlp_in.0", "mlp_hidden.1", "mlp_out.1"):
        with pytest.raises(points.PointUnavailableError, match="chunk_size_feed_forward=2"):
            pyhook.TraceDict(model, ["resid_post.0", name])
        with pytest.raises(points.PointUnavailableError, match="chunks of 2 tokens"):
            capture(model, ["resid_post.0", name], to="host")
    assert _hooks_of(model) == before
    with torch.no_grad(), pyhook.TraceDict(model, ["attn_out.1", "resid_post.1"]) as t:
        out = model(x, output_hidden_states=True)
    assert torch.equal(t["resid_post.1"].output, out.hidden_states[2])
    assert t["attn_out.1"].output.shape == (2, 6, 16)
    # DistilBERT chunks in its FFN module, below the block
    dcfg = T.DistilBertConfig(
        dim=16, n_layers=1, n_heads=2, hidden_dim=32, vocab_size=50, chunk_size_feed_forward=3
    )
    distil = T.DistilBertModel(dcfg).eval()
    with pytest.raises(points.PointUnavailableError, match=r"FFN .*chunks of 3 tokens"):
        pyhook.Trace(distil, "mlp_hidden.0")
    # its FFN module itself is called once with every token: its input and output stay
    with torch.no_grad(), pyhook.TraceDict(distil, ["mlp_in.0", "mlp_out.0"]) as t:
        distil(x)
    assert t["mlp_in.0"].output.shape == t["mlp_out.0"].output.shape == (2, 6, 16)
    # unchunked, the same points resolve
    cfg.chunk_size_feed_forward = 0
    with torch.no_grad(), pyhook.Trace(T.BertModel(cfg).eval(), "mlp_out.1") as t:
        pass
    assert t.layer == "mlp_out.1"


def test_a_projection_bloom_applies_in_slices_is_refused():
    """Bloom with pretraining_tp > 1 and slow_but_exact=True applies self_attention.dense and
    mlp.dense_4h_to_h with F.linear, slice by slice, never calling them: attn_out, attn_z,
    mlp_hidden and mlp_out never ran (Trace left .output unset, a capture stored no row).
    Refused by name, before any hook; the block's other points stay exact."""
    cfg = T.BloomConfig(
        hidden_size=16, n_layer=2, n_head=2, vocab_size=50, pretraining_tp=2, slow_but_exact=True
    )
    torch.manual_seed(0)
    model = T.BloomModel(cfg).eval()
    before = _hooks_of(model)
    for name in ("attn_out.0", "attn_z.1", "mlp_hidden.0", "mlp_out.1"):
        with pytest.raises(points.PointUnavailableError, match=r"pretraining_tp=2.*never calls"):
            pyhook.TraceDict(model, ["resid_post.0", name])
        with pytest.raises(points.PointUnavailableError, match="slow_but_exact=False"):
            capture(model, [name], to="host")
    assert _hooks_of(model) == before
    x = torch.randint(0, 50, (2, 5))
    with torch.no_grad(), pyhook.TraceDict(model, ["attn_in.1", "mlp_in.1", "resid_post.0"]) as t:
        out = model(x, output_hidden_states=True)
    assert torch.equal(t["resid_post.0"].output, out.hidden_states[1])
    assert t["mlp_in.1"].output.shape == t["attn_in.1"].output.shape == (2, 5, 16)
    cfg.slow_but_exact = False  # the sliced path off: the projections are called
    with torch.no_grad(), pyhook.Trace(T.BloomModel(cfg).eval(), "mlp_out.1") as t:
        pass
    assert t.layer == "mlp_out.1"


def test_a_model_cut_short_by_its_config_has_the_blocks_that_run():
    """Llama (and most decoders) run layers[: config.num_hidden_layers]: with 2 of 3 blocks
    run, resid_post.-1 named block 2, which never ran (Trace left .output unset; a capture of
    'resid_post.*' had a layer of no rows). The points count the blocks that run; a later one
    is refused saying why."""
    model = copy.deepcopy(build("llama"))
    n = len(model.model.layers)
    model.config.num_hidden_layers = n - 1
    seen = {}
    last = model.model.layers[n - 2]
    h = last.register_forward_hook(
        lambda m, a, o: seen.update(out=o[0] if isinstance(o, tuple) else o)
    )
    try:
        with torch.no_grad(), pyhook.TraceDict(model, ["resid_post.-1", "final"]) as t:
            model(ids())
    finally:
        h.remove()
    assert torch.equal(t["resid_post.-1"].output, seen["out"])
    assert [n for n, _ in points.expand_points(model, "resid_post.*")] == [
        f"resid_post.{i}" for i in range(n - 1)
    ]
    with pytest.raises(LookupError, match=rf"config.num_hidden_layers={n - 1} of its {n}"):
        pyhook.Trace(model, f"resid_post.{n - 1}")
    with capture(model, "resid_post.*", to="host") as rec:
        model(ids())
    assert rec.layers == [f"resid_post.{i}" for i in range(n - 1)]
    assert all(rec.rows[k] > 0 for k in rec.layers)
    model.config.num_hidden_layers = n  # every block runs again
    assert len(points.expand_points(model, "resid_post.*")) == n


def test_unknown_architecture_gets_a_one_line_error_and_no_hook():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mix, self.ff = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return x + self.ff(x + self.mix(x))

    class Mystery(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = torch.nn.ModuleList([Block(), Block()])

        def forward(self, x):
            for b in self.stack:
                x = b(x)
            return x

    net = Mystery()
    with pytest.raises(points.UnknownArchitectureError) as info:
        pyhook.TraceDict(net, ["stack.0", "resid_post.0"])
    msg = str(info.value)
    assert "\n" not in msg
    assert "'stack'" in msg and "mix, ff" in msg and "register_architecture" in msg
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in net.modules())
    assert "blocks=" in msg and "stack" in msg
    points.register_architecture(
        "Mystery", blocks="stack", attn="mix", mlp="ff", mid="ff", final=None
    )
    try:
        x = torch.randn(3, 4)
        with pyhook.TraceDict(net, ["resid_mid.1", "mlp_out.1", "final"]) as ret:
            y = net(x)
        assert torch.equal(ret["final"].output, y)
        h1 = net.stack[0](x)
        torch.testing.assert_close(ret["resid_mid.1"].output, h1 + net.stack[1].mix(h1))
    finally:
        points._USER_ROWS.clear()
        points._CACHE.clear()


def test_point_on_hookset_forward_pre_is_refused():
    from pyhook._hooks import HookSet

    model = build("gpt2")
    with pytest.raises(TypeError, match="forward hooks only"):
        HookSet().forward_pre(points.resolve_point(model, "resid_pre.0"), lambda *a: None)


def test_docs_table_is_generated_from_the_mapping():
    page = Path(__file__).resolve().parents[1] / "docs" / "points.md"
    text = page.read_text()
    m = re.search(
        r"<!-- architecture-table:start -->\n(.*?)\n<!-- architecture-table:end -->", text, re.S
    )
    assert m, "docs/points.md lost its generated-table markers"
    assert m.group(1) == points.architecture_table(), (
        "docs/points.md is out of date: paste "
        "`python -c 'import pyhook.points as p; print(p.architecture_table())'` between the markers"
    )
    m = re.search(r"<!-- sites-table:start -->\n(.*?)\n<!-- sites-table:end -->", text, re.S)
    assert m, "docs/points.md lost its generated sites-table markers"
    assert m.group(1) == points.architecture_table(sites=True), (
        "docs/points.md is out of date: paste `python -c 'import pyhook.points as p; "
        "print(p.architecture_table(sites=True))'` between the sites-table markers"
    )


# -- every row of the table ---------------------------------------------------------------------
def test_every_table_row_resolves_and_traces():
    """Each row of the mapping is used by some tiny config, and on it every point that
    point_names() lists (and its TransformerLens alias) is a real module of the model, traces in
    one forward, and the residual points are HF's hidden_states (issue 23: granitemoe's row named
    a module the model lacks; OPT-350m's row a final norm it lacks)."""
    rows_seen = set()
    for arch in ALL_ARCHS:
        model = build(arch)
        row = points.architecture_of(model)
        rows_seen.add(id(row))
        names = points.point_names(model)
        tl_names = points.point_names(model, tl=True)
        assert len(names) == len(set(names)) and len(tl_names) == len(set(tl_names))
        for name in names:
            p = points.resolve_point(model, name)
            assert model.get_submodule(p.module_name) is p.module, (arch, name)
        for alias in tl_names:  # TransformerLens' names: aliases of a point, or their own
            p = points.resolve_point(model, alias)
            assert model.get_submodule(p.module_name) is p.module, (arch, alias)
            kind, layer = points._split(alias)[:2]
            if kind not in points.TL_ONLY_KINDS:
                canon = kind if layer is None else f"{kind}.{layer}"
                assert p == points.resolve_point(model, canon), (arch, alias)
        with torch.no_grad(), pyhook.TraceDict(model, names) as ret:
            hs = model(ids(), output_hidden_states=True).hidden_states
        for name in names:
            assert isinstance(ret[name].output, torch.Tensor), (arch, name)
        assert torch.equal(ret["embed"].output, hs[0]), arch
        assert torch.equal(ret["resid_pre.1"].output, hs[1]), arch
        assert torch.equal(ret["final"].output, hs[-1]), arch
    missing = [f"{r.key} (when {r.when})" for r in points.ARCHITECTURES if id(r) not in rows_seen]
    assert not missing, f"table rows no test config selects: {missing}"


# -- the sites inside a block -------------------------------------------------------------------
# Hand-written from each architecture's modeling code, paths relative to block 1: the attention
# module, its output projection, the MLP module, its down projection (None: experts), and how
# the MLP is applied to its input ("plain", "residual": it adds a residual argument itself,
# "opt": fc1 -> activation -> fc2 in the block, "bert": intermediate -> output.dense).
LLAMA_SITES = ("self_attn", "self_attn.o_proj", "mlp", "mlp.down_proj", "plain")
MOE_SITES = ("self_attn", "self_attn.o_proj", "mlp", None, "plain")
BERT_SITES = ("attention.self", "attention.output.dense", "intermediate", "output.dense", "bert")
OPT_SITES = ("self_attn", "self_attn.out_proj", "fc1", "fc2", "opt")
FALCON_SITES = ("self_attention", "self_attention.dense", "mlp", "mlp.dense_4h_to_h", "plain")
NEOX_SITES = ("attention", "attention.dense", "mlp", "mlp.dense_4h_to_h", "plain")
SITES = {
    "gpt2": ("attn", "attn.c_proj", "mlp", "mlp.c_proj", "plain"),
    "gpt_bigcode": ("attn", "attn.c_proj", "mlp", "mlp.c_proj", "plain"),
    "gpt_neo": ("attn", "attn.attention.out_proj", "mlp", "mlp.c_proj", "plain"),
    "gptj": ("attn", "attn.out_proj", "mlp", "mlp.fc_out", "plain"),
    "codegen": ("attn", "attn.out_proj", "mlp", "mlp.fc_out", "plain"),
    "gpt_neox": NEOX_SITES,
    "gpt_neox_sequential": NEOX_SITES,
    "opt": OPT_SITES,
    "opt_postnorm": OPT_SITES,
    "bloom": ("self_attention", "self_attention.dense", "mlp", "mlp.dense_4h_to_h", "residual"),
    "falcon": FALCON_SITES,
    "falcon_new": FALCON_SITES,
    "falcon_sequential": FALCON_SITES,
    "mpt": ("attn", "attn.out_proj", "ffn", "ffn.down_proj", "residual"),
    "phi": ("self_attn", "self_attn.dense", "mlp", "mlp.fc2", "plain"),
    "persimmon": ("self_attn", "self_attn.dense", "mlp", "mlp.dense_4h_to_h", "plain"),
    "starcoder2": ("self_attn", "self_attn.o_proj", "mlp", "mlp.c_proj", "plain"),
    "granitemoe": ("self_attn", "self_attn.o_proj", "block_sparse_moe", None, "plain"),
    "distilbert": ("attention", "attention.out_lin", "ffn", "ffn.lin2", "plain"),
}
for _name in ("bert", "roberta", "electra", "xlm-roberta", "camembert"):
    SITES[_name] = BERT_SITES
for _name in ("mixtral", "qwen2_moe", "qwen3_moe"):
    SITES[_name] = MOE_SITES
for _name in ALL_ARCHS:
    SITES.setdefault(_name, LLAMA_SITES)  # Llama's layout: llama, mistral, qwen, gemma, olmo, ...
# sandwich norms (a norm after each branch, before the residual add)
SANDWICH = {"gemma2", "gemma3_text", "olmo2", "olmo3"}
# no norm before the branches: the branches read the residual stream itself
NO_PRE_NORM = {
    "olmo2",
    "olmo3",
    "bert",
    "roberta",
    "electra",
    "xlm-roberta",
    "camembert",
    "distilbert",
    "opt_postnorm",
}
# parallel blocks where one norm feeds both branches / where each branch has its own
SHARED_NORM = {"gptj", "codegen", "phi", "cohere", "stablelm_parallel", "falcon"}
TWO_NORMS = {"gpt_neox", "falcon_new"}
SITE_NAMES = ("attn_in", "attn_z", "mlp_in", "mlp_hidden")


def _hooks_of(model):
    # transformers adds hooks of its own on a first output_hidden_states forward: compare counts
    return [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]


def _arg0(args, kwargs):
    return args[0] if args else kwargs["hidden_states"]


def _heads(model):
    return model.config.num_attention_heads


def _mlp_of(block, arch):
    mlp, how = SITES[arch][2], SITES[arch][4]
    if how == "opt":
        return lambda x: block.fc2(block.activation_fn(block.fc1(x)))
    if how == "bert":
        return lambda x: block.output.dense(block.intermediate(x))
    module = block.get_submodule(mlp)
    if how == "residual":
        return lambda x: module(x, torch.zeros_like(x))
    return lambda x: first(module(x))


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_sites_match_hand_written_pre_hooks(arch):
    model = build(arch)
    before = _hooks_of(model)
    block = model.get_submodule(blocks_of(model))[1]
    attn, o_proj, mlp, down, _ = SITES[arch]
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for key, path in (("attn_in", attn), ("attn_z", o_proj), ("mlp_in", mlp), ("mlp_hidden", down)):
        if path is None:
            continue
        handles.append(
            block.get_submodule(path).register_forward_pre_hook(
                lambda m, a, k, key=key: seen.__setitem__(key, _arg0(a, k).clone()),
                with_kwargs=True,
            )
        )
    names = [f"{s}.1" for s in SITE_NAMES if not (s == "mlp_hidden" and down is None)]
    try:
        with torch.no_grad(), pyhook.TraceDict(model, names, clone=True) as ret:
            model(ids())
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(ret["attn_in.1"].output, seen["attn_in"])
    assert torch.equal(ret["mlp_in.1"].output, seen["mlp_in"])
    z = ret["attn_z.1"].output
    heads = _heads(model)
    assert z.shape[-2] == heads and z.shape[:2] == (2, 5)
    assert torch.equal(z, seen["attn_z"].unflatten(-1, (heads, -1)))
    if down is None:  # a mixture of experts: refused by name, and not listed
        assert points.architecture_of(model).moe
        with pytest.raises(points.PointUnavailableError, match="mixture of experts"):
            pyhook.Trace(model, "mlp_hidden.1")
        with pytest.raises(points.PointUnavailableError, match="mixture of experts"):
            points.expand_points(model, "mlp_hidden.*")
        assert not any(n.startswith("mlp_hidden") for n in points.point_names(model))
        assert _hooks_of(model) == before
    else:
        assert torch.equal(ret["mlp_hidden.1"].output, seen["mlp_hidden"])


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_site_identities(arch):
    """What a user computes from the sites: the block's MLP applied to mlp_in gives the MLP
    branch, the down projection applied to mlp_hidden too, the output projection applied to
    attn_z flattened gives the attention output before any post-norm; on sandwich-norm layouts
    the post-norms then give attn_out/mlp_out; without pre-norms the sites hold the residual
    stream's values; on parallel blocks attn_in and mlp_in agree where one norm feeds both."""
    model = build(arch)
    block = model.get_submodule(blocks_of(model))[1]
    o_proj, down = SITES[arch][1], SITES[arch][3]
    kinds = ["resid_pre", "attn_in", "attn_z", "attn_out", "mlp_in", "mlp_out"]
    kinds += [] if down is None else ["mlp_hidden"]
    kinds += [] if arch in PARALLEL or arch in SHARED_NORM | TWO_NORMS else ["resid_mid"]
    with torch.no_grad(), pyhook.TraceDict(model, [f"{k}.1" for k in kinds], clone=True) as ret:
        model(ids())
        v = {k: ret[f"{k}.1"].output for k in kinds}
        mlp_branch = _mlp_of(block, arch)(v["mlp_in"])
        attn_branch = block.get_submodule(o_proj)(v["attn_z"].flatten(-2))
        if down is not None:
            torch.testing.assert_close(block.get_submodule(down)(v["mlp_hidden"]), mlp_branch)
        if arch in SANDWICH:
            mlp_branch = block.post_feedforward_layernorm(mlp_branch)
            attn_branch = block.post_attention_layernorm(attn_branch)
    torch.testing.assert_close(mlp_branch, v["mlp_out"])
    torch.testing.assert_close(attn_branch, v["attn_out"])
    if arch in NO_PRE_NORM:
        assert torch.equal(v["attn_in"], v["resid_pre"])
        assert torch.equal(v["mlp_in"].reshape(v["resid_mid"].shape), v["resid_mid"])
    if arch in SHARED_NORM:
        assert torch.equal(v["attn_in"], v["mlp_in"])
        assert "same values" in points.architecture_of(model).sites_note
    if arch in TWO_NORMS:  # freshly initialised norms agree: make the MLP's norm differ
        other = copy.deepcopy(model)
        norm = {"gpt_neox": "post_attention_layernorm", "falcon_new": "ln_mlp"}[arch]
        with torch.no_grad():
            other.get_submodule(blocks_of(other))[1].get_submodule(norm).weight.add_(1.0)
            with pyhook.TraceDict(other, ["attn_in.1", "mlp_in.1"]) as ret2:
                other(ids())
        assert torch.equal(ret2["attn_in.1"].output, v["attn_in"])
        assert not torch.equal(ret2["attn_in.1"].output, ret2["mlp_in.1"].output)


def _delta(width: int, seed: int) -> torch.Tensor:
    return torch.randn(width, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("site", SITE_NAMES)
@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_edit_at_a_site_is_a_pre_hook_edit_of_that_module(arch, site):
    """Steering at a site equals a hand-written pre-hook edit of the module whose input it is:
    that module sees the edit and nothing else does (the skip connection, the other branch)."""
    model = build(arch)
    before = _hooks_of(model)
    block = model.get_submodule(blocks_of(model))[1]
    attn, o_proj, mlp, down, _ = SITES[arch]
    path = dict(zip(SITE_NAMES, (attn, o_proj, mlp, down)))[site]
    if path is None:
        pytest.skip(
            "mixture of experts: mlp_hidden is refused (test_sites_match_hand_written_pre_hooks)"
        )
    module = block.get_submodule(path)
    with torch.no_grad(), pyhook.Trace(model, f"{site}.1") as t:
        model(ids())
    shape = t.output.shape
    d = _delta(shape[-1] * (shape[-2] if site == "attn_z" else 1), 3).reshape(
        shape[-2:] if site == "attn_z" else shape[-1:]
    )

    def by_hand(_m, args, kwargs):
        if args:
            return (args[0] + d.reshape(-1), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"] + d.reshape(-1)}

    key = "last_hidden_state" if arch in ENCODERS else "logits"
    other = "mlp_in.1" if site.startswith("attn") else "attn_out.1"
    with torch.no_grad():
        with pyhook.TraceDict(model, [other, "resid_pre.1"]) as plain_ret:
            plain = model(ids())[key]
        handle = module.register_forward_pre_hook(by_hand, with_kwargs=True)
        try:
            expected = model(ids())[key]
        finally:
            handle.remove()
        with pyhook.TraceDict(
            model,
            [f"{site}.1", other, "resid_pre.1"],
            edit_output={f"{site}.1": lambda output: output + d},
        ) as ret:
            edited = model(ids())[key]
    assert torch.equal(edited, expected)
    assert not torch.allclose(edited, plain)
    assert torch.equal(ret["resid_pre.1"].output, plain_ret["resid_pre.1"].output)
    if not (
        site.startswith("attn") and arch not in PARALLEL and arch not in SHARED_NORM | TWO_NORMS
    ):
        # the other branch is untouched (sequential blocks: the MLP sees the attention's edit)
        assert torch.equal(ret[other].output, plain_ret[other].output)
    assert _hooks_of(model) == before


def test_edit_at_a_point_the_model_modifies_in_place_later():
    """Falcon adds the attention output into its MLP output in place (``mlp!``): an in-place
    edit there (an ablation) must reach the model, as on every other point (it was dropped),
    and a stored patch returned by the edit must not be changed by the model (it was: the
    attention output was added into it)."""
    model = build("falcon")
    d = _delta(H, 5)
    with torch.no_grad():
        with pyhook.Trace(model, "mlp_out.1", edit_output=lambda output: output + d):
            want = model(ids()).logits

        def in_place(output):
            output += d
            return output

        with pyhook.Trace(model, "mlp_out.1", edit_output=in_place) as t:
            got = model(ids()).logits
        assert torch.equal(got, want)
        kept = t.output.clone()
        patch = kept.clone()
        with pyhook.Trace(model, "mlp_out.1", edit_output=lambda output: patch):
            again = model(ids()).logits
    assert torch.equal(again, want)
    assert torch.equal(patch, kept)  # the model added the attention output into a copy


@pytest.mark.parametrize("arch", ["olmo2", "gemma2", "bert"])
def test_mlp_in_edit_misses_the_skip_connection_unlike_resid_mid(arch):
    """An edit at mlp_in reaches the MLP only; the same edit at resid_mid (written in place)
    reaches the skip connection too: the skip part of resid_post (resid_post - mlp_out) is
    unchanged by the first and changed by the second (sandwich, no-pre-norm and post-norm
    layouts, where the two read the same module or the same values)."""
    model = build(arch)
    d = _delta(H, 4)
    names = ["resid_post.1", "mlp_out.1"]

    def skip(ret):
        return ret["resid_post.1"].output - ret["mlp_out.1"].output

    with torch.no_grad():
        with pyhook.TraceDict(model, names, clone=True) as plain:
            model(ids())
        with (
            pyhook.Trace(model, "mlp_in.1", edit_output=lambda output: output + d),
            pyhook.TraceDict(model, names, clone=True) as at_in,
        ):
            model(ids())
        with (
            pyhook.Trace(model, "resid_mid.1", edit_output=lambda output: output + d),
            pyhook.TraceDict(model, names, clone=True) as at_mid,
        ):
            model(ids())
    assert not torch.equal(at_in["mlp_out.1"].output, plain["mlp_out.1"].output)
    if arch in POST_NORM:  # the block's norm follows the add: compare before it
        return
    torch.testing.assert_close(skip(at_in), skip(plain), rtol=0, atol=1e-6)
    assert not torch.allclose(skip(at_mid), skip(plain), atol=1e-3)


def test_site_names_globs_and_transformerlens_aliases():
    model = build("gpt2")
    pairs = [
        ("blocks.1.attn.hook_z", "attn_z.1"),
        ("blocks.0.mlp.hook_post", "mlp_hidden.0"),
    ]
    for alias, canon in pairs:
        assert points.resolve_point(model, alias) == points.resolve_point(model, canon)
    assert [n for n, _ in points.expand_points(model, "*.1")] == [
        "resid_pre.1",
        "attn_in.1",
        "attn_z.1",
        "attn_out.1",
        "resid_mid.1",
        "mlp_in.1",
        "mlp_hidden.1",
        "mlp_out.1",
        "resid_post.1",
    ]
    assert [n for n, _ in points.expand_points(model, "blocks.*.ln2.hook_normalized")] == [
        "blocks.0.ln2.hook_normalized",
        "blocks.1.ln2.hook_normalized",
    ]
    assert [n for n, _ in points.expand_points(model, "mlp_*.0")] == [
        "mlp_in.0",
        "mlp_hidden.0",
        "mlp_out.0",
    ]
    # TransformerLens' hook_mlp_in / hook_attn_in are the un-normalised residual stream, another
    # tensor than mlp_in / attn_in: not aliases
    for tl_other in ("blocks.1.hook_mlp_in", "blocks.1.hook_attn_in"):
        assert not points.is_point_name(tl_other)
        with pytest.raises(LookupError):
            pyhook.Trace(model, tl_other)


def test_capture_sites_rows():
    """capture stores attn_z as [tokens, heads, d_head] rows and the other sites as one row per
    token, equal to what TraceDict sees."""
    model = build("llama")
    names = ["attn_z.1", "mlp_in.1", "mlp_hidden.0"]
    with torch.no_grad(), capture(model, names, to="host") as rec:
        model(ids())
    with torch.no_grad(), pyhook.TraceDict(model, names) as ret:
        model(ids())
    assert rec["attn_z.1"].shape == (10, 2, H // 2)
    assert rec["mlp_hidden.0"].shape == (10, 32)
    for name in names:
        assert torch.equal(rec[name], ret[name].output.reshape(10, *ret[name].output.shape[2:]))


def test_attn_z_edit_of_the_wrong_shape_is_refused():
    model = build("gpt2")
    before = _hooks_of(model)
    with (
        pytest.raises(ValueError, match=r"\[\.\.\., heads, d_head\]"),
        torch.no_grad(),
        pyhook.Trace(model, "attn_z.1", edit_output=lambda output: output.flatten(-2)),
    ):
        model(ids())
    assert _hooks_of(model) == before


def test_register_architecture_checks_every_argument_naming_it():
    """mid / final / when / heads / a path's suffix were not checked: the mistake surfaced at
    the first trace as a raw AttributeError ('bool' object has no attribute 'endswith'), a
    ZeroDivisionError (heads=0) or a torch unflatten error; now refused by name, registering
    nothing."""
    base = dict(blocks="stack", attn="mix", mlp="ff", mid="norm2", attn_z="mix")
    bad = [
        (dict(mid=False), TypeError, "mid must be a dotted module path"),
        (dict(final=7), TypeError, "final must be a dotted module path"),
        (dict(when=["use_parallel_residual"]), TypeError, "when must be a condition"),
        (dict(heads=0), ValueError, "heads must be a positive number"),
        (dict(heads=-2), ValueError, "heads must be a positive number"),
        (dict(mid="norm2:inn"), ValueError, "mid: bad point path 'norm2:inn'"),
        (dict(attn="mix:outt"), ValueError, "attn: bad point path"),
    ]
    before = list(points._USER_ROWS)
    for kw, error, message in bad:
        with pytest.raises(error, match=message):
            points.register_architecture("NoSuchNet", **{**base, **kw})
    assert before == points._USER_ROWS


def test_register_architecture_sites_are_optional():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mix, self.ff = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            x = x + self.mix(x)
            return x + self.ff(x)

    class Bare(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = torch.nn.ModuleList([Block(), Block()])

        def forward(self, x):
            for b in self.stack:
                x = b(x)
            return x

    net = Bare()
    points.register_architecture("Bare", blocks="stack", attn="mix", mlp="ff", mid="ff")
    try:
        assert "mlp_in.0" not in points.point_names(net)
        with pytest.raises(
            points.PointUnavailableError, match=r"mlp_in=\.\.\. with register_architecture"
        ):
            pyhook.Trace(net, "mlp_in.0")
        points.register_architecture(
            "Bare", blocks="stack", attn="mix", mlp="ff", mid="ff", mlp_in="ff", attn_z="mix"
        )
        with pytest.raises(points.PointUnavailableError, match="heads=<number>"):
            pyhook.Trace(net, "attn_z.0")
        points.register_architecture(
            "Bare",
            blocks="stack",
            attn="mix",
            mlp="ff",
            mid="ff",
            mlp_in="ff",
            attn_z="mix",
            heads=2,
        )
        x = torch.randn(3, 4)
        with pyhook.TraceDict(net, ["mlp_in.1", "attn_z.0"]) as ret:
            net(x)
        assert ret["attn_z.0"].output.shape == (3, 2, 2)
        h = net.stack[0](x)
        torch.testing.assert_close(ret["mlp_in.1"].output, h + net.stack[1].mix(h))
    finally:
        points._USER_ROWS.clear()
        points._CACHE.clear()


def test_point_like_typos_suggest_points():
    """issue 23: 'resid_pots.1' suggested '', 'transformer', ...: a point-like name that is no
    module suggests point names."""
    model = build("gpt2")
    before = _hooks_of(model)
    for typo, expect in (
        ("resid_pots.1", "'resid_post.1'"),
        ("mlp_ot.*", "'mlp_out."),
        ("blocks.1.hook_resid_pots", "'blocks.1.hook_resid_post'"),
        ("atn_z.0", "'attn_z.0'"),
    ):
        with pytest.raises(LookupError) as info:
            pyhook.TraceDict(model, ["resid_post.0", typo])
        msg = str(info.value)
        assert expect in msg and "neither a standard point nor a module" in msg, msg
        assert "(the root)" not in msg
        with pytest.raises(LookupError, match="closest points"):
            capture(model, typo, to="host")
    assert _hooks_of(model) == before
    # module names and their typos are unchanged
    with pytest.raises(LookupError, match="closest names"):
        pyhook.Trace(model, "transformer.h.9")
    with pyhook.Trace(model, "transformer.h.1"):
        model(ids())


# -- module inputs: "<module>:in" ---------------------------------------------------------------
def _hand_inputs(model, paths):
    seen: dict[str, list[torch.Tensor]] = {p: [] for p in paths}
    handles = [
        model.get_submodule(p).register_forward_pre_hook(
            lambda m, a, k, p=p: seen[p].append(_arg0(a, k).clone()), with_kwargs=True
        )
        for p in paths
    ]
    return seen, handles


def test_module_inputs_in_every_tool():
    """'<module>:in' is the module's input wherever a module name is taken: Trace, TraceDict
    (globs too), capture, TruncatedModule, FlexModel; equal to a hand-written pre-hook."""
    model = build("gpt2")
    paths = ["transformer.h.0.mlp", "transformer.h.1.mlp"]
    seen, handles = _hand_inputs(model, paths)
    try:
        with torch.no_grad():
            with pyhook.Trace(model, "transformer.h.1.mlp:in") as t:
                model(ids())
            with pyhook.TraceDict(model, ["transformer.h.*.mlp:in", "resid_post.0"]) as ret:
                model(ids())
            with capture(model, "transformer.h.*.mlp:in", to="host") as rec:
                model(ids())
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(t.output, seen[paths[1]][0])
    assert list(ret) == ["transformer.h.0.mlp:in", "transformer.h.1.mlp:in", "resid_post.0"]
    assert rec.layers == ["transformer.h.0.mlp:in", "transformer.h.1.mlp:in"]
    for p in paths:
        assert torch.equal(ret[f"{p}:in"].output, seen[p][1])
        assert torch.equal(rec[f"{p}:in"], seen[p][2].reshape(10, H))
    # TruncatedModule stops at a module's input: the block's input is resid_pre.1
    with torch.no_grad():
        got = pyhook.TruncatedModule(model, "transformer.h.1:in")(ids())
        hs = model(ids(), output_hidden_states=True).hidden_states
    assert torch.equal(got, hs[1])
    # FlexModel's HookFunction takes it too
    out: dict = {}
    fm = pyhook.FlexModel(model, out)
    fm.register_forward_hook(pyhook.HookFunction("transformer.h.0.mlp:in"))
    try:
        with torch.no_grad():
            fm(ids())
    finally:
        fm.restore()
    assert torch.equal(out["transformer.h.0.mlp:in"][0], seen[paths[0]][0])


def test_module_input_by_keyword_and_its_edit_is_a_pre_hook_edit():
    """Llama's attention is called with hidden_states= (no positional argument); an edit at
    '<module>:in' equals a hand-written pre-hook edit and reaches that module only."""
    model = build("llama")
    name = "model.layers.1.self_attn"
    seen, handles = _hand_inputs(model, [name])
    d = _delta(H, 5)
    try:
        with torch.no_grad(), pyhook.Trace(model, f"{name}:in") as t:
            plain = model(ids()).logits
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(t.output, seen[name][0])

    def by_hand(_m, args, kwargs):
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"] + d}

    with torch.no_grad():
        handle = model.get_submodule(name).register_forward_pre_hook(by_hand, with_kwargs=True)
        try:
            expected = model(ids()).logits
        finally:
            handle.remove()
        with pyhook.TraceDict(
            model,
            [f"{name}:in", "resid_pre.1"],
            edit_output={f"{name}:in": lambda output: output + d},
        ) as ret:
            edited = model(ids()).logits
    assert torch.equal(edited, expected) and not torch.equal(edited, plain)
    # the block's input (the skip connection) is untouched
    assert torch.equal(
        ret["resid_pre.1"].output, model(ids(), output_hidden_states=True).hidden_states[1]
    )


def test_module_input_errors_name_the_layer_and_leave_no_hook():
    model = build("gpt2")
    before = _hooks_of(model)
    with pytest.raises(LookupError, match=r"'transformer\.h\.9\.mlp'.*closest names"):
        pyhook.TraceDict(model, ["resid_post.0", "transformer.h.9.mlp:in"])
    with pytest.raises(LookupError, match="matches no module"):
        capture(model, ["transformer.h.*", "transformer.zz*:in"], to="host")
    with pytest.raises(LookupError, match="is a standard point"):
        pyhook.Trace(model, "resid_post.1:in")
    assert _hooks_of(model) == before


# -- TransformerLens' names that hold another tensor than pyhook's points (issue 45 item 12) -----
def _norms_randomised(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """A copy of ``model`` whose norms have weights far from 1 and biases far from 0: with
    gamma=1, beta=0 a norm's output equals TransformerLens' hook_normalized, hiding the bug."""
    model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if "Norm" not in type(m).__name__:
                continue
            for name in ("weight", "bias"):
                p = getattr(m, name, None)
                if isinstance(p, torch.Tensor):
                    base = 1.0 if name == "weight" else 0.0
                    p.copy_(base + 0.7 * torch.randn(p.shape, generator=g))
    return model


def _hand_norm(module: torch.nn.Module, x: torch.Tensor):
    """(scale, normalized, the module's output from normalized) by hand, from transformers'
    norm classes: LayerNorm subtracts the mean, RMSNorm does not; Gemma's weight is 1 + w."""
    cls = type(module).__name__
    eps = getattr(module, "eps", None) or getattr(module, "variance_epsilon", None) or 1e-5
    x = x.double()
    if "RMSNorm" not in cls:
        x = x - x.mean(-1, keepdim=True)
    scale = torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    n = x / scale
    w = getattr(module, "weight", None)
    b = getattr(module, "bias", None)
    out = n
    if w is not None:
        out = out * ((1 + w.double()) if cls.startswith("Gemma") else w.double())
    if b is not None:
        out = out + b.double()
    return scale, n, out


def _norm_inputs(model, paths, run):
    """The input and output of each module in ``paths``, from plain torch hooks."""
    seen, handles = {}, []
    for path in paths:
        mod = model.get_submodule(path)
        handles.append(
            mod.register_forward_hook(
                lambda m, a, o, path=path: seen.__setitem__(path, (a[0].detach(), o.detach()))
            )
        )
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return seen


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_tl_norm_names_hold_the_values_before_the_norms_weights(arch):
    """blocks.L.ln1/ln2.hook_normalized, .hook_scale and ln_final.* are TransformerLens' values
    before the norm's weight and bias ((x - mean) / scale, or x / scale for RMSNorm), computed
    by hand from the norm's input; the hand-applied weight and bias give back attn_in / mlp_in /
    final (so the norm is the one feeding the branch). They differed by 1-3 before: the alias
    gave the norm's output."""
    model = _norms_randomised(build(arch))
    tl = points.point_names(model, tl=True)
    norm_names = [n for n in tl if n.endswith(("hook_normalized", "hook_scale"))]
    if not norm_names:
        pytest.skip(f"{arch}: no TransformerLens norm names (refused, see the next test)")
    resolved = {n: points.resolve_point(model, n) for n in norm_names}
    paths = sorted({p.module_name for p in resolved.values()})
    with torch.no_grad():
        seen = _norm_inputs(model, paths, lambda: model(ids()))
        with pyhook.TraceDict(model, norm_names + points.point_names(model)) as ret:
            model(ids())
    for name, p in resolved.items():
        x, out = seen[p.module_name]
        scale, n, affine = _hand_norm(p.module, x)
        torch.testing.assert_close(affine, out.double(), rtol=1e-4, atol=1e-4, msg=f"{arch} {name}")
        want = scale if name.endswith("scale") else n
        got = ret[name].output
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=f"{arch} {name}")
        if name.endswith("hook_normalized") and "Olmo" not in type(p.module).__name__:
            # tells the two apart: the norm's output is not TransformerLens' value
            assert (got.double() - out.double()).abs().max() > 0.1, (arch, name)
        canon = {"ln1": "attn_in", "ln2": "mlp_in"}.get(name.split(".")[-2], "final")
        layer = name.split(".")[1] if name.startswith("blocks.") else None
        cname = canon if layer is None else f"{canon}.{layer}"
        if cname in ret and name.endswith("hook_normalized"):
            torch.testing.assert_close(
                affine.to(ret[cname].output.dtype), ret[cname].output, rtol=1e-4, atol=1e-4
            )


def _const(value, output):
    return value


@pytest.mark.parametrize(
    "arch, norm",
    [("gpt2", "transformer.h.1.ln_2"), ("llama", "model.layers.1.post_attention_layernorm")],
)
def test_tl_norm_edits_reach_the_model_through_the_norms_weights(arch, norm):
    """An edit at ln2.hook_normalized / hook_scale changes the norm's output as TransformerLens'
    does (weight and bias applied to the edited value): the same logits as a plain torch hook
    replacing the norm's output with the hand-made one. GPT-2 (LayerNorm) and Llama (RMSNorm)."""
    model = _norms_randomised(build(arch))
    mod = model.get_submodule(norm)
    patch = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(3))
    new_scale = torch.rand(2, 5, 1, generator=torch.Generator().manual_seed(4)) + 0.5
    with torch.no_grad():
        seen = _norm_inputs(model, [norm], lambda: model(ids()))
        x = seen[norm][0]
        _, n, _ = _hand_norm(mod, x)
        centred = n * _hand_norm(mod, x)[0]

        def hand(value):
            w = mod.weight.double()
            b = getattr(mod, "bias", None)
            out = value.double() * w + (b.double() if b is not None else 0)
            return out.to(x.dtype)

        for name, tl_value, hand_out in (
            ("blocks.1.ln2.hook_normalized", patch, hand(patch)),
            ("blocks.1.ln2.hook_scale", new_scale, hand(centred / new_scale)),
        ):
            h = mod.register_forward_hook(lambda m, a, o, v=hand_out: v)
            try:
                want = model(ids()).logits
            finally:
                h.remove()
            with pyhook.Trace(model, name, edit_output=functools.partial(_const, tl_value)):
                got = model(ids()).logits
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{arch} {name}")
            assert not torch.allclose(got, model(ids()).logits, atol=1e-3)


def test_tl_hook_embed_is_the_token_embedding():
    """TransformerLens' hook_embed is W_E[tokens] alone (hook_pos_embed holds the position
    embeddings): on GPT-2 it is wte's output, not the sum entering block 0 (pyhook's embed)."""
    model = build("gpt2")
    with torch.no_grad(), pyhook.TraceDict(model, ["hook_embed", "embed"]) as ret:
        model(ids())
    torch.testing.assert_close(ret["hook_embed"].output, model.transformer.wte.weight[ids()])
    assert not torch.allclose(ret["hook_embed"].output, ret["embed"].output)
    llama = build("llama")  # no learned positions: the token embedding is what block 0 reads
    with torch.no_grad(), pyhook.TraceDict(llama, ["hook_embed", "embed"]) as ret:
        llama(ids())
    assert torch.equal(ret["hook_embed"].output, ret["embed"].output)


@pytest.mark.parametrize(
    "arch, name, match",
    [
        ("bert", "blocks.0.hook_resid_post", "before the block's last norm"),
        ("bert", "blocks.0.hook_resid_mid", "before the post-attention norm"),
        ("bert", "blocks.0.ln1.hook_normalized", "names no ln1 norm"),
        ("bert", "ln_final.hook_normalized", "no final norm"),
        ("distilbert", "blocks.*.hook_resid_post", "another tensor"),
        ("olmo2", "blocks.0.hook_attn_out", "before the post-attention norm"),
        ("olmo2", "blocks.1.ln2.hook_scale", "names no ln2 norm"),
        ("bloom", "hook_embed", "after the embedding norm"),
        ("opt", "blocks.0.mlp.hook_post", r"\[batch\*tokens"),
        ("gpt2", "blocks.0.hook_mlp_in", "only ln2 reads"),
        ("gpt2", "blocks.0.hook_attn_in", "hook_resid_pre"),
        ("gpt2", "blocks.0.attn.hook_pattern", "output_attentions"),
        ("gpt2", "hook_pos_embed", "wpe"),
    ],
)
def test_tl_names_that_hold_another_tensor_are_refused(arch, name, match):
    """A TransformerLens name whose tensor on this architecture is not TransformerLens' is
    refused with the reason (not silently mapped to pyhook's tensor), by every tool, with no
    hook left; it is not listed by point_names(tl=True)."""
    from _hygiene import hook_snapshot

    model = build(arch)
    before = hook_snapshot(model)
    with pytest.raises(LookupError, match=match):
        pyhook.TraceDict(model, ["resid_pre.0", name])
    with pytest.raises(LookupError, match=match):
        resolve_layers(model, [name])
    assert hook_snapshot(model) == before
    assert name not in points.point_names(model, tl=True)
