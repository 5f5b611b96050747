"""Capture inside ``torch.compile`` (issue 13): compiled vs eager, with and without capture.

Run:  python benchmarks/bench_compile.py [--quick] [--backend inductor|aot_eager|eager] [--to disk]

A GPT-2-shaped model (``transformers.GPT2Model`` from a config with random weights: 6 blocks,
width 256, 4 heads) runs batches of 8 x 128 tokens under ``torch.no_grad()``. One round of a
method is ``--forwards`` forwards; the capture methods enter ``capture(model, "h.*")`` (every
block's output to host memory) around them and read the rows back after the block, so a round
pays the whole capture: entering, the forwards, and the results. With ``--to disk`` the capture
writes a fresh directory instead (the writer's defaults: stats, checksums, fsync), removed in
the round; a disk capture hands each batch to the writer after its forward, outside the
compiled code (docs/compile.md). Methods are measured
round-robin in a shuffled order (paired rounds, one process), and ratios are medians of the
per-round ratios:

* ``eager``: the forward alone; ``eager+capture``: with capture;
* ``compiled``: ``torch.compile(model)`` (default settings, inductor on CPU) alone;
* ``compiled+capture``: the same compiled model, with capture.

Targets: compiled+capture / compiled <= 1.1, and compiled+capture faster than eager+capture.

Then the one-time costs on the compiled model, in seconds of wall time: the first call (the
compilation without a tracer), the first capture (a dispatcher is installed on each block and
dynamo's code caches are dropped once, then the forward compiles with the capture), entering
the same capture again (nothing compiles), and a capture of other layers (one compilation).
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

# the same paired, shuffled round-robin (with one warm-up call each) as the capture benchmark
from bench_capture import compare  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import pyhook  # noqa: E402
from pyhook.capture import capture  # noqa: E402


def ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--forwards", type=int, default=4, help="forwards per round")
    parser.add_argument(
        "--to",
        choices=("host", "disk"),
        default="host",
        help="where the capture goes (disk: a fresh directory per round, removed in the round)",
    )
    args = parser.parse_args()
    rounds = 3 if args.quick else 10

    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=6, n_embd=256, n_head=4, vocab_size=1000, n_positions=128,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2Model(cfg).eval()
    ids = torch.randint(0, 1000, (8, 128))
    layers = "h.*"
    n = args.forwards
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
        f"{platform.machine()}, pyhook {pyhook.__version__}, native={pyhook.native_available()}, "
        f"backend={args.backend}"
    )
    print(
        f"GPT2Model 6 blocks, width 256, batch 8 x 128 tokens; capture of h.* (6 blocks) "
        f"to {args.to}"
    )

    torch.set_grad_enabled(False)
    compiled = torch.compile(model, backend=args.backend)

    def wall(fn: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    root = tempfile.mkdtemp(prefix="bench_compile_")
    runs = itertools.count()

    def captured(
        runner: torch.nn.Module, names: object = layers, read: bool = False
    ) -> Callable[[], object]:
        def run() -> object:
            if args.to == "host":
                with capture(runner, names) as rec:
                    for _ in range(n):
                        runner(ids)
                return rec.results()
            out = os.path.join(root, f"c{next(runs)}")  # a fresh directory, removed after
            with capture(runner, names, out=out):
                for _ in range(n):
                    runner(ids)
            stored = pyhook.open_capture(out)
            rows = {k: stored[k].to_tensor() for k in stored.layers} if read else None
            shutil.rmtree(out)
            return rows

        return run

    def forwards(runner: torch.nn.Module) -> Callable[[], object]:
        def run() -> object:
            for _ in range(n):
                runner(ids)
            return None

        return run

    # exactness first: the compiled capture equals the eager one (up to inductor's rounding)
    costs = {"first compiled call (no tracer)": wall(lambda: compiled(ids))}
    g0 = counters["stats"]["unique_graphs"]
    costs["first capture on the compiled model"] = wall(captured(compiled))
    g1 = counters["stats"]["unique_graphs"]
    costs["the same capture again"] = wall(captured(compiled))
    g2 = counters["stats"]["unique_graphs"]
    costs["compiled call after the capture"] = wall(lambda: compiled(ids))
    costs["a capture of other layers (h.0, h.5)"] = wall(captured(compiled, ["h.0", "h.5"]))
    costs["the same again"] = wall(captured(compiled, ["h.0", "h.5"]))
    g3 = counters["stats"]["unique_graphs"]
    ref = captured(model, read=True)()
    got = captured(compiled, read=True)()
    err = max(float((ref[k] - got[k]).abs().max()) for k in ref)

    fns = {
        "eager": forwards(model),
        "eager+capture": captured(model),
        "compiled": forwards(compiled),
        "compiled+capture": captured(compiled),
    }
    times = compare(fns, rounds)
    print(f"\n{rounds} paired rounds of {n} forwards; median ms per forward:")
    print(f"{'method':<18} {'ms':>8}")
    for name, ts in times.items():
        print(f"{name:<18} {statistics.median(ts) / n * 1e3:8.2f}")
    print("\nratios (median of per-round ratios):")
    rows = [
        ("compiled+capture / compiled", "compiled+capture", "compiled", "<= 1.10"),
        ("compiled+capture / eager+capture", "compiled+capture", "eager+capture", "< 1"),
        ("compiled / eager", "compiled", "eager", ""),
        ("eager+capture / eager", "eager+capture", "eager", ""),
    ]
    for label, a, b, target in rows:
        print(f"{label:<34} {ratio(times, a, b):6.3f}  {target}")
    print("\none-time costs on the compiled model (s, wall):")
    for label, s in costs.items():
        print(f"  {label:<40} {s:7.2f}")
    print(
        f"graphs compiled: first capture {g1 - g0}, same capture again {g2 - g1}, "
        f"other layers + again {g3 - g2}; max |compiled - eager| over captured rows: {err:.2e}"
    )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
