"""The capture job: the whole pipeline (corpus -> model -> layers -> store or trainer) as one
config, the thing the ``pyhook capture`` command parses its flags (or ``--config job.yaml``) into.

:class:`CaptureJob` holds the options; :meth:`~CaptureJob.plan` checks everything it can before
the first forward and says what the run will write (:class:`CapturePlan`: rows, bytes and shards
per layer, the free space, what is already stored); :meth:`~CaptureJob.run` writes the store and
returns a :class:`CaptureResult` summed over every rank; :meth:`~CaptureJob.stream` hands the same
model, corpus and layers to :func:`pyhook.pipeline.stream.stream` for a trainer that reads
activations without a disk. :meth:`CaptureJob.from_file` reads a job from JSON (or YAML).

Importing this module does not import torch: the command checks its arguments (and the job's
values) before it pays for that.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._generate_options import STEER_FIELDS, _got
from ._names import check_model_name

if TYPE_CHECKING:
    from torch import nn
from ._paths import _existing_dir, _is_url, check_out_dir, input_problem
from .runner import _MAP_WORDS  # the words transformers knows (torch-free)

__all__ = [
    "CaptureJob",
    "CapturePlan",
    "CaptureResult",
    "JobError",
    "LayerPlan",
    "default_corpus",
    "default_layers",
]

#: ``context_size`` of the default job (the bundled corpus): packed, SAE-style contexts.
DEFAULT_CONTEXT_SIZE = 128

# Names of the storable dtypes (pyhook.store.format's list, spelled without torch so that the
# command checks --dtype before importing it; tests/test_job.py keeps the two in step).
_DTYPE_NAMES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
)
_DTYPE_ALIASES = ("fp32", "fp16", "half", "bf16", "float", "double", "fp64")


def default_corpus() -> str:
    """Path of the bundled public-domain corpus (320 fairy-tale lines).

    >>> os.path.basename(default_corpus())
    'fairy_tales.txt'
    """
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(here, "data", "fairy_tales.txt")


# -- words: a message names an option as Python spells it (``limit``) or as the command does
# (``--limit``). Messages are written with `name` (and `name=True` for a switch) and spelled when
# shown, so one check serves both.
_MARK = re.compile(r"`([a-z_]+)(=True)?`")
#: options whose flag is not the option's name with dashes (one set a flag, repeated)
_FLAG_NAMES = {"steer_sets": "steer-set"}


def _spell(text: str, flags: bool = False) -> str:
    """Render the `name` marks of a message as Python names or as the command's flags.

    >>> _spell("`limit` must be >= 1; or `overwrite=True`")
    'limit must be >= 1; or overwrite=True'
    >>> _spell("`limit` must be >= 1; or `overwrite=True`", flags=True)
    '--limit must be >= 1; or --overwrite'
    """

    def one(m: re.Match[str]) -> str:
        name, switch = m.group(1), m.group(2) or ""
        if flags:
            return "--" + _FLAG_NAMES.get(name, name.replace("_", "-"))
        return name + switch

    return _MARK.sub(one, text)


#: The longest message a :class:`JobError` carries (a job file's value may be any size).
_MAX_MESSAGE = 2000


class JobError(ValueError):
    """A job that cannot run as configured: one line naming the option and what was expected.

    ``str(e)`` names options as Python does (``limit``); the command prints
    ``e.spelled(flags=True)`` (``--limit``). A value of the wrong type raises one that is also a
    ``TypeError``.

    >>> try:
    ...     CaptureJob(limit=0)
    ... except JobError as e:
    ...     print(e); print(e.spelled(flags=True))
    limit must be >= 1, got 0
    --limit must be >= 1, got 0
    """

    def __init__(self, template: str) -> None:
        if len(template) > _MAX_MESSAGE:  # (values are shown by _got; a name may be long)
            template = template[: _MAX_MESSAGE - 20] + " ... (message cut)"
        self.template = template
        super().__init__(_spell(template))

    def spelled(self, flags: bool = False) -> str:
        return _spell(self.template, flags)


class _JobTypeError(JobError, TypeError):
    """A :class:`JobError` for a value of the wrong type (also a ``TypeError``)."""


def _human(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header), fmt.format(*["-" * w for w in widths])]
    out += [fmt.format(*map(str, r)) for r in rows]
    return "\n".join(out)


def _shown(path: str) -> str:
    """A capture's place as the user sees it: a URL as given, a folder made absolute."""
    return path if _is_url(path) else os.path.abspath(path)


# How each stored setting is named in a refusal to resume (a job option, spelled when shown).
_SETTING_WORDS = {
    "model_path": "`model`",
    "tokenizer_path": "`tokenizer`",
    "model_class": "`model_class`",
    "input": "`input`",
    "input_sha1": "`input` (its contents)",
    "text_column": "`text_column`",
    "context_size": "`context_size`",
    "exclude_special_tokens": "`exclude_special_tokens`",
    "max_length": "`max_length`",
    "model_dtype": "`model_dtype`",
    "dtype": "`dtype`",
    "positions": "`positions`",
    "layers": "`layers`",
    "examples_total": "the number of examples (several ranks)",
    "quantize": "`quantize`",
    "compress": "`compress`",
    "generate": "`generate`",
    "generated_only": "`generated_only`",
    "sampling": "`sampling`",
    "seed": "`seed`",
    "generate_kwargs": "`generate_kwargs`",
    "steer": "`steer`",
    "steer_sets": "`steer_sets`",
    "steer_column": "`steer_column`",
    "steer_scale_column": "`steer_scale_column`",
    "gradients": "`gradients`",
    "metric": "`metric`",
}
_DEFAULT_WORDS = {
    "dtype": "the model's",
    "model_dtype": "the checkpoint's",
    "positions": "all",
    "context_size": "none: one example per row",
    "max_length": "none",
    "generate": "none (a forward over the corpus)",
}


def _setting_value(key: str, v: Any) -> str:
    if v is None:
        return _DEFAULT_WORDS.get(key, "none")
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, list):
        return " ".join(map(str, v))
    return str(v)


def settings_differences(stored: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The settings that differ, as marked message parts (```dtype` float16 now, the model's
    when stored``); keys only one side has are compared as absent (None).

    >>> [_spell(d, flags=True) for d in settings_differences(
    ...     {"dtype": None, "positions": None}, {"dtype": "float16", "positions": None})]
    ["--dtype float16 now, the model's when stored"]
    """
    out = []
    for key in now:
        if key not in _SETTING_WORDS or stored.get(key) == now.get(key):
            continue
        if key == "input_sha1" and stored.get("input") != now.get("input"):
            continue  # another file: its contents differ too, no need to say it
        out.append(
            f"{_SETTING_WORDS[key]} {_setting_value(key, now.get(key))} now, "
            f"{_setting_value(key, stored.get(key))} when stored"
        )
    return out


def _sum_over_ranks(values: list[int], device: Any) -> list[int]:
    """``values`` summed over the ranks of the initialised process group (as is without one)."""
    import torch

    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    on = device if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.int64, device=on)
    dist.all_reduce(t)
    return [int(v) for v in t.tolist()]


def default_layers(model: Any) -> str:
    """``resid_post.*`` (every block's output, a standard point) when the model's architecture
    has a mapping (see :mod:`pyhook.points`), else a glob for the children of its longest
    ``nn.ModuleList``.

    >>> import torch
    >>> default_layers(torch.nn.Sequential(torch.nn.ModuleList([torch.nn.ReLU()])))
    '0.*'
    """
    from torch import nn

    from ..points import architecture_of

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
        raise JobError("could not guess the model's blocks (no ModuleList); pass `layers`")
    return f"{best}.*"


# -- several models (pyhook.pipeline.paired): checked here, without torch ------------------------
def _check_models(v: dict[Any, Any]) -> None:
    """``model`` as a mapping of names to models (a paired capture), checked."""
    if len(v) < 2:
        only = f" ({_got(next(iter(v)))})" if v else ""
        raise JobError(
            f"`model` names {len(v)} model(s){only}: several named models make one paired "
            "store (`model` {'base': DIR, 'chat': DIR2}; --model base=DIR --model chat=DIR2); "
            "for one model give its folder or name alone"
        )
    for name, spec in v.items():
        problem = check_model_name(name)
        if problem:
            raise JobError(f"`model`: {problem}")
        if not isinstance(spec, str) or not spec:
            raise _JobTypeError(
                f"`model` {name!r} must be a checkpoint folder or a model's name, got {_got(spec)}"
            )


def models_from_flags(values: list[str]) -> str | dict[str, str]:
    """``--model`` given once or several times: one model (``DIR``) or named models
    (``NAME=DIR`` each; ``NAME`` must not contain ``/``). A value that is an existing path is a
    path, even with a ``=`` in it. Unnamed and given again, the last one counts (as any flag).

    >>> models_from_flags(["./ckpt"]), models_from_flags(["base=./a", "chat=./b"])
    ('./ckpt', {'base': './a', 'chat': './b'})
    >>> models_from_flags(["./a", "chat=./b"])
    Traceback (most recent call last):
    ...
    pyhook.pipeline.job.JobError: model './a' has no name but 'chat=./b' has one: name every model (--model base=DIR --model chat=DIR2)
    """
    named: dict[str, str] = {}
    plain: list[str] = []
    for v in values:
        if "=" in v and not os.path.exists(v):
            name, spec = v.split("=", 1)
            problem = check_model_name(name)
            if problem:
                raise JobError(f"`model` {v!r} is neither a folder nor NAME=DIR: {problem}")
            if name in named:
                raise JobError(
                    f"`model`: the name {name!r} is given twice ({name}={named[name]}, {v}); "
                    "give each model its own name"
                )
            if not spec:
                raise JobError(f"`model` {v!r}: no folder or model name after '='")
            named[name] = spec
        else:
            plain.append(v)
    if named and plain:
        first = next(iter(named))
        raise JobError(
            f"`model` {plain[0]!r} has no name but '{first}={named[first]}' has one: name every "
            "model (--model base=DIR --model chat=DIR2)"
        )
    if plain:  # unnamed, given again: the last one counts, as for every other flag
        return plain[-1]
    _check_models(named)
    return named


def _paired_default_layers(pair: Any) -> list[str]:
    """Every model's default layers (:func:`default_layers`) for a
    :class:`~pyhook.pipeline.paired.Paired`: one entry when the models agree (a layer without a
    model's name is taken from every model), else ``NAME/LAYER`` each."""
    per = {n: default_layers(pair.model(n)) for n in pair.names}
    if len(set(per.values())) == 1:
        return [next(iter(per.values()))]
    return [f"{n}/{layer}" for n, layer in per.items()]


# -- the job -----------------------------------------------------------------------------------
@dataclass
class CaptureJob:
    """One capture, configured as data: the model, the corpus and how it is cut, the layers,
    what is stored and where. The ``pyhook capture`` command takes the same options as flags
    (``context_size`` is ``--context-size``) or as a file (:meth:`from_file`).

    >>> import tempfile, pyhook
    >>> job = pyhook.CaptureJob(model="minilm", layers=["resid_post.5"], limit=2,
    ...                         out=tempfile.mkdtemp())
    >>> plan = job.plan()                     # checks, size estimate; nothing written yet
    >>> plan.examples, plan.exact, [layer.name for layer in plan.layers]
    (2, True, ['resid_post.5'])
    >>> result = job.run(plan)                # the store; sums over every rank
    >>> result.examples, result.rows["resid_post.5"] == plan.rows
    (2, True)
    >>> pyhook.open_capture(job.out)["resid_post.5"].shape[1]
    384

    Options (every one optional):

    * ``model``: a local checkpoint folder, a built-in name (``minilm``) or a model in the local
      Hugging Face cache; never downloaded; or a mapping ``{name: model}`` of several models into
      one store (layers stored as ``name/LAYER``; see :mod:`pyhook.pipeline.paired`).
      ``tokenizer`` (for a checkpoint saved without one),
      ``model_class`` (a transformers class name), ``model_dtype`` (dtype to load it in),
      ``device``. A ``model`` may also be a model object already loaded (``tokenizer`` names
      its tokenizer when it was not loaded from a folder).
    * large models (docs/large-models.md): ``device_map``, ``max_memory``,
      ``offload_folder`` (placed and offloaded by accelerate, as ``from_pretrained`` takes
      them); ``tp_size`` (under torchrun: tensor-parallel groups of that many ranks; the
      world / ``tp_size`` data-parallel groups split the corpus, the first rank of each writes).
    * ``input``: the corpus (txt, jsonl/json, csv, parquet or a folder of them, a
      ``save_to_disk`` folder; default the bundled corpus), ``text_column``, ``context_size``
      (pack documents into contexts of N tokens; default 128 for the bundled corpus without
      ``max_length``, else one example per row), ``max_length`` (one example per row: tokens kept per example; default
      128 or the model's positions), ``exclude_special_tokens``, ``limit`` (first N examples or
      contexts), ``batch_size`` (examples or contexts per forward).
    * ``layers``: names, globs or standard points (default every block, ``resid_post.*``);
      ``positions`` (``"all"``, ``"last"`` or an index); ``dtype`` (stored dtype).
    * ``generate`` (N): continue each example (a prompt, one per row) with ``model.generate``
      for up to N new tokens and store the rows of every token run through the model (see
      :mod:`pyhook.pipeline.generate`); ``generated_only`` (only generated tokens' rows; with
      ``positions="last"``: the last token of each step), ``sampling`` (``"greedy"``,
      ``"sample"``, or ``"model"``: its ``generation_config``), ``seed``, ``generate_kwargs``
      (more ``generate`` options, e.g. ``{"temperature": 0.7}``), ``steer`` (steering specs as
      data, applied to every prompt: dicts of :class:`pyhook.Steer`'s fields whose vector is
      ``"FILE[:NAME]"`` of a ``.safetensors``/``.pt``/``.npy`` file, or the command's
      ``POINT=FILE[:NAME][*SCALE]``; see docs/steering.md). Per example: ``steer_sets``
      (``{name: [spec, ...]}``; the command's ``NAME:POINT=FILE[:NAME][*SCALE]``) with
      ``steer_column`` (the corpus column naming each example's set; empty or null: ``steer``,
      or no steering), and ``steer_scale_column`` (a column of numbers multiplying each
      example's scales); the store's ``meta["steering"]`` records each example's set and specs.
    * ``gradients`` (``true``, or names/globs among ``layers``) and ``metric``: also store
      ``"<layer>_grad"``, the gradient of each example's metric at that layer (docs/job.md,
      "Gradients"). In a file ``metric`` is a named metric, ``"loss"`` (next-token loss) or
      ``"logit:<token id>"``; from Python also a callable ``(output, batch) -> [batch]``.
    * ``out`` (a folder or an fsspec URL), ``shard_mb``, ``overwrite`` (replace a different
      capture there), ``force`` (start even when the estimate exceeds the free space), ``stats``
      (per-layer statistics), ``tokens`` (token ids and row index next to the rows);
      ``quantize`` (``"fp8"``/``"int8"``: one byte a value and a float32 scale a row) and
      ``compress`` (``"zstd"``: lossless), a compact store (docs/store-format.md).

    Values are checked when the job is made (a :class:`JobError` naming the option); what needs
    the model or the files (does the corpus have that column, does the layer run) is checked by
    :meth:`plan`, before the weights are loaded where it can be.
    """

    model: str | dict[str, str] | nn.Module | None = None
    tokenizer: str | None = None
    model_class: str | None = None
    layers: list[str] | None = None
    input: str | None = None
    text_column: str | None = None
    context_size: int | None = None
    exclude_special_tokens: bool | None = None
    limit: int | None = None
    batch_size: int = 32
    max_length: int | None = None
    dtype: str | None = None
    model_dtype: str | None = None
    positions: str | int = "all"
    device: str = "cpu"
    device_map: str | dict[str, Any] | None = None
    max_memory: dict[str, Any] | None = None
    offload_folder: str | None = None
    tp_size: int = 1
    out: str = "pyhook-activations"
    shard_mb: float = 256.0
    overwrite: bool = False
    force: bool = False
    stats: bool = True
    tokens: bool = True
    quantize: str | None = None
    compress: str | None = None
    generate: int | None = None
    generated_only: bool = False
    sampling: str = "greedy"
    seed: int = 0
    generate_kwargs: dict[str, Any] | None = None
    steer: list[Any] | None = None
    gradients: bool | list[str] | None = None
    metric: Any = None
    steer_sets: dict[str, list[Any]] | None = None
    steer_column: str | None = None
    steer_scale_column: str | None = None

    def __post_init__(self) -> None:
        # the forms a file or the command gives, made one (so equal jobs compare equal)
        if isinstance(self.layers, str):
            self.layers = [self.layers]
        elif isinstance(self.layers, tuple):
            self.layers = list(self.layers)
        for name in ("input", "out", "model", "tokenizer"):
            v = getattr(self, name)
            if isinstance(v, os.PathLike):
                setattr(self, name, os.fspath(v))
        if isinstance(self.model, dict):  # several named models (a paired capture)
            self.model = {
                k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in self.model.items()
            }
        if self.positions is None:
            self.positions = "all"
        if isinstance(self.positions, str) and re.fullmatch(r"-?\d+", self.positions.strip()):
            self.positions = int(self.positions)
        if isinstance(self.shard_mb, int) and not isinstance(self.shard_mb, bool):
            self.shard_mb = float(self.shard_mb)
        if isinstance(self.steer, (str, dict)):
            self.steer = [self.steer]
        if isinstance(self.steer, (list, tuple)):  # the command's POINT=FILE[:NAME][*SCALE]
            self.steer = [_steer_flag(s) if isinstance(s, str) else s for s in self.steer]
        self.steer_sets = _steer_sets_given(self.steer_sets)
        self.check()

    # -- checks that need neither torch nor a file --------------------------------------------
    def check(self) -> None:
        """Raise :class:`JobError` for a value of the wrong type or range, or options that
        contradict each other (run when the job is made; needs neither torch nor any file)."""
        types = {f.name: f.type for f in dataclasses.fields(self)}
        for name, kind in types.items():
            v = getattr(self, name)
            if name == "layers":
                if v is None:
                    continue
                if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                    raise _JobTypeError(
                        f"`layers` must be a list of layer names or globs, got {_got(v)}"
                    )
                if not v or not all(v):
                    raise JobError(f"`layers` must name at least one layer, got {_got(v)}")
            elif name == "model" and isinstance(v, dict):
                _check_models(v)
            elif name == "model" and _is_module(v):
                continue  # a model already loaded (checked with the loading options below)
            elif name in ("device_map", "max_memory"):
                _check_placement(name, v)
            elif name == "positions":
                if not (v in ("all", "last") or (isinstance(v, int) and not isinstance(v, bool))):
                    raise JobError(
                        f"`positions` must be 'all', 'last' or an integer, got {_got(v)}"
                    )
            elif name == "seed":
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise JobError(f"`seed` must be an integer >= 0, got {_got(v)}")
            elif name == "generate_kwargs":
                if v is not None:
                    _check_generate_kwargs(v)
            elif name == "steer":
                if v is not None:
                    _check_steer(v)
            elif name == "steer_sets":
                if v is not None:
                    _check_steer_sets(v)
            elif name in ("gradients", "metric"):
                continue  # _check_gradients, below
            elif name == "shard_mb":
                if isinstance(v, bool) or not isinstance(v, float) or not 0 < v < math.inf:
                    raise JobError(
                        f"`shard_mb` must be > 0 and finite (MB per shard), got {_got(v)}"
                    )
            elif "bool" in kind:
                if not (isinstance(v, bool) or (v is None and "None" in kind)):
                    raise _JobTypeError(f"`{name}` must be true or false, got {_got(v)}")
            elif "int" in kind:
                if v is None and "None" in kind:
                    continue
                if isinstance(v, bool) or not isinstance(v, int):
                    raise _JobTypeError(f"`{name}` must be an integer, got {_got(v)}")
                if v < 1:
                    raise JobError(f"`{name}` must be >= 1, got {v}")
            elif "str" in kind and not (isinstance(v, str) or (v is None and "None" in kind)):
                hint = (
                    " (a checkpoint folder or a model's name, or a mapping of names to them for "
                    "a paired capture, or a torch.nn.Module already loaded)"
                    if name == "model"
                    else ""
                )
                raise _JobTypeError(f"`{name}` must be a string, got {_got(v)}{hint}")
        for name in (
            "model",
            "tokenizer",
            "model_class",
            "input",
            "text_column",
            "out",
            "steer_column",
            "steer_scale_column",
        ):
            v = getattr(self, name)
            if isinstance(v, str) and not v.strip():  # `--input "$CORPUS"` with it unset
                raise JobError(
                    f"`{name}` is empty, got {v!r}: leave it out for the default, or name one"
                )
        if isinstance(self.model_class, str) and not re.fullmatch(
            r"[A-Za-z_][A-Za-z0-9_]*", self.model_class
        ):  # a name in transformers (AutoModel, GPT2LMHeadModel), never a path or module
            raise JobError(
                "`model_class` must be the name of a transformers model class (e.g. AutoModel, "
                f"AutoModelForCausalLM), got {_got(self.model_class)}"
            )
        for name in ("dtype", "model_dtype"):
            v = getattr(self, name)
            if v is not None:
                key = v.lower().removeprefix("torch.")
                if key not in _DTYPE_NAMES and key not in _DTYPE_ALIASES:
                    raise JobError(
                        f"`{name}` must be one of {', '.join(_DTYPE_NAMES)} (a name such as "
                        f"'bf16'), got {_got(v)}"
                    )
        for name, choices in (("quantize", ("fp8", "int8")), ("compress", ("zstd",))):
            v = getattr(self, name)
            if v is not None and v not in choices:
                raise JobError(
                    f"`{name}` must be {' or '.join(map(repr, choices))} (or absent), got {_got(v)}"
                )
        self._check_generate()
        self._check_gradients()
        self._check_loading()
        if self.context_size is not None and self.max_length is not None:
            raise JobError(
                "`max_length` cuts each example of a one-example-per-row capture; with "
                f"`context_size` every row is a context of exactly {self.context_size} tokens: "
                "drop one of them"
            )

    def _check_gradients(self) -> None:
        g, m = self.gradients, self.metric
        if g is not None and g is not True and g is not False:
            if isinstance(g, str):
                g = self.gradients = [g]
            if not isinstance(g, list) or not g or not all(isinstance(x, str) and x for x in g):
                raise _JobTypeError(
                    f"`gradients` must be true or a list of captured layer names, got {_got(g)}"
                )
        if not g:
            if m is not None:
                raise JobError(
                    "`metric` is the function whose gradient `gradients` stores: "
                    "give `gradients` too (true, or layer names)"
                )
            return
        if m is None:
            raise JobError(
                "`gradients` needs `metric`: 'loss' (each example's next-token loss) or "
                "'logit:<token id>' (that token's logit at each example's last position)"
            )
        if isinstance(m, str):
            if not re.fullmatch(r"loss|logit:\d+", m.strip()):
                raise JobError(
                    f"`metric` must be a named metric, 'loss' or 'logit:<token id>' (a callable "
                    f"only from Python), got {_got(m)}"
                )
        elif not callable(m):
            raise _JobTypeError(
                f"`metric` must be 'loss', 'logit:<token id>' or (from Python) a callable "
                f"(output, batch) -> [batch] tensor, got {_got(m)}"
            )
        if self.generate is not None:
            raise JobError("`gradients` are of plain forwards: not with `generate`")
        if isinstance(self.model, dict):
            raise JobError("`gradients` are of one model, not several (`model` is a mapping)")

    def _check_loading(self) -> None:
        """The loading options: for one checkpoint the job loads (not a model object, not a
        paired capture), and one way at a time (accelerate's placement or tensor parallelism)."""
        given = [
            n
            for n, default in (
                ("device_map", None),
                ("max_memory", None),
                ("offload_folder", None),
                ("tp_size", 1),
            )
            if getattr(self, n) != default
        ]
        if not given:
            return
        if _is_module(self.model):
            raise JobError(
                f"`{given[0]}` is an option of loading a checkpoint; the `model` given is already "
                "loaded (its layout is its own): leave the loading options out"
            )
        if isinstance(self.model, dict):
            raise JobError(
                f"`{given[0]}`: a paired capture (several named `model`s) loads each model "
                "whole; load large models one at a time"
            )
        if self.device_map is None and ("max_memory" in given or "offload_folder" in given):
            which = "max_memory" if "max_memory" in given else "offload_folder"
            raise JobError(
                f"`{which}` places layers with `device_map`: add `device_map` (e.g. 'auto')"
            )
        if self.device_map is not None and self.tp_size > 1:
            raise JobError(
                "`device_map` and `tp_size` are two ways of placing the model (offloading or "
                "tensor parallelism), as in transformers: give one of them"
            )
        if self.generate is not None and self.tp_size > 1:
            raise JobError(
                "`generate` with `tp_size`: capture during generation runs on one model per "
                "rank; drop `tp_size` or `generate`"
            )

    def _check_generate(self) -> None:
        """The generation options: only with `generate`, and not with packed contexts."""
        if self.generate is None:
            for name, default in (
                ("generated_only", False),
                ("sampling", "greedy"),
                ("seed", 0),
                ("generate_kwargs", None),
                ("steer", None),
                ("steer_sets", None),
                ("steer_column", None),
                ("steer_scale_column", None),
            ):
                if getattr(self, name) != default:
                    raise JobError(
                        f"`{name}` is an option of capture during generation: add `generate` "
                        "(new tokens per prompt)"
                    )
            return
        if self.steer_sets is not None and self.steer_column is None:
            raise JobError(
                "`steer_sets`: each example's set is named by `steer_column` (a corpus column "
                "holding the set's name): add `steer_column`"
            )
        if self.steer_column is not None and self.steer_sets is None:
            raise JobError(
                f"`steer_column` {self.steer_column!r} names each example's set, defined by "
                "`steer_sets`: add `steer_sets`"
            )
        if self.steer_scale_column is not None and not (self.steer or self.steer_sets):
            raise JobError(
                f"`steer_scale_column` {self.steer_scale_column!r} multiplies the scales of "
                "each example's steering specs: add `steer` (every example's) or `steer_sets`"
            )
        if self.sampling not in ("greedy", "sample", "model"):
            raise JobError(
                "`sampling` must be 'greedy', 'sample' (seeded by `seed`) or 'model' (the "
                f"model's generation_config), got {_got(self.sampling)}"
            )
        if isinstance(self.model, dict):
            raise JobError(
                "`generate` captures one model's generation; a paired capture (several named "
                "`model`s) runs plain forwards over the corpus"
            )
        if self.context_size is not None:
            raise JobError(
                "`context_size` packs the corpus into contexts; `generate` continues each "
                "example (one prompt per row, left-padded): drop `context_size`"
            )
        if self.positions not in ("all", "last"):
            raise JobError(
                f"`positions` {self.positions!r} with `generate`: use 'all' (every token) or "
                "'last' (the last token of each generation step)"
            )

    def check_files(self) -> None:
        """Raise :class:`JobError` when a file the job reads is missing: ``input`` (a file or
        folder; absent, the bundled corpus). Needs no torch: the command calls it with the
        other checks of its arguments, and :meth:`plan` before it imports anything heavier.

        >>> CaptureJob(input="no-such-corpus.txt").check_files()
        Traceback (most recent call last):
        ...
        pyhook.pipeline.job.JobError: cannot read input 'no-such-corpus.txt': No such file or directory
        """
        if self.input is not None:
            problem = input_problem(self.input)
            if problem:
                shown = repr(self.input) if len(self.input) <= 500 else _got(self.input)
                raise JobError(f"cannot read `input` {shown}: {problem}")

    # -- files ----------------------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | os.PathLike[str], **overrides: Any) -> CaptureJob:
        """The job a JSON or YAML file describes (keys are the option names; ``overrides``
        replace the file's values, as the command's flags do).

        >>> import json, os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "job.json")
        >>> _ = open(path, "w").write(json.dumps({"model": "minilm", "context_size": 64}))
        >>> CaptureJob.from_file(path, limit=8).context_size
        64
        >>> _ = open(path, "w").write(json.dumps({"context_sise": 64}))
        >>> CaptureJob.from_file(path)
        Traceback (most recent call last):
        ...
        pyhook.pipeline.job.JobError: job.json: unknown key 'context_sise' (did you mean 'context_size'?)
        """
        values = cls.read_file(path)
        return cls(**{**values, **overrides})

    @classmethod
    def read_file(cls, path: str | os.PathLike[str]) -> dict[str, Any]:
        """The options a job file sets, checked: a mapping whose keys are option names (``-``
        may stand for ``_``); an unknown key is refused naming it and the closest option."""
        path = os.fspath(path)
        name = os.path.basename(path)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise JobError(f"cannot read the job file {path!r}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise JobError(f"the job file {path!r} is not UTF-8 text") from None
        if path.lower().endswith((".yaml", ".yml")):
            try:
                import yaml
            except ImportError:
                raise JobError(
                    f"reading {name} needs PyYAML (pip install pyyaml); or write the job as JSON"
                ) from None
            try:
                data = yaml.load(text, Loader=_job_yaml_loader(yaml))  # a safe loader, below
            except RecursionError:
                raise JobError(f"{name} is nested too deeply to be a job") from None
            except yaml.YAMLError as e:
                where = getattr(e, "problem_mark", None)
                at = f" (line {where.line + 1})" if where is not None else ""
                raise JobError(
                    f"{name} is not valid YAML{at}: {getattr(e, 'problem', e)}"
                ) from None
        else:
            try:
                data = json.loads(text, parse_int=_file_int)
            except RecursionError:
                raise JobError(f"{name} is nested too deeply to be a job") from None
            except json.JSONDecodeError as e:
                raise JobError(f"{name} is not valid JSON (line {e.lineno}): {e.msg}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise JobError(
                f"{name} must hold a mapping of options (model, layers, input, ...), "
                f"got a {type(data).__name__}"
            )
        known = [f.name for f in dataclasses.fields(cls)]
        values = {}
        for key, v in data.items():
            k = str(key).replace("-", "_")
            if k not in known:
                raise JobError(f"{name}: unknown key {_got(key)}{_closest(k, known)}")
            if k in values and values[k] != v:  # `context-size` and `context_size` differ
                raise JobError(f"{name}: the option {k!r} is given twice, with different values")
            values[k] = v
        try:
            cls(**values)  # its values alone, so a mistake names the file and its key
        except JobError as e:
            raise JobError(f"{name}: {e}") from None
        return values

    # -- the plan -------------------------------------------------------------------------------
    def _world(self) -> tuple[int, int]:
        """This rank's data-parallel rank and size (the share of the corpus it reads)."""
        lay = self._layout()
        return lay.dp_rank, lay.dp_size

    def _layout(self) -> Any:
        """The ranks (:func:`pyhook.pipeline.ranks.rank_layout`: torch.distributed or the
        environment) with this job's ``tp_size`` (or a model object's own)."""
        from .ranks import rank_layout

        try:
            if _is_module(self.model):
                return rank_layout(model=self.model)
            return rank_layout(tp_size=self.tp_size)
        except ValueError as e:
            raise JobError(f"`tp_size`: {e}") from None

    def _check_out(self, out: str) -> None:
        """``out`` must be (or be creatable as) a writable folder. A URL is checked by the
        writer, which names what is wrong (a missing fsspec backend, credentials, the bucket)."""
        check_out_dir(out, "`out`", JobError)

    def _source(self, *, rank: int, world: int) -> dict[str, Any]:
        """The model's config and tokenizer and the corpus, all checked before the weights."""
        from .runner import RunnerError, in_memory, load_tokenizer, prepare_model
        from .source import SourceError, open_source

        paired = isinstance(self.model, dict)
        loaded = _is_module(self.model)  # a model object, already loaded
        if paired:  # several named models, one store (pyhook.pipeline.paired)
            from .paired import prepare_models

            prepared = prepare_models(self.model, model_class=self.model_class)  # type: ignore[arg-type]
        elif loaded:
            prepared = in_memory(self.model)
        else:
            prepared = prepare_model(self.model, model_class=self.model_class, need_tokenizer=False)
        try:
            if loaded and self.tokenizer is None and not os.path.isdir(prepared.path):
                raise JobError(
                    f"`tokenizer`: the `model` given ({type(self.model).__name__}) is in memory "
                    "and names no folder (config.name_or_path): name its tokenizer (a folder "
                    "or a built-in name)"
                )
            if paired:  # each model's tokenizer; they must agree (checked here, before weights)
                tokenizer, tok_path = prepared.load_tokenizer(self.tokenizer)
            else:
                tokenizer, tok_path = load_tokenizer(self.tokenizer, prepared.path)
            tok_error = None
        except (RunnerError, JobError) as e:
            tokenizer, tok_path, tok_error = None, None, e
        positions_limit = prepared.max_positions
        context_size = self.context_size
        if (
            context_size is None
            and self.input is None
            and self.generate is None
            and self.max_length is None  # asks for one example per row
        ):
            # the default job (the bundled corpus): packed contexts, as SAE datasets use
            context_size = min(DEFAULT_CONTEXT_SIZE, positions_limit or DEFAULT_CONTEXT_SIZE)
        model_name = getattr(prepared, "display_name", None) or os.path.basename(prepared.path)
        if positions_limit is not None:
            if context_size is not None and context_size > positions_limit:
                raise JobError(
                    f"`context_size` {context_size} is above the {positions_limit} positions "
                    f"of {model_name} (its config); use at most {positions_limit}"
                )
            if context_size is None and self.max_length and self.max_length > positions_limit:
                raise JobError(
                    f"`max_length` {self.max_length} is above the {positions_limit} positions "
                    f"of {model_name} (its config); use at most {positions_limit}"
                )
        if self.generate is not None:
            _check_generation_model(prepared, self.generate, self.max_length, model_name)
            _check_token_ids(self.generate_kwargs or {}, prepared.config, model_name)
        # the default: 128, or fewer when the model has fewer positions
        max_length = self.max_length or min(128, positions_limit or 128)
        if self.generate is not None and positions_limit is not None and not self.max_length:
            max_length = min(max_length, positions_limit - self.generate)
        length = context_size or max_length  # no row is longer
        p = self.positions
        if isinstance(p, int) and self.generate is None and not -length <= p < length:
            what = (
                f"`context_size` {context_size}"
                if context_size
                else f"`max_length` {length}" + ("" if self.max_length else ", the default")
            )
            raise JobError(
                f"`positions` {p} is outside the {length} tokens of a row ({what}): use an index "
                f"in [{-length}, {length - 1}]"
            )
        input_path = os.path.abspath(self.input or default_corpus())
        try:
            src = open_source(
                input_path,
                text_column=self.text_column,
                tokenizer=tokenizer,
                context_size=context_size,
                max_length=None if context_size else max_length,
                batch_size=self.batch_size,
                exclude_special_tokens=self.exclude_special_tokens,
                limit=self.limit,
                rank=rank,
                world_size=world,
                vocab_size=getattr(prepared.config, "vocab_size", None) or None,
                vocab_of=getattr(prepared.config, "vocab_of", None) or "the model's",
            )
        except SourceError as e:
            if tok_error is not None and "tokenizer" in str(e):
                raise tok_error from None
            raise
        if tokenizer is None and not src.pretokenized:
            assert tok_error is not None
            raise tok_error
        src.first_context_or_error()
        return {
            "prepared": prepared,
            "tokenizer": tokenizer,
            "tokenizer_path": tok_path,
            "source": src,
            "context_size": context_size,
            "max_length": max_length,
            "input": input_path,
        }

    def _store_settings(self, got: dict[str, Any], model_dtype: Any) -> dict[str, Any]:
        """The settings of this job's store beyond the recorder's own: the model, the corpus
        and its cutting (compared on resume, by :meth:`run` and by a :meth:`stream`'s tee)."""
        from .format import dtype_name

        context_size = got["context_size"]
        return {
            "model_path": got["prepared"].path,
            **({"tokenizer_path": got["tokenizer_path"]} if self.tokenizer else {}),
            **({"model_class": self.model_class} if self.model_class else {}),
            **got["source"].settings(),
            "max_length": None if context_size else got["max_length"],
            "model_dtype": dtype_name(model_dtype) if model_dtype else None,
        }

    def _steering(self, src: Any) -> tuple[Any, dict[str, Any] | None, Any]:
        """``steer=`` for run_generate (None; a tuple of specs for every prompt; or one entry
        per example, from `steer_sets` chosen by `steer_column` and scales multiplied by
        `steer_scale_column`), what the store's ``meta["steering"]`` records beside each
        prompt's specs (the columns and each example's set name and factor), and how many
        examples each set steers (``plan.steering``). Vectors are read and every example's
        values checked here, before the weights load."""
        default = _steer_specs(self.steer) or ()
        if self.steer_sets is None and self.steer_scale_column is None:
            return default or None, None, None
        sets = {
            name: _steer_specs(specs, f"`steer_sets` {name!r}") or ()
            for name, specs in (self.steer_sets or {}).items()
        }
        note: dict[str, Any] = {}
        chosen = factors = None
        if self.steer_column is not None:
            values = _column_values(src, self.steer_column, "`steer_column`")
            chosen = _steer_choices(values, sets, self.steer_column)
            note.update(set_column=self.steer_column, set=chosen)
        if self.steer_scale_column is not None:
            values = _column_values(src, self.steer_scale_column, "`steer_scale_column`")
            factors = _steer_factors(values, self.steer_scale_column)
            note.update(scale_column=self.steer_scale_column, scale_factor=factors)
        from .steer import specs_of_examples

        count = src.count()
        counts: dict[str | None, int] = {}
        for name in chosen if chosen is not None else [None] * count:
            counts[name] = counts.get(name, 0) + 1
        # every example the corpus holds (after `limit`), by its index
        return specs_of_examples(default, sets, chosen, factors, count), note, counts

    def _load(self, prepared: Any, device: str, model_dtype: Any) -> Any:
        """The model: the object given, or the checkpoint's weights loaded as the loading
        options say (whole on ``device``; placed by ``device_map``; sharded by ``tp_size``)."""
        from . import runner

        if _is_module(self.model):
            return self.model
        if hasattr(prepared, "load_weights"):  # several models (pyhook.pipeline.paired)
            return prepared.load_weights(device=device, dtype=model_dtype)
        memory = self.max_memory
        if memory is not None:  # a job file's keys are strings: "0" is GPU 0
            memory = {
                int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in memory.items()
            }
        try:  # a device map is checked against the model's modules before the weights load
            device_map = runner.check_placement(
                prepared, self.device_map, max_memory=memory, offload_folder=self.offload_folder
            )
        except runner.RunnerError as e:
            raise JobError(str(e)) from None
        return runner.load_weights(
            prepared,
            device=device,
            dtype=model_dtype,
            device_map=device_map,
            max_memory=memory,
            offload_folder=self.offload_folder,
            tp_size=self.tp_size,
        )

    def _loading_line(self, prepared: Any, device: str) -> str:
        """What the weights' load is about to do, in words (``progress``)."""
        if _is_module(self.model):
            return f"using the {type(self.model).__name__} given (already loaded)"
        paths = [getattr(m, "path", "") for m in getattr(prepared, "loaded", {}).values()]
        paths = paths or [prepared.path]
        size = sum(_weights_bytes(p) for p in paths)
        what = f"{_human(size)} of weights" if size else "the weights"
        if self.device_map is not None:
            m = self.device_map
            shown = f"{m!r}" if isinstance(m, str) else f"({len(m)} module(s) named)"
            where = f"placed by `device_map` {shown}"
        elif self.tp_size > 1:
            where = f"sharded over tensor-parallel groups of {self.tp_size} ranks"
        else:
            where = f"onto {device}"
        return f"loading {what} {where}, from {', '.join(paths)}"

    def _device(self, world: int) -> str:
        """The device, after joining the process group when torchrun started several ranks."""
        import torch

        device = self.device
        dist = torch.distributed
        if world > 1 and not dist.is_initialized():
            if device.startswith("cuda"):
                device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
                torch.cuda.set_device(device)
            dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        return device

    def plan(self, *, progress: bool = False) -> CapturePlan:
        """Check everything that can be checked before the first forward and estimate the run.

        In order, each a one-line error (:class:`JobError`, or the runner's and the corpus's
        own ``ValueError``) before anything is written: the device, ``out`` (writable, and no
        *different* capture there unless ``overwrite``), the model's config and tokenizer, the
        corpus (file, column, at least one context), the lengths against the model's
        positions; then the weights load and one short probe forward gives each layer's width
        (a layer that never runs is an error). The plan holds the loaded model: pass it to
        :meth:`run`. It does not refuse a run that exceeds the free space (``plan.fits``):
        :meth:`run` does, unless ``force``. ``progress`` says on stderr (rank 0) what is being
        read or loaded as each step starts: the model's config and tokenizer, the corpus, the
        weights, the probe.
        """
        import torch

        from . import runner
        from .capture import capture
        from .format import dtype_name, parse_dtype
        from .runner import check_device
        from .writer import ShardWriter, shard_limit

        dtype = parse_dtype(self.dtype, _spell("`dtype`"))
        model_dtype = parse_dtype(self.model_dtype, _spell("`model_dtype`"))
        positions = None if self.positions == "all" else self.positions
        self.check_files()
        check_device(self.device)
        out = _shown(self.out)
        self._check_out(out)
        lay = self._layout()
        rank, world = lay.dp_rank, lay.dp_size  # the corpus's shares: one per writer
        say = _progress_line if progress and lay.rank == 0 else _quiet

        # 1. The model's config and tokenizer, the corpus and out: all before the weights.
        say(
            ("importing transformers, " if "transformers" not in sys.modules else "")
            + f"reading {_model_shown(self.model)}: its config and tokenizer, and the corpus"
        )
        got = self._source(rank=rank, world=world)
        prepared, src, context_size = got["prepared"], got["source"], got["context_size"]
        if self.tp_size > 1:
            _check_tp_heads(prepared.config, self.tp_size)
        unit = f"contexts of {context_size} tokens" if context_size else "examples"
        settings = self._store_settings(got, model_dtype)
        if self.generate is not None:  # absent otherwise: stores made before compare equal
            settings.update(
                generate=self.generate,
                generated_only=self.generated_only,
                sampling=self.sampling,
                seed=self.seed,
                generate_kwargs=self.generate_kwargs,
                positions=positions,
            )
            if self.steer:  # absent otherwise: unsteered stores made before compare equal
                settings["steer"] = self.steer
            for name in ("steer_sets", "steer_column", "steer_scale_column"):
                if getattr(self, name) is not None:  # absent otherwise, as `steer`
                    settings[name] = getattr(self, name)
        plan = CapturePlan(
            job=self,
            model_path=prepared.path,
            input=got["input"],
            out=out,
            unit=unit,
            context_size=context_size,
            max_length=None if context_size else got["max_length"],
            rank=lay.rank,
            world_size=lay.world,
            layout=lay,
        )
        stored = None if self.overwrite else _stored_capture(out)
        if stored is not None:
            _refuse_different(
                out,
                stored,
                {
                    **settings,
                    "dtype": dtype_name(dtype) if dtype else None,
                    "positions": positions,
                    "quantize": self.quantize,  # compact stores: another encoding is another
                    "compress": self.compress,  # capture (None: absent, as plain ones store it)
                    "metric": _metric_name(self.metric) if self.gradients else None,
                },
                world,
            )
            plan.stored = stored.examples
        # Nothing to do when the store already holds every example asked for: said before the
        # weights load only when the layers are told the same by name; otherwise the layers
        # are resolved first (globs, standard points, the default), and other layers are
        # refused as a different capture, not answered "nothing to do".
        done_note = None
        share = None
        if stored is not None and world == 1:
            if self.limit is not None and stored.examples >= self.limit:
                done_note = (
                    f"{out} already holds {stored.examples:,} {unit.split(' ')[0]}, "
                    + ("more than" if stored.examples > self.limit else "all")
                    + f" the {self.limit:,} `limit` asks for: nothing to do "
                    "(`overwrite=True` starts again)"
                )
            else:
                share = src.estimate()  # this rank's share, from its start (needs no weights)
                if share["exact"] and stored.examples >= share["examples"]:
                    done_note = (
                        f"{out} already holds all {stored.examples:,} {unit.split(' ')[0]} of "
                        f"{os.path.basename(got['input'])}: nothing to do (`overwrite=True` "
                        "starts again)"
                    )
            if done_note is not None and self.layers == stored.settings.get("layers"):
                plan.note = done_note
                return plan
        if share is None:
            say(f"counting {os.path.basename(got['input'])}")
            share = src.estimate()
        # the steering vectors read and each example's set checked, before the weights
        steer, steer_note, plan.steering = (
            self._steering(src) if self.generate is not None else (None, None, None)
        )

        # 2. The weights, the layers, one probe forward for their widths.
        device = self._device(lay.world)
        say(self._loading_line(prepared, device))
        model = self._load(prepared, device, model_dtype)
        paired = hasattr(prepared, "load_weights")  # several models (pyhook.pipeline.paired)
        layers = self.layers or (
            _paired_default_layers(model) if paired else [default_layers(model)]
        )
        keep = runner._Keep()
        meta = {
            "model": model_class_name(model),
            "model_path": prepared.path,
            "command": "pyhook capture",
        }
        gen = self.generate is not None  # the rows of each step are chosen by the generation
        if steer_note is not None:  # each example's set (run_generate adds the specs)
            meta["steering"] = steer_note
        if paired:
            meta["models"] = {
                n: {"path": prepared.loaded[n].path, "class": type(model.model(n)).__name__}
                for n in model.names
            }
        rec = capture(
            model,
            layers,
            out=out,
            mask=None if gen else keep,
            positions=None if gen else positions,
            dtype=dtype,
            overwrite=self.overwrite,
            shard_bytes=int(self.shard_mb * (1 << 20)),
            settings=settings,
            meta=meta,
            stats=False if gen else self.stats,  # generate: the kept rows' (run_generate)
            tokens=self.tokens,
            quantize=self.quantize,
            compress=self.compress,
            tp_size=lay.tp_size,
            **({"gradients": self.gradients, "metric": self.metric} if self.gradients else {}),
        )
        if stored is not None:  # (a store with gradients differs from one without)
            _refuse_different(out, stored, {"gradients": None, **rec.settings}, world)
        if done_note is not None:  # the same layers, resolved: nothing to do after all
            plan.note = done_note
            return plan
        grads = getattr(rec, "_grads", None)  # "<layer>_grad": the rows of its layer's shape
        acts = [n for n in rec.layers if grads is None or n not in grads.names]
        say(f"sizing {len(acts)} layer(s) with one short example through {type(model).__name__}")
        shapes = _probe_layers(model, acts, src.peek(), device)
        if grads is not None:
            shapes.update({g: shapes[a] for g, a in zip(grads.names, grads.layers)})

        # 3. The estimate: rows x width x dtype per layer (+ token ids, row index, statistics),
        # against the free space at out.
        done = stored.examples if stored is not None and world == 1 else 0
        frac = max(0, share["examples"] - done) / max(share["examples"], 1)
        est = {k: (round(v * frac) if k != "exact" else v) for k, v in share.items()}
        rows = est["examples"] if positions is not None else est["rows"]
        if self.generate is not None:
            # at most: the prompts' rows and one a new token but the last (fewer after EOS)
            n = est["examples"]
            rows = n * self.generate if positions == "last" else n * (self.generate - 1)
            if not self.generated_only and positions != "last":
                rows += est["rows"]
            est["text_bytes"] = est.get("text_bytes", 0) + n * self.generate * 8
            est["exact"] = False
        batches = math.ceil(est["examples"] / self.batch_size)
        # the writer's shards: at most half its buffer, and never less than one batch
        buffer = ShardWriter.__init__.__kwdefaults__["max_buffer_bytes"]  # the writer's default
        limit = shard_limit(int(self.shard_mb * (1 << 20)), buffer)
        extra = rows * 24 if self.tokens else 0  # int64 token id + int64 (context, position)
        extra += est.get("text_bytes", 0) + 16 * est.get("texts", 0)  # + int64 length, index
        if self.compress:  # the bound counts the frames of each shard (of the plain size)
            from .encoding import Encoding, stored_bytes_bound

            plain = sum(
                rows
                * math.prod(shapes[n][0])
                * torch.empty((), dtype=dtype or shapes[n][1]).element_size()
                for n in rec.layers
            )
            shards_at_most = max(1, min(batches, math.ceil(plain / limit)))
        for name in rec.layers:
            row_shape, out_dtype = shapes[name]
            itemsize = torch.empty((), dtype=dtype or out_dtype).element_size()
            width = math.prod(row_shape)
            nbytes = rows * width * itemsize
            if self.quantize:  # one byte a value, a float32 scale a row: exact
                nbytes = rows * (width + 4)
            if self.compress:  # at most: the rows uncompressed plus zstd's framing
                d = dtype or out_dtype
                enc = Encoding(self.quantize, self.compress).layer_info(
                    name, d, {"dtype": dtype_name(d), "row_shape": list(row_shape)}
                )["encoding"]
                row_bytes = width * (1 if self.quantize else itemsize)
                nbytes, _ = stored_bytes_bound(enc, rows, row_bytes, shards_at_most)
                nbytes += rows * 4 if self.quantize else 0
                plan.upper_bound = True
            plan.layers.append(
                LayerPlan(
                    name,
                    row_shape,
                    rows,
                    dtype_name(dtype or out_dtype),
                    nbytes,
                    "+".join(e for e in (self.quantize, self.compress) if e) or "-",
                )
            )
            if self.stats:  # float64 [batches, 2 + 2 * width]
                extra += batches * (2 + 2 * width) * 8
        plan.examples, plan.tokens, plan.rows, plan.exact = (
            est["examples"],
            est["tokens"],
            rows,
            est["exact"],
        )
        plan.bytes = sum(layer.bytes for layer in plan.layers) + extra
        plan.shards = max(1, min(batches, math.ceil(plan.bytes / limit))) if plan.bytes else 0
        plan.free = None if _is_url(out) else shutil.disk_usage(_existing_dir(out)).free
        plan.model_class = model.describe() if paired else model_class_name(model)
        plan.device = device
        plan.ranks = _ranks_table(lay, model, plan.examples, plan.rows, plan.bytes)
        if self.device_map is not None:  # where transformers put each module
            placed = getattr(model, "hf_device_map", None)
            first = next(iter(model.parameters()), None)
            plan.placement = dict(placed) if placed else {"": str(getattr(first, "device", device))}
        plan._state = {
            "model": model,
            "source": src,
            "recorder": rec,
            "keep": keep,
            "share": share,
            "tokenizer": got["tokenizer"],
            "steer": steer,
        }
        return plan

    # -- the run --------------------------------------------------------------------------------
    def run(self, plan: CapturePlan | None = None, *, progress: bool = False) -> CaptureResult:
        """Write the store (or resume it) and return what was written, summed over every rank.

        ``plan`` is this job's :meth:`plan` (made here when not given; a plan runs once).
        ``progress`` shows a tqdm bar (tokens/s, MB/s) and the resume line on stderr, on rank 0.
        A run larger than the free space at ``out`` is refused unless ``force``.
        """
        if plan is None:
            plan = self.plan()
        elif plan.job is not self:
            raise JobError("this plan is another job's: pass the plan of this job (job.plan())")
        if plan.note is not None:  # nothing to do
            return CaptureResult(out=plan.out, unit=plan.unit, note=plan.note, rank=plan.rank)
        if plan._state is None:
            raise JobError("this plan has already run: make a new one with job.plan()")
        plan.check_space()
        state, plan._state = plan._state, None
        from .runner import run

        src, rec, keep, share = state["source"], state["recorder"], state["keep"], state["share"]
        model, device = state["model"], plan.device
        show = progress and plan.rank == 0
        unit = plan.unit.split(" ")[0]
        truncated = 0
        tokens = 0
        generated = 0  # tokens generated (with `generate`); also counted in `tokens`
        t0 = time.perf_counter()
        with rec:
            src.skip = rec.examples_done
            todo = max(0, share["examples"] - rec.examples_done)
            w = int(rec.layout.writer)  # a group's rows are counted once, by its writer
            done_all, todo_all = _sum_over_ranks([rec.examples_done * w, todo * w], device)
            if done_all and show:
                print(
                    f"resuming {self.out}: {done_all:,} {unit} already stored, "
                    f"about {todo_all:,} to go",
                    file=sys.stderr,
                )
            from tqdm import tqdm

            bar = tqdm(
                total=todo,
                unit="ctx" if plan.context_size else "ex",
                desc=f"rank 0 of {plan.world_size}" if plan.world_size > 1 else None,
                disable=not show,
                file=sys.stderr,
                dynamic_ncols=True,
            )

            def on_generated(n: int) -> None:
                nonlocal tokens, generated
                tokens += n
                generated += n

            def on_batch(b: Any, _dt: float) -> None:
                nonlocal truncated, tokens
                truncated += b.truncated
                tokens += int(b.attention_mask.sum())
                dt = max(time.perf_counter() - t0, 1e-9)
                bar.set_postfix_str(f"{tokens / dt:,.0f} tok/s, {rec.bytes / dt / 1e6:,.1f} MB/s")
                n = len(b.examples)
                if bar.total and bar.n + n >= bar.total and not plan.exact:
                    # the estimate was low: grow the total before it is passed (tqdm drops a
                    # passed total, and with it the percentage and the time left)
                    bar.total = bar.n + n + max(n, math.ceil((bar.n + n) * 0.05))
                bar.update(n)

            try:
                if self.generate is not None:
                    from .generate import run_generate

                    timing = run_generate(
                        model,
                        src,
                        rec,
                        max_new_tokens=self.generate,
                        generated_only=self.generated_only,
                        last_only=self.positions == "last",
                        sampling=self.sampling,
                        seed=self.seed,
                        tokenizer=state["tokenizer"],
                        stats=self.stats,
                        device=device,
                        on_batch=on_batch,
                        on_generated=on_generated,
                        exclude_tokens=src._excluded(),
                        steer=state["steer"],
                        **(self.generate_kwargs or {}),
                    )
                else:
                    timing = run(model, src, rec, device=device, keep=keep, on_batch=on_batch)
                if bar.total != bar.n:  # an estimate, now counted: the bar ends at 100%
                    bar.total = bar.n
                    bar.refresh()
            finally:
                bar.close()
        elapsed = time.perf_counter() - t0
        # The result is of the whole run: every rank's share.
        tokens, truncated, nbytes, generated = _sum_over_ranks(
            [v * w for v in (tokens, truncated, rec.bytes, generated)], device
        )
        result = CaptureResult(
            out=plan.out,
            unit=plan.unit,
            rank=plan.rank,
            input=plan.input,
            max_length=plan.max_length,
            tokens=tokens,
            truncated=truncated,
            bytes_written=nbytes,
            seconds=elapsed,
            forward_seconds=timing["forward"],
            generated_tokens=generated,
        )
        if plan.rank != 0:  # rank 0 reads the merged store back
            return result
        import torch

        from .format import parse_dtype
        from .reader import open_capture

        reader = open_capture(plan.out)
        result.examples = reader.examples
        result.shards = len(reader.index["shards"])
        result.stored_bytes = reader.index["bytes"]
        for name in reader.layers:
            info = reader.index["layers"][name]
            itemsize = torch.empty((), dtype=parse_dtype(info["dtype"])).element_size()
            nbytes = info["rows"] * itemsize * math.prod(info["row_shape"])
            if "encoding" in info:  # a compact store: the bytes its shards hold
                from .encoding import describe, layer_bytes

                stored = layer_bytes(info, reader._shards, name)[0]
                nbytes = stored if stored >= 0 else nbytes
            result.layers.append(
                LayerPlan(
                    name,
                    tuple(info["row_shape"]),
                    info["rows"],
                    info["dtype"],
                    nbytes,
                    describe(info) if "encoding" in info else "-",
                )
            )
        return result

    # -- streaming ------------------------------------------------------------------------------
    def stream(self, **options: Any) -> Any:
        """Activations straight to a trainer: :func:`pyhook.pipeline.stream.stream` over this
        job's model (loaded here), corpus (this rank's share) and layers, on its ``device`` in
        its ``dtype``; ``options`` go to ``stream`` (``batch_size`` there is rows a trainer
        batch, ``buffer_rows``, ``seed``, ``tee``, ...). ``out``, ``overwrite``, ``shard_mb``
        are for :meth:`run`: a tee is ``options["tee"]``.
        """
        try:
            from .stream import stream
        except ImportError as e:
            if e.name not in ("pyhook.pipeline.stream",):
                raise
            raise NotImplementedError(
                "CaptureJob.stream needs pyhook.pipeline.stream, which this pyhook lacks"
            ) from None
        import inspect

        from .format import parse_dtype
        from .runner import check_device

        if self.generate is not None:
            raise JobError(
                "`generate`: stream() runs plain forwards over the corpus; capture during "
                "generation with run() (a store)"
            )
        self.check_files()
        check_device(self.device)
        lay = self._layout()
        rank, world = lay.dp_rank, lay.dp_size
        got = self._source(rank=rank, world=world)
        params = inspect.signature(stream).parameters
        if self.positions != "all" and "positions" not in params:
            raise JobError(
                f"`positions` {self.positions!r}: stream() hands every kept token's row to the "
                "trainer; positions is for run()"
            )
        device = self._device(lay.world)
        model_dtype = parse_dtype(self.model_dtype, "model_dtype")
        model = self._load(got["prepared"], device, model_dtype)
        if hasattr(got["prepared"], "load_weights"):  # several models (pyhook.pipeline.paired)
            layers = self.layers or _paired_default_layers(model)
        else:
            layers = self.layers or [default_layers(model)]
        kw: dict[str, Any] = {"device": device, "dtype": parse_dtype(self.dtype, "dtype")}
        if self.positions != "all":
            kw["positions"] = self.positions
        if options.get("tee") is not None:
            # the store run() writes: its settings (a tee resumes run()'s store, and refuses one
            # of another model or corpus, which the recorder's settings alone do not tell apart)
            kw.update(
                settings=self._store_settings(got, model_dtype),
                meta={"model_path": got["prepared"].path},
                stats=self.stats,
                tokens=self.tokens,
                quantize=self.quantize,
                compress=self.compress,
            )
        return stream(model, got["source"], layers, **{**kw, **options})


#: The most digits an integer of a job file has (every option is far below; Python refuses
#: 4,300 with a bare ValueError).
_MAX_DIGITS = 64


class _LongNumber:
    """An integer of a job file too long to be any option's value: refused by the option's
    check, which names the key (as ``a number of N digits``)."""

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"a number of {self.digits} digits"


def _file_int(text: str) -> Any:
    return int(text) if len(text) <= _MAX_DIGITS else _LongNumber(len(text))


def _job_yaml_loader(yaml: Any) -> Any:
    """PyYAML's safe loader, refusing aliases (``*name``: a 1 KB file of aliases nested ten
    deep holds 9**10 values) and reading an over-long integer as :class:`_LongNumber`."""

    class JobLoader(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                raise yaml.composer.ComposerError(
                    None,
                    None,
                    "an alias (*name): a job file writes each value out (aliases are not read)",
                    self.peek_event().start_mark,
                )
            return super().compose_node(parent, index)

        def construct_yaml_int(self, node: Any) -> Any:
            text = self.construct_scalar(node)
            if len(text) > _MAX_DIGITS:
                return _LongNumber(len(text))
            return super().construct_yaml_int(node)

    JobLoader.add_constructor("tag:yaml.org,2002:int", JobLoader.construct_yaml_int)
    return JobLoader


def _closest(key: str, known: list[str]) -> str:
    """`` (did you mean 'context_size'?)`` for a mistyped option, else the list of options."""
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else f"; a job's keys are: {', '.join(known)}"


def _named_options_only(init: Any) -> Any:
    """``CaptureJob(context_sise=12)`` is a :class:`JobError` (also a ``TypeError``) naming the
    closest option, as the same key in a job file is, instead of dataclass's bare TypeError."""
    import functools

    @functools.wraps(init)
    def __init__(self: CaptureJob, *args: Any, **kwargs: Any) -> None:
        known = [f.name for f in dataclasses.fields(CaptureJob)]
        for key in kwargs:
            if key not in known:
                raise _JobTypeError(f"CaptureJob: unknown option {key!r}{_closest(key, known)}")
        if len(args) > len(known):
            raise _JobTypeError(
                f"CaptureJob takes its options by name (model=..., layers=...), got "
                f"{len(args)} positional values"
            )
        init(self, *args, **kwargs)

    return __init__


CaptureJob.__init__ = _named_options_only(CaptureJob.__init__)  # type: ignore[method-assign]


@dataclass
class LayerPlan:
    """One layer of a plan or of a result: its rows, row shape, stored dtype and bytes."""

    name: str
    row_shape: tuple[int, ...]
    rows: int
    dtype: str
    bytes: int
    #: how the rows are stored (compact stores: ``"fp8"``, ``"zstd"``, ``"fp8+zstd"``; ``"-"``)
    encoding: str = "-"


@dataclass
class CapturePlan:
    """What :meth:`CaptureJob.run` will do: this rank's share still to capture
    (``examples``, ``tokens``, ``rows`` kept per layer: counted when ``exact``, else estimated
    from a sample), ``layers`` (row shape, dtype and bytes each), ``bytes`` in all (the layers'
    rows, plus 24 bytes a row for token ids and row index, the examples' texts and the
    per-batch statistics),
    ``shards``, the ``free`` bytes at ``out`` (None for a URL), whether it ``fits``, and
    ``stored`` (examples already in ``out``, resumed after). ``note`` is set when there is
    nothing to do. ``str(plan)`` is what ``pyhook capture --dry-run`` prints.

    Accuracy: with ``exact`` the rows are the rows the run writes and ``bytes`` is within the
    shards' headers (a few kB each) of the store's size; estimated packed contexts are
    extrapolated from 2,000 documents drawn across the corpus (tokens per byte, times the
    corpus's bytes), one example per row from its count and 2,000 documents drawn the same way.
    """

    job: CaptureJob
    model_path: str
    input: str
    out: str
    unit: str
    context_size: int | None = None
    max_length: int | None = None
    rank: int = 0
    world_size: int = 1
    model_class: str = ""
    device: str = "cpu"
    layers: list[LayerPlan] = field(default_factory=list)
    examples: int = 0
    tokens: int = 0
    rows: int = 0
    exact: bool = True
    bytes: int = 0
    shards: int = 0
    free: int | None = None
    stored: int = 0
    note: str | None = None
    #: ``bytes`` is an upper bound, not an estimate: ``compress`` is set, and what it saves
    #: depends on the values (the rows uncompressed, plus zstd's framing)
    upper_bound: bool = False
    #: the ranks (:class:`pyhook.pipeline.ranks.RankLayout`): data-parallel x tensor-parallel
    layout: Any = None
    #: per rank (every rank's, gathered): ``rank``, ``dp_rank``, ``writer``, ``examples``,
    #: ``rows`` and ``bytes`` of its group's share, ``weights`` (bytes of its weights by device;
    #: ``"offloaded"``: held by accelerate off the device, loaded when the layer runs)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    #: with ``device_map``: where the loaded model's modules are (module name -> device; the
    #: model's ``hf_device_map``, or ``{"": device}`` when transformers placed it whole)
    placement: dict[str, Any] | None = None
    #: with `steer_sets` or `steer_scale_column`: examples per set name (None: the examples
    #: whose `steer_column` is empty, steered by `steer` or not at all), the whole corpus's
    steering: dict[str | None, int] | None = None
    _state: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    @property
    def fits(self) -> bool:
        """Whether the estimate fits in the free space at ``out`` (always, for a URL)."""
        return self.free is None or self.bytes <= self.free

    def check_space(self) -> None:
        """Raise :class:`JobError` when the estimate exceeds the free space (unless ``force``)."""
        if self.fits or self.job.force:
            return
        where = _existing_dir(self.out)
        size = (
            f"at most {_human(self.bytes)} (before compression)"
            if self.upper_bound
            else f"about {_human(self.bytes)}"
        )
        raise JobError(
            f"the capture needs {size} but {where} has "
            f"{_human(self.free or 0)} free; capture less (`limit`, fewer `layers`, `dtype` "
            "float16) or another `out`, or `force=True` to start anyway"
        )

    def summary(self, flags: bool = False) -> str:
        """The one-line plan (``plan: N contexts ... about X MB in ~K shard(s); F free at D``)."""
        if self.note is not None:
            return _spell(self.note, flags)
        how = "counted" if self.exact else "estimated from a sample"
        where = (
            f"shard(s) to {self.out}"
            if self.free is None
            else f"shard(s); {_human(self.free)} free at {_existing_dir(self.out)}"
        )
        return (
            f"plan: {self.examples:,} {self.unit} ({self.rows:,} rows kept, {how}) through "
            f"{self.model_class} -> {len(self.layers)} layer(s), "
            + (
                f"at most {_human(self.bytes)} (the size before compression) in at most "
                if self.upper_bound
                else f"about {_human(self.bytes)} in ~"
            )
            + f"{self.shards} {where}"
        )

    def table(self) -> str:
        """Per layer: row shape, rows, dtype, MB (and the encoding of a compact store: with
        ``compress`` the MB are an upper bound, the size before compression plus zstd's
        framing)."""
        rows = [
            [p.name, "x".join(map(str, p.row_shape)), f"{p.rows:,}", p.dtype, _mb(p.bytes)]
            for p in self.layers
        ]
        if any(p.encoding != "-" for p in self.layers):
            for row, p in zip(rows, self.layers):
                row.insert(4, p.encoding)
            mb = "MB (at most)" if "zstd" in "".join(p.encoding for p in self.layers) else "MB"
            return _table(rows, ["layer", "row shape", "rows", "dtype", "stored as", mb])
        return _table(rows, ["layer", "row shape", "rows", "dtype", "MB"])

    def ranks_table(self) -> str:
        """The layout: one line for the ranks (data-parallel x tensor-parallel, which write),
        then per rank its share (examples, rows, MB written: 0 on a rank that does not write)
        and the memory its weights take, by device. Empty for one process whose model is
        whole on one device."""
        if not self.ranks:
            return ""
        one = self.ranks[0]["weights"]
        whole = len(self.ranks) == 1 and len(one) <= 1 and "offloaded" not in one
        if whole and self.placement is None:
            return ""
        unit = self.unit.split(" ")[0]
        rows = []
        for r in self.ranks:
            weights = ", ".join(f"{d} {_mb(b)}" for d, b in r["weights"].items()) or "-"
            rows.append(
                [
                    str(r["rank"]),
                    str(r["dp_rank"]),
                    "yes" if r["writer"] else "no",
                    f"{r['examples']:,}",
                    f"{r['rows']:,}",
                    _mb(r["bytes"] if r["writer"] else 0),
                    weights,
                ]
            )
        head = self.layout.describe() if self.layout is not None else ""
        table = _table(
            rows, ["rank", "dp rank", "writes", unit, "rows", "MB written", "weights MB"]
        )
        if self.placement is not None:
            table += "\n" + _placement_table(self.placement)
        return f"layout: {head}\n{table}"

    def report(self, flags: bool = False) -> str:
        """The model and corpus, the table, the ranks' layout (several ranks or an offloaded
        model) and the summary (what ``--dry-run`` prints)."""
        if self.note is not None:
            return self.summary(flags)
        ranks = self.ranks_table()
        steering = self.steering_line(flags)
        return "\n".join(
            [
                f"model {self.model_path} ({self.model_class}), input {self.input}",
                self.table(),
                *([ranks] if ranks else []),
                *([steering] if steering else []),
                self.summary(flags),
            ]
        )

    def steering_line(self, flags: bool = False) -> str:
        """How many examples of the corpus each steering set steers (``steering by
        steer_column 'concept': happy 120, sad 80 examples; 100 empty (unsteered)``); empty
        without per-example steering."""
        if not self.steering:
            return ""
        job = self.job
        counts = dict(self.steering)
        empty = counts.pop(None, 0)
        rest = "`steer`'s specs" if job.steer else "unsteered"
        if job.steer_column is None:
            text = f"steering: {rest} on all {empty:,} examples"
        else:
            sets = ", ".join(f"{name} {n:,}" for name, n in sorted(counts.items()))
            text = f"steering by `steer_column` {job.steer_column!r}: {sets or 'no set'} examples"
            if empty:
                text += f"; {empty:,} empty ({rest})"
        if job.steer_scale_column is not None:
            text += f"; scales times `steer_scale_column` {job.steer_scale_column!r}"
        return _spell(text, flags)

    def __str__(self) -> str:
        return self.report()


@dataclass
class CaptureResult:
    """What :meth:`CaptureJob.run` wrote: ``tokens``, ``truncated`` examples, ``bytes_written``
    this run (summed over every rank), ``seconds`` (``forward_seconds`` of it in the model); and,
    on rank 0, the store as it now is: ``examples``, ``shards``, ``stored_bytes`` and per-layer
    ``layers`` (rows, row shape, dtype, bytes). ``note`` is set when there was nothing to do.
    ``str(result)`` is what the command prints at the end.
    """

    out: str
    unit: str
    rank: int = 0
    input: str = ""
    max_length: int | None = None
    tokens: int = 0
    truncated: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    forward_seconds: float = 0.0
    examples: int = 0
    shards: int = 0
    stored_bytes: int = 0
    layers: list[LayerPlan] = field(default_factory=list)
    note: str | None = None
    generated_tokens: int = 0  # of ``tokens``: those ``generate`` added (capture with `generate`)

    @property
    def rows(self) -> dict[str, int]:
        """Rows stored per layer (rank 0)."""
        return {p.name: p.rows for p in self.layers}

    def table(self) -> str:
        rows = [
            [p.name, f"{p.rows:,}", "x".join(map(str, p.row_shape)), p.dtype, _mb(p.bytes)]
            for p in self.layers
        ]
        if any(p.encoding != "-" for p in self.layers):  # a compact store: MB as stored
            for row, p in zip(rows, self.layers):
                row.insert(4, p.encoding)
            return _table(rows, ["layer", "rows", "row shape", "dtype", "stored as", "MB"])
        return _table(rows, ["layer", "rows", "row shape", "dtype", "MB"])

    def _generated_part(self) -> str:
        """``", 1,024 of them generated"`` for a capture during ``generate``."""
        return f", {self.generated_tokens:,} of them generated" if self.generated_tokens else ""

    def report(self, flags: bool = False) -> str:
        if self.note is not None:
            return _spell(self.note, flags)
        text = (
            f"{self.table()}\n\n{self.examples:,} {self.unit.split(' ')[0]} ({self.tokens:,} "
            f"tokens this run{self._generated_part()}) from {os.path.basename(self.input)} -> {self.out}: "
            f"{self.shards} shard(s), {_mb(self.stored_bytes)} MB; this run {self.seconds:.1f} s "
            f"(forward {self.forward_seconds:.1f} s), "
            f"{_mb(self.bytes_written / max(self.seconds, 1e-9))} MB/s"
        )
        if self.truncated:
            text += (
                f"\n{self.truncated} line(s) were longer than `max_length` {self.max_length} "
                "tokens and were truncated"
            )
        return _spell(text, flags)

    def __str__(self) -> str:
        return self.report()


# -- helpers of the plan -----------------------------------------------------------------------
def _progress_line(text: str) -> None:
    """One line on stderr, at once: what the plan is doing now (``plan(progress=True)``)."""
    print(f"pyhook: {_spell(text, flags=True)} ...", file=sys.stderr, flush=True)


def _quiet(text: str) -> None:
    pass


def _model_shown(model: Any) -> str:
    """The job's ``model`` in a progress line."""
    if model is None:
        from .runner import DEFAULT_MODEL

        return f"{DEFAULT_MODEL} (the default model)"
    if isinstance(model, dict):
        return "the models " + ", ".join(f"{n}={m}" for n, m in model.items())
    if _is_module(model):
        return f"the {type(model).__name__} given"
    return str(model)


def _weights_bytes(path: str) -> int:
    """Bytes of the weight files in a checkpoint folder (0 when there are none to count)."""
    if not os.path.isdir(path):
        return 0
    ends = (".safetensors", ".bin", ".pt", ".pth")
    return sum(
        os.path.getsize(os.path.join(path, f))
        for f in os.listdir(path)
        if f.endswith(ends) and os.path.isfile(os.path.join(path, f))
    )


def _weight_bytes(model: Any) -> dict[str, int]:
    """Bytes of this rank's weights (parameters and buffers) by device: a tensor-parallel
    shard counts its local part; weights accelerate holds off the device (on the ``meta``
    device in the module) count as ``"offloaded"``."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        local = t.to_local() if hasattr(t, "to_local") else t
        where = "offloaded" if local.device.type == "meta" else str(local.device)
        out[where] = out.get(where, 0) + local.numel() * local.element_size()
    return dict(sorted(out.items(), key=lambda kv: kv[0] == "offloaded"))


def _placement_table(placement: dict[str, Any]) -> str:
    """The device map as loaded, one line a device: its modules in order, a run of numbered
    layers shown as one (``model.layers.0-31``).

    >>> print(_placement_table({"model.embed": 0, "model.layers.0": 0, "model.layers.1": 0,
    ...                         "model.layers.2": "disk", "lm_head": "cpu"}))
    device  modules (device map)
    ------  -----------------------------
    0       model.embed, model.layers.0-1
    disk    model.layers.2
    cpu     lm_head
    """
    by: dict[str, list[str]] = {}
    for name, dev in placement.items():
        by.setdefault(str(dev), []).append(name or "(the whole model)")
    rows = []
    for dev, names in by.items():
        runs: list[list[Any]] = []  # [name] or [prefix, first, last]
        for n in names:
            prefix, _, last = n.rpartition(".")
            numbered = last.isdigit() and bool(prefix)
            run = runs[-1] if runs else []
            if numbered and len(run) == 3 and run[0] == prefix and int(last) == run[2] + 1:
                run[2] = int(last)
                continue
            runs.append([prefix, int(last), int(last)] if numbered else [n])
        shown = [
            r[0] if len(r) == 1 else f"{r[0]}.{r[1]}" + (f"-{r[2]}" if r[2] != r[1] else "")
            for r in runs
        ]
        rows.append([dev, ", ".join(shown)])
    return _table(rows, ["device", "modules (device map)"])


def _ranks_table(
    lay: Any, model: Any, examples: int, rows: int, nbytes: int
) -> list[dict[str, Any]]:
    """Every rank's line of the plan's layout (gathered over the process group)."""
    import torch

    mine = {
        "rank": lay.rank,
        "dp_rank": lay.dp_rank,
        "writer": lay.writer,
        "examples": examples,
        "rows": rows,
        "bytes": nbytes,
        "weights": _weight_bytes(model),
    }
    dist = torch.distributed
    if lay.world == 1 or not (dist.is_available() and dist.is_initialized()):
        return [mine]
    every: list[Any] = [None] * lay.world
    dist.all_gather_object(every, mine)
    return every


def _is_module(v: Any) -> bool:
    """Whether ``v`` is a ``torch.nn.Module`` (told without importing torch)."""
    return any(
        c.__name__ == "Module" and c.__module__.startswith("torch.nn") for c in type(v).__mro__
    )


def _check_placement(name: str, v: Any) -> None:
    """``device_map`` (a word transformers knows, a device, or module names to devices) and
    ``max_memory`` (devices to sizes such as ``"10GiB"`` or bytes)."""
    if v is None:
        return
    if name == "device_map":
        if isinstance(v, str):
            if not v.strip():
                raise JobError("`device_map` is empty: leave it out, or give 'auto' or a device")
            return
        if (
            isinstance(v, dict)
            and all(isinstance(k, str) for k in v)
            and all(isinstance(d, (str, int)) and not isinstance(d, bool) for d in v.values())
        ):
            return
        raise _JobTypeError(
            f"`device_map` must be {', '.join(map(repr, _MAP_WORDS))}, a device, or a mapping "
            f"of module names to devices ('cpu', 'disk', 0, 'cuda:1'), got {_got(v)}"
        )
    ok = (
        isinstance(v, dict)
        and v
        and all(
            isinstance(k, (str, int))
            and not isinstance(k, bool)
            and (isinstance(m, str) or (isinstance(m, int) and not isinstance(m, bool) and m > 0))
            for k, m in v.items()
        )
    )
    if not ok:
        raise _JobTypeError(
            "`max_memory` must be a mapping of devices to sizes (e.g. {0: '20GiB', 'cpu': "
            f"'60GiB'}}; --max-memory 0=20GiB,cpu=60GiB), got {_got(v)}"
        )


def placement_from_flag(name: str, text: str) -> Any:
    """``--device-map``/``--max-memory`` as the command gives them: a word or device, JSON,
    or ``KEY=VALUE,...`` (a key of digits is a GPU index).

    >>> placement_from_flag("max_memory", "0=20GiB,cpu=60GiB")
    {0: '20GiB', 'cpu': '60GiB'}
    >>> placement_from_flag("device_map", "auto")
    'auto'
    >>> placement_from_flag("device_map", '{"model.layers.0": "disk"}')
    {'model.layers.0': 'disk'}
    """
    text = text.strip()
    if text.startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise JobError(f"`{name}` {text!r} is not valid JSON: {e.msg}") from None
    if "=" not in text:
        if name == "max_memory":
            raise JobError(f"`max_memory` {text!r}: give DEVICE=SIZE pairs, e.g. 0=20GiB,cpu=60GiB")
        return text
    out: dict[Any, Any] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise JobError(f"`{name}` {text!r}: {part!r} is not KEY=VALUE")
        k: Any = int(key) if key.isdigit() else key
        out[k] = int(value) if value.isdigit() else value
    return out


def _check_generate_kwargs(v: Any) -> None:
    """``generate_kwargs``: a mapping of the plain-data ``generate`` options a job may pass
    (:data:`pyhook.pipeline._generate_options.GENERATE_OPTIONS`, each checked by type; stored
    in the capture's settings); an option that loads code or another model is refused by name."""
    from ._generate_options import check_generate_options

    try:
        check_generate_options(v)
    except TypeError as e:
        raise _JobTypeError(str(e)) from None
    except ValueError as e:
        raise JobError(str(e)) from None


_STEER_FLAG = re.compile(r"\s*([^=\s]+)\s*=\s*(.+?)(?:\*\s*([-+]?[0-9.]+(?:[eE][-+]?\d+)?))?\s*")


def _steer_flag(text: str) -> dict[str, Any]:
    """``--steer POINT=FILE[:NAME][*SCALE]`` as a spec (add SCALE times the vector).

    >>> _steer_flag("resid_post.6=vectors.safetensors:happy*4")
    {'point': 'resid_post.6', 'vector': 'vectors.safetensors:happy', 'scale': 4.0}
    """
    m = _STEER_FLAG.fullmatch(text)
    if m is None:
        raise JobError(
            f"`steer` {text!r}: expected POINT=FILE[:NAME][*SCALE], e.g. "
            "resid_post.6=vectors.safetensors:happy*4"
        )
    spec: dict[str, Any] = {"point": m.group(1), "vector": m.group(2)}
    if m.group(3) is not None:
        spec["scale"] = float(m.group(3))
    return spec


def _check_steer(v: Any, what: str = "`steer`", *, empty: bool = False) -> None:
    """`steer` (or one set of `steer_sets`, ``empty`` allowed): a list of spec dicts (no torch,
    no file read here)."""
    if not isinstance(v, list) or not (v or empty):
        raise _JobTypeError(f"{what} must be a list of steering specs, got {_got(v)}")
    for i, d in enumerate(v):
        if not isinstance(d, dict):
            raise _JobTypeError(f"{what} entry {i} must be a spec (a mapping), got {_got(d)}")
        unknown = set(d) - STEER_FIELDS
        if unknown:
            raise JobError(
                f"{what} entry {i}: unknown field(s) {_got(sorted(map(str, unknown)))}; a spec "
                f"has {sorted(STEER_FIELDS)}"
            )
        if not isinstance(d.get("point"), str) or "vector" not in d:
            raise JobError(
                f"{what} entry {i}: needs 'point' (a point name) and 'vector' "
                "('FILE[:NAME]' of a .safetensors/.pt/.npy file, or a list of numbers)"
            )


def _steer_set_flag(text: str) -> tuple[str, dict[str, Any] | None]:
    """``--steer-set NAME:POINT=FILE[:NAME][*SCALE]`` as (set name, spec); ``NAME:`` alone is
    a set that steers nothing (None).

    >>> _steer_set_flag("happy:resid_post.6=vectors.safetensors:happy*4")
    ('happy', {'point': 'resid_post.6', 'vector': 'vectors.safetensors:happy', 'scale': 4.0})
    >>> _steer_set_flag("control:")
    ('control', None)
    """
    name, sep, spec = text.partition(":")
    if not sep or not name.strip() or "=" in name:
        raise JobError(
            f"`steer_sets` {_got(text)}: expected NAME:POINT=FILE[:NAME][*SCALE], e.g. "
            "happy:resid_post.6=vectors.safetensors:happy*4 (NAME: alone steers nothing)"
        )
    return name.strip(), (_steer_flag(spec) if spec.strip() else None)


def _steer_sets_given(v: Any) -> Any:
    """`steer_sets` as one form (so equal jobs compare equal): the command's list of
    ``NAME:POINT=FILE[:NAME][*SCALE]`` grouped by name; a YAML file's integer names (``0:``,
    class labels) as strings; a set given as one spec (or flag text) as a list. Anything else
    is left for :func:`_check_steer_sets` to refuse."""
    if isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v):
        grouped: dict[str, list[Any]] = {}
        for text in v:
            name, spec = _steer_set_flag(text)
            grouped.setdefault(name, [])
            if spec is not None:
                grouped[name].append(spec)
        return grouped
    if not isinstance(v, dict):
        return v
    out: dict[Any, Any] = {}
    for k, specs in v.items():
        if isinstance(k, int) and not isinstance(k, bool) and abs(k) < 10**30:
            k = str(k)  # a class label
        if isinstance(specs, (str, dict)):
            specs = [specs]
        if isinstance(specs, (list, tuple)):
            specs = [_steer_flag(x) if isinstance(x, str) else x for x in specs]
        if k in out:  # 1 and "1"
            raise JobError(f"`steer_sets` names the set {k!r} twice")
        out[k] = specs
    return out


def _check_steer_sets(v: Any) -> None:
    """`steer_sets`: a mapping of set names to lists of spec dicts (a set may be empty: the
    examples that name it are not steered)."""
    if not isinstance(v, dict) or not v:
        raise _JobTypeError(
            "`steer_sets` must be a mapping of set names to lists of steering specs "
            f"(e.g. {{happy: [...], sad: [...]}}), got {_got(v)}"
        )
    for name, specs in v.items():
        if not isinstance(name, str) or not name.strip():
            raise _JobTypeError(
                f"`steer_sets`: a set's name is a non-empty string (or a small integer), got "
                f"{_got(name)}"
            )
        _check_steer(specs, f"`steer_sets` {_got(name)}", empty=True)


def _steer_specs(v: list[Any] | None, what: str = "`steer`") -> Any:
    """The job's `steer` (or one of `steer_sets`) as the specs run_generate takes (a tuple:
    every prompt, all of them); None for none."""
    if not v:
        return None
    from ..steering import SteeringError
    from .steer import specs_from_data

    try:
        return tuple(specs_from_data(v))
    except SteeringError as e:
        raise JobError(f"{what}: {e}") from None


def _column_values(src: Any, column: str, what: str) -> list[Any]:
    """The values of a per-example column of the corpus (``what``: the option naming it)."""
    from .source import SourceError

    try:
        values = src.column_values(column)
    except SourceError as e:
        raise JobError(f"{what}: {e}") from None
    if len(values) != src.count():  # pragma: no cover - one reading of the same records
        raise JobError(f"{what} {column!r}: {len(values)} values for {src.count()} examples")
    return values


def _empty_cell(v: Any) -> bool:
    """A null (None, or NaN as pandas writes one in a numeric column) or an empty string."""
    return v is None or v == "" or (isinstance(v, float) and math.isnan(v))


def _steer_choices(values: list[Any], sets: Any, column: str) -> list[str | None]:
    """Each example's set name from the `steer_column` values (None: empty, `steer`'s specs);
    a value that is not a set's name is refused with its example and the sets there are.

    >>> _steer_choices(["happy", None, 1, ""], {"happy": [], "1": []}, "concept")
    ['happy', None, '1', None]
    >>> _steer_choices(["happy", "angry"], {"happy": [], "sad": []}, "concept")
    Traceback (most recent call last):
    ...
    pyhook.pipeline.job.JobError: steer_column 'concept', example 1 (from 0): 'angry' is not a set of steer_sets (its sets: happy, sad)
    """
    out: list[str | None] = []
    unknown: list[tuple[int, Any]] = []
    for e, v in enumerate(values):
        if _empty_cell(v):
            out.append(None)
            continue
        if isinstance(v, float) and v.is_integer():  # an integer label in a float column
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            raise JobError(
                f"`steer_column` {column!r}, example {e:,} (from 0): holds {_got(v)}, not a "
                "set's name (a string or an integer; empty or null: `steer`, or no steering)"
            )
        name = v if isinstance(v, str) else str(v)
        out.append(name if name in sets else None)
        if name not in sets:
            unknown.append((e, v))
    if unknown:
        e, v = unknown[0]
        more = (
            f"; {len(unknown) - 1:,} more example(s) name sets that are not there"
            if len(unknown) > 1
            else ""
        )
        names = ", ".join(sorted(sets))
        names = names if len(names) <= 300 else names[:300] + "..."
        raise JobError(
            f"`steer_column` {column!r}, example {e:,} (from 0): {_got(v)} is not a set of "
            f"`steer_sets` (its sets: {names}){more}"
        )
    return out


def _steer_factors(values: list[Any], column: str) -> list[float | None]:
    """Each example's factor of its specs' scales from the `steer_scale_column` values (None:
    empty, the specs' own scales); anything but a finite number is refused with its example.

    >>> _steer_factors([0, 2.5, None], "scale")
    [0.0, 2.5, None]
    """
    out: list[float | None] = []
    for e, v in enumerate(values):
        if _empty_cell(v) and not isinstance(v, str):
            out.append(None)
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise JobError(
                f"`steer_scale_column` {column!r}, example {e:,} (from 0): holds {_got(v)}, "
                "not a number (the factor of the example's steering scales; null: 1)"
            )
        try:
            f = float(v)
        except OverflowError:
            f = math.inf
        if not math.isfinite(f):
            raise JobError(
                f"`steer_scale_column` {column!r}, example {e:,} (from 0): {_got(v)} is not a "
                "finite number"
            )
        out.append(f)
    return out


def _check_token_ids(options: dict[str, Any], config: Any, name: str) -> None:
    """The token ids ``generate_kwargs`` names must be in the model's vocabulary (checked
    before the weights load; generate would fail on them mid-run)."""
    from ._generate_options import token_ids

    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab <= 0:
        return
    for key, t in token_ids(options):
        if t >= vocab:
            raise JobError(
                f"`generate_kwargs`: {key!r} names the token id {t}, above the {vocab} tokens "
                f"of {name}'s vocabulary"
            )


def _stored_capture(out: str) -> Any:
    """The reader of the capture already in ``out`` (None when there is none or it is unreadable:
    the writer then reports what is wrong)."""
    from .reader import open_capture

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
    diff = settings_differences(stored.settings, now)
    old_world = stored.index.get("world_size", 1)
    if old_world != world:
        diff.append(
            f"{world} writer rank(s) now, {old_world} when stored (one per data-parallel group: "
            "the ranks / `tp_size`)"
        )
    if diff:
        raise JobError(
            f"`out` {out!r} already holds a different capture ({stored.examples:,} examples): "
            + "; ".join(diff)
            + ". Use another `out`, or add `overwrite=True` to replace it."
        )


def _check_tp_heads(config: Any, tp_size: int) -> None:
    """Tensor parallelism gives each rank whole attention heads: a ``tp_size`` that does not
    divide the model's head counts is refused here, from the config, before the weights load
    (transformers would fail on every rank while loading them)."""
    config = getattr(config, "get_text_config", lambda: config)()
    for key, what in (
        ("num_attention_heads", "attention heads"),
        ("num_key_value_heads", "key/value heads"),
    ):
        n = getattr(config, key, None)
        if isinstance(n, int) and not isinstance(n, bool) and n > 0 and n % tp_size:
            raise JobError(
                f"`tp_size` {tp_size} does not divide the model's {n} {what} ({key} in its "
                "config): each tensor-parallel rank computes whole heads; give a `tp_size` "
                "that divides it"
            )


def model_class_name(model: Any) -> str:
    """The class name a store records for ``model``: the model's own class, not the one FSDP2's
    ``fully_shard`` makes for it (``FSDPLlamaForCausalLM``), so that a resume with another
    layout (tensor-parallel with data-parallel replicas, or none) is the same model."""
    import torch

    cls = type(model)
    fsdp = getattr(getattr(torch.distributed, "fsdp", None), "FSDPModule", None)
    while fsdp is not None and fsdp in cls.__bases__:
        cls = next(b for b in cls.__bases__ if b is not fsdp)
    return cls.__name__


def _metric_name(metric: Any) -> str:
    """The name a store's settings record for ``metric`` (as the recorder does)."""
    return metric if isinstance(metric, str) else getattr(metric, "__name__", type(metric).__name__)


def _probe_layers(model: Any, layers: list[str], batch: Any, device: Any) -> dict[str, Any]:
    """Run one short example through the model with a host capture of ``layers``: each layer's
    row shape and dtype; a layer that never runs is an error (it would capture nothing)."""
    import torch

    from .capture import capture

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
        raise JobError(
            f"`layers`: {', '.join(repr(n) for n in silent)} never run(s) in a forward of "
            f"{type(model).__name__}{hint}; the capture would be empty. "
            "Pick modules that run (pyhook layers lists them with their output shapes)"
        )
    return shapes


def _check_generation_model(prepared: Any, new: int, max_length: int | None, name: str) -> None:
    """`generate` needs a model with a generation head, and room for the new tokens in its
    positions (checked before the weights load)."""
    from .generate import _bidirectional, can_generate

    cls = prepared.model_class
    if not can_generate(cls, prepared.config):
        raise JobError(
            f"`generate`: {name} loads as {getattr(cls, '__name__', cls)}, which has no "
            "generation head (cannot generate); pick a class that has one with `model_class` "
            "(e.g. AutoModelForCausalLM) or a causal language model"
        )
    if _bidirectional(prepared.config):
        raise JobError(
            f"`generate`: {name} is a bidirectional encoder ({prepared.config.model_type}, "
            "is_decoder false): its rows over a sequence would not be those generate computes "
            "step by step; use a causal (decoder-only) language model"
        )
    if getattr(prepared.config, "is_encoder_decoder", False):
        raise JobError(
            f"`generate`: {name} is an encoder-decoder model; capture during generation takes "
            "a decoder-only (causal) language model"
        )
    limit = prepared.max_positions
    if limit is not None and new >= limit:
        raise JobError(
            f"`generate` {new} leaves no room for a prompt in the {limit} positions of {name}"
        )
    if limit is not None and max_length is not None and max_length + new > limit:
        raise JobError(
            f"`max_length` {max_length} + `generate` {new} is above the {limit} positions of "
            f"{name} (its config); use at most {limit - new} for `max_length`"
        )
