"""FlexModel's gather of a tensor-parallel activation against a hand-written all-gather hook.

Two gloo ranks spawned on this machine, each holding half of a column-parallel ``nn.Linear``
(``--width`` inputs, ``--hidden`` outputs: each rank computes ``hidden / 2`` features of a
``--batch`` x ``--tokens`` input). Variants, each timed over ``--steps`` forwards, in rounds of
every variant in rotating order (rank 0's wall time; the ranks start each variant together):

- ``bare``: the sharded layer alone, for scale;
- ``hand-written``: a ``register_forward_hook`` that all-gathers the shards (``dist.all_gather``
  + ``torch.cat``) and keeps a copy of the full activation on rank 0: the least a gathering save
  does;
- ``FlexModel save``: ``FlexModel`` + ``HookFunction(expected_shape=(None, None, hidden))``, no
  editing function: the full activation is gathered to rank 0 and saved there;
- ``FlexModel edit``: the same with an identity editing function: every rank gets the full
  activation, runs the edit and keeps its own slice again.

The table gives medians of the per-round ratios to ``hand-written``. Run:
``python benchmarks/bench_flex.py`` (``--quick``: fewer steps and rounds, under a minute).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

VARIANTS = ["bare", "hand-written", "FlexModel save", "FlexModel edit"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _identity(current_module, inputs, save_ctx, modules):
    return inputs


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # one core per rank
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from pyhook.flex import FlexModel, HookFunction

    torch.manual_seed(0)
    layer = nn.Linear(args.width, args.hidden // world)  # this rank's shard of the features
    x = torch.randn(args.batch, args.tokens, args.width)
    kept: dict[str, torch.Tensor] = {}

    def gather_hook(_m: nn.Module, _a: object, o: torch.Tensor) -> None:
        parts = [torch.empty_like(o) for _ in range(world)]
        dist.all_gather(parts, o.contiguous())
        if rank == 0:
            kept["full"] = torch.cat(parts, -1).clone()

    def run(name: str) -> float:
        handle = fm = None
        if name == "hand-written":
            handle = layer.register_forward_hook(gather_hook)
            model: nn.Module = layer
        elif name.startswith("FlexModel"):
            fm = FlexModel(layer, {}, tensor_parallel_size=world)
            edit = _identity if name.endswith("edit") else None
            fm.register_forward_hook(
                HookFunction("", expected_shape=(None, None, args.hidden), editing_function=edit)
            )
            model = fm
        else:
            model = layer
        try:
            with torch.no_grad():
                model(x)  # warm-up
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    model(x)
                dist.barrier()
                return time.perf_counter() - t0
        finally:
            if handle is not None:
                handle.remove()
            if fm is not None:
                fm.restore()

    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        for name in order:
            times[name].append(run(name))
    if rank == 0:
        torch.save(times, out)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=50, help="forwards per variant and round")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--hidden", type=int, default=3072)
    args = p.parse_args()
    if args.quick:
        args.rounds, args.steps = 3, 10
    world = 2
    import pyhook

    print(
        f"FlexModel gather: {world} gloo ranks, one thread each, a column-parallel Linear "
        f"{args.width} -> {args.hidden} ({args.hidden // world} features a rank), input "
        f"{args.batch} x {args.tokens} x {args.width}, {args.steps} forwards a variant and round, "
        f"{args.rounds} rounds; pyhook {pyhook.__version__} from {os.path.dirname(pyhook.__file__)}"
        f"; load {os.getloadavg()[0]:.2f}"
    )
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "times.pt")
        mp.spawn(_worker, args=(world, _free_port(), args, out), nprocs=world, join=True)
        times = torch.load(out)
    base = times["hand-written"]
    print(f"load after {os.getloadavg()[0]:.2f}\n")
    print("| variant | ms a forward (median) | / hand-written (median) | range |")
    print("|---|---|---|---|")
    for name in VARIANTS:
        ratios = [t / b for t, b in zip(times[name], base)]
        ms = statistics.median(times[name]) / args.steps * 1e3
        print(
            f"| {name} | {ms:.3f} | {statistics.median(ratios):.3f}x | "
            f"{min(ratios):.3f}-{max(ratios):.3f} |"
        )


if __name__ == "__main__":
    main()
