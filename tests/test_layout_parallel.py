"""A name means the whole tensor on every layout (pyhook.distributed's layout layer).

Two gloo ranks (spawned on 127.0.0.1, no mocks) run the same traces, edits, gradients and
captures on sharded models: transformers' tensor parallelism (``tp_plan="auto"``), torch's
``parallelize_module`` (column- and row-wise), FSDP2 and accelerate's offloading. Every value
must equal the unsharded model's (same weights, computed here in one process), up to float32
summation order.
"""

from __future__ import annotations

import copy
import os

import _layout_workers as W
import pytest
import torch
import transformers
from test_distributed import _spawn

import pyhook

pytestmark = pytest.mark.distributed

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    outdir = str(tmp_path_factory.mktemp("layout"))
    W.save_llama(os.path.join(outdir, "llama"))
    return _spawn(W.worker, WORLD, outdir), outdir


def _compare(got: dict, want: dict, rank: int, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for k, w in want.items():
        g = got[k]
        assert isinstance(g, torch.Tensor) and type(g) is torch.Tensor, (
            f"{what} rank {rank}: {k} is a {type(g).__name__}, not a plain tensor"
        )
        assert g.shape == w.shape, (
            f"{what} rank {rank}: {k} has shape {tuple(g.shape)}, the unsharded model's is "
            f"{tuple(w.shape)} (a shard handed out as the whole?)"
        )
        torch.testing.assert_close(g, w, msg=lambda m, k=k: f"{what} rank {rank}: {k}: {m}")


# One spawn runs every sharded scenario; one test checks them all (pytest-xdist would run a
# module fixture once per worker, and the spawn is the slow part).
SCENARIOS = [
    ("llama_tp", "llama_tp"),  # transformers tp_plan="auto": colwise/rowwise Linear
    ("mlp_tp", "mlp_tp"),  # torch parallelize_module: ColwiseParallel + RowwiseParallel
    ("gpt2_fsdp", "gpt2"),  # FSDP2 fully_shard on GPT-2 (Conv1D)
    ("gpt2_offload", "gpt2"),  # accelerate cpu_offload, with the layout layer active
]


def test_whole_tensor_on_every_layout(ranks):
    """Trace/TraceDict outputs and inputs, stop, edits (returned and in place), retain_grad
    gradients and capture rows on two ranks equal the unsharded model's, on every layout;
    an unknown parallel style is refused by name and leaves no hook."""
    results, outdir = ranks
    llama = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(outdir, "llama")).eval()
    references = {
        "llama_tp": W.llama_scenarios(llama),
        "mlp_tp": W.mlp_scenarios(W.make_mlp()),
        "gpt2": W.gpt2_scenarios(W.make_gpt2()),
    }
    for scenario, reference in SCENARIOS:
        for r, res in enumerate(results):
            _compare(res[scenario], references[reference], r, scenario)

    # the edits reached the model on every rank (an edit that did nothing would pass above)
    ref = references["llama_tp"]
    for k in ("edit/attn_z.0", "edit/up_proj.0", "edit/mlp_hidden.1", "edit/v_proj.1 in place"):
        assert not torch.allclose(ref[k], ref["logits"]), k
        for res in results:
            assert not torch.allclose(res["llama_tp"][k], ref["logits"]), k

    for r, res in enumerate(results):
        msg = res["refused"]["message"]
        assert msg is not None, f"rank {r}: a PrepareModuleOutput layer was traced, not refused"
        assert "'1'" in msg and "PrepareModuleOutput" in msg, msg
        assert res["refused"]["hooks_left"] == 0


def test_a_module_between_column_and_row_parallel_layers_is_refused(ranks):
    """Llama's act_fn under tp_plan and the ReLU of a parallelize_module MLP have no style of
    their own but see this rank's slice: every tracer refuses them by name, leaving no hook;
    the MLP around them, and the same module of an unsharded model, trace as usual."""
    results, _ = ranks
    for r, res in enumerate(results):
        got = res["between"]
        for what in ("trace act_fn", "tracedict act_fn", "capture act_fn", "backward act_fn"):
            msg = got[what]
            assert msg is not None, f"rank {r}: {what} handed out a shard"
            assert "act_fn" in msg and "'gate_proj'" in msg, msg
            assert "'down_proj'" in msg and "split" in msg, msg
        msg = got["trace relu"]
        assert msg is not None and "'1'" in msg and "'0'" in msg and "'2'" in msg, msg
        assert got["left"] == {"llama": 0, "mlp": 0}
        assert got["mlp whole"] == (2, 7, 32)  # the hidden size, whole
        assert got["plain act"] == (2, 5, 128)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")  # no input grad
def test_backward_hooks_whole_on_tensor_parallel_layers(ranks):
    """Full backward hooks and pre-hooks (HookSet's and FlexModel's) on column- and row-parallel
    layers (transformers' tp_plan, torch's parallelize_module) see the unsharded model's whole
    grad_output and grad_input on every rank; the gradients they return or edit in place are
    re-sharded, so the model's parameter (and input) gradients are the unsharded model's (also
    along the sequence: torch's SequenceParallel before a colwise/rowwise pair). On
    FSDP2 and offloaded models (nothing sharded) they see and do what they do unsharded."""
    results, outdir = ranks
    llama = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(outdir, "llama")).eval()
    references = {
        "llama_tp_backward": W.llama_backward(llama),
        "mlp_tp_backward": W.mlp_backward(W.make_mlp()),
        "seq_tp_backward": W.seq_backward(W.make_seq_mlp(), W.SEQ_X),
        "gpt2_fsdp_backward": W.gpt2_backward(W.make_gpt2()),
    }
    # accelerate's offloading loads the weights anew for every forward: they keep no gradients
    references["gpt2_offload_backward"] = {
        k: v for k, v in references["gpt2_fsdp_backward"].items() if "/grad " not in k
    }
    for r, res in enumerate(results):
        for n in ("0", "2"):
            msg = res["mlp_tp_backward"].pop(f"wrong shape {n}")
            assert msg is not None and f"'{n}'" in msg and "whole" in msg, (r, n, msg)
    for scenario, ref in references.items():
        # every hook ran and every gradient it saw is there, on both sides of every layer
        seen = [k for k in ref if k.startswith("seen/")]
        assert len(seen) >= 5 and any(k.endswith("grad_input") for k in seen), seen
        for r, res in enumerate(results):
            _compare(res[scenario], ref, r, scenario)
        # each edit changed the model's gradients (an edit that did nothing would pass above)
        plain = {k.split("/", 1)[1]: v for k, v in ref.items() if k.startswith("plain/")}
        for tag in ("edit sharded", "edit sharded in place", "edit replicated", "flex"):
            if not plain:
                break  # offloaded: no parameter gradients to tell
            changed = [k for k, v in plain.items() if not torch.allclose(ref[f"{tag}/{k}"], v)]
            assert changed, f"{scenario}: {tag} changed no gradient"
        assert int(ref["hooks left"]) == 0

    for r, res in enumerate(results):
        ref = res["refused_backward"]
        for key in ("hookset", "flex"):
            assert ref[key] is not None, f"rank {r}: {key}: a PrepareModuleOutput layer was hooked"
            assert "'1'" in ref[key] and "PrepareModuleOutput" in ref[key], ref[key]
        assert ref["hookset left"] == 0 and ref["flex left"] == 0, ref
        for how in ("trace", "backward"):
            assert "ReplicatedWithGradAllReduce" in (ref[f"{how} 0"] or ""), ref
            assert "Shard(dim=1)" in (ref[f"{how} 1"] or ""), ref
        assert ref["styled left"] == 0


def test_offload_single_process_exact():
    """Offloading (accelerate's hooks move the weights in per forward) without
    torch.distributed: the same values as the model kept in memory."""
    accelerate = pytest.importorskip("accelerate")
    want = W.gpt2_scenarios(W.make_gpt2())
    got = W.gpt2_scenarios(accelerate.cpu_offload(W.make_gpt2(), execution_device="cpu"))
    _compare(got, want, 0, "offload")


def test_module_layout_plain_model():
    assert pyhook.distributed.module_layout(copy.deepcopy(W.make_mlp())[0]) is None


@pytest.mark.parametrize("full,n", [(32, 2), (33, 2), (7, 4), (5, 4), (3, 4), (64, 3)])
def test_shard_sizes_follow_torch_chunk(full, n):
    """The sizes the layer expects each rank to hold (a transformers column-parallel output,
    which DTensor splits as torch.chunk does), so no size exchange is needed."""
    want = [len(c) for c in torch.arange(full).chunk(n)]
    want += [0] * (n - len(want))
    assert pyhook.distributed._chunk_sizes(full, n) == want
