"""High-throughput activation capture: :func:`capture` / :class:`Recorder`.

Pick layers by name or glob, optionally reduce on the device (token positions, a mask such as the
attention mask, a dtype cast), and send each captured tensor to a destination:

* ``to="device"``: stays where the model computed it (a detached copy);
* ``to="host"``: host memory; on CUDA through pinned buffers on a side stream (see
  :mod:`pyhook.offload`), so the copy overlaps the rest of the forward; with
  ``buffers=HostBuffers()`` into host buffers that a loop of captures reuses;
* ``to="disk"`` (or just ``out=DIR``): safetensors shards written by a background thread (see
  :mod:`pyhook.store`); read them back with :func:`pyhook.store.open_capture`.

Rows: what is stored along dim 0. For a layer output with a token dimension (``[batch, tokens,
...]``) and ``flatten=True`` (the default) one row is one token: all ``batch * tokens`` tokens, or
only the valid ones when a ``mask`` is given. With ``positions`` set to an ``int`` or ``"last"`` one
row is one example (the selected token of each). Outputs without a token dimension (``[batch,
hidden]``, e.g. a pooler) always give one row per example; so does ``flatten=False``.

Example::

    >>> import torch, pyhook
    >>> from pyhook.capture import capture
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> x = torch.randn(3, 5, 4)  # 3 examples of 5 tokens
    >>> with capture(net, ["0", "2"]) as rec:
    ...     _ = net(x)
    >>> rec["0"].shape, torch.equal(rec["2"], net(x).reshape(15, 2))
    (torch.Size([15, 8]), True)
"""

from __future__ import annotations

import json
import os
import re
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from .. import _backend, _malloc
from .._compiled import unwrap_compiled
from .._hooks import HookSet, compiled_path
from .._version import __version__
from ..modules import LayerNotFoundError, glob_regex, resolve_module
from ..offload import (
    HostBuffers,
    Offloader,
    PendingCopy,
    check_byte_count,
    resident_bytes,
    trim_host_memory,
)
from ..points import all_points, module_path, resolve_targets
from ._record import (
    CaptureModifiedError,
    MaskSpec,
    Positions,
    Reduction,
    _Note,
    check_guard,
    check_mask_name,
    positions_repr,
    row_annotations,
)
from ._record_compiled import CompiledPath
from ._record_eager import EagerPath
from .encoding import Encoding
from .format import dtype_name, parse_dtype
from .ranks import rank_layout
from .writer import ShardWriter

__all__ = [
    "CaptureModifiedError",
    "MaskSpec",
    "Positions",
    "Recorder",
    "capture",
    "resolve_layers",
]

Destination = Literal["device", "host", "disk"]

_GLOB_CHARS = re.compile(r"[*?]")


def _list_names(names: Sequence[str], limit: int = 60) -> str:
    shown = ", ".join(names[:limit])
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return shown + more


def resolve_layers(
    model: nn.Module, layers: str | nn.Module | Iterable[str | nn.Module]
) -> list[tuple[str, nn.Module]]:
    """Expand exact names, globs and submodules into ``[(name, module), ...]`` in model order.

    ``*`` matches within one dotted component (``transformer.h.*`` is each block, not its
    children), ``**`` matches across dots, ``?`` one character. A glob matching nothing raises
    :class:`~pyhook.modules.LayerNotFoundError` listing the model's layer names.

    Example::

        >>> import torch
        >>> from pyhook.capture import resolve_layers
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU()))
        >>> [n for n, _ in resolve_layers(net, "*")], [n for n, _ in resolve_layers(net, "**")]
        (['0', '1'], ['0', '1', '1.0'])
    """
    paired = getattr(model, "_pyhook_resolve_layers", None)
    if paired is not None:  # several models as one (pyhook.pipeline.paired): NAME/LAYER
        return paired(layers)
    if isinstance(layers, (str, nn.Module)):
        layers = [layers]
    if not isinstance(layers, Iterable):
        raise TypeError(
            f"layers must be a name, a glob, a submodule or a list of them, got {type(layers).__name__}"
        )
    entries = list(layers)
    if not entries:
        raise ValueError(
            "layers is empty: name at least one layer (names or globs such as 'transformer.h.*')"
        )
    named: dict[str, nn.Module] | None = None
    found: dict[str, nn.Module] = {}
    for entry in entries:
        points = resolve_targets(model, entry)  # standard points (resid_post.*, ...), or None
        if points is not None:
            for n, point in points:
                found.setdefault(n, point)
        elif isinstance(entry, str) and _GLOB_CHARS.search(entry):
            if named is None:
                named = dict(model.named_modules())
            all_names = [n for n in named if n]
            rx = glob_regex(entry)
            hits = [n for n in all_names if rx.match(n)]
            if not hits:
                raise LayerNotFoundError(
                    entry,
                    f"layer glob {entry!r} matches no module of {type(model).__name__}; its layers are: "
                    + _list_names(all_names),
                )
            for n in hits:
                found.setdefault(n, named[n])
        elif isinstance(entry, (str, nn.Module)):
            name, module = resolve_module(model, entry)
            found.setdefault(name, module)
        else:
            raise TypeError(
                f"layers must hold names, globs or submodules, got {type(entry).__name__}: {entry!r}"
            )
    if len(found) < 2 or all_points(found.values()):
        return list(found.items())  # standard points come in forward order
    if named is None:
        named = dict(model.named_modules())
    order = {n: i for i, n in enumerate(named)}  # dicts keep named_modules' order
    # a standard point sorts with the module it hooks
    return sorted(found.items(), key=lambda kv: order.get(module_path(*kv), -1))


# Joined host results from this size on give the freed batch buffers back to the system.
_TRIM_BYTES = 16 << 20
# A disk capture that closes with the process this much above its size before is trimmed.
_TRIM_SLACK = 32 << 20
# Host buffers from this size on come from the native pool's own mappings (csrc/cpu/pool.cpp,
# kMapMin), never from malloc's heap; smaller ones (and every buffer of the reference backend)
# do.
_MAPPED_MIN = 1 << 20


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_positions_arg(positions: Any) -> None:
    ok = (
        positions is None
        or positions == "last"
        or _is_int(positions)
        or isinstance(positions, slice)
        or (isinstance(positions, (list, tuple)) and all(_is_int(p) for p in positions))
    )
    if not ok:
        raise ValueError(
            f"positions must be None, an int, 'last', a slice or a list of ints, got {positions!r}"
        )
    if isinstance(positions, (list, tuple)) and not positions:
        raise ValueError(
            "positions is an empty list, which would keep no token of any example; pass None "
            "for every token, 'last', an int, a slice or a non-empty list of ints"
        )


def _check_json(name: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a dict of JSON values, got {type(value).__name__}")
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{name} must be a dict of JSON values (str, numbers, bools, lists, dicts), "
            f"it is stored in the capture's index: {e}"
        ) from None


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model under torch.compile's (:func:`~pyhook._compiled.unwrap_compiled`) and DDP's
    wrappers: the model a capture's index names, so that a resume through another wrapper is
    the same model."""
    while True:
        inner = unwrap_compiled(model)
        if isinstance(inner, torch.nn.parallel.DistributedDataParallel):
            inner = inner.module
        if inner is model:
            return model
        model = inner


class _NullWriter:
    """The writer of a tensor-parallel rank that is not its group's writer: its rows are the
    writer rank's (the same examples, the same whole block outputs), so they are given back at
    once; it resumes where its writer does and meets the other ranks before the index merge."""

    _shard_limit = 0

    def __init__(self, examples_done: int, on_release: Callable[[dict[str, Any]], None]) -> None:
        self.examples_done = examples_done
        self.on_release = on_release

    def add(
        self, batch: dict[str, Any], examples: int, *, wait: Any = None, skipped: bool = False
    ) -> None:
        if wait is not None:
            wait()  # copies in flight into these buffers land before the buffers go back
        self.on_release(batch)

    def flush(self) -> None:
        pass

    def _check_error(self) -> None:
        pass

    def close(self, *, merge: bool = True, barrier: Any = None) -> None:
        if barrier is not None:
            barrier()  # the writers' close calls it once: every rank meets there

    def abort(self) -> None:
        pass

    def __exit__(self, *exc: Any) -> None:
        pass


class Recorder:
    """Records chosen layers' outputs over many forward passes; made by :func:`capture`.

    Example::

        >>> import torch
        >>> from pyhook.capture import Recorder
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        >>> with Recorder(net, "*", positions="last") as rec:
        ...     for _ in range(3):
        ...         _ = net(torch.randn(2, 6, 4))
        >>> rec.layers, rec["1"].shape, rec.examples
        (['0', '1'], torch.Size([6, 2]), 6)

    Hooks are registered on ``__enter__`` (atomically) and removed on ``__exit__``, also when the
    body raises. One batch = one call of ``model``: a pre-hook on ``model`` starts it (and reads
    the mask), the layer hooks reduce and start the copy of each output as soon as it exists,
    and a hook after ``model`` commits the batch. A forward that raises commits nothing; if a
    layer runs several times in one forward, the last call is kept. The work is done by one of
    two paths, :class:`pyhook._record_eager.EagerPath` or, for compiled models,
    :class:`pyhook._record_compiled.CompiledPath`; this class holds the settings, the
    destination and the counters.

    A forward that raises while the loop goes on (the caller skips that batch) stores no rows,
    but its examples still count in :attr:`examples` (and :attr:`skipped`), and with
    ``to="disk"`` in the index (``"skipped"`` lists their ranges), so that
    ``loader[rec.examples_done:]`` resumes at the right example. An error that leaves the
    ``with`` block is not counted: a resume retries that batch. A loop that runs a failed batch
    again instead of skipping it calls :meth:`retry` first, so that it is not counted twice.

    After exit (or during, for ``device``/``host``), ``rec[layer]`` is all rows of that layer;
    for ``to="disk"`` read the directory with :func:`pyhook.store.open_capture`. With ``to="disk"``
    an existing capture with the same settings is resumed: :attr:`examples_done` tells how many
    examples of the data are already stored (skip them).

    Token bookkeeping and statistics (see docs/store-format.md): for token rows, the token id
    and ``(example, position)`` of every row are kept next to the rows (:attr:`tokens`,
    :attr:`row_index`; on disk the reserved tensors ``__token_ids__``/``__row_index__``), from
    :meth:`annotate` or, without it, from an integer ``input_ids`` argument; ``stats=True``
    (the default for disk captures) keeps per-layer count, mean, variance and mean row norm,
    computed on the device while capturing (:meth:`stats`).
    """

    def __init__(
        self,
        model: nn.Module,
        layers: str | nn.Module | Iterable[str | nn.Module],
        *,
        to: Destination | None = None,
        out: str | os.PathLike[str] | None = None,
        positions: Positions = None,
        mask: MaskSpec = None,
        flatten: bool = True,
        dtype: torch.dtype | str | None = None,
        copy: bool = True,
        select: Callable[[Any], torch.Tensor] | None = None,
        overwrite: bool = False,
        shard_bytes: int | None = None,
        max_pending_shards: int | None = None,
        max_inflight_bytes: int | None = None,
        max_host_bytes: int = 256 << 20,
        meta: dict[str, Any] | None = None,
        settings: dict[str, Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        tp_size: int | None = None,
        fsync: bool = True,
        stats: bool | None = None,
        tokens: bool = True,
        quantize: str | None = None,
        compress: str | None = None,
        gradients: bool | str | Iterable[str] | None = None,
        metric: Any = None,
        buffers: HostBuffers | None = None,
    ) -> None:
        # Every argument is checked here, before a hook is registered or a file is written.
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        # The torch.compile wrapper, if given one: its own hooks run in eager Python around the
        # compiled forward (the compiled path finishes batches there, without a graph break).
        inner = unwrap_compiled(model)  # names resolve as in the eager model
        self._wrapper: nn.Module | None = model if inner is not model else None
        model = inner
        if to is None:
            to = "disk" if out is not None else "host"
        if to not in ("device", "host", "disk"):
            raise ValueError(f"to must be 'device', 'host' or 'disk', got {to!r}")
        if out is not None and not isinstance(out, (str, os.PathLike)):
            raise TypeError(
                f"out must be a directory path (str or os.PathLike), got {type(out).__name__}: "
                f"{out!r}"
            )
        if to == "disk" and out is None:
            raise ValueError("to='disk' needs out=<directory>")
        if to != "disk" and out is not None:
            raise ValueError(f"out= is only used with to='disk' (got to={to!r})")
        _check_positions_arg(positions)
        if mask is not None and not isinstance(mask, str) and not callable(mask):
            raise TypeError(
                "mask must be the name of a forward argument (e.g. 'attention_mask') or a callable "
                f"(args, kwargs) -> bool tensor [batch, tokens], got {type(mask).__name__}"
            )
        # a mask name only forward(**kwargs) could take: warned about once if a call lacks it
        self._mask_unlisted = isinstance(mask, str) and check_mask_name(model, mask)
        for flag, value in (("flatten", flatten), ("copy", copy), ("overwrite", overwrite)):
            if not isinstance(value, bool):
                raise TypeError(f"{flag} must be a bool, got {value!r}")
        for flag, value in (("fsync", fsync), ("tokens", tokens)):
            if not isinstance(value, bool):
                raise TypeError(f"{flag} must be a bool, got {value!r}")
        if stats is not None and not isinstance(stats, bool):
            raise TypeError(f"stats must be a bool or None, got {stats!r}")
        per_example = positions == "last" or _is_int(positions)
        if mask is not None and not flatten and not per_example:
            raise ValueError(
                "mask selects tokens, which needs flatten=True (rows = valid tokens) or positions "
                "'last'/int (rows = examples)"
            )
        if not copy and to == "disk":
            raise ValueError(
                "copy=False keeps references to the model's own output tensors, which the "
                "background disk writer cannot use safely; it is for to='host' or to='device'"
            )
        if select is not None and not callable(select):
            raise TypeError(
                f"select must be callable (output -> tensor), got {type(select).__name__}"
            )
        if buffers is not None:
            if not isinstance(buffers, HostBuffers):
                raise TypeError(
                    f"buffers must be a pyhook.HostBuffers, got {type(buffers).__name__}"
                )
            if to != "host":
                raise ValueError(
                    f"buffers= holds rows in host memory: it is for to='host', not to={to!r} "
                    "(a disk capture reuses its own pooled buffers already)"
                )
            if not copy:
                raise ValueError(
                    "buffers= is where copies of the rows go; copy=False keeps references to "
                    "the model's own tensors instead: use one or the other"
                )
        # Host memory: the capture's buffers (rows waiting for the disk, pooled copies, copies
        # in flight) are sized from one budget, so that a disk capture of any size holds about
        # max_host_bytes beyond the forward's own memory; each setting can be raised for speed.
        check_byte_count("max_host_bytes", max_host_bytes, 4)
        share = max_host_bytes // 4
        if shard_bytes is None:
            shard_bytes = share  # a batch larger than this is a shard of its own
        if max_pending_shards is None:
            max_pending_shards = 1
        if max_inflight_bytes is None:
            max_inflight_bytes = share
        check_byte_count("shard_bytes", shard_bytes, 1)
        if not _is_int(max_pending_shards) or max_pending_shards < 1:
            raise ValueError(f"max_pending_shards must be an int >= 1, got {max_pending_shards!r}")
        check_byte_count("max_inflight_bytes", max_inflight_bytes, 1)  # the Offloader is lazy
        self.max_host_bytes = max_host_bytes
        # Host captures into reusable buffers: this capture's lease of them (see HostBuffers).
        self._lease = buffers._lease(max_inflight_bytes) if buffers is not None else None
        self._pool_share = share
        self._pool_idle = share  # idle bytes the Offloader's pool keeps (see __enter__)
        # Rows held for the writer get the rest: with the pool's idle share, within the budget.
        self._rows_budget = max_host_bytes - share
        self._saved_pool_limit: int | None = None
        self._pool_limit_now = share  # the native pool's idle limit during a disk capture
        self._held = 0  # bytes of rows handed to the writer and not yet written
        self._held_cv = threading.Condition()
        # the most bytes of rows held at once for the writer (and by a generation capture)
        self.peak_held_bytes = 0
        _check_json("meta", meta)
        _check_json("settings", settings)
        # the ranks (pyhook.pipeline.ranks): the store's writer ranks are the data-parallel ones
        self.layout = rank_layout(tp_size=tp_size, model=model, rank=rank, world_size=world_size)
        self._rank, self._world = self.layout.dp_rank, self.layout.dp_size
        self.model = model
        self.to = to
        self.out = os.fspath(out) if out is not None else None
        self.positions = positions
        self.mask = mask
        self.flatten = flatten
        self.dtype = parse_dtype(dtype, "dtype")
        # Compact stores (pipeline/encoding.py): checked now, applied by the writer thread.
        self._encoding = Encoding(quantize, compress)
        if self._encoding and to != "disk":
            raise ValueError(
                f"quantize= and compress= choose how a disk capture stores its rows (to='disk', "
                f"out=DIR); got to={to!r}"
            )
        self._encoding.check_dtype(self.dtype)
        self.copy = copy
        self.select = select
        self.overwrite = overwrite
        self._reduction = Reduction(positions, flatten, self.dtype)
        self._stats = (to == "disk") if stats is None else stats
        self._tokens = tokens
        # Where finished batches go instead of the in-memory results (pyhook.pipeline.stream):
        # sink(batch, examples) with batch = {layer: rows, reserved name: tensor}. Host and
        # device captures call it from the forward's thread; disk captures from the writer
        # thread once the batch is on disk, before its buffers are reused (the sink copies).
        self._sink: Callable[[dict[str, Any], int], None] | None = None
        self._barrier: Callable[[], Any] | None = None  # ranks meet before the index merge
        # Batches kept back instead of stored (pyhook.pipeline.generate: the steps of one
        # generate call, joined into one batch once the sequences are final).
        self._hold: list[Any] | None = None
        self._writer_opts: dict[str, Any] = {
            "shard_bytes": shard_bytes,
            "max_pending": max_pending_shards,
            "fsync": fsync,
            "encoding": self._encoding or None,
        }
        self._modules = resolve_layers(model, layers)  # raises before anything is registered
        self.layers = [n for n, _ in self._modules]
        self._grads = None  # gradient layers "<layer>_grad" (pipeline/_record_grad.py)
        # A compiled model (or one with compiled layers): hooks go through dispatchers, and the
        # batches are built in code dynamo traces, then finished lazily.
        self._compiled = any(
            compiled_path(model, module_path(n, m)) is not None for n, m in self._modules
        )
        if gradients is not None or metric is not None:
            from ._record_grad import GradientLayers

            self._grads = GradientLayers(
                model,
                self.layers,
                gradients,
                metric,
                select=select,
                compiled=self._compiled,
            )
            self.layers = self.layers + self._grads.names
        self.meta = {"model": type(_unwrapped(model)).__name__, **(meta or {})}
        own = {
            "layers": self.layers,
            "positions": positions_repr(positions),
            "mask": mask
            if isinstance(mask, str) or mask is None
            else getattr(mask, "__name__", "callable"),
            "flatten": flatten,
            "dtype": dtype_name(self.dtype) if self.dtype is not None else None,
            **self._encoding.settings(),  # only when set: plain captures resume as before
            **(self._grads.settings() if self._grads is not None else {}),  # likewise
        }
        for key in ("layers", "mask", "flatten", "dtype", "quantize", "compress"):
            # what the resume check compares: a caller's settings may add to it, not hide it
            if settings and key in settings and settings[key] != own.get(key):
                raise ValueError(
                    f"settings[{key!r}] = {settings[key]!r} contradicts the capture's own "
                    f"{key} ({own.get(key)!r}), which its resume check compares; drop it from "
                    "settings"
                )
        self.settings = {**own, **(settings or {})}
        self._max_inflight_bytes = max_inflight_bytes
        # Made on first use: host captures of CPU tensors never need the engine.
        self._offloader_: Offloader | None = None
        self._hooks = HookSet(model=model)
        self._writer: ShardWriter | _NullWriter | None = None
        self._results: dict[str, list[Any]] = {n: [] for n in self.layers}
        # copy=False: (tensor, version) of each kept reference, checked on read
        self._guards: dict[str, list[Any]] = {n: [] for n in self.layers}
        self._extra: dict[str, list[torch.Tensor]] = {}  # reserved tensors of host captures
        self._joined: dict[str, tuple[torch.Tensor, int]] = {}  # rec[layer] and its batches
        self._note: _Note | None = None
        self._notes: dict[int, _Note] = {}  # compiled path: notes by batch number
        self._path: EagerPath | CompiledPath = self._new_path(weakref.proxy(self))
        self.examples = 0
        self.skipped = 0
        self.examples_done = 0
        self.rows: dict[str, int] = dict.fromkeys(self.layers, 0)
        self.bytes = 0
        self.batches = 0

    def _new_path(self, rec: Any) -> EagerPath | CompiledPath:
        return CompiledPath(rec) if self._compiled else EagerPath(rec)

    @property
    def _offloader(self) -> Offloader:
        if self._offloader_ is None:
            self._offloader_ = Offloader(
                max_inflight_bytes=self._max_inflight_bytes, pool_limit_bytes=self._pool_idle
            )
        return self._offloader_

    @staticmethod
    def _dist_info(rank: int | None, world: int | None) -> tuple[int, int]:
        lay = rank_layout(rank=rank, world_size=world)
        return lay.rank, lay.world

    @property
    def rank(self) -> int:
        """This process's writer rank in the store: its data-parallel rank (``layout``)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The store's writer ranks: the data-parallel groups (``layout.dp_size``)."""
        return self._world

    def _global_examples(self, start: int, n: int) -> torch.Tensor:
        """Example indices of this rank's ``n`` examples from its ``start``-th, global across
        the data-parallel ranks as a ``DistributedSampler`` without shuffling deals them
        (example ``k`` of rank ``r`` of ``R`` is ``k * R + r``); one rank: ``start..``."""
        local = torch.arange(start, start + n, dtype=torch.long)
        return local * self._world + self._rank if self._world > 1 else local

    # -- lifetime --------------------------------------------------------------------------
    def __enter__(self) -> Recorder:
        if self._hooks.active:
            raise RuntimeError("this Recorder is already active")
        # The path holds this Recorder strongly while its hooks are registered (the model keeps
        # them), weakly otherwise: no reference cycle keeps captured rows alive.
        _malloc.tune()  # glibc's heap kept between forwards (pyhook/_malloc.py says why)
        self._path = self._new_path(self)
        self._note = None
        self._notes = {}
        self._held = 0
        self._heap_bytes = 0
        if self.to == "disk":
            assert self.out is not None
            # Without the pool's idle buffers, which the close gives back whatever this capture
            # does: counted here, a pool left full by earlier work (250 MB of freed batches)
            # hid a capture's growth, and the close did not trim.
            self._rss_before = resident_bytes() - _backend.pool_stats()["cached_bytes"]
            self._writer = self._open_writer()
            # The rows held get 3/4 of the budget, the pools 1/4.
            idle = self._pool_share
            if self._offloader_ is None:
                self._pool_idle = idle
            self._pool_limit_now = idle
            self.examples_done = self._writer.examples_done
            self._limit_pool()
        try:
            with self._hooks.registering():
                self._path.install(self._hooks)
        except BaseException:
            if self._writer is not None:
                self._writer.abort()
                self._writer = None
            self._give_back_memory()
            raise
        return self

    def _open_writer(self) -> ShardWriter | _NullWriter:
        """This rank's writer: a :class:`ShardWriter` on the first rank of each
        tensor-parallel group, a :class:`_NullWriter` on the others (their rows are their
        writer's). They learn where their writer resumes (and whether it opened) from it."""
        lay = self.layout
        writer: ShardWriter | _NullWriter | None = None
        error: BaseException | None = None
        if lay.writer:
            try:
                writer = ShardWriter(
                    self.out,
                    settings=self.settings,
                    meta={**self.meta, "pyhook_version": __version__},
                    rank=self._rank,
                    world_size=self._world,
                    overwrite=self.overwrite,
                    on_release=self._release,
                    **self._writer_opts,
                )
            except BaseException as e:
                error = e
        if lay.tp_size == 1:
            if error is not None:
                raise error
            assert writer is not None
            return writer
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            if writer is not None:
                writer.abort()
            raise RuntimeError(
                f"a tensor-parallel capture (tp_size={lay.tp_size}) needs torch.distributed "
                "initialised: the ranks of a group learn from their writer where it resumes"
            )
        said = [
            None
            if not lay.writer
            else (f"{type(error).__name__}: {error}" if error else writer.examples_done)  # type: ignore[union-attr]
        ]
        every: list[Any] = [None] * lay.world
        dist.all_gather_object(every, said[0])
        if error is not None:
            raise error
        if writer is not None:
            return writer
        theirs = every[lay.writer_rank]
        if isinstance(theirs, str):
            raise RuntimeError(
                f"rank {lay.writer_rank}, the writer of this rank's tensor-parallel group, "
                f"could not open {self.out!r}: {theirs}"
            )
        return _NullWriter(int(theirs), self._release)

    def _limit_pool(self) -> None:
        """During a disk capture, the native pool keeps at most a share of max_host_bytes idle:
        buffers the writer gives back are reused by the next batches, not hoarded."""
        limit = _backend.pool_stats()["limit_bytes"]
        if _backend.native_available() and limit > self._pool_limit_now:
            self._saved_pool_limit = limit
            _backend.set_pool_limit(self._pool_limit_now)

    def _pool_holds_a_batch(self, nbytes: int) -> None:
        """A batch larger than the pool's idle share: during this capture the native pool may
        keep one batch's buffers idle (never more than its own limit before the capture).

        The writer gives back the buffers of the batch it wrote just as the next batch takes as
        many: with a smaller idle limit the pool unmapped the difference and every batch mapped
        and zeroed it afresh (GPT-2 small, 48 hooked modules, 151 MB a batch against a 64 MiB
        share: ~8,000 page faults and ~87 MB zeroed a batch, on the forward's thread). The peak
        is the same either way: the next batch's rows are taken while the written one's are
        idle, kept or not."""
        if self._saved_pool_limit is None or nbytes <= self._pool_limit_now:
            return  # not lowered for this capture (the user's limit is lower), or it fits
        want = min(nbytes, self._saved_pool_limit)
        if want > self._pool_limit_now and (
            _backend.pool_stats()["limit_bytes"] == self._pool_limit_now  # nobody changed it
        ):
            self._pool_limit_now = want
            _backend.set_pool_limit(want)

    def _give_back_memory(self) -> None:
        """After a disk capture: the pools' idle buffers and glibc's free pages go back to the
        operating system (the process returns to about its RSS before the capture)."""
        if self._saved_pool_limit is not None:
            if _backend.pool_stats()["limit_bytes"] == self._pool_limit_now:  # nobody changed it
                _backend.set_pool_limit(self._saved_pool_limit)
            self._saved_pool_limit = None
        if self._offloader_ is not None:
            self._offloader_.empty_pool()
        # The heap is trimmed only when the capture left the process bigger than it found it
        # and it can hold the capture's bytes: a trim also unmaps the free pages the forward
        # reuses, so the next forward faults them back in (measured: GPT-2 small, 12 hooked
        # blocks, ~57,000 faults in the forward after each close, none without the trim). With
        # the native pool every row buffer from 1 MiB on is its own mapping, unmapped above;
        # when the rows and annotations taken from the heap add up to less than the slack (and
        # no encoder made temporaries of the shard), whatever the heap kept is the forward's.
        if self._heap_only_forward():
            _backend.empty_pool()
            return
        trim_host_memory(above=getattr(self, "_rss_before", 0) + _TRIM_SLACK)

    def _heap_only_forward(self) -> bool:
        """Whether the heap can hold no more than the slack of this disk capture's bytes."""
        return (
            _backend.get_backend() == "native"
            and not self._compiled  # a compiled graph's outputs are its own allocations
            and not self._encoding
            and self._heap_bytes <= _TRIM_SLACK
        )

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._hooks.remove()
        try:
            self._finish(exc_type, exc, tb)
        finally:
            self._path.rec = weakref.proxy(self)
            if self.to == "disk":
                self._give_back_memory()

    def _finish(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if isinstance(self._path, CompiledPath):
                self._path.finish()
            else:
                self._path.finish(exc_type)
            if self._lease is not None:
                self._lease.close()
        except BaseException:
            if self._writer is not None:
                writer, self._writer = self._writer, None
                writer.abort()
            raise
        if self._writer is not None:
            writer, self._writer = self._writer, None
            if exc_type is None:
                barrier = None
                dist = torch.distributed
                if self.layout.world > 1 and dist.is_available() and dist.is_initialized():
                    barrier = self._barrier or dist.barrier
                writer.close(barrier=barrier)
            else:
                writer.__exit__(exc_type, exc, tb)

    def close(self) -> None:
        """Same as leaving the ``with`` block without error."""
        self.__exit__(None, None, None)

    def retry(self) -> None:
        """The forward that just raised will be run again (e.g. in halves after running out of
        memory): do not count its examples as skipped.

        Example::

            >>> import torch
            >>> from pyhook.capture import capture
            >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
            >>> with capture(net, "0") as rec:
            ...     try:
            ...         net(torch.randn(4, 3))  # wrong width: raises
            ...     except RuntimeError:
            ...         rec.retry()
            ...     _ = net(torch.randn(4, 2))
            >>> rec.examples, rec.skipped
            (4, 0)
        """
        if isinstance(self._path, EagerPath):
            self._path.retry()

    def annotate(
        self,
        token_ids: torch.Tensor,
        keep: torch.Tensor | None = None,
        examples: torch.Tensor | None = None,
        texts: Sequence[str] | None = None,
    ) -> None:
        """Describe the next forward's batch: its token ids ``[batch, tokens]``, which tokens
        to store (``keep``, bool ``[batch, tokens]``: e.g. no BOS, EOS or padding rows), the
        example (or context) index of each batch row (default: counted by the recorder) and
        the examples' texts. Call it right before each forward.

        Example::

            >>> import torch
            >>> from pyhook.capture import capture
            >>> emb = torch.nn.Sequential(torch.nn.Embedding(10, 3))
            >>> ids = torch.tensor([[1, 2, 3], [4, 5, 0]])
            >>> keep = torch.tensor([[False, True, True], [True, True, False]])  # no BOS, no pad
            >>> with capture(emb, "0") as rec:
            ...     rec.annotate(ids, keep, texts=["a b", "c d"])
            ...     _ = emb(ids)
            >>> rec["0"].shape[0], rec.tokens.tolist(), rec.row_index.tolist()
            (4, [2, 3, 4, 5], [[0, 1], [0, 2], [1, 0], [1, 1]])
        """
        if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 2:
            raise TypeError(
                "annotate: token_ids must be an integer tensor [batch, tokens], got "
                f"{getattr(token_ids, 'shape', type(token_ids).__name__)!r}"
            )
        if token_ids.is_floating_point() or token_ids.is_complex() or token_ids.dtype == torch.bool:
            raise TypeError(f"annotate: token_ids must hold integers, got {token_ids.dtype}")
        b, n = token_ids.shape
        if keep is not None:
            if not isinstance(keep, torch.Tensor) or tuple(keep.shape) != (b, n):
                raise ValueError(
                    f"annotate: keep must be a bool tensor of token_ids' shape {(b, n)}, got "
                    f"{getattr(keep, 'shape', type(keep).__name__)!r}"
                )
            keep = keep.detach().bool()
        if examples is not None:
            examples = torch.as_tensor(examples)
            if examples.shape != (b,) or examples.is_floating_point():
                raise ValueError(
                    f"annotate: examples must be {b} integer indices (one per batch row), got "
                    f"{tuple(examples.shape)} {examples.dtype}"
                )
            examples = examples.to("cpu", torch.long)
        if texts is not None:
            texts = list(texts)
            if len(texts) != b or not all(isinstance(s, str) for s in texts):
                raise ValueError(f"annotate: texts must be {b} strings (one per batch row)")
        note = _Note(token_ids.detach(), keep, examples, texts)
        if isinstance(self._path, CompiledPath):
            self._path.drain()  # batches before this one are finished: the next one is numbered
            self._notes[self._path.drained] = note
            p = self.positions
            if keep is not None and p is not None and not _is_int(p):
                self._path.keep = keep  # "last", a list or a slice picks among kept tokens
        else:
            self._note = note

    def _take_note(self, number: int | None = None) -> _Note | None:
        if number is not None:
            return self._notes.pop(number, None)
        note, self._note = self._note, None
        return note

    # -- what the paths hand over ---------------------------------------------------------
    def _skip(self, examples: int) -> None:
        """Count the examples of a forward that raised and was skipped by the caller's loop:
        they were consumed from the data, so they move the resume point (examples_done) too."""
        self.skipped += examples
        self.examples += examples
        if self._writer is not None and examples:
            self._writer.add({}, examples, skipped=True)

    def _annotations(
        self,
        note: _Note | None,
        token_ids: torch.Tensor | None,
        mask: torch.Tensor | None,
        examples: int,
        grids: dict[str, Any],
        counts: dict[str, int],
    ) -> dict[str, torch.Tensor]:
        """The reserved tensors of one batch (host, int64/uint8): ``__token_ids__`` and
        ``__row_index__`` when every layer gives token rows of one layout, the texts."""
        extra: dict[str, torch.Tensor] = {}
        if note is not None and note.texts is not None:
            enc = [s.encode("utf-8") for s in note.texts]
            extra["__text_lengths__"] = torch.tensor([len(e) for e in enc], dtype=torch.long)
            # the example index of each text (what row_index says), so text(e) finds example e
            # whatever order ranks and resumes stored the texts in
            if note.examples is not None:
                extra["__text_examples__"] = (
                    note.examples.detach().to("cpu", torch.long).reshape(-1)
                )
            else:
                start = self.examples_done + self.examples
                extra["__text_examples__"] = self._global_examples(start, len(enc))
            blob = b"".join(enc)
            extra["__text_bytes__"] = (
                torch.frombuffer(bytearray(blob), dtype=torch.uint8)
                if blob
                else torch.empty(0, dtype=torch.uint8)
            )
        if (token_ids is None and note is None) or not grids:
            return extra
        shapes = set(grids.values())
        if len(shapes) != 1 or None in shapes:
            return extra  # rows of different layouts: no single row annotation describes them
        (shape,) = shapes
        if token_ids is not None and tuple(token_ids.shape) != shape:
            token_ids = None
        if mask is not None and tuple(mask.shape) != shape:
            return extra
        if token_ids is None and mask is None:
            return extra  # the layers' tokens are not the input's (a prefix, say): unknown
        if note is not None and note.examples is not None:
            index = note.examples
        else:
            start = self.examples_done + self.examples
            index = self._global_examples(start, shape[0])
        ids, rows = row_annotations(self._reduction, token_ids, mask, index)
        if any(c != rows.shape[0] for c in counts.values()):
            return extra
        if ids is not None:
            extra["__token_ids__"] = ids
        extra["__row_index__"] = rows
        return extra

    def _stats_to_host(
        self, stats: dict[str, torch.Tensor], *, wait: bool = False
    ) -> dict[str, Any]:
        """Per-batch statistics rows moved off the device (tiny; asynchronous on CUDA)."""
        if self.to == "device" or all(s.is_cpu for s in stats.values()):
            return stats
        out: dict[str, Any] = {}
        for name, s in stats.items():
            p = self._offloader.submit([s], copy=False, pooled=False)
            out[name] = p.wait()[0] if wait else p
        return out

    def _add(
        self,
        rows: dict[str, Any],
        examples: int,
        extra: dict[str, torch.Tensor],
        *,
        wait: Callable[[], Any] | None = None,
        guards: dict[str, tuple[torch.Tensor, int]] | None = None,
    ) -> None:
        """One finished batch: ``rows`` (layer -> tensor or PendingCopy) and the reserved
        tensors ``extra``, to the writer (disk) or the in-memory results."""
        if self._hold is not None:
            self._hold.append((rows, examples, extra, wait))
            return
        if self.to == "disk":
            assert self._writer is not None
            batch = {**rows, **extra}
            nbytes = sum(t.nbytes for t in batch.values())
            self._heap_bytes += sum(
                t.nbytes
                for t in batch.values()
                if not isinstance(t, torch.Tensor) or t.nbytes < _MAPPED_MIN
            )
            self._pool_holds_a_batch(nbytes)
            self._wait_for_room(nbytes)
            with self._held_cv:
                self._held += nbytes
                self.peak_held_bytes = max(self.peak_held_bytes, self._held)
            try:
                self._writer.add(batch, examples, wait=wait)
            except BaseException:
                with self._held_cv:
                    self._held -= nbytes
                raise
        elif self._sink is not None:
            self._sink({**rows, **extra}, examples)
        else:
            for name, p in rows.items():
                self._results[name].append(p)
            for name, guard in (guards or {}).items():
                self._guards[name].append(guard)
            for name, t in extra.items():
                self._extra.setdefault(name, []).append(t)
        self.batches += 1
        self.examples += examples
        for name, p in rows.items():
            self.rows[name] += int(p.shapes[0][0] if isinstance(p, PendingCopy) else p.shape[0])
            self.bytes += p.nbytes

    def _wait_for_room(self, nbytes: int) -> None:
        """Back-pressure on host memory: a batch goes to the writer once the rows it still
        holds leave room for it within max_host_bytes, less the pool's idle share (or it holds
        none)."""
        budget = self._rows_budget
        with self._held_cv:
            if self._held == 0 or self._held + nbytes <= budget:
                return
        assert self._writer is not None
        self._writer.flush()  # what it buffers becomes a shard, so that it can be released
        with self._held_cv:
            while self._held > 0 and self._held + nbytes > budget:
                self._held_cv.wait(0.1)

    def _release(self, batch: dict[str, torch.Tensor]) -> None:
        # Called by the writer thread once a batch is on disk.
        try:
            if self._sink is not None:
                self._sink(batch, 0)
        finally:
            self._release_buffers(batch)

    def _release_buffers(self, batch: dict[str, torch.Tensor]) -> None:
        if not self._compiled:  # compiled batches hold no pooled buffers
            self._offloader.release(list(batch.values()))
        nbytes = sum(t.nbytes for t in batch.values())
        # The writer holds no other reference to these rows (ShardWriter._release_all): once
        # the dict lets go, they are back in their pool before the producer hears of it.
        batch.clear()
        with self._held_cv:
            self._held -= nbytes
            self._held_cv.notify_all()

    # -- results -----------------------------------------------------------------------------
    def parts(self, layer: str) -> list[torch.Tensor]:
        """The rows of ``layer``, one tensor per batch (waits for copies in flight)."""
        if self.to == "disk":
            raise RuntimeError(
                f"to='disk' keeps nothing in memory; read {self.out!r} with pyhook.store.open_capture"
            )
        if layer not in self._results:
            raise KeyError(f"layer {layer!r} was not captured; captured layers: {self.layers}")
        if isinstance(self._path, CompiledPath):
            self._path.drain()
        out = [p.wait()[0] if isinstance(p, PendingCopy) else p for p in self._results[layer]]
        # Checked after the waits: an unchanged version once a copy has finished means no
        # in-place update was issued before the copy read the values.
        for guard in self._guards[layer]:
            check_guard(layer, guard, "after the forward")
        return out

    def __getitem__(self, layer: str) -> torch.Tensor:
        joined = self._joined.get(layer)
        if joined is not None and joined[1] == len(self._results.get(layer, ())):
            return joined[0]
        parts = self.parts(layer)
        if not parts:
            raise KeyError(
                f"layer {layer!r} has no rows yet (no forward of the model ran while recording)"
            )
        if len(parts) == 1:
            return parts[0]
        # Rows in reusable host buffers: a view of the buffer they were copied into, back to
        # back (or joined into one the next capture reuses); None if they are not all there.
        whole = self._lease.whole(layer, parts) if self._lease is not None else None
        out = whole if whole is not None else self._cat(layer, parts)
        if self.copy:
            # The rows are held once: the batches become views of the joined rows, and their
            # own buffers are freed (copy=False's are the model's tensors: left alone).
            views, at = [], 0
            for p in parts:
                views.append(out[at : at + p.shape[0]])
                at += p.shape[0]
            self._results[layer] = views
            self._joined[layer] = (out, len(views))
            del parts, views
            if whole is None and out.is_cpu and out.nbytes >= _TRIM_BYTES:
                trim_host_memory()
        return out

    @staticmethod
    def _cat(layer: str, parts: list[torch.Tensor]) -> torch.Tensor:
        try:
            return torch.cat(parts)
        except RuntimeError as e:
            raise ValueError(
                f"rows of layer {layer!r} differ in shape between batches ({[tuple(p.shape) for p in parts[:4]]}...); "
                "use rec.parts(layer), or flatten=True / a fixed sequence length"
            ) from e

    def results(self) -> dict[str, torch.Tensor]:
        """``{layer: rows}`` for every captured layer."""
        return {n: self[n] for n in self.layers if self._results[n]}

    def _extra_rows(self, name: str) -> torch.Tensor | None:
        if self.to == "disk":
            raise RuntimeError(
                f"to='disk' keeps nothing in memory; read {self.out!r} with "
                "pyhook.store.open_capture and pyhook.annotations"
            )
        if isinstance(self._path, CompiledPath):
            self._path.drain()
        parts = self._extra.get(name)
        if not parts or len(parts) != self.batches:
            return None  # some batch had none: rows would not line up
        return torch.cat([p.to("cpu") for p in parts])

    @property
    def tokens(self) -> torch.Tensor | None:
        """Token id of every row (int64 ``[rows]``, aligned with each layer's rows), or None
        when the batches had no token ids (see :meth:`annotate`). Host and device captures."""
        return self._extra_rows("__token_ids__")

    @property
    def row_index(self) -> torch.Tensor | None:
        """``(example, position)`` of every row (int64 ``[rows, 2]``), or None when absent."""
        return self._extra_rows("__row_index__")

    def stats(self, layer: str) -> dict[str, torch.Tensor]:
        """Statistics of ``layer``'s rows, computed while capturing (``stats=True``):
        ``count``, per-dimension ``mean`` and ``var`` (population variance), ``norm_mean``
        (mean L2 norm of the rows), float64 tensors.

        Example::

            >>> import torch
            >>> from pyhook.capture import capture
            >>> net = torch.nn.Sequential(torch.nn.Linear(4, 3))
            >>> with capture(net, "0", stats=True) as rec:
            ...     for _ in range(3):
            ...         _ = net(torch.randn(5, 4))
            >>> s = rec.stats("0"); var, mean = torch.var_mean(rec["0"].double(), 0, correction=0)
            >>> int(s["count"]), torch.allclose(s["mean"], mean), torch.allclose(s["var"], var)
            (15, True, True)
        """
        from .annotations import merge_stats

        if layer not in self._results:
            raise KeyError(f"layer {layer!r} was not captured; captured layers: {self.layers}")
        if not self._stats:
            raise LookupError(
                f"no statistics for layer {layer!r}: capture with stats=True to compute them"
            )
        rows = self._extra_rows(f"__stats__.{layer}")
        if rows is None:
            raise LookupError(f"no statistics for layer {layer!r} yet (no forward ran)")
        return merge_stats(rows)

    def __repr__(self) -> str:
        state = "recording" if self._hooks.active else "idle"
        return f"<pyhook.Recorder to={self.to!r} layers={len(self.layers)} examples={self.examples} {state}>"


def capture(
    model: nn.Module,
    layers: str | nn.Module | Iterable[str | nn.Module],
    *,
    to: Destination | None = None,
    out: str | os.PathLike[str] | None = None,
    positions: Positions = None,
    mask: MaskSpec = None,
    flatten: bool = True,
    dtype: torch.dtype | str | None = None,
    copy: bool = True,
    **options: Any,
) -> Recorder:
    """Record the outputs of ``layers`` of ``model`` over the forwards run in a ``with`` block.

    Example (a transformers model, valid tokens only, streamed to disk)::

        >>> import torch, tempfile, transformers, pyhook.store
        >>> from pyhook.capture import capture
        >>> cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=32)
        >>> gpt = transformers.GPT2Model(cfg).eval()
        >>> ids = torch.randint(0, 50, (2, 7)); am = torch.ones(2, 7, dtype=torch.long); am[1, 5:] = 0
        >>> out = tempfile.mkdtemp()
        >>> with capture(gpt, "h.*", out=out, mask="attention_mask") as rec:
        ...     _ = gpt(input_ids=ids, attention_mask=am)
        >>> r = pyhook.store.open_capture(out)
        >>> r["h.0"].shape, r["h.1"].shape  # 7 + 5 valid tokens
        (torch.Size([12, 16]), torch.Size([12, 16]))

    Arguments: ``layers`` are exact names, globs (``transformer.h.*``) or submodules;
    ``to``/``out`` choose the destination (``"device"``, ``"host"`` (default), ``"disk"``);
    ``positions`` keeps token positions (``"last"`` = last valid token, an ``int``, a ``slice``
    or a list); ``mask`` names the forward argument holding a ``[batch, tokens]`` mask (or is a
    callable ``(args, kwargs) -> mask``) selecting the valid tokens; ``flatten`` makes tokens the
    rows; ``dtype`` casts on the device before the copy. Further options of :class:`Recorder`:
    ``select`` (output -> tensor; default the first tensor of the output), ``overwrite``,
    ``meta``, ``settings``, ``rank``/``world_size`` (this process's writer rank in the store;
    default: from ``torch.distributed`` or ``RANK``/``WORLD_SIZE``), ``tp_size`` (tensor-parallel
    ranks per group, default the model's ``tp_size``: the first rank of each group writes, the
    groups are the store's ranks; see :mod:`pyhook.pipeline.ranks`). Without ``annotate``'s
    ``examples``, the row index of several data-parallel ranks is global, as a
    ``DistributedSampler`` without shuffling deals the examples (rank ``r`` of ``R``: ``r``,
    ``r + R``, ...); ``stats`` (per-layer statistics while capturing, default on for
    disk captures), ``tokens`` (keep token ids/row index from ``input_ids``, default on);
    host memory: ``max_host_bytes`` (default 256 MiB) sizes ``shard_bytes`` (default a quarter
    of it), ``max_pending_shards`` (1), ``max_inflight_bytes`` (a quarter) and the buffer
    pools; raise it (e.g. ``1 << 30``) for speed when memory is plentiful. Compact stores
    (docs/store-format.md): ``quantize="fp8"`` (or ``"int8"``) stores float rows in one byte
    per value with one float32 scale per row, ``compress="zstd"`` compresses them losslessly in
    chunks of rows; reads return the rows decoded, in the captured dtype. Gradients
    (docs/capture.md, "Gradients (attribution datasets)"): ``gradients`` (True, or captured
    layer names/globs) stores beside each of those layers a layer ``"<layer>_grad"``, the
    gradient of ``metric`` (``"loss"``, ``"logit:<token id>"`` or a callable
    ``(output, batch) -> [batch]`` tensor: one value per example) at that layer, rows reduced
    as the layer's; the forward must run with autograd on (see
    :mod:`pyhook.pipeline._record_grad`). ``buffers`` (a :class:`pyhook.HostBuffers`, for
    ``to="host"``): rows go straight into reusable host buffers (pinned on CUDA), and
    ``rec[layer]`` is a view of them instead of a join; a loop of captures reuses the memory.
    """
    return Recorder(
        model,
        layers,
        to=to,
        out=out,
        positions=positions,
        mask=mask,
        flatten=flatten,
        dtype=dtype,
        copy=copy,
        **options,
    )
