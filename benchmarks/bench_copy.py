"""Capture-copy benchmark: native ``clone_tensors`` vs the reference vs raw copy bandwidth.

Each capture is a list of 12 GPT-2-like block outputs ``(1, seq, 768)`` float32; the loop is
the steady state of tracing (capture, use, drop). Columns:

* ``native`` / ``reference``: median time of ``pyhook._backend.clone_tensors`` per backend;
* ``copy_``: ``copy_`` into preallocated buffers reused every iteration (no allocation, no
  page faults) - the machine's memory-copy speed, measured in the same run;
* ``speedup``: reference / native; ``%bw``: native throughput as % of ``copy_``.

Run: ``python benchmarks/bench_copy.py [--threads N] [--device cuda]`` (about 30 s). With
``--device cuda`` the captures live on the GPU (the CUDA rows: device-to-device clones, each
timed to ``torch.cuda.synchronize()``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from pyhook import _backend

HIDDEN = 768
N_TENSORS = 12
TARGETS = [("64 KB", 64 << 10), ("1 MB", 1 << 20), ("16 MB", 16 << 20), ("64 MB", 64 << 20)]


def capture_list(total_bytes: int, device: str = "cpu") -> list[torch.Tensor]:
    seq = max(1, round(total_bytes / (N_TENSORS * HIDDEN * 4)))
    return [torch.randn(1, seq, HIDDEN, device=device) for _ in range(N_TENSORS)]


def interleaved_medians(fns: dict, budget_s: float, min_rounds: int = 5) -> dict:
    for fn in fns.values():  # warm-up: fill the pool, fault in the copy_ buffers
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    start = time.perf_counter()
    rounds = 0
    while rounds < min_rounds or (time.perf_counter() - start < budget_s and rounds < 500):
        for k, fn in fns.items():
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        rounds += 1
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch.set_num_threads (0: torch's default). On a loaded machine 1 thread "
        "gives stable numbers: a parallel copy waits for its slowest, descheduled thread.",
    )
    parser.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="where the captures live"
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device; nothing measured")
        return
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    native = _backend.native_available()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, "
        f"native={'yes' if native else 'NO (' + str(_backend.native_load_error()) + ')'}, "
        f"device={torch.cuda.get_device_name() if cuda else 'cpu'}"
    )
    header = (
        f"{'capture':>8} {'bytes':>10} {'native ms':>10} {'ref ms':>9} {'copy_ ms':>9} "
        f"{'speedup':>8} {'native GB/s':>12} {'copy GB/s':>10} {'%bw':>6}"
    )
    print(header)
    print("-" * len(header))
    for label, target in TARGETS:
        xs = capture_list(target, args.device)
        nbytes = sum(t.nbytes for t in xs)
        budget = 8.0 if nbytes >= (16 << 20) else 3.0
        dst = [torch.empty_like(t) for t in xs]

        def raw_copy(dst: list = dst, xs: list = xs) -> None:
            for d, s in zip(dst, xs):
                d.copy_(s)
            sync()

        def run(backend: str, xs: list = xs):
            def step() -> None:
                with _backend.use_backend(backend):
                    ys = _backend.clone_tensors(xs)
                ys[0][0, 0, 0].item()  # "use" the capture (and wait for it), then drop it

            return step

        # Interleave the three so that load from other processes hits all alike.
        fns = {"copy": raw_copy, "reference": run("reference"), "native": run("native")}
        if not native:
            del fns["native"]
        t = interleaved_medians(fns, budget)
        t_copy, t_ref = t["copy"], t["reference"]
        t_nat = t.get("native", float("nan"))
        gbs = nbytes / t_nat / 1e9
        copy_gbs = nbytes / t_copy / 1e9
        print(
            f"{label:>8} {nbytes:>10} {t_nat * 1e3:>10.3f} {t_ref * 1e3:>9.3f} "
            f"{t_copy * 1e3:>9.3f} {t_ref / t_nat:>7.2f}x {gbs:>12.2f} {copy_gbs:>10.2f} "
            f"{100 * gbs / copy_gbs:>5.0f}%"
        )
    if native:
        s = _backend.pool_stats()
        print(f"pool: hits={s['hits']} misses={s['misses']} cached={s['cached_bytes']} bytes")


if __name__ == "__main__":
    main()
