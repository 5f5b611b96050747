"""The first run on a GPU: build with CUDA, run the CUDA tests and benchmarks, write one report.

On a machine with CUDA, from the repository root::

    python benchmarks/gpu_check.py                  # writes gpu_check.md, at most 10 minutes

Steps, each in a subprocess with its own time limit inside one overall budget (``--budget``,
600 s by default; a step that would outlast it is cut short and reported as such):

0. the wheels in ``.whl/`` (ignored by git), when there are any: pyhook's dependencies the GPU
   machine lacks, downloaded here for its Python (3.12) and named in the device call's
   ``carry``; at least ``crc32c``, whose absence slows every shard's checksum ~4x (``pyhook
   info`` names the checksum in use);
1. build: ``pip install --no-build-isolation --no-deps .`` with ``PYHOOK_BUILD_CUDA=1`` (the
   build fails rather than quietly skipping the CUDA kernels), then ``pyhook info``;
2. tests: every ``cuda``-marked test (``pytest -m cuda``), among them
   ``tests/test_cuda_interventions.py`` (attribution graphs, splicing, steering and
   ``HostBuffers`` on the GPU against the same computation on the CPU);
3. ``bench_copy.py --device cuda`` (the CUDA rows: native vs reference clones on the GPU);
4. ``bench_capture.py --skip peers disk job host`` (case (c): pinned copies, the Offloader, GPT-2
   small forward with a capture to host, joined and into reused pinned ``HostBuffers``), then
   ``bench_large.py --device cuda`` (an offloaded capture against the offloaded forward; tensor
   parallelism when there are 2 GPUs);
5. the capture loop on a GPT-2-small forward (random weights, nothing downloaded): ``capture(model,
   "h.*", out=dir)`` with the defaults, checked row for row against a hand-written forward hook,
   then timed (5 rounds, medians, each run into a fresh directory removed outside the timing)
   against the bare forward and the strongest hand-written loop (a pinned ring, copies on a side
   stream, a writer thread, fsync), with the disk's own O_DIRECT speed beside them; captures to
   host memory (joined, and into reused pinned ``HostBuffers``, with their page faults) beside a
   hand-written loop of pinned non-blocking copies, joined and not;
6. ``gpu_compiled.py``: capture on compiled models (the default mode, CUDA graphs through
   ``mode="reduce-overhead"`` and ``backend="cudagraphs"``, ``module.compile()``): rows against
   the eager capture, a capture block's time against the compiled forwards alone, the frames
   dynamo traced, with its logs of graph breaks, recompilations and CUDA-graph skips.

The report (``--out``) has the device, the versions, a table of the steps, and each step's
output. Without CUDA the script says so and exits 0 (nothing to check). ``--skip-build``
uses the installed pyhook as it is; ``--only`` runs the steps it names (``build info tests copy
case-c large loop compiled``), for a second call in a short lease.
"""

from __future__ import annotations

import argparse
import glob
import os
import platform
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The capture loop of step 5, run in a fresh interpreter (after the build).
CAPTURE_LOOP = r"""
import os, queue, shutil, statistics, subprocess, tempfile, threading, time
import torch, pyhook
from transformers import GPT2Config, GPT2Model

dev = torch.device("cuda")
torch.manual_seed(0)
cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
model = GPT2Model(cfg).to(dev).eval()
blocks = list(model.h)
B, T, D, L = 8, 128, 768, 12
batches = [torch.randint(0, cfg.vocab_size, (B, T), device=dev) for _ in range(12)]

def block_output(out):
    return out[0] if isinstance(out, tuple) else out  # a tuple in older transformers

# The batches' forwards with the hook make_hook(i) on block i (removed after), calling
# after_batch() after each forward: the hand-written loops below.
def hooked_loop(make_hook, after_batch=None):
    hs = [b.register_forward_hook(make_hook(i)) for i, b in enumerate(blocks)]
    try:
        with torch.no_grad():
            for x in batches:
                model(x)
                if after_batch is not None:
                    after_batch()
    finally:
        for h in hs:
            h.remove()

# the reference: a hand-written forward hook per block, outputs copied to the host
ref = {i: [] for i in range(L)}
def keep(i):
    def hook(m, a, out):
        ref[i].append(block_output(out).detach().to("cpu"))
    return hook
hooked_loop(keep)

root = tempfile.mkdtemp()  # each timed run writes a fresh directory, removed outside the timing
runs = iter(range(10**6))
def fresh():
    return os.path.join(root, f"run{next(runs)}")
def clean():
    for name in os.listdir(root):
        p = os.path.join(root, name)
        shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)

def bare():
    with torch.no_grad():
        for x in batches:
            model(x)
    torch.cuda.synchronize()

def captured(out=None, **kw):
    with torch.no_grad(), pyhook.capture(model, "h.*", out=out, **kw) as rec:
        for x in batches:
            model(x)
    if out is None:
        rec.results()
    torch.cuda.synchronize()
    return rec

# The strongest hand-written loop: a pinned ring (3 batches of every layer), the copies on a side
# stream behind an event, a writer thread writing each batch's rows to one file, fsync at the end.
RING = 3
pins = [[torch.empty(B * T * D, pin_memory=True) for _ in range(L)] for _ in range(RING)]
side = torch.cuda.Stream()
def handwritten():
    q = queue.Queue(maxsize=RING - 1)
    fd = os.open(fresh() + ".bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    def writer():
        while (item := q.get()) is not None:
            ev, slot = item
            ev.synchronize()
            for t in pins[slot]:
                os.write(fd, memoryview(t.numpy()).cast("B"))
    th = threading.Thread(target=writer)
    th.start()
    slot = [0]
    def mk(i):
        def hook(m, a, out):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                pins[slot[0]][i].copy_(block_output(out).reshape(-1), non_blocking=True)
        return hook
    def hand_over():
        ev = torch.cuda.Event()
        ev.record(side)
        q.put((ev, slot[0]))
        slot[0] = (slot[0] + 1) % RING
    try:
        hooked_loop(mk, hand_over)
    finally:
        q.put(None)
        th.join()
        os.fsync(fd)
        os.close(fd)
    torch.cuda.synchronize()

# The strongest hand-written loop to host memory: each block's output copied into pinned memory
# (torch's caching host allocator) without blocking, the batches joined per layer at the end.
def handwritten_host(join=True):
    parts = {i: [] for i in range(L)}
    def mk(i):
        def hook(m, a, out):
            o = block_output(out)
            buf = torch.empty(o.shape, dtype=o.dtype, pin_memory=True)
            buf.copy_(o, non_blocking=True)
            parts[i].append(buf)
        return hook
    hooked_loop(mk)
    torch.cuda.synchronize()
    return {i: torch.cat(p) for i, p in parts.items()} if join else parts

# Reused pinned host buffers (pyhook.HostBuffers): rows straight into one buffer per layer.
bufs = pyhook.HostBuffers()
got = captured(buffers=bufs).results()
exact_bufs = all(
    torch.equal(got[f"h.{i}"].reshape(-1, D).cpu(), torch.cat(ref[i]).reshape(-1, D).cpu())
    for i in range(L)
)
print(f"HostBuffers: pinned={bufs.pin}; rows exact vs hand-written hooks: {exact_bufs}")
del got

d = fresh()
captured(d)
r = pyhook.open_capture(d)
exact = all(
    torch.equal(r[f"h.{i}"][:].reshape(-1, D), torch.cat(ref[i]).reshape(-1, D)) for i in range(L)
)
print(f"rows: {r.examples} examples, layers {len(r.layers)}; exact vs hand-written hooks: {exact}")
dd = subprocess.run(["dd", "if=/dev/zero", f"of={root}/dd", "bs=4M", "count=256", "oflag=direct"],
                    capture_output=True, text=True).stderr.strip().splitlines()[-1]
print(f"disk ({root}): dd 1 GiB with O_DIRECT: {dd}")
clean()
variants = {
    "bare forward": bare,
    "hand-written (pinned ring, side stream, writer thread, fsync)": handwritten,
    "capture 'h.*' to disk, defaults": lambda: captured(fresh()),
    "capture 'h.*' to disk, stats=False": lambda: captured(fresh(), stats=False),
    "capture 'h.*' to host memory (results joined)": lambda: captured(),
    "capture 'h.*' to host memory, stats=False": lambda: captured(stats=False),
    "capture 'h.*' to host memory into reused pinned HostBuffers": lambda: captured(buffers=bufs),
    "hand-written to host: pinned copies without blocking, joined": handwritten_host,
    "hand-written to host, not joined (the join's cost)": lambda: handwritten_host(False),
}
times = {k: [] for k in variants}
for f in variants.values():
    f()  # warm
    clean()
for _ in range(5):
    for k, f in variants.items():
        t0 = time.perf_counter()
        f()
        times[k].append(time.perf_counter() - t0)
        clean()
mb = sum(t.numel() * 4 for v in ref.values() for t in v) / 1e6
b = statistics.median(times["bare forward"])
h = statistics.median(times["hand-written (pinned ring, side stream, writer thread, fsync)"])
print(f"| loop: 12 x {B}x{T} tokens, GPT-2 small, {mb:.0f} MB of rows (5 rounds) | median ms | vs bare | vs hand-written (disk) |")
print("|---|---|---|---|")
for k, v in times.items():
    m = statistics.median(v)
    print(f"| {k} | {m * 1e3:.0f} | {m / b:.2f} | {m / h:.2f} |")
import resource
for k in ("capture 'h.*' to host memory (results joined)",
          "capture 'h.*' to host memory into reused pinned HostBuffers"):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    variants[k]()
    print(f"minor page faults in one loop, {k}: {resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0}")
print(f"HostBuffers after every round: {bufs!r} {bufs.stats()}")
shutil.rmtree(root)
raise SystemExit(0 if exact and exact_bufs else 1)
"""


# the steps, as --only names them
STEP_NAMES = (
    "carried wheels",
    "build with CUDA",
    "pyhook info",
    "cuda-marked tests",
    "bench_copy.py --device cuda",
    "bench_capture.py case (c)",
    "bench_large.py --device cuda",
    "capture loop, GPT-2 small",
    "compiled models: rows and cost",
)
STEP_KEYS = ("build", "build", "info", "tests", "copy", "case-c", "large", "loop", "compiled")


def run_step(
    cmd: list[str], seconds: float, env: dict[str, str] | None = None
) -> tuple[str, str, float]:
    """Run ``cmd`` in its own process group for at most ``seconds``: (status, output, time)."""
    t0 = time.monotonic()
    if seconds <= 1:
        return "skipped (out of time)", "", 0.0
    p = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a timeout ends the whole tree (pip's compilers too)
    )
    try:
        out, _ = p.communicate(timeout=seconds)
        status = "ok" if p.returncode == 0 else f"FAILED (exit {p.returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        status = f"TIMED OUT after {seconds:.0f} s"
    return status, out or "", time.monotonic() - t0


def versions() -> list[str]:
    import torch

    lines = [
        f"- python {platform.python_version()} ({sys.executable}), {platform.platform()}",
        f"- torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}",
    ]
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        lines.append(
            f"- GPU {i}: {p.name}, compute capability {p.major}.{p.minor}, "
            f"{p.total_memory / 2**30:.0f} GiB"
        )
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        lines.append(f"- driver {smi.stdout.strip().splitlines()[0]}")
    except (OSError, subprocess.SubprocessError, IndexError):
        lines.append("- driver: nvidia-smi not available")
    try:
        commit = subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        lines.append(f"- pyhook checkout {commit or '(not a git checkout)'}")
    except (OSError, subprocess.SubprocessError):
        pass
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "gpu_check.md"), help="the report")
    ap.add_argument("--logdir", help="also write each step's whole output to a file here")
    ap.add_argument("--budget", type=float, default=600.0, help="seconds for all steps")
    ap.add_argument("--skip-build", action="store_true", help="use the installed pyhook")
    ap.add_argument(
        "--only",
        nargs="+",
        choices=STEP_KEYS,
        help="run only these steps (default: all), e.g. --only build tests loop",
    )
    args = ap.parse_args(argv)
    start = time.monotonic()

    import torch

    if not torch.cuda.is_available():
        print(
            f"gpu_check: no CUDA device (torch {torch.__version__}, CUDA build: "
            f"{torch.version.cuda or 'no'}); nothing to check, no report written."
        )
        return 0

    py = sys.executable
    env = {**os.environ, "PYHOOK_BUILD_CUDA": "1", "MAX_JOBS": str(os.cpu_count() or 4)}
    # (name, command, at most seconds)
    steps: list[tuple[str, list[str], float]] = []
    wheels = sorted(glob.glob(os.path.join(ROOT, ".whl", "*.whl")))
    if wheels and not args.skip_build:
        # pyhook's own dependencies the machine lacks (crc32c: without it shards are checksummed
        # by zlib's crc32, ~4x slower, which the second GPU run's disk timings paid), brought
        # as wheels in .whl/ (named in the device call's carry)
        steps.append(
            (
                "carried wheels",
                [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", *wheels],
                120,
            )
        )
    if not args.skip_build:
        steps.append(
            (
                "build with CUDA",
                [
                    py,
                    "-m",
                    "pip",
                    "install",
                    "--no-build-isolation",
                    "--no-deps",
                    "--force-reinstall",
                    ".",
                ],
                300,
            )
        )
    steps += [
        ("pyhook info", [py, "-I", "-m", "pyhook", "info"], 30),
        (
            "cuda-marked tests",
            [
                py,
                "-I",
                "-m",
                "pytest",
                "tests",
                "-m",
                "cuda",
                "-n",
                "4",  # a worker that crashes is reported, the others go on
                "-q",
                "-rfEs",  # failures and errors by name, then skips
                "-p",
                "no:cacheprovider",
                "-p",
                "no:logging",  # dynamo's debug records would bury the summary
            ],
            150,
        ),
        (
            "bench_copy.py --device cuda",
            [py, "-I", "-u", "benchmarks/bench_copy.py", "--device", "cuda"],
            90,
        ),
        (
            "bench_capture.py case (c)",
            [
                py, "-I", "-u", "benchmarks/bench_capture.py",
                "--skip", "peers", "disk", "job", "host",
            ],
            120,
        ),
        (
            # Issue 44 item 5 on CUDA: an offloaded capture (accelerate's cpu_offload onto the
            # GPU) against the offloaded forward; tensor parallelism needs 2 GPUs (NCCL runs no
            # two ranks on one device) and says so when there is one.
            "bench_large.py --device cuda",
            [py, "-I", "-u", "benchmarks/bench_large.py", "--device", "cuda", "--rounds", "5"],
            120,
        ),
        ("capture loop, GPT-2 small", [py, "-I", "-c", CAPTURE_LOOP], 120),
        (
            # Capture on compiled models on the GPU (benchmarks/gpu_compiled.py): rows against
            # the eager capture under each way of compiling (CUDA graphs included), the cost of
            # a capture block against the compiled forwards, and dynamo's logs.
            "compiled models: rows and cost",
            [py, "-I", "-u", "benchmarks/gpu_compiled.py"],
            240,
        ),
    ]
    if args.only:
        keys = dict(zip(STEP_NAMES, STEP_KEYS))
        steps = [s for s in steps if keys[s[0]] in args.only]
    results = []
    for name, cmd, cap in steps:
        left = args.budget - (time.monotonic() - start)
        print(f"gpu_check: {name} (at most {min(cap, left):.0f} s) ...", flush=True)
        status, out, took = run_step(cmd, min(cap, left), env)
        print(f"gpu_check: {name}: {status} in {took:.0f} s", flush=True)
        results.append((name, cmd, status, out, took))
        if args.logdir:
            os.makedirs(args.logdir, exist_ok=True)
            key = dict(zip(STEP_NAMES, STEP_KEYS))[name]
            with open(os.path.join(args.logdir, f"{key}.log"), "w") as f:
                f.write(out)
        if name in ("carried wheels", "build with CUDA") and status != "ok":
            break  # the rest would test the old install

    total = time.monotonic() - start
    md = [
        "# pyhook GPU check",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}, {total:.0f} s in all (budget {args.budget:.0f} s)",
        "",
        *versions(),
        "",
        "| step | result | seconds |",
        "|---|---|---|",
        *[f"| {n} | {s} | {t:.0f} |" for n, _, s, _, t in results],
        "",
    ]
    for name, cmd, status, out, _ in results:
        shown = " ".join(c if len(c) < 80 else "<script>" for c in cmd)
        tail = out[-12000:]
        md += [f"## {name}: {status}", "", "```text", f"$ {shown}", tail.rstrip(), "```", ""]
    with open(args.out, "w") as f:
        f.write("\n".join(md))
    print(f"gpu_check: report written to {args.out}")
    return 0 if all(s == "ok" for _, _, s, _, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
