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


# -- issue 23, item 5: corpora that change, records that differ, early close ---------------------
def _datasetdict(path, texts):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts})}).save_to_disk(
        str(path)
    )


def test_datasetdict_fingerprint_follows_its_contents(tmp_path):
    """A DatasetDict folder keeps its arrow files under train/: the fingerprint reads them."""
    _datasetdict(tmp_path / "a", DOCS)
    _datasetdict(tmp_path / "b", DOCS)  # the same rows saved again: the same corpus
    _datasetdict(tmp_path / "c", [*DOCS[:-1], "another last document"])
    fp = {n: open_source(tmp_path / n).fingerprint() for n in "abc"}
    assert fp["a"] == fp["b"] and fp["a"] != fp["c"]
    # and in place: the folder rewritten with other rows is another corpus
    _datasetdict(tmp_path / "a", DOCS[::-1])
    assert open_source(tmp_path / "a").fingerprint() != fp["b"]


def _jsonl(path, column, values, bad_at, bad):
    """JSON lines with ``bad`` as record ``bad_at`` (from 1); a blank line after record 1, so
    record n is on line n + 1 from record 2 on."""
    with open(path, "w") as f:
        for n, v in enumerate(values, 1):
            f.write(json.dumps({column: bad if n == bad_at else v}) + "\n")
            if n == 1:
                f.write("\n")


TEXT_BAD = [(5, "an int (5)"), ({"a": 1}, "a dict"), (["the cat", "sat down"], "sentence pair")]
IDS_BAD = [
    ([5, 6.0], "a float (6.0)"),
    ([5, "7"], "a str ('7')"),
    ([5, True], "a bool (True)"),
    ("5 6", "a str ('5 6')"),
    ([5, -1], "token id -1 is negative"),
]


@pytest.mark.parametrize("bad_at", [3, 1500])  # in the first chunk (checked at open), or later
@pytest.mark.parametrize("context_size", [None, 4])
@pytest.mark.parametrize(
    "column, bad, message", [("text", *c) for c in TEXT_BAD] + [("input_ids", *c) for c in IDS_BAD]
)
def test_a_later_record_of_another_type_names_file_record_and_column(
    tmp_path, tok, bad_at, context_size, column, bad, message
):
    path = tmp_path / "c.jsonl"
    good = DOCS[1] if column == "text" else [5, 6, 7]
    _jsonl(path, column, [good] * 2000, bad_at, bad)
    with pytest.raises(SourceError) as e:
        for _ in open_source(path, tokenizer=tok, context_size=context_size):
            pass
    text = str(e.value)
    assert "\n" not in text and str(path) in text and message in text, text
    assert f"record {bad_at:,} (line {bad_at + 1:,}), column {column!r}" in text, text


def test_ids_at_or_above_the_vocabulary_size_are_refused(tmp_path, tok):
    rows = [[5, 6, 7]] * 1500 + [[5, 100]]  # record 1,501; parquet: checked without Python
    pq.write_table(pa.table({"input_ids": rows}), tmp_path / "ids.parquet")
    _jsonl(tmp_path / "ids.jsonl", "input_ids", rows, 0, None)
    import datasets

    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(tmp_path / "saved"))
    for name, where in [
        ("ids.parquet", "record 1,501,"),
        ("ids.jsonl", "record 1,501 (line"),
        ("saved", "record 1,501,"),
    ]:
        for context_size in (None, 4):
            ok = open_source(tmp_path / name, vocab_size=101, context_size=context_size)
            assert sum(len(b.examples) for b in ok) > 0
            with pytest.raises(SourceError) as e:
                list(open_source(tmp_path / name, vocab_size=100, context_size=context_size))
            text = str(e.value)
            assert where in text and "'input_ids'" in text and name in text, text
            assert "token id 100 is not below the vocabulary size 100" in text, text
    # text: what the tokenizer makes of each example is checked (another model's tokenizer)
    (tmp_path / "c.txt").write_text("\n".join(DOCS) + "\n")
    vocab = max(tok(DOCS[5])["input_ids"])  # example 5 holds the highest id of the first six
    assert max(i for d in DOCS[:5] for i in tok(d)["input_ids"]) < vocab
    for context_size in (None, 4):
        with pytest.raises(SourceError) as e:
            list(open_source(tmp_path / "c.txt", tokenizer=tok, vocab_size=vocab,
                             context_size=context_size))  # fmt: skip
        assert (
            f"example {5:,} (from 0), column 'text': the tokenizer gives token id {vocab}"
            in str(e.value)
        ), str(e.value)
    pq.write_table(pa.table({"input_ids": [[1], [2, -3]]}), tmp_path / "neg.parquet")
    with pytest.raises(SourceError, match=r"record 2, column 'input_ids': token id -3 is negative"):
        open_source(tmp_path / "neg.parquet")


def test_a_padding_id_outside_the_vocabulary_is_refused_for_token_id_corpora(tmp_path, tok):
    """One example a row pads with the tokenizer's pad id, token-id corpora too: an id the
    model's embedding lacks is refused naming it, before a forward looks it up."""
    pad = tok.pad_token_id
    rows = [[0, 0, 0], [0, 0]]  # below every vocabulary; padded to 3 tokens with the pad id
    pq.write_table(pa.table({"input_ids": rows}), tmp_path / "ids.parquet")
    ok = open_source(tmp_path / "ids.parquet", tokenizer=tok, vocab_size=pad + 1)
    (batch,) = list(ok)
    assert batch.input_ids[1].tolist() == [0, 0, pad] and pad > 0
    with pytest.raises(SourceError) as e:
        list(open_source(tmp_path / "ids.parquet", tokenizer=tok, vocab_size=pad))
    text = str(e.value)
    assert f"the tokenizer's padding token id {pad} is not below the vocabulary size" in text
    # packed contexts pad nothing: the same tokenizer is not refused there
    assert list(open_source(tmp_path / "ids.parquet", tokenizer=tok, vocab_size=pad,
                            context_size=2))  # fmt: skip


def test_a_later_parquet_file_that_differs_is_refused_at_open(tmp_path, tok):
    """Every file of a parquet folder is checked from its footer before anything runs."""
    table = pa.table({"text": DOCS})
    for name, write in [
        ("missing", lambda p: pq.write_table(pa.table({"body": DOCS}), p)),
        ("int64", lambda p: pq.write_table(pa.table({"text": list(range(5))}), p)),
        ("truncated", lambda p: p.write_bytes(_parquet_bytes(table)[:-100])),
    ]:
        folder = tmp_path / name
        folder.mkdir()
        pq.write_table(table, folder / "a.parquet")
        write(folder / "b.parquet")
        with pytest.raises(SourceError) as e:
            open_source(folder, tokenizer=tok)
        text = str(e.value)
        assert "\n" not in text and str(folder) in text and "file 'b.parquet'" in text, text
        assert {
            "missing": "has no column 'text' (its columns are: body), unlike a.parquet",
            "int64": "column 'text' holds int64, but in a.parquet it holds string",
            "truncated": "as parquet: ",
        }[name] in text, text


def _parquet_bytes(table):
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def test_a_damaged_row_group_names_the_file(tmp_path, tok):
    """A file whose footer reads but whose data does not: the error names the file."""
    data = bytearray(_parquet_bytes(pa.table({"text": DOCS})))
    data[4:200] = b"\xff" * 196  # the first column chunk (the footer at the end is intact)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.parquet").write_bytes(bytes(data))
    with pytest.raises(SourceError) as e:
        list(open_source(tmp_path / "d", tokenizer=tok))
    assert "file 'a.parquet'" in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_dictionary_and_string_view_text_columns_are_read(tmp_path, tok):
    pd = pytest.importorskip("pandas")
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"text": DOCS}), plain)
    pd.DataFrame({"text": pd.Categorical(DOCS)}).to_parquet(tmp_path / "cat.parquet")
    pq.write_table(pa.table({"text": pa.array(DOCS, pa.string_view())}), tmp_path / "sv.parquet")
    assert pa.types.is_dictionary(pq.read_schema(tmp_path / "cat.parquet").field("text").type)

    def batches(path, **kw):
        return [(b.input_ids.tolist(), b.texts) for b in open_source(path, tokenizer=tok, **kw)]

    for name in ("cat.parquet", "sv.parquet"):
        for kw in ({"batch_size": 16}, {"context_size": 16}):
            assert batches(tmp_path / name, **kw) == batches(plain, **kw), (name, kw)


def _source_threads():
    import threading

    return [t for t in threading.enumerate() if t.name == "pyhook-source"]


def _wait_gone(bound=10.0):
    import time

    end = time.monotonic() + bound
    while _source_threads() and time.monotonic() < end:
        time.sleep(0.01)
    return not _source_threads()


@pytest.mark.parametrize("fails", [False, True])
def test_closing_early_stops_the_prefetch_thread(tmp_path, tok, fails):
    """The consumer stops after one batch (a forward raised) while the thread waits to hand
    over its last item (the end, or an error): close() must free it, not leave it blocked on a
    full queue for ever."""
    import threading

    assert _wait_gone()
    pq.write_table(pa.table({"text": DOCS[:30]}), tmp_path / "c.parquet")
    src = open_source(tmp_path / "c.parquet", tokenizer=tok, batch_size=10, prefetch=2)
    produced = threading.Event()
    batches = src.batches

    def three_then_end():
        yield from batches()  # 3 batches of 10
        produced.set()
        if fails:
            raise SourceError("a damaged record after the last batch")

    src.batches = three_then_end
    it = iter(src)
    next(it)  # the thread fills the queue (2) with the rest, then has the end to hand over
    assert produced.wait(60)
    assert len(_source_threads()) == 1
    it.close()
    assert _wait_gone(), "the prefetch thread is still there after close()"
