"""Every tool on compiled models (issue 13), with dynamo's default settings.

Each test compares a compiled run against the same tool on the eager model (or a hand-written
reference). Graph-break counts come from ``torch._dynamo.explain`` on a small ``GPT2Model``
(4 blocks) and must equal the count without hooks; recompilations are counted with
``torch._dynamo.utils.counters["stats"]["unique_graphs"]``. Most tests compile with
``backend="eager"`` (dynamo's tracing, guards and graph breaks, without inductor's compile time).
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch._dynamo.testing
from torch import nn
from torch._dynamo.utils import counters

import pyhook
from pyhook import Trace, TraceDict, TraceMultiple
from pyhook._compiled import active_entries
from pyhook.capture import capture
from pyhook.modules import LayerNotFoundError
from pyhook.truncate import TruncatedModule

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

transformers = pytest.importorskip("transformers")

HOWS = ["torch.compile", "module.compile"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    # the point of the issue: nothing here changes dynamo's configuration
    assert torch._dynamo.config.skip_nnmodule_hook_guards is True
    yield
    assert torch._dynamo.config.skip_nnmodule_hook_guards is True
    torch._dynamo.reset()


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def compiled(net: nn.Module, how: str) -> nn.Module:
    """The callable a user runs: the wrapper, or the module itself after ``module.compile()``."""
    if how == "torch.compile":
        return torch.compile(net, backend="eager")
    net.compile(backend="eager")
    return net


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def gpt_parts():
    cfg = transformers.GPT2Config(
        n_layer=4,
        n_embd=32,
        n_head=4,
        vocab_size=64,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2Model(cfg).eval()
    ids = torch.randint(0, 64, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    return model, ids, mask


BLOCKS = ["h.0", "h.1", "h.2", "h.3", "h.0.mlp"]


def double_hidden(output):
    """A traceable edit of a block's output (a tensor, or a tuple starting with one)."""
    if isinstance(output, torch.Tensor):
        return output * 2
    return (output[0] * 2, *output[1:])


def breaks(fn, *args, **kwargs) -> int:
    torch._dynamo.reset()
    return torch._dynamo.explain(fn)(*args, **kwargs).graph_break_count


# -- exact results, per tool ------------------------------------------------------------------
@pytest.mark.parametrize("how", HOWS)
def test_trace_on_a_compiled_model_matches_eager(how):
    net = mlp()
    x = torch.randn(3, 4)
    with torch.no_grad():
        h0 = net[0](x)
        plain = net(x)
    runner = compiled(net, how)
    runner(x)  # compiled before any tracer exists: the tracer must still be seen
    with Trace(
        runner, "0", retain_input=True, clone=True, edit_output=lambda output: output + 1
    ) as t:
        y = runner(x)
    with torch.no_grad():
        assert torch.equal(t.input, x)
        assert torch.allclose(t.output, h0 + 1)
        assert torch.allclose(y, net[2](torch.relu(h0 + 1)))
        # the edit is gone after exit (never a stale compiled edit)
        assert torch.allclose(runner(x), plain)
    assert active_entries(net) == 0


@pytest.mark.parametrize("how", HOWS)
def test_tracedict_and_its_stop_on_a_compiled_model_match_eager(how):
    net = mlp()
    x, x2 = torch.randn(3, 4), torch.randn(3, 4)
    with TraceDict(net, ["0", "2"], detach=True) as ref:
        net(x2)
    runner = compiled(net, how)
    runner(x)
    with TraceDict(runner, ["0", "2"], detach=True) as td:
        y = runner(x2)
    assert torch.equal(td["0"].output, ref["0"].output)
    assert torch.equal(td["2"].output, ref["2"].output) and torch.equal(y, ref["2"].output)
    ran = []
    with TraceDict(runner, ["0"], stop=True) as td:
        runner(x2)
        ran.append("after the forward")  # skipped: the stop ends the block
    assert ran == [] and torch.equal(td["0"].output, ref["0"].output)
    with Trace(runner, "2", stop=True) as t:
        runner(x2)
        ran.append("after the forward")
    assert ran == [] and torch.equal(t.output, ref["2"].output)
    assert active_entries(net) == 0


def test_nested_stops_are_owned_on_a_compiled_model():
    """An inner tracer's stop is not swallowed by an outer one, and vice versa (as in eager)."""
    net = mlp()
    x = torch.randn(2, 4)
    runner = torch.compile(net, backend="eager")
    with Trace(runner, "2") as outer:
        with Trace(runner, "0", stop=True) as inner:
            runner(x)
        assert outer.__dict__.get("output") is None  # layer 2 never ran
        runner(x)
    with torch.no_grad():
        assert torch.allclose(inner.output, net[0](x))
        assert torch.allclose(outer.output, net(x))
    with pytest.raises(pyhook.StopForward), TraceDict(runner, ["2"]):
        with Trace(runner, "0", stop=True):
            pass
        raise pyhook.StopForward(owner=object())  # someone else's stop passes through
    assert active_entries(net) == 0


@pytest.mark.parametrize("how", HOWS)
def test_trace_multiple_on_a_compiled_model_matches_eager(how):
    net = mlp()
    x = torch.randn(3, 4)
    settings = {"0": (True, True, lambda output, layer_name: output * 2), "2": (True,)}
    with TraceMultiple(net, settings) as ref:
        y_ref = net(x)
    runner = compiled(net, how)
    runner(x)
    with TraceMultiple(runner, settings) as tm:
        y = runner(x)
    assert torch.equal(tm["0"].output, ref["0"].output)
    assert torch.equal(tm["0"].input, x)
    assert torch.equal(tm["2"].output, ref["2"].output) and torch.allclose(y, y_ref)
    assert active_entries(net) == 0


@pytest.mark.parametrize("how", HOWS)
def test_flex_model_hook_functions_on_a_compiled_model_match_eager(how):
    def double(module, x, save_ctx, modules):
        return x * 2

    net = mlp()
    x = torch.randn(3, 4)
    out_ref: dict = {}
    fm = pyhook.FlexModel(net, out_ref)
    fm.register_forward_hook(pyhook.HookFunction("0", editing_function=double))
    y_ref = fm(x)
    fm.restore()
    runner = compiled(net, how)
    runner(x)
    out: dict = {}
    fm = pyhook.FlexModel(runner, out)
    fm.register_forward_hook(pyhook.HookFunction("0", editing_function=double))
    y = fm(x)
    assert torch.allclose(y, y_ref)
    assert torch.equal(out["0"][0], out_ref["0"][0])
    fm.restore()
    with torch.no_grad():
        assert torch.allclose(runner(x), net[2](torch.relu(net[0](x))))
    assert active_entries(net) == 0


def _unmarked_wrapper(net: nn.Module) -> nn.Module:
    """``torch.compile(net)`` as torch before 2.13 leaves it: only the wrapper is marked (the
    GPU machine's 2.11.0 does not forward ``_is_torch_compile`` to the module it wraps)."""
    runner = torch.compile(net, backend="eager")
    net.__dict__.pop("_is_torch_compile", None)
    assert pyhook._hooks.compiled_path(net) is None  # the situation the tools must handle
    return runner


def _tool_outputs(tool: str, model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """What each tool given ``model`` (a wrapper or the eager module) sees of layers 0 and 2."""
    if tool == "Trace":
        with Trace(model, "0") as t:
            model(x)
        return [t.output]
    if tool == "TraceDict":
        with TraceDict(model, ["0", "2"]) as td:
            model(x)
        return [td["0"].output, td["2"].output]
    if tool == "TraceMultiple":
        with TraceMultiple(model, {"0": (True,), "2": (True,)}) as tm:
            model(x)
        return [tm["0"].output, tm["2"].output]
    if tool == "capture":
        with capture(model, ["0", "2"]) as rec:
            model(x)
            model(-x)
        return [rec["0"], rec["2"]]
    if tool == "FlexModel":
        out: dict = {}
        fm = pyhook.FlexModel(model, out)
        fm.register_forward_hook(pyhook.HookFunction("0"))
        fm(x)
        fm.restore()
        return [out["0"][0]]
    assert tool == "TruncatedModule"
    return [TruncatedModule(model, "0")(x)]


@pytest.mark.parametrize(
    "tool", ["Trace", "TraceDict", "TraceMultiple", "capture", "FlexModel", "TruncatedModule"]
)
def test_tools_see_a_wrapper_whose_module_torch_did_not_mark(tool):
    """Found on the GPU machine (torch 2.11): every tool given ``torch.compile(net)`` after a
    warm-up call registered plain hooks on ``net``, which the compiled code ignored (no rows,
    no output). The tools now mark the module they unwrap."""
    net = mlp()
    x = torch.randn(3, 4)
    with torch.no_grad():
        ref = _tool_outputs(tool, net, x)
        runner = _unmarked_wrapper(net)
        runner(x)  # compiled before any tracer: hooks added to net later are not guarded
        got = _tool_outputs(tool, runner, x)
        assert pyhook._hooks.compiled_path(net) == "torch.compile(module)"
        assert len(got) == len(ref)
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r)
        assert active_entries(net) == 0
        torch.testing.assert_close(runner(x), net[2](torch.relu(net[0](x))))  # nothing left


@pytest.mark.parametrize(
    "how", ["torch.compile", pytest.param("module.compile", marks=pytest.mark.slow)]
)
def test_truncated_module_on_a_compiled_model_matches_eager(how, gpt_parts):
    model, ids, _ = gpt_parts
    ref = TruncatedModule(model, "h.1")(ids)
    runner = compiled(model, how)
    try:
        got = TruncatedModule(runner, "h.1")(ids)
        assert torch.equal(got[0], ref[0])
        got = torch.compile(TruncatedModule(model, model.h[1]), backend="eager")(ids)
        assert torch.equal(got[0], ref[0])
        assert active_entries(model) == 0
    finally:
        if how == "module.compile":
            model._compiled_call_impl = None
        pyhook.release_compiled(model)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"to": "device", "mask": "attention_mask"},
        pytest.param({"positions": "last", "mask": "attention_mask"}, marks=pytest.mark.slow),
        pytest.param({"positions": [0, 3], "dtype": torch.float16}, marks=pytest.mark.slow),
        pytest.param({"flatten": False, "positions": slice(2, 5)}, marks=pytest.mark.slow),
    ],
    ids=["host", "device-mask", "last", "positions-dtype", "unflattened"],
)
def test_capture_on_a_compiled_model_matches_eager(options, gpt_parts):
    model, ids, mask = gpt_parts
    with capture(model, BLOCKS, **options) as ref:
        model(input_ids=ids, attention_mask=mask)
        model(input_ids=ids[:1], attention_mask=mask[:1])
    runner = torch.compile(model, backend="eager")
    try:
        with capture(runner, BLOCKS, **options) as rec:  # names as in the eager model
            runner(input_ids=ids, attention_mask=mask)
            runner(input_ids=ids[:1], attention_mask=mask[:1])
        assert rec.layers == ref.layers
        for name in BLOCKS:
            assert [p.shape for p in rec.parts(name)] == [p.shape for p in ref.parts(name)]
            assert torch.equal(rec[name], ref[name]), name
        assert (rec.examples, rec.batches, rec.rows) == (ref.examples, ref.batches, ref.rows)
        assert active_entries(model) == 0
    finally:
        pyhook.release_compiled(model)


def test_capture_to_disk_on_a_compiled_model_matches_eager(tmp_path, gpt_parts):
    model, ids, mask = gpt_parts
    with capture(model, BLOCKS, mask="attention_mask") as ref:
        model(input_ids=ids, attention_mask=mask)
    runner = torch.compile(model, backend="eager")
    try:
        with capture(runner, BLOCKS, out=tmp_path / "c", mask="attention_mask"):
            runner(input_ids=ids, attention_mask=mask)
        stored = pyhook.open_capture(tmp_path / "c")
        for name in BLOCKS:
            assert torch.equal(stored[name].to_tensor(), ref[name])
    finally:
        pyhook.release_compiled(model)


@pytest.mark.parametrize("positions", ["last", [0, 3], slice(0, 9)])
def test_capture_on_a_compiled_model_picks_positions_among_the_annotated_kept_tokens(
    positions, gpt_parts
):
    """``rec.annotate(ids, keep)`` with positions: "last" is the last kept token and a list or
    slice keeps only kept tokens, as on the eager model. The compiled graph picked them by the
    attention mask alone, so the rows were other tokens than the row index and token ids said
    (``last``), or included the tokens ``keep`` excluded (a list or slice)."""
    model, ids, mask = gpt_parts
    keep = mask.bool().clone()
    keep[:, 0] = False  # no BOS
    keep[0, 11] = keep[1, 7] = False  # nor each example's last valid token (an EOS, say)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[2]
    if positions == "last":
        want = [(0, 10), (1, 6)]
    else:
        cols = range(12)[positions] if isinstance(positions, slice) else positions
        want = [(e, p) for e in range(2) for p in cols if keep[e, p]]
    runner = torch.compile(model, backend="eager")
    try:
        with (
            torch.no_grad(),
            capture(runner, "h.1", positions=positions, mask="attention_mask") as rec,
        ):
            for _ in range(2):  # the second batch runs the code compiled for the first
                rec.annotate(ids, keep)
                runner(input_ids=ids, attention_mask=mask)
        want = want + [(e + 2, p) for e, p in want]
        assert rec.row_index.tolist() == [list(w) for w in want]
        assert rec.tokens.tolist() == [int(ids[e % 2, p]) for e, p in want]
        torch.testing.assert_close(rec["h.1"], torch.stack([ref[e % 2, p] for e, p in want]))
        assert active_entries(model) == 0
    finally:
        pyhook.release_compiled(model)


@pytest.mark.parametrize("how", HOWS + ["eager module given"])
def test_a_disk_capture_on_a_compiled_model_traces_nothing_per_forward(tmp_path, how):
    """A batch a disk capture (or a GPU's rows) must finish after each forward is finished in
    eager Python around the compiled call: on the wrapper, or around a module.compile()d
    module's compiled code. The traced commit's call out of the graph (kept for an eager
    module given while its wrapper runs) made dynamo retrace the hook dispatcher's frame on
    every forward (a break inside its loop); a frame the same tracers break every call now
    stays skipped while they do."""
    net = mlp()
    xs = [torch.randn(3, 5, 4) for _ in range(3)]
    with torch.no_grad(), capture(net, ["0", "2"]) as ref:
        for x in xs:
            net(x)
    if how == "module.compile":
        net.compile(backend="eager")
        runner = target = net
    else:
        runner = torch.compile(net, backend="eager")
        target = runner if how == "torch.compile" else net
    impl = net.__dict__.get("_compiled_call_impl")
    try:
        for i in range(3):
            counters.clear()
            with torch.no_grad(), capture(target, ["0", "2"], out=tmp_path / f"c{i}"):
                for x in xs:
                    runner(x)
            stored = pyhook.open_capture(tmp_path / f"c{i}")
            for name in ("0", "2"):
                torch.testing.assert_close(stored[name].to_tensor(), ref[name])
        assert counters["frames"]["total"] == 0  # frames dynamo tried to compile, last block
        if how == "torch.compile":  # the eager module run under a capture of its wrapper:
            with torch.no_grad(), capture(target, ["0"], out=tmp_path / "eager") as rec:
                for i, x in enumerate(xs):
                    net(x)  # no wrapper hook runs: the batch is finished at once all the same
                    assert rec.rows["0"] == (i + 1) * 15
        # the module's compiled call is its own again, also after a forward that raised
        with pytest.raises(RuntimeError), capture(target, ["0"], out=tmp_path / "bad"):
            runner(torch.randn(3, 5))  # wrong width
        assert net.__dict__.get("_compiled_call_impl") is impl
        assert active_entries(net) == 0
    finally:
        if how == "module.compile":
            net._compiled_call_impl = None
        pyhook.release_compiled(net)


@pytest.mark.parametrize("tool", ["Trace(stop=True)", "TruncatedModule"])
def test_stopping_on_a_compiled_model_compiles_nothing_per_call(tool, gpt_parts):
    """A stop inside compiled code, one tracer per call as a loop over batches does it: the
    frames the stop breaks (in a loop dynamo cannot resume) stay skipped while stopping tracers
    run, instead of being retraced every call (~1.2 s a call on this 4-block GPT-2); the
    TruncatedModule's traced entry read a counter that dynamo guarded, so every call
    recompiled (~250 ms). Plain calls afterwards still run compiled code."""
    model, ids, _ = gpt_parts
    with torch.no_grad():
        ref = TruncatedModule(model, "h.1")(ids)
        runner = torch.compile(model, backend="eager")
        runner(ids)

        def stop() -> torch.Tensor:
            if tool == "TruncatedModule":
                return TruncatedModule(runner, "h.1")(ids)
            with Trace(runner, "h.1", stop=True) as t:
                runner(ids)
            return t.output

        try:
            for _ in range(3):  # compiles (and gives up) what it must, once
                stop()
            counters.clear()
            for _ in range(4):
                out = stop()
                hidden = out[0] if isinstance(out, tuple) else out
                assert torch.equal(hidden, ref[0] if isinstance(ref, tuple) else ref)
            assert counters["frames"]["total"] == 0  # nothing traced again
            plain = model(ids).last_hidden_state
            for _ in range(2):
                torch.testing.assert_close(runner(ids).last_hidden_state, plain)
            counters.clear()
            runner(ids)
            assert counters["frames"]["total"] == 0  # plain calls: compiled code, as before
            assert active_entries(model) == 0
            for _ in range(2):
                stop()
            if tool != "TruncatedModule":  # (its graph ends at the point: nothing is given up)
                assert pyhook._compiled._pending  # frames the stops keep breaking stay skipped
            pyhook.release_compiled(model)  # no frame stays marked skip for the stops' sake
            assert not pyhook._compiled._pending
        finally:
            pyhook.release_compiled(model)


# -- no graph breaks of pyhook's making -------------------------------------------------------
def test_graph_breaks_equal_the_hookless_count(gpt_parts):
    model, ids, _ = gpt_parts
    baseline = breaks(model, ids)
    store: dict = {}
    handles = [
        model.get_submodule(n).register_forward_hook(
            lambda m, a, o, n=n: store.__setitem__(n, o[0].clone())
        )
        for n in BLOCKS
    ]
    try:
        assert breaks(model, ids) == baseline  # a plain hook keeping a clone: no break either
    finally:
        for h in handles:
            h.remove()
    runner = torch.compile(model, backend="eager")
    try:
        with capture(runner, BLOCKS):
            assert breaks(model, ids) == baseline
        with capture(runner, BLOCKS, to="device", positions="last"):
            assert breaks(model, ids) == baseline
        with TraceDict(runner, BLOCKS, clone=True, detach=True):
            assert breaks(model, ids) == baseline
        with Trace(runner, "h.1", edit_output=double_hidden):
            assert breaks(model, ids) == baseline
        with TraceMultiple(runner, {"h.0": (True, True), "h.2": ()}):
            assert breaks(model, ids) == baseline
        assert breaks(TruncatedModule(model, "h.2"), ids) == baseline
    finally:
        pyhook.release_compiled(model)


def test_a_stop_inside_compiled_code_is_one_break_and_skips_the_rest():
    net = mlp()
    x = torch.randn(2, 4)
    runner = torch.compile(net, backend="eager")
    runner(x)
    compiled_graphs = torch._dynamo.testing.CompileCounter()
    runner = torch.compile(net, backend=compiled_graphs)
    ran = []
    with Trace(runner, "0", stop=True) as t, Trace(runner, "2") as later:
        runner(x)
        ran.append("after the forward")
    assert ran == [] and later.__dict__.get("output") is None  # layer 2 never ran
    with torch.no_grad():
        assert torch.allclose(t.output, net[0](x))
    # one graph, up to the stop (the raise is the one graph break); nothing compiled after it
    assert compiled_graphs.frame_count == 1
    assert sum(counters["graph_break"].values()) >= 1


# -- no recompilation on re-entry -------------------------------------------------------------
def test_reentry_compiles_nothing_new_and_a_change_compiles_once(gpt_parts):
    model, ids, _ = gpt_parts
    runner = torch.compile(model, backend="eager")
    try:
        runner(ids)
        for make in (
            lambda: capture(runner, BLOCKS),
            lambda: TraceDict(runner, BLOCKS, clone=True),
            lambda: Trace(runner, "h.1", detach=True),
        ):
            with make():
                runner(ids)
            before = graphs()
            for _ in range(3):
                with make():
                    runner(ids)
                    runner(ids)
            assert graphs() == before
        runner(ids)  # no tracer (compiled once more: the dispatchers now exist)
        before = graphs()
        runner(ids)
        with capture(runner, ["h.0"]):  # other layers: one new graph ...
            runner(ids)
        assert graphs() == before + 1
        with capture(runner, ["h.0"]):  # ... once
            runner(ids)
        with Trace(runner, "h.1", detach=True):  # and the earlier entries are still cached
            runner(ids)
        assert graphs() == before + 1
    finally:
        pyhook.release_compiled(model)


def test_an_edit_function_is_part_of_the_cache_key():
    net = mlp()
    x = torch.randn(2, 4)
    runner = torch.compile(net, backend="eager")

    def plus(output):
        return output + 1

    outs = []
    for fn in (plus, plus, lambda output: output * 0):
        with Trace(runner, "0", edit_output=fn) as t:
            runner(x)
        outs.append(t.output)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[2], torch.zeros_like(outs[2]))


# -- reliability: threads, bad input, removal ---------------------------------------------------
def test_thread_isolation_on_a_compiled_model():
    net = mlp()
    x = torch.randn(2, 4)
    runner = torch.compile(net, backend="eager")
    with torch.no_grad():
        plain = net(x)
    results: dict = {}

    def other_thread():
        results["y"] = runner(x)  # not traced, not edited: its own compiled code
        with Trace(runner, "0", edit_output=lambda output: output * 0) as t:
            results["edited"] = runner(x)
        results["t"] = t.output

    with Trace(runner, "0", edit_output=lambda output: output + 1) as mine:
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        y = runner(x)
    with torch.no_grad():
        assert torch.allclose(results["y"], plain)
        assert torch.equal(results["t"], torch.zeros(2, 8))
        assert torch.allclose(results["edited"], net[2](torch.zeros(2, 8)))
        assert torch.allclose(mine.output, net[0](x) + 1)
        assert torch.allclose(y, net[2](torch.relu(net[0](x) + 1)))
    assert active_entries(net) == 0


def test_bad_input_keeps_named_errors_and_registers_nothing(gpt_parts):
    model, ids, _ = gpt_parts
    runner = torch.compile(model, backend="eager")
    try:
        with pytest.raises(LayerNotFoundError, match=r"h\.9"):
            capture(runner, ["h.0", "h.9"])
        with pytest.raises(LayerNotFoundError):
            Trace(runner, "_orig_mod.h.0")  # the wrapper's own name is not a layer of the model
        with pytest.raises(TypeError, match="edit_output"):
            Trace(runner, "h.0", edit_output=3)
        with (
            pytest.raises(ValueError, match=r"h\.1.*positions"),
            capture(runner, ["h.1"], positions=[40]),
        ):
            runner(ids)
        assert active_entries(model) == 0
        with capture(runner, ["h.1"]) as rec:  # still usable afterwards
            runner(ids)
        assert rec["h.1"].shape == (24, 32)
    finally:
        pyhook.release_compiled(model)


def test_release_removes_the_dispatchers_and_recompiles():
    net = mlp()
    x = torch.randn(2, 4)
    runner = torch.compile(net, backend="eager")
    with Trace(runner, "0"):
        runner(x)
    assert len(net[0]._forward_hooks) == 1  # the dispatcher stays for the next tracer
    pyhook.release_compiled(runner)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in net.modules())
    with torch.no_grad():
        assert torch.allclose(runner(x), net(x))
    with Trace(runner, "0") as t:  # installed again on demand
        runner(x)
    with torch.no_grad():
        assert torch.allclose(t.output, net[0](x))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("to", ["host", "device"])
def test_capture_under_cuda_graphs_matches_eager(to):  # pragma: no cover - no GPU here
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).cuda()
    x = torch.randn(4, 10, 16, device="cuda")
    xs = [x, x * 0.5 + 1, -x]  # distinct batches: a replay must not overwrite earlier rows
    with torch.no_grad():
        with capture(net, ["0", "2"]) as ref:
            for xb in xs:
                net(xb)
        runner = torch.compile(net, mode="reduce-overhead")
        for _ in range(3):
            runner(x)
        for _ in range(2):  # the second block replays the graphs the first one recorded
            with capture(runner, ["0", "2"], to=to) as rec:
                for xb in xs:
                    runner(xb)
            for name in ("0", "2"):
                # inductor's kernels are not eager's: equal to rounding, not bit for bit
                torch.testing.assert_close(rec[name].cpu(), ref[name].cpu())
        assert active_entries(net) == 0


# -- inductor -----------------------------------------------------------------------------------
def test_capture_and_trace_with_inductor_match_eager():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(2, 5, 8)
    with torch.no_grad(), capture(net, ["0", "1", "2"], positions="last") as ref:
        net(x)
    runner = torch.compile(net)  # inductor
    with torch.no_grad():
        runner(x)
        with capture(runner, ["0", "1", "2"], positions="last") as rec:
            runner(x)
        with Trace(runner, "1", edit_output=lambda output: -output) as t:
            y = runner(x)
        expected = net[2](-net[1](net[0](x)))
    for name in ("0", "1", "2"):
        torch.testing.assert_close(rec[name], ref[name])
    torch.testing.assert_close(t.output, -net[1](net[0](x)).detach())
    torch.testing.assert_close(y, expected)


def test_inductor_keeps_the_native_clone_op():
    """pyhook::clone_many has a fake kernel: inductor compiles a graph that calls it."""
    from torch._inductor.utils import run_and_get_code

    if not pyhook.native_available():
        pytest.skip("the native core is not built")

    def f(x):
        (a,) = torch.ops.pyhook.clone_many([x * 2])
        return a + 1

    x = torch.randn(4, 3)
    out, code = run_and_get_code(torch.compile(f, fullgraph=True), x)
    assert torch.equal(out, x * 2 + 1)
    assert any("pyhook.clone_many" in c for c in code)


def test_a_model_with_dispatchers_can_be_copied_and_saved(tmp_path):
    import copy

    net = mlp()
    x = torch.randn(2, 4)
    runner = torch.compile(net, backend="eager")
    with Trace(runner, "0"):
        runner(x)
    twin = copy.deepcopy(net)
    torch.save(net, tmp_path / "net.pt")
    loaded = torch.load(tmp_path / "net.pt", weights_only=False)
    with torch.no_grad():
        assert torch.equal(twin(x), net(x)) and torch.equal(loaded(x), net(x))
    pyhook.release_compiled(twin)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in twin.modules())


# -- issue 16: a break inside compiled code must not cost later calls -------------------------
def counting(calls: list[int]):
    """A dynamo backend that counts graph executions (one list shared by its graphs)."""

    def backend(gm, _example_inputs):
        def run(*args):
            calls[0] += 1
            return gm.forward(*args)

        return run

    return backend


def graphs_per_call(fn, *args) -> int:
    calls = fn.calls
    before = calls[0]
    fn(*args)
    return calls[0] - before


@pytest.mark.parametrize("kind", ["stop", "raising edit", "retain_grad"])
def test_a_break_inside_compiled_code_leaves_later_plain_calls_compiled(kind, gpt_parts):
    model, ids, _ = gpt_parts
    other = transformers.GPT2Model(model.config).eval()  # never traced: shares dynamo's code
    calls = [0]
    backend = counting(calls)  # one backend, as torch.compile's default: dynamo's cache is shared
    runner, bystander = (torch.compile(m, backend=backend) for m in (model, other))
    runner.calls = bystander.calls = calls
    with torch.no_grad():
        runner(ids), bystander(ids)
        with Trace(runner, "h.1"):  # installs the dispatchers (drops compiled code once)
            runner(ids)
        assert graphs_per_call(runner, ids) == 1 and graphs_per_call(bystander, ids) == 1
        if kind == "stop":
            with Trace(runner, "h.1", stop=True) as t:
                runner(ids)
            assert t.output is not None
        elif kind == "raising edit":
            with pytest.raises(ZeroDivisionError), Trace(runner, "h.1", edit_output=lambda: 1 / 0):
                runner(ids)
    if kind == "retain_grad":
        with Trace(runner, "h.1", retain_grad=True) as t:
            runner(ids).last_hidden_state.sum().backward()
        kept = t.output if isinstance(t.output, torch.Tensor) else t.output[0]
        assert kept.grad is not None
    with torch.no_grad():
        # the compiled code of before runs again: one graph per plain call, for both models
        assert [graphs_per_call(runner, ids) for _ in range(2)] == [1, 1]
        assert graphs_per_call(bystander, ids) == 1


@pytest.mark.parametrize("how", HOWS)
def test_a_stop_on_a_compiled_sequential_leaves_later_plain_calls_compiled(how):
    # A stop inside nn.Sequential's loop cannot resume in dynamo: it compiles, for the
    # wrapper function every torch.compile'd nn.Sequential shares, a version that calls the
    # model eagerly and guards only the model's type. pyhook limits that version to the
    # tracer state of the stop, so plain calls run their compiled graph again.
    calls = [0]
    x = torch.randn(2, 4)
    backend = counting(calls)  # one backend, as torch.compile's default: dynamo's cache is shared

    def counted(net):
        if how == "torch.compile":
            run = torch.compile(net, backend=backend)
        else:
            net.compile(backend=backend)
            run = net
        run.calls = calls
        return run

    net, other = mlp(), mlp()
    runner, bystander = counted(net), counted(other)  # bystander: never traced
    with torch.no_grad():
        before = [graphs_per_call(runner, x), graphs_per_call(bystander, x)]
        if how == "torch.compile":
            assert before == [1, 1]  # (module.compile() of a torch.nn-only model: no graph)
        with Trace(runner, "0"):  # installs the dispatcher (drops compiled code once)
            runner(x)
        assert graphs_per_call(runner, x) == before[0]
        for _ in range(2):  # the second stop reuses the first one's compiled code
            ran = []
            with Trace(runner, "0", stop=True) as t:
                runner(x)
                ran.append("after the forward")
            assert ran == [] and torch.allclose(t.output, net[0](x))
            assert [graphs_per_call(runner, x) for _ in range(2)] == [before[0]] * 2
        assert [graphs_per_call(bystander, x) for _ in range(2)] == [before[1]] * 2
        fresh = counted(mlp())  # compiled after the stop
        assert [graphs_per_call(fresh, x) for _ in range(2)] == [before[1]] * 2


def test_a_stop_on_a_compiled_sequential_with_other_threads_alive_warns_and_release_recovers():
    # Changing the guards of compiled code another thread may be checking is not safe: with
    # other live threads pyhook leaves dynamo's version as it is and says so, once.
    calls = [0]
    x = torch.randn(2, 4)
    net = mlp()
    runner = torch.compile(net, backend=counting(calls))
    runner.calls = calls
    with torch.no_grad():
        with Trace(runner, "0"):
            runner(x)
        assert graphs_per_call(runner, x) == 1
        idle = threading.Event()
        worker = threading.Thread(target=idle.wait)
        worker.start()
        try:
            with pytest.warns(RuntimeWarning, match="Sequential.*release_compiled"):
                with Trace(runner, "0", stop=True):
                    runner(x)
        finally:
            idle.set()
            worker.join()
        pyhook.release_compiled(runner)  # the named way back (from one thread)
        assert [graphs_per_call(runner, x) for _ in range(2)] == [1, 1]


@pytest.mark.parametrize("arch", ["Sequential", "GPT2Model"])
def test_code_compiled_for_another_model_of_the_class_does_not_hide_the_tracers(arch, gpt_parts):
    # Dynamo shares compiled code between models of one class (one backend, as torch.compile's
    # default) and does not guard hook dicts that were empty: the code compiled for a model
    # without dispatchers would run for the traced one, without its hooks.
    if arch == "Sequential":
        net, other = mlp(), mlp()
        x, layers = torch.randn(2, 4), ["0", "2"]
    else:
        net, x, _ = gpt_parts
        other = transformers.GPT2Model(net.config).eval()
        layers = ["h.0", "h.1"]
    runner, bystander = (torch.compile(m, backend="eager") for m in (net, other))

    def first(out):
        return out if isinstance(out, torch.Tensor) else out[0]

    with torch.no_grad():
        pyhook.prepare_compiled(runner, layers)
        expected = first(net(x))
        bystander(x)  # compiled now: the newest code for this class, no dispatchers
        with Trace(runner, layers[1], edit_output=double_hidden) as t:
            edited = first(runner(x))
        assert not torch.equal(edited, expected) and t.output is not None
        bystander(x)
        ran = []
        with Trace(runner, layers[0], stop=True) as t:
            runner(x)
            ran.append("after the forward")
        assert ran == [] and t.output is not None
        bystander(x)
        assert torch.equal(first(runner(x)), expected)  # no tracer: the plain result
    pyhook.release_compiled(runner)
    assert all("forward" not in m.__dict__ for m in net.modules())


def test_bad_options_on_a_compiled_model_raise_before_any_dispatcher_or_cache_drop():
    net = mlp()
    calls = [0]
    runner = torch.compile(net, backend=counting(calls))
    runner.calls = calls
    x = torch.randn(2, 4)
    runner(x)
    compiled_before = counters["stats"]["unique_graphs"]
    for bad in ({"edit_output": 5}, {"clone": "yes"}, {"retain_grad": 2}):
        with pytest.raises(TypeError, match=next(iter(bad))):
            Trace(runner, "0", **bad)
        with pytest.raises(TypeError, match=next(iter(bad))):
            TraceDict(runner, ["0", "2"], **bad)
    assert all("_pyhook_dispatch" not in m.__dict__ for m in net.modules())
    assert graphs_per_call(runner, x) == 1  # the compiled code was kept: nothing recompiled
    assert counters["stats"]["unique_graphs"] == compiled_before


def test_dropping_compiled_code_with_other_threads_alive_is_refused_not_a_crash():
    net = mlp()
    runner = torch.compile(net, backend="eager")
    x = torch.randn(2, 4)
    runner(x)  # compiled code exists: a dispatcher installed now must drop it
    started, release = threading.Event(), threading.Event()

    def plain_calls():
        started.set()
        while not release.is_set():
            runner(x)

    worker = threading.Thread(target=plain_calls)
    worker.start()
    try:
        started.wait()
        with pytest.raises(pyhook.CompiledModelError, match="prepare_compiled"):
            Trace(runner, "0")
        assert all("_pyhook_dispatch" not in m.__dict__ for m in net.modules())
    finally:
        release.set()
        worker.join()
    # the documented way: install the dispatchers from one thread first, then trace anywhere
    pyhook.prepare_compiled(runner)
    out = {}

    def trace_in_thread(i):
        xi = x + i
        with Trace(runner, "0") as t:
            runner(xi)
        out[i] = torch.equal(t.output, net[0](xi))

    threads = [threading.Thread(target=trace_in_thread, args=(i,)) for i in range(3)]
    with torch.no_grad():
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert out == {0: True, 1: True, 2: True}


def test_idle_executor_threads_do_not_block_tracing_a_compiled_model():
    """Libraries leave ThreadPoolExecutor workers behind (fsspec, datasets, tokenizers): idle in
    their queue they run no compiled code, so tracing may drop dynamo's code; a worker that is
    running the model is still a reason to refuse."""
    from concurrent.futures import ThreadPoolExecutor

    net = mlp()
    runner = torch.compile(net, backend="eager")
    x = torch.randn(2, 4)
    runner(x)
    pool = ThreadPoolExecutor(2)
    try:
        pool.submit(lambda: None).result()  # a live, idle worker
        with Trace(runner, "0") as t:
            runner(x)
        assert torch.equal(t.output, net[0](x).detach())
        pyhook.release_compiled(runner)
        runner(x)  # compiled code exists again
        started, release = threading.Event(), threading.Event()

        def busy():
            started.set()
            while not release.is_set():
                runner(x)

        job = pool.submit(busy)
        started.wait()
        try:
            with pytest.raises(pyhook.CompiledModelError, match="prepare_compiled"):
                Trace(runner, "0")
        finally:
            release.set()
            job.result()
    finally:
        pool.shutdown()


def test_extend_tools_accept_eager_names_on_a_torch_compile_wrapper():
    from pyhook.extend import ActivationMapGrabber, ModelExtender, ModelStump

    net = mlp()
    x = torch.randn(3, 4)
    with torch.no_grad():
        h0, y = net[0](x), net(x)
    runner = torch.compile(net, backend="eager")
    runner(x)
    with torch.no_grad():
        with ActivationMapGrabber(runner, ["0", "2"]) as grabber:
            out, acts = grabber(x)
        assert torch.equal(out, y) and torch.equal(acts["0"], h0) and torch.equal(acts["2"], y)
        with ModelStump(runner, "0") as stump:
            assert torch.equal(stump(x), h0)
        probe = nn.Linear(8, 1)
        with ModelExtender(runner, {"0": {"probe": probe}}) as ext:
            out, ext_outs = ext(x)
        assert torch.equal(out, y) and torch.equal(ext_outs["probe"], probe(h0))
    assert active_entries(net) == 0


@pytest.mark.parametrize("how", HOWS)
def test_handles_on_a_compiled_model_are_removable_handles(how):
    from torch.utils.hooks import RemovableHandle

    net = mlp()
    model = compiled(net, how)
    with Trace(model, "0") as t, Trace(model, "2") as t2:
        h, h2 = t.registered_hook, t2.registered_hook
        assert isinstance(h, RemovableHandle) and h.id != h2.id
        assert h.id in h.hooks_dict_ref() and h2.id in h2.hooks_dict_ref()
        assert h.id not in h2.hooks_dict_ref() and h.extra_dict_ref == ()
        model(torch.ones(1, 4))
    assert h.id not in h.hooks_dict_ref() and h2.id not in h2.hooks_dict_ref()
    pyhook.release_compiled(net)
