"""The capture job (pyhook.pipeline.job.CaptureJob) and the command that parses into it: the same
store from Python and from the command, --config equal to the flags, the plan equal to what the
run writes, arguments checked before torch is imported, and the words a user reads."""

from __future__ import annotations

import dataclasses
import doctest
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from _models import save_gpt2_lm, word_tokenizer

import pyhook
from pyhook import cli
from pyhook.cli import main, parse_arguments
from pyhook.pipeline import job as jobmod
from pyhook.pipeline.job import CaptureJob, JobError
from pyhook.store import open_capture

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

DOCS = [f"the fox number {i} ran {' '.join(['far'] * (i % 7))} away ." for i in range(80)]
LAYERS = ["transformer.h.0", "transformer.h.1"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A GPT-2 LM checkpoint (random weights, 64 positions) with its tokenizer, a parquet
    corpus and a text corpus."""
    root = tmp_path_factory.mktemp("job")
    tok = word_tokenizer(DOCS)
    save_gpt2_lm(root / "model", tok)
    pq.write_table(pa.table({"text": DOCS}), root / "c.parquet")
    (root / "c.txt").write_text("\n".join(DOCS) + "\n")
    return root


def _store_files(out):
    """Every shard's bytes, and the merged index."""
    out = os.fspath(out)
    names = [p for p in os.listdir(out) if p.startswith("shard") and p.endswith(".safetensors")]
    shards = {p: Path(out, p).read_bytes() for p in names}
    return shards, json.loads(Path(out, "index.json").read_text())


def _same_store(a, b):
    sa, ia = _store_files(a)
    sb, ib = _store_files(b)
    assert sorted(sa) == sorted(sb) and sa, (sorted(sa), sorted(sb))
    for name in sa:
        assert sa[name] == sb[name], f"shard {name} differs"
    for key in ("settings", "layers", "examples", "bytes", "shards"):
        assert ia[key] == ib[key], key
    assert ia["meta"] == ib["meta"]


# -- the job and the command write the same store ----------------------------------------------
def test_job_and_command_write_identical_stores(ckpt, tmp_path, capsys):
    flags = ["--model", str(ckpt / "model"), "--input", str(ckpt / "c.parquet")]
    flags += ["--layers", *LAYERS, "--context-size", "16", "--batch-size", "3"]
    flags += ["--shard-mb", "0.01", "--dtype", "float16"]
    assert main(["capture", *flags, "--out", str(tmp_path / "cmd"), "--quiet"]) == 0
    job = CaptureJob(
        model=str(ckpt / "model"),
        input=str(ckpt / "c.parquet"),
        layers=LAYERS,
        context_size=16,
        batch_size=3,
        shard_mb=0.01,
        dtype="float16",
        out=str(tmp_path / "job"),
    )
    result = job.run()
    _same_store(tmp_path / "cmd", tmp_path / "job")
    r = open_capture(tmp_path / "job")
    assert result.examples == r.examples and result.rows == {n: len(r[n]) for n in LAYERS}
    assert result.shards == len(r.index["shards"]) > 1 and result.stored_bytes == r.index["bytes"]
    # the command printed nothing with --quiet; str(result) is the command's closing summary
    assert capsys.readouterr().out == ""
    assert f"{r.examples:,} contexts" in str(result) and "transformer.h.1" in str(result)


def test_config_file_equals_the_flags(ckpt, tmp_path):
    flags = [
        "--model", str(ckpt / "model"), "--input", str(ckpt / "c.txt"), "--layers", *LAYERS,
        "--max-length", "8", "--batch-size", "4", "--positions", "last", "--no-stats",
        "--exclude-special-tokens", "--out", str(tmp_path / "flags"), "--limit", "30",
    ]  # fmt: skip
    by_flags = parse_arguments(["capture", *flags]).job
    values = {
        "model": str(ckpt / "model"),
        "input": str(ckpt / "c.txt"),
        "layers": LAYERS,
        "max_length": 8,
        "batch_size": 4,
        "positions": "last",
        "stats": False,
        "exclude_special_tokens": True,
        "out": str(tmp_path / "flags"),
        "limit": 30,
    }
    (tmp_path / "job.json").write_text(json.dumps(values))
    files = [tmp_path / "job.json"]
    if importlib.util.find_spec("yaml") is not None:
        import yaml

        (tmp_path / "job.yaml").write_text(yaml.safe_dump({**values, "batch-size": 4}))
        files.append(tmp_path / "job.yaml")
    for f in files:
        by_file = parse_arguments(["capture", "--config", str(f)]).job
        assert by_file == by_flags == CaptureJob.from_file(f), f
    # flags given on the command line override the file; those not given leave it alone
    over = parse_arguments(["capture", "--config", str(files[0]), "--limit", "3", "--stats"]).job
    assert over == dataclasses.replace(by_flags, limit=3, stats=True)
    # and the run from the file is the run from the flags
    assert main(["capture", *flags, "--quiet"]) == 0
    cfg = ["capture", "--config", str(files[0]), "--out", str(tmp_path / "file"), "--quiet"]
    assert main(cfg) == 0
    _same_store(tmp_path / "flags", tmp_path / "file")
    assert open_capture(tmp_path / "file").index["settings"]["positions"] == "last"


def test_unknown_and_bad_keys_in_a_job_file_are_named(tmp_path, capsys):
    f = tmp_path / "job.json"
    f.write_text(json.dumps({"context_sise": 64}))
    with pytest.raises(
        JobError, match=r"job.json: unknown key 'context_sise' \(did you mean 'context_size'\?\)"
    ):
        CaptureJob.from_file(f)
    assert main(["capture", "--config", str(f)]) == 2
    assert "unknown key 'context_sise' (did you mean 'context_size'?)" in capsys.readouterr().err
    f.write_text(json.dumps({"frobnicate": 1}))
    with pytest.raises(JobError, match="unknown key 'frobnicate'; a job's keys are: model, "):
        CaptureJob.from_file(f)
    f.write_text(json.dumps({"limit": "ten"}))
    with pytest.raises(JobError, match=r"job\.json: limit must be an integer, got 'ten'"):
        CaptureJob.from_file(f)
    f.write_text("[1, 2]")
    with pytest.raises(JobError, match="must hold a mapping of options"):
        CaptureJob.from_file(f)
    f.write_text('{"limit": 3,}')
    with pytest.raises(JobError, match=r"job.json is not valid JSON \(line 1\)"):
        CaptureJob.from_file(f)
    with pytest.raises(JobError, match="cannot read the job file"):
        CaptureJob.from_file(tmp_path / "missing.json")
    if importlib.util.find_spec("yaml") is not None:
        y = tmp_path / "job.yaml"
        y.write_text("limit: [1\n")
        with pytest.raises(JobError, match=r"job\.yaml is not valid YAML"):
            CaptureJob.from_file(y)


def test_an_option_given_twice_in_a_job_file_is_refused(tmp_path):
    # `context-size` and `context_size` both: the later one silently won
    (tmp_path / "job.json").write_text('{"context-size": 64, "context_size": 32}')
    with pytest.raises(JobError, match=r"job\.json: the option 'context_size' is given twice"):
        CaptureJob.from_file(tmp_path / "job.json")


def test_yaml_without_pyyaml_says_so(tmp_path, monkeypatch):
    (tmp_path / "job.yaml").write_text("limit: 3\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml fails
    with pytest.raises(
        JobError, match=r"needs PyYAML \(pip install pyyaml\); or write the job as JSON"
    ):
        CaptureJob.from_file(tmp_path / "job.yaml")
    (tmp_path / "job.json").write_text('{"limit": 3}')
    assert CaptureJob.from_file(tmp_path / "job.json").limit == 3  # JSON always works


# -- the plan is what the run writes -----------------------------------------------------------
@pytest.mark.parametrize(
    "options",
    [
        {"context_size": 16, "batch_size": 5},
        {"max_length": 8, "batch_size": 7, "tokens": False},
        {"context_size": 16, "positions": "last", "stats": False, "dtype": "bfloat16"},
        # attn_z's rows are [heads, d_head]: the plan's probe (positions="last") kept the heads
        {"context_size": 16, "layers": ["attn_z.1", "resid_post.1"]},
    ],
    ids=["packed", "per-example", "last-bf16", "attn_z"],
)
def test_plan_matches_what_the_run_writes(ckpt, tmp_path, options):
    options = dict(options)
    job = CaptureJob(
        model=str(ckpt / "model"),
        input=str(ckpt / "c.parquet"),
        layers=options.pop("layers", LAYERS),
        shard_mb=0.02,
        out=str(tmp_path / "acts"),
        **options,
    )
    plan = job.plan()
    assert not os.path.exists(tmp_path / "acts" / "index.json")  # a plan writes nothing
    assert plan.exact and plan.note is None and plan.fits
    result = job.run(plan)
    r = open_capture(tmp_path / "acts")
    assert plan.examples == r.examples == result.examples
    for layer in plan.layers:
        assert layer.rows == len(r[layer.name]) == plan.rows
        info = r.index["layers"][layer.name]
        assert list(layer.row_shape) == info["row_shape"] and layer.dtype == info["dtype"]
        assert layer.bytes == r[layer.name].to_tensor().nbytes
    # the documented accuracy of an exact plan: within the shards' headers (a few kB each)
    stored = r.index["bytes"]
    assert plan.bytes <= stored <= plan.bytes + 4096 * len(r.index["shards"]), (plan.bytes, stored)
    with pytest.raises(JobError, match="already run"):
        job.run(plan)  # a plan runs once


def test_plan_counts_the_shards_the_writer_makes(ckpt, tmp_path, monkeypatch):
    # a batch is never split across shards, and a shard is at most half the writer's buffer:
    # the plan said 20 shards for a run of 2 batches (2 shards), and ignored the buffer's cap
    base = {"model": str(ckpt / "model"), "input": str(ckpt / "c.parquet"), "layers": LAYERS}
    base |= {"context_size": 16, "limit": 8, "batch_size": 4, "out": str(tmp_path / "a")}
    job = CaptureJob(**base, shard_mb=0.001)
    plan = job.plan()
    job.run(plan)
    assert plan.shards == len(open_capture(tmp_path / "a").index["shards"]) == 2
    from pyhook.pipeline.writer import ShardWriter

    defaults = {**ShardWriter.__init__.__kwdefaults__, "max_buffer_bytes": 2 * 1024}
    monkeypatch.setattr(ShardWriter.__init__, "__kwdefaults__", defaults)
    big = CaptureJob(**{**base, "out": str(tmp_path / "b"), "batch_size": 1}, shard_mb=1.0)
    plan = big.plan()  # 1 MB asked, 1 kB the writer's cap: one shard per context
    big.run(plan)
    assert plan.shards == len(open_capture(tmp_path / "b").index["shards"]) == 8


def test_max_length_on_the_bundled_corpus_gives_one_example_per_row(ckpt, tmp_path):
    # the bundled corpus's default packing (contexts of 64 here) won over max_length, which was
    # dropped without a word: rows of 64 tokens instead of examples of at most 8
    job = CaptureJob(model=str(ckpt / "model"), layers=LAYERS, max_length=8, limit=4)
    job = dataclasses.replace(job, exclude_special_tokens=False)  # its [UNK]s count too
    plan = dataclasses.replace(job, out=str(tmp_path / "a")).plan()
    assert plan.examples == 4 and 4 <= plan.rows <= 4 * 8, plan.rows


def test_positions_outside_every_row_is_refused_by_the_plan(ckpt, tmp_path):
    # positions 20 with contexts of 16 tokens loaded the weights, began the store and failed
    # at the first forward
    base = {"model": str(ckpt / "model"), "input": str(ckpt / "c.parquet"), "layers": LAYERS}
    for kw, what in (
        ({"context_size": 16}, "context_size 16"),
        ({"max_length": 8}, "max_length 8"),
    ):
        job = CaptureJob(**base, **kw, positions=20, out=str(tmp_path / "a"))
        with pytest.raises(JobError, match=f"positions 20 is outside the .* \\({what}\\)"):
            job.plan()
        assert not os.path.exists(tmp_path / "a")
    ok = CaptureJob(**base, context_size=16, positions=-16, out=str(tmp_path / "b"), limit=2)
    assert ok.plan().rows == 2


def test_plan_of_a_resumed_capture_counts_what_is_left(ckpt, tmp_path):
    base = {"model": str(ckpt / "model"), "input": str(ckpt / "c.parquet"), "layers": LAYERS}
    base |= {"context_size": 16, "out": str(tmp_path / "acts"), "shard_mb": 0.001}
    CaptureJob(**base, limit=5).run()
    full = CaptureJob(**base)
    plan = full.plan()
    whole = CaptureJob(**{**base, "out": str(tmp_path / "other")}).plan()
    assert plan.stored == 5 and plan.examples == whole.examples - 5
    full.run(plan)
    assert open_capture(tmp_path / "acts").examples == whole.examples
    again = full.plan()  # everything stored: nothing to do, nothing loaded
    assert again.note is not None and "nothing to do" in again.note and again.layers == []
    assert full.run(again).note == again.note


def test_plan_refuses_a_different_capture_and_run_refuses_what_does_not_fit(
    ckpt, tmp_path, monkeypatch
):
    import shutil
    from collections import namedtuple

    base = {"model": str(ckpt / "model"), "input": str(ckpt / "c.parquet"), "layers": LAYERS}
    base |= {"context_size": 16, "out": str(tmp_path / "acts"), "limit": 4}
    CaptureJob(**base).run()
    with pytest.raises(JobError) as e:
        CaptureJob(**base, dtype="float16").plan()
    assert "already holds a different capture (4 examples): dtype float16 now, the model's " in str(
        e.value
    )
    assert "overwrite=True" in str(e.value)
    assert "--dtype float16 now" in e.value.spelled(flags=True)

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10_000, 9_000, 1_000))
    job = CaptureJob(**{**base, "out": str(tmp_path / "small")})
    plan = job.plan()
    assert not plan.fits and plan.free == 1_000
    with pytest.raises(JobError, match=r"needs about .* but .* has 1.0 kB free.*force=True"):
        job.run(plan)
    assert not os.path.exists(tmp_path / "small" / "index.json")
    forced = dataclasses.replace(job, force=True)
    assert forced.run().examples == 4


# -- values are checked when the job is made, in the words of whoever made it -------------------
@pytest.mark.parametrize(
    "kw, python, flag",
    [
        ({"limit": 0}, "limit must be >= 1, got 0", "--limit must be >= 1, got 0"),
        ({"batch_size": 2.5}, "batch_size must be an integer", "--batch-size must be an integer"),
        ({"shard_mb": 0}, "shard_mb must be > 0", "--shard-mb must be > 0"),
        # inf passed, and the plan's int(shard_mb * 2**20) was an OverflowError traceback
        ({"shard_mb": float("inf")}, "shard_mb must be > 0 and finite", "--shard-mb must be"),
        ({"positions": "first"}, "positions must be 'all', 'last' or an integer", "--positions"),
        ({"dtype": "float7"}, "dtype must be one of float64, float32", "--dtype must be one of"),
        ({"layers": []}, "layers must name at least one layer", "--layers must name"),
        ({"layers": 3}, "layers must be a list of layer names", "--layers must be a list"),
        ({"overwrite": "yes"}, "overwrite must be true or false", "--overwrite must be"),
        (
            {"model": 3.5},  # a torch.nn.Module is taken (tests/test_large_jobs.py)
            "model must be a string, got 3.5 (a checkpoint folder",
            "--model must be a string",
        ),
        (
            {"context_size": 16, "max_length": 8},
            "max_length cuts each example",
            "with --context-size every row is a context of exactly 16 tokens: drop one",
        ),
    ],
)
def test_bad_values_are_refused_when_the_job_is_made(kw, python, flag):
    with pytest.raises(JobError) as e:
        CaptureJob(**kw)
    assert python in str(e.value) and "--" not in str(e.value)
    assert flag in e.value.spelled(flags=True)


@pytest.mark.parametrize("flag", ["--input", "--out", "--text-column", "--model", "--config"])
def test_an_empty_path_or_name_is_refused(flag, tmp_path, monkeypatch, capsys):
    # `--input "$CORPUS"` with CORPUS unset captured the bundled corpus, `--out ''` wrote into
    # the current directory and `--config ''` was ignored: each ran a capture nobody asked for
    monkeypatch.chdir(tmp_path)
    assert main(["capture", flag, "", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and (f"{flag} is empty" in err or "job file ''" in err), err
    assert os.listdir(tmp_path) == []


def test_equal_jobs_compare_equal():
    assert CaptureJob(layers="h.0", positions="3", shard_mb=1) == CaptureJob(
        layers=["h.0"], positions=3, shard_mb=1.0
    )


def test_every_job_option_is_a_flag_and_back():
    sub = cli.build_parser()._pyhook_commands["capture"]
    dests = {a.dest for a in sub._actions if a.option_strings and a.dest != "help"}
    fields = {f.name for f in dataclasses.fields(CaptureJob)}
    assert dests - fields == {"config", "dry_run", "quiet"}  # the command's own
    assert fields - dests == set()


def test_dtype_names_checked_without_torch_are_the_stores():
    from pyhook.pipeline.format import _DTYPE_TO_ST, dtype_name, parse_dtype

    assert {dtype_name(d) for d in _DTYPE_TO_ST} <= set(jobmod._DTYPE_NAMES)
    for name in (*jobmod._DTYPE_NAMES, *jobmod._DTYPE_ALIASES):
        if hasattr(torch, name) or name in jobmod._DTYPE_ALIASES:
            assert parse_dtype(name) is not None


def test_docstring_examples_of_the_job_module_run():
    # tests/test_install.py doctests pyhook's top-level modules; this one is in a subpackage
    result = doctest.testmod(jobmod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 5 and result.failed == 0
    assert pyhook.CaptureJob is CaptureJob and "CaptureJob" in pyhook.__all__


# -- stream(): the job's model, corpus and layers handed to pyhook.pipeline.stream ---------------
def test_stream_without_the_stream_module_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyhook.pipeline.stream", None)
    with pytest.raises(NotImplementedError, match=r"needs pyhook\.pipeline\.stream"):
        CaptureJob().stream()


@pytest.mark.skipif(
    importlib.util.find_spec("pyhook.pipeline.stream") is None,
    reason="pyhook.pipeline.stream is not on this branch (the lead wires it at merge)",
)
def test_stream_hands_out_the_rows_run_writes(ckpt, tmp_path):
    job = CaptureJob(
        model=str(ckpt / "model"),
        input=str(ckpt / "c.parquet"),
        layers=LAYERS,
        context_size=16,
        out=str(tmp_path / "acts"),
    )
    job.run()
    r = open_capture(tmp_path / "acts")
    got = {n: [] for n in LAYERS}
    index = []
    for batch in job.stream(batch_size=64, buffer_rows=256, seed=0):
        for n in LAYERS:
            got[n].append(batch[n])
        index.append(batch["row_index"])
    index = torch.cat(index)
    order = torch.argsort(index[:, 0] * 1000 + index[:, 1])
    want_order = torch.argsort(r.row_index[:, 0] * 1000 + r.row_index[:, 1])
    assert torch.equal(index[order], r.row_index[want_order])  # each row exactly once
    for n in LAYERS:
        torch.testing.assert_close(torch.cat(got[n])[order], r[n].to_tensor()[want_order])


@pytest.mark.skipif(
    importlib.util.find_spec("pyhook.pipeline.stream") is None,
    reason="pyhook.pipeline.stream is not on this branch (the lead wires it at merge)",
)
def test_stream_tee_is_the_store_run_writes(ckpt, tmp_path):
    # job.stream(tee=) wrote none of the job's settings (model, corpus, context size): the store
    # run() began was refused as a different capture, and one of another corpus was resumed
    base = dict(model=str(ckpt / "model"), layers=LAYERS, context_size=16, batch_size=8)
    out, full = str(tmp_path / "acts"), str(tmp_path / "full")
    CaptureJob(input=str(ckpt / "c.parquet"), out=out, limit=3, **base).run()
    job = CaptureJob(input=str(ckpt / "c.parquet"), out=full, **base)
    job.run()
    s = job.stream(batch_size=64, buffer_rows=256, tee=out)
    rows = torch.cat([b["row_index"] for b in s])
    a, b = open_capture(out), open_capture(full)
    assert s.examples_done == 3 and set(rows[:, 0].tolist()) == set(range(3, b.examples))
    assert torch.equal(a.row_index, b.row_index)
    for n in LAYERS:
        assert torch.equal(a[n].to_tensor(), b[n].to_tensor())
    other = CaptureJob(input=str(ckpt / "c.txt"), out=out, **base)
    with pytest.raises(ValueError, match=r"different capture.*input"):
        other.stream(tee=out)


# -- the command checks its arguments before importing torch -----------------------------------
def _command(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "pyhook", *args],
        capture_output=True,
        text=True,
        cwd=cwd or tempfile.gettempdir(),  # the installed package, not the checkout
        timeout=300,
    )


def _imported(stderr):
    """Module names in ``-X importtime``'s report."""
    return {
        ln.split("|")[-1].strip() for ln in stderr.splitlines() if ln.startswith("import time:")
    }


def _errors(stderr):
    return [ln for ln in stderr.splitlines() if not ln.startswith("import time:")]


@pytest.mark.parametrize(
    "args, message",
    [
        (["capture", "--limt", "3"], "--limt (did you mean --limit?)"),
        (["--limit", "0"], "pyhook: error: --limit must be >= 1, got 0"),
        (["capture", "--context-size", "16", "--max-length", "8"], "drop one of them"),
        (["capture", "--dtype", "float7"], "--dtype must be one of"),
        (["capture", "--positions", "first"], "--positions must be 'all', 'last' or an integer"),
        (["capture", "--batch-size", "x"], "argument --batch-size: invalid int value: 'x'"),
        (["inspect", "acts", "--sample", "0"], "--sample must be >= 1"),
        (
            ["layers", "--model", "base=./a", "--model", "chat=./b"],
            "pyhook layers lists one model's modules, got 2 named model(s) (base=./a, chat=./b)",
        ),
    ],
)
def test_a_bad_argument_exits_2_before_torch_is_imported(args, message):
    p = _command(*args)
    assert p.returncode == 2, p.stderr
    assert message in "\n".join(_errors(p.stderr)), _errors(p.stderr)
    assert "torch" not in _imported(p.stderr)


def test_a_bad_config_file_exits_2_before_torch_is_imported(tmp_path):
    (tmp_path / "job.json").write_text(json.dumps({"context_sise": 64}))
    p = _command("capture", "--config", str(tmp_path / "job.json"))
    assert p.returncode == 2
    assert _errors(p.stderr) == [
        "pyhook: error: job.json: unknown key 'context_sise' (did you mean 'context_size'?)"
    ]
    assert "torch" not in _imported(p.stderr)


def test_help_is_shown_without_torch_and_a_good_command_still_imports_it():
    p = _command("capture", "--help")
    assert p.returncode == 0 and "--config JOB.yaml" in p.stdout
    assert "torch" not in _imported(p.stderr)
    # the control: a command that parses goes on and imports torch (the check above can fail)
    p = _command("inspect", "/nonexistent/acts")
    assert p.returncode == 2 and "torch" in _imported(p.stderr)
    assert "does not exist" in "\n".join(_errors(p.stderr))


# -- words a user reads --------------------------------------------------------------------------
def test_capture_help_says_what_it_accepts():
    sub = cli.build_parser()._pyhook_commands["capture"]
    text = " ".join(sub.format_help().split())
    assert "one example per line" not in text and "lines per forward pass" not in text
    assert "parquet" in text.split("options:")[0]  # the description names the corpus kinds
    batch = next(a for a in sub._actions if "--batch-size" in a.option_strings)
    assert "contexts (--context-size) per forward pass" in batch.help


def test_packing_gives_no_sequence_length_warning(ckpt):
    """Packed documents are cut into contexts, never run whole: transformers' "Token indices
    sequence length is longer than the specified maximum" does not apply and is not shown."""
    from pyhook.source import open_source

    tok = word_tokenizer(DOCS)
    tok.model_max_length = 4  # every document is longer than this
    seen = []

    class Catch(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Catch()
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        src = open_source(ckpt / "c.parquet", tokenizer=tok, context_size=4)
        assert sum(len(b.examples) for b in src) > 10
        # the control: encoding a long document whole does warn through the same logger
        tok2 = word_tokenizer(DOCS)
        tok2.model_max_length = 4
        tok2(DOCS[5])
    finally:
        logger.removeHandler(handler)
    assert sum("Token indices sequence length" in m for m in seen) == 1, seen


def test_inspect_labels_its_two_stds_and_each_is_what_it_says(tmp_path, capsys):
    # value std: the std of all values of the sampled rows; dim std: the mean over dimensions of
    # each dimension's std over every row. On rows whose dimensions have different means the two
    # differ, so one label for both was wrong.
    net = torch.nn.Sequential(torch.nn.Linear(4, 3))
    x = torch.randn(64, 4) + torch.tensor([0.0, 5.0, -5.0, 0.0])
    with torch.no_grad(), pyhook.capture(net, "0", out=tmp_path / "acts"):
        for i in range(0, 64, 16):
            net(x[i : i + 16])
    rows = open_capture(tmp_path / "acts")["0"].to_tensor().double()
    assert main(["inspect", str(tmp_path / "acts"), "--sample", "64"]) == 0
    out = capsys.readouterr().out.splitlines()
    head = next(ln for ln in out if ln.startswith("layer") and "row shape" in ln).split("  ")
    head = [c.strip() for c in head if c.strip()]
    assert "value std" in head and "std" not in head
    line = next(ln for ln in out if ln.startswith("0 "))
    assert float(line.split()[head.index("value std")]) == pytest.approx(
        float(rows.std()), abs=2e-3
    )
    stats_head = next(ln for ln in out if "dim std" in ln and "width" in ln)
    cols = [c.strip() for c in stats_head.split("  ") if c.strip()]
    stats_line = next(ln for ln in out if ln.strip().startswith("0 ") and ln.startswith("    "))
    value = float(stats_line.split()[cols.index("dim std")])
    assert value == pytest.approx(float(rows.var(0, correction=0).sqrt().mean()), rel=1e-3)
    assert abs(value - float(rows.std())) > 0.1  # the two are different numbers
