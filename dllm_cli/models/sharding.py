"""Tensor parallelism's model side: where a family's pieces split (Megatron's layout), a rank's
place in its group (`Shards`), and the modules that sum partial products.

q/k/v and the MLP's gate and up projections split over their outputs (column-parallel), the
attention output and the MLP's down projection over their inputs (row-parallel: partial
products summed by one all-reduce); the embedding and the LM head split over the vocabulary;
the KV cache holds only the rank's KV heads; experts split as dense MLPs, the router
replicated. docs/tensor-parallel.md counts the collectives. Reading a rank's slices:
sharded_load.py; sampling from vocabulary shards: decoding/sharded_sampling.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dllm_cli.errors import SettingsError
from dllm_cli.models.collectives import Shards
from dllm_cli.models.moe import LLaDAMoESparseBlock

Slice = tuple[int, int, int] | None  # (dim, start, stop) of a checkpoint tensor; None: whole
ZERO = "zero"  # a row-parallel bias on ranks other than 0: added once, after the sum


@dataclass(frozen=True)
class Layout:
    """Where a family's parallel pieces are: names inside a block, and at the model's level."""

    sizes: Callable[[object], dict[str, int]]  # config -> what must divide by the degree
    attention: str  # the block's submodule holding n_heads / n_kv ("": the block itself)
    columns: tuple[str, ...]  # linears split over their outputs
    rows: tuple[str, ...]  # linears split over their inputs, summed by an all-reduce
    vocabulary: tuple[str, ...]  # the embedding and the LM head (model-level names)
    feed_forward: str | None = None  # a block's MLP that is sparse in some layers (MoE)


def moe_sizes(c) -> dict[str, int]:
    """LLaDA-MoE: heads, KV heads, and every feed-forward width its layers have."""
    sizes = {"attention heads": c.num_attention_heads, "KV heads": c.num_key_value_heads}
    sizes["expert MLP columns"] = c.expert_intermediate_size
    if not all(c.moe_layer_freq):
        sizes["dense MLP columns"] = c.dense_intermediate_size
    if c.shared_expert_intermediate_size:
        sizes["shared expert MLP columns"] = c.shared_expert_intermediate_size
    return sizes


def llada2_sizes(c) -> dict[str, int]:
    """LLaDA2.x: heads, KV heads, the dense MLP's, every expert's and the shared experts'
    widths (split by columns under --expert-parallel too)."""
    sizes = {"attention heads": c.num_attention_heads, "KV heads": c.num_key_value_heads}
    sizes["dense MLP columns"] = c.intermediate_size
    if c.num_experts:
        sizes["expert MLP columns"] = c.moe_intermediate_size
    if c.num_experts and c.num_shared_experts:
        sizes["shared expert MLP columns"] = c.moe_intermediate_size * c.num_shared_experts
    return sizes


# Qwen's names (Dream, SDAR): heads, KV heads and the SwiGLU's columns split alike.
QWEN_LAYOUT = Layout(
    lambda c: {
        "attention heads": c.num_attention_heads,
        "KV heads": c.num_key_value_heads,
        "MLP columns": c.intermediate_size,
    },
    "self_attn",
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
    ("self_attn.o_proj", "mlp.down_proj"),
    ("model.embed_tokens", "lm_head"),
)

# Keyed by families.py names; a family absent here is refused (`layout_of`).
LAYOUTS: dict[str, Layout] = {
    "llada": Layout(
        lambda c: {"attention heads": c.n_heads, "KV heads": c.kv_heads, "MLP columns": c.ffn_size},
        "",
        ("q_proj", "k_proj", "v_proj", "ff_proj", "up_proj"),
        ("attn_out", "ff_out"),
        ("model.transformer.wte", "model.transformer.ff_out"),
    ),
    "dream": QWEN_LAYOUT,
    # Qwen3's names: Dream's layout; q_norm and k_norm act per head (replicated). The block
    # stepper drafts from the vocabulary shard (decoding/sharded_sampling.py block_drafter).
    "sdar": QWEN_LAYOUT,
    # The fused QKV read as three row ranges, experts split by columns: its blocks are split
    # by sharded_llada2.py (sharded_load.py's BLOCK_SPLITS), not by these lists.
    "llada2": Layout(llada2_sizes, "attention", (), (), ("model.word_embeddings", "lm_head")),
    # Attention as Dream's; each expert's columns split as a dense MLP's, the router replicated
    # (every rank routes the same all-reduced hidden states), one all-reduce per sparse block.
    "llada_moe": Layout(
        moe_sizes,
        "self_attn",
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("self_attn.o_proj",),
        ("model.embed_tokens", "lm_head"),
        feed_forward="mlp",
    ),
}


def layout_of(family: str) -> Layout:
    """The family's layout, or a one-line refusal."""
    if family not in LAYOUTS:
        raise SettingsError(
            f"--tensor-parallel does not support {family} models yet "
            f"(supported: {', '.join(LAYOUTS)})"
        )
    return LAYOUTS[family]


def check_degree(family: str, config, world: int, experts: bool = False) -> None:
    """Refuse a degree that does not divide the heads, the KV heads, an MLP's width or (with
    `experts`: --expert-parallel) the experts."""
    sizes = layout_of(family).sizes(config)
    if experts:
        sizes = expert_sizes(family, config, sizes)
    every = ", ".join(f"{count} {what}" for what, count in sizes.items())
    for what, count in sizes.items():
        if count % world:
            flag = " with --expert-parallel" if what == "experts" else ""
            raise SettingsError(
                f"--tensor-parallel {world}{flag} does not divide the model's {count} {what} "
                f"({every})"
            )


# family -> the config field counting the experts --expert-parallel splits whole
# (models/expert_parallel.py, sharded_llada2.py); a family not here is refused.
EXPERT_COUNTS = {"llada_moe": "num_experts", "llada2": "num_experts"}


def expert_sizes(family: str, config, sizes: dict[str, int]) -> dict[str, int]:
    """What must divide under --expert-parallel: whole experts, not their columns."""
    if family not in EXPERT_COUNTS:
        raise SettingsError(
            f"--expert-parallel supports {', '.join(EXPERT_COUNTS)} models only (this is {family})"
        )
    kept = {what: n for what, n in sizes.items() if what != "expert MLP columns"}
    return {**kept, "experts": getattr(config, EXPERT_COUNTS[family])}


# --- the modules of a split model ---------------------------------------------------------


class VocabEmbedding(nn.Embedding):
    """Ids [start, stop) of the table (`num_embeddings` stays whole); others': an all-reduce."""

    shards: Shards
    start: int

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start  # (B, T)
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, d)
        return self.shards.all_reduce(rows.masked_fill_(outside[..., None], 0.0))


class RowLinear(nn.Linear):
    """A linear over this rank's share of its inputs: partial products summed over ranks."""

    shards: Shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shards.all_reduce(super().forward(x))


def split_columns(lin: nn.Linear, shards: Shards, plan: dict, name: str) -> None:
    """A column-parallel linear: this rank's share of the outputs (and of their biases)."""
    lo, hi = shards.even(lin.out_features)
    narrow(lin, 0, lo, hi, plan, name)
    lin.out_features = hi - lo


def split_inputs(lin: nn.Linear, shards: Shards, plan: dict, name: str) -> None:
    """This rank's share of a linear's inputs (the caller sums the partial outputs)."""
    lo, hi = shards.even(lin.in_features)
    narrow(lin, 1, lo, hi, plan, name)
    if lin.bias is not None and shards.rank:
        plan[f"{name}.bias"] = ZERO
    lin.in_features = hi - lo


def split_rows(lin: nn.Linear, shards: Shards, plan: dict, name: str) -> None:
    """A row-parallel linear: its partial output summed over ranks by one all-reduce."""
    split_inputs(lin, shards, plan, name)
    lin.__class__, lin.shards = RowLinear, shards


def split_swiglu(mlp, shards: Shards, plan: dict, where: str, down: Callable) -> None:
    """A SwiGLU's gate and up projections split over their outputs, `down` splits its output."""
    split_columns(mlp.gate_proj, shards, plan, f"{where}.gate_proj")
    split_columns(mlp.up_proj, shards, plan, f"{where}.up_proj")
    down(mlp.down_proj, shards, plan, f"{where}.down_proj")


def narrow(module: nn.Module, dim: int, lo: int, hi: int, plan: dict, name: str) -> None:
    """Replace `module`'s weight (and a column split's bias) by meta tensors of the piece."""
    for kind in ("weight", "bias"):
        p = getattr(module, kind, None)
        if p is None or (kind == "bias" and dim == 1):  # a row split keeps the whole bias
            continue
        shape = list(p.shape)
        shape[dim] = hi - lo
        setattr(module, kind, nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta")))
        plan[f"{name}.{kind}"] = (dim, lo, hi)


class ShardedLM:
    """Mixed in before a DiffusionLM class: a KV cache of this rank's heads, forwards counted;
    its `shards` make the engine sample from vocabulary shards (decoding/sharded_sampling.py)."""

    shards: Shards
    local_kv: int
    vocab_start: int  # the first id of this rank's logits
    vocab_width: int  # every rank's logits together (the whole embedding's rows)
    weight_bytes: tuple[int, int]  # (this rank's, the whole model's)

    def kv_shape(self) -> tuple[int, int, int]:
        layers, _, head_dim = super().kv_shape()
        return layers, self.local_kv, head_dim

    def forward(self, *args, **kwargs):
        self.shards.counts.forwards += 1
        return super().forward(*args, **kwargs)


class SummedExperts(LLaDAMoESparseBlock):
    """A sparse block of column-split experts: their routed sum is summed over ranks once."""

    shards: Shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shards.all_reduce(super().forward(x))
