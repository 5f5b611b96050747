"""Host memory of a capture: the RSS a capture adds to the forward's own, and what stays after.

Run:  python benchmarks/bench_memory.py [--quick | --full] [--batches N] [--rounds R] [--out-dir DIR]

A GPT-2-small-shaped model (random weights: 12 blocks, width 768) runs batches of 8 x 256
tokens; every block's output is captured (12 x 2048 rows x 768 float32 = 75.5 MB a batch).
Every measurement is a fresh Python process that samples its own RSS (``/proc/self/statm``)
every 5 ms in a background thread. "The forward's own working memory" is measured the same way,
by a process that runs the same batches without a capture: the glibc heap of a long run of
forwards fragments and grows by itself (GPT-2 small: +265 MB over 12 forwards, no capture),
so a few forwards before the capture are not a baseline. Printed per configuration:

* extra = peak RSS of the capture process minus the peak of the forward-only process (both
  above their own RSS after one warm-up forward and a trim), median over ``--rounds`` rounds,
  with two allocators' settings: glibc's defaults (noisy: the heap's fragmentation varies by
  a few hundred MB from run to run, so it is paired with a forward-only run in every round) and
  a fixed mmap threshold (``MALLOC_MMAP_THRESHOLD_=1048576``, set for both processes: large
  blocks are mapped and unmapped, so the RSS follows the live bytes);
* pooled = the most bytes of capture buffers alive at once (the native pool's live plus idle
  bytes, sampled), what the capture itself holds;
* left = RSS after ``close()`` above the RSS before the capture;
* seconds per batch of the capture and of the forward alone.

First, issue 23's setting: one ``nn.Identity`` layer (the forward allocates nothing, so the
process grows only by the capture's own bytes), 80 batches of 4096 x 768 float32 to disk
(``--quick``: 40), with the defaults and with ``stats``, ``tokens`` and ``fsync`` off: peak RSS over
the RSS before the capture and what is left after close (goals: <= 256 MB and <= 64 MB).

Goals (issue 19): extra <= 256 MB by default whatever the capture's size (``--full``: 40
batches, 3.0 GB on disk; ``--quick``: 8 batches, 0.6 GB), left <= 64 MB. The host
configuration captures 4 batches and calls ``rec.results()``: bytes held over the bytes of
the rows (goal: 1.0x, the rows once).
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


class PoolSampler(RssSampler):
    """Also samples the native pool: the most capture-buffer bytes alive at once (live + idle)."""

    def __init__(self, every: float = 0.005) -> None:
        from pyhook import _backend

        self._stats = _backend.pool_stats
        self.pooled = 0
        super().__init__(every)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            st = self._stats()
            self.pooled = max(self.pooled, st["live_bytes"] + st["cached_bytes"])
            time.sleep(self.every)


def child(config: str, batches: int, out_dir: str) -> dict:
    """One measurement in this (fresh) process: ``forward`` (no capture), ``disk-default``,
    ``disk-1GiB`` or ``host-results``."""
    import gc

    import torch

    from pyhook.capture import capture
    from pyhook.offload import trim_host_memory

    net = model()
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 50257, (BATCH, TOKENS), generator=g) for _ in range(4)]
    sampler = PoolSampler()
    result: dict = {"config": config}
    opts: dict = {}
    with torch.inference_mode():
        net(input_ids=ids[0])  # warm-up
        trim_host_memory()  # "before" and "after" are both measured trimmed (close trims)
        before = sampler.reset()
        times = []
        if config == "forward":
            for i in range(batches):
                t = time.perf_counter()
                net(input_ids=ids[i % 4])
                times.append(time.perf_counter() - t)
        else:
            if config == "disk-1GiB":
                opts["max_host_bytes"] = 1 << 30
            if config.startswith("disk"):
                opts["out"] = tempfile.mkdtemp(dir=out_dir)
            with capture(net, "h.*", **opts) as rec:
                for i in range(batches):
                    t = time.perf_counter()
                    net(input_ids=ids[i % 4])
                    times.append(time.perf_counter() - t)
                if config == "host-results":
                    held_before = sampler.rss()
                    res = rec.results()
                    nbytes = sum(t.nbytes for t in res.values())
        peak = sampler.peak
        if config == "host-results":
            trim_host_memory()
            result["results_bytes"] = nbytes
            result["held_over_rows"] = (sampler.rss() - before) / nbytes
            result["results_call_extra"] = sampler.rss() - held_before
            del rec, res
        gc.collect()
        time.sleep(0.2)
        after = sampler.rss()
    sampler.stop()
    result.update(
        peak_mb=(peak - before) / MB,
        pooled_mb=sampler.pooled / MB,
        left_mb=(after - before) / MB,
        captured_mb=batches * BATCH * TOKENS * WIDTH * 4 * BLOCKS / MB,
        s_per_batch=statistics.median(times),
    )
    if config.startswith("disk"):
        import shutil

        shutil.rmtree(opts["out"], ignore_errors=True)
    return result


def identity_child(config: str, batches: int, out_dir: str) -> dict:
    """Issue 23 item 2: one ``nn.Identity`` layer, batches of 4096 x 768 float32 (12.6 MB) to
    disk, the same input every time, so the forward allocates nothing and every byte the process
    grows by is the capture's own. ``identity-default`` or ``identity-lean`` (stats, tokens and
    fsync off)."""
    import shutil

    import torch

    from pyhook.capture import capture
    from pyhook.offload import trim_host_memory

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.id = torch.nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.id(x)

    net = Net()
    x = torch.randn(4096, 768)
    opts: dict = {"stats": False, "tokens": False, "fsync": False} if "lean" in config else {}
    out = tempfile.mkdtemp(dir=out_dir)
    sampler = PoolSampler(every=0.002)
    with torch.inference_mode():
        net(x)
        trim_host_memory()
        before = sampler.reset()
        t0 = time.perf_counter()
        with capture(net, "id", out=out, **opts):
            for _ in range(batches):
                net(x)
        seconds = time.perf_counter() - t0
        peak = sampler.peak
        time.sleep(0.2)
        after = sampler.rss()
    sampler.stop()
    shutil.rmtree(out, ignore_errors=True)
    return {
        "config": config,
        "peak_mb": (peak - before) / MB,
        "pooled_mb": sampler.pooled / MB,
        "left_mb": (after - before) / MB,
        "captured_mb": batches * x.nbytes / MB,
        "s_per_batch": seconds / batches,
    }


def run_child(config: str, batches: int, out_dir: str, fixed_malloc: bool) -> dict:
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if fixed_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", config, "--batches", str(batches)]
    cmd += ["--out-dir", out_dir]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if done.returncode:
        print(done.stderr, file=sys.stderr)
        raise SystemExit(f"{config}: child failed")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="8 batches (0.6 GB)")
    mode.add_argument("--full", action="store_true", help="40 batches (3.0 GB)")
    ap.add_argument("--batches", type=int, help="batches of the disk captures")
    ap.add_argument("--rounds", type=int, default=2, help="rounds (medians are printed)")
    ap.add_argument("--out-dir", default=None, help="where the captures are written")
    ap.add_argument(
        "--configs", default="identity-default,identity-lean,disk-default,disk-1GiB,host-results"
    )
    ap.add_argument(
        "--malloc", default="fixed,default", help="allocator settings: fixed, default or both"
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    batches = args.batches or (40 if args.full else 8)
    out_dir = args.out_dir or tempfile.gettempdir()
    if args.child:
        if args.child.startswith("identity"):
            result = identity_child(args.child, args.batches or 80, out_dir)
        else:
            result = child(args.child, batches, out_dir)
        print(json.dumps(result))
        return
    print(
        f"# bench_memory: {platform.platform()}, {os.cpu_count()} cores, python "
        f"{platform.python_version()}, load {os.getloadavg()[0]:.2f}"
    )
    print(
        f"# GPT-2-small shape ({BLOCKS} blocks x {WIDTH}), {BATCH}x{TOKENS} tokens a batch, "
        f"{BLOCKS * BATCH * TOKENS * WIDTH * 4 / MB:.1f} MB captured a batch, {args.rounds} rounds"
    )
    configs = args.configs.split(",")
    disk = [c for c in configs if c.startswith("disk")]
    med = statistics.median
    identity = [c for c in configs if c.startswith("identity")]
    if identity:
        n = 40 if args.quick else 80
        print(
            f"\n# one nn.Identity layer (the forward allocates nothing), {n} batches of 4096 x 768 "
            "float32 to disk; goal: peak <= 256 MB over the RSS before, <= 64 MB left after close"
        )
        print("\n| config | captured MB | **peak MB** | pooled MB | **left after close MB** | s/batch |")
        print("|---|---|---|---|---|---|")
        for config in identity:
            r = [
                run_child(config, n, out_dir, False)
                for _ in range(args.rounds)
            ]
            print(
                f"| {config} | {r[0]['captured_mb']:.0f} | **{max(x['peak_mb'] for x in r):.0f}** "
                f"| {max(x['pooled_mb'] for x in r):.0f} | **{max(x['left_mb'] for x in r):.0f}** "
                f"| {med(x['s_per_batch'] for x in r):.3f} |"
            )
        print("(peak and left: the largest of the rounds)")
    if disk:
        print(
            "\n| config | malloc | captured MB | forward peak MB | capture peak MB | **extra MB** "
            "| pooled MB | left after close MB | s/batch capture / forward |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
    for malloc in args.malloc.split(",") if disk else []:
        fixed = malloc == "fixed"
        runs: dict[str, list[dict]] = {c: [] for c in ["forward", *disk]}
        for _ in range(args.rounds):  # a forward-only process paired with every round
            for config in runs:
                runs[config].append(run_child(config, batches, out_dir, fixed))
        fwd = runs["forward"]
        for config in disk:
            r = runs[config]
            print(
                f"| {config} | {malloc} | {r[0]['captured_mb']:.0f} "
                f"| {med(x['peak_mb'] for x in fwd):.0f} | {med(x['peak_mb'] for x in r):.0f} "
                f"| **{med(c['peak_mb'] - f['peak_mb'] for c, f in zip(r, fwd)):.0f}** "
                f"| {med(x['pooled_mb'] for x in r):.0f} | {med(x['left_mb'] for x in r):.0f} "
                f"| {med(x['s_per_batch'] for x in r):.2f} / "
                f"{med(x['s_per_batch'] for x in fwd):.2f} |"
            )
    if "host-results" in configs:
        r = run_child("host-results", 4, out_dir, False)
        print(
            f"\nhost capture + results(): {r['results_bytes'] / MB:.0f} MB of rows; RSS held "
            f"after results() = {r['held_over_rows']:.2f}x the rows (goal 1.0x); the "
            f"results() call itself added {r['results_call_extra'] / MB:.0f} MB"
        )


if __name__ == "__main__":
    main()
