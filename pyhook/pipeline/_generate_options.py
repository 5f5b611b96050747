"""The ``generate`` options a capture job may pass (``generate_kwargs``): plain data only.

A job (a JSON/YAML file, ``--generate-kwargs``, or a :class:`~pyhook.pipeline.job.CaptureJob`)
is data that may come from someone else, and ``model.generate`` takes options that load and run
code or other models (``custom_generate`` with ``trust_remote_code`` imports a ``generate.py``;
``assistant_model``, ``streamer``, ``prefix_allowed_tokens_fn``, ``logits_processor``, ... are
objects and functions; ``dola_layers``, ``penalty_alpha``, ``num_beam_groups``, ``constraints``
run decoding modes transformers loads from a Hub repository). So a job passes only the options
listed in :data:`GENERATE_OPTIONS`, each checked by type here (no torch, no transformers), and
refuses every other key by name. From Python, :func:`pyhook.pipeline.generate.run_generate`
takes any ``generate`` option: there the caller's own code is the trusted party.

``_REFUSED`` (options that would break the one-row-per-token bookkeeping, with the reason) is
shared with :mod:`pyhook.pipeline.generate`, which refuses them in every capture.

>>> check_generate_options({"temperature": 0.7, "stop_strings": ["\\n\\n"]})
>>> check_generate_options({"custom_generate": "./gen", "trust_remote_code": True})
Traceback (most recent call last):
...
ValueError: `generate_kwargs`: 'custom_generate' is refused: it runs a generate function from a file or repository (code); a job is data and passes only the plain options listed in docs/job.md
"""

from __future__ import annotations

import difflib
import itertools
import math
from collections.abc import Callable
from typing import Any

#: The fields of a steering spec given as data (a job file's `steer`, the command's --steer):
#: pyhook.Steer's arguments. Torch-free, so the job checks a spec before torch is imported.
STEER_FIELDS = frozenset({"point", "vector", "scale", "op", "prompt", "generated", "when"})

# generate options that would break the one-row-per-token bookkeeping
_REFUSED = {
    "input_ids": "the prompts come from the batches",
    "attention_mask": "it is made from the prompts",
    "max_new_tokens": "pass max_new_tokens (--generate N)",
    "max_length": "pass max_new_tokens (--generate N)",
    "num_return_sequences": "one completion per prompt is captured",
    "num_beams": "beam search reorders the sequences between steps",
    "assistant_model": "assisted decoding runs tokens through another model",
    "prompt_lookup_num_tokens": "speculative decoding runs several tokens per step",
    "assistant_early_exit": "self-speculative decoding runs several tokens per step",
    "prefill_chunk_size": "chunked prefill runs each prompt in several calls of the model",
}

# options (of model.generate or GenerationConfig) that load or run code, another model, or take
# objects and functions: named in the refusal, with what they would do
LOADS_CODE = {
    "custom_generate": "it runs a generate function from a file or repository (code)",
    "trust_remote_code": "it lets transformers run code from a repository",
    "assistant_model": "it runs another model",
    "assistant_tokenizer": "it loads another model's tokenizer",
    "tokenizer": "pyhook passes the job's own tokenizer",
    "streamer": "it takes an object that is called at each step",
    "prefix_allowed_tokens_fn": "it takes a function",
    "logits_processor": "it takes functions",
    "stopping_criteria": "it takes functions (stop with `eos_token_id`, `stop_strings` or "
    "`max_time`)",
    "synced_gpus": "it is set by the distributed setup, not by a job",
    "dola_layers": "DoLa decoding is loaded from a Hub repository (code)",
    "penalty_alpha": "contrastive search is loaded from a Hub repository (code)",
    "num_beam_groups": "group beam search is loaded from a Hub repository (code)",
    "constraints": "constrained beam search is loaded from a Hub repository (code)",
    "force_words_ids": "constrained beam search is loaded from a Hub repository (code)",
    "watermarking_config": "it makes a watermarking processor from a configuration object",
    "compile_config": "it compiles the model's forward",
    "cache_implementation": "it replaces the model's KV cache (a paged one ends in another "
    "generation loop)",
    "cache_config": "it configures a replaced KV cache",
    "negative_prompt_ids": "it takes a tensor",
    "negative_prompt_attention_mask": "it takes a tensor",
}

_TOKEN_LIMIT = 1 << 62  # a token id beyond any vocabulary (the plan checks the model's)


def _int(v: Any, low: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and low <= v < _TOKEN_LIMIT


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _positive(v: Any) -> bool:
    return _number(v) and v > 0


def _token(v: Any) -> bool:
    return _int(v)


def _tokens(v: Any) -> bool:
    return isinstance(v, list) and all(_token(x) for x in v)


def _token_or_tokens(v: Any) -> bool:
    return _token(v) or (_tokens(v) and len(v) > 0)


def _token_lists(v: Any) -> bool:
    return isinstance(v, list) and all(_tokens(x) and len(x) > 0 for x in v)


#: The most characters ``stop_strings`` may hold in all: transformers prepares each stop string
#: against every token of the vocabulary, a cost that grows with vocabulary x length (6,000
#: characters added 32 s to a job); stop strings are words or end markers.
MAX_STOP_CHARACTERS = 256


def _strings(v: Any) -> bool:
    texts = [v] if isinstance(v, str) else v if isinstance(v, list) else None
    return (
        texts is not None
        and 0 < len(texts) <= MAX_STOP_CHARACTERS
        and all(isinstance(x, str) and x for x in texts)
        and sum(len(x) for x in texts) <= MAX_STOP_CHARACTERS
    )


def _decay(v: Any) -> bool:
    return isinstance(v, list) and len(v) == 2 and _int(v[0]) and _number(v[1])


def _bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_none(v: Any) -> bool:
    return v is None


#: The ``generate`` options a job may pass, each with the check of its value and how the check
#: is worded (null is accepted for each: generate's default, or for ``eos_token_id`` no end). ``num_beams``, ``num_return_sequences`` (1), ``use_cache`` (true) and
#: ``prefill_chunk_size`` (null) are accepted at the one value a capture can run;
#: ``generation_config`` is a mapping of these same options.
GENERATE_OPTIONS: dict[str, tuple[Callable[[Any], bool], str]] = {
    # how the next token is chosen
    "do_sample": (_bool, "true or false"),
    "temperature": (_positive, "a number > 0"),
    "top_k": (_int, "an integer >= 0"),
    "top_p": (_positive, "a number > 0"),
    "min_p": (_number, "a number"),
    "typical_p": (_positive, "a number > 0"),
    "epsilon_cutoff": (_number, "a number"),
    "eta_cutoff": (_number, "a number"),
    "repetition_penalty": (_positive, "a number > 0"),
    "no_repeat_ngram_size": (_int, "an integer >= 0"),
    "bad_words_ids": (_token_lists, "a list of lists of token ids"),
    "suppress_tokens": (_tokens, "a list of token ids"),
    "begin_suppress_tokens": (_tokens, "a list of token ids"),
    "forced_bos_token_id": (_token, "a token id (an integer >= 0)"),
    "forced_eos_token_id": (_token_or_tokens, "a token id or a list of them"),
    "exponential_decay_length_penalty": (_decay, "[start index, decay factor]"),
    "renormalize_logits": (_bool, "true or false"),
    "remove_invalid_values": (_bool, "true or false"),
    "min_new_tokens": (_int, "an integer >= 0"),
    "min_length": (_int, "an integer >= 0"),
    # where a sequence ends, and its special tokens
    "eos_token_id": (_token_or_tokens, "a token id or a list of them"),
    "pad_token_id": (_token, "a token id (an integer >= 0)"),
    "bos_token_id": (_token, "a token id (an integer >= 0)"),
    "stop_strings": (
        _strings,
        f"a string or a list of strings, at most {MAX_STOP_CHARACTERS} characters in all",
    ),
    "max_time": (_positive, "seconds, a number > 0"),
    # accepted at the value a capture runs (any other is refused with the reason)
    "num_beams": (_int, "1"),
    "num_return_sequences": (_int, "1"),
    "use_cache": (_bool, "true"),
    "prefill_chunk_size": (_is_none, "null"),
}


def _refusal(key: str, where: str) -> str:
    if key in LOADS_CODE:
        return (
            f"`generate_kwargs`: {where}{key!r} is refused: {LOADS_CODE[key]}; a job is data and "
            "passes only the plain options listed in docs/job.md"
        )
    if key in _REFUSED:
        return f"`generate_kwargs`: {where}{key!r} cannot be captured: {_REFUSED[key]}"
    close = difflib.get_close_matches(key, list(GENERATE_OPTIONS), n=1, cutoff=0.75)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (
        f"`generate_kwargs`: {where}{key!r} is not a generate option a job passes{hint}; it "
        f"passes: {', '.join(GENERATE_OPTIONS)}, generation_config (a mapping of them)"
    )


def _got(v: Any) -> str:
    """A value as an error shows it: its repr when short, else its type (also job.py's).

    The value is measured before it is written out: a job file's value may be huge (a YAML
    file of aliases nested ten deep is 9**10 leaves in 1 KB), and no message may grow with it.

    >>> _got([1, 2]), _got("x" * 10**7), _got([[1] * 9] * 9)
    ('[1, 2]', 'a str', 'a list')
    """
    if not _short(v):
        return f"a {type(v).__name__}"
    try:
        text = repr(v)
    except (RecursionError, ValueError):  # (a subclass's repr)
        return f"a {type(v).__name__}"
    return text if len(text) <= 60 else f"a {type(v).__name__}"


def _short(v: Any, budget: int = 16) -> bool:
    """Whether ``v`` has at most ``budget`` parts (containers, items, tens of characters): it
    can be written out in a short line; decided without walking further."""
    todo = [v]
    while todo:
        x = todo.pop()
        budget -= 1
        if isinstance(x, (str, bytes)):
            budget -= len(x) // 10 if len(x) < 1000 else budget + 1
        elif isinstance(x, int) and not isinstance(x, bool):
            budget -= 0 if x.bit_length() < 200 else budget + 1
        elif isinstance(x, (list, tuple, set, frozenset)):
            todo.extend(itertools.islice(x, budget + 1))
        elif isinstance(x, dict):
            todo.extend(item for kv in itertools.islice(x.items(), budget + 1) for item in kv)
        if budget < 0:
            return False
    return True


def check_generate_options(options: Any, where: str = "") -> None:
    """Raise ``ValueError`` (one line, the key and what was expected) unless ``options`` is a
    mapping of the plain-data options of :data:`GENERATE_OPTIONS` (and ``generation_config``, a
    mapping of them), each of the right type; ``TypeError`` when ``options`` is no mapping."""
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise TypeError(
            f"`generate_kwargs` {where}must be a mapping of generate options, got {_got(options)}"
        )
    for key, v in options.items():
        if key == "generation_config" and not where:
            if v is not None:
                if not isinstance(v, dict):
                    raise TypeError(
                        "`generate_kwargs`: 'generation_config' must be a mapping of generate "
                        f"options, got {_got(v)}"
                    )
                check_generate_options(v, "generation_config ")
            continue
        if key not in GENERATE_OPTIONS:
            raise ValueError(_refusal(key, where))
        ok, expected = GENERATE_OPTIONS[key]
        if v is None:  # unset: generate's default (eos_token_id null: no end token)
            continue
        if not ok(v):
            raise ValueError(f"`generate_kwargs`: {where}{key!r} must be {expected}, got {_got(v)}")
        if key in _REFUSED and not (
            (key in ("num_beams", "num_return_sequences") and v == 1)
            or (key == "prefill_chunk_size" and v is None)
        ):
            raise ValueError(_refusal(key, where))
        if key == "use_cache" and v is False:
            raise ValueError(
                f"`generate_kwargs`: {where}'use_cache' false: capture runs generate with its KV "
                "cache (one token per sequence per step)"
            )


def token_ids(options: dict[str, Any]) -> list[tuple[str, int]]:
    """Every (option, token id) that ``options`` (checked) names, ``generation_config``'s too:
    the plan checks them against the model's vocabulary before the weights load.

    >>> token_ids({"eos_token_id": [5, 6], "generation_config": {"bad_words_ids": [[7]]}})
    [('eos_token_id', 5), ('eos_token_id', 6), ('bad_words_ids', 7)]
    """
    out: list[tuple[str, int]] = []
    for key, v in options.items():
        if key == "generation_config" and isinstance(v, dict):
            out += token_ids(v)
        elif key in (
            "bad_words_ids",
            "suppress_tokens",
            "begin_suppress_tokens",
            "forced_bos_token_id",
            "forced_eos_token_id",
            "eos_token_id",
            "pad_token_id",
            "bos_token_id",
        ):
            flat = v if isinstance(v, list) else [v]
            for x in flat:
                out += [(key, y) for y in (x if isinstance(x, list) else [x]) if y is not None]
    return out
