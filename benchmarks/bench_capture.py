"""Capture throughput: pyhook vs TransformerLens, nnsight and plain hooks; disk vs dd; GPU offload.

Run:  python benchmarks/bench_capture.py [--quick] [--out-dir DIR]

Prints ratio tables (one run, everything measured in the same process):

(a0) the microseconds each method adds per captured layer and forward, on a model whose forward
    costs almost nothing (16 KB and 512 KB outputs): the per-layer costs that (a) adds up.
(a) capture of every block's output of a GPT-2-small-shaped model (random weights) over a batch
    loop, as overhead over each tool's own raw forward (median of per-round ratios), in two
    regimes (one short example per forward; 8 x 128 tokens per forward): pyhook
    ``capture(to="host")`` (exact: copies outputs that alias model memory) and with
    ``copy=False`` (references guarded by version counters, like the peers keep), plain
    nethook-style ``register_forward_hook`` + ``clone()``, nnsight ``trace`` + ``save``,
    TransformerLens ``run_with_cache`` on a ``HookedTransformer`` of the same shape. Peers that are
    not installed are skipped (``pip install -c constraints.txt -r benchmarks/requirements-peers.txt``).
(b) capture to disk (``to="disk"``): the writer's sustained MB/s against the disk's sequential write
    speed measured with ``dd ... conv=fsync`` in the same directory, and the forward loop with the
    disk capture against the forward alone (is the model stalled by the disk?), in paired rounds.
(c) on CUDA only: the offloader's device-to-host MB/s against a plain pinned-copy bandwidth, and a
    forward + capture of all residual streams against the forward alone, with the default host
    results (joined at the end) and into reusable pinned ``HostBuffers``.
(e) a loop of captures to host memory (GPT-2-small shape, every block, several batches per
    capture, the last capture's rows held while the next runs, as a training loop holds them):
    the bare forward; the strongest hand-written loop (hooks copying each output into per-layer
    buffers allocated once, outside the loop); ``capture(to="host")`` with its results joined;
    ``capture(..., buffers=HostBuffers())``. Paired rounds, medians, and the minor page faults
    of each loop run twice more back to back, counted in the second (``getrusage``).
"""

from __future__ import annotations

import argparse
import os
import platform
import queue
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import torch

try:  # the installed package (with its native core), else the source tree
    import pyhook  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pyhook.capture import capture
from pyhook.offload import HostBuffers, Offloader

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def timeit(fn: Callable[[], object], repeat: int, warmup: int = 1) -> float:
    """Best of ``repeat`` timings of ``fn`` (seconds), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def compare(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, list[float]]:
    """Seconds per function and round, measured round-robin (one warm-up each) so that load from
    other processes affects every method alike; ratios are then taken within each round. The
    order is shuffled every round (fixed seed): a method's run leaves the allocator and caches
    in a state that the next one inherits, and a fixed order would bias one neighbour."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    rng = random.Random(0)
    for _ in range(repeat):
        rng.shuffle(order)
        for name in order:
            fn = fns[name]
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def paired_overhead(times: list[float], base: list[float]) -> float:
    """Median over rounds of (time with capture / raw time in the same round) - 1."""
    return statistics.median(t / b for t, b in zip(times, base)) - 1


def paired_spread(times: list[float], base: list[float]) -> tuple[float, float]:
    """25th and 75th percentiles of the per-round overheads: the noise around the median."""
    q = statistics.quantiles([t / b - 1 for t, b in zip(times, base)], n=4)
    return q[0], q[2]


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = "| " + " | ".join("{:<%d}" % w for w in widths) + " |"
    out = [line.format(*header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    return "\n".join(out + [line.format(*r) for r in rows])


def gpt2_config(n_layer: int, d_model: int, heads: int, vocab: int, positions: int):
    """The GPT-2 shape every part of this benchmark (and every peer) uses."""
    from transformers import GPT2Config

    return GPT2Config(
        n_layer=n_layer, n_embd=d_model, n_head=heads, vocab_size=vocab, n_positions=positions,
        bos_token_id=0, eos_token_id=0,
    )


def gpt2_and_batches(
    L: int, D: int, H: int, T: int, B: int, steps: int, vocab: int = 1000
) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """A GPT-2 of that shape (random weights, seed 0) and ``steps`` batches of B x T token ids:
    the model and data of (b) and (d)."""
    from transformers import GPT2Model

    torch.manual_seed(0)
    model = GPT2Model(gpt2_config(L, D, H, vocab, T)).eval()
    return model, [torch.randint(0, vocab, (B, T)) for _ in range(steps)]


def out_dir(args: argparse.Namespace, prefix: str) -> str:
    """``--out-dir`` (created) or a fresh temporary directory: where (b) and (d) write."""
    base = args.out_dir or tempfile.mkdtemp(prefix=prefix)
    os.makedirs(base, exist_ok=True)
    return base


def nnsight_order(names: list[str]) -> list[str]:
    """Module names ``h.I[.attn|.ln_2|.mlp]`` in execution order: nnsight reads outputs in the
    order the forward produces them."""
    step = {"attn": 0, "ln_2": 1, "mlp": 2, "": 3}  # a block's order of execution

    def when(name: str) -> tuple[int, int]:
        parts = name.split(".", 2)
        return int(parts[1]), step[parts[2] if len(parts) > 2 else ""]

    return sorted(names, key=when)


def with_clone_hooks(blocks: torch.nn.ModuleList, run: Callable[[], object]) -> None:
    """The nethook-style baseline: a hand-written forward hook per block that keeps a detached
    clone of the block's first output, around ``run()``."""
    store: list[list[torch.Tensor]] = [[] for _ in blocks]
    handles = [
        blk.register_forward_hook(
            lambda m, a, o, i=i: store[i].append(
                (o[0] if isinstance(o, tuple) else o).detach().clone()
            )
        )
        for i, blk in enumerate(blocks)
    ]
    try:
        run()
    finally:
        for h in handles:
            h.remove()


# -- (a0) cost per captured layer ---------------------------------------------------------------
class _Block(torch.nn.Module):
    """A block whose forward costs almost nothing: what is left is the capture's own cost."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x * 1.0, None  # a fresh tensor, returned as a (hidden, extra) tuple like GPT-2's


class _Stack(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.h = torch.nn.ModuleList(_Block() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.h:
            x = block(x)[0]
        return x


def bench_per_layer(args: argparse.Namespace) -> None:
    """Microseconds each method adds per captured layer and forward, on a model whose forward
    is nearly free: the end-to-end loops of (a) are this cost times layers x batches, hidden in
    the noise of a real forward on a shared VM."""
    n, forwards = (12, 2) if args.quick else (48, 4)
    rounds = 5 if args.quick else 40
    model = _Stack(n).eval()
    print(
        f"\n(a0) cost per captured layer: {n} cheap blocks, {forwards} forwards per capture "
        f"session, medians of {rounds} rounds (us per layer per forward, over the raw forward)"
    )
    try:
        import nnsight
    except ImportError:
        nnsight = None

    def measure(x: torch.Tensor) -> dict[str, list[float]]:

        def raw() -> None:
            for _ in range(forwards):
                model(x)

        def pyhook_copy() -> None:
            with capture(model, "h.*", flatten=False) as rec:
                for _ in range(forwards):
                    model(x)
            assert rec.batches == forwards

        def pyhook_ref() -> None:
            with capture(model, "h.*", flatten=False, copy=False) as rec:
                for _ in range(forwards):
                    model(x)
            assert rec.batches == forwards

        def hooks() -> None:
            with_clone_hooks(model.h, raw)

        fns: dict[str, Callable[[], object]] = {
            "raw": raw,
            "pyhook capture(to='host')": pyhook_copy,
            "pyhook capture(to='host', copy=False)": pyhook_ref,
            "nethook-style hooks + clone": hooks,
        }
        if nnsight is not None:
            nn_model = nnsight.NNsight(model)

            def run_nnsight() -> None:
                kept = []
                for _ in range(forwards):
                    with nn_model.trace(x):
                        kept.append([nn_model.h[i].output[0].save() for i in range(n)])
                assert len(kept) == forwards

            fns[f"nnsight {nnsight.__version__} trace+save"] = run_nnsight
        with torch.no_grad():
            return compare(fns, rounds)

    rows = []
    for shape in [(1, 32, 128), (8, 128, 128)]:
        x = torch.randn(*shape)
        times = measure(x)
        kb = x.nbytes / 1024
        for name in times:
            if name == "raw":
                continue
            per = [(t - b) / (n * forwards) * 1e6 for t, b in zip(times[name], times["raw"])]
            rows.append([f"{kb:.0f} KB", name, f"{statistics.median(per):.1f}"])
    print(table(rows, ["output", "method", "us per layer"]))


# -- (a) in-memory capture vs peers ----------------------------------------------------------------
def bench_peers(args: argparse.Namespace, regime: str, B: int, T: int, steps: int) -> None:
    from transformers import GPT2Model

    L, D, H, V = args.layers, args.d_model, args.heads, 1000
    torch.manual_seed(0)
    model = GPT2Model(
        gpt2_config(L, D, H, V, T)
    ).eval()
    batches = [torch.randint(0, V, (B, T)) for _ in range(steps)]
    mb = L * B * T * D * 4 * len(batches) / 1e6
    print(
        f"\n(a, {regime}) capture every block output: GPT-2 shape n_layer={L} d_model={D} heads={H}, "
        f"{len(batches)} batches of {B}x{T} tokens, {mb:.1f} MB captured per loop, "
        f"torch threads={torch.get_num_threads()}, {args.repeat} rounds"
    )
    fns: dict[str, Callable[[], object]] = {}
    base_of: dict[str, str] = {}

    def loop_raw(m: torch.nn.Module) -> Callable[[], None]:
        def run() -> None:
            for ids in batches:
                m(ids)

        return run

    fns["raw"] = loop_raw(model)

    def run_pyhook() -> None:
        with capture(model, "h.*", flatten=False) as rec:
            for ids in batches:
                model(ids)
        assert rec.rows["h.0"] == B * len(batches)

    fns["pyhook capture(to='host')"] = run_pyhook
    base_of["pyhook capture(to='host')"] = "raw"

    def run_pyhook_ref() -> None:
        with capture(model, "h.*", flatten=False, copy=False) as rec:
            for ids in batches:
                model(ids)
        assert rec.rows["h.0"] == B * len(batches)

    fns["pyhook capture(to='host', copy=False)"] = run_pyhook_ref
    base_of["pyhook capture(to='host', copy=False)"] = "raw"

    def run_hooks() -> None:
        with_clone_hooks(model.h, fns["raw"])

    fns["nethook-style hooks + clone"] = run_hooks
    base_of["nethook-style hooks + clone"] = "raw"

    try:
        import nnsight
    except ImportError:
        print("  nnsight not installed: skipped")
    else:
        nn_model = nnsight.NNsight(model)

        def run_nnsight() -> None:
            kept = []
            for ids in batches:
                with nn_model.trace(ids):
                    kept.append([nn_model.h[i].output.save() for i in range(L)])
            assert len(kept) == len(batches) and isinstance(kept[-1][-1], torch.Tensor)

        name = f"nnsight {nnsight.__version__} trace+save"
        fns[name] = run_nnsight
        base_of[name] = "raw"

    tl = _transformer_lens(L, D, H, T, V)
    if tl is not None:
        label, tl_model, tl_run = tl
        fns["raw (TransformerLens model)"] = loop_raw(tl_model)

        def run_tl() -> None:
            for ids in batches:
                tl_run(ids)

        fns[label] = run_tl
        base_of[label] = "raw (TransformerLens model)"

    with torch.no_grad():
        times = compare(fns, args.repeat)
    results = [
        (name, base, paired_overhead(times[name], times[base])) for name, base in base_of.items()
    ]
    rows = []
    for name, base, over in results:
        lo, hi = paired_spread(times[name], times[base])
        rows.append(
            [
                name,
                f"{statistics.median(times[base]) * 1e3:.1f}",
                f"{statistics.median(times[name]) * 1e3:.1f}",
                f"{1 + over:.3f}x",
                f"{over * 100:+.1f}%",
                f"{lo * 100:+.1f}% .. {hi * 100:+.1f}%",
            ]
        )
    print(
        table(
            rows,
            [
                "method",
                "raw forward ms",
                "with capture ms",
                "paired ratio",
                "overhead",
                "middle half of rounds",
            ],
        )
    )
    # The target compares with the peers that capture whole outputs (TransformerLens, nnsight);
    # both keep references, so pyhook's copy=False row is the like-for-like one.
    peers = [over for name, _, over in results if not name.startswith(("pyhook", "nethook"))]
    if peers:
        best = min(peers)
        for name, base, ours in results[:2]:
            verdict = "met" if ours <= best / 2 else "NOT met"
            lo, hi = paired_spread(times[name], times[base])
            if lo <= best / 2 < hi:
                verdict += " by the medians; not resolved (the middle half of the rounds straddles it)"
            print(
                f"target ({name}): overhead <= half the best peer's ({ours * 100:+.1f}% vs "
                f"{best * 100:+.1f}% / 2): {verdict}"
            )


def _transformer_lens(L: int, D: int, H: int, T: int, V: int):
    """(label, model, run(ids)) for TransformerLens, or None when it is not installed.

    TransformerLens >= 4 dropped ``HookedTransformer``; its ``TransformerBridge`` wraps a
    transformers model, booted here offline from a temporary GPT-2 checkpoint of the same shape.
    Older versions get a ``HookedTransformer`` built from a ``HookedTransformerConfig``.
    """
    try:
        import transformer_lens
    except ImportError:
        print("  transformer_lens not installed: skipped")
        return None
    from importlib.metadata import version as dist_version

    version = getattr(transformer_lens, "__version__", "") or dist_version("transformer-lens")
    names = lambda n: n.endswith("hook_resid_post")  # noqa: E731
    try:
        from transformer_lens import HookedTransformer, HookedTransformerConfig

        cfg = HookedTransformerConfig(
            n_layers=L,
            d_model=D,
            n_ctx=T,
            d_head=D // H,
            n_heads=H,
            d_vocab=V,
            act_fn="gelu_new",
            normalization_type="LN",
            seed=0,
        )
        ht = HookedTransformer(cfg).eval()
        return (
            f"TransformerLens {version} HookedTransformer.run_with_cache",
            ht,
            lambda ids: ht.run_with_cache(ids, names_filter=names),
        )
    except ImportError:
        pass
    from tokenizers import Tokenizer, models
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast

    os.environ["HF_HUB_OFFLINE"] = "1"
    path = tempfile.mkdtemp(prefix="pyhook-bench-tl-")
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(
        gpt2_config(L, D, H, V, T)
    ).eval()
    hf.save_pretrained(path)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")),
        unk_token="[UNK]",
        pad_token="[UNK]",
    )
    tok.save_pretrained(path)
    bridge = TransformerBridge.boot_transformers(path, hf_model=hf, tokenizer=tok, device="cpu")
    shutil.rmtree(path, ignore_errors=True)
    return (
        f"TransformerLens {version} bridge.run_with_cache",
        bridge,
        lambda ids: bridge.run_with_cache(ids, names_filter=names),
    )


# -- (b) disk ----------------------------------------------------------------------------------------
def dd_speed(directory: str, mb: int) -> float:
    path = os.path.join(directory, "pyhook-dd-test")
    try:
        proc = subprocess.run(
            ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mb}", "conv=fsync"],
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        if os.path.exists(path):
            os.remove(path)
    m = re.search(r"copied, ([\d.]+) s", proc.stderr)
    if not m:
        raise RuntimeError(f"cannot parse dd output: {proc.stderr!r}")
    return mb * (1 << 20) / float(m.group(1)) / 1e6


def bench_disk(args: argparse.Namespace) -> None:
    base = out_dir(args, "pyhook-bench-")
    L, D, H, T, B = args.disk_shape
    model, batches = gpt2_and_batches(L, D, H, T, B, args.disk_steps)
    # Capture every module output (attention, MLP, norms too), so that the bytes per second of
    # compute are high enough for the disk to matter.
    layers = ["h.*", "h.*.attn", "h.*.mlp", "h.*.ln_1", "h.*.ln_2"]
    out = os.path.join(base, "capture")
    dd = dd_speed(base, args.dd_mb)
    rounds = args.disk_rounds

    def forward_loop() -> None:
        for ids in batches:
            model(ids)

    def disk_capture() -> tuple[float, float, int, float, int, float]:
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        c0 = time.thread_time()
        with capture(
            model, layers, out=out, flatten=True, shard_bytes=64 << 20, max_pending_shards=2
        ) as rec:
            forward_loop()
            loop_done = time.perf_counter()
            cpu = time.thread_time() - c0
            writer = rec._writer
        total = time.perf_counter() - t0
        shutil.rmtree(out, ignore_errors=True)
        return (
            loop_done - t0,
            total,
            writer.bytes_written,
            writer.write_seconds,
            len(rec.layers),
            cpu,
        )

    fwd: list[float] = []
    fwd_cpu: list[float] = []
    runs = []
    with torch.no_grad():
        forward_loop()
        disk_capture()  # warm-up: the pool, the page cache, the writer thread's first start
        for r in range(rounds):
            # alternate which goes first, so that neither always inherits the other's state
            for step in ("fwd", "cap") if r % 2 == 0 else ("cap", "fwd"):
                if step == "fwd":
                    t0 = time.perf_counter()
                    c0 = time.thread_time()
                    forward_loop()
                    fwd.append(time.perf_counter() - t0)
                    fwd_cpu.append(time.thread_time() - c0)
                else:
                    runs.append(disk_capture())
    loop = [x[0] for x in runs]
    total = [x[1] for x in runs]
    loop_cpu = [x[5] for x in runs]
    nbytes = runs[0][2]
    rate = statistics.median(x[2] / x[3] for x in runs) / 1e6
    med = statistics.median
    print(
        f"\n(b) capture to disk: {runs[0][4]} module outputs of the same model, {len(batches)} batches, "
        f"{nbytes / 1e6:.0f} MB written per run to {base}; medians of {rounds} paired rounds"
    )
    rows = [
        ["dd bs=1M conv=fsync (disk sequential write)", f"{dd:.0f}", "1.00"],
        ["pyhook writer, while writing (bytes / busy time)", f"{rate:.0f}", f"{rate / dd:.2f}"],
        [
            "pyhook end to end (bytes / (forward loop + final flush))",
            f"{nbytes / med(total) / 1e6:.0f}",
            f"{nbytes / med(total) / 1e6 / dd:.2f}",
        ],
    ]
    print(table(rows, ["what", "MB/s", "vs dd"]))
    print(
        table(
            [
                ["forward loop alone", f"{med(fwd) * 1e3:.0f}", "1.00"],
                [
                    "forward loop with disk capture (until the last forward returned)",
                    f"{med(loop) * 1e3:.0f}",
                    f"{med(a / f for a, f in zip(loop, fwd)):.2f}",
                ],
                [
                    "forward loop with disk capture, CPU time of the forward's thread "
                    "(steadier than wall time on a loaded machine)",
                    f"{med(loop_cpu) * 1e3:.0f}",
                    f"{med(a / f for a, f in zip(loop_cpu, fwd_cpu)):.2f}",
                ],
                [
                    "... plus waiting for the last shards (close)",
                    f"{med(total) * 1e3:.0f}",
                    f"{med(a / f for a, f in zip(total, fwd)):.2f}",
                ],
            ],
            ["loop", "ms", "vs forward (paired)"],
        )
    )
    ratio = rate / dd
    print(
        f"target: writer >= 70% of dd: {'met' if ratio >= 0.7 else 'NOT met'} ({ratio * 100:.0f}%)"
    )


# -- (d) the main job: a dataset on disk, against a hand-written loop --------------------------------
def _job_layers(n: int) -> list[str]:
    """12 hooked modules (every block) or 48 (blocks, attention, MLP, second norm)."""
    return ["h.*"] if n == 12 else ["h.*", "h.*.attn", "h.*.mlp", "h.*.ln_2"]


def _job_modules(model: torch.nn.Module, n: int) -> list[tuple[str, torch.nn.Module]]:
    names = [f"h.{i}" for i in range(len(model.h))]
    if n == 48:
        names = [f"{b}{s}" for b in names for s in ("", ".attn", ".mlp", ".ln_2")]
    return [(name, model.get_submodule(name)) for name in names]


def bench_job(args: argparse.Namespace) -> None:
    """``capture(model, layers, out=dir)`` against the bare forward, a hand-written
    ``register_forward_hook`` + ``safetensors.save_file`` loop and nnsight, at 12 and 48 hooked
    modules: wall and process CPU time (every thread, user + sys) over the bare forward, in
    paired rounds (shuffled order), and the bare forward right after each variant."""
    from safetensors.torch import save_file

    L, D, H, B, T, steps = args.job_shape
    rounds = args.job_rounds
    model, batches = gpt2_and_batches(L, D, H, T, B, steps)
    base = out_dir(args, "pyhook-bench-job-")
    try:
        import nnsight
    except ImportError:
        nnsight = None
    try:
        from pyhook.pipeline import _directio as directio
    except ImportError:  # a pyhook without direct I/O
        directio = None
    load = os.getloadavg()
    print(f"\nuptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print(
        f"\n(d) the main job, a dataset on disk: GPT-2 n_layer={L} d_model={D} (random weights), "
        f"{steps} batches of {B}x{T} tokens per loop, torch threads={torch.get_num_threads()}, "
        f"{rounds} paired rounds (order shuffled), load before {load[0]:.2f}"
    )

    def bare() -> None:
        for ids in batches:
            model(ids)

    for n in args.job_modules:
        layers = _job_layers(n)
        modules = _job_modules(model, n)
        mb = 0.0
        out = os.path.join(base, f"job-{n}")

        def pyhook_run(env: dict[str, str] | None = None, **opts) -> Callable[[], None]:
            env = dict(env or {})

            def run() -> None:
                saved = {k: os.environ.get(k) for k in env}
                os.environ.update(env)
                try:
                    with capture(model, layers, out=out, **opts) as rec:
                        for ids in batches:
                            model(ids)
                finally:
                    for k, v in saved.items():
                        if v is None:
                            os.environ.pop(k, None)
                        else:
                            os.environ[k] = v
                assert rec.batches == len(batches)

            return run

        def handwritten() -> None:
            os.makedirs(out, exist_ok=True)
            kept: dict[str, torch.Tensor] = {}

            def keep(name: str) -> Callable[..., None]:
                def hook(_m: torch.nn.Module, _a: object, o: object) -> None:
                    kept[name] = (o[0] if isinstance(o, tuple) else o).detach().clone()

                return hook

            handles = [m.register_forward_hook(keep(name)) for name, m in modules]
            try:
                for i, ids in enumerate(batches):
                    model(ids)
                    save_file(kept, os.path.join(out, f"batch-{i:05d}.safetensors"))
                    kept.clear()
            finally:
                for h in handles:
                    h.remove()

        def copy_floor(
            modules: list[tuple[str, torch.nn.Module]] = modules,
            bufs: dict[str, torch.Tensor] = {},  # noqa: B006 - kept across calls on purpose
        ) -> None:
            """The bytes copied once into memory that is never freed, nothing written: the least
            any capture that keeps the rows pays (no capture can skip the copy unless the model
            never reuses or changes an output)."""

            def keep(name: str) -> Callable[..., None]:
                def hook(_m: torch.nn.Module, _a: object, o: object) -> None:
                    t = o[0] if isinstance(o, tuple) else o
                    buf = bufs.get(name)
                    if buf is None or buf.shape != t.shape:
                        buf = bufs[name] = torch.empty_like(t)
                    buf.copy_(t)

                return hook

            handles = [m.register_forward_hook(keep(name)) for name, m in modules]
            try:
                for ids in batches:
                    model(ids)
            finally:
                for h in handles:
                    h.remove()

        def write_floor(
            modules: list[tuple[str, torch.nn.Module]] = modules,
            out: str = out,
            ring: list[dict[str, torch.Tensor]] = [{}, {}],  # noqa: B006 - kept across calls
        ) -> None:
            """The copy floor plus the same bytes written to one file with ``O_DIRECT`` by a
            thread, batch by batch (a ring of two batches of page-aligned buffers), fsync at the
            end: the least a capture that writes its rows to this disk pays (no index, no
            checksums, no statistics)."""
            slot = [0]

            def keep(name: str) -> Callable[..., None]:
                def hook(_m: torch.nn.Module, _a: object, o: object) -> None:
                    t = o[0] if isinstance(o, tuple) else o
                    buf = ring[slot[0]].get(name)
                    if buf is None or buf.shape != t.shape:
                        buf = ring[slot[0]][name] = aligned_like(t)
                    buf.copy_(t)

                return hook

            os.makedirs(out, exist_ok=True)
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
            fd = os.open(os.path.join(out, "rows.bin"), flags)
            free = threading.Semaphore(2)
            todo: queue.Queue[int | None] = queue.Queue()

            def writer() -> None:
                offset = 0
                while (s := todo.get()) is not None:
                    for buf in ring[s].values():
                        view = memoryview(buf.numpy()).cast("B")
                        offset += os.pwrite(fd, view, offset)
                    free.release()

            th = threading.Thread(target=writer, daemon=True)
            th.start()
            handles = [m.register_forward_hook(keep(name)) for name, m in modules]
            try:
                for ids in batches:
                    free.acquire()
                    model(ids)
                    todo.put(slot[0])
                    slot[0] ^= 1
            finally:
                for h in handles:
                    h.remove()
                todo.put(None)
                th.join()
                os.fsync(fd)
                os.close(fd)

        fns: dict[str, Callable[[], None]] = {
            "bare forward": bare,
            "hand-written hooks + clone + save_file per batch": handwritten,
        }
        if args.job_core:
            fns["floor: hooks copy_ into kept buffers, nothing written"] = copy_floor
            fns["floor: the same + O_DIRECT writes of the bytes by a thread, fsync"] = write_floor
        if nnsight is not None:
            nn_model = nnsight.NNsight(model)
            run_order = nnsight_order([name for name, _ in modules])

            def run_nnsight() -> None:
                os.makedirs(out, exist_ok=True)
                for i, ids in enumerate(batches):
                    saved: dict[str, torch.Tensor] = {}
                    with nn_model.trace(ids):
                        for name in run_order:  # nnsight reads outputs in execution order
                            node = nn_model
                            for part in name.split("."):
                                node = node[int(part)] if part.isdigit() else getattr(node, part)
                            o = node.output
                            saved[name] = (o[0] if isinstance(o, tuple) else o).save()
                    save_file(
                        {k: v.contiguous() for k, v in saved.items()},
                        os.path.join(out, f"batch-{i:05d}.safetensors"),
                    )

            fns[f"nnsight {nnsight.__version__} trace + save + save_file"] = run_nnsight
        fns["pyhook capture(out=dir), defaults"] = pyhook_run()
        if directio is not None and hasattr(directio, "direct_share"):
            # the write path of the defaults before direct I/O became the default
            fns["pyhook defaults, buffered writes (PYHOOK_DIRECT_IO=0, the previous default)"] = (
                pyhook_run(env={"PYHOOK_DIRECT_IO": "0"})
            )
        if not args.job_core:
            fns["pyhook, stats=False tokens=False fsync=False"] = pyhook_run(
                stats=False, tokens=False, fsync=False
            )
        # Where the defaults' cost goes: each option off alone.
        if not (args.job_no_split or args.job_core):
            fns["pyhook defaults, stats=False"] = pyhook_run(stats=False)
            fns["pyhook defaults, tokens=False"] = pyhook_run(tokens=False)
            fns["pyhook defaults, fsync=False"] = pyhook_run(fsync=False)
        wall: dict[str, list[float]] = {k: [] for k in fns}
        cpu: dict[str, list[float]] = {k: [] for k in fns}
        after: dict[str, list[float]] = {k: [] for k in fns}
        faults: dict[str, list[float]] = {k: [] for k in fns}
        after_faults: dict[str, list[float]] = {k: [] for k in fns}
        rng = random.Random(n)
        order = list(fns)
        with torch.inference_mode():
            for fn in fns.values():  # warm-up: pools, page cache, threads, nnsight's tracer
                shutil.rmtree(out, ignore_errors=True)
                fn()
            shutil.rmtree(out, ignore_errors=True)
            with capture(model, layers) as probe:
                model(batches[0])
            mb = sum(probe.parts(k)[0].nbytes for k in probe.layers) / 1e6
            del probe
            for _ in range(rounds):
                rng.shuffle(order)
                for name in order:
                    shutil.rmtree(out, ignore_errors=True)  # (each writes a fresh directory)
                    os.sync()
                    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    t0, c0 = time.perf_counter(), time.process_time()
                    fns[name]()
                    wall[name].append(time.perf_counter() - t0)
                    cpu[name].append(time.process_time() - c0)
                    f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    faults[name].append((f1 - f0) / len(batches))
                    t0 = time.perf_counter()
                    model(batches[0])  # the plain forward right after: did the variant slow it?
                    after[name].append(time.perf_counter() - t0)
                    f2 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    after_faults[name].append(f2 - f1)  # (a heap trimmed at close faults here)
        shutil.rmtree(out, ignore_errors=True)
        med = statistics.median
        b = "bare forward"
        rows = []
        for name in fns:
            w = [x / y for x, y in zip(wall[name], wall[b])]
            c = [x / y for x, y in zip(cpu[name], cpu[b])]
            a = [x / y for x, y in zip(after[name], after[b])]
            q = statistics.quantiles(w, n=4) if len(w) > 1 else [w[0], w[0], w[0]]
            rows.append(
                [
                    name,
                    f"{med(wall[name]) * 1e3:.0f}",
                    f"{med(w):.3f}x",
                    f"{q[0]:.3f}-{q[2]:.3f}",
                    f"{med(c):.3f}x",
                    f"{med(a):.3f}x",
                    f"{med(faults[name]):,.0f}",
                    f"{med(after_faults[name]):,.0f}",
                ]
            )
        if nnsight is None:
            rows.insert(2, ["nnsight: not installed, skipped", "-", "-", "-", "-", "-", "-", "-"])
        print(
            f"\n{n} hooked modules ({', '.join(layers)}), {mb:.1f} MB captured per batch, load "
            f"after {os.getloadavg()[0]:.2f}"
        )
        if directio is not None:
            c = directio.counters
            print(
                f"direct I/O ({directio.ENV}={directio.mode()}): {c['files']} shard files so far, "
                f"{c['direct_bytes'] / 1e6:,.0f} MB written from the buffers themselves, "
                f"{c['staged_bytes'] / 1e6:,.0f} MB through the staging buffer, "
                f"{c['fallbacks']} refusals"
            )
        print(
            table(
                rows,
                [
                    "variant",
                    "loop ms",
                    "wall / bare",
                    "middle half",
                    "process CPU / bare",
                    "next forward / bare's",
                    "minor faults / batch",
                    "next forward's faults",
                ],
            )
        )
        d = med(x / y for x, y in zip(wall["pyhook capture(out=dir), defaults"], wall[b]))
        h = med(x / y for x, y in zip(wall[rows[1][0]], wall[b]))
        c = med(x / y for x, y in zip(cpu["pyhook capture(out=dir), defaults"], cpu[b]))
        ok = d <= 1.03 and d <= h * 1.01 and c <= 1.02
        print(
            f"target (defaults <= 1.03x bare and within 1% of the hand-written loop, CPU <= "
            f"1.02x): {'met' if ok else 'NOT met'} ({d:.3f}x vs {h:.3f}x, CPU {c:.3f}x)"
        )


def aligned_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of ``t``'s shape and dtype whose data starts on a 4 KiB page
    (what ``O_DIRECT`` needs); its byte size must be a multiple of 4 KiB too."""
    n = t.numel() * t.element_size()
    raw = torch.empty(n + 4096, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % 4096
    return raw[skip : skip + n].view(t.dtype).view(t.shape)


# -- (c) GPU -----------------------------------------------------------------------------------------
def bench_host(args: argparse.Namespace) -> None:
    """(e) Repeated captures into host memory: joined results against reusable HostBuffers."""
    L, D, H, B, T, steps = (4, 128, 2, 4, 64, 3) if args.quick else (12, 768, 12, 8, 128, 6)
    rounds = args.host_rounds or (2 if args.quick else 7)
    model, batches = gpt2_and_batches(L, D, H, T, B, steps)
    blocks = model.h
    rows = B * T * steps
    mb = L * rows * D * 4 / 1e6
    print(
        f"\n(e) loop of captures to host memory: GPT-2 shape n_layer={L} d_model={D}, {steps} "
        f"batches of {B}x{T} tokens per capture, every block ({mb:.0f} MB of rows), the last "
        f"capture's rows held during the next, torch threads={torch.get_num_threads()}, "
        f"{rounds} paired rounds"
    )
    held: dict[str, object] = {}
    bufs = HostBuffers()
    # The strongest hand-written loop: per-layer buffers allocated (and faulted in) once.
    hand = [torch.zeros(rows, D) for _ in range(L)], [torch.zeros(rows, D) for _ in range(L)]

    def bare() -> None:
        for ids in batches:
            model(ids)

    def handwritten() -> None:
        # two sets of buffers, alternating: the previous loop's rows stay valid while held
        out = hand[0] if held.get("hand") is not hand[0] else hand[1]
        at = [0]

        def keep(i: int) -> Callable[..., None]:
            def hook(_m: torch.nn.Module, _a: object, o: object) -> None:
                t = o[0] if isinstance(o, tuple) else o
                n = t.shape[0] * t.shape[1]
                out[i][at[0] : at[0] + n].copy_(t.reshape(n, D))

            return hook

        hs = [b.register_forward_hook(keep(i)) for i, b in enumerate(blocks)]
        try:
            for ids in batches:
                model(ids)
                at[0] += B * T
        finally:
            for h in hs:
                h.remove()
        held["hand"] = out

    def joined() -> None:
        with capture(model, "h.*") as rec:
            for ids in batches:
                model(ids)
        held["joined"] = rec.results()

    def reused() -> None:
        with capture(model, "h.*", buffers=bufs) as rec:
            for ids in batches:
                model(ids)
        held["reused"] = rec.results()

    fns = {"bare forward": bare, "hand-written (buffers allocated once)": handwritten,
           "capture(to='host'), results joined": joined,
           "capture(..., buffers=HostBuffers())": reused}
    with torch.no_grad():
        for fn in fns.values():  # rows identical to the hand-written loop's
            fn()
        for i in range(L):
            assert torch.equal(held["joined"][f"h.{i}"], held["hand"][i])
            assert torch.equal(held["reused"][f"h.{i}"], held["hand"][i])
        times = compare(fns, rounds)
        # Each loop twice more, back to back, the faults of the second counted: what that loop
        # costs in its own steady state (another loop's frees may have had the heap trimmed).
        faults = {}
        for name, fn in fns.items():
            fn()
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            fn()
            faults[name] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    base, hw = times["bare forward"], times["hand-written (buffers allocated once)"]
    print(
        table(
            [
                [
                    name,
                    f"{statistics.median(t) * 1e3:.0f}",
                    f"{1 + paired_overhead(t, base):.3f}",
                    f"{1 + paired_overhead(t, hw):.3f}",
                    str(faults[name]),
                ]
                for name, t in times.items()
            ],
            ["loop", "median ms", "vs bare", "vs hand-written", "minor faults"],
        )
    )
    print(f"HostBuffers after the rounds: {bufs!r}, {bufs.stats()}")


def bench_gpu(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        print("\n(c) GPU path: skipped (no CUDA device)")
        return
    from transformers import GPT2Config, GPT2Model

    dev = torch.device("cuda")
    n = 256 << 20
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)

    def pinned_copy() -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    bw = n / timeit(pinned_copy, 5) / 1e6
    chunks = [torch.randn(16 << 20 >> 2, device=dev) for _ in range(16)]  # 16 x 16 MB
    off = Offloader(max_inflight_bytes=128 << 20)

    def offload() -> None:
        pending = [off.submit([c]) for c in chunks]
        for p in pending:
            off.release(p.wait())  # buffers go back to the pool, as the disk writer does

    off_bw = sum(c.nbytes for c in chunks) / timeit(offload, 5) / 1e6
    torch.manual_seed(0)
    model = (
        GPT2Model(GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=512))
        .to(dev)
        .eval()
    )
    ids = [torch.randint(0, 50257, (8, 512), device=dev) for _ in range(8)]

    def fwd() -> None:
        for x in ids:
            model(x)
        torch.cuda.synchronize()

    def fwd_cap() -> None:
        with capture(model, "h.*", flatten=False) as rec:
            for x in ids:
                model(x)
        rec.results()
        torch.cuda.synchronize()

    bufs = HostBuffers()  # pinned, faulted in by the first capture, reused by the rest

    def fwd_cap_bufs() -> None:
        with capture(model, "h.*", flatten=False, buffers=bufs) as rec:
            for x in ids:
                model(x)
        rec.results()
        torch.cuda.synchronize()

    with torch.no_grad():
        t_fwd = timeit(fwd, 3)
        t_cap = timeit(fwd_cap, 3)
        t_bufs = timeit(fwd_cap_bufs, 3)
    print(f"\n(c) GPU {torch.cuda.get_device_name()}")
    print(
        table(
            [
                ["pinned copy D2H (256 MB, one copy)", f"{bw:.0f}", "1.00"],
                [
                    "pyhook Offloader (16 x 16 MB, side stream, pooled)",
                    f"{off_bw:.0f}",
                    f"{off_bw / bw:.2f}",
                ],
            ],
            ["what", "MB/s", "vs pinned copy"],
        )
    )
    print(
        table(
            [
                ["GPT-2 small forward, 8 x (8x512)", f"{t_fwd * 1e3:.0f}", "1.00"],
                [
                    "... + capture of all 12 residual streams to host",
                    f"{t_cap * 1e3:.0f}",
                    f"{t_cap / t_fwd:.2f}",
                ],
                [
                    "... the same into reused pinned HostBuffers",
                    f"{t_bufs * 1e3:.0f}",
                    f"{t_bufs / t_fwd:.2f}",
                ],
            ],
            ["loop", "ms", "vs forward"],
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    p.add_argument(
        "--out-dir", default=None, help="directory on the disk to test (default: a temp dir)"
    )
    p.add_argument(
        "--skip", nargs="*", default=[], choices=["peers", "disk", "gpu", "job", "host"]
    )
    p.add_argument("--host-rounds", type=int, default=0, help="paired rounds of (e) (default 7)")
    p.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (default 1: stable timings)"
    )
    p.add_argument("--repeat", type=int, default=15, help="timed rounds per method in (a)")
    p.add_argument("--n-layer", type=int, default=12, help="blocks of the (a) model")
    p.add_argument("--d-model", type=int, default=128, help="width of the (a) model (768 = GPT-2 small)")
    p.add_argument(
        "--job-threads", type=int, default=0,
        help="torch threads for (d) (default 0: torch's default, every core, as a user runs it)",
    )
    p.add_argument("--job-rounds", type=int, default=0, help="paired rounds of (d)")
    p.add_argument(
        "--job-no-split", action="store_true",
        help="(d) without the variants that turn stats, tokens, fsync or direct I/O off one by one",
    )
    p.add_argument(
        "--job-core", action="store_true",
        help="(d) with only the bare forward, the hand-written loop, a floor that only copies "
        "the rows, nnsight, the defaults and the defaults with buffered writes (the previous "
        "default), side by side",
    )
    p.add_argument(
        "--job-modules", type=int, nargs="*", default=[12, 48], choices=[12, 48],
        help="hooked modules of (d)",
    )
    p.add_argument(
        "--job-batches", type=int, default=0,
        help="batches per loop of (d) (default 6): a capture's fixed costs (its writer thread, "
        "the pool's first buffers, the index) are spread over this many batches",
    )
    args = p.parse_args()
    default_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    # (a) GPT-2's 12 blocks at a width (--d-model, default 128) where a forward takes a few ms on
    # a small CPU: at GPT-2 small's 768 a 1 x 32 forward takes ~140 ms on a 2-vCPU VM and every
    # tool's overhead drowns in the noise (RESULTS.md has that run). (b) uses a narrow model so
    # that the disk, not the CPU, is the bottleneck it measures.
    args.layers, args.seq, args.batch = (4, 64, 4) if args.quick else (args.n_layer, 128, 8)
    args.d_model, args.heads = (128, 4) if args.quick else (args.d_model, args.d_model // 64)
    args.repeat = 3 if args.quick else args.repeat
    regimes = [
        # (name, batch, tokens, batches per loop)
        ("latency: one short example per forward", 1, 32, 4 if args.quick else 32),
        ("throughput: 8 x 128 tokens per forward", args.batch, args.seq, 2 if args.quick else 6),
    ]
    args.disk_shape = (4, 128, 4, 64, 4) if args.quick else (6, 256, 4, 128, 8)
    args.disk_steps, args.dd_mb = (4, 64) if args.quick else (12, 512)
    args.disk_rounds = 2 if args.quick else 7
    # (d) GPT-2 small (12 x 768), 8 x 128 tokens a batch; --quick: a narrow model, few rounds.
    args.job_shape = (12, 128, 2, 4, 64, 4) if args.quick else (12, 768, 12, 8, 128, 6)
    if args.job_batches:
        args.job_shape = (*args.job_shape[:5], args.job_batches)
    args.job_rounds = args.job_rounds or (2 if args.quick else 7)
    print(
        f"pyhook capture benchmark: {platform.platform()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, python {platform.python_version()}"
    )
    if "peers" not in args.skip:
        bench_per_layer(args)
        for regime, b, t, steps in regimes:
            bench_peers(args, regime, b, t, steps)
    if "disk" not in args.skip:
        bench_disk(args)
    if "gpu" not in args.skip:
        bench_gpu(args)
    if "host" not in args.skip:
        torch.set_num_threads(args.job_threads or default_threads)
        bench_host(args)
    if "job" not in args.skip:
        torch.set_num_threads(args.job_threads or default_threads)
        bench_job(args)


if __name__ == "__main__":
    main()
