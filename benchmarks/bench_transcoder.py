"""Transcoder sites: what capturing all 2xL in/out sites of a block costs against the same bytes
captured as plain module outputs.

A GPT-2-small shape (12 blocks x 768, random weights, ``GPT2Model``), a disk capture with the
defaults, ``--batches`` forwards of ``--batch`` x ``--tokens`` token ids each, into a fresh folder
per run. Variants, all storing 24 tensors of [tokens, 768] per forward (the same bytes):

- ``outputs``: 24 module outputs by name, the baseline: ``h.*`` (the 12 block outputs) and
  ``h.*.ln_2`` (the 12 normalised MLP inputs, as the norm's output);
- ``sites``: the transcoder sites ``mlp_in.*`` + ``mlp_out.*`` (standard points: 12 forward
  pre-hooks on the MLPs, 12 forward hooks);
- ``inputs``: the same tensors as module inputs and outputs by name, ``h.*.mlp:in`` + ``h.*.mlp``.

``bare`` is the forward alone, for scale. Rounds run every variant once in rotating order; the
table gives medians of the per-round ratios to ``outputs`` (wall time and process CPU time,
user+sys over all threads), with the interquartile range. Target: ``sites`` <= 1.05x.

Run: ``python benchmarks/bench_transcoder.py`` (``--quick``: a smaller batch, under 2 minutes).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import transformers as T

import pyhook
from pyhook.capture import capture

VARIANTS = {
    "outputs": ["h.*", "h.*.ln_2"],
    "sites": ["mlp_in.*", "mlp_out.*"],
    "inputs": ["h.*.mlp:in", "h.*.mlp"],
}


def run(model, layers, batches, where):
    out = tempfile.mkdtemp(dir=where)
    try:
        c0, t0 = time.process_time(), time.perf_counter()
        with torch.no_grad():
            if layers is None:
                for ids in batches:
                    model(ids)
            else:
                with capture(model, layers, out=out):
                    for ids in batches:
                        model(ids)
        return time.perf_counter() - t0, time.process_time() - c0
    finally:
        shutil.rmtree(out, ignore_errors=True)


def quartiles(xs):
    q = sorted(xs)
    return statistics.median(q), q[len(q) // 4], q[(3 * len(q)) // 4]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (a core left free)")
    p.add_argument("--dir", default=None, help="where the captures go (default: a temp folder)")
    p.add_argument("--quick", action="store_true", help="2x64 tokens, 3 rounds (smoke run)")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.batch, args.tokens, args.batches = 3, 2, 64, 2
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = T.GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=max(args.tokens, 128))
    model = T.GPT2Model(cfg).eval()
    g = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, cfg.vocab_size, (args.batch, args.tokens), generator=g)
        for _ in range(args.batches)
    ]
    mb = 24 * args.batch * args.tokens * 768 * 4 / 1e6
    print(
        f"pyhook {pyhook.__version__}, torch {torch.__version__}, threads={args.threads}, "
        f"GPT-2-small shape (12x768), {args.batches} forwards of {args.batch}x{args.tokens} "
        f"tokens, {mb:.0f} MB captured a forward, {args.rounds} rounds; load before: "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    names = ["bare", *VARIANTS]
    for name in names:  # warm-up: allocator, page cache, first-call costs
        run(model, VARIANTS.get(name), batches[:1], args.dir)
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            w, c = run(model, VARIANTS.get(name), batches, args.dir)
            wall[name].append(w)
            cpu[name].append(c)
    header = (
        f"{'variant':8} {'layers':24} {'wall s':>7} {'/ outputs':>9} {'(IQR)':>13} "
        f"{'cpu / outputs':>13} {'(IQR)':>13}"
    )
    print(header)
    print("-" * len(header))
    for name in names:
        rw = quartiles([a / b for a, b in zip(wall[name], wall["outputs"])])
        rc = quartiles([a / b for a, b in zip(cpu[name], cpu["outputs"])])
        layers = " + ".join(VARIANTS.get(name, ["(no capture)"]))
        print(
            f"{name:8} {layers:24} {statistics.median(wall[name]):7.2f} {rw[0]:9.3f} "
            f"{f'{rw[1]:.3f}-{rw[2]:.3f}':>13} {rc[0]:13.3f} {f'{rc[1]:.3f}-{rc[2]:.3f}':>13}"
        )
    print(f"load after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; target: sites <= 1.05")


if __name__ == "__main__":
    main()
