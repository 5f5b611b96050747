"""Guarantee 7: bad input everywhere. Each public entry point gets wrong types, unknown names,
empty collections and out-of-range values; the error names the argument (or the layer) and the
expected form, and nothing stays registered on the model afterwards.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _hygiene import diff, hook_snapshot
from torch import nn

import pyhook
from pyhook import deephook, extend, flex, truncate

# `pyhook.capture` is the function; the module is reached through the import system
capture_mod = importlib.import_module("pyhook.capture")


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


M = net()  # shared model: every case must leave its hooks exactly as they were
X = torch.ones(1, 4)
NOT_A_MODEL = "not a model"

# (entry point, call, exception types, regex the message must match)
Case = tuple[str, Callable[[], Any], tuple[type[BaseException], ...], str]
CASES: list[Case] = [
    # --- nethook Trace / TraceDict
    (
        "Trace",
        lambda: pyhook.Trace(NOT_A_MODEL, "0"),
        (TypeError,),
        "module must be a torch.nn.Module",
    ),
    ("Trace", lambda: pyhook.Trace(M, 3), (TypeError,), "layer must be a dotted module name"),
    ("Trace", lambda: pyhook.Trace(M, "nope"), (LookupError,), "nope"),
    ("Trace", lambda: pyhook.Trace(M, "0.weight"), (LookupError,), "0.weight"),
    (
        "Trace",
        lambda: pyhook.Trace(M, "0", clone="yes"),
        (TypeError,),
        "clone for layer '0' must be a bool",
    ),
    (
        "Trace",
        lambda: pyhook.Trace(M, "0", stop=2),
        (TypeError,),
        "stop for layer '0' must be a bool",
    ),
    (
        "Trace",
        lambda: pyhook.Trace(M, "0", edit_output=3),
        (TypeError,),
        "edit_output for layer '0' must be callable",
    ),
    ("Trace", lambda: pyhook.Trace(M, nn.Linear(1, 1)), (ValueError,), "not a submodule"),
    (
        "TraceDict",
        lambda: pyhook.TraceDict(M, "0"),
        (TypeError,),
        "layers must be a list of dotted layer names",
    ),
    # TransformerLens-shaped calls (pyhook.lens)
    (
        "run_with_cache",
        lambda: pyhook.run_with_cache(M, X, names_filter=["0", "nope"]),
        (LookupError,),
        "nope",
    ),
    (
        "run_with_cache",
        lambda: pyhook.run_with_cache(M, X, names_filter=3),
        (TypeError,),
        "names_filter must be",
    ),
    (
        "run_with_cache",
        lambda: pyhook.run_with_cache(M, X, names_filter=["0"], incl_bwd=True),
        (ValueError,),
        "output.loss",
    ),
    (
        "run_with_cache",
        lambda: pyhook.run_with_cache(M, X, names_filter=["0"], pos_slice=1.5),
        (TypeError,),
        "pos_slice must be",
    ),
    (
        "run_with_cache",
        lambda: pyhook.run_with_cache(M, X, names_filter=["0"], stop_at_layer="2"),
        (TypeError,),
        "stop_at_layer must be",
    ),
    (
        "run_with_hooks",
        lambda: pyhook.run_with_hooks(M, X, fwd_hooks=[("0", 3)]),
        (TypeError,),
        "must be callable",
    ),
    (
        "run_with_hooks",
        lambda: pyhook.run_with_hooks(M, X, fwd_hooks=["0"]),
        (TypeError,),
        r"list of \(name, fn\) pairs",
    ),
    (
        "run_with_hooks",
        lambda: pyhook.run_with_hooks(M, X, fwd_hooks=[(0, print)]),
        (TypeError,),
        "hook names must be str",
    ),
    (
        "hooks",
        lambda: pyhook.hooks(M, bwd_hooks=[("nope.*", print)]).__enter__(),
        (LookupError,),
        "matches no",
    ),
    ("TraceDict", lambda: pyhook.TraceDict(M, None), (TypeError,), "layers must be a list"),
    ("TraceDict", lambda: pyhook.TraceDict(M, [0]), (TypeError,), "layers must hold layer names"),
    ("TraceDict", lambda: pyhook.TraceDict(M, ["0", "nope"]), (LookupError,), "nope"),
    (
        "TraceDict",
        lambda: pyhook.TraceDict(M, ["0"], clone={"2": True}),
        (KeyError,),
        "clone names layers that are not traced",
    ),
    (
        "TraceDict",
        lambda: pyhook.TraceDict(M, ["0"], retain_input={"0": "x"}),
        (TypeError,),
        "retain_input for layer '0'",
    ),
    (
        "TraceDict",
        lambda: pyhook.TraceDict(NOT_A_MODEL, ["0"]),
        (TypeError,),
        "module must be a torch.nn.Module",
    ),
    # --- module helpers
    ("get_module", lambda: pyhook.get_module(M, "nope"), (LookupError,), "nope"),
    ("get_module", lambda: pyhook.get_module(M, 1), (TypeError,), "str"),
    ("get_parameter", lambda: pyhook.get_parameter(M, "0.nope"), (LookupError,), "0.nope"),
    (
        "get_parameter",
        lambda: pyhook.get_parameter(M, None),
        (TypeError,),
        "parameter name must be a str",
    ),
    (
        "replace_module",
        lambda: pyhook.replace_module(M, "0", "x"),
        (TypeError,),
        "new_module must be an nn.Module",
    ),
    ("replace_module", lambda: pyhook.replace_module(M, "nope", nn.ReLU()), (LookupError,), "nope"),
    (
        "set_requires_grad",
        lambda: pyhook.set_requires_grad(True, "x"),
        (TypeError,),
        "Module|Tensor|tensor|module",
    ),
    (
        "subsequence",
        lambda: pyhook.subsequence(M, first_layer="0", after_layer="1"),
        (ValueError,),
        "first_layer or after_layer",
    ),
    (
        "subsequence",
        lambda: pyhook.subsequence(M, single_layer="0", last_layer="2"),
        (ValueError,),
        "single_layer",
    ),
    (
        "subsequence",
        lambda: pyhook.subsequence(M, first_layer="nope"),
        (ValueError, LookupError),
        "nope",
    ),
    (
        "hierarchical_subsequence",
        lambda: pyhook.hierarchical_subsequence(M, first="0", last=None, after="1", upto=None),
        (ValueError,),
        "exclusive",
    ),
    (
        "invoke_with_optional_args",
        lambda: pyhook.invoke_with_optional_args(lambda a, b: a, a=1),
        (TypeError,),
        "b",
    ),
    # --- backends
    (
        "recursive_copy",
        lambda: pyhook.recursive_copy(torch.ones(2), True, False, True).backward(),
        (RuntimeError,),
        "grad",
    ),  # non-scalar backward: torch's own error passes through
    (
        "set_backend",
        lambda: pyhook.set_backend("cuda"),
        (ValueError,),
        "backend name must be one of 'native', 'reference', 'auto'",
    ),
    ("set_backend", lambda: pyhook.set_backend(None), (ValueError, TypeError), "backend"),
    (
        "use_backend",
        lambda: pyhook.use_backend("fast").__enter__(),
        (ValueError,),
        "backend name must be one of",
    ),
    (
        "format_info",
        lambda: pyhook.format_info(["torch"]),
        (TypeError,),
        "facts must be a non-empty dict",
    ),
    ("format_info", lambda: pyhook.format_info({}), (TypeError,), "facts must be a non-empty dict"),
    ("set_pool_limit", lambda: pyhook.set_pool_limit(-1), (ValueError,), "nbytes must be >= 0"),
    ("set_pool_limit", lambda: pyhook.set_pool_limit("1GB"), (TypeError,), "nbytes"),
    (
        "release_compiled",
        lambda: pyhook.release_compiled("model"),
        (TypeError,),
        "module must be a torch.nn.Module",
    ),
    (
        "prepare_compiled",
        lambda: pyhook.prepare_compiled("model"),
        (TypeError,),
        "model must be a torch.nn.Module",
    ),
    # --- Paired: two models, one store
    ("Paired", lambda: pyhook.Paired(a=M), (ValueError,), "at least two named models"),
    (
        "Paired",
        lambda: pyhook.Paired(**{"a/b": M, "c": net()}),
        (ValueError,),
        "cannot contain '/'",
    ),
    ("Paired", lambda: pyhook.Paired(a=M, b=M), (ValueError,), "same module object"),
    (
        "Paired",
        lambda: pyhook.Paired(a=M, b=3),
        (TypeError,),
        "model 'b' must be a torch.nn.Module",
    ),
    (
        "prepare_compiled",
        lambda: pyhook.prepare_compiled(M, "0"),
        (TypeError,),
        "layers must be a list",
    ),
    ("prepare_compiled", lambda: pyhook.prepare_compiled(M, ["nope"]), (LookupError,), "nope"),
    # --- deephook
    (
        "deephook.Trace",
        lambda: deephook.Trace(NOT_A_MODEL, "0"),
        (TypeError,),
        "model must be a torch.nn.Module",
    ),
    (
        "deephook.Trace",
        lambda: deephook.Trace(M, 0),
        (TypeError,),
        "layer_name must be a dotted module name",
    ),
    ("deephook.Trace", lambda: deephook.Trace(M, "nope"), (LookupError,), "nope"),
    ("deephook.Trace", lambda: deephook.Trace(M, "0", edit_output=1), (TypeError,), "edit"),
    (
        "TraceMultiple",
        lambda: deephook.TraceMultiple(M, ["0"]),
        (TypeError,),
        "layer_settings must be a dict",
    ),
    (
        "TraceMultiple",
        lambda: deephook.TraceMultiple(M, {"0": "yes"}),
        (TypeError,),
        "settings for layer '0' must be a tuple",
    ),
    (
        "TraceMultiple",
        lambda: deephook.TraceMultiple(M, {"0": (1, 1, None, 1)}),
        (TypeError,),
        "0 to 3 items",
    ),
    ("TraceMultiple", lambda: deephook.TraceMultiple(M, {"nope": ()}), (LookupError,), "nope"),
    # --- truncate
    (
        "TruncatedModule",
        lambda: truncate.TruncatedModule(NOT_A_MODEL, "0"),
        (TypeError,),
        "module must be a torch.nn.Module",
    ),
    (
        "TruncatedModule",
        lambda: truncate.TruncatedModule(M, "nope"),
        (ValueError,),
        "truncation_point 'nope'",
    ),
    (
        "TruncatedModule",
        lambda: truncate.TruncatedModule(M, 1),
        (TypeError,),
        "truncation_point must be",
    ),
    (
        "TruncatedModule",
        lambda: truncate.TruncatedModule(M, nn.ReLU()),
        (ValueError,),
        "truncation_point",
    ),
    # --- extend
    (
        "ActivationMapGrabber",
        lambda: extend.ActivationMapGrabber(M, ["nope"]),
        (KeyError, LookupError),
        "nope",
    ),
    (
        "ActivationMapGrabber",
        lambda: extend.ActivationMapGrabber(NOT_A_MODEL, ["0"]),
        (TypeError,),
        "model",
    ),
    (
        "ActivationMapGrabber",
        lambda: extend.ActivationMapGrabber(M, [0]),
        (TypeError, KeyError),
        "0",
    ),
    (
        "HooksHandle",
        lambda: extend.ActivationMapGrabber(M, ["0", "0.weight"]),
        (KeyError, LookupError),
        "0.weight",
    ),
    (
        "dummy_output",
        lambda: extend.dummy_output(M, (2, 4), ["nope"]),
        (KeyError, LookupError),
        "nope",
    ),
    ("dummy_output", lambda: extend.dummy_output(M, (2, 5)), (RuntimeError,), "shape|size|mat"),
    (
        "output_sizes",
        lambda: extend.output_sizes(M, (4,), ["nope"]),
        (KeyError, LookupError),
        "nope",
    ),
    ("output_size", lambda: extend.output_size(M, "four"), (TypeError, ValueError), "size|int"),
    ("ModelStump", lambda: extend.ModelStump(M, "nope"), (KeyError, LookupError), "nope"),
    ("ModelStump", lambda: extend.ModelStump(M, 3), (TypeError, KeyError), "3"),
    (
        "ModelExtender",
        lambda: extend.ModelExtender(M, {"0": {"a.b": nn.ReLU()}}),
        (ValueError, KeyError),
        "a.b",
    ),
    (
        "ModelExtender",
        lambda: extend.ModelExtender(M, {"nope": {"a": nn.ReLU()}}),
        (KeyError, LookupError),
        "nope",
    ),
    (
        "ModelExtender",
        lambda: extend.ModelExtender(M, {"0": {"a": "x"}}),
        (TypeError, ValueError),
        "nn.Module|Module",
    ),
    (
        "ModelExtender",
        lambda: extend.ModelExtender(M, {"0": {"a": nn.ReLU()}, "2": {"a": nn.ReLU()}}),
        (ValueError, KeyError),
        "name: a|'a'",
    ),
    (
        "ExtendedModelStump",
        lambda: extend.ExtendedModelStump(M, "0", 3),
        (ValueError, TypeError),
        "modification",
    ),
    # --- flex
    ("HookFunction", lambda: flex.HookFunction(3), (TypeError,), "module_name must be a str"),
    (
        "HookFunction",
        lambda: flex.HookFunction("0", expected_shape=(-1, 2)),
        (TypeError, ValueError),
        "expected_shape",
    ),
    (
        "HookFunction",
        lambda: flex.HookFunction("0", editing_function=3),
        (TypeError,),
        "editing_function must be callable",
    ),
    (
        "HookFunction",
        lambda: flex.HookFunction("0", unpack_idx="0"),
        (TypeError,),
        "unpack_idx must be an int",
    ),
    ("FlexModel", lambda: flex.FlexModel(NOT_A_MODEL), (TypeError,), "module must be an nn.Module"),
    (
        "FlexModel",
        lambda: flex.FlexModel(M, output_ptr=[]),
        (TypeError,),
        "output_ptr must be a dict",
    ),
    (
        "FlexModel",
        lambda: flex.FlexModel(M, save_on="some"),
        (ValueError,),
        "save_on must be 'first' or 'all'",
    ),
    (
        "FlexModel.register_forward_hook",
        lambda: _flex_register("nope"),
        (LookupError, KeyError, AttributeError, ValueError),
        "nope",
    ),
    (
        "FlexModel.register_forward_hook",
        lambda: _flex_register_wrong_type(),
        (TypeError,),
        "HookFunction",
    ),
    # --- capture store
    ("CaptureJob", lambda: pyhook.CaptureJob(limit=0), (ValueError,), "limit must be >= 1, got 0"),
    ("CaptureJob", lambda: pyhook.CaptureJob(model=3.5), (TypeError,), "model must be a string"),
    ("CaptureJob", lambda: pyhook.CaptureJob(layers=[3]), (TypeError,), "layers must be a list"),
    (
        "CaptureJob",
        lambda: pyhook.CaptureJob(positions="first"),
        (ValueError,),
        "positions must be",
    ),
    ("open_capture", lambda: pyhook.open_capture(3), (TypeError,), "path must be a directory path"),
    (
        "open_capture",
        lambda: pyhook.open_capture("/nonexistent/pyhook"),
        (FileNotFoundError,),
        "does not exist",
    ),
    (
        "verify_capture",
        lambda: pyhook.verify_capture(3),
        (TypeError,),
        "path must be a directory path",
    ),
    (
        "CaptureReader",
        lambda: pyhook.CaptureReader(None),
        (TypeError,),
        "path must be a directory path",
    ),
    ("ShardWriter", lambda: pyhook.ShardWriter(3.5), (TypeError,), "out must be a directory path"),
    ("HostBuffers", lambda: pyhook.HostBuffers(depth=0), (ValueError,), "depth must be an int"),
    ("HostBuffers", lambda: pyhook.HostBuffers(pin="no"), (TypeError,), "pin must be True"),
    # --- capture
    (
        "capture",
        lambda: capture_mod.capture(M, "0", buffers=[]),
        (TypeError,),
        "buffers must be a pyhook.HostBuffers",
    ),
    (
        "capture",
        lambda: capture_mod.capture(M, "0", to="device", buffers=pyhook.HostBuffers(pin=False)),
        (ValueError,),
        "buffers= holds rows in host memory",
    ),
    (
        "capture",
        lambda: capture_mod.capture(NOT_A_MODEL, "0"),
        (TypeError,),
        "model must be a torch.nn.Module",
    ),
    (
        "capture",
        lambda: capture_mod.capture(M, "nope*"),
        (LookupError, ValueError, KeyError),
        "nope",
    ),
    ("capture", lambda: capture_mod.capture(M, []), (ValueError, TypeError, LookupError), "layer"),
    (
        "capture",
        lambda: capture_mod.capture(M, "0", to="cloud"),
        (ValueError,),
        "to must be 'device', 'host' or 'disk'",
    ),
    (
        "capture",
        lambda: capture_mod.capture(M, "0", positions="first"),
        (ValueError,),
        "positions must be",
    ),
    ("capture", lambda: capture_mod.capture(M, "0", mask=3), (TypeError,), "mask must be"),
    (
        "capture",
        lambda: capture_mod.capture(M, "0", flatten="no"),
        (TypeError,),
        "flatten must be a bool",
    ),
    (
        "capture",
        lambda: capture_mod.capture(M, "0", dtype="float7"),
        (ValueError, TypeError),
        "dtype",
    ),
    # --- pyhook.stream (refused before the producer starts)
    ("stream", lambda: pyhook.stream(NOT_A_MODEL, [], "0"), (TypeError,), "model must be"),
    ("stream", lambda: pyhook.stream(M, [], "9"), (LookupError, ValueError), "'9'"),
    (
        "stream",
        lambda: pyhook.stream(M, [], "0", batch_size=8, buffer_rows=4),
        (ValueError,),
        "buffer_rows",
    ),
    ("stream", lambda: pyhook.stream(M, "corpus.txt", "0"), (TypeError,), "source must be"),
    # --- dictionaries spliced in (pyhook.splice)
    ("splice", lambda: pyhook.splice(M, {}), (pyhook.DictionaryError,), "non-empty dict"),
    (
        "Splice",
        lambda: pyhook.Splice(M, {"resid_post.0": nn.ReLU()}),
        (pyhook.DictionaryError,),
        "ReLU is not a dictionary",
    ),
    (
        "evaluate_dictionaries",
        lambda: pyhook.evaluate_dictionaries(M, {"0": nn.ReLU()}, [], spliced=["1"]),
        (pyhook.DictionaryError,),
        "spliced names '1'",
    ),
    ("linear_parts", lambda: pyhook.linear_parts(nn.ReLU()), (pyhook.DictionaryError,), "ReLU"),
    # --- steering (pyhook.steering)
    (
        "Steer",
        lambda: pyhook.Steer("0", torch.randn(3), op="scale"),
        (pyhook.SteeringError,),
        r"Steer\('0', op='scale'\): op must be one of add, ablate, cap, replace",
    ),
    (
        "Steer",
        lambda: pyhook.Steer("0", torch.randn(3), generated=(3, 1)),
        (pyhook.SteeringError,),
        r"generated=\(3, 1\) must have 0 <= start <= stop",
    ),
    (
        "Probe",
        lambda: pyhook.Probe("0", torch.randn(3), 0.0, reduce="max"),
        (pyhook.SteeringError,),
        "reduce must be 'mean' or 'last', got 'max'",
    ),
    (
        "steering",
        lambda: pyhook.steering(M, pyhook.Steer("nope", torch.randn(3))).__enter__(),
        (pyhook.SteeringError,),
        "unknown point: no module named 'nope'",
    ),
    (
        "steering",
        lambda: pyhook.steering(M, [1, 2]).__enter__(),
        (pyhook.SteeringError,),
        "entry 0 of specs must be a pyhook.Steer",
    ),
    (
        "match_norm",
        lambda: pyhook.match_norm(torch.randn(3), "rows"),
        (pyhook.SteeringError,),
        "match_norm: rows must be a tensor of activations",
    ),
    (
        "match_norm",
        lambda: pyhook.match_norm(torch.randn(3), torch.randn(5, 4)),
        (pyhook.SteeringError,),
        r"match_norm: rows must be \[n, 3\], got \[5, 4\]",
    ),
    (
        "mean_difference",
        lambda: pyhook.mean_difference("/nonexistent/store", "0", [0], [1]),
        (FileNotFoundError,),
        "/nonexistent/store",
    ),
    # --- attribution graphs (pyhook.attribution_graph)
    (
        "attribution_graph",
        lambda: pyhook.attribution_graph(M, {}, torch.tensor([1, 2, 3])),
        (LookupError, ValueError),
        "no standard hook points for Sequential",
    ),
    (
        "attribution_graph",
        lambda: pyhook.attribution_graph(M, {}, torch.tensor([1, 2, 3]), offload="gpu"),
        (ValueError,),
        "offload must be None, 'cpu' or 'disk'",
    ),
    (
        "attribution_graph",
        lambda: pyhook.attribution_graph(M, {}, torch.tensor([1, 2, 3]), batch_size=0),
        (ValueError,),
        "batch_size must be a positive int",
    ),
    (
        "attribution_graph",
        lambda: pyhook.attribution_graph(M, {}, torch.zeros(2, 3, dtype=torch.long)),
        (ValueError,),
        r"input_ids must be one prompt of token ids, \[T\] or \[1, T\], got \(2, 3\)",
    ),
]


def _flex_register(name: str) -> None:
    fm = flex.FlexModel(M, {})
    try:
        fm.register_forward_hook(flex.HookFunction(name))
    finally:
        fm.restore()


def _flex_register_wrong_type() -> None:
    fm = flex.FlexModel(M, {})
    try:
        fm.register_forward_hook(lambda *a: None)  # type: ignore[arg-type]
    finally:
        fm.restore()


# Cases that currently fail: (entry, regex) -> reason. Each is a bug report to the module owner.
KNOWN_BAD: dict[tuple[str, str], str] = {}


def _case_id(case: Case) -> str:
    return f"{case[0]}:{case[3][:30]}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_bad_input_raises_a_clear_error_and_registers_nothing(case):
    entry, call, types, pattern = case
    reason = KNOWN_BAD.get((entry, pattern))
    if reason:
        pytest.xfail(reason)
    before = hook_snapshot(M)
    params = [p.detach().clone() for p in M.parameters()]
    with pytest.raises(types, match=pattern):
        call()
    assert not diff(before, hook_snapshot(M)), diff(before, hook_snapshot(M))
    assert all(torch.equal(a, b) for a, b in zip(params, M.parameters())), "model was modified"
    assert pyhook.get_backend() in ("native", "reference")


def test_every_public_entry_point_has_bad_input_cases():
    covered = {c[0].split(".")[0] for c in CASES} | {c[0] for c in CASES}
    no_arguments = {
        "__version__",
        "native_available",
        "info",
        "get_backend",
        "pool_stats",
        "empty_pool",
        "module_names",
        "parameter_names",
        "StopForward",
        "LayerNotFoundError",
        "CallRecord",
        "native_load_error",
        "TruncationExecutionFinished",
        "HookNotCalledError",
        "DummyModule",
        "default_editing_function",
        "HOOK_TYPES",
        "Recorder",
        "Stream",
        "resolve_layers",
        "CompiledModelError",
        "CaptureExistsError",
        "CaptureWriteError",
        "CaptureDamagedError",
        "CaptureModifiedError",
        "LayerData",
        "LensHook",  # made by pyhook.lens for hook functions, not by users
        "DictionaryError",
        "LinearParts",  # plain containers of tensors (linear_parts and encode make them)
        "SparseFeatures",
        "DictionaryEval",
        "AttributionGraph",  # attribution_graph's result and its nodes
        "GraphNode",
        "SteeringError",
    }
    missing = [n for n in pyhook.__all__ if n not in covered and n not in no_arguments]
    assert not missing, f"public names without bad-input cases: {missing}"


def test_unclosed_wrapper_at_interpreter_exit_prints_nothing():
    from conftest import run_python

    proc = run_python(
        "import torch\nfrom pyhook import extend\n"
        "M = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())\n"
        "g = extend.ActivationMapGrabber(M, ['0'])\n"
    )
    assert proc.returncode == 0
    assert "Exception ignored" not in proc.stderr, proc.stderr


def test_errors_list_close_names_for_typos():
    model = net()
    with pytest.raises(LookupError, match="'0'") as info:
        pyhook.Trace(model, "O")  # letter O, not zero
    assert "closest" in str(info.value) or "did you mean" in str(info.value).lower()


def test_empty_collections_are_rejected_or_harmless():
    model = net()
    before = hook_snapshot(model)
    with pyhook.TraceDict(model, []) as td:  # nethook accepts an empty list: traces nothing
        model(torch.randn(1, 4))
    assert len(td) == 0
    assert pyhook.recursive_copy((), clone=True) == ()
    assert pyhook.recursive_copy({}, clone=True) == {}
    assert pyhook._backend.clone_tensors([]) == []
    with deephook.TraceMultiple(model, {}) as tm:
        model(torch.randn(1, 4))
    assert len(tm) == 0
    assert not diff(before, hook_snapshot(model))
