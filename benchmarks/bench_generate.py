"""Capture during ``model.generate`` against ``generate`` alone (issue 27).

Run:  python benchmarks/bench_generate.py [--quick] [--device cuda] [--out-dir DIR]

A GPT-2-small-shaped ``GPT2LMHeadModel`` (random weights from a transformers config: 12 blocks,
768 wide), 32 prompts of 8 to 40 tokens (left-padded, one batch) continued by 64 new tokens
(greedy, KV cache). In paired rounds (the order alternates every round):

* ``generate``: plain ``model.generate`` of the batch (the baseline: what a user runs anyway);
* ``capture``: :func:`pyhook.pipeline.generate.run_generate` under a disk capture of every
  block's output (``resid_post.*``, float32, with token ids, row index, generated flags and
  statistics), from entering the capture to the store closed (shards written and fsynced).

Prints one table: the median over rounds of each round's wall-clock ratio and of its process CPU
time ratio (user + sys of every thread, the writer's included), the load average, and the peak
resident memory of each side (sampled from /proc every 5 ms): the capture's peak over
``generate``'s must stay within ``max_host_bytes`` (256 MiB by default), as for any disk
capture (issue 23 item 2), met or MISSED; the rows a generation holds until its sequences are
final count against that budget with the rows waiting for the disk. ``--quick``: 8 prompts
x 16 new tokens, 3 rounds (under 2 minutes on 2 loaded cores).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time

import torch

try:  # the installed package (with its native core), else the source tree
    import pyhook
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import pyhook
from pyhook.pipeline.generate import prompt_batches, run_generate

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


class PeakRSS:
    """Peak resident set size of this process while the block runs (sampled every 5 ms)."""

    def __enter__(self) -> PeakRSS:
        self.peak = self.start = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _watch(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 prompts x 16 tokens, 3 rounds")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=None, help="prompts (one batch)")
    ap.add_argument("--new", type=int, default=None, help="new tokens a prompt")
    ap.add_argument("--out-dir", default=None, help="where the captures go (default: a temp dir)")
    args = ap.parse_args()
    import transformers

    prompts_n, new, rounds = (8, 16, 3) if args.quick else (32, 64, 5)
    rounds = args.rounds or rounds
    prompts_n, new = args.prompts or prompts_n, args.new or new
    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config()  # GPT-2 small: 12 x 768, 50257 tokens, 1024 positions
    model = transformers.GPT2LMHeadModel(cfg).eval().to(device)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(8, 41, (prompts_n,), generator=g).tolist()
    prompts = [torch.randint(0, 50000, (n,), generator=g).tolist() for n in lengths]
    # the baseline's inputs: the same left-padded batch run_generate makes
    width = max(lengths)
    pad = cfg.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    am = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    # EOS is a token no prompt holds and the random model does not emit first: every sequence
    # runs its 64 steps in both sides (the same work; the same kwargs for both)
    kw = dict(max_new_tokens=new, do_sample=False, pad_token_id=pad, eos_token_id=pad)
    root = args.out_dir or tempfile.mkdtemp(prefix="bench-generate-")
    out = os.path.join(root, "acts")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def plain() -> None:
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=am, **kw)
        sync()

    bound = 256 << 20  # a disk capture's default max_host_bytes
    held_peak = 0

    def captured() -> None:
        nonlocal held_peak
        with pyhook.capture(
            model, "resid_post.*", out=out, overwrite=True, max_host_bytes=bound
        ) as rec:
            run_generate(
                model,
                prompt_batches(prompts, batch_size=prompts_n),
                rec,
                max_new_tokens=new,
                eos_token_id=pad,
                pad_token_id=pad,
            )
        held_peak = max(held_peak, getattr(rec, "peak_held_bytes", 0))
        sync()

    fns = {"generate": plain, "capture": captured}
    for fn in fns.values():  # warm-up (allocator, kernels, page cache)
        fn()
    load_before = os.getloadavg()[0]
    wall: dict[str, list[float]] = {n: [] for n in fns}
    cpu: dict[str, list[float]] = {n: [] for n in fns}
    peak: dict[str, int] = dict.fromkeys(fns, 0)
    for r in range(rounds):
        order = list(fns) if r % 2 == 0 else list(fns)[::-1]
        for name in order:
            with PeakRSS() as mem:
                t0, c0 = time.perf_counter(), time.process_time()
                fns[name]()
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
            peak[name] = max(peak[name], mem.peak)
    reader = pyhook.open_capture(out)
    rows = reader.rows("resid_post.0")
    row_bytes = sum(reader.layer(n).to_tensor()[:1].nbytes for n in reader.layers) * rows
    gen_rows = int(reader.generated.sum())
    shutil.rmtree(root, ignore_errors=True)

    wall_ratio = statistics.median(c / p for c, p in zip(wall["capture"], wall["generate"]))
    cpu_ratio = statistics.median(c / p for c, p in zip(cpu["capture"], cpu["generate"]))
    print(
        f"bench_generate: GPT-2 small shape (random weights), {prompts_n} prompts of "
        f"{min(lengths)}-{max(lengths)} tokens x {new} new tokens, greedy, KV cache; "
        f"capture of {len(reader.layers)} layers (resid_post.*, float32) to disk"
    )
    print(
        f"device {device}, torch {torch.__version__}, {platform.processor() or platform.machine()}"
        f", {os.cpu_count()} cpus, {torch.get_num_threads()} threads; load {load_before:.2f} "
        f"before, {os.getloadavg()[0]:.2f} after; {rounds} paired rounds (order alternating)"
    )
    print(
        f"stored: {rows:,} rows a layer ({gen_rows:,} generated), {row_bytes / 1e6:,.1f} MB of "
        "rows a run"
    )
    print()
    print(f"{'':24}{'generate':>12}{'capture':>12}{'ratio':>10}   target")
    print(
        f"{'wall s (median)':24}{statistics.median(wall['generate']):12.3f}"
        f"{statistics.median(wall['capture']):12.3f}{wall_ratio:10.3f}   <= 1.10"
    )
    print(
        f"{'CPU s (median)':24}{statistics.median(cpu['generate']):12.3f}"
        f"{statistics.median(cpu['capture']):12.3f}{cpu_ratio:10.3f}"
    )
    over = peak["capture"] - peak["generate"]
    print(
        f"{'peak RSS MB':24}{peak['generate'] / 1e6:12.0f}{peak['capture'] / 1e6:12.0f}"
        f"{over / 1e6:+10.0f}   over <= {bound / 1e6:.0f} MB (max_host_bytes, 256 MiB): "
        + ("met" if over <= bound else "MISSED")
    )
    print(
        f"host bytes the capture counted (Recorder.peak_held_bytes): {held_peak / 1e6:,.0f} MB "
        f"at most, of which one prompt batch's rows: {row_bytes / 1e6:,.0f} MB"
    )
    print(
        "per round (capture/generate wall): "
        + " ".join(f"{c / p:.3f}" for c, p in zip(wall["capture"], wall["generate"]))
    )


if __name__ == "__main__":
    main()
