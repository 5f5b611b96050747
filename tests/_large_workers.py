"""Code run by the gloo ranks that tests/test_large_jobs.py spawns: captures over data-parallel x
tensor-parallel (x FSDP) ranks, in processes that joined their process group without
``RANK``/``WORLD_SIZE`` in the environment (as ``mp.spawn`` and hand-made launchers do)."""

from __future__ import annotations

import os
import traceback

import torch

DOCS = [
    "the king had three sons and the youngest was called the fool",
    "once upon a time there lived a poor miller who had a beautiful daughter",
    "the wolf went to the house of the grandmother and knocked at the door",
    "a frog came up out of the well and spoke to the princess",
    "the old woman gave the girl a golden spindle and sent her home",
    "seven dwarfs lived in a little house behind the mountains",
    "the tailor killed seven flies with one blow and was proud of it",
    "the goose girl sat by the stream and combed her golden hair",
] * 3


def save_llama_lm(folder, tok, *, seed: int = 0):
    """A toy Llama LM (2 layers x 32, 4 heads and 4 key/value heads: tensor-parallel over 1, 2
    or 4 ranks) whose vocabulary is ``tok``'s, saved with ``tok``; norms get weights that are
    not 1 (a gather or a shard that skipped them would show)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.5 + torch.rand_like(p))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model


def examples(ckpt: str, n: int = 8, length: int = 9):
    """``n`` examples of ``length`` tokens (the last two of every third padded)."""
    torch.manual_seed(1)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(ckpt).vocab_size
    out = []
    for i in range(n):
        ids = torch.randint(2, vocab, (1, length))
        am = torch.ones(1, length, dtype=torch.long)
        if i % 3 == 2:
            am[0, -2:] = 0
        out.append((ids, am))
    return out


def _init(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)  # the ranks come from torch.distributed alone
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )


def _raw_capture(model, layers: str, mine, out: str) -> None:
    """A raw ``capture`` of this rank's examples, one forward each."""
    from pyhook.capture import capture

    with capture(model, layers, out=out, mask="attention_mask") as rec, torch.no_grad():
        for ids, am in mine:
            model(input_ids=ids, attention_mask=am)
    return rec


def worker(rank: int, world: int, port: int, outdir: str, spec: dict) -> None:
    """Every scenario, in order, on the same ranks; each rank saves what it saw."""
    import time

    import torch.distributed as dist

    res: dict = {"t": []}
    t0 = time.perf_counter()
    try:
        _init(rank, world, port)
        from pyhook import CaptureJob
        from pyhook.pipeline.ranks import rank_layout

        res["layout"] = rank_layout()
        # 1. the job, data-parallel x tensor-parallel, every option as a user gives it
        job = CaptureJob(**spec["job"], tp_size=spec["tp"], out=os.path.join(outdir, "job"))
        plan = job.plan()
        res["plan_ranks"] = plan.ranks
        res["plan_report"] = plan.report()
        res["plan_rows"] = plan.rows
        job.run(plan)
        res["t"].append(time.perf_counter() - t0)
        # 2. begun over one tensor-parallel group of every rank (one writer), half the corpus
        half = {**spec["job"], "limit": spec["job"]["limit"] // 2}
        CaptureJob(**half, tp_size=world, out=os.path.join(outdir, "half")).run()
        res["t"].append(time.perf_counter() - t0)
        # 3. a raw capture of a transformers tensor-parallel model (tp_plan) from every rank
        import transformers
        from transformers.distributed import DistributedConfig

        tp = spec["tp"]
        model = transformers.AutoModelForCausalLM.from_pretrained(
            spec["ckpt"],
            distributed_config=DistributedConfig(tp_size=tp, dp_replicate_size=world // tp),
        ).eval()
        lay = rank_layout(model=model)
        res["model_layout"] = lay
        mine = examples(spec["ckpt"])[lay.dp_rank :: lay.dp_size]  # as DistributedSampler deals
        rec = _raw_capture(model, "model.layers.*", mine, os.path.join(outdir, "raw_tp"))
        # what this rank copied to host memory for the store (its own rows' bytes, or none)
        res["raw_tp_copied"] = (
            rec._offloader_.stats()["bytes_submitted"] if rec._offloader_ is not None else 0
        )
        res["raw_tp_bytes"] = rec.bytes
        res["t"].append(time.perf_counter() - t0)
        # 4. FSDP2: every rank data-parallel, its own examples; row indices global
        from torch.distributed.fsdp import fully_shard

        model = transformers.AutoModelForCausalLM.from_pretrained(spec["ckpt"]).eval()
        for block in model.model.layers:
            fully_shard(block)
        fully_shard(model)
        mine = examples(spec["ckpt"])[rank::world]
        _raw_capture(model, "model.layers.*", mine, os.path.join(outdir, "raw_fsdp"))
        res["t"].append(time.perf_counter() - t0)
    except BaseException:
        res["exception"] = traceback.format_exc()
    finally:
        torch.save(res, os.path.join(outdir, f"rank{rank}.pt"))
        if dist.is_initialized():
            dist.destroy_process_group()


def ray_loop(config: dict) -> None:
    """Ray Train's ``train_loop_per_worker``: the same job as torchrun's ranks run."""
    from pyhook import CaptureJob

    CaptureJob(**config).run()


def tp_gradients_and_fsdp_resume(rank: int, world: int, port: int, outdir: str, spec: dict) -> None:
    """Two ranks (issue 54 items 3 and 4): a job's gradients through a tensor-parallel model;
    a job and a raw capture begun on an FSDP2 model (its class ``FSDP<class>``) and resumed by
    the plain model on the same two writers."""
    import time

    import torch.distributed as dist

    res: dict = {"t": []}
    t0 = time.perf_counter()
    try:
        _init(rank, world, port)
        import transformers
        from pyhook.capture import capture
        from torch.distributed.fsdp import fully_shard

        from pyhook import CaptureJob

        # 1. gradients with tp_size: one tensor-parallel group of both ranks, one writer
        CaptureJob(
            **spec["job"],
            tp_size=world,
            gradients=True,
            metric="loss",
            out=os.path.join(outdir, "grad_tp"),
        ).run()
        res["t"].append(time.perf_counter() - t0)
        torch.save(res, os.path.join(outdir, f"rank{rank}.pt"))  # (where a hang stopped)

        def fsdp_model():
            model = transformers.AutoModelForCausalLM.from_pretrained(spec["ckpt"]).eval()
            for block in model.model.layers:
                fully_shard(block)
            fully_shard(model)
            return model

        # 2. a job begun on the FSDP2 model (4 contexts: one batch on each rank, as FSDP's
        # collectives need), resumed from the checkpoint
        half = {**spec["job"], "limit": 4}
        job_out = os.path.join(outdir, "fsdp_job")
        CaptureJob(**{**half, "model": fsdp_model()}, out=job_out).run()
        res["fsdp_job_class"] = type(fsdp_model()).__name__
        try:
            CaptureJob(**spec["job"], out=job_out).run()
            res["fsdp_job_resume"] = None
        except Exception as e:
            res["fsdp_job_resume"] = f"{type(e).__name__}: {e}"
        res["t"].append(time.perf_counter() - t0)
        torch.save(res, os.path.join(outdir, f"rank{rank}.pt"))
        # 3. a raw capture begun on the FSDP2 model, resumed by the plain model
        mine = examples(spec["ckpt"])[rank::world]
        raw_out = os.path.join(outdir, "fsdp_raw")
        model = fsdp_model()
        with capture(model, "model.layers.*", out=raw_out, mask="attention_mask"), torch.no_grad():
            for ids, am in mine[: len(mine) // 2]:
                model(input_ids=ids, attention_mask=am)
        plain = transformers.AutoModelForCausalLM.from_pretrained(spec["ckpt"]).eval()
        try:
            with (
                capture(plain, "model.layers.*", out=raw_out, mask="attention_mask") as rec,
                torch.no_grad(),
            ):
                for ids, am in mine[rec.examples_done :]:
                    plain(input_ids=ids, attention_mask=am)
            res["fsdp_raw_resume"] = None
        except Exception as e:
            res["fsdp_raw_resume"] = f"{type(e).__name__}: {e}"
        res["t"].append(time.perf_counter() - t0)
    except BaseException:
        res["exception"] = traceback.format_exc()
    finally:
        torch.save(res, os.path.join(outdir, f"rank{rank}.pt"))
        if dist.is_initialized():
            dist.destroy_process_group()
