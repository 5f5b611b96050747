"""Steering on batched ``generate`` (issue 50): per-row steering in one batch against a loop of
single-row generations, its cost over unsteered ``generate``, and the host-device
synchronisations that steering adds per step.

Run:  python benchmarks/bench_steer.py [--quick] [--device cuda]

A GPT-2-small-shaped ``GPT2LMHeadModel`` (random weights from a transformers config: 12 blocks,
768 wide), 8 prompts of 8 to 24 tokens (left-padded, one batch), 8 different steering vectors
(one a row, at ``resid_post.6``), greedy, KV cache. In paired rounds (order alternating):

* ``batched``: one ``generate`` of the 8 rows under ``steering(model, [spec_0, ..., spec_7])``;
* ``loop``: 8 ``generate`` calls of one row each, each under ``steering(model, spec_i)``;
* ``plain``: ``generate`` of the 8 rows, unsteered;
* ``conditional``: the batched run with every spec conditional (a :class:`pyhook.Probe` at
  ``resid_post.3`` deciding each row on its prompt) plus a second, windowed spec a row.

Prints the median over rounds of each round's wall-clock ratio and the synchronisations
(``.item()``, ``.tolist()``, ``bool(tensor)``, ``torch.equal``, ... made by pyhook's steering
and position code) per decode step, counted in a separate run. ``--quick``: 8 new tokens,
3 rounds.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

try:  # the installed package (with its native core), else the source tree
    import pyhook
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import pyhook

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# Tensor methods and functions that wait for the device (a host read of a tensor's values).
_SYNCING = {
    "item",
    "tolist",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "equal",
    "nonzero",
    "cpu",
    "numpy",
    "any_",
}


class SyncCounter(torch.overrides.TorchFunctionMode):
    """Counts the calls that read a tensor's values on the host (a synchronisation on a GPU)
    made from the given source files (pyhook's steering and positions by default)."""

    def __init__(self, files: tuple[str, ...] = ("steering.py", "positions.py")) -> None:
        super().__init__()
        self.files = files
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = getattr(func, "__name__", "")
        if name in _SYNCING or (name == "to" and any(str(a) == "cpu" for a in args[1:])):
            frame = sys._getframe(1)
            for _ in range(4):
                if frame is None:
                    break
                if frame.f_code.co_filename.endswith(self.files) and "pyhook" in (
                    frame.f_code.co_filename
                ):
                    self.count += 1
                    break
                frame = frame.f_back
        return func(*args, **(kwargs or {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 new tokens, 3 rounds")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--new", type=int, default=None, help="new tokens a prompt")
    args = ap.parse_args()
    import transformers

    new, rounds = (8, 3) if args.quick else (32, 5)
    new, rounds = args.new or new, args.rounds or rounds
    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config()  # GPT-2 small: 12 x 768
    model = transformers.GPT2LMHeadModel(cfg).eval().to(device)
    g = torch.Generator().manual_seed(1)
    rows = 8
    lengths = torch.randint(8, 25, (rows,), generator=g).tolist()
    prompts = [torch.randint(0, 50000, (n,), generator=g).tolist() for n in lengths]
    width = max(lengths)
    pad = cfg.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    am = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    vecs = [torch.randn(768, generator=g) for _ in range(rows)]
    specs = [pyhook.Steer("resid_post.6", v, scale=4.0) for v in vecs]
    probe = pyhook.Probe("resid_post.3", vecs[0], threshold=0.0)
    cond = [
        [
            pyhook.Steer("resid_post.6", v, scale=4.0, when=probe),
            pyhook.Steer("resid_post.8", v, op="ablate", prompt=[-1], generated=(0, 4)),
        ]
        for v in vecs
    ]
    kw = dict(max_new_tokens=new, do_sample=False, pad_token_id=pad, eos_token_id=pad)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def plain() -> None:
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=am, **kw)
        sync()

    def batched() -> None:
        with pyhook.steering(model, specs), torch.no_grad():
            model.generate(input_ids=ids, attention_mask=am, **kw)
        sync()

    def conditional() -> None:
        with pyhook.steering(model, cond), torch.no_grad():
            model.generate(input_ids=ids, attention_mask=am, **kw)
        sync()

    def loop() -> None:
        for i, p in enumerate(prompts):
            one = torch.tensor([p], device=device)
            with pyhook.steering(model, specs[i]), torch.no_grad():
                model.generate(input_ids=one, attention_mask=torch.ones_like(one), **kw)
        sync()

    fns = {"plain": plain, "batched": batched, "conditional": conditional, "loop": loop}
    for fn in fns.values():  # warm-up
        fn()
    counts = {}
    for name in ("batched", "conditional"):
        with SyncCounter() as c:
            fns[name]()
        counts[name] = c.count
    load_before = os.getloadavg()[0]
    wall: dict[str, list[float]] = {n: [] for n in fns}
    for r in range(rounds):
        order = list(fns) if r % 2 == 0 else list(fns)[::-1]
        for name in order:
            t0 = time.perf_counter()
            fns[name]()
            wall[name].append(time.perf_counter() - t0)

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(wall[a], wall[b]))

    print(
        f"bench_steer: GPT-2 small shape (random weights), {rows} prompts of "
        f"{min(lengths)}-{max(lengths)} tokens x {new} new tokens, greedy, KV cache; "
        f"{rows} different vectors (one a row) at resid_post.6"
    )
    print(
        f"device {device}, torch {torch.__version__}, {platform.processor() or platform.machine()}"
        f", {os.cpu_count()} cpus, {torch.get_num_threads()} threads; load {load_before:.2f} "
        f"before, {os.getloadavg()[0]:.2f} after; {rounds} rounds (order alternating)"
    )
    print()
    print(f"{'':44}{'median s':>10}")
    for name in fns:
        print(f"{name:44}{statistics.median(wall[name]):10.3f}")
    print()
    print(f"{'ratio':44}{'median':>10}   target")
    print(
        f"{'loop of 8 single-row / batched (speed-up)':44}{ratio('loop', 'batched'):10.2f}   >= 3"
    )
    print(f"{'batched steered / plain':44}{ratio('batched', 'plain'):10.3f}   <= 1.10")
    print(f"{'conditional + windowed / plain':44}{ratio('conditional', 'plain'):10.3f}   <= 1.10")
    steps = new - 1  # decode steps after the prefill
    for name, n in counts.items():
        print(
            f"host reads by steering ({name}): {n} in one generate of {new} tokens "
            f"({steps} decode steps): {n / steps:.2f} per step (target 0; the prefill may "
            "read prompt lengths once to check prompt indices)"
        )


if __name__ == "__main__":
    main()
