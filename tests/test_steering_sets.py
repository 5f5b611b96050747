"""Per-example steering in a capture job and on the command line: named sets of specs
(`steer_sets`), chosen per example by a corpus column (`steer_column`), scales multiplied by
another (`steer_scale_column`); one mechanism with run_generate's per-prompt ``steer=`` list.

Each example of a job equals a Python ``run_generate(..., steer=[per-prompt list])`` with the
same specs (rows and generated tokens), and each row alone recomputed without cache by plain
hooks (float64 GPT-2 with randomised norms, left-padded batches, KV cache on)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _models import randomise_norms, word_tokenizer
from test_steering import _reference
from test_steering_capture import _plain_rows

import pyhook
from pyhook.pipeline import job as jobmod
from pyhook.pipeline.generate import prompt_batches, run_generate
from pyhook.pipeline.job import CaptureJob, JobError

T = pytest.importorskip("transformers")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

NEW = 4
LAYER = "resid_post.1"
DOCS = [
    "the cat sat on the mat and looked at the dog",
    "a dog ran in the park with a ball and a stick",
    "birds sing in the morning when the sun comes up",
    "the river runs past the old mill to the sea",
]
TEXTS = [
    "the cat sat",
    "a dog",
    "birds sing in the morning",
    "the river runs past",
    "the old mill to",
    "sun comes up",
    "a ball and a stick",
    "the sea",
]
CONCEPT = ["happy", None, "sad", "happy", "both", "", "control", "sad"]
SCALE = [1.0, None, 2.0, 0.0, -1.5, 3.0, 5.0, None]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A GPT-2 checkpoint (randomised norms, no EOS: every prompt gets NEW tokens), the
    corpus as parquet (text, concept, scale) and as JSON lines, and two vectors."""
    root = tmp_path_factory.mktemp("steersets")
    tok = word_tokenizer(DOCS)
    torch.manual_seed(0)
    cfg = T.GPT2Config(
        n_layer=2,
        n_embd=16,
        n_head=2,
        vocab_size=len(tok),
        n_positions=64,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=tok.pad_token_id,
    )
    randomise_norms(T.GPT2LMHeadModel(cfg).eval()).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    table = pa.table({"text": TEXTS, "concept": CONCEPT, "scale": SCALE})
    pq.write_table(table, root / "prompts.parquet")
    with open(root / "prompts.jsonl", "w") as f:
        for t, c, s in zip(TEXTS, CONCEPT, SCALE):
            f.write(json.dumps({"text": t, "concept": c, "scale": s}) + "\n")
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    save_file(
        {"happy": torch.randn(16, generator=g), "sad": torch.randn(16, generator=g)},
        root / "v.safetensors",
    )
    return root


def _vectors(root):
    from safetensors.torch import load_file

    return load_file(root / "v.safetensors")


def _sets(root):
    v = f"{root / 'v.safetensors'}"
    return {
        "happy": [{"point": "resid_post.0", "vector": f"{v}:happy", "scale": 4.0}],
        "sad": [
            {
                "point": "resid_post.1",
                "vector": f"{v}:sad",
                "op": "ablate",
                "prompt": [-1],
                "generated": [0, 2],
            }
        ],
        "both": [
            {"point": "resid_post.0", "vector": f"{v}:happy", "scale": -2.0, "prompt": None},
            {"point": "attn_out.1", "vector": f"{v}:sad", "scale": 2.5, "prompt": [0]},
        ],
        "unused": [{"point": "resid_post.0", "vector": f"{v}:sad"}],  # no example names it
        "control": [],  # named, and steers nothing
    }


def _default(root):
    v = f"{root / 'v.safetensors'}"
    return [{"point": "attn_out.1", "vector": f"{v}:happy", "scale": 1.5, "generated": [1, 3]}]


def _expected(root):
    """Each example's specs written out by hand from CONCEPT and SCALE: the set's (or the
    default's) specs, each scale times the example's factor."""
    vs = _vectors(root)
    h, s = vs["happy"], vs["sad"]

    def happy(f):
        return [pyhook.Steer("resid_post.0", h, scale=4.0 * f)]

    def sad(f):
        return [
            pyhook.Steer(
                "resid_post.1", s, scale=1.0 * f, op="ablate", prompt=[-1], generated=(0, 2)
            )
        ]

    def default(f):
        return [pyhook.Steer("attn_out.1", h, scale=1.5 * f, generated=(1, 3))]

    return [
        happy(1.0),
        default(1.0),  # no concept, no scale
        sad(2.0),
        happy(0.0),
        [
            pyhook.Steer("resid_post.0", h, scale=-2.0 * -1.5, prompt=None),
            pyhook.Steer("attn_out.1", s, scale=2.5 * -1.5, prompt=[0]),
        ],
        default(3.0),  # "" is empty
        None,  # "control": an empty set
        sad(1.0),  # no scale: the set's own
    ]


def _job(root, out, **kw):
    return CaptureJob(
        model=str(root / "model"),
        input=str(root / "prompts.parquet"),
        model_dtype="float64",
        generate=NEW,
        layers=[LAYER],
        batch_size=3,  # batches of 3, 3, 2 prompts of different lengths: left padded
        out=str(out),
        **kw,
    )


def _python_store(root, out, steer):
    """The Python path: run_generate with a per-prompt list, on the same model and prompts."""
    model = T.GPT2LMHeadModel.from_pretrained(root / "model").double().eval()
    tok = T.AutoTokenizer.from_pretrained(root / "model")
    with pyhook.capture(model, LAYER, out=str(out)) as rec:
        run_generate(
            model,
            prompt_batches(TEXTS, tokenizer=tok, batch_size=3),
            rec,
            max_new_tokens=NEW,
            tokenizer=tok,
            steer=steer,
        )
    return model, tok, pyhook.open_capture(str(out))


def _same_store(a, b):
    assert torch.equal(a.row_index, b.row_index)
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.layer(LAYER).to_tensor(), b.layer(LAYER).to_tensor())


def test_job_sets_equal_run_generate_per_prompt_and_each_row_alone(root, tmp_path):
    job = _job(
        root,
        tmp_path / "job",
        steer=_default(root),
        steer_sets=_sets(root),
        steer_column="concept",
        steer_scale_column="scale",
    )
    plan = job.plan()
    assert plan.steering == {"happy": 2, None: 2, "sad": 2, "both": 1, "control": 1}
    assert (
        "steering by steer_column 'concept': both 1, control 1, happy 2, sad 2 examples; "
        "2 empty (steer's specs); scales times steer_scale_column 'scale'"
    ) in str(plan)
    assert "steering by --steer-column 'concept'" in plan.report(flags=True)
    job.run(plan)
    got = pyhook.open_capture(job.out)

    expected = _expected(root)
    model, tok, py = _python_store(root, tmp_path / "py", expected)
    _same_store(got, py)

    note = got.index["meta"]["steering"]
    assert note["examples"] == "each"
    assert note["set_column"] == "concept" and note["scale_column"] == "scale"
    assert note["set"] == ["happy", None, "sad", "happy", "both", None, "control", "sad"]
    assert note["scale_factor"] == SCALE
    for e, specs in enumerate(expected):
        assert note["entries"][note["entry"][e]] == [s.describe() for s in specs or []]
    # each distinct list of specs once: examples 0 and 3 share "happy" at other scales
    assert len(note["entries"]) == len({json.dumps(x, sort_keys=True) for x in note["entries"]})
    assert got.index["settings"]["steer_sets"] == _sets(root)

    # and each example alone, recomputed every step without cache by plain hooks
    rows = got.layer(LAYER).to_tensor()
    ri = got.row_index
    for e, text in enumerate(TEXTS):
        prompt = tok(text)["input_ids"]
        specs = expected[e] or []
        tokens, _ = _reference(model, prompt, specs, new=NEW)
        seq = prompt + tokens[:-1]  # the last token is never run
        mine = ri[:, 0] == e
        assert got.tokens[mine].tolist() == seq, e
        want = _plain_rows(model, seq, len(prompt), specs, LAYER)
        torch.testing.assert_close(rows[mine], want, rtol=1e-10, atol=1e-10)

    # the steering changes what is generated: the sets are not a no-op
    plain = _job(root, tmp_path / "plain")
    plain.run()
    assert not torch.equal(pyhook.open_capture(plain.out).tokens, got.tokens)


def test_the_command_with_set_flags_equals_run_generate(root, tmp_path):
    """`python -m pyhook capture` with --steer-set / --steer-column / --steer-scale-column on
    the same corpus (JSON lines this time) equals run_generate's per-prompt list."""
    v = root / "v.safetensors"
    out = tmp_path / "cli"
    args = [
        sys.executable,
        "-m",
        "pyhook",
        "capture",
        "--model", str(root / "model"),
        "--input", str(root / "prompts.jsonl"),
        "--model-dtype", "float64",
        "--generate", str(NEW),
        "--layers", LAYER,
        "--batch-size", "3",
        "--steer", f"attn_out.1={v}:happy*1.5",
        "--steer-set", f"happy:resid_post.0={v}:happy*4",
        "--steer-set", f"sad:resid_post.1={v}:sad*-2",
        "--steer-set", f"both:resid_post.0={v}:happy*-2",
        "--steer-set", f"both:attn_out.1={v}:sad*2.5",
        "--steer-set", "control:",
        "--steer-column", "concept",
        "--steer-scale-column", "scale",
        "--out", str(out),
        "--quiet",
    ]  # fmt: skip
    p = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    vs = _vectors(root)
    h, s = vs["happy"], vs["sad"]
    factors = [1.0 if f is None else f for f in SCALE]
    by_set = {
        "happy": lambda f: [pyhook.Steer("resid_post.0", h, scale=4.0 * f)],
        "sad": lambda f: [pyhook.Steer("resid_post.1", s, scale=-2.0 * f)],
        "both": lambda f: [
            pyhook.Steer("resid_post.0", h, scale=-2.0 * f),
            pyhook.Steer("attn_out.1", s, scale=2.5 * f),
        ],
        "control": lambda f: None,
        None: lambda f: [pyhook.Steer("attn_out.1", h, scale=1.5 * f)],
    }
    steer = [by_set[c or None](f) for c, f in zip(CONCEPT, factors)]
    _, _, py = _python_store(root, tmp_path / "py", steer)
    got = pyhook.open_capture(str(out))
    _same_store(got, py)
    assert got.index["meta"]["steering"]["set"][:3] == ["happy", None, "sad"]
    assert got.index["settings"]["steer_sets"]["both"][1] == {
        "point": "attn_out.1",
        "vector": f"{v}:sad",
        "scale": 2.5,
    }


# -- refused before any token ------------------------------------------------------------------
@pytest.fixture
def no_weights(monkeypatch):
    """Loading the weights fails the test: every refusal below comes before them."""
    from pyhook.pipeline import runner

    def refuse(*a, **k):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(runner, "load_weights", refuse)


@pytest.mark.parametrize("corpus", ["prompts.parquet", "prompts.jsonl"])
def test_a_name_that_is_no_set_is_refused_with_its_example(root, tmp_path, corpus, no_weights):
    sets = {k: v for k, v in _sets(root).items() if k != "both"}
    job = _job(root, tmp_path / "a", steer_sets=sets, steer_column="concept")
    job.input = str(root / corpus)
    with pytest.raises(JobError) as e:
        job.plan()
    assert str(e.value) == (
        "`steer_column` 'concept', example 4 (from 0): 'both' is not a set of `steer_sets` "
        "(its sets: control, happy, sad, unused)"
    ).replace("`", "")


@pytest.mark.parametrize("corpus", ["prompts.parquet", "prompts.jsonl"])
def test_a_column_the_corpus_lacks_is_refused(root, tmp_path, corpus, no_weights):
    job = _job(root, tmp_path / "a", steer_sets=_sets(root), steer_column="concpet")
    job.input = str(root / corpus)
    with pytest.raises(JobError, match=r"steer_column: 'concpet' is not a column of prompts\."):
        job.plan()
    job = _job(root, tmp_path / "b", steer=_default(root), steer_scale_column="nope")
    job.input = str(root / corpus)
    with pytest.raises(JobError, match=r"columns are: text, concept, scale"):
        job.plan()


def test_a_scale_that_is_no_number_is_refused(root, tmp_path, no_weights):
    # the concept column as a scale: strings
    job = _job(root, tmp_path / "a", steer=_default(root), steer_scale_column="concept")
    with pytest.raises(JobError) as e:
        job.plan()
    assert str(e.value) == (
        "steer_scale_column 'concept', example 0 (from 0): holds 'happy', not a number (the "
        "factor of the example's steering scales; null: 1)"
    )


def test_a_record_without_the_column_is_empty_and_integer_labels_name_sets(root, tmp_path):
    path = tmp_path / "c.jsonl"
    with open(path, "w") as f:
        for i, t in enumerate(TEXTS[:4]):
            f.write(json.dumps({"text": t, **({"label": i % 2} if i != 2 else {})}) + "\n")
    v = f"{root / 'v.safetensors'}"
    job = CaptureJob(
        model=str(root / "model"),
        input=str(path),
        generate=2,
        layers=[LAYER],
        steer_sets={0: [], 1: f"resid_post.0={v}:happy*3"},  # a YAML file's integer keys
        steer_column="label",
        out=str(tmp_path / "o"),
    )
    assert job.steer_sets == {"0": [], "1": [{"point": "resid_post.0", "vector": f"{v}:happy",
                                              "scale": 3.0}]}  # fmt: skip
    plan = job.plan()
    assert plan.steering == {"0": 1, "1": 2, None: 1}
    specs = plan._state["steer"]
    assert specs[0] is None and specs[2] is None and specs[1] is specs[3]
    assert specs[1][0].scale == 3.0


def test_resume_with_other_per_example_steering_is_refused(root, tmp_path):
    base = dict(steer_sets=_sets(root), steer_column="concept")
    out = tmp_path / "acts"
    job = _job(root, out, limit=3, **base)
    job.run()
    assert _job(root, out, limit=3, **base).plan().note is not None  # the same: nothing to do
    other = _sets(root)
    other["happy"][0]["scale"] = 5.0
    for kw in (
        dict(steer_sets=other, steer_column="concept"),  # another scale in one set
        dict(**base, steer_scale_column="scale"),
        dict(**base, steer=_default(root)),  # the empty examples steered now
    ):
        with pytest.raises(JobError, match=r"already holds a different capture.*steer"):
            _job(root, out, limit=6, **kw).plan()


# -- checked when the job is made, without torch ------------------------------------------------
@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(steer_sets={"a": []}), "steer_sets: each example's set is named by steer_column"),
        (dict(steer_column="c"), "steer_column 'c' names each example's set, defined by"),
        (dict(steer_scale_column="s"), "steer_scale_column 's' multiplies the scales"),
        (dict(steer_sets={"a": 5}, steer_column="c"), "steer_sets 'a' must be a list of"),
        (dict(steer_sets=["happy"], steer_column="c"), "expected NAME:POINT=FILE[:NAME]"),
        (dict(steer_sets={"a": [{"x": 1}]}, steer_column="c"), "unknown field(s) ['x']"),
        (dict(steer_sets={True: []}, steer_column="c"), "a set's name is a non-empty string"),
        (dict(steer_sets={"a": []}, steer_column=""), "steer_column is empty"),
    ],
)
def test_bad_set_options_are_refused_when_the_job_is_made(kw, message):
    with pytest.raises(JobError) as e:
        CaptureJob(generate=2, **kw)
    assert message in str(e.value)


@pytest.mark.parametrize("name", ["steer_sets", "steer_column", "steer_scale_column"])
def test_the_set_options_need_generate(name):
    value = {"a": []} if name == "steer_sets" else "c"
    with pytest.raises(JobError, match=f"{name} is an option of capture during generation"):
        CaptureJob(**{name: value})


def test_set_names_from_a_file_and_from_flags_are_one_job():
    flags = CaptureJob(
        generate=2,
        steer_sets=["a:resid_post.0=v.npy*2", "a:resid_post.1=w.npy", "b:"],
        steer_column="c",
    )
    data = CaptureJob(
        generate=2,
        steer_sets={
            "a": [
                {"point": "resid_post.0", "vector": "v.npy", "scale": 2.0},
                {"point": "resid_post.1", "vector": "w.npy"},
            ],
            "b": [],
        },
        steer_column="c",
    )
    assert flags == data


def test_a_bad_set_flag_exits_2_before_torch_is_imported(tmp_path):
    p = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "pyhook", "capture", "--generate", "2",
         "--steer-set", "resid_post.0=v.npy", "--steer-column", "c"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    errors = [ln for ln in p.stderr.splitlines() if not ln.startswith("import time:")]
    imported = {ln.split("|")[-1].strip() for ln in p.stderr.splitlines() if "|" in ln}
    assert p.returncode == 2
    assert errors == [
        "pyhook: error: --steer-set 'resid_post.0=v.npy': expected NAME:POINT=FILE[:NAME][*SCALE], "
        "e.g. happy:resid_post.6=vectors.safetensors:happy*4 (NAME: alone steers nothing)"
    ]
    assert "torch" not in imported


def test_set_data_is_refused_by_one_job_error_whatever_it_holds():
    """Junk in the new options (as a job file may hold) is a JobError, never a traceback."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**70), max_value=2**70)
        | st.sampled_from([10**400, float("nan"), float("inf"), 0.5])
        | st.text(max_size=8)
    )
    junk = st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
        ),
        max_leaves=8,
    )

    @hypothesis.settings(max_examples=150, deadline=None, database=None)
    @hypothesis.given(sets=junk, column=junk, scale=junk)
    def check(sets, column, scale):
        try:
            CaptureJob(generate=2, steer_sets=sets, steer_column=column, steer_scale_column=scale)
        except JobError as e:
            assert "\n" not in str(e) and len(str(e)) <= 2000

    check()


def test_the_doc_job_file_runs(root, tmp_path, monkeypatch):
    """The job file of docs/steering.md, with its files made here: a model, a corpus with its
    columns, its vectors file."""
    yaml = pytest.importorskip("yaml")
    page = Path(__file__).parent.parent / "docs" / "steering.md"
    block = re.search(r"```yaml\n(# steer-job\.yaml\n.*?)```", page.read_text(), re.S)
    assert block, "docs/steering.md has no steer-job.yaml block"
    data = yaml.safe_load(block.group(1))
    monkeypatch.chdir(tmp_path)
    import shutil

    shutil.copytree(root / "model", tmp_path / data["model"])
    width = 16
    layers = sorted(
        {s["point"] for specs in data["steer_sets"].values() for s in specs}
        | {s["point"] for s in data.get("steer") or []}
    )
    # the doc's points on a model deep enough for them
    depth = 1 + max(int(p.rsplit(".", 1)[1]) for p in layers + data["layers"])
    cfg = T.GPT2Config.from_pretrained(tmp_path / data["model"])
    cfg.n_layer = depth
    T.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / data["model"])
    names = set()
    for specs in [*data["steer_sets"].values(), data.get("steer") or []]:
        for s in specs:
            file, _, name = s["vector"].partition(":")
            names.add((file, name))
    from safetensors.torch import save_file

    for file in {f for f, _ in names}:
        save_file({n: torch.ones(width) for f, n in names if f == file}, tmp_path / file)
    concepts = sorted(data["steer_sets"])
    column = data["steer_column"]
    rows = {
        "text": TEXTS,
        column: [concepts[i % len(concepts)] if i % 3 else None for i in range(len(TEXTS))],
    }
    if data.get("steer_scale_column"):
        rows[data["steer_scale_column"]] = [float(i % 4) for i in range(len(TEXTS))]
    pq.write_table(pa.table(rows), tmp_path / data["input"])
    (tmp_path / "steer-job.yaml").write_text(block.group(1))
    job = CaptureJob.from_file(tmp_path / "steer-job.yaml", generate=2, limit=6)
    job.run()
    note = pyhook.open_capture(job.out).index["meta"]["steering"]
    assert note["set"] == rows[column][:6]


def test_the_jobs_messages_name_the_command_flags():
    assert jobmod._spell("`steer_sets` and `steer_column`", flags=True) == (
        "--steer-set and --steer-column"
    )


# -- the column read beside the text, in every corpus format -------------------------------------
@pytest.mark.parametrize(
    "kind", ["parquet", "categorical", "folder", "jsonl", "json", "csv", "arrow"]
)
def test_column_values_in_every_format(tmp_path, kind):
    from pyhook.pipeline.source import SourceError, open_source

    texts, sets = ["a b", "c", "d e f", "g"], ["happy", None, "sad", "happy"]
    table = pa.table({"text": texts, "concept": sets})
    if kind == "parquet":
        path = tmp_path / "c.parquet"
        pq.write_table(table, path)
    elif kind == "categorical":  # as pandas writes a category column
        path = tmp_path / "c.parquet"
        pq.write_table(table.set_column(1, "concept", table["concept"].dictionary_encode()), path)
    elif kind == "folder":  # two files: the examples in file order
        path = tmp_path / "f"
        path.mkdir()
        pq.write_table(table.slice(0, 3), path / "a.parquet")
        pq.write_table(table.slice(3), path / "b.parquet")
    elif kind in ("jsonl", "json"):
        path = tmp_path / f"c.{kind}"
        records = [{"text": t, **({"concept": c} if c else {})} for t, c in zip(texts, sets)]
        path.write_text(
            "\n".join(map(json.dumps, records)) if kind == "jsonl" else json.dumps(records)
        )
    elif kind == "csv":
        path = tmp_path / "c.csv"
        path.write_text("text,concept\n" + "".join(f"{t},{c or ''}\n" for t, c in zip(texts, sets)))
    else:
        datasets = pytest.importorskip("datasets")
        path = tmp_path / "ds"
        datasets.Dataset.from_dict({"text": texts, "concept": sets}).save_to_disk(str(path))
    src = open_source(path)
    got = src.column_values("concept")
    assert [v or None for v in got] == sets  # CSV reads an empty cell as "" or null
    assert open_source(path, limit=2).column_values("concept") == got[:2]
    with pytest.raises(SourceError, match="'label' is not a column of"):
        src.column_values("label")


def test_a_parquet_file_of_a_folder_without_the_column_is_named(tmp_path):
    from pyhook.pipeline.source import SourceError, open_source

    pq.write_table(pa.table({"text": ["a"], "concept": ["happy"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": ["b"]}), tmp_path / "b.parquet")
    with pytest.raises(SourceError, match=r"file 'b.parquet' has no column 'concept'"):
        open_source(tmp_path).column_values("concept")
