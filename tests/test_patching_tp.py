"""pyhook.patching on a tensor-parallel model: the unsharded model's scores (2 gloo ranks).

Two ranks spawned on 127.0.0.1 (no mocks) load the same Llama with transformers' tensor
parallelism (``tp_plan="auto"``: column-parallel q/k/v/gate/up, row-parallel o_proj/down) and
run ``edge_attribution`` and ``attribution_patch``; every score must equal the unsharded
model's (same weights, computed here in one process), up to float32 summation order. An
output projection under torch's ``parallelize_module`` (whose input layout pyhook does not
slice) is refused by name.
"""

from __future__ import annotations

import os
import traceback

import _layout_workers as W
import pytest
import torch
import torch.distributed as dist
import transformers
from test_distributed import _spawn

from pyhook.distributed import LayoutError
from pyhook.patching import attribution_patch, edge_attribution

pytestmark = pytest.mark.distributed

CLEAN = W.IDS
CORRUPT = torch.tensor([[3, 17, 40, 60, 22, 9, 41], [8, 11, 30, 2, 55, 13, 7]])


def _metric(out):
    return out.logits[:, -1, 5] - out.logits[:, -1, 7]


def _scores(model) -> dict:
    edges = edge_attribution(model, CLEAN, CORRUPT, _metric)
    ig = edge_attribution(model, CLEAN, CORRUPT, _metric, steps=2, noising=True)
    atp = attribution_patch(model, CLEAN, CORRUPT, _metric, ["resid_pre.*", "attn_z.1"])
    return {
        "eap": edges.scores,
        "eap-ig noising": ig.scores,
        **{f"atp/{k}": v for k, v in atp.scores.items()},
    }


def _worker(rank: int, world: int, port: int, outdir: str) -> None:
    results: dict = {}
    try:
        W._init(rank, world, port)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        path = os.path.join(outdir, "llama")
        llama = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto").eval()
        results["tp"] = _scores(llama)

        plain = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        mesh = init_device_mesh("cpu", (world,))
        plan = {f"{w}_proj": ColwiseParallel() for w in "qkv"} | {"o_proj": RowwiseParallel()}
        parallelize_module(plain.model.layers[0].self_attn, mesh, plan)
        try:
            edge_attribution(plain, CLEAN, CORRUPT, _metric)
        except LayoutError as e:
            results["refused"] = str(e)
        results["hooks left"] = sum(
            len(m._forward_hooks) + len(m._forward_pre_hooks) for m in llama.modules()
        )
        results["hooks left torch"] = sum(
            len(m._forward_hooks) + len(m._forward_pre_hooks) for m in plain.modules()
        )
        dist.barrier()
    except BaseException:
        results["exception"] = traceback.format_exc()
    finally:
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
        if dist.is_initialized():
            dist.destroy_process_group()


def test_edge_and_attribution_scores_on_a_tensor_parallel_model(tmp_path):
    outdir = str(tmp_path)
    W.save_llama(os.path.join(outdir, "llama"))
    results = _spawn(_worker, 2, outdir)
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(outdir, "llama"))
    want = _scores(model.eval())
    assert float(want["eap"].abs().max()) > 1e-3
    hooks = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
    for rank, res in enumerate(results):
        got = res["tp"]
        assert sorted(got) == sorted(want)
        for k, w in want.items():
            torch.testing.assert_close(
                got[k], w, rtol=1e-4, atol=1e-5, msg=lambda m, k=k, r=rank: f"rank {r}: {k}: {m}"
            )
        assert "model.layers.0.self_attn.o_proj" in res["refused"], res.get("refused")
        assert "RowwiseParallel" in res["refused"]
        assert res["hooks left"] == sum(hooks)
        assert res["hooks left torch"] == 8  # parallelize_module's own: in and out of 4 layers
