"""pyhook.splice on offloaded and tensor-parallel models: the same outputs and features as on
the plain model (a disk-offloaded device_map; two gloo ranks with transformers' tp_plan)."""

from __future__ import annotations

import os
import traceback

import pytest
import torch

T = pytest.importorskip("transformers")

import _layout_workers as W  # noqa: E402
from _dicts import CLT, SAELensSAE, SparsifyCoder  # noqa: E402

from _models import offloaded_llama  # noqa: E402

import pyhook  # noqa: E402


def _dicts(d: int):
    torch.manual_seed(5)
    return {
        "resid_post.0": SAELensSAE(d, 3 * d, arch="jumprelu"),
        ("mlp_in.1", "mlp_out.1"): SAELensSAE(d, 3 * d, apply_b_dec=False),
        "attn_out.1": SparsifyCoder(d, 3 * d, 5),
    }


def _edit(f):
    if isinstance(f, pyhook.SparseFeatures):
        return f._replace(values=f.values * 2)
    return f * 1.5 + (f > 0) * 0.25


def scenarios(model, ids) -> dict:
    """Logits and features with splices (replacement, error term with edits, a CLT)."""
    d = model.config.hidden_size
    dicts = _dicts(d)
    out = {}
    with torch.no_grad():
        out["plain"] = model(ids).logits
        with pyhook.splice(model, dicts, error=False) as sp:
            out["replaced"] = model(ids).logits
        for k, f in sp.features.items():
            out[f"features/{k}"] = pyhook.dictionaries.dense_features(f)
        with pyhook.splice(model, dicts, edit={k: _edit for k in dicts}):
            out["edited"] = model(ids).logits
        with pyhook.splice(model, dicts):
            out["identity"] = model(ids).logits
        torch.manual_seed(6)
        clt = CLT(d, 2 * d, d, 2)
        with pyhook.splice(model, {("mlp_in.0", ("mlp_out.0", "mlp_out.1")): clt}, error=False):
            out["clt"] = model(ids).logits
    return out


def _check(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for k in want:
        torch.testing.assert_close(got[k], want[k], msg=lambda m, k=k: f"{what}: {k}: {m}")
    torch.testing.assert_close(got["identity"], got["plain"], rtol=0, atol=0)
    for k in ("replaced", "edited", "clt"):
        assert not torch.allclose(want[k], want["plain"]), k  # each splice moved the output


def test_splice_on_a_disk_offloaded_model(tmp_path):
    pytest.importorskip("accelerate")
    W.save_llama(str(tmp_path / "ckpt"))
    model = T.LlamaForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    want = scenarios(model, W.IDS)
    offloaded = offloaded_llama(tmp_path / "ckpt", tmp_path / "offload")
    assert hasattr(offloaded.model.layers[1], "_hf_hook")
    got = scenarios(offloaded, W.IDS)
    for k in want:  # the same computation on the same device: bitwise
        assert torch.equal(got[k], want[k]), k
    _check(got, want, "offloaded")


def worker(rank: int, world: int, port: int, outdir: str) -> None:
    results: dict = {}
    try:
        W._init(rank, world, port)
        llama = T.AutoModelForCausalLM.from_pretrained(
            os.path.join(outdir, "llama"), tp_plan="auto"
        ).eval()
        results["tp"] = scenarios(llama, W.IDS)
        torch.distributed.barrier()
    except BaseException:
        results["exception"] = traceback.format_exc()
    finally:
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@pytest.mark.distributed
def test_splice_on_a_tensor_parallel_model(tmp_path):
    from test_distributed import _spawn

    W.save_llama(str(tmp_path / "llama"))
    results = _spawn(worker, 2, str(tmp_path))
    model = T.AutoModelForCausalLM.from_pretrained(tmp_path / "llama").eval()
    want = scenarios(model, W.IDS)
    for r, res in enumerate(results):
        _check(res["tp"], want, f"tensor parallel rank {r}")
