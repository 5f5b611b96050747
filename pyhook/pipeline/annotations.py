"""Token bookkeeping and statistics of a capture on disk, read from its reserved tensors.

A capture made by :func:`pyhook.capture.capture` keeps, next to each layer's rows, reserved
tensors (names starting with ``__``; the format is in ``docs/store-format.md``):

* ``__token_ids__`` (int64 ``[rows]``) and ``__row_index__`` (int64 ``[rows, 2]``: example,
  position): which token each row is, aligned with every layer's rows;
* ``__text_lengths__``/``__text_bytes__``: the examples' utf-8 texts, when they were given;
* ``__stats__.<layer>`` (float64 ``[batches, 2 + 2*D]``): per-batch count, sum of row norms,
  mean and M2, merged here with Chan's parallel formula (exact across shards, resumes, ranks).

The functions take a :class:`~pyhook.store.CaptureReader`: :func:`tokens`, :func:`row_index`,
:func:`text`, :func:`stats`, and :func:`format_stats` (the table ``pyhook inspect`` prints).
Stores written before these fields existed still open: :func:`tokens`/:func:`row_index` return
None and :func:`text`/:func:`stats` raise :class:`AnnotationMissingError`.

Example::

    >>> import tempfile, torch, transformers
    >>> from pyhook.capture import capture
    >>> from pyhook.store import open_capture
    >>> from pyhook import annotations
    >>> gpt = transformers.GPT2Model(transformers.GPT2Config(
    ...     n_layer=1, n_embd=8, n_head=2, vocab_size=20, n_positions=8,
    ...     bos_token_id=0, eos_token_id=0)).eval()
    >>> ids = torch.tensor([[1, 2, 3], [4, 5, 6]]); am = torch.tensor([[1, 1, 1], [1, 1, 0]])
    >>> out = tempfile.mkdtemp()
    >>> with torch.no_grad(), capture(gpt, "h.0", out=out, mask="attention_mask", stats=True,
    ...                                 tokens=True) as rec:
    ...     _ = gpt(input_ids=ids, attention_mask=am)
    >>> r = open_capture(out)
    >>> annotations.tokens(r).tolist(), annotations.row_index(r)[-1].tolist()
    ([1, 2, 3, 4, 5], [1, 1])
    >>> s = annotations.stats(r, "h.0"); int(s["count"]), tuple(s["mean"].shape)
    (5, (8,))
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = [
    "AnnotationMissingError",
    "completion",
    "format_stats",
    "generated",
    "merge_stats",
    "row_index",
    "stats",
    "text",
    "tokens",
]

TOKEN_IDS = "__token_ids__"
ROW_INDEX = "__row_index__"
TEXT_LENGTHS = "__text_lengths__"
TEXT_BYTES = "__text_bytes__"
TEXT_EXAMPLES = "__text_examples__"
STATS_PREFIX = "__stats__."
GENERATED = "__generated__"  # bool [rows]: the row's token was generated (capture in generate)
TEXT_PROMPT_BYTES = "__text_prompt_bytes__"  # int64 [texts]: utf-8 bytes of the prompt


class AnnotationMissingError(LookupError):
    """The capture holds no such annotation (an older store, or a capture made without it).

    Example::

        >>> from pyhook.annotations import AnnotationMissingError
        >>> issubclass(AnnotationMissingError, LookupError)
        True
    """


def _reserved(name: str) -> bool:
    return name.startswith("__")


def _read(reader: Any, name: str) -> torch.Tensor | None:
    """All rows of a reserved tensor, or None when the capture has none."""
    try:
        data = reader.layer(name)
    except KeyError:
        return None
    return data.to_tensor()


def _data_layers(reader: Any) -> list[str]:
    return [n for n in reader.layers if not _reserved(n)]


def _aligned(reader: Any, what: str, t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    for layer in _data_layers(reader):
        if reader.rows(layer) != t.shape[0]:
            raise AnnotationMissingError(
                f"{what} of {reader.path!r} cover {t.shape[0]} rows but layer {layer!r} has "
                f"{reader.rows(layer)}: part of the capture was made without them (or with "
                "layers of different row layouts), so they cannot be matched to the rows"
            )
    return t


def tokens(reader: Any) -> torch.Tensor | None:
    """The token id of every row (int64 ``[rows]``, aligned with each layer's rows), or None
    when the capture keeps no token ids. Example: see the module docstring."""
    return _aligned(reader, "token ids", _read(reader, TOKEN_IDS))


def row_index(reader: Any) -> torch.Tensor | None:
    """``(example, position)`` of every row (int64 ``[rows, 2]``), or None when absent.

    The example is the index :meth:`~pyhook.capture.Recorder.annotate` gave, or, without it,
    the example's place in the data stream of its rank (counted from 0 by each rank).
    Example: see the module docstring."""
    return _aligned(reader, "row indices", _read(reader, ROW_INDEX))


_TEXT_CACHE: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def text(reader: Any, example: int) -> str:
    """The text of stored example ``example`` (utf-8 decoded), when the capture kept texts
    (``Recorder.annotate(..., texts=...)``, the ``pyhook capture`` command on text inputs).

    Example::

        >>> import tempfile, torch
        >>> from pyhook.capture import capture
        >>> from pyhook.store import open_capture
        >>> from pyhook.annotations import text
        >>> emb = torch.nn.Sequential(torch.nn.Embedding(10, 2)); out = tempfile.mkdtemp()
        >>> with capture(emb, "0", out=out) as rec:
        ...     rec.annotate(torch.tensor([[1, 2], [3, 4]]), texts=["héllo", "world"])
        ...     _ = emb(torch.tensor([[1, 2], [3, 4]]))
        >>> text(open_capture(out), 0)
        'héllo'
    """
    offsets, example = _text_slot(reader, example)
    lo, hi = int(offsets[example]), int(offsets[example + 1])
    raw = reader.layer(TEXT_BYTES)[lo:hi] if hi > lo else torch.empty(0, dtype=torch.uint8)
    try:
        return bytes(raw.tolist()).decode("utf-8")
    except UnicodeDecodeError as e:
        path = _TEXT_CACHE[reader][2][example]
        raise _damaged(
            path, f"text {example} in {TEXT_BYTES!r} is not utf-8 ({e.reason})"
        ) from None


def _damaged(path: str | None, what: str) -> Exception:
    from .format import CaptureDamagedError

    return CaptureDamagedError(
        f"{path}: {what} (the shard is damaged or forged; pyhook verify checks the texts)", path
    )


def _text_shards(reader: Any, lengths: torch.Tensor) -> list[str | None]:
    """The shard file of each stored text, after checking each shard's texts' lengths against
    its text bytes (>= 0, adding up to them): CaptureDamagedError naming the shard otherwise."""
    shards = getattr(reader, "_shards", None)
    if shards is None:  # (a reader without shards: no file to name, nothing to check per shard)
        return [None] * lengths.numel()
    owner: list[str | None] = []
    at = 0
    for m in shards:
        rows = m.entry["rows"]
        n, size = int(rows.get(TEXT_LENGTHS, 0)), int(rows.get(TEXT_BYTES, 0))
        mine = lengths[at : at + n].to(torch.long)
        at += n
        path = getattr(m, "path", None)
        if n and int(mine.min()) < 0:
            raise _damaged(path, f"a text has length {int(mine.min())} in {TEXT_LENGTHS!r}")
        if (n and int(mine.max()) > size) or int(mine.sum()) != size:
            raise _damaged(
                path,
                f"its texts' lengths ({TEXT_LENGTHS!r}) add up to {int(mine.sum())} bytes, "
                f"{TEXT_BYTES!r} holds {size}",
            )
        owner += [path] * n
    return owner


def _text_slot(reader: Any, example: int) -> tuple[torch.Tensor, int]:
    """The texts' byte offsets and where example ``example``'s text is stored."""
    cached = _TEXT_CACHE.get(reader)
    if cached is None:
        lengths = _read(reader, TEXT_LENGTHS)
        if lengths is None:
            raise AnnotationMissingError(
                f"capture {reader.path!r} keeps no texts (made from token ids, or by a pyhook "
                "without text bookkeeping)"
            )
        owner = _text_shards(reader, lengths)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.to(torch.long).cumsum(0)])
        ids = _read(reader, TEXT_EXAMPLES)  # absent in stores written before it existed
        where = None
        if ids is not None and ids.numel() == lengths.numel():
            where = {int(e): i for i, e in enumerate(ids.tolist())}
        cached = _TEXT_CACHE[reader] = (offsets, where, owner)
    offsets, where, _ = cached
    n = offsets.shape[0] - 1
    if isinstance(example, bool) or not isinstance(example, int):
        example = int(torch.as_tensor(example))
    if where is not None and example < 0:  # from the end, in storage order (as a list)
        if example < -n:
            raise IndexError(f"example {example} out of range: the capture keeps {n} texts")
        example += n
    elif where is not None:  # example indices as row_index gives them
        if example not in where:
            raise IndexError(
                f"example {example} out of range: the capture keeps no text for it ({n} texts)"
            )
        example = where[example]
    else:  # older stores: texts in storage order
        if not -n <= example < n:
            raise IndexError(f"example {example} out of range: the capture keeps {n} texts")
        example %= n
    return offsets, example


def completion(reader: Any, example: int) -> str:
    """The completion alone of example ``example`` of a capture made during ``generate`` (its
    text without the prompt; :func:`text` gives both).

    Example::

        >>> import tempfile, torch
        >>> from pyhook.store import ShardWriter, open_capture
        >>> out = tempfile.mkdtemp()
        >>> with ShardWriter(out) as w:
        ...     w.add({"x": torch.zeros(1, 1), "__text_lengths__": torch.tensor([7]),
        ...            "__text_bytes__": torch.tensor(list(b"Hi, you"), dtype=torch.uint8),
        ...            "__text_prompt_bytes__": torch.tensor([3])}, examples=1)
        >>> completion(open_capture(out), 0)
        ' you'
    """
    prompts = _read(reader, TEXT_PROMPT_BYTES)
    if prompts is None:
        raise AnnotationMissingError(
            f"capture {reader.path!r} keeps no completions (it was not made during generate)"
        )
    full = text(reader, example).encode("utf-8")
    _, slot = _text_slot(reader, example)
    cut = int(prompts[slot]) if slot < prompts.numel() else -1
    try:
        if not 0 <= cut <= len(full):
            raise ValueError(f"a prompt of {cut} bytes in a text of {len(full)}")
        return full[cut:].decode("utf-8")
    except (ValueError, UnicodeDecodeError) as e:
        path = _TEXT_CACHE[reader][2][slot]
        raise _damaged(
            path,
            f"text {slot}: its prompt's bytes ({TEXT_PROMPT_BYTES!r}) do not split it into "
            f"utf-8 prompt and completion ({e})",
        ) from None


def generated(reader: Any) -> torch.Tensor | None:
    """Which rows hold generated tokens (bool ``[rows]``, aligned with each layer's rows), for a
    capture made during ``generate``; None for any other capture (older stores included).

    Example::

        >>> import tempfile, torch
        >>> from pyhook.store import ShardWriter, open_capture
        >>> out = tempfile.mkdtemp()
        >>> with ShardWriter(out) as w:
        ...     w.add({"x": torch.zeros(2, 1)}, examples=1)
        >>> generated(open_capture(out)) is None
        True
    """
    t = _read(reader, GENERATED)
    return None if t is None else _aligned(reader, "generated flags", t.bool())


def merge_stats(rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Merge per-batch statistics rows ``[k, 2 + 2*D]`` (count, sum of row norms, mean, M2)
    with Chan's parallel formula: ``count``, ``mean``, ``var`` (population), ``norm_mean``.

    Example::

        >>> import torch
        >>> from pyhook._record import batch_stats
        >>> from pyhook.annotations import merge_stats
        >>> x = torch.randn(10, 3, dtype=torch.float64)
        >>> s = merge_stats(torch.cat([batch_stats(x[:4]), batch_stats(x[4:])]))
        >>> var, mean = torch.var_mean(x, 0, correction=0)
        >>> torch.allclose(s["mean"], mean), torch.allclose(s["var"], var)
        (True, True)
    """
    rows = rows.to(torch.float64)
    d = (rows.shape[1] - 2) // 2
    rows = rows[rows[:, 0] > 0]
    counts = rows[:, 0]
    n = counts.sum()
    if rows.shape[0] == 0:
        nan = torch.full((d,), float("nan"), dtype=torch.float64)
        return {
            "count": n,
            "mean": nan,
            "var": nan.clone(),
            "norm_mean": n.new_tensor(float("nan")),
        }
    means, m2 = rows[:, 2 : 2 + d], rows[:, 2 + d :]
    mean = (counts[:, None] * means).sum(0) / n
    m2_total = m2.sum(0) + (counts[:, None] * (means - mean) ** 2).sum(0)
    return {
        "count": n,
        "mean": mean,
        "var": m2_total / n,
        "norm_mean": rows[:, 1].sum() / n,
    }


def stats(reader: Any, layer: str) -> dict[str, torch.Tensor]:
    """Statistics of ``layer``'s rows, computed while capturing: ``count``, per-dimension
    ``mean`` and ``var`` (population variance, over each row flattened), ``norm_mean`` (mean
    L2 norm of the rows); float64 tensors, exact over every shard, resume and rank.

    Raises :class:`AnnotationMissingError` when the capture has no statistics for ``layer``
    (made with ``stats=False`` or by an older pyhook), or when they do not cover every row.
    Example: see the module docstring.
    """
    if layer not in _data_layers(reader):
        raise KeyError(f"layer {layer!r} is not in this capture; it holds {_data_layers(reader)}")
    rows = _read(reader, STATS_PREFIX + layer)
    if rows is None:
        raise AnnotationMissingError(
            f"capture {reader.path!r} has no statistics for layer {layer!r} (captured with "
            "stats=False, or by a pyhook that did not compute them)"
        )
    merged = merge_stats(rows)
    if int(merged["count"]) != reader.rows(layer):
        raise AnnotationMissingError(
            f"the statistics of layer {layer!r} cover {int(merged['count'])} of its "
            f"{reader.rows(layer)} rows: part of the capture was made with stats=False"
        )
    return merged


def format_stats(reader: Any) -> str:
    """A table of every layer's statistics (what ``pyhook inspect`` shows), one line per layer:
    rows, width, mean of the per-dimension means, mean per-dimension std, mean row norm.

    Example::

        >>> import tempfile, torch
        >>> from pyhook.capture import capture
        >>> from pyhook.store import open_capture
        >>> from pyhook.annotations import format_stats
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 3)); out = tempfile.mkdtemp()
        >>> with capture(net, "0", out=out, stats=True) as rec:
        ...     _ = net(torch.randn(4, 2))
        >>> [c.strip() for c in format_stats(open_capture(out)).splitlines()[0].split("  ") if c]
        ['layer', 'rows', 'width', 'mean', 'dim std', 'norm']
    """
    # "dim std": the mean over dimensions of each dimension's std (not the std of all values)
    lines = [("layer", "rows", "width", "mean", "dim std", "norm")]
    missing = []
    for layer in _data_layers(reader):
        try:
            s = stats(reader, layer)
        except AnnotationMissingError:
            missing.append(layer)
            continue
        lines.append(
            (
                layer,
                str(int(s["count"])),
                str(int(s["mean"].numel())),
                f"{float(s['mean'].mean()):.4g}",
                f"{float(s['var'].sqrt().mean()):.4g}",
                f"{float(s['norm_mean']):.4g}",
            )
        )
    widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
    out = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
        ).rstrip()
        for row in lines
    ]
    if len(lines) == 1:
        out = []
    if missing:
        out.append(f"no statistics for: {', '.join(missing)}")
    return "\n".join(out)
