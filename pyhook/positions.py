"""Where am I: for the forward being run, which batch row and which absolute position of its
unpadded sequence each column is, and which positions are the prompt.

One piece for every intervention during ``generate`` (steering, splicing) and for capture: a
forward of a batched ``generate`` is the prefill (the left-padded prompts) or one decode step
(one token a row with the KV cache, the whole sequence without it). Its columns' positions
follow from what the model is called with: the attention mask (``[batch, past + tokens]`` in
``generate``, 0 on padding), else the cache's length, else none (a plain forward from 0).

* :func:`absolute_positions` -- ``[batch, tokens]`` positions of the last ``tokens`` columns
  of an attention mask (padding: -1); no host synchronisation.
* :class:`Where` -- one forward's answer: ``positions``, ``real``, each row's
  ``prompt_lengths``, the generation's ``step``.
* :class:`PositionTracker` -- a pre-hook on the top model that keeps :attr:`PositionTracker.where`
  for every forward, inside pyhook's own ``generate`` loop or the user's ``model.generate(...)``
  / ``model(...)``, and knows where each generation starts (a forward without a past, unless it
  continues the previous forward without a cache: the same rows, its tokens followed by more).

>>> import torch, transformers
>>> from pyhook._hooks import HookSet
>>> gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config(
...     n_layer=1, n_embd=8, n_head=2, vocab_size=20, n_positions=16)).eval()
>>> hooks = HookSet(model=gpt)
>>> track = PositionTracker(gpt, hooks)
>>> seen = []
>>> track.listeners.append(lambda w: seen.append((w.step, w.positions.tolist())))
>>> ids = torch.tensor([[0, 0, 5, 6], [1, 2, 3, 4]])
>>> am = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
>>> _ = gpt.generate(ids, attention_mask=am, max_new_tokens=2, do_sample=False, pad_token_id=0)
>>> hooks.remove()
>>> seen   # the prefill (padding: -1), then one column a row at its own next position
[(0, [[-1, -1, 0, 1], [0, 1, 2, 3]]), (1, [[2], [4]])]
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["PositionTracker", "Where", "absolute_positions"]


def absolute_positions(attention_mask: torch.Tensor, tokens: int | None = None) -> torch.Tensor:
    """The absolute position, in its row's unpadded sequence, of each of the last ``tokens``
    columns (all of them by default) of ``attention_mask`` (``[batch, columns]``, 0 or False on
    padding): ``[batch, tokens]`` int64, -1 on padding. Computed on the mask's device.

    >>> absolute_positions(torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]), 2).tolist()
    [[1, 2], [3, 4]]
    """
    am = attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0
    pos = torch.cumsum(am, dim=-1, dtype=torch.long) - 1
    if tokens is not None and tokens != am.shape[-1]:
        pos, am = pos[..., am.shape[-1] - tokens :], am[..., am.shape[-1] - tokens :]
    return pos.masked_fill_(~am, -1)


class Where:
    """Where the columns of one forward are.

    ``positions``: ``[batch, tokens]`` int64, each column's absolute position in its row's
    unpadded sequence (-1 on padding). ``real``: ``[batch, tokens]`` bool, not padding.
    ``prompt_lengths``: ``[batch]`` int64, the real prompt tokens of each row's generation (a
    position ``p`` holds a generated token iff ``p >= prompt_lengths[row]``; generated token
    ``g`` sits at ``prompt_lengths[row] + g``). ``step``: 0 for the forward that starts a
    generation (the prompt), then 1, 2, ... ``past``: the columns before this forward's (the
    KV cache's length). All tensors are on the device of the model's inputs.

    >>> w = Where(torch.tensor([[-1, 0, 1]]), torch.tensor([[False, True, True]]),
    ...           torch.tensor([2]), step=0, past=0)
    >>> w.is_prompt.tolist(), w.generated_index.tolist()
    ([[False, True, True]], [[-3, -2, -1]])
    """

    __slots__ = ("_gen", "_prompt", "batch", "past", "positions", "prompt_lengths", "real", "step")

    def __init__(
        self,
        positions: torch.Tensor,
        real: torch.Tensor,
        prompt_lengths: torch.Tensor,
        *,
        step: int,
        past: int,
    ) -> None:
        self.positions = positions
        self.real = real
        self.prompt_lengths = prompt_lengths
        self.step = step
        self.past = past
        self.batch = int(positions.shape[0])
        self._prompt: torch.Tensor | None = None
        self._gen: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return int(self.positions.shape[1])

    @property
    def is_prompt(self) -> torch.Tensor:
        """``[batch, tokens]`` bool: the column holds a real prompt token."""
        if self._prompt is None:
            self._prompt = self.real & (self.positions < self.prompt_lengths[:, None])
        return self._prompt

    @property
    def generated_index(self) -> torch.Tensor:
        """``[batch, tokens]`` int64: which generated token each column holds (0: the first;
        negative on prompt tokens and padding)."""
        if self._gen is None:
            self._gen = self.positions - self.prompt_lengths[:, None]
        return self._gen


_CACHE_KEYS = ("past_key_values", "cache")
_INPUT_KEYS = ("input_ids", "inputs_embeds")


def _past_length(kwargs: dict[str, Any]) -> int:
    """Columns already in the KV cache the model is called with (0: none)."""
    for key in _CACHE_KEYS:
        cache = kwargs.get(key)
        if cache is None:
            continue
        get = getattr(cache, "get_seq_length", None)
        if callable(get):
            return int(get())
        if isinstance(cache, (tuple, list)) and cache and isinstance(cache[0], (tuple, list)):
            return int(cache[0][0].shape[-2])  # the legacy format: ((key, value), ...)
    pos = kwargs.get("cache_position")
    if isinstance(pos, torch.Tensor) and pos.numel():
        return int(pos.reshape(-1)[0])  # a host synchronisation: the last resort
    return 0


class PositionTracker:
    """Keeps :attr:`where` (a :class:`Where`) for every forward of ``model``, from a forward
    pre-hook registered through ``hooks`` (a :class:`~pyhook._hooks.HookSet`: removed with
    it). ``listeners`` are called with each forward's :class:`Where` before the model runs
    (a listener may raise to refuse the forward).

    A generation starts at a forward without a past (no KV cache, or an empty one), unless
    that forward continues the previous one without a cache (the same rows, the previous
    forward's tokens followed by new ones: ``generate(use_cache=False)``); its prompt is the
    real tokens of that first forward.
    """

    def __init__(self, model: nn.Module, hooks: Any) -> None:
        self.model = model
        self.where: Where | None = None
        self.listeners: list[Callable[[Where], None]] = []
        self._prompt: torch.Tensor | None = None
        self._step = 0
        self._last_ids: torch.Tensor | None = None  # a forward without a past: its tokens
        self._sig: inspect.Signature | None = None
        hooks.forward_pre(model, self._begin, with_kwargs=True, prepend=True)

    def _inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        if not args:
            return kwargs
        if self._sig is None:
            self._sig = inspect.signature(self.model.forward)
        try:
            return {**self._sig.bind_partial(*args, **kwargs).arguments, **kwargs}
        except TypeError:
            return {"input_ids": args[0], **kwargs}

    def _begin(self, _m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        kw = self._inputs(args, kwargs)
        first = next((kw[k] for k in _INPUT_KEYS if isinstance(kw.get(k), torch.Tensor)), None)
        if first is None:
            first = next((v for v in kw.values() if isinstance(v, torch.Tensor)), None)
        if first is None or first.dim() < 2:
            self.where = None
            return
        batch, tokens = int(first.shape[0]), int(first.shape[1])
        am = kw.get("attention_mask")
        if isinstance(am, torch.Tensor) and am.dim() == 2 and am.shape[1] >= tokens:
            past = int(am.shape[1]) - tokens
            am = am.to(first.device) if am.device != first.device else am
            positions = absolute_positions(am, tokens)
            real = positions >= 0
        else:
            past = _past_length(kw)
            am = None
            positions = torch.arange(past, past + tokens, device=first.device).expand(batch, -1)
            real = torch.ones(batch, tokens, dtype=torch.bool, device=first.device)
        ids = kw.get("input_ids")
        ids = ids if isinstance(ids, torch.Tensor) else None
        if past == 0 and not self._continues(ids, batch, tokens):
            self._step = 0
            self._prompt = real.sum(1) if am is None else (am[:, -tokens:] != 0).sum(1)
        else:
            self._step += 1
            if self._prompt is None or int(self._prompt.shape[0]) != batch:
                # a cached forward whose generation began outside: its past is all prompt
                self._prompt = (
                    (am[:, :past] != 0).sum(1)
                    if am is not None
                    else torch.full((batch,), past, device=first.device)
                )
        self._last_ids = ids if past == 0 else None
        self.where = w = Where(positions, real, self._prompt, step=self._step, past=past)
        for fn in self.listeners:
            fn(w)

    def _continues(self, ids: torch.Tensor | None, batch: int, tokens: int) -> bool:
        """Whether a forward without a past continues the previous one (no cache): the same
        rows, the previous tokens followed by more (one host synchronisation)."""
        last = self._last_ids
        if ids is None or last is None or int(last.shape[0]) != batch:
            return False
        n = int(last.shape[1])
        if tokens <= n:
            return False
        return bool(torch.equal(ids[:, :n], last.to(ids.device)))
