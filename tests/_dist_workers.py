"""Code run by the gloo ranks spawned in test_distributed.py, and the shared MLP/edit definitions.

Weights and inputs are small integers stored in float32, so every sum is exact whatever the
order: sharded and single-process results can be compared bit for bit.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

D, H, B, S = 8, 16, 4, 3
LOG: dict = {}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, H)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def make_mlp() -> MLP:
    g = torch.Generator().manual_seed(0)
    mlp = MLP()
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randint(-3, 4, p.shape, generator=g).float())
    return mlp


def make_input() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(-3, 4, (B, S, D), generator=g).float()


def edit(current_module, inputs, save_ctx, modules):
    """Depends on the whole tensor: the full hidden dim (flip) and the full batch (flip)."""
    save_ctx.calls = getattr(save_ctx, "calls", 0) + 1
    ar = torch.arange(inputs.shape[-1], dtype=inputs.dtype)
    return inputs * ar + inputs.flip(-1) + inputs.flip(0)


def edit_plus1(current_module, inputs, save_ctx, modules):
    return inputs + 1


# ------------------------------------------------------------------------ hand-sharded Megatron MLP
class _ReduceFwd(torch.autograd.Function):
    """All-reduce in forward, identity in backward (Megatron's row-parallel output)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def _shard(t: torch.Tensor, rank: int, size: int, dim: int, sizes=None) -> torch.Tensor:
    parts = t.chunk(size, dim) if sizes is None else t.split(sizes, dim)
    return parts[rank].clone()


class ColumnParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear, rank: int, size: int, sizes=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(_shard(full.weight.detach(), rank, size, 0, sizes))
        self.bias = nn.Parameter(_shard(full.bias.detach(), rank, size, 0, sizes))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear, rank: int, size: int, group, sizes=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(_shard(full.weight.detach(), rank, size, 1, sizes))
        self.bias = nn.Parameter(full.bias.detach().clone())
        self.group = group

    def forward(self, x):
        return _ReduceFwd.apply(F.linear(x, self.weight), self.group) + self.bias


class TPMLP(nn.Module):
    """``sizes``: the hidden features of each rank (default: equal shards)."""

    def __init__(self, full: MLP, rank: int, size: int, group, sizes=None) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(full.fc1, rank, size, sizes)
        self.act = nn.ReLU()
        self.fc2 = RowParallelLinear(full.fc2, rank, size, group, sizes)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# -------------------------------------------------------------------------------------- scenarios
def scenario_tp(rank: int, world: int, tp: int, dp: int, save_on: str) -> dict:
    """Hand-sharded TP (tp ranks), optionally with DP replicas, the Megatron way."""
    from pyhook.flex import FlexModel, HookFunction

    tp_rank, dp_rank = rank % tp, rank // tp
    tp_group = None
    for d in range(dp):  # every rank creates every TP group of the all-reduce inside the model
        ranks = list(range(d * tp, (d + 1) * tp))
        g = dist.new_group(ranks)
        if rank in ranks:
            tp_group = g
    model = TPMLP(make_mlp(), tp_rank, tp, tp_group)
    x = make_input().chunk(dp, 0)[dp_rank].clone()
    out: dict = {}
    fm = FlexModel(model, out, tensor_parallel_size=tp, data_parallel_size=dp, save_on=save_on)
    fm.register_forward_hook(
        HookFunction("fc1", expected_shape=(None, None, H), editing_function=edit)
    )
    fm.register_forward_pre_hook(
        HookFunction("act", expected_shape=(None, None, H))
    )  # capture only
    fm.register_forward_hook(HookFunction("fc2", editing_function=edit_plus1))
    y = fm(x)
    y.sum().backward()
    res = {
        "y": y.detach(),
        "out": {k: [t.clone() for t in v] for k, v in out.items()},
        "grads": _grads(model),
        "calls": fm.save_ctx.calls,
    }
    fm.restore()
    res["hooks_left"] = _count_hooks(model)
    return res


# Uneven shards: hidden features and batch rows split unequally (rank 0 holds fewer).
UNEVEN_H = [5, 11]
UNEVEN_B = [2, 4]


def make_input_uneven() -> torch.Tensor:
    """A batch of sum(UNEVEN_B) rows (make_input has B rows)."""
    x = make_input()
    return torch.cat([x, x.flip(0)[: sum(UNEVEN_B) - B]])


def _run_mlp(model, x, **kw) -> dict:
    """scenario_tp's hook functions on ``model`` (a TPMLP or an MLP), forward and backward."""
    from pyhook.flex import FlexModel, HookFunction

    out: dict = {}
    fm = FlexModel(model, out, timeout=datetime.timedelta(seconds=20), **kw)
    fm.register_forward_hook(
        HookFunction("fc1", expected_shape=(None, None, H), editing_function=edit)
    )
    fm.register_forward_pre_hook(HookFunction("act", expected_shape=(None, None, H)))
    fm.register_forward_hook(HookFunction("fc2", editing_function=edit_plus1))
    y = fm(x)
    y.sum().backward()
    res = {"y": y.detach(), "out": {k: [t.clone() for t in v] for k, v in out.items()}}
    res["grads"] = _grads(model)
    fm.restore()
    return res


def scenario_uneven(rank: int, world: int) -> dict:
    """Unequal shards along the gathered dimension (world 2): tensor-parallel hidden features,
    data-parallel batch rows; then data-parallel ranks whose other dimensions differ."""
    from pyhook.flex import FlexModel, HookFunction

    res: dict = {}
    res["tp"] = _run_mlp(
        TPMLP(make_mlp(), rank, world, None, sizes=UNEVEN_H), make_input(), tensor_parallel_size=2
    )
    x = make_input_uneven().split(UNEVEN_B)[rank].clone()
    res["dp"] = _run_mlp(make_mlp(), x, data_parallel_size=2)
    fm = FlexModel(make_mlp(), {}, data_parallel_size=2, timeout=datetime.timedelta(seconds=20))
    fm.register_forward_hook(HookFunction("fc1"))
    try:
        fm(make_input()[:, : S - rank])  # a sequence length per rank: cannot be concatenated
        res["mismatch"] = None
    except ValueError as e:
        res["mismatch"] = str(e)
    fm.restore()
    return res


def scenario_dtensor(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from pyhook.flex import FlexModel, HookFunction

    mesh = init_device_mesh("cpu", (world,))
    model = parallelize_module(
        make_mlp(), mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    )
    out: dict = {}
    fm = FlexModel(model, out)
    fm.register_forward_hook(HookFunction("fc1", editing_function=edit))  # no expected_shape
    fm.register_forward_hook(HookFunction("fc2", editing_function=edit_plus1))
    y = fm(make_input())
    res = {"y": y.detach() if not hasattr(y, "full_tensor") else y.full_tensor().detach()}
    res["out"] = {k: [t.clone() for t in v] for k, v in out.items()}
    fm.restore()
    res["hooks_left"] = sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()
    )
    return res


def scenario_failure(rank: int, world: int, flag: str) -> dict:
    """Rank 1 fails before the layer; rank 0 must get a clear error within the timeout."""
    from pyhook.distributed import DistributedHookError
    from pyhook.flex import FlexModel, HookFunction

    model = TPMLP(make_mlp(), rank, world, None)
    fm = FlexModel(model.fc1, {}, tensor_parallel_size=world, timeout=datetime.timedelta(seconds=3))
    fm.register_forward_hook(
        HookFunction("", expected_shape=(None, None, H), editing_function=edit)
    )
    res: dict = {}
    if rank == 0:
        start = time.monotonic()
        try:
            fm(make_input())
            res["error"] = None
        except DistributedHookError as e:
            res["error"] = str(e)
        except Exception as e:
            res["error"] = f"wrong type {type(e).__name__}: {e}"
        res["waited"] = time.monotonic() - start
        open(flag, "w").close()
    else:
        try:
            raise RuntimeError("rank failed before the layer")
        except RuntimeError:
            pass
        deadline = time.monotonic() + 60
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)
    fm.restore()
    return res


def _count_hooks(model):
    return sum(
        len(m._forward_hooks)
        + len(m._forward_pre_hooks)
        + len(m._backward_hooks)
        + len(m._backward_pre_hooks)
        for m in model.modules()
    )


def _init_gloo(rank: int, world: int, port: int) -> None:
    """One thread a rank, the gloo group over 127.0.0.1:port (collectives time out after 60 s)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )


def worker_uneven(rank: int, world: int, port: int, outdir: str) -> None:
    _init_gloo(rank, world, port)
    try:
        results = {"uneven": scenario_uneven(rank, world)}
    except Exception:
        results = {"exception": traceback.format_exc()}
    torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def worker(rank: int, world: int, port: int, outdir: str) -> None:
    _init_gloo(rank, world, port)
    results: dict = {}
    try:
        results["tp"] = scenario_tp(rank, world, world, 1, "first")
        results["tp_all"] = scenario_tp(rank, world, world, 1, "all")
        results["dp"] = scenario_tp(rank, world, 1, world, "first")
        if world == 4:
            results["tp2dp2"] = scenario_tp(rank, world, 2, 2, "first")
        results["dtensor"] = scenario_dtensor(rank, world)
        dist.barrier()
        if world == 2:
            results["failure"] = scenario_failure(rank, world, os.path.join(outdir, "flag"))
    except Exception:  # reported to the parent test, which shows it
        results["exception"] = traceback.format_exc()
    torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    if "failure" not in results:
        dist.destroy_process_group()
    else:
        # After the failure scenario the group holds a timed-out collective: gloo cannot tear it
        # down cleanly, and its destructor may std::terminate at interpreter exit (SIGABRT,
        # depending on timing). The results are saved; leave without running C++ destructors.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
