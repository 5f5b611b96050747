"""What splicing dictionaries costs: the extra time of a forward with ``pyhook.splice`` against
one encode + decode of the same dictionaries on the same tensors.

The target (issue 51): splicing with the error term costs at most 1.1x one encode + decode per
site, not two (SAELens' error term runs each SAE a second time). Printed as ratios:

* ``splice, error term``: (spliced forward - plain forward) / (encode + decode of every site);
  without autograd and without an edit pyhook skips the decoder, so this is below 1;
* ``splice, error term, autograd on``: the same with the decoder run for the features' gradient
  path (both forwards, and the encode + decode it is divided by, with autograd on);
* ``splice, error=False``: the sites replaced by the reconstructions;
* ``two passes (SAELens' error term)``: plain hooks that encode + decode once for the
  reconstruction and once more for the error term, for comparison.

Usage: ``python benchmarks/bench_splice.py [--d 256] [--layers 4] [--expansion 16]
[--tokens 1024] [--repeat 7]``. A GPT-2 built from a config (random weights) on the CPU, or on
CUDA with ``--device cuda``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import transformers
from torch import nn

import pyhook


class SAE(nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.W_enc = nn.Parameter(torch.randn(d, n) / d**0.5)
        self.b_enc = nn.Parameter(torch.zeros(n) - 0.5)
        self.W_dec = nn.Parameter(torch.randn(n, d) / n**0.5)
        self.b_dec = nn.Parameter(torch.zeros(d))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu((x - self.b_dec) @ self.W_enc + self.b_enc)

    def decode(self, f: torch.Tensor) -> torch.Tensor:
        return f @ self.W_dec + self.b_dec


def _time(fn, repeat: int, sync) -> float:
    times = []
    for _ in range(repeat):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return min(times)  # the least disturbed run: the machine may be shared


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--expansion", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_embd=a.d,
        n_layer=a.layers,
        n_head=max(1, a.d // 64),
        vocab_size=1024,
        n_positions=1024,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(cfg).eval().to(dev)
    seq = min(128, a.tokens)
    ids = torch.randint(0, 1024, (max(1, a.tokens // seq), seq), device=dev)
    dicts = {f"resid_post.{i}": SAE(a.d, a.expansion * a.d).to(dev) for i in range(a.layers)}

    with torch.no_grad(), pyhook.TraceDict(model, list(dicts)) as tr:
        model(ids)
    sites = {k: tr[k].output.clone() for k in dicts}

    def encode_decode() -> None:
        with torch.no_grad():
            for k, d in dicts.items():
                d.decode(d.encode(sites[k]))

    def encode_decode_grad() -> None:
        for k, d in dicts.items():
            d.decode(d.encode(sites[k]))

    def plain() -> None:
        with torch.no_grad():
            model(ids)

    def spliced(error: bool = True) -> None:
        with torch.no_grad(), pyhook.splice(model, dicts, error=error):
            model(ids)

    def plain_grad() -> None:
        model(ids)

    def spliced_grad() -> None:
        with pyhook.splice(model, dicts):
            model(ids)

    def two_passes() -> None:
        def fn(x, hook):
            d = dicts[hook.name]
            x_hat = d.decode(d.encode(x))
            err = x - d.decode(d.encode(x))  # SAELens: a second pass for the error term
            return x_hat + err

        with torch.no_grad(), pyhook.hooks(model, fwd_hooks=[(k, fn) for k in dicts]):
            model(ids)

    # Interleaved: every repetition runs each case once, and each case keeps its fastest run,
    # so a burst of load on a shared machine hits all cases alike.
    cases = {
        "ed": encode_decode,
        "ed_grad": encode_decode_grad,
        "plain": plain,
        "plain_grad": plain_grad,
        "splice": spliced,
        "splice_grad": spliced_grad,
        "replace": lambda: spliced(False),
        "two": two_passes,
    }
    best = {k: _time(fn, 1, sync) for k, fn in cases.items()}
    for _ in range(a.repeat - 1):
        for k, fn in cases.items():
            best[k] = min(best[k], _time(fn, 1, sync))
    t_ed, t_plain = best["ed"], best["plain"]
    rows = [
        ("splice, error term", best["splice"] - t_plain, t_ed),
        (
            "splice, error term, autograd on",
            best["splice_grad"] - best["plain_grad"],
            best["ed_grad"],
        ),
        ("splice, error=False", best["replace"] - t_plain, t_ed),
        ("two passes (SAELens' error term)", best["two"] - t_plain, t_ed),
    ]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"GPT-2 d={a.d} layers={a.layers}, {a.layers} SAEs of {a.expansion * a.d} features, "
        f"{ids.numel()} tokens, {dev.type}, threads={torch.get_num_threads()}, "
        f"load average {load:.1f}"
    )
    print(
        f"plain forward {t_plain * 1e3:.1f} ms; encode + decode of every site {t_ed * 1e3:.1f} ms"
    )
    print(f"{'':34s} {'extra ms':>9s} {'x (encode + decode)':>20s}")
    for name, extra, ref in rows:  # (autograd on: against encode + decode with autograd on)
        print(f"{name:34s} {extra * 1e3:9.1f} {extra / ref:20.2f}")


if __name__ == "__main__":
    main()
