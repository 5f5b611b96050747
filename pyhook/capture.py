"""High-throughput activation capture: :func:`capture` / :class:`Recorder`.

Pick layers by name or glob, optionally reduce on the device (token positions, a mask such as the
attention mask, a dtype cast), and send each captured tensor to a destination:

* ``to="device"``: stays where the model computed it (a detached copy);
* ``to="host"``: host memory; on CUDA through pinned buffers on a side stream (see
  :mod:`pyhook.offload`), so the copy overlaps the rest of the forward;
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

import inspect
import os
import re
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, Union

import torch
from torch import nn

from . import _backend
from ._compiled import call_outside, unwrap_compiled
from ._hooks import HookSet, check_not_compiled, compiled_path
from ._tree import tensor_leaves
from ._version import __version__
from .modules import LayerNotFoundError, resolve_module
from .offload import Offloader, PendingCopy, check_byte_count
from .points import all_points, module_path, resolve_targets
from .store import ShardWriter, dtype_name, parse_dtype

__all__ = [
    "CaptureModifiedError",
    "MaskSpec",
    "Positions",
    "Recorder",
    "capture",
    "resolve_layers",
]

Positions = Union[int, Literal["last"], slice, Sequence[int], None]  # noqa: UP007 (runtime alias on 3.10)
MaskSpec = Union[str, Callable[[tuple[Any, ...], dict[str, Any]], Any], None]  # noqa: UP007
Destination = Literal["device", "host", "disk"]

_GLOB_CHARS = re.compile(r"[*?]")


class CaptureModifiedError(RuntimeError):
    """A tensor kept by reference (``copy=False``) was modified in place after it was captured.

    Example::

        >>> import torch
        >>> from pyhook.capture import capture, CaptureModifiedError
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(inplace=True))
        >>> with capture(net, "0", copy=False) as rec:
        ...     try:
        ...         _ = net(torch.randn(3, 2))  # ReLU(inplace=True) overwrites layer 0's output
        ...     except CaptureModifiedError as e:
        ...         print(e.layer)
        0
    """

    def __init__(self, layer: str, message: str) -> None:
        super().__init__(message)
        self.layer = layer


def _glob_regex(pattern: str) -> re.Pattern[str]:
    # '*' and '?' stay within one dotted component; '**' crosses dots.
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^.]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^.]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


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
            rx = _glob_regex(entry)
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


def _check_mask_name(model: nn.Module, mask: str) -> bool:
    """A misspelled mask name would silently keep every token: refuse names that the model's
    forward cannot take. True when only a ``**kwargs`` could take it (checked per call)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    if mask in params:
        return False
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return True
    names = [n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    raise ValueError(
        f"mask {mask!r} is not an argument of {type(model).__name__}.forward; its arguments "
        f"are: {', '.join(names) or '(none)'}"
    )


def _batch_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """Examples in a call: dim 0 of its first tensor argument (None if it has none)."""
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            return int(v.shape[0]) if v.dim() else None
    return None


def _first_tensor(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if type(output) is tuple and output and isinstance(output[0], torch.Tensor):
        return output[0]  # the usual (hidden_states, ...) block output: skip the tree walk
    leaves = tensor_leaves(output)
    if not leaves:
        raise TypeError(f"the layer output ({type(output).__name__}) holds no tensor")
    return leaves[0]


def _layer_rows(name: str, output: Any, select: Callable[[Any], Any] | None) -> torch.Tensor:
    """The tensor capture stores for layer ``name`` (``select(output)``, or the output's first
    tensor), checked: a dense tensor. Shared by the eager and the compiled layer hooks."""
    if select is not None:
        raw = select(output)
        if not isinstance(raw, torch.Tensor):
            raise TypeError(
                f"layer {name!r}: select returned {type(raw).__name__}, expected a tensor"
            )
    else:
        raw = _first_tensor(output)
    if raw.layout != torch.strided:
        raise TypeError(
            f"layer {name!r}: its output is a {raw.layout} tensor; capture stores dense "
            "rows (pass select=lambda out: out.to_dense(), or capture another layer)"
        )
    return raw


class _Batch:
    """One forward's rows on a compiled model, linked to the batch before it (see _drain)."""

    __slots__ = ("first", "mask", "prev", "rows")

    def __init__(self, prev: _Batch | None, rows: dict[str, Any], first: Any, mask: Any) -> None:
        self.prev = prev
        self.rows = rows
        self.first = first
        self.mask = mask


def _first_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v
    return None


def _positional_index(model: nn.Module, mask: Any) -> int | None:
    """Where a mask named ``mask`` sits among ``model.forward``'s positional parameters."""
    if not isinstance(mask, str):
        return None
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    for i, p in enumerate(params):
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return None
        if p.name == mask:
            return i
    return None


def _positions_repr(p: Positions) -> Any:
    if isinstance(p, slice):
        return {"slice": [p.start, p.stop, p.step]}
    if isinstance(p, (list, tuple)):
        return list(p)
    return p


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
    layer runs several times in one forward, the last call is kept.

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
        shard_bytes: int = 256 << 20,
        max_pending_shards: int = 2,
        max_inflight_bytes: int = 1 << 30,
        meta: dict[str, Any] | None = None,
        settings: dict[str, Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        fsync: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        model = unwrap_compiled(model)  # names resolve as in the eager model
        if to is None:
            to = "disk" if out is not None else "host"
        if to not in ("device", "host", "disk"):
            raise ValueError(f"to must be 'device', 'host' or 'disk', got {to!r}")
        if to == "disk" and out is None:
            raise ValueError("to='disk' needs out=<directory>")
        if to != "disk" and out is not None:
            raise ValueError(f"out= is only used with to='disk' (got to={to!r})")
        if not (
            positions is None
            or positions == "last"
            or (isinstance(positions, int) and not isinstance(positions, bool))
            or isinstance(positions, slice)
            or (isinstance(positions, (list, tuple)) and all(isinstance(p, int) for p in positions))
        ):
            raise ValueError(
                f"positions must be None, an int, 'last', a slice or a list of ints, got {positions!r}"
            )
        if mask is not None and not isinstance(mask, str) and not callable(mask):
            raise TypeError(
                "mask must be the name of a forward argument (e.g. 'attention_mask') or a callable "
                f"(args, kwargs) -> bool tensor [batch, tokens], got {type(mask).__name__}"
            )
        # a mask name only forward(**kwargs) could take: warned about once if a call lacks it
        self._mask_unlisted = isinstance(mask, str) and _check_mask_name(model, mask)
        if not isinstance(flatten, bool):
            raise TypeError(f"flatten must be a bool, got {flatten!r}")
        per_example = positions == "last" or (
            isinstance(positions, int) and not isinstance(positions, bool)
        )
        if mask is not None and not flatten and not per_example:
            raise ValueError(
                "mask selects tokens, which needs flatten=True (rows = valid tokens) or positions "
                "'last'/int (rows = examples)"
            )
        if not isinstance(copy, bool):
            raise TypeError(f"copy must be a bool, got {copy!r}")
        if not copy and to == "disk":
            raise ValueError(
                "copy=False keeps references to the model's own output tensors, which the "
                "background disk writer cannot use safely; it is for to='host' or to='device'"
            )
        if select is not None and not callable(select):
            raise TypeError(
                f"select must be callable (output -> tensor), got {type(select).__name__}"
            )
        self.model = model
        self.to = to
        self.out = os.fspath(out) if out is not None else None
        self.positions = positions
        self.mask = mask
        self.flatten = flatten
        self.dtype = parse_dtype(dtype, "dtype")
        self.copy = copy
        self.select = select
        self.overwrite = overwrite
        self._writer_opts: dict[str, Any] = {
            "shard_bytes": shard_bytes,
            "max_pending": max_pending_shards,
            "fsync": fsync,
        }
        self._modules = resolve_layers(model, layers)  # raises before anything is registered
        self.layers = [n for n, _ in self._modules]
        # A compiled model (or one with compiled layers): hooks go through dispatchers, and the
        # batches are built in code dynamo traces, then finished lazily (see _drain).
        self._compiled = any(
            compiled_path(model, module_path(n, m)) is not None for n, m in self._modules
        )
        self._chead: _Batch = _Batch(None, {}, None, None)
        self._cbatch: dict[str, Any] = {}
        self._cfirst: torch.Tensor | None = None
        self._cmask: torch.Tensor | None = None
        self._mask_pos = _positional_index(model, mask) if self._compiled else None
        self.meta = {"model": type(model).__name__, **(meta or {})}
        self.settings = {
            "layers": self.layers,
            "positions": _positions_repr(positions),
            "mask": mask
            if isinstance(mask, str) or mask is None
            else getattr(mask, "__name__", "callable"),
            "flatten": flatten,
            "dtype": dtype_name(self.dtype) if self.dtype is not None else None,
            **(settings or {}),
        }
        self._rank, self._world = self._dist_info(rank, world_size)
        check_byte_count("max_inflight_bytes", max_inflight_bytes, 1)  # the Offloader is lazy
        self._max_inflight_bytes = max_inflight_bytes
        # Made on first use: host captures of CPU tensors never need the engine.
        self._offloader_: Offloader | None = None
        self._hooks = HookSet()
        self._writer: ShardWriter | None = None
        self._results: dict[str, list[Any]] = {n: [] for n in self.layers}
        self._pending: dict[str, Any] = {}
        # copy=False: (tensor, version) of each kept reference, checked at commit and on read
        self._guards: dict[str, list[Any]] = {n: [] for n in self.layers}
        self._pending_guard: dict[str, tuple[torch.Tensor, int]] = {}
        self._batch_mask: torch.Tensor | None = None
        self._batch_examples: int | None = None
        self._sig: inspect.Signature | None = None
        self.examples = 0
        self.skipped = 0
        self._in_forward = False  # a forward began and has not committed (yet, or it raised)
        self.examples_done = 0
        self.rows: dict[str, int] = dict.fromkeys(self.layers, 0)
        self.bytes = 0
        self.batches = 0

    @property
    def _offloader(self) -> Offloader:
        if self._offloader_ is None:
            self._offloader_ = Offloader(max_inflight_bytes=self._max_inflight_bytes)
        return self._offloader_

    @staticmethod
    def _dist_info(rank: int | None, world: int | None) -> tuple[int, int]:
        if rank is not None or world is not None:
            return int(rank or 0), int(world or 1)
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    # -- lifetime --------------------------------------------------------------------------
    def __enter__(self) -> Recorder:
        if self._hooks.active:
            raise RuntimeError("this Recorder is already active")
        self._in_forward = False
        if self.to == "disk":
            assert self.out is not None
            self._writer = ShardWriter(
                self.out,
                settings=self.settings,
                meta={**self.meta, "pyhook_version": __version__},
                rank=self._rank,
                world_size=self._world,
                overwrite=self.overwrite,
                on_release=self._release,
                **self._writer_opts,
            )
            self.examples_done = self._writer.examples_done
        try:
            with self._hooks.registering():
                if self._compiled:
                    for name, module in self._modules:
                        check_not_compiled(self.model, module_path(name, module), who="capture")
                    self._chead = _Batch(None, {}, None, None)
                    self._hooks.forward_pre(
                        self.model, self._begin_compiled, with_kwargs=True, prepend=True
                    )
                    for name, module in self._modules:
                        self._hooks.forward(module, self._make_compiled_hook(name))
                    self._hooks.forward(self.model, self._commit_compiled)
                else:
                    self._hooks.forward_pre(self.model, self._begin, with_kwargs=True, prepend=True)
                    for name, module in self._modules:
                        self._hooks.forward(module, self._make_hook(name))
                    self._hooks.forward(self.model, self._commit)
        except BaseException:
            if self._writer is not None:
                self._writer.abort()
                self._writer = None
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._hooks.remove()
        self._discard_pending()
        if self._compiled:
            try:
                self._drain()
            except BaseException:
                if self._writer is not None:
                    writer, self._writer = self._writer, None
                    writer.abort()
                raise
        if self._in_forward:
            self._in_forward = False
            if exc_type is None:
                # The last forward raised and the loop went on: its examples were consumed.
                self._skip(self._batch_examples or 0)
        if self._writer is not None:
            writer, self._writer = self._writer, None
            if exc_type is None:
                barrier = None
                dist = torch.distributed
                if self._world > 1 and dist.is_available() and dist.is_initialized():
                    barrier = dist.barrier
                writer.close(barrier=barrier)
            else:
                writer.__exit__(exc_type, exc, tb)

    def close(self) -> None:
        """Same as leaving the ``with`` block without error."""
        self.__exit__(None, None, None)

    # -- hooks -------------------------------------------------------------------------------
    def _discard_pending(self) -> None:
        for p in self._pending.values():
            if isinstance(p, PendingCopy) and self.to == "disk":
                self._offloader.release(p.wait())
        # Cleared in place: the layer hooks hold these dicts.
        self._pending.clear()
        self._pending_guard.clear()

    def _skip(self, examples: int) -> None:
        """Count the examples of a forward that raised and was skipped by the caller's loop:
        they were consumed from the data, so they move the resume point (examples_done) too."""
        self.skipped += examples
        self.examples += examples
        if self._writer is not None and examples:
            self._writer.add({}, examples, skipped=True)

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
        self._in_forward = False

    def _begin(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._discard_pending()  # leftovers of a forward that raised
        if self._in_forward:  # the previous forward raised, and the caller went on
            self._skip(self._batch_examples or 0)
        self._batch_mask = None
        # Examples come from the inputs: the first captured layer may broadcast over the batch
        # (a position embedding's [1, tokens, hidden]); a layer's dim 0 is the fallback.
        self._batch_examples = _batch_size(args, kwargs)
        self._in_forward = True
        if self.mask is None:
            return
        if callable(self.mask):
            m = self.mask(args, kwargs)
        else:
            m = kwargs.get(self.mask)
            if m is None and args:
                if self._sig is None:
                    self._sig = inspect.signature(self.model.forward)
                try:
                    m = self._sig.bind_partial(*args, **kwargs).arguments.get(self.mask)
                except TypeError:
                    m = None
        if m is None and self._mask_unlisted:
            self._mask_unlisted = False  # warn once: maybe a misspelling
            warnings.warn(
                f"mask {self.mask!r} was not among the arguments of this call of "
                f"{type(self.model).__name__} ({', '.join(kwargs) or 'positional only'}); "
                "its tokens are not masked",
                stacklevel=2,
            )
        if m is not None:
            if not isinstance(m, torch.Tensor) or m.dim() != 2:
                raise ValueError(
                    f"mask {self.mask!r} must be a tensor [batch, tokens], got {getattr(m, 'shape', m)!r}"
                )
            self._batch_mask = m.detach().bool()
            self._batch_examples = int(m.shape[0])

    def _reduce(self, name: str, t: torch.Tensor) -> torch.Tensor:
        t, mask = self._select_positions(name, t.detach(), self._batch_mask)
        if t.dim() >= 3 and self.flatten:
            t = t[mask] if mask is not None else t.reshape(-1, *t.shape[2:])
        if self.dtype is not None and t.dtype != self.dtype:
            t = t.to(self.dtype)
        return t

    def _select_positions(
        self, name: str, t: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows of ``positions`` (eager and compiled captures alike): ``t`` reduced to them
        and the mask of the tokens kept (None once positions picked one token per example)."""
        has_tokens = t.dim() >= 3
        if has_tokens and mask is not None and tuple(t.shape[:2]) != tuple(mask.shape):
            raise ValueError(
                f"layer {name!r}: output shape {tuple(t.shape)} does not start with the mask's "
                f"[batch, tokens] {tuple(mask.shape)}"
            )
        if mask is not None and mask.device != t.device:
            mask = mask.to(t.device, non_blocking=True)
        p = self.positions
        if has_tokens and p is not None:
            if p == "last":
                if mask is not None:
                    # Last valid token, for left or right padding alike.
                    steps = torch.arange(1, mask.shape[1] + 1, device=t.device)
                    idx = (mask * steps).argmax(dim=1)
                    t = t[torch.arange(t.shape[0], device=t.device), idx]
                else:
                    t = t[:, -1]
                mask = None
            elif isinstance(p, int):
                self._check_positions(name, t, [p])
                t = t[:, p]
                mask = None
            else:
                if not isinstance(p, slice):
                    self._check_positions(name, t, p)
                sel = p if isinstance(p, slice) else torch.tensor(list(p), device=t.device)
                t = t[:, sel]
                if mask is not None:
                    mask = mask[:, sel]
        return t, mask

    def _check_positions(self, name: str, t: torch.Tensor, positions: Sequence[int]) -> None:
        tokens = int(t.shape[1])
        bad = [q for q in positions if not -tokens <= q < tokens]
        if bad:
            raise ValueError(
                f"layer {name!r}: positions={self.positions!r} reaches token {bad[0]}, but this "
                f"batch has {tokens} tokens (output shape {tuple(t.shape)})"
            )

    def _make_hook(self, name: str) -> Callable[..., None]:
        # Everything that does not change between calls is read once here: the hook runs once
        # per layer per forward, and at a few microseconds of Python it is most of the cost of
        # capturing a small activation.
        select = self.select
        reduces = not (
            self.positions is None and self.mask is None and self.dtype is None and not self.flatten
        )
        by_reference = not self.copy
        to = self.to
        pending = self._pending  # never rebound: cleared in place
        pending_guard = self._pending_guard
        clone_one = _backend.clone_one
        kept_min = _backend.KEPT_MIN_BYTES

        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            raw = _layer_rows(name, output, select)
            if self._batch_examples is None:
                self._batch_examples = int(raw.shape[0]) if raw.dim() else 1
            if reduces:
                # _reduce starts from a detached tensor, so nothing in it is recorded by autograd.
                t = self._reduce(name, raw)
                # Copy only when t may alias memory the model owns (an un-reduced output or a
                # view), unless copy=False: then keep the reference, check its version later.
                needs_copy = t.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
            else:
                t = raw.detach()
                needs_copy = True
            if t.dim() == 0:
                t = t.reshape(1)  # a scalar output (a loss, a score): one row per forward
            if by_reference:
                if needs_copy and not t.is_inference():
                    needs_copy = False
                    pending_guard[name] = (t, t._version)
                else:
                    pending_guard.pop(name, None)
            if to == "disk":
                old = pending.pop(name, None)
                if old is not None:  # the layer ran twice in this forward: the last call is kept
                    self._offloader.release(old.wait())
                pending[name] = self._offloader.submit([t], copy=needs_copy, pooled=True)
            elif to == "device" or t.is_cpu:
                # Host memory already (or staying on the device): a synchronous copy, nothing
                # to overlap and no engine to go through.
                # Every batch's copy is kept, so malloc would hand out fresh (faulting)
                # pages: the native pool recycles mapped buffers from a smaller size on.
                pending[name] = clone_one(t, kept_min) if needs_copy else t
            else:
                pending[name] = self._offloader.submit([t], copy=needs_copy, pooled=False)

        return hook

    def _commit(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        self._in_forward = False
        guards = dict(self._pending_guard)
        self._pending_guard.clear()
        for name, guard in guards.items():
            self._check(name, guard, "before the forward returned")
        pending = dict(self._pending)
        self._pending.clear()
        examples = self._batch_examples or 0
        rows = self.rows
        if self.to == "disk":
            assert self._writer is not None
            batch = {name: p._host[0] for name, p in pending.items()}  # shapes only until waited
            waits = list(pending.values())
            try:
                self._writer.add(batch, examples, wait=lambda: [p.wait() for p in waits])
            except BaseException:
                for p in waits:  # refused (e.g. a shape change): nothing of it is counted
                    self._offloader.release(p.wait())
                raise
            self.batches += 1
            self.examples += examples
            for name, t in batch.items():
                rows[name] += int(t.shape[0])
                self.bytes += t.nbytes
            return
        self.batches += 1
        self.examples += examples
        results, kept = self._results, self._guards
        for name, guard in guards.items():
            kept[name].append(guard)
        for name, p in pending.items():
            results[name].append(p)
            rows[name] += int(p.shapes[0][0] if isinstance(p, PendingCopy) else p.shape[0])
            self.bytes += p.nbytes

    @staticmethod
    def _check(name: str, guard: tuple[torch.Tensor, int] | None, when: str) -> None:
        if guard is not None and guard[0]._version != guard[1]:
            raise CaptureModifiedError(
                name,
                f"layer {name!r}: its output was modified in place {when}, after it was captured "
                "with copy=False (kept by reference), so the captured values are gone; capture "
                "with copy=True (the default) for this model",
            )

    def _release(self, batch: dict[str, torch.Tensor]) -> None:
        if not self._compiled:  # compiled batches hold no pooled buffers
            self._offloader.release(list(batch.values()))

    # -- compiled models ------------------------------------------------------------------------
    # The hooks below run inside code compiled by torch.compile, so they only use what dynamo
    # traces without a graph break or a recompilation per batch: tensor ops, attributes set on
    # the Recorder, a dict made in the same forward, and a new _Batch linked in front of the
    # previous one (a list that grows would be guarded on its length). Everything data-dependent
    # (masked rows, host copies of device tensors, counters) is finished by _drain, in eager
    # Python, when results are read or the block exits.
    def _begin_compiled(
        self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        self._cbatch = {}
        self._cmask = None
        self._cfirst = _first_input(args, kwargs)
        mask = self.mask
        if mask is None:
            return
        if callable(mask):
            m = mask(args, kwargs)
        else:
            m = kwargs.get(mask)
            pos = self._mask_pos
            if m is None and pos is not None and len(args) > pos:
                m = args[pos]
        if m is not None:
            if not isinstance(m, torch.Tensor) or m.dim() != 2:
                raise ValueError(
                    f"mask {self.mask!r} must be a tensor [batch, tokens], got {getattr(m, 'shape', m)!r}"
                )
            self._cmask = m.detach().bool()

    def _make_compiled_hook(self, name: str) -> Callable[..., None]:
        select = self.select
        reduces = not (
            self.positions is None and self.mask is None and self.dtype is None and not self.flatten
        )

        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            raw = _layer_rows(name, output, select)
            t, mask = self._reduce_compiled(name, raw.detach()) if reduces else (raw.detach(), None)
            if t.dim() == 0:
                t = t.reshape(1)
            # Always a copy: in a graph the compiler removes it when nothing else could change
            # the values (and copy=False's by-reference rows have no meaning there).
            self._cbatch[name] = (t.clone(), mask)

        return hook

    def _reduce_compiled(
        self, name: str, t: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`_reduce` without the data-dependent step: rows selected by a mask are left
        for :meth:`_drain` (the returned mask), so the graph keeps static shapes."""
        t, mask = self._select_positions(name, t, self._cmask)
        if t.dim() >= 3 and self.flatten:
            if mask is None:
                t = t.reshape(-1, *t.shape[2:])
        else:
            mask = None
        if self.dtype is not None and t.dtype != self.dtype:
            t = t.to(self.dtype)
        return t, mask

    def _commit_compiled(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        batch = self._cbatch
        self._chead = _Batch(self._chead, batch, self._cfirst, self._cmask)
        self._cbatch = {}
        if self.to == "disk" or any(t.is_cuda for t, _ in batch.values()):
            # The writer's hand-off is Python that cannot be traced, and rows on a GPU may sit
            # in a CUDA graph's memory pool that the next replay overwrites: one graph break,
            # at the end of the forward, finishes the batch at once (see docs/compile.md).
            call_outside(self._drain)

    def _drain(self) -> None:
        """Finish the batches compiled code linked since the last drain (eager, in order)."""
        node, batches = self._chead, []
        while node.prev is not None:
            batches.append(node)
            node = node.prev
        self._chead = node
        for b in reversed(batches):
            examples = None
            if b.mask is not None:
                examples = int(b.mask.shape[0])
            elif b.first is not None and b.first.dim():
                examples = int(b.first.shape[0])
            elif self.mask is not None and self._mask_unlisted:
                self._mask_unlisted = False
                warnings.warn(
                    f"mask {self.mask!r} was not among the arguments of a call of "
                    f"{type(self.model).__name__}; its tokens are not masked",
                    stacklevel=2,
                )
            rows_of: dict[str, torch.Tensor] = {}
            for name, (t, mask) in b.rows.items():
                if mask is not None:
                    t = t[mask.to(t.device)]
                if self.to != "device" and not t.is_cpu:
                    t = t.to("cpu")
                elif t.is_cuda:
                    t = t.clone()  # out of a CUDA graph's pool, before the next replay
                if examples is None:
                    examples = int(t.shape[0])
                rows_of[name] = t
            if self.to == "disk":
                assert self._writer is not None
                self._writer.add(rows_of, examples or 0)
            else:
                for name, t in rows_of.items():
                    self._results[name].append(t)
            self.batches += 1
            self.examples += examples or 0
            for name, t in rows_of.items():
                self.rows[name] += int(t.shape[0])
                self.bytes += t.nbytes

    # -- results -----------------------------------------------------------------------------
    def parts(self, layer: str) -> list[torch.Tensor]:
        """The rows of ``layer``, one tensor per batch (waits for copies in flight)."""
        if self.to == "disk":
            raise RuntimeError(
                f"to='disk' keeps nothing in memory; read {self.out!r} with pyhook.store.open_capture"
            )
        if layer not in self._results:
            raise KeyError(f"layer {layer!r} was not captured; captured layers: {self.layers}")
        if self._compiled:
            self._drain()
        out = [p.wait()[0] if isinstance(p, PendingCopy) else p for p in self._results[layer]]
        # Checked after the waits: an unchanged version once a copy has finished means no
        # in-place update was issued before the copy read the values.
        for guard in self._guards[layer]:
            self._check(layer, guard, "after the forward")
        return out

    def __getitem__(self, layer: str) -> torch.Tensor:
        parts = self.parts(layer)
        if not parts:
            raise KeyError(
                f"layer {layer!r} has no rows yet (no forward of the model ran while recording)"
            )
        if len(parts) == 1:
            return parts[0]
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
        >>> r.layers, r["h.1"].shape  # 7 + 5 valid tokens
        (['h.0', 'h.1'], torch.Size([12, 16]))

    Arguments: ``layers`` are exact names, globs (``transformer.h.*``) or submodules;
    ``to``/``out`` choose the destination (``"device"``, ``"host"`` (default), ``"disk"``);
    ``positions`` keeps token positions (``"last"`` = last valid token, an ``int``, a ``slice``
    or a list); ``mask`` names the forward argument holding a ``[batch, tokens]`` mask (or is a
    callable ``(args, kwargs) -> mask``) selecting the valid tokens; ``flatten`` makes tokens the
    rows; ``dtype`` casts on the device before the copy. Further options of :class:`Recorder`:
    ``select`` (output -> tensor; default the first tensor of the output), ``overwrite``,
    ``shard_bytes``, ``max_pending_shards``, ``max_inflight_bytes``, ``meta``, ``settings``,
    ``rank``/``world_size`` (default: from ``torch.distributed`` or ``RANK``/``WORLD_SIZE``).
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
