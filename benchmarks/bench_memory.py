"""Host memory of a capture: the RSS a capture adds to the forward's own, and what stays after.

Run:  python benchmarks/bench_memory.py [--quick | --full] [--batches N] [--out-dir DIR]

A GPT-2-small-shaped model (random weights: 12 blocks, width 768) runs batches of 8 x 256
tokens; every block's output is captured (12 x 2048 rows x 768 float32 = 75.5 MB a batch).
Each configuration runs in a fresh Python process, which samples its own RSS
(``/proc/self/statm``) every 5 ms in a background thread, through three phases:

1. forward only, a few batches: the forward's own working memory (its peak RSS is the baseline);
2. the capture over ``--batches`` batches (``--full``: 40 batches, 3.0 GB on disk;
   ``--quick``: 8 batches, 0.6 GB), in the same process;
3. after ``close()``: the RSS left over.

Printed per configuration: the peak RSS of phase 2 above phase 1's peak ("extra", the goal is
<= 256 MB by default whatever the capture's size), RSS after close above the RSS before the
capture ("left", goal <= 64 MB), and the time per batch of the capture against the forward
alone. Configurations: the default disk capture; the same with the memory budget raised
(``max_host_bytes=1 GiB``: larger shards and pools, for speed); a host capture of a few batches
followed by ``rec.results()``, as bytes held over the bytes of the rows (goal: 1.0x, the rows
once).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

MB = 1 << 20
BATCH, TOKENS, WIDTH, BLOCKS = 8, 256, 768, 12


class RssSampler:
    """Samples this process's resident set size in a background thread."""

    def __init__(self, every: float = 0.005) -> None:
        self.every = every
        self._page = os.sysconf("SC_PAGE_SIZE")
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.every)

    def reset(self) -> int:
        now = self.rss()
        self.peak = now
        return now

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def model():
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=BLOCKS, n_embd=WIDTH, n_head=12, n_positions=1024, vocab_size=50257
    )
    return transformers.GPT2Model(cfg).eval()


def child(config: str, batches: int, fwd_batches: int, out_dir: str) -> dict:
    import torch

    from pyhook.capture import capture
    from pyhook.offload import trim_host_memory

    net = model()
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 50257, (BATCH, TOKENS), generator=g) for _ in range(4)]
    sampler = RssSampler()
    result: dict = {"config": config}
    with torch.inference_mode():
        net(input_ids=ids[0])  # warm-up
        start = sampler.reset()
        t0 = time.perf_counter()
        for i in range(fwd_batches):
            net(input_ids=ids[i % 4])
        fwd_time = (time.perf_counter() - t0) / fwd_batches
        fwd_peak = sampler.peak
        trim_host_memory()  # "before" and "after" are both measured trimmed (close trims)
        before = sampler.reset()
        opts: dict = {}
        if config == "disk-1GiB":
            opts["max_host_bytes"] = 1 << 30
        if config.startswith("disk"):
            out = tempfile.mkdtemp(dir=out_dir)
            opts["out"] = out
        times = []
        with capture(net, "h.*", **opts) as rec:
            for i in range(batches):
                t = time.perf_counter()
                net(input_ids=ids[i % 4])
                times.append(time.perf_counter() - t)
            if config == "host-results":
                held_before = sampler.rss()
                res = rec.results()
                nbytes = sum(t.nbytes for t in res.values())
        cap_peak = sampler.peak
        if config == "host-results":
            trim_host_memory()
            result["results_bytes"] = nbytes
            result["held_over_rows"] = (sampler.rss() - before) / nbytes
            result["results_call_extra"] = sampler.rss() - held_before
            del rec, res
        import gc

        gc.collect()
        time.sleep(0.2)
        after = sampler.rss()
    sampler.stop()
    result.update(
        start_mb=start / MB,
        fwd_peak_mb=fwd_peak / MB,
        cap_peak_mb=cap_peak / MB,
        extra_mb=(cap_peak - fwd_peak) / MB,
        left_mb=(after - before) / MB,
        captured_mb=batches * BATCH * TOKENS * WIDTH * 4 * BLOCKS / MB,
        fwd_s=fwd_time,
        cap_s=statistics.median(times),
    )
    if config.startswith("disk"):
        import shutil

        shutil.rmtree(opts["out"], ignore_errors=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="8 batches (0.6 GB)")
    mode.add_argument("--full", action="store_true", help="40 batches (3.0 GB)")
    ap.add_argument("--batches", type=int, help="batches of the disk captures")
    ap.add_argument("--out-dir", default=None, help="where the captures are written")
    ap.add_argument("--configs", default="disk-default,disk-1GiB,host-results")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--fwd-batches", type=int, default=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    batches = args.batches or (40 if args.full else 8)
    out_dir = args.out_dir or tempfile.gettempdir()
    if args.child:
        print(json.dumps(child(args.child, batches, args.fwd_batches, out_dir)))
        return
    print(
        f"# bench_memory: {platform.platform()}, {os.cpu_count()} cores, python {platform.python_version()}"
    )
    print(
        f"# GPT-2-small shape ({BLOCKS} blocks x {WIDTH}), {BATCH}x{TOKENS} tokens a batch, "
        f"{BLOCKS * BATCH * TOKENS * WIDTH * 4 / MB:.1f} MB captured a batch"
    )
    rows = []
    for config in args.configs.split(","):
        n = 4 if config == "host-results" else batches
        cmd = [sys.executable, os.path.abspath(__file__), "--child", config, "--batches", str(n)]
        cmd += ["--out-dir", out_dir]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode:
            print(done.stderr, file=sys.stderr)
            raise SystemExit(f"{config}: child failed")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print()
    print(
        "| config | captured MB | forward peak MB | extra during capture MB | left after close MB "
        "| s/batch capture / forward |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['config']} | {r['captured_mb']:.0f} | {r['fwd_peak_mb']:.0f} | "
            f"{r['extra_mb']:.0f} | {r['left_mb']:.0f} | {r['cap_s']:.2f} / {r['fwd_s']:.2f} |"
        )
    for r in rows:
        if r["config"] == "host-results":
            print(
                f"\nhost capture + results(): {r['results_bytes'] / MB:.0f} MB of rows; RSS held "
                f"after results() = {r['held_over_rows']:.2f}x the rows (goal 1.0x); the "
                f"results() call itself added {r['results_call_extra'] / MB:.0f} MB"
            )


if __name__ == "__main__":
    main()
