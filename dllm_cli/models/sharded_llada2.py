"""LLaDA2.x's pieces under tensor parallelism (the model side).

The fused `query_key_value` projection's rows are every query head, then every KV head's key,
then its value: a rank reads its three row ranges and concatenates them (its own fused
projection); `dense` is row-parallel. A dense MLP splits as LLaDA's; a sparse layer splits its
routed and shared experts over their columns (router replicated), its whole output summed by
one all-reduce. Under --expert-parallel a rank keeps E/N whole routed experts instead
(`LocalLLaDA2MoE`), the shared experts still split over their columns.
"""

from __future__ import annotations

import torch
from torch import nn

from dllm_cli.models.collectives import Shards
from dllm_cli.models.layers import SwiGLU
from dllm_cli.models.llada2 import LLaDA2MoE
from dllm_cli.models.moe import each_expert
from dllm_cli.models.sharding import split_inputs, split_rows, split_swiglu

ROWS = "rows"  # a plan entry ("rows", ((lo, hi), ...)): these row ranges, concatenated


class SummedLLaDA2MoE(LLaDA2MoE):
    """A sparse layer of partial experts: its output summed over the ranks once."""

    shards: Shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shards.all_reduce(super().forward(x))


def split_llada2_block(block, shards: Shards, plan: dict, prefix: str) -> None:
    """One LLaDA2 layer shrunk to this rank's pieces."""
    attention = block.attention
    split_fused_qkv(attention, shards, plan, f"{prefix}.attention.query_key_value")
    split_rows(attention.dense, shards, plan, f"{prefix}.attention.dense")
    mlp, where = block.mlp, f"{prefix}.mlp"
    if isinstance(mlp, SwiGLU):
        split_swiglu(mlp, shards, plan, where, split_rows)
        return
    named = [(f"experts.{i}", e) for i, e in enumerate(mlp.experts)]
    if shards.expert_parallel:  # whole experts: only the shared experts' columns split
        keep_llada2_experts(mlp, shards)
        named = []
    if mlp.shared_experts is not None:
        named.append(("shared_experts", mlp.shared_experts))
    for name, expert in named:
        split_swiglu(expert, shards, plan, f"{where}.{name}", split_inputs)
    if not shards.expert_parallel:
        mlp.__class__, mlp.shards = SummedLLaDA2MoE, shards


class LocalLLaDA2MoE(SummedLLaDA2MoE):
    """A sparse layer holding routed experts [first, first + count) whole (names stay
    `experts.{i}.*`): the reference's routing, sort and weighted sum with other ranks' pairs 0,
    plus this rank's shared-expert columns, summed over ranks (SummedLLaDA2MoE)."""

    first: int
    count: int

    def routed(self, flat: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """(N k, d): this rank's experts' outputs for their (token, choice) pairs, 0 elsewhere."""
        k = experts.shape[1]
        order = experts.reshape(-1).argsort()  # the reference's (unstable) sort
        counts = torch.bincount(experts.reshape(-1), minlength=self.gate.weight.shape[0])
        lo, hi = self.first, self.first + self.count
        start, stop = int(counts[:lo].sum()), int(counts[:hi].sum())  # this rank's sorted pairs
        mine = order[start:stop]
        outs = each_expert(list(self.experts.values()), flat[mine // k], counts[lo:hi].tolist())
        back = flat.new_zeros(flat.shape[0] * k, flat.shape[-1])
        back[mine] = outs
        return back


def keep_llada2_experts(mlp: LLaDA2MoE, shards: Shards) -> None:
    """Shrink a meta-built sparse layer to this rank's routed experts, in place (others unread)."""
    lo, hi = shards.even(len(mlp.experts))
    mlp.experts = nn.ModuleDict({str(i): mlp.experts[i] for i in range(lo, hi)})
    mlp.__class__, mlp.shards, mlp.first, mlp.count = LocalLLaDA2MoE, shards, lo, hi - lo


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
