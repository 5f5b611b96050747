"""Activations straight to a trainer: :func:`stream` runs the model over a corpus in a
background thread and hands out shuffled batches of rows, with no disk in between.

>>> import torch, transformers, pyhook
>>> from pyhook.source import Batch
>>> cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=32)
>>> gpt = transformers.GPT2Model(cfg).eval()
>>> def corpus():  # any iterable of pyhook.source.Batch (or a pyhook.source corpus)
...     for c in range(0, 8, 2):
...         ids = torch.randint(0, 50, (2, 8))
...         yield Batch(ids, torch.ones_like(ids), torch.ones(2, 8, dtype=torch.bool),
...                     torch.tensor([c, c + 1]), None)
>>> seen = []
>>> for batch in pyhook.stream(gpt, corpus(), "h.1", batch_size=16, buffer_rows=32):
...     seen.append(batch["row_index"])
>>> batch["h.1"].shape, sorted(map(tuple, torch.cat(seen).tolist())) == [
...     (c, p) for c in range(8) for p in range(8)]  # every token exactly once
(torch.Size([16, 16]), True)

The stages: a producer thread runs :func:`pyhook.runner.run` (the same loop as ``capture``) under
a :class:`~pyhook.capture.Recorder` whose finished batches go to a sink instead of its results, so
the rows are exactly the rows a capture keeps (same positions, mask, excluded special tokens,
dtype). They enter a mixing buffer (:class:`Mixer`), and mixed batches wait in a bounded queue for
the trainer. With ``tee=DIR`` the recorder writes to disk instead, exactly as ``capture(out=DIR)``
does, and hands each batch to the mixer once its shard is on disk.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from .._omp import release_thread_team
from .._queues import put_unless_stopped

__all__ = ["Mixer", "Stream", "stream"]

_DONE = object()
_RESERVED = ("tokens", "row_index")


class _Failed:
    """An error of the producer thread, re-raised in the consumer."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Mixer:
    """The mixing buffer: ``capacity`` slots; once full, each batch takes ``batch_size`` slots
    at random and the next rows to arrive take their places. Every row comes out exactly once.

    Rows are dicts of tensors sharing dim 0 (one row = one token, all layers): a slot holds one
    token's rows of every key, so they stay together. The draw is seeded: the output depends on
    the order of the rows and ``seed`` only, not on how the rows were split into chunks.

    Why this scheme (measured in benchmarks/bench_stream.py): rows stay in the buffer a random
    (geometric) number of batches, so a context's rows leave spread over many batches; at equal
    memory its rate of same-context rows in a batch is about half that of the half-refill
    buffers (SAELens' ``mixing_buffer``, Language-Model-SAEs' ``ActivationBatchler``), which
    shuffle a full buffer and serve half of it.

    Example::

        >>> import torch
        >>> from pyhook.pipeline.stream import Mixer
        >>> m = Mixer(capacity=8, batch_size=4, seed=0)
        >>> out = list(m.add({"x": torch.arange(10)})) + list(m.finish())
        >>> [len(b["x"]) for b in out], sorted(torch.cat([b["x"] for b in out]).tolist())
        ([4, 4, 2], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    """

    def __init__(
        self,
        capacity: int,
        batch_size: int,
        seed: int = 0,
        *,
        device: torch.device | str | None = None,
        drop_last: bool = False,
    ) -> None:
        if capacity < batch_size:
            raise ValueError(f"buffer_rows ({capacity}) must be >= batch_size ({batch_size})")
        self.capacity = capacity
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.device = torch.device(device) if device is not None else None
        gen_device = self.device if self.device is not None else torch.device("cpu")
        self._gen = torch.Generator(device=gen_device)
        self._gen.manual_seed(seed)
        self._buf: dict[str, torch.Tensor] | None = None
        self._filled = 0
        self._staged: collections.deque[dict[str, torch.Tensor]] = collections.deque()
        self._n_staged = 0

    @property
    def held_rows(self) -> int:
        """Rows in the buffer and waiting to enter it."""
        return self._filled + self._n_staged

    def _take(self, n: int) -> dict[str, torch.Tensor]:
        """The first ``n`` staged rows."""
        pieces: list[dict[str, torch.Tensor]] = []
        need = n
        while need:
            head = self._staged[0]
            k = _nrows(head)
            if k <= need:
                pieces.append(self._staged.popleft())
                need -= k
            else:
                pieces.append({key: v[:need] for key, v in head.items()})
                self._staged[0] = {key: v[need:] for key, v in head.items()}
                need = 0
        self._n_staged -= n
        if len(pieces) == 1:
            return pieces[0]
        return {key: torch.cat([p[key] for p in pieces]) for key in pieces[0]}

    def add(self, rows: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        """Take ``rows`` in; yield the batches that are ready (fresh tensors)."""
        n = _nrows(rows)
        if n == 0:
            return
        if self._buf is None:
            dev = self.device
            self._buf = {
                k: torch.empty(
                    (self.capacity, *v.shape[1:]),
                    dtype=v.dtype,
                    device=v.device if dev is None else dev,
                )
                for k, v in rows.items()
            }
        elif rows.keys() != self._buf.keys():
            raise ValueError(f"rows with keys {sorted(rows)}, expected {sorted(self._buf)}")
        self._staged.append(rows)
        self._n_staged += n
        if self._filled < self.capacity:
            k = min(self.capacity - self._filled, self._n_staged)
            part = self._take(k)
            for key, buf in self._buf.items():
                buf[self._filled : self._filled + k].copy_(part[key])
            self._filled += k
        b = self.batch_size
        while self._filled == self.capacity and self._n_staged >= b:
            slots = torch.randperm(self.capacity, generator=self._gen, device=self._gen.device)[:b]
            if slots.device != next(iter(self._buf.values())).device:
                slots = slots.to(next(iter(self._buf.values())).device)
            out = {k: v.index_select(0, slots) for k, v in self._buf.items()}
            new = self._take(b)
            for key, buf in self._buf.items():
                _index_copy(buf, slots, new[key].to(buf.device))
            yield out

    def finish(self) -> Iterator[dict[str, torch.Tensor]]:
        """The rows still held, shuffled, in batches (the last one shorter unless drop_last)."""
        if self._buf is None:
            return
        # The rows held are the buffer's, then the staged ones (fewer than a batch once the
        # buffer is full): each batch is gathered from the two, as from their concatenation,
        # which would copy the whole buffer (twice its memory at the end of every pass).
        filled = self._filled
        held = {k: v[:filled] for k, v in self._buf.items()}
        staged = self._take(self._n_staged) if self._n_staged else None
        if staged is not None:
            staged = {k: staged[k].to(v.device) for k, v in held.items()}
        self._buf, self._filled = None, 0
        total = filled + (_nrows(staged) if staged is not None else 0)
        perm = torch.randperm(total, generator=self._gen, device=self._gen.device)
        perm = perm.to(next(iter(held.values())).device)
        b = self.batch_size
        for i in range(0, total, b):
            if self.drop_last and i + b > total:
                return
            idx = perm[i : i + b]
            if staged is None:
                yield {k: v.index_select(0, idx) for k, v in held.items()}
                continue
            late = idx >= filled
            at_late = late.nonzero().squeeze(1)
            at_held = (~late).nonzero().squeeze(1)
            out = {}
            for k, v in held.items():
                rows = torch.empty((len(idx), *v.shape[1:]), dtype=v.dtype, device=v.device)
                _index_copy(rows, at_held, v.index_select(0, idx[at_held]))
                _index_copy(rows, at_late, staged[k].index_select(0, idx[at_late] - filled))
                out[k] = rows
            yield out


def _index_copy(buf: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``buf[slots] = rows``. One-byte floats (``dtype=float8_e4m3fn``, a dtype a capture
    stores) are copied as their bytes: ``index_copy_`` has no kernel for them."""
    if buf.is_floating_point() and buf.element_size() == 1:
        buf, rows = buf.view(torch.uint8), rows.view(torch.uint8)
    buf.index_copy_(0, slots, rows)


def _nrows(rows: dict[str, torch.Tensor]) -> int:
    return int(next(iter(rows.values())).shape[0]) if rows else 0


def _world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """This process's rank and the world (:func:`pyhook.pipeline.ranks.rank_layout`)."""
    from .ranks import rank_layout

    lay = rank_layout(rank=rank, world_size=world_size)
    return lay.rank, lay.world


def _batches_of(source: Iterable[Any]) -> Iterator[Any]:
    """The items of an iterable ``source``, each checked to be a :class:`pyhook.source.Batch`
    (token ids alone, or a tokenizer's dict, failed in the runner as an ``AttributeError``)."""
    from .source import Batch

    for b in source:
        if not isinstance(b, Batch):
            raise TypeError(
                "source must be a pyhook.source corpus or an iterable of pyhook.source.Batch "
                f"(input_ids, attention_mask, keep, examples, texts), but it yielded a "
                f"{type(b).__name__}; a corpus file opens with pyhook.source.open_source(path, "
                "tokenizer=..., context_size=...)"
            )
        yield b


def _skip_examples(batches: Iterable[Any], n: int) -> Iterator[Any]:
    """The batches after their first ``n`` examples (a batch that straddles is cut)."""
    from .source import Batch

    for b in batches:
        k = len(b.examples)
        if n >= k:
            n -= k
            continue
        if n:
            b = Batch(
                b.input_ids[n:],
                b.attention_mask[n:],
                b.keep[n:],
                b.examples[n:],
                None if b.texts is None else b.texts[n:],
            )
            n = 0
        yield b


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def _stream_device(model: nn.Module, device: torch.device | str | None) -> torch.device:
    """Where the pass runs: ``device``, or the model's. One no forward can run on is refused
    here, naming ``device``, rather than failing in the producer thread.

    Example::

        >>> import torch
        >>> from pyhook.pipeline.stream import _stream_device
        >>> _stream_device(torch.nn.Linear(2, 2), None)
        device(type='cpu')
        >>> _stream_device(torch.nn.Linear(2, 2), "meta")
        Traceback (most recent call last):
        ...
        ValueError: device 'meta' holds no data (shapes only): activations cannot be streamed from it; use cpu or cuda
    """
    if device is None:
        dev = _model_device(model)
        given = f"{str(dev)!r} (the model's; pass device= to run elsewhere)"
    else:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError, ValueError) as e:
            raise ValueError(
                f"device must be a torch.device or its name (cpu, cuda, cuda:1, ...), got "
                f"{device!r}: {e}"
            ) from None
        given = repr(str(device) if isinstance(device, str) else str(dev))
    if dev.type == "meta":
        raise ValueError(
            f"device {given} holds no data (shapes only): activations cannot be streamed from "
            "it; use cpu or cuda"
        )
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {given}: this torch ({torch.__version__}) has no usable CUDA device; "
                "use device='cpu'"
            )
        if (dev.index or 0) >= torch.cuda.device_count():
            raise ValueError(
                f"device {given}: only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
    elif dev.type != "cpu":
        try:  # the mixer draws with a generator on the device
            torch.Generator(device=dev)
        except RuntimeError as e:
            raise ValueError(f"device {given} cannot be streamed on here: {e}") from None
    return dev


class Stream:
    """Shuffled batches of a model's activations over a corpus; made by :func:`stream`.

    Iterating runs one pass: the producer thread starts, and every kept row comes out exactly
    once. Each batch is ``{layer: rows, "tokens": ids [n], "row_index": [n, 2]}`` (context or
    example, position), all rows of one token at the same index. Leaving the loop (``break``,
    an exception, Ctrl-C) stops the producer within one forward and removes every hook; so does
    :meth:`close` (or a ``with`` block), from the loop or another thread: the loop then ends at
    its next step. The pass starts at the first ``next()``, not at ``iter()``.

    Counters of the last pass: :attr:`rows`, :attr:`batches`, :attr:`examples` (examples or
    contexts run through the model), :attr:`dropped_rows` (``even_batches``),
    :attr:`wait_seconds` (the consumer's time waiting for
    batches, after the first), :attr:`first_batch_seconds` (filling the buffer),
    :attr:`examples_done` (with a tee: examples already stored when the pass began), and
    :attr:`from_tee` (the pass read a complete tee instead of running the model).

    Example::

        >>> import torch, transformers, pyhook
        >>> from pyhook.source import Batch
        >>> cfg = transformers.BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        ...                               intermediate_size=16, vocab_size=10)
        >>> bert = transformers.BertModel(cfg).eval()
        >>> ids = torch.arange(10).reshape(2, 5)
        >>> src = [Batch(ids, torch.ones_like(ids), ids > 0, torch.tensor([0, 1]), None)]
        >>> s = pyhook.stream(bert, src, "encoder.layer.0", batch_size=4, buffer_rows=4, seed=1)
        >>> [len(b["tokens"]) for b in s], s.rows  # token 0 is not kept
        ([4, 4, 1], 9)
    """

    def __init__(
        self,
        model: nn.Module,
        source: Any,
        recorder: Any,
        keep: Any,
        *,
        batch_size: int,
        buffer_rows: int,
        seed: int,
        device: torch.device,
        prefetch: int,
        drop_last: bool,
        tee: str | None,
        rank: int,
        world_size: int,
        even_group: Any = None,
        tee_group: Any = None,
    ) -> None:
        self.model = model
        self.source = source
        self.recorder = recorder
        self.layers: list[str] = list(recorder.layers)
        self.batch_size = batch_size
        self.buffer_rows = buffer_rows
        self.seed = seed
        self.device = device
        self.prefetch = prefetch
        self.drop_last = drop_last
        self.tee = tee
        self.rank = rank
        self.world_size = world_size
        self._even_group = even_group
        self._tee_group = tee_group
        self.from_tee = False
        self.dropped_rows = 0
        self._keep = keep
        self._passes = 0
        self._active: _Pass | None = None
        self._stop: threading.Event | None = None
        self._out: queue.Queue[Any] | None = None
        self.rows = self.batches = self.examples = self.examples_done = 0
        self.wait_seconds = self.first_batch_seconds = self.forward_seconds = 0.0

    # -- the producer ------------------------------------------------------------------------
    def _source_batches(self, stop: threading.Event, skip: int) -> Iterator[Any]:
        from .source import CorpusSource

        src = self.source
        if isinstance(src, CorpusSource):
            if self.tee is not None or (src.world_size == 1 and self.world_size > 1):
                clone = CorpusSource.__new__(CorpusSource)
                clone.__dict__.update(src.__dict__)
                if src.world_size == 1 and self.world_size > 1:
                    # the shares capture uses (the command opens the source with them)
                    clone.rank, clone.world_size, clone._count = self.rank, self.world_size, None
                if self.tee is not None:
                    # as the command does on resume, after the examples the source skips itself
                    clone.skip = src.skip + skip
                src = clone
            it: Iterable[Any] = src
        else:
            it = _batches_of(src)
            if skip:
                it = _skip_examples(it, skip)
        none = True
        for b in it:
            if stop.is_set():
                return
            none = False
            yield b
        if none and self._passes > 1 and self.tee is None and isinstance(src, Iterator):
            # a generator used up by an earlier pass: this pass (an epoch) had no row, silently
            raise ValueError(
                f"source is a one-shot iterator ({type(src).__name__}) that an earlier pass used "
                "up: this pass has no row. A stream iterated again needs a source it can iterate "
                "again: a list of pyhook.source.Batch, a pyhook.source corpus, or an iterable "
                "whose __iter__ starts over"
            )

    def _tee_is_complete(self) -> bool:
        """Whether this pass found every example of the source in the tee already (it ran no
        forward, and the tee holds rows): then the pass reads the tee. Several ranks agree on
        it (a rank that still had examples to run makes every rank stream live)."""
        ran_nothing = self.examples == 0
        stored = self.examples_done
        if self._tee_group is not None:
            dist = torch.distributed
            votes = torch.tensor([int(ran_nothing), -stored])
            dist.all_reduce(votes, dist.ReduceOp.MIN, group=self._tee_group)
            ran_nothing, stored = bool(votes[0]), -int(votes[1])
        return ran_nothing and stored > 0

    def _stored_batches(
        self, stop: threading.Event, epoch: int
    ) -> Iterator[dict[str, torch.Tensor]]:
        """A pass over a complete tee: its rows read back, shuffled over the whole store from
        ``(seed, epoch)`` (as :class:`~pyhook.dataset.CaptureDataset` shuffles), in this rank's
        share, as batches with the live pass's keys, dtypes and device. No forward runs."""
        from .dataset import CaptureDataset

        assert self.tee is not None
        ds = CaptureDataset(
            self.tee,
            self.layers,
            batch_size=self.batch_size,
            shuffle=True,
            seed=self.seed,
            rank=self.rank,
            world_size=self.world_size,
            drop_last=self.drop_last,
            tokens=True,
            row_index=True,
        )
        ds.set_epoch(epoch)
        keys = [*self.layers, *_RESERVED]
        to = self.device if self.device.type != "cpu" else None
        for b in ds:
            if stop.is_set():
                return
            yield {k: b[k] if to is None else b[k].to(to) for k in keys}

    def _produce(self, out: queue.Queue[Any], stop: threading.Event, seed: int, epoch: int) -> bool:
        from .runner import run

        rec = self.recorder
        inbox: collections.deque[dict[str, torch.Tensor]] = collections.deque()
        errors: list[BaseException] = []
        layers = self.layers
        tee = self.tee is not None
        side: torch.cuda.Stream | None = None

        def sink(batch: dict[str, Any], _examples: int) -> None:
            if not batch or stop.is_set():
                return
            try:
                inbox.append(_rows_of(batch, layers, copy=tee))
            except BaseException as e:
                if not tee:
                    raise  # from the forward: run() stops with it
                errors.append(e)  # the writer thread would swallow it

        def put(item: Any) -> bool:
            return put_unless_stopped(out, item, stop, 0.1)

        def emit(batches: Iterable[dict[str, torch.Tensor]]) -> None:
            for b in batches:
                event = None
                if side is not None:
                    event = torch.cuda.Event()
                    event.record(side)
                if not put((b, event)):
                    return

        def drain() -> None:
            if errors:
                raise errors[0]
            while inbox and not stop.is_set():
                emit(mixer.add(inbox.popleft()))

        def after_forward(b: Any, dt: float) -> None:
            self.examples += len(b.examples)
            self.forward_seconds += dt
            drain()

        try:
            # set up inside the try: an error here (the device) reaches the loop as itself
            mixer = Mixer(
                self.buffer_rows,
                self.batch_size,
                seed,
                device=self.device if self.device.type != "cpu" else None,
                drop_last=self.drop_last,
            )
            if self.device.type == "cuda" and torch.cuda.is_available():
                side = torch.cuda.Stream(self.device)
            rec._sink = sink
            with torch.cuda.stream(side) if side is not None else _nullcontext():
                with rec:
                    # overwrite=True replaces the tee once: a later pass resumes what this one
                    # writes (a second pass had wiped a complete tee, and a break left a part)
                    rec.overwrite = False
                    self.examples_done = rec.examples_done if tee else 0
                    batches = self._source_batches(stop, self.examples_done)
                    run(
                        self.model,
                        batches,
                        rec,
                        device=self.device,
                        keep=self._keep,
                        on_batch=after_forward,
                    )
                drain()  # a tee's last shards went to disk when the recorder closed
                if tee and self._tee_is_complete():
                    # Every example was stored before this pass: the tee is the cache.
                    self.from_tee = True
                    emit(self._stored_batches(stop, epoch))
                elif not stop.is_set():
                    emit(mixer.finish())
            last: Any = _DONE
        except BaseException as e:
            last = _Failed(e)
        finally:
            rec._sink = None  # before the consumer learns the pass is over (and starts another)
        normal = last is _DONE and not stop.is_set()
        put(last)
        return normal

    # -- the consumer ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """A new pass. It starts at the first ``next()``: an iterator made but never advanced
        (``zip(range(0), stream)``) starts no thread and registers no hook."""
        return self._consume()

    def _begin(self) -> tuple[queue.Queue[Any], threading.Event, _Pass]:
        """Start a pass: its queue, its stop event and its producer."""
        if self._active is not None and self._active.is_alive():
            raise RuntimeError("this stream is already being iterated; finish or close() it first")
        epoch = self._passes
        seed = (self.seed + epoch) % 2**64  # the generator's seed is 64-bit (-1 is 2**64-1)
        self._passes += 1
        self.from_tee = False
        self.rows = self.batches = self.examples = self.dropped_rows = 0
        self.wait_seconds = self.first_batch_seconds = self.forward_seconds = 0.0
        out: queue.Queue[Any] = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        if self.device.type == "cpu" and release_consumer_team():
            # The forward moves to the producer thread: this thread's idle OpenMP workers go,
            # so that the producer's team is not throttled as one of too many (pyhook._omp).
            release_thread_team()
        t = _Producer.start(lambda: self._produce(out, stop, seed, epoch))
        self._active, self._stop, self._out = t, stop, out
        return out, stop, t

    def _consume(self) -> Iterator[dict[str, torch.Tensor]]:
        out, stop, t = self._begin()
        current = (
            torch.cuda.current_stream(self.device)
            if self.device.type == "cuda" and torch.cuda.is_available()
            else None
        )
        start = time.perf_counter()
        try:
            while True:
                t0 = time.perf_counter()
                while True:
                    try:
                        item = out.get(timeout=0.1)
                        break
                    except queue.Empty:
                        if not t.is_alive() and out.empty():
                            if stop.is_set():  # close(): the producer queued no end marker
                                return
                            raise RuntimeError("the pyhook stream's producer thread died") from None
                if self._even_group is not None and not self._all_have(item):
                    # another rank's share is used up: every rank stops at the same batch
                    if isinstance(item, tuple):
                        self.dropped_rows += int(item[0]["tokens"].shape[0])
                    elif isinstance(item, _Failed):
                        raise item.error
                    return
                if item is _DONE:
                    return
                if isinstance(item, _Failed):
                    raise item.error
                batch, event = item
                if current is not None and event is not None:
                    # the rows were made on the producer's stream: the trainer's stream waits
                    # for them, and their memory is not reused while it still reads them
                    current.wait_event(event)
                    for v in batch.values():
                        v.record_stream(current)
                now = time.perf_counter()
                if self.batches == 0:
                    self.first_batch_seconds = now - start
                else:
                    self.wait_seconds += now - t0
                self.batches += 1
                self.rows += int(batch["tokens"].shape[0])
                yield batch
        finally:
            self._shutdown(stop, t, out)

    def _all_have(self, item: Any) -> bool:
        """even_batches: whether every rank has a batch this step (a MIN over the ranks)."""
        have = torch.tensor([1 if isinstance(item, tuple) else 0])
        torch.distributed.all_reduce(have, torch.distributed.ReduceOp.MIN, group=self._even_group)
        return bool(have.item())

    def _shutdown(self, stop: threading.Event, t: _Pass, out: queue.Queue[Any]) -> None:
        stop.set()
        while t.is_alive():
            try:  # unblock a producer waiting for room
                while True:
                    out.get_nowait()
            except queue.Empty:
                pass
            t.join(0.05)
        if self._active is t:
            self._active = self._stop = self._out = None

    def close(self) -> None:
        """Stop a pass in progress: the producer ends after its current forward, the hooks are
        removed, and a tee is closed consistent (resumable). Returns once all that is done.

        The loop over the pass then ends quietly at its next step, whether ``close()`` was
        called from its body or from another thread (a watchdog): the batches still queued are
        dropped (a batch the loop had already taken comes out), and an error the producer had
        queued before the stop is raised there. A pass that is over (its iterator took every
        batch) is only forgotten: close() waits for no later pass that reuses its thread.
        """
        t, stop, out = self._active, self._stop, self._out
        if t is None or stop is None or out is None:
            return
        stop.set()
        t.join()
        # The producer is gone: nothing else puts into its queue. The loop's next step finds
        # the end marker the stopped producer could not queue.
        last: Any = _DONE
        try:
            while True:
                item = out.get_nowait()
                if isinstance(item, _Failed):
                    last = item
        except queue.Empty:
            pass
        try:
            out.put_nowait(last)
        except queue.Full:  # another close() just did the same
            pass
        if self._active is t:
            self._active = self._stop = self._out = None

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<pyhook.Stream layers={len(self.layers)} batch_size={self.batch_size} "
            f"buffer_rows={self.buffer_rows} tee={self.tee!r}>"
        )


def release_consumer_team() -> bool:
    """Whether a CPU stream releases the consumer thread's idle OpenMP team before its
    producer thread starts (:func:`pyhook._omp.release_thread_team`).

    Only when the machine is not oversubscribed: the 1-minute load average is at most the
    number of cores plus one half.
    On a machine with a core per runnable thread the producer's forward then runs as fast as
    on the main thread; where other processes take the cores, GNU OpenMP's throttled teams
    (kept when not released) lose less to spinning workers that are descheduled.

    Example::

        >>> from pyhook.pipeline.stream import release_consumer_team
        >>> release_consumer_team() in (True, False)
        True
    """
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not POSIX: no load to judge by
        return False
    return load <= (os.cpu_count() or 1) + 0.5


class _Producer:
    """One pass's producer: a job on a thread of its own, kept between passes.

    A fresh thread per pass paid for its start every pass: glibc gives a new thread's
    allocations an arena whose pages the forward then faults in again (15,000-28,000 minor
    faults per 6-forward pass at GPT-2-small width, against ~700 on a kept thread; in one paired
    measurement at load 7, 1.71 s against 1.55 s of CPU per pass; benchmarks/RESULTS.md,
    "stream, issue 24, 2026-11-25"), and OpenMP starts it a new team. So a thread whose pass
    ended normally waits, named ``pyhook-stream (idle)``, up to :data:`_IDLE_SECONDS` for the
    next pass (of any stream) before it exits; its OpenMP workers are released after each pass
    (pyhook._omp), so that between passes the process has the one team it had before. A pass
    that stopped early (``break``, an exception, Ctrl-C, ``close()``) or failed lets its
    thread end, as before. :meth:`start` returns the pass (:class:`_Pass`), whose end is waited
    for, not the thread's: the thread may run another stream's pass by then.
    """

    _idle: ClassVar[list[_Producer]] = []
    _lock = threading.Lock()

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Any, _Pass] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="pyhook-stream", daemon=True)

    @classmethod
    def start(cls, job: Any) -> _Pass:
        """Run ``job`` (one pass: True when it ended normally) on a kept thread or a new one."""
        with cls._lock:
            p = cls._idle.pop() if cls._idle else None
        if p is not None and not p.thread.is_alive():
            p = None  # gone (e.g. in a forked child, which has no copy of the thread)
        fresh = p is None
        if p is None:
            p = cls()
        run = _Pass()
        p.thread.name = "pyhook-stream"
        p._jobs.put((job, run))
        if fresh:
            p.thread.start()
        return run

    @classmethod
    def retire_idle(cls) -> None:
        """End the kept threads that wait for a pass now (they exit at once)."""
        with cls._lock:
            idle, cls._idle[:] = list(cls._idle), []
        for p in idle:
            p._jobs.put(None)
            p.thread.join()

    def _loop(self) -> None:
        while True:
            try:
                item = self._jobs.get(timeout=_IDLE_SECONDS)
            except queue.Empty:
                with _Producer._lock:
                    if self in _Producer._idle:
                        _Producer._idle.remove(self)
                        return
                continue  # taken for a pass just now: its job is coming
            if item is None:  # retire_idle
                return
            job, run = item
            item = None
            keep = False
            try:
                keep = job() is True  # the pass ended normally
            finally:
                job = None  # an idle thread holds no stream (nor its model) alive
                _release_producer_team()
                if keep:
                    self.thread.name = "pyhook-stream (idle)"
                    with _Producer._lock:
                        _Producer._idle.append(self)
                run._done.set()
            if not keep:
                return


class _Pass:
    """One pass on a :class:`_Producer`'s thread: ``is_alive``/``join`` are this pass's, so a
    stream whose pass is over never waits for the next pass the same kept thread runs."""

    __slots__ = ("_done",)

    def __init__(self) -> None:
        self._done = threading.Event()

    def is_alive(self) -> bool:
        return not self._done.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)


_IDLE_SECONDS = 30.0


def _forget_producers_in_child() -> None:
    """A forked child has none of the parent's threads: it starts with no kept producer."""
    _Producer._idle = []
    _Producer._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_producers_in_child)
_release_producer_team = release_thread_team  # the producer's own call (tests watch it apart)


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _rows_of(batch: dict[str, Any], layers: list[str], *, copy: bool) -> dict[str, torch.Tensor]:
    """One finished capture batch as mixer rows: the layers, then tokens and row index."""
    from ..offload import PendingCopy

    ids = batch.get("__token_ids__")
    index = batch.get("__row_index__")
    if index is None or ids is None:
        raise ValueError(
            "stream needs token rows of one layout in every layer (one row per kept token, or "
            f"per example with positions=): the layers {layers} gave rows that no token index "
            "describes; stream the layers separately"
        )
    rows: dict[str, torch.Tensor] = {}
    for name in layers:
        t = batch[name]
        if isinstance(t, PendingCopy):
            t = t.wait()[0]
        rows[name] = t.clone() if copy else t
    rows["tokens"] = ids.clone() if copy else ids
    rows["row_index"] = index.clone() if copy else index
    return rows


def _check_options(options: dict[str, Any]) -> None:
    """Further ``stream()`` options are the recorder's (:func:`pyhook.capture`'s): an unknown
    one is a ``TypeError`` naming it and the closest known one, before anything is made."""
    import difflib
    import inspect

    from .capture import Recorder

    def keywords(fn: Any) -> list[str]:
        params = inspect.signature(fn).parameters.items()
        return [n for n, p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]

    known = [n for n in keywords(Recorder.__init__) if n not in ("to", "out", "mask")]
    for name in options:
        if name not in known:
            close = difflib.get_close_matches(name, [*known, *keywords(stream)], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(
                f"stream() got an unknown option {name!r}{hint}; besides its own arguments it "
                f"takes the recorder's: {', '.join(sorted(known))}"
            )


def stream(
    model: nn.Module,
    source: Any,
    layers: Any,
    *,
    batch_size: int = 4096,
    buffer_rows: int | None = None,
    seed: int = 0,
    tee: str | os.PathLike[str] | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    positions: Any = None,
    prefetch: int = 2,
    drop_last: bool = False,
    overwrite: bool = False,
    rank: int | None = None,
    world_size: int | None = None,
    even_batches: bool = False,
    **options: Any,
) -> Stream:
    """Train on activations without a disk: shuffled batches of ``layers``' rows from live
    forwards of ``model`` over ``source``.

    Example (an SAE step per batch)::

        >>> import torch, transformers, pyhook
        >>> from pyhook.source import Batch
        >>> cfg = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=20, n_positions=16)
        >>> gpt = transformers.GPT2Model(cfg).eval()
        >>> ids = torch.randint(0, 20, (4, 16))
        >>> src = [Batch(ids, torch.ones_like(ids), torch.ones(4, 16, dtype=torch.bool), torch.arange(4), None)]
        >>> sae = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
        >>> opt = torch.optim.Adam(sae.parameters(), 1e-3)
        >>> for b in pyhook.stream(gpt, src, "h.0", batch_size=16, buffer_rows=32):
        ...     loss = (sae(b["h.0"]) - b["h.0"]).pow(2).mean()
        ...     opt.zero_grad(); loss.backward(); opt.step()
        >>> b["row_index"].shape
        torch.Size([16, 2])

    Arguments: ``source`` is a :mod:`pyhook.source` corpus (:func:`pyhook.source.open_source`;
    under ``torchrun`` each rank streams the share a capture would take) or any iterable of
    :class:`pyhook.source.Batch`; ``layers`` names, globs, submodules or standard points, as
    for :func:`pyhook.capture`. ``batch_size`` rows per batch; ``buffer_rows`` the mixing
    buffer (default 16 batches; at least ``batch_size``); ``seed`` its draws (pass ``k`` of the
    same stream uses ``seed + k``); ``prefetch`` batches ready ahead of the trainer.
    ``device``: where the model runs and the rows stay (default: the model's); on CUDA the
    producer runs on its own stream. ``dtype``/``positions`` and further ``options``
    (``select``, ``settings``, ``meta``, ``shard_bytes``, ``max_host_bytes``, ...) are
    :func:`pyhook.capture`'s. ``tee=DIR_OR_URL``: the rows also go to a crash-safe store,
    the same bytes ``capture(out=)`` and :func:`pyhook.runner.run` write; a tee that holds part
    of this capture is resumed (the pass streams the examples it lacks), one that holds another
    capture is refused (``overwrite=True`` replaces it). A tee is also a cache: a pass that
    finds every example of ``source`` already in it (the second epoch, or a rerun) runs no
    forward and reads the tee instead: every stored row once, shuffled over the whole store
    from ``(seed, k)`` for pass ``k`` (as :class:`~pyhook.dataset.CaptureDataset` shuffles),
    in batches with the live pass's keys, dtypes and device (:attr:`Stream.from_tee` is then
    True). A tee written with ``quantize=`` gives back its dequantised rows.

    ``even_batches=True`` (several ranks): every rank yields as many batches as the rank with
    the fewest, for a trainer with a collective per step (DDP), which would wait forever for a
    rank that has run out; the ranks agree once per batch, and the rows of the batch each rank
    had in hand then are counted in :attr:`Stream.dropped_rows` (a lower bound: the rest of its
    share is not run to be counted). Leave it off to get every row.

    Bad input (an unknown layer, ``buffer_rows < batch_size``, a tee holding a different
    capture, a ``device`` no forward can run on: ``meta``, CUDA where torch has none, a flag
    that is not a bool, a ``rank`` outside ``[0, world_size)``, an unknown option) raises
    here, before any forward, naming the argument. An error once the pass runs (the corpus,
    the model) is raised in the trainer's loop.
    """
    from .capture import Recorder
    from .runner import _Keep

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(source, (str, bytes, os.PathLike)):
        raise TypeError(
            "source must be a pyhook.source corpus (pyhook.source.open_source(path, ...)) or an "
            f"iterable of pyhook.source.Batch, got the path {source!r}"
        )
    if not isinstance(source, Iterable):
        raise TypeError(
            f"source must be a pyhook.source corpus or an iterable of Batch, got {type(source).__name__}"
        )
    for name, value, low in (("batch_size", batch_size, 1), ("prefetch", prefetch, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if buffer_rows is None:
        buffer_rows = 16 * batch_size
    if not isinstance(buffer_rows, int) or isinstance(buffer_rows, bool):
        raise TypeError(f"buffer_rows must be an int (rows), got {buffer_rows!r}")
    if buffer_rows < batch_size:
        raise ValueError(
            f"buffer_rows ({buffer_rows}) must be >= batch_size ({batch_size}): the mixing buffer "
            "holds at least one batch (16 batches or more mix well)"
        )
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if not -(2**63) <= seed < 2**64:
        raise ValueError(f"seed must be a 64-bit int (-2**63 <= seed < 2**64), got {seed!r}")
    if "to" in options or "out" in options or "mask" in options:
        raise TypeError(
            "stream chooses the recorder's destination and mask itself (the source's keep mask); "
            "use tee= to also write the rows to disk"
        )
    _check_options(options)
    dev = _stream_device(model, device)
    r, world = _world(rank, world_size)
    for flag, value in (
        ("even_batches", even_batches),
        ("drop_last", drop_last),
        ("overwrite", overwrite),
    ):
        if not isinstance(value, bool):
            raise TypeError(f"{flag} must be a bool (True or False), got {value!r}")
    dist = torch.distributed
    if even_batches and world > 1 and not (dist.is_available() and dist.is_initialized()):
        # without a process group there is no vote: each rank would run to its own end
        raise ValueError(
            f"even_batches=True: the {world} ranks agree on each batch through torch.distributed, "
            "which is not initialized; call torch.distributed.init_process_group() before stream()"
        )
    keep = _Keep()
    rec_opts: dict[str, Any] = {"positions": positions, "dtype": dtype, "mask": keep, **options}
    if tee is not None:
        if not isinstance(tee, (str, os.PathLike)):
            raise TypeError(
                f"tee must be a directory path or URL (str or os.PathLike), got {type(tee).__name__}"
            )
        tee = os.fspath(tee)
        from ._paths import check_out_dir

        check_out_dir(tee, "tee", ValueError)  # a file, '', a folder no one can write to
        rec = Recorder(
            model,
            layers,
            out=tee,
            overwrite=overwrite,
            rank=rank,
            world_size=world_size,
            **rec_opts,
        )
        if not overwrite:
            _refuse_other_capture(tee, rec)
    else:
        enc = [n for n in ("quantize", "compress") if options.get(n) is not None]
        if enc:
            raise ValueError(
                f"{enc[0]}= chooses how a tee stores its rows; pass tee=DIR_OR_URL with it "
                "(stream's batches are the rows as captured)"
            )
        rec = Recorder(
            model,
            layers,
            to="device" if dev.type != "cpu" else "host",
            stats=options.pop("stats", False),
            **{k: v for k, v in rec_opts.items() if k != "stats"},
        )
    bad = [n for n in rec.layers if n in _RESERVED]
    if bad:
        raise ValueError(f"layers: {bad[0]!r} is a key stream reserves for its own columns")
    even_group = tee_group = None
    if world > 1 and dist.is_available() and dist.is_initialized():
        # Groups of their own (gloo, made by every rank here, after the checks), so that the
        # stream's collectives never interleave with the trainer's: the tee's one barrier
        # (from the producer thread, before the index merge) and even_batches' vote per batch.
        if tee is not None:
            tee_group = dist.new_group(backend="gloo")
            rec._barrier = lambda: dist.barrier(group=tee_group)
        if even_batches:
            even_group = dist.new_group(backend="gloo")
    return Stream(
        model,
        source,
        rec,
        keep,
        batch_size=batch_size,
        buffer_rows=buffer_rows,
        seed=seed,
        device=dev,
        prefetch=prefetch,
        drop_last=drop_last,
        tee=tee,
        rank=r,
        world_size=world,
        even_group=even_group,
        tee_group=tee_group,
    )


def _refuse_other_capture(tee: str, rec: Any) -> None:
    """A tee that already holds another capture is refused now, not at the first forward."""
    import json
    import re

    from .format import _settings_diff
    from .reader import open_capture

    local = not re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", tee)
    if local and (
        not os.path.isdir(tee) or not any(n.startswith("index") for n in os.listdir(tee))
    ):
        return
    try:
        stored = open_capture(tee)
    except Exception:  # damage, or nothing there: the writer reports it when the pass starts
        return
    now = json.loads(json.dumps(rec.settings))
    diff = _settings_diff(stored.settings, now)
    if diff:
        raise ValueError(
            f"tee {tee!r} already holds a different capture ({stored.examples:,} examples): "
            + "; ".join(diff)
            + ". Use another tee, or overwrite=True to replace it."
        )
