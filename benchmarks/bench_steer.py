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
* ``loop_plain``: the same loop unsteered (what batching itself gains on this machine: the
  ceiling of ``loop / batched``);
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

# Tensor methods and functions that read a tensor's values on the host (a wait for the device
# on a GPU); .to()/.cpu() count when they bring a device tensor to the host.
_SYNCING = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "equal", "nonzero"}
_MOVES = {"to", "cpu", "numpy"}


class SyncCounter(torch.overrides.TorchFunctionMode):
    """Counts the calls that read a tensor's values on the host (a synchronisation on a GPU)
    made from the given source files (pyhook's steering and positions by default)."""

    def __init__(self, files: tuple[str, ...] = ("steering.py", "positions.py")) -> None:
        super().__init__()
        self.files = files
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = getattr(func, "__name__", "")
        moved = (
            name in _MOVES
            and isinstance(args[0], torch.Tensor)
            and args[0].device.type != "cpu"
            and (name != "to" or any(str(a) == "cpu" for a in args[1:]))
        )
        if name in _SYNCING or moved:
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
    # every row runs all its steps in every configuration (steering changes the tokens: a
    # steered batch that reached EOS early would do less work than the plain one)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad)

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

    def loop_plain() -> None:
        for p in prompts:
            one = torch.tensor([p], device=device)
            with torch.no_grad():
                model.generate(input_ids=one, attention_mask=torch.ones_like(one), **kw)
        sync()

    fns = {
        "plain": plain,
        "batched": batched,
        "conditional": conditional,
        "loop": loop,
        "loop_plain": loop_plain,
    }
    for fn in fns.values():  # warm-up
        fn()
    counts = {}  # host reads by steering in each forward of one generate
    for name in ("batched", "conditional"):
        c = SyncCounter()
        per_forward: list[int] = []
        handle = model.register_forward_hook(
            lambda *_, c=c, per_forward=per_forward: per_forward.append(c.count)
        )
        try:
            with c:
                fns[name]()
        finally:
            handle.remove()
        counts[name] = [b - a for a, b in zip([0, *per_forward], per_forward)]
    load_before = os.getloadavg()[0]
    wall: dict[str, list[float]] = {n: [] for n in fns}
    cpu: dict[str, list[float]] = {n: [] for n in fns}
    for r in range(rounds):
        order = list(fns) if r % 2 == 0 else list(fns)[::-1]
        for name in order:
            t0, c0 = time.perf_counter(), time.process_time()
            fns[name]()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)

    def ratio(a: str, b: str, of: dict[str, list[float]] = wall) -> float:
        return statistics.median(x / y for x, y in zip(of[a], of[b]))

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
    print(f"{'':44}{'wall s':>10}{'CPU s':>10}   (medians)")
    for name in fns:
        print(f"{name:44}{statistics.median(wall[name]):10.3f}{statistics.median(cpu[name]):10.3f}")
    print()
    print(f"{'ratio (median of rounds)':44}{'wall':>10}{'CPU':>10}   target")
    for label, a, b, target in (
        ("loop of 8 single-row / batched (speed-up)", "loop", "batched", ">= 3"),
        ("  the same unsteered (batching's own gain)", "loop_plain", "plain", ""),
        ("batched steered / plain", "batched", "plain", "<= 1.10"),
        ("conditional + windowed / plain", "conditional", "plain", "<= 1.10"),
    ):
        print(f"{label:44}{ratio(a, b):10.3f}{ratio(a, b, cpu):10.3f}   {target}")
    for name, per in counts.items():
        print(
            f"host reads by steering ({name}), per forward: prefill {per[0]}, decode steps "
            f"{per[1:]} (target 0 a step; the prefill reads the prompt lengths once when a "
            "spec has prompt indices)"
        )


if __name__ == "__main__":
    main()
