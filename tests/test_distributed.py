"""FlexModel under torch.distributed: real gloo ranks (2 and 4) spawned on 127.0.0.1, no mocks.

One spawn per world size runs every scenario (tests/_dist_workers.py) and each rank saves its
results to a file; the tests here compare them, bit for bit in float32, with a single-process
reference computed from hand-written PyTorch hooks on the unsharded MLP.
"""

from __future__ import annotations

import os
import socket
import time

import _dist_workers as W
import pytest
import torch
import torch.multiprocessing as mp

from pyhook.distributed import parallel_layout

pytestmark = pytest.mark.distributed

SPAWN_DEADLINE_S = 150


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, world: int, outdir: str, *extra, deadline_s: float = SPAWN_DEADLINE_S) -> list:
    """Run ``fn(rank, world, port, outdir, *extra)`` on ``world`` gloo ranks; each rank's saved
    results (``rank{r}.pt`` in ``outdir``), checked for exceptions."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    ctx = mp.spawn(fn, args=(world, _free_port(), outdir, *extra), nprocs=world, join=False)
    deadline = time.monotonic() + deadline_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(
                f"distributed workers (world {world}) did not finish in {deadline_s} s: a hang"
            )
    results = [
        torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world)
    ]
    for r, res in enumerate(results):
        assert "exception" not in res, f"rank {r} raised:\n{res['exception']}"
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def ranks(request, tmp_path_factory):
    world = request.param
    return world, _spawn(W.worker, world, str(tmp_path_factory.mktemp(f"dist{world}")))


def reference(x=None):
    """Single process: the full MLP with hand-written hooks doing the same edits on ``x``
    (default ``make_input()``)."""
    mlp = W.make_mlp()
    x = W.make_input() if x is None else x
    saved: dict = {}
    ctx = type("Ctx", (), {})()

    def fc1_hook(m, args, out):
        saved["fc1"] = out.detach().clone()
        return W.edit(m, out, ctx, None)

    def act_pre(m, args):
        saved["act"] = args[0].detach().clone()

    def fc2_hook(m, args, out):
        saved["fc2"] = out.detach().clone()
        return out + 1

    hs = [
        mlp.fc1.register_forward_hook(fc1_hook),
        mlp.act.register_forward_pre_hook(act_pre),
        mlp.fc2.register_forward_hook(fc2_hook),
    ]
    y = mlp(x)
    y.sum().backward()
    for h in hs:
        h.remove()
    grads = {n: p.grad.clone() for n, p in mlp.named_parameters()}
    return y.detach(), saved, grads


def _eq(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _check_saved(res, saved, keys, expect_saved: bool):
    for k in keys:
        if expect_saved:
            assert len(res["out"][k]) == 1, k
            assert _eq(res["out"][k][0], saved[k]), k
        else:
            assert k not in res["out"], k


@pytest.mark.parametrize("save_on", ["first", "all"])
def test_tensor_parallel_hand_sharded(ranks, save_on):
    world, results = ranks
    y_ref, saved, grads = reference()
    for r, res in enumerate(results):
        res = res["tp" if save_on == "first" else "tp_all"]
        assert _eq(res["y"], y_ref), (
            f"rank {r}: edited output differs from the single-process reference"
        )
        _check_saved(res, saved, ["fc1", "act", "fc2"], expect_saved=(r == 0 or save_on == "all"))
        g = res["grads"]
        assert _eq(g["fc1.weight"], grads["fc1.weight"].chunk(world, 0)[r])
        assert _eq(g["fc1.bias"], grads["fc1.bias"].chunk(world, 0)[r])
        assert _eq(g["fc2.weight"], grads["fc2.weight"].chunk(world, 1)[r])
        assert _eq(g["fc2.bias"], grads["fc2.bias"])
        assert res["calls"] == 1 and res["hooks_left"] == 0


def test_data_parallel(ranks):
    world, results = ranks
    y_ref, saved, grads = reference()
    total = {}
    for r, full in enumerate(results):
        res = full["dp"]
        assert _eq(res["y"], y_ref.chunk(world, 0)[r])
        _check_saved(res, saved, ["fc1", "act", "fc2"], expect_saved=(r == 0))
        for n, g in res["grads"].items():
            total[n] = total.get(n, 0) + g
        assert res["hooks_left"] == 0
    for n in grads:  # what DDP's all-reduce would give
        assert _eq(total[n], grads[n]), n


def test_tensor_and_data_parallel_2x2(ranks):
    world, results = ranks
    if world != 4:
        pytest.skip("needs 4 ranks")
    y_ref, saved, grads = reference()
    total: dict = {}
    for r, full in enumerate(results):
        res = full["tp2dp2"]
        tp_rank, dp_rank = r % 2, r // 2
        assert _eq(res["y"], y_ref.chunk(2, 0)[dp_rank])
        _check_saved(res, saved, ["fc1", "act", "fc2"], expect_saved=(r == 0))
        for n, g in res["grads"].items():
            total.setdefault((n, tp_rank), 0)
            total[(n, tp_rank)] = total[(n, tp_rank)] + g
    for tp_rank in range(2):
        assert _eq(total[("fc1.weight", tp_rank)], grads["fc1.weight"].chunk(2, 0)[tp_rank])
        assert _eq(total[("fc2.weight", tp_rank)], grads["fc2.weight"].chunk(2, 1)[tp_rank])
        assert _eq(total[("fc2.bias", tp_rank)], grads["fc2.bias"])


def test_dtensor_parallelize_module(ranks):
    world, results = ranks
    y_ref, saved, _ = reference()
    for r, full in enumerate(results):
        res = full["dtensor"]
        assert _eq(res["y"], y_ref), f"rank {r}"
        _check_saved(res, saved, ["fc1", "fc2"], expect_saved=(r == 0))
        # parallelize_module's own input/output hooks on fc1 and fc2 (2 each) stay; ours are gone
        assert res["hooks_left"] == 4


def test_uneven_shards_match_unsharded_model(tmp_path):
    # Shards of unequal size along the gathered dimension (rank 0 holds fewer): each rank used
    # to all-gather as many rows/features as it held, so gloo aborted the process, delivered
    # the wrong slice or left a rank waiting while the others raised.
    results = [r["uneven"] for r in _spawn(W.worker_uneven, 2, str(tmp_path))]
    y_ref, saved, grads = reference()
    h = W.UNEVEN_H
    for r, res in enumerate(results):
        tp = res["tp"]
        assert _eq(tp["y"], y_ref), f"rank {r}"
        _check_saved(tp, saved, ["fc1", "act", "fc2"], expect_saved=(r == 0))
        assert _eq(tp["grads"]["fc1.weight"], grads["fc1.weight"].split(h, 0)[r])
        assert _eq(tp["grads"]["fc2.weight"], grads["fc2.weight"].split(h, 1)[r])
    y_ref, saved, grads = reference(W.make_input_uneven())
    for r, res in enumerate(results):
        dp = res["dp"]
        assert _eq(dp["y"], y_ref.split(W.UNEVEN_B)[r]), f"rank {r}"
        _check_saved(dp, saved, ["fc1", "act", "fc2"], expect_saved=(r == 0))
    for n in grads:  # what DDP's all-reduce would give
        assert _eq(sum(res["dp"]["grads"][n] for res in results), grads[n]), n
    # ranks that cannot be concatenated all raise the same clear error (none hangs or aborts)
    errors = [res["mismatch"] for res in results]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert "HookFunction('fc1'" in errors[0] and "[[4, 3, 16], [4, 2, 16]]" in errors[0]


def test_failing_rank_gives_clear_error_not_hang(ranks):
    world, results = ranks
    if world != 2:
        pytest.skip("run with 2 ranks")
    err = results[0]["failure"]["error"]
    assert err is not None, "rank 0 completed a gather that rank 1 never joined"
    assert "HookFunction(''" in err and "tensor-parallel group" in err and "3 s" in err, err
    assert "out of step" in err and "re-create the process group" in err, err  # what to do next


def test_parallel_layout_matches_flex_model_mesh():
    # flex_model's _test/distributed/test_initialize.py::test_GPUDeviceMesh, (tp, pp, dp) = (2, 2, 2)
    lay = parallel_layout(2, 2, 2)
    assert lay["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    lay = parallel_layout(1, 1, 4, ranks=[4, 5, 6, 7])
    assert lay["dp"] == [[4, 5, 6, 7]] and lay["tp"] == [[4], [5], [6], [7]]
    with pytest.raises(ValueError, match="3 ranks"):
        parallel_layout(2, 1, 1, ranks=[0, 1, 2])
