"""Feeding a trainer from a capture: a ``torch.utils.data`` dataset and a Hugging Face export.

Index:

* :class:`CaptureDataset` - an ``IterableDataset`` of ``{layer: rows}`` batches (rows of several
  layers of the same tokens together, token ids alongside), shuffled at token level across the
  whole capture, split exactly once per epoch over ranks x DataLoader workers;
* :func:`dataset` - the same, as the function behind ``reader.dataset(...)``;
* :func:`to_hf_dataset` - a ``datasets.Dataset`` of the rows (one row per token, or one per
  context in SAELens' cached-activations layout), with token ids when the capture has them;
* :func:`shuffle_quality` - how well a stream of batches is mixed (used by the benchmark).

Batches are assembled inside the dataset (a plain ``DataLoader(ds, batch_size=None, ...)``
consumes them) by :func:`pyhook._backend.gather_rows`, which copies the rows of a batch from the
memory-mapped shards (with a second thread only when a core is free; rows not in the page cache
are read in ascending file order) and returns memory the caller owns.
See docs/training.md for the shuffling trade-off and measured throughput.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from .. import _backend
from .._backend import gather_rows, gather_rows_into
from . import _ring, _seqread
from . import reader as _reader
from .encoding import DecodedSource
from .encoding import chunk_cache_bytes as _chunk_cache_bytes
from .format import parse_dtype
from .reader import open_capture

__all__ = ["CaptureDataset", "dataset", "to_hf_dataset", "shuffle_quality"]

# The reserved tensor of the shared store format holding each row's token id.
TOKEN_IDS = "__token_ids__"
# Each row's flag of a capture made during generate (bool): its token was generated.
GENERATED = "__generated__"
# Each row's (example or context, position) (int64 [rows, 2]), as stream() yields it.
ROW_INDEX = "__row_index__"
_EXTRA_KEYS = {TOKEN_IDS: "tokens", GENERATED: "generated", ROW_INDEX: "row_index"}
_SHUFFLES = (False, True, "global", "chunks")


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _open(path: str) -> Any:
    return open_capture(path)


def _parts(data: Any, dtype: torch.dtype | None = None) -> Any:
    """The zero-copy (memory-mapped) per-shard tensors of one ``LayerData``, in order.

    They never leave this module: every batch is a fresh copy made by ``gather_rows``.
    ``LayerData`` keeps its memory maps private (its public ``parts`` returns copies, which
    would read the whole layer for every batch), hence the private attribute. A compact
    store's layer gives its :class:`~pyhook.pipeline.encoding.DecodedSource` instead, which
    decodes (dequantises, decompresses) inside its own gather, straight into ``dtype`` when
    one is asked for; a plain layer read as another ``dtype`` gives a :class:`_CastSource`.
    """
    if getattr(data, "encoding", None) is not None:
        return (data if dtype in (None, data.dtype) else data.astype(dtype)).source()
    parts = list(data._parts)
    if not parts:
        parts = [torch.empty((0, *tuple(data.shape)[1:]), dtype=data.dtype)]
    if dtype not in (None, data.dtype):
        return _CastSource(parts, dtype)
    return parts


class _CastSource(DecodedSource):
    """A plain layer read as another floating dtype (``CaptureDataset(dtype=...)``): gathered
    as stored, then cast into the batch."""

    __slots__ = ("_dtype", "parts")

    def __init__(self, parts: list[torch.Tensor], dtype: torch.dtype) -> None:
        self.parts, self._dtype = parts, dtype

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def row_shape(self) -> tuple[int, ...]:
        return tuple(self.parts[0].shape[1:])

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        return gather_rows(self.parts, idx).to(self._dtype)

    def gather_into(self, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(gather_rows(self.parts, idx))


class _Fused:
    """A batch of a compact store read in one native call: every quantised layer's rows
    gathered from the memory maps and dequantised into its output (``dequant_rows_many``),
    plain keys (token ids, plain layers) in one more call (``gather_rows_many``)."""

    __slots__ = ("counts", "dtypes", "keys", "order", "plain", "q", "scales", "shapes")

    def __init__(self, sources: dict[str, Any]) -> None:
        self.q: list[torch.Tensor] = []
        self.scales: list[torch.Tensor] = []
        self.counts: list[int] = []
        self.keys: list[str] = []
        self.dtypes: list[torch.dtype] = []
        self.shapes: list[tuple[int, ...]] = []
        flat: list[torch.Tensor] = []
        counts: list[int] = []
        keys: list[str] = []
        for name, p in sources.items():
            if isinstance(p, DecodedSource):
                mapped = p.layer._mapped_quantised()
                assert mapped is not None  # checked by _fused_plan
                parts, scales = mapped
                self.q += parts
                self.scales += scales
                self.counts.append(len(parts))
                self.keys.append(_key(name))
                self.dtypes.append(p.dtype)
                self.shapes.append(tuple(p.row_shape))
            else:
                flat += p
                counts.append(len(p))
                keys.append(_key(name))
        self.plain = (flat, counts, keys) if keys else None
        self.order = [_key(n) for n in sources]

    def batch(
        self, idx: torch.Tensor, out: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """The batch ``idx`` as a new dict of pooled tensors, or written into ``out``'s."""
        if out is not None:
            _backend._dequant_many_direct_into(
                self.q, self.scales, self.counts, idx, [out[k] for k in self.keys]
            )
            if self.plain is not None:
                flat, counts, keys = self.plain
                _backend._gather_many_direct_into(flat, counts, idx, [out[k] for k in keys])
            return out
        if len(set(self.dtypes)) == 1:
            rows = _backend._dequant_many_direct(
                self.q, self.scales, self.counts, idx, self.dtypes[0]
            )
        else:  # layers read in different dtypes: outputs made here, one call still
            rows = [
                _backend.empty_host((idx.numel(), *shape), dtype)
                for shape, dtype in zip(self.shapes, self.dtypes)
            ]
            _backend._dequant_many_direct_into(self.q, self.scales, self.counts, idx, rows)
        got = dict(zip(self.keys, rows))
        if self.plain is not None:
            flat, counts, keys = self.plain
            got.update(zip(keys, _backend._gather_many_direct(flat, counts, idx)))
        return {k: got[k] for k in self.order}


def _fused_plan(sources: dict[str, Any]) -> _Fused | None:
    """A :class:`_Fused` reader of ``sources`` when every layer is either a local quantised
    (not compressed) layer of a compact store or plain memory maps the native gather takes, and
    at least one is quantised; None otherwise (each source then reads its own rows)."""
    if not _backend.native_available():
        return None
    quantised = False
    for p in sources.values():
        if isinstance(p, DecodedSource):
            if type(p) is not DecodedSource or p.layer._mapped_quantised() is None:
                return None
            quantised = True
        elif not _backend._direct_gather_ok(p):
            return None
    return _Fused(sources) if quantised else None


def _check_layers(reader: Any, layers: str | Sequence[str] | None, tokens: bool) -> list[str]:
    # Names starting with "__" are the store's reserved tensors (token ids, statistics...).
    known = [n for n in reader.layers if not n.startswith("__")]
    names = known if layers is None else [layers] if isinstance(layers, str) else list(layers)
    if not names:
        raise ValueError(f"layers: ask for at least one layer of {known}")
    for name in names:
        if not isinstance(name, str) or name not in known:
            raise KeyError(
                f"layer {name!r} is not in the capture {reader.path!r}; it holds {known}"
                + ("; token ids come with tokens=True" if name == TOKEN_IDS else "")
            )
    if len(set(names)) != len(names):
        raise ValueError(f"layers: {names} names a layer twice")
    counts = {n: len(reader.layer(n)) for n in names}
    if tokens:
        try:
            tok = reader.layer(TOKEN_IDS)
        except KeyError:
            raise ValueError(
                f"tokens=True, but the capture {reader.path!r} holds no token ids (they are "
                "recorded when every layer stores one row per kept token: capture with "
                "`input_ids` or Recorder.annotate); pass tokens=False"
            ) from None
        counts[TOKEN_IDS] = len(tok)
    if len(set(counts.values())) > 1:
        raise ValueError(
            f"layers have different row counts {counts}: rows of several layers are batched "
            "together only when row i of each comes from the same token; read them separately"
        )
    return names


def _key(name: str) -> str:
    """The batch key of a source: token ids come as ``"tokens"``."""
    return _EXTRA_KEYS.get(name, name)


def _resolve_ranks(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if world_size is None or rank is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
        else:
            rank = 0 if rank is None else rank
            world_size = 1 if world_size is None else world_size
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in 0..{world_size - 1}, got {rank!r}")
    return rank, world_size


class _Training:
    """The functions :class:`~pyhook.store.CaptureReader` delegates to (see the end of this
    module)."""

    __slots__ = ("dataset", "to_hf_dataset")

    def __init__(self, dataset: Any, to_hf_dataset: Any) -> None:
        self.dataset = dataset
        self.to_hf_dataset = to_hf_dataset


class CaptureDataset(IterableDataset):
    """``{layer: rows}`` batches of a capture for a ``DataLoader(ds, batch_size=None, ...)``.

    Each epoch visits every row exactly once across ``world_size`` ranks x ``num_workers``
    DataLoader workers: batch ``b`` of the epoch goes to rank ``b % world_size`` and, within a
    rank, to its workers in turn, so a DataLoader yields the same batches in the same order
    whatever ``num_workers`` is. Rank and world size come from the arguments, else from an
    initialised ``torch.distributed``, else ``0`` and ``1``.

    Shuffling (``shuffle=``):

    * ``True`` / ``"global"``: a permutation of all rows, drawn from ``(seed, epoch)``: every
      batch is a uniform sample of the whole capture. Each batch's rows are copied in
      ascending file order by the native gather (sorted, then written to their shuffled
      positions), which runs at memory speed from the page cache; from disk it reads rows
      scattered over the files (one page each).
    * ``"chunks"``: the rows are cut into chunks of ``chunk_rows`` consecutive rows, the chunks
      are put in random order, and the rows of every ``buffer_chunks`` consecutive chunks (a
      window) are shuffled together, like a shuffle buffer of that many rows. A batch then
      holds rows of about ``buffer_chunks`` chunks only: fewer, larger regions of the files to
      read from a cold disk, at the price of a less mixed batch (docs/training.md measures both).
    * ``False``: batches of consecutive rows, in capture order (in the main process, batches
      not in the page cache are read with ``preadv`` rather than through the memory maps).

    ``set_epoch(e)`` changes the permutation reproducibly (the same ``seed`` and ``e`` give the
    same batches). ``drop_last=False`` serves every row (the last batch may be short and a rank
    may get one batch more than another); ``drop_last=True`` gives every rank the same number
    of full batches (what DistributedDataParallel needs) and skips the few rows left over,
    different ones each epoch when shuffling. ``tokens=True`` adds ``"tokens"`` (int64 token
    ids of the rows); ``with_index=True`` adds ``"index"`` (the rows' global numbers);
    ``generated=True`` adds ``"generated"`` (bool: the row's token was generated, for a capture
    made during ``generate``); ``row_index=True`` adds ``"row_index"`` (int64 ``[n, 2]``: the
    rows' example or context and position, the column :func:`pyhook.stream` yields). ``dtype`` (e.g. ``torch.bfloat16``) gives every layer's rows in
    that floating dtype: a compact store's quantised rows are dequantised straight into it (no
    float32 copy); plain rows of another dtype are cast after the gather. A batch of
    quantised layers (with plain ones such as token ids beside them) is read in one native
    call that gathers and dequantises every layer's rows. ``chunk_cache_bytes`` bounds the
    decoded-chunk cache of each compressed layer (default: the reader's, else
    ``PYHOOK_CHUNK_CACHE_BYTES``, else 128 MiB; in each DataLoader worker separately).

    The dataset holds the capture's path, not its memory maps: a worker process (or a pickled
    copy) reopens the capture by path. Batches are memory the caller owns. In a DataLoader
    worker (Linux) they are gathered into one of ``worker_slots`` reused shared-memory slots of
    that worker (one full batch of every key each, mapped once by both processes; only the
    slots in use take memory) and the main process gets a plain ``dict`` of tensors over the
    slot; the slot is reused only after every tensor and view of that batch is freed, so kept
    batches stay intact. When every slot is taken (batches kept), on other platforms, or with
    ``worker_slots=0``, a worker gathers into fresh shared memory that torch sends as usual
    (slower: page faults on every batch). docs/training.md has the measurements.

    Example::

        >>> import tempfile, torch
        >>> from torch.utils.data import DataLoader
        >>> from pyhook.store import ShardWriter, open_capture
        >>> from pyhook.dataset import CaptureDataset
        >>> out = tempfile.mkdtemp()
        >>> with ShardWriter(out, shard_bytes=1) as w:  # 3 shards of 4 rows
        ...     for s in range(3):
        ...         rows = torch.arange(4 * s, 4 * s + 4.0)
        ...         w.add({"a": rows[:, None].repeat(1, 2), "b": -rows[:, None]}, examples=4)
        >>> ds = CaptureDataset(open_capture(out), ["a", "b"], batch_size=5, seed=0)
        >>> batches = list(DataLoader(ds, batch_size=None, num_workers=2))
        >>> [tuple(b["a"].shape) for b in batches]
        [(5, 2), (5, 2), (2, 2)]
        >>> sorted(torch.cat([b["a"][:, 0] for b in batches]).tolist()) == list(range(12))
        True
        >>> all(torch.equal(b["a"][:, 0], -b["b"][:, 0]) for b in batches)  # same tokens
        True
    """

    def __init__(
        self,
        reader: Any,
        layers: str | Sequence[str] | None = None,
        *,
        batch_size: int = 4096,
        shuffle: bool | str = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        tokens: bool = False,
        with_index: bool = False,
        generated: bool = False,
        row_index: bool = False,
        chunk_rows: int = 2048,
        buffer_chunks: int = 64,
        worker_slots: int = 8,
        dtype: torch.dtype | str | None = None,
        chunk_cache_bytes: int | None = None,
    ) -> None:
        super().__init__()
        if isinstance(reader, (str, os.PathLike)):
            reader = _open(os.fspath(reader))
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if shuffle not in _SHUFFLES or (isinstance(shuffle, int) and shuffle not in (0, 1)):
            raise ValueError(
                f"shuffle must be one of {', '.join(map(repr, _SHUFFLES))}, got {shuffle!r}"
            )
        if not isinstance(seed, int):
            raise TypeError(
                f"seed must be an int (the same seed gives the same batches), got {seed!r}"
            )
        for name, value in (("chunk_rows", chunk_rows), ("buffer_chunks", buffer_chunks)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if (
            not isinstance(worker_slots, int)
            or isinstance(worker_slots, bool)
            or not 0 <= worker_slots <= _ring.MAX_SLOTS
        ):
            raise ValueError(
                f"worker_slots must be an int in 0..{_ring.MAX_SLOTS} (0: no reused slots), "
                f"got {worker_slots!r}"
            )
        if rank is not None or world_size is not None:
            _resolve_ranks(0 if rank is None else rank, 1 if world_size is None else world_size)
        self.path = reader.path
        self.layers = _check_layers(reader, layers, tokens)
        for key in ("tokens", "index", "row_index"):
            if key in self.layers:
                raise ValueError(
                    f"layer {key!r} collides with the batch key {key!r}; read it alone"
                )
        self.dtype = parse_dtype(dtype, "dtype")
        if self.dtype is not None:
            if self.dtype not in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
                raise ValueError(
                    "dtype must be a floating-point dtype to read rows in (float64, float32, "
                    f"float16, bfloat16), got {self.dtype}"
                )
            for name in self.layers:
                held = reader.layer(name).dtype
                if not held.is_floating_point:
                    raise ValueError(
                        f"dtype={dtype!r}: layer {name!r} holds {held} rows; dtype converts "
                        "floating-point layers only (read integer layers in a dataset without it)"
                    )
        self.rows = len(reader.layer(self.layers[0]))
        self.batch_size = batch_size
        self.shuffle = "global" if shuffle is True else shuffle
        self.seed = seed
        # The epoch lives in shared memory: set_epoch in the main process reaches DataLoader
        # workers that are already running (persistent_workers=True; fork or spawn).
        self._epoch = torch.zeros((), dtype=torch.int64)
        try:
            self._epoch.share_memory_()
        except (RuntimeError, OSError):  # no shared memory: workers see the epoch at start
            pass
        self.rank, self.world_size = rank, world_size
        self.drop_last, self.tokens, self.with_index = drop_last, tokens, with_index
        self.generated = bool(generated)
        if self.generated and GENERATED not in reader:
            raise ValueError(
                f"generated=True, but the capture {reader.path!r} holds no generated flags "
                "(they are stored by a capture during generate); pass generated=False"
            )
        self.row_index = bool(row_index)
        if self.row_index and ROW_INDEX not in reader:
            raise ValueError(
                f"row_index=True, but the capture {reader.path!r} holds no row index (it is "
                "recorded when every layer stores one row per kept token); pass row_index=False"
            )
        self.chunk_rows, self.buffer_chunks = chunk_rows, buffer_chunks
        self.worker_slots = worker_slots
        # Compressed layers: each one's decoded-chunk cache bound (None: the reader's, which
        # a worker reopening by path would not know, so it travels here).
        if chunk_cache_bytes is None:
            chunk_cache_bytes = getattr(reader, "chunk_cache_bytes", None)
        self.chunk_cache_bytes = (
            None if chunk_cache_bytes is None else _chunk_cache_bytes(chunk_cache_bytes)
        )
        self._reader: Any = reader
        # (pid, this worker's slots or None), set in a DataLoader worker on first iteration.
        self._ring: tuple[int, _ring.WorkerRing | None] | None = None
        self._pid = os.getpid()
        self._cache: dict[str, list[torch.Tensor]] = {}
        self._direct = False  # set by _sources: every part may go straight to the native kernel
        # Set with _direct: (every part of every key, parts per key, batch keys) for one
        # native call per batch.
        self._flat: tuple[list[torch.Tensor], list[int], list[str]] | None = None
        # Set with _flat: (the native plan of its parts, its number, the plan's call, the
        # batch keys) for batch's fast path (the number and call taken out of the plan once:
        # each attribute lookup costs a batch right after a training step).
        self._fast: tuple[_backend._GatherPlan, int, Any, list[str]] | None = None
        # shuffle=False in the main process: cold batches read with preadv (_seqread); False
        # once found impossible (remote shards, encoded rows).
        self._seq: _seqread.SequentialReader | bool | None = None
        # Set with the sources when every quantised layer can go to the fused native decode
        # (pyhook::dequant_rows_many): the batch is one call (plus one for plain keys).
        self._fused: _Fused | None = None

    # -- pickling: the path travels, the memory maps stay behind ------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_reader"], state["_cache"], state["_ring"] = None, {}, None
        state["_flat"], state["_seq"], state["_fused"] = None, None, None
        state["_fast"] = None
        return state

    def _sources(self) -> dict[str, list[torch.Tensor]]:
        if self._reader is None:
            self._reader = _open(self.path)
        if not self._cache:
            names = [*self.layers, *([TOKEN_IDS] if self.tokens else [])]
            names += [GENERATED] if self.generated else []
            names += [ROW_INDEX] if self.row_index else []
            self._cache = {
                n: _parts(self._layer(n), None if n in _EXTRA_KEYS else self.dtype) for n in names
            }
            self._fused = _fused_plan(self._cache)
            # The parts are plain CPU memory maps: checked once here, so that each batch goes
            # straight to the native kernel (the generic checks of gather_rows cost ~40 us a
            # batch for a dozen shards, per layer).
            self._direct = all(
                isinstance(p, DecodedSource) or _backend._direct_gather_ok(p)
                for p in self._cache.values()
            )
            if self._direct and not any(isinstance(p, DecodedSource) for p in self._cache.values()):
                self._flat = (
                    [t for p in self._cache.values() for t in p],
                    [len(p) for p in self._cache.values()],
                    [_key(n) for n in self._cache],
                )
                try:
                    plan = _backend._GatherPlan(*self._flat[:2])
                except RuntimeError:  # parts the plan refuses: batch() takes its general path
                    pass
                else:
                    self._fast = (plan, plan.id, plan.rows, self._flat[2])
        else:  # a shard truncated since: a named error, not SIGBUS on the mapped views
            check = getattr(self._reader, "check_mapped", None)
            if check is not None:
                check()
        return self._cache

    def _layer(self, name: str) -> Any:
        data = self._reader.layer(name)
        if self.chunk_cache_bytes is not None and hasattr(data, "with_cache"):
            return data.with_cache(self.chunk_cache_bytes)  # a compact store's layer
        return data

    # -- the epoch's plan ----------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch whose permutation the next iteration uses (see :meth:`set_epoch`)."""
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of epoch ``epoch`` from the next iteration on.

        >>> import tempfile, torch
        >>> from pyhook.store import ShardWriter
        >>> out = tempfile.mkdtemp()
        >>> with ShardWriter(out) as w:
        ...     w.add({"x": torch.arange(8.0)[:, None]}, examples=8)
        >>> ds = CaptureDataset(out, "x", batch_size=8, seed=1)
        >>> first = next(iter(ds))["x"]; ds.set_epoch(1); second = next(iter(ds))["x"]
        >>> torch.equal(first, second), sorted(first.flatten()) == sorted(second.flatten())
        (False, True)

        It also reaches the workers of a ``DataLoader(..., persistent_workers=True)`` started
        before (the epoch is kept in shared memory).
        """
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        self._epoch.fill_(epoch)

    def _generator(self) -> torch.Generator:
        # One stream per (seed, epoch), the same in every rank and worker.
        return torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) % (1 << 63))

    def _batch_count(self, world_size: int) -> int:
        n, bs = self.rows, self.batch_size
        if self.drop_last:
            return (n // bs) // world_size * world_size
        return math.ceil(n / bs)

    def __len__(self) -> int:
        """Batches this rank gets in one epoch (what ``len(DataLoader(ds, ...))`` reports)."""
        rank, world_size = _resolve_ranks(self.rank, self.world_size)
        return len(range(rank, self._batch_count(world_size), world_size))

    def _order(self) -> torch.Tensor | None:
        """The epoch's row order (``None``: capture order). Every rank and worker computes the
        same one from ``(seed, epoch)``; int32 halves its memory (4 bytes a row) when it can."""
        n, gen = self.rows, self._generator()
        dtype = torch.int32 if n < 2**31 else torch.int64
        if self.shuffle == "global":
            return torch.randperm(n, generator=gen, dtype=dtype)
        if self.shuffle == "chunks":
            # Chunks of consecutive rows in random order; every `buffer_chunks` of them form a
            # window whose rows are shuffled together (a shuffle buffer of that many rows).
            c = self.chunk_rows
            chunks = torch.randperm(math.ceil(n / c), generator=gen)
            rows = torch.cat(
                [torch.arange(int(j) * c, min(int(j) * c + c, n), dtype=dtype) for j in chunks]
            )
            w = c * self.buffer_chunks
            for s in range(0, n, w):
                window = rows[s : s + w]
                rows[s : s + w] = window[torch.randperm(len(window), generator=gen)]
            return rows
        return None

    def _plan(self) -> Iterator[torch.Tensor]:
        """The global row numbers of this consumer's batches, in order."""
        rank, world_size = _resolve_ranks(self.rank, self.world_size)
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        n, bs = self.rows, self.batch_size
        mine = range(rank, self._batch_count(world_size), world_size)[worker::workers]
        order = self._order()
        if order is not None and mine.step == 1:
            # Consecutive batches: the (int32) order converted to int64 about a million rows at
            # a time and split into the batches' views once. A conversion per batch was an
            # allocation and two dispatches in the training loop's path: the iterator's batch
            # took 30-48 us more than batch() of the same rows, with the CPU caches cold.
            group = max(1, min(256, (1 << 20) // max(1, bs)))
            for first in range(mine.start, mine.stop, group):
                last = min(first + group, mine.stop)
                yield from order[first * bs : last * bs].long().split(bs)
            return
        for b in mine:
            if order is None:
                yield torch.arange(b * bs, min((b + 1) * bs, n))
            else:
                yield order[b * bs : (b + 1) * bs].long()

    # -- reading -------------------------------------------------------------------------------
    def _read(self, parts: list[torch.Tensor], idx: torch.Tensor, shared: bool) -> torch.Tensor:
        if isinstance(parts, DecodedSource):  # a compact store's layer: decoded in its gather
            if not shared:
                return parts.gather(idx)
            shape = torch.Size((idx.numel(), *parts.row_shape))
            storage = torch.UntypedStorage._new_shared(shape.numel() * parts.dtype.itemsize)
            out = torch.empty(0, dtype=parts.dtype).set_(storage, 0, shape, _contiguous(shape))
            return parts.gather_into(idx, out)
        if not shared:
            if self._direct and _backend.get_backend() == "native":
                return _backend._gather_direct(parts, idx)
            return gather_rows(parts, idx)
        # In a worker: gather straight into new shared memory, which the DataLoader then sends
        # to the main process as is (a pooled buffer would be copied into shared memory again:
        # measured 37 against 29 ms a batch of 4096 x 3 KB rows with 2 workers).
        shape = torch.Size((idx.numel(), *parts[0].shape[1:]))
        storage = torch.UntypedStorage._new_shared(shape.numel() * parts[0].element_size())
        out = torch.empty(0, dtype=parts[0].dtype).set_(storage, 0, shape, _contiguous(shape))
        return gather_rows_into(parts, idx, out)

    def batch(self, idx: torch.Tensor | Sequence[int]) -> dict[str, torch.Tensor]:
        """The batch of the rows ``idx`` (global row numbers), as the iterator builds it.

        >>> import tempfile, torch
        >>> from pyhook.store import ShardWriter
        >>> out = tempfile.mkdtemp()
        >>> with ShardWriter(out) as w:
        ...     w.add({"x": torch.arange(6.0).reshape(3, 2)}, examples=3)
        >>> CaptureDataset(out, "x").batch([2, 0])["x"].tolist()
        [[4.0, 5.0], [0.0, 1.0]]
        """
        fast = self._fast
        if (
            fast is not None
            and type(idx) is torch.Tensor
            and idx.dtype is torch.long
            and idx.dim() == 1
            and _backend._requested != "reference"  # the native core is loaded (self._fast)
            and get_worker_info() is None
        ):
            # The batch of a training loop, kept short: right after a training step the CPU
            # caches hold none of the objects and code a longer path touches (measured: the
            # Python around the native call took 41-66 us of a 0.75 ms batch of 4096 x 3 KB
            # rows after the caches were overwritten, a third of it one fstat per shard; this
            # path 12-17 us). Every layer (and the token ids) in one native call; a shard
            # truncated since it was mapped raises SIGBUS in the copy, which the call turns
            # into an error, named here (_read_failed).
            _, plan, rows, keys = fast
            try:
                out = dict(zip(keys, rows(plan, idx)))
            except RuntimeError as e:
                self._read_failed(e)
                raise
            if self.with_index:
                out["index"] = idx.clone()
            return out
        if type(idx) is not torch.Tensor or idx.dtype != torch.long or idx.dim() != 1:
            idx = torch.as_tensor(idx, dtype=torch.long)
            if idx.dim() != 1:
                raise ValueError(
                    f"idx must be 1-D global row numbers, got shape {tuple(idx.shape)}"
                )
        shared = get_worker_info() is not None
        sources = self._sources()
        if not shared and self._fused is not None and _backend._dequant_many_ok():
            out = self._fused.batch(idx)
        elif not shared and self._flat is not None and _backend.get_backend() == "native":
            # Every layer (and the token ids) of the batch in one native call (the first batch,
            # or an idx that was not a 1-D int64 tensor).
            flat, counts, keys = self._flat
            try:
                out = dict(zip(keys, _backend._gather_many_direct(flat, counts, idx)))
            except RuntimeError as e:
                self._read_failed(e)
                raise
        else:
            out = {_key(n): self._read(parts, idx, shared) for n, parts in sources.items()}
        if self.with_index:
            out["index"] = idx.share_memory_() if shared else idx.clone()
        return out

    def _read_failed(self, e: RuntimeError) -> None:
        """A native read of the memory maps raised ``e``: if a page could not be read (SIGBUS),
        raise :class:`CaptureDamagedError` naming the shard that became shorter; otherwise
        return (the caller re-raises ``e``: a disk error, for one)."""
        if "SIGBUS" in str(e):
            check = getattr(self._reader, "check_mapped", None)
            if check is not None:
                check()

    def _worker_ring(self) -> _ring.WorkerRing | None:
        """This worker's slots (created on first use), or ``None``: not in a DataLoader worker,
        ``worker_slots=0``, or the platform cannot (then batches take torch's path)."""
        if self.worker_slots == 0 or get_worker_info() is None:
            return None
        if self._ring is None or self._ring[0] != os.getpid():
            ring = None
            if _ring.available():
                # The keys in the order `batch` gives them: layers, tokens, index.
                layout = [
                    (_key(n), p.dtype, p.row_shape)
                    if isinstance(p, DecodedSource)
                    else (_key(n), p[0].dtype, tuple(p[0].shape[1:]))
                    for n, p in self._sources().items()
                ]
                if self.with_index:
                    layout.append(("index", torch.int64, ()))
                try:
                    ring = _ring.WorkerRing(layout, self.batch_size, self.worker_slots)
                except OSError:  # no memfd (old kernel, seccomp): torch's path
                    ring = None
            self._ring = (os.getpid(), ring)
        return self._ring[1]

    def _ring_batch(self, ring: _ring.WorkerRing, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        """The batch ``idx`` gathered into a free slot of ``ring`` (else as :meth:`batch` does)."""
        slot = ring.acquire() if idx.numel() <= ring.rows else None
        if slot is None:
            _ring.stats["fallback"] += 1
            return self.batch(idx)
        out = ring.batch(slot, idx.numel())
        # On an error the batch is never sent: its slot is free again once `out` is gone.
        sources = self._sources()
        if self._fused is not None and _backend._dequant_many_ok():
            self._fused.batch(idx, out)
        elif self._flat is not None and _backend.get_backend() == "native":
            flat, counts, keys = self._flat
            _backend._gather_many_direct_into(flat, counts, idx, [out[k] for k in keys])
        else:
            direct = self._direct and _backend.get_backend() == "native"
            for name, parts in sources.items():
                if isinstance(parts, DecodedSource):
                    parts.gather_into(idx, out[_key(name)])
                elif direct:
                    _backend._gather_direct_into(parts, idx, out[_key(name)])
                else:
                    gather_rows_into(parts, idx, out[_key(name)])
        if self.with_index:
            out["index"].copy_(idx)
        return out

    def _sequential_batch(
        self, idx: torch.Tensor, streaming: bool = False
    ) -> dict[str, torch.Tensor] | None:
        """The batch of the consecutive rows ``idx`` read with ``preadv`` when they are not in
        the page cache (``None``: they are, or this capture cannot; then :meth:`batch`).
        ``streaming``: the previous batch of this iteration was read so and ended where this
        one starts; then this one is read so too, resident or not (see :meth:`__iter__`)."""
        if self._seq is None:
            sources = self._sources()
            seq = None
            if self._flat is not None:
                seq = _seqread.SequentialReader.create(self._reader, list(sources))
            self._seq = seq if seq is not None else False
        seq = self._seq
        if seq is False or not idx.numel():
            return None
        assert isinstance(seq, _seqread.SequentialReader)
        start, stop = int(idx[0]), int(idx[-1]) + 1
        if not streaming and seq.resident(start, stop):
            return None
        out = {_key(n): t for n, t in seq.read(start, stop).items()}
        if self.with_index:
            out["index"] = idx.clone()
        return out

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        ring = self._worker_ring()
        sequential = self.shuffle is False and ring is None and get_worker_info() is None
        # Once a batch of a cold capture was read with preadv, the batches that follow it are
        # read so too: the kernel's read-ahead on the descriptor (up to read_ahead_kb, 8 MiB on
        # some disks) has often read all of the next batch
        # by then, and a resident batch went through the memory maps: measured in
        # bench_read.py (c2), 9 of 32 cold batches took the mapped path, each with page-table
        # work and a MADV_WILLNEED of the batch after it, where readinto simply reads on.
        streaming_from = -1
        for idx in self._plan():
            if sequential:
                b = self._sequential_batch(idx, bool(idx.numel()) and int(idx[0]) == streaming_from)
                if b is not None:
                    streaming_from = int(idx[-1]) + 1
                    yield b
                    continue
                streaming_from = -1
            yield self.batch(idx) if ring is None else self._ring_batch(ring, idx)

    def __repr__(self) -> str:
        return (
            f"<CaptureDataset {self.path!r} layers={self.layers} rows={self.rows} "
            f"batch_size={self.batch_size} shuffle={self.shuffle!r} epoch={self.epoch}>"
        )


def dataset(
    reader: Any,
    layers: str | Sequence[str] | None = None,
    *,
    batch_size: int = 4096,
    shuffle: bool | str = True,
    seed: int = 0,
    rank: int | None = None,
    world_size: int | None = None,
    drop_last: bool = False,
    tokens: bool = False,
    **options: Any,
) -> CaptureDataset:
    """A :class:`CaptureDataset` of ``reader`` (a ``CaptureReader`` or a capture path).

    The function behind ``reader.dataset(layers, ...)``; the arguments are those of
    :class:`CaptureDataset`.

    >>> import tempfile, torch
    >>> from pyhook.store import ShardWriter, open_capture
    >>> out = tempfile.mkdtemp()
    >>> with ShardWriter(out) as w:
    ...     w.add({"h": torch.randn(10, 4)}, examples=10)
    >>> ds = dataset(open_capture(out), ["h"], batch_size=4, shuffle=False)
    >>> [b["h"].shape[0] for b in ds]
    [4, 4, 2]
    """
    return CaptureDataset(
        reader,
        layers,
        batch_size=batch_size,
        shuffle=shuffle,
        seed=seed,
        rank=rank,
        world_size=world_size,
        drop_last=drop_last,
        tokens=tokens,
        **options,
    )


# -- Hugging Face datasets ---------------------------------------------------------------------
_HF_DTYPES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
}


def _hf_feature(dtype: str, shape: tuple[int, ...]) -> Any:
    import datasets

    if not shape:
        return datasets.Value(dtype)
    if len(shape) == 1:
        return datasets.Sequence(datasets.Value(dtype), length=shape[0])
    kinds = {2: datasets.Array2D, 3: datasets.Array3D, 4: datasets.Array4D, 5: datasets.Array5D}
    if len(shape) not in kinds:
        raise ValueError(f"rows of {len(shape)} dimensions have no Hugging Face array feature")
    return kinds[len(shape)](shape=shape, dtype=dtype)


def to_hf_dataset(
    reader: Any,
    layers: str | Sequence[str] | None = None,
    *,
    context_size: int | None = None,
    bfloat16: str = "float32",
    path: str | os.PathLike[str] | None = None,
    chunk_rows: int = 65536,
    columns: dict[str, str] | None = None,
) -> Any:
    """The rows of ``layers`` as a Hugging Face ``datasets.Dataset`` (plus ``token_ids``).

    One dataset row per captured row (``context_size=None``): a column per layer (a
    fixed-length list for ``[D]`` rows), and ``token_ids`` (int64) when the capture holds token
    ids. With ``context_size=T``, every ``T`` consecutive rows form one dataset row: a layer
    column is then ``Array2D(shape=(T, D))`` and ``token_ids`` a length-``T`` int32 sequence,
    the layout of SAELens' cached activations (``columns={"blocks.0": "blocks.0.hook_resid_post"}``
    renames columns to the hook names SAELens expects; save it with ``save_to_disk``).

    Arrow has no bfloat16: by default bfloat16 rows are stored as float32 (exact: every
    bfloat16 is a float32; twice the bytes); ``bfloat16="uint16"`` keeps their raw 16 bits
    (read back with ``torch.from_numpy(a.astype('uint16')).view(torch.bfloat16)``: datasets'
    numpy formatting may widen the integers). The choice is written in
    the dataset's ``info.description``.

    The rows are written ``chunk_rows`` at a time to an Arrow file in ``path`` (a new temporary
    directory by default; the dataset memory-maps it), so memory stays bounded.

    >>> import tempfile, torch
    >>> from pyhook.store import ShardWriter, open_capture
    >>> out = tempfile.mkdtemp()
    >>> with ShardWriter(out) as w:
    ...     w.add({"h": torch.arange(6.0).reshape(3, 2).bfloat16()}, examples=3)
    >>> hf = to_hf_dataset(open_capture(out), "h")
    >>> hf.features["h"].feature.dtype, hf[2]["h"]
    ('float32', [4.0, 5.0])
    """
    import datasets
    from datasets.arrow_writer import ArrowWriter

    if bfloat16 not in ("float32", "uint16"):
        raise ValueError(f"bfloat16 must be 'float32' or 'uint16', got {bfloat16!r}")
    if isinstance(reader, (str, os.PathLike)):
        reader = _open(os.fspath(reader))
    names = _check_layers(reader, layers, tokens=False)
    try:
        tokens = _parts(reader.layer(TOKEN_IDS))
    except KeyError:
        tokens = None
    columns = dict(columns or {})
    unknown = set(columns) - set(names)
    if unknown:
        raise KeyError(f"columns renames {sorted(unknown)}, which are not among layers {names}")
    n = len(reader.layer(names[0]))
    if tokens is not None and sum(len(p) for p in tokens) != n:
        tokens = None  # token ids of another row layout than these layers'
    if context_size is not None:
        if not isinstance(context_size, int) or context_size < 1:
            raise ValueError(f"context_size must be a positive int, got {context_size!r}")
        if n % context_size:
            raise ValueError(
                f"context_size={context_size} does not divide the {n} rows of {names}: it must "
                "be the number of rows each example stored"
            )
    group = context_size or 1
    features: dict[str, Any] = {}
    sources: dict[str, tuple[list[torch.Tensor], bool]] = {}
    notes = []
    for name in names:
        data = reader.layer(name)
        dtype, as_bits = data.dtype, False
        if dtype == torch.bfloat16:
            as_bits = bfloat16 == "uint16"
            hf_dtype = "uint16" if as_bits else "float32"
            notes.append(
                f"{name}: bfloat16 stored as {'raw uint16 bits' if as_bits else 'float32 (exact)'}"
            )
        elif dtype in _HF_DTYPES:
            hf_dtype = _HF_DTYPES[dtype]
        else:
            raise TypeError(f"layer {name!r} has dtype {dtype}, which Arrow cannot hold")
        row_shape = tuple(data.shape)[1:]
        shape = (context_size, *row_shape) if context_size else row_shape
        col = columns.get(name, name)
        features[col] = _hf_feature(hf_dtype, shape)
        sources[col] = (_parts(data), as_bits)
    if tokens is not None:
        features["token_ids"] = (
            datasets.Sequence(datasets.Value("int32"), length=context_size)
            if context_size
            else datasets.Value("int64")
        )
    feats = datasets.Features(features)
    directory = os.fspath(path) if path is not None else tempfile.mkdtemp(prefix="pyhook-hf-")
    os.makedirs(directory, exist_ok=True)
    filename = os.path.join(directory, "data.arrow")
    step = max(1, chunk_rows // group) * group
    with ArrowWriter(features=feats, path=filename) as writer:
        for start in range(0, n, step):
            idx = torch.arange(start, min(start + step, n))
            batch: dict[str, Any] = {}
            for col, (parts, as_bits) in sources.items():
                rows = (
                    parts.gather(idx)
                    if isinstance(parts, DecodedSource)
                    else gather_rows(parts, idx)
                )
                if as_bits:
                    rows = rows.view(torch.int16)
                elif rows.dtype == torch.bfloat16:
                    rows = rows.float()
                a = rows.numpy()
                if as_bits:
                    a = a.view("uint16")
                batch[col] = a.reshape(-1, group, *a.shape[1:]) if context_size else a
            if tokens is not None:
                t = gather_rows(tokens, idx).numpy()
                batch["token_ids"] = t.reshape(-1, group).astype("int32") if context_size else t
            writer.write_batch(batch)
        writer.finalize()
    description = "pyhook capture " + reader.path + (" (" + "; ".join(notes) + ")" if notes else "")
    return datasets.Dataset.from_file(
        filename, info=datasets.DatasetInfo(description=description, features=feats)
    )


# -- measuring the shuffle -----------------------------------------------------------------------
def shuffle_quality(
    indices: Sequence[torch.Tensor], rows: int, group_rows: int = 128
) -> dict[str, float]:
    """How mixed a stream of batches is, from each batch's global row numbers.

    * ``neighbour_corr``: Pearson correlation of the source positions of consecutive rows
      within a batch (0 for a uniform shuffle, 1 for sequential reads);
    * ``distinct_groups``: the mean number of distinct groups of ``group_rows`` consecutive
      rows (e.g. one context) per batch, divided by what a uniform shuffle gives (1.0 = as
      mixed as a global permutation; a shuffle buffer over few chunks is below 1).

    >>> perm = torch.randperm(10_000, generator=torch.Generator().manual_seed(0))
    >>> q = shuffle_quality(list(perm.split(1000)), 10_000, group_rows=100)
    >>> abs(q["neighbour_corr"]) < 0.1, 0.9 < q["distinct_groups"] < 1.1
    (True, True)
    """
    a = torch.cat([b[:-1] for b in indices if len(b) > 1]).double()
    c = torch.cat([b[1:] for b in indices if len(b) > 1]).double()
    corr = float(torch.corrcoef(torch.stack([a, c]))[0, 1]) if len(a) > 2 else float("nan")
    groups = math.ceil(rows / group_rows)
    distinct = [len(torch.unique(b // group_rows)) for b in indices]
    # Expected distinct groups in a uniform sample of k rows (without replacement, ~ with).
    expected = [groups * (1 - (1 - 1 / groups) ** len(b)) for b in indices]
    return {
        "neighbour_corr": corr,
        "distinct_groups": sum(distinct) / max(sum(expected), 1e-9),
    }


# The reader sits below this module (it is what a dataset reads) and never imports it; its
# two training conveniences, ``CaptureReader.dataset`` and ``.to_hf_dataset``, are handed over
# here. ``pyhook/__init__.py`` imports this module, so they are there for every reader.
_reader.training = _Training(dataset, to_hf_dataset)
