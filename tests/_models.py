"""Small real models shared by the tests (no downloads: transformers models come from configs)."""

from __future__ import annotations

import collections
import dataclasses

import torch
from torch import nn

Pair = collections.namedtuple("Pair", ["hidden", "aux"])


@dataclasses.dataclass
class DataOut:
    hidden: torch.Tensor
    note: str = "x"


class NamedTupleBlock(nn.Module):
    """Returns a namedtuple holding a tensor and a None (like HF blocks' optional outputs)."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> Pair:
        return Pair(self.lin(x), None)


class DictBlock(nn.Module):
    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> dict:
        h = self.lin(x)
        return {"hidden": h, "pair": (h * 2, "tag"), "cache": object()}


class Counting(nn.Module):
    """Identity that counts how often it ran (to prove that a forward was cut short)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x


class ResidualBlock(nn.Module):
    """The block of baukit PR #2's compatibility suite: forward(hidden_states, scale_factor=1.0)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, hidden_states: torch.Tensor, scale_factor: float = 1.0) -> torch.Tensor:
        return hidden_states + torch.relu(self.lin(hidden_states)) * scale_factor


class DummyModel(nn.Module):
    def __init__(self, d: int = 8, n: int = 3, use_kwargs: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({f"block_{i}": ResidualBlock(d) for i in range(n)})
        self.use_kwargs = use_kwargs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            x = block(hidden_states=x, scale_factor=0.5) if self.use_kwargs else block(x)
        return x


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6), Counting(), nn.Linear(6, 2))


def gpt2(n_layer: int = 2, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_layer=n_layer,
        n_embd=32,
        n_head=2,
        vocab_size=100,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg).eval()


def randomise_norms(model: nn.Module) -> nn.Module:
    """Every norm's weight and bias drawn far from 1 and 0 (seed 1), in place: with HF's init a
    norm's input, its normalised value and its output cannot be told apart."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if "Norm" in type(m).__name__:
                for name, base in (("weight", 1.0), ("bias", 0.0)):
                    p = getattr(m, name, None)
                    if isinstance(p, torch.Tensor):
                        p.copy_(base + 0.7 * torch.randn(p.shape, generator=g))
    return model


def all_hooks(model: nn.Module) -> int:
    """Number of hooks of every kind on every submodule."""
    total = 0
    for m in model.modules():
        total += len(m._forward_hooks) + len(m._forward_pre_hooks)
        total += len(m._backward_hooks) + len(m._backward_pre_hooks)
        # flags of removed hooks must be gone too (a leak of PyTorch's bookkeeping)
        assert set(getattr(m, "_forward_hooks_with_kwargs", {})) <= set(m._forward_hooks)
    return total


def word_tokenizer(docs):
    """A real tokenizer that needs no download: a WordLevel one trained on ``docs``, with
    GPT-2's special-token layout (one <|endoftext|> that is BOS, EOS and pad)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t.train_from_iterator(
        docs, trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|endoftext|>"])
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=t,
        unk_token="[UNK]",
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )


def save_gpt2_lm(folder, tok, *, seed: int = 0):
    """Save a small GPT-2 LM checkpoint (2 layers x 32, random weights, 64 positions) whose
    vocabulary and special tokens are ``tok``'s, with ``tok`` beside it, as
    ``from_pretrained`` and the ``pyhook`` command load it; returns the model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=len(tok),
        n_positions=64,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model = GPT2LMHeadModel(cfg).eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model


def offloaded_llama(ckpt, offload_folder, *, disk=("model.layers.1",), **kwargs):
    """The ``LlamaForCausalLM`` saved in ``ckpt`` loaded through accelerate with the modules
    ``disk`` on disk (their weights on the meta device, read in at each call) and the rest on
    the CPU; ``kwargs`` go to ``from_pretrained`` (``dtype=``)."""
    import transformers

    layers = transformers.AutoConfig.from_pretrained(ckpt).num_hidden_layers
    names = [
        "model.embed_tokens",
        "model.rotary_emb",
        *(f"model.layers.{i}" for i in range(layers)),
        "model.norm",
        "lm_head",
    ]
    device_map = {n: "disk" if n in disk else "cpu" for n in names}
    return transformers.LlamaForCausalLM.from_pretrained(
        ckpt, device_map=device_map, offload_folder=offload_folder, **kwargs
    ).eval()


def checkpointed_copy(plain: nn.Module, reentrant: bool) -> tuple[nn.Module, nn.Module]:
    """(a copy of ``plain`` with transformers' gradient checkpointing, ``plain``), both in
    train mode: the copy checkpoints each decoder layer, reentrant or not."""
    import copy
    import warnings

    plain = plain.train()
    ckpt = copy.deepcopy(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the name changes in transformers 6
        ckpt.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant}
        )
    return ckpt.train(), plain
