"""Capture during ``model.generate``: the activations of every token a generation runs through
the model, prompt and generated, one row each, stored as a plain forward over the final
sequences would store them.

>>> import tempfile, torch, transformers, pyhook
>>> from pyhook.pipeline.generate import prompt_batches, run_generate
>>> gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config(
...     n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=32,
...     bos_token_id=0, eos_token_id=0)).eval()
>>> out = tempfile.mkdtemp()
>>> with pyhook.capture(gpt, "resid_post.1", out=out) as rec:
...     _ = run_generate(gpt, prompt_batches([[5, 6, 7], [8, 9]]), rec, max_new_tokens=4)
>>> r = pyhook.open_capture(out)
>>> r.examples, r.row_index[:, 0].tolist() == sorted(r.row_index[:, 0].tolist())
(2, True)

How it works, for one batch of prompts (:func:`run_generate`):

* the prompts are left-padded and handed to ``model.generate`` (KV cache on; greedy unless
  asked otherwise); the recorder's hooks see each step, i.e. each call of the model: the
  prompt (the first call, its padding masked out through :meth:`~pyhook.capture.Recorder.annotate`)
  and then one token per sequence per call;
* the steps' rows are kept back from the store (``Recorder._hold``, a :class:`_Held`) until
  the generation ends: each step's rows are copied into one buffer per layer with a slot per
  sequence (its kept prompt rows, then ``max_new_tokens - 1`` new ones), and count against the
  capture's host budget (``max_host_bytes``) with the rows waiting for the disk;
  then the final sequences are known, and the batch is written as **one** batch of the store:
  rows ordered by (example, position) as a forward over the final sequences gives them (the
  slots moved together), each with its token id, ``row_index`` (example, absolute position in
  the unpadded sequence) and a ``__generated__`` flag; rows of a sequence past its end are
  dropped (its end: its first EOS, or the step a criterion of ``stopping_criteria=`` or a
  stop string said it was done, seen by wrapping them, :class:`_Stops`);
* statistics are those of the stored rows; the examples count once per prompt batch, so a
  killed capture resumes at the next prompt batch (a batch is never split across shards).

The last token of each sequence (its EOS, the token a stopping criterion or stop string ended it
at, or the ``max_new_tokens``-th new token) is never run through the model by ``generate``
(nothing is predicted after it), so it has no row; every row's next token is in the sequence.
``reader.text(e)`` is the prompt and its completion, ``reader.completion(e)`` the completion
alone.
"""

from __future__ import annotations

import contextlib
import json
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from .. import _backend
from ..positions import absolute_positions
from ..steering import steering
from . import annotations
from ._generate_options import _REFUSED  # options that break one row per token
from ._record import batch_stats, stats_later
from .steer import describe, specs_of_batch

__all__ = [
    "GENERATED",
    "GenerateError",
    "can_generate",
    "prompt_batches",
    "run_generate",
]

#: The reserved tensor holding each row's flag (bool ``[rows]``): its token was generated.
GENERATED = annotations.GENERATED
#: Bytes of each text that are the prompt (int64, aligned with ``__text_lengths__``).
TEXT_PROMPT_BYTES = annotations.TEXT_PROMPT_BYTES


class GenerateError(ValueError):
    """A generation that cannot be captured as asked (one line naming the option or example).

    >>> issubclass(GenerateError, ValueError)
    True
    """


def can_generate(model_class: Any, config: Any = None) -> bool:
    """Whether a transformers class (an auto class resolved for ``config``) has a generation
    head (``can_generate()``): checked before the weights load.

    >>> import transformers
    >>> can_generate(transformers.GPT2LMHeadModel), can_generate(transformers.GPT2Model)
    (True, False)
    """
    target = model_class
    mapping = getattr(model_class, "_model_mapping", None)
    if mapping is not None and config is not None:
        try:
            target = mapping[type(config)]
        except (KeyError, ValueError):
            return False
    check = getattr(target, "can_generate", None)
    try:
        return bool(check()) if callable(check) else False
    except Exception:  # a class whose check needs an instance
        return False


def _bidirectional(config: Any) -> bool:
    """Whether ``config`` is an encoder's (BERT, RoBERTa, ...: a masked-LM family) loaded as a
    causal LM without ``is_decoder=True``: its attention sees the later tokens, so a forward
    over a sequence does not give what ``generate``'s steps (each seeing the earlier ones)
    give.

    >>> import transformers
    >>> cfg = transformers.BertConfig()
    >>> _bidirectional(cfg), _bidirectional(transformers.BertConfig(is_decoder=True))
    (True, False)
    >>> _bidirectional(transformers.GPT2Config())
    False
    """
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    if getattr(config, "is_decoder", False) or getattr(config, "causal", False):
        return False
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES
    except ImportError:  # pragma: no cover - transformers without its auto mappings
        return False
    return getattr(config, "model_type", None) in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def prompt_batches(
    prompts: Sequence[str | Sequence[int]],
    *,
    tokenizer: Any = None,
    batch_size: int = 32,
    skip: int = 0,
) -> Iterator[Any]:
    """Batches (:class:`pyhook.source.Batch`) of ``prompts``: strings (tokenised with
    ``tokenizer``, which adds its own special tokens) or lists of token ids, ``batch_size`` a
    batch, from prompt ``skip`` on (``rec.examples_done`` resumes a capture).

    >>> [b.examples.tolist() for b in prompt_batches([[1], [2, 3], [4]], batch_size=2)]
    [[0, 1], [2]]
    """
    from .source import Batch

    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise GenerateError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if isinstance(prompts, (str, bytes)):
        raise GenerateError(
            "prompts must be a list of prompts (strings or lists of token ids), got one "
            f"{type(prompts).__name__}: pass [prompt]"
        )
    prompts = list(prompts)
    for start in range(skip, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        texts = None
        if all(isinstance(p, str) for p in chunk):
            if tokenizer is None:
                raise GenerateError("prompts given as text need a tokenizer= to tokenise them")
            texts = list(chunk)
            ids = [list(tokenizer(p)["input_ids"]) for p in chunk]
        else:
            ids = [_prompt_ids(p, start + i) for i, p in enumerate(chunk)]
        width = max(1, max(len(i) for i in ids))
        input_ids = torch.zeros(len(ids), width, dtype=torch.long)
        mask = torch.zeros(len(ids), width, dtype=torch.long)
        for row, seq in enumerate(ids):
            input_ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, : len(seq)] = 1
        examples = torch.arange(start, start + len(ids), dtype=torch.long)
        yield Batch(input_ids, mask, mask.bool(), examples, texts)


def _prompt_ids(p: Any, i: int) -> list[int]:
    """Prompt ``i`` given as token ids: a list of ints (or a 1-D tensor)."""
    if not isinstance(p, str):
        try:
            return [int(t) for t in p]
        except (TypeError, ValueError, RuntimeError):
            pass
    got = "text among prompts given as token ids" if isinstance(p, str) else repr(p)[:40]
    raise GenerateError(
        f"prompt {i}: a prompt is a string or a list of token ids (all of one kind), got {got}; "
        "one prompt of token ids is a list in the list of prompts: [[5, 6, 7]]"
    )


def _setting(model: Any, kwargs: dict[str, Any], key: str) -> Any:
    """The value ``generate`` uses for its option ``key``, resolved as transformers resolves
    it: ``kwargs[key]`` when given (even None), else the ``generation_config=`` argument's
    field when set (not None), else the model's ``generation_config``.

    >>> import transformers
    >>> m = transformers.GPT2LMHeadModel(transformers.GPT2Config(
    ...     n_layer=1, n_embd=8, n_head=2, vocab_size=20, bos_token_id=3, eos_token_id=3))
    >>> gc = transformers.GenerationConfig(eos_token_id=[5, 6])
    >>> _setting(m, {}, "eos_token_id"), _setting(m, {"generation_config": gc}, "eos_token_id")
    (3, [5, 6])
    >>> _setting(m, {"generation_config": gc, "eos_token_id": 7}, "eos_token_id")
    7
    """
    if key in kwargs:
        return kwargs[key]
    for cfg in (kwargs.get("generation_config"), getattr(model, "generation_config", None)):
        value = getattr(cfg, key, None)
        if value is not None:
            return value
    return None


def _token_id(v: Any, key: str) -> int:
    """One token id of the option ``key`` (an int, or a one-element tensor)."""
    if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_floating_point():
        return int(v.reshape(-1)[0])
    if not isinstance(v, (bool, torch.Tensor)):
        with contextlib.suppress(TypeError):
            return operator.index(v)  # an int, a numpy integer
    raise GenerateError(
        f"generate option {key!r} must be a token id (an int)"
        + (" or a list of them" if key == "eos_token_id" else "")
        + f", got {v!r}"
    )


def _eos_ids(model: Any, kwargs: dict[str, Any]) -> list[int]:
    """The EOS token ids ``generate`` stops a sequence at (an int, a list or a tensor of them,
    from ``kwargs``, the ``generation_config=`` argument or the model's)."""
    eos = _setting(model, kwargs, "eos_token_id")
    if eos is None:
        return []
    if isinstance(eos, torch.Tensor):
        eos = list(eos.reshape(-1))
    items = eos if isinstance(eos, (list, tuple)) else [eos]
    return [_token_id(x, "eos_token_id") for x in items]


def _pad_id(model: Any, kwargs: dict[str, Any], tokenizer: Any, eos: list[int]) -> int:
    for v in (
        _setting(model, kwargs, "pad_token_id"),
        getattr(tokenizer, "pad_token_id", None),
        eos[0] if eos else None,
    ):
        if v is not None:
            return _token_id(v, "pad_token_id")
    return 0


def _generation_config(options: dict[str, Any]) -> None:
    """``options["generation_config"]`` as a ``transformers.GenerationConfig`` (a mapping, e.g.
    from a job's JSON ``generate_kwargs``, is made one), in place."""
    cfg = options.get("generation_config")
    if cfg is None:
        options.pop("generation_config", None)
        return
    if isinstance(cfg, Mapping):
        import transformers

        try:
            options["generation_config"] = transformers.GenerationConfig(**cfg)
        except (TypeError, ValueError) as e:
            raise GenerateError(f"generate option 'generation_config': {e}") from None
    elif not callable(getattr(cfg, "to_dict", None)):
        raise GenerateError(
            "generate option 'generation_config' must be a transformers.GenerationConfig (or a "
            f"mapping of its fields), got {type(cfg).__name__}"
        )


class _Watched:
    """A stopping criterion of the user's, as ``generate`` calls it, that records what it
    returned at each step: ``(sequence length, done [batch] bool)`` into ``seen``.

    Other attributes are the criterion's own (``generate`` pads the finished sequences only
    when a criterion has an ``eos_token_id``).
    """

    def __init__(self, inner: Any, seen: list[tuple[int, torch.Tensor]]) -> None:
        self.inner = inner
        self.seen = seen

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> Any:
        done = self.inner(input_ids, scores, **kwargs)
        n = int(input_ids.shape[0])
        flags = torch.as_tensor(done, device=input_ids.device).to(torch.bool)
        self.seen.append((int(input_ids.shape[1]), flags.reshape(-1).expand(n).clone()))
        return done

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "seen") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.inner, name)


class _Stops:
    """The ways a sequence stops that its final tokens do not show: the criteria of
    ``stopping_criteria=`` and the stop strings (``stop_strings=``), each wrapped
    (:class:`_Watched`) so that each sequence's first step with a criterion done is known.

    (EOS is seen in the tokens; ``max_new_tokens`` and ``max_time`` stop every sequence at once,
    at the generation's last step.)
    """

    def __init__(self, criteria: list[Any]) -> None:
        self.seen: list[tuple[int, torch.Tensor]] = []
        self.criteria = [_Watched(c, self.seen) for c in criteria]

    def reset(self) -> None:
        """Forget the steps of the previous prompt batch."""
        self.seen.clear()

    def ends(self, width: int, steps: int, n_seq: int) -> torch.Tensor:
        """Each sequence's new tokens up to the first step a criterion said it is done (that
        step's token included), ``steps`` where none did."""
        calls = sorted(length - width for length, _ in self.seen)
        if calls != sorted(list(range(1, steps + 1)) * len(self.criteria)):
            raise RuntimeError(
                f"generate called the stopping criteria {len(self.seen)} time(s) for {steps} "
                f"new token(s) and {len(self.criteria)} criteria: where each sequence stopped "
                "is not known (one call per criterion per step is expected)"
            )
        ends = torch.full((n_seq,), steps, dtype=torch.long)
        for length, done in self.seen:
            step = length - width
            ends = torch.where(done.to("cpu"), torch.clamp(ends, max=step), ends)
        return ends


# Criteria that generate makes itself from its options: one of the same class in
# stopping_criteria= replaces generate's own (transformers keeps the user's).
_OWN_CRITERIA = {
    "MaxLengthCriteria": "max_new_tokens",
    "MaxTimeCriteria": "max_time",
    "StopStringCriteria": "stop_strings",
    "EosTokenCriteria": "eos_token_id",
}


def _stops(
    model: Any, options: dict[str, Any], tokenizer: Any, eos: list[int]
) -> tuple[_Stops | None, dict[str, Any]]:
    """The watched criteria of a generation (None: no criterion to watch) and the options
    that replace ``generate``'s own (``stop_strings=None``: pyhook matches them itself)."""
    criteria: list[Any] = []
    given = options.get("stopping_criteria")
    stop_strings = _setting(model, options, "stop_strings")
    if given is None and stop_strings is None:
        return None, {}
    import transformers  # the criteria are transformers' own, or made like them

    if given is not None:
        if callable(given) and not isinstance(given, (list, tuple)):
            given = [given]  # one criterion, not in a list
        made = {  # the criteria generate makes itself here
            "max_new_tokens": True,
            "max_time": _setting(model, options, "max_time") is not None,
            "stop_strings": bool(stop_strings),
            "eos_token_id": bool(eos),
        }
        for c in given:
            if not callable(c):
                raise GenerateError(
                    "generate option 'stopping_criteria' must hold transformers "
                    f"StoppingCriteria (callables), got {type(c).__name__}"
                )
            name = type(c).__name__
            flag = _OWN_CRITERIA.get(name)
            if flag is not None and made[flag] and type(c) is getattr(transformers, name, None):
                raise GenerateError(
                    f"generate option 'stopping_criteria': its {name} would replace the one "
                    f"generate makes from {flag} (transformers keeps only one); set {flag} "
                    "instead"
                )
            criteria.append(c)
    extra: dict[str, Any] = {}
    if stop_strings is not None:  # matched by a watched criterion (none: nothing to match)
        extra["stop_strings"] = None
    if stop_strings:
        if tokenizer is None:
            raise GenerateError(
                "generate option 'stop_strings' needs tokenizer= (the tokenizer whose text the "
                "stop strings are matched in)"
            )
        if isinstance(stop_strings, str):
            stop_strings = [stop_strings]
        try:
            criteria.append(
                transformers.StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings)
            )
        except (TypeError, ValueError) as e:
            raise GenerateError(
                "generate option 'stop_strings': transformers' StopStringCriteria could not be "
                f"made from them and tokenizer= ({type(e).__name__}: {e})"
            ) from None
    if not criteria:
        return None, extra
    stops = _Stops(criteria)
    extra["stopping_criteria"] = transformers.StoppingCriteriaList(stops.criteria)
    return stops, extra


def _left_pad(b: Any, pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, attention mask, keep, lengths)`` of batch ``b`` with its prompts left-padded."""
    am = b.attention_mask.to("cpu").bool()
    lengths = am.sum(1)
    if int(lengths.min()) == 0:
        row = int((lengths == 0).nonzero()[0])
        raise GenerateError(
            f"example {int(b.examples[row])}: the prompt is empty (no token to continue); "
            "give every prompt at least one token"
        )
    width = int(lengths.max())
    ids = torch.full((am.shape[0], width), pad, dtype=torch.long)
    mask = torch.zeros(am.shape[0], width, dtype=torch.long)
    keep = torch.zeros(am.shape[0], width, dtype=torch.bool)
    src_ids = b.input_ids.to("cpu")
    src_keep = b.keep.to("cpu").bool() if b.keep is not None else am
    for row in range(am.shape[0]):
        n = int(lengths[row])
        ids[row, width - n :] = src_ids[row][am[row]]
        mask[row, width - n :] = 1
        keep[row, width - n :] = src_keep[row][am[row]]
    return ids, mask, keep, lengths


def _generate_kwargs(
    model: Any, sampling: str, options: dict[str, Any], max_new_tokens: int, pad: int
) -> dict[str, Any]:
    for key in options:
        if key in _REFUSED and not (
            (key in ("num_beams", "num_return_sequences") and options[key] == 1)
            or (key == "prefill_chunk_size" and options[key] is None)
        ):
            raise GenerateError(f"generate option {key!r} cannot be captured: {_REFUSED[key]}")
    if options.get("use_cache") is False:
        raise GenerateError(
            "generate option use_cache=False: capture runs generate with its KV cache (one "
            "token per sequence per step)"
        )
    # what the generation_config argument or the model's sets (generate's own resolution)
    counts = ("num_beams", "num_return_sequences")
    for key in (*counts, "prompt_lookup_num_tokens", "assistant_early_exit", "prefill_chunk_size"):
        arg = getattr(options.get("generation_config"), key, None) is not None
        if key in options or (key == "num_beams" and sampling != "model" and not arg):
            continue  # given (and checked above), or the model's, set to 1 below
        value = _setting(model, options, key)
        if value is None or (key in counts and int(value) <= 1):
            continue
        where = "generate option 'generation_config'" if arg else "the model's generation_config"
        fix = f"pass {key}=1 (generate_kwargs)" if key in counts else ""
        if key == "prefill_chunk_size":
            fix = "pass prefill_chunk_size=None (generate_kwargs)"
        if key == "num_beams" and not arg:
            fix += ", or sampling 'greedy'/'sample'"
        raise GenerateError(
            f"{where} sets {key}={value}: {_REFUSED[key]}" + (f"; {fix}" if fix else "")
        )
    kw: dict[str, Any] = {"max_new_tokens": max_new_tokens, "use_cache": True, "pad_token_id": pad}
    if sampling == "greedy":
        kw.update(do_sample=False, num_beams=1)
    elif sampling == "sample":
        kw.update(do_sample=True, num_beams=1)
    elif sampling != "model":
        raise GenerateError(f"sampling must be 'greedy', 'sample' or 'model', got {sampling!r}")
    if getattr(options.get("generation_config"), "do_sample", None) is not None:
        kw.pop("do_sample", None)  # the generation_config argument's, as a do_sample option's
    kw.update(options)
    return kw


def _folded(kw: dict[str, Any]) -> dict[str, Any]:
    """``generate``'s arguments with a ``generation_config`` argument: its fields set by the
    other arguments set in a copy of it instead (what ``generate`` does with them, without
    its warning that passing both is deprecated). Arguments that are None stay arguments:
    ``generate`` fills the config's unset (None) fields from the model's, and applies its
    arguments after that."""
    cfg = kw.get("generation_config")
    if cfg is None:
        return kw
    import copy

    cfg = copy.deepcopy(cfg)
    fields = {
        k: v
        for k, v in kw.items()
        if k != "generation_config" and v is not None and hasattr(cfg, k)
    }
    try:
        cfg.update(**fields)
    except (TypeError, ValueError) as e:
        raise GenerateError(f"generate option 'generation_config': {e}") from None
    rest = {k: v for k, v in kw.items() if k not in fields}
    rest["generation_config"] = cfg
    return rest


class _Held:
    """The rows of one prompt batch's generation, placed as the steps come.

    Each step's rows are copied at once (or, for copies still in flight to the host, at the
    next step) into one buffer per layer, where each sequence has a slot of its kept prompt
    rows plus ``max_new_tokens - 1`` generated rows, and the step's own buffers go back to the
    pool: what a batch holds is its rows once (only the pages written are resident). For a
    disk capture the rows held count against the capture's host budget
    (``Recorder._held``, within ``max_host_bytes``): a step waits for the writer while the
    rows it still holds of earlier batches and these would exceed it (never for the rows of
    this batch alone, which must all be held until its sequences are final).
    """

    def __init__(
        self, rec: Any, prefill_keep: torch.Tensor, max_new_tokens: int, sync: bool
    ) -> None:
        self.rec = rec
        self.n_seq = int(prefill_keep.shape[0])
        self.max_new = max_new_tokens
        self.pk = prefill_keep.sum(1).to(torch.long)  # kept prompt rows of each sequence
        self.prefill_rows = int(self.pk.sum())
        slot = self.pk + (max_new_tokens - 1)
        self.base = torch.cumsum(slot, 0) - slot  # each sequence's first row in the buffers
        self.cap = int(slot.sum())
        r0, c0 = prefill_keep.nonzero(as_tuple=True)  # the prompt rows, in the step's order
        within = torch.cumsum(prefill_keep.to(torch.long), 1) - 1
        self.prefill_dest = self.base[r0] + within[r0, c0]
        self.steps = 0  # calls of the model seen
        self.pending: list[tuple[int, dict[str, Any], Any]] = []  # (step, rows, wait)
        self.out: dict[str, torch.Tensor] | None = None
        self.charged = 0  # bytes counted in rec._held for this batch
        self.sync = sync  # the model runs on the CPU: its copies are done, placed at once

    def append(self, item: tuple[dict[str, Any], int, dict[str, Any], Any]) -> None:
        """One call of the model (``Recorder._add`` while holding): its rows are placed."""
        rows, _, _, wait = item
        step = self.steps
        if step >= self.max_new:
            raise RuntimeError(
                f"generate ran the model more than max_new_tokens={self.max_new} time(s); "
                "pyhook captures generate with its KV cache, one call per new token (no beam "
                "search, assisted or speculative decoding)"
            )
        want = self.prefill_rows if step == 0 else self.n_seq
        for name, p in rows.items():
            got = int(p.shapes[0][0] if not isinstance(p, torch.Tensor) else p.shape[0])
            if got != want:
                raise GenerateError(
                    f"layer {name!r} gave {got} row(s) in step {step} of generate, expected "
                    f"{want} (one per token run): capture layers whose output has a "
                    "token dimension, [batch, tokens, ...] (e.g. blocks, not the LM head)"
                )
        if self.out is None:
            self.out = {}
            for name, p in rows.items():
                shape, dtype, dev = _shape_of(p)
                self.out[name] = (
                    _backend.empty_host((self.cap, *shape), dtype)
                    if dev.type == "cpu"
                    else torch.empty((self.cap, *shape), dtype=dtype, device=dev)
                )
        nbytes = sum(int(p.nbytes) for p in rows.values())
        self._charge(nbytes)
        self.steps += 1
        self.pending.append((step, rows, wait))
        # Copies to the host still in flight are waited for one step later (not at once).
        self.place(keep=0 if self.sync else 1)

    def _charge(self, nbytes: int) -> None:
        rec = self.rec
        if rec.to != "disk" or rec._writer is None:
            return
        budget = rec._rows_budget
        with rec._held_cv:
            full = rec._held - self.charged > 0 and rec._held + nbytes > budget
        if full:
            rec._writer.flush()  # what it buffers becomes a shard, so that it can be released
            with rec._held_cv:
                while rec._held - self.charged > 0 and rec._held + nbytes > budget:
                    rec._held_cv.wait(0.1)
                    rec._writer._check_error()
        with rec._held_cv:
            rec._held += nbytes
            self.charged += nbytes
            rec.peak_held_bytes = max(rec.peak_held_bytes, rec._held)

    def uncharge(self) -> None:
        rec = self.rec
        if self.charged:
            with rec._held_cv:
                rec._held -= self.charged
                self.charged = 0
                rec._held_cv.notify_all()

    def place(self, keep: int = 0) -> None:
        """Copy the pending steps (all but the last ``keep``) into the buffers."""
        rec = self.rec
        assert self.out is not None or not self.pending
        while len(self.pending) > keep:
            step, rows, wait = self.pending.pop(0)
            if wait is not None:
                wait()
            parts = {name: _resolved(p) for name, p in rows.items()}
            dest = self.prefill_dest if step == 0 else self.base + self.pk + (step - 1)
            with torch.no_grad():
                for name, part in parts.items():
                    o = self.out[name]  # type: ignore[index]
                    if part.shape[0]:
                        o.index_copy_(0, dest.to(o.device), part.to(o.device))
            if rec.to == "disk" and not rec._compiled:
                rec._offloader.release(list(parts.values()))

    def drop(self) -> None:
        """Give back what a failed generation holds (nothing of it is stored)."""
        rec = self.rec
        for _, rows, wait in self.pending:
            with contextlib.suppress(Exception):
                if wait is not None:
                    wait()
                parts = [_resolved(p) for p in rows.values()]
                if rec.to == "disk" and not rec._compiled:
                    rec._offloader.release(parts)
        self.pending.clear()
        self.out = None
        self.uncharge()


class _Steps:
    """What one prompt batch's generation holds back (:class:`_Held`) while it runs."""

    def __init__(
        self, rec: Any, prefill_keep: torch.Tensor, max_new_tokens: int, sync: bool
    ) -> None:
        self.rec = rec
        self.held = _Held(rec, prefill_keep, max_new_tokens, sync)

    def __enter__(self) -> _Steps:
        if self.rec._hold is not None:
            raise RuntimeError("run_generate: this recorder is already holding a generation")
        self.rec._hold = self.held
        self.notes = set(getattr(self.rec, "_notes", {}))  # a compiled path's, by batch
        # The steps' own token annotations (a host copy of each step's ids) are not needed:
        # the joined batch gets its token ids from the final sequences.
        self.tokens, self.rec._tokens = self.rec._tokens, False
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.rec._hold = None
        self.rec._tokens = self.tokens
        if exc_type is not None:  # nothing of this batch is stored: give the buffers back
            self.held.drop()
            # and the prompts' annotation, when generate raised before running the model: the
            # next forward under this recorder is not this batch
            self.rec._note = None
            notes = getattr(self.rec, "_notes", {})
            for key in set(notes) - self.notes:
                notes.pop(key, None)
            # a step that raised is no batch the caller's loop went on from (its prompts are
            # not consumed: examples_done resumes at them), so not counted as skipped
            self.rec.retry()


def _forked_rng(device: Any) -> Any:
    """``torch.random.fork_rng`` over the generators :func:`_seed` sets for ``device``: the
    CPU's, and the device's own when it is a CUDA device (no other CUDA device's)."""
    dev = torch.device(device)
    return torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else [])


def _seed(device: Any, value: int) -> None:
    """Seed the generators ``generate`` draws from on ``device`` (the CPU's, and the CUDA
    device's) with ``value``, as ``torch.manual_seed`` would for them, leaving every other
    device's generator as it was (``torch.manual_seed`` reseeds all CUDA devices, and
    :func:`_forked_rng` restores only the model's)."""
    dev = torch.device(device)
    torch.random.default_generator.manual_seed(value)
    if dev.type == "cuda":
        with torch.cuda.device(dev):
            torch.cuda.manual_seed(value)
    elif dev.type != "cpu":  # another accelerator: its generator, as torch.manual_seed seeds it
        torch.manual_seed(value)


def _resolved(p: Any) -> torch.Tensor:
    """A step's rows: a tensor, or a pending host copy (waited for)."""
    return p if isinstance(p, torch.Tensor) else p.wait()[0]


def run_generate(
    model: Any,
    batches: Iterable[Any],
    rec: Any,
    *,
    max_new_tokens: int,
    generated_only: bool = False,
    last_only: bool = False,
    sampling: str = "greedy",
    seed: int = 0,
    tokenizer: Any = None,
    stats: bool | None = None,
    device: Any = None,
    on_batch: Callable[[Any, float], None] | None = None,
    on_generated: Callable[[int], None] | None = None,
    exclude_tokens: Any = None,
    steer: Any = None,
    **generate_kwargs: Any,
) -> dict[str, float]:
    """Run ``model.generate`` over the prompt ``batches`` (:class:`pyhook.source.Batch`, e.g.
    from :func:`prompt_batches` or a corpus source) under the recorder ``rec`` (made by
    :func:`pyhook.capture` with no ``mask`` or ``positions``), one store batch per prompt batch.

    ``max_new_tokens`` new tokens at most per prompt: a sequence ends sooner at its EOS
    (``eos_token_id``, an int or a list, from ``generate_kwargs``, else a ``generation_config=``
    there, else the model's ``generation_config``), at the step a criterion of
    ``stopping_criteria=`` said it was done, or at the token that completes one of its
    ``stop_strings=`` (matched with ``tokenizer``); ``max_time=`` ends them all. A criterion of
    one of the classes ``generate`` makes itself from these options (``MaxLengthCriteria``,
    ``EosTokenCriteria``, ...) while that option is set is refused (``GenerateError``: it would
    replace ``generate``'s own). ``generated_only`` stores only the rows of generated tokens;
    ``last_only`` only the last token of each step
    (the token whose output chose the next one: the prompt's last, then each generated token
    but the final one). ``sampling``: ``"greedy"`` (default), ``"sample"`` (multinomial, seeded
    per batch from ``seed`` and the batch's first example, so a resumed capture samples the
    same), or ``"model"`` (the model's ``generation_config``, seeded the same way);
    ``generate_kwargs`` go to ``generate`` (``temperature=``, ``eos_token_id=``, ...).
    ``on_batch(batch, seconds)`` is called after each prompt batch, right after
    ``on_generated(new_tokens)`` (the tokens the batch generated, its EOS included).
    ``tokenizer`` decodes the completions into the stored texts. ``exclude_tokens`` (token ids,
    e.g. the special tokens) have no row, prompt or generated (a job's
    ``exclude_special_tokens``). ``steer`` steers the generation (:func:`pyhook.steering`): a
    :class:`pyhook.Steer` (or a tuple of them) for every prompt, or a list with one entry per
    prompt (a spec, a list of specs, or None), indexed by example number; the stored rows are
    the steered ones, and the store's metadata holds the specs (``meta["steering"]``, checked
    before anything is generated). ``stats`` (default: the
    recorder's) stores the statistics of the kept rows. Returns timings like
    :func:`pyhook.runner.run` (``forward`` seconds, ``wait``, ``tokens`` run through the
    model) plus ``new_tokens``.

    >>> import transformers, pyhook
    >>> gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config(
    ...     n_layer=1, n_embd=8, n_head=2, vocab_size=20, n_positions=16)).eval()
    >>> with pyhook.capture(gpt, "resid_post.0") as rec:  # in memory: one batch per prompt batch
    ...     t = run_generate(gpt, prompt_batches([[1, 2, 3]]), rec, max_new_tokens=2)
    >>> rec.row_index.tolist(), t["new_tokens"]        # 3 prompt + 2 new tokens, the last not run
    ([[0, 0], [0, 1], [0, 2], [0, 3]], 2)
    """
    import time

    if (
        not isinstance(max_new_tokens, int)
        or isinstance(max_new_tokens, bool)
        or max_new_tokens < 1
    ):
        raise GenerateError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not callable(getattr(model, "generate", None)):
        raise GenerateError(
            f"{type(model).__name__} has no generate(): capture during generation needs a model "
            "with a generation head (e.g. AutoModelForCausalLM, GPT2LMHeadModel)"
        )
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise GenerateError(
            f"{type(model).__name__} is an encoder-decoder model: capture during generation "
            "takes a decoder-only (causal) language model, e.g. AutoModelForCausalLM"
        )
    if _bidirectional(getattr(model, "config", None)):
        raise GenerateError(
            f"{type(model).__name__} is a bidirectional encoder (is_decoder=False): a forward "
            "over the final sequence would let each token see the later ones, which generate's "
            "steps do not; capture during generation takes a causal language model (or an "
            "encoder configured with is_decoder=True)"
        )
    if rec.positions is not None or not rec.flatten:
        raise GenerateError(
            "run_generate: capture with positions=None and flatten=True (keep only the last "
            "token of each step with last_only=True)"
        )
    from .runner import _Keep

    if rec.mask is not None and not isinstance(rec.mask, _Keep):
        raise GenerateError(
            "run_generate: capture without mask= (the rows of each step are chosen from the "
            "generation: prompt tokens without padding, then the running sequences)"
        )
    if not rec.copy:
        raise GenerateError("run_generate: capture with copy=True (the steps' rows are joined)")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise GenerateError(f"seed must be an int >= 0, got {seed!r}")
    if stats is None:
        stats = bool(rec._stats)
    if device is None:
        p = next(iter(model.parameters()), None)
        device = p.device if p is not None else "cpu"
    options = dict(generate_kwargs)
    _generation_config(options)
    eos = _eos_ids(model, options)
    pad = _pad_id(model, options, tokenizer, eos)
    kw = _generate_kwargs(model, sampling, options, max_new_tokens, pad)
    stops, replaced = _stops(model, options, tokenizer, eos)
    kw = _folded({**kw, **replaced})
    seeded = sampling != "greedy" or bool(
        getattr(kw.get("generation_config"), "do_sample", None) or kw.get("do_sample")
    )
    if exclude_tokens is not None:
        exclude_tokens = torch.as_tensor(exclude_tokens, dtype=torch.long).reshape(-1).cpu()
    if steer is not None:
        _check_steer(model, rec, steer)
    forward = wait = 0.0
    tokens = new_tokens = 0
    it = iter(batches)
    try:
        while True:
            t0 = time.perf_counter()
            try:
                b = next(it)
            except StopIteration:
                break
            t1 = time.perf_counter()
            wait += t1 - t0
            ids, am, keep, lengths = _left_pad(b, pad)
            prefill_keep = keep.clone()
            if last_only:
                prefill_keep[:, :-1] = False
            if generated_only:
                prefill_keep[:] = False
            if isinstance(rec.mask, _Keep):
                rec.mask.current = None
            fork = _forked_rng(device) if seeded else contextlib.nullcontext()
            on_cpu = torch.device(device).type == "cpu"
            with _Steps(rec, prefill_keep, max_new_tokens, on_cpu) as steps, fork, torch.no_grad():
                if seeded:
                    _seed(device, (seed * 1_000_003 + int(b.examples[0])) % (1 << 64))
                # the first call's rows (the prompts): their tokens, no padding
                rec.annotate(ids, prefill_keep, b.examples.to("cpu", torch.long))
                if stops is not None:
                    stops.reset()
                steered = (
                    steering(model, specs_of_batch(steer, b.examples.tolist()))
                    if steer is not None
                    else contextlib.nullcontext()
                )
                try:
                    with steered:
                        seqs = model.generate(
                            input_ids=ids.to(device), attention_mask=am.to(device), **kw
                        )
                except IndexError as e:
                    # an absolute position embedding indexed past its end (GPT-2's wpe)
                    from .runner import max_positions

                    limit = max_positions(getattr(model, "config", None))
                    if limit is None or ids.shape[1] + max_new_tokens <= limit:
                        raise
                    raise GenerateError(
                        f"prompts from example {int(b.examples[0])}: the longest prompt "
                        f"({ids.shape[1]} tokens) + max_new_tokens={max_new_tokens} exceeds the "
                        f"model's {limit} positions; shorten the prompts or ask fewer new tokens"
                    ) from e
                except TypeError as e:
                    if not options:
                        raise
                    # most likely an option of the wrong type, which generate takes unchecked
                    raise GenerateError(
                        f"model.generate failed with the generate options "
                        f"{', '.join(sorted(options))} (check their types): TypeError: {e}"
                    ) from e
                if not isinstance(seqs, torch.Tensor):  # return_dict_in_generate=True
                    seqs = seqs.sequences
                seqs = seqs.to("cpu")
                joined = _join(
                    rec,
                    b,
                    steps.held,
                    seqs,
                    ids.shape[1],
                    lengths,
                    prefill_keep,
                    eos,
                    stops,
                    generated_only=generated_only,
                    stats=stats,
                    tokenizer=tokenizer,
                    tokens=steps.tokens,
                    exclude=exclude_tokens,
                )
            # the batch's rows are counted by the writer's budget from here on
            steps.held.uncharge()
            rec._add(*joined[:3], wait=joined[3])
            dt = time.perf_counter() - t1
            forward += dt
            tokens += joined[4]
            new_tokens += joined[5]
            if on_generated is not None:
                on_generated(joined[5])
            if on_batch is not None:
                on_batch(b, dt)
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
    return {"forward": forward, "wait": wait, "tokens": tokens, "new_tokens": new_tokens}


def _check_steer(model: Any, rec: Any, steer: Any) -> None:
    """Check ``steer`` before generating (every point resolved, every vector's width), and
    write its specs into the store's metadata (``meta["steering"]``, beside what the
    recorder's meta already holds there)."""
    from ..steering import Steer

    def specs(e: Any) -> bool:
        return isinstance(e, Steer) or (
            isinstance(e, (list, tuple)) and all(isinstance(s, Steer) for s in e)
        )

    if isinstance(steer, list):
        for i, e in enumerate(steer):
            if e is not None and not specs(e):
                raise GenerateError(
                    f"steer: entry {i} (prompt {i}) must be a pyhook.Steer, a list of them or "
                    f"None, got {e!r}"
                )
        every = [s for e in steer if e is not None for s in ([e] if isinstance(e, Steer) else e)]
        # each distinct list of specs once ("entries"), and per prompt the index of its own
        # ("entry"): a few bytes a prompt, however many prompts share an entry
        described: dict[int, int] = {}
        where: dict[str, int] = {}
        entries: list[list[dict[str, Any]]] = []
        entry: list[int] = []
        for e in steer:
            if id(e) not in described:
                d = describe(e)
                key = json.dumps(d, sort_keys=True)
                if key not in where:
                    where[key] = len(entries)
                    entries.append(d)
                described[id(e)] = where[key]
            entry.append(described[id(e)])
        note: dict[str, Any] = {"examples": "each", "entries": entries, "entry": entry}
    elif isinstance(steer, Steer) or (isinstance(steer, tuple) and specs(steer)):
        every = [steer] if isinstance(steer, Steer) else list(steer)
        note = {"examples": "all", "specs": describe(every)}
    else:
        raise GenerateError(
            "steer must be a pyhook.Steer, a tuple of them (every prompt) or a list with one "
            f"entry per prompt, got {type(steer).__name__}"
        )
    distinct = tuple({id(s): s for s in every}.values())
    with steering(model, distinct):  # resolves and checks every spec, before generating
        pass
    # what the caller recorded beside the specs (a job: each prompt's set name) is kept
    prior = rec.meta.get("steering")
    note = {**(prior if isinstance(prior, dict) else {}), **note}
    rec.meta = {**rec.meta, "steering": note}
    writer = getattr(rec, "_writer", None)
    if writer is not None and isinstance(getattr(writer, "meta", None), dict):
        writer.meta = {**writer.meta, "steering": note}


def _join(
    rec: Any,
    b: Any,
    held: _Held,
    seqs: torch.Tensor,
    width: int,
    lengths: torch.Tensor,
    prefill_keep: torch.Tensor,
    eos: list[int],
    stops: _Stops | None,
    *,
    generated_only: bool,
    stats: bool,
    tokenizer: Any,
    tokens: bool,
    exclude: torch.Tensor | None = None,
) -> tuple[dict[str, Any], int, dict[str, torch.Tensor], Any, int, int]:
    """The held rows of one prompt batch as one store batch: ``(rows, examples, extra,
    wait, tokens run, new tokens)``; rows ordered by (example, position), past-the-end rows
    dropped, token ids, row index, generated flags and texts from the final sequences."""
    n_seq = seqs.shape[0]
    steps = seqs.shape[1] - width  # new tokens = calls of the model
    if steps < 1 or held.steps != steps:
        raise RuntimeError(
            f"generate ran the model {held.steps} time(s) for {steps} new token(s) a sequence; "
            "pyhook captures generate with its KV cache, one call per new token (no beam "
            "search, assisted or speculative decoding)"
        )
    # Each sequence's end: its first EOS among the new tokens (included), or the first step a
    # stopping criterion or stop string said it was done, else all of them. (A finished
    # sequence is padded, or without EOS runs on: nothing of it after its end is kept.)
    gen = seqs[:, width:]
    ends = torch.full((n_seq,), steps, dtype=torch.long)
    if eos:
        hit = torch.isin(gen, torch.tensor(eos, dtype=gen.dtype))
        first = torch.where(hit.any(1), hit.int().argmax(1) + 1, steps)
        ends = first.to(torch.long)
    if stops is not None:
        ends = torch.minimum(ends, stops.ends(width, steps, n_seq))
    last_col = width + ends - 1  # the padded column of each sequence's final token
    # Where each held row comes from: (sequence, padded column), in the steps' row order.
    r0, c0 = prefill_keep.nonzero(as_tuple=True)
    slots = [r0] + [torch.arange(n_seq)] * (steps - 1)
    cols = [c0] + [torch.full((n_seq,), width + s - 1, dtype=torch.long) for s in range(1, steps)]
    slot = torch.cat(slots)
    col = torch.cat(cols)
    valid = col < last_col[slot]  # the final token is never run; nothing after it is kept
    if generated_only:
        valid &= col >= width
    if exclude is not None and exclude.numel():  # e.g. special tokens, generated ones too
        valid &= ~torch.isin(seqs[slot, col], exclude)
    key = slot * (width + steps + 1) + col
    sel = valid.nonzero(as_tuple=True)[0]
    perm = sel[torch.argsort(key[sel])]
    n_rows = int(perm.numel())

    examples_of = b.examples.to("cpu", torch.long).reshape(-1)
    extra: dict[str, torch.Tensor] = {}
    if tokens:
        extra["__token_ids__"] = seqs[slot[perm], col[perm]].contiguous()
        # each kept row's absolute position in its unpadded sequence, as every step saw it
        # (pyhook.positions: the final sequences' mask, left padding then the new tokens)
        mask = torch.arange(width + steps) >= (width - lengths)[:, None]
        where = absolute_positions(mask)
        extra["__row_index__"] = torch.stack(
            [examples_of[slot[perm]], where[slot[perm], col[perm]]], dim=1
        ).contiguous()
    extra[GENERATED] = (col[perm] >= width).contiguous()
    texts = _texts(b, seqs, width, lengths, ends, tokenizer)
    if texts is not None:
        full, prompt_bytes = texts
        enc = [s.encode("utf-8") for s in full]
        extra["__text_lengths__"] = torch.tensor([len(e) for e in enc], dtype=torch.long)
        extra["__text_examples__"] = examples_of.clone()
        blob = b"".join(enc)
        extra["__text_bytes__"] = (
            torch.frombuffer(bytearray(blob), dtype=torch.uint8)
            if blob
            else torch.empty(0, dtype=torch.uint8)
        )
        extra[TEXT_PROMPT_BYTES] = torch.tensor(prompt_bytes, dtype=torch.long)

    # The rows: the held buffers, each sequence's slot moved up behind the one before it
    # (slots hold max_new_tokens - 1 generated rows; a sequence that ended sooner leaves a
    # gap). On the writer thread for a disk capture.
    held.place()
    assert held.out is not None
    # each kept row's place in the buffers (as _Held.place put it), in the stored order; runs
    # of consecutive places are moved together to the front
    placed = torch.cat(
        [held.prefill_dest.to("cpu")] + [held.base + held.pk + (s - 1) for s in range(1, steps)]
    )[perm]
    run_start = torch.ones(n_rows, dtype=torch.bool)
    run_start[1:] = placed[1:] != placed[:-1] + 1
    starts = run_start.nonzero(as_tuple=True)[0]
    lens = torch.diff(starts, append=torch.tensor([n_rows]))
    moves = [
        (int(placed[d]), int(d), int(k))
        for d, k in zip(starts.tolist(), lens.tolist())
        if int(placed[d]) != d
    ]
    bufs = held.out
    out = {name: buf[:n_rows] for name, buf in bufs.items()}
    fill_stats: Callable[[], None] | None = None
    with_stats = [n for n, t in out.items() if not t.is_complex()] if stats else []
    if with_stats and rec.to == "disk":  # disk rows are host rows: the writer thread does them
        later, fill_stats = stats_later({n: out[n] for n in with_stats})
        for name, s in later.items():
            extra[f"__stats__.{name}"] = s

    def fill() -> None:
        with torch.no_grad():
            for src, dst, k in moves:  # dst < src: each move reads rows not yet overwritten
                for buf in bufs.values():
                    part = buf[src : src + k]
                    buf[dst : dst + k].copy_(part if src - dst >= k else part.clone())
        if fill_stats is not None:
            fill_stats()

    run = int(lengths.sum()) + n_seq * (steps - 1)  # every prompt token, kept or not
    if rec.to == "disk":
        return out, n_seq, extra, fill, run, int(ends.sum())
    fill()
    for name in with_stats:
        extra[f"__stats__.{name}"] = batch_stats(out[name])
    return out, n_seq, extra, None, run, int(ends.sum())


def _shape_of(p: Any) -> tuple[tuple[int, ...], torch.dtype, torch.device]:
    if isinstance(p, torch.Tensor):
        return tuple(p.shape[1:]), p.dtype, p.device
    host = p._host[0]  # a pending copy: its destination exists already
    return tuple(host.shape[1:]), host.dtype, host.device


def _texts(
    b: Any,
    seqs: torch.Tensor,
    width: int,
    lengths: torch.Tensor,
    ends: torch.Tensor,
    tokenizer: Any,
) -> tuple[list[str], list[int]] | None:
    """Each example's prompt + completion text and the prompt's utf-8 byte count, or None
    without a tokenizer to decode the completions."""
    if tokenizer is None:
        return None
    full, prompt_bytes = [], []
    for row in range(seqs.shape[0]):
        prompt_ids = seqs[row, width - int(lengths[row]) : width].tolist()
        new_ids = seqs[row, width : width + int(ends[row])].tolist()
        decoded = tokenizer.decode(prompt_ids, skip_special_tokens=False)
        both = tokenizer.decode(prompt_ids + new_ids, skip_special_tokens=False)
        # the completion as the tokenizer writes it after this prompt (a space between them,
        # a sentencepiece word start), else decoded alone
        if both.startswith(decoded):
            completion = both[len(decoded) :]
        else:
            completion = tokenizer.decode(new_ids, skip_special_tokens=False)
        if b.texts is None:
            prompt = decoded
        elif getattr(b, "truncated", 0):  # some prompt of the batch was cut to max_length
            prompt = _run_part(b.texts[row], int(lengths[row]), tokenizer, decoded)
        else:
            prompt = b.texts[row]
        full.append(prompt + completion)
        prompt_bytes.append(len(prompt.encode("utf-8")))
    return full, prompt_bytes


def _run_part(text: str, n_tokens: int, tokenizer: Any, decoded: str) -> str:
    """The part of a prompt ``text`` that its ``n_tokens`` run tokens are: the text itself,
    or for a prompt truncated to fewer tokens (``max_length``) the text up to the end of its
    last token kept (``decoded``, those tokens decoded, without offsets to cut it at)."""
    try:
        enc = tokenizer(text, return_offsets_mapping=True, verbose=False)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
    except Exception:  # a tokenizer without offsets (a slow one)
        try:
            ids, offsets = tokenizer(text, verbose=False)["input_ids"], None
        except Exception:
            return text
    if len(ids) <= n_tokens:
        return text
    if offsets is None:
        return decoded
    return text[: max((int(end) for _, end in offsets[:n_tokens]), default=0)]


generated = annotations.generated  # documented in pyhook.annotations
