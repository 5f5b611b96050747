"""The command with real corpora (parquet, jsonl, save_to_disk, pre-tokenised), packed contexts,
the estimate and --dry-run, model loading (cache names, --tokenizer, --model-class), and what a new
user tried (issue 16, item 5). References: packing and hooks written out by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from _models import save_gpt2_lm, word_tokenizer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from pyhook import runner  # noqa: E402
from pyhook.cli import main  # noqa: E402
from pyhook.store import open_capture  # noqa: E402

DOCS = [f"the fox number {i} ran {' '.join(['far'] * (i % 5))} away ." for i in range(60)]


def _tokenizer():
    return word_tokenizer(DOCS)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A GPT-2 LM checkpoint (random weights, 64 positions) with its tokenizer, a copy saved
    without a tokenizer (as model.save_pretrained leaves it), and a parquet corpus."""
    root = tmp_path_factory.mktemp("ckpt")
    tok = _tokenizer()
    model = save_gpt2_lm(root / "model", tok)
    model.save_pretrained(root / "bare")
    pq.write_table(pa.table({"text": DOCS, "n": list(range(len(DOCS)))}), root / "c.parquet")
    return root


def hand_reference(root, n, layers):
    """Pack DOCS by hand (<|endoftext|> before each), run the model, keep non-special rows."""
    from transformers import AutoTokenizer, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(root / "model")
    model = GPT2LMHeadModel.from_pretrained(root / "model").eval()
    stream = []
    for t in DOCS:
        stream += [tok.bos_token_id, *tok(t, add_special_tokens=False)["input_ids"]]
    ids = torch.tensor(stream[: len(stream) // n * n]).reshape(-1, n)
    got = {}
    hooks = [
        model.get_submodule(name).register_forward_hook(
            lambda m, a, o, name=name: got.__setitem__(name, o[0] if isinstance(o, tuple) else o)
        )
        for name in layers
    ]
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    keep = ids != tok.bos_token_id
    return ids, {name: got[name][keep] for name in layers}


def cap(root, *extra):
    """pyhook capture of the parquet corpus, layers named (the default --layers may change)."""
    args = ["capture", "--model", str(root / "model"), "--input", str(root / "c.parquet")]
    return [*args, "--layers", *LAYERS, *extra]


LAYERS = ["transformer.h.0", "transformer.h.1"]


def test_packed_parquet_capture_matches_hand_packing_and_resumes(ckpt, tmp_path, capsys):
    out = str(tmp_path / "acts")
    ids, want = hand_reference(ckpt, 16, LAYERS)
    base = cap(
        ckpt, "--context-size", "16", "--batch-size", "3", "--out", out, "--shard-mb", "0.000001"
    )
    assert main([*base, "--limit", "4"]) == 0
    assert main(base) == 0  # resumes at context 4
    err = capsys.readouterr().err
    assert "already stored" in err and "plan: " in err
    r = open_capture(out)
    assert r.layers == LAYERS and r.examples == len(ids)
    for name in LAYERS:
        torch.testing.assert_close(r[name].to_tensor(), want[name])
    assert r.settings["context_size"] == 16 and r.settings["exclude_special_tokens"] is True


def test_other_kinds_give_the_same_capture(ckpt, tmp_path):
    import datasets

    _, want = hand_reference(ckpt, 16, ["transformer.h.1"])
    with open(tmp_path / "c.jsonl", "w") as f:
        for t in DOCS:
            f.write(json.dumps({"body": t}) + "\n")
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "saved"))
    tok = _tokenizer()
    pre = [[tok.bos_token_id, *tok(t, add_special_tokens=False)["input_ids"]] for t in DOCS]
    pq.write_table(pa.table({"input_ids": pre}), tmp_path / "ids.parquet")
    for src, extra in [
        (tmp_path / "c.jsonl", ["--text-column", "body"]),
        (tmp_path / "saved", []),
        (tmp_path / "ids.parquet", []),  # pre-tokenised: used as is
    ]:
        out = str(tmp_path / f"out-{src.name}")
        args = ["capture", "--model", str(ckpt / "model"), "--input", str(src), *extra]
        assert (
            main(
                [
                    *args,
                    "--context-size",
                    "16",
                    "--layers",
                    "transformer.h.1",
                    "--out",
                    out,
                    "--quiet",
                ]
            )
            == 0
        )
        got = open_capture(out)["transformer.h.1"].to_tensor()
        torch.testing.assert_close(got, want["transformer.h.1"]), src


def test_dry_run_and_estimate_match_the_capture(ckpt, tmp_path, capsys):
    out = tmp_path / "acts"
    assert main(cap(ckpt, "--context-size", "16", "--out", str(out), "--dry-run")) == 0
    plan = capsys.readouterr().out
    assert not out.exists()  # nothing written
    assert "transformer.h.1" in plan and "row shape" in plan and "shard(s)" in plan
    ids, want = hand_reference(ckpt, 16, LAYERS)
    rows = len(want["transformer.h.0"])
    assert f"{len(ids):,} contexts of 16 tokens ({rows:,} rows kept, counted)" in plan
    assert f"{rows * 32 * 4 / 1e6:,.1f}" in plan  # MB per layer: rows x 32 x float32


def test_refuses_when_the_estimate_does_not_fit(ckpt, tmp_path, capsys, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10_000, 9_000, 1_000))
    out = str(tmp_path / "acts")
    assert main(cap(ckpt, "--context-size", "16", "--out", out, "--quiet")) == 2
    err = capsys.readouterr().err
    assert "the capture needs about" in err and "1.0 kB free" in err and "--force" in err
    assert not os.path.exists(os.path.join(out, "index.json"))
    assert main(cap(ckpt, "--context-size", "16", "--out", out, "--quiet", "--force")) == 0


@pytest.fixture
def no_weights(monkeypatch):
    """Loading the weights fails the test: the check must come before it."""

    def boom(*a, **k):
        raise AssertionError("the model's weights were loaded")

    monkeypatch.setattr(runner, "load_weights", boom)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--text-column", "body"], "its columns are: text, n"),
        (["--text-column", "n"], "holds int64, not text"),
        (["--context-size", "100000"], "is above the 64 positions"),
        (["--max-length", "100"], "--max-length 100 is above the 64 positions"),
        (["--device", "meta"], "--device 'meta' holds no data"),
        (["--context-size", "16", "--max-length", "8"], "drop one of them"),
        (["--out", "/proc/pyhook-x"], "cannot write to --out '/proc/pyhook-x'"),
    ],
)
def test_bad_input_is_one_line_before_the_weights(
    ckpt, tmp_path, capsys, no_weights, extra, message
):
    args = cap(ckpt, "--out", str(tmp_path / "o"), *extra)
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Errno" not in err[0], err


def test_empty_and_short_corpora(ckpt, tmp_path, capsys, no_weights):
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "short.txt").write_text("the fox ran\n")
    for name, message in [
        ("empty.txt", "holds no non-empty line"),
        ("short.txt", "fewer than one context"),
    ]:
        args = ["capture", "--model", str(ckpt / "model"), "--input", str(tmp_path / name)]
        assert main([*args, "--context-size", "16", "--out", str(tmp_path / "o")]) == 2
        assert message in capsys.readouterr().err


def test_checkpoint_without_tokenizer(ckpt, tmp_path, capsys):
    bare = str(ckpt / "bare")
    for cmd in (
        ["layers", "--model", bare],
        ["capture", "--model", bare, "--out", str(tmp_path / "o")],
    ):
        assert main(cmd) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "has no tokenizer files" in err[0] and "--tokenizer" in err[0], err
    out = str(tmp_path / "o")
    args = [
        "capture",
        "--model",
        bare,
        "--tokenizer",
        str(ckpt / "model"),
        "--input",
        str(ckpt / "c.parquet"),
    ]
    assert main([*args, "--context-size", "16", "--layers", *LAYERS, "--out", out, "--quiet"]) == 0
    _, want = hand_reference(ckpt, 16, LAYERS)
    torch.testing.assert_close(
        open_capture(out)["transformer.h.1"].to_tensor(), want["transformer.h.1"]
    )


def test_model_from_the_hub_cache_and_model_class(ckpt, tmp_path, monkeypatch, capsys):
    # A hub cache laid out as huggingface_hub writes it; nothing is downloaded.
    cache = tmp_path / "hub"
    snap = cache / "models--acme--tiny-gpt2" / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    for f in os.listdir(ckpt / "model"):
        os.symlink(ckpt / "model" / f, snap / f)
    (cache / "models--acme--tiny-gpt2" / "refs").mkdir()
    (cache / "models--acme--tiny-gpt2" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    assert runner.resolve_model_path("acme/tiny-gpt2") == str(snap)
    loaded = runner.load_model("acme/tiny-gpt2", model_class="AutoModel")
    assert type(loaded.model).__name__ == "GPT2Model"  # not the config's GPT2LMHeadModel
    assert main(["layers", "--model", "acme/tiny-gpt2", "--model-class", "AutoModel"]) == 0
    assert "GPT2Model" in capsys.readouterr().out
    with pytest.raises(runner.RunnerError, match="nor a model in the local Hugging Face cache"):
        runner.resolve_model_path("acme/not-cached")
    with pytest.raises(runner.RunnerError, match="is not a transformers model class"):
        runner.load_model("acme/tiny-gpt2", model_class="NoSuchModel")


def test_a_layer_that_never_runs_is_an_error(ckpt, tmp_path, capsys):
    assert main(cap(ckpt, "--layers", "transformer.h", "--out", str(tmp_path / "o"))) == 2
    err = capsys.readouterr().err
    assert "'transformer.h' never run(s)" in err and "'transformer.h.*'" in err
    assert not (tmp_path / "o" / "index.json").exists()


def test_existing_capture_checks_come_before_the_model(ckpt, tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "acts")
    assert main(cap(ckpt, "--batch-size", "8", "--out", out, "--quiet")) == 0  # 60 examples
    capsys.readouterr()

    def boom(*a, **k):
        raise AssertionError("the model's weights were loaded")

    monkeypatch.setattr(runner, "load_weights", boom)
    assert main(cap(ckpt, "--limit", "20", "--out", out)) == 0
    err = capsys.readouterr().err
    assert "already holds 60 examples, more than the 20 --limit asks for" in err
    assert main(cap(ckpt, "--dtype", "float16", "--context-size", "16", "--out", out)) == 2
    err = capsys.readouterr().err
    assert "already holds a different capture (60 examples)" in err
    assert "--dtype float16 now, the model's when stored" in err
    assert "--context-size 16 now, none: one example per row when stored" in err
    assert "!=" not in err and "None" not in err and "--overwrite" in err


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["capture", "--limt", "64"], "--limt (did you mean --limit?)"),
        (["--limt", "64"], "--limt (did you mean --limit?)"),  # no command: capture's options
        (["capture", "--quantise", "fp8"], "--quantise (did you mean --quantize?)"),
    ],
)
def test_a_typo_is_one_line_with_a_suggestion(capsys, argv, hint):
    """Issue 53, item 9: not argparse's whole usage block before the suggestion."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "usage:" not in err, err
    assert err.startswith("pyhook: error: unrecognized argument(s) of pyhook capture: ")
    assert hint in err and "(pyhook capture --help lists the options)" in err


def _ranks(n: int, argv: list[str], tmp_path) -> list[subprocess.CompletedProcess]:
    """``python -m pyhook ARGV`` as ``n`` ranks of one machine (torchrun's environment)."""
    procs = []
    for r in range(n):
        env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(n)}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1", LOCAL_WORLD_SIZE=str(n))
        procs.append(
            subprocess.Popen(
                [sys.executable, "-X", "importtime", "-m", "pyhook", *argv],
                env=env,
                cwd=tmp_path,
                stderr=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    return [subprocess.CompletedProcess(p.args, p.wait(60), *p.communicate()) for p in procs]


def test_a_tp_size_the_ranks_cannot_take_is_said_once_before_torch_loads(tmp_path):
    """Issue 53, item 9: every rank parses the same flags; rank 0 alone says what is wrong,
    before torch is imported (so before any process-group work), and every rank exits 2."""
    done = _ranks(3, ["capture", "--tp-size", "2", "--limit", "4", "--out", "acts"], tmp_path)
    said = []
    for r, p in enumerate(done):
        lines = [ln for ln in p.stderr.splitlines() if not ln.startswith("import time:")]
        imported = [ln.rsplit("|", 1)[-1].strip() for ln in p.stderr.splitlines()]
        assert p.returncode == 2, (r, p.stderr[-2000:])
        assert "torch" not in imported, f"rank {r} imported torch before refusing --tp-size"
        said.append(lines)
    assert said[1] == said[2] == [], said
    assert said[0] == [
        "pyhook: error: --tp-size 2: tp_size 2 does not divide the 3 ranks (environment): each "
        "tensor-parallel group is tp_size ranks in a row, so the number of ranks must be a "
        "multiple of tp_size"
    ]


@pytest.mark.distributed
def test_under_torchrun_the_tp_size_error_is_the_first_rank_s_alone(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "-m", "pyhook",
         "capture", "--tp-size", "2", "--limit", "4", "--out", str(tmp_path / "acts")],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert run.returncode != 0
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith("pyhook: error:")]
    assert len(errors) == 1 and "--tp-size 2: tp_size 2 does not divide the 3 ranks" in errors[0]
    # torchrun's report names rank 0's exit as the failure (the others were stopped)
    root = run.stderr.split("Root Cause", 1)[-1]
    assert "rank      : 0 (local_rank: 0)" in root and "exitcode  : 2" in root, run.stderr


def test_inspect_on_a_file(tmp_path, capsys):
    (tmp_path / "f.txt").write_text("x")
    assert main(["inspect", str(tmp_path / "f.txt")]) == 2
    assert "is a file; pyhook inspect reads a capture directory" in capsys.readouterr().err


def _run(code, cwd=None):
    return subprocess.run(
        ["bash", "-c", code],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "default"},
    )


def test_broken_pipe_is_quiet():
    exe = f"{sys.executable} -I -m pyhook"
    res = _run(f"{exe} info | head -1; {exe} layers | head -2")
    assert res.stderr == "", res.stderr
    assert len(res.stdout.splitlines()) == 3


def test_import_from_the_source_tree_says_so_once():
    import glob

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if glob.glob(os.path.join(root, "pyhook", "_C*")):
        pytest.skip("the native core was built in place in this checkout")
    res = _run(f"{sys.executable} -c 'import pyhook, pyhook.capture'", cwd=root)
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("imported from the source tree") == 1, res.stderr
    assert "python -I" in res.stderr and "pip install" in res.stderr


def _rank_worker(rank: int, world: int, port: int, args: list[str]) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    code = main(args)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    assert code == 0


def test_two_ranks_share_packed_contexts(ckpt, tmp_path):
    """torchrun with packed contexts: rank r takes contexts r, r + 2, ...; the store holds rank
    0's rows, then rank 1's, each equal to the hand-packed reference of those contexts."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "two")
    args = cap(ckpt, "--context-size", "16", "--layers", "transformer.h.1", "--batch-size", "4")
    mp.spawn(_rank_worker, args=(2, port, [*args, "--out", out, "--quiet"]), nprocs=2, join=True)
    ids, _ = hand_reference(ckpt, 16, [])
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(ckpt / "model").eval()
    got = []
    h = model.transformer.h[1].register_forward_hook(
        lambda m, a, o: got.append(o[0] if isinstance(o, tuple) else o)
    )
    with torch.no_grad():
        model(input_ids=ids)
    h.remove()
    hidden = got[0]
    keep = ids != ids[0, 0]  # the BOS id
    want = torch.cat([hidden[r::2][keep[r::2]] for r in range(2)])
    r = open_capture(out)
    assert r.index["ranks"] == [0, 1] and r.examples == len(ids)
    torch.testing.assert_close(r["transformer.h.1"].to_tensor(), want, rtol=1e-4, atol=1e-5)
    # token bookkeeping across ranks: each row's (context, position) names its token in the
    # hand-packed contexts, and text(context) is that context's text, whichever rank stored it
    tokens, index = r.tokens, r.row_index
    assert torch.equal(tokens, torch.cat([ids[k::2][keep[k::2]] for k in range(2)]))
    assert torch.equal(ids[index[:, 0], index[:, 1]], tokens)
    assert sorted(set(index[:, 0].tolist())) == list(range(len(ids)))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt / "model")
    for c in (0, 1, len(ids) - 1):
        assert r.text(c) == tok.decode(ids[c].tolist(), skip_special_tokens=False)


# -- issue 23, item 5: changed corpora, records that differ, ids, encoder-decoders --------------
def _datasetdict(path, texts):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts})}).save_to_disk(
        str(path)
    )


def test_a_changed_datasetdict_corpus_is_not_resumed(ckpt, tmp_path, capsys):
    """A DatasetDict folder rewritten with other documents is another corpus: the capture of the
    old one is not continued over it (the fingerprint reads the split's arrow files)."""
    corpus, out = tmp_path / "dd", str(tmp_path / "acts")
    _datasetdict(corpus, DOCS[:30])
    base = [
        "capture", "--model", str(ckpt / "model"), "--input", str(corpus), "--context-size", "16",
        "--layers", "transformer.h.1", "--out", out, "--quiet",
    ]  # fmt: skip
    assert main([*base, "--limit", "2"]) == 0
    before = open_capture(out)["transformer.h.1"].to_tensor()
    _datasetdict(corpus, DOCS[30:])
    capsys.readouterr()
    assert main(base) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds a different capture (2 examples)" in err[0], err
    assert "--input (its contents)" in err[0] and "--overwrite" in err[0], err
    r = open_capture(out)
    assert r.examples == 2 and torch.equal(r["transformer.h.1"].to_tensor(), before)
    _datasetdict(corpus, DOCS[:30])  # the same documents again: resumes
    assert main(base) == 0 and open_capture(out).examples > 2


def _later_record_cases(tmp, vocab):
    """(corpus path, extra flags, what the one line must say) for corpora that go wrong after
    their first record or file."""
    tmp.mkdir()
    cases = []

    def jsonl(name, column, bad, extra, *message):
        path = tmp / name
        with open(path, "w") as f:
            for n in range(1, 41):
                good = DOCS[n] if column == "text" else [3, 4, 5, 6]
                f.write(json.dumps({column: bad if n == 3 else good}) + "\n")
        cases.append(
            (path, extra, [str(path), "record 3 (line 3)", f"column {column!r}", *message])
        )

    jsonl("int.jsonl", "text", 5, [], "holds an int (5), not text")
    jsonl("dict.jsonl", "text", {"t": "x"}, ["--context-size", "16"], "holds a dict, not text")
    jsonl("pair.jsonl", "text", ["the fox", "ran"], [], "sentence pair")
    jsonl("float.jsonl", "input_ids", [3, 4.0], [], "a list with a float (4.0)")
    jsonl("big.jsonl", "input_ids", [3, vocab], ["--context-size", "16"],
          f"token id {vocab} is not below the vocabulary size {vocab}")  # fmt: skip
    for name, write, message in [
        ("truncated", lambda p: p.write_bytes((tmp / "t.parquet").read_bytes()[:-50]), "as parquet"),
        ("int64", lambda p: pq.write_table(pa.table({"text": [1, 2]}), p), "holds int64"),
    ]:  # fmt: skip
        pq.write_table(pa.table({"text": DOCS}), tmp / "t.parquet")
        folder = tmp / name
        folder.mkdir()
        pq.write_table(pa.table({"text": DOCS}), folder / "a.parquet")
        write(folder / "b.parquet")
        cases.append((folder, [], [str(folder), "file 'b.parquet'", message]))
    pq.write_table(pa.table({"input_ids": [[3, 4]] * 5 + [[3, vocab + 7]]}), tmp / "ids.parquet")
    cases.append(
        (tmp / "ids.parquet", [], ["ids.parquet", "record 6, column 'input_ids'", f"{vocab + 7}"])
    )
    # text that another model's tokenizer turns into ids this model does not have
    for extra in ([], ["--context-size", "16"]):
        cases.append(
            (
                ckpt_corpus(tmp),
                ["--tokenizer", "minilm", *extra],
                [
                    "the tokenizer's BOS token id 101 is not below the vocabulary size",
                    "(--tokenizer)",
                ],
            )
        )
    return cases


def ckpt_corpus(tmp):
    (tmp / "c.txt").write_text("\n".join(DOCS) + "\n")
    return tmp / "c.txt"


def test_corpus_errors_are_one_line_before_the_weights_and_write_nothing(
    ckpt, tmp_path, capsys, no_weights
):
    vocab = len(_tokenizer())
    for n, (path, extra, message) in enumerate(_later_record_cases(tmp_path / "c", vocab)):
        out = tmp_path / f"o{n}"
        args = ["capture", "--model", str(ckpt / "model"), "--input", str(path), *extra]
        assert main([*args, "--layers", *LAYERS, "--out", str(out)]) == 2, path
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("pyhook: error: "), err
        assert all(m in err[0] for m in message), (message, err)
        assert not out.exists() or not os.listdir(out), os.listdir(out)


def test_a_bad_record_found_during_the_capture_is_one_line(ckpt, tmp_path, capsys):
    """A record of another type found while capturing (here: written after the plan read the
    corpus, which it reads whole to estimate packed contexts): the command still ends with one
    line naming it (exit 2), no traceback, no hook left, and the contexts before it stay
    stored (resumable, as after Ctrl-C)."""
    from _hygiene import hook_snapshot

    from pyhook.pipeline.job import CaptureJob

    path = tmp_path / "late.jsonl"
    with open(path, "w") as f:
        for n in range(1, 3001):
            f.write(json.dumps({"text": DOCS[n % 60]}) + "\n")
    models = []
    load = runner.load_weights
    plan = CaptureJob.plan

    def keep_model(*a, **k):
        models.append(load(*a, **k))
        return models[-1]

    def plan_then_damage(job, **options):
        got = plan(job, **options)
        with open(path, "a") as f:
            f.write(json.dumps({"text": {"oops": 1}}) + "\n")
        return got

    out = str(tmp_path / "o")
    args = ["capture", "--model", str(ckpt / "model"), "--input", str(path)]
    extra = ["--context-size", "64", "--batch-size", "256", "--layers", "transformer.h.1"]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(runner, "load_weights", keep_model)
        m.setattr(CaptureJob, "plan", plan_then_damage)
        assert main([*args, *extra, "--out", out, "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"{path}', record 3,001 (line 3,001), column 'text': holds a dict" in err[0], err
    assert models and not any(
        hooks for hooks in hook_snapshot(models[0]).values() if isinstance(hooks, list)
    )
    assert open_capture(out).examples > 0


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    """A tiny T5 (encoder-decoder) checkpoint with a tokenizer, as save_pretrained leaves it."""
    from transformers import T5Config, T5ForConditionalGeneration

    root = tmp_path_factory.mktemp("t5")
    tok = _tokenizer()
    torch.manual_seed(0)
    cfg = T5Config(
        vocab_size=len(tok), d_model=16, d_ff=32, d_kv=8, num_layers=2, num_heads=2,
        decoder_start_token_id=tok.pad_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    T5ForConditionalGeneration(cfg).eval().save_pretrained(root)
    tok.save_pretrained(root)
    return root


def test_an_encoder_decoder_is_refused_with_the_encoder_class(t5, tmp_path, capsys, monkeypatch):
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "c.parquet")
    args = ["capture", "--model", str(t5), "--input", str(tmp_path / "c.parquet")]
    out = tmp_path / "o"
    with monkeypatch.context() as m:
        m.setattr(runner, "load_weights", lambda *a, **k: pytest.fail("weights loaded"))
        for extra in ([], ["--model-class", "AutoModel"]):
            assert main([*args, *extra, "--out", str(out)]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and str(t5) in err[0], err
            assert "is an encoder-decoder model" in err[0], err
            assert "--model-class T5EncoderModel" in err[0], err
            assert not out.exists() or not os.listdir(out)
    with pytest.raises(runner.RunnerError, match=r"encoder-decoder.*T5EncoderModel"):
        runner.load_model(str(t5))
    # the class it suggests captures the encoder: rows equal a hand-written hook's
    layers = ["encoder.block.0", "encoder.block.1"]
    extra = ["--model-class", "T5EncoderModel", "--context-size", "16", "--layers", *layers]
    assert main([*args, *extra, "--out", str(out), "--quiet"]) == 0
    from transformers import T5EncoderModel

    tok = _tokenizer()
    model = T5EncoderModel.from_pretrained(t5).eval()
    stream = [
        t for d in DOCS for t in (tok.bos_token_id, *tok(d, add_special_tokens=False)["input_ids"])
    ]
    ids = torch.tensor(stream[: len(stream) // 16 * 16]).reshape(-1, 16)
    got = {}
    hooks = [
        model.get_submodule(n).register_forward_hook(
            lambda m, a, o, n=n: got.__setitem__(n, o[0] if isinstance(o, tuple) else o)
        )
        for n in layers
    ]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    for h in hooks:
        h.remove()
    r = open_capture(str(out))
    for n in layers:
        torch.testing.assert_close(r[n].to_tensor(), got[n][ids != tok.bos_token_id])


def test_the_capture_docs_show_the_names_the_default_command_stores(tmp_path):
    """docs/capture.md shows the default command's layer names: a reader indexed with them
    finds the layers (issue 23, item 7: it showed encoder.layer.*, a KeyError)."""
    import re

    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "capture.md")) as f:
        doc = f.read()
    section = doc.split("## The command", 1)[1].split("### Your corpus", 1)[0]
    shown = set(re.findall(r"^(\S+\.\d+)\s+[\d,]+\s+384\s", section, flags=re.M))
    default = re.search(r"captures `([^`]+)`", section).group(1)
    out = str(tmp_path / "acts")
    assert main(["capture", "--limit", "2", "--out", out, "--quiet"]) == 0
    r = open_capture(out)
    assert shown and shown <= set(r.layers), (shown, r.layers)
    assert len(r.layers) == 6 and default.replace("*", "") + "0" in r.layers
    for name in shown:
        assert r[name].shape[1:] == (384,)


def test_the_command_says_what_it_loads_as_it_loads(ckpt, tmp_path, capsys, monkeypatch):
    """Issue 53, item 8: at a terminal, a line as each step starts, not silence until the plan
    line; the weights' line is on stderr before transformers reads the weights."""
    import transformers

    from pyhook import cli

    monkeypatch.setattr(cli, "_shows_progress", lambda: True)  # stderr is a terminal

    from pyhook.pipeline.job import _human

    seen: dict[str, str] = {}
    load = transformers.GPT2LMHeadModel.from_pretrained.__func__

    def from_pretrained(cls, *a, **k):
        seen["err"] = capsys.readouterr().err  # what the user saw when the load began
        return load(cls, *a, **k)

    monkeypatch.setattr(
        transformers.GPT2LMHeadModel, "from_pretrained", classmethod(from_pretrained)
    )
    weights = sum(f.stat().st_size for f in (ckpt / "model").glob("*.safetensors"))
    assert (
        main(cap(ckpt, "--context-size", "16", "--limit", "3", "--out", str(tmp_path / "a"))) == 0
    )
    before = [ln.replace("importing transformers, ", "") for ln in seen["err"].splitlines()]
    assert (
        before[0]
        == f"pyhook: reading {ckpt / 'model'}: its config and tokenizer, and the corpus ..."
    )
    assert before[1] == "pyhook: counting c.parquet ..."
    size = _human(weights)
    assert before[2] == f"pyhook: loading {size} of weights onto cpu, from {ckpt / 'model'} ...", (
        before
    )
    after = capsys.readouterr().err.splitlines()
    assert (
        after[0] == "pyhook: sizing 2 layer(s) with one short example through GPT2LMHeadModel ..."
    )
    assert after[1].startswith("plan: ")
    # --quiet: none of it
    quiet = cap(
        ckpt, "--context-size", "16", "--limit", "3", "--out", str(tmp_path / "b"), "--quiet"
    )
    assert main(quiet) == 0
    assert "pyhook:" not in capsys.readouterr().err


def test_the_loading_lines_start_before_torch_at_a_terminal_only(ckpt, tmp_path):
    """The first line comes before torch's import (seconds); piped or logged, stderr keeps one
    line per error and nothing else."""
    import pty

    args = [sys.executable, "-m", "pyhook", *cap(ckpt, "--limit", "2", "--context-size", "16")]
    args += ["--out", str(tmp_path / "a"), "--dry-run"]
    piped = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert piped.returncode == 0, piped.stderr
    assert "pyhook: importing" not in piped.stderr and "pyhook: loading" not in piped.stderr
    leader, follower = pty.openpty()  # stderr a terminal
    p = subprocess.Popen([*args[:-3], "--out", str(tmp_path / "b"), "--dry-run"],
                         stdout=subprocess.DEVNULL, stderr=follower, cwd=tmp_path)  # fmt: skip
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the command exited: the terminal closed
            break
        if not chunk:
            break
        seen += chunk
    assert p.wait(60) == 0
    lines = [ln.strip() for ln in seen.decode().splitlines() if ln.startswith("pyhook: ")]
    assert lines[0] == "pyhook: importing torch ...", lines
    assert lines[1].endswith(
        f"reading {ckpt / 'model'}: its config and tokenizer, and the corpus ..."
    )
    assert any(ln.startswith("pyhook: loading ") for ln in lines), lines
