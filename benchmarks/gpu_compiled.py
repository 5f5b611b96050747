"""Capture on a compiled model on a GPU: exact rows and their cost, under each way of compiling.

Run on a machine with CUDA (``benchmarks/gpu_check.py`` runs it as its ``compiled`` step)::

    python benchmarks/gpu_compiled.py             # every variant, each in a fresh interpreter
    python benchmarks/gpu_compiled.py --device cpu  # a dry run of the same code on the CPU

Each variant compiles a model, calls it (``warm`` times) without a capture, then captures three
distinct batches (a replay must not overwrite earlier rows) and compares the rows with the eager
capture of the same batches (maximum absolute difference). It then times, in the same process,
three compiled forwards alone and a ``capture`` block of the same three forwards (medians of 20
rounds after 5 warm-up rounds), and counts the frames dynamo traced and the graph breaks during
all of it (no per-forward retrace: 0 frames after the first block). Dynamo's logs of graph
breaks, recompilations and CUDA-graph skips (``perf_hints``) come after each variant.

The variants: ``default`` (inductor without CUDA graphs), ``reduce-overhead`` (CUDA graphs
trees), the same without a warm-up call, ``to="device"``, ``backend="cudagraphs"``, a 12-layer
model, and ``module.compile()``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

# name: (how, compile kwargs, warm calls, capture options, layers)
VARIANTS: dict[str, tuple[str, dict, int, dict, int]] = {
    "default mode": ("torch.compile", {}, 3, {}, 2),
    "reduce-overhead": ("torch.compile", {"mode": "reduce-overhead"}, 3, {}, 2),
    "reduce-overhead, no warm-up": ("torch.compile", {"mode": "reduce-overhead"}, 0, {}, 2),
    "reduce-overhead, to=device": (
        "torch.compile",
        {"mode": "reduce-overhead"},
        3,
        {"to": "device"},
        2,
    ),
    "backend=cudagraphs": ("torch.compile", {"backend": "cudagraphs"}, 3, {}, 2),
    "reduce-overhead, 12 layers": ("torch.compile", {"mode": "reduce-overhead"}, 3, {}, 12),
    "module.compile(mode=reduce-overhead)": (
        "module.compile",
        {"mode": "reduce-overhead"},
        3,
        {},
        2,
    ),
}


def one(name: str, device: str) -> dict:
    import torch
    import torch._dynamo
    from pyhook.capture import capture
    from torch import nn
    from torch._dynamo.utils import counters

    import pyhook

    how, kw, warm, opts, n_layers = VARIANTS[name]
    if device != "cuda" and kw.get("backend") == "cudagraphs":
        kw = {}
    info: dict = {"variant": name, "torch": torch.__version__, "native": pyhook.native_available()}
    torch.manual_seed(0)
    if n_layers == 2:
        net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).to(device)
        layers = ["0", "2"]
        x = torch.randn(4, 10, 16, device=device)
    else:
        net = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(12)])
        net = net.to(device)
        layers = [str(i) for i in range(12)]
        x = torch.randn(4, 10, 64, device=device)
    xs = [x, x * 0.5 + 1, -x]

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    with torch.no_grad():
        with capture(net, layers) as ref:
            for xb in xs:
                net(xb)
        ref = {n: ref[n].cpu() for n in layers}
        if how == "module.compile":
            net.compile(**kw)
            runner = net
        else:
            runner = torch.compile(net, **kw)
        for _ in range(warm):
            runner(x)
        counters.clear()
        try:
            with capture(runner, layers, **opts) as rec:
                for xb in xs:
                    runner(xb)
            sync()
            info["max |compiled - eager| per layer"] = {
                n: float((rec[n].cpu() - ref[n]).abs().max()) for n in layers
            }
            info["batches"] = rec.batches

            def block() -> None:
                with capture(runner, layers, **opts):
                    for xb in xs:
                        runner(xb)
                sync()

            def bare() -> None:
                for xb in xs:
                    runner(xb)
                sync()

            for f in (block, bare):
                for _ in range(5):
                    f()
            frames0 = counters["frames"]["total"]
            times: dict[str, list[float]] = {"bare": [], "block": []}
            for _ in range(20):
                for key, f in (("bare", bare), ("block", block)):
                    t = time.perf_counter()
                    f()
                    times[key].append(time.perf_counter() - t)
            info["us: 3 compiled forwards"] = round(statistics.median(times["bare"]) * 1e6)
            info["us: capture block of the 3"] = round(statistics.median(times["block"]) * 1e6)
            info["frames traced while timed"] = counters["frames"]["total"] - frames0
        except Exception as e:
            info["error"] = "".join(traceback.format_exception(e))[-3000:]
    info["graph breaks"] = sum(counters["graph_break"].values())
    info["unique graphs"] = counters["stats"]["unique_graphs"]
    info["cudagraph skips"] = dict(counters["inductor"]).get("cudagraph_skips", 0)
    info["tracer entries left"] = pyhook._compiled.active_entries(net)
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "variant",
        nargs="?",
        choices=list(VARIANTS),
        help="run this variant here (default: all, each apart)",
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", nargs="+", choices=list(VARIANTS), help="these variants only")
    args = ap.parse_args()
    if args.variant:
        print("RESULT " + json.dumps(one(args.variant, args.device)), flush=True)
        return 0
    env = {**os.environ, "TORCH_LOGS": "graph_breaks,recompiles,perf_hints"}
    rows, ok = [], True
    for name in args.only or list(VARIANTS):
        t0 = time.monotonic()
        cmd = [sys.executable, "-u", os.path.abspath(__file__), name, "--device", args.device]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
            out, status = p.stdout + p.stderr, f"exit {p.returncode}"
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            status = "TIMED OUT"
        print(f"===== {name}: {status} in {time.monotonic() - t0:.0f} s", flush=True)
        res = [json.loads(ln[7:]) for ln in out.splitlines() if ln.startswith("RESULT ")]
        logs = [ln for ln in out.splitlines() if not ln.startswith("RESULT ")]
        print("\n".join(logs[-40:])[-4000:], flush=True)
        if not res:
            ok = False
            continue
        r = res[0]
        print(json.dumps(r, indent=1), flush=True)
        err = r.get("max |compiled - eager| per layer", {})
        ok = ok and "error" not in r and all(v < 1e-4 for v in err.values())
        rows.append(r)
    print("\n| variant | max abs diff | 3 forwards us | capture block us | frames traced |")
    print("|---|---|---|---|---|")
    for r in rows:
        diff = max(r.get("max |compiled - eager| per layer", {"-": float("nan")}).values())
        print(
            f"| {r['variant']} | {diff:.1e} | {r.get('us: 3 compiled forwards', '-')} | "
            f"{r.get('us: capture block of the 3', '-')} | {r.get('frames traced while timed', '-')} |"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
