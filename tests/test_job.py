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
    empty = tempfile.mkdtemp()  # a folder, but no capture: found by the reader, after torch
    p = _command("inspect", empty)
    assert p.returncode == 2 and "torch" in _imported(p.stderr)
    assert empty in "\n".join(_errors(p.stderr))


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


# -- job files are data (issue 45): what a job can make pyhook do -------------------------------
def _code_dir(tmp_path):
    """A folder whose custom_generate/generate.py, imported, writes the file SENTINEL next to
    it (what a job naming it with `custom_generate` made transformers import and run)."""
    root = tmp_path / "evil"
    (root / "custom_generate").mkdir(parents=True)
    sentinel = root / "SENTINEL"
    (root / "custom_generate" / "generate.py").write_text(
        f"open({str(sentinel)!r}, 'w').write('ran')\n"
        "def generate(model, *args, **kwargs):\n"
        "    raise SystemExit('custom generate ran')\n"
    )
    return root, sentinel


def test_a_job_that_names_code_to_run_is_refused_and_the_code_never_runs(ckpt, tmp_path):
    # Before: generate_kwargs went to model.generate as given; custom_generate with
    # trust_remote_code imported (ran) the job's file.
    root, sentinel = _code_dir(tmp_path)
    base = {"model": str(ckpt / "model"), "input": str(ckpt / "c.txt"), "generate": 2}
    base |= {"layers": LAYERS[:1], "limit": 2, "out": str(tmp_path / "o")}
    kw = {"custom_generate": str(root), "trust_remote_code": True}
    with pytest.raises(JobError, match=r"'custom_generate' is refused: it runs a generate funct"):
        CaptureJob(**base, generate_kwargs=kw).run()
    # the same inside a generation_config mapping, and from a job file through the command
    (tmp_path / "job.json").write_text(
        json.dumps({**base, "generate_kwargs": {"generation_config": kw}})
    )
    with pytest.raises(JobError, match=r"generation_config 'custom_generate' is refused"):
        CaptureJob.from_file(tmp_path / "job.json")
    assert main(["capture", "--config", str(tmp_path / "job.json")]) == 2
    assert not sentinel.exists() and not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("trust_remote_code", True, "lets transformers run code from a repository"),
        ("assistant_model", "./other", "it runs another model"),
        ("prefix_allowed_tokens_fn", "os.system", "it takes a function"),
        ("streamer", "x", "it takes an object"),
        ("dola_layers", "high", "DoLa decoding is loaded from a Hub repository"),
        ("penalty_alpha", 0.6, "contrastive search is loaded from a Hub repository"),
        ("num_beam_groups", 2, "group beam search"),
        ("cache_implementation", "paged", "replaces the model's KV cache"),
        ("output_attentions", True, "is not a generate option a job passes"),
        ("temprature", 0.5, "(did you mean 'temperature'?)"),
        ("num_beams", 4, "beam search reorders the sequences"),
        ("temperature", "hot", "'temperature' must be a number > 0, got 'hot'"),
        ("eos_token_id", [1, 1.5], "a token id or a list of them"),
        ("top_k", 10**30, "an integer >= 0"),
        ("stop_strings", [["nested"]], "a string or a list of strings"),
        ("use_cache", False, "capture runs generate with its KV cache"),
    ],
)
def test_generate_kwargs_are_an_allow_list_of_plain_data(key, value, words):
    with pytest.raises(JobError) as e:
        CaptureJob(generate=2, generate_kwargs={key: value})
    assert words in str(e.value) and repr(key) in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_every_allowed_generate_option_is_a_plain_generation_config_field():
    # The allow-list names GenerationConfig fields only (a typo would pass nothing), and every
    # field it leaves out is refused by name; plain values of each allowed option are accepted.
    from transformers import GenerationConfig

    from pyhook.pipeline._generate_options import GENERATE_OPTIONS

    fields = GenerationConfig().to_dict()
    assert set(GENERATE_OPTIONS) <= set(fields)
    good = {
        "bad_words_ids": [[3]],
        "suppress_tokens": [3],
        "begin_suppress_tokens": [3],
        "exponential_decay_length_penalty": [4, 1.5],
        "stop_strings": ["\n\n"],
        "eos_token_id": [2, 3],
        "forced_eos_token_id": 2,
        "num_beams": 1,
        "num_return_sequences": 1,
        "use_cache": True,
        "prefill_chunk_size": None,
    }
    for key, (ok, _) in GENERATE_OPTIONS.items():
        value = good.get(key, True if ok(True) else 2)
        CaptureJob(generate=2, generate_kwargs={key: value, "generation_config": {key: value}})
    for key in set(fields) - set(GENERATE_OPTIONS):
        with pytest.raises(JobError, match=repr(key)):
            CaptureJob(generate=2, generate_kwargs={key: 1})


def test_plain_generate_options_still_reach_generate(ckpt, tmp_path):
    # the allow-list passes what it lists: eos_token_id null runs every sequence to its end
    base = {"model": str(ckpt / "model"), "input": str(ckpt / "c.txt"), "generate": 3}
    base |= {"layers": LAYERS[:1], "limit": 2, "batch_size": 2}
    kw = {"eos_token_id": None, "generation_config": {"temperature": 0.5, "top_k": 4}}
    CaptureJob(**base, out=str(tmp_path / "a"), generate_kwargs=kw, sampling="sample").run()
    r = open_capture(tmp_path / "a")
    assert int(r.generated.sum()) == 2 * 2  # 3 new tokens each, the last one never run
    assert r.settings["generate_kwargs"] == kw


def test_a_token_id_beyond_the_vocabulary_is_refused_by_the_plan(ckpt, tmp_path):
    # Before: the run failed inside generate (an index error) after the weights loaded.
    job = CaptureJob(
        model=str(ckpt / "model"),
        input=str(ckpt / "c.txt"),
        generate=2,
        generate_kwargs={"generation_config": {"bad_words_ids": [[1, 10**9]]}},
        out=str(tmp_path / "o"),
    )
    with pytest.raises(JobError, match=r"'bad_words_ids' names the token id 1000000000, above"):
        job.plan()


def test_a_checkpoint_that_asks_for_its_own_code_is_refused_without_running_it(
    ckpt, tmp_path, capsys
):
    # A job's model loads with transformers' default trust_remote_code (off): a folder whose
    # config maps its class to a file beside it is refused in one line, and the file never runs.
    import shutil

    model = tmp_path / "remote"
    shutil.copytree(ckpt / "model", model)
    sentinel = tmp_path / "SENTINEL"
    (model / "modeling_evil.py").write_text(
        f"open({str(sentinel)!r}, 'w').write('ran')\n"
        "from transformers import GPT2LMHeadModel as EvilModel\n"
    )
    (model / "configuration_evil.py").write_text(
        f"open({str(sentinel)!r}, 'w').write('ran')\n"
        "from transformers import GPT2Config as EvilConfig\n"
    )
    cfg = json.loads((model / "config.json").read_text())
    cfg["auto_map"] = {
        "AutoConfig": "configuration_evil.EvilConfig",
        "AutoModel": "modeling_evil.EvilModel",
    }
    (model / "config.json").write_text(json.dumps(cfg))
    job = CaptureJob(model=str(model), input=str(ckpt / "c.txt"), out=str(tmp_path / "o"))
    # a known model type: its files are ignored, the built-in class loads
    assert job.plan().model_class == "GPT2LMHeadModel"
    assert not sentinel.exists()
    # a type only its own code knows: refused in one line, without transformers' prompt
    # ("Do you wish to run the custom code? [y/N]", which a terminal's user could answer y)
    (model / "config.json").write_text(json.dumps({**cfg, "model_type": "evil"}))
    capsys.readouterr()
    with pytest.raises(ValueError, match="contains custom code which must be executed") as e:
        job.plan()
    assert "\n" not in str(e.value)
    assert "Do you wish" not in "".join(capsys.readouterr())
    assert not sentinel.exists()


def test_an_unknown_option_from_python_names_the_closest_one():
    # Before: CaptureJob(context_sise=12) was dataclass's bare TypeError, where the same key
    # in a job file got "did you mean".
    with pytest.raises(
        JobError, match=r"unknown option 'context_sise' \(did you mean 'context_size'\?\)"
    ) as e:
        CaptureJob(context_sise=12)
    assert isinstance(e.value, TypeError)
    with pytest.raises(TypeError, match="a job's keys are: model, tokenizer"):
        CaptureJob(zzz=1)
    assert CaptureJob(context_size=12).context_size == 12  # the signature is the dataclass's
    assert "context_size" in str(__import__("inspect").signature(CaptureJob))


@pytest.mark.parametrize(
    "args, message",
    [
        (["capture", "--input", "no-such-corpus.txt"], "cannot read --input 'no-such-corpus.txt'"),
        (["inspect", "no-such-capture"], "no capture at 'no-such-capture': no such directory"),
    ],
)
def test_a_missing_input_or_capture_is_answered_before_torch(args, message):
    # Before: both were answered after torch imported and (capture) the model loaded.
    p = _command(*args)
    assert p.returncode == 2, p.stderr
    assert _errors(p.stderr) == [
        f"pyhook: error: {message}"
        + (
            ": No such file or directory"
            if args[0] == "capture"
            else " (the --out of pyhook capture)"
        )
    ], _errors(p.stderr)
    assert "torch" not in _imported(p.stderr)


@pytest.mark.parametrize("how", ["limit", "exact"])
def test_a_rerun_with_other_layers_is_refused_not_nothing_to_do(ckpt, tmp_path, capsys, how):
    # Before: a finished store, rerun with other layers, said "nothing to do" and exited 0:
    # the check that refuses a different capture ran before the layers were resolved.
    base = {"model": str(ckpt / "model"), "input": str(ckpt / "c.parquet"), "context_size": 16}
    base |= {"out": str(tmp_path / "acts")} | ({"limit": 3} if how == "limit" else {})
    CaptureJob(**base, layers=["transformer.h.0"]).run()
    with pytest.raises(
        JobError,
        match=r"different capture .*layers transformer.h.1 now, "
        r"transformer.h.0 when stored",
    ):
        CaptureJob(**base, layers=["transformer.h.1"]).plan()
    flags = ["capture", "--model", base["model"], "--input", base["input"], "--out", base["out"]]
    flags += ["--context-size", "16"] + (["--limit", "3"] if how == "limit" else [])
    capsys.readouterr()
    assert main([*flags, "--layers", "transformer.h.*"]) == 2  # h.0 and h.1: another capture
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--layers transformer.h.0 transformer.h.1 now" in err[0], err
    # the same layers, however named: nothing to do (said before the weights load when named
    # as stored, after resolving them otherwise)
    for layers in (["transformer.h.0"], ["transformer.*.0"]):
        plan = CaptureJob(**base, layers=layers).plan()
        assert plan.note is not None and "nothing to do" in plan.note and plan.layers == []
    assert open_capture(base["out"]).layers == ["transformer.h.0"]


def _uneven_corpus(path, n=4000):
    """Its first half: lines of a few long words; its second: lines of many short ones (few
    tokens per byte first, many after)."""
    long_words = " ".join(["number"] * 3)  # words of the tokenizer's (no [UNK], a special)
    short_words = " ".join(["."] * 12)
    lines = [long_words] * (n // 2) + [short_words] * (n - n // 2)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_estimate_samples_across_the_corpus(ckpt, tmp_path):
    # Before: tokens per byte came from the first 2,000 documents: far off when they differ
    # from the rest (the corpus: 13% low).
    from pyhook.pipeline.runner import load_tokenizer
    from pyhook.pipeline.source import open_source

    tok, _ = load_tokenizer(str(ckpt / "model"), "")
    src = open_source(_uneven_corpus(tmp_path / "c.txt"), tokenizer=tok, context_size=16)
    est = src.estimate()
    counted = sum(len(b.examples) for b in src.batches())
    assert not est["exact"] and est["rows"] > 0
    assert abs(est["examples"] - counted) <= 0.05 * counted, (est["examples"], counted)
    # one example per row: the examples counted, their tokens and rows drawn the same way
    src = open_source(tmp_path / "c.txt", tokenizer=tok, max_length=32)
    est = src.estimate()
    tokens = rows = 0
    for b in src.batches():
        tokens += int(b.attention_mask.sum())
        rows += int(b.keep.sum())
    assert not est["exact"] and est["examples"] == 4000
    assert abs(est["tokens"] - tokens) <= 0.05 * tokens, (est["tokens"], tokens)
    assert abs(est["rows"] - rows) <= 0.05 * rows, (est["rows"], rows)


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet", "arrow"])
def test_a_large_corpus_is_sampled_in_windows_across_it(ckpt, tmp_path, monkeypatch, kind):
    # Past _FULL_PASS_BYTES the estimate reads windows spread across the corpus instead of all
    # of it (set to 0 here, so that this small corpus is "large").
    from pyhook.pipeline import source
    from pyhook.pipeline.runner import load_tokenizer

    tok, _ = load_tokenizer(str(ckpt / "model"), "")
    lines = _uneven_corpus(tmp_path / "c.txt", 12_000).read_text().splitlines()
    path = tmp_path / f"c.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    elif kind == "parquet":
        pq.write_table(pa.table({"text": lines}), path, row_group_size=100)
    elif kind == "arrow":
        datasets = pytest.importorskip("datasets")
        path = tmp_path / "ds"
        datasets.Dataset.from_dict({"text": lines}).save_to_disk(str(path))
    src = source.open_source(path, tokenizer=tok, context_size=16)
    counted = sum(len(b.examples) for b in src.batches())
    monkeypatch.setattr(source, "_FULL_PASS_BYTES", 0)
    read = []
    chunks = src._chunks

    def counted_chunks():
        for c in chunks():
            read.append(len(c))
            yield c

    monkeypatch.setattr(src, "_chunks", counted_chunks)
    est = src.estimate()
    assert sum(read) < len(lines) / 2, sum(read)  # only the first documents are read whole
    assert abs(est["examples"] - counted) <= 0.05 * counted, (est["examples"], counted)


def test_the_progress_bar_grows_when_the_estimate_is_passed(ckpt, tmp_path, capsys):
    # Before: once the count passed the estimate, tqdm dropped the total ("531ctx": no
    # percentage, no time left). The estimate is made low here, as a skewed corpus makes it.
    job = CaptureJob(
        model=str(ckpt / "model"),
        input=str(_uneven_corpus(tmp_path / "c.txt", 2400)),
        context_size=64,
        layers=LAYERS[:1],
        batch_size=16,
        stats=False,
        out=str(tmp_path / "o"),
    )
    plan = job.plan()
    assert not plan.exact
    plan._state["share"]["examples"] //= 3
    capsys.readouterr()
    result = job.run(plan, progress=True)
    renders = [r.strip() for r in capsys.readouterr().err.split("\r") if "ctx" in r]
    assert renders and all("%" in r for r in renders), [r for r in renders if "%" not in r]
    n = result.examples
    assert "100%" in renders[-1] and f"{n}/{n}" in renders[-1], renders[-1]
