"""Cost of verified stores: checksum speed, writer vs dd, forward loop, reads that copy, verify.

Prints tables of ratios measured in one run (paired rounds, medians):

(a) checksum throughput on one core (64 MB in memory): crc32c (the one pyhook uses), zlib.crc32
    (its fallback), xxhash.xxh3_64 and blake2b when installed;
(b) ShardWriter throughput with the checksum on and off (same data, paired) against
    ``dd bs=1M conv=fsync`` in the same directory (target: >= 70% of dd);
(c) a forward loop capturing to disk with the checksum on and off, against the forward alone
    (target: <= 1.1x);
(d) reads: ``CaptureReader.batches`` returning copies (what the reader does) against handing
    out views of the memory map (what it did before issue 12);
(e) opening a capture (cheap checks: one stat and one header read per shard), resuming it
    (checks every shard's checksum), and ``verify_capture``, per GB;
(f) the writer's host-memory bound (issue 19 item 5): wall time of adding every batch and
    closing, and the most bytes the writer held, with the default ``max_buffer_bytes`` (256 MiB)
    against an unbounded writer (256 MB shards, two waiting: what capture() did before);
(g) the cost of adding a shard as the shard count grows (one batch per shard, 2,000 shards,
    fsync off so that the disk's noise does not hide the bookkeeping): ms per batch over the
    first and the last 200 shards (the index is no longer rewritten for every shard);
(h) the size check each read makes (the SIGBUS guard): one ``mmap.size()`` per shard touched.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
import zlib
from collections.abc import Callable

import torch

from pyhook.capture import capture
from pyhook.store import ShardWriter, open_capture, verify_capture
from pyhook.store import format as store_format

med = statistics.median


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join(
        [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
        + [line(r) for r in rows]
    )


def best(fn: Callable[[], object], n: int = 5) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


def dd_speed(directory: str, mb: int) -> float:
    path = os.path.join(directory, "dd-test")
    t = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mb}", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    dt = time.perf_counter() - t
    os.remove(path)
    return mb * (1 << 20) / dt / 1e6


class no_checksum:
    """Within the block the writer computes no checksum (the cost before issue 12)."""

    def __enter__(self) -> None:
        store_format._CHECKSUM_FUNCS["none"] = lambda data, value=0: 0
        self.saved, store_format.CHECKSUM = store_format.CHECKSUM, "none"

    def __exit__(self, *exc: object) -> None:
        store_format.CHECKSUM = self.saved


def bench_checksums(mb: int) -> None:
    buf = memoryview(os.urandom(mb << 20))
    fns: dict[str, Callable[[], object]] = {}
    try:
        import crc32c

        fns["crc32c (crc32c package, used)"] = lambda: crc32c.crc32c(buf)
    except ImportError:
        pass
    fns["zlib.crc32 (fallback)"] = lambda: zlib.crc32(buf)
    try:
        import xxhash

        fns["xxhash.xxh3_64"] = lambda: xxhash.xxh3_64_intdigest(buf)
    except ImportError:
        pass
    fns["hashlib.blake2b"] = lambda: hashlib.blake2b(buf).digest()
    rows = [[name, f"{len(buf) / best(fn) / 1e9:.2f}"] for name, fn in fns.items()]
    print(f"\n(a) checksum throughput, {mb} MB in memory, one core (best of 5)")
    print(table(rows, ["checksum", "GB/s"]))


def bench_writer(base: str, mb: int, rounds: int) -> None:
    rows_per = 4096
    n = max(1, (mb << 20) // (rows_per * 256 * 4))
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(rows_per, 256, generator=g) for _ in range(n)]
    out = os.path.join(base, "w")

    def write() -> float:
        shutil.rmtree(out, ignore_errors=True)
        with ShardWriter(out, shard_bytes=64 << 20) as w:
            for b in batches:
                w.add({"x": b}, examples=len(b))
        rate = w.bytes_written / w.write_seconds / 1e6
        shutil.rmtree(out, ignore_errors=True)
        return rate

    on, off, dd = [], [], []
    write()  # warm-up
    for r in range(rounds):
        order = ("on", "off") if r % 2 == 0 else ("off", "on")
        for what in order:
            if what == "on":
                on.append(write())
            else:
                with no_checksum():
                    off.append(write())
        dd.append(dd_speed(base, mb))
    print(
        f"\n(b) ShardWriter, {n * rows_per * 256 * 4 / 1e6:.0f} MB in 64 MB shards, fsync on; "
        f"medians of {rounds} paired rounds"
    )
    print(
        table(
            [
                ["dd bs=1M conv=fsync", f"{med(dd):.0f}", "1.00"],
                [
                    "writer, no checksum (before)",
                    f"{med(off):.0f}",
                    f"{med(o / d for o, d in zip(off, dd)):.2f}",
                ],
                [
                    "writer, crc32c (now)",
                    f"{med(on):.0f}",
                    f"{med(o / d for o, d in zip(on, dd)):.2f}",
                ],
            ],
            ["what", "MB/s while writing", "vs dd (paired)"],
        )
    )
    ratio = med(o / d for o, d in zip(on, dd))
    print(
        f"target: writer >= 70% of dd: {'met' if ratio >= 0.7 else 'NOT met'} ({ratio * 100:.0f}%)"
    )


def bench_bounded(base: str, mb: int, rounds: int) -> None:
    rows_per = 4096
    n = max(1, (mb << 20) // (rows_per * 256 * 4))
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(rows_per, 256, generator=g) for _ in range(n)]
    out = os.path.join(base, "bounded")

    def write(limit: int) -> tuple[float, int]:
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        with ShardWriter(out, shard_bytes=256 << 20, max_buffer_bytes=limit) as w:
            for b in batches:
                w.add({"x": b}, examples=len(b))
        dt = time.perf_counter() - t0
        shutil.rmtree(out, ignore_errors=True)
        return w.bytes_written / dt / 1e6, w.peak_buffer_bytes

    bounded, unbounded, peaks = [], [], {"bounded": 0, "unbounded": 0}
    write(256 << 20)  # warm-up
    for r in range(rounds):
        for what in ("bounded", "unbounded") if r % 2 == 0 else ("unbounded", "bounded"):
            rate, peak = write(256 << 20 if what == "bounded" else 1 << 40)
            (bounded if what == "bounded" else unbounded).append(rate)
            peaks[what] = max(peaks[what], peak)
    print(
        f"\n(f) ShardWriter end to end (add every batch + close), {n * rows_per * 256 * 4 / 1e6:.0f} MB, "
        f"shard_bytes=256 MB, fsync on; medians of {rounds} paired rounds"
    )
    print(
        table(
            [
                [
                    "unbounded (before)",
                    f"{med(unbounded):.0f}",
                    "1.00",
                    f"{peaks['unbounded'] / 2**20:.0f}",
                ],
                [
                    "max_buffer_bytes=256 MiB (now)",
                    f"{med(bounded):.0f}",
                    f"{med(b / u for b, u in zip(bounded, unbounded)):.2f}",
                    f"{peaks['bounded'] / 2**20:.0f}",
                ],
            ],
            ["writer", "MB/s wall", "vs before (paired)", "peak MiB held"],
        )
    )


def bench_many_shards(base: str, shards: int = 2000) -> None:
    out = os.path.join(base, "many")
    shutil.rmtree(out, ignore_errors=True)
    x = torch.randn(16, 64)
    times = []
    with ShardWriter(out, shard_bytes=1, fsync=False) as w:
        for _ in range(shards):
            t0 = time.perf_counter()
            w.add({"x": x}, examples=16)
            w.wait()
            times.append(time.perf_counter() - t0)
    shutil.rmtree(out, ignore_errors=True)
    first, last = med(times[:200]) * 1e3, med(times[-200:]) * 1e3
    print(f"\n(g) adding a shard (one 4 KB batch each, fsync off), {shards} shards")
    print(
        table(
            [
                ["shards 1-200", f"{first:.2f}"],
                [f"shards {shards - 199}-{shards}", f"{last:.2f}"],
                ["ratio last/first", f"{last / first:.2f}"],
            ],
            ["when", "ms per batch (median)"],
        )
    )


def bench_size_check(base: str) -> None:
    out = os.path.join(base, "sizecheck")
    shutil.rmtree(out, ignore_errors=True)
    with ShardWriter(out, shard_bytes=1) as w:
        for _ in range(64):
            w.add({"x": torch.randn(256, 256)}, examples=256)
    r = open_capture(out)
    h = r["x"]
    h[0]
    shard = r._shards[0]
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        shard.check()
    per_check = (time.perf_counter() - t0) / n * 1e6
    idx = torch.randperm(len(h), generator=torch.Generator().manual_seed(0))[:4096]
    h[idx]
    reps = 20
    t0 = time.perf_counter()
    for _ in range(reps):
        h[idx]
    per_batch = (time.perf_counter() - t0) / reps * 1e3
    print("\n(h) the size check of each read (SIGBUS guard)")
    print(
        table(
            [
                ["one check (mmap.size(): one fstat)", f"{per_check:.2f} us"],
                [
                    "shuffled batch of 4096 rows x 256 f32 over 64 shards",
                    f"{per_batch:.2f} ms (of which checks {64 * per_check / 1e3:.3f} ms)",
                ],
            ],
            ["what", "time"],
        )
    )
    shutil.rmtree(out, ignore_errors=True)


def bench_loop(base: str, rounds: int) -> None:
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=4,
        n_embd=256,
        n_head=4,
        vocab_size=1000,
        n_positions=128,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2Model(cfg).eval()
    data = [torch.randint(0, 1000, (8, 128)) for _ in range(6)]
    layers = ["h.*", "h.*.attn", "h.*.mlp", "h.*.ln_1", "h.*.ln_2"]
    out = os.path.join(base, "loop")

    def fwd() -> float:
        t = time.perf_counter()
        for ids in data:
            model(ids)
        return time.perf_counter() - t

    def cap() -> float:
        shutil.rmtree(out, ignore_errors=True)
        t = time.perf_counter()
        with capture(model, layers, out=out, shard_bytes=32 << 20):
            for ids in data:
                model(ids)
            dt = time.perf_counter() - t
        shutil.rmtree(out, ignore_errors=True)
        return dt

    f, on, off = [], [], []
    with torch.no_grad():
        fwd()
        cap()
        for r in range(rounds):
            steps = ["f", "on", "off"]
            steps = steps[r % 3 :] + steps[: r % 3]
            for s in steps:
                if s == "f":
                    f.append(fwd())
                elif s == "on":
                    on.append(cap())
                else:
                    with no_checksum():
                        off.append(cap())
    print(
        f"\n(c) forward loop (GPT-2 4 x 256, 6 batches of 8 x 128 tokens, 20 module outputs) "
        f"capturing to disk; medians of {rounds} paired rounds"
    )
    print(
        table(
            [
                ["forward alone", f"{med(f) * 1e3:.0f}", "1.00"],
                [
                    "with disk capture, no checksum (before)",
                    f"{med(off) * 1e3:.0f}",
                    f"{med(a / b for a, b in zip(off, f)):.2f}",
                ],
                [
                    "with disk capture, crc32c (now)",
                    f"{med(on) * 1e3:.0f}",
                    f"{med(a / b for a, b in zip(on, f)):.2f}",
                ],
            ],
            ["loop (until the last forward returned)", "ms", "vs forward (paired)"],
        )
    )


def bench_reads(base: str, mb: int, rounds: int) -> tuple[str, float]:
    out = os.path.join(base, "read")
    shutil.rmtree(out, ignore_errors=True)
    g = torch.Generator().manual_seed(0)
    rows = (mb << 20) // (512 * 4)
    with ShardWriter(out, shard_bytes=64 << 20) as w:
        for i in range(0, rows, 4096):
            w.add({"x": torch.randn(min(4096, rows - i), 512, generator=g)}, examples=4096)
    r = open_capture(out)
    x = r["x"]

    def copies() -> None:
        for b in r.batches(1024):
            b["x"].sum()

    def views() -> None:  # the old reader: slices of the memory map, no copy
        for i in range(0, len(x), 1024):
            lo = i
            for j, p in enumerate(x._parts):
                s, e = x._starts[j], x._starts[j + 1]
                if s <= lo < e:
                    p[lo - s : min(lo + 1024, e) - s].sum()
                    break

    a, b = [], []
    copies(), views()
    for _ in range(rounds):
        a.append(best(copies, 1))
        b.append(best(views, 1))
    print(
        f"\n(d) reading {mb} MB (page cache warm) in batches of 1024 rows x 512 float32; medians of {rounds} rounds"
    )
    print(
        table(
            [
                ["views of the memory map (before)", f"{mb * 1.048576 / med(b):.0f}", "1.00"],
                [
                    "copies the caller owns (now)",
                    f"{mb * 1.048576 / med(a):.0f}",
                    f"{med(a) / med(b):.2f}",
                ],
            ],
            ["batches() then .sum()", "MB/s", "time vs views"],
        )
    )
    return out, r.index["bytes"]


def bench_open(out: str, nbytes: float, rounds: int) -> None:
    t_open = med(best(lambda: open_capture(out), 1) for _ in range(rounds))
    t_verify = med(best(lambda: verify_capture(out), 1) for _ in range(rounds))

    def resume() -> None:
        ShardWriter(out).abort()

    t_resume = med(best(resume, 1) for _ in range(rounds))
    shards = len(open_capture(out).index["shards"])
    gb = nbytes / 1e9
    print(
        f"\n(e) opening a capture of {nbytes / 1e6:.0f} MB in {shards} shards (page cache warm); medians of {rounds}"
    )
    print(
        table(
            [
                [
                    "open_capture (sizes + headers)",
                    f"{t_open * 1e3:.1f}",
                    f"{t_open / shards * 1e3:.2f} ms/shard",
                ],
                [
                    "resume: ShardWriter open (+ checksums)",
                    f"{t_resume * 1e3:.1f}",
                    f"{t_resume / gb:.2f} s/GB",
                ],
                [
                    "verify_capture / pyhook verify",
                    f"{t_verify * 1e3:.1f}",
                    f"{t_verify / gb:.2f} s/GB",
                ],
            ],
            ["what", "ms", "per unit"],
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--out-dir", default=None, help="directory on the disk to test (default: a temp dir)"
    )
    p.add_argument("--mb", type=int, default=256, help="MB written per writer round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=["checksums", "writer", "loop", "reads", "bounded", "shards", "sizecheck"],
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    base = args.out_dir or tempfile.mkdtemp(prefix="pyhook-bench-integrity-")
    os.makedirs(base, exist_ok=True)
    print(
        f"pyhook integrity benchmark: {platform.platform()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"checksum {store_format.CHECKSUM}, directory {base}"
    )
    if "checksums" not in args.skip:
        bench_checksums(64)
    if "writer" not in args.skip:
        bench_writer(base, args.mb, args.rounds)
    if "bounded" not in args.skip:
        bench_bounded(base, max(args.mb, 1024), args.rounds)
    if "shards" not in args.skip:
        bench_many_shards(base)
    if "sizecheck" not in args.skip:
        bench_size_check(base)
    if "loop" not in args.skip:
        bench_loop(base, args.rounds)
    if "reads" not in args.skip:
        out, nbytes = bench_reads(base, args.mb, args.rounds)
        bench_open(out, nbytes, args.rounds)
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
