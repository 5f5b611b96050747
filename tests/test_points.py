"""Standard hook points (pyhook.points) on real transformers architectures, built from configs.

References are independent of the mapping: HF's ``output_hidden_states``, hand-written hooks on
the modules each architecture's source computes its branches with (the table HAND below, written
from the transformers source, not from pyhook's mapping), and the residual-stream algebra
(``resid_mid = resid_pre + attn_out``, ``resid_post = resid_mid + mlp_out``).
"""

from __future__ import annotations

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
ENCODERS = {"bert", "roberta", "electra", "distilbert"}
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
DECODERS = [a for a in ARCHS if a not in ENCODERS]


@functools.cache
def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = CONFIGS[name]()
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
    assert [n for n, _ in exp(model, "*.1")] == [
        "resid_pre.1",
        "attn_out.1",
        "resid_mid.1",
        "mlp_out.1",
        "resid_post.1",
    ]
    assert [n for n, _ in exp(model, "blocks.*.hook_resid_post")] == [
        "blocks.0.hook_resid_post",
        "blocks.1.hook_resid_post",
    ]
    pairs = [
        ("blocks.1.hook_resid_pre", "resid_pre.1"),
        ("blocks.-1.hook_mlp_out", "mlp_out.1"),
        ("hook_embed", "embed"),
        ("ln_final.hook_normalized", "final"),
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
    # module names win over point spellings, module globs are unchanged
    assert not points.is_point_name("transformer.h.*", model)
    assert [n for n, _ in resolve_layers(model, "transformer.h.*")] == [
        "transformer.h.0",
        "transformer.h.1",
    ]


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
