"""Capture during steered ``generate`` (issue 50 item 4): the stored rows are the steered
generation's, each prompt's specs are in the store's metadata; steering specs as data (job
file, command line); CAA's mean difference from a store and norm matching."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _models import all_hooks, word_tokenizer
from test_steering import _edit, _model, _positions, _reference, _vec

import pyhook
from pyhook.pipeline.generate import prompt_batches, run_generate
from pyhook.points import resolve_point

T = pytest.importorskip("transformers")

PROMPTS = [[5, 6, 7, 8, 9, 10], [8, 9], [1, 2, 3], [11, 12, 13, 14]]
NEW = 5


def _plain_rows(model, seq, n_prompt, specs, layer):
    """One forward of ``seq`` (no padding, no cache) with plain steering hooks at the specs'
    absolute positions, and a plain hook keeping ``layer``'s output."""
    handles, kept = [], {}
    for spec in specs:
        point = resolve_point(model, spec.point)
        where = _positions(spec, n_prompt, len(seq))

        def hook(_m, _a, out, spec=spec, where=where):
            x = out[0] if isinstance(out, tuple) else out
            y = x.clone()
            for p in where:
                y[:, p] = _edit(x[:, p], spec)
            return (y, *out[1:]) if isinstance(out, tuple) else y

        handles.append(point.module.register_forward_hook(hook))
    target = resolve_point(model, layer).module

    def keep(_m, _a, out):
        kept["x"] = (out[0] if isinstance(out, tuple) else out)[0].detach().clone()

    handles.append(target.register_forward_hook(keep))
    try:
        with torch.no_grad():
            model(torch.tensor([seq]))
    finally:
        for h in handles:
            h.remove()
    return kept["x"]


def test_run_generate_stores_the_steered_rows_and_each_prompts_specs(tmp_path):
    model = _model("gpt2")
    specs = [
        pyhook.Steer("resid_post.0", _vec(1), scale=3.0),
        None,
        [
            pyhook.Steer("resid_post.1", _vec(2), op="ablate", prompt=[-1], generated=(0, 2)),
            pyhook.Steer("resid_post.0", _vec(3), scale=-2.0, prompt=None),
        ],
        pyhook.Steer("attn_out.1", _vec(4), scale=2.5, prompt=[0]),
    ]
    out = tmp_path / "acts"
    with pyhook.capture(model, "resid_post.2", out=str(out)) as rec:
        run_generate(
            model,
            prompt_batches(PROMPTS, batch_size=2),  # examples 2, 3 in the second batch
            rec,
            max_new_tokens=NEW,
            steer=specs,
            pad_token_id=0,
            eos_token_id=None,
        )
    assert all_hooks(model) == 0
    reader = pyhook.open_capture(str(out))
    rows = reader.layer("resid_post.2").to_tensor()
    ri = reader.row_index
    note = reader.index["meta"]["steering"]
    assert note["examples"] == "each"
    for e, prompt in enumerate(PROMPTS):
        spec = specs[e]
        spec = [] if spec is None else [spec] if isinstance(spec, pyhook.Steer) else spec
        assert note["entries"][note["entry"][e]] == [s.describe() for s in spec]
        tokens, _ = _reference(model, prompt, spec, new=NEW)
        seq = list(prompt) + tokens[:-1]  # the last token is never run
        want = _plain_rows(model, seq, len(prompt), spec, "resid_post.2")
        mine = ri[:, 0] == e
        assert ri[mine, 1].tolist() == list(range(len(seq)))
        assert reader.tokens[mine].tolist() == seq
        torch.testing.assert_close(rows[mine], want.to(rows.dtype), rtol=1e-10, atol=1e-10)


def test_run_generate_refuses_a_bad_spec_before_generating(tmp_path):
    model = _model("gpt2")
    calls = []
    h = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pyhook.capture(model, "resid_post.2", out=str(tmp_path / "a")) as rec:
            with pytest.raises(pyhook.SteeringError, match="width 3"):
                run_generate(
                    model,
                    prompt_batches(PROMPTS),
                    rec,
                    max_new_tokens=2,
                    steer=[None, pyhook.Steer("resid_post.0", torch.ones(3))],
                )
            assert calls == []
    finally:
        h.remove()
    assert all_hooks(model) == 0


def test_mean_difference_from_a_store_against_plain_hooks(tmp_path):
    model = _model("llama")
    prompts = [[5, 6, 7, 8], [5, 9, 7], [5, 6, 10, 11, 8], [20, 21], [20, 24, 22], [2, 3, 4]]
    out = tmp_path / "acts"
    with torch.no_grad(), pyhook.capture(model, "resid_post.1", out=str(out)) as rec:
        for b in prompt_batches(prompts, batch_size=4):
            rec.annotate(b.input_ids, b.keep, b.examples)
            model(b.input_ids, attention_mask=b.attention_mask)
    block = model.model.layers[1]
    acts = []
    for p in prompts:
        seen = {}
        h = block.register_forward_hook(
            lambda _m, _a, o, seen=seen: seen.update(x=o[0] if isinstance(o, tuple) else o)
        )
        with torch.no_grad():
            model(torch.tensor([p]))
        h.remove()
        acts.append(seen["x"][0])
    pos, neg = [0, 1, 2], [3, 4]
    want_last = torch.stack([acts[i][-1] for i in pos]).mean(0) - torch.stack(
        [acts[i][-1] for i in neg]
    ).mean(0)
    want_all = torch.cat([acts[i] for i in pos]).mean(0) - torch.cat([acts[i] for i in neg]).mean(0)
    want_1 = torch.stack([acts[i][1] for i in pos]).mean(0) - torch.stack(
        [acts[i][1] for i in neg]
    ).mean(0)
    got_last = pyhook.mean_difference(str(out), "resid_post.1", pos, neg, position="last")
    got_all = pyhook.mean_difference(pyhook.open_capture(str(out)), "resid_post.1", pos, neg)
    got_1 = pyhook.mean_difference(str(out), "resid_post.1", pos, neg, position=1)
    torch.testing.assert_close(got_last.double(), want_last, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_all.double(), want_all, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_1.double(), want_1, rtol=1e-6, atol=1e-6)
    with pytest.raises(pyhook.SteeringError, match="negative"):
        pyhook.mean_difference(str(out), "resid_post.1", pos, [40])


def test_match_norm():
    rows = torch.randn(50, 16, generator=torch.Generator().manual_seed(0)) * 7
    v = _vec(3).float()
    m = pyhook.match_norm(v, rows)
    torch.testing.assert_close(m.norm(), rows.norm(dim=1).mean(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m / m.norm(), v / v.norm())
    with pytest.raises(pyhook.SteeringError, match=r"rows must be \[n, 16\]"):
        pyhook.match_norm(v, torch.ones(4, 8))


# -- steering as data: the job and the command ------------------------------------------------
DOCS = [
    "the cat sat on the mat and looked at the dog",
    "a dog ran in the park with a ball and a stick",
    "birds sing in the morning when the sun comes up",
    "the river runs past the old mill to the sea",
    "one two three four five six seven eight nine ten",
    "red green blue yellow black white orange purple",
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("steerjob")
    tok = word_tokenizer(DOCS)
    torch.manual_seed(0)
    cfg = T.GPT2Config(
        n_layer=2,
        n_embd=16,
        n_head=2,
        vocab_size=len(tok),
        n_positions=64,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    T.GPT2LMHeadModel(cfg).eval().save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    with open(root / "prompts.jsonl", "w") as f:
        for i, d in enumerate(DOCS):
            f.write(json.dumps({"text": " ".join(d.split()[: 2 + i % 3])}) + "\n")
    np.save(root / "v.npy", (np.arange(16) % 5 - 2).astype(np.float32))
    from safetensors.torch import save_file

    save_file({"happy": torch.linspace(-1, 1, 16), "sad": torch.ones(16)}, root / "v.safetensors")
    return root


def test_command_steer_flag_is_data(ckpt, tmp_path):
    from pyhook.cli import build_parser, job_from_args

    args = build_parser().parse_args(
        [
            "capture",
            "--generate",
            "3",
            "--steer",
            f"resid_post.0={ckpt / 'v.safetensors'}:happy*4",
            "--steer",
            f"resid_post.1={ckpt / 'v.npy'}",
        ]
    )
    job = job_from_args(args)
    assert job.steer == [
        {"point": "resid_post.0", "vector": f"{ckpt / 'v.safetensors'}:happy", "scale": 4.0},
        {"point": "resid_post.1", "vector": str(ckpt / "v.npy")},
    ]


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--steer", "resid_post.0=v.npy"], "--steer is an option of capture during generation"),
        (["--generate", "2", "--steer", "resid_post.0"], "expected POINT=FILE[:NAME][*SCALE]"),
    ],
)
def test_command_refuses_bad_steer_flags_in_one_line(flags, message, capsys):
    from pyhook.cli import main

    assert main(["capture", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err, err


def test_job_steers_like_run_generate_and_refuses_code(ckpt, tmp_path):
    spec = {"point": "resid_post.0", "vector": f"{ckpt / 'v.safetensors'}:happy", "scale": 6.0}
    opts = dict(
        model=str(ckpt / "model"),
        input=str(ckpt / "prompts.jsonl"),
        generate=3,
        layers=["resid_post.1"],
        batch_size=3,
        limit=4,
    )
    pyhook.CaptureJob(**opts, out=str(tmp_path / "job"), steer=[spec]).run()
    pyhook.CaptureJob(**opts, out=str(tmp_path / "plain")).run()
    steered = pyhook.open_capture(str(tmp_path / "job"))
    plain = pyhook.open_capture(str(tmp_path / "plain"))
    assert steered.index["settings"]["steer"] == [spec]
    assert steered.index["meta"]["steering"]["examples"] == "all"
    assert steered.index["meta"]["steering"]["specs"][0]["scale"] == 6.0
    # the same in Python: run_generate with the vector loaded by hand
    model = T.GPT2LMHeadModel.from_pretrained(ckpt / "model").eval()
    tok = T.AutoTokenizer.from_pretrained(ckpt / "model")
    from safetensors.torch import load_file

    vec = load_file(ckpt / "v.safetensors")["happy"]
    with open(ckpt / "prompts.jsonl") as f:
        texts = [json.loads(line)["text"] for line in f][:4]
    with pyhook.capture(model, "resid_post.1", out=str(tmp_path / "py")) as rec:
        run_generate(
            model,
            prompt_batches(texts, tokenizer=tok, batch_size=3),
            rec,
            max_new_tokens=3,
            tokenizer=tok,
            steer=pyhook.Steer("resid_post.0", vec, scale=6.0),
        )
    py = pyhook.open_capture(str(tmp_path / "py"))
    assert torch.equal(steered.tokens, py.tokens)
    torch.testing.assert_close(
        steered.layer("resid_post.1").to_tensor(), py.layer("resid_post.1").to_tensor()
    )
    assert not torch.equal(
        steered.layer("resid_post.1").to_tensor()[: len(plain.tokens)],
        plain.layer("resid_post.1").to_tensor()[: len(steered.tokens)],
    )
    # a vector is data: a file that holds code (a pickle) is refused, not run
    import pickle

    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"v": torch.ones(16), "x": print}, f)
    bad = {"point": "resid_post.0", "vector": f"{tmp_path / 'evil.pt'}:v"}
    with pytest.raises(ValueError, match="cannot be read"):
        pyhook.CaptureJob(**opts, out=str(tmp_path / "bad"), steer=[bad]).run()
