"""Leak soak: RSS and live-tensor slope over many trace cycles (guarantee 2, exact figures).

Usage: ``python benchmarks/bench_soak.py [--cycles 2000] [--sample 100]``

Each configuration runs ``cycles`` trace cycles on a small MLP (after a warm-up), sampling the
process RSS every ``sample`` cycles, and prints the least-squares slope in KiB per 1,000 cycles
and the change in the number of live tensor objects. A flat run shows a slope near 0 (allocator
noise) and a tensor delta of exactly 0.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

import pyhook
from pyhook.capture import capture
from pyhook.flex import FlexModel, HookFunction
from pyhook.truncate import TruncatedModule


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def live_tensors() -> int:
    gc.collect()
    warnings.filterwarnings(
        "ignore", category=FutureWarning
    )  # isinstance on deprecated torch aliases
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs) or 1.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den


def configs(model: nn.Module, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    def trace_clone_grad():
        with pyhook.Trace(model, "1", clone=True, retain_grad=True) as t:
            model(x).sum().backward()
        model.zero_grad(set_to_none=True)
        return t.output

    def tracedict_stop():
        with pyhook.TraceDict(model, ["0", "2"], clone=True, detach=True, stop=True) as td:
            model(x)
        return td["2"].output

    def keep_calls():
        with pyhook.Trace(model, "2", keep_calls=True, clone=True) as t:
            model(x)
            model(x)
        return t.calls

    def truncated():
        return TruncatedModule(model, "2")(x)

    def flex():
        out: dict = {}
        fm = FlexModel(model, out)
        fm.register_forward_hook(HookFunction("2"))
        fm(x)
        fm.restore()
        return out

    def capture_host():
        with capture(model, ["0", "2"], to="host") as rec:
            model(x)
        return rec["2"]

    return {
        "Trace clone+retain_grad+backward": trace_clone_grad,
        "TraceDict clone+detach+stop": tracedict_stop,
        "Trace keep_calls (2 calls)": keep_calls,
        "TruncatedModule": truncated,
        "FlexModel register+restore": flex,
        "capture to host": capture_host,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=2000)
    ap.add_argument("--sample", type=int, default=100)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64), nn.Linear(64, 8))
    x = torch.randn(args.batch, 64)
    print(
        f"torch {torch.__version__}, backend {pyhook.get_backend()}, {args.cycles} cycles, "
        f"batch {args.batch}, {os.cpu_count()} CPUs"
    )
    print(
        f"{'configuration':36s} {'KiB/1000 cycles':>16s} {'RSS delta MiB':>14s} {'tensors delta':>14s} {'us/cycle':>9s}"
    )
    for name, fn in configs(model, x).items():
        keep = None
        for _ in range(50):
            keep = fn()
        t0, r0 = live_tensors(), rss()
        xs, ys = [], []
        start = time.perf_counter()
        for i in range(args.cycles):
            keep = fn()
            if i % args.sample == 0:
                xs.append(float(i))
                ys.append(float(rss()))
        elapsed = time.perf_counter() - start
        del keep
        t1, r1 = live_tensors(), rss()
        print(
            f"{name:36s} {slope(xs, ys) * 1000 / 1024:16.1f} {(r1 - r0) / 2**20:14.2f} "
            f"{t1 - t0:14d} {elapsed / args.cycles * 1e6:9.0f}"
        )


if __name__ == "__main__":
    main()
