"""Several models, one store: the same tokens through two (or more) named models, for crosscoders
and model diffing (issue 25 item 4).

:class:`Paired` is one ``nn.Module`` holding the models by name; its forward runs every model on
the same arguments, in order. A capture of it records layers as ``NAME/LAYER``
(``base/resid_post.6``, ``chat/resid_post.6``); a layer without a model's name is taken from
every model. Both models' rows of a batch go into the same batch of the recorder, so they land in
the same shard under one ``__token_ids__``/``__row_index__``: the store cannot hold one model's
rows out of step with the other's (a swapped, reordered or damaged shard is caught by the shard
checks every store has: the shard's name and first example in its header, its size, its
checksum).

>>> import tempfile, torch, pyhook
>>> from pyhook.pipeline.paired import Paired
>>> a = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4))
>>> b = torch.nn.Sequential(torch.nn.Embedding(10, 6), torch.nn.Linear(6, 3))
>>> pair = Paired(base=a, chat=b)
>>> ids = torch.randint(0, 10, (2, 5))
>>> with torch.no_grad(), pyhook.capture(pair, ["1"], out=tempfile.mkdtemp()) as rec:
...     _ = pair(ids)
>>> reader = pyhook.open_capture(rec.out)
>>> reader.layers, reader["chat/1"].shape
(['base/1', 'chat/1'], torch.Size([10, 3]))

:class:`~pyhook.CaptureJob` (and ``pyhook capture --model base=DIR --model chat=DIR2``) loads the models
named in a ``model`` mapping into a :class:`Paired` and checks, before any forward, that their
tokenizers give the same ids (see :func:`check_tokenizers` and :class:`AgreeingTokenizer`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from ._names import SEP, check_model_name

__all__ = [
    "AgreeingTokenizer",
    "Paired",
    "PairedLoaded",
    "TokenizerMismatchError",
    "check_tokenizers",
    "prepare_models",
]


class TokenizerMismatchError(ValueError):
    """The models of a paired capture tokenize differently (one line naming the models and
    what differs)."""


class Paired(nn.Module):
    """Several named models run on the same inputs, as one module to capture from.

    ``Paired(base=model_a, chat=model_b)`` (or ``Paired({"base": model_a, "chat": model_b})``):
    a forward calls every model, in the order given, with the arguments it got, and returns
    ``{name: output}`` (``None`` when :attr:`keep_outputs` is off: each output is dropped as soon
    as its model returns, as a capture does not need the logits). Capturing it records layers as
    ``NAME/LAYER``; a layer given without a name (``resid_post.1``) is taken from every model.
    The models may differ in width and architecture; they must take the same inputs (token ids).
    A captured layer must be a module of one model only (a model that holds the other, such as
    a steered wrapper, is refused for the layers they share: a hook there runs in both).

    >>> import torch
    >>> from pyhook.capture import capture
    >>> a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 5)
    >>> pair = Paired(base=torch.nn.Sequential(a), chat=torch.nn.Sequential(b))
    >>> x = torch.randn(4, 3)
    >>> with capture(pair, ["base/0", "chat/0"]) as rec:
    ...     _ = pair(x)
    >>> torch.equal(rec["base/0"], a(x)), rec["chat/0"].shape
    (True, torch.Size([4, 5]))
    """

    def __init__(
        self, models: Mapping[str, nn.Module] | None = None, /, **named: nn.Module
    ) -> None:
        super().__init__()
        self.keep_outputs = True  # set first: no model can take the name
        given: dict[str, Any] = {}
        if models is not None:
            if not isinstance(models, Mapping):
                raise TypeError(
                    "Paired takes the models by name: Paired(base=model_a, chat=model_b) or "
                    f"Paired({{'base': model_a, 'chat': model_b}}), got {type(models).__name__}"
                )
            given.update(models)
        for name, m in named.items():
            if name in given:
                raise ValueError(f"Paired: the model name {name!r} is given twice")
            given[name] = m
        if len(given) < 2:
            raise ValueError(
                f"Paired needs at least two named models (got {len(given)}): "
                "Paired(base=model_a, chat=model_b)"
            )
        seen: dict[int, str] = {}
        for name, m in given.items():
            problem = check_model_name(name)
            if problem:
                raise ValueError(f"Paired: {problem}")
            if not isinstance(m, nn.Module):
                raise TypeError(
                    f"Paired: model {name!r} must be a torch.nn.Module, got {type(m).__name__}"
                )
            if id(m) in seen:
                raise ValueError(
                    f"Paired: models {seen[id(m)]!r} and {name!r} are the same module object; "
                    "pair two models"
                )
            seen[id(m)] = name
            from .._hooks import compiled_path

            if compiled_path(m) is not None:
                raise ValueError(
                    f"Paired: model {name!r} is compiled ({compiled_path(m)}); pair the eager "
                    "models (a paired capture hooks each model's modules by name)"
                )
            try:
                self.add_module(name, m)
            except KeyError:
                raise ValueError(
                    f"Paired: {name!r} cannot name a model (an attribute of Paired); "
                    "choose another name, e.g. 'base', 'chat'"
                ) from None
        self._names = list(given)

    @property
    def names(self) -> list[str]:
        """The models' names, in the order they run."""
        return list(self._names)

    def model(self, name: str) -> nn.Module:
        """The model called ``name``."""
        if name not in self._names:
            raise KeyError(f"no model named {name!r}; the models are {', '.join(self._names)}")
        return self._modules[name]  # type: ignore[return-value]

    def forward(self, *args: Any, **kwargs: Any) -> dict[str, Any] | None:
        outputs: dict[str, Any] = {}
        for name in self._names:
            out = self._modules[name](*args, **kwargs)  # type: ignore[misc]
            if self.keep_outputs:
                outputs[name] = out
            del out
        return outputs if self.keep_outputs else None

    def describe(self) -> str:
        """``base: GPT2LMHeadModel, chat: LlamaForCausalLM`` (plans and reports show this)."""
        return ", ".join(f"{n}: {type(self._modules[n]).__name__}" for n in self._names)

    # -- token ids ---------------------------------------------------------------------------
    def _pyhook_vocab(self) -> tuple[int, str] | None:
        """``(rows, whose)``: the fewest input-embedding rows among the models and whose they
        are (:func:`pyhook.pipeline.runner.run` checks each batch's ids against them: every
        model embeds the same ids); None when no model has an input embedding."""
        from .runner import _vocab_rows

        rows = {n: _vocab_rows(self._modules[n]) for n in self._names}
        known = {n: v for n, v in rows.items() if v is not None}
        if not known:
            return None
        fewest = min(known, key=lambda n: known[n])
        return known[fewest], f"model {fewest!r}'s"

    # -- layers ------------------------------------------------------------------------------
    def _pyhook_resolve_layers(
        self, layers: str | nn.Module | Iterable[str | nn.Module]
    ) -> list[tuple[str, Any]]:
        """``[(NAME/LAYER, target), ...]``: what :func:`pyhook.capture.resolve_layers` returns
        for a :class:`Paired` (each model resolves its own layers; model by model, in order)."""
        from ..modules import LayerNotFoundError
        from .capture import resolve_layers

        if isinstance(layers, (str, nn.Module)):
            layers = [layers]
        entries = list(layers)
        if not entries:
            raise ValueError(
                "layers is empty: name at least one layer (NAME/LAYER, or a LAYER of every model)"
            )
        asked: dict[str, list[Any]] = {n: [] for n in self._names}
        for entry in entries:
            if isinstance(entry, nn.Module):
                owner = next(
                    (
                        n
                        for n in self._names
                        if any(m is entry for m in self._modules[n].modules())  # type: ignore[union-attr]
                    ),
                    None,
                )
                if owner is None:
                    raise LayerNotFoundError(
                        type(entry).__name__,
                        f"the module {type(entry).__name__} is in none of the models "
                        f"({', '.join(self._names)})",
                    )
                asked[owner].append(entry)
            elif isinstance(entry, str) and SEP in entry:
                name, layer = entry.split(SEP, 1)
                if name not in asked:
                    raise LayerNotFoundError(
                        entry,
                        f"layer {entry!r} names no model: {name!r} is not one of "
                        f"{', '.join(self._names)} (a layer is NAME{SEP}LAYER, e.g. "
                        f"'{self._names[0]}{SEP}resid_post.1', or a LAYER of every model)",
                    )
                if not layer:
                    raise LayerNotFoundError(entry, f"layer {entry!r} names no layer after {SEP!r}")
                asked[name].append(layer)
            elif isinstance(entry, str):
                for name in self._names:
                    asked[name].append(entry)
            else:
                raise TypeError(
                    f"layers must hold names, globs or submodules, got {type(entry).__name__}: "
                    f"{entry!r}"
                )
        found: dict[str, Any] = {}
        # A module held by two models (a wrapper around the other model, a shared block) runs
        # in both forwards: a hook on it would store the last model's rows under both names.
        held = {n: {id(m) for m in self._modules[n].modules()} for n in self._names}  # type: ignore[union-attr]
        for name in self._names:
            if not asked[name]:
                continue
            model = self._modules[name]
            try:
                resolved = resolve_layers(model, asked[name])  # type: ignore[arg-type]
            except LayerNotFoundError as e:
                raise type(e)(f"{name}{SEP}{e.name}", f"model {name!r}: {e.args[0]}") from None
            for layer, target in resolved:
                module = target if isinstance(target, nn.Module) else target.module
                other = next((n for n in self._names if n != name and id(module) in held[n]), None)
                if other is not None:
                    there = next(
                        p
                        for p, m in self._modules[other].named_modules()  # type: ignore[union-attr]
                        if m is module
                    )
                    raise ValueError(
                        f"layer '{name}{SEP}{layer}': its module is also a module of model "
                        f"{other!r} ({there!r}), so it runs in both models' forwards and its "
                        "rows would mix the two models' rows; pair models that share no "
                        "module (e.g. copy.deepcopy(model) for the second), or capture a layer "
                        "that only one model holds"
                    )
                if type(target).__name__ == "Point":  # its module's path within this module
                    target = dataclasses.replace(target, module_name=f"{name}.{target.module_name}")
                found.setdefault(f"{name}{SEP}{layer}", target)
        return list(found.items())


# -- tokenizers ---------------------------------------------------------------------------------
def _serialized(tok: Any) -> str | None:
    """A fast tokenizer's whole pipeline as JSON (normaliser, pre-tokeniser, model with its
    vocabulary and merges, post-processor, added tokens), or None for a slow one."""
    backend = getattr(tok, "backend_tokenizer", None)
    try:
        return backend.to_str() if backend is not None else None
    except Exception:  # pragma: no cover - a backend that cannot serialise: compared on the corpus
        return None


def _specials(tok: Any) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id", "pad_token_id")
    return {k: getattr(tok, k, None) for k in keys}


def check_tokenizers(tokenizers: Mapping[str, Any]) -> bool:
    """Compare the tokenizers of several models: True when they are the same tokenizer (the
    same serialised pipeline, and the same special tokens), so the corpus needs no check; False
    when they differ but may still agree on a corpus (then :class:`AgreeingTokenizer` checks
    every text). Raises :class:`TokenizerMismatchError` when they cannot agree: a token id
    that means another token in one of them, or a special token (BOS, EOS, pad) that differs
    and is not a token of every model (differing ones are taken from the first model's
    tokenizer, as a base model's EOS and its chat model's differ).

    >>> from transformers import AutoTokenizer
    >>> from pyhook.pipeline.runner import resolve_model_path
    >>> tok = AutoTokenizer.from_pretrained(resolve_model_path("minilm"))
    >>> check_tokenizers({"base": tok, "chat": tok})
    True
    """
    names = list(tokenizers)
    first = tokenizers[names[0]]
    same = True
    for name in names[1:]:
        tok = tokenizers[name]
        a, b = _specials(first), _specials(tok)
        differ = [key for key in a if a[key] != b[key]]
        sa, sb = _serialized(first), _serialized(tok)
        if not differ and sa is not None and sa == sb:
            continue
        same = False
        va, vb = first.get_vocab(), tok.get_vocab()
        ia = {i: t for t, i in va.items()}
        ib = {i: t for t, i in vb.items()}
        # Special tokens that differ (a base model's EOS and its chat model's, as Llama 3 and
        # Qwen 2.5 have): the first model's are used, so each must be a token of every model.
        for key in differ:
            what = key.removesuffix("_token_id").upper()
            for i in (a[key], b[key]):
                if i is not None and (i not in ia or i not in ib):
                    owner = names[0] if i == a[key] else name
                    lacking = names[0] if i not in ia else name
                    raise TokenizerMismatchError(
                        f"the tokenizers of {names[0]!r} and {name!r} differ: {what} token id "
                        f"{a[key]} in {names[0]!r}, {b[key]} in {name!r}, and {owner!r}'s id "
                        f"{i} is not a token of {lacking!r}; a paired capture feeds the same "
                        "token ids (with the first model's special tokens) to every model"
                    )
        for i in sorted(set(ia) & set(ib)):
            if ia[i] != ib[i]:
                raise TokenizerMismatchError(
                    f"the tokenizers of {names[0]!r} and {name!r} differ: token id {i} is "
                    f"{ia[i]!r} in {names[0]!r} and {ib[i]!r} in {name!r}; a paired capture "
                    "feeds the same token ids to every model, so their vocabularies must agree"
                )
    return same


def _snippet(text: Any) -> str:
    text = text if isinstance(text, str) else repr(text)
    return repr(text if len(text) <= 60 else text[:57] + "...")


class AgreeingTokenizer:
    """A tokenizer that is the first model's, and checks on every call that the other models'
    tokenizers give the same ids: the first text they disagree on raises
    :class:`TokenizerMismatchError` naming the models, the text and the first token that
    differs (before the batch holding it is run or written). Everything else (special tokens,
    ``batch_decode``, ...) is the first tokenizer's.

    >>> from transformers import AutoTokenizer
    >>> from pyhook.pipeline.runner import resolve_model_path
    >>> tok = AutoTokenizer.from_pretrained(resolve_model_path("minilm"))
    >>> both = AgreeingTokenizer({"base": tok, "chat": tok})
    >>> both(["a test"])["input_ids"]
    [[101, 1037, 3231, 102]]
    """

    def __init__(self, tokenizers: Mapping[str, Any]) -> None:
        self._names = list(tokenizers)
        self._toks = dict(tokenizers)
        self._first = self._toks[self._names[0]]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_first"], name)

    def __len__(self) -> int:
        return len(self._first)

    def __call__(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        got = self._first(text, *args, **kwargs)
        ids = got["input_ids"]
        texts = [text] if isinstance(text, str) else list(text)
        rows = [ids] if isinstance(text, str) else ids
        for name in self._names[1:]:
            other = self._toks[name](text, *args, **kwargs)["input_ids"]
            other_rows = [other] if isinstance(text, str) else other
            if rows == other_rows:
                continue
            for t, x, y in zip(texts, rows, other_rows):
                x, y = list(x), list(y)
                if x == y:
                    continue
                at = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
                shown = [
                    repr(self._first.convert_ids_to_tokens(x[at])) if at < len(x) else "the end",
                    repr(self._toks[name].convert_ids_to_tokens(y[at]))
                    if at < len(y)
                    else "the end",
                ]
                raise TokenizerMismatchError(
                    f"the tokenizers of {self._names[0]!r} and {name!r} give different ids for "
                    f"the text {_snippet(t)}: token {at} is {shown[0]} (id "
                    f"{x[at] if at < len(x) else '-'}) in {self._names[0]!r}, {shown[1]} (id "
                    f"{y[at] if at < len(y) else '-'}) in {name!r}; a paired capture needs models "
                    "whose tokenizers give the same ids on the corpus"
                )
        return got


# -- loading (the job's) -------------------------------------------------------------------------
@dataclasses.dataclass
class PairedLoaded:
    """The models of a paired job, found and configured (weights not loaded yet): what
    :func:`pyhook.pipeline.runner.prepare_model` gives for one model, for several.

    ``path`` is ``NAME=PATH`` of each model (what the store's settings record),
    ``max_positions`` and ``config.vocab_size`` the smallest of the models'.
    """

    loaded: dict[str, Any]
    path: str
    max_positions: int | None
    config: Any
    display_name: str

    @property
    def names(self) -> list[str]:
        return list(self.loaded)

    def paths(self) -> dict[str, str]:
        return {n: ld.path for n, ld in self.loaded.items()}

    def load_tokenizer(self, spec: str | None) -> tuple[Any, str]:
        """``(tokenizer, path)``: each model's own tokenizer (``spec`` for a model saved
        without one), checked to agree (:func:`check_tokenizers`); an
        :class:`AgreeingTokenizer` when they are not the same tokenizer."""
        from .runner import _TOKENIZER_FILES, RunnerError, load_tokenizer

        toks: dict[str, Any] = {}
        first_path = ""
        owns = {
            name: any(os.path.exists(os.path.join(ld.path, f)) for f in _TOKENIZER_FILES)
            for name, ld in self.loaded.items()
        }
        if spec is not None and all(owns.values()):
            raise RunnerError(
                f"--tokenizer {spec!r} is for models saved without a tokenizer, and every model "
                f"here has its own ({', '.join(self.names)}): a paired capture uses each model's "
                "own tokenizer, checked to agree; drop --tokenizer"
            )
        for name, ld in self.loaded.items():
            own = owns[name]
            try:
                tok, path = load_tokenizer(None if own else spec, ld.path)
            except RunnerError as e:
                raise RunnerError(f"model {name!r}: {e}") from None
            toks[name] = tok
            first_path = first_path or path
        same = check_tokenizers(toks)
        return (toks[self.names[0]] if same else AgreeingTokenizer(toks)), first_path

    def load_weights(self, *, device: Any = "cpu", dtype: Any = None) -> Paired:
        """Every model's weights (on ``device``, in ``dtype``), as a :class:`Paired` that drops
        each model's output as soon as it returns."""
        from .runner import load_weights

        pair = Paired(
            {n: load_weights(ld, device=device, dtype=dtype) for n, ld in self.loaded.items()}
        )
        pair.keep_outputs = False
        return pair


def prepare_models(models: Mapping[str, str], *, model_class: str | None = None) -> PairedLoaded:
    """Find every model of a paired job and read its config (no weights, no tokenizer yet).

    >>> p = prepare_models({"base": "minilm", "chat": "minilm"})
    >>> p.names, p.max_positions, p.config.vocab_size
    (['base', 'chat'], 512, 30522)
    """
    from .runner import RunnerError, prepare_model

    loaded = {}
    for name, spec in models.items():
        try:
            loaded[name] = prepare_model(spec, model_class=model_class, need_tokenizer=False)
        except RunnerError as e:
            raise RunnerError(f"model {name!r}: {e}") from None
    positions = [ld.max_positions for ld in loaded.values() if ld.max_positions is not None]
    vocabs = {
        n: v
        for n, v in ((n, getattr(ld.config, "vocab_size", None)) for n, ld in loaded.items())
        if isinstance(v, int) and v > 0
    }
    fewest = min(vocabs, key=lambda n: vocabs[n]) if vocabs else None
    smallest = min(loaded, key=lambda n: loaded[n].max_positions or float("inf"))
    return PairedLoaded(
        loaded=loaded,
        path=" ".join(f"{n}={ld.path}" for n, ld in loaded.items()),
        max_positions=min(positions) if positions else None,
        config=_Config(
            vocabs[fewest] if fewest is not None else None,
            f"model {fewest!r}'s, the smallest of the models'" if fewest is not None else "",
        ),
        display_name=f"{smallest} ({os.path.basename(loaded[smallest].path)})",
    )


@dataclasses.dataclass
class _Config:
    vocab_size: int | None
    vocab_of: str = "the model's"  # whose vocabulary size it is, for the corpus's messages


def is_paired(model: Any) -> bool:
    """Whether ``model`` (a job's ``model``) names several models (a mapping)."""
    return isinstance(model, Mapping)
