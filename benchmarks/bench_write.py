"""Shard writes: ``O_DIRECT`` (the default for shards of 1 MiB or more) against buffered writes.

Run:  python benchmarks/bench_write.py [--rounds 8] [--layers 12] [--batches 4] [--dir DIR]

Writes a GPT-2-small batch's rows (``--layers`` tensors of 1024 x 768 float32 from the native
pool, 2 MiB-aligned as a capture's are) as ``--batches`` fsynced shard files with pyhook's own
shard writer (``pyhook.pipeline.format._write_file``), once with ``PYHOOK_DIRECT_IO=1`` and once
with ``=0``, in paired rounds (the order alternates), and prints the medians of wall time and of
the process's user and system CPU time, and their ratios. The files go to ``--dir`` (default: a
temporary folder under the current directory, so that the disk is the one a capture would use).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import tempfile
import time

import torch

from pyhook import _backend
from pyhook.pipeline import _directio
from pyhook.pipeline.format import _write_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    rows = [_backend.empty_host((1024, 768), torch.float32).normal_() for _ in range(args.layers)]
    mb = args.layers * args.batches * rows[0].nbytes / 1e6
    root = tempfile.mkdtemp(prefix="bench-write-", dir=args.dir or os.getcwd())

    def write(mode: str) -> tuple[float, float, float]:
        os.environ[_directio.ENV] = mode
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        for b in range(args.batches):
            _write_file(
                os.path.join(root, f"s{b}.safetensors"), {f"l{i}": [t] for i, t in enumerate(rows)}
            )
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        for b in range(args.batches):
            os.unlink(os.path.join(root, f"s{b}.safetensors"))
        return wall, r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime

    try:
        write("1"), write("0")  # warm-up (staging buffer, file system metadata)
        before = _directio.counters["direct_bytes"]
        load0 = os.getloadavg()[0]
        res: dict[str, list[tuple[float, float, float]]] = {"1": [], "0": []}
        for r in range(args.rounds):
            for mode in ("1", "0") if r % 2 == 0 else ("0", "1"):
                res[mode].append(write(mode))
        direct_used = _directio.counters["direct_bytes"] > before
    finally:
        os.environ.pop(_directio.ENV, None)
        shutil.rmtree(root, ignore_errors=True)
    med = {m: [statistics.median(x[i] for x in v) for i in range(3)] for m, v in res.items()}
    print(
        f"{mb:.1f} MB a round ({args.layers} layers x {args.batches} fsynced shards), "
        f"{args.rounds} paired rounds, load {load0:.2f} -> {os.getloadavg()[0]:.2f}"
    )
    if not direct_used:
        print("NOTE: this file system refused O_DIRECT: both rows are buffered writes")
    print(f"{'write':<10}{'wall ms':>10}{'user ms':>10}{'sys ms':>10}{'sys ms/MB':>11}")
    for mode, name in (("0", "buffered"), ("1", "direct")):
        w, u, s = med[mode]
        print(f"{name:<10}{w * 1e3:>10.1f}{u * 1e3:>10.1f}{s * 1e3:>10.1f}{s * 1e3 / mb:>11.3f}")
    cpu = {m: med[m][1] + med[m][2] for m in med}
    print(
        f"direct / buffered: wall {med['1'][0] / med['0'][0]:.3f}x, "
        f"CPU (user+sys) {cpu['1'] / max(cpu['0'], 1e-9):.3f}x"
    )


if __name__ == "__main__":
    main()
