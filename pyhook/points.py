"""Standard hook points: one name for each place in every transformer.

Every ``transformers`` architecture names its insides differently (``transformer.h.3`` on GPT-2,
``model.layers.3`` on Llama, ``gpt_neox.layers.3`` on Pythia). The standard points name the same
places on all of them, and every pyhook tool takes them where it takes a module name
(:class:`~pyhook.Trace`, :class:`~pyhook.TraceDict`, :func:`~pyhook.capture.capture`,
:class:`~pyhook.TruncatedModule`, :class:`~pyhook.FlexModel` hook functions, ``pyhook capture
--layers``):

=================  ===========================================================================
``embed``          the hidden state entering block 0 (token + position embeddings, any scaling)
``resid_pre.L``    the input of block ``L`` (a pre-hook on the block)
``attn_in.L``      what the attention module receives (the normalised input on pre-norm models)
``attn_z.L``       the attention's per-head output before the output projection,
                   ``[..., heads, d_head]``
``attn_out.L``     the attention branch's output, as it is added to the residual stream
``resid_mid.L``    the residual stream after attention, before the MLP (absent on parallel
                   attention architectures: GPT-J, Pythia, Falcon, Phi, ...)
``mlp_in.L``       what the MLP module receives (the normalised input on pre-norm models)
``mlp_hidden.L``   the MLP's hidden activation, the input of its down projection (refused in
                   a mixture of experts: :class:`PointUnavailableError`)
``mlp_out.L``      the MLP branch's output, as it is added to the residual stream
``resid_post.L``   the output of block ``L``
``final``          the output of the final norm (the last block's output where there is none)
=================  ===========================================================================

On GPT-2 and Llama, ``attn_q.L``, ``attn_k.L`` and ``attn_v.L`` are the per-head queries, keys
(after the rotary embedding) and values, ``[batch, pos, head, d_head]``; they are named
explicitly (not in :func:`point_names` nor in ``*.L`` globs), and refused elsewhere.

``L`` may be negative (``resid_post.-1``), a range (``resid_post.2:5``, Python's slice rules) or
a glob (``resid_post.*``, ``*.3``). TransformerLens' names are taken too, each holding what it
holds in TransformerLens or refused with the reason (:func:`tl_unavailable`): aliases of points
(``blocks.3.hook_resid_post``, ``blocks.3.attn.hook_z``, ...) and values of their own
(``blocks.3.ln2.hook_normalized`` / ``hook_scale``, before the norm's weight and bias, and
``hook_embed``, the token embeddings). Any module's input is spelt
``"<module name>:in"`` (:func:`module_inputs`) wherever a module name is taken. A point resolves
to a :class:`Point`: a module, whether the tensor is its input (a forward pre-hook) or its
output, and where the tensor sits in the arguments or the output tuple. Tools hand users the
hidden-state tensor itself, and an edit replaces exactly that tensor (an edit at
``resid_pre.L`` is seen by block ``L`` only; the rest of a block's output tuple, caches
included, passes through untouched).

The mapping from points to modules is data: :data:`ARCHITECTURES`, one :class:`Architecture`
row per ``config.model_type`` (or model class), which also generates the docs' table. Add your
own with :func:`register_architecture`.

Example::

    >>> import torch, transformers, pyhook
    >>> cfg = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=64)
    >>> model = transformers.GPT2LMHeadModel(cfg).eval()
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> with pyhook.TraceDict(model, ["resid_pre.1", "resid_post.0"]) as ret:
    ...     out = model(ids, output_hidden_states=True)
    >>> torch.equal(ret["resid_pre.1"].output, out.hidden_states[1])
    True
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import re
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .distributed import _input_key
from .modules import LayerNotFoundError, get_module, glob_regex

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "Point",
    "PointUnavailableError",
    "UnknownArchitectureError",
    "architecture_of",
    "architecture_table",
    "expand_points",
    "is_point_name",
    "module_inputs",
    "point_names",
    "points_by_module",
    "register_architecture",
    "resolve_point",
    "tl_unavailable",
]

#: The per-layer point kinds, in the order a block computes them.
LAYER_KINDS = (
    "resid_pre",
    "attn_in",
    "attn_z",
    "attn_out",
    "resid_mid",
    "mlp_in",
    "mlp_hidden",
    "mlp_out",
    "resid_post",
)
KINDS = ("embed", *LAYER_KINDS, "final")
#: Per-head query, key and value points (``[batch, pos, head, d_head]``, the query and key after
#: rotary embedding): named explicitly only (not in :func:`point_names`, nor in ``*.L`` globs),
#: on the GPT-2 and Llama families (:data:`QKV_MODULES`); other architectures refuse them.
QKV_KINDS = ("attn_q", "attn_k", "attn_v")
#: The sites inside a block: the input of a module of the block (see :class:`Architecture`).
SITE_KINDS = ("attn_in", "attn_z", "mlp_in", "mlp_hidden")
#: TransformerLens' names of the sites inside a block that are aliases (``blocks.L.<alias>``).
TL_SITES = {
    "attn_z": "attn.hook_z",
    "mlp_hidden": "mlp.hook_post",
}
#: TransformerLens' norm hooks inside a block (``blocks.L.<name>``): pyhook kinds of their own,
#: the values *before* the norm's weight and bias (see :func:`point_names` with ``tl=True``).
TL_NORMS = {
    "ln1_scale": "ln1.hook_scale",
    "ln1_normalized": "ln1.hook_normalized",
    "ln2_scale": "ln2.hook_scale",
    "ln2_normalized": "ln2.hook_normalized",
}
#: The model-wide TransformerLens names that are pyhook kinds of their own.
TL_GLOBAL = {
    "tok_embed": "hook_embed",
    "final_scale": "ln_final.hook_scale",
    "final_normalized": "ln_final.hook_normalized",
}
#: TransformerLens' per-layer names in forward order, as pyhook kinds.
TL_LAYER_KINDS = (
    "resid_pre",
    "ln1_scale",
    "ln1_normalized",
    "attn_z",
    "attn_out",
    "resid_mid",
    "ln2_scale",
    "ln2_normalized",
    "mlp_hidden",
    "mlp_out",
    "resid_post",
)


# -- the data ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Architecture:
    """One row of the mapping: where the standard points sit in one architecture.

    Paths are dotted module names. ``blocks`` (the ``ModuleList`` of blocks) and ``final`` (the
    final norm) are relative to the base model (e.g. ``LlamaModel``; the prefix of a
    ``...ForCausalLM`` head model is found automatically); ``attn``, ``mlp`` and ``mid`` are
    relative to one block. ``attn`` and ``mlp`` name the module whose *output* is ``attn_out`` /
    ``mlp_out``, ``mid`` the module whose *input* is ``resid_mid`` (``None``: a parallel
    attention block, which has no ``resid_mid``). A path may end in ``:in`` or ``:out`` to take
    the other side of the module, and in ``!`` when the model later modifies that tensor in
    place (the model then goes on with a copy, so what hooks see, edit in place or return is
    never changed by it). ``when`` is a condition on the config (``"attr"``,
    ``"not attr"``, joined by ``" or "``): rows of one key are tried in order, the first whose
    condition holds is used. ``key`` is a ``config.model_type`` or a model class name.

    The sites inside a block name, relative to one block, the module whose *input* each is:
    ``attn_in`` (the attention module), ``attn_z`` (the attention's output projection: its
    input is the per-head output, handed over as ``[..., heads, d_head]``, with ``heads`` a
    config attribute or a number), ``mlp_in`` (the MLP module) and ``mlp_hidden`` (the MLP's
    down projection). ``None``: the site is not mapped (it is then not listed, and asking for it
    raises :class:`PointUnavailableError`); ``moe=True``: the MLP is a mixture of experts, whose
    hidden activations are not one tensor per token (``mlp_hidden`` is refused). ``flat``: the
    kinds the model computes as ``[batch*tokens, ...]`` (OPT's MLP); captures see them as
    ``[batch, tokens, ...]``, so masks, positions and token ids apply to them as to the others.
    ``sites_note`` is the docs' note on the sites.

    TransformerLens' names: ``ln1`` / ``ln2`` name, relative to one block, the norm modules
    whose output the attention / the MLP reads (TransformerLens' ``blocks.L.ln1`` /
    ``blocks.L.ln2``: their ``hook_normalized`` and ``hook_scale`` are computed from these
    modules' inputs); ``None``: those names are refused. ``tl_differs``: the kinds whose
    TransformerLens name holds another tensor on this architecture (``"embed"`` for
    ``hook_embed``), refused under that name (post-norm blocks: TransformerLens'
    ``hook_resid_mid`` / ``hook_resid_post`` are before the norms, pyhook's after).

    Example::

        >>> from pyhook.points import Architecture
        >>> Architecture("llama", "layers", "self_attn", "mlp", "post_attention_layernorm", "norm").parallel
        False
    """

    key: str
    blocks: str
    attn: str
    mlp: str
    mid: str | None
    final: str | None
    when: str | None = None
    note: str = ""
    attn_in: str | None = None
    attn_z: str | None = None
    mlp_in: str | None = None
    mlp_hidden: str | None = None
    heads: str | int = "num_attention_heads"
    moe: bool = False
    sites_note: str = ""
    flat: tuple[str, ...] = ()
    ln1: str | None = None
    ln2: str | None = None
    tl_differs: tuple[str, ...] = ()

    @property
    def parallel(self) -> bool:
        """Whether attention and MLP read the same input (then ``resid_mid`` does not exist)."""
        return self.mid is None


A = Architecture
_POST_NORM = "post-norm: no final norm, `final` is the last block's output"
_POST_BRANCH = "attn_out/mlp_out are taken after the post-branch norms"
_MULTIPLIER = "`attn_out`/`mlp_out` are taken before the residual multiplier"
_SHARED = "parallel: one norm feeds both branches, so `attn_in` and `mlp_in` hold the same values (an edit at either reaches its own branch only)"
_TWO_NORMS = "parallel: each branch has its own norm"
_MOE = "`mlp_hidden`: refused (a mixture of experts has no one hidden activation per token)"
_SANDWICH = "sandwich norms: `attn_in`/`mlp_in` are after the pre-norms; the projections of `attn_z` and the MLP of `mlp_in` give the branch outputs before the post-norms"
_NO_PRE_NORM = "no pre-norms: `attn_in` holds `resid_pre`'s values and `mlp_in` `resid_mid`'s (an edit there reaches that branch only, not the skip connection)"
_ENCODER = "post-norm: `attn_in` holds `resid_pre`'s values and `mlp_in` `resid_mid`'s (an edit there reaches that branch only)"
_OPT = "`mlp_in`/`mlp_hidden` are [batch*tokens, ...] in hooks, as OPT computes them; captures store one row per token, masked like every layer"
# The sites inside a block, by family: (attn_in, attn_z, mlp_in, mlp_hidden), relative to a block.
# ln1/ln2: the norms TransformerLens calls blocks.L.ln1 / ln2 (see Architecture)
_LN_HF = dict(ln1="input_layernorm", ln2="post_attention_layernorm")
_LLAMA = dict(
    attn_in="self_attn",
    attn_z="self_attn.o_proj",
    mlp_in="mlp",
    mlp_hidden="mlp.down_proj",
    **_LN_HF,
)
_MOE_SITES = dict(
    attn_in="self_attn",
    attn_z="self_attn.o_proj",
    mlp_in="mlp",
    moe=True,
    sites_note=_MOE,
    **_LN_HF,
)
_GPT2 = dict(
    attn_in="attn",
    attn_z="attn.c_proj",
    mlp_in="mlp",
    mlp_hidden="mlp.c_proj",
    ln1="ln_1",
    ln2="ln_2",
)
_GPTJ = dict(
    attn_in="attn",
    attn_z="attn.out_proj",
    mlp_in="mlp",
    mlp_hidden="mlp.fc_out",
    sites_note=_SHARED,
    ln1="ln_1",
    ln2="ln_1",
)
_NEOX = dict(
    attn_in="attention",
    attn_z="attention.dense",
    mlp_in="mlp",
    mlp_hidden="mlp.dense_4h_to_h",
    **_LN_HF,
)
_OPT_SITES = dict(
    attn_in="self_attn",
    attn_z="self_attn.out_proj",
    mlp_in="fc1",
    mlp_hidden="fc2",
    sites_note=_OPT,
    flat=("resid_mid", "mlp_in", "mlp_hidden", "mlp_out"),
    ln1="self_attn_layer_norm",
    ln2="final_layer_norm",
)
_FALCON = dict(
    attn_in="self_attention",
    attn_z="self_attention.dense",
    mlp_in="mlp",
    mlp_hidden="mlp.dense_4h_to_h",
)
_PHI = dict(
    attn_in="self_attn",
    attn_z="self_attn.dense",
    mlp_in="mlp",
    mlp_hidden="mlp.fc2",
    ln1="input_layernorm",
    ln2="input_layernorm",
)
# post-norm: TransformerLens' hook_resid_mid / hook_resid_post are the sums before the norms
_POST_NORM_TL = ("resid_mid", "resid_post")
_BERT = dict(
    attn_in="attention.self",
    attn_z="attention.output.dense",
    mlp_in="intermediate",
    mlp_hidden="output.dense",
    sites_note=_ENCODER,
    tl_differs=_POST_NORM_TL,
)

#: The mapping, one row (or a few, with conditions) per architecture. Generates docs/points.md.
# fmt: off
ARCHITECTURES: list[Architecture] = [
    A("gpt2", "h", "attn", "mlp", "ln_2", "ln_f", **_GPT2),
    A("gpt_neo", "h", "attn", "mlp", "ln_2", "ln_f", **{**_GPT2, "attn_z": "attn.attention.out_proj"}),
    A("gpt_bigcode", "h", "attn", "mlp", "ln_2", "ln_f", **_GPT2),
    A("gptj", "h", "attn", "mlp", None, "ln_f", **_GPTJ),
    A("codegen", "h", "attn", "mlp", None, "ln_f", **_GPTJ),
    A("gpt_neox", "layers", "post_attention_dropout", "post_mlp_dropout", None, "final_layer_norm", when="use_parallel_residual", **_NEOX, sites_note=_TWO_NORMS),
    A("gpt_neox", "layers", "post_attention_dropout", "post_mlp_dropout", "post_attention_layernorm", "final_layer_norm", **_NEOX),
    A("opt", "decoder.layers", "self_attn", "fc2", "self_attn_layer_norm:out", None, when="not do_layer_norm_before", tl_differs=_POST_NORM_TL, note="post-norm (OPT-350m): no final norm, `final` is the last block's output; `mlp_out` is [batch*tokens, hidden] in hooks, as OPT computes it (captures: one row per token)", **{**_OPT_SITES, "flat": ("mlp_in", "mlp_hidden", "mlp_out"), "ln1": None, "ln2": None}),
    A("opt", "decoder.layers", "self_attn", "fc2", "final_layer_norm", "decoder.final_layer_norm", note="`mlp_out` and `resid_mid` are [batch*tokens, hidden] in hooks, as OPT computes them (captures: one row per token)", **_OPT_SITES),
    A("bloom", "h", "self_attention.dense", "mlp.dense_4h_to_h", "post_attention_layernorm", "ln_f", note="the attention and MLP modules add the residual themselves: their inner projections are used", **_FALCON, **_LN_HF, tl_differs=("embed",)),
    A("falcon", "h", "self_attention", "mlp!", None, "ln_f", when="new_decoder_architecture or parallel_attn", **_FALCON, sites_note="parallel: `attn_in` and `mlp_in` hold the same values when one norm feeds both (`num_ln_in_parallel_attn=1`; `new_decoder_architecture` defaults to two norms)"),
    A("falcon", "h", "self_attention", "mlp", "post_attention_layernorm", "ln_f", **_FALCON, **_LN_HF),
    A("mpt", "blocks", "resid_attn_dropout", "ffn.down_proj", "norm_2", "norm_f", note="the MLP module adds the residual itself: its down projection is used", attn_in="attn", attn_z="attn.out_proj", mlp_in="ffn", mlp_hidden="ffn.down_proj", ln1="norm_1", ln2="norm_2"),
    A("phi", "layers", "self_attn", "mlp", None, "final_layernorm", **_PHI, sites_note=_SHARED),
    A("stablelm", "layers", "self_attn", "dropout", None, "norm", when="use_parallel_residual", **{**_LLAMA, "ln2": "input_layernorm"}, sites_note=_SHARED),
    A("stablelm", "layers", "self_attn", "dropout", "post_attention_layernorm", "norm", **_LLAMA),
    A("persimmon", "layers", "self_attn", "dropout", "post_attention_layernorm", "final_layernorm", **{**_PHI, "mlp_hidden": "mlp.dense_4h_to_h", "ln2": "post_attention_layernorm"}),
    A("cohere", "layers", "self_attn", "mlp", None, "norm", **{**_LLAMA, "ln2": "input_layernorm"}, sites_note=_SHARED),
    A("llama", "layers", "self_attn", "mlp", "post_attention_layernorm", "norm", **_LLAMA),
    A("mistral", "layers", "self_attn", "mlp", "post_attention_layernorm", "norm", **_LLAMA),
    A("mixtral", "layers", "self_attn", "mlp", "post_attention_layernorm", "norm", **_MOE_SITES),
    A("qwen2", "layers", "self_attn", "mlp", "post_attention_layernorm", "norm", **_LLAMA),
    A("qwen2_moe", "layers", "self_attn", "mlp", "post_attention_layernorm", "norm", **_MOE_SITES),
    A("qwen3", "layers", "self_attn", "mlp", "post_attention_layernorm", "norm", **_LLAMA),
    A("qwen3_moe", "layers", "self_attn", "mlp", "post_attention_layernorm", "norm", **_MOE_SITES),
    A("gemma", "layers", "self_attn", "mlp", "post_attention_layernorm", "norm", **_LLAMA),
    A("phi3", "layers", "self_attn", "mlp", "post_attention_layernorm", "norm", **_LLAMA),
    A("olmo", "layers", "self_attn", "mlp", "post_attention_layernorm", "norm", **_LLAMA),
    A("starcoder2", "layers", "self_attn", "mlp", "post_attention_layernorm", "norm", **{**_LLAMA, "mlp_hidden": "mlp.c_proj"}),
    A("helium", "layers", "self_attn", "mlp", "post_attention_layernorm", "norm", **_LLAMA),
    A("glm", "layers", "self_attn", "mlp", "post_attention_layernorm", "norm", **_LLAMA),
    A("smollm3", "layers", "self_attn", "mlp", "post_attention_layernorm", "norm", **_LLAMA),
    A("granite", "layers", "self_attn", "mlp", "post_attention_layernorm", "norm", note=_MULTIPLIER, **_LLAMA),
    A("granitemoe", "layers", "self_attn", "block_sparse_moe", "post_attention_layernorm", "norm", note=_MULTIPLIER, **{**_MOE_SITES, "mlp_in": "block_sparse_moe"}),
    A("gemma2", "layers", "post_attention_layernorm", "post_feedforward_layernorm", "pre_feedforward_layernorm", "norm", note=_POST_BRANCH, **{**_LLAMA, "ln2": "pre_feedforward_layernorm"}, sites_note=_SANDWICH),
    A("gemma3_text", "layers", "post_attention_layernorm", "post_feedforward_layernorm", "pre_feedforward_layernorm", "norm", note=_POST_BRANCH, **{**_LLAMA, "ln2": "pre_feedforward_layernorm"}, sites_note=_SANDWICH),
    A("olmo2", "layers", "post_attention_layernorm", "post_feedforward_layernorm", "mlp", "norm", note=_POST_BRANCH, **{**_LLAMA, "ln1": None, "ln2": None}, tl_differs=("attn_out", "mlp_out"), sites_note=_NO_PRE_NORM),
    A("olmo3", "layers", "post_attention_layernorm", "post_feedforward_layernorm", "mlp", "norm", note=_POST_BRANCH, **{**_LLAMA, "ln1": None, "ln2": None}, tl_differs=("attn_out", "mlp_out"), sites_note=_NO_PRE_NORM),
    A("bert", "encoder.layer", "attention.output.dropout", "output.dropout", "intermediate", None, note=_POST_NORM, **_BERT),
    A("roberta", "encoder.layer", "attention.output.dropout", "output.dropout", "intermediate", None, note=_POST_NORM, **_BERT),
    A("xlm-roberta", "encoder.layer", "attention.output.dropout", "output.dropout", "intermediate", None, note=_POST_NORM, **_BERT),
    A("electra", "encoder.layer", "attention.output.dropout", "output.dropout", "intermediate", None, note=_POST_NORM, **_BERT),
    A("camembert", "encoder.layer", "attention.output.dropout", "output.dropout", "intermediate", None, note=_POST_NORM, **_BERT),
    A("distilbert", "transformer.layer", "attention", "ffn", "ffn", None, note=_POST_NORM, attn_in="attention", attn_z="attention.out_lin", mlp_in="ffn", mlp_hidden="ffn.lin2", sites_note=_ENCODER, tl_differs=_POST_NORM_TL),
]
# fmt: on
del A


def register_architecture(
    key: str | type,
    *,
    blocks: str,
    attn: str,
    mlp: str,
    mid: str | None,
    final: str | None = None,
    when: str | None = None,
    note: str = "",
    attn_in: str | None = None,
    attn_z: str | None = None,
    mlp_in: str | None = None,
    mlp_hidden: str | None = None,
    heads: str | int = "num_attention_heads",
    moe: bool = False,
    flat: Sequence[str] = (),
    ln1: str | None = None,
    ln2: str | None = None,
    tl_differs: Sequence[str] = (),
) -> Architecture:
    """Add (or override) the mapping for an architecture: a ``config.model_type`` or a class.

    The new row is tried before the built-in ones. See :class:`Architecture` for the fields
    (the sites inside a block, ``attn_in`` ... ``mlp_hidden``, ``flat``, and the
    TransformerLens fields ``ln1``, ``ln2``, ``tl_differs`` are optional).

    Example::

        >>> import torch, pyhook
        >>> from pyhook.points import register_architecture
        >>> class Block(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.norm, self.attn, self.norm2, self.mlp = (torch.nn.Identity(), torch.nn.Linear(4, 4),
        ...                                                       torch.nn.LayerNorm(4), torch.nn.Linear(4, 4))
        ...     def forward(self, x):
        ...         x = x + self.attn(self.norm(x))
        ...         return x + self.mlp(self.norm2(x))
        >>> class Tiny(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.blocks = torch.nn.ModuleList([Block(), Block()])
        ...     def forward(self, x):
        ...         for b in self.blocks:
        ...             x = b(x)
        ...         return x
        >>> _ = register_architecture(Tiny, blocks="blocks", attn="attn", mlp="mlp", mid="norm2")
        >>> net = Tiny()
        >>> with pyhook.Trace(net, "resid_mid.1") as t:
        ...     y = net(torch.ones(1, 4))
        >>> t.output.shape
        torch.Size([1, 4])
    """
    name = key.__name__ if isinstance(key, type) else key
    if not isinstance(name, str) or not name:
        raise TypeError(f"key must be a config.model_type (str) or a model class, got {key!r}")
    for field_name, value in (("blocks", blocks), ("attn", attn), ("mlp", mlp)):
        if not isinstance(value, str) or not value:
            raise TypeError(f"{field_name} must be a dotted module path (str), got {value!r}")
    sites = {"attn_in": attn_in, "attn_z": attn_z, "mlp_in": mlp_in, "mlp_hidden": mlp_hidden}
    for field_name, value in (
        ("mid", mid),
        ("final", final),
        ("ln1", ln1),
        ("ln2", ln2),
        *sites.items(),
    ):
        if value is not None and (not isinstance(value, str) or not value):
            raise TypeError(
                f"{field_name} must be a dotted module path (str) or None, got {value!r}"
            )
    paths = {"attn": attn, "mlp": mlp, "mid": mid, "final": final, "ln1": ln1, "ln2": ln2, **sites}
    for field_name, value in paths.items():
        if value is not None:
            try:
                _side(value, "output")
            except ValueError as e:
                raise ValueError(f"{field_name}: {e}") from None
    if when is not None and (not isinstance(when, str) or not when.strip()):
        raise TypeError(
            f"when must be a condition on the config (str, e.g. 'attr' or 'not attr'), got {when!r}"
        )
    if isinstance(heads, bool) or not isinstance(heads, (str, int)) or heads == "":
        raise TypeError(f"heads must be a config attribute (str) or a number, got {heads!r}")
    if isinstance(heads, int) and heads < 1:
        raise ValueError(f"heads must be a positive number of attention heads, got {heads}")
    if isinstance(flat, str) or not all(isinstance(k, str) for k in flat):
        raise TypeError(f"flat must be a sequence of point kinds, got {flat!r}")
    unknown = [k for k in flat if k not in LAYER_KINDS]
    if unknown:
        raise ValueError(
            f"flat: {unknown[0]!r} is not a per-layer point kind (one of {', '.join(LAYER_KINDS)})"
        )
    if isinstance(tl_differs, str) or not all(isinstance(k, str) for k in tl_differs):
        raise TypeError(f"tl_differs must be a sequence of point kinds, got {tl_differs!r}")
    unknown = [k for k in tl_differs if k not in KINDS]
    if unknown:
        raise ValueError(
            f"tl_differs: {unknown[0]!r} is not a point kind (one of {', '.join(KINDS)})"
        )
    row = Architecture(
        name,
        blocks,
        attn,
        mlp,
        mid,
        final,
        when,
        note,
        **sites,
        heads=heads,
        moe=bool(moe),
        flat=tuple(flat),
        ln1=ln1,
        ln2=ln2,
        tl_differs=tuple(tl_differs),
    )
    _USER_ROWS.insert(0, row)
    _CACHE.clear()
    return row


_USER_ROWS: list[Architecture] = []


# -- errors -----------------------------------------------------------------------------------
class PointUnavailableError(LayerNotFoundError):
    """A standard point that this architecture does not have as one tensor per token: ``resid_mid``
    on parallel-attention blocks, ``mlp_hidden`` in a mixture of experts, a site that the
    mapping does not name. The message says why and what to use instead.

    Example::

        >>> import transformers, pyhook
        >>> cfg = transformers.GPTJConfig(n_embd=16, n_layer=1, n_head=2, rotary_dim=4, vocab_size=64)
        >>> try:
        ...     pyhook.Trace(transformers.GPTJForCausalLM(cfg), "resid_mid.0")
        ... except pyhook.points.PointUnavailableError as e:
        ...     print(e.name)
        resid_mid.0
    """


class UnknownArchitectureError(LayerNotFoundError):
    """A standard point was asked of a model whose architecture has no mapping.

    It is a :class:`~pyhook.modules.LayerNotFoundError` (so a ``KeyError``/``LookupError``); the
    one-line message lists the module names found and the :func:`register_architecture` call
    that would add a mapping.

    Example::

        >>> import torch, pyhook
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> try:
        ...     pyhook.Trace(net, "resid_post.0")
        ... except pyhook.points.UnknownArchitectureError as e:
        ...     print(str(e).split(":")[0])
        no standard hook points for Sequential (no config.model_type)
    """


# -- resolving --------------------------------------------------------------------------------
@dataclass
class Point:
    """A standard point resolved on one model: which module, which side, which tensor.

    ``kind`` is ``"input"`` (the tensor is the module's first argument, or its ``hidden_states``
    keyword: registered as a forward pre-hook) or ``"output"`` (the tensor is the output, or
    element 0 of an output tuple). ``inplace``: an edit is written into the tensor in place, so
    that every reader of it sees the edit (``resid_mid``, read by both the MLP branch and the
    skip connection). ``copy``: the model modifies the tensor in place later, so it goes on
    with a copy of what the hooks left (what they saw or returned is not changed by it). Tools
    register hooks on a Point as on a module (see :meth:`register`).

    Example::

        >>> import transformers
        >>> from pyhook.points import resolve_point
        >>> cfg = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=64)
        >>> p = resolve_point(transformers.GPT2LMHeadModel(cfg), "resid_mid.1")
        >>> p.module_name, p.kind, p.inplace
        ('transformer.h.1.ln_2', 'input', True)
    """

    name: str
    module_name: str
    module: nn.Module
    kind: str
    inplace: bool = False
    copy: bool = False
    #: ``attn_z``: the input's last dimension is handed over split as ``[heads, d_head]``
    heads: int | None = None
    #: the model computes this tensor as ``[batch*tokens, ...]`` (:attr:`Architecture.flat`);
    #: hooks see it so, captures view it as ``[batch, tokens, ...]``
    flat: bool = False
    #: TransformerLens' norm values: ``"normalized"`` (the norm's input centred and divided by
    #: the scale, before its weight and bias) or ``"scale"`` (``[..., 1]``), computed from the
    #: input of :attr:`module` (a norm); an edit gives the norm's output from the edited value
    norm: str | None = None
    #: ``attn_q``/``attn_k``/``attn_v``: ``(family, "q"|"k"|"v", attention module)``, the value
    #: cut from the projection's output (see :func:`_make_qkv`)
    qkv: tuple[str, str, nn.Module] | None = None

    def register(
        self,
        hooks: Any,
        fn: Callable[..., Any],
        *,
        with_kwargs: bool = False,
        prepend: bool = False,
        always_call: bool = False,
        inputs: bool = False,
    ) -> Any:
        """Register ``fn`` on this point through ``hooks`` (a :class:`~pyhook._hooks.HookSet`).

        ``fn`` is called as a forward hook whose ``output`` is the point's tensor:
        ``fn(module, args, value)`` (``fn(module, args, kwargs, value)`` with ``with_kwargs``),
        where ``module``/``args`` are those of :attr:`module`; returning another tensor replaces
        the value, ``None`` (or the value itself) leaves it. On a sharded model the value is
        the whole tensor (``args`` too with ``inputs``), gathered by the layout layer
        (:func:`pyhook.distributed.layout_hook`) before ``attn_z`` splits it into heads.
        """
        point = self
        if self.norm is not None:
            return self._register_norm(hooks, fn, with_kwargs, prepend, always_call)
        if self.qkv is not None:
            return self._register_qkv(hooks, fn, with_kwargs, prepend, always_call)
        if self.kind == "output":
            copy = self.copy

            def on_output(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
                value = output if type(output) is torch.Tensor else _output_tensor(point, output)
                new = fn(module, args, kwargs, value) if with_kwargs else fn(module, args, value)
                if copy:
                    # The model modifies this tensor in place later: it goes on with a copy of
                    # what the hook left (an in-place edit included), so neither the tensor the
                    # hook saw nor one it returned (a stored patch) is changed by the model.
                    kept = value if new is None else new
                    if isinstance(kept, torch.Tensor):
                        kept = kept.clone()
                    return _replace_output(output, kept)
                if new is None or new is value:
                    return None
                return _replace_output(output, new)

            return hooks.forward(
                self.module,
                on_output,
                with_kwargs=True,
                prepend=prepend,
                always_call=always_call,
                inputs=inputs,
                name=self.name,
            )

        inplace = self.inplace
        heads = self.heads

        def on_input(module: nn.Module, args: Any, kwargs: Any) -> Any:
            key = None if args else _input_key(kwargs)
            value = args[0] if args else kwargs.get(key)
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"{'standard point' if point.kind_name else 'module input'} {point.name!r}: "
                    f"{point.module_name!r} was called without a tensor as its first argument "
                    "(or hidden_states= keyword)"
                )
            # With grad, the hook gets a node of its own that the module alone reads, so its
            # gradient is the one through this module's argument (what an edit here changes),
            # not the tensor's total when other modules read it too (OLMo 2's attn_in, a
            # q_proj:in): one gradient meaning for every tool. An inplace point's edit reaches
            # every reader, so its tensor (and total gradient) is handed as it is.
            own = not inplace and value.requires_grad and torch.is_grad_enabled()
            if heads is not None:
                handed = _split_heads(point, value, heads)
            else:
                handed = value.view_as(value) if own else value
            new = fn(module, args, kwargs, handed) if with_kwargs else fn(module, args, handed)
            if new is None or new is handed:
                if not own:
                    return None
                new = handed  # the module goes on with the node the hook was given
            if heads is not None:
                new = _merge_heads(point, new, handed)
            if inplace:
                value.copy_(new)  # every reader of the tensor (the skip connection too) sees it
                return None
            if args:
                return (new, *args[1:]), kwargs
            return args, {**kwargs, key: new}

        return hooks.forward_pre(
            self.module, on_input, with_kwargs=True, prepend=prepend, name=self.name
        )

    def _register_norm(
        self,
        hooks: Any,
        fn: Callable[..., Any],
        with_kwargs: bool,
        prepend: bool,
        always_call: bool,
    ) -> Any:
        """:meth:`register` for TransformerLens' norm values (:attr:`norm`)."""
        point = self
        rule = _norm_rule(self.module)
        if rule is None:  # the module was replaced since the point was resolved
            raise PointUnavailableError(
                self.name, f"{self.name!r}: {self.module_name!r} is not a norm pyhook knows"
            )
        scale_point = self.norm == "scale"

        def on_norm(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
            # An output an earlier norm hook of this call made carries its (centred, scale,
            # normalized): edits compose, as TransformerLens' hook_scale then hook_normalized.
            out_t = output if isinstance(output, torch.Tensor) else _output_tensor(point, output)
            state = _NORM_STATE.get(id(out_t))
            if state is not None and state[0]() is not out_t:
                state = None
            x = _norm_input(point, args, kwargs)
            if state is not None:
                centred, scale, normalized = state[1]
            else:
                centred, scale = rule.parts(x)
                normalized = centred / scale if not scale_point else None
            value = scale if scale_point else normalized
            new = fn(module, args, kwargs, value) if with_kwargs else fn(module, args, value)
            if new is None or new is value:
                return None
            if not isinstance(new, torch.Tensor):
                raise TypeError(
                    f"{point.name!r}: an edit must return a tensor, got {type(new).__name__}"
                )
            if scale_point:
                scale, normalized = new, centred / new
            else:
                normalized = new
            out = rule.affine(module, normalized, x.dtype)
            _keep_norm_state(out, (centred, scale, normalized))
            return out if isinstance(output, torch.Tensor) else _replace_output(output, out)

        on_norm._pyhook_norm_rank = 0 if scale_point else 1  # type: ignore[attr-defined]
        handle = hooks.forward(
            self.module, on_norm, with_kwargs=True, prepend=prepend, always_call=always_call
        )
        _order_norm_hooks(handle)
        return handle

    def _register_qkv(
        self,
        hooks: Any,
        fn: Callable[..., Any],
        with_kwargs: bool,
        prepend: bool,
        always_call: bool,
    ) -> Any:
        """:meth:`register` for the per-head query/key/value points (:attr:`qkv`)."""
        point = self
        family, which, attn = self.qkv  # type: ignore[misc]
        heads = self.heads
        assert heads is not None

        def call(module: nn.Module, args: Any, kwargs: Any, value: torch.Tensor) -> Any:
            new = fn(module, args, kwargs, value) if with_kwargs else fn(module, args, value)
            if new is None or new is value:
                return None
            return _merge_heads(point, new, value).unflatten(-1, value.shape[-2:])

        if family == "gpt2":  # c_attn's output is [q | k | v] along the features

            def on_fused(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
                out = _output_tensor(point, output)
                d = out.shape[-1] // 3
                i = "qkv".index(which)
                value = _split_heads(point, out[..., i * d : (i + 1) * d], heads)
                new = call(module, args, kwargs, value)
                if new is None:
                    return None
                new = new.flatten(-2).to(out.dtype)
                return torch.cat([out[..., : i * d], new, out[..., (i + 1) * d :]], dim=-1)

            return hooks.forward(
                self.module, on_fused, with_kwargs=True, prepend=prepend, always_call=always_call
            )

        # llama: q_proj / k_proj / v_proj, the query and key then rotated by the rotary
        # embedding the attention module receives (kwargs["position_embeddings"] = (cos, sin))
        seen: dict[str, Any] = {}

        def on_attn(module: nn.Module, args: Any, kwargs: Any) -> None:
            seen["pe"] = kwargs.get("position_embeddings")

        def on_proj(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
            out = _output_tensor(point, output)
            value = _split_heads(point, out, heads)
            cos = sin = None
            if which != "v":
                pe = seen.get("pe")
                if not (isinstance(pe, (tuple, list)) and len(pe) == 2):
                    raise TypeError(
                        f"standard point {point.name!r}: the attention module was called without "
                        "position_embeddings=(cos, sin), which the query and key are rotated by"
                    )
                cos, sin = (t.unsqueeze(-2).to(value.dtype) for t in pe)
                value = value * cos + _rotate_half(value) * sin
            new = call(module, args, kwargs, value)
            if new is None:
                return None
            if cos is not None:  # the inverse rotation: back to the projection's output
                # (divided by cos^2 + sin^2: Llama's cos/sin are float32 values, not unit)
                new = (new * cos - _rotate_half(new) * sin) / (cos * cos + sin * sin)
            return _replace_output(output, new.flatten(-2).to(out.dtype))

        pre = hooks.forward_pre(attn, on_attn, with_kwargs=True, prepend=True)
        post = hooks.forward(
            self.module, on_proj, with_kwargs=True, prepend=prepend, always_call=always_call
        )
        return _Handles(post, pre)

    @property
    def kind_name(self) -> str | None:
        """The standard point kind (``"attn_z"``, ...), None for a module input (``name:in``)."""
        if self.name.endswith(INPUT_SUFFIX):
            return None
        parts = _split(self.name)
        return parts[0] if parts is not None else None


class _Handles:
    """Several hooks' handles as one (``remove()`` removes them all; ``id``: the first's)."""

    def __init__(self, *handles: Any) -> None:
        self.handles = handles
        self.id = handles[0].id

    @property
    def alive(self) -> bool:
        """Whether any of the hooks is still registered."""
        return any(h.alive for h in self.handles)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


#: The architectures with ``attn_q``/``attn_k``/``attn_v`` points: ``model_type -> (family,
#: the attention module's class name)``; the projections are found relative to the block.
QKV_MODULES = {"gpt2": ("gpt2", "GPT2Attention"), "llama": ("llama", "LlamaAttention")}


def _make_qkv(model: nn.Module, layout: _Layout, kind: str, layer: int, name: str) -> Point:
    """The Point of ``attn_q.L``/``attn_k.L``/``attn_v.L`` (see :data:`QKV_KINDS`)."""
    arch = layout.arch
    what = type(model).__name__
    row = QKV_MODULES.get(arch.key)
    which = kind[-1]
    if row is None:
        raise PointUnavailableError(
            name,
            f"standard point {name!r} does not exist on {what}: per-head query/key/value points "
            f"are implemented for {', '.join(sorted(QKV_MODULES))} only (model_type "
            f"{arch.key!r}); hook the projections by module name instead",
        )
    family, cls = row
    blocks = layout.path(arch.blocks)
    attn_name = f"{blocks}.{layer}.{arch.attn_in}"
    attn = _lookup(model, attn_name)
    if attn is None or type(attn).__name__ != cls:
        raise PointUnavailableError(
            name,
            f"standard point {name!r} does not exist on {what}: it needs {attn_name!r} to be "
            f"transformers' {cls}, found {type(attn).__name__ if attn is not None else 'nothing'}",
        )
    if family == "gpt2":
        if getattr(attn, "is_cross_attention", False):
            raise PointUnavailableError(name, f"{name!r}: {attn_name!r} is cross-attention")
        module_name = f"{attn_name}.c_attn"
        heads = int(attn.num_heads)
    else:
        module_name = f"{attn_name}.{which}_proj"
        config = attn.config
        n = config.num_attention_heads
        heads = n if which == "q" else getattr(config, "num_key_value_heads", None) or n
    module = get_module(model, module_name)
    _check_not_shared(layout, module, module_name, name)
    return Point(name, module_name, module, "output", heads=heads, qkv=(family, which, attn))


def _split_heads(point: Point, value: torch.Tensor, heads: int) -> torch.Tensor:
    width = value.shape[-1] if value.dim() else 0
    if width % heads:
        raise ValueError(
            f"standard point {point.name!r}: the input of {point.module_name!r} has "
            f"{width} features, not a multiple of the {heads} heads"
        )
    return value.unflatten(-1, (heads, width // heads))


def _merge_heads(point: Point, new: Any, handed: torch.Tensor) -> torch.Tensor:
    if not isinstance(new, torch.Tensor) or new.shape[-2:] != handed.shape[-2:]:
        raise ValueError(
            f"standard point {point.name!r}: an edit must return a tensor [..., heads, d_head] "
            f"= [..., {handed.shape[-2]}, {handed.shape[-1]}], got "
            f"{tuple(new.shape) if isinstance(new, torch.Tensor) else type(new).__name__}"
        )
    return new.flatten(-2)


def _output_tensor(point: Point, output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(
        f"standard point {point.name!r}: the output of {point.module_name!r} is a "
        f"{type(output).__name__}, expected a tensor or a tuple starting with one"
    )


def _replace_output(output: Any, new: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return new
    if type(output) is tuple:
        return (new, *output[1:])
    if isinstance(output, tuple):  # a namedtuple
        return type(output)(new, *output[1:])
    return [new, *output[1:]]


@dataclass
class _Layout:
    arch: Architecture
    prefix: str  # "" or "model." ...: where the base model sits in the model given
    blocks: nn.ModuleList
    n: int
    # resolved points, reused while their module is still in place (fewer allocations: a
    # TraceDict over hundreds of points stays as cheap as one over module names)
    made: dict[tuple[str, int | None, int], Point] = field(default_factory=dict)
    # id(module) -> the blocks whose module tree holds it (built on first need, for the blocks
    # in runs_of: rebuilt when a block is added, removed or replaced)
    runs_in: dict[int, list[int]] | None = None
    runs_of: tuple[nn.Module, ...] = ()
    block_at: dict[int, list[int]] = field(default_factory=dict)  # id(block) -> its places
    # (config,) when the module that holds the blocks runs layers[: config.num_hidden_layers],
    # () when it runs them all, None until known (see _blocks_run)
    sliced_by: tuple[Any, ...] | None = None

    def path(self, rel: str | None) -> str | None:
        return None if rel is None else self.prefix + rel


_CACHE: weakref.WeakKeyDictionary[nn.Module, _Layout] = weakref.WeakKeyDictionary()


def _rows() -> Iterable[Architecture]:
    yield from _USER_ROWS
    yield from ARCHITECTURES


def _condition_holds(when: str | None, config: Any) -> bool:
    if not when:
        return True
    for term in when.split(" or "):
        term = term.strip()
        negate = term.startswith("not ")
        value = bool(getattr(config, term[4:] if negate else term, False))
        if value != negate:
            return True
    return False


def _keys_of(model: nn.Module) -> list[str]:
    config = getattr(model, "config", None)
    keys = [c.__name__ for c in type(model).__mro__ if c not in (nn.Module, object)]
    model_type = getattr(config, "model_type", None)
    if isinstance(model_type, str):
        keys.insert(0, model_type)
        sub = getattr(config, "text_config", None)
        if sub is not None and isinstance(getattr(sub, "model_type", None), str):
            keys.append(sub.model_type)
    return keys


def _lookup(model: nn.Module, path: str) -> nn.Module | None:
    """``get_module`` without the error (and its costly list of close names)."""
    module: nn.Module | None = model
    for part in path.split(".") if path else ():
        module = module._modules.get(part)  # type: ignore[union-attr]
        if module is None:
            return None
    return module


def _find_blocks(model: nn.Module, rel: str) -> str | None:
    """The prefix under which ``rel`` is a ModuleList in ``model`` ('' first, then the shortest)."""
    base = getattr(model, "base_model_prefix", None)
    tries = [""] + ([base + "."] if isinstance(base, str) and base else [])
    for prefix in tries:
        if isinstance(_lookup(model, prefix + rel), nn.ModuleList):
            return prefix
    suffix = "." + rel
    hits = [
        n[: -len(rel)]
        for n, m in model.named_modules()
        if n.endswith(suffix) and isinstance(m, nn.ModuleList)
    ]
    return min(hits, key=len) if hits else None


def architecture_of(model: nn.Module) -> Architecture:
    """The :class:`Architecture` row used for ``model`` (raises
    :class:`UnknownArchitectureError` when there is none).

    Example::

        >>> import transformers
        >>> from pyhook.points import architecture_of
        >>> cfg = transformers.GPTNeoXConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        ...                                  intermediate_size=32, vocab_size=64)
        >>> architecture_of(transformers.GPTNeoXForCausalLM(cfg)).parallel  # Pythia's parallel residual
        True
    """
    return _layout(model).arch


def _layout(model: nn.Module) -> _Layout:
    layout = _CACHE.get(model)
    if layout is not None and _lookup(model, layout.prefix + layout.arch.blocks) is layout.blocks:
        return _refresh(model, layout)
    keys = _keys_of(model)
    config = getattr(model, "config", None)
    for key in keys:
        for row in _rows():
            if row.key != key or not _condition_holds(row.when, config):
                continue
            prefix = _find_blocks(model, row.blocks)
            if prefix is None:
                continue
            blocks = get_module(model, prefix + row.blocks)
            layout = _Layout(row, prefix, blocks, len(blocks))  # type: ignore[arg-type]
            _CACHE[model] = layout
            return _refresh(model, layout)
    raise _unknown(model, keys)


def _refresh(model: nn.Module, layout: _Layout) -> _Layout:
    """``layout`` with what depends on its blocks brought up to date (blocks may have been
    added, removed or replaced since): how many run, and where each block is."""
    layout.n = _blocks_run(model, layout)
    now = tuple(layout.blocks._modules.values())
    if now != layout.runs_of:
        at: dict[int, list[int]] = {}
        for i, block in enumerate(now):
            at.setdefault(id(block), []).append(i)
        layout.block_at, layout.runs_of, layout.runs_in = at, now, None
    return layout


def _blocks_run(model: nn.Module, layout: _Layout) -> int:
    """How many of the blocks a forward runs: all, except in a model whose forward runs
    ``layers[: config.num_hidden_layers]`` (Llama and most decoders in transformers) with a
    config asking for fewer (a model cut short by its config): the later blocks never run."""
    n = len(layout.blocks)
    if layout.sliced_by is None:  # the config of the module that runs the blocks, if it slices
        path = layout.prefix + layout.arch.blocks
        owner = _lookup(model, path.rpartition(".")[0]) if "." in path else model
        config = getattr(owner, "config", None)
        sliced = config is not None and _slices_by_config(type(owner))
        layout.sliced_by = (config,) if sliced else ()
    if layout.sliced_by:
        config = layout.sliced_by[0]
        try:  # the instance's own value, past transformers' (slow) __getattribute__
            want = object.__getattribute__(config, "__dict__").get("num_hidden_layers")
        except AttributeError:  # pragma: no cover - a config without a __dict__
            want = None
        if want is None:
            want = getattr(config, "num_hidden_layers", None)
        if type(want) is int and 0 <= want < n:
            return want
    return n


@functools.cache
def _slices_by_config(cls: type) -> bool:
    """Whether ``cls.forward`` runs its blocks as ``...[: self.config.num_hidden_layers]``."""
    import inspect

    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return re.search(r"\[\s*:\s*self\.config\.num_hidden_layers\s*\]", source) is not None


def _unknown(model: nn.Module, keys: list[str]) -> UnknownArchitectureError:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    what = f"model_type {model_type!r}" if model_type else "no config.model_type"
    best, size = None, 0
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > size:
            best, size = name, len(mod)
    if best is None:
        names = [n for n, _ in model.named_children()]
        found = f"no ModuleList of blocks; its children: {', '.join(names) or '(none)'}"
        hint = "register_architecture(...)"
    else:
        children = [n for n, _ in model.get_submodule(best)[0].named_children()]
        found = f"blocks {best!r} ({size} x {type(model.get_submodule(best)[0]).__name__} with {', '.join(children)})"
        key = model_type or type(model).__name__
        hint = (
            f"pyhook.points.register_architecture({key!r}, blocks={best!r}, attn=..., mlp=..., "
            "mid=... (module whose input is resid_mid, None if parallel), final=...)"
        )
    return UnknownArchitectureError(
        keys[0] if keys else type(model).__name__,
        f"no standard hook points for {type(model).__name__} ({what}): found {found}; "
        f"add a mapping with {hint} (see docs/points.md), or use module names",
    )


# -- names ------------------------------------------------------------------------------------
_CANON_KINDS = "|".join((*LAYER_KINDS, *QKV_KINDS))
# TransformerLens' hook_<kind> names only for the residual-stream kinds: its hook_attn_in and
# hook_mlp_in are other tensors (the un-normalised residual stream) than attn_in and mlp_in.
_ALIAS_KINDS = "|".join(k for k in LAYER_KINDS if k not in SITE_KINDS)
_TL_SITE_RX = "|".join(re.escape(v) for v in (*TL_SITES.values(), *TL_NORMS.values()))
_TL_KIND = {v: k for k, v in (*TL_SITES.items(), *TL_NORMS.items(), *TL_GLOBAL.items())}
_TL_GLOBAL_RX = "|".join(re.escape(v) for v in TL_GLOBAL.values())
#: pyhook's kinds that exist under TransformerLens' names only (no canonical spelling).
TL_ONLY_KINDS = frozenset((*TL_NORMS, *TL_GLOBAL))
_CANON_RX = re.compile(rf"(?:(embed|final)|({_CANON_KINDS})\.(-?\d+|-?\d*:-?\d*|\*))\Z")
_TL_RX = re.compile(
    rf"(?:({_TL_GLOBAL_RX})|blocks\.(-?\d+|-?\d*:-?\d*|\*)\."
    rf"(?:hook_({_ALIAS_KINDS})|({_TL_SITE_RX})))\Z"
)
#: The spelling of a module's input (``"transformer.h.3.mlp:in"``): see :func:`resolve_targets`.
INPUT_SUFFIX = ":in"
_GLOB = re.compile(r"[*?\[]")
_HEADS = frozenset((*KINDS, *QKV_KINDS))
_TL_HEADS = ("blocks.", "hook_embed", "ln_final.")


def _is_tl_style(name: str) -> bool:
    return name.startswith(_TL_HEADS)


def _glob_head_matches(name: str) -> bool:
    if _is_tl_style(name):
        return True
    head = name.partition(".")[0]
    return any(c.isalpha() for c in head) and any(fnmatch.fnmatchcase(k, head) for k in KINDS)


def is_point_name(name: Any, model: nn.Module | None = None) -> bool:
    """Whether ``name`` is spelled as a standard point (canonical, TransformerLens alias, range
    or glob). With ``model``, a name that is also a real module path of it (a glob: that matches
    one) is *not* a point (module names win).

    Example::

        >>> from pyhook.points import is_point_name
        >>> [is_point_name(n) for n in ("resid_post.3", "blocks.0.hook_attn_out", "resid_*.*", "transformer.h.3")]
        [True, True, True, False]
    """
    if not isinstance(name, str):
        return False
    head = name.partition(".")[0]
    if head in _HEADS or name.startswith(_TL_HEADS):
        ok = bool(_CANON_RX.match(name) or _TL_RX.match(name)) or (
            _GLOB.search(name) is not None and _glob_head_matches(name)
        )
    elif _GLOB.search(head):
        ok = _glob_head_matches(name)
    else:
        return False
    if not ok or model is None:
        return ok
    if head not in model._modules:
        return True
    # A child has the point's first part (MPT's and many models' `blocks`, as TransformerLens
    # names start): the name is a point unless it is (a glob: matches) a module path.
    if _GLOB.search(name):
        rx = glob_regex(name)
        return not any(n and rx.match(n) for n, _ in model.named_modules())
    return _lookup(model, name) is None


def _index(layout: _Layout, text: str, name: str) -> int:
    i = int(text)
    if not -layout.n <= i < layout.n:
        raise LayerNotFoundError(
            name,
            f"standard point {name!r}: {type(layout.blocks).__name__} at "
            f"{layout.path(layout.arch.blocks)!r} has {layout.n} blocks (0..{layout.n - 1})"
            + (
                f" that run: config.num_hidden_layers={layout.n} of its {len(layout.blocks)}"
                if layout.n < len(layout.blocks)
                else ""
            ),
        )
    return i % layout.n


def _range(layout: _Layout, text: str) -> list[int]:
    if text == "*":
        return list(range(layout.n))
    start, _, stop = text.partition(":")
    return list(range(layout.n))[slice(int(start) if start else None, int(stop) if stop else None)]


def _split(name: str) -> tuple[str, str | None, bool] | None:
    """(kind, layer text or None, tl_style) of a non-glob point name, or None."""
    m = _CANON_RX.match(name)
    if m:
        return (m.group(1), None, False) if m.group(1) else (m.group(2), m.group(3), False)
    m = _TL_RX.match(name)
    if m:
        if m.group(1):
            return _TL_KIND[m.group(1)], None, True
        return m.group(3) or _TL_KIND[m.group(4)], m.group(2), True
    return None


def _spell(kind: str, layer: int | None, tl: bool) -> str:
    """A kind's name: canonical, or TransformerLens' (``tl``, and always for the kinds that
    only TransformerLens names)."""
    if (not tl and kind not in TL_ONLY_KINDS) or kind in ("embed", "final"):
        return kind if layer is None else f"{kind}.{layer}"
    if kind in TL_GLOBAL:
        return TL_GLOBAL[kind]
    if kind in TL_SITES:
        return f"blocks.{layer}.{TL_SITES[kind]}"
    if kind in TL_NORMS:
        return f"blocks.{layer}.{TL_NORMS[kind]}"
    return f"blocks.{layer}.hook_{kind}"


def _side(spec: str, default: str) -> tuple[str, str, bool]:
    copy = spec.endswith("!")
    spec = spec.rstrip("!")
    path, _, side = spec.partition(":")
    side = {"in": "input", "out": "output", "": default}.get(side, side)
    if side not in ("input", "output"):
        raise ValueError(f"bad point path {spec!r}: the suffix must be ':in' or ':out'")
    return path, side, copy


def _make(model: nn.Module, layout: _Layout, kind: str, layer: int | None, name: str) -> Point:
    point = layout.made.get((kind, layer, layout.n))
    if point is not None and _lookup(model, point.module_name) is point.module:
        return point
    point = _make_new(model, layout, kind, layer, name)
    layout.made[kind, layer, layout.n] = point
    return point


def _make_new(model: nn.Module, layout: _Layout, kind: str, layer: int | None, name: str) -> Point:
    arch = layout.arch
    blocks = layout.path(arch.blocks)
    if kind in TL_ONLY_KINDS:
        return _make_tl(model, layout, kind, layer, name)
    if kind in QKV_KINDS:
        return _make_qkv(model, layout, kind, layer, name)  # type: ignore[arg-type]
    if kind in ("embed", "resid_pre"):
        i = 0 if kind == "embed" else layer
        module_name, side, inplace, copy = f"{blocks}.{i}", "input", False, False
    elif kind == "resid_post":
        module_name, side, inplace, copy = f"{blocks}.{layer}", "output", False, False
    elif kind == "final":
        if arch.final is None:
            module_name, side, copy = f"{blocks}.{layout.n - 1}", "output", False
        else:
            path, side, copy = _side(arch.final, "output")
            module_name = layout.path(path)  # type: ignore[assignment]
        inplace = False
    else:
        rel = getattr(arch, _FIELD.get(kind, kind))
        if rel is None:
            raise _unavailable(model, arch, kind, name)
        path, side, copy = _side(rel, "output" if kind in ("attn_out", "mlp_out") else "input")
        module_name = f"{blocks}.{layer}.{path}"
        inplace = kind == "resid_mid" and side == "input"
    try:
        module = get_module(model, module_name)  # type: ignore[arg-type]
    except LookupError as e:
        raise LayerNotFoundError(
            name,
            f"standard point {name!r}: the mapping for {arch.key!r} names {module_name!r}, which "
            f"{type(model).__name__} does not have ({e}); fix it with register_architecture",
        ) from None
    if kind != "final" or arch.final is None:
        _check_not_shared(layout, module, module_name, name)
    if kind not in _BLOCK_KINDS:  # a site inside block `layer`: called once, whole?
        _check_called_whole(model, kind, f"{blocks}.{layer}", module_name, name)
    heads = _heads(model, arch, name) if kind == "attn_z" else None
    flat = kind in arch.flat
    return Point(name, module_name, module, side, inplace, copy, heads, flat)  # type: ignore[arg-type]


def _make_tl(model: nn.Module, layout: _Layout, kind: str, layer: int | None, name: str) -> Point:
    """The Point of a kind only TransformerLens names (checked by :func:`_tl_refusal`)."""
    err = _tl_refusal(model, layout, kind, name, layer)
    if err is not None:
        raise err
    arch = layout.arch
    if kind == "tok_embed":
        module = model.get_input_embeddings()  # type: ignore[operator]
        module_name = next((n for n, m in model.named_modules() if m is module), None)
        if module_name is None:
            raise PointUnavailableError(
                name,
                f"{name!r}: the input embeddings of {type(model).__name__} are not a submodule",
            )
        return Point(name, module_name, module, "output")
    if kind.startswith("final"):
        module_name = layout.path(_side(arch.final, "output")[0])  # type: ignore[arg-type]
    else:
        rel = arch.ln1 if kind.startswith("ln1") else arch.ln2
        module_name = f"{layout.path(arch.blocks)}.{layer}.{_side(rel, 'output')[0]}"  # type: ignore[arg-type]
    try:
        module = get_module(model, module_name)  # type: ignore[arg-type]
    except LookupError as e:
        raise LayerNotFoundError(
            name,
            f"{name!r}: the mapping for {arch.key!r} names the norm {module_name!r}, which "
            f"{type(model).__name__} does not have ({e}); fix it with register_architecture",
        ) from None
    if not kind.startswith("final"):
        _check_not_shared(layout, module, module_name, name)
    norm = "scale" if kind.endswith("scale") else "normalized"
    return Point(name, module_name, module, "output", norm=norm)


# -- TransformerLens' norm values -------------------------------------------------------------
@dataclass(frozen=True)
class _NormRule:
    """How a norm module computes: ``centered`` (LayerNorm) or not (RMSNorm), its epsilon, and
    ``style``, how its weight and bias apply to the normalized value: ``"wb"`` (``n * w + b``,
    either optional), ``"w_cast"`` (``w * n.to(dtype)``: Llama's RMSNorm), ``"w32"`` (``(w * n)
    .to(dtype)`` in float32: Cohere), ``"1+w"`` (``(n * (1 + w)).to(dtype)``: Gemma)."""

    centered: bool
    eps: float
    style: str

    def parts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the centred input, TransformerLens' scale), computed as TransformerLens does:
        in float32 when the input is a lower precision."""
        if x.dtype not in (torch.float32, torch.float64):
            x = x.float()
        if self.centered:
            x = x - x.mean(-1, keepdim=True)
        return x, (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()

    def affine(self, module: nn.Module, n: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The norm's output for the normalized value ``n``."""
        w = getattr(module, "weight", None)
        b = getattr(module, "bias", None)
        if self.style == "w_cast":
            return w * n.to(dtype)  # type: ignore[operator]
        n = n.float() if dtype not in (torch.float32, torch.float64) else n.to(dtype)
        if self.style == "1+w":
            return (n * (1.0 + w.float())).to(dtype)  # type: ignore[union-attr]
        if w is not None:
            n = n * w.to(n.dtype)
        if self.style == "wb" and b is not None:
            n = n + b.to(n.dtype)
        return n.to(dtype)


def _norm_rule(module: nn.Module) -> _NormRule | None:
    """The :class:`_NormRule` of a norm module pyhook knows, else None."""
    cls = type(module).__name__
    weight = getattr(module, "weight", None)
    if isinstance(module, nn.LayerNorm):
        if len(module.normalized_shape) != 1:
            return None
        return _NormRule(True, float(module.eps), "wb")
    if cls == "OlmoLayerNorm":  # no weight, no bias, eps fixed in its forward
        return _NormRule(True, 1e-5, "wb")
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(eps, float) or not isinstance(weight, torch.Tensor):
        return None
    if cls.endswith("RMSNorm"):
        if cls.startswith("Gemma"):
            return _NormRule(False, eps, "1+w")
        return _NormRule(False, eps, "w_cast")
    if cls == "CohereLayerNorm":
        return _NormRule(True, eps, "w32")
    return None


#: id(output of a norm hook's edit) -> (a weak reference to it, its (centred, scale,
#: normalized)): read by the norm's later hooks in the same call; an entry goes with its tensor
_NORM_STATE: dict[int, tuple[weakref.ReferenceType[torch.Tensor], tuple[torch.Tensor, ...]]] = {}


def _keep_norm_state(out: torch.Tensor, parts: tuple[torch.Tensor, ...]) -> None:
    key = id(out)
    # (the callback runs while ``out`` is freed, before its id can be reused)
    _NORM_STATE[key] = (weakref.ref(out, lambda _r: _NORM_STATE.pop(key, None)), parts)


def _norm_rank(fn: Any) -> int:
    while fn is not None:
        rank = getattr(fn, "_pyhook_norm_rank", None)
        if rank is not None:
            return int(rank)
        fn = getattr(fn, "__wrapped__", None)
    return 2


def _order_norm_hooks(handle: Any) -> None:
    """Order a norm's forward hooks as TransformerLens runs its norm hooks: every ``hook_scale``
    hook, then every ``hook_normalized`` hook (each kind in registration order), then the rest
    (the norm's output as a point or a module). A dispatcher's entry is left as it is."""
    hooks = getattr(handle, "_hooks", None)
    if not isinstance(hooks, dict) or not hasattr(hooks, "move_to_end"):
        return
    ranks = [_norm_rank(f) for f in hooks.values()]
    if ranks == sorted(ranks):
        return
    for key in sorted(hooks, key=lambda k: _norm_rank(hooks[k])):
        hooks.move_to_end(key)


def _norm_input(point: Point, args: Any, kwargs: Any) -> torch.Tensor:
    value = args[0] if args else kwargs.get(_input_key(kwargs) or "")
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{point.name!r}: the norm {point.module_name!r} was called without a tensor as its "
            "first argument"
        )
    return value


_FIELD = {"attn_out": "attn", "mlp_out": "mlp", "resid_mid": "mid"}
_BLOCK_KINDS = frozenset({"embed", "resid_pre", "resid_post", "final"})  # a block's own tensors


# The points a block computes inside its feed-forward, which BERT-like blocks run in chunks of
# tokens when config.chunk_size_feed_forward > 0 (transformers' apply_chunking_to_forward)
_FEED_FORWARD_KINDS = frozenset({"resid_mid", "mlp_in", "mlp_hidden", "mlp_out"})


def _check_called_whole(
    model: nn.Module, kind: str, block: str, module_name: str, name: str
) -> None:
    """Refuse a point whose module its parent does not call once with the whole tensor:

    * a feed-forward point below a module that runs it in chunks of tokens
      (``chunk_size_feed_forward > 0``: BERT's layer, DistilBERT's FFN): the module runs once
      a chunk, and a hook on it would hold the last chunk's tokens;
    * a projection that Bloom's attention or MLP applies slice by slice with ``F.linear``
      (``pretraining_tp > 1`` and ``slow_but_exact``): the module is never called, and a hook
      on it never runs.
    """
    parts = module_name[len(block) + 1 :].split(".") if module_name != block else []
    path = block
    for part in ["", *parts[:-1]]:  # the block and the module's ancestors below it
        path = f"{path}.{part}" if part else path
        try:
            m = get_module(model, path)
        except LookupError:  # pragma: no cover - the point's own module was found above
            return
        size = getattr(m, "chunk_size_feed_forward", 0)
        if kind in _FEED_FORWARD_KINDS and type(size) is int and size > 0:
            raise PointUnavailableError(
                name,
                f"standard point {name!r}: {type(m).__name__} {path!r} runs its feed-forward in "
                f"chunks of {size} tokens (config.chunk_size_feed_forward={size}), so "
                f"{module_name!r} runs once a chunk and a hook on it would hold the last chunk's "
                "tokens; load the model with chunk_size_feed_forward=0 (the same outputs, one "
                "call a block)",
            )
        tp = getattr(m, "pretraining_tp", 1)
        if getattr(m, "slow_but_exact", False) is True and type(tp) is int and tp > 1:
            raise PointUnavailableError(
                name,
                f"standard point {name!r}: {type(m).__name__} {path!r} applies the weights of "
                f"{module_name!r} in {tp} slices with F.linear (config.pretraining_tp={tp}, "
                "slow_but_exact=True) and never calls it, so a hook on it would never run; load "
                "the model with slow_but_exact=False (or pretraining_tp=1)",
            )


def _check_not_shared(layout: _Layout, module: nn.Module, module_name: str, name: str) -> None:
    """Refuse a point whose module runs in more than one block (a block listed twice, a module
    shared between blocks): a hook on it would run at each, and the point hold the last call."""
    blocks = layout.block_at.get(id(module))  # a block (resid_pre/post, embed)
    if blocks is None:  # a module inside a block: where each block's modules are, once
        if layout.runs_in is None:
            runs: dict[int, list[int]] = {}
            for i, block in enumerate(layout.runs_of):
                for m in block.modules():
                    runs.setdefault(id(m), []).append(i)
            layout.runs_in = runs
        blocks = layout.runs_in.get(id(module), [])
    if len(blocks) > 1:
        raise PointUnavailableError(
            name,
            f"standard point {name!r}: {module_name!r} is one module that runs in blocks "
            f"{', '.join(map(str, blocks))} of {layout.path(layout.arch.blocks)!r}, so a hook on "
            "it would run at each of them and hold the last call's tensor; hook the module by "
            "name instead (Trace(..., keep_calls=True) keeps every call)",
        )


def _available(arch: Architecture) -> list[str]:
    """The per-layer kinds an architecture has, in forward order."""
    return [
        k
        for k in LAYER_KINDS
        if k == "resid_pre" or k == "resid_post" or getattr(arch, _FIELD.get(k, k)) is not None
    ]


def _unavailable(
    model: nn.Module, arch: Architecture, kind: str, name: str
) -> PointUnavailableError:
    what = type(model).__name__
    if kind == "resid_mid":
        why = (
            "its blocks run attention and the MLP in parallel on the same input (no residual "
            "stream between them); use resid_pre, attn_out, mlp_out or resid_post"
        )
    elif kind == "mlp_hidden" and arch.moe:
        why = (
            "its MLP is a mixture of experts: each token's hidden activation lives in the experts "
            "it was routed to, not in one tensor per token; use mlp_in / mlp_out (the input and "
            "output of the whole MoE block)"
        )
    else:
        why = (
            f"the mapping for {arch.key!r} does not name the module whose input it is; add "
            f"{_FIELD.get(kind, kind)}=... with register_architecture, or use module names"
        )
    return PointUnavailableError(name, f"standard point {name!r} does not exist on {what}: {why}")


def _heads(model: nn.Module, arch: Architecture, name: str) -> int:
    if isinstance(arch.heads, int):
        return arch.heads
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None)):
        value = getattr(cfg, arch.heads, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    raise PointUnavailableError(
        name,
        f"standard point {name!r}: the number of attention heads is not known ({type(model).__name__}"
        f" has no config.{arch.heads}); pass heads=<number> to register_architecture",
    )


def point_names(model: nn.Module, *, tl: bool = False) -> list[str]:
    """Every standard point of ``model``, in the order the forward computes them.

    Example::

        >>> import transformers
        >>> from pyhook.points import point_names
        >>> cfg = transformers.GPTJConfig(n_embd=16, n_layer=1, n_head=2, rotary_dim=4, vocab_size=64)
        >>> point_names(transformers.GPTJForCausalLM(cfg))  # parallel attention: no resid_mid
        ['embed', 'resid_pre.0', 'attn_in.0', 'attn_z.0', 'attn_out.0', 'mlp_in.0', 'mlp_hidden.0', 'mlp_out.0', 'resid_post.0', 'final']

    With ``tl=True``: the TransformerLens names that hold on ``model`` what they hold in
    TransformerLens (see :func:`tl_unavailable`), in TransformerLens' order:

        >>> point_names(transformers.GPTJForCausalLM(cfg), tl=True)[:4]
        ['hook_embed', 'blocks.0.hook_resid_pre', 'blocks.0.ln1.hook_scale', 'blocks.0.ln1.hook_normalized']
    """
    layout = _layout(model)
    if tl:
        return [_spell(k, i, True) for k, i in _tl_points(model, layout)]
    kinds = _available(layout.arch)
    names = [_spell("embed", None, tl)]
    for i in range(layout.n):
        names.extend(_spell(k, i, tl) for k in kinds)
    names.append(_spell("final", None, tl))
    return names


def _tl_points(model: nn.Module, layout: _Layout) -> list[tuple[str, int | None]]:
    """(kind, layer) of every TransformerLens name ``model`` has, in forward order."""
    have = set(_available(layout.arch)) | TL_ONLY_KINDS
    per_layer = [
        k for k in TL_LAYER_KINDS if k in have and _tl_refusal(model, layout, k, k, 0) is None
    ]
    out: list[tuple[str, int | None]] = []
    if _tl_refusal(model, layout, "tok_embed", "hook_embed", None) is None:
        out.append(("tok_embed", None))
    for i in range(layout.n):
        out.extend((k, i) for k in per_layer)
    out.extend(
        (k, None)
        for k in ("final_scale", "final_normalized")
        if _tl_refusal(model, layout, k, k, None) is None
    )
    return out


def tl_unavailable(model: nn.Module, name: str) -> str | None:
    """Why TransformerLens' ``name`` is refused on ``model`` (its tensor there is another
    than TransformerLens'), or None when pyhook gives what TransformerLens' name holds.

    Example::

        >>> import transformers
        >>> from pyhook.points import tl_unavailable
        >>> cfg = transformers.BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        ...                               intermediate_size=32, vocab_size=64)
        >>> print(tl_unavailable(transformers.BertModel(cfg), "blocks.0.hook_resid_post"))  # doctest: +ELLIPSIS
        TransformerLens' 'blocks.0.hook_resid_post' holds another tensor on BertModel: ...
        >>> tl_unavailable(transformers.BertModel(cfg), "blocks.0.hook_resid_pre") is None
        True
    """
    parts = _split(name) if isinstance(name, str) else None
    if parts is None or not parts[2]:
        raise LayerNotFoundError(str(name), f"{name!r} is not a TransformerLens name pyhook knows")
    kind, text, _ = parts
    layout = _layout(model)
    layer = None if text is None or not re.fullmatch(r"-?\d+", text) else _index(layout, text, name)
    err = _tl_refusal(model, layout, kind, name, layer)
    return None if err is None else str(err.args[-1] if err.args else err)


# What TransformerLens' names are on a model where pyhook's tensor under the name differs.
_TL_DIFFERS = {
    "resid_mid": "the sum before the post-attention norm (pyhook's resid_mid is after it)",
    "resid_post": "the sum before the block's last norm (pyhook's resid_post is after it)",
    "attn_out": "the attention's output before the post-attention norm",
    "mlp_out": "the MLP's output before the post-MLP norm",
    "embed": "the token embeddings after the embedding norm",
}


def _tl_refusal(
    model: nn.Module, layout: _Layout, kind: str, name: str, layer: int | None
) -> PointUnavailableError | None:
    """Why TransformerLens' name ``name`` (of ``kind``) is refused on ``model``, or None."""
    arch = layout.arch
    what = type(model).__name__
    why = None
    if kind in arch.tl_differs or (kind == "tok_embed" and "embed" in arch.tl_differs):
        why = (
            f"TransformerLens' {name!r} holds another tensor on {what}: "
            f"{_TL_DIFFERS.get('embed' if kind == 'tok_embed' else kind, 'another tensor')}; use "
            "pyhook's own point names (docs/points.md says what each holds)"
        )
    elif kind in arch.flat:
        why = (
            f"TransformerLens' {name!r} is [batch, pos, ...]; {what} computes this tensor as "
            f"[batch*tokens, ...]; use {_spell(kind, layer, False)!r} (captures store it per token)"
        )
    elif kind in TL_NORMS or kind in ("final_scale", "final_normalized"):
        rel = arch.final if kind.startswith("final") else getattr(arch, kind[:3])
        if rel is None:
            norm = "final norm" if kind.startswith("final") else f"{kind[:3]} norm"
            why = (
                f"TransformerLens' {name!r}: the mapping for {arch.key!r} names no {norm} "
                "before the branch (post-norm or no pre-norm blocks, or one pyhook does not "
                "map; register_architecture takes ln1=/ln2=)"
                if not kind.startswith("final")
                else f"TransformerLens' {name!r}: {what} has no final norm (post-norm blocks)"
            )
        else:
            path = layout.path(_side(rel, "output")[0])
            if not kind.startswith("final"):
                path = f"{layout.path(arch.blocks)}.{0 if layer is None else layer}.{_side(rel, 'output')[0]}"
            module = _lookup(model, path)  # type: ignore[arg-type]
            if module is not None and _norm_rule(module) is None:
                why = (
                    f"TransformerLens' {name!r}: {path!r} is a {type(module).__name__}, not a norm "
                    "pyhook can split into TransformerLens' scale and normalized values "
                    "(LayerNorm, RMSNorm)"
                )
    elif kind == "tok_embed":
        get = getattr(model, "get_input_embeddings", None)
        try:
            emb = get() if callable(get) else None
        except (NotImplementedError, AttributeError):
            emb = None
        if not isinstance(emb, nn.Module):
            why = f"TransformerLens' 'hook_embed': {what} has no get_input_embeddings() module"
    if why is None:
        return None
    return PointUnavailableError(name, why)


# TransformerLens names pyhook does not provide, with what to use instead.
_TL_UNPROVIDED = {
    "hook_attn_in": "[batch, pos, head, d_model] copies of the residual stream (use_attn_in); "
    "use 'blocks.L.hook_resid_pre'",
    "hook_q_input": "per-head copies of the residual stream; use 'blocks.L.hook_resid_pre'",
    "hook_k_input": "per-head copies of the residual stream; use 'blocks.L.hook_resid_pre'",
    "hook_v_input": "per-head copies of the residual stream; use 'blocks.L.hook_resid_pre'",
    "hook_mlp_in": "a copy of the residual stream that only ln2 reads (use_hook_mlp_in); use "
    "'blocks.L.hook_resid_mid' (an edit there reaches the skip connection too) or "
    "'<ln2 module>:in' (the MLP branch only)",
    "hook_pos_embed": "the learned position embeddings; hook the position embedding module by "
    "name (GPT-2: 'transformer.wpe')",
    "attn.hook_q": "hook the query projection module by name",
    "attn.hook_k": "hook the key projection module by name",
    "attn.hook_v": "hook the value projection module by name",
    "attn.hook_rot_q": "not provided (rotary queries live inside the attention's forward)",
    "attn.hook_rot_k": "not provided (rotary keys live inside the attention's forward)",
    "attn.hook_attn_scores": "not provided (hook the attention module with output_attentions "
    "for the pattern)",
    "attn.hook_pattern": "the attention weights: run the model with output_attentions=True",
    "attn.hook_result": "not provided: the per-head outputs are attn.hook_z through W_O",
    "mlp.hook_pre": "the MLP's pre-activation; hook its up (or gate) projection module by name",
    "mlp.hook_pre_linear": "hook the MLP's up projection module by name",
}
_TL_UNPROVIDED_RX = re.compile(
    r"(?:blocks\.(?:-?\d+|-?\d*:-?\d*|\*)\.)?("
    + "|".join(re.escape(k) for k in _TL_UNPROVIDED)
    + r")\Z"
)


def _check_tl_unprovided(model: nn.Module, layer: str) -> None:
    m = _TL_UNPROVIDED_RX.match(layer)
    if m is None or (not layer.startswith("blocks.") and m.group(1) != "hook_pos_embed"):
        return
    raise LayerNotFoundError(
        layer,
        f"TransformerLens' {layer!r} is not a pyhook point on {type(model).__name__}: "
        f"{_TL_UNPROVIDED[m.group(1)]}",
    )


def resolve_point(model: nn.Module, name: str) -> Point:
    """The :class:`Point` a single standard point name (canonical or alias) stands for.

    Example::

        >>> import transformers
        >>> from pyhook.points import resolve_point
        >>> cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        ...                                num_attention_heads=2, vocab_size=64)
        >>> p = resolve_point(transformers.LlamaForCausalLM(cfg), "blocks.-1.hook_attn_out")
        >>> p.name, p.module_name, p.kind
        ('attn_out.1', 'model.layers.1.self_attn', 'output')
    """
    parts = _split(name) if isinstance(name, str) else None
    if parts is None or (parts[1] is not None and (":" in parts[1] or parts[1] == "*")):
        raise LayerNotFoundError(
            str(name), f"{name!r} is not a single standard point (e.g. 'resid_post.3', 'embed')"
        )
    kind, text, tl = parts
    layout = _layout(model)
    layer = None if text is None else _index(layout, text, name)
    if tl:
        err = _tl_refusal(model, layout, kind, name, layer)
        if err is not None:
            raise err
    return _make(model, layout, kind, layer, _spell(kind, layer, False))


def expand_points(model: nn.Module, pattern: str) -> list[tuple[str, Point]]:
    """``[(name, Point), ...]`` for a point name, range or glob, in forward order.

    Names keep the pattern's spelling (TransformerLens patterns give TransformerLens names); a
    single name is returned as written. A glob or range matching nothing raises.

    Example::

        >>> import transformers
        >>> from pyhook.points import expand_points
        >>> cfg = transformers.GPT2Config(n_embd=16, n_layer=4, n_head=2, vocab_size=64)
        >>> model = transformers.GPT2LMHeadModel(cfg)
        >>> [n for n, _ in expand_points(model, "resid_post.1:3")], [n for n, _ in expand_points(model, "*.-1")][:2]
        (['resid_post.1', 'resid_post.2'], ['resid_pre.3', 'attn_in.3'])
    """
    if not isinstance(pattern, str):
        raise TypeError(
            f"expand_points takes one point name, range or glob (str), got "
            f"{type(pattern).__name__} {pattern!r}; expand several with one call each"
        )
    layout = _layout(model)
    parts = _split(pattern)
    if parts is not None:
        kind, text, tl = parts
        if text is None or (":" not in text and text != "*"):
            return [(pattern, resolve_point(model, pattern))]
        layers = _range(layout, text)
        if tl:
            err = _tl_refusal(model, layout, kind, pattern, layers[0] if layers else None)
            if err is not None:
                raise err
        if (
            kind not in _available(layout.arch)
            and kind not in TL_ONLY_KINDS
            and kind not in QKV_KINDS
        ):
            raise _unavailable(model, layout.arch, kind, pattern)
        hits = [(_spell(kind, i, tl), kind, i) for i in layers]
    else:
        tl = _is_tl_style(pattern)
        # a negative layer in a glob (``*.-1``) counts from the end
        pattern = re.sub(
            r"(?<=\.)-(\d+)(?=\.|\Z)", lambda m: str(layout.n - int(m.group(1))), pattern
        )
        rx = glob_regex(pattern)
        hits = []
        for n in point_names(model, tl=tl):
            if rx.match(n):
                kind, text, _ = _split(n)  # type: ignore[misc]
                hits.append((n, kind, None if text is None else int(text)))
    if not hits:
        raise LayerNotFoundError(
            pattern,
            f"point pattern {pattern!r} matches no standard point of {type(model).__name__}; its "
            f"points are: embed, {'/'.join(_available(layout.arch))}.0..{layout.n - 1}, final",
        )
    return [(n, _make(model, layout, k, i, _spell(k, i, False))) for n, k, i in hits]


def resolve_targets(model: nn.Module, layer: Any) -> list[tuple[str, Any]] | None:
    """``expand_points(model, layer)`` when ``layer`` is a point name of ``model``, the
    :func:`module_inputs` of a ``"<module>:in"`` name, else None (then it is a module name or a
    module): the one call tools make while resolving layers. A name that is neither a module
    nor a point but looks like a misspelt point raises, suggesting point names."""
    if type(layer) is not str:
        return None
    if layer.endswith(INPUT_SUFFIX) and _lookup(model, layer) is None:
        return module_inputs(model, layer)
    if is_point_name(layer, model):
        return expand_points(model, layer)
    head = layer.partition(".")[0]
    if not head or head in model._modules:  # a module name (the common case): nothing more
        return None
    if not head.strip("*?") and _is_block_glob(model, layer):
        return expand_points(model, layer)
    _check_tl_unprovided(model, layer)
    _check_point_typo(model, layer)
    return None


def _is_block_glob(model: nn.Module, layer: str) -> bool:
    """Whether ``layer`` is a glob over the points of blocks whose head is glob characters
    only (``*.3``, ``*.-1``: every point of block 3, of the last block): taken as points when
    no module name matches it (module names win) and the model has a mapping."""
    head, _, rest = layer.partition(".")
    if not head or any(c not in "*?" for c in head) or not re.fullmatch(r"-?\d+", rest):
        return False
    try:
        _layout(model)
    except LayerNotFoundError:
        return False
    rx = glob_regex(layer)
    return not any(n and rx.match(n) for n, _ in model.named_modules())


def module_inputs(model: nn.Module, name: str) -> list[tuple[str, Point]]:
    """``[(name, Point), ...]`` for ``"<module name or glob>:in"``: the input of each module (its
    first positional argument, else its ``hidden_states=`` keyword, else its first tensor
    keyword), hooked with a forward pre-hook; an edit replaces that argument, so the module
    alone sees it. Every tool that takes module names takes these (``Trace``, ``TraceDict``,
    ``capture``, ``TruncatedModule``, ``FlexModel``, ``pyhook capture --layers``).

    Example::

        >>> import torch, pyhook
        >>> from pyhook.points import module_inputs
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
        >>> [n for n, _ in module_inputs(net, "*:in")]
        ['0:in', '1:in', '2:in']
        >>> with pyhook.Trace(net, "2:in") as t:
        ...     y = net(torch.ones(4, 2))
        >>> torch.equal(t.output, net[1](net[0](torch.ones(4, 2))))
        True
    """
    if not isinstance(name, str) or not name.endswith(INPUT_SUFFIX):
        raise LayerNotFoundError(
            str(name),
            f"{name!r} is not a module input (a module name followed by {INPUT_SUFFIX!r})",
        )
    base = name[: -len(INPUT_SUFFIX)]
    if is_point_name(base, model):
        raise LayerNotFoundError(
            name,
            f"{name!r}: {INPUT_SUFFIX!r} takes a module name, and {base!r} is a standard point; "
            "the points inside a block are points of their own (attn_in, mlp_in, ...: see "
            "pyhook.points)",
        )
    if _GLOB.search(base):
        rx = glob_regex(base)
        hits = [(n, m) for n, m in model.named_modules() if n and rx.match(n)]
        if not hits:
            names = [n for n, _ in model.named_modules() if n]
            shown = ", ".join(repr(n) for n in names[:8]) + (", ..." if len(names) > 8 else "")
            raise LayerNotFoundError(
                name,
                f"module glob {base!r} (of {name!r}) matches no module of {type(model).__name__}; "
                f"its modules: {shown or '(none)'}",
            )
    else:
        hits = [(base, get_module(model, base))]
    return [(n + INPUT_SUFFIX, Point(n + INPUT_SUFFIX, n, m, "input")) for n, m in hits]


# A misspelt point is caught when its first part is close to a point's (and is no module).
_TYPO_HEADS = (*KINDS, "blocks", "hook_embed", "ln_final")


def _check_point_typo(model: nn.Module, layer: str) -> None:
    head = layer.partition(".")[0]
    if not head or head in model._modules:
        return
    if not difflib.get_close_matches(head, _TYPO_HEADS, n=1, cutoff=0.75):
        return
    try:
        names = point_names(model) + point_names(model, tl=True)
    except LayerNotFoundError:  # no mapping: the module-name error says what there is
        return
    close = difflib.get_close_matches(layer, names, n=5, cutoff=0.6)
    modules = difflib.get_close_matches(
        layer, [n for n, _ in model.named_modules() if n], n=3, cutoff=0.6
    )
    hint = (
        f"closest points: {', '.join(repr(n) for n in close)}"
        if close
        else (
            f"its points: embed, {'/'.join(_available(_layout(model).arch))}.0..{_layout(model).n - 1}, final"
        )
    )
    if modules:
        hint += f"; closest module names: {', '.join(repr(n) for n in modules)}"
    raise LayerNotFoundError(
        layer,
        f"{layer!r} is neither a standard point nor a module of {type(model).__name__}; {hint}",
    )


def module_path(name: Any, target: Any) -> Any:
    """The module path a tool hooks for ``name`` resolved to ``target`` (a Point's module)."""
    return target.module_name if type(target) is Point else name


def all_points(targets: Iterable[Any]) -> bool:
    """Whether every resolved target is a :class:`Point` (their order is then forward order)."""
    return all(type(t) is Point for t in targets)


def points_by_module(model: nn.Module) -> dict[str, list[str]]:
    """``{module name: [standard points on it, '(input)' marked]}``, for listing a model.

    Example::

        >>> import transformers
        >>> from pyhook.points import points_by_module
        >>> cfg = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=64)
        >>> points_by_module(transformers.GPT2LMHeadModel(cfg))["transformer.h.0"]
        ['embed (input)', 'resid_pre.0 (input)', 'resid_post.0']
    """
    out: dict[str, list[str]] = {}
    for name, point in expand_points(model, "**"):
        label = f"{name} (input)" if point.kind == "input" else name
        out.setdefault(point.module_name, []).append(label)
    return out


# -- the docs' table --------------------------------------------------------------------------
def _cell(value: str | None, default: str) -> str:
    if value is None:
        return "(none: parallel)" if default == "input" else "(last block)"
    path, side, copy = _side(value, default)
    extra = "" if side == default else f" ({side})"
    return f"`{path}`{extra}{' (copied)' if copy else ''}"


def _site_cell(row: Architecture, kind: str) -> str:
    value = getattr(row, kind)
    if value is None:
        return "(experts: refused)" if kind == "mlp_hidden" and row.moe else "(not mapped)"
    return _cell(value, "input")


def architecture_table(rows: Sequence[Architecture] | None = None, *, sites: bool = False) -> str:
    """The Markdown table of the mapping (what docs/points.md shows; a test keeps them equal):
    the residual-stream points, or with ``sites=True`` the sites inside a block (the module
    whose input each one is).

    Example::

        >>> from pyhook.points import architecture_table
        >>> architecture_table().splitlines()[0]
        '| model_type | when | blocks | attn_out | mlp_out | resid_mid (input of) | final | notes |'
        >>> architecture_table(sites=True).splitlines()[0]
        '| model_type | when | attn_in | attn_z | mlp_in | mlp_hidden | notes |'
    """
    rows = ARCHITECTURES if rows is None else rows
    if sites:
        lines = [
            "| model_type | when | attn_in | attn_z | mlp_in | mlp_hidden | notes |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            cells = " | ".join(_site_cell(r, k) for k in SITE_KINDS)
            lines.append(f"| `{r.key}` | {r.when or ''} | {cells} | {r.sites_note} |")
        return "\n".join(lines)
    lines = [
        "| model_type | when | blocks | attn_out | mlp_out | resid_mid (input of) | final | notes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        note = r.note
        lines.append(
            f"| `{r.key}` | {r.when or ''} | `{r.blocks}` | {_cell(r.attn, 'output')} | "
            f"{_cell(r.mlp, 'output')} | {_cell(r.mid, 'input')} | {_cell(r.final, 'output')} | {note} |"
        )
    return "\n".join(lines)
