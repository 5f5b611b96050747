"""Several pyhook tools on one model at once: each result equals the one of a separate run."""

from __future__ import annotations

import pytest
import torch
from _models import all_hooks, gpt2, mlp
from torch import nn

import pyhook
from pyhook.deephook import TraceMultiple
from pyhook.extend import ActivationMapGrabber, ModelExtender, ModelStump
from pyhook.truncate import HookNotCalledError, TruncatedModule

H0, H1, LNF = "transformer.h.0", "transformer.h.1", "transformer.ln_f"


@pytest.fixture(scope="module")
def model():
    return gpt2(n_layer=3)


@pytest.fixture(scope="module")
def ids():
    return torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])


def test_tracedict_extender_truncation_nested(model, ids):
    torch.manual_seed(0)
    probe = nn.Linear(32, 3)
    with torch.no_grad():
        # separate runs
        with pyhook.TraceDict(model, [H0, H1, LNF]) as alone:
            model(ids)
        ref_h0, ref_h1 = alone[H0].output, alone[H1].output
        ref_trunc = TruncatedModule(model, H1)(ids)
        ref_ext = ModelExtender(model, {H0: {"probe": probe}})(ids)[1]["probe"]
        before = all_hooks(model)

        # all three at once: an extender around a truncated model, inside a TraceDict
        trunc = TruncatedModule(model, H1)
        ext = ModelExtender(trunc, {f"module.{H0}": {"probe": probe}})
        lnf_runs = []
        with pyhook.TraceDict(model, [H0, H1, LNF]) as td:
            main_out, ext_outs = ext(ids)
            lnf_runs.append(hasattr(td[LNF], "output"))

    assert torch.equal(ref_trunc, ref_h1)
    assert torch.equal(main_out, ref_trunc)  # the extender's main output is the truncated one
    assert torch.equal(ext_outs["probe"], ref_ext)
    assert torch.equal(ext_outs["probe"], probe(ref_h0))
    assert torch.equal(td[H0].output, ref_h0) and torch.equal(td[H1].output, ref_h1)
    assert lnf_runs == [False]  # the truncation stopped the model before ln_f
    ext.close()
    assert all_hooks(model) == before


def test_edit_from_tracedict_reaches_truncation_and_extender(model, ids):
    def halve(output):
        return output * 0.5

    with torch.no_grad():
        with pyhook.TraceDict(model, [H0], edit_output=halve):
            ref = TruncatedModule(model, H1)(ids)  # separate: edit + truncation only
        with pyhook.TraceDict(model, [H0], edit_output=halve) as alone:
            model(ids)
        plain_h0 = TruncatedModule(model, H0)(ids)
        before = all_hooks(model)
        # Hooks run in registration order: an extender made before the TraceDict sees h.0's
        # output before the edit, one made inside it sees the edited output.
        early = ModelExtender(TruncatedModule(model, H1), {f"module.{H0}": {"h0": nn.Identity()}})
        with pyhook.TraceDict(model, [H0, H1], edit_output={H0: halve}) as td:
            late = ModelExtender(
                TruncatedModule(model, H1), {f"module.{H0}": {"h0": nn.Identity()}}
            )
            out, outs = early(ids)
            late_out, late_outs = late(ids)
            late.close()
    assert torch.equal(out, ref) and torch.equal(late_out, ref) and torch.equal(td[H1].output, ref)
    assert torch.equal(outs["h0"], plain_h0)
    assert torch.equal(late_outs["h0"], alone[H0].output)
    assert torch.equal(alone[H0].output, plain_h0 * 0.5)
    early.close()
    assert all_hooks(model) == before


def test_each_tool_swallows_only_its_own_stop(model, ids):
    with torch.no_grad():
        ref_h0 = TruncatedModule(model, H0)(ids)
        before = all_hooks(model)
        grabber = ActivationMapGrabber(model, [H0, H1])
        trunc = TruncatedModule(model, H1)
        # The TraceDict stops at h.0, before the truncation point: its stop crosses the
        # TruncatedModule and the grabber untouched and ends at the TraceDict's `with`.
        with pyhook.TraceDict(model, [H0], stop=True) as td:
            trunc(ids)
            pytest.fail("the TraceDict's stop did not propagate")
        assert torch.equal(td[H0].output, ref_h0)
        # A stump stopping at h.0 inside the truncation at h.1: the stump's stop is its own.
        stump = ModelStump(TruncatedModule(model, H1), f"module.{H0}")
        assert torch.equal(stump(ids), ref_h0)
        # A truncation whose point comes after the stump's head never gets its output.
        late = TruncatedModule(ModelStump(model, H0), f"wrapped_model.{H1}")
        with pytest.raises(HookNotCalledError):
            late(ids)
        _, acts = grabber(ids)
        assert torch.equal(acts[H0], ref_h0)
        grabber.close()
        stump.close()
        del late
    assert all_hooks(model) == before


def test_deephook_and_nethook_and_stump_together():
    net, x = mlp(), torch.randn(4, 4)

    def add1(output, layer_name):
        return output + 1

    with torch.no_grad():
        with pyhook.Trace(net, "0", edit_output=lambda output: output + 1):
            ref_stump = ModelStump(net, "2")(x)
        with (
            TraceMultiple(net, {"0": (True, False, add1), "2": ()}) as tm,
            pyhook.Trace(net, "2", retain_input=True) as tr,
        ):
            out = ModelStump(net, "2")(x)
    assert torch.equal(out, ref_stump)
    assert torch.equal(tm["2"].output, out) and torch.equal(tr.output, out)
    assert torch.equal(tr.input, torch.relu(tm["0"].output))
    assert net[3].calls == 0  # both stumps stopped before the counting layer
    assert all_hooks(net) == 0
