"""pyhook.splice during ``generate``: a left-padded batch of prompts of different lengths with
the KV cache on gives, row by row, the logits and tokens of that row alone recomputed without
a cache under plain torch hooks doing the same splice (float64 models, randomised norms)."""

from __future__ import annotations

import pytest
import torch
from test_splice import _dicts, _model, _Plain, _scale_feature

import pyhook
from pyhook.dictionaries import as_dictionary

T = pytest.importorskip("transformers")

PAD = 0
PROMPTS = [[5, 9, 3], [7, 2, 11, 4, 8], [13, 6, 1, 12, 10, 3]]
STEPS = 4


def _left_padded():
    width = max(len(p) for p in PROMPTS)
    ids = torch.full((len(PROMPTS), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(PROMPTS):
        ids[r, width - len(p) :] = torch.tensor(p)
        mask[r, width - len(p) :] = 1
    return ids, mask


def _by_hand(model, fn):
    """Each row alone, no cache, greedy: the logits of every generated step and the tokens."""
    rows = []
    for p in PROMPTS:
        seq = torch.tensor([p])
        logits = []
        with torch.no_grad(), _Plain(model, fn):
            for _ in range(STEPS):
                last = model(seq, use_cache=False).logits[:, -1]
                logits.append(last[0])
                seq = torch.cat([seq, last.argmax(-1, keepdim=True)], 1)
        rows.append((torch.stack(logits), seq[0, len(p) :]))
    return rows


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("mode", ["replace", "edit"])
def test_spliced_generate_equals_each_row_alone_without_cache(family, mode):
    model = _model(family)
    model.generation_config.pad_token_id = PAD
    dicts = _dicts()
    adapted = {k: as_dictionary(d) for k, d in dicts.items()}
    if mode == "replace":
        kwargs = {"error": False}

        def fn(k, x, y):
            return adapted[k].decode(adapted[k].encode(x))
    else:
        kwargs = {"edit": {k: _scale_feature for k in dicts}}

        def fn(k, x, y):
            f = adapted[k].encode(x)
            return y + (adapted[k].decode(_scale_feature(f)) - adapted[k].decode(f))

    ids, mask = _left_padded()
    with torch.no_grad(), pyhook.splice(model, dicts, **kwargs):
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=STEPS,
            min_new_tokens=STEPS,
            do_sample=False,
            use_cache=True,
            output_logits=True,
            return_dict_in_generate=True,
        )
    with torch.no_grad():
        plain = model.generate(
            ids, attention_mask=mask, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False
        )
    new_tokens = out.sequences[:, ids.shape[1] :]
    assert not torch.equal(new_tokens, plain[:, ids.shape[1] :]) or mode == "edit"
    for r, (logits, tokens) in enumerate(_by_hand(model, fn)):
        got = torch.stack([step[r] for step in out.logits])  # generate hands float32 logits
        torch.testing.assert_close(got, logits.to(got.dtype), rtol=1e-6, atol=1e-6)
        assert torch.equal(new_tokens[r], tokens)


def _by_hand_at(model, make_fn):
    """As _by_hand, with ``make_fn(prompt_length)`` giving each row's hook function."""
    rows = []
    for p in PROMPTS:
        seq = torch.tensor([p])
        logits = []
        with torch.no_grad(), _Plain(model, make_fn(len(p))):
            for _ in range(STEPS):
                last = model(seq, use_cache=False).logits[:, -1]
                logits.append(last[0])
                seq = torch.cat([seq, last.argmax(-1, keepdim=True)], 1)
        rows.append((torch.stack(logits), seq[0, len(p) :]))
    return rows


@pytest.mark.parametrize(
    "family, prompt, generated, chosen",
    [
        ("llama", None, (1, 3), lambda col, n: (col - n >= 1) & (col - n < 3)),
        ("gpt2", None, (1, 3), lambda col, n: (col - n >= 1) & (col - n < 3)),
        ("llama", [-1], None, lambda col, n: col == n - 1),
        ("llama", [0, -2], (0, 1), lambda col, n: (col == 0) | (col == n - 2) | (col == n)),
    ],
)
def test_spliced_generate_at_chosen_positions(family, prompt, generated, chosen):
    model = _model(family)
    model.generation_config.pad_token_id = PAD
    dicts = _dicts()
    adapted = {k: as_dictionary(d) for k, d in dicts.items()}

    def make_fn(n):
        def fn(k, x, y):
            new = adapted[k].decode(adapted[k].encode(x))
            m = chosen(torch.arange(y.shape[1]), n)[None, :, None]
            return torch.where(m, new, y)

        return fn

    ids, mask = _left_padded()
    with (
        torch.no_grad(),
        pyhook.splice(model, dicts, error=False, prompt=prompt, generated=generated),
    ):
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=STEPS,
            min_new_tokens=STEPS,
            do_sample=False,
            use_cache=True,
            output_logits=True,
            return_dict_in_generate=True,
        )
    new_tokens = out.sequences[:, ids.shape[1] :]
    with torch.no_grad():
        plain = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=STEPS,
            min_new_tokens=STEPS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    assert not torch.allclose(torch.stack(out.logits), torch.stack(plain.logits))
    for r, (logits, tokens) in enumerate(_by_hand_at(model, make_fn)):
        got = torch.stack([step[r] for step in out.logits])
        torch.testing.assert_close(got, logits.to(got.dtype), rtol=1e-6, atol=1e-6)
        assert torch.equal(new_tokens[r], tokens)


def test_bad_position_choices_are_refused():
    model = _model("gpt2")
    sae = _dicts()["resid_post.0"]
    with pytest.raises(pyhook.DictionaryError, match="prompt must be"):
        pyhook.splice(model, {"resid_post.0": sae}, prompt="last")
    with pytest.raises(pyhook.DictionaryError, match="generated must be"):
        pyhook.splice(model, {"resid_post.0": sae}, generated=3)
    with pytest.raises(pyhook.DictionaryError, match="0 <= start <= stop"):
        pyhook.splice(model, {"resid_post.0": sae}, generated=(3, 1))


def _edit_generated_0_1(adapted):
    """The by-hand reference's edit of generated tokens 0 and 1 (prompt length ``n``): each
    site moved by the decoded change of ``_scale_feature`` there, the error term kept."""

    def make_fn(n):
        def fn(k, x, y):
            f = adapted[k].encode(x)
            moved = y + (adapted[k].decode(_scale_feature(f)) - adapted[k].decode(f))
            col = torch.arange(y.shape[1])
            return torch.where(((col - n >= 0) & (col - n < 2))[None, :, None], moved, y)

        return fn

    return make_fn


def test_spliced_generate_edit_at_chosen_positions():
    model = _model("llama")
    model.generation_config.pad_token_id = PAD
    dicts = _dicts()
    adapted = {k: as_dictionary(d) for k, d in dicts.items()}
    make_fn = _edit_generated_0_1(adapted)

    ids, mask = _left_padded()
    edits = {k: _scale_feature for k in dicts}
    with torch.no_grad(), pyhook.splice(model, dicts, edit=edits, prompt=None, generated=(0, 2)):
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=STEPS,
            min_new_tokens=STEPS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    new_tokens = out.sequences[:, ids.shape[1] :]
    for r, (logits, tokens) in enumerate(_by_hand_at(model, make_fn)):
        got = torch.stack([step[r] for step in out.logits])
        torch.testing.assert_close(got, logits.to(got.dtype), rtol=1e-6, atol=1e-6)
        assert torch.equal(new_tokens[r], tokens)
