"""Job files are untrusted input (issue 45): hypothesis mutates a valid job file.

Each example writes a job (JSON or YAML) with a few mutations: values of the wrong type,
nested junk, huge or non-finite numbers, unknown keys, ``generate`` options that load code or
another model (pointing at a file that writes a sentinel when run), deep nesting, and mutations
that keep the meaning (``-`` for ``_`` in keys, the key order, JSON or YAML). It runs
``pyhook capture --config JOB --dry-run`` in-process: the command either plans the job (exit 0),
and then the job is exactly what the file says (the unmutated plan, when the meaning was kept),
or refuses it with one ``pyhook: error:`` line (exit 2); never a traceback, and never code.

``PYHOOK_FUZZ_EXAMPLES=N`` runs N examples (CI runs a bounded, derandomized set).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from typing import Any

import pytest
from _hygiene import bounded
from _models import save_gpt2_lm, word_tokenizer
from hypothesis import given
from hypothesis import strategies as st

from pyhook.cli import main
from pyhook.pipeline._generate_options import LOADS_CODE
from pyhook.pipeline.job import CaptureJob

yaml = pytest.importorskip("yaml")

DOCS = [f"the fox number {i} ran {' '.join(['far'] * (i % 7))} away ." for i in range(40)]
DEEP = "__deep__"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A tiny GPT-2 checkpoint, a corpus, and a custom_generate folder that writes SENTINEL."""
    root = tmp_path_factory.mktemp("fuzzjob")
    save_gpt2_lm(root / "model", word_tokenizer(DOCS))
    (root / "c.txt").write_text("\n".join(DOCS) + "\n")
    (root / "evil" / "custom_generate").mkdir(parents=True)
    (root / "evil" / "custom_generate" / "generate.py").write_text(
        f"open({str(root / 'SENTINEL')!r}, 'w').write('ran')\n"
        "def generate(model, *args, **kwargs):\n    raise SystemExit('ran')\n"
    )
    return root


def _bases(root: Any) -> list[dict[str, Any]]:
    common = {"model": str(root / "model"), "input": str(root / "c.txt")}
    common |= {"layers": ["transformer.h.0"], "limit": 4, "batch_size": 4}
    return [
        {**common, "context_size": 16, "dtype": "float16", "shard_mb": 1},
        {**common, "generate": 2, "generate_kwargs": {"temperature": 0.5, "eos_token_id": None}},
    ]


scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, -1, 2**63, 10**30, 1e308, float("inf"), float("nan"), -0.0, 0.5])
    | st.text(max_size=12)
)
junk = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def mutations(draw: st.DrawFn) -> list[tuple[str, Any]]:
    """A few mutations: ("value", key, junk), ("unknown", key, junk), ("code", key, nested),
    ("deep", key, depth), ("huge", key, number), ("dashes",), ("order",)."""
    keys = st.sampled_from(
        [
            "model",
            "input",
            "layers",
            "limit",
            "batch_size",
            "context_size",
            "dtype",
            "generate",
            "generate_kwargs",
            "positions",
            "shard_mb",
            "overwrite",
            "seed",
            "sampling",
            "out",
        ]
    )
    kinds = st.sampled_from(["value", "unknown", "code", "deep", "huge", "dashes", "order"])
    out = []
    for kind in draw(st.lists(kinds, min_size=1, max_size=3)):
        if kind == "value":
            out.append(("value", draw(keys), draw(junk)))
        elif kind == "unknown":
            out.append(("unknown", draw(st.text(min_size=1, max_size=10)), draw(junk)))
        elif kind == "code":
            out.append(("code", draw(st.sampled_from(sorted(LOADS_CODE))), draw(st.booleans())))
        elif kind == "deep":
            out.append(("deep", draw(keys), draw(st.sampled_from([2, 60, 3000]))))
        elif kind == "huge":
            out.append(("huge", draw(keys), draw(st.sampled_from([2**64, 10**400, -(2**63)]))))
        else:
            out.append((kind, None, None))
    return out


def _apply(base: dict[str, Any], muts: list[tuple[str, Any, Any]], root: Any):
    """The mutated mapping, the text of the deep value (if any), and whether a code-loading
    option is in it; ``kept``: only meaning-keeping mutations."""
    data = json.loads(json.dumps(base))
    deep = None
    code = False
    dashes = order = False
    for kind, key, value in muts:
        if kind in ("value", "huge", "unknown"):
            data[key] = value
        elif kind == "code":
            opts = {key: str(root / "evil"), "trust_remote_code": True}
            gk = data.get("generate_kwargs")
            gk = dict(gk) if isinstance(gk, dict) else {}
            if value:
                gk["generation_config"] = opts
            else:
                gk.update(opts)
            data["generate_kwargs"] = gk
            data.setdefault("generate", 2)
            code = True
        elif kind == "deep":
            deep = "[" * value + "1" + "]" * value
            data[key] = DEEP
        elif kind == "dashes":
            dashes = True
        else:
            order = True
    if code and not isinstance(data.get("generate_kwargs"), dict):
        code = False  # a later mutation replaced them
    if code and not any(
        k in LOADS_CODE or (k == "generation_config" and isinstance(v, dict))
        for k, v in data["generate_kwargs"].items()
    ):
        code = False
    if dashes:
        data = {k.replace("_", "-"): v for k, v in data.items()}
    if order:
        data = dict(reversed(list(data.items())))
    kept = all(kind in ("dashes", "order") for kind, _, _ in muts)
    return data, deep, code, kept


def _write(data: dict[str, Any], deep: str | None, as_yaml: bool, folder: str) -> str:
    if as_yaml and (deep is None or len(deep) < 400):  # PyYAML's dumper recurses
        text = yaml.safe_dump(data, sort_keys=False)
        if deep is not None:
            text = text.replace(DEEP, deep)
        path = os.path.join(folder, "job.yaml")
    else:
        text = json.dumps(data)  # NaN and Infinity as Python's json writes (and reads) them
        if deep is not None:
            text = text.replace(json.dumps(DEEP), deep)
        path = os.path.join(folder, "job.json")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def _dry_run(path: str, out: str) -> tuple[int, str, str]:
    so, se = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
        code = main(["capture", "--config", path, "--dry-run", "--out", out])
    return code, so.getvalue(), se.getvalue()


_plans: dict[int, str] = {}


@bounded(30)
@given(which=st.sampled_from([0, 1]), muts=mutations(), as_yaml=st.booleans())
def test_a_mutated_job_file_is_planned_as_written_or_refused_in_one_line(
    root, which, muts, as_yaml
):
    base = _bases(root)[which]
    folder = tempfile.mkdtemp(dir=root)
    out = os.path.join(folder, "acts")
    if which not in _plans:  # the unmutated job's plan
        code, stdout, _ = _dry_run(_write(base, None, False, folder), out)
        assert code == 0
        _plans[which] = stdout.replace(folder, "DIR")
    data, deep, code_key, kept = _apply(base, muts, root)
    path = _write(data, deep, as_yaml, folder)
    code, stdout, stderr = _dry_run(path, out)  # any exception fails the test
    assert not (root / "SENTINEL").exists(), "a job file ran code"
    assert code in (0, 2), (code, stderr)
    if code == 2:
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("pyhook: error: "), stderr
        assert "Traceback" not in stderr
    else:
        job = CaptureJob.from_file(path)  # the job holds what the file says
        values = {k.replace("-", "_"): v for k, v in CaptureJob.read_file(path).items()}
        assert job == CaptureJob(**values)
    if code_key:  # refused (for it, or for another mistake found first)
        assert code == 2, stdout
    if kept:
        assert code == 0 and stdout.replace(folder, "DIR") == _plans[which], stderr
    assert not os.path.exists(out)  # a dry run writes nothing
