"""pyhook.runner.run: a batch the model cannot embed is refused before its forward, and a forward
that raises stops the source's prefetch thread at once (issue 23, item 5)."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch
from _hygiene import diff, hook_snapshot
from _models import word_tokenizer
from pyhook.capture import capture
from pyhook.runner import RunnerError, run
from pyhook.source import Batch, open_source

from pyhook.store import open_capture

DOCS = [f"the owl number {i} flew {' '.join(['high'] * (i % 4))} home ." for i in range(30)]


@pytest.fixture(scope="module")
def model():
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32)
    return GPT2Model(cfg).eval()


def _batch(ids, first):
    ids = torch.tensor(ids)
    n = len(ids)
    return Batch(ids, torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool),
                 torch.arange(first, first + n), None)  # fmt: skip


@pytest.mark.parametrize("bad", [50, -1])
def test_ids_outside_the_embedding_are_refused_before_the_forward(model, tmp_path, bad):
    good = _batch([[1, 2, 3], [4, 5, 6]], 0)
    wrong = _batch([[7, 8, 9], [10, bad, 11]], 2)
    before = hook_snapshot(model)
    out = tmp_path / "acts"
    with pytest.raises(RunnerError) as e, capture(model, ["h.0"], out=out) as rec:
        run(model, [good, wrong], rec)
    text = str(e.value)
    assert "\n" not in text and f"example (or context) 3, position 1: token id {bad}" in text
    assert "its input embedding has 50 rows" in text, text
    assert diff(before, hook_snapshot(model)) == []
    r = open_capture(out)  # the batch before is stored; nothing of the refused one
    assert r.examples == 2
    got = []
    h = model.h[0].register_forward_hook(
        lambda m, a, o: got.append(o[0] if isinstance(o, tuple) else o)
    )
    with torch.no_grad():
        model(input_ids=good.input_ids)
    h.remove()
    torch.testing.assert_close(r["h.0"].to_tensor(), got[0].reshape(-1, 16))


def test_ids_outside_the_smallest_vocabulary_of_paired_models_are_refused_naming_it(
    model, tmp_path
):
    """A Paired module has no input embedding of its own: each model's is checked, and the
    smallest names its model."""
    from transformers import GPT2Config, GPT2Model

    from pyhook.pipeline.paired import Paired

    torch.manual_seed(1)
    small = GPT2Model(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=40, n_positions=32))
    pair = Paired(base=model, chat=small.eval())
    before = hook_snapshot(pair)
    with pytest.raises(RunnerError) as e, capture(pair, ["h.0"]) as rec:
        run(pair, [_batch([[1, 2, 3], [4, 45, 6]], 0)], rec)
    text = str(e.value)
    assert "example (or context) 1, position 1: token id 45" in text, text
    assert "model 'chat''s vocabulary (its input embedding has 40 rows" in text, text
    assert diff(before, hook_snapshot(pair)) == []


def _source_threads():
    return [t for t in threading.enumerate() if t.name == "pyhook-source"]


def test_a_forward_that_raises_stops_the_prefetch_thread(tmp_path):
    """run() closes the source's iterator when the forward raises, while the exception (and
    the frame that holds the iterator) is still alive: the thread does not wait on a full queue."""
    path = tmp_path / "c.txt"
    path.write_text("\n".join(DOCS) + "\n")
    src = open_source(path, tokenizer=word_tokenizer(DOCS), batch_size=5, prefetch=2)

    def forward(input_ids, attention_mask):
        raise RuntimeError("the forward failed")

    with pytest.raises(RuntimeError, match="the forward failed") as e:
        run(forward, src)
    assert e.traceback  # the traceback, and with it run()'s frame, is alive here
    end = time.monotonic() + 10
    while _source_threads() and time.monotonic() < end:
        time.sleep(0.01)
    assert not _source_threads(), "the prefetch thread is still running"


# -- issue 53, items 1-2: a device map is checked against the model before its weights load ------
LAYERS = ["resid_post.0", "resid_post.1"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    import _large_workers as W

    root = tmp_path_factory.mktemp("placed")
    W.save_llama_lm(root / "model", word_tokenizer(W.DOCS))
    (root / "c.txt").write_text("\n".join(W.DOCS) + "\n")
    return root


def _options(root, out) -> dict:
    return {
        "model": str(root / "model"),
        "input": str(root / "c.txt"),
        "context_size": 12,
        "limit": 6,
        "batch_size": 2,
        "layers": LAYERS,
        "out": str(out),
    }


@pytest.fixture()
def no_weights(monkeypatch):
    """Loading weights fails the test: each refusal must come before it."""
    import transformers

    def refuse(*a, **k):
        raise AssertionError("the weights were loaded before the device map was checked")

    monkeypatch.setattr(transformers.LlamaForCausalLM, "from_pretrained", refuse)


@pytest.mark.parametrize(
    ("placement", "message"),
    [
        # the case: transformers puts the misspelt layer on the CPU without a word
        (
            {"device_map": {"model.layer.0": "disk", "": "cpu"}, "offload_folder": "off"},
            r"device_map names no module of LlamaForCausalLM: 'model\.layer\.0' "
            r"\(closest names: 'model\.layers\.0'",
        ),
        (
            {"device_map": {"model.embed_tokens": "cpu", "model.layers": "cpu"}},
            r"device_map gives no device to \d+ weight\(s\) of LlamaForCausalLM, in "
            r"'model\.norm', 'lm_head': add them, or '' for the rest",
        ),
        ({"device_map": {"": "gpu"}}, r"device_map '': 'gpu' is not a device"),
        ({"device_map": "autp"}, r"device_map 'autp' is not a device.*'auto', 'balanced'"),
        ({"device_map": {"": 0}}, r"device_map '': 0: no CUDA device is visible"),
        (
            {"device_map": "auto", "max_memory": {"cuda:0": "1GB", "cpu": "1GB"}},
            r"max_memory key 'cuda:0' is not a device.*by its index: 0",
        ),
        ({"device_map": "auto", "max_memory": {3: "1GB"}}, r"max_memory GPU 3: no CUDA device"),
        (
            {"device_map": {"model.layers.1": "disk", "": "cpu"}},
            r"device_map puts layers on 'disk': give offload_folder",
        ),
    ],
)
def test_a_device_map_mistake_is_refused_before_the_weights_load(
    llama, tmp_path, no_weights, placement, message
):
    if torch.cuda.is_available() and "CUDA" in message:
        pytest.skip("this machine has a GPU")
    from pyhook import CaptureJob
    from pyhook.pipeline.job import JobError

    if "offload_folder" in placement:
        placement = {**placement, "offload_folder": str(tmp_path / "off")}
    job = CaptureJob(**_options(llama, tmp_path / "acts"), **placement)
    with pytest.raises(JobError, match=message) as e:
        job.plan()
    assert "\n" not in str(e.value)
    assert not (tmp_path / "acts").exists() or not list((tmp_path / "acts").iterdir())


def test_the_command_names_the_misspelt_module_with_its_flag(llama, tmp_path, capsys, no_weights):
    from pyhook.cli import main

    o = _options(llama, tmp_path / "acts")
    code = main(
        [
            "capture", "--model", o["model"], "--input", o["input"], "--context-size", "12",
            "--layers", *LAYERS, "--out", o["out"], "--offload-folder", str(tmp_path / "off"),
            "--device-map", '{"model.layer.0": "disk", "": "cpu"}',
        ]
    )  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("pyhook: error: --device-map names no module of LlamaForCausalLM")
    assert "'model.layers.0'" in err[-1]


def test_the_rest_of_the_model_beside_a_disk_layer_loads_and_captures_the_same_rows(
    llama, tmp_path
):
    """``{"model.layers.0": "disk", "": "cpu"}``: accelerate cannot offload a layer under a ""
    entry (it fails after the load); the job spells "" out as the modules left, so the layer
    is on the disk and the rows are those of the model loaded whole, bit for bit."""
    from pyhook import CaptureJob

    whole = CaptureJob(**_options(llama, tmp_path / "whole")).run()
    job = CaptureJob(
        **_options(llama, tmp_path / "placed"),
        device_map={"model.layers.0": "disk", "": "cpu"},
        offload_folder=str(tmp_path / "off"),
    )
    plan = job.plan()
    assert plan.placement["model.layers.0"] == "disk"
    assert {plan.placement[k] for k in ("model.embed_tokens", "model.layers.1", "lm_head")} == {
        "cpu"
    }
    assert plan.ranks[0]["weights"].get("offloaded", 0) > 0
    job.run(plan)
    a, b = open_capture(whole.out), open_capture(str(tmp_path / "placed"))
    for name in LAYERS:
        assert torch.equal(a[name].to_tensor(), b[name].to_tensor()), name


def test_the_command_prints_where_the_layers_went_when_a_device_map_is_given(
    llama, tmp_path, capsys
):
    from pyhook.cli import main

    o = _options(llama, tmp_path / "acts")
    code = main(
        [
            "capture", "--model", o["model"], "--input", o["input"], "--context-size", "12",
            "--limit", "4", "--layers", *LAYERS, "--out", o["out"],
            "--device-map", '{"model.layers.1": "disk", "": "cpu"}',
            "--offload-folder", str(tmp_path / "off"),
        ]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0, err
    rows = {ln.split()[0]: ln.split(None, 1)[1].strip() for ln in err.splitlines()
            if ln.startswith(("cpu ", "disk "))}  # fmt: skip
    assert rows == {
        "cpu": "model.embed_tokens, model.layers.0, model.norm, model.rotary_emb, lm_head",
        "disk": "model.layers.1",
    }, err
    # the whole model on one device, by a device map: said too (a misspelt key would show)
    code = main(
        [
            "capture", "--model", o["model"], "--input", o["input"], "--context-size", "12",
            "--limit", "4", "--layers", *LAYERS, "--out", o["out"], "--overwrite",
            "--device-map", "cpu",
        ]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0, err
    assert re.search(r"^cpu\s+\(the whole model\)", err, re.M), err
