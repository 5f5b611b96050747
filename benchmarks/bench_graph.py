"""Attribution graphs: peak memory and time against prompt length, dense against streamed.

A small Llama-shaped model from a config (``--layers`` x ``--hidden``, random weights, float32,
CPU) with a random top-k transcoder at every layer (``--features`` features, ``k`` active per
token), one prompt of ``T`` random tokens. Two builds of :func:`pyhook.attribution_graph`:

- ``dense``: every active feature gets its row of edges (``max_feature_nodes=None``, what
  circuit-tracer builds when nothing is pruned): the buffer is (active features + logits) x
  (active features + errors + tokens), the square of the active features;
- ``streamed``: ``max_feature_nodes=--keep`` (ranked by influence as they are computed): the
  buffer is (kept + logits) x (active features + errors + tokens), linear in the prompt.

Each (build, T) runs in a fresh process; the table gives wall time, the process's peak resident
memory (``ru_maxrss``: model, forward of ``--batch`` copies kept for the backward passes, buffer),
and the edge buffer's size. A dense build whose buffer alone would pass ``--dense-cap`` GiB is
skipped (said so), as is any length after one that took longer than ``--budget`` seconds.

Run: ``python benchmarks/bench_graph.py`` (``--lengths 128,256,...``; ``--quick``: 128 and 256).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def build(args: argparse.Namespace, T: int, mode: str) -> dict:
    import torch
    import transformers

    import pyhook

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    cfg = transformers.LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=args.vocab,
        max_position_embeddings=max(4096, T),
    )
    model = transformers.LlamaForCausalLM(cfg).eval()

    class TopK(torch.nn.Module):
        def __init__(self, d: int, n: int, k: int) -> None:
            super().__init__()
            self.k = k
            self.W_enc = torch.nn.Parameter(torch.randn(d, n) / d**0.5)
            self.b_enc = torch.nn.Parameter(torch.zeros(n))
            self.W_dec = torch.nn.Parameter(torch.randn(n, d) / n**0.5)
            self.b_dec = torch.nn.Parameter(torch.zeros(d))

        def encode(self, x: torch.Tensor) -> torch.Tensor:
            pre = x @ self.W_enc + self.b_enc
            v, i = pre.topk(self.k, dim=-1)
            return torch.zeros_like(pre).scatter(-1, i, torch.relu(v))

        def decode(self, f: torch.Tensor) -> torch.Tensor:
            return f @ self.W_dec + self.b_dec

    tcs = {
        (f"mlp_in.{i}", f"mlp_out.{i}"): TopK(args.hidden, args.features, args.k)
        for i in range(args.layers)
    }
    ids = torch.randint(0, args.vocab, (T,))
    keep = None if mode == "dense" else args.keep
    t0 = time.perf_counter()
    g = pyhook.attribution_graph(
        model, tcs, ids, max_feature_nodes=keep, batch_size=args.batch, max_n_logits=args.logits
    )
    secs = time.perf_counter() - t0
    n_active = g.n_active_features
    rows = (n_active if keep is None else min(keep, n_active)) + len(g.logit_tokens)
    cols = n_active + (args.layers + 1) * T
    return {
        "T": T,
        "mode": mode,
        "secs": secs,
        "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "buffer_gib": rows * cols * 4 / 2**30,
        "active": n_active,
        "kept": g.n_features,
        "completeness": g.completeness_error(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="128,256,512,1024,2048,4096")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--features", type=int, default=1024)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--keep", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--logits", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dense-cap", type=float, default=2.0)
    p.add_argument("--budget", type=float, default=600.0)
    p.add_argument("--modes", default="streamed,dense")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        T, mode = args.one.split(":")
        print(json.dumps(build(args, int(T), mode)))
        return
    lengths = [128, 256] if args.quick else [int(x) for x in args.lengths.split(",")]
    load = os.getloadavg()[0]
    print(
        f"# {args.layers} layers x {args.hidden}, {args.features} features (top-{args.k}) per "
        f"layer, keep {args.keep}, batch {args.batch}, {args.threads} thread(s); load {load:.1f}"
    )
    print("| T | build | active features | kept | time (s) | peak RSS (GiB) | edge buffer (GiB) |")
    print("|---|---|---|---|---|---|---|")
    base = [sys.executable, __file__] + [a for a in sys.argv[1:] if a != "--quick"]
    slow: set[str] = set()
    for T in lengths:
        for mode in args.modes.split(","):
            active = args.layers * args.k * T
            dense_gib = (active + args.logits) * (active + (args.layers + 1) * T) * 4 / 2**30
            if mode in slow:
                print(
                    f"| {T} | {mode} | | | skipped: the previous length took > {args.budget:.0f} s | | |"
                )
                continue
            if mode == "dense" and dense_gib > args.dense_cap:
                print(
                    f"| {T} | {mode} | ~{active} | | skipped: the buffer alone would be "
                    f"{dense_gib:.1f} GiB (> --dense-cap) | | {dense_gib:.1f} |"
                )
                continue
            out = subprocess.run([*base, "--one", f"{T}:{mode}"], capture_output=True, text=True)
            if out.returncode != 0:
                print(f"| {T} | {mode} | failed: {out.stderr.strip().splitlines()[-1]} | | | | |")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            assert r["completeness"] < 1e-2, r
            print(
                f"| {T} | {mode} | {r['active']} | {r['kept']} | {r['secs']:.1f} | "
                f"{r['peak_gib']:.2f} | {r['buffer_gib']:.3f} |",
                flush=True,
            )
            if r["secs"] > args.budget:
                slow.add(mode)


if __name__ == "__main__":
    main()
