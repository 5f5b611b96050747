"""Compact stores: rows kept in fewer bytes (quantised, compressed) and read back decoded.

Index:

* :class:`Encoding` - a capture's ``quantize=``/``compress=`` settings: checked before any
  forward, described per layer in the index, applied by the writer thread to each shard;
* :func:`quantize_rows` - float rows -> float8_e4m3fn (or int8) and one float32 scale per row
  (``amax / 448``, ``amax / 127``); :func:`pyhook._backend.dequant_rows` (the native gather,
  ``csrc/cpu/dequant.cpp``) reads them back;
* :func:`compress_rows` / :func:`decompress_chunk` - zstd frames over chunks of ``chunk_rows``
  rows (each byte plane of 2- and 4-byte values its own frame), so that a shuffled batch
  decodes only the chunks it touches;
* :class:`EncodedLayerData` - a layer of a compact store, read like
  :class:`~pyhook.store.LayerData` (indexing, ``to_tensor``, ``parts``, ``batches``), decoded
  in the gather; :class:`DecodedSource` - what :mod:`pyhook.dataset` gathers batches from;
* :func:`stored_layout` - what the shard header of an encoded layer holds (for the checks of
  :mod:`.format`); :func:`layer_bytes` - stored and decoded bytes (``pyhook inspect``);
  :func:`stored_bytes_bound` - the bytes a plan announces (an upper bound with ``compress``);
* :func:`chunk_cache_bytes` - the bound of a compressed layer's decoded-chunk cache (argument,
  ``PYHOOK_CHUNK_CACHE_BYTES``, default).

The layout on disk is described in docs/store-format.md ("Compact stores"). This module sits
with the format (it imports :mod:`.format`, never the reader or the writer, and hands the
format its :func:`stored_layout` for the shard checks).
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from . import format as _format
from .format import _DTYPE_TO_ST, CaptureDamagedError, parse_dtype

__all__ = [
    "ENCODED_FORMAT_VERSION",
    "QUANTIZE",
    "COMPRESS",
    "Encoding",
    "EncodedLayerData",
    "DecodedSource",
    "quantize_rows",
    "compress_rows",
    "decompress_chunk",
    "stored_layout",
    "layer_bytes",
    "chunk_cache_bytes",
    "stored_bytes_bound",
]

#: The index's ``format_version`` of a store with encoded layers (plain stores keep 2).
ENCODED_FORMAT_VERSION = 3

#: ``quantize=`` names: (stored dtype name, largest stored magnitude).
QUANTIZE: dict[str, tuple[str, float]] = {"fp8": ("float8_e4m3fn", 448.0), "int8": ("int8", 127.0)}
#: ``compress=`` names.
COMPRESS = ("zstd",)

SCALE_PREFIX = "__scale__."
CHUNKS_PREFIX = "__chunks__."

#: Uncompressed bytes per chunk (a chunk is at least one row).
DEFAULT_CHUNK_BYTES = 64 << 10
#: The largest chunk (uncompressed) a writer makes and a reader decodes: a received store's
#: ``chunk_rows`` beyond it is refused (the decoder allocates a chunk's rows at once).
MAX_CHUNK_BYTES = 1 << 30
DEFAULT_LEVEL = 1  # measured on MiniLM bf16 rows: ratio 1.44 at level 1, 1.41 at 3 (byte planes)
#: Decoded rows each compressed layer keeps for later reads (whole shards' worth, least
#: recently used dropped first), unless ``open_capture(chunk_cache_bytes=...)``,
#: ``dataset(chunk_cache_bytes=...)`` or the environment variable ``PYHOOK_CHUNK_CACHE_BYTES``
#: says otherwise (see :func:`chunk_cache_bytes`).
DEFAULT_CACHE_BYTES = 128 << 20
CACHE_ENV = "PYHOOK_CHUNK_CACHE_BYTES"

_QUANTISED_DTYPES = {torch.float8_e4m3fn: "fp8", torch.int8: "int8"}


def _dtype(name: str) -> torch.dtype:
    d = getattr(torch, str(name), None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return d


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:
        raise ImportError(
            "compress='zstd' (and reading a capture stored with it) needs the zstandard "
            "package: pip install zstandard (or pip install 'pyhook[compact]')"
        ) from None
    return zstandard


def chunk_cache_bytes(value: Any = None, what: str = "chunk_cache_bytes") -> int:
    """The bound, in bytes, of each compressed layer's decoded-chunk cache: ``value`` when
    given (an int >= 0; 0 keeps nothing, every read decodes the chunks it touches), else the
    environment variable ``PYHOOK_CHUNK_CACHE_BYTES``, else ``DEFAULT_CACHE_BYTES`` (128 MiB).

    >>> chunk_cache_bytes(1 << 20), chunk_cache_bytes() == DEFAULT_CACHE_BYTES
    (1048576, True)
    """
    source = what
    if value is None:
        env = os.environ.get(CACHE_ENV)
        if env is None or not env.strip():
            return DEFAULT_CACHE_BYTES
        source = f"the environment variable {CACHE_ENV}"
        try:
            value = int(env.strip())
        except ValueError:
            raise ValueError(f"{source} must be a number of bytes >= 0, got {env!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{source} must be an int >= 0 (bytes), got {value!r}")
    return value


def check_quantize(quantize: Any, what: str = "quantize") -> str | None:
    """``None`` or a known ``quantize=`` name; ValueError naming the choices otherwise."""
    if quantize is None or (isinstance(quantize, str) and quantize in QUANTIZE):
        return quantize
    raise ValueError(
        f"{what} must be None, {' or '.join(repr(k) for k in QUANTIZE)}, got {quantize!r}"
    )


def check_compress(compress: Any, what: str = "compress") -> str | None:
    """``None`` or a known ``compress=`` name (the codec's package is checked too)."""
    if compress is None:
        return None
    if compress not in COMPRESS:
        raise ValueError(
            f"{what} must be None or {' or '.join(repr(c) for c in COMPRESS)}, got {compress!r}"
        )
    _zstd()
    return compress


# -- quantisation ----------------------------------------------------------------------------
# Rows whose largest |value| is below this cannot round a scale up past float32's largest value
# over the limit (a few float32 steps of margin).
_F32_MAX = float(torch.finfo(torch.float32).max)
_NEAR_F32_MAX = _F32_MAX * (1 - 2.0**-20)
_F32_TINY = float(torch.finfo(torch.float32).tiny)  # the smallest normal float32


def quantize_rows(x: torch.Tensor, kind: str = "fp8") -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: rows ``x`` ``[n, ...]`` as float8_e4m3fn (``kind="fp8"``) or int8, and
    one float32 scale per row, ``amax(|row|) / 448`` (``/ 127``), so that ``q * scale`` is the
    row to fp8's (int8's) precision relative to the row's largest value. A row of zeros has
    scale 0; a row holding inf or NaN has a NaN scale (it reads back as NaN). A scale is
    rounded so that ``limit * scale`` stays finite in float32 (a row up to float32's largest
    value reads back finite). float64 rows are scaled in float64; a finite row whose scale
    float32 cannot hold, or whose values a float32 read-back cannot (its largest ``|value|``
    beyond float32's largest, or under ``limit`` times its smallest subnormal), is a
    ``ValueError``: it would read back as inf, NaN or zeros.

    >>> x = torch.tensor([[1.0, -0.5, 0.25], [0.0, 0.0, 0.0]])
    >>> q, s = quantize_rows(x)
    >>> (q.float() * s[:, None]).tolist(), (s * 448).tolist()
    ([[1.0, -0.5, 0.25], [0.0, 0.0, 0.0]], [1.0, 0.0])
    """
    stored, limit = QUANTIZE[kind]
    n = x.shape[0]
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    flat = x.detach().reshape(n, math.prod(x.shape[1:])).to(work)  # (not -1: n may be 0)
    amax = flat.abs().amax(dim=1) if flat.shape[1] else torch.zeros(n, dtype=work)
    finite = torch.isfinite(amax)
    scale = (amax / limit).to(torch.float32)
    if work == torch.float64:
        # Read back in float32 (the dequant's product), so the values must fit float32 too.
        lost = finite & ((amax > _F32_MAX) | ((scale == 0) & (amax > 0)))
        if bool(lost.any()):
            i = int(lost.nonzero()[0])
            raise ValueError(
                f"a row's largest |value| is {float(amax[i]):.3g}, which a float32 scale and a "
                f"float32 read-back cannot hold; quantize={kind!r} keeps float64 rows whose "
                f"largest |value| lies within {limit * 2.0**-149:.1e} .. {_F32_MAX:.1e} (or is 0)"
            )
    # A scale under float32's smallest normal keeps few bits: rounded down (to 0 for a row under
    # limit * 2^-150) it would clip the row's largest values or read the row back as zeros;
    # rounded up, every value keeps fp8's (int8's) precision (rows of float32 subnormals too).
    sub = finite & (amax > 0) & (scale < _F32_TINY)
    if bool(sub.any()):
        short = sub & (scale.to(torch.float64) * limit < amax.to(torch.float64))
        scale = torch.where(short, torch.nextafter(scale, torch.full_like(scale, math.inf)), scale)
    # Rounded up, limit * scale could overflow float32 when read back: round such scales down
    # (only rows within a rounding of float32's largest value can; one reduction finds none).
    if n and not float(amax.max()) <= _NEAR_F32_MAX:  # (a NaN or inf row hides the others)
        over = finite & (scale.to(torch.float64) * limit > _F32_MAX)
        scale = torch.where(over, torch.nextafter(scale, torch.zeros_like(scale)), scale)
    safe = torch.where(finite & (scale > 0), scale, torch.ones_like(scale)).to(work)
    y = flat / safe[:, None]
    y = y.clamp_(-limit, limit)  # x / (amax / limit) can round to just above the limit
    if kind == "int8":
        y = y.round_()
    y = y.masked_fill_(~finite[:, None], 0.0)
    q = y.to(_dtype(stored)).reshape(x.shape)
    scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    return q, scale.contiguous()


# -- compression -----------------------------------------------------------------------------
_local = threading.local()  # zstandard's (de)compressors are not thread-safe: one per thread


def _compressor(level: int) -> Any:
    comps = getattr(_local, "comps", None)
    if comps is None:
        comps = _local.comps = {}
    if level not in comps:
        comps[level] = _zstd().ZstdCompressor(
            level=level, write_checksum=True, write_content_size=True
        )
    return comps[level]


def _decompressor() -> Any:
    d = getattr(_local, "decomp", None)
    if d is None:
        d = _local.decomp = _zstd().ZstdDecompressor()
    return d


def _row_bytes(dtype: torch.dtype, row_shape: Sequence[int]) -> int:
    return dtype.itemsize * math.prod(row_shape)


def compress_rows(
    rows: torch.Tensor, chunk_rows: int, *, level: int = DEFAULT_LEVEL, planes: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blob, offsets)``: rows ``[n, ...]`` as zstd frames, ``planes`` per chunk of
    ``chunk_rows`` rows (``planes`` = the dtype's size splits each value's bytes into planes:
    for bfloat16 the sign-and-exponent bytes, which compress well, apart from the mantissa
    bytes). ``blob`` is uint8, ``offsets`` int64 ``[chunks * planes + 1]``: frame ``f`` is
    ``blob[offsets[f]:offsets[f + 1]]``. Lossless: :func:`decompress_chunk` gives the bytes back.

    >>> x = torch.arange(10.0).reshape(5, 2).bfloat16()
    >>> blob, offsets = compress_rows(x, 2, planes=2)
    >>> offsets.numel(), torch.equal(decompress_chunk(blob, offsets, 2, 1, x.dtype, (2,), 2), x[4:])
    (7, True)
    """
    n = rows.shape[0]
    flat = rows.detach().contiguous().reshape(n, math.prod(rows.shape[1:]))  # (n may be 0)
    raw = flat.view(torch.uint8).numpy()
    comp = _compressor(level)
    frames: list[bytes] = []
    offsets = [0]
    for c in range(0, n, chunk_rows):
        chunk = raw[c : c + chunk_rows].reshape(-1)
        if planes > 1:
            split = chunk.reshape(-1, planes)
            pieces = [np.ascontiguousarray(split[:, p]) for p in range(planes)]
        else:
            pieces = [chunk]
        for piece in pieces:
            frame = comp.compress(piece)
            frames.append(frame)
            offsets.append(offsets[-1] + len(frame))
    blob = b"".join(frames)
    data = (
        torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        if blob
        else torch.empty(0, dtype=torch.uint8)
    )
    return data, torch.tensor(offsets, dtype=torch.int64)


def decompress_chunk(
    blob: torch.Tensor,
    offsets: torch.Tensor,
    chunk: int,
    rows: int,
    dtype: torch.dtype,
    row_shape: Sequence[int],
    planes: int = 1,
) -> torch.Tensor:
    """Chunk ``chunk`` (``rows`` rows of ``dtype``, ``row_shape``) of a :func:`compress_rows`
    blob, as a fresh tensor. ValueError when a frame is out of bounds, damaged (zstd's frame
    checksum) or decodes to another size."""
    row_bytes = _row_bytes(dtype, row_shape)
    want = rows * row_bytes
    f0 = chunk * planes
    if f0 + planes >= offsets.numel():
        raise ValueError(f"chunk {chunk} is beyond the {offsets.numel() - 1} frames recorded")
    bounds = offsets[f0 : f0 + planes + 1].tolist()
    data = blob.numpy()
    if (
        bounds[0] < 0
        or bounds[-1] > data.shape[0]
        or any(a > b for a, b in itertools.pairwise(bounds))
    ):
        raise ValueError(f"chunk {chunk}: frame offsets {bounds} outside the {data.shape[0]} bytes")
    d = _decompressor()
    out = np.empty((want // planes, planes) if planes > 1 else want, dtype=np.uint8)
    for p in range(planes):
        try:
            piece = d.decompress(data[bounds[p] : bounds[p + 1]], max_output_size=want)
        except Exception as e:  # zstandard.ZstdError: a damaged frame
            raise ValueError(f"chunk {chunk}: {e}") from None
        if len(piece) * planes != want:
            raise ValueError(f"chunk {chunk}: decoded {len(piece) * planes} bytes, expected {want}")
        if planes > 1:
            out[:, p] = np.frombuffer(piece, dtype=np.uint8)
        else:
            out[:] = np.frombuffer(piece, dtype=np.uint8)
    t = torch.from_numpy(out.reshape(-1))
    return (
        t.view(dtype).reshape(rows, *row_shape)
        if want
        else torch.empty((rows, *row_shape), dtype=dtype)
    )


# -- the capture's settings and the writer's side -------------------------------------------
class Encoding:
    """How a capture stores its layers' rows: ``quantize`` (``"fp8"``: float8_e4m3fn with one
    float32 scale per row; ``"int8"``: the same with int8) and/or ``compress`` (``"zstd"``:
    lossless, in chunks of about ``chunk_bytes`` uncompressed bytes, ``level`` 1-22;
    ``byte_planes`` splits 2- and 4-byte values into byte planes). Made by the capture from its
    ``quantize=``/``compress=`` arguments; the writer thread calls :meth:`encode` per shard.

    >>> enc = Encoding("fp8")
    >>> enc.layer_info("h", torch.float32, {"dtype": "float32", "row_shape": [4]})["encoding"]
    {'quantize': 'fp8', 'stored': 'float8_e4m3fn', 'scale': '__scale__.h'}
    >>> Encoding("fp8").layer_info("ids", torch.int64, {"dtype": "int64", "row_shape": []})
    Traceback (most recent call last):
    ...
    ValueError: layer 'ids': quantize='fp8' stores floating-point rows, but its rows are int64; capture this layer without quantize (or cast it with dtype=)
    """

    def __init__(
        self,
        quantize: str | None = None,
        compress: str | None = None,
        *,
        level: int = DEFAULT_LEVEL,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        byte_planes: bool = True,
    ) -> None:
        self.quantize = check_quantize(quantize)
        self.compress = check_compress(compress)
        if not isinstance(level, int) or not 1 <= level <= 22:
            raise ValueError(f"compress level must be an int in 1..22, got {level!r}")
        if not isinstance(chunk_bytes, int) or not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(
                f"chunk_bytes must be an int in 1..{MAX_CHUNK_BYTES} (1 GiB), got {chunk_bytes!r}"
            )
        self.level, self.chunk_bytes, self.byte_planes = level, chunk_bytes, bool(byte_planes)

    def __bool__(self) -> bool:
        return bool(self.quantize or self.compress)

    def settings(self) -> dict[str, Any]:
        """The capture settings that name this encoding (only those set: a plain capture's
        settings, and so its resume, are as before)."""
        out: dict[str, Any] = {}
        if self.quantize:
            out["quantize"] = self.quantize
        if self.compress:
            out["compress"] = self.compress
        return out

    def check_dtype(self, dtype: torch.dtype | None, what: str = "dtype") -> None:
        """Refuse a cast (``dtype=``) that cannot be quantised, before any forward."""
        if (
            self.quantize
            and dtype is not None
            and (not dtype.is_floating_point or dtype.itemsize < 2)
        ):
            raise ValueError(
                f"quantize={self.quantize!r} stores floating-point rows of 2 bytes or more, but "
                f"{what}={str(dtype).replace('torch.', '')} was asked for; drop one of the two"
            )

    def layer_info(self, name: str, dtype: torch.dtype, info: dict[str, Any]) -> dict[str, Any]:
        """The index's entry of layer ``name`` (``info``: its logical dtype and row shape) with
        this encoding added; reserved tensors (``__...``) are stored as they are."""
        if name.startswith("__") or not self:
            return info
        enc: dict[str, Any] = {}
        stored = dtype
        if self.quantize:
            if not dtype.is_floating_point or dtype.itemsize < 2:
                raise ValueError(
                    f"layer {name!r}: quantize={self.quantize!r} stores floating-point rows, but "
                    f"its rows are {str(dtype).replace('torch.', '')}; capture this layer without "
                    "quantize (or cast it with dtype=)"
                )
            stored = _dtype(QUANTIZE[self.quantize][0])
            enc.update(quantize=self.quantize, stored=QUANTIZE[self.quantize][0])
            enc["scale"] = SCALE_PREFIX + name
        if self.compress:
            row_bytes = max(1, _row_bytes(stored, info["row_shape"]))
            planes = stored.itemsize if self.byte_planes and stored.itemsize in (2, 4, 8) else 1
            enc.update(
                compress=self.compress,
                level=self.level,
                chunk_rows=max(1, self.chunk_bytes // row_bytes),
                byte_planes=planes,
                chunks=CHUNKS_PREFIX + name,
            )
        return {**info, "encoding": enc}

    @staticmethod
    def reserved(info: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """The index entries of the reserved tensors an encoded layer keeps beside it."""
        enc = info.get("encoding") or {}
        out: dict[str, dict[str, Any]] = {}
        if "scale" in enc:
            out[enc["scale"]] = {"dtype": "float32", "row_shape": []}
        if "chunks" in enc:
            out[enc["chunks"]] = {"dtype": "int64", "row_shape": []}
        return out

    @staticmethod
    def encode(
        pieces: dict[str, list[torch.Tensor]],
        rows: dict[str, int],
        layers: dict[str, dict[str, Any]],
    ) -> tuple[dict[str, list[torch.Tensor]], dict[str, int]]:
        """One shard's tensors (name -> pieces, rows per name) with every encoded layer (per
        ``layers``, the index's table) replaced by its encoded tensor and its reserved tensors
        (scales, chunk offsets) added after it. Runs on the writer thread, after the
        statistics were taken from the rows as captured."""
        out: dict[str, list[torch.Tensor]] = {}
        counts = dict(rows)
        for name, ps in pieces.items():
            enc = (layers.get(name) or {}).get("encoding")
            if not enc:
                out[name] = ps
                continue
            stored = ps
            extra: dict[str, list[torch.Tensor]] = {}
            if enc.get("quantize"):
                try:
                    pairs = [quantize_rows(p, enc["quantize"]) for p in ps]
                except ValueError as e:
                    raise ValueError(f"layer {name!r}: {e}") from None
                stored = [q for q, _ in pairs]
                extra[enc["scale"]] = [s for _, s in pairs]
                counts[enc["scale"]] = rows[name]
            if enc.get("compress"):
                t = stored[0] if len(stored) == 1 else torch.cat(stored)
                blob, offsets = compress_rows(
                    t, enc["chunk_rows"], level=enc["level"], planes=enc["byte_planes"]
                )
                stored = [blob]
                extra[enc["chunks"]] = [offsets]
                counts[enc["chunks"]] = int(offsets.numel())
            out[name] = stored
            out.update(extra)
        return out, counts


def stored_layout(info: dict[str, Any], rows: int, header: dict[str, Any]) -> tuple[str, list[Any]]:
    """``(safetensors dtype code, shape)`` that a shard's header must hold for an encoded layer
    of ``rows`` rows: the quantised rows ``[rows, *row_shape]``, or, compressed, a uint8 blob
    of any length (checked against its frame offsets when decoded)."""
    enc = info["encoding"]
    if enc.get("compress"):
        shape = header.get("shape")
        ok = (
            isinstance(shape, list)
            and len(shape) == 1
            and isinstance(shape[0], int)
            and shape[0] >= 0
        )
        return "U8", list(shape) if ok and isinstance(shape, list) else ["<bytes>"]
    stored = _dtype(enc.get("stored", info["dtype"]))
    return _DTYPE_TO_ST[stored], [rows, *info.get("row_shape", [])]


def layer_bytes(info: dict[str, Any], shards: Sequence[Any], name: str) -> tuple[int, int]:
    """``(stored, decoded)`` bytes of layer ``name``: what its shards hold (the encoded rows and
    their reserved tensors, from the shards' headers when known) and what its rows take once
    read, in their logical dtype."""
    decoded = int(info.get("rows", 0)) * _row_bytes(_dtype(info["dtype"]), info["row_shape"])
    enc = info.get("encoding")
    if not enc:
        return decoded, decoded
    names = [name, *[enc[k] for k in ("scale", "chunks") if k in enc]]
    stored = 0
    for s in shards:
        header = getattr(s, "header", None)
        for n in names:
            if n not in s.entry["rows"]:
                continue
            if header is not None and n in header:
                a, b = header[n]["data_offsets"]
                stored += b - a
            elif n == name and not enc.get("compress"):
                stored += s.entry["rows"][n] * _row_bytes(_dtype(enc["stored"]), info["row_shape"])
            elif n == enc.get("scale"):
                stored += 4 * s.entry["rows"][n]
            else:
                return -1, decoded  # compressed sizes are in the headers only
    return stored, decoded


#: Bytes a zstd frame adds to its input at most when the input does not compress (zstd then
#: stores it as raw blocks): the frame header (18 at most) and checksum (4), plus the frame's
#: int64 offset kept beside the blob (8); and 3 a block of 128 KiB.
_FRAME_BYTES = 18 + 4 + 8
_BLOCK = 128 << 10


def stored_bytes_bound(
    enc: dict[str, Any], rows: int, row_bytes: int, shards: int = 1
) -> tuple[int, bool]:
    """``(bytes, exact)``: what ``rows`` rows of ``row_bytes`` stored bytes each (after
    quantisation; scales not included) take in the shards of a layer encoded as ``enc`` (its
    index entry, :meth:`Encoding.layer_info`), split over at most ``shards`` shards. Exact
    without ``compress``; with it, an upper bound: the rows uncompressed plus the most zstd
    adds to input it cannot compress (what compression saves depends on the values, unknown
    before the capture: 1.44x on bf16 activations in benchmarks/bench_compact.py).

    >>> enc = Encoding(compress="zstd").layer_info(
    ...     "h", torch.bfloat16, {"dtype": "bfloat16", "row_shape": [384]})["encoding"]
    >>> stored_bytes_bound(enc, 1000, 768)
    (768866, False)
    """
    plain = rows * row_bytes
    if not enc.get("compress"):
        return plain, True
    cr, planes = int(enc["chunk_rows"]), int(enc.get("byte_planes", 1))
    frames = (math.ceil(rows / cr) + max(1, shards)) * planes  # a shard starts a new chunk
    blocks = max(1, math.ceil(cr * row_bytes / planes / _BLOCK))
    return plain + frames * (_FRAME_BYTES + 3 * blocks) + 8 * max(1, shards), False


def describe(info: dict[str, Any]) -> str:
    """``"fp8"``, ``"zstd"``, ``"fp8+zstd"`` or ``"-"``."""
    enc = info.get("encoding") or {}
    parts = [enc[k] for k in ("quantize", "compress") if enc.get(k)]
    return "+".join(parts) or "-"


# -- reading -----------------------------------------------------------------------------------
class _ChunkCache:
    """Decoded rows of a compressed layer, per shard: a buffer of the shard's rows and which of
    its chunks are decoded in it. Past ``max_bytes`` the least recently used shard's buffer is
    dropped; a shard larger than ``max_bytes`` is never kept (its chunks are decoded for each
    read that touches them)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[int, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()
        self.complete: set[int] = set()  # shards whose every chunk is decoded in the cache

    def get(self, key: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
            return item

    def make(
        self, key: int, shape: tuple[int, ...], dtype: torch.dtype, chunks: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A new empty entry for shard ``key`` (older ones dropped to make room), or None when
        it alone exceeds the bound."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > self.max_bytes:
            return None
        with self._lock:
            item = self._items.get(key)
            if item is not None:  # made by another thread since its get: kept, chunks and all
                self._items.move_to_end(key)
                return item
            while self._items and self.bytes + nbytes > self.max_bytes:
                key_out, (old, _) = self._items.popitem(last=False)
                self.complete.discard(key_out)
                self.bytes -= old.nbytes
            item = (torch.empty(shape, dtype=dtype), torch.zeros(chunks, dtype=torch.bool))
            self._items[key] = item
            self.bytes += nbytes
            return item


def _dequant(
    parts: list[torch.Tensor],
    scales: list[torch.Tensor],
    idx: torch.Tensor,
    dtype: torch.dtype,
    out: torch.Tensor | None,
) -> torch.Tensor:
    from .._backend import dequant_rows, dequant_rows_into

    if out is None:
        return dequant_rows(parts, scales, idx, dtype)
    return dequant_rows_into(parts, scales, idx, out)


def _gather(
    parts: list[torch.Tensor], idx: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None
) -> torch.Tensor:
    from .._backend import gather_rows, gather_rows_into

    if parts[0].dtype == dtype:
        return gather_rows(parts, idx) if out is None else gather_rows_into(parts, idx, out)
    rows = gather_rows(parts, idx).to(dtype)
    return rows if out is None else out.copy_(rows)


class EncodedLayerData:
    """The rows of one layer of a compact store, read like :class:`~pyhook.store.LayerData`:
    indexing (ints, slices, index lists, boolean masks), :meth:`to_tensor`, :attr:`parts`,
    ``reader.batches(...)``; every read returns decoded rows in :attr:`dtype` (the dtype the
    rows were captured in, or the one :meth:`astype` asks for), copies the caller owns.

    Quantised rows are dequantised inside the native gather (``pyhook::dequant_rows``);
    compressed rows are decoded one chunk at a time, only the chunks a read touches, into a
    bounded cache (``cache_bytes`` per layer, by default :func:`chunk_cache_bytes`'s: the
    reader's ``chunk_cache_bytes``, ``PYHOOK_CHUNK_CACHE_BYTES`` or 128 MiB) that later reads
    gather from as from a plain store.

    >>> import tempfile
    >>> import pyhook
    >>> net, out = torch.nn.Sequential(torch.nn.Linear(4, 8)), tempfile.mkdtemp()
    >>> x = torch.randn(6, 4)
    >>> with pyhook.capture(net, "0", out=out, quantize="fp8"):
    ...     _ = net(x)
    >>> h = pyhook.open_capture(out)["0"]
    >>> h.dtype, h.encoding["quantize"], torch.allclose(h[:], net(x), rtol=2**-4, atol=1e-3)
    (torch.float32, 'fp8', True)
    """

    def __init__(
        self,
        name: str,
        shards: Sequence[Any],
        info: dict[str, Any],
        rows: Sequence[int],
        *,
        dtype: torch.dtype | None = None,
        cache_bytes: int | None = None,
        _cache: _ChunkCache | None = None,
    ) -> None:
        self.name = name
        self._sources = list(shards)  # _MappedShard each (their tensor(name) is a checked view)
        self._info = info
        self.encoding: dict[str, Any] = dict(info["encoding"])
        self.stored_dtype = _dtype(self.encoding.get("stored", info["dtype"]))
        self.dtype = dtype or _dtype(info["dtype"])
        if self.encoding.get("quantize") and self.dtype not in (
            torch.float32,
            torch.float64,
            torch.bfloat16,
            torch.float16,
        ):
            raise ValueError(
                f"layer {name!r}: quantised rows read back as float32, float64, bfloat16 or "
                f"float16, not {self.dtype}"
            )
        self.row_shape = tuple(info["row_shape"])
        self._rows = [int(r) for r in rows]
        self._starts = [0]
        for r in self._rows:
            self._starts.append(self._starts[-1] + r)
        self._starts_t = torch.tensor(self._starts, dtype=torch.long)
        # Remote shards are downloaded when first touched: only the touched ones are asked for.
        self._local = all(getattr(s, "fetch", None) is None for s in self._sources)
        if _cache is None:
            _cache = _ChunkCache(chunk_cache_bytes(cache_bytes, "cache_bytes"))
        self._cache = _cache

    # -- the LayerData interface ----------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return torch.Size([len(self), *self.row_shape])

    def __len__(self) -> int:
        return self._starts[-1]

    def astype(self, dtype: torch.dtype | str) -> EncodedLayerData:
        """The same rows, read as ``dtype`` (dequantised straight into it: e.g. bfloat16 for a
        trainer in bfloat16, without a float32 copy). Shares the decoded-chunk cache."""
        d = parse_dtype(dtype, "dtype")
        assert d is not None
        held = _dtype(self._info["dtype"])
        if d != held and (
            d not in (torch.float64, torch.float32, torch.float16, torch.bfloat16)
            or not held.is_floating_point
        ):
            # as dataset(dtype=): floating-point layers read in a floating dtype of 2 bytes or more
            raise ValueError(
                f"astype({str(d).replace('torch.', '')}): layer {self.name!r} holds "
                f"{str(held).replace('torch.', '')} rows; its rows are read as float64, float32, "
                "float16 or bfloat16 (a floating-point layer) or as they are stored"
            )
        return EncodedLayerData(
            self.name, self._sources, self._info, self._rows, dtype=d, _cache=self._cache
        )

    def with_cache(self, cache_bytes: int) -> EncodedLayerData:
        """The same rows with a decoded-chunk cache of its own, bounded by ``cache_bytes``
        (what ``dataset(chunk_cache_bytes=...)`` reads through; matters for compressed
        layers only).

        >>> import tempfile
        >>> import pyhook
        >>> net, out = torch.nn.Sequential(torch.nn.Linear(4, 8)), tempfile.mkdtemp()
        >>> with pyhook.capture(net, "0", out=out, compress="zstd"):
        ...     _ = net(torch.randn(6, 4))
        >>> h = pyhook.open_capture(out)["0"].with_cache(0)  # decode on every read
        >>> h[:2].shape, h._cache.bytes
        (torch.Size([2, 8]), 0)
        """
        return EncodedLayerData(
            self.name,
            self._sources,
            self._info,
            self._rows,
            dtype=self.dtype,
            cache_bytes=chunk_cache_bytes(cache_bytes, "cache_bytes"),
        )

    def _mapped_quantised(self) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """``(parts, scales)``: every local shard's memory-mapped quantised rows and their
        scales, for a caller that reads batches of several layers in one native call
        (:mod:`pyhook.dataset`); None for rows that are compressed, remote or not quantised."""
        if (
            not self.encoding.get("quantize")
            or self.encoding.get("compress")
            or not self._local
            or not self._sources
        ):
            return None
        n = len(self._sources)
        return (
            [self._tensor(i, self.name) for i in range(n)],
            [self._tensor(i, self.encoding["scale"]) for i in range(n)],
        )

    @property
    def parts(self) -> list[torch.Tensor]:
        """The decoded rows of each shard, one tensor per shard."""
        return [self._gather(torch.arange(a, b)) for a, b in zip(self._starts, self._starts[1:])]

    def to_tensor(self) -> torch.Tensor:
        """All rows, decoded, as one tensor."""
        return self._gather(torch.arange(len(self)))

    def __getitem__(self, index: Any) -> torch.Tensor:
        n = len(self)
        if (
            not isinstance(index, (slice, torch.Tensor))
            and not hasattr(index, "__len__")
            and hasattr(index, "__index__")
        ):
            i = int(index.__index__())
            if i < 0:
                i += n
            if not 0 <= i < n:
                raise IndexError(f"row {index} out of range for layer {self.name!r} with {n} rows")
            return self._gather(torch.tensor([i]))[0]
        if isinstance(index, slice):
            r = range(*index.indices(n))  # an empty slice (h[5:2]) gives no rows, as for a tensor
            return self._gather(torch.arange(r.start, r.start + r.step * len(r), r.step))
        idx = torch.as_tensor(index)
        if idx.numel() == 0 and idx.dtype != torch.bool:
            idx = idx.long()
        if idx.dtype == torch.bool:
            if idx.shape != (n,):
                raise IndexError(
                    f"a boolean mask over layer {self.name!r} must have shape ({n},), got "
                    f"{tuple(idx.shape)}"
                )
            return self._gather(idx.nonzero().squeeze(1))
        if idx.is_floating_point() or idx.is_complex():
            raise IndexError(
                f"rows of layer {self.name!r} are indexed by ints, slices, int sequences or "
                f"boolean masks, got a {idx.dtype} index"
            )
        if idx.dim() == 0:
            return self[int(idx)]
        return self._gather(idx.long().reshape(-1)).reshape(*idx.shape, *self.row_shape)

    def __repr__(self) -> str:
        return (
            f"<EncodedLayerData {self.name!r} shape={tuple(self.shape)} "
            f"dtype={str(self.dtype).replace('torch.', '')} encoding={describe(self._info)} "
            f"parts={len(self._sources)}>"
        )

    def source(self) -> DecodedSource:
        """What :mod:`pyhook.dataset` gathers this layer's batches from."""
        return DecodedSource(self)

    # -- decoding ------------------------------------------------------------------------------
    def _gather(self, idx: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        n = len(self)
        idx = torch.where(idx < 0, idx + n, idx)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise IndexError(f"row index out of range for layer {self.name!r} with {n} rows")
        if not idx.numel():
            return torch.empty((0, *self.row_shape), dtype=self.dtype) if out is None else out
        if not self.encoding.get("compress") and self._local:
            # Local shards: every part's map is cheap to hand over (the kernel touches only the
            # rows asked for), so the batch goes to the kernel as it is, in one call.
            raw = [self._tensor(i, self.name) for i in range(len(self._sources))]
            if self.encoding.get("quantize"):
                scales = [self._tensor(i, self.encoding["scale"]) for i in range(len(raw))]
                return _dequant(raw, scales, idx, self.dtype, out)
            return _gather(raw, idx, self.dtype, out)
        part_of = torch.bucketize(idx, self._starts_t[1:], right=True)
        local = idx - self._starts_t[part_of]
        if self.encoding.get("compress"):
            return self._gather_chunks(part_of, local, out)
        touched, inverse = torch.unique(part_of, return_inverse=True)
        ids = touched.tolist()
        sizes = torch.tensor([self._rows[i] for i in ids], dtype=torch.long)
        starts = torch.cumsum(sizes, 0) - sizes
        j = starts[inverse] + local
        raw = [self._tensor(i, self.name) for i in ids]
        if self.encoding.get("quantize"):
            scales = [self._tensor(i, self.encoding["scale"]) for i in ids]
            return _dequant(raw, scales, j, self.dtype, out)
        return _gather(raw, j, self.dtype, out)

    def _tensor(self, i: int, name: str) -> torch.Tensor:
        return self._sources[i].tensor(name)

    def _gather_chunks(
        self, part_of: torch.Tensor, local: torch.Tensor, out: torch.Tensor | None
    ) -> torch.Tensor:
        cr = int(self.encoding["chunk_rows"])
        if len(self._cache.complete) == len(self._sources):
            # Every shard decoded and kept: gathered like a plain store, in one kernel call.
            entries = [self._cache.get(i) for i in range(len(self._sources))]
            if all(e is not None for e in entries):
                buffers = [e[0] for e in entries if e is not None]
                idx = self._starts_t[part_of] + local
                if self.encoding.get("quantize"):
                    scales = [self._tensor(i, self.encoding["scale"]) for i in range(len(buffers))]
                    return _dequant(buffers, scales, idx, self.dtype, out)
                return _gather(buffers, idx, self.dtype, out)
        chunk = torch.div(local, cr, rounding_mode="floor")
        touched, inverse = torch.unique(part_of, return_inverse=True)
        ids = touched.tolist()
        buffers = []
        for i in ids:
            entry = self._cache.get(i)
            if entry is None:
                rows = self._rows[i]
                entry = self._cache.make(
                    i, (rows, *self.row_shape), self.stored_dtype, -(-rows // cr)
                )
                if entry is None:  # a shard larger than the cache: decode chunk by chunk
                    return self._gather_blocks(part_of, local, chunk, out)
            buf, done = entry
            need = torch.unique(chunk[part_of == i])
            missing = need[~done[need]].tolist()
            for c in missing:  # only chunks not decoded before
                block = self._chunk(i, c)
                buf[c * cr : c * cr + block.shape[0]] = block
                done[c] = True
            if missing and bool(done.all()):
                self._cache.complete.add(i)
            buffers.append(buf)
        sizes = torch.tensor([self._rows[i] for i in ids], dtype=torch.long)
        j = (torch.cumsum(sizes, 0) - sizes)[inverse] + local
        if self.encoding.get("quantize"):
            scales = [self._tensor(i, self.encoding["scale"]) for i in ids]
            return _dequant(buffers, scales, j, self.dtype, out)
        return _gather(buffers, j, self.dtype, out)

    def _gather_blocks(
        self,
        part_of: torch.Tensor,
        local: torch.Tensor,
        chunk: torch.Tensor,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """Without the cache: every chunk the rows touch, decoded for this read."""
        cr = int(self.encoding["chunk_rows"])
        per = max(self._rows) // cr + 1
        keys, inverse = torch.unique(part_of * per + chunk, return_inverse=True)
        blocks: list[torch.Tensor] = []
        scales: list[torch.Tensor] = []
        for k in keys.tolist():
            i, c = divmod(k, per)
            block = self._chunk(i, c)
            blocks.append(block)
            if self.encoding.get("quantize"):
                lo = c * cr
                scales.append(self._tensor(i, self.encoding["scale"])[lo : lo + block.shape[0]])
        sizes = torch.tensor([b.shape[0] for b in blocks], dtype=torch.long)
        starts = torch.cumsum(sizes, 0) - sizes
        j = starts[inverse] + (local - chunk * cr)
        if self.encoding.get("quantize"):
            return _dequant(blocks, scales, j, self.dtype, out)
        return _gather(blocks, j, self.dtype, out)

    def _chunk(self, i: int, c: int) -> torch.Tensor:
        shard = self._sources[i]
        cr = int(self.encoding["chunk_rows"])
        rows = min(cr, self._rows[i] - c * cr)
        # (a remote shard is fetched here: its own CaptureDamagedError names it already)
        blob, offsets = self._tensor(i, self.name), self._tensor(i, self.encoding["chunks"])
        try:
            block = decompress_chunk(
                blob,
                offsets,
                c,
                rows,
                self.stored_dtype,
                self.row_shape,
                int(self.encoding.get("byte_planes", 1)),
            )
        except ValueError as e:
            path = getattr(shard, "path", None)
            raise CaptureDamagedError(
                f"{path}: layer {self.name!r}: {e} (the shard is damaged; pyhook verify checks "
                "every shard's checksum)",
                path,
            ) from None
        return block


class DecodedSource:
    """A compact store's layer as :mod:`pyhook.dataset` reads it: ``gather(idx)`` and
    ``gather_into(idx, out)`` give decoded rows (``dtype``, ``row_shape``). Not a list of
    parts: the dataset asks it for whole batches."""

    __slots__ = ("layer",)

    def __init__(self, layer: EncodedLayerData) -> None:
        self.layer = layer

    @property
    def dtype(self) -> torch.dtype:
        return self.layer.dtype

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.layer.row_shape

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        return self.layer._gather(idx)

    def gather_into(self, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return self.layer._gather(idx, out)


def check_encoding(name: str, info: dict[str, Any], layers: dict[str, Any]) -> str | None:
    """What is wrong with the ``encoding`` of layer ``name`` in an index's layer table
    ``layers`` (its fields already of their types), or ``None``: exactly what
    :meth:`Encoding.layer_info` writes, so that what verify passes the decoder reads (a
    received store is untrusted input: docs/integrity.md).

    >>> info = Encoding(quantize="fp8").layer_info("h", torch.float32,
    ...                                            {"dtype": "float32", "row_shape": [4]})
    >>> layers = {"h": info, **Encoding.reserved(info)}
    >>> check_encoding("h", info, layers) is None
    True
    >>> check_encoding("h", {**info, "encoding": {**info["encoding"], "stored": "int8"}}, layers)
    "stores 'int8', where quantize 'fp8' stores 'float8_e4m3fn'"
    """
    enc = info["encoding"]
    q, c = enc.get("quantize"), enc.get("compress")
    fields = set()
    stored = info["dtype"]
    if q:
        if q not in QUANTIZE:
            return f"quantize {q!r}, not one of {sorted(QUANTIZE)}"
        stored = QUANTIZE[q][0]
        if not _dtype(info["dtype"]).is_floating_point or _dtype(info["dtype"]).itemsize < 2:
            return f"quantize {q!r} of {info['dtype']} rows, which are not floating-point"
        if enc.get("stored") != stored:
            return f"stores {enc.get('stored')!r}, where quantize {q!r} stores {stored!r}"
        if enc.get("scale") != SCALE_PREFIX + name:
            return f"keeps its scales in {enc.get('scale')!r}, not {SCALE_PREFIX + name!r}"
        fields |= {"quantize", "stored", "scale"}
    if c:
        if c not in COMPRESS:
            return f"compress {c!r}, not one of {list(COMPRESS)}"
        if enc.get("chunks") != CHUNKS_PREFIX + name:
            return f"keeps its frame table in {enc.get('chunks')!r}, not {CHUNKS_PREFIX + name!r}"
        missing = [k for k in ("level", "chunk_rows", "byte_planes") if k not in enc]
        if missing:
            return f"compresses without {missing}"
        size = _dtype(stored).itemsize
        row = _row_bytes(_dtype(stored), info["row_shape"])
        if enc["chunk_rows"] > max(1, MAX_CHUNK_BYTES // max(row, 1)):
            return f"has chunks of {enc['chunk_rows']} rows, more than {MAX_CHUNK_BYTES} bytes"
        if enc["byte_planes"] not in {1, size if size in (2, 4, 8) else 1}:
            return f"splits {stored} values into {enc['byte_planes']} byte planes"
        fields |= {"compress", "level", "chunk_rows", "byte_planes", "chunks"}
    if not fields:
        return "has an encoding that neither quantizes nor compresses"
    extra = sorted(set(enc) - fields)
    if extra:
        return f"has encoding fields {extra} that its encoding does not write"
    for table, layout in Encoding.reserved(info).items():
        have = layers.get(table)
        have = {k: have.get(k) for k in layout} if isinstance(have, dict) else have
        if have != layout:  # (the merged index's table adds rows and shape)
            return f"needs {table!r} {layout} in the layer table, which has {have}"
    return None


def encoded_rows(info: dict[str, Any], rows: int) -> dict[str, int]:
    """The rows of the reserved tensors that a shard holding ``rows`` rows of a layer encoded
    as ``info`` (its index entry) lists: one scale per row, and the zstd frame table's
    ``chunks * byte_planes + 1`` offsets.

    >>> info = Encoding(compress="zstd").layer_info("h", torch.float32,
    ...                                             {"dtype": "float32", "row_shape": [4]})
    >>> info["encoding"]["byte_planes"], encoded_rows(info, 10)  # 1 chunk of 4 planes
    (4, {'__chunks__.h': 5})
    """
    enc = info["encoding"]
    out = {}
    if enc.get("quantize"):
        out[enc["scale"]] = rows
    if enc.get("compress"):
        out[enc["chunks"]] = -(-rows // enc["chunk_rows"]) * enc["byte_planes"] + 1
    return out


# The format checks each shard's header against the index; an encoded layer's header is this
# module's to describe, and so is its encoding's schema. Handed over here (the format never
# imports this module back): pyhook's __init__ imports the dataset, which imports this module,
# before any capture is opened.
_format._encoded_layout = stored_layout
_format._encoding_schema = (check_encoding, encoded_rows)


def check_frames(
    info: dict[str, Any], rows: int, blob: np.ndarray, offsets: np.ndarray
) -> str | None:
    """What is wrong with a shard's compressed layer for the decoder, or ``None``: its frame
    table ``offsets`` (int64) tiles the layer's bytes ``blob`` (uint8) from 0 to the end, holds
    one frame per byte plane of each chunk of ``chunk_rows`` of the shard's ``rows`` rows, and
    each frame decodes to the bytes of its chunk's rows (its zstd header's content size; a
    frame without one is decoded). What :func:`decompress_chunk` relies on, checked without
    decoding the frames (``pyhook verify``; a received store is untrusted input).

    >>> info = Encoding(compress="zstd").layer_info("h", torch.float32,
    ...                                             {"dtype": "float32", "row_shape": [4]})
    >>> info["encoding"]["chunk_rows"] = 2  # (4 byte planes of float32 rows of 4 values)
    >>> blob, offsets = compress_rows(torch.ones(3, 4), 2, planes=4)
    >>> check_frames(info, 3, blob.numpy(), offsets.numpy()) is None
    True
    >>> check_frames(info, 4, blob.numpy(), offsets.numpy())  # a row more than the frames hold
    'frame 4 (chunk 1, plane 0) decodes to 4 bytes, the 2 rows of its chunk take 8'
    """
    enc = info["encoding"]
    cr, planes = int(enc["chunk_rows"]), int(enc.get("byte_planes", 1))
    stored = _dtype(enc.get("stored", info["dtype"]))
    plane_bytes = _row_bytes(stored, info["row_shape"]) // planes  # one row's bytes per plane
    chunks = -(-rows // cr)
    if offsets.shape != (chunks * planes + 1,):
        return (
            f"has a frame table of {offsets.shape[0] if offsets.ndim else 0} offsets, its "
            f"{rows} rows in chunks of {cr} need {chunks * planes + 1}"
        )
    bounds = offsets.tolist()
    if bounds[0] != 0 or bounds[-1] != blob.shape[0]:
        return f"has frames over bytes {bounds[0]}..{bounds[-1]}, not the {blob.shape[0]} it holds"
    zstd = _zstd()
    for f, (a, b) in enumerate(itertools.pairwise(bounds)):
        c, p = divmod(f, planes)
        want = min(cr, rows - c * cr) * plane_bytes
        where = f"frame {f} (chunk {c}, plane {p})"
        if b < a:
            return f"{where} ends at byte {b}, before it starts ({a})"
        frame = blob[a:b].tobytes()
        try:
            size = zstd.frame_content_size(frame)
        except Exception as e:  # zstandard.ZstdError: no frame header there
            return f"{where}: not a zstd frame ({e})"
        if size < 0:  # the content size is not in the header: decoded
            try:
                size = len(_decompressor().decompress(frame, max_output_size=want + 1))
            except Exception as e:
                return f"{where}: {e}"
        if size != want:
            n = min(cr, rows - c * cr)
            return f"{where} decodes to {size} bytes, the {n} rows of its chunk take {want}"
    return None
