"""Reading a capture for training: shuffled and sequential batches, warm and cold, DataLoader.

Run:  python benchmarks/bench_read.py [--quick] [--dir DIR]

One run writes a capture larger than the native buffer pool (float32 rows of 768 values, the
GPT-2-small residual width) and the same rows as one raw file, then prints tables of paired
rounds (each round times every method on the same batch indices, in a shuffled order; medians
of the per-round ratios):

(a) shuffled batches of 4096 rows, page cache warm: ``numpy.memmap`` fancy indexing of the raw
    file (the baseline), ``LayerData[idx]`` as the reader does it today, the native
    ``gather_rows`` and ``CaptureDataset.batch`` (target: >= 1.0x the baseline);
(b) the same after dropping the files from the page cache (``posix_fadvise(DONTNEED)``, maps
    closed) before every round: the first batch read from disk;
(c) sequential batches against ``readinto`` of the raw file, warm and cold (target: >= 0.9x);
    (before every timed call, 96 MB are overwritten so that no method reads rows the previous
    one left in the CPU caches);
(d) a ``DataLoader(ds, batch_size=None, num_workers=k)`` over shuffled batches, warm: 2
    workers sending batches through their reused shared-memory slots (the default), 2 workers
    through torch's fresh shared memory (``worker_slots=0``, the path before the slots), and 0
    workers (the dataset iterated in the main process); time from the first batch to the
    last (worker start-up excluded; the first batch's time is printed). Two consumers side by side, paired in the same rounds:
    one that does nothing with the batch (the feed rate), and one that runs a training step
    on every batch (a 768 -> 64 -> 768 ReLU autoencoder, forward, backward and Adam, on as
    many of the batch's rows as make a step about as long as loading a batch in-process):
    in-process loads then trains, workers load while the main process trains;
(e) shuffle quality and speed of the modes: global permutation, chunk windows, sequential.

Rows/s and GB/s are for the rows delivered (4096 x 768 x 4 bytes = 12.6 MB a batch).
"""

from __future__ import annotations

import argparse
import gc
import glob
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch
from torch.utils.data import DataLoader

import pyhook
from pyhook import _backend
from pyhook.dataset import CaptureDataset, shuffle_quality
from pyhook.store import ShardWriter, open_capture

D = 768
BATCH = 4096
med = statistics.median


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join(
        [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
        + [line(r) for r in rows]
    )


def drop_cache(paths: list[str]) -> None:
    """Evict the files from the page cache (pages still mapped by this process stay: callers
    close their maps first)."""
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


def evict_cpu_caches() -> None:
    """Overwrite 96 MB (3x this machine's L3): a method must not read rows that the previous
    method of the round left in the CPU caches (a 12.6 MB batch fits in a 32 MB L3)."""
    global _EVICT
    if _EVICT.size == 0:
        _EVICT = np.zeros(96 << 20, dtype=np.uint8)
    _EVICT += 1


def paired(
    fns: dict[str, Callable[[int], object]], rounds: int, seed: int = 0
) -> dict[str, list[float]]:
    """Seconds per method and round; every method sees round r (same indices), in a shuffled
    order, after the CPU caches were flushed of the previous method's rows. A method may return
    its own measured time as a float (when setup must not count)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns)
    rng = random.Random(seed)
    for r in range(rounds):
        rng.shuffle(order)
        for name in order:
            evict_cpu_caches()
            t0 = time.perf_counter()
            own = fns[name](r)
            times[name].append(own if isinstance(own, float) else time.perf_counter() - t0)
    return times


def report(times: dict[str, list[float]], base: str, rows: int, target: str = "") -> str:
    out = []
    nbytes = rows * D * 4
    for name, ts in times.items():
        ratio = med(b / t for b, t in zip(times[base], ts))
        t = med(ts)
        out.append(
            [
                name,
                f"{1e3 * t:.2f}",
                f"{rows / t / 1e6:.2f}",
                f"{nbytes / t / 1e9:.2f}",
                f"{ratio:.2f}",
            ]
        )
    return table(out, ["method", "ms", "M rows/s", "GB/s", f"speed vs {base} (paired)"]) + target


def sae_step(out: str) -> tuple[Callable[[torch.Tensor], None], int, float, float]:
    """A training step on a batch: a 768 -> 64 -> 768 ReLU autoencoder on the batch's first
    ``n`` rows, MSE loss, backward, Adam, on one intra-op thread. On this CPU a step on a whole
    4096-row batch takes 10x-20x the load (even 768 -> 8 -> 768: the elementwise passes over
    12.6 MB), so ``n`` is the number of rows whose step time is the closest to loading one batch
    in-process. One thread: on the shared 2-core VM, two OpenMP threads made a 64-row step take
    ~220 ms instead of ~1 ms (each parallel region waits for a thread that has no core).
    Returns (step, n, step seconds, load seconds)."""
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
            torch.set_num_threads(1)  # see the docstring; the gather keeps its threads
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


def warm_sections(
    out: str, raw_path: str, files: list[str], rows: int, idxs: list[torch.Tensor], rounds: int
) -> None:
    # (a) shuffled, warm
    warm(files)
    mm = np.memmap(raw_path, dtype=np.float32, mode="r", shape=(rows, D))
    reader = open_capture(out)
    layer = reader.layer("h")
    ds = CaptureDataset(reader, "h", batch_size=BATCH, seed=0)
    parts = ds._sources()["h"]
    mm[:].sum(), layer[:].sum()  # map every page in this process once
    for r in range(2):
        assert np.array_equal(mm[idxs[r].numpy()], ds.batch(idxs[r])["h"].numpy())
    t = paired(
        {
            "numpy memmap fancy index": lambda r: mm[idxs[r].numpy()],
            "LayerData[idx] (reader today)": lambda r: layer[idxs[r]],
            "gather_rows (native)": lambda r: _backend.gather_rows(parts, idxs[r]),
            "CaptureDataset.batch": lambda r: ds.batch(idxs[r]),
        },
        rounds,
    )
    print(
        f"\n(a) shuffled batches of {BATCH} rows, page cache warm; medians of {rounds} paired rounds"
    )
    print(
        report(
            t,
            "numpy memmap fancy index",
            BATCH,
            f"\ntarget: CaptureDataset >= 1.0x numpy: "
            f"{med(a / b for a, b in zip(t['numpy memmap fancy index'], t['CaptureDataset.batch'])):.2f}x",
        )
    )

    # (c) sequential, warm: readinto of the raw file vs sequential dataset batches
    seq = CaptureDataset(reader, "h", batch_size=BATCH, shuffle=False)
    buf = np.empty((BATCH, D), dtype=np.float32)
    nb = rows // BATCH

    def raw_seq(r: int) -> None:
        with open(raw_path, "rb", buffering=0) as f:
            f.seek((r % nb) * BATCH * D * 4)
            f.readinto(memoryview(buf).cast("B"))

    t = paired(
        {
            "raw file readinto": raw_seq,
            "CaptureDataset (shuffle=False)": lambda r: seq.batch(
                torch.arange((r % nb) * BATCH, (r % nb + 1) * BATCH)
            ),
        },
        rounds * 2,
    )
    print(
        f"\n(c1) sequential batches of {BATCH} rows, page cache warm; medians of {rounds * 2} paired rounds"
    )
    print(
        report(
            t,
            "raw file readinto",
            BATCH,
            f"\ntarget: >= 0.9x raw: {med(a / b for a, b in zip(t['raw file readinto'], t['CaptureDataset (shuffle=False)'])):.2f}x",
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick", action="store_true", help="smaller capture and fewer rounds (< 2 min)"
    )
    p.add_argument("--dir", default=None, help="where to write the capture (default: a temp dir)")
    args = p.parse_args()
    if not _backend.native_available():
        raise SystemExit(f"the native core is not built: {_backend.native_load_error()}")

    if args.quick:
        # A smaller pool keeps "capture larger than the pool" true at a quick size.
        pool = 128 << 20
        _backend.set_pool_limit(pool)
        rows, rounds, cold_rounds, loader_batches = 80_000, 15, 3, 18
    else:
        pool = _backend.pool_stats()["limit_bytes"]
        rows, rounds, cold_rounds, loader_batches = 460_000, 15, 5, 64
    nbytes = rows * D * 4
    print(
        f"machine: {platform.platform()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"pyhook {pyhook.__version__}, intra-op threads {torch.get_num_threads()}, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"capture: {rows} rows x {D} float32 = {nbytes / 1e9:.2f} GB (pool limit {pool / 1e9:.2f} GB)"
    )

    root = tempfile.mkdtemp(prefix="pyhook-bench-read-", dir=args.dir)
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

        warm_sections(out, raw_path, files, rows, idxs, rounds)
        gc.collect()

        # (b) shuffled, cold: first batch after dropping the files from the page cache
        def cold_numpy(r: int) -> float:
            gc.collect()
            drop_cache(files)
            m = np.memmap(raw_path, dtype=np.float32, mode="r", shape=(rows, D))
            t0 = time.perf_counter()
            m[idxs[r].numpy()]
            dt = time.perf_counter() - t0
            del m
            return dt

        def cold_dataset(r: int, **kw) -> float:
            gc.collect()
            drop_cache(files)
            d = CaptureDataset(out, "h", batch_size=BATCH, **kw)
            d._sources()
            t0 = time.perf_counter()
            d.batch(idxs[r])
            dt = time.perf_counter() - t0
            del d
            gc.collect()
            return dt

        t = paired(
            {"numpy memmap fancy index": cold_numpy, "CaptureDataset.batch": cold_dataset},
            cold_rounds,
        )
        print(
            f"\n(b) shuffled batches of {BATCH} rows, files dropped from the page cache before each; medians of {cold_rounds} paired rounds"
        )
        print(
            report(
                t,
                "numpy memmap fancy index",
                BATCH,
                f"\ntarget: >= 1.0x numpy: {med(a / b for a, b in zip(t['numpy memmap fancy index'], t['CaptureDataset.batch'])):.2f}x",
            )
        )

        # (c2) sequential, cold: the first n batches after a drop
        nb = rows // BATCH
        n_seq = min(nb, 16 if args.quick else 32)
        buf = np.empty((BATCH, D), dtype=np.float32)

        def cold_raw_seq(r: int) -> float:
            drop_cache(files)
            t0 = time.perf_counter()
            with open(raw_path, "rb", buffering=0) as f:
                for _ in range(n_seq):
                    f.readinto(memoryview(buf).cast("B"))
            return time.perf_counter() - t0

        def cold_ds_seq(r: int) -> float:
            gc.collect()
            drop_cache(files)
            d = CaptureDataset(out, "h", batch_size=BATCH, shuffle=False)
            it = iter(d)
            t0 = time.perf_counter()
            for _ in range(n_seq):
                next(it)
            dt = time.perf_counter() - t0
            del it, d
            gc.collect()
            return dt

        t = paired(
            {"raw file readinto": cold_raw_seq, "CaptureDataset (shuffle=False)": cold_ds_seq},
            cold_rounds,
        )
        print(
            f"\n(c2) {n_seq} sequential batches of {BATCH} rows from a dropped page cache; medians of {cold_rounds} paired rounds"
        )
        print(
            report(
                t,
                "raw file readinto",
                BATCH * n_seq,
                f"\ntarget: >= 0.9x raw: {med(a / b for a, b in zip(t['raw file readinto'], t['CaptureDataset (shuffle=False)'])):.2f}x",
            )
        )

        # (d) DataLoader, warm
        warm(files)
        step, width, t_step, t_load = sae_step(out)

        def loader(workers: int, slots: int, train: bool) -> Callable[[int], float]:
            def run(r: int) -> float:
                d = CaptureDataset(out, "h", batch_size=BATCH, seed=r, worker_slots=slots)
                t_start = time.perf_counter()
                it = iter(DataLoader(d, batch_size=None, num_workers=workers))
                next(it)  # worker start-up excluded
                t0 = time.perf_counter()
                startups.setdefault((workers, slots), []).append(t0 - t_start)
                for _ in range(loader_batches - 1):
                    batch = next(it)
                    if train:
                        step(batch["h"])
                    del batch
                steady = time.perf_counter() - t0
                del it
                return steady

            return run

        startups: dict[tuple[int, int], list[float]] = {}
        methods = {
            "in-process (num_workers=0)": (0, 8),
            "DataLoader num_workers=2 (reused slots)": (2, 8),
            "DataLoader num_workers=2, worker_slots=0 (fresh shared memory)": (2, 0),
        }
        fns = {}
        for name, (workers, slots) in methods.items():
            fns[(name, False)] = loader(workers, slots, False)
            fns[(name, True)] = loader(workers, slots, True)
        d_rounds = max(3, rounds // 3)
        t = paired(fns, d_rounds)  # type: ignore[arg-type]
        n_rows = BATCH * (loader_batches - 1)
        base = "in-process (num_workers=0)"
        cells = []
        for name in methods:
            row = [name]
            for train in (False, True):
                ts = t[(name, train)]
                tm = med(ts)
                ratio = med(b / x for b, x in zip(t[(base, train)], ts))
                row += [
                    f"{1e3 * tm / (loader_batches - 1):.2f}",
                    f"{n_rows / tm / 1e6:.2f}",
                    f"{n_rows * D * 4 / tm / 1e9:.2f}",
                    f"{ratio:.2f}",
                ]
            cells.append(row)
        print(
            f"\n(d) DataLoader over {loader_batches} shuffled batches of {BATCH} rows (warm), time "
            f"after the first batch; medians of {d_rounds} paired rounds. Training step: "
            f"autoencoder 768 -> 64 -> 768 on {width} rows of each batch, {1e3 * t_step:.1f} ms a step alone "
            f"(in-process load {1e3 * t_load:.1f} ms a batch); first batch, start-up included: "
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
                    "M rows/s",
                    "GB/s",
                    "vs in-process",
                    "feed+train: ms/batch",
                    "M rows/s",
                    "GB/s",
                    "vs in-process",
                ],
            )
        )
        ring = "DataLoader num_workers=2 (reused slots)"
        print(
            "target: 2 workers faster than one process: feed "
            + f"{med(a / b for a, b in zip(t[(base, False)], t[(ring, False)])):.2f}x, "
            + f"feeding a training step {med(a / b for a, b in zip(t[(base, True)], t[(ring, True)])):.2f}x"
        )

        # (e) shuffle modes: quality and speed (warm and cold)
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
            f"\n(e) shuffle modes, batches of {BATCH} rows: quality (first 64 batches; groups = 128 consecutive rows) and speed (medians)"
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
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
