"""Token bookkeeping: which token, example and position each stored row is (pyhook.annotations).

The reference is the model's own input (the token ids, the attention mask) and a hand-written
forward hook: the row the store says is (example e, position p) must be that hook's output at
[e, p], and its token id ``input_ids[e, p]``.
"""

from __future__ import annotations

import pytest
import torch
from _models import all_hooks, gpt2
from torch import nn

from pyhook import annotations
from pyhook.capture import capture
from pyhook.store import open_capture

LAYER = "transformer.h.1"


def batches(n: int = 3, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Right-padded batches of 3 examples of up to 7 tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, 100, (3, 7), generator=g)
        lengths = torch.randint(2, 8, (3,), generator=g)
        am = (torch.arange(7) < lengths[:, None]).long()
        out.append((ids, am))
    return out


def hooked_outputs(model, data):
    """The hand-written reference: LAYER's output [batch, tokens, hidden] of each batch."""
    seen = []
    h = model.get_submodule(LAYER).register_forward_hook(
        lambda _m, _a, o: seen.append((o[0] if isinstance(o, tuple) else o).detach().clone())
    )
    try:
        with torch.no_grad():
            for ids, am in data:
                model(input_ids=ids, attention_mask=am)
    finally:
        h.remove()
    return seen


def expected(data, outputs, keep_of=lambda ids, am: am.bool()):
    """Token ids, (example, position) and rows of the kept tokens, in row-major order."""
    toks, index, rows = [], [], []
    start = 0
    for (ids, am), out in zip(data, outputs):
        keep = keep_of(ids, am)
        e, p = keep.nonzero(as_tuple=True)
        toks.append(ids[e, p])
        index.append(torch.stack([e + start, p], 1))
        rows.append(out[e, p])
        start += ids.shape[0]
    return torch.cat(toks), torch.cat(index), torch.cat(rows)


def test_disk_tokens_and_row_index_match_the_inputs(tmp_path):
    model, data = gpt2(), batches()
    want_tok, want_idx, want_rows = expected(data, hooked_outputs(model, data))
    with torch.no_grad(), capture(model, LAYER, out=tmp_path, mask="attention_mask"):
        for ids, am in data:
            model(input_ids=ids, attention_mask=am)
    r = open_capture(tmp_path)
    tok, idx = annotations.tokens(r), annotations.row_index(r)
    assert tok.dtype == torch.long and idx.dtype == torch.long
    assert torch.equal(tok, want_tok) and torch.equal(idx, want_idx)
    # every stored row is the hooked output at its (example, position)
    assert torch.allclose(r[LAYER].to_tensor(), want_rows, atol=1e-6)
    # the padding rows were never stored
    assert r.rows(LAYER) == sum(int(am.sum()) for _, am in data)


def test_host_capture_keeps_the_same_annotations():
    model, data = gpt2(), batches()
    want_tok, want_idx, _ = expected(data, hooked_outputs(model, data))
    with torch.no_grad(), capture(model, LAYER, mask="attention_mask") as rec:
        for ids, am in data:
            model(input_ids=ids, attention_mask=am)
    assert torch.equal(rec.tokens, want_tok) and torch.equal(rec.row_index, want_idx)


def test_annotate_keep_drops_bos_rows_and_stores_texts(tmp_path):
    model, data = gpt2(), batches(2)
    # keep: no BOS at position 0, no padding (the rule SAE pipelines want)
    keep_of = lambda ids, am: am.bool() & (torch.arange(7) > 0)  # noqa: E731
    want_tok, want_idx, want_rows = expected(data, hooked_outputs(model, data), keep_of)
    texts = [f"example {i} ünïcode" for i in range(6)]
    with torch.no_grad(), capture(model, LAYER, out=tmp_path) as rec:
        for b, (ids, am) in enumerate(data):
            rec.annotate(ids, keep_of(ids, am), texts=texts[3 * b : 3 * b + 3])
            model(input_ids=ids, attention_mask=am)
    r = open_capture(tmp_path)
    assert torch.equal(annotations.tokens(r), want_tok)
    assert torch.equal(annotations.row_index(r), want_idx)
    assert torch.allclose(r[LAYER].to_tensor(), want_rows, atol=1e-6)
    assert [annotations.text(r, i) for i in range(6)] == texts
    assert annotations.text(r, -1) == texts[-1]
    with pytest.raises(IndexError, match="6 texts"):
        annotations.text(r, 6)


def test_annotate_examples_give_the_global_index():
    emb = nn.Sequential(nn.Embedding(50, 4))
    ids = torch.tensor([[5, 6], [7, 8]])
    with capture(emb, "0") as rec:
        rec.annotate(ids, examples=torch.tensor([40, 41]))
        emb(ids)
    assert rec.row_index.tolist() == [[40, 0], [40, 1], [41, 0], [41, 1]]
    assert rec.tokens.tolist() == [5, 6, 7, 8]


def test_positions_last_gives_one_row_per_example(tmp_path):
    model, data = gpt2(), batches()
    outputs = hooked_outputs(model, data)
    with (
        torch.no_grad(),
        capture(model, LAYER, out=tmp_path, mask="attention_mask", positions="last"),
    ):
        for ids, am in data:
            model(input_ids=ids, attention_mask=am)
    r = open_capture(tmp_path)
    last = [am.sum(1) - 1 for _, am in data]
    want_tok = torch.cat([ids[torch.arange(3), p] for (ids, _), p in zip(data, last)])
    want_idx = torch.cat([torch.stack([torch.arange(3) + 3 * b, p], 1) for b, p in enumerate(last)])
    want_rows = torch.cat([o[torch.arange(3), p] for o, p in zip(outputs, last)])
    assert r.rows(LAYER) == 9
    assert torch.equal(annotations.tokens(r), want_tok)
    assert torch.equal(annotations.row_index(r), want_idx)
    assert torch.allclose(r[LAYER].to_tensor(), want_rows, atol=1e-6)


def test_resume_continues_the_example_numbering(tmp_path):
    model, data = gpt2(), batches(4)
    want_tok, want_idx, _ = expected(data, hooked_outputs(model, data))
    for run, part in enumerate((data[:2], data[2:])):  # two runs: the second resumes the first
        with torch.no_grad(), capture(model, LAYER, out=tmp_path, mask="attention_mask") as rec:
            assert rec.examples_done == 6 * run
            for ids, am in part:
                model(input_ids=ids, attention_mask=am)
    r = open_capture(tmp_path)
    assert torch.equal(annotations.tokens(r), want_tok)
    assert torch.equal(annotations.row_index(r), want_idx)


def test_compiled_model_keeps_the_same_annotations(tmp_path):
    model, data = gpt2(), batches(2)
    want_tok, want_idx, _ = expected(data, hooked_outputs(model, data))
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad(), capture(compiled, LAYER, out=tmp_path, mask="attention_mask"):
        for ids, am in data:
            compiled(input_ids=ids, attention_mask=am)
    r = open_capture(tmp_path)
    assert torch.equal(annotations.tokens(r), want_tok)
    assert torch.equal(annotations.row_index(r), want_idx)


def test_stores_without_annotations_say_so(tmp_path):
    net = nn.Sequential(nn.Linear(3, 2))
    with capture(net, "0", out=tmp_path, stats=False):
        net(torch.randn(4, 3))  # float inputs: no token ids to keep
    r = open_capture(tmp_path)
    assert annotations.tokens(r) is None and annotations.row_index(r) is None
    with pytest.raises(annotations.AnnotationMissingError, match="no texts"):
        annotations.text(r, 0)
    with pytest.raises(annotations.AnnotationMissingError, match=r"no statistics.*'0'"):
        annotations.stats(r, "0")


def test_layers_of_different_row_layouts_get_no_token_ids():
    model, data = gpt2(), batches(1)
    ids, _ = data[0]
    with torch.no_grad(), capture(model, LAYER) as rec:  # no mask: every token is a row
        model(input_ids=ids)
    assert torch.equal(rec.tokens, ids.reshape(-1))
    # the position embedding's output is [1, tokens, hidden]: its rows are not the batch's tokens
    with torch.no_grad(), capture(model, [LAYER, "transformer.wpe"]) as rec:
        model(input_ids=ids)
    assert rec.tokens is None and rec.row_index is None
    with torch.no_grad(), capture(model, LAYER, flatten=False) as rec:
        model(input_ids=ids)
    assert rec.tokens is None and rec.row_index is None  # rows are examples [tokens, hidden]


class PrefixModel(nn.Module):
    """Prepends two learned tokens (prefix tuning, soft prompts): its layers see more tokens
    than its ``input_ids`` has."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 4)
        self.prefix = nn.Parameter(torch.randn(1, 2, 4))
        self.lin = nn.Linear(4, 4)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids)
        return self.lin(torch.cat([self.prefix.expand(h.shape[0], -1, -1), h], 1))


@pytest.mark.parametrize("positions", [None, "last", 0])
@pytest.mark.parametrize("to", ["host", "disk"])
def test_layers_with_more_tokens_than_the_input_ids_are_captured_without_token_ids(
    tmp_path, to, positions
):
    """Token ids that do not match a layer's [batch, tokens] (and no mask) describe none of its
    rows: the rows are stored without token ids or row index. Building the row index from
    neither raised AttributeError from the commit hook, failing every forward."""
    torch.manual_seed(0)
    model = PrefixModel()
    ids = torch.randint(0, 20, (2, 5))
    seen = []
    h = model.lin.register_forward_hook(lambda _m, _a, o: seen.append(o.detach().clone()))
    with torch.no_grad():
        model(ids)
    h.remove()
    want = seen[0].reshape(-1, 4) if positions is None else seen[0][:, -1 if positions else 0]
    kw = {"out": tmp_path} if to == "disk" else {}
    with torch.no_grad(), capture(model, "lin", positions=positions, **kw) as rec:
        model(ids)
        model(ids)
    r = open_capture(tmp_path) if to == "disk" else rec
    rows = r["lin"].to_tensor() if to == "disk" else r["lin"]
    assert torch.equal(rows, torch.cat([want, want]))
    assert r.tokens is None and r.row_index is None
    assert all_hooks(model) == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"token_ids": torch.ones(2, 3)}, "integers"),
        ({"token_ids": torch.ones(3, dtype=torch.long)}, r"\[batch, tokens\]"),
        ({"token_ids": torch.ones(2, 3, dtype=torch.long), "keep": torch.ones(2, 4)}, "keep"),
        ({"token_ids": torch.ones(2, 3, dtype=torch.long), "texts": ["a"]}, "texts"),
        ({"token_ids": torch.ones(2, 3, dtype=torch.long), "examples": [1, 2, 3]}, "examples"),
    ],
)
def test_annotate_refuses_bad_arguments(kwargs, match):
    emb = nn.Sequential(nn.Embedding(5, 2))
    with capture(emb, "0") as rec, pytest.raises((TypeError, ValueError), match=match):
        rec.annotate(**kwargs)
    assert all_hooks(emb) == 0


def test_annotate_keep_on_a_compiled_model():
    emb = nn.Sequential(nn.Embedding(20, 3), nn.Linear(3, 3))
    compiled = torch.compile(emb, backend="eager")
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    keep = torch.tensor([[False, True, True], [True, True, False]])
    with torch.no_grad(), capture(compiled, ["0", "1"], stats=True) as rec:
        for _ in range(2):
            rec.annotate(ids, keep)
            compiled(ids)
    with torch.no_grad():
        want = emb(ids)[keep]
    assert torch.equal(rec["1"], torch.cat([want, want]))
    assert rec.tokens.tolist() == [2, 3, 4, 5] * 2
    assert rec.row_index.tolist() == [
        [0, 1],
        [0, 2],
        [1, 0],
        [1, 1],
        [2, 1],
        [2, 2],
        [3, 0],
        [3, 1],
    ]
    assert int(rec.stats("1")["count"]) == 8
