"""Thread isolation and re-entry of the tracers (issue 12, items 6-8).

Every test runs real threads and compares with a reference computed without pyhook (or with a
hand-written hook): a tracer held by one thread must never touch another thread's forward, not
even when autograd recomputes that forward during a backward (activation checkpointing).
"""

from __future__ import annotations

import copy
import io
import threading

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import pyhook
from _hygiene import diff, hook_snapshot, run_in_threads

MODES = [pytest.param(False, id="non-reentrant"), pytest.param(True, id="reentrant")]

# Whose forward a recomputation replays is read from the autograd graph by pyhook._C; a
# pure-Python install takes every recomputation as the owner's (documented fallback).
needs_native = pytest.mark.skipif(
    not pyhook.native_available(), reason="checkpoint isolation needs the native module"
)


class Checkpointed(nn.Module):
    """A block run under activation checkpointing, then a head."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant
        self.block = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.block, x, use_reentrant=self.use_reentrant))


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def train_steps(model: nn.Module, xs: list[torch.Tensor], between=None) -> list[dict]:
    """Forward + backward + SGD step per input; the gradients of every step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for k, x in enumerate(xs):
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        out.append(grads(model))
        opt.step()
        if between is not None:
            between(k)
    return out


@needs_native
@pytest.mark.parametrize("use_reentrant", MODES)
def test_checkpointed_training_on_another_thread_is_not_edited(use_reentrant):
    """Thread A holds a Trace with an edit; thread B trains the same model with checkpointing
    and never uses pyhook: B's gradients equal a no-pyhook run in every step, and A's
    ``t.output`` stays the output of A's own forward."""
    torch.manual_seed(0)
    model = Checkpointed(use_reentrant)
    reference = copy.deepcopy(model)  # no hooks: the no-pyhook run of B
    xs = [torch.randn(3, 4, requires_grad=use_reentrant) for _ in range(6)]
    expected = train_steps(reference, xs)

    xa = torch.full((2, 4), 0.5, requires_grad=True)
    a_ready, b_step, a_check = threading.Event(), threading.Barrier(2), threading.Barrier(2)
    seen: dict[str, object] = {}

    def thread_a() -> None:
        with pyhook.Trace(model, "block.0", clone=True, edit_output=lambda output: output * 3) as t:
            model(xa)
            mine = t.output.clone()
            a_ready.set()
            for _ in xs:  # after each of B's steps, A's capture is still its own
                b_step.wait()
                seen.setdefault("outputs", []).append(torch.equal(t.output, mine))
                a_check.wait()

    def thread_b() -> None:
        a_ready.wait()

        def sync(_k: int) -> None:
            b_step.wait()
            a_check.wait()

        seen["grads"] = train_steps(model, xs, between=sync)

    ta, tb = threading.Thread(target=thread_a), threading.Thread(target=thread_b)
    ta.start(), tb.start()
    ta.join(), tb.join()
    got = seen["grads"]
    wrong = [
        k
        for k, (g, e) in enumerate(zip(got, expected, strict=True))
        if any(not torch.allclose(g[n], e[n], atol=1e-6) for n in e)
    ]
    assert wrong == [], f"B's gradients differ from the no-pyhook run in steps {wrong}"
    assert seen["outputs"] == [True] * len(xs), "A's t.output was overwritten by B's recomputation"
    assert all(not m._forward_hooks for m in model.modules())


def input_grad(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """d(sum of net(x))/dx, by .backward() (reentrant checkpoint refuses autograd.grad)."""
    x = x.detach().requires_grad_(True)
    net(x).sum().backward()
    return x.grad


@needs_native
@pytest.mark.parametrize("use_reentrant", MODES)
def test_own_checkpointed_backward_gets_the_edit_while_another_thread_trains(use_reentrant):
    """A's own checkpointed forward, backward run on a third thread while B runs forward and
    backward on the same model: A's recomputation gets A's edit (equal to a hand-written
    hook's), B's recomputation none."""
    torch.manual_seed(1)
    model = Checkpointed(use_reentrant)
    ref_a, ref_b = copy.deepcopy(model), copy.deepcopy(model)
    xa, xb = torch.randn(3, 4), torch.randn(3, 4)
    ref_a.block[0].register_forward_hook(lambda m, a, o: o * 3)
    want_a, want_b = input_grad(ref_a, xa), input_grad(ref_b, xb)
    got: dict[str, torch.Tensor] = {}
    a_forward_done, b_forward_done, b_done = threading.Event(), threading.Event(), threading.Event()

    def thread_a() -> None:
        with pyhook.Trace(model, "block.0", edit_output=lambda output: output * 3):
            x = xa.clone().requires_grad_(True)
            loss = model(x).sum()
            a_forward_done.set()
            b_forward_done.wait()
            worker = threading.Thread(target=loss.backward)  # recomputes on the worker
            worker.start()
            worker.join()
            got["a"] = x.grad
            b_done.wait(30)

    def thread_b() -> None:
        a_forward_done.wait()
        x = xb.clone().requires_grad_(True)
        loss = model(x).sum()
        b_forward_done.set()
        loss.backward()  # recomputes on B, while A holds its Trace
        got["b"] = x.grad
        b_done.set()

    ta, tb = threading.Thread(target=thread_a), threading.Thread(target=thread_b)
    ta.start(), tb.start()
    ta.join(), tb.join()
    assert torch.allclose(got["a"], want_a, atol=1e-6), "A's recomputation lost A's edit"
    assert torch.allclose(got["b"], want_b, atol=1e-6), "B's recomputation got A's edit"
    assert all(not m._forward_hooks for m in model.modules())


@needs_native
@pytest.mark.parametrize("use_reentrant", MODES)
def test_owner_running_backward_of_another_threads_forward_does_not_edit_it(use_reentrant):
    """The thread holding the Trace runs the backward of a loss another thread computed: the
    recomputed forward is the other thread's, so the edit must not apply to it."""
    torch.manual_seed(2)
    model = Checkpointed(use_reentrant)
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4, requires_grad=True)
    reference(x).sum().backward()
    want = x.grad.clone()
    x.grad = None
    box: dict[str, torch.Tensor] = {}
    th = threading.Thread(target=lambda: box.update(loss=model(x).sum()))
    th.start()
    th.join()
    with pyhook.Trace(model, "block.0", edit_output=lambda output: output * 3):
        box["loss"].backward()
    assert torch.allclose(x.grad, want, atol=1e-6)


@needs_native
def test_checkpoint_isolation_with_trace_dict_and_many_threads():
    """Four threads train the same checkpointed model; one holds a TraceDict with edits and
    checkpoints too. Every other thread's grads equal the no-pyhook run; the owner's equal a
    hand-hooked run."""
    torch.manual_seed(3)
    model = Checkpointed(False)
    before = hook_snapshot(model)
    xs = [torch.randn(2, 4) for _ in range(4)]
    plain = copy.deepcopy(model)
    edited = copy.deepcopy(model)
    edited.block[0].register_forward_hook(lambda m, a, o: o * 2)

    want = [input_grad(edited if k == 0 else plain, x) for k, x in enumerate(xs)]
    barrier = threading.Barrier(4)

    def work(k: int) -> list[torch.Tensor]:
        out = []
        if k == 0:
            with pyhook.TraceDict(
                model, ["block.0", "block.2"], edit_output={"block.0": lambda output: output * 2}
            ):
                for _ in range(5):
                    barrier.wait()
                    out.append(input_grad(model, xs[k]))
        else:
            for _ in range(5):
                barrier.wait()
                out.append(input_grad(model, xs[k]))
        return out

    results = run_in_threads(work, 4)
    for k, got in enumerate(results):
        assert all(torch.allclose(g, want[k], atol=1e-6) for g in got), f"thread {k}"
    assert diff(before, hook_snapshot(model)) == []


class Nested(nn.Module):
    """A checkpointed block inside a checkpointed block: the inner recomputation's autograd
    node is created during the outer recomputation, on the thread running the backward."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        self.post = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def outer(self, x: torch.Tensor) -> torch.Tensor:
        inner = checkpoint(self.inner, x, use_reentrant=self.use_reentrant)
        return self.post(torch.tanh(inner))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.outer, x, use_reentrant=self.use_reentrant))


@needs_native
@pytest.mark.parametrize("on_worker", [False, True], ids=["owner-backward", "worker-backward"])
@pytest.mark.parametrize("use_reentrant", MODES)
def test_nested_checkpoints_get_the_owners_edit_and_only_the_owners(use_reentrant, on_worker):
    """Nested checkpoints: the owner's edit reaches the inner recomputation (backward on the
    owner's thread or another one); then the thread that ran the owner's backward trains on its
    own and gets no edit."""
    torch.manual_seed(4)
    model = Nested(use_reentrant)
    edited, plain = copy.deepcopy(model), copy.deepcopy(model)
    edited.inner[0].register_forward_hook(lambda m, a, o: o * 3)
    x = torch.randn(2, 4)
    want_edited, want_plain = input_grad(edited, x), input_grad(plain, x)
    got: dict[str, torch.Tensor] = {}
    with pyhook.Trace(model, "inner.0", edit_output=lambda output: output * 3):
        xa = x.clone().requires_grad_(True)
        loss = model(xa).sum()

        def worker() -> None:
            loss.backward()  # the owner's forward, recomputed here
            got["own"] = input_grad(model, x)  # then this thread's own forward and backward

        if on_worker:
            th = threading.Thread(target=worker)
            th.start()
            th.join()
        else:
            loss.backward()
    assert torch.allclose(xa.grad, want_edited, atol=1e-6), "the owner's edit was skipped"
    if on_worker:
        assert torch.allclose(got["own"], want_plain, atol=1e-6), "another thread got the edit"


def test_without_the_native_module_every_recomputation_counts_as_the_owners():
    """The documented fallback (no ``pyhook._C``): no node thread to read, the edit applies."""
    from pyhook._hooks import forward_owner_matches

    assert forward_owner_matches(threading.get_ident() + 1, 0) is True


# -- item 7: TraceMultiple as a decorator on several threads at once ------------------------------


def test_trace_multiple_decorator_on_two_threads_at_once_edits_and_records_each_thread():
    """Both threads are inside the decorated function at the same time: each thread's forward
    gets the edit, and ``tm[name]`` read inside the function is that thread's own capture."""
    from pyhook.deephook import TraceMultiple

    torch.manual_seed(5)
    net = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    before = hook_snapshot(net)
    tm = TraceMultiple(net, {"0": (True, False, lambda output, name: output * 0 + 1), "2": ()})
    xs = [torch.randn(2, 4), torch.randn(5, 4)]
    expected = [net[2](net[1](torch.ones(len(x), 3))) for x in xs]  # layer 0 edited to ones
    inside = threading.Barrier(2)

    @tm
    def run(k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        inside.wait()  # both threads have entered before either runs its forward
        y = net(xs[k])
        inside.wait()  # both forwards ran before either reads its capture
        return y, tm["0"].output, tm["2"].output

    results = run_in_threads(run, 2)
    for k, (y, out0, out2) in enumerate(results):
        assert torch.allclose(y, expected[k]), f"thread {k}'s forward missed the edit"
        assert torch.equal(out0, torch.ones(len(xs[k]), 3)), f"thread {k}: layer 0 capture"
        assert torch.equal(out2, y.detach()), f"thread {k} read another thread's capture"
    assert diff(before, hook_snapshot(net)) == []


def test_trace_multiple_decorator_many_threads_many_calls():
    """Eight calls on four threads, overlapping: every call's capture is its own forward's."""
    from pyhook.deephook import TraceMultiple

    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    before = hook_snapshot(net)
    tm = TraceMultiple(net, {"1": (True, True)})
    barrier = threading.Barrier(4, timeout=60)  # a thread that raised must fail the test, not hang it

    @tm
    def run(x: torch.Tensor) -> bool:
        barrier.wait()
        y = net(x)
        barrier.wait()
        with tm:  # a nested entry on the same thread keeps this thread's hooks
            pass
        net(x)
        return torch.equal(tm["1"].output, y.detach()) and torch.equal(
            tm["1"].input, net[0](x).detach()
        )

    def work(k: int) -> list[bool]:
        return [run(torch.full((1, 4), float(k * 10 + i))) for i in range(2)]

    assert run_in_threads(work, 4) == [[True, True]] * 4
    assert diff(before, hook_snapshot(net)) == []


# -- item 8: entering the same Trace / TraceDict object twice, nested ------------------------------


def _net() -> nn.Sequential:
    torch.manual_seed(6)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def test_nested_entry_of_one_trace_keeps_its_hook_until_the_outermost_exit():
    net, x = _net(), torch.randn(2, 4)
    before = hook_snapshot(net)
    want = net[2](net[1](net[0](x) * 0 + 2))  # layer 0 edited, as a hand-computed reference
    t = pyhook.Trace(net, "0", edit_output=lambda output: output * 0 + 2, keep_calls=True)
    with t:
        with t:
            net(x)
        y = net(x)  # after the inner exit: still edited and recorded
        assert torch.equal(y, want) and torch.equal(t.output, torch.full((2, 3), 2.0))
        assert len(t.calls) == 2
        with t as again:
            assert again is t
    assert diff(before, hook_snapshot(net)) == []
    assert torch.equal(net(x), net[2](net[1](net[0](x))))  # closed: no edit any more


def test_nested_entry_of_one_trace_dict_keeps_its_hooks_and_stop():
    net, x = _net(), torch.randn(2, 4)
    before = hook_snapshot(net)
    td = pyhook.TraceDict(net, ["0", "2"], edit_output={"0": lambda output: output + 1}, stop=True)
    with td:
        with td:
            net(x)
            raise AssertionError("stop=True should end the block")  # pragma: no cover
        with td:
            pass
        hooked = net[0](x) + 1
        net(x * 2)  # stops after layer 2; the rest of the outer block is skipped
        raise AssertionError("stop=True should end the block")  # pragma: no cover
    assert torch.equal(td["0"].output, net[0](x * 2) + 1)
    assert torch.equal(td["2"].output, net[2](net[1](net[0](x * 2) + 1)))
    assert hooked.shape == (2, 3)
    assert diff(before, hook_snapshot(net)) == []


def test_trace_entered_on_another_thread_while_active_is_refused_clearly():
    net, x = _net(), torch.randn(2, 4)
    before = hook_snapshot(net)
    t = pyhook.Trace(net, "0")
    errors: list[BaseException] = []

    def other() -> None:
        try:
            with t:
                pass
        except RuntimeError as e:
            errors.append(e)

    with t:
        th = threading.Thread(target=other)
        th.start()
        th.join()
        net(x)  # the owner's entry is intact
        assert torch.equal(t.output, net[0](x))
    assert len(errors) == 1 and "'0'" in str(errors[0]) and "another thread" in str(errors[0])
    assert diff(before, hook_snapshot(net)) == []


def test_trace_made_on_one_thread_and_entered_on_another_records_that_threads_forward():
    """Entering (outermost) registers the hooks for the entering thread."""
    net, x = _net(), torch.randn(2, 4)
    before = hook_snapshot(net)
    box: dict[str, pyhook.Trace] = {}
    th = threading.Thread(target=lambda: box.update(t=pyhook.Trace(net, "0")))
    th.start()
    th.join()
    with box["t"] as t:
        net(x)
    assert torch.equal(t.output, net[0](x))
    assert diff(before, hook_snapshot(net)) == []


def test_nested_entry_of_one_deephook_trace_keeps_its_hook():
    from pyhook.deephook import Trace as DeepTrace

    net, x = _net(), torch.randn(2, 4)
    before = hook_snapshot(net)
    t = DeepTrace(net, "0", edit_output=lambda output, name: output * 0)
    with t:
        with t:
            net(x)
        y = net(x)
        assert torch.equal(y, net[2](net[1](torch.zeros(2, 3))))
        assert torch.equal(t.output, torch.zeros(2, 3))
    assert diff(before, hook_snapshot(net)) == []


# -- issue 16: deep copies and FlexModel threads ------------------------------------------------
def test_a_deep_copy_made_inside_a_block_has_none_of_pyhooks_hooks():
    from pyhook.capture import capture

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    clean = hook_snapshot(model)
    x = torch.randn(3, 4)
    with pyhook.TraceDict(model, ["0", "2"], edit_output=lambda output: output * 0) as td:
        twin = copy.deepcopy(model)
        model(x)
    with pyhook.Trace(model, "1"):
        twin_t = copy.deepcopy(model)
    with capture(model, ["0"]) as rec:
        model(x)
        twin_c = copy.deepcopy(model)
        twin_c(x)  # a copy's forward adds no rows to the capture
    assert rec.batches == 1 and rec["0"].shape[0] == 3
    for copied in (twin, twin_t, twin_c):
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in copied.modules())
        with torch.no_grad():
            assert torch.equal(copied(x), model(x))  # unedited: the same as the model
    assert float(td["2"].output.detach().abs().sum()) == 0.0  # the original was edited
    assert diff(clean, hook_snapshot(model)) == []
    torch.save(twin, io.BytesIO())  # a copy pickles like a plain model


def test_flex_model_per_thread_on_a_shared_model_sees_only_its_own_forwards():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    clean = hook_snapshot(model)
    rounds = 40

    def work(i: int) -> list[bool]:
        ok = []
        for r in range(rounds):
            x = torch.full((1, 4), float(i * rounds + r))
            with torch.no_grad():
                expect = nn.functional.linear(x, model[0].weight, model[0].bias)  # no hook runs
            out: dict[str, list[torch.Tensor]] = {}
            fm = pyhook.FlexModel(model, out)
            fm.register_forward_hook(pyhook.HookFunction("0"))
            with torch.no_grad():
                fm(x)
            fm.restore()
            ok.append(len(out["0"]) == 1 and torch.equal(out["0"][0], expect))
        return ok

    results = run_in_threads(work, 4)
    assert all(all(r) for r in results)
    assert diff(clean, hook_snapshot(model)) == []
