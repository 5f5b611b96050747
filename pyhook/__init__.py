"""pyhook: capture, edit and cut short the forward (and backward) pass of any ``nn.Module``.

Index of the public API (``import pyhook as nethook`` runs nethook code unchanged):

* tracing (nethook): :class:`Trace` hooks one layer, :class:`TraceDict` several,
  :class:`StopForward` ends a forward early, :func:`recursive_copy` copies nested outputs;
* module helpers: :func:`get_module`, :func:`get_parameter`, :func:`replace_module`,
  :func:`module_names`, :func:`parameter_names`, :func:`set_requires_grad`,
  :func:`subsequence`, :func:`hierarchical_subsequence`, :func:`invoke_with_optional_args`;
* truncation: :class:`TruncatedModule` returns a submodule's output and skips the rest;
* hybrid_learning: :class:`ModelExtender`, :class:`ActivationMapGrabber`, :class:`ModelStump`
  attach extension models to intermediate outputs;
* deephook: :class:`TraceMultiple` (and :mod:`pyhook.deephook` for its single-layer ``Trace``);
* flex_model: :class:`HookFunction` and :class:`FlexModel` (editing functions with a save
  context and trainable modules; activations sharded over ``torch.distributed`` are gathered,
  see :mod:`pyhook.distributed`), :class:`DummyModule`;
* capture: :func:`capture` / :class:`Recorder` pull activations of many layers (names or
  globs) to the device, host memory or safetensors shards on disk; :func:`open_capture` reads
  them back, :func:`verify_capture` checks them; :class:`CaptureJob` is a whole capture (corpus,
  model, layers, store) as one config with ``plan()``/``run()``/``stream()``, the job the
  ``pyhook capture`` command parses its flags or ``--config`` file into; :class:`Paired` runs
  several named models on the same tokens into one store (crosscoders, model diffing);
* TransformerLens-shaped hooks (:mod:`pyhook.lens`): :func:`run_with_cache`,
  :func:`run_with_hooks`, :func:`hooks` (``fn(tensor, hook)`` hook functions, forward and
  backward, on points, TransformerLens names and module names);
* streaming: :func:`stream` hands shuffled batches of live activations to a trainer (a
  producer thread ahead of it, a seeded mixing buffer, optionally a tee to a store);
* backends: :func:`get_backend`, :func:`set_backend`, :func:`use_backend` choose between the
  native core and the pure-PyTorch reference; :func:`pool_stats`, :func:`set_pool_limit`,
  :func:`empty_pool` control the native capture-buffer pool; :class:`HostBuffers` is host
  memory that captures to host write their rows into and reuse (pinned on CUDA);
* installation: :func:`info` / :func:`format_info` report what was built and loaded (the
  ``pyhook info`` command); ``import pyhook`` warns once when the native build failed.
* patching and attribution (:mod:`pyhook.patching`, imported on first use):
  ``activation_patch`` (exact, many patches per forward), ``attribution_patch`` (AtP, AtP*)
  and ``edge_attribution`` (EAP, EAP-IG) over the standard points, results keyed by point name;
* steering (:mod:`pyhook.steering`): ``with steering(model, specs):`` adds, ablates, caps or
  sets a direction (:class:`Steer`) at chosen positions of each batch row, under ``generate``
  with the KV cache and left padding, optionally on a per-row condition (:class:`Probe`);
* attribution graphs (:mod:`pyhook.graph`): :func:`attribution_graph` builds circuit-tracer's
  graph of features, errors, tokens and logits through transcoders, :class:`AttributionGraph`;
* compiled models: every tool works on ``torch.compile(model)`` / ``model.compile()`` with
  dynamo's default settings (through persistent dispatcher hooks, see :mod:`pyhook._compiled`);
  :func:`release_compiled` removes those dispatchers; :func:`prepare_compiled` installs them
  up front, from one thread, for a model that several threads will trace.
"""

from __future__ import annotations

import importlib as _importlib

# _startup first among the imports of torch (Ctrl-C while the command imports torch), _precheck
# (the command's arguments, checked before torch); _aliases answers the pipeline's old module
# paths (pyhook.capture, pyhook.store.writer, ...).
from . import _aliases, _precheck, _startup  # noqa: F401
from ._backend import (
    empty_pool,
    get_backend,
    native_available,
    pool_stats,
    set_backend,
    set_pool_limit,
    use_backend,
)
from ._build import check_build as _check_build
from ._build import format_info, info
from ._compiled import prepare_compiled
from ._compiled import release as release_compiled
from ._copy import recursive_copy
from ._hooks import CompiledModelError, StopForward
from ._invoke import invoke_with_optional_args
from ._version import __version__
from .deephook import TraceMultiple
from .dictionaries import DictionaryError, LinearParts, SparseFeatures, linear_parts
from .extend import (
    ActivationMapGrabber,
    ExtendedModelStump,
    HooksHandle,
    ModelExtender,
    ModelStump,
    dummy_output,
    output_size,
    output_sizes,
)
from .flex import DummyModule, FlexModel, HookFunction, default_editing_function
from .graph import AttributionGraph, GraphNode, attribution_graph
from .lens import LensHook, hooks, run_with_cache, run_with_hooks
from .modules import (
    LayerNotFoundError,
    get_module,
    get_parameter,
    hierarchical_subsequence,
    module_names,
    parameter_names,
    replace_module,
    set_requires_grad,
    subsequence,
)
from .offload import HostBuffers
from .pipeline import dataset as _dataset  # noqa: F401  (gives CaptureReader its dataset())
from .pipeline.capture import CaptureModifiedError, Recorder, capture, resolve_layers
from .pipeline.job import CaptureJob
from .pipeline.paired import Paired
from .pipeline.steer import mean_difference
from .pipeline.stream import Stream, stream
from .splice import DictionaryEval, Splice, evaluate_dictionaries, splice
from .steering import Probe, Steer, SteeringError, match_norm, steering
from .store import (
    CaptureDamagedError,
    CaptureExistsError,
    CaptureReader,
    CaptureWriteError,
    LayerData,
    ShardWriter,
    open_capture,
    verify_capture,
)
from .trace import CallRecord, Trace, TraceDict
from .truncate import HookNotCalledError, TruncatedModule, TruncationExecutionFinished

# The module pyhook.annotations (this name was bound to the __future__ feature above, which
# would hide the submodule from `from pyhook import annotations`).
annotations = _importlib.import_module(".pipeline.annotations", __name__)
_aliases.bind_loaded()

__all__ = [
    "__version__",
    # nethook
    "Trace",
    "TraceDict",
    "CallRecord",
    "StopForward",
    "release_compiled",
    "prepare_compiled",
    "recursive_copy",
    "subsequence",
    "hierarchical_subsequence",
    "set_requires_grad",
    "get_module",
    "get_parameter",
    "replace_module",
    "invoke_with_optional_args",
    "module_names",
    "parameter_names",
    "LayerNotFoundError",
    "CompiledModelError",
    # truncation
    "TruncatedModule",
    "TruncationExecutionFinished",
    "HookNotCalledError",
    # hybrid_learning
    "HooksHandle",
    "ActivationMapGrabber",
    "ModelStump",
    "ExtendedModelStump",
    "ModelExtender",
    "dummy_output",
    "output_sizes",
    "output_size",
    # deephook (its single-layer Trace is pyhook.deephook.Trace)
    "TraceMultiple",
    # flex_model
    "HookFunction",
    "FlexModel",
    "DummyModule",
    "default_editing_function",
    # TransformerLens-shaped hooks (forward and backward)
    "run_with_cache",
    "run_with_hooks",
    "hooks",
    "LensHook",
    # attribution graphs (circuit tracing) through transcoders
    "attribution_graph",
    "AttributionGraph",
    "GraphNode",
    # high-throughput capture
    "capture",
    "CaptureJob",
    "Paired",
    "Recorder",
    "HostBuffers",
    "resolve_layers",
    "stream",
    "Stream",
    "open_capture",
    "verify_capture",
    "CaptureReader",
    "LayerData",
    "ShardWriter",
    "CaptureExistsError",
    "CaptureWriteError",
    "CaptureDamagedError",
    "CaptureModifiedError",
    # steering during generate (pyhook.steering)
    "Steer",
    "Probe",
    "steering",
    "SteeringError",
    "mean_difference",
    "match_norm",
    # backends
    "get_backend",
    "set_backend",
    "use_backend",
    "native_available",
    "pool_stats",
    "set_pool_limit",
    "empty_pool",
    # dictionaries (SAEs, transcoders, CLTs): the protocol
    "linear_parts",
    "LinearParts",
    "SparseFeatures",
    "DictionaryError",
    "splice",
    "Splice",
    "evaluate_dictionaries",
    "DictionaryEval",
    # installation: what was built, what is loaded (``pyhook info``)
    "info",
    "format_info",
]


def __getattr__(name: str) -> object:
    # pyhook.patching is imported on first use (``pyhook.patching.activation_patch``), so that
    # ``import pyhook`` does not pay for it; ``import pyhook.patching`` works as usual.
    if name == "patching":
        return _importlib.import_module(".patching", __name__)
    raise AttributeError(f"module 'pyhook' has no attribute {name!r}")


# Once per process: warn (with the fix) if the native build failed, was skipped without the
# user choosing it, or was built against another torch. Quiet after PYHOOK_BUILD_NATIVE=0.
_check_build()
