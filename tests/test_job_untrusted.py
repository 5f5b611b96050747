"""Job files and command lines that hung, ran out of memory or traced back (issue 49 item 14,
issue 52 items 4-6): each is now one line naming the file, the option or the input, before
anything heavy runs.

References: what the issue says each input must give (a one-line ``pyhook: error:`` and exit
status 2, or :class:`JobError` naming the file and key), and that nothing grows: the command
runs under a memory limit and a timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest
from _models import save_gpt2_lm, word_tokenizer

from pyhook.cli import main
from pyhook.pipeline._generate_options import MAX_STOP_CHARACTERS, _got
from pyhook.pipeline.job import CaptureJob, JobError

DOCS = [f"the fox number {i} ran {' '.join(['far'] * (i % 7))} away ." for i in range(40)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("untrusted")
    save_gpt2_lm(root / "model", word_tokenizer(DOCS))
    (root / "c.txt").write_text("\n".join(DOCS) + "\n")
    return root


def _pyhook(*args, timeout=120, memory_gb=3):
    """``python -m pyhook ARGS`` under a memory limit and a timeout (a run that grows or hangs
    fails the test instead of the machine)."""
    code = (
        "import resource, sys, runpy\n"
        f"lim = {memory_gb} << 30\n"
        "resource.setrlimit(resource.RLIMIT_AS, (lim, lim))\n"
        f"sys.argv = ['pyhook', *{list(map(str, args))!r}]\n"
        "runpy.run_module('pyhook', run_name='__main__')\n"
    )
    try:
        return subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            cwd=tempfile.gettempdir(),
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"pyhook {' '.join(map(str, args))[:200]} ran past {timeout} s (a hang)")


def _one_line(p, *needles):
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert lines[0].startswith("pyhook: error: "), lines
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# -- issue 49 item 14: a YAML file of nested aliases ---------------------------------------------
LAUGHS = "\n".join(
    ["limit:", "  - &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    + [f"  - &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
)


def test_a_yaml_file_of_nested_aliases_is_one_line_not_all_the_memory(tmp_path):
    pytest.importorskip("yaml")
    job = tmp_path / "job.yaml"
    job.write_text(LAUGHS + "\n")
    assert job.stat().st_size < 1024
    t0 = time.monotonic()
    p = _pyhook("capture", "--config", job, "--dry-run", timeout=120, memory_gb=2)
    line = _one_line(p, "job.yaml", "alias")
    assert len(line) < 300 and time.monotonic() - t0 < 120


def test_a_small_alias_is_refused_too(tmp_path):
    pytest.importorskip("yaml")
    job = tmp_path / "job.yml"
    job.write_text("x-size: &n 4\nlimit: *n\n")
    with pytest.raises(JobError, match=r"job\.yml is not valid YAML \(line 2\): an alias"):
        CaptureJob.from_file(job)


def _limited(code: str, timeout: int = 120, memory_gb: int = 2) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter under a memory limit (a check that expands a shared
    value fails there, not on the machine)."""
    head = f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({memory_gb} << 30,) * 2)\n"
    try:
        return subprocess.run(
            [sys.executable, "-c", head + code], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"ran past {timeout} s")


def test_a_huge_shared_value_from_python_is_named_by_its_type():
    """The same value built in Python (no YAML): the message is bounded, and fast."""
    p = _limited(
        "import time\n"
        "from pyhook.pipeline.job import CaptureJob, JobError\n"
        "v = [1] * 9\n"
        "for _ in range(10):\n"
        "    v = [v] * 9  # 9**11 leaves, shared\n"
        "t0 = time.monotonic()\n"
        "for bad in ({'limit': v}, {'dtype': 'f' * 10**6}, {'positions': v}):\n"
        "    try:\n"
        "        CaptureJob(**bad)\n"
        "    except JobError as e:\n"
        "        print(len(str(e)), str(e)[:60])\n"
        "print(time.monotonic() - t0 < 5)\n"
    )
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert lines[0] == "36 limit must be an integer, got a list", lines
    assert all(int(line.split()[0]) < 300 for line in lines[:3]) and lines[3] == "True", lines
    assert _got("x" * 10**7) == "a str" and _got({"a": [1, 2]}) == "{'a': [1, 2]}"


# -- issue 52 item 6: a 5,000-digit integer in a job file ---------------------------------------
@pytest.mark.parametrize("kind", ["json", "yaml"])
@pytest.mark.parametrize("key", ["limit", "batch_size", "positions", "seed"])
def test_a_5000_digit_integer_is_a_job_error_naming_the_file_and_key(tmp_path, kind, key):
    if kind == "yaml":
        pytest.importorskip("yaml")
    number = "7" * 5000
    text = f'{{"{key}": {number}}}' if kind == "json" else f"{key}: {number}\n"
    job = tmp_path / f"job.{kind}"
    job.write_text(text)
    with pytest.raises(JobError) as e:
        CaptureJob.from_file(job)
    msg = str(e.value)
    assert msg.startswith(f"job.{kind}: ") and key in msg and "5000 digits" in msg, msg
    assert len(msg) < 300


def test_a_5000_digit_integer_from_the_command_is_one_line(tmp_path):
    (tmp_path / "job.json").write_text('{"limit": ' + "9" * 5000 + "}")
    p = _pyhook("capture", "--config", tmp_path / "job.json", "--dry-run")
    _one_line(p, "job.json", "limit", "5000 digits")


# -- issue 52 item 4: an input that is not a regular file ----------------------------------------
def test_dev_zero_as_input_is_refused_before_it_is_read(ckpt, tmp_path):
    with pytest.raises(JobError, match=r"character device"):
        CaptureJob(input="/dev/zero").check_files()
    p = _pyhook(
        "capture",
        "--model",
        ckpt / "model",
        "--input",
        "/dev/zero",
        "--out",
        tmp_path / "acts",
        "--dry-run",
        timeout=120,
        memory_gb=3,
    )
    _one_line(p, "/dev/zero", "not a regular file or a folder")


def test_a_fifo_as_input_is_refused_instead_of_blocking(ckpt, tmp_path):
    fifo = tmp_path / "corpus.txt"
    os.mkfifo(fifo)
    with pytest.raises(JobError, match=r"FIFO"):
        CaptureJob(input=str(fifo)).check_files()
    p = _pyhook(
        "capture",
        "--model",
        ckpt / "model",
        "--input",
        fifo,
        "--out",
        tmp_path / "acts",
        "--dry-run",
        timeout=120,
    )
    _one_line(p, str(fifo), "FIFO")
    # the corpus reader itself, as pyhook.stream and the dataset build it (no job around it)
    code = (
        "from pyhook.pipeline.source import CorpusSource, SourceError\n"
        "import sys\n"
        f"for path in ({str(fifo)!r}, '/dev/zero'):\n"
        "    try:\n"
        "        CorpusSource(path)\n"
        "    except SourceError as e:\n"
        "        print(e)\n"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        pytest.fail("CorpusSource on a FIFO or /dev/zero did not return (a hang)")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == [
        f"cannot read --input {str(fifo)!r}: not a regular file or a folder (a FIFO (named "
        "pipe)); give a corpus file or folder",
        "cannot read --input '/dev/zero': not a regular file or a folder (a character "
        "device); give a corpus file or folder",
    ]


# -- issue 52 item 5: stop_strings bounded -------------------------------------------------------
@pytest.mark.parametrize(
    "value",
    ["x" * 6000, ["ab"] * (MAX_STOP_CHARACTERS // 2 + 1), "y" * (MAX_STOP_CHARACTERS + 1)],
)
def test_stop_strings_past_the_bound_are_refused(value):
    with pytest.raises(JobError, match=f"stop_strings' must be .* at most {MAX_STOP_CHARACTERS}"):
        CaptureJob(generate=2, generate_kwargs={"stop_strings": value})
    with pytest.raises(JobError, match="at most"):  # inside generation_config too
        CaptureJob(generate=2, generate_kwargs={"generation_config": {"stop_strings": value}})


def test_stop_strings_within_the_bound_are_kept():
    for value in ("\n\n", ["</answer>", "Question:"], "z" * MAX_STOP_CHARACTERS):
        job = CaptureJob(generate=2, generate_kwargs={"stop_strings": value})
        assert job.generate_kwargs == {"stop_strings": value}


# -- issue 52 item 6: model_class that is not a model class; tp_size against the heads ------------
@pytest.mark.parametrize("cls", ["AutoTokenizer", "GenerationConfig", "AutoConfig"])
def test_a_model_class_that_is_no_model_class_is_one_line(ckpt, tmp_path, capsys, cls):
    args = ["capture", "--model", str(ckpt / "model"), "--input", str(ckpt / "c.txt")]
    args += ["--out", str(tmp_path / "acts"), "--model-class", cls, "--dry-run"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and cls in err[0] and "is not a transformers model class" in err[0], err


def test_a_tp_size_that_does_not_divide_the_heads_is_refused_before_the_weights(
    ckpt, tmp_path, monkeypatch
):
    """GPT-2 here has 2 heads; 3 tensor-parallel ranks cannot each hold whole heads."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")

    def no_weights(*_a, **_k):
        raise AssertionError("the weights began to load (the process group joined)")

    monkeypatch.setattr(CaptureJob, "_device", no_weights)
    job = CaptureJob(
        model=str(ckpt / "model"),
        input=str(ckpt / "c.txt"),
        out=str(tmp_path / "acts"),
        tp_size=3,
        limit=4,
    )
    with pytest.raises(JobError, match=r"tp_size 3 does not divide the model's 2 attention heads"):
        job.plan()


# -- issue 54 item 4: gradients with tp_size are no longer refused by the check ------------------
def test_gradients_with_tp_size_are_accepted_by_the_checks():
    job = CaptureJob(gradients=True, metric="loss", tp_size=2)
    assert job.gradients is True and job.tp_size == 2


# -- issue 54 item 3: a resume compares the model, not FSDP2's class for it --------------------------
def _store(out, model_name):
    import torch

    from pyhook.store import ShardWriter

    with ShardWriter(str(out), meta={"model": model_name}) as w:
        w.add({"x": torch.ones(2, 4)}, examples=1)


def test_a_store_begun_under_fsdp_resumes_with_the_plain_model(tmp_path):
    """transformers' tp_size with data-parallel replicas (and any fully_shard) gives the model
    the class FSDP<its class>; the store it began is the same model's, resumed unwrapped."""
    from pyhook.store import CaptureExistsError, ShardWriter, open_capture

    _store(tmp_path / "a", "FSDPQwen2ForCausalLM")
    import torch

    with ShardWriter(str(tmp_path / "a"), meta={"model": "Qwen2ForCausalLM"}) as w:
        assert w.examples_done == 1
        w.add({"x": torch.ones(2, 4)}, examples=1)
    assert open_capture(str(tmp_path / "a")).examples == 2
    with pytest.raises(CaptureExistsError, match=r"Qwen2ForCausalLM' \(stored\) != 'Llama"):
        ShardWriter(str(tmp_path / "a"), meta={"model": "LlamaForCausalLM"})


def test_the_job_records_the_models_own_class_under_fsdp():
    import torch
    from torch.distributed.fsdp import FSDPModule

    from pyhook.pipeline.job import model_class_name

    m = torch.nn.Linear(2, 2)
    m.__class__ = type("FSDPLinear", (FSDPModule, torch.nn.Linear), {})  # as fully_shard does
    assert type(m).__name__ == "FSDPLinear" and model_class_name(m) == "Linear"
    assert model_class_name(torch.nn.Linear(2, 2)) == "Linear"
