"""Per-traced-layer overhead of ``pyhook.TraceDict`` vs the raw forward and vs hand-written hooks.

Both sides pay what a user pays for every ``with`` block: name lookup, registration, the hook
calls, and removal. The hand-written side is the tightest equivalent code:
``model.get_submodule(name).register_forward_hook(store)`` for each layer, then ``remove()``.

Run: ``python benchmarks/bench_trace.py`` (one run prints the whole table; medians of many
repeats, so it is robust to the noise of a shared machine).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import pyhook


def median_time(fn: Callable[[], object], repeat: int, inner: int) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def hand_written(model: nn.Module, names: list[str], run: Callable[[], object], clone: bool) -> dict:
    store: dict[str, torch.Tensor] = {}
    handles = []
    for name in names:
        def hook(_m, _a, out, name=name):
            if clone:  # hand-written equivalent of clone=True for a tensor or a tuple output
                out = out.clone() if isinstance(out, torch.Tensor) else tuple(
                    o.clone() if isinstance(o, torch.Tensor) else o for o in out
                )
            store[name] = out
        handles.append(model.get_submodule(name).register_forward_hook(hook))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return store


def pyhook_trace(model: nn.Module, names: list[str], run: Callable[[], object], clone: bool) -> dict:
    with pyhook.TraceDict(model, names, clone=clone) as td:
        run()
    return {n: t.output for n, t in td.items()}


def deep_model(n_layers: int = 400, width: int = 16) -> nn.Module:
    blocks = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(n_layers // 2)]
    return nn.Sequential(*blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt = GPT2LMHeadModel(
        GPT2Config(n_layer=12, n_embd=256, n_head=4, vocab_size=1000, n_positions=128,
                   bos_token_id=0, eos_token_id=0)
    ).eval()
    ids = torch.randint(0, 1000, (2, 32))
    deep = deep_model().eval()
    xs = torch.randn(4, 16)
    cases = [
        ("gpt2-12L: 12 blocks", gpt, [f"transformer.h.{i}" for i in range(12)], lambda: gpt(ids)),
        ("gpt2-12L: 48 submodules", gpt,
         [f"transformer.h.{i}.{s}" for i in range(12) for s in ("attn", "mlp", "ln_1", "ln_2")],
         lambda: gpt(ids)),
        ("deep-400: 200 layers", deep, [f"{i}.0" for i in range(200)], lambda: deep(xs)),
    ]
    print(f"pyhook {pyhook.__version__}, backend={pyhook.get_backend()}, torch {torch.__version__}, "
          f"threads={torch.get_num_threads()}")
    header = (f"{'case':28} {'clone':>5} {'raw ms':>8} {'hand ms':>8} {'pyhook ms':>9} "
              f"{'hand us/layer':>13} {'pyhook us/layer':>15} {'pyhook/hand overhead':>20}")
    print(header)
    print("-" * len(header))
    with torch.no_grad():
        for label, model, names, run in cases:
            for clone in (False, True):
                inner = 20 if "deep" in label else 5
                raw = median_time(run, args.repeat, inner)
                hand = median_time(lambda: hand_written(model, names, run, clone), args.repeat, inner)
                ours = median_time(lambda: pyhook_trace(model, names, run, clone), args.repeat, inner)
                ho = (hand - raw) / len(names) * 1e6
                po = (ours - raw) / len(names) * 1e6
                print(f"{label:28} {str(clone):>5} {raw * 1e3:8.3f} {hand * 1e3:8.3f} {ours * 1e3:9.3f} "
                      f"{ho:13.2f} {po:15.2f} {po / ho if ho > 0 else float('nan'):20.2f}")


if __name__ == "__main__":
    main()
