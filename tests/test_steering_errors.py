"""Bad steering input (issue 50 item 5): one line naming the spec and what was expected,
before any token is generated, and nothing left registered."""

from __future__ import annotations

import pytest
import torch
from _models import all_hooks

import pyhook
from pyhook.steering import SteeringError

T = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    cfg = T.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=40, n_positions=64)
    return T.GPT2LMHeadModel(cfg).eval()


IDS = torch.tensor([[0, 0, 5, 6], [1, 2, 3, 4]])
AM = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])


def _generate(model, specs, steps):
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(SteeringError) as info, pyhook.steering(model, specs), torch.no_grad():
        steps.append("entered")
        model.generate(
            IDS,
            attention_mask=AM,
            max_new_tokens=3,
            do_sample=False,
            pad_token_id=0,
            logits_processor=[_Count(steps)],
        )
    assert all_hooks(model) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    msg = str(info.value)
    assert "\n" not in msg
    return msg


class _Count:
    """A logits processor: called once per generated token."""

    def __init__(self, steps):
        self.steps = steps

    def __call__(self, ids, scores):
        self.steps.append("token")
        return scores


def test_unknown_point_is_named_before_entering(gpt):
    steps = []
    msg = _generate(gpt, pyhook.Steer("resid_post.9", torch.ones(16)), steps)
    assert steps == [] and "Steer('resid_post.9'" in msg and "unknown point" in msg
    msg = _generate(gpt, pyhook.Steer("transformer.hh.0", torch.ones(16)), steps)
    assert steps == [] and "transformer.hh.0" in msg


def test_vector_of_the_wrong_width_or_shape(gpt):
    steps = []
    msg = _generate(gpt, pyhook.Steer("resid_post.0", torch.ones(12)), steps)
    assert steps == [] and "width 12" in msg and "16 wide" in msg
    msg = _generate(gpt, pyhook.Steer("attn_z.0", torch.ones(16)), steps)
    assert steps == [] and "[heads, d_head]" in msg and "[2, 8]" in msg
    # a module's output whose width is known only when it runs: refused at the first forward
    msg = _generate(gpt, pyhook.Steer("transformer.h.0.mlp.c_fc", torch.ones(16)), steps)
    assert steps == ["entered"] and "[16]" in msg and "[64]" in msg


def test_vectors_that_cannot_be_cast():
    with pytest.raises(SteeringError, match="real numbers"):
        pyhook.Steer("resid_post.0", torch.ones(4, dtype=torch.complex64))
    with pytest.raises(SteeringError, match="tensor of numbers"):
        pyhook.Steer("resid_post.0", ["a", "b"])
    with pytest.raises(SteeringError, match="Probe"):
        pyhook.Probe("resid_post.0", torch.ones(4, dtype=torch.bool))


def test_bad_selectors_and_ops():
    with pytest.raises(SteeringError, match=r"generated=\(3, 1\).*start <= stop"):
        pyhook.Steer("resid_post.0", torch.ones(4), generated=(3, 1))
    with pytest.raises(SteeringError, match="op must be one of"):
        pyhook.Steer("resid_post.0", torch.ones(4), op="multiply")
    with pytest.raises(SteeringError, match="prompt must be"):
        pyhook.Steer("resid_post.0", torch.ones(4), prompt="last")


def test_prompt_index_outside_a_rows_prompt_names_the_row(gpt):
    steps = []
    spec = pyhook.Steer("resid_post.0", torch.ones(16), prompt=[-3])
    msg = _generate(gpt, spec, steps)
    # row 0 has 2 real tokens (left padding excluded); nothing was generated
    assert "token" not in steps and "row 0" in msg and "-3" in msg and "-2..1" in msg


def test_probe_that_runs_after_the_steered_prompt(gpt):
    steps = []
    probe = pyhook.Probe("resid_post.1", torch.ones(16))
    spec = pyhook.Steer("resid_post.0", torch.ones(16), when=probe)
    msg = _generate(gpt, spec, steps)
    assert "token" not in steps and "runs after" in msg and "prompt=None" in msg
    # another spec of the row steering its prompt before the probe: not its unsteered prompt
    other = pyhook.Steer("resid_post.0", torch.ones(16))
    late = pyhook.Steer("resid_post.1", torch.ones(16), prompt=None, when=probe)
    msg = _generate(gpt, [[other, late], None], steps)
    assert "token" not in steps and "row 0" in msg and "unsteered prompt" in msg
    # generated tokens only, with the probe later in the forward: honoured
    ok = pyhook.Steer("resid_post.0", torch.ones(16), prompt=None, when=probe)
    with pyhook.steering(gpt, ok) as st, torch.no_grad():
        gpt.generate(IDS, attention_mask=AM, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert len(st.decisions()) == 2 and all_hooks(gpt) == 0


def test_spec_list_of_the_wrong_length(gpt):
    steps = []
    spec = pyhook.Steer("resid_post.0", torch.ones(16))
    msg = _generate(gpt, [spec, None, spec], steps)
    assert "token" not in steps and "3 entries" in msg and "2 rows" in msg
    with pytest.raises(SteeringError, match="entry 1"), pyhook.steering(gpt, [spec, "x"]):
        pass
    assert all_hooks(gpt) == 0
