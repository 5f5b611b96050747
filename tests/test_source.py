"""pyhook.source: every input kind reads the same examples; packing, keep masks, shares and resume
checked against packing written out by hand here."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from _models import word_tokenizer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from pyhook.source import SourceError, open_source  # noqa: E402

DOCS = [f"doc {i} says {' '.join(['word'] * (i % 7))} end" for i in range(200)]


@pytest.fixture(scope="module")
def tok():
    """A real tokenizer that needs no download: a WordLevel one trained here, with GPT-2's
    special-token layout (one <|endoftext|> that is BOS, EOS and pad)."""
    return word_tokenizer(DOCS)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """The same documents in every supported kind (plus an unrelated column)."""
    import datasets

    d = tmp_path_factory.mktemp("corpora")
    (d / "c.txt").write_text("\n".join(DOCS[:100]) + "\n\n" + "\n".join(DOCS[100:]) + "\n")
    with open(d / "c.jsonl", "w") as f:
        for i, t in enumerate(DOCS):
            f.write(json.dumps({"id": i, "text": t}) + "\n")
    (d / "c.json").write_text(json.dumps([{"text": t} for t in DOCS]))
    with open(d / "c.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "text"])
        w.writerows(enumerate(DOCS))
    table = pa.table({"id": list(range(len(DOCS))), "text": DOCS})
    pq.write_table(table, d / "c.parquet", row_group_size=37)
    (d / "parts").mkdir()
    pq.write_table(table.slice(0, 120), d / "parts" / "a.parquet")
    pq.write_table(table.slice(120), d / "parts" / "b.parquet")
    datasets.Dataset.from_dict({"text": DOCS, "id": list(range(len(DOCS)))}).save_to_disk(
        str(d / "saved")
    )
    return d


KINDS = ["c.txt", "c.jsonl", "c.json", "c.csv", "c.parquet", "parts", "saved"]


@pytest.mark.parametrize("name", KINDS)
def test_every_kind_reads_the_same_examples(corpora, tok, name):
    src = open_source(corpora / name, tokenizer=tok, batch_size=16, max_length=64)
    assert src.count() == len(DOCS)
    texts, idx = [], []
    for b in src:
        texts += b.texts
        idx += b.examples.tolist()
        # one example per row: ids of that text, padded; keep = attention mask (no exclusion)
        for row, t in enumerate(b.texts):
            want = tok(t)["input_ids"]
            assert b.input_ids[row, : len(want)].tolist() == want
            assert b.attention_mask[row].sum() == len(want)
            assert torch.equal(b.keep[row], b.attention_mask[row].bool())
    assert texts == DOCS and idx == list(range(len(DOCS)))


def hand_packed(tok, n):
    """The packing written out by hand: <|endoftext|> before each document (GPT-2: BOS = EOS, so
    once), the stream cut into full contexts of n tokens."""
    stream = []
    for t in DOCS:
        stream += [tok.bos_token_id, *tok(t, add_special_tokens=False)["input_ids"]]
    return [stream[i : i + n] for i in range(0, len(stream) - n + 1, n)]


@pytest.mark.parametrize("name", ["c.txt", "c.parquet", "saved", "c.csv"])
def test_packed_contexts_match_hand_packing(corpora, tok, name):
    want = hand_packed(tok, 16)
    src = open_source(corpora / name, tokenizer=tok, context_size=16, batch_size=7)
    got, idx = [], []
    for b in src:
        assert b.input_ids.shape[1] == 16 and b.attention_mask.all()
        assert torch.equal(b.keep, b.input_ids != tok.bos_token_id)  # specials not kept
        got += b.input_ids.tolist()
        idx += b.examples.tolist()
        assert b.texts == tok.batch_decode(b.input_ids.tolist())
    assert got == want and idx == list(range(len(want)))
    est = src.estimate()
    assert est["exact"] and est["examples"] == len(want)
    assert est["rows"] == sum(int((torch.tensor(c) != tok.bos_token_id).sum()) for c in want)


def test_keep_special_tokens_when_asked(corpora, tok):
    src = open_source(
        corpora / "c.parquet", tokenizer=tok, context_size=16, exclude_special_tokens=False
    )
    assert all(b.keep.all() for b in src)
    assert src.estimate()["rows"] == src.estimate()["tokens"]


@pytest.mark.parametrize("context_size", [None, 16])
@pytest.mark.parametrize("world", [2, 3])
def test_rank_shares_and_resume_cover_everything_once(corpora, tok, context_size, world):
    def ids(**kw):
        src = open_source(
            corpora / "c.parquet", tokenizer=tok, context_size=context_size, batch_size=5, **kw
        )
        return [  # (example, its unpadded ids): padding depends on the batch's longest row
            (int(e), r[: int(m.sum())])
            for b in src
            for e, r, m in zip(b.examples, b.input_ids.tolist(), b.attention_mask)
        ]

    whole = ids()
    shares = [ids(rank=r, world_size=world) for r in range(world)]
    assert sorted(x for s in shares for x in s) == sorted(whole)
    # resume: skip the first 3 of rank 1's share, get exactly the rest of it
    assert ids(rank=1, world_size=world, skip=3) == shares[1][3:]
    assert ids(limit=10) == whole[:10]


def test_pretokenised_column_is_used_as_is(tmp_path):
    rows = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    pq.write_table(pa.table({"input_ids": rows}), tmp_path / "ids.parquet")
    src = open_source(tmp_path / "ids.parquet", batch_size=8)  # no tokenizer needed
    assert src.pretokenized and src.column == "input_ids"
    b = next(iter(src))
    assert b.input_ids[2].tolist() == [10, 11, 12, 13] and b.attention_mask[1].tolist() == [
        1,
        1,
        0,
        0,
    ]
    assert b.texts is None and b.keep.sum() == 9
    packed = next(iter(open_source(tmp_path / "ids.parquet", context_size=3)))
    assert packed.input_ids.tolist() == [[5, 6, 7], [8, 9, 10], [11, 12, 13]]


def test_bad_inputs_are_one_line_errors(corpora, tok, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "folder").mkdir()
    (tmp_path / "empty.parquet").touch()
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "norows.parquet")
    cases = [
        (dict(path=corpora / "c.parquet", text_column="body"), "its columns are: id, text"),
        (dict(path=corpora / "c.csv", text_column="id"), "holds int64, not text"),
        (dict(path=corpora / "c.jsonl", text_column="id"), "holds int values, not text"),
        (dict(path=tmp_path / "empty.jsonl"), "is empty"),
        (dict(path=tmp_path / "empty.parquet"), "cannot read --input"),
        (dict(path=tmp_path / "norows.parquet"), "holds no rows"),
        (dict(path=tmp_path / "missing.txt"), "No such file"),
        (dict(path=tmp_path / "folder"), "neither a datasets.save_to_disk folder"),
    ]
    for kw, message in cases:
        with pytest.raises(SourceError) as e:
            open_source(kw.pop("path"), tokenizer=tok, **kw)
        assert message in str(e.value) and "\n" not in str(e.value), (message, str(e.value))
    short = open_source(corpora / "c.txt", tokenizer=tok, context_size=100_000)
    with pytest.raises(SourceError, match="fewer than one context of --context-size 100000"):
        short.first_context_or_error()


def test_parquet_is_read_in_bounded_chunks(tmp_path, tok, monkeypatch):
    """Laziness: the parquet reader is asked for record batches, never for the whole table."""
    pq.write_table(pa.table({"text": DOCS * 20}), tmp_path / "big.parquet", row_group_size=500)

    def whole(*a, **k):
        raise AssertionError("the whole table was read")

    monkeypatch.setattr(pq, "read_table", whole)
    monkeypatch.setattr(pq.ParquetFile, "read", whole)
    src = open_source(tmp_path / "big.parquet", tokenizer=tok, context_size=32, batch_size=64)
    sizes = [len(c) for c in src._chunks()]
    assert max(sizes) <= 1024 and sum(sizes) == 20 * len(DOCS)
    total = 20 * sum(1 + len(tok(t, add_special_tokens=False)["input_ids"]) for t in DOCS)
    assert sum(len(b.examples) for b in src) == total // 32
