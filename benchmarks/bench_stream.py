"""Streaming activations to a trainer (``pyhook.stream``): throughput, trainer stalls, mixing
quality at equal memory, host memory, and when a cache pays off.

Run:  python benchmarks/bench_stream.py [--quick]

One run prints one table per question, each from paired rounds in this process (medians):

(a) producer-bound (trainer step = 0): tokens/s of ``for b in pyhook.stream(...)`` against the
    bare forward loop (``model(input_ids=, attention_mask=)`` under ``no_grad``) over the same
    pre-tokenised batches of a GPT-2-small-shaped model (d=768, 12 heads, random weights from a
    ``transformers`` config; --quick: 4 of its 12 blocks), and the same loop on a thread kept
    for the whole run (the one with the lower median is the baseline); many short
    rounds (--quick: 12 of 6 forwards; else 16 of 8), the methods in rotating order; the
    per-round ratios, their median and middle half, in wall and in process CPU time (target:
    >= 0.95x); (a') what each piece of a batch costs (forward on either thread, hook copy,
    mixing buffer, queue handoff) against the forward's CPU time;
(b) consumer-bound: a trainer step longer than a forward (a sleep of 1.5x the measured forward
    time per batch, and a real SAE step: a 768 -> 6144 ReLU autoencoder with Adam, timed alone
    first); the trainer's time waiting for the next batch after the first, as a share of its
    step time (target: <= 5%);
(c) mixing quality at equal memory (a buffer of 16 batches of 4096 rows, contexts of 128
    tokens, 8 contexts per forward, 4096 contexts; row indices only, no model): the share of
    same-context neighbours in a batch (adjacent rows i, i+1), the same-context rate over all
    pairs of a batch, and the correlation of neighbouring rows' positions, for pyhook's mixer,
    a global shuffle of the whole pass, a global shuffle of each buffer-sized window (the best
    a buffer that is filled, shuffled and emptied can do), SAELens' ``mixing_buffer`` and
    Language-Model-SAEs' ``ActivationBatchler`` (both re-implemented here from their published
    algorithms: shuffle the full buffer, serve half / serve until half full), and no shuffle
    (EleutherAI sparsify's order);
(d) host memory: peak RSS of a stream pass in a fresh process over 50 MB and 200 MB of rows
    (a one-block model of the same width; resident memory sampled at every batch, over the
    process after one forward), against the bound ``(buffer_rows + (prefetch + 1)
    * batch_size + one forward's rows) * row bytes``;
(e) stream or cache: seconds per pass of the stream, of the stream with ``tee=`` (the first
    pass of a cache), and of reading the cached rows back in shuffled batches of 4096; the
    number of passes from which caching is cheaper.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import pyhook
from pyhook.pipeline.stream import Mixer
from pyhook.source import Batch

med = statistics.median
HERE = os.path.dirname(os.path.abspath(__file__))


def table(rows: list[list[str]], header: list[str]) -> str:
    cols = [header, *rows]
    w = [max(len(str(r[i])) for r in cols) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w[i]) for i, c in enumerate(r))  # noqa: E731
    return "\n".join([line(header), line(["-" * x for x in w]), *map(line, rows)])


def gpt2_small(n_layer: int):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=768, n_head=12, n_positions=1024)
    return transformers.GPT2Model(cfg).eval()


def make_batches(
    n: int, contexts: int, ctx: int, vocab: int = 50257, start: int = 0
) -> list[Batch]:
    g = torch.Generator().manual_seed(start)
    out = []
    for i in range(n):
        ids = torch.randint(0, vocab, (contexts, ctx), generator=g)
        keep = torch.ones(contexts, ctx, dtype=torch.bool)
        first = start + i * contexts
        out.append(
            Batch(ids, torch.ones_like(ids), keep, torch.arange(first, first + contexts), None)
        )
    return out


def cpu() -> float:
    """Process CPU time, user + system, all threads (ns resolution; os.times() has 10 ms)."""
    return time.process_time()


def bare(model, batches) -> None:
    with torch.no_grad():
        for b in batches:
            model(input_ids=b.input_ids, attention_mask=b.attention_mask)


def streamed(model, batches, layer, batch_size, buffer_rows, step=None) -> pyhook.Stream:
    s = pyhook.stream(model, batches, layer, batch_size=batch_size, buffer_rows=buffer_rows)
    for b in s:
        if step is not None:
            step(b[layer])
    return s


# -- (a) -------------------------------------------------------------------------------------------
class KeptThread:
    """A thread kept for the whole benchmark that runs what it is given: the strongest
    threaded baseline (no thread start, arena or OpenMP team set-up per round)."""

    def __init__(self) -> None:
        import queue
        import threading

        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.t = threading.Thread(target=self._loop, daemon=True)
        self.t.start()

    def _loop(self) -> None:
        while True:
            fn = self.jobs.get()
            if fn is None:
                return
            self.done.put(fn())

    def __call__(self, fn):
        self.jobs.put(fn)
        return self.done.get()

    def close(self) -> None:
        self.jobs.put(None)
        self.t.join()


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[1], q[2]


def producer_bound(model, batches, layer, rounds):
    """Short paired rounds, in rotating order: the bare loop on the main thread, the bare loop
    on a kept thread (both baselines: which placement is faster depends on the load, OpenMP's
    thread teams), and the stream. The baseline is the placement with the lower median wall
    time over all rounds; per round, its wall time over the stream's, and the same for process
    CPU time; medians and the middle half. (Taking the faster of the two anew in each round,
    as this bench did before, biases the ratio low by the rounds' noise: the minimum of two
    noisy times against one.)"""
    rows_per_forward = batches[0].input_ids.numel()
    tokens = rows_per_forward * len(batches)
    kept = KeptThread()
    methods = {
        "bare forward loop (main thread)": lambda: bare(model, batches),
        "bare forward loop (a kept thread)": lambda: kept(lambda: bare(model, batches)),
        "pyhook.stream (step = 0)": lambda: streamed(
            model, batches, layer, rows_per_forward, 4 * rows_per_forward
        ),
    }
    names = list(methods)
    streamed(model, batches[:2], layer, rows_per_forward, rows_per_forward)  # warm-up
    bare(model, batches[:2])
    kept(lambda: bare(model, batches[:2]))
    wall: dict[str, list[float]] = {n: [] for n in methods}
    cpus: dict[str, list[float]] = {n: [] for n in methods}
    mins, loads = [], []
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        if r % 2:
            order.reverse()
        for name in order:
            c0, t0 = cpu(), time.perf_counter()
            methods[name]()
            wall[name].append(time.perf_counter() - t0)
            cpus[name].append(cpu() - c0)
        mins.append(min(wall[n][-1] for n in names[:2]) / wall[names[2]][-1])
        loads.append(os.getloadavg()[0])
    kept.close()
    base = min(names[:2], key=lambda n: med(wall[n]))
    ratios = [b / s for b, s in zip(wall[base], wall[names[2]])]
    cratios = [b / s for b, s in zip(cpus[base], cpus[names[2]])]
    rows = [
        [
            n,
            f"{tokens / med(wall[n]):,.0f}",
            f"{med(wall[n]):.3f} s",
            f"{med(cpus[n]):.3f} s",
            f"{1e6 * med(cpus[n]) / tokens:.0f} us",
        ]
        for n in names
    ]
    q1, q2, q3 = quartiles(ratios)
    c1, c2, c3 = quartiles(cratios)
    rows.append(
        [
            f"stream / {base.split('(')[1][:-1]} bare, per round ({rounds} rounds)",
            f"{q2:.3f}x",
            f"middle half {q1:.3f}-{q3:.3f}",
            f"CPU {c2:.3f}x ({c1:.3f}-{c3:.3f})",
            "",
        ]
    )
    rows.append(
        [
            "(old measure: stream / the faster bare in each round)",
            f"{med(mins):.3f}x",
            "",
            "",
            "",
        ]
    )
    per_round = " ".join(f"{x:.2f}" for x in ratios)
    return rows, q2, c2, per_round, (min(loads), max(loads))


def pieces(model, batches, layer, reps):
    """What a batch costs, piece by piece (medians of ``reps``): the forward on the main thread
    and on a kept thread (wall, process CPU), and the stream's own work per forward's rows:
    the hook's copy of the rows, the mixing buffer's insert and batch gather (``Mixer.add``),
    and a batch handed over through the queue between two threads."""
    import queue
    import threading

    b0 = batches[0]
    n = b0.input_ids.numel()
    x = torch.randn(n, 768)

    def fwd():
        with torch.no_grad():
            model(input_ids=b0.input_ids, attention_mask=b0.attention_mask)

    def timed(fn, k=reps):
        ws, cs = [], []
        for _ in range(k):
            c0, t0 = cpu(), time.perf_counter()
            fn()
            ws.append(time.perf_counter() - t0)
            cs.append(cpu() - c0)
        return med(ws), med(cs)

    kept = KeptThread()
    fwd()
    kept(fwd)
    out = {}
    main_w, main_c = [], []
    th_w, th_c = [], []
    for _ in range(reps):  # alternating
        w, c = timed(fwd, 1)
        main_w.append(w)
        main_c.append(c)
        w, c = kept(lambda: timed(fwd, 1))
        th_w.append(w)
        th_c.append(c)
    out["forward, main thread"] = (med(main_w), med(main_c))
    out["forward, a kept thread"] = (med(th_w), med(th_c))
    # the stream's own work runs on the producer thread, right after its forward: timed there
    out["hook copy of one forward's rows (clone), producer thread"] = kept(
        lambda: timed(lambda: x.clone(), 20)
    )
    m = Mixer(4 * n, n, 0)
    rows = {
        layer: x,
        "tokens": torch.zeros(n, dtype=torch.long),
        "row_index": torch.zeros(n, 2, dtype=torch.long),
    }
    for _ in range(4):
        list(m.add(rows))
    out["mixer insert + batch gather (Mixer.add, full buffer), producer thread"] = kept(
        lambda: timed(lambda: list(m.add(rows)), 20)
    )
    kept.close()
    q: queue.Queue = queue.Queue(maxsize=2)
    back: queue.Queue = queue.Queue(maxsize=2)

    def echo():
        while (item := q.get()) is not None:
            back.put(item)

    t = threading.Thread(target=echo, daemon=True)
    t.start()

    def handoff():
        q.put(rows)
        back.get()

    timed(handoff, 5)
    w, c = timed(handoff, 50)
    q.put(None)
    t.join()
    out["queue handoff, there and back (2 handoffs)"] = (w, c)
    fc = out["forward, main thread"][1]
    return [
        [name, f"{1e3 * w:.2f} ms", f"{1e3 * c:.2f} ms", f"{100 * c / fc:.2f}%"]
        for name, (w, c) in out.items()
    ]


# -- (b) -------------------------------------------------------------------------------------------
def consumer_bound(model, batches, layer, rounds):
    rows = batches[0].input_ids.numel()
    times = []
    with torch.no_grad():
        for b in batches[:4]:
            t0 = time.perf_counter()
            model(input_ids=b.input_ids, attention_mask=b.attention_mask)
            times.append(time.perf_counter() - t0)
    fwd = med(times)
    sleep_step = 1.5 * fwd

    sae = torch.nn.Sequential(
        torch.nn.Linear(768, 6144), torch.nn.ReLU(), torch.nn.Linear(6144, 768)
    )
    opt = torch.optim.Adam(sae.parameters(), 1e-4)

    def sae_step(x):
        loss = (sae(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    x = torch.randn(rows, 768)
    sae_step(x)
    t0 = time.perf_counter()
    for _ in range(3):
        sae_step(x)
    sae_time = (time.perf_counter() - t0) / 3
    out = []
    results = []
    for name, step, per in (
        (
            f"sleep {sleep_step * 1e3:.0f} ms (1.5x forward)",
            lambda _x: time.sleep(sleep_step),
            sleep_step,
        ),
        (f"SAE 768->6144 step ({sae_time * 1e3:.0f} ms alone)", sae_step, sae_time),
    ):
        shares, firsts = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            s = streamed(model, batches, layer, rows, 4 * rows, step=step)
            total = time.perf_counter() - t0
            steps = s.batches - 1
            shares.append(s.wait_seconds / max(steps * per, 1e-9))
            firsts.append(s.first_batch_seconds)
            del total
        out.append(
            [name, f"{fwd * 1e3:.0f} ms", f"{med(firsts):.2f} s", f"{100 * med(shares):.1f}%"]
        )
        results.append(med(shares))
    return out, results


# -- (c) -------------------------------------------------------------------------------------------
def saelens_mixing(rows, buffer_size, batch_size, chunks, g):
    """SAELens' mixing_buffer: concatenate chunks; once at buffer_size, shuffle everything,
    serve the first half (whole batches), keep the rest; at the end serve the rest in order."""
    store = None
    for new in chunks(rows):
        store = new if store is None else torch.cat([store, new])
        if len(store) >= buffer_size:
            store = store[torch.randperm(len(store), generator=g)]
            n = max(1, len(store) // (2 * batch_size)) * batch_size
            serve, store = store[:n], store[n:]
            for i in range(0, n, batch_size):
                yield serve[i : i + batch_size]
    if store is not None:
        for i in range(0, len(store) // batch_size * batch_size, batch_size):
            yield store[i : i + batch_size]


def lmsaes_batchler(rows, buffer_size, batch_size, chunks, g):
    """Language-Model-SAEs' ActivationBatchler: append chunks; once at buffer_size, shuffle the
    buffer and serve batches from its front while it holds >= half; the rest at the end."""
    buf = rows[:0]
    for new in chunks(rows):
        buf = torch.cat([buf, new])
        if len(buf) >= buffer_size:
            buf = buf[torch.randperm(len(buf), generator=g)]
            while len(buf) >= buffer_size // 2 and len(buf) >= batch_size:
                yield buf[:batch_size]
                buf = buf[batch_size:]
    while len(buf):
        yield buf[:batch_size]
        buf = buf[batch_size:]


def pyhook_mixer(rows, buffer_size, batch_size, chunks, seed):
    m = Mixer(buffer_size, batch_size, seed)
    for new in chunks(rows):
        for b in m.add({"i": new}):
            yield b["i"]
    for b in m.finish():
        yield b["i"]


def window_shuffle(rows, buffer_size, batch_size, g):
    for s in range(0, len(rows), buffer_size):
        w = rows[s : s + buffer_size]
        w = w[torch.randperm(len(w), generator=g)]
        for i in range(0, len(w), batch_size):
            yield w[i : i + batch_size]


def quality(batches, batch_size):
    """(same-context neighbours, same-context pairs, neighbour position correlation), over the
    full batches."""
    adj, pairs, xs, ys = [], [], [], []
    for b in batches:
        if len(b) < batch_size:
            continue
        c, p = b[:, 0], b[:, 1]
        adj.append((c[1:] == c[:-1]).double().mean().item())
        counts = torch.bincount(c - c.min()).double()
        pairs.append(((counts * (counts - 1)).sum() / (len(c) * (len(c) - 1))).item())
        xs.append(p[:-1].double())
        ys.append(p[1:].double())
    x, y = torch.cat(xs), torch.cat(ys)
    corr = torch.corrcoef(torch.stack([x, y]))[0, 1].item()
    return statistics.mean(adj), statistics.mean(pairs), corr


def mixing(contexts, ctx, per_forward, batch_size, buffer_batches):
    c = torch.arange(contexts).repeat_interleave(ctx)
    p = torch.arange(ctx).repeat(contexts)
    rows = torch.stack([c, p], 1)
    m = buffer_batches * batch_size

    def chunks(r):
        step = per_forward * ctx
        for i in range(0, len(r), step):
            yield r[i : i + step]

    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    schemes = {
        "pyhook Mixer (random slots)": pyhook_mixer(rows, m, batch_size, chunks, 0),
        "global shuffle of the pass": (
            rows[torch.randperm(len(rows), generator=g())][i : i + batch_size]
            for i in range(0, len(rows), batch_size)
        ),
        "shuffle of each buffer-sized window": window_shuffle(rows, m, batch_size, g()),
        "SAELens mixing_buffer": saelens_mixing(rows, m, batch_size, chunks, g()),
        "LM-SAEs ActivationBatchler (half refill)": lmsaes_batchler(
            rows, m, batch_size, chunks, g()
        ),
        "no shuffle (sparsify)": (
            rows[i : i + batch_size] for i in range(0, len(rows), batch_size)
        ),
    }
    res = {name: quality(list(it), batch_size) for name, it in schemes.items()}
    glob_adj = res["global shuffle of the pass"][0]
    win_adj = res["shuffle of each buffer-sized window"][0]
    out = [
        [
            name,
            f"{a:.5f}",
            f"{a / glob_adj:.1f}x",
            f"{a / win_adj:.2f}x",
            f"{pr:.5f}",
            f"{corr:+.3f}",
        ]
        for name, (a, pr, corr) in res.items()
    ]
    return out, res


# -- (d) -------------------------------------------------------------------------------------------
MEM_CHILD = r"""
import json, resource, sys, torch, transformers, pyhook
from pyhook.source import Batch
mb, bs, buf = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
m = transformers.GPT2Model(transformers.GPT2Config(n_layer=1, n_embd=768, n_head=12, vocab_size=1000)).eval()
ctx, per = 128, 4
forwards = int(mb * 1e6 / (per * ctx * 768 * 4))
def src():
    g = torch.Generator().manual_seed(0)
    for i in range(forwards):
        ids = torch.randint(0, 1000, (per, ctx), generator=g)
        yield Batch(ids, torch.ones_like(ids), torch.ones(per, ctx, dtype=torch.bool), torch.arange(i * per, (i + 1) * per), None)
def rss_kb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() // 1024
with torch.no_grad():  # one forward first: the model's own working memory is not the stream's
    m(input_ids=torch.zeros(per, ctx, dtype=torch.long))
base = peak = rss_kb()
n = 0
for b in pyhook.stream(m, src(), "h.0", batch_size=bs, buffer_rows=buf):
    n += b["h.0"].shape[0]
    peak = max(peak, rss_kb())
print(json.dumps({"rows": n, "base_kb": base, "peak_kb": peak, "forwards": forwards}))
"""


def memory(sizes, bs, buf):
    out = []
    growth = []
    for mb in sizes:
        r = subprocess.run(
            [sys.executable, "-c", MEM_CHILD, str(mb), str(bs), str(buf)],
            capture_output=True,
            text=True,
            check=True,
        )
        d = json.loads(r.stdout.strip().splitlines()[-1])
        grow = (d["peak_kb"] - d["base_kb"]) / 1024
        bound = (buf + 3 * bs + 4 * 128) * (768 * 4 + 24) / 2**20  # buffer, queue, forward
        growth.append(grow)
        out.append(
            [
                f"{mb} MB of rows",
                f"{d['rows']:,}",
                f"{grow:.0f} MB",
                f"{bound:.0f} MB + the forward's own",
            ]
        )
    return out, growth


# -- (e) -------------------------------------------------------------------------------------------
def break_even(model, batches, layer, rounds):
    from pyhook.dataset import CaptureDataset

    tmp = tempfile.mkdtemp(prefix="bench-stream-")
    try:
        ts, tt, tr = [], [], []
        for r in range(rounds):
            t0 = time.perf_counter()
            streamed(model, batches, layer, 4096, 4 * 4096)
            ts.append(time.perf_counter() - t0)
            d = os.path.join(tmp, f"tee{r}")
            t0 = time.perf_counter()
            for _ in pyhook.stream(
                model, batches, layer, batch_size=4096, buffer_rows=4 * 4096, tee=d
            ):
                pass
            tt.append(time.perf_counter() - t0)
            ds = CaptureDataset(d, layer, batch_size=4096, shuffle=True, seed=r)
            t0 = time.perf_counter()
            n = 0
            for b in ds:
                n += len(b)
            tr.append(time.perf_counter() - t0)
            assert n > 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    s, t, rd = med(ts), med(tt), med(tr)
    # k passes: stream k*s; cache t + (k-1)*rd  ->  cheaper from k > (t - rd) / (s - rd)
    k = (t - rd) / (s - rd) if s > rd else float("inf")
    return [
        ["stream pass", f"{s:.2f} s"],
        ["stream pass with tee= (writes the cache)", f"{t:.2f} s"],
        ["read the cache, shuffled batches of 4096", f"{rd:.3f} s"],
        ["cache pays off from pass", f"{k:.2f}"],
    ], k


def main() -> None:
    import builtins
    import functools

    builtins.print = functools.partial(builtins.print, flush=True)  # a log file shows progress
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="~2 minutes: 4 blocks, fewer rounds")
    ap.add_argument("--only-a", action="store_true", help="section (a) and its pieces only")
    args = ap.parse_args()
    quick = args.quick
    n_layer = 4 if quick else 12
    layer = f"h.{n_layer // 2}"
    torch.manual_seed(0)
    model = gpt2_small(n_layer)
    ctx, per = 64, 4  # 256 tokens per forward
    forwards = 6 if quick else 16
    rounds_a = 12 if quick else 16
    per_round_forwards = 6 if quick else 8
    batches = make_batches(forwards, per, ctx)
    print(
        f"bench_stream: torch {torch.__version__}, python {platform.python_version()}, "
        f"{os.cpu_count()} cpus, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}; "
        f"GPT-2-small shape (d=768) with {n_layer} blocks, {per}x{ctx} tokens per forward, "
        f"capturing {layer}"
    )
    summary = []

    print("\n(a) producer-bound: tokens/s, bare forward loop vs stream (trainer step = 0)")
    rows, ratio, cratio, per_round, (lo, hi) = producer_bound(
        model, batches[:per_round_forwards], layer, rounds_a
    )
    print(table(rows, ["method", "tokens/s", "wall (median)", "CPU time (median)", "CPU/token"]))
    print(f"per-round wall ratios (stream / bare), load {lo:.1f}-{hi:.1f}: {per_round}")
    summary.append(
        ["(a) stream / bare forward, tokens/s", f"{ratio:.3f}x", ">= 0.95x", ratio >= 0.95]
    )
    summary.append(
        ["(a) the same in process CPU time", f"{cratio:.3f}x", "(>= 0.95x)", cratio >= 0.95]
    )
    print("\n(a') the pieces of a batch: per forward of 4x64 tokens, share of its CPU time")
    print(
        table(
            pieces(model, batches, layer, 6 if quick else 10),
            ["piece", "wall", "CPU", "of forward CPU"],
        )
    )

    if args.only_a:
        print(
            table(
                [[a, b, c, "yes" if d else "NO"] for a, b, c, d in summary],
                ["check", "measured", "target", "met"],
            )
        )
        return

    print("\n(b) consumer-bound: the trainer's wait for the next batch, share of its step time")
    rows, shares = consumer_bound(model, batches, layer, 2 if quick else 3)
    print(table(rows, ["trainer step", "forward", "first batch", "wait / step"]))
    for name, sh in zip(("sleep", "SAE"), shares):
        summary.append([f"(b) trainer wait, {name} step", f"{100 * sh:.1f}%", "<= 5%", sh <= 0.05])

    print(
        "\n(c) mixing quality at equal memory: buffer of 16 batches of 4096 rows, contexts of 128"
    )
    rows, res = mixing(2048 if quick else 4096, 128, 8, 4096, 16)
    print(
        table(
            rows,
            [
                "scheme",
                "same-ctx neighbours",
                "vs global",
                "vs window",
                "same-ctx pairs",
                "pos corr",
            ],
        )
    )
    ours = res["pyhook Mixer (random slots)"][0]
    win = res["shuffle of each buffer-sized window"][0]
    glob_ = res["global shuffle of the pass"][0]
    summary.append(
        [
            "(c) same-ctx neighbours vs window shuffle",
            f"{ours / win:.2f}x",
            "<= 1.2x",
            ours / win <= 1.2,
        ]
    )
    summary.append(
        [
            "(c) same-ctx neighbours vs global shuffle",
            f"{ours / glob_:.1f}x",
            "<= 1.2x",
            ours / glob_ <= 1.2,
        ]
    )

    print("\n(d) host memory of a stream pass (fresh process; RSS sampled per batch, growth)")
    sizes = (50, 200)
    rows, growth = memory(sizes, 1024, 8192)
    print(table(rows, ["rows streamed", "rows", "peak RSS growth", "bound (rows held)"]))
    same = growth[1] <= 1.15 * growth[0] + 16
    summary.append(
        ["(d) RSS growth 200 MB vs 50 MB", f"{growth[1]:.0f} vs {growth[0]:.0f} MB", "same", same]
    )

    print("\n(e) stream or cache (same batches; 4096-row batches, buffer of 4)")
    rows, _ = break_even(
        model, make_batches(forwards * 2, per, ctx, start=1), layer, 1 if quick else 2
    )
    print(table(rows, ["", "seconds"]))

    print(
        f"\nsummary (load {os.getloadavg()[0]:.2f}, peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB)"
    )
    print(
        table(
            [[a, b, c, "yes" if d else "NO"] for a, b, c, d in summary],
            ["check", "measured", "target", "met"],
        )
    )


if __name__ == "__main__":
    main()
