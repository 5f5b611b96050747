"""Code run by the gloo ranks spawned in test_layout_parallel.py, and the shared scenarios.

Each scenario is a function ``(model) -> dict of tensors`` run twice: on the sharded model by
every rank (tensor parallel via transformers' ``tp_plan``, torch's ``parallelize_module``,
FSDP2, accelerate's offloading) and on the unsharded model with the same weights in the test
process; the tests compare the two.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch import nn

import pyhook
from pyhook.capture import capture
from pyhook.source import Batch

IDS = torch.tensor([[3, 17, 5, 60, 22, 9, 41], [8, 8, 30, 2, 55, 13, 7]])


# -- models (toy sizes; norms with non-trivial weights and biases) ------------------------------
def _perturb_norms(model: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name or name.endswith("ln_f.weight"):
                p.copy_(1 + 0.5 * torch.rand(p.shape, generator=g) if p.dim() == 1 else p)
            if name.endswith("ln_f.bias") or (".ln_" in name and name.endswith("bias")):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


def save_llama(path: str) -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=64,
        max_position_embeddings=32,
    )
    _perturb_norms(transformers.LlamaForCausalLM(cfg)).save_pretrained(path)


def make_gpt2() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32)
    return _perturb_norms(transformers.GPT2LMHeadModel(cfg)).eval()


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 6))


MLP_X = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(2))


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The model's own output (torch's RowwiseParallel leaves it an AsyncCollectiveTensor)."""
    return t.trigger_wait() if hasattr(t, "trigger_wait") else t


# -- scenarios ------------------------------------------------------------------------------------
def _loss(out) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return (logits * torch.linspace(-1, 1, logits.shape[-1])).sum()


def llama_scenarios(model: nn.Module) -> dict:
    """Tracing, editing, retain_grad and capture at sites inside sharded layers."""
    res: dict = {}
    names = [
        "resid_post.0",
        "attn_out.0",
        "mlp_out.1",
        "attn_z.0",
        "attn_z.1",
        "mlp_hidden.0",
        "model.layers.0.self_attn.q_proj",  # colwise: a local shard of the features
        "model.layers.1.mlp.up_proj",
        "model.layers.1.self_attn.o_proj",  # rowwise: whole output, sharded input
    ]
    with torch.no_grad():
        with pyhook.TraceDict(model, names, retain_input=True) as tr:
            res["logits"] = model(IDS).logits
        for n in names:
            res[f"out/{n}"] = tr[n].output
        res["in/model.layers.1.self_attn.o_proj"] = tr["model.layers.1.self_attn.o_proj"].input
        with pyhook.Trace(model, "model.layers.1.mlp.gate_proj", stop=True) as t:
            model(IDS)
        res["stop/gate_proj.1"] = t.output

        # edits see and return the whole tensor
        def zero_head(output):
            output = output.clone()
            output[..., 1, :] = 0
            return output

        def scale_features(output):
            return output * torch.linspace(0.5, 1.5, output.shape[-1])

        with pyhook.Trace(model, "attn_z.0", edit_output=zero_head):
            res["edit/attn_z.0"] = model(IDS).logits
        with pyhook.Trace(model, "model.layers.0.mlp.up_proj", edit_output=scale_features):
            res["edit/up_proj.0"] = model(IDS).logits
        with pyhook.Trace(model, "mlp_hidden.1", edit_output=scale_features):
            res["edit/mlp_hidden.1"] = model(IDS).logits

        def halve_in_place(output):
            output.mul_(0.5)

        with pyhook.Trace(model, "model.layers.1.self_attn.v_proj", edit_output=halve_in_place):
            res["edit/v_proj.1 in place"] = model(IDS).logits

        # capture (the recorder's rows) of sharded and whole sites
        cap = ["resid_post.1", "attn_z.1", "mlp_hidden.0", "model.layers.0.self_attn.k_proj"]
        with capture(model, cap, to="host") as rec:
            model(IDS)
        for n, t in rec.results().items():
            res[f"capture/{n}"] = t

    # pyhook.stream's rows (its recorder runs the forwards on a producer thread); every rank of
    # the tensor-parallel group streams the same examples
    src = [
        Batch(
            IDS,
            torch.ones_like(IDS),
            torch.ones(IDS.shape, dtype=torch.bool),
            torch.arange(2),
            None,
        )
    ]
    rows = IDS.numel()
    batches = list(
        pyhook.stream(
            model,
            src,
            ["mlp_hidden.0", "attn_z.1"],
            batch_size=rows,
            buffer_rows=rows,
            rank=0,
            world_size=1,
        )
    )
    for n in ("mlp_hidden.0", "attn_z.1"):
        res[f"stream/{n}"] = batches[0][n]

    # FlexModel: its hook functions see the whole tensor too (attn_z split into whole heads)
    saved: dict = {}
    fm = pyhook.FlexModel(model, saved, save_on="all")
    fm.register_forward_hook(pyhook.HookFunction("attn_z.0", expected_shape=(2, 7, 4, 8)))
    fm.register_forward_hook(
        pyhook.HookFunction("model.layers.1.mlp.gate_proj", expected_shape=(2, 7, 64))
    )
    with torch.no_grad():
        fm(IDS)
    for n, kept in saved.items():
        res[f"flex/{n}"] = kept[0]
    fm.restore()

    # gradients: retain_grad on whole tensors at sharded sites
    for n in ("model.layers.0.self_attn.q_proj", "mlp_hidden.1", "attn_z.0", "resid_post.0"):
        model.zero_grad()
        with pyhook.Trace(model, n, retain_grad=True) as t:
            _loss(model(IDS)).backward()
        res[f"grad/{n}"] = t.output.grad
    return res


def gpt2_scenarios(model: nn.Module) -> dict:
    res: dict = {}
    names = ["resid_post.0", "attn_z.1", "mlp_hidden.0", "attn_out.1", "transformer.h.1.mlp.c_fc"]
    with torch.no_grad():
        with pyhook.TraceDict(model, names) as tr:
            res["logits"] = model(IDS).logits
        for n in names:
            res[f"out/{n}"] = tr[n].output
        with pyhook.Trace(model, "mlp_hidden.0", edit_output=lambda output: output * 0.5):
            res["edit/mlp_hidden.0"] = model(IDS).logits
        with capture(model, ["resid_post.1", "attn_z.0"], to="host") as rec:
            model(IDS)
        for n, t in rec.results().items():
            res[f"capture/{n}"] = t
    with pyhook.Trace(model, "mlp_hidden.1", retain_grad=True) as t:
        _loss(model(IDS)).backward()
    res["grad/mlp_hidden.1"] = t.output.grad
    return res


def mlp_scenarios(model: nn.Module) -> dict:
    res: dict = {}
    with torch.no_grad():
        with pyhook.TraceDict(model, ["0", "2"], retain_input=True) as tr:
            res["y"] = _plain(model(MLP_X))
        res["out/0"], res["out/2"], res["in/2"] = tr["0"].output, tr["2"].output, tr["2"].input
        with pyhook.Trace(model, "0", edit_output=lambda output: output * 2 - 1):
            res["edit/0"] = _plain(model(MLP_X))
        with capture(model, ["0", "2"], to="host") as rec:
            model(MLP_X)
        for n, t in rec.results().items():
            res[f"capture/{n}"] = t
    with pyhook.Trace(model, "0", retain_grad=True) as t:
        _loss(model(MLP_X)).backward()
    res["grad/0"] = t.output.grad
    return res


def _param_grads(model: nn.Module, tag: str) -> dict:
    """Every parameter's whole gradient (a DTensor parameter's gathered), then cleared."""
    out = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[f"{tag}/grad {n}"] = (g.full_tensor() if hasattr(g, "full_tensor") else g).clone()
    model.zero_grad(set_to_none=True)
    return out


def _scale(t: torch.Tensor) -> torch.Tensor:
    """A per-feature scale: an edit re-sharded to the wrong slice would scale the wrong features."""
    return t * torch.linspace(0.5, 2.0, t.shape[-1])


def _scale_or_none(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else _scale(t)


def backward_scenarios(
    model: nn.Module,
    x: torch.Tensor,
    col: list[str],
    row: list[str],
    flex: tuple[str, str],
    *,
    input_grad: bool = True,
) -> dict:
    """Full backward hooks and pre-hooks (HookSet's, and FlexModel's) on column-parallel
    (``col``: sharded output) and row-parallel (``row``: sharded input) layers: the gradients
    they see, and the model's gradients after they edit them."""
    from pyhook._hooks import HookSet

    res: dict = {}
    x = x.clone().requires_grad_(input_grad and x.is_floating_point())
    model.zero_grad(set_to_none=True)

    def run(tag: str, register) -> None:
        hooks = HookSet()
        with hooks.registering():
            register(hooks)
        try:
            _loss(model(x)).backward()
        finally:
            hooks.remove()
        res.update(_param_grads(model, tag))
        if x.grad is not None:
            res[f"{tag}/x.grad"] = x.grad.clone()
            x.grad = None

    # what the hooks see, on both sides of every layer
    def record(hooks):
        for n in col + row:
            m = model.get_submodule(n)

            def pre(mod, grad_output, n=n):
                res[f"seen/{n}/pre grad_output"] = grad_output[0].clone()

            def post(mod, grad_input, grad_output, n=n):
                res[f"seen/{n}/grad_output"] = grad_output[0].clone()
                if grad_input[0] is not None:
                    res[f"seen/{n}/grad_input"] = grad_input[0].clone()

            hooks.full_backward_pre(m, pre, name=n)
            hooks.full_backward(m, post, name=n)

    run("plain", record)

    # edits of the sharded sides: a column-parallel grad_output, a row-parallel grad_input
    def sharded(hooks):
        for n in col:
            hooks.full_backward_pre(
                model.get_submodule(n), lambda mod, go: (_scale(go[0]), *go[1:]), name=n
            )
        for n in row:
            hooks.full_backward(
                model.get_submodule(n), lambda mod, gi, go: (_scale_or_none(gi[0]), *gi[1:]), name=n
            )

    run("edit sharded", sharded)

    def sharded_in_place(hooks):
        def pre(mod, grad_output):
            grad_output[0].mul_(torch.linspace(0.5, 2.0, grad_output[0].shape[-1]))

        def post(mod, grad_input, grad_output):
            if grad_input[0] is not None:
                grad_input[0].mul_(torch.linspace(0.5, 2.0, grad_input[0].shape[-1]))

        for n in col:
            hooks.full_backward_pre(model.get_submodule(n), pre, name=n)
        for n in row:
            hooks.full_backward(model.get_submodule(n), post, name=n)

    run("edit sharded in place", sharded_in_place)

    # edits of the replicated sides (nothing to gather or re-shard), one of them in place
    def replicated(hooks):
        def in_place(mod, grad_output):
            grad_output[0].mul_(3.0)

        hooks.full_backward_pre(model.get_submodule(row[0]), in_place, name=row[0])
        for n in col:
            hooks.full_backward(
                model.get_submodule(n), lambda mod, gi, go: (_scale_or_none(gi[0]), *gi[1:]), name=n
            )

    run("edit replicated", replicated)

    # FlexModel's backward hook functions: the whole gradient saved, and edited
    saved: dict = {}
    fm = pyhook.FlexModel(model, saved, save_on="all")

    def double(module, grad, ctx, modules):
        return _scale(grad)

    fm.register_full_backward_pre_hook(pyhook.HookFunction(flex[0], editing_function=double))
    fm.register_full_backward_hook(pyhook.HookFunction(flex[1], editing_function=double))
    try:
        _loss(model(x)).backward()
    finally:
        fm.restore()
    for n, kept in saved.items():
        res[f"flex/{n}"] = kept[0]
    res.update(_param_grads(model, "flex"))
    if x.grad is not None:
        res["flex/x.grad"] = x.grad.clone()
    res["hooks left"] = torch.tensor(
        sum(len(m._backward_hooks) + len(m._backward_pre_hooks) for m in model.modules())
    )
    return res


LLAMA_COL = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj"]
LLAMA_ROW = ["model.layers.1.self_attn.o_proj", "model.layers.0.mlp.down_proj"]


def llama_backward(model: nn.Module) -> dict:
    return backward_scenarios(
        model, IDS, LLAMA_COL, LLAMA_ROW, ("model.layers.1.mlp.up_proj", LLAMA_ROW[0])
    )


def make_seq_mlp() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 6))
    with torch.no_grad():
        net[0].weight.uniform_(0.5, 1.5)
        net[0].bias.normal_(0, 0.3)
    return net


SEQ_X = torch.randn(3, 6, 8, generator=torch.Generator().manual_seed(3))


def seq_backward(model: nn.Module, x: torch.Tensor) -> dict:
    """torch's SequenceParallel norm (its output split along the sequence) before a
    ColwiseParallel/RowwiseParallel pair; ``x`` is this rank's share of the sequence of
    ``SEQ_X`` (torch's SequenceParallel needs equal shares)."""
    return backward_scenarios(model, x, ["0", "1"], ["3"], ("0", "3"), input_grad=False)


def gpt2_backward(model: nn.Module) -> dict:
    """FSDP2 and offloading: nothing sharded, the hooks see what they see unsharded."""
    return backward_scenarios(
        model,
        IDS,
        ["transformer.h.0.mlp.c_fc"],
        ["transformer.h.1.mlp.c_proj"],
        ("transformer.h.1.attn.c_attn", "transformer.h.0.mlp.c_proj"),
    )


def mlp_backward(model: nn.Module) -> dict:
    res = backward_scenarios(model, MLP_X, ["0"], ["2"], ("0", "2"))
    if dist.is_initialized():  # a shard returned as the whole gradient is refused by name
        from pyhook._hooks import HookSet

        for n, register in (
            (
                "0",
                lambda h: h.full_backward_pre(model[0], lambda m, go: (go[0][..., :3],), name="0"),
            ),
            (
                "2",
                lambda h: h.full_backward(model[2], lambda m, gi, go: (gi[0][..., :3],), name="2"),
            ),
        ):
            hooks = HookSet()
            register(hooks)
            try:
                _loss(model(MLP_X.clone().requires_grad_())).backward()
                res[f"wrong shape {n}"] = None
            except ValueError as e:
                res[f"wrong shape {n}"] = str(e)
            finally:
                hooks.remove()
                model.zero_grad(set_to_none=True)
    return res


# -- the ranks ------------------------------------------------------------------------------------
def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _unknown_style_mlp() -> tuple[nn.Module, Any]:
    """make_mlp() whose layer "1" has a parallel style pyhook does not know, and the mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import PrepareModuleOutput, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mlp = make_mlp()
    parallelize_module(
        mlp,
        mesh,
        {"1": PrepareModuleOutput(output_layouts=Shard(-1), desired_output_layouts=Shard(-1))},
    )
    return mlp, mesh


def _refusals(rank: int) -> dict:
    """An unknown parallel style is refused by name, and leaves no hook behind."""
    mlp, _ = _unknown_style_mlp()
    before = len(mlp[1]._forward_hooks)
    try:
        pyhook.Trace(mlp, "1")
        msg = None
    except pyhook.distributed.LayoutError as e:
        msg = str(e)
    return {"message": msg, "hooks_left": len(mlp[1]._forward_hooks) - before}


def _backward_refusals(rank: int) -> dict:
    """Backward hooks on an unknown layout are refused by name at registration: no hook is
    left (nor the hooks registered with it in the same set), no HookFunction registered.
    transformers' per-head norm style and a column-parallel layer with a sharded input, whose
    tensors pyhook cannot give whole, are refused too (forward and backward)."""
    from torch.distributed.tensor import Shard
    from transformers.integrations import tensor_parallel as hf_tp

    from pyhook._hooks import HookSet

    mlp, mesh = _unknown_style_mlp()
    out: dict = {}

    def left() -> int:
        return sum(len(m._backward_hooks) + len(m._backward_pre_hooks) for m in mlp)

    hooks = HookSet()
    try:
        with hooks.registering():
            hooks.full_backward_pre(mlp[0], lambda m, go: None, name="0")
            hooks.full_backward(mlp[1], lambda m, gi, go: None, name="1")
        out["hookset"] = None
    except pyhook.distributed.LayoutError as e:
        out["hookset"] = str(e)
    out["hookset left"] = left()

    fm = pyhook.FlexModel(mlp, {})
    hf = pyhook.HookFunction("1")
    try:
        fm.register_full_backward_pre_hook(hf)
        out["flex"] = None
    except pyhook.distributed.LayoutError as e:
        out["flex"] = str(e)
    out["flex left"] = left() + int(hf.registered)

    net = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16))
    hf_tp.ReplicatedWithGradAllReduce().install_forward(net[0], mesh)
    hf_tp.ColwiseParallel(input_layouts=Shard(1)).install_forward(net[1], mesh)

    def styled_hooks() -> int:
        return sum(
            len(m._backward_hooks) + len(m._forward_hooks) + len(m._forward_pre_hooks) for m in net
        )

    styled_before = styled_hooks()  # transformers' own (the per-head norm style's pre-hook)
    for n in ("0", "1"):
        for how, make in (
            ("trace", lambda n=n: pyhook.Trace(net, n)),
            ("backward", lambda n=n: HookSet().full_backward(net[int(n)], print, name=n)),
        ):
            try:
                make()
                out[f"{how} {n}"] = None
            except pyhook.distributed.LayoutError as e:
                out[f"{how} {n}"] = str(e)
    out["styled left"] = styled_hooks() - styled_before
    return out


def _between_shards(llama: nn.Module, mlp: nn.Module) -> dict:
    """A module with no style of its own between a column- and a row-parallel layer (Llama's
    act_fn, the ReLU of a parallelized MLP) sees this rank's slice: refused by name, by every
    tracer, no hook left; the same module of an unsharded model traces as usual."""
    from pyhook._hooks import HookSet

    out: dict = {}

    def hooks_on(model: nn.Module) -> int:
        return sum(
            len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
            for m in model.modules()
        )

    before = {"llama": hooks_on(llama), "mlp": hooks_on(mlp)}
    attempts = {
        "trace act_fn": lambda: pyhook.Trace(llama, "model.layers.0.mlp.act_fn"),
        "tracedict act_fn": lambda: pyhook.TraceDict(
            llama, ["model.layers.0.mlp", "model.layers.1.mlp.act_fn"]
        ),
        "capture act_fn": lambda: capture(llama, "model.layers.*.mlp.act_fn").__enter__(),
        "backward act_fn": lambda: HookSet().full_backward(
            llama.model.layers[0].mlp.act_fn, print, name="model.layers.0.mlp.act_fn"
        ),
        "trace relu": lambda: pyhook.Trace(mlp, "1"),
    }
    for what, make in attempts.items():
        try:
            with make():
                pass
            out[what] = None
        except pyhook.distributed.LayoutError as e:
            out[what] = str(e)
    out["left"] = {"llama": hooks_on(llama) - before["llama"], "mlp": hooks_on(mlp) - before["mlp"]}
    with torch.no_grad(), pyhook.Trace(llama, "model.layers.0.mlp") as t:  # whole: allowed
        llama(IDS)
    out["mlp whole"] = tuple(t.output.shape)
    plain = make_gpt2()
    with torch.no_grad(), pyhook.Trace(plain, "transformer.h.0.mlp.act") as t:
        plain(torch.randint(0, 64, (2, 5)))
    out["plain act"] = tuple(t.output.shape)
    return out


def worker(rank: int, world: int, port: int, outdir: str) -> None:
    results: dict = {}
    try:
        _init(rank, world, port)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )

        llama = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.join(outdir, "llama"), tp_plan="auto"
        ).eval()
        results["llama_tp"] = llama_scenarios(llama)
        results["llama_tp_backward"] = llama_backward(llama)

        mesh = init_device_mesh("cpu", (world,))
        mlp = make_mlp()
        parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        results["mlp_tp"] = mlp_scenarios(mlp)
        results["mlp_tp_backward"] = mlp_backward(mlp)
        results["between"] = _between_shards(llama, mlp)

        seq = make_seq_mlp()
        parallelize_module(
            seq,
            mesh,
            {
                "0": SequenceParallel(),
                "1": ColwiseParallel(input_layouts=Shard(1)),
                "3": RowwiseParallel(),
            },
        )
        results["seq_tp_backward"] = seq_backward(seq, SEQ_X.chunk(world, 1)[rank])

        gpt = make_gpt2()
        for block in gpt.transformer.h:
            fully_shard(block)
        fully_shard(gpt)
        results["gpt2_fsdp"] = gpt2_scenarios(gpt)
        results["gpt2_fsdp_backward"] = gpt2_backward(gpt)

        import accelerate

        gpt = accelerate.cpu_offload(make_gpt2(), execution_device="cpu")
        results["gpt2_offload"] = gpt2_scenarios(gpt)
        results["gpt2_offload_backward"] = gpt2_backward(gpt)

        results["refused"] = _refusals(rank)
        results["refused_backward"] = _backward_refusals(rank)
        dist.barrier()
    except BaseException:
        results["exception"] = traceback.format_exc()
    finally:
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
        if dist.is_initialized():
            dist.destroy_process_group()


# -- compiled tensor-parallel models, distribute_module, writers, gradient meaning -------------
def save_olmo2(path: str) -> None:
    torch.manual_seed(0)
    cfg = transformers.Olmo2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=64,
        max_position_embeddings=32,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    _perturb_norms(transformers.Olmo2ForCausalLM(cfg)).save_pretrained(path)


COMPILED_NAMES = [
    "resid_post.0",
    "attn_z.0",
    "mlp_hidden.0",
    "model.layers.0.self_attn.q_proj",  # colwise: a local shard of the features
    "model.layers.1.mlp.up_proj",
    "model.layers.1.self_attn.o_proj",  # rowwise: whole output, sharded input
]


def compiled_scenarios(model: nn.Module, short: bool = False) -> dict:
    """Trace, TraceDict, run_with_cache and capture on a (compiled) Llama: whole tensors."""
    res: dict = {}
    with torch.no_grad():
        with pyhook.TraceDict(model, COMPILED_NAMES, retain_input=True) as tr:
            res["logits"] = model(IDS).logits
        for n in COMPILED_NAMES:
            res[f"out/{n}"] = tr[n].output
        res["in/o_proj.1"] = tr["model.layers.1.self_attn.o_proj"].input
        if short:
            return res

        def zero_head(output):
            output = output.clone()
            output[..., 1, :] = 0
            return output

        with pyhook.Trace(model, "attn_z.0", edit_output=zero_head):
            res["edit/attn_z.0"] = model(IDS).logits
        with pyhook.Trace(model, "mlp_hidden.1") as t:
            model(IDS)
        res["trace/mlp_hidden.1"] = t.output
        _, cache = pyhook.run_with_cache(model, IDS, names_filter=["attn_z.1", "mlp_hidden.1"])
        for n, v in cache.items():
            res[f"cache/{n}"] = v
        with capture(model, ["attn_z.1", "model.layers.0.self_attn.k_proj"], to="host") as rec:
            model(IDS)
        for n, t in rec.results().items():
            res[f"capture/{n}"] = t
    return res


def _distribute_module_refusal(mesh: Any) -> dict:
    """distribute_module with output_fn/input_fn of the user's: refused by name, no hook left;
    the writer count cannot be read off it either (tp_size= asked for)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
    from torch.distributed.tensor import distribute_tensor as dt

    from pyhook._hooks import HookSet

    def shard_rows(name, module, mesh):
        for pname, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, nn.Parameter(dt(p.detach(), mesh, [Shard(0)])))

    def replicate_in(mod, inputs, mesh):
        return tuple(DTensor.from_local(x, mesh, [Replicate()]) for x in inputs)

    def local_out(mod, out, mesh):
        return out.to_local()

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16))
    distribute_module(net[0], mesh, shard_rows, replicate_in, local_out)
    out: dict = {"local width": net(MLP_X).shape[-1]}
    before = len(net[0]._forward_hooks) + len(net[0]._forward_pre_hooks)
    attempts = {
        "trace": lambda: pyhook.Trace(net, "0"),
        "capture": lambda: capture(net, ["0"], to="host").__enter__(),
        "input point": lambda: pyhook.Trace(net, "0:in"),
        "backward": lambda: HookSet().full_backward(net[0], print, name="0"),
    }
    for what, make in attempts.items():
        try:
            with make():
                net(MLP_X)
            out[what] = None
        except pyhook.distributed.LayoutError as e:
            out[what] = str(e)
    out["left"] = len(net[0]._forward_hooks) + len(net[0]._forward_pre_hooks) - before
    try:
        pyhook.distributed.tensor_parallel_ranks(net)
        out["ranks"] = None
    except pyhook.distributed.LayoutError as e:
        out["ranks"] = str(e)
    return out


def _parallelize_module_writers(mesh: Any, outdir: str) -> dict:
    """A raw capture of a parallelize_module model (no model.tp_size): one writer per group."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from pyhook.pipeline.ranks import rank_layout

    mlp = make_mlp()
    parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    lay = rank_layout(model=mlp)
    with torch.no_grad(), capture(mlp, ["0", "2"], out=os.path.join(outdir, "mlp_store")):
        mlp(MLP_X)
    return {"tp_size": lay.tp_size, "writer": lay.writer}


GRAD_POINTS = [
    "attn_in.0",
    "mlp_in.1",
    "model.layers.0.self_attn.q_proj:in",
    "model.layers.1.mlp.up_proj:in",
    "model.layers.1.self_attn.o_proj:in",
]


def olmo2_grads(model: nn.Module) -> dict:
    """retain_grad (Trace, TraceDict) and run_with_cache's gradients at input points that other
    modules read too."""
    res: dict = {}
    for n in GRAD_POINTS:
        with pyhook.Trace(model, n, retain_grad=True) as t:
            _loss(model(IDS)).backward()
        model.zero_grad()
        res[f"trace/{n}"] = t.output.grad
    _, cache = pyhook.run_with_cache(
        model, IDS, names_filter=GRAD_POINTS, incl_bwd=True, metric=_loss
    )
    model.zero_grad()
    for n in GRAD_POINTS:
        res[f"cache/{n}"] = cache[f"{n}_grad"]
    return res


def edges_worker(rank: int, world: int, port: int, outdir: str, compiled: bool) -> None:
    """The scenarios of test_layout_edges: the compiled ones alone (``compiled``: slow to
    compile), or the others."""
    results: dict = {}
    try:
        _init(rank, world, port)
        from torch.distributed.device_mesh import init_device_mesh

        if not compiled:
            mesh = init_device_mesh("cpu", (world,))
            results["distribute_module"] = _distribute_module_refusal(mesh)
            results["writers"] = _parallelize_module_writers(mesh, outdir)
            olmo = transformers.AutoModelForCausalLM.from_pretrained(
                os.path.join(outdir, "olmo2"), tp_plan="auto", dtype=torch.float64
            ).eval()
            results["olmo2_tp"] = olmo2_grads(olmo)
        else:
            llama = transformers.AutoModelForCausalLM.from_pretrained(
                os.path.join(outdir, "llama"), tp_plan="auto"
            ).eval()
            results["compiled_eager"] = compiled_scenarios(torch.compile(llama, backend="eager"))
            llama2 = transformers.AutoModelForCausalLM.from_pretrained(
                os.path.join(outdir, "llama"), tp_plan="auto"
            ).eval()
            llama2.compile(backend="eager")
            results["module_compile"] = compiled_scenarios(llama2, short=True)
            llama3 = transformers.AutoModelForCausalLM.from_pretrained(
                os.path.join(outdir, "llama"), tp_plan="auto"
            ).eval()
            inductor = torch.compile(llama3, backend="inductor")
            results["inductor"] = compiled_scenarios(inductor, short=True)
        dist.barrier()
    except BaseException:
        results["exception"] = traceback.format_exc()
    finally:
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
        if dist.is_initialized():
            dist.destroy_process_group()
