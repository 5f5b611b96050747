"""Capture on large-model layouts: tensor parallelism and offloading (issue 44 item 5).

Run:  python benchmarks/bench_large.py [--quick] [--rounds N]

Prints a table of ratios (median over paired rounds; each round times both sides back to back,
each side a loop of ``--forwards`` forwards, the capture's rows joined by ``results()``):

(a) tensor parallel: 2 gloo ranks on this machine run a Llama model of GPT-2-small's shape
    (768 wide, 12 layers, 12 heads, 3072 MLP; random weights) loaded with transformers'
    ``DistributedConfig(tp_plan="auto")``; the forward alone against the forward inside ``capture(to="host")`` of
    every block's output (``resid_post.*``), and of every block plus every sharded MLP hidden
    activation (``mlp_hidden.*``: gathered from the ranks by pyhook's layout layer).
    Target: every-block capture <= 1.1x the forward alone.
(b) offloaded: one process runs GPT-2-small (random weights) under accelerate's
    ``cpu_offload`` (weights moved in for each module's forward); the forward alone against
    the forward inside a capture of every block. Target: <= 1.05x.

``--device cuda``: the same on GPUs. (b) moves the weights onto the GPU for each module's
forward; (a) needs two GPUs (NCCL runs no two ranks on one device) and is skipped, with the
reason printed, when there is one.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

try:  # the installed package (with its native core), else the source tree
    import pyhook  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pyhook.capture import capture

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _paired(forward, captured, rounds: int) -> tuple[float, float, float]:
    """Median forward seconds, median captured seconds, median per-round ratio."""
    forward()
    captured()  # warm-up (buffers, first-call costs)
    fs, cs, ratios = [], [], []
    for i in range(rounds):
        order = (forward, captured) if i % 2 == 0 else (captured, forward)
        t = {}
        for fn in order:
            t0 = time.perf_counter()
            fn()
            t[fn] = time.perf_counter() - t0
        fs.append(t[forward])
        cs.append(t[captured])
        ratios.append(t[captured] / t[forward])
    return statistics.median(fs), statistics.median(cs), statistics.median(ratios)


def _llama_small(path: str, layers: int) -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=12,
        vocab_size=8192,
        max_position_embeddings=1024,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _tp_rank(rank: int, world: int, port: int, path: str, args: argparse.Namespace) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    import transformers
    from transformers.distributed import DistributedConfig

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_plan="auto")
    ).eval()
    n = model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.tokens))
    if cuda:
        ids = ids.cuda()
    out = {}

    def forward():
        with torch.no_grad():
            for _ in range(args.forwards):
                model(ids)
        _sync(args.device)
        dist.barrier()

    def capture_of(layers):
        def run():
            with torch.no_grad(), capture(model, layers, to="host") as rec:
                for _ in range(args.forwards):
                    model(ids)
            rec.results()
            _sync(args.device)
            dist.barrier()

        return run

    blocks = [f"resid_post.{i}" for i in range(n)]
    hidden = blocks + [f"mlp_hidden.{i}" for i in range(n)]
    out["blocks"] = _paired(forward, capture_of(blocks), args.rounds)
    out["blocks+hidden"] = _paired(forward, capture_of(hidden), args.rounds)
    if rank == 0:
        torch.save(out, os.path.join(os.path.dirname(path), "tp.pt"))
    dist.destroy_process_group()


def bench_tp(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "llama")
        _llama_small(path, args.layers)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_tp_rank, args=(2, port, path, args), nprocs=2)
        return torch.load(os.path.join(tmp, "tp.pt"))


def bench_offload(args: argparse.Namespace) -> dict:
    import accelerate
    import transformers

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=args.layers, vocab_size=8192)  # GPT-2-small's shape
    model = accelerate.cpu_offload(
        transformers.GPT2LMHeadModel(cfg).eval(), execution_device=args.device
    )
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.tokens), device=args.device)
    blocks = [f"resid_post.{i}" for i in range(cfg.n_layer)]

    def forward():
        with torch.no_grad():
            for _ in range(args.forwards):
                model(ids)
        _sync(args.device)

    def captured():
        with torch.no_grad(), capture(model, blocks, to="host") as rec:
            for _ in range(args.forwards):
                model(ids)
        rec.results()
        _sync(args.device)

    return {"blocks": _paired(forward, captured, args.rounds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 layers, 3 rounds")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--forwards", type=int, default=4, help="forwards per timed loop")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    if args.quick:
        args.layers, args.rounds = 4, 3
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, device {args.device}, load {os.getloadavg()[0]:.1f}; "
        f"batch {args.batch} x "
        f"{args.tokens} tokens, {args.layers} layers, {args.forwards} forwards per loop, "
        f"{args.rounds} paired rounds, "
        f"{args.threads} thread(s) per process"
    )
    rows = []
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print(
            f"tensor parallel: skipped, {torch.cuda.device_count()} GPU (2 ranks need 2 GPUs: "
            "NCCL runs no two ranks on one device)"
        )
    else:
        backend = "nccl" if args.device == "cuda" else "gloo"
        for what, res in bench_tp(args).items():
            rows.append(
                (f"tensor parallel, 2 {backend} ranks", what, *res, 1.1 if what == "blocks" else None)
            )
    for what, res in bench_offload(args).items():
        rows.append(("offloaded (accelerate cpu_offload)", what, *res, 1.05))
    print(f"{'layout':36} {'captured':14} {'forward s':>10} {'capture s':>10} {'ratio':>7} target")
    for layout, what, f, c, r, target in rows:
        goal = f"<= {target}x {'ok' if r <= target else 'MISSED'}" if target else "-"
        print(f"{layout:36} {what:14} {f:10.3f} {c:10.3f} {r:7.3f} {goal}")


if __name__ == "__main__":
    main()
