"""Reading a capture for training, against the strongest hand-written reader of each case.

Run:  python benchmarks/bench_read.py [--quick] [--busy {both,off,on}] [--pin] [--only abcde]
                                     [--dir DIR]

One run writes a capture (float32 rows of 768 values, the GPT-2-small residual width; 128 MB
shards) and the same rows as one raw file, then times paired rounds: each round times every
method on the same batch indices, in a shuffled order, after overwriting 96 MB so that no
method reads rows the previous one left in the CPU caches; ratios are medians of per-round
ratios. Every number is printed with the load average it was measured under, and next to the
wall time this process's CPU time (user + system, all its threads) of the timed part: steadier
than wall time on a shared machine, but blind to waiting for the disk and to DataLoader workers
(not shown for (d)).

**The other core busy.** A reader for training shares the machine with the trainer. With
``--busy both`` (the default) a spinning process runs for the whole run and is paused
(``SIGSTOP``) or resumed (``SIGCONT``) before every round, in a shuffled order: every case is
measured "no spinner" and "spinner on a core" in paired rounds of one run. ``--pin`` pins the spinner
to the last core (else the scheduler places it).

Cases (pyhook = ``CaptureDataset.batch`` / its iterator; the hand-written readers use the raw
file, the best of them is named in the table):

(a) shuffled batches of 4096 rows, page cache warm. Hand-written: numpy memmap fancy index;
    ``np.take`` into a preallocated buffer, in batch order and with the rows sorted first (a
    batch is a uniform sample: a trainer may take its rows in file order); the rows read in
    sorted order and scattered to their slots (``np.take`` then ``out[order] = rows``: the batch's
    order kept); ``torch.index_select`` into a preallocated buffer (torch's intra-op threads, and
    one thread). Limit: ``copy_`` of the same number of *consecutive* bytes into a preallocated
    buffer (memory bandwidth). Targets: pyhook >= 1.0x the best hand-written reader and >= 80%
    of the ``copy_`` bandwidth. Also timed: pyhook on one thread.
(b) the same batch as the first read after the files left the page cache (``posix_fadvise
    (DONTNEED)`` on every file, maps closed; no global ``drop_caches``: the machine is shared).
    Hand-written: numpy fancy index; sorted rows, ``madvise(MADV_WILLNEED)`` of each row's pages,
    ``np.take`` into a preallocated buffer; sorted ``os.preadv`` of each row from 8 threads.
    Target: >= 1.0x the WILLNEED reader (and the best is named).
(c) sequential batches against one ``readinto`` a batch of the raw file: warm (c1: the
    ``shuffle=False`` iterator, each batch's pages touched for the first time in the process,
    and ``batch`` of consecutive rows from the other half of the capture), and cold (c2: the
    first 16/32 batches after the files left the page cache; also ``readinto`` after
    ``POSIX_FADV_SEQUENTIAL``, and the better of the two is the reference). pyhook's cold
    sequential batches are read with ``preadv`` (see ``pyhook/pipeline/_seqread.py``). Target
    cold: >= 0.9x readinto.
(d) ``DataLoader(ds, batch_size=None, num_workers=2)`` (reused shared-memory slots) against the
    dataset iterated in the main process, warm, feeding nothing and feeding a training step (a
    768 -> 64 -> 768 autoencoder, forward, backward, Adam, on as many rows as make a step about
    as long as loading a batch in-process). Quiet rounds only.
(e) (full runs only) shuffle modes: quality and speed.
(f) a batch of 12 layers + token ids (256 and 2048 rows): the dataset's one native call for all
    of them against one call per layer (the path before) and a sorted ``np.take`` per layer.
(g) the shuffled batch of (a) read right after a training step on torch's threads (what an
    in-process training loop does: the step leaves torch's OpenMP workers spinning on the other
    core): pyhook against ``torch.index_select`` and ``np.take``, batches of 4096 and of 1024
    rows. Target: >= 1.0x the best.

At the end: one table of every target, measured in this run, with pass/miss.
"""

from __future__ import annotations

import argparse
import gc
import glob
import mmap
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch.utils.data import DataLoader

import pyhook
from pyhook import _backend
from pyhook.dataset import CaptureDataset, shuffle_quality
from pyhook.store import ShardWriter

D = 768
BATCH = 4096
ROW = D * 4
med = statistics.median
STATES = ("no spinner", "spinner on a core")
SINGLE_STATE = STATES[0]  # the label of rounds run without pausing the spinner (--busy off/on)


def load() -> float:
    return os.getloadavg()[0]


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join(
        [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
        + [line(r) for r in rows]
    )


def drop_cache(paths: list[str]) -> None:
    """Evict the files from the page cache (pages still mapped by a process stay: callers close
    their maps first)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(paths: list[str]) -> None:
    buf = bytearray(64 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


_EVICT = np.zeros(0, dtype=np.uint8)


def aligned_empty(shape: tuple[int, ...]) -> np.ndarray:
    """A float32 buffer starting at a page boundary, for the hand-written readers. ``np.empty``
    of a large array starts 16 bytes past a page boundary (malloc's header); a copy whose
    destination is a few bytes ahead of its source modulo 4 KiB stalls on "4K aliasing" of loads
    with earlier stores: measured 1.4x the CPU time of the same gather into a page-aligned
    buffer (rows of 3 KB from a page-aligned file). Aligned, every reader gets its best case."""
    n = int(np.prod(shape)) * 4
    raw = np.empty(n + 4096, dtype=np.uint8)
    off = (-raw.ctypes.data) % 4096
    return raw[off : off + n].view(np.float32).reshape(shape)


def evict_cpu_caches() -> None:
    """Overwrite 96 MB (3x this machine's L3): a method must not read rows that the previous
    method of the round left in the CPU caches (a 12.6 MB batch fits in a 32 MB L3)."""
    global _EVICT
    if _EVICT.size == 0:
        _EVICT = np.zeros(96 << 20, dtype=np.uint8)
    _EVICT += 1


class Spinner:
    """A process spinning on one core, paused (SIGSTOP) or running (SIGCONT) on demand."""

    def __init__(self, pin: bool) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        if pin:
            os.sched_setaffinity(self.proc.pid, {max(os.sched_getaffinity(0))})
        self.busy = True
        self.set(False)

    def set(self, busy: bool) -> None:
        if busy != self.busy:
            os.kill(self.proc.pid, signal.SIGCONT if busy else signal.SIGSTOP)
            self.busy = busy
            time.sleep(0.02)  # let the scheduler see it

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def clock() -> tuple[float, float]:
    """(wall, process CPU) seconds now."""
    return time.perf_counter(), time.process_time()


def since(t0: tuple[float, float]) -> tuple[float, float]:
    """(wall, process CPU) seconds since ``t0 = clock()``: what a method returns when its setup
    (dropping the page cache, opening the capture) must not count."""
    return time.perf_counter() - t0[0], time.process_time() - t0[1]


def paired(
    fns: dict[str, Callable[[int], object]],
    rounds: int,
    spinner: Spinner | None,
    seed: int = 0,
    before: Callable[[], object] = evict_cpu_caches,
) -> dict[str, dict[str, list[float]]]:
    """Seconds per state, method and round. Round r of every method uses the same indices, in
    a shuffled order; with a spinner, every round is run once with it paused and once with it
    spinning (in a shuffled order). A method may return its own measured time (when
    its setup must not count). ``before`` runs, untimed, before every method (by default the
    CPU caches are overwritten)."""
    states = STATES if spinner is not None else (SINGLE_STATE,)
    times: dict[str, dict[str, list[float]]] = {s: {k: [] for k in fns} for s in states}
    loads: dict[str, list[float]] = {s: [] for s in states}
    order = list(fns)
    rng = random.Random(seed)
    for r in range(rounds):
        st = list(states)
        rng.shuffle(st)
        for s in st:
            if spinner is not None:
                spinner.set(s != STATES[0])
            rng.shuffle(order)
            for name in order:
                before()
                t0 = clock()
                own = fns[name](r)
                wall, cpu = own if isinstance(own, tuple) else since(t0)
                times[s][name].append(wall)
                times[s].setdefault(f"cpu:{name}", []).append(cpu)
            loads[s].append(load())
    if spinner is not None:
        spinner.set(False)
    for s in states:
        times[s]["__load__"] = loads[s]
    return times


def ratio(times: dict[str, list[float]], base: str, name: str) -> float:
    """Speed of ``name`` relative to ``base`` (> 1: faster), median of paired rounds."""
    return med(b / t for b, t in zip(times[base], times[name]))


def report(times: dict[str, list[float]], base: str, nbytes: int, rows: int) -> str:
    out = []
    for name, ts in times.items():
        if name.startswith(("__", "cpu:")):
            continue
        t = med(ts)
        out.append(
            [
                name,
                f"{1e3 * t:.2f}",
                f"{1e3 * med(times[f'cpu:{name}']):.2f}",
                f"{rows / t / 1e6:.2f}",
                f"{nbytes / t / 1e9:.2f}",
                f"{ratio(times, base, name):.2f}",
                f"{ratio(times, f'cpu:{base}', f'cpu:{name}'):.2f}",
            ]
        )
    return table(
        out,
        ["method", "ms", "CPU ms", "M rows/s", "GB/s", f"speed vs {base}", "CPU time ratio"],
    )


SUMMARY: list[list[str]] = []


def verdict(
    case: str,
    state: str,
    times: dict[str, list[float]],
    ours: str,
    base: str,
    target: float,
    cpu: bool = True,
) -> None:
    """A summary row; ``cpu=False`` where this process's CPU time is not the reader's (workers)."""
    r = ratio(times, base, ours)
    SUMMARY.append(
        [
            case,
            state,
            f"{med(times['__load__']):.1f}",
            base,
            f"{1e3 * med(times[ours]):.2f}",
            f"{1e3 * med(times[base]):.2f}",
            f"{r:.2f}x",
            f"{ratio(times, f'cpu:{base}', f'cpu:{ours}'):.2f}x" if cpu else "-",
            f">= {target:.2f}x",
            "pass" if r >= target else "MISS",
        ]
    )


def best_of(times: dict[str, list[float]], names: list[str]) -> str:
    return min(names, key=lambda n: med(times[n]))


def raw_views(raw_path: str, rows: int) -> tuple[np.memmap, np.ndarray, torch.Tensor]:
    """The raw file of rows as a numpy memmap, a plain ndarray over the same map (no memmap
    subclass wrapping) and a tensor over it, for the hand-written readers."""
    mm = np.memmap(raw_path, dtype=np.float32, mode="r", shape=(rows, D))
    arr = np.asarray(mm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only memory: only ever read here
        mt = torch.from_numpy(arr)
    return mm, arr, mt


def one_thread(fn: Callable[[int], object]) -> Callable[[int], object]:
    """``fn`` run with torch on one intra-op thread (pyhook's gather then uses no helper)."""

    def run(r: int) -> object:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(r)
        finally:
            torch.set_num_threads(threads)

    return run


def sae_step(out: str) -> tuple[Callable[[torch.Tensor], None], int, float, float]:
    """A training step on a batch: a 768 -> 64 -> 768 ReLU autoencoder on the batch's first
    ``n`` rows, MSE loss, backward, Adam, on one intra-op thread; ``n`` is the number of rows
    whose step time is the closest to loading one batch in-process (a step on all 4096 rows
    takes 10x-20x the load on this CPU). Returns (step, n, step seconds, load seconds)."""
    d = CaptureDataset(out, "h", batch_size=BATCH, seed=0)
    plan = list(d._plan())[:12]
    loads = []
    for idx in plan:
        t0 = time.perf_counter()
        d.batch(idx)
        loads.append(time.perf_counter() - t0)
    t_load = med(loads)
    x = d.batch(plan[0])["h"]
    enc, dec = torch.nn.Linear(D, 64), torch.nn.Linear(64, D)
    opt = torch.optim.Adam([*enc.parameters(), *dec.parameters()], lr=1e-4)

    def make(n: int) -> Callable[[torch.Tensor], None]:
        def step(rows: torch.Tensor) -> None:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # two OpenMP threads on a shared 2-core VM wait for a core
            try:
                rows = rows[:n]
                loss = (dec(torch.relu(enc(rows))) - rows).pow(2).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            finally:
                torch.set_num_threads(threads)

        return step

    best: tuple[float, int, float] | None = None
    for n in (64, 128, 256, 512, 1024, 2048, 4096):
        step = make(n)
        ts = []
        for _ in range(7):
            t0 = time.perf_counter()
            step(x)
            ts.append(time.perf_counter() - t0)
        t_step = med(ts[2:])
        gap = abs(np.log(t_step / t_load))
        if best is None or gap < best[0]:
            best = (gap, n, t_step)
    assert best is not None
    return make(best[1]), best[1], best[2], t_load


# -- (a) warm shuffled ---------------------------------------------------------------------------
def case_warm_shuffled(
    out: str,
    raw_path: str,
    files: list[str],
    rows: int,
    idxs: list[torch.Tensor],
    rounds: int,
    spinner: Spinner | None,
) -> None:
    warm(files)
    mm, arr, mt = raw_views(raw_path, rows)
    ds = CaptureDataset(out, "h", batch_size=BATCH, seed=0)
    parts = ds._sources()["h"]
    buf = aligned_empty((BATCH, D))
    tbuf = torch.from_numpy(buf)
    float(mm.sum()), sum(float(p.sum()) for p in parts)  # map every page in this process once
    np_idx = [i.numpy() for i in idxs]
    offsets = [int(i[0]) % (rows - BATCH) for i in idxs]
    for r in range(2):  # exactness, before timing
        want = mm[np_idx[r]]
        assert np.array_equal(want, ds.batch(idxs[r])["h"].numpy())
        torch.index_select(mt, 0, idxs[r], out=tbuf)
        assert np.array_equal(want, buf)
        np.take(arr, np_idx[r], axis=0, out=buf, mode="clip")
        assert np.array_equal(want, buf)
        np.take(arr, np.sort(np_idx[r]), axis=0, out=buf, mode="clip")
        assert np.array_equal(mm[np.sort(np_idx[r])], buf)

    tmp = aligned_empty((BATCH, D))

    def sorted_scatter(r: int) -> None:
        # The batch's order kept: the rows read in file order into a staging buffer, then each
        # written to its slot (numpy has no one-pass gather-scatter: two copies).
        i = np_idx[r]
        order = np.argsort(i, kind="stable")
        np.take(arr, i[order], axis=0, out=tmp, mode="clip")
        buf[order] = tmp

    sorted_scatter(0)
    assert np.array_equal(mm[np_idx[0]], buf)

    # np.take's mode="clip" (the indices are valid): with the default "raise", `out` is buffered.
    # "sorted np.take" returns the rows in file order, not the batch's: the strongest reader
    # when a trainer may take a batch's rows in any order. The others keep the batch's order.
    hand = [
        "numpy memmap fancy index",
        "np.take into preallocated",
        "sorted np.take into preallocated",
        "sorted read + scatter write (np.take, then out[order] = rows)",
        "torch.index_select into preallocated",
        "torch.index_select into preallocated, 1 thread",
    ]
    limits = [
        "copy_ of consecutive rows (bandwidth limit)",
        "copy_ of consecutive rows, 1 thread",
    ]
    copy = lambda r: tbuf.copy_(mt[offsets[r] : offsets[r] + BATCH])  # noqa: E731
    fns: dict[str, Callable[[int], object]] = {
        hand[0]: lambda r: mm[np_idx[r]],
        hand[1]: lambda r: np.take(arr, np_idx[r], axis=0, out=buf, mode="clip"),
        hand[2]: lambda r: np.take(arr, np.sort(np_idx[r]), axis=0, out=buf, mode="clip"),
        hand[3]: sorted_scatter,
        hand[4]: lambda r: torch.index_select(mt, 0, idxs[r], out=tbuf),
        hand[5]: one_thread(lambda r: torch.index_select(mt, 0, idxs[r], out=tbuf)),
        limits[0]: copy,
        limits[1]: one_thread(copy),
        "pyhook gather_rows (native, alone)": lambda r: _backend.gather_rows(parts, idxs[r]),
        # The same kernel over the raw file the hand-written readers use: tells the code apart
        # from the memory (the page-cache pages of the shards and of the raw file may differ).
        "pyhook gather_rows over the raw file": lambda r: _backend.gather_rows([mt], idxs[r]),
        "pyhook CaptureDataset.batch": lambda r: ds.batch(idxs[r]),
        "pyhook CaptureDataset.batch, 1 thread": one_thread(lambda r: ds.batch(idxs[r])),
    }
    t = paired(fns, rounds, spinner)
    for state, ts in t.items():
        best = best_of(ts, hand)
        print(
            f"\n(a) shuffled batches of {BATCH} rows, page cache warm, {state} (load "
            f"{med(ts['__load__']):.1f}); medians of {rounds} paired rounds; best hand-written: {best}"
        )
        print(report(ts, best, BATCH * ROW, BATCH))
        verdict(
            "(a) warm shuffled vs best hand-written",
            state,
            ts,
            "pyhook CaptureDataset.batch",
            best,
            1.0,
        )
        verdict(
            "(a) warm shuffled vs copy_ bandwidth",
            state,
            ts,
            "pyhook CaptureDataset.batch",
            best_of(ts, limits),
            0.8,
        )


# -- (b) cold shuffled ---------------------------------------------------------------------------
def case_cold_shuffled(
    out: str,
    raw_path: str,
    files: list[str],
    rows: int,
    idxs: list[torch.Tensor],
    rounds: int,
    spinner: Spinner | None,
) -> None:
    buf = aligned_empty((BATCH, D))
    page = mmap.PAGESIZE
    pool = ThreadPoolExecutor(8)

    def timed_raw(read: Callable[[int, object], None]) -> Callable[[int], tuple[float, float]]:
        def run(r: int) -> tuple[float, float]:
            gc.collect()
            drop_cache(files)
            with open(raw_path, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                t0 = clock()
                read(r, (f, m))
                dt = since(t0)
                m.close()
            return dt

        return run

    def numpy_fancy(r: int, fm: object) -> None:
        _, m = fm  # type: ignore[misc]
        a = np.frombuffer(m, dtype=np.float32).reshape(rows, D)
        a[idxs[r].numpy()]
        del a

    def willneed(r: int, fm: object) -> None:
        _, m = fm  # type: ignore[misc]
        s = np.sort(idxs[r].numpy())
        for row in s.tolist():
            lo = row * ROW // page * page
            m.madvise(mmap.MADV_WILLNEED, lo, (row + 1) * ROW - lo)
        a = np.frombuffer(m, dtype=np.float32).reshape(rows, D)
        np.take(a, s, axis=0, out=buf)
        del a

    def preadv(r: int, fm: object) -> None:
        f, _ = fm  # type: ignore[misc]
        s = np.sort(idxs[r].numpy()).tolist()
        views = memoryview(buf).cast("B")
        fd = f.fileno()
        list(
            pool.map(
                lambda k: os.preadv(fd, [views[k * ROW : (k + 1) * ROW]], s[k] * ROW), range(len(s))
            )
        )

    def pyhook_cold(r: int) -> tuple[float, float]:
        gc.collect()
        drop_cache(files)
        d = CaptureDataset(out, "h", batch_size=BATCH)
        d._sources()
        t0 = clock()
        d.batch(idxs[r])
        dt = since(t0)
        del d
        gc.collect()
        return dt

    hand = [
        "numpy memmap fancy index",
        "sorted + madvise(WILLNEED) + np.take into preallocated",
        "sorted os.preadv, 8 threads",
    ]
    fns = {
        hand[0]: timed_raw(numpy_fancy),
        hand[1]: timed_raw(willneed),
        hand[2]: timed_raw(preadv),
        "pyhook CaptureDataset.batch": pyhook_cold,
    }
    t = paired(fns, rounds, spinner)
    pool.shutdown()
    for state, ts in t.items():
        best = best_of(ts, hand)
        print(
            f"\n(b) shuffled batches of {BATCH} rows, first read after the files left the page "
            f"cache, {state} (load {med(ts['__load__']):.1f}); medians of {rounds} paired rounds; "
            f"best hand-written: {best}"
        )
        print(report(ts, hand[1], BATCH * ROW, BATCH))
        verdict(
            "(b) cold shuffled vs WILLNEED reader",
            state,
            ts,
            "pyhook CaptureDataset.batch",
            hand[1],
            1.0,
        )
        if best != hand[1]:
            verdict(
                "(b) cold shuffled vs best hand-written",
                state,
                ts,
                "pyhook CaptureDataset.batch",
                best,
                1.0,
            )


# -- (c) sequential -------------------------------------------------------------------------------
def case_sequential(
    out: str,
    raw_path: str,
    files: list[str],
    rows: int,
    rounds: int,
    n_seq: int,
    spinner: Spinner | None,
) -> None:
    buf = aligned_empty((BATCH, D))
    view = memoryview(buf).cast("B")
    nb = rows // BATCH

    # warm
    warm(files)
    seq = CaptureDataset(out, "h", batch_size=BATCH, shuffle=False)
    seq._sources()

    def raw_seq(r: int) -> None:
        with open(raw_path, "rb", buffering=0) as f:
            f.seek((r % nb) * BATCH * ROW)
            f.readinto(view)

    # What a shuffle=False user runs: the dataset's iterator, one batch a round (each batch's
    # pages touched for the first time in this process), and a batch of consecutive rows asked
    # for by index (`batch`: the memory-mapped gather, no sequential read path), from the
    # other half of the capture (pages the iterator has not mapped either).
    its: list[Iterator[dict[str, torch.Tensor]]] = [iter(seq)]

    def ds_iter(r: int) -> object:
        try:
            return next(its[0])
        except StopIteration:
            its[0] = iter(seq)
            return next(its[0])

    t = paired(
        {
            "raw file readinto": raw_seq,
            "pyhook CaptureDataset (shuffle=False)": ds_iter,
            "pyhook CaptureDataset.batch of consecutive rows": lambda r: seq.batch(
                torch.arange(((r + nb // 2) % nb) * BATCH, ((r + nb // 2) % nb + 1) * BATCH)
            ),
        },
        rounds * 2,
        spinner,
    )
    for state, ts in t.items():
        print(
            f"\n(c1) sequential batches of {BATCH} rows, page cache warm, {state} (load "
            f"{med(ts['__load__']):.1f}); medians of {rounds * 2} paired rounds"
        )
        print(report(ts, "raw file readinto", BATCH * ROW, BATCH))
        verdict(
            "(c1) warm sequential vs readinto",
            state,
            ts,
            "pyhook CaptureDataset (shuffle=False)",
            "raw file readinto",
            0.9,
        )

    its.clear()  # the iterator holds the dataset and its maps
    seq = None  # unmap: mapped pages cannot leave the page cache
    gc.collect()

    # cold: the first n_seq batches after a drop
    def cold_raw_seq(r: int) -> tuple[float, float]:
        drop_cache(files)
        t0 = clock()
        with open(raw_path, "rb", buffering=0) as f:
            for _ in range(n_seq):
                f.readinto(view)
        return since(t0)

    def cold_ds_seq(r: int) -> tuple[float, float]:
        gc.collect()
        drop_cache(files)
        d = CaptureDataset(out, "h", batch_size=BATCH, shuffle=False)
        it = iter(d)
        d._sources()
        t0 = clock()
        for _ in range(n_seq):
            next(it)
        dt = since(t0)
        del it, d
        gc.collect()
        return dt

    def cold_raw_seq_advised(r: int) -> tuple[float, float]:
        drop_cache(files)
        t0 = clock()
        with open(raw_path, "rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)  # twice the read-ahead
            for _ in range(n_seq):
                f.readinto(view)
        return since(t0)

    t = paired(
        {
            "raw file readinto": cold_raw_seq,
            "raw file readinto, POSIX_FADV_SEQUENTIAL": cold_raw_seq_advised,
            "pyhook CaptureDataset (shuffle=False)": cold_ds_seq,
        },
        rounds,
        spinner,
    )
    for state, ts in t.items():
        print(
            f"\n(c2) the first {n_seq} sequential batches of {BATCH} rows after the files left "
            f"the page cache, {state} (load {med(ts['__load__']):.1f}); medians of {rounds} paired rounds"
        )
        best = best_of(ts, ["raw file readinto", "raw file readinto, POSIX_FADV_SEQUENTIAL"])
        print(report(ts, best, BATCH * ROW * n_seq, BATCH * n_seq))
        verdict(
            "(c2) cold sequential vs best readinto",
            state,
            ts,
            "pyhook CaptureDataset (shuffle=False)",
            best,
            0.9,
        )


# -- (d) DataLoader ------------------------------------------------------------------------------
def case_loader(out: str, files: list[str], loader_batches: int, rounds: int, full: bool) -> None:
    warm(files)
    step, width, t_step, t_load = sae_step(out)
    startups: dict[tuple[int, int], list[float]] = {}

    def loader(workers: int, slots: int, train: bool) -> Callable[[int], tuple[float, float]]:
        def run(r: int) -> tuple[float, float]:
            d = CaptureDataset(out, "h", batch_size=BATCH, seed=r, worker_slots=slots)
            t_start = time.perf_counter()
            it = iter(DataLoader(d, batch_size=None, num_workers=workers))
            next(it)  # worker start-up excluded
            t0 = clock()
            startups.setdefault((workers, slots), []).append(t0[0] - t_start)
            for _ in range(loader_batches - 1):
                batch = next(it)
                if train:
                    step(batch["h"])
                del batch
            steady = since(t0)
            del it
            return steady

        return run

    methods = {
        "in-process (num_workers=0)": (0, 8),
        "DataLoader num_workers=2 (reused slots)": (2, 8),
    }
    if full:
        methods["DataLoader num_workers=2, worker_slots=0 (fresh shared memory)"] = (2, 0)
    fns = {}
    for name, (workers, slots) in methods.items():
        fns[f"{name}, feed"] = loader(workers, slots, False)
        fns[f"{name}, feed+train"] = loader(workers, slots, True)
    t = paired(fns, rounds, None)[SINGLE_STATE]
    n_rows = BATCH * (loader_batches - 1)
    base = "in-process (num_workers=0)"
    cells = []
    for name in methods:
        row = [name]
        for kind in ("feed", "feed+train"):
            ts = t[f"{name}, {kind}"]
            row += [
                f"{1e3 * med(ts) / (loader_batches - 1):.2f}",
                f"{n_rows * ROW / med(ts) / 1e9:.2f}",
                f"{ratio(t, f'{base}, {kind}', f'{name}, {kind}'):.2f}",
            ]
        cells.append(row)
    print(
        f"\n(d) DataLoader over {loader_batches} shuffled batches of {BATCH} rows (warm), time "
        f"after the first batch, load {med(t['__load__']):.1f}; medians of {rounds} paired rounds. "
        f"Training step: autoencoder 768 -> 64 -> 768 on {width} rows of each batch, "
        f"{1e3 * t_step:.1f} ms a step alone (in-process load {1e3 * t_load:.1f} ms a batch); "
        "first batch, start-up included: "
        + ", ".join(
            f"{k} workers (slots {s}) {1e3 * med(v):.0f} ms" for (k, s), v in startups.items()
        )
    )
    print(
        table(
            cells,
            [
                "method",
                "feed: ms/batch",
                "GB/s",
                "vs in-process",
                "feed+train: ms/batch",
                "GB/s",
                "vs in-process",
            ],
        )
    )
    ring = "DataLoader num_workers=2 (reused slots)"
    for kind in ("feed", "feed+train"):
        verdict(
            f"(d) 2 workers, {kind}, vs in-process",
            SINGLE_STATE,
            t,
            f"{ring}, {kind}",
            f"{base}, {kind}",
            1.0,
            cpu=False,
        )


# -- (e) shuffle modes ---------------------------------------------------------------------------
def case_modes(out: str, files: list[str], rows: int, rounds: int, cold_rounds: int) -> None:
    modes = {
        "global permutation": {"shuffle": True},
        "chunks 2048 x 64 (default)": {"shuffle": "chunks"},
        "chunks 2048 x 8": {"shuffle": "chunks", "buffer_chunks": 8},
        "sequential": {"shuffle": False},
    }
    rows_out = []
    for name, kw in modes.items():
        d = CaptureDataset(out, "h", batch_size=BATCH, seed=0, with_index=True, **kw)
        plan = list(d._plan())
        q = shuffle_quality(plan[:64], rows, group_rows=128)
        warm(files)
        d._sources()
        ts = []
        for r in range(min(rounds, len(plan))):
            t0 = time.perf_counter()
            d.batch(plan[r])
            ts.append(time.perf_counter() - t0)
        del d
        gc.collect()
        cts = []
        for r in range(cold_rounds):
            gc.collect()
            drop_cache(files)
            d = CaptureDataset(out, "h", batch_size=BATCH, seed=0, **kw)
            d._sources()
            t0 = time.perf_counter()
            d.batch(plan[r])
            cts.append(time.perf_counter() - t0)
            del d
            gc.collect()
        rows_out.append(
            [
                name,
                f"{q['neighbour_corr']:.3f}",
                f"{q['distinct_groups']:.2f}",
                f"{BATCH / med(ts) / 1e6:.2f}",
                f"{BATCH / med(cts) / 1e6:.3f}",
            ]
        )
    print(
        f"\n(e) shuffle modes, batches of {BATCH} rows, load {load():.1f}: quality (first 64 "
        "batches; groups = 128 consecutive rows) and speed (medians)"
    )
    print(
        table(
            rows_out,
            [
                "mode",
                "neighbour corr",
                "distinct groups vs uniform",
                "M rows/s warm",
                "M rows/s cold",
            ],
        )
    )


# -- (g) a shuffled batch read right after a training step ----------------------------------------
def case_after_step(
    out: str, raw_path: str, files: list[str], rows: int, idxs: list[torch.Tensor], rounds: int
) -> None:
    """What an in-process training loop does: a step, then the next batch. The step (a 768 ->
    256 -> 768 ReLU autoencoder on 4096 rows, forward, backward, Adam, on torch's threads)
    leaves torch's OpenMP workers spinning for milliseconds on the other core, which is where
    a reader's second thread has to run. Each round times every reader right after a step, in
    a shuffled order; batches of 4096 rows, then of 1024 (where a call's fixed costs weigh
    four times as much)."""
    warm(files)
    mm, arr, mt = raw_views(raw_path, rows)
    ds = CaptureDataset(out, "h", batch_size=BATCH, seed=0)
    float(mm.sum()), [float(p.sum()) for p in ds._sources()["h"]]  # every page mapped once
    g = torch.Generator().manual_seed(0)
    enc, dec = torch.nn.Linear(D, 256), torch.nn.Linear(256, D)
    opt = torch.optim.Adam([*enc.parameters(), *dec.parameters()], lr=1e-4)
    x = torch.randn(BATCH, D, generator=g)

    def step() -> None:
        loss = (dec(torch.relu(enc(x))) - x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    hand = [
        "torch.index_select into preallocated",
        "np.take into preallocated",
        "sorted np.take into preallocated",
    ]
    for _ in range(3):
        step()
    for n in (BATCH, BATCH // 4):
        after_step_rows(ds, mt, arr, [i[:n] for i in idxs], hand, step, rounds)


def after_step_rows(
    ds: CaptureDataset,
    mt: torch.Tensor,
    arr: np.ndarray,
    ix: list[torch.Tensor],
    hand: list[str],
    step: Callable[[], None],
    rounds: int,
) -> None:
    """Case (g) for batches of ``len(ix[0])`` rows."""
    n = len(ix[0])
    np_idx = [i.numpy() for i in ix]
    buf = aligned_empty((n, D))
    tbuf = torch.from_numpy(buf)
    fns: dict[str, Callable[[int], object]] = {
        hand[0]: lambda r: torch.index_select(mt, 0, ix[r], out=tbuf),
        hand[1]: lambda r: np.take(arr, np_idx[r], axis=0, out=buf, mode="clip"),
        hand[2]: lambda r: np.take(arr, np.sort(np_idx[r]), axis=0, out=buf, mode="clip"),
        "pyhook CaptureDataset.batch": lambda r: ds.batch(ix[r]),
        "pyhook CaptureDataset.batch, 1 thread": one_thread(lambda r: ds.batch(ix[r])),
    }
    ts = paired(fns, rounds, None, before=step)[SINGLE_STATE]
    best = best_of(ts, hand)
    print(
        f"\n(g) shuffled batches of {n} rows read right after a training step (page cache "
        f"warm, {SINGLE_STATE}, load {med(ts['__load__']):.1f}); medians of {rounds} paired "
        f"rounds; best hand-written: {best}"
    )
    print(report(ts, best, n * ROW, n))
    verdict(
        "(g) warm shuffled after a training step" + ("" if n == BATCH else f", {n}-row batches"),
        SINGLE_STATE,
        ts,
        "pyhook CaptureDataset.batch",
        best,
        1.0,
    )


# -- (f) several layers in one batch ---------------------------------------------------------------
def case_layers(root: str, rounds: int, spinner: Spinner | None, quick: bool) -> None:
    """A batch of 12 layers (+ token ids), as an SAE sweep over every block reads it: the
    dataset's one native call for all of them against one call per layer (the path before,
    each call through the same direct kernel entry), and a hand-written sorted ``np.take`` per
    layer into preallocated buffers. Small and large batches: the fixed cost of a call shows
    in the small ones."""
    layers, rows = 12, 8192 if quick else 16384
    out = os.path.join(root, "layers")
    g = torch.Generator().manual_seed(2)
    with ShardWriter(out, shard_bytes=64 << 20) as w:
        for s in range(0, rows, 2048):
            xs = {f"h.{i}": torch.randn(2048, D, generator=g) for i in range(layers)}
            w.add({**xs, "__token_ids__": torch.arange(s, s + 2048)}, examples=2048)
    files = sorted(glob.glob(os.path.join(out, "*.safetensors")))
    warm(files)
    names = [f"h.{i}" for i in range(layers)]
    ds = CaptureDataset(out, names, batch_size=BATCH, tokens=True)
    src = ds._sources()
    for parts in src.values():
        sum(float(p.double().sum()) for p in parts)  # map every page once
    arrays = [torch.cat(src[n]).numpy() for n in names]  # anonymous copies for numpy
    for size in (256, 2048):
        rng = torch.Generator().manual_seed(size)
        idxs = [torch.randperm(rows, generator=rng)[:size] for _ in range(rounds)]
        bufs = [aligned_empty((size, D)) for _ in names]
        want = ds.batch(idxs[0])
        per_layer = {n: _backend._gather_direct(parts, idxs[0]) for n, parts in src.items()}
        assert all(torch.equal(want[_k], per_layer[n]) for n, _k in zip(src, [*names, "tokens"]))

        def numpy_take(r: int, idxs: list[torch.Tensor] = idxs, bufs: list = bufs) -> None:
            s = np.sort(idxs[r].numpy())
            for a, b in zip(arrays, bufs):
                np.take(a, s, axis=0, out=b, mode="clip")

        def per_layer(r: int, idxs: list[torch.Tensor] = idxs) -> object:
            return [_backend._gather_direct(parts, idxs[r]) for parts in src.values()]

        def one_call(r: int, idxs: list[torch.Tensor] = idxs) -> object:
            return ds.batch(idxs[r])

        fns: dict[str, Callable[[int], object]] = {
            "sorted np.take per layer into preallocated (anonymous memory)": numpy_take,
            "one gather_rows call per layer (before)": per_layer,
            "pyhook CaptureDataset.batch (one call)": one_call,
        }
        t = paired(fns, rounds, spinner)
        for state, ts in t.items():
            print(
                f"\n(f) batches of {size} rows x {layers} layers of {D} float32 + token ids, "
                f"warm, {state} (load {med(ts['__load__']):.1f}); medians of {rounds} paired rounds"
            )
            base = "one gather_rows call per layer (before)"
            print(report(ts, base, size * layers * ROW, size))
            verdict(
                f"(f) {size}-row batch of {layers} layers vs a call per layer",
                state,
                ts,
                "pyhook CaptureDataset.batch (one call)",
                base,
                1.0,
            )
    gc.collect()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller capture, fewer rounds (~2 min)")
    p.add_argument(
        "--busy",
        choices=("both", "off", "on"),
        default="both",
        help="measure cases (a)-(c) without and with a spinning process on the other core "
        "(both, the default), without only (off), or with it only (on)",
    )
    p.add_argument("--pin", action="store_true", help="pin the spinning process to the last core")
    p.add_argument("--only", default="abcdefg", help="the cases to run, e.g. 'ab'")
    p.add_argument("--dir", default=None, help="where to write the capture (default: a temp dir)")
    args = p.parse_args()
    if not _backend.native_available():
        raise SystemExit(f"the native core is not built: {_backend.native_load_error()}")

    if args.quick:
        rows, rounds, cold_rounds, loader_batches, d_rounds, n_seq = 120_000, 9, 3, 16, 3, 16
    else:
        rows, rounds, cold_rounds, loader_batches, d_rounds, n_seq = 500_000, 21, 7, 64, 5, 32
    nbytes = rows * ROW
    print(
        f"machine: {platform.platform()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"pyhook {pyhook.__version__}, intra-op threads {torch.get_num_threads()}, "
        f"load average at start {load():.1f}"
    )
    print(f"capture: {rows} rows x {D} float32 = {nbytes / 1e9:.2f} GB, shards of 128 MB")

    root = tempfile.mkdtemp(prefix="pyhook-bench-read-", dir=args.dir)
    spinner = None
    try:
        out = os.path.join(root, "cap")
        raw_path = os.path.join(root, "raw.f32")
        g = torch.Generator().manual_seed(0)
        with ShardWriter(out, shard_bytes=128 << 20) as w, open(raw_path, "wb") as raw:
            step = 16_384
            for s in range(0, rows, step):
                x = torch.randn(min(step, rows - s), D, generator=g)
                w.add({"h": x}, examples=len(x))
                raw.write(x.numpy().tobytes())
        files = [*sorted(glob.glob(os.path.join(out, "*.safetensors"))), raw_path]
        print(f"shards: {len(files) - 1}; raw file of the same rows: {raw_path}")
        rng = torch.Generator().manual_seed(1)
        idxs = [
            torch.randperm(rows, generator=rng)[:BATCH] for _ in range(max(rounds, cold_rounds))
        ]
        if args.busy != "off":
            spinner = Spinner(args.pin)
            if args.busy == "on":
                spinner.set(True)
                global SINGLE_STATE
                SINGLE_STATE = STATES[1]
        sp = spinner if args.busy == "both" else None
        print(
            "other core: "
            + {
                "both": "rounds without and with a spinner, paired",
                "off": "no spinner",
                "on": "a spinner throughout",
            }[args.busy]
            + (" (spinner pinned)" if args.pin else "")
        )
        if "a" in args.only:
            case_warm_shuffled(out, raw_path, files, rows, idxs, rounds, sp)
            gc.collect()  # unmap: mapped pages cannot leave the page cache
        if "b" in args.only:
            case_cold_shuffled(out, raw_path, files, rows, idxs, cold_rounds, sp)
        if "c" in args.only:
            case_sequential(out, raw_path, files, rows, cold_rounds, n_seq, sp)
        if sp is not None:
            sp.set(False)  # (d) without the spinner (its two workers use both cores)
        if "d" in args.only:
            case_loader(out, files, loader_batches, d_rounds, not args.quick)
        if "f" in args.only:
            case_layers(root, rounds, sp, args.quick)
            if sp is not None:
                sp.set(False)
        if "g" in args.only:
            case_after_step(out, raw_path, files, rows, idxs, rounds)
            gc.collect()
        if "e" in args.only and not args.quick:
            case_modes(out, files, rows, rounds, cold_rounds)
        print(
            f"\nSummary (pyhook vs the named reader, paired medians; load average at end {load():.1f})"
        )
        print(
            table(
                SUMMARY,
                [
                    "case",
                    "other core",
                    "load",
                    "against",
                    "pyhook ms",
                    "its ms",
                    "speed",
                    "CPU time ratio",
                    "target (speed)",
                    "",
                ],
            )
        )
    finally:
        if spinner is not None:
            spinner.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
