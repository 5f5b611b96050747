"""Reading a capture: :func:`open_capture` / :class:`CaptureReader` merge the index, check the
shards, map them into memory, and hand out per-layer :class:`LayerData` (copies the caller owns).
"""

from __future__ import annotations

import mmap
import os
import secrets
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .format import (
    _ST_TO_DTYPE,
    RESERVED_PREFIX,
    CaptureDamagedError,
    _directory_arg,
    _is_int,
    _open_regular,
    dtype_name,
    merged_index,
    parse_dtype,
)
from .transport import ShardCache, at_url, is_url, open_remote_index
from .verify import _check_shard


class _MappedShard:
    """One shard file, memory-mapped on first use; every access checks that the file still has
    the size it had when it was checked (a shard truncated while mapped would otherwise kill the
    process with SIGBUS on the next read of a page past its new end).

    ``fetch`` (remote captures) returns the local path of the shard, downloading and checking it
    first; ``release`` drops the mapping (the remote cache evicts the file).
    """

    def __init__(
        self,
        path: str,
        entry: dict[str, Any],
        header: dict[str, Any] | None = None,
        data_start: int = 0,
        *,
        size: int | None = None,
        fetch: Callable[[_MappedShard], tuple[str, dict[str, Any], int]] | None = None,
    ) -> None:
        self.path = path
        self.entry = entry
        self.header, self.data_start = header, data_start
        self.size = size
        self.fetch = fetch
        self._mm: mmap.mmap | None = None
        self._views: dict[str, torch.Tensor] = {}

    def names(self) -> list[str]:
        return list(self.entry["rows"])

    def _open(self) -> mmap.mmap:
        if self.fetch is not None:
            self.path, self.header, self.data_start = self.fetch(self)
            self.size = os.path.getsize(self.path)
        try:
            with _open_regular(self.path) as f:  # no link followed, no FIFO waited on
                size = os.fstat(f.fileno()).st_size
                if self.size is None:
                    self.size = size
                elif size < self.size:
                    raise self._truncated(size)
                # Copy-on-write mapping: pages are read lazily and the file is never modified.
                # The views stay inside LayerData, which hands out copies.
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except OSError as e:
            raise CaptureDamagedError(
                f"{self.path}: cannot be read: {e.strerror or e}", self.path
            ) from e
        return self._mm

    def _truncated(self, now: int) -> CaptureDamagedError:
        return CaptureDamagedError(
            f"{self.path}: now {now} bytes, {self.size} when the capture was opened (truncated "
            "or rewritten while being read); reopen the capture (pyhook verify lists every "
            "problem)",
            self.path,
        )

    def check(self) -> None:
        """Raise :class:`CaptureDamagedError` if the mapped file became shorter (one fstat)."""
        mm = self._mm
        if mm is not None:
            try:
                now = mm.size()
            except (OSError, ValueError) as e:
                raise CaptureDamagedError(f"{self.path}: cannot be read: {e}", self.path) from e
            if self.size is not None and now < self.size:
                raise self._truncated(now)

    def tensor(self, name: str) -> torch.Tensor:
        """A view of tensor ``name`` (checked: the file still has its size)."""
        view = self._views.get(name)
        if view is not None:
            self.check()
            return view
        if self._mm is None:
            self._open()
        self.check()
        assert self.header is not None and self._mm is not None
        try:  # the header passed check_header: this cannot fail, but if it did, say where
            info = self.header[name]
            dtype = _ST_TO_DTYPE[info["dtype"]]
            begin, end = info["data_offsets"]
            shape = info["shape"]
            if end == begin:
                view = torch.empty(shape, dtype=dtype)
            else:
                flat = torch.frombuffer(
                    self._mm, dtype=torch.uint8, count=end - begin, offset=self.data_start + begin
                )
                view = flat.view(dtype).view(shape)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise CaptureDamagedError(
                f"{self.path}: tensor {name!r} cannot be read from its header: {e}", self.path
            ) from None
        self._views[name] = view
        return view

    def release(self) -> None:
        """Drop the mapping (it is made again on the next access)."""
        self._views.clear()
        self._mm = None  # unmapped once no view of it is left


def _gather_rows(
    parts: Sequence[torch.Tensor | None], starts: torch.Tensor, idx: torch.Tensor
) -> torch.Tensor:
    """Rows ``idx`` (int64, in range) of the row-concatenation of ``parts`` into a new tensor.

    ``starts[i]`` is the first row of part ``i`` (``len(parts) + 1`` entries, the last is the
    total). Parts that ``idx`` does not touch may be ``None``. Every row read of
    :class:`LayerData` that is not a contiguous slice goes through this one function, so a
    faster gather (the native core's, on all cores) plugs in here.
    """
    from .._backend import gather_rows  # the native gather (all cores, no GIL), or the reference

    touched = [i for i, p in enumerate(parts) if p is not None]
    if len(touched) != len(parts):  # renumber idx over the touched parts only
        part_of = torch.bucketize(idx, starts[1:], right=True)
        shift = torch.zeros(len(parts), dtype=torch.long)
        at = 0
        for i in touched:
            shift[i] = int(starts[i]) - at
            at += int(starts[i + 1]) - int(starts[i])
        idx = idx - shift[part_of]
    return gather_rows([p for p in parts if p is not None], idx)


class LayerData:
    """The rows of one layer across all shards: memory-mapped parts, indexed like a tensor.

    Every read (indexing, :meth:`to_tensor`, :attr:`parts`, :meth:`CaptureReader.batches`)
    returns tensors the caller owns: the rows are copied out of the memory map, so editing a
    batch in place never changes what a later read returns. Nothing is read until indexed.

    Example::

        >>> import torch, tempfile
        >>> from pyhook.store import ShardWriter, open_capture
        >>> out = tempfile.mkdtemp()
        >>> with ShardWriter(out, shard_bytes=1) as w:  # one shard per batch
        ...     w.add({"h": torch.arange(4.).reshape(2, 2)}, examples=2)
        ...     w.add({"h": torch.arange(4., 8.).reshape(2, 2)}, examples=2)
        >>> h = open_capture(out)["h"]
        >>> len(h), len(h.parts), h[1:3].tolist()
        (4, 2, [[2.0, 3.0], [4.0, 5.0]])
        >>> h[0].zero_().tolist(), h[0].tolist()  # a copy: the stored rows are unchanged
        ([0.0, 0.0], [0.0, 1.0])
    """

    def __init__(
        self,
        name: str,
        parts: Sequence[torch.Tensor | _MappedShard],
        row_shape: Sequence[int],
        dtype: torch.dtype,
        *,
        rows: Sequence[int] | None = None,
    ) -> None:
        self.name = name
        # Tensors, or the shards that hold this layer (views made, and the file's size checked,
        # on each read); neither is ever handed out.
        self._sources = list(parts)
        self.dtype = dtype
        self.row_shape = tuple(row_shape)
        if rows is None:
            rows = [int(p.shape[0]) for p in parts]  # type: ignore[union-attr]
        self._starts = [0]
        for s in rows:
            self._starts.append(self._starts[-1] + int(s))
        self._starts_t = torch.tensor(self._starts, dtype=torch.long)

    def _part(self, i: int) -> torch.Tensor:
        src = self._sources[i]
        if isinstance(src, torch.Tensor):
            return src
        return src.tensor(self.name)

    @property
    def _parts(self) -> list[torch.Tensor]:
        return [self._part(i) for i in range(len(self._sources))]

    @property
    def shape(self) -> torch.Size:
        return torch.Size([len(self), *self.row_shape])

    def __len__(self) -> int:
        return self._starts[-1]

    @property
    def parts(self) -> list[torch.Tensor]:
        """The rows of each shard, one tensor per shard (copies, made on each access)."""
        return [p.clone() for p in self._parts]

    def to_tensor(self) -> torch.Tensor:
        """All rows as one tensor (a copy the caller owns)."""
        if len(self._sources) == 1:
            return self._part(0).clone()
        if not self._sources:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.cat(self._parts)

    def __getitem__(self, index: int | slice | torch.Tensor | Sequence[int]) -> torch.Tensor:
        n = len(self)
        if not isinstance(index, (int, slice)):
            if (
                not isinstance(index, torch.Tensor)
                and not hasattr(index, "__len__")
                and hasattr(index, "__index__")
            ):
                index = int(index.__index__())  # numpy integers
            else:
                idx = torch.as_tensor(index)
                if idx.numel() == 0 and idx.dtype != torch.bool:
                    idx = idx.long()  # [] is a float tensor: no rows, not a float index
                if idx.dim() == 0 and not idx.is_floating_point() and idx.dtype != torch.bool:
                    index = int(idx)
                elif idx.dtype == torch.bool:
                    if idx.shape != (n,):
                        raise IndexError(
                            f"a boolean mask over layer {self.name!r} must have shape ({n},), "
                            f"got {tuple(idx.shape)}"
                        )
                    return self._gather(idx.nonzero().squeeze(1))
                elif idx.is_floating_point() or idx.is_complex():
                    raise IndexError(
                        f"rows of layer {self.name!r} are indexed by ints, slices, int sequences "
                        f"or boolean masks, got a {idx.dtype} index"
                    )
        if isinstance(index, int):
            if index < 0:
                index += n
            if not 0 <= index < n:
                raise IndexError(f"row {index} out of range for layer {self.name!r} with {n} rows")
            import bisect

            i = bisect.bisect_right(self._starts, index) - 1
            return self._part(i)[index - self._starts[i]].clone()
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            if step == 1:
                out = []
                for i in range(len(self._sources)):
                    lo, hi = max(start, self._starts[i]), min(stop, self._starts[i + 1])
                    if lo < hi:
                        p = self._part(i)
                        out.append(p[lo - self._starts[i] : hi - self._starts[i]])
                if len(out) == 1:
                    return out[0].clone()
                return (
                    torch.cat(out) if out else torch.empty((0, *self.row_shape), dtype=self.dtype)
                )
            if not range(start, stop, step):  # e.g. [22:6:2]: no rows
                return torch.empty((0, *self.row_shape), dtype=self.dtype)
            index = torch.arange(start, stop, step)
        return self._gather(torch.as_tensor(index, dtype=torch.long))

    def _gather(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.dim() > 1:  # as a tensor indexed so: [*idx.shape, *row_shape]
            return self._gather(idx.reshape(-1)).reshape(*idx.shape, *self.row_shape)
        n = len(self)
        idx = torch.where(idx < 0, idx + n, idx)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise IndexError(f"row index out of range for layer {self.name!r} with {n} rows")
        if not idx.numel():
            return torch.empty((0, *self.row_shape), dtype=self.dtype)
        touched = torch.bucketize(idx, self._starts_t[1:], right=True).unique().tolist()
        parts: list[torch.Tensor | None] = [None] * len(self._sources)
        for i in touched:
            parts[i] = self._part(i)
        return _gather_rows(parts, self._starts_t, idx)

    def __repr__(self) -> str:
        return f"<LayerData {self.name!r} shape={tuple(self.shape)} dtype={dtype_name(self.dtype)} parts={len(self._sources)}>"


class CaptureReader:
    """Read a capture directory: the merged index, memory-mapped per-layer rows, row batches.

    Example::

        >>> import torch, tempfile
        >>> from pyhook.store import ShardWriter, CaptureReader
        >>> out = tempfile.mkdtemp()
        >>> with ShardWriter(out) as w:
        ...     w.add({"a": torch.arange(10.).reshape(5, 2), "b": torch.zeros(5, 1)}, examples=5)
        >>> r = CaptureReader(out)
        >>> r.layers, r.rows("a")
        (['a', 'b'], 5)
        >>> [b["a"].shape[0] for b in r.batches(2)]
        [2, 2, 1]

    The per-rank index files are merged on open (so a capture is readable even if it was
    interrupted before ``index.json`` was written); shards are ordered by rank, then by number,
    which under torchrun with contiguous per-rank shares is the original data order.

    Opening checks every listed shard against the index (present, a regular file of the
    recorded size, a header with the recorded dtypes and shapes, naming this shard): one stat
    and one small read per shard. ``verify=True`` also compares each shard's checksum (reads
    every byte). A mismatch raises :class:`CaptureDamagedError` naming the file.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        verify: bool = False,
        cache_bytes: int = 4 << 30,
        prefetch: int = 2,
        chunk_cache_bytes: int | None = None,
    ) -> None:
        self._remote_cache: ShardCache | None = None
        if chunk_cache_bytes is not None:  # checked now, not at the first read of a layer
            from .encoding import chunk_cache_bytes as _check

            _check(chunk_cache_bytes)
        #: the bound of each compressed layer's decoded-chunk cache (None: the default,
        #: see :func:`pyhook.pipeline.encoding.chunk_cache_bytes`)
        self.chunk_cache_bytes = chunk_cache_bytes
        if is_url(path):
            self._open_remote(str(path), verify, cache_bytes, prefetch)
            return
        self.path = _directory_arg("path", path)
        if not os.path.isdir(self.path):
            raise FileNotFoundError(f"capture directory {self.path!r} does not exist")
        self.index = merged_index(self.path)
        if self.index["missing_ranks"]:
            warnings.warn(
                f"capture {self.path!r} has no index for rank(s) {self.index['missing_ranks']} of "
                f"{self.index['world_size']} (crashed, interrupted or still running): their rows "
                "are not read; rerun the same command with the same number of processes to "
                "complete it",
                stacklevel=2,
            )
        self._shards = []
        for s in self.index["shards"]:
            try:
                header, start = _check_shard(self.path, s, self.index["layers"], checksum=verify)
            except CaptureDamagedError as e:
                raise CaptureDamagedError(
                    f"capture {self.path!r} is damaged: {e} (pyhook verify lists every problem)",
                    e.path,
                ) from None
            self._shards.append(
                _MappedShard(
                    os.path.join(self.path, s["file"]), s, header, start, size=s.get("bytes")
                )
            )
        self._cache: dict[str, LayerData] = {}

    def _open_remote(self, url: str, verify: bool, cache_bytes: int, prefetch: int) -> None:
        """A capture on object storage: the index now, each shard when first read (prefetching
        the next ``prefetch``), into a local cache of at most ``cache_bytes``."""
        if not _is_int(cache_bytes) or cache_bytes < 0:
            raise ValueError(f"cache_bytes must be an int >= 0, got {cache_bytes!r}")
        if not _is_int(prefetch) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
        remote, local, listing = open_remote_index(url)
        self.path = remote.url
        try:
            if not any(n.startswith("index-r") and "/" not in n for n in listing):
                raise FileNotFoundError(f"{url!r} holds no pyhook capture (no index-r*.json)")
            try:
                self.index = merged_index(local)
            except CaptureDamagedError as e:  # named by its URL, not the local copy's path
                raise at_url(e, local, remote.url) from None
            for s in self.index["shards"]:
                if s["file"] not in listing:
                    u = remote.url_of(s["file"])
                    raise CaptureDamagedError(
                        f"capture {url!r} is damaged: {u}: missing (listed in the index)", u
                    )
                if s.get("bytes") is not None and listing[s["file"]] != s["bytes"]:
                    u = remote.url_of(s["file"])
                    raise CaptureDamagedError(
                        f"capture {url!r} is damaged: {u}: size {listing[s['file']]} bytes, the "
                        f"index records {s['bytes']}",
                        u,
                    )
        except BaseException:
            import shutil

            shutil.rmtree(local, ignore_errors=True)
            raise
        cache = ShardCache(
            remote, local, self.index["layers"], cache_bytes=cache_bytes, prefetch=prefetch
        )
        self._remote_cache = cache
        self._shards = [
            _MappedShard(remote.url_of(s["file"]), s, size=s.get("bytes"), fetch=cache.fetch)
            for s in self.index["shards"]
        ]
        cache.register(self._shards)
        self._cache = {}
        if verify:  # every shard downloaded and checked now (evicted again past cache_bytes)
            for m in self._shards:
                if m.entry["rows"]:
                    m.tensor(next(iter(m.entry["rows"])))

    def close(self) -> None:
        """Drop the local cache of a remote capture (no-op for a local one)."""
        if self._remote_cache is not None:
            self._remote_cache.close()

    @property
    def layers(self) -> list[str]:
        """Layer names, in capture order (names starting with ``"__"``, the store's own
        tensors such as token ids, are not listed; :meth:`layer` reads them)."""
        return [n for n in self.index["layers"] if not n.startswith(RESERVED_PREFIX)]

    @property
    def settings(self) -> dict[str, Any]:
        return self.index["settings"]

    @property
    def examples(self) -> int:
        return self.index["examples"]

    def rows(self, layer: str) -> int:
        return self._info(layer)["rows"]

    def _info(self, layer: str) -> dict[str, Any]:
        try:
            return self.index["layers"][layer]
        except KeyError:
            raise KeyError(
                f"layer {layer!r} is not in this capture; it holds {self.layers}"
            ) from None

    def layer(self, name: str) -> LayerData:
        """The rows of layer ``name`` (memory-mapped, nothing read until indexed)."""
        if name not in self._cache:
            info = self._info(name)
            dtype = parse_dtype(info["dtype"])
            assert dtype is not None
            shards = [m for m in self._shards if name in m.entry["rows"]]
            rows = [int(m.entry["rows"][name]) for m in shards]
            if "encoding" in info:  # a compact store's layer, decoded in the gather
                from .encoding import EncodedLayerData

                self._cache[name] = EncodedLayerData(  # type: ignore[assignment]
                    name, shards, info, rows, cache_bytes=self.chunk_cache_bytes
                )
                return self._cache[name]
            self._cache[name] = LayerData(name, shards, info["row_shape"], dtype, rows=rows)
        return self._cache[name]

    __getitem__ = layer

    def __contains__(self, name: object) -> bool:
        return name in self.index["layers"]

    def __iter__(self) -> Iterator[str]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def batches(
        self,
        batch_size: int,
        *,
        layers: Sequence[str] | None = None,
        shuffle: bool = False,
        seed: int | None = None,
        drop_last: bool = False,
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Yield ``{layer: rows}`` batches of ``batch_size`` rows, in order or shuffled.

        Every requested layer must have the same number of rows (the same row ``i`` of each layer
        comes from the same token or example). Shuffling is a permutation of all rows drawn from
        ``seed`` (reproducible), gathered shard by shard from the memory maps.
        """
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        names = list(layers) if layers is not None else self.layers
        if isinstance(layers, str):
            names = [layers]
        data = [self.layer(n) for n in names]
        counts = {n: len(d) for n, d in zip(names, data)}
        if len(set(counts.values())) > 1:
            raise ValueError(
                f"layers have different row counts {counts}; ask for them separately (layers=[...])"
            )
        n = next(iter(counts.values()), 0)
        if shuffle:
            # Without a seed: a fresh one that leaves torch's global generator alone.
            gen = torch.Generator().manual_seed(seed if seed is not None else secrets.randbits(63))
            order: torch.Tensor | None = torch.randperm(n, generator=gen)
        else:
            order = None
        stop = (n // batch_size) * batch_size if drop_last else n
        for start in range(0, stop, batch_size):
            end = min(start + batch_size, n)
            if order is None:
                yield {name: d[start:end] for name, d in zip(names, data)}
            else:
                idx = order[start:end]
                yield {name: d[idx] for name, d in zip(names, data)}

    # -- token bookkeeping and statistics (pyhook.annotations), training (pyhook.dataset) ----
    @property
    def tokens(self) -> torch.Tensor | None:
        """The token id of every row (``LongTensor [rows]``, aligned with each layer's rows), or
        None when the capture keeps none (older stores, rows of different layouts); see
        :func:`pyhook.annotations.tokens`."""
        from . import annotations

        return annotations.tokens(self)

    @property
    def row_index(self) -> torch.Tensor | None:
        """``(example, position)`` of every row (``LongTensor [rows, 2]``), or None when
        absent; see :func:`pyhook.annotations.row_index`."""
        from . import annotations

        return annotations.row_index(self)

    def text(self, example: int) -> str:
        """The text of example ``example`` (the index :attr:`row_index` gives), when the
        capture kept texts; see :func:`pyhook.annotations.text`."""
        from . import annotations

        return annotations.text(self, example)

    def completion(self, example: int) -> str:
        """The completion alone of example ``example`` (a capture made during ``generate``);
        see :func:`pyhook.annotations.completion`."""
        from . import annotations

        return annotations.completion(self, example)

    @property
    def generated(self) -> torch.Tensor | None:
        """Which rows hold generated tokens (``BoolTensor [rows]``), or None for a capture made
        without ``generate``; see :func:`pyhook.annotations.generated`."""
        from . import annotations

        return annotations.generated(self)

    def stats(self, layer: str) -> dict[str, torch.Tensor]:
        """Statistics of ``layer`` gathered while capturing, exact across shards, resumes and
        ranks: ``count``, per-dimension ``mean`` and ``var``, ``norm_mean`` (mean L2 norm of a
        row); see :func:`pyhook.annotations.stats`."""
        from . import annotations

        return annotations.stats(self, layer)

    def dataset(self, layers: str | Sequence[str] | None = None, **options: Any) -> Any:
        """A ``torch.utils.data`` dataset of shuffled ``{layer: rows}`` batches for a plain
        ``DataLoader(ds, batch_size=None)``; see :func:`pyhook.dataset.dataset`."""
        return training.dataset(self, layers, **options)

    def to_hf_dataset(self, layers: str | Sequence[str] | None = None, **options: Any) -> Any:
        """The rows as a Hugging Face ``datasets.Dataset`` (with token ids); see
        :func:`pyhook.dataset.to_hf_dataset`."""
        return training.to_hf_dataset(self, layers, **options)

    def check_mapped(self) -> None:
        """Raise :class:`CaptureDamagedError` if a shard mapped so far became shorter (one
        ``fstat`` each): what every read does first, for readers that keep the views."""
        for shard in self._shards:
            if hasattr(shard, "check"):
                shard.check()

    def __repr__(self) -> str:
        return f"<CaptureReader {self.path!r} layers={len(self.layers)} examples={self.examples}>"


# The training wrappers (pyhook.pipeline.dataset) sit above the reader: that module sets this
# when it is imported (pyhook's __init__ imports it), so the reader never imports it.
training: Any = None


def open_capture(
    path: str | os.PathLike[str],
    *,
    verify: bool = False,
    cache_bytes: int = 4 << 30,
    prefetch: int = 2,
    chunk_cache_bytes: int | None = None,
) -> CaptureReader:
    """Open a capture directory, or a capture on object storage (any fsspec URL such as
    ``s3://bucket/prefix``), for reading (see :class:`CaptureReader`).

    Every shard's size and header are checked against the index; ``verify=True`` also checks
    every shard's checksum (reads all the data once). For a URL, shards are downloaded when
    first read, ``prefetch`` ahead, into a local cache of at most ``cache_bytes``, each checked
    against its checksum before use. ``chunk_cache_bytes`` bounds the decoded-chunk cache of
    each compressed layer of a compact store (default: ``PYHOOK_CHUNK_CACHE_BYTES``, else 128
    MiB; docs/store-format.md).

    Example::

        >>> import torch, tempfile, pyhook.store as store
        >>> out = tempfile.mkdtemp()
        >>> with store.ShardWriter(out) as w:
        ...     w.add({"x": torch.ones(3, 4)}, examples=3)
        >>> store.open_capture(out, verify=True)["x"].shape
        torch.Size([3, 4])
    """
    return CaptureReader(
        path,
        verify=verify,
        cache_bytes=cache_bytes,
        prefetch=prefetch,
        chunk_cache_bytes=chunk_cache_bytes,
    )
