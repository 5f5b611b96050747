"""Two models, one store (issue 25 item 4): crosscoder / model-diffing captures.

Tiny random GPT-2 and LLaMA models (different widths) with one word-level tokenizer are saved
to tmp folders. The reference for every row is a hand-written forward hook on that model
alone, run over contexts packed here by hand (BOS doc EOS ..., cut into CONTEXT tokens).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest
import torch
from _models import all_hooks, word_tokenizer

pytest.importorskip("transformers")
import transformers as T

import pyhook
from pyhook.capture import capture
from pyhook.cli import main
from pyhook.pipeline.job import CaptureJob, JobError
from pyhook.pipeline.paired import (
    AgreeingTokenizer,
    Paired,
    TokenizerMismatchError,
    check_tokenizers,
)
from pyhook.store import CaptureDamagedError, open_capture, verify_capture

CONTEXT = 16
DOCS = [
    "once upon a time a miller lived by the river .",
    "the princess found a golden key in the grass .",
    "a fox ran over the hill and the king saw it .",
    "long ago the king gave half of his kingdom as a reward .",
    "the wolf slept by the fire and the bells rang for three days .",
    "the miller had three sons and a cat .",
] * 3


def _gpt2(vocab: int) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = T.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=4,
        vocab_size=vocab,
        n_positions=64,
        bos_token_id=1,
        eos_token_id=1,
    )
    return T.GPT2LMHeadModel(cfg).eval()


def _llama(vocab: int) -> torch.nn.Module:
    torch.manual_seed(1)
    cfg = T.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=48,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=1,
    )
    return T.LlamaForCausalLM(cfg).eval()


def _save(path, model, tok):
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """base: GPT-2 (width 32), chat: LLaMA (width 48), one tokenizer; the corpus file."""
    root = tmp_path_factory.mktemp("paired")
    tok = word_tokenizer(DOCS)
    base = _save(root / "base", _gpt2(len(tok)), tok)
    chat = _save(root / "chat", _llama(len(tok)), tok)
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(DOCS) + "\n")
    return {"base": base, "chat": chat, "corpus": str(corpus), "root": root, "tok": tok}


def _block(model, layer):
    return (
        model.transformer.h[layer] if hasattr(model, "transformer") else model.model.layers[layer]
    )


def _contexts(tok, docs=DOCS, n=CONTEXT):
    """Packed contexts, by hand: BOS doc EOS ... (GPT-2 layout: one token for both)."""
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    stream = []
    for d in docs:
        stream += [eot, *tok(d, add_special_tokens=False)["input_ids"]]
    # the source adds EOS only when it differs from BOS: one <|endoftext|> between documents
    ids = [stream[i : i + n] for i in range(0, len(stream) - n + 1, n)]
    return torch.tensor(ids), eot


def _hand_rows(path, layer, ids, keep):
    """The rows of block ``layer``'s output of the checkpoint at ``path``, by a plain hook."""
    model = T.AutoModelForCausalLM.from_pretrained(path).eval()
    got = []
    h = _block(model, layer).register_forward_hook(
        lambda m, a, o: got.append(o[0] if isinstance(o, tuple) else o)
    )
    try:
        with torch.no_grad():
            for i in range(0, len(ids), 4):
                model(input_ids=ids[i : i + 4])
    finally:
        h.remove()
    return torch.cat(got)[keep]


def _job_args(ckpts, out, *extra):
    return [
        "capture",
        "--model",
        f"base={ckpts['base']}",
        "--model",
        f"chat={ckpts['chat']}",
        "--input",
        ckpts["corpus"],
        "--context-size",
        str(CONTEXT),
        "--batch-size",
        "4",
        "--layers",
        "resid_post.1",
        "--out",
        str(out),
        "--quiet",
        *extra,
    ]


@pytest.fixture(scope="module")
def reference(ckpts):
    ids, eot = _contexts(ckpts["tok"])
    keep = ids != eot
    return {
        "ids": ids,
        "keep": keep,
        "base": _hand_rows(ckpts["base"], 1, ids, keep),
        "chat": _hand_rows(ckpts["chat"], 1, ids, keep),
    }


@pytest.fixture(scope="module")
def stored(ckpts, tmp_path_factory):
    out = tmp_path_factory.mktemp("paired-store") / "acts"
    assert main(_job_args(ckpts, out, "--shard-mb", "0.004")) == 0
    return out


# -- the rows -------------------------------------------------------------------------------------
def test_rows_of_each_model_equal_a_hand_written_hook_on_that_model(stored, reference):
    r = open_capture(stored)
    assert r.layers == ["base/resid_post.1", "chat/resid_post.1"]
    assert len(r.index["shards"]) > 2  # several shards, each holding both models' rows
    torch.testing.assert_close(r["base/resid_post.1"].to_tensor(), reference["base"])
    torch.testing.assert_close(r["chat/resid_post.1"].to_tensor(), reference["chat"])
    assert r["chat/resid_post.1"].shape[1] == 48 and r["base/resid_post.1"].shape[1] == 32
    # one token index for both: the token ids and (context, position) of every row
    assert torch.equal(r.tokens, reference["ids"][reference["keep"]])
    pos = reference["keep"].nonzero()
    assert torch.equal(r.row_index, pos)
    assert r.index["meta"]["models"]["chat"]["class"] == "LlamaForCausalLM"


def test_per_model_statistics(stored, reference):
    r = open_capture(stored)
    for name in ("base", "chat"):
        s = r.stats(f"{name}/resid_post.1")
        var, mean = torch.var_mean(reference[name].double(), 0, correction=0)
        assert int(s["count"]) == len(reference[name])
        torch.testing.assert_close(s["mean"], mean)
        torch.testing.assert_close(s["var"], var)


def test_dataset_yields_both_models_rows_of_the_same_tokens_under_one_permutation(
    stored, reference
):
    r = open_capture(stored)
    ds = r.dataset(
        ["base/resid_post.1", "chat/resid_post.1"],
        batch_size=7,
        seed=3,
        tokens=True,
        with_index=True,
    )
    seen = []
    for batch in ds:
        idx = batch["index"]
        seen.append(idx)
        torch.testing.assert_close(batch["base/resid_post.1"], reference["base"][idx])
        torch.testing.assert_close(batch["chat/resid_post.1"], reference["chat"][idx])
        assert torch.equal(batch["tokens"], reference["ids"][reference["keep"]][idx])
    order = torch.cat(seen)
    assert sorted(order.tolist()) == list(range(len(reference["base"])))
    assert not torch.equal(order, torch.arange(len(order)))  # shuffled


def test_python_capture_of_paired_models_equals_hooks_on_each_model_alone(tmp_path):
    """capture(Paired(...)): every forward runs both models; layers named, or taken from both;
    a standard point, a module name and a module input each resolved in its own model."""
    base, chat = _gpt2(40), _llama(40)
    pair = Paired(base=base, chat=chat)
    xs = [
        torch.randint(0, 40, (3, 9), generator=torch.Generator().manual_seed(i)) for i in range(4)
    ]
    want = {"base": [], "mlp": [], "chat": [], "chat_in": []}
    hs = [
        base.transformer.h[0].register_forward_hook(
            lambda m, a, o: want["base"].append(o[0] if isinstance(o, tuple) else o)
        ),
        base.transformer.h[1].mlp.register_forward_hook(lambda m, a, o: want["mlp"].append(o)),
        chat.model.layers[0].register_forward_hook(
            lambda m, a, o: want["chat"].append(o[0] if isinstance(o, tuple) else o)
        ),
        chat.model.layers[1].mlp.register_forward_pre_hook(
            lambda m, a: want["chat_in"].append(a[0])
        ),
    ]
    with torch.no_grad():
        for x in xs:
            base(input_ids=x)
            chat(input_ids=x)
    for h in hs:
        h.remove()
    layers = ["resid_post.0", "base/transformer.h.1.mlp", "chat/model.layers.1.mlp:in"]
    with torch.no_grad(), capture(pair, layers, out=str(tmp_path / "acts")) as rec:
        for x in xs:
            assert pair(input_ids=x) is not None  # {name: output}
    assert all_hooks(pair) == 0
    r = open_capture(rec.out)
    assert r.layers == [
        "base/resid_post.0",
        "base/transformer.h.1.mlp",
        "chat/resid_post.0",
        "chat/model.layers.1.mlp:in",
    ]
    flat = lambda ts: torch.cat([t.reshape(-1, t.shape[-1]) for t in ts])  # noqa: E731
    torch.testing.assert_close(r["base/resid_post.0"].to_tensor(), flat(want["base"]))
    torch.testing.assert_close(r["base/transformer.h.1.mlp"].to_tensor(), flat(want["mlp"]))
    torch.testing.assert_close(r["chat/resid_post.0"].to_tensor(), flat(want["chat"]))
    torch.testing.assert_close(r["chat/model.layers.1.mlp:in"].to_tensor(), flat(want["chat_in"]))
    assert torch.equal(r.tokens, torch.cat([x.reshape(-1) for x in xs]))


# -- bad input ------------------------------------------------------------------------------------
def _run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "pyhook", *args],
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),
        timeout=300,
    )


@pytest.mark.parametrize(
    "models, message",
    [
        (["base=./a", "base=./b"], "--model: the name 'base' is given twice"),
        (["a/b=./x", "chat=./y"], "a model's name cannot contain '/'"),
        (["./a", "chat=./b"], "--model './a' has no name but 'chat=./b' has one"),
        (["base=./a"], "--model names 1 model(s) ('base')"),
        (["_x=./a", "chat=./b"], "starting with a letter or digit"),
    ],
)
def test_bad_model_spellings_exit_2_with_one_line_and_write_nothing(models, message, tmp_path):
    out = tmp_path / "acts"
    args = [a for m in models for a in ("--model", m)]
    p = _run_cli("capture", *args, "--out", str(out))
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert not out.exists()


def test_an_unnamed_model_given_again_overrides_as_before():
    from pyhook.cli import parse_arguments

    assert parse_arguments(["capture", "--model", "./a", "--model", "./b"]).job.model == "./b"
    job = parse_arguments(["capture", "--model", "base=./a", "--model", "chat=./b"]).job
    assert job.model == {"base": "./a", "chat": "./b"}


def test_bad_models_in_python_are_named():
    with pytest.raises(JobError, match="the model's name|a model's name cannot contain '/'"):
        CaptureJob(model={"a/b": "x", "chat": "y"})
    with pytest.raises(JobError, match=r"model names 1 model\(s\)"):
        CaptureJob(model={"base": "x"})
    with pytest.raises(TypeError, match="'chat' must be a checkpoint folder"):
        CaptureJob(model={"base": "x", "chat": 3})
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="at least two named models"):
        Paired(base=a)
    with pytest.raises(ValueError, match="same module object"):
        Paired(base=a, chat=a)
    with pytest.raises(ValueError, match="cannot contain '/'"):
        Paired({"x/y": a, "chat": b})
    with pytest.raises(ValueError, match="'forward' cannot name a model"):
        Paired({"forward": a, "chat": b})
    with pytest.raises(ValueError, match="'keep_outputs' cannot name a model"):
        Paired(keep_outputs=a, chat=b)
    assert Paired(models=a, chat=b).names == ["models", "chat"]  # any free name, even this one
    with pytest.raises(ValueError, match="given twice"):
        Paired({"base": a}, base=b)


def test_a_layer_naming_no_model_or_missing_in_one_model_leaves_no_hook(tmp_path):
    base, chat = _gpt2(40), _llama(40)
    pair = Paired(base=base, chat=chat)
    with pytest.raises(LookupError, match="'other' is not one of base, chat"):
        capture(pair, ["other/resid_post.0"], out=str(tmp_path / "a"))
    with pytest.raises(LookupError, match="model 'chat'"):
        capture(pair, ["transformer.h.0"], out=str(tmp_path / "b"))  # GPT-2's name only
    assert all_hooks(pair) == 0
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


class _Steered(torch.nn.Module):
    """``model`` with a vector added to block 0's output: a second model that holds the first
    (model diffing against a steered copy), sharing every module with it."""

    def __init__(self, model):
        super().__init__()
        self.m = model
        self.v = torch.nn.Parameter(torch.randn(32, generator=torch.Generator().manual_seed(5)))
        self.head = torch.nn.Linear(32, 3)

    def _add(self, _m, _a, o):
        return (o[0] + self.v, *o[1:]) if isinstance(o, tuple) else o + self.v

    def forward(self, input_ids):
        h = self.m.transformer.h[0].register_forward_hook(self._add)
        try:
            out = self.m.transformer(input_ids=input_ids).last_hidden_state
        finally:
            h.remove()
        return self.head(out)


def test_a_layer_of_a_module_both_models_hold_is_refused_naming_it(tmp_path):
    # The hook of base/transformer.h.1 also ran in chat's forward (which runs base's blocks):
    # the last call was kept, so base's rows were chat's, silently.
    base = _gpt2(40)
    chat = _Steered(base)
    pair = Paired(base=base, chat=chat)
    x = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(0))
    for layers in (
        ["base/transformer.h.1"],
        ["resid_post.0", "chat/head"],
        [base.transformer.h[1]],
    ):
        with pytest.raises(
            ValueError, match=r"also a module of model 'chat' \('m\.transformer\.h\."
        ) as e:
            capture(pair, layers, out=str(tmp_path / "acts"))
        assert "layer 'base/" in str(e.value)
        assert all_hooks(pair) == 0
        assert not (tmp_path / "acts").exists()
    # a layer only one of them holds: its rows, as a hand-written hook on it gives them
    want = []
    h = chat.head.register_forward_hook(lambda m, a, o: want.append(o))
    with torch.no_grad():
        chat(x)
    h.remove()
    with torch.no_grad(), capture(pair, ["chat/head"]) as rec:
        pair(x)
    torch.testing.assert_close(rec["chat/head"], want[0].reshape(-1, 3))
    assert all_hooks(pair) == 0


# -- tokenizers -----------------------------------------------------------------------------------
def _variant(tok, *, pre=None, added=None, swap=None, eos="<|endoftext|>"):
    """A tokenizer like ``tok``: another pre-tokenizer, an added special token, two words'
    ids swapped, or another EOS token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = tok.get_vocab()
    if swap:
        a, b = swap
        vocab[a], vocab[b] = vocab[b], vocab[a]
    t = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre or pre_tokenizers.WhitespaceSplit()
    fast = T.PreTrainedTokenizerFast(
        tokenizer_object=t,
        unk_token="[UNK]",
        bos_token="<|endoftext|>",
        eos_token=eos,
        pad_token="<|endoftext|>",
    )
    if added:
        fast.add_special_tokens({"additional_special_tokens": [added]})
    return fast


def _checkpoint_with(ckpts, name, tok):
    """The chat model saved again with tokenizer ``tok``."""
    path = ckpts["root"] / name
    if not path.exists():
        shutil.copytree(ckpts["chat"], path)
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (path / f).exists():
                (path / f).unlink()
        tok.save_pretrained(path)
    return str(path)


def test_tokenizers_that_split_the_corpus_differently_are_refused_before_any_forward(
    ckpts, tmp_path
):
    from tokenizers import pre_tokenizers

    # the same vocabulary, but punctuation split off: "river ." agrees, "river." would not
    tok = _variant(ckpts["tok"], pre=pre_tokenizers.Whitespace())
    other = _checkpoint_with(ckpts, "chat-split", tok)
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(DOCS[:5] + ["the king."] + DOCS[5:]) + "\n")
    out = tmp_path / "acts"
    p = _run_cli(
        "capture",
        "--model",
        f"base={ckpts['base']}",
        "--model",
        f"chat={other}",
        "--input",
        str(corpus),
        "--context-size",
        str(CONTEXT),
        "--out",
        str(out),
    )
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "tokenizers of 'base' and 'chat' give different ids for the text 'the king.'" in lines[0]
    assert not out.exists()


def test_tokenizers_with_another_vocabulary_are_refused(ckpts, tmp_path):
    shuffled = _variant(ckpts["tok"], swap=("king", "fox"))
    other = _checkpoint_with(ckpts, "chat-vocab", shuffled)
    out = tmp_path / "acts"
    code = main(_job_args({**ckpts, "chat": other}, out))
    assert code == 2
    assert not out.exists()
    a = ckpts["tok"]
    with pytest.raises(TokenizerMismatchError, match=r"token id \d+ is '(king|fox)' in 'base'"):
        check_tokenizers({"base": a, "chat": shuffled})


def test_a_model_with_fewer_token_ids_than_the_corpus_uses_is_named(ckpts, tmp_path, capsys):
    # The corpus's ids are checked against the smallest vocabulary of the models: the message
    # says whose it is (it said "the model's", with two models).
    tok = ckpts["tok"]
    small = _save(ckpts["root"] / "chat-small-vocab", _llama(len(tok) - 8), tok)
    out = tmp_path / "acts"
    assert main(_job_args({**ckpts, "chat": small}, out)) == 2
    err = capsys.readouterr().err
    assert f"vocabulary size {len(tok) - 8:,} (model 'chat''s, the smallest of the models')" in err
    assert not out.exists()


def test_tokenizers_that_differ_in_files_but_agree_on_the_corpus_are_accepted(
    ckpts, tmp_path, reference
):
    # a chat tokenizer with one more special token (as chat templates add): not the same
    # tokenizer, but the same ids on this corpus, checked text by text
    tok = _variant(ckpts["tok"], added="<|im_start|>")
    assert check_tokenizers({"base": ckpts["tok"], "chat": tok}) is False
    other = _checkpoint_with(ckpts, "chat-added", tok)
    out = tmp_path / "acts"
    assert main(_job_args({**ckpts, "chat": other}, out)) == 0
    r = open_capture(out)
    torch.testing.assert_close(r["chat/resid_post.1"].to_tensor(), reference["chat"])


def test_a_tokenizer_flag_no_model_would_use_is_refused(ckpts, tmp_path, capsys, reference):
    """--tokenizer is for a model saved without one: when every model has its own, it would
    be ignored, so it is refused (one line, nothing written)."""
    out = tmp_path / "acts"
    assert main([*_job_args(ckpts, out), "--tokenizer", ckpts["base"]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tokenizer" in err[0], err
    assert "every model here has its own (base, chat)" in err[0], err
    assert not out.exists()
    # the control: a model saved without a tokenizer takes it, and the rows are chat's
    bare = tmp_path / "chat-bare"
    shutil.copytree(ckpts["chat"], bare)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (bare / f).unlink(missing_ok=True)
    args = _job_args({**ckpts, "chat": str(bare)}, out)
    assert main([*args, "--tokenizer", ckpts["base"]]) == 0
    torch.testing.assert_close(
        open_capture(out)["chat/resid_post.1"].to_tensor(), reference["chat"]
    )


def test_a_chat_model_with_its_own_eos_is_fed_the_first_models_special_tokens(ckpts, tmp_path):
    """A base model and its chat model whose EOS ids differ (Llama 3's and Qwen 2.5's do) get
    the same ids, with the first model's BOS and EOS; a special id another model lacks is
    refused, naming it."""
    base_tok = _variant(ckpts["tok"], added="<|eot|>")
    chat_tok = _variant(ckpts["tok"], added="<|eot|>", eos="<|eot|>")
    eot = chat_tok.convert_tokens_to_ids("<|eot|>")
    assert chat_tok.eos_token_id == eot != base_tok.eos_token_id
    assert check_tokenizers({"base": base_tok, "chat": chat_tok}) is False
    with pytest.raises(TokenizerMismatchError, match=f"'chat''s id {eot} is not a token of 'base'"):
        check_tokenizers({"base": ckpts["tok"], "chat": chat_tok})
    root = tmp_path / "ckpt"
    paths = {
        "base": _save(root / "base", _gpt2(len(base_tok)), base_tok),
        "chat": _save(root / "chat", _llama(len(chat_tok)), chat_tok),
    }
    out = tmp_path / "acts"
    assert main(_job_args({**ckpts, **paths}, out)) == 0
    ids, first_eos = _contexts(base_tok)  # packed by hand with base's <|endoftext|>
    keep = ids != first_eos
    r = open_capture(out)
    for name in ("base", "chat"):
        torch.testing.assert_close(
            r[f"{name}/resid_post.1"].to_tensor(), _hand_rows(paths[name], 1, ids, keep)
        )


def test_agreeing_tokenizer_stops_at_the_first_text_that_differs(ckpts):
    from tokenizers import pre_tokenizers

    both = AgreeingTokenizer(
        {"base": ckpts["tok"], "chat": _variant(ckpts["tok"], pre=pre_tokenizers.Whitespace())}
    )
    assert both(["the king ."])["input_ids"] == ckpts["tok"](["the king ."])["input_ids"]
    assert both.eos_token == "<|endoftext|>"  # the first tokenizer's, for everything else
    with pytest.raises(TokenizerMismatchError, match="'the fox.'") as e:
        both(["the king .", "the fox.", "a fox."], add_special_tokens=False)
    assert "token 1 is '[UNK]'" in str(e.value)


# -- resume, config, ranks ------------------------------------------------------------------------
def test_resume_continues_to_the_one_shot_store(ckpts, stored, tmp_path, reference):
    out = tmp_path / "acts"
    assert main([*_job_args(ckpts, out, "--shard-mb", "0.004"), "--limit", "2"]) == 0
    assert open_capture(out).examples == 2
    assert main(_job_args(ckpts, out, "--shard-mb", "0.004")) == 0
    r, one = open_capture(out, verify=True), open_capture(stored)
    assert r.examples == one.examples
    for n in one.layers:
        assert torch.equal(r[n].to_tensor(), one[n].to_tensor())
    assert torch.equal(r.row_index, one.row_index)
    # another second model is another capture: refused, naming what differs
    with pytest.raises(JobError, match="already holds a different capture.*`model`|model.*now"):
        CaptureJob(
            model={"base": ckpts["base"], "chat": ckpts["base"]},
            input=ckpts["corpus"],
            context_size=CONTEXT,
            layers=["resid_post.1"],
            out=str(out),
        ).plan()


def test_config_file_equals_the_flags(ckpts, stored, tmp_path):
    cfg = tmp_path / "job.json"
    cfg.write_text(
        json.dumps(
            {
                "model": {"base": ckpts["base"], "chat": ckpts["chat"]},
                "input": ckpts["corpus"],
                "context_size": CONTEXT,
                "batch_size": 4,
                "layers": ["resid_post.1"],
                "shard_mb": 0.004,
            }
        )
    )
    out = tmp_path / "acts"
    assert main(["capture", "--config", str(cfg), "--out", str(out), "--quiet"]) == 0
    shards = sorted(p.name for p in stored.iterdir() if p.suffix == ".safetensors")
    assert shards and shards == sorted(p.name for p in out.iterdir() if p.suffix == ".safetensors")
    for name in shards:
        assert (out / name).read_bytes() == (stored / name).read_bytes()
    job = CaptureJob.from_file(cfg)
    assert job.model == {"base": ckpts["base"], "chat": ckpts["chat"]}


def _cli_rank(rank, world, port, args):
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    code = main(args)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    assert code == 0


@pytest.mark.distributed
def test_two_gloo_ranks_write_one_paired_store(ckpts, tmp_path, reference):
    import torch.multiprocessing as mp

    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "acts"
    mp.spawn(_cli_rank, args=(2, port, _job_args(ckpts, out)), nprocs=2, join=True)
    r = open_capture(out, verify=True)
    assert r.index["ranks"] == [0, 1]
    assert sorted(r.index["meta"]["models"]) == ["base", "chat"]
    # rank r captured contexts r, r + 2, ...: put the rows back in context order
    order = torch.argsort(r.row_index[:, 0] * 1000 + r.row_index[:, 1])
    assert torch.equal(r.row_index[order], reference["keep"].nonzero())
    for name in ("base", "chat"):  # single-threaded ranks: float sums in another order
        torch.testing.assert_close(
            r[f"{name}/resid_post.1"].to_tensor()[order], reference[name], rtol=1e-5, atol=1e-6
        )
    assert torch.equal(r.tokens[order], reference["ids"][reference["keep"]])


# -- damage ---------------------------------------------------------------------------------------
def test_a_swapped_or_damaged_shard_is_found_never_read_as_misaligned_rows(stored, tmp_path):
    out = tmp_path / "acts"
    shutil.copytree(stored, out)
    shards = sorted(p for p in out.iterdir() if p.suffix == ".safetensors")
    a, b = shards[0], shards[1]
    ta, tb = a.read_bytes(), b.read_bytes()
    a.write_bytes(tb)
    b.write_bytes(ta)
    problems, _ = verify_capture(out)
    assert any(a.name in p for p in problems) and any(b.name in p for p in problems), problems
    assert main(["verify", str(out)]) == 2
    with pytest.raises(CaptureDamagedError, match=a.name):
        open_capture(out)
    # the same bytes under the right size: the header names the shard it is
    b.write_bytes(ta[: len(tb)] if len(ta) >= len(tb) else ta + b"\0" * (len(tb) - len(ta)))
    problems, _ = verify_capture(out)
    assert any(b.name in p and "swapped" in p for p in problems), problems
    # one model's rows changed inside a shard: its checksum says so
    a.write_bytes(ta)
    b.write_bytes(tb)
    assert verify_capture(out)[0] == []
    from pyhook.pipeline.format import _read_header

    header, data_start = _read_header(str(shards[1]))
    start = data_start + header["chat/resid_post.1"]["data_offsets"][0]
    data = bytearray(shards[1].read_bytes())
    data[start : start + 4] = b"\x00\x00\x80\x7f"  # one float of the chat model's rows
    shards[1].write_bytes(bytes(data))
    problems, _ = verify_capture(out)
    assert any(shards[1].name in p and "checksum" in p for p in problems), problems
    with pytest.raises(CaptureDamagedError, match="checksum"):
        open_capture(out, verify=True)


# -- object storage -------------------------------------------------------------------------------
def test_a_paired_store_on_s3_equals_the_local_one(ckpts, stored):
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from test_remote import s3_server

    with s3_server():
        url = "s3://pyhook/paired"
        assert main(_job_args(ckpts, url, "--shard-mb", "0.004")) == 0
        r, one = open_capture(url, verify=True), open_capture(stored)
        assert r.layers == one.layers
        for n in one.layers:
            assert torch.equal(r[n].to_tensor(), one[n].to_tensor())
        assert torch.equal(r.row_index, one.row_index)
        assert verify_capture(url) == ([], [])
        assert main(["verify", url]) == 0
        r.close()


def test_paired_is_exported():
    assert pyhook.Paired is Paired and "Paired" in pyhook.__all__


def test_a_difference_past_the_plans_sample_stops_the_run_before_that_batch(ckpts, tmp_path):
    """A corpus larger than the plan's sample (2,000 documents): the text the tokenizers split
    differently comes late; the run stops at its batch, naming it, and what was stored before
    it is a readable store of agreeing texts."""
    from tokenizers import pre_tokenizers

    tok = _variant(ckpts["tok"], pre=pre_tokenizers.Whitespace())
    other = _checkpoint_with(ckpts, "chat-split", tok)
    from pyhook.source import open_source

    # The plan samples 2,000 documents across the corpus (seeded: which positions it draws
    # depends only on how many documents there are); put the differing text at a position it
    # does not draw, late in the corpus.
    numbered = tmp_path / "numbered.jsonl"
    numbered.write_text("".join(f'{{"input_ids": [{i}]}}\n' for i in range(2600)))
    drawn = {v[0] for v in open_source(str(numbered), context_size=CONTEXT)._spread_sample(2000)[0]}
    late = max(i for i in range(2000, 2600) if i not in drawn)
    docs = [DOCS[i % len(DOCS)] for i in range(2600)]
    docs[late] = "the king."
    corpus = tmp_path / "big.txt"
    corpus.write_text("\n".join(docs) + "\n")
    out = tmp_path / "acts"
    args = [
        "capture",
        "--model",
        f"base={ckpts['base']}",
        "--model",
        f"chat={other}",
        "--input",
        str(corpus),
        "--context-size",
        str(CONTEXT),
        "--batch-size",
        "64",
        "--layers",
        "resid_post.0",
        "--out",
        str(out),
        "--quiet",
        "--shard-mb",
        "0.5",
    ]
    p = _run_cli(*args)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "for the text 'the king.'" in lines[0], lines
    assert verify_capture(out)[0] == []  # the batches before it: a store, intact
    r = open_capture(out)
    total = len(_contexts(ckpts["tok"], docs[:late])[0])
    assert 0 < r.examples <= total  # only contexts of the texts before the one that differs


def test_job_stream_hands_out_both_models_rows_of_the_same_tokens(ckpts, stored):
    r = open_capture(stored)
    at = {tuple(ix): i for i, ix in enumerate(r.row_index.tolist())}
    base, chat = r["base/resid_post.1"].to_tensor(), r["chat/resid_post.1"].to_tensor()
    job = CaptureJob(
        model={"base": ckpts["base"], "chat": ckpts["chat"]},
        input=ckpts["corpus"],
        context_size=CONTEXT,
        batch_size=4,
        layers=["resid_post.1"],
    )
    n = 0
    with job.stream(batch_size=32, buffer_rows=128, seed=1) as s:
        for batch in s:
            rows = torch.tensor([at[tuple(ix)] for ix in batch["row_index"].tolist()])
            torch.testing.assert_close(batch["base/resid_post.1"], base[rows])
            torch.testing.assert_close(batch["chat/resid_post.1"], chat[rows])
            n += len(rows)
    assert n == len(base)
