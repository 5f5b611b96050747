"""The CUDA paths of the interventions, each against the same computation on the CPU.

Every test here is marked ``cuda`` and skipped where ``torch.cuda.is_available()`` is False (CI,
the CPU machines pyhook is developed on); ``benchmarks/gpu_check.py`` runs them on a GPU (its
step 2, ``pytest -m cuda``). Models and dictionaries are built on the CPU by the builders of the
CPU tests, then moved; the reference is the same builder's model left on the CPU.

* :func:`pyhook.attribution_graph` on a model and transcoders on the GPU: the CPU graph (nodes,
  adjacency, values, constant, pruned), with the edge buffer on the GPU, in host memory and in a
  file, all features kept or ``max_feature_nodes`` with re-ranking; transcoders left on the CPU
  are refused by name.
* :func:`pyhook.splice` with dictionaries on another device than their sites (the model on the
  GPU and the dictionaries on the CPU, and the reverse): outputs, features, feature gradients
  and the dictionaries' own parameter gradients of the all-CPU run; the error term bitwise
  unchanged; a CLT whose decoders sit on two devices; an edit at chosen positions of a batched,
  left-padded ``generate`` against each row alone on the CPU.
* :func:`pyhook.steering` with vectors given on the CPU on a batched, left-padded ``generate``
  with the KV cache on the GPU: each row's tokens and logits generated alone, without a cache,
  on the CPU model; a :class:`pyhook.Probe` deciding on the GPU.
* :class:`pyhook.HostBuffers` with a CUDA capture into pinned buffers: rows equal a hand-written
  hook's ``.cpu()`` copies; a buffer shared with ``share_memory_()`` or sent through a
  ``torch.multiprocessing`` queue is retired, never written again.

Tolerances. GPT-2 in float64 computes every op in float64 on both devices: the GPU and the CPU
differ only in the order of their sums (a few units of 1e-16 per op, 1e-13 after a few
layers), so values agree to 1e-9 relative (and to 1e-10 of a graph's largest entry). Llama's
RMSNorm computes in float32 even in a float64 model (transformers casts to float32 inside it);
there the CUDA and CPU float32 means and ``rsqrt`` may differ by a few ulps (1e-7 relative).
Measured on the CPU, a 3-ulp change of every RMSNorm's variance moves a Llama graph's entries by
at most 2e-7 of its largest entry, and the steered Llama logits below by at most 8e-8 (the
largest is 0.3): the Llama checks allow 1e-5 of the largest entry (graphs) and 1e-5 absolute
plus relative (logits), 50 to 100 times that. The discrete choices (which features are active,
which are kept, which token is greedy) have margins far above both: the smallest
|pre-activation| of the graph's transcoders on its prompt is 1e-3 (the largest 5), the splice's
dictionaries' pre-activations are 5e-5 or more from 0 and from their JumpReLU thresholds and
their top-k gaps 9e-3 or more (float64: the devices differ by 1e-15), the probe's
scores are 4e-3 or more from its threshold, and in every CPU reference below the best logit of
each greedy step leads the next by 1.8% or more of the largest logit, which :func:`_margins`
checks, so a token that differs on the GPU is a bug, not a tie rounded the other way.
"""

from __future__ import annotations

import queue as _queue
import re

import pytest
import torch
from _dicts import CLT
from _models import all_hooks
from pyhook.capture import capture
from test_graph import IDS, make, transcoders  # (skips the module where transformers is missing)
from test_host_buffers_shared import _consumer
from test_splice import IDS as SPLICE_IDS
from test_splice import _dicts, _scale_feature
from test_splice import _model as _splice_model
from test_splice_generate import PAD, STEPS, _by_hand_at, _edit_generated_0_1, _left_padded
from test_splice_generate import PROMPTS as SPLICE_PROMPTS
from test_steering import NEW, PROMPTS, _left_pad, _reference, _row_specs, _vec
from test_steering import _model as _steer_model
from torch import nn

import pyhook
import pyhook.graph as G
from pyhook.dictionaries import SparseFeatures, as_dictionary, dense_features
from pyhook.graph import AttributionGraph, attribution_graph
from pyhook.offload import HostBuffers

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="CUDA is not available: these check the CUDA paths of attribution_graph, splice, "
        "steering and HostBuffers, on a GPU (benchmarks/gpu_check.py, step 2)",
    ),
]


def _cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _close_to_scale(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    """``|got - want| <= tol * max|want|`` everywhere (float64 sums in another order)."""
    a, b = got.double(), want.double()
    assert a.shape == b.shape, (what, tuple(a.shape), tuple(b.shape))
    scale = max(float(b.abs().max()), 1e-300) if b.numel() else 1.0
    err = float((a - b).abs().max()) if b.numel() else 0.0
    assert err <= tol * scale, f"{what}: off by {err:.3g}, {err / scale:.3g} of the largest entry"


def _margins(logits: list[torch.Tensor], what: str, at_least: float) -> None:
    """Each greedy step of a CPU reference has its best token ahead of the next by
    ``at_least`` (relative to the largest logit): a token that differs on the GPU is then a
    bug, not a tie rounded the other way."""
    for step, row in enumerate(logits):
        top = row.double().topk(2).values
        gap = float(top[0] - top[1]) / max(float(row.double().abs().max()), 1e-300)
        assert gap > at_least, f"{what}: step {step}'s two best logits are {gap:.3g} apart"


# -- 1. attribution graphs -------------------------------------------------------------------
# gpt2: float64 throughout; llama: float32 RMSNorm (see the module's docstring)
GRAPH_TOL = {"gpt2": 1e-10, "llama": 1e-5}
COMPLETE_TOL = {"gpt2": 1e-9, "llama": 1e-6}  # test_graph's completeness tolerances
GRAPH_KW = dict(max_n_logits=3, desired_logit_prob=1.0, batch_size=4, rerank_every=5)
_CPU_GRAPHS: dict[tuple[str, int | None], AttributionGraph] = {}


def _cpu_graph(arch: str, max_feature_nodes: int | None) -> AttributionGraph:
    key = (arch, max_feature_nodes)
    if key not in _CPU_GRAPHS:
        _CPU_GRAPHS[key] = attribution_graph(
            make(arch), transcoders(), IDS, max_feature_nodes=max_feature_nodes, **GRAPH_KW
        )
    return _CPU_GRAPHS[key]


def _no_graph_state(model: nn.Module, before: int) -> None:
    assert all_hooks(model) == before
    assert G._HELD == {} and G._HELD_USERS[0] == 0  # the attention-function wrapper is gone


@pytest.mark.parametrize("offload", [None, "cpu", "disk"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_attribution_graph_on_cuda_is_the_cpu_graph(arch, offload):
    """The model and its transcoders on the GPU; the edge buffer on the GPU (offload=None), in
    host memory or in a file; every feature kept, or 12 chosen by influence re-ranked every 5
    rows (the ranking reads the buffer's rows back from wherever it is)."""
    tol = GRAPH_TOL[arch]
    for max_feature_nodes in (None, 12):
        want = _cpu_graph(arch, max_feature_nodes)
        model = make(arch).to(_cuda())
        tcs = {k: t.to(_cuda()) for k, t in transcoders().items()}
        before = all_hooks(model)
        got = attribution_graph(
            model,
            tcs,
            IDS,
            max_feature_nodes=max_feature_nodes,
            offload=offload,
            **GRAPH_KW,
        )
        what = f"{arch}, offload={offload}, max_feature_nodes={max_feature_nodes}"
        _no_graph_state(model, before)
        assert all(p.device == _cuda() for t in tcs.values() for p in t.parameters()), what
        if max_feature_nodes is not None:
            assert got.n_features == max_feature_nodes < got.n_active_features, what
        assert got.nodes == want.nodes, what
        assert got.n_active_features == want.n_active_features, what
        assert torch.equal(got.targets, want.targets), what
        assert torch.equal(got.input_ids, want.input_ids), what
        assert torch.equal(got.logit_tokens, want.logit_tokens), what
        for field in ("adjacency", "values", "constant", "pruned", "logit_probabilities"):
            t = getattr(got, field)
            assert t.device.type == "cpu", (what, field)  # the graph is returned in host memory
            assert t.dtype == getattr(want, field).dtype, (what, field)
            # logit_probabilities are float32 (rounded from float64: one ulp, 6e-8, apart)
            f_tol = max(tol, 1e-6) if t.dtype == torch.float32 else tol
            _close_to_scale(t, getattr(want, field), f_tol, f"{what}: {field}")
        assert got.completeness_error() < COMPLETE_TOL[arch], what


def test_attribution_graph_on_a_gpu_run_offloaded_model_is_the_cpu_graph(tmp_path):
    """accelerate's device map with the embedding and layer 0 on the GPU, layer 1 and the
    unembedding offloaded (host memory and disk): the layers run on the GPU while the frozen
    norms and the logit directions are read from accelerate's map in host memory; the graph's
    buffers go where the activations are. The graph is the in-memory CPU model's."""
    pytest.importorskip("accelerate")
    import transformers

    cpu = make("llama")
    cpu.save_pretrained(tmp_path / "ckpt")
    device_map = {
        "model.embed_tokens": 0,
        "model.rotary_emb": 0,
        "model.layers.0": 0,
        "model.layers.1": "cpu",
        "model.norm": 0,
        "lm_head": "disk",
    }
    model = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "ckpt", device_map=device_map, offload_folder=tmp_path / "off",
        dtype=torch.float64,
    ).eval()  # fmt: skip
    tcs = {k: t.to(_cuda()) for k, t in transcoders().items()}
    before = all_hooks(model)
    for max_feature_nodes in (None, 12):
        want = _cpu_graph("llama", max_feature_nodes)
        got = attribution_graph(model, tcs, IDS, max_feature_nodes=max_feature_nodes, **GRAPH_KW)
        what = f"offloaded on cuda, max_feature_nodes={max_feature_nodes}"
        assert all_hooks(model) == before, what
        assert got.nodes == want.nodes, what
        for field in ("adjacency", "values", "constant", "pruned"):
            _close_to_scale(
                getattr(got, field), getattr(want, field), GRAPH_TOL["llama"], f"{what}: {field}"
            )


def test_attribution_graph_refuses_transcoders_off_the_models_device_by_name():
    model = make("gpt2").to(_cuda())
    before = all_hooks(model)
    key = ("mlp_in.0", "mlp_out.0")
    msg = re.escape(f"transcoder at {key!r} is on cpu, but mlp_in.0 runs on {_cuda()}")
    with pytest.raises(ValueError, match=msg):
        attribution_graph(model, transcoders(), IDS)  # transcoders left on the CPU
    _no_graph_state(model, before)


# -- 2. splicing dictionaries on another device ------------------------------------------------
SPLICE_TOL = dict(rtol=1e-9, atol=1e-10)  # GPT-2 in float64 on both devices


def _dense_grad(f) -> torch.Tensor:
    """The gradient a forward left on features, dense (top-k features in whatever order)."""
    if isinstance(f, SparseFeatures):
        g = torch.zeros(*f.values.shape[:-1], f.size, dtype=f.values.dtype, device=f.values.device)
        return g.scatter(-1, f.indices, f.values.grad)
    return f.grad


def _splice_results(model_dev: torch.device, dict_dev: torch.device) -> dict[str, torch.Tensor]:
    """GPT-2 (float64) on ``model_dev``, the CPU tests' three dictionaries (a JumpReLU SAE, a
    transcoder, a top-k coder) on ``dict_dev``: outputs, features and gradients, on the CPU.
    Checks on the way what holds on any one device (the error term bitwise unchanged, where the
    features live, no hook left)."""
    model = _splice_model("gpt2").to(model_dev)
    dicts = {k: d.to(dict_dev) for k, d in _dicts().items()}
    ids = SPLICE_IDS.to(model_dev)
    before = all_hooks(model)
    out: dict[str, torch.Tensor] = {}
    edits = {k: _scale_feature for k in dicts}
    with torch.no_grad():
        plain = model(ids).logits
        with pyhook.splice(model, dicts) as sp:
            same = model(ids).logits
        assert torch.equal(same, plain)  # error=True, no edit: the sites untouched
        with pyhook.splice(model, dicts, error=False) as sp:
            out["replaced"] = model(ids).logits
        for k, f in sp.features.items():
            t = f.values if isinstance(f, SparseFeatures) else f
            assert t.device == dict_dev, (k, t.device)  # computed where the dictionary is
            out[f"features {k}"] = dense_features(f)
        with pyhook.splice(model, dicts, edit=edits):
            out["edited"] = model(ids).logits
        with pyhook.splice(model, dicts, edit=edits, error=False):
            out["edited, replaced"] = model(ids).logits
    # autograd on, error term kept: the output still bitwise the model's (x_hat - x_hat.detach()
    # moved between devices is still an exact zero); the features get the site's gradient
    plain = model(ids).logits.detach()  # the model's own forward with autograd on
    with pyhook.splice(model, dicts) as sp:
        logits = model(ids).logits
        assert torch.equal(logits.detach(), plain)
        logits.double().pow(2).mean().backward()
    for k, f in sp.features.items():
        out[f"feature grad {k}"] = _dense_grad(f)
    model.zero_grad(set_to_none=True)
    for d in dicts.values():  # the error=True backward reached them too (through x_hat)
        d.zero_grad(set_to_none=True)
    # error=False: the loss reaches the dictionaries' own parameters, wherever they are
    with pyhook.splice(model, dicts, error=False):
        model(ids, labels=ids).loss.backward()
    for k, d in dicts.items():
        for name, p in d.named_parameters():
            if p.grad is not None:
                assert p.grad.device == dict_dev, (k, name)
                out[f"grad {k} {name}"] = p.grad
    assert all_hooks(model) == before
    assert all(p.device == dict_dev for d in dicts.values() for p in d.parameters())
    return {k: v.detach().cpu() for k, v in out.items()}


@pytest.mark.parametrize("where", ["model on cuda, dictionaries on cpu", "the reverse"])
def test_splice_with_dictionaries_on_another_device_is_the_cpu_run(where):
    cpu = torch.device("cpu")
    model_dev, dict_dev = (_cuda(), cpu) if where.startswith("model") else (cpu, _cuda())
    want = _splice_results(cpu, cpu)
    got = _splice_results(model_dev, dict_dev)
    assert sorted(got) == sorted(want)
    # every dictionary's encoder got a gradient (not a copy's: the user's parameters)
    for k in _dicts():
        assert any(name.startswith(f"grad {k} ") for name in got), k
    assert not torch.allclose(want["replaced"], want["edited, replaced"])
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, **SPLICE_TOL, msg=lambda m, n=name: f"{n}: {m}")


class _PlacedCLT(CLT):
    """A CLT whose decoders may sit on different devices: its own decode places the features
    beside each decoder (a user's CLT split across a model's devices)."""

    def decode(self, f):
        return [f.to(w.device) @ w + b for w, b in zip(self.W_dec, self.b_dec)]


def test_splice_a_clt_with_decoders_on_two_devices_writes_each_output_on_its_site():
    key = ("mlp_in.0", ("mlp_out.0", "mlp_out.1"))

    def run(model_dev, split: bool):
        model = _splice_model("gpt2").to(model_dev)
        torch.manual_seed(3)
        clt = _PlacedCLT(16, 30, 16, 2).double().to(model_dev)
        if split:  # the second output's decoder in host memory
            clt.W_dec[1].data = clt.W_dec[1].data.cpu()
            clt.b_dec[1].data = clt.b_dec[1].data.cpu()
        ids = SPLICE_IDS.to(model_dev)
        with torch.no_grad():
            with pyhook.splice(model, {key: clt}, error=False):
                replaced = model(ids).logits
            with pyhook.splice(model, {key: clt}, edit={key: lambda f: f * 2}):
                edited = model(ids).logits
        assert all_hooks(model) == 0
        return replaced.cpu(), edited.cpu()

    want = run(torch.device("cpu"), split=False)
    got = run(_cuda(), split=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **SPLICE_TOL)


def test_splice_edit_at_chosen_positions_of_a_cuda_generate_equals_each_row_alone_on_the_cpu():
    """Dictionaries on the CPU, the model on the GPU; a left-padded batch, the KV cache on;
    generated tokens 0 and 1 edited: each row alone recomputed without a cache on the CPU model
    under plain hooks (test_splice_generate's reference)."""
    cpu_model = _splice_model("gpt2")
    dicts = _dicts()  # on the CPU, used by both runs
    adapted = {k: as_dictionary(d) for k, d in dicts.items()}
    rows = _by_hand_at(cpu_model, _edit_generated_0_1(adapted))
    for r, (logits, _) in enumerate(rows):
        _margins(list(logits), f"row {r}", 1e-6)
    model = _splice_model("gpt2").to(_cuda())
    model.generation_config.pad_token_id = PAD
    ids, mask = _left_padded()
    edits = {k: _scale_feature for k in dicts}
    with torch.no_grad(), pyhook.splice(model, dicts, edit=edits, prompt=None, generated=(0, 2)):
        out = model.generate(
            ids.to(_cuda()),
            attention_mask=mask.to(_cuda()),
            max_new_tokens=STEPS,
            min_new_tokens=STEPS,
            do_sample=False,
            use_cache=True,
            output_logits=True,
            return_dict_in_generate=True,
        )
    assert all_hooks(model) == 0
    new_tokens = out.sequences[:, ids.shape[1] :].cpu()
    assert len(rows) == len(SPLICE_PROMPTS)
    for r, (logits, tokens) in enumerate(rows):
        got = torch.stack([step[r] for step in out.logits]).cpu()  # generate's float32 logits
        torch.testing.assert_close(got, logits.to(got.dtype), rtol=1e-6, atol=1e-6)
        assert torch.equal(new_tokens[r], tokens), r


# -- 3. steering a batched generate on the GPU -------------------------------------------------
STEER_TOL = {"gpt2": dict(rtol=1e-9, atol=1e-9), "llama": dict(rtol=1e-5, atol=1e-5)}


def _cuda_generate(model, specs):
    """Greedy generate of PROMPTS, left-padded, KV cache on, steered by ``specs`` (as given: on
    the CPU): the new tokens and each step's last logits (float64, by a plain hook on the
    head), on the CPU."""
    ids, am = _left_pad(PROMPTS)
    seen = []
    h = model.get_output_embeddings().register_forward_hook(
        lambda _m, _a, out: seen.append(out[:, -1].detach().cpu())
    )
    try:
        with pyhook.steering(model, specs) as st, torch.no_grad():
            out = model.generate(
                ids.to(_cuda()),
                attention_mask=am.to(_cuda()),
                max_new_tokens=NEW,
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
                eos_token_id=None,
            )
    finally:
        h.remove()
    return out[:, ids.shape[1] :].cpu(), torch.stack(seen, 1), st


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_steering_a_cuda_generate_equals_each_row_alone_on_the_cpu(family):
    cpu_model = _steer_model(family)
    model = _steer_model(family).to(_cuda())
    specs = _row_specs()  # per-row specs: ops, points, prompt indices, generated windows
    flat = [s for e in specs if e is not None for s in ([e] if isinstance(e, pyhook.Steer) else e)]
    assert all(s.vector.device.type == "cpu" for s in flat)
    tokens, logits, _ = _cuda_generate(model, specs)
    assert all_hooks(model) == 0
    for row, prompt in enumerate(PROMPTS):
        spec = specs[row]
        spec = [] if spec is None else [spec] if isinstance(spec, pyhook.Steer) else spec
        ref_tokens, ref_logits = _reference(cpu_model, prompt, spec)
        _margins(ref_logits, f"{family} row {row}", 1e-4)
        torch.testing.assert_close(logits[row], torch.stack(ref_logits), **STEER_TOL[family])
        assert tokens[row].tolist() == ref_tokens, (family, row)
    unsteered, _, _ = _cuda_generate(model, None)
    assert not torch.equal(tokens, unsteered)  # the steering did something


def test_a_probe_decides_on_the_gpu_like_a_two_pass_reference_on_the_cpu():
    cpu_model = _steer_model("gpt2")
    model = _steer_model("gpt2").to(_cuda())
    direction = _vec(11)  # on the CPU
    scores = []
    for prompt in PROMPTS:  # each row's score on its own unsteered prompt, by a plain hook
        seen = {}
        h = cpu_model.transformer.h[0].register_forward_hook(
            lambda _m, _a, out, seen=seen: seen.update(x=out[0] if isinstance(out, tuple) else out)
        )
        with torch.no_grad():
            cpu_model(torch.tensor([prompt]))
        h.remove()
        scores.append(float((seen["x"][0] * direction).sum(-1)[-1]))
    vals = sorted(scores)
    threshold = (vals[1] + vals[2]) / 2  # two rows above, two below
    assert min(abs(s - threshold) for s in scores) > 1e-6  # a decision, not a rounding
    probe = pyhook.Probe("resid_post.0", direction, threshold=threshold, reduce="last")
    steer = pyhook.Steer("resid_post.1", _vec(12), scale=4.0, when=probe)
    tokens, _, st = _cuda_generate(model, steer)
    expected = [s > threshold for s in scores]
    assert st.decisions() == expected
    plain = pyhook.Steer("resid_post.1", _vec(12), scale=4.0)
    for row, prompt in enumerate(PROMPTS):
        ref_tokens, ref_logits = _reference(cpu_model, prompt, [plain] if expected[row] else [])
        _margins(ref_logits, f"row {row}", 1e-4)
        assert tokens[row].tolist() == ref_tokens, row


# -- 4. HostBuffers: pinned buffers, shared ones retired ------------------------------------------
def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8)).to(_cuda()).eval()


def _inputs(seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device=_cuda()).manual_seed(seed)
    return [torch.randn(4, 8, 16, device=_cuda(), generator=g) for _ in range(3)]


def _captured(net, bufs, layers, seed):
    """Rows of ``layers`` captured into ``bufs`` over three forwards, checked against a
    hand-written hook's ``.cpu()`` copies of the same forwards; they are pinned, not shared."""
    ref: dict[str, list[torch.Tensor]] = {k: [] for k in layers}
    handles = [
        net[int(k)].register_forward_hook(
            lambda _m, _a, o, k=k: ref[k].append(o.detach().reshape(-1, o.shape[-1]).cpu())
        )
        for k in layers
    ]
    try:
        with torch.no_grad(), capture(net, list(layers), buffers=bufs) as rec:
            for x in _inputs(seed):
                net(x)
        got = rec.results()
    finally:
        for h in handles:
            h.remove()
    for k in layers:
        assert torch.equal(got[k], torch.cat(ref[k])), (seed, k)
        assert got[k].is_pinned(), (seed, k)
        # a retired (shared) buffer written again would show here: it lives in shared memory
        assert not got[k].untyped_storage().is_shared(), (seed, k)
    return got


def test_host_buffers_retire_a_pinned_buffer_shared_with_share_memory():
    net = _net()
    bufs = HostBuffers(depth=2)
    assert bufs.pin  # the default on a machine with CUDA
    for seed in range(3):  # the set learns the sizes; later captures reuse its buffers
        _captured(net, bufs, ["0", "2"], seed)
    assert bufs.stats()["reuses"] > 0
    got = _captured(net, bufs, ["0", "2"], 10)
    shared = got["0"]
    expect = shared.clone()
    shared.share_memory_()  # the buffer moves to shared memory: another process may map it
    assert shared.untyped_storage().is_shared() and torch.equal(shared, expect)
    at = shared.untyped_storage().data_ptr()
    del got
    reuses = bufs.stats()["reuses"]
    for i in range(4):
        later = _captured(net, bufs, ["0", "2"], 20 + i)
        if shared is not None:
            assert torch.equal(shared, expect), i
            assert all(t.untyped_storage().data_ptr() != at for t in later.values()), i
        if i == 1:
            shared = None  # dropped here too: the set must still never write it again
        del later
    # layer 2's buffer is reused by each of the 4 (its rows are dropped every time)
    assert bufs.stats()["reuses"] - reuses >= 4


@pytest.fixture
def consumer():
    """A process (spawned, CPU only) that keeps the tensors it is sent, as in
    test_host_buffers_shared, and shows their values on request."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_consumer, args=(inbox, outbox), daemon=True)
    proc.start()

    def ask(msg, timeout=120):
        inbox.put(msg)
        try:
            return outbox.get(timeout=timeout)
        except _queue.Empty:
            raise AssertionError(f"consumer process did not answer {msg[:2]!r}") from None

    yield ask
    inbox.put(None)
    proc.join(timeout=30)
    if proc.is_alive():
        proc.kill()


def test_host_buffers_never_write_pinned_rows_sent_to_another_process(consumer):
    net = _net()
    bufs = HostBuffers(depth=2)
    expect = []
    for i in range(5):
        rows = _captured(net, bufs, ["0"], 30 + i)["0"]
        expect.append(rows.clone())
        assert consumer(("keep", i, rows)) == ("kept", i)  # pickled: moved to shared memory
        del rows
    for i in range(5):
        got = torch.tensor(consumer(("show", i))[2], dtype=expect[i].dtype)
        assert torch.equal(got, expect[i]), f"capture {i}'s rows, held by the consumer, changed"
    assert bufs.stats()["reuses"] == 0  # every buffer went to the consumer: none written again
