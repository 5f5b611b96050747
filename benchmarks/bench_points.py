"""Standard hook points: what resolving them costs, and tracing through them vs module names.

(a) Resolving: for each architecture (tiny random-weight models from ``transformers`` configs,
    12 blocks), the first ``expand_points(model, "resid_post.*")`` on a model (finding the
    mapping row and the blocks: a walk of the module tree, then cached per model) and the
    following ones (cached), in microseconds.
(b) Tracing: a whole ``with pyhook.TraceDict(...)`` cycle (resolve, register, forward, remove)
    through ``resid_post.*`` against the same layers named as modules (``transformer.h.0``, ...),
    paired rounds in rotating order, median of the per-round ratios. The target is <= 1.05x.
    ``deep-200`` is a 200-block toy model with a one-line mapping and a cheap forward, where
    the per-hook cost of the point wrapper is most visible.

Run: ``python benchmarks/bench_points.py`` (``--quick`` for a short smoke run).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import transformers as T
from torch import nn

import pyhook
from pyhook import points

L = 12
KW = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=L,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
)
ARCHS: dict[str, Callable[[], nn.Module]] = {
    "gpt2": lambda: T.GPT2LMHeadModel(
        T.GPT2Config(n_embd=64, n_layer=L, n_head=4, vocab_size=128, bos_token_id=0, eos_token_id=0)
    ),
    "gpt_neox": lambda: T.GPTNeoXForCausalLM(
        T.GPTNeoXConfig(
            **{k: v for k, v in KW.items() if k != "num_key_value_heads"},
            eos_token_id=0,
            bos_token_id=0,
        )
    ),
    "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**KW)),
    "mixtral": lambda: T.MixtralForCausalLM(T.MixtralConfig(**KW, num_local_experts=4)),
    "gemma2": lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**KW, head_dim=16)),
    "phi": lambda: T.PhiForCausalLM(
        T.PhiConfig(**{k: v for k, v in KW.items() if k != "num_key_value_heads"})
    ),
    "bert": lambda: T.BertModel(
        T.BertConfig(
            hidden_size=64,
            num_hidden_layers=L,
            num_attention_heads=4,
            intermediate_size=128,
            vocab_size=128,
        )
    ),
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix, self.ff = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(x + self.mix(x))


class Deep(nn.Module):
    def __init__(self, n: int = 200) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def timed(fn: Callable[[], object], inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def paired_ratio(a: Callable[[], object], b: Callable[[], object], repeat: int, inner: int):
    """Median times of a and b and the median of the per-round ratios b/a (rotating order)."""
    for fn in (a, b):
        for _ in range(3):
            fn()
    ta, tb, ratios = [], [], []
    for r in range(repeat):
        if r % 2:
            y, x = timed(b, inner), timed(a, inner)
        else:
            x, y = timed(a, inner), timed(b, inner)
        ta.append(x)
        tb.append(y)
        ratios.append(y / x)
    q = sorted(ratios)
    return (
        statistics.median(ta),
        statistics.median(tb),
        statistics.median(ratios),
        q[len(q) // 4],
        q[(3 * len(q)) // 4],
    )


def resolve_cost(model: nn.Module, repeat: int) -> tuple[float, float]:
    cold, warm = [], []
    for _ in range(repeat):
        points._CACHE.clear()
        t0 = time.perf_counter()
        points.expand_points(model, "resid_post.*")
        t1 = time.perf_counter()
        points.expand_points(model, "resid_post.*")
        t2 = time.perf_counter()
        cold.append(t1 - t0)
        warm.append(t2 - t1)
    return statistics.median(cold) * 1e6, statistics.median(warm) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=41)
    p.add_argument("--quick", action="store_true", help="a few rounds only (smoke run)")
    args = p.parse_args()
    repeat = 5 if args.quick else args.repeat
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(
        f"pyhook {pyhook.__version__}, torch {torch.__version__}, transformers {T.__version__}, "
        f"threads=1, medians of {repeat} rounds"
    )
    models = {name: make().eval() for name, make in ARCHS.items()}

    print(f"\n(a) resolving 'resid_post.*' ({L} blocks), microseconds")
    print(f"{'architecture':14} {'modules':>7} {'first call':>10} {'cached':>8}")
    for name, model in models.items():
        cold, warm = resolve_cost(model, repeat)
        n = sum(1 for _ in model.modules())
        print(f"{name:14} {n:7d} {cold:10.1f} {warm:8.1f}")

    print("\n(b) whole TraceDict cycle: standard points vs the same layers by module name")
    header = f"{'case':26} {'names ms':>9} {'points ms':>9} {'ratio':>6} {'(IQR)':>13}"
    print(header)
    print("-" * len(header))
    ids = torch.randint(0, 128, (1, 16))
    deep = Deep().eval()
    points.register_architecture(Deep, blocks="blocks", attn="mix", mlp="ff", mid=None)
    xs = torch.randn(4, 8)
    cases = [
        (f"gpt2-{L}L resid_post", models["gpt2"], "transformer.h", ids),
        (f"llama-{L}L resid_post", models["llama"], "model.layers", ids),
        ("deep-200 resid_post", deep, "blocks", xs),
    ]
    with torch.no_grad():
        for label, model, blocks, x in cases:
            n = len(model.get_submodule(blocks))
            names = [f"{blocks}.{i}" for i in range(n)]

            def by_name(model=model, names=names, x=x) -> None:
                with pyhook.TraceDict(model, names):
                    model(x)

            def by_point(model=model, x=x) -> None:
                with pyhook.TraceDict(model, ["resid_post.*"]):
                    model(x)

            inner = 3 if "deep" in label else 5
            a, b, ratio, lo, hi = paired_ratio(by_name, by_point, repeat, inner)
            print(
                f"{label:26} {a * 1e3:9.3f} {b * 1e3:9.3f} {ratio:6.3f} {f'{lo:.3f}-{hi:.3f}':>13}"
            )


if __name__ == "__main__":
    main()
