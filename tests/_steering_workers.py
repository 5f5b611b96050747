"""Code run by the gloo ranks of test_steering_layouts.py: steered ``generate`` on a
tensor-parallel Llama (transformers' ``tp_plan="auto"``), each rank saving its tokens and
the logits of every step."""

from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist
import transformers
from _layout_workers import _init
from _models import randomise_norms

import pyhook

PROMPTS = [[5, 6, 7, 8, 9, 10], [8, 9], [1, 2, 3]]
NEW = 5


def save_llama(path: str) -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=64,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    randomise_norms(transformers.LlamaForCausalLM(cfg)).save_pretrained(path)


def vectors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(32, generator=g) for _ in range(3)]


def specs() -> list:
    v = vectors()
    return [
        pyhook.Steer("resid_post.0", v[0], scale=4.0),
        [
            pyhook.Steer("attn_out.1", v[1], scale=-3.0, prompt=[-1], generated=(1, 3)),
            pyhook.Steer("resid_post.1", v[2], op="ablate"),
        ],
        None,
    ]


def steered_generate(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in PROMPTS)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    am = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    seen: list[torch.Tensor] = []

    def head(_m, _a, out):
        seen.append(out[:, -1].detach().clone())

    h = model.get_output_embeddings().register_forward_hook(head)
    try:
        with pyhook.steering(model, specs()), torch.no_grad():
            out = model.generate(
                ids, attention_mask=am, max_new_tokens=NEW, do_sample=False, pad_token_id=0
            )
    finally:
        h.remove()
    logits = torch.stack(seen, 1)
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    return out[:, width:], logits


def worker(rank: int, world: int, port: int, outdir: str) -> None:
    results: dict = {}
    try:
        _init(rank, world, port)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.join(outdir, "llama"), tp_plan="auto"
        ).eval()
        results["tokens"], results["logits"] = steered_generate(model)
        dist.barrier()
    except BaseException:
        results["exception"] = traceback.format_exc()
    finally:
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
        if dist.is_initialized():
            dist.destroy_process_group()
