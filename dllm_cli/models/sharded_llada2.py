"""LLaDA2.x's pieces under tensor parallelism (the model side: decoding it under the flag is
refused until the block stepper drafts from vocabulary shards).

Its attention has one fused `query_key_value` projection whose rows are every query head, then
every KV head's key, then its value: a rank reads three row ranges of it (its query heads, its
keys, its values) and concatenates them, which is its own fused projection. `dense` (the output)
is row-parallel. A dense layer's MLP splits as LLaDA's; a sparse layer splits every routed
expert and the shared experts over their columns, the router replicated (every rank routes the
same hidden states), and the layer's whole output (routed sum plus shared experts, each rank's
partial) is summed by one all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from dllm_cli.models.collectives import Shards
from dllm_cli.models.layers import SwiGLU
from dllm_cli.models.llada2 import LLaDA2MoE

ROWS = "rows"  # a plan entry ("rows", ((lo, hi), ...)): these row ranges, concatenated


class SummedLLaDA2MoE(LLaDA2MoE):
    """A sparse layer of partial experts: its output summed over the ranks once."""

    shards: Shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shards.all_reduce(super().forward(x))


def split_llada2_block(block, shards: Shards, plan: dict, prefix: str, ops) -> None:
    """One LLaDA2 layer shrunk to this rank's pieces; `ops`: sharded_load's split_columns,
    split_inputs and split_rows (passed in: that module imports this one)."""
    split_columns, split_inputs, split_rows = ops
    attention = block.attention
    split_fused_qkv(attention, shards, plan, f"{prefix}.attention.query_key_value")
    split_rows(attention.dense, shards, plan, f"{prefix}.attention.dense")
    mlp, where = block.mlp, f"{prefix}.mlp"
    if isinstance(mlp, SwiGLU):
        split_columns(mlp.gate_proj, shards, plan, f"{where}.gate_proj")
        split_columns(mlp.up_proj, shards, plan, f"{where}.up_proj")
        split_rows(mlp.down_proj, shards, plan, f"{where}.down_proj")
        return
    named = [(f"experts.{i}", e) for i, e in enumerate(mlp.experts)]
    if mlp.shared_experts is not None:
        named.append(("shared_experts", mlp.shared_experts))
    for name, expert in named:
        split_columns(expert.gate_proj, shards, plan, f"{where}.{name}.gate_proj")
        split_columns(expert.up_proj, shards, plan, f"{where}.{name}.up_proj")
        split_inputs(expert.down_proj, shards, plan, f"{where}.{name}.down_proj")
    mlp.__class__, mlp.shards = SummedLLaDA2MoE, shards


def split_fused_qkv(attention, shards: Shards, plan: dict, name: str) -> None:
    """This rank's query heads, keys and values of the fused projection, in that order."""
    lin, hd = attention.query_key_value, attention.query_key_value.out_features
    hd //= attention.n_heads + 2 * attention.n_kv
    q, kv = attention.n_heads * hd, attention.n_kv * hd
    ranges = []
    for start, width in ((0, q), (q, kv), (q + kv, kv)):
        lo, hi = shards.even(width)
        ranges.append((start + lo, start + hi))
    size = sum(hi - lo for lo, hi in ranges)
    for kind in ("weight", "bias"):
        p = getattr(lin, kind, None)
        if p is None:
            continue
        shape = [size, *p.shape[1:]]
        setattr(lin, kind, nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta")))
        plan[f"{name}.{kind}"] = (ROWS, tuple(ranges))
    lin.out_features = size


def read_rows(tensor, ranges) -> torch.Tensor:
    """The row ranges of a checkpoint slice (safetensors' get_slice), concatenated."""
    return torch.cat([tensor[lo:hi] for lo, hi in ranges])
