"""Guarantee 4: modules called several times per forward, and ``generate`` with a KV cache.

Per-call capture (``keep_calls=True``) keeps every call in order with its step index, edits apply
at every step (steering a generation gives what a hand-written hook gives), and nothing grows
when the option is off.
"""

from __future__ import annotations

from typing import Any

import torch
from _hygiene import diff, hook_snapshot
from _models import gpt2
from torch import nn

from pyhook import Trace, TraceDict
from pyhook.capture import capture
from pyhook.deephook import Trace as DeepTrace
from pyhook.flex import FlexModel, HookFunction

LAYER = "transformer.h.1"
NEW = 4


def _generate(model: nn.Module, ids: torch.Tensor, **kw: Any) -> Any:
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW,
        do_sample=False,
        pad_token_id=0,
        use_cache=True,
        return_dict_in_generate=True,
        output_scores=True,
        **kw,
    )


def _hand_generate(
    model: nn.Module, ids: torch.Tensor, edit=None
) -> tuple[Any, list[torch.Tensor]]:
    """Reference: a plain forward hook that records (and optionally edits) every call."""
    seen: list[torch.Tensor] = []

    def hook(_m, _a, out):
        if edit is not None:
            out = edit(out)
        seen.append(out.detach().clone())
        return out

    h = model.get_submodule(LAYER).register_forward_hook(hook)
    try:
        return _generate(model, ids), seen
    finally:
        h.remove()


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(seed))


def test_module_called_several_times_per_forward_keeps_every_call_in_order():
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(3, 3)

        def forward(self, x):
            return self.inner(torch.tanh(self.inner(x)))

    model = Twice()
    x = torch.randn(2, 3)
    ref: list[torch.Tensor] = []
    h = model.inner.register_forward_hook(lambda m, a, o: ref.append(o.detach().clone()))
    model(x)
    h.remove()
    with Trace(model, "inner", keep_calls=True, retain_input=True, clone=True) as t:
        y = model(x)
    assert [c.step for c in t.calls] == [0, 1]
    assert torch.equal(t.calls[0].output, ref[0]) and torch.equal(t.calls[1].output, ref[1])
    assert torch.equal(t.calls[0].input, x) and torch.equal(t.calls[1].input, torch.tanh(ref[0]))
    assert torch.equal(t.output, y)  # last call wins for .output, as in nethook
    # an edit applies at every call
    with Trace(model, "inner", edit_output=lambda output: output + 1, keep_calls=True) as t:
        y = model(x)
    with torch.no_grad():
        want = model.inner(torch.tanh(model.inner(x) + 1)) + 1
    assert torch.allclose(y, want)
    assert len(t.calls) == 2


def test_generate_with_kv_cache_keeps_every_step_in_order():
    model = gpt2()
    ids = _ids()
    ref_out, ref_steps = _hand_generate(model, ids)
    before = hook_snapshot(model)
    with Trace(model, LAYER, keep_calls=True, clone=True, detach=True) as t:
        out = _generate(model, ids)
    assert torch.equal(out.sequences, ref_out.sequences)
    assert [c.step for c in t.calls] == list(range(NEW))
    assert len(ref_steps) == NEW
    for call, ref in zip(t.calls, ref_steps):
        assert torch.equal(call.output, ref)
    # prefill sees the prompt, each later step one new token (the KV cache is in use)
    assert [c.output.shape[1] for c in t.calls] == [ids.shape[1]] + [1] * (NEW - 1)
    assert not diff(before, hook_snapshot(model))


def test_steering_a_generation_matches_a_hand_written_hook():
    model = gpt2()
    ids = _ids(1)
    torch.manual_seed(3)
    direction = torch.randn(32) * 4

    def steer(output):
        return output + direction

    ref_out, ref_steps = _hand_generate(model, ids, edit=steer)
    plain_out, _ = _hand_generate(model, ids)
    # the steering must change the run, or this test could not fail
    assert not torch.allclose(ref_out.scores[0], plain_out.scores[0])
    with Trace(model, LAYER, edit_output=steer, keep_calls=True, clone=True, detach=True) as t:
        out = _generate(model, ids)
    assert torch.equal(out.sequences, ref_out.sequences)
    for got, want in zip(out.scores, ref_out.scores):
        assert torch.equal(got, want)
    assert len(t.calls) == NEW
    for call, ref in zip(t.calls, ref_steps):
        assert torch.equal(call.output, ref)  # retained = post-edit output at every step
    # TraceDict steering one layer, recording another, per-layer options
    with TraceDict(
        model,
        ["transformer.h.0", LAYER],
        edit_output={LAYER: steer},
        keep_calls={"transformer.h.0": True},
    ) as td:
        out2 = _generate(model, ids)
    assert torch.equal(out2.sequences, ref_out.sequences)
    assert len(td["transformer.h.0"].calls) == NEW and td[LAYER].calls == []


def test_nothing_grows_when_keep_calls_is_off():
    model = gpt2()
    ids = _ids()
    with Trace(model, LAYER, clone=True) as t:
        _generate(model, ids)
        _generate(model, ids)
    assert t.calls == []
    assert t.output.shape[1] == 1  # the last step only
    with DeepTrace(model, LAYER) as dt:
        _generate(model, ids)
    assert dt.output.shape[1] == 1


def test_keep_calls_restarts_on_each_entry():
    model = gpt2()
    t = Trace(model, LAYER, keep_calls=True)
    with t:
        _generate(model, _ids())
    with t:
        _generate(model, _ids())
    assert [c.step for c in t.calls] == list(range(NEW))


def test_flexmodel_saves_one_copy_per_generation_step():
    model = gpt2()
    ids = _ids()
    _, ref_steps = _hand_generate(model, ids)
    out: dict[str, list[torch.Tensor]] = {}
    fm = FlexModel(model, out)
    try:
        fm.register_forward_hook(HookFunction(LAYER))
        fm.module.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
        )
    finally:
        fm.restore()
    assert len(out[LAYER]) == NEW
    for got, want in zip(out[LAYER], ref_steps):
        assert torch.equal(got, want)


def test_capture_records_each_generation_step_as_one_batch():
    model = gpt2()
    ids = _ids()
    _, ref_steps = _hand_generate(model, ids)
    with capture(model, [LAYER], to="host", positions="last") as rec:
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
        )
    got = rec[LAYER]
    want = torch.cat([s[:, -1] for s in ref_steps])
    assert got.shape == want.shape
    assert torch.allclose(got, want)
