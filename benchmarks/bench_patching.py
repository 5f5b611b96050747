"""Patching and attribution (``pyhook.patching``) on the GPT-2-small shape, on the CPU.

GPT-2 small's shape (12 blocks, d=768, 12 heads, random weights), one clean/corrupt pair of a
short sequence. Each row times one whole call (clean and corrupt runs included), median of
``--rounds`` rounds run in rotating order, and prints the ratio the issue asks about:

(a) batched activation patching (``batch_size`` patches per forward) against a loop of single
    patched forwards (``batch_size=1``), over ``resid_pre.*`` at every position; target >= 3x;
(b) AtP over every (point, position) of ``resid_pre.*``, ``attn_out.*``, ``mlp_out.*`` against
    brute-force activation patching of the same sites: batched (measured), and the loop of
    single patched forwards (its time per forward measured in (a), times the number of
    forwards: running it takes too long on a loaded 2-core machine); target >= 50x;
(c) AtP* (GradDrop: one more backward per block) against AtP; target <= 3x;
(d) AtP with ``offload=True`` (source activations in host memory) against AtP, and per-head
    AtP over ``attn_z.*`` (12 x 12 heads x positions).

The machine's load (``os.getloadavg``) is printed before and after.

Run: ``python benchmarks/bench_patching.py`` (``--quick``: 1 round, shorter sequence).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import transformers as T

import pyhook
from pyhook.patching import activation_patch, attribution_patch

KEYS = (
    "patch resid_pre.*, loop (1/forward)",
    "patch resid_pre.*, batched ({bs}/forward)",
    "patch 3 kinds x 12, batched ({bs})",
    "AtP 3 kinds x 12",
    "AtP* 3 kinds x 12",
    "AtP 3 kinds x 12, offload",
)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seq", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--only", default="", help="run only the cases whose name contains this (e.g. AtP)"
    )
    args = p.parse_args()
    rounds = 1 if args.quick else args.rounds
    seq = 6 if args.quick else args.seq
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = T.GPT2Config(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=64)
    # the base model and the logit difference as a direction on the final hidden state (GPT-2
    # ties the unembedding to wte): the same metric without a 50,257-wide product per copy
    model = T.GPT2Model(cfg).eval()
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, 50257, (1, seq), generator=g)
    corrupt = clean.clone()
    corrupt[0, seq // 2] = (corrupt[0, seq // 2] + 1) % 50257
    answer, wrong = 11, 12

    direction = (model.wte.weight[answer] - model.wte.weight[wrong]).detach()

    def metric(out):
        return out.last_hidden_state[:, -1] @ direction

    load0 = os.getloadavg()
    print(
        f"pyhook {pyhook.__version__}, torch {torch.__version__}, transformers {T.__version__}, "
        f"threads={args.threads}, GPT-2-small shape (12 x 768, 12 heads, random weights), "
        f"sequence {seq}, medians of {rounds} rounds; load average {load0[0]:.1f} "
        f"({os.cpu_count()} cores)",
        flush=True,
    )
    resid = ["resid_pre.*"]
    sites = ["resid_pre.*", "attn_out.*", "mlp_out.*"]
    bs = args.batch_size
    cases: dict[str, Callable[[], object]] = {
        KEYS[0]: lambda: activation_patch(model, clean, corrupt, metric, resid, batch_size=1),
        KEYS[1].format(bs=bs): lambda: activation_patch(
            model, clean, corrupt, metric, resid, batch_size=bs
        ),
        KEYS[2].format(bs=bs): lambda: activation_patch(
            model, clean, corrupt, metric, sites, batch_size=bs
        ),
        KEYS[3]: lambda: attribution_patch(model, clean, corrupt, metric, sites),
        KEYS[4]: lambda: attribution_patch(model, clean, corrupt, metric, sites, method="atp*"),
        KEYS[5]: lambda: attribution_patch(model, clean, corrupt, metric, sites, offload=True),
        "AtP attn_z.* per head": lambda: attribution_patch(
            model, clean, corrupt, metric, ["attn_z.*"]
        ),
    }
    cases = {k: v for k, v in cases.items() if args.only in k}
    times: dict[str, list[float]] = {k: [] for k in cases}
    names = list(cases)
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            times[name].append(timed(cases[name]))
            print(f"  round {r + 1}: {name:40} {times[name][-1]:9.3f} s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{'case':40} {'seconds':>9}")
    for k in names:
        print(f"{k:40} {med[k]:9.3f}")

    n_sites = 36 * seq
    key = dict(zip(("loop", "batched", "batched3", "atp", "star", "off"), KEYS))
    m = {short: med.get(k.format(bs=bs)) for short, k in key.items()}
    ratios = []
    if m["loop"] and m["batched"]:
        ratios.append(
            (
                "(a) loop / batched activation patching, resid_pre.*",
                m["loop"] / m["batched"],
                ">= 3x",
            )
        )
    if m["atp"]:
        if m["loop"]:
            # the loop of single patched forwards over all 3 x 12 points is not run (hours on a
            # loaded 2-core machine): its time is (a)'s loop per forward (2 recording runs +
            # 12 x seq patched ones) times the 2 + 36 x seq forwards it would make
            loop3 = m["loop"] / (2 + 12 * seq) * (2 + n_sites)
            print(f"{'patch 3 kinds x 12, loop (from (a))':40} {loop3:9.3f}")
            ratios.append(
                (
                    f"(b) brute force (loop, from (a)) / AtP, {n_sites} sites",
                    loop3 / m["atp"],
                    ">= 50x",
                )
            )
        if m["batched3"]:
            ratios.append(
                (
                    f"(b) brute force (batched) / AtP, {n_sites} sites",
                    m["batched3"] / m["atp"],
                    "(info)",
                )
            )
        if m["star"]:
            ratios.append(("(c) AtP* / AtP", m["star"] / m["atp"], "<= 3x"))
        if m["off"]:
            ratios.append(("(d) AtP offload / AtP", m["off"] / m["atp"], "(info)"))
    print(f"\n{'ratio':56} {'value':>8} {'target':>8}")
    for label, value, target in ratios:
        print(f"{label:56} {value:8.2f} {target:>8}")
    load1 = os.getloadavg()
    print(f"\nload average after: {load1[0]:.1f} (before: {load0[0]:.1f})")


if __name__ == "__main__":
    main()
