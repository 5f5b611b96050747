"""Steering on batched ``generate`` (issue 50): per-row specs at each row's own absolute
positions, under left padding and the KV cache, equal to each row alone.

The reference is independent of pyhook's hook layer: each row is generated alone (no padding,
no cache), recomputing the whole sequence every step with a plain ``register_forward_hook``
that edits the absolute positions the spec names (pyhook only names the module of a point).
"""

from __future__ import annotations

import sys

import pytest
import torch
from _models import all_hooks, randomise_norms

import pyhook
from pyhook.points import resolve_point

T = pytest.importorskip("transformers")

PROMPTS = [[5, 6, 7, 8, 9, 10], [8, 9], [1, 2, 3], [11, 12, 13, 14]]
NEW = 6


def _model(family: str):
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = T.GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=40, n_positions=64)
        m = T.GPT2LMHeadModel(cfg)
    elif family == "llama":
        cfg = T.LlamaConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=40,
        )
        m = T.LlamaForCausalLM(cfg)
    else:
        cfg = T.Qwen2Config(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=40,
        )
        m = T.Qwen2ForCausalLM(cfg)
    m.config.pad_token_id = 0
    m.generation_config.pad_token_id = 0
    return randomise_norms(m.double().eval())


def _left_pad(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
    am = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, am


def _vec(seed: int, d: int = 16) -> torch.Tensor:
    return torch.randn(d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _positions(spec, n_prompt: int, seq_len: int) -> list[int]:
    """The absolute positions a spec names in a sequence of ``seq_len`` tokens whose first
    ``n_prompt`` are the prompt (written from the issue's text)."""
    out = []
    if spec.prompt == "all":
        out += list(range(n_prompt))
    elif spec.prompt is not None:
        out += [i if i >= 0 else n_prompt + i for i in spec.prompt]
    if spec.generated == "all":
        out += list(range(n_prompt, seq_len))
    elif spec.generated is not None:
        start, stop = spec.generated
        out += [n_prompt + g for g in range(start, stop) if n_prompt + g < seq_len]
    return sorted(set(out))


def _edit(x, spec):
    v = spec.vector.to(x.dtype)
    if spec.op == "add":
        return x + spec.scale * v
    u = v / v.norm()
    proj = (x * u).sum(-1, keepdim=True)
    if spec.op == "ablate":
        return x + (-spec.scale * proj) * u
    if spec.op == "replace":
        return x + (spec.scale - proj) * u
    return x + (torch.clamp(proj, max=spec.scale) - proj) * u


def _reference(model, prompt, specs, new=NEW):
    """Greedy, one row, no cache: every step recomputes the whole sequence with plain hooks
    that edit the spec's absolute positions. Returns (tokens, [last logits of each step])."""
    seq = list(prompt)
    logits = []
    for _ in range(new):
        handles = []
        for spec in specs:
            point = resolve_point(model, spec.point)
            assert point.kind == "output"
            where = _positions(spec, len(prompt), len(seq))

            def hook(_m, _a, out, spec=spec, where=where):
                x = out[0] if isinstance(out, tuple) else out
                y = x.clone()
                for p in where:
                    y[:, p] = _edit(x[:, p], spec)
                return (y, *out[1:]) if isinstance(out, tuple) else y

            handles.append(point.module.register_forward_hook(hook))
        try:
            with torch.no_grad():
                out = model(torch.tensor([seq])).logits[0, -1]
        finally:
            for h in handles:
                h.remove()
        logits.append(out)
        seq.append(int(out.argmax()))
    return seq[len(prompt) :], logits


def _steered(model, prompts, specs, use_cache=True, new=NEW):
    ids, am = _left_pad(prompts)
    seen = []  # each step's last column of logits, float64, by a plain hook on the head
    h = model.get_output_embeddings().register_forward_hook(
        lambda _m, _a, out: seen.append(out[:, -1].clone())
    )
    try:
        with pyhook.steering(model, specs), torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=am,
                max_new_tokens=new,
                do_sample=False,
                use_cache=use_cache,
                pad_token_id=0,
                eos_token_id=None,
            )
    finally:
        h.remove()
    tokens = out[:, ids.shape[1] :]
    logits = torch.stack(seen, 1)  # [batch, steps, vocab]
    return tokens, logits


def _row_specs():
    """Different specs per row: ops, points, prompt indices, generated windows, one row none."""
    return [
        pyhook.Steer("resid_post.0", _vec(1), scale=3.0),
        [
            pyhook.Steer("resid_post.1", _vec(2), op="ablate", prompt=[-1], generated=(1, 3)),
            pyhook.Steer("attn_out.2", _vec(3), scale=-2.0, prompt=None, generated=(0, 2)),
        ],
        None,
        [
            pyhook.Steer("resid_post.0", _vec(4), scale=2.0, prompt=[0, -2], generated=(2, 5)),
            pyhook.Steer("resid_post.0", _vec(5), op="cap", scale=0.1),
            pyhook.Steer("resid_post.2", _vec(6), op="replace", scale=1.5, prompt=None),
        ],
    ]


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_per_row_steering_equals_each_row_alone(family, use_cache):
    model = _model(family)
    specs = _row_specs()
    tokens, logits = _steered(model, PROMPTS, specs, use_cache=use_cache)
    unsteered, _ = _steered(model, PROMPTS, None)
    for row, prompt in enumerate(PROMPTS):
        spec = specs[row]
        spec = [] if spec is None else [spec] if isinstance(spec, pyhook.Steer) else spec
        ref_tokens, ref_logits = _reference(model, prompt, spec)
        assert tokens[row].tolist() == ref_tokens, (family, row)
        torch.testing.assert_close(logits[row], torch.stack(ref_logits), rtol=1e-10, atol=1e-10)
    # the steering did something (rows with specs differ from the unsteered generation)
    assert not torch.equal(tokens[0], unsteered[0]) or not torch.equal(tokens[3], unsteered[3])
    assert all_hooks(model) == 0


def test_one_spec_for_all_rows_and_a_per_head_point():
    model = _model("gpt2")
    heads = torch.randn(2, 8, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    spec = pyhook.Steer("resid_pre.1", _vec(9), scale=2.0, prompt=[-1], generated=(0, 3))
    tokens, logits = _steered(model, PROMPTS, spec)
    # resid_pre.1 is block 1's input: the reference hooks block 0's output (the same tensor)
    alias = pyhook.Steer("resid_post.0", _vec(9), scale=2.0, prompt=[-1], generated=(0, 3))
    for row, prompt in enumerate(PROMPTS):
        ref_tokens, ref_logits = _reference(model, prompt, [alias])
        assert tokens[row].tolist() == ref_tokens
        torch.testing.assert_close(logits[row], torch.stack(ref_logits), rtol=1e-10, atol=1e-10)
    # attn_z (per head, [heads, d_head]) against a plain pre-hook on c_proj
    spec = pyhook.Steer("attn_z.1", heads, scale=1.5, prompt=None)
    tokens, _ = _steered(model, PROMPTS, spec)
    c_proj = model.transformer.h[1].attn.c_proj
    for row, prompt in enumerate(PROMPTS):
        seq = list(prompt)
        for _ in range(NEW):
            n = len(prompt)

            def pre(_m, args, n=n):
                x = args[0].clone()
                x[:, n:] = x[:, n:] + 1.5 * heads.reshape(-1)
                return (x,)

            h = c_proj.register_forward_pre_hook(pre)
            try:
                with torch.no_grad():
                    seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            finally:
                h.remove()
        assert tokens[row].tolist() == seq[len(prompt) :]


def test_scale_zero_is_byte_identical_to_unsteered():
    model = _model("llama")
    base_tokens, base_logits = _steered(model, PROMPTS, None)
    specs = [
        pyhook.Steer("resid_post.0", _vec(1), scale=0.0),
        pyhook.Steer("resid_post.1", _vec(2), op="ablate", scale=0.0),
        [pyhook.Steer("attn_out.0", _vec(3), scale=0.0)],
        None,
    ]
    tokens, logits = _steered(model, PROMPTS, specs)
    assert torch.equal(tokens, base_tokens)
    assert torch.equal(logits, base_logits)  # byte for byte


def test_probe_decides_per_row_like_a_two_pass_reference():
    model = _model("gpt2")
    direction = _vec(11)
    # each row's score on its unsteered prompt, by a plain hook (the first pass)
    block0 = model.transformer.h[0]
    scores = {"mean": [], "last": []}
    for prompt in PROMPTS:
        seen = {}
        h = block0.register_forward_hook(
            lambda _m, _a, out, seen=seen: seen.update(x=out[0] if isinstance(out, tuple) else out)
        )
        with torch.no_grad():
            model(torch.tensor([prompt]))
        h.remove()
        s = (seen["x"][0] * direction).sum(-1)
        scores["mean"].append(float(s.mean()))
        scores["last"].append(float(s[-1]))
    for reduce in ("mean", "last"):
        vals = sorted(scores[reduce])
        threshold = (vals[1] + vals[2]) / 2  # two rows above, two below
        probe = pyhook.Probe("resid_post.0", direction, threshold=threshold, reduce=reduce)
        steer = pyhook.Steer("resid_post.1", _vec(12), scale=4.0, when=probe)
        ids, am = _left_pad(PROMPTS)
        with pyhook.steering(model, steer) as st, torch.no_grad():
            out = model.generate(
                ids, attention_mask=am, max_new_tokens=NEW, do_sample=False, pad_token_id=0
            )
        decided = st.decisions()
        expected = [s > threshold for s in scores[reduce]]
        assert decided == expected and any(expected) and not all(expected)
        plain = pyhook.Steer("resid_post.1", _vec(12), scale=4.0)
        for row, prompt in enumerate(PROMPTS):
            ref_tokens, _ = _reference(model, prompt, [plain] if expected[row] else [])
            assert out[row, ids.shape[1] :].tolist() == ref_tokens, (reduce, row)


def test_user_forward_inside_the_block_is_steered_at_its_positions():
    """A plain forward (not generate) on a left-padded batch: prompt indices count real tokens."""
    model = _model("llama")
    spec = pyhook.Steer("resid_post.1", _vec(3), scale=5.0, prompt=[0, -1])
    ids, am = _left_pad(PROMPTS)
    with pyhook.steering(model, spec), torch.no_grad():
        got = model(ids, attention_mask=am).logits
    for row, prompt in enumerate(PROMPTS):
        _, ref = _reference(model, prompt, [spec], new=1)
        torch.testing.assert_close(got[row, -1], ref[0], rtol=1e-10, atol=1e-10)


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts calls that read tensor values on the host (a device synchronisation on a GPU)
    made by pyhook's steering and position code, per forward of the model."""

    NAMES = frozenset(
        {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "equal", "cpu"}
    )

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.NAMES:
            frame = sys._getframe(1)
            for _ in range(4):
                if frame is None:
                    break
                f = frame.f_code.co_filename
                if "pyhook" in f and f.endswith(("steering.py", "positions.py")):
                    self.reads += 1
                    break
                frame = frame.f_back
        return func(*args, **(kwargs or {}))


def test_conditions_read_nothing_on_the_host_per_step():
    model = _model("gpt2")
    probe = pyhook.Probe("resid_post.0", _vec(11), threshold=0.0)
    specs = [
        [
            pyhook.Steer("resid_post.1", _vec(r), scale=2.0, when=probe),
            pyhook.Steer("resid_post.2", _vec(r + 10), op="cap", scale=0.5, generated=(1, 4)),
        ]
        for r in range(len(PROMPTS))
    ]
    ids, am = _left_pad(PROMPTS)
    per_forward = []
    counter = _HostReads()
    h = model.get_output_embeddings().register_forward_hook(
        lambda *_: per_forward.append(counter.reads)
    )
    try:
        with pyhook.steering(model, specs), torch.no_grad(), counter:
            model.generate(ids, attention_mask=am, max_new_tokens=NEW, do_sample=False)
    finally:
        h.remove()
    assert len(per_forward) == NEW
    assert per_forward == [0] * NEW  # no prompt indices to check: not even in the prefill
    # with prompt indices, the prefill reads the prompt lengths once; the steps read nothing
    specs[0][1] = pyhook.Steer("resid_post.2", _vec(3), prompt=[-1])
    per_forward.clear()
    counter = _HostReads()
    h = model.get_output_embeddings().register_forward_hook(
        lambda *_: per_forward.append(counter.reads)
    )
    try:
        with pyhook.steering(model, specs), torch.no_grad(), counter:
            model.generate(ids, attention_mask=am, max_new_tokens=NEW, do_sample=False)
    finally:
        h.remove()
    assert per_forward == [1] * NEW


def test_a_manual_decode_loop_with_the_cache_is_steered_like_generate():
    """The user's own loop of model(...) calls with past_key_values: positions from the
    attention mask the model is called with, the prompt from the loop's first call."""
    model = _model("llama")
    specs = _row_specs()
    want, _ = _steered(model, PROMPTS, specs)
    ids, am = _left_pad(PROMPTS)
    got = []
    with pyhook.steering(model, specs), torch.no_grad():
        out = model(ids, attention_mask=am, use_cache=True)
        for _ in range(NEW):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            got.append(nxt)
            am = torch.cat([am, torch.ones_like(nxt)], 1)
            out = model(nxt, attention_mask=am, past_key_values=out.past_key_values)
    assert torch.equal(torch.cat(got, 1), want)


def test_observers_at_the_steered_point_see_the_steered_value():
    model = _model("gpt2")
    v = _vec(5)
    ids, am = _left_pad(PROMPTS)
    with torch.no_grad():
        with pyhook.Trace(model, "resid_post.0") as plain:
            model(ids, attention_mask=am)
        with pyhook.Trace(model, "resid_post.0") as tr, pyhook.steering(
            model, pyhook.Steer("resid_post.0", v, scale=2.0)
        ):
            model(ids, attention_mask=am)
    real = am.bool()
    torch.testing.assert_close(tr.output[real], plain.output[real] + 2.0 * v)
    assert torch.equal(tr.output[~real], plain.output[~real])  # padding untouched
