"""pyhook.runner.run: a batch the model cannot embed is refused before its forward, and a forward
that raises stops the source's prefetch thread at once (issue 23, item 5)."""

from __future__ import annotations

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
