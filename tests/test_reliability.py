"""Guarantees 1 and 3: nothing left behind after any exit of any tracer; isolation between traces.

The property tests draw a random small model, a random tracer with random options, random
foreign hooks (the user's own, which must survive untouched) and a random failure point, and
compare the hook dictionaries of every submodule before and after.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _hygiene import bounded, diff, hook_snapshot, run_in_threads
from _models import Pair, gpt2
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import pyhook
from pyhook import StopForward, Trace, TraceDict
from pyhook.capture import capture
from pyhook.deephook import Trace as DeepTrace
from pyhook.deephook import TraceMultiple
from pyhook.extend import ActivationMapGrabber, ModelExtender, ModelStump
from pyhook.flex import FlexModel, HookFunction
from pyhook.truncate import HookNotCalledError, TruncatedModule

D = 4


# --------------------------------------------------------------------------------------------
# random small models: every block maps [batch, D] -> [batch, D]
class Twice(nn.Module):
    """Calls its child twice per forward (a module called several times)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(torch.tanh(self.inner(x)))


class TupleOut(nn.Module):
    """Has a child returning a namedtuple holding a None."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.pair = _PairBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pair(self.lin(x)).hidden


class _PairBlock(nn.Module):
    def forward(self, x: torch.Tensor) -> Pair:
        return Pair(x * 2, None)


class KwBlock(nn.Module):
    """A child called with keyword arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(input=x)


BLOCKS: dict[str, Callable[[], nn.Module]] = {
    "linear": lambda: nn.Linear(D, D),
    "relu": nn.ReLU,
    "twice": Twice,
    "tuple": TupleOut,
    "kw": KwBlock,
    "seq": lambda: nn.Sequential(nn.Linear(D, D), nn.Tanh()),
}


@st.composite
def models(draw: st.DrawFn) -> nn.Sequential:
    kinds = draw(st.lists(st.sampled_from(sorted(BLOCKS)), min_size=1, max_size=4))
    torch.manual_seed(draw(st.integers(0, 3)))
    return nn.Sequential(*(BLOCKS[k]() for k in kinds))


def _names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_modules() if n]


# --------------------------------------------------------------------------------------------
# failures injected through the user's own hooks (which must survive) or edit functions
class Boom(Exception):
    pass


FAILURES = ("none", "runtime", "keyboard", "foreign_stop", "unowned_stop", "edit_error")


def _raiser(kind: str) -> Callable[..., Any]:
    def hook(*_a: Any) -> None:
        if kind == "runtime":
            raise Boom("model failed")
        if kind == "keyboard":
            raise KeyboardInterrupt
        if kind == "foreign_stop":
            raise StopForward(owner=object())
        if kind == "unowned_stop":
            raise StopForward()

    return hook


def _failing_edit(*_a: Any, **_k: Any) -> Any:
    raise Boom("edit failed")


# --------------------------------------------------------------------------------------------
# every tracer of the package, run once on (model, layers, x) with random options
def run_trace(model, layers, x, opts, edit):
    with Trace(
        model,
        layers[0],
        stop=opts["stop"],
        clone=opts["clone"],
        retain_input=opts["flag"],
        keep_calls=opts["flag"],
        edit_output=edit,
    ) as t:
        model(x)
    return t


def run_tracedict(model, layers, x, opts, edit):
    with TraceDict(
        model,
        layers,
        stop=opts["stop"],
        clone=opts["clone"],
        retain_grad=opts["flag"],
        edit_output=edit,
    ) as td:
        model(x)
    return td


def run_nested(model, layers, x, opts, edit):
    with Trace(model, layers[0], edit_output=edit), TraceDict(model, layers, stop=opts["stop"]):
        with Trace(model, layers[-1], stop=opts["stop"], clone=True):
            model(x)


def run_deep_trace(model, layers, x, opts, edit):
    deep_edit = (lambda output, layer_name: _failing_edit()) if edit else None
    with DeepTrace(model, layers[0], retain_input=opts["flag"], edit_output=deep_edit):
        model(x)


def run_trace_multiple(model, layers, x, opts, edit):
    deep_edit = (lambda output, layer_name: _failing_edit()) if edit else None
    settings = {name: (True, opts["flag"], deep_edit) for name in layers}
    tm = TraceMultiple(model, settings)

    @tm
    def go():
        return model(x)

    go()
    go()  # decorator use works every time


def run_truncated(model, layers, x, opts, edit):
    if edit:
        raise Boom("edit failed")  # TruncatedModule has no edit function
    try:
        TruncatedModule(model, layers[0])(x)
    except HookNotCalledError:
        pass


def run_stump(model, layers, x, opts, edit):
    if edit:
        raise Boom("edit failed")
    with ModelStump(model, layers[0]) as stump:
        try:
            stump(x)
        except HookNotCalledError:
            pass


def run_grabber(model, layers, x, opts, edit):
    if edit:
        raise Boom("edit failed")
    with ActivationMapGrabber(model, layers) as grab:
        grab(x)


def run_extender(model, layers, x, opts, edit):
    ext = {
        name: {f"e{i}": (nn.Identity() if not edit else _FailingModule())}
        for i, name in enumerate(layers)
    }
    with ModelExtender(model, ext) as m:
        m(x)


class _FailingModule(nn.Module):
    def forward(self, _x: Any) -> Any:
        raise Boom("extension failed")


def run_flex(model, layers, x, opts, edit):
    fm = FlexModel(model, {})
    try:
        for name in layers:
            fn = (lambda m, t, ctx, mods: _failing_edit()) if edit else None
            fm.register_forward_hook(HookFunction(name, editing_function=fn))
        fm(x)
    finally:
        fm.restore()


def run_capture(model, layers, x, opts, edit):
    if edit:
        raise Boom("edit failed")
    # capture keeps [batch, D] outputs; rows are examples
    with capture(model, layers, to="host"):
        model(x)


TRACERS = {
    "trace": run_trace,
    "tracedict": run_tracedict,
    "nested": run_nested,
    "deephook.Trace": run_deep_trace,
    "deephook.TraceMultiple": run_trace_multiple,
    "TruncatedModule": run_truncated,
    "ModelStump": run_stump,
    "ActivationMapGrabber": run_grabber,
    "ModelExtender": run_extender,
    "FlexModel": run_flex,
    "capture": run_capture,
}

# exceptions a tracer must let through (it may swallow only its own StopForward)
_PROPAGATES = {
    "runtime": Boom,
    "keyboard": KeyboardInterrupt,
    "foreign_stop": StopForward,
    "edit_error": Boom,
}


@bounded(60)
@given(
    model=models(),
    tracer=st.sampled_from(sorted(TRACERS)),
    data=st.data(),
    failure=st.sampled_from(FAILURES),
    stop=st.booleans(),
    clone=st.booleans(),
    flag=st.booleans(),
)
def test_no_hook_left_behind_and_no_foreign_hook_touched(
    model, tracer, data, failure, stop, clone, flag
):
    names = _names(model)
    layers = data.draw(
        st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True), "layers"
    )
    # the user's own hooks, some on traced layers, one of them maybe the failure point
    foreign: list[Any] = []
    for name in data.draw(st.lists(st.sampled_from(names), max_size=3), "foreign"):
        mod = model.get_submodule(name)
        foreign.append(mod.register_forward_hook(lambda m, a, o: None))
        foreign.append(mod.register_forward_pre_hook(lambda m, a: None, prepend=True))
        foreign.append(mod.register_full_backward_hook(lambda m, gi, go: None))
    if failure not in ("none", "edit_error"):
        where = data.draw(st.sampled_from(names), "failure point")
        model.get_submodule(where).register_forward_hook(_raiser(failure))
    edit = _failing_edit if failure == "edit_error" else None
    x = torch.randn(3, D)
    before = hook_snapshot(model)
    opts = {"stop": stop, "clone": clone, "flag": flag}
    try:
        TRACERS[tracer](model, layers, x, opts, edit)
    except (Boom, KeyboardInterrupt, StopForward) as e:
        caught: BaseException | None = e
    else:
        caught = None
    after = hook_snapshot(model)
    assert not diff(before, after), "\n".join(diff(before, after))
    # a failure of the user's own making is never swallowed (except the innermost unowned stop)
    if failure in _PROPAGATES and caught is None:
        # the failure point may not have run: a stop=True tracer or a truncation ended first
        pass
    if failure == "keyboard" and caught is not None:
        assert isinstance(caught, KeyboardInterrupt)
    if caught is not None and isinstance(caught, StopForward):
        # only a stop nobody owns here may escape: never a tracer's own stop
        assert caught.owner is None or failure == "foreign_stop"


def test_keyboard_interrupt_from_inside_a_pyhook_edit_leaves_nothing():
    model = gpt2()
    before = hook_snapshot(model)

    def interrupt(output):
        raise KeyboardInterrupt

    ids = torch.randint(0, 100, (1, 5))
    for make in (
        lambda: Trace(model, "transformer.h.1", edit_output=interrupt),
        lambda: TraceDict(
            model,
            ["transformer.h.0", "transformer.h.1.mlp"],
            edit_output={"transformer.h.1.mlp": interrupt},
            stop=True,
        ),
    ):
        with pytest.raises(KeyboardInterrupt), make():
            model(ids)
        assert not diff(before, hook_snapshot(model))


def test_failure_while_registering_rolls_back_every_tracer():
    model = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))
    before = hook_snapshot(model)
    bad_cases: list[Callable[[], Any]] = [
        lambda: TraceDict(model, ["0", "2", "nope"]),
        lambda: TraceMultiple(model, {"0": (), "nope": ()}).__enter__(),
        lambda: ActivationMapGrabber(model, ["0", "nope"]),
        lambda: ModelExtender(model, {"0": {"a": nn.Identity()}, "nope": {"b": nn.Identity()}}),
        lambda: capture(model, ["0", "nope"]).__enter__(),
        lambda: TruncatedModule(model, "nope"),
    ]
    for make in bad_cases:
        with pytest.raises((KeyError, ValueError, AttributeError, LookupError)):
            make()
        assert not diff(before, hook_snapshot(model))


def test_transformers_output_hooks_are_not_ours_and_stay():
    """transformers installs permanent output-capturing hooks on first output_hidden_states call."""
    model = gpt2()
    ids = torch.randint(0, 100, (1, 4))
    model(ids, output_hidden_states=True)  # let transformers install whatever it installs
    before = hook_snapshot(model)
    with TraceDict(model, ["transformer.h.0", "transformer.h.1"], clone=True) as td:
        out = model(ids, output_hidden_states=True)
    assert torch.equal(
        td["transformer.h.0"].output[0]
        if isinstance(td["transformer.h.0"].output, tuple)
        else td["transformer.h.0"].output,
        out.hidden_states[1],
    )
    assert not diff(before, hook_snapshot(model))


# --------------------------------------------------------------------------------------------
# guarantee 3: isolation
def test_nested_tracers_edit_in_registration_order_outer_first():
    """Documented order: the tracer entered first (outer) edits first; the inner one sees its edit."""
    lin = nn.Linear(D, D)
    model = nn.Sequential(lin)
    x = torch.randn(2, D)
    with Trace(model, "0", edit_output=lambda output: output + 1) as outer:
        with Trace(model, "0", edit_output=lambda output: output * 10, clone=True) as inner:
            y = model(x)
    ref = (lin(x) + 1) * 10
    assert torch.allclose(y, ref)
    assert torch.allclose(inner.output, ref)
    # outer retained its own post-edit value: the object it returned, before the inner edit
    assert torch.allclose(outer.output, lin(x) + 1)


def test_inner_stop_is_not_swallowed_by_outer_and_outer_stop_reaches_outer():
    model = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))
    x = torch.randn(2, D)
    after_call = []
    # inner tracer stops at layer 0; outer (stop=True at layer 2) must not swallow it
    with Trace(model, "2", stop=True) as outer:
        with Trace(model, "0", stop=True) as inner:
            model(x)
            after_call.append("inner body")
        after_call.append("outer body")
    assert after_call == ["outer body"]
    assert hasattr(inner, "output") and not hasattr(outer, "output")
    # outer stops at layer 0 while the inner stop layer is never reached: propagates through inner
    with TraceDict(model, ["0"], stop=True) as outer_td, Trace(model, "2", stop=True) as inner2:
        model(x)
        after_call.append("unreached")
    assert "unreached" not in after_call and not hasattr(inner2, "output")
    assert outer_td["0"].output is not None
    assert not diff({}, {}) and sum(len(m._forward_hooks) for m in model.modules()) == 0


def test_stopforward_of_another_owner_passes_through_every_tracer():
    model = nn.Sequential(nn.Linear(D, D), nn.ReLU())
    x = torch.randn(2, D)
    token = object()

    def stop_other(output):
        raise StopForward(owner=token)

    for make in (
        lambda: Trace(model, "1", stop=True, edit_output=stop_other),
        lambda: TraceDict(model, ["0", "1"], stop=True, edit_output={"1": stop_other}),
    ):
        with pytest.raises(StopForward) as info, make():
            model(x)
        assert info.value.owner is token
    with pytest.raises(StopForward) as info, Trace(model, "1", edit_output=stop_other):
        TruncatedModule(model, "1")(x)  # the truncation point's own stop must not eat it
    assert info.value.owner is token


@pytest.mark.parametrize(
    "tracer", ["Trace", "TraceDict", "deephook", "TruncatedModule", "ModelStump", "capture"]
)
def test_two_threads_tracing_one_model_each_get_their_own_forward(tracer):
    model = gpt2()
    inputs = [
        torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(k)) for k in range(2)
    ]
    with torch.no_grad():
        ref = [
            model.transformer.h[0](
                model.transformer.drop(
                    model.transformer.wte(ids) + model.transformer.wpe(torch.arange(6)[None])
                )
            )[0]
            for ids in inputs
        ]
    barrier = threading.Barrier(2)
    layer = "transformer.h.0"

    def first(o: Any) -> torch.Tensor:
        return o[0] if isinstance(o, tuple) else o

    def work(k: int) -> torch.Tensor:
        got = []
        for _ in range(5):
            with torch.no_grad():
                if tracer == "Trace":
                    with Trace(model, layer, clone=True) as t:
                        barrier.wait()
                        model(inputs[k])
                    got.append(first(t.output))
                elif tracer == "TraceDict":
                    with TraceDict(model, [layer, "transformer.h.1"], clone=True) as td:
                        barrier.wait()
                        model(inputs[k])
                    got.append(first(td[layer].output))
                elif tracer == "deephook":
                    with DeepTrace(model, layer) as t:
                        barrier.wait()
                        model(inputs[k])
                    got.append(first(t.output))
                elif tracer == "TruncatedModule":
                    barrier.wait()
                    got.append(first(TruncatedModule(model, layer)(inputs[k])))
                elif tracer == "ModelStump":
                    stump = ModelStump(model, layer)
                    barrier.wait()
                    got.append(first(stump(inputs[k])))
                    stump.close()
                else:
                    with capture(model, [layer], to="host", flatten=False) as rec:
                        barrier.wait()
                        model(inputs[k])
                    got.append(rec[layer])
        return got

    results = run_in_threads(work, 2)
    for k in range(2):
        for got in results[k]:
            assert torch.allclose(got.reshape(ref[k].shape), ref[k], atol=1e-6), (
                f"thread {k} saw the other forward"
            )
    before = hook_snapshot(gpt2())
    assert not diff(before, hook_snapshot(model))


def test_any_thread_tracer_sees_every_thread_and_default_tracer_ignores_others():
    model = nn.Sequential(nn.Linear(D, D))
    x = torch.randn(1, D)
    with (
        Trace(model, "0", keep_calls=True) as mine,
        Trace(model, "0", keep_calls=True, any_thread=True) as every,
    ):
        th = threading.Thread(target=lambda: model(x))
        th.start()
        th.join()
        model(x)
    assert len(mine.calls) == 1
    assert len(every.calls) == 2


def test_pyhook_exports_stopforward_used_by_all_tracers():
    from pyhook.truncate import TruncationExecutionFinished

    assert issubclass(TruncationExecutionFinished, pyhook.StopForward)
