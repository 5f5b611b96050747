"""Paired reading: two layers of two models (a crosscoder's input) against the same bytes from one
model (issue 25 item 4; target >= 0.9x the speed).

Two stores of the same rows, tokens and bytes are written once with ``pyhook.capture``:

- ``one``: one model with two layers of width ``--width`` (``a``, ``b``);
- ``paired``: ``pyhook.Paired(base=..., chat=...)``, each model with one layer of that width,
  read as ``base/a`` + ``chat/a``.

(The models are embedding tables: the benchmark is about reading, so the forward is kept cheap.)
Each round reads both stores once, in alternating order, two ways: ``dataset`` (a shuffled epoch
of ``reader.dataset([...], batch_size=4096)``, what a trainer does) and ``sequential`` (each
layer's rows in order, ``reader[layer][a:b]`` slices of ``--slice`` rows). The table gives the
median of the per-round speed ratios paired / one (>= 1 is paired at least as fast), by wall
time and by process CPU time (user+sys), with the interquartile range.

Run: ``python benchmarks/bench_paired.py`` (``--quick``: smaller stores, 3 rounds, under 2 min).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

import pyhook
from pyhook.capture import capture


class Tables(torch.nn.Module):
    """``forward(input_ids)``: each named embedding table's rows of the ids (cheap 'layers')."""

    def __init__(self, names, vocab, width):
        super().__init__()
        self.t = torch.nn.ModuleDict({n: torch.nn.Embedding(vocab, width) for n in names})

    def forward(self, input_ids, attention_mask=None):
        return [emb(input_ids) for emb in self.t.values()]


def write(model, layers, out, batches):
    with torch.no_grad(), capture(model, layers, out=out, max_host_bytes=1 << 30):
        for ids in batches:
            model(input_ids=ids)
    return pyhook.open_capture(out)


def read_dataset(reader, layers, epoch):
    ds = reader.dataset(layers, batch_size=4096, seed=0)
    ds.set_epoch(epoch)
    n = 0
    for batch in ds:
        n += sum(int(v.shape[0]) for v in batch.values())
    return n


def read_sequential(reader, layers, step):
    n = 0
    for name in layers:
        data = reader[name]
        for start in range(0, len(data), step):
            n += int(data[start : start + step].shape[0])
    return n


def timed(fn, *args):
    c0, t0 = time.process_time(), time.perf_counter()
    n = fn(*args)
    return time.perf_counter() - t0, time.process_time() - c0, n


def quartiles(xs):
    q = sorted(xs)
    return statistics.median(q), q[len(q) // 4], q[(3 * len(q)) // 4]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--rows", type=int, default=131072, help="rows (tokens) per layer")
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--slice", type=int, default=8192, help="rows per sequential read")
    p.add_argument("--dir", default=None, help="where the stores go (default: a temp folder)")
    p.add_argument("--quick", action="store_true", help="32k rows, 3 rounds (smoke run)")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.rows = 3, 32768
    torch.manual_seed(0)
    tokens = 512
    batches = [torch.randint(0, 1000, (8, tokens)) for _ in range(max(1, args.rows // (8 * tokens)))]
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        one = write(Tables(["a", "b"], 1000, args.width), ["t.a", "t.b"], f"{root}/one", batches)
        pair = pyhook.Paired(
            base=Tables(["a"], 1000, args.width), chat=Tables(["a"], 1000, args.width)
        )
        paired = write(pair, ["t.a"], f"{root}/paired", batches)
        sets = {"one": (one, ["t.a", "t.b"]), "paired": (paired, ["base/t.a", "chat/t.a"])}
        sizes = {k: r.index["bytes"] for k, (r, _) in sets.items()}
        rows = {k: len(r[names[0]]) for k, (r, names) in sets.items()}
        assert rows["one"] == rows["paired"], rows
        ways = {
            "dataset": lambda r, names, i: read_dataset(r, names, i),
            "sequential": lambda r, names, i: read_sequential(r, names, args.slice),
        }
        for way, fn in ways.items():  # warm: the page cache holds both stores
            for r, names in sets.values():
                fn(r, names, 0)
        ratios = {way: {"wall": [], "cpu": []} for way in ways}
        for i in range(args.rounds):
            for way, fn in ways.items():
                order = ["one", "paired"] if i % 2 == 0 else ["paired", "one"]
                got = {}
                for k in order:
                    r, names = sets[k]
                    got[k] = timed(fn, r, names, i)
                assert got["one"][2] == got["paired"][2]
                ratios[way]["wall"].append(got["one"][0] / got["paired"][0])
                ratios[way]["cpu"].append(got["one"][1] / got["paired"][1])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"paired reading: {rows['one']:,} rows x 2 layers x {args.width} float32 per store; "
        f"stores {sizes['one'] / 1e6:,.1f} MB (one) and {sizes['paired'] / 1e6:,.1f} MB (paired); "
        f"{args.rounds} rounds; load: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(f"{'read':<12}{'speed paired/one (wall)':>28}{'(cpu)':>24}")
    for way, r in ratios.items():
        w, c = quartiles(r["wall"]), quartiles(r["cpu"])
        print(
            f"{way:<12}{w[0]:>12.3f}x  [{w[1]:.3f}, {w[2]:.3f}]"
            f"{c[0]:>12.3f}x  [{c[1]:.3f}, {c[2]:.3f}]"
        )
    print("target: >= 0.9x (median); >= 1 means paired reads at least as fast as one model")


if __name__ == "__main__":
    main()
