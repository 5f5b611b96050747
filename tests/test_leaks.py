"""Guarantee 2: no leaks. Models and activations are freed when dropped; trace cycles stay flat.

``PYHOOK_SOAK=1`` runs the full 2,000-cycle soak (CI runs 150 cycles per configuration);
``benchmarks/bench_soak.py`` prints the exact RSS slope.
"""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from pyhook import Trace, TraceDict
from pyhook.capture import capture
from pyhook.deephook import TraceMultiple
from pyhook.extend import ActivationMapGrabber, ModelExtender, ModelStump
from pyhook.flex import FlexModel, HookFunction
from pyhook.truncate import TruncatedModule

SOAK = os.environ.get("PYHOOK_SOAK") == "1"
CYCLES = 2000 if SOAK else 150


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Linear(8, 2))


def _use_trace(model, x):
    t = Trace(model, "1", clone=True, retain_grad=True, retain_input=True)
    with t:
        model(x).sum().backward()
    return t, t.output


def _use_trace_unclosed(model, x):
    t = Trace(model, "2", clone=True)  # never closed: stays registered, lives as long as the model
    model(x)
    return t, t.output


def _use_tracedict(model, x):
    with TraceDict(model, ["0", "2"], stop=True, clone=True, keep_calls=True) as td:
        model(x)
    return td, td["0"].output


def _use_trace_multiple(model, x):
    with TraceMultiple(model, {"0": (True, True), "2": ()}) as tm:
        model(x)
    return tm, tm["0"].output


def _use_truncated(model, x):
    tm = TruncatedModule(model, "2")
    out = tm(x)
    return tm, out


def _use_stump(model, x):
    stump = ModelStump(model, "1")  # never closed: must not keep the model alive
    out = stump(x)
    return stump, out


def _use_grabber(model, x):
    grab = ActivationMapGrabber(model, ["0", "2"])
    _, acts = grab(x)
    return grab, acts["0"]


def _use_extender(model, x):
    ext = ModelExtender(model, {"1": {"e": nn.Linear(16, 1)}})
    _, outs = ext(x)
    return ext, outs["e"]


def _use_flex(model, x):
    out: dict[str, list[torch.Tensor]] = {}
    fm = FlexModel(model, out)
    fm.register_forward_hook(HookFunction("2"))
    fm(x)
    return fm, out["2"][0]


def _use_capture(model, x):
    with capture(model, ["0", "2"], to="host") as rec:
        model(x)
    return rec, rec["0"]


USES: dict[str, Callable[[nn.Module, torch.Tensor], tuple[Any, torch.Tensor]]] = {
    "Trace": _use_trace,
    "Trace(unclosed)": _use_trace_unclosed,
    "TraceDict": _use_tracedict,
    "TraceMultiple": _use_trace_multiple,
    "TruncatedModule": _use_truncated,
    "ModelStump(unclosed)": _use_stump,
    "ActivationMapGrabber(unclosed)": _use_grabber,
    "ModelExtender(unclosed)": _use_extender,
    "FlexModel(unrestored)": _use_flex,
    "capture": _use_capture,
}


@pytest.mark.parametrize("use", sorted(USES))
def test_model_tracer_and_activations_are_freed_when_dropped(use):
    model = mlp()
    x = torch.randn(4, 8)
    tracer, activation = USES[use](model, x)
    refs = {
        "model": weakref.ref(model),
        "tracer": weakref.ref(tracer),
        "activation": weakref.ref(activation),
        "weight": weakref.ref(model[0].weight),
    }
    del model, tracer, activation
    gc.collect()
    alive = [name for name, r in refs.items() if r() is not None]
    assert not alive, f"{use}: still alive after drop: {alive}"


def test_activations_freed_without_gc_when_no_cycle():
    """Closed tracers hold no reference cycle: dropping them frees activations immediately."""
    model = mlp()
    x = torch.randn(4, 8)
    gc.disable()
    try:
        with Trace(model, "1", clone=True) as t:
            model(x)
        ref = weakref.ref(t.output)
        del t
        assert ref() is None
        with TraceDict(model, ["0", "2"], clone=True) as td:
            model(x)
        ref = weakref.ref(td["2"].output)
        del td
        assert ref() is None
    finally:
        gc.enable()


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _cycle(model: nn.Module, x: torch.Tensor, keep: list[Any]) -> None:
    with Trace(model, "1", clone=True, retain_grad=True) as t:
        model(x).sum().backward()
    with TraceDict(model, ["0", "2", "3"], clone=True, detach=True, stop=True) as td:
        model(x)
    model.zero_grad(set_to_none=True)
    keep[:] = [t.output, td["2"].output]  # the last cycle's activations only


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc (Linux)")
def test_many_trace_cycles_with_clones_and_gradients_stay_flat():
    torch.manual_seed(0)
    model = mlp()
    x = torch.randn(64, 8)
    keep: list[Any] = []
    for _ in range(20):  # warm up allocator, pools, caches
        _cycle(model, x, keep)
    tensors0, rss0 = _live_tensors(), _rss_bytes()
    for _ in range(CYCLES):
        _cycle(model, x, keep)
    tensors1, rss1 = _live_tensors(), _rss_bytes()
    # exact: no tensor object survives a cycle
    assert tensors1 == tensors0, f"{tensors1 - tensors0} tensors leaked over {CYCLES} cycles"
    # generous: allocator noise only (a leak of one 64x16 float activation per cycle would be
    # 4 KiB x cycles; 2000 cycles of any leak of the retained copies exceed this bound)
    assert rss1 - rss0 < 16 * 2**20, (
        f"RSS grew by {(rss1 - rss0) / 2**20:.1f} MiB over {CYCLES} cycles"
    )
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == 0
