"""The layout layer's edges, on two spawned gloo ranks against the unsharded model in this
process: compiled tensor-parallel models (``torch.compile(model)``, ``model.compile()``),
``distribute_module`` with functions of the user's (refused by name), the writers of a raw
capture from a ``parallelize_module`` model, and the gradient at an input point that other
modules read too (OLMo 2 under transformers' tensor parallelism).
"""

from __future__ import annotations

import os

import _layout_workers as W
import pytest
import torch
import transformers
from test_distributed import _spawn
from test_layout_parallel import _compare

import pyhook

pytestmark = pytest.mark.distributed

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    outdir = str(tmp_path_factory.mktemp("edges"))
    W.save_olmo2(os.path.join(outdir, "olmo2"))
    return _spawn(W.edges_worker, WORLD, outdir, False, deadline_s=600), outdir


@pytest.fixture(scope="module")
def compiled_ranks(tmp_path_factory):
    outdir = str(tmp_path_factory.mktemp("edges_compiled"))
    W.save_llama(os.path.join(outdir, "llama"))
    # dynamo compiles (and recompiles, for each tracer) a TP Llama on both ranks: slow on CPU
    return _spawn(W.edges_worker, WORLD, outdir, True, deadline_s=1200), outdir


def test_compiled_tensor_parallel_model_gives_whole_tensors(compiled_ranks):
    """Trace, TraceDict, an edit, run_with_cache and capture on a compiled 2-rank transformers
    TP Llama (eager backend: torch.compile(model) and model.compile(); one TraceDict under
    inductor) equal the unsharded model's: no local shard is handed out as the whole tensor."""
    results, outdir = compiled_ranks
    llama = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(outdir, "llama")).eval()
    want = W.compiled_scenarios(llama)
    assert not torch.allclose(want["edit/attn_z.0"], want["logits"])  # the edit does something
    short = {k: v for k, v in want.items() if k.startswith(("out/", "in/")) or k == "logits"}
    for r, res in enumerate(results):
        _compare(res["compiled_eager"], want, r, "torch.compile(model, backend='eager')")
        _compare(res["module_compile"], short, r, "model.compile(backend='eager')")
        _compare(res["inductor"], short, r, "torch.compile(model) (inductor)")


def test_distribute_module_with_user_functions_is_refused_by_name(ranks):
    """distribute_module whose output_fn hands on a local shard: every tracer (and the writer
    count) refuses the module by name instead of handing out the shard as the whole."""
    results, _ = ranks
    for r, res in enumerate(results):
        got = res["distribute_module"]
        assert got["local width"] == 16 // WORLD  # the module does hand out shards
        for what in ("trace", "capture", "input point", "backward"):
            msg = got[what]
            assert msg is not None, f"rank {r}: {what} handed out the local shard"
            assert "'0" in msg and "distribute_module(" in msg, msg
        assert "local_out" in got["trace"] and "replicate_in" in got["input point"]
        assert got["left"] == 0
        assert got["ranks"] is not None and "tp_size=" in got["ranks"], got["ranks"]


def test_raw_capture_of_a_parallelize_module_model_writes_each_row_once(ranks):
    """The ranks of a tensor-parallel group hold the same rows: one writer per group, read off
    the model's parallel styles (the model has no tp_size attribute)."""
    results, outdir = ranks
    assert [res["writers"] for res in results] == [
        {"tp_size": 2, "writer": True},
        {"tp_size": 2, "writer": False},
    ]
    mlp = W.make_mlp()
    with torch.no_grad(), pyhook.TraceDict(mlp, ["0", "2"]) as td:
        mlp(W.MLP_X)
    store = pyhook.store.open_capture(os.path.join(outdir, "mlp_store"))
    for n in ("0", "2"):
        got = store[n][:]
        want = td[n].output.reshape(-1, td[n].output.shape[-1])
        assert got.shape == want.shape, f"{n}: {tuple(got.shape)} rows, want {tuple(want.shape)}"
        torch.testing.assert_close(got, want)


def test_input_point_gradient_under_tensor_parallelism(ranks):
    """OLMo 2 under transformers TP (float64): Trace(retain_grad) and run_with_cache give, at
    input points other modules read too, the unsharded model's gradient through the module's
    argument (plain pre-hook and autograd), on both ranks."""
    from test_layout_grads import _plain_input_grad

    results, outdir = ranks
    olmo = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.join(outdir, "olmo2"), dtype=torch.float64
    ).eval()
    want = {n: _plain_input_grad(olmo, n, True, W.IDS, W._loss) for n in W.GRAD_POINTS}
    for r, res in enumerate(results):
        for n, w in want.items():
            for tool in ("trace", "cache"):
                got = res["olmo2_tp"][f"{tool}/{n}"]
                assert got.shape == w.shape, (r, tool, n, tuple(got.shape))
                torch.testing.assert_close(got, w, msg=lambda m, n=n, t=tool: f"{t} {n}: {m}")
