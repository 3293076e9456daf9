"""--expert-parallel: LLaDA-MoE's experts shared out whole over the tensor-parallel ranks.

Rank r of N holds experts [r E/N, (r + 1) E/N) whole and computes them for the tokens routed to
them; the router is replicated (every rank picks the same experts), attention stays split by
heads, a shared expert by its columns, and the layer's feed-forward output is summed over the
ranks by one all-reduce. Every rank holds every token, so no token is sent anywhere.

The reference (OLMoE's sparse block) has no expert parallelism; its routing and weights are
kept exactly, only the order in which a token's k expert outputs are added changes (a rank's
own, then the sum over ranks).
"""

from __future__ import annotations

import torch
from torch import nn

from dllm_cli.models.collectives import Shards
from dllm_cli.models.moe import LLaDAMoESparseBlock, route
from dllm_cli.models.qwen_layers import QwenLayer


class LocalExperts(LLaDAMoESparseBlock):
    """A sparse block holding experts [first, first + count) only (keyed by their global
    indices: names stay `experts.{i}.*`); its output is this rank's part, unreduced."""

    first: int
    count: int

    def members(self) -> list[nn.Module]:
        return list(self.experts.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, d)
        weights, experts = route(self.gate(flat), self.top_k, self.expert_bias)  # (N, k) each
        local = experts.reshape(-1) - self.first  # (N k,) index among this rank's experts
        mine = (local >= 0) & (local < self.count)
        chosen = torch.where(mine, local, self.count)  # other ranks' pairs sort last
        order = chosen.argsort(stable=True)
        token = order // self.top_k  # (N k,) the token each sorted pair reads
        counts = torch.bincount(chosen, minlength=self.count + 1)[: self.count]  # (count,)
        rows = flat[token]  # (N k, d): this rank's pairs first, grouped by expert
        out_rows = self.dispatch(rows, counts)  # rows past this rank's: not computed
        scaled = out_rows * weights.to(x.dtype).reshape(-1)[order, None]
        out_rows = torch.where(mine[order, None], scaled, 0.0)  # (N k, d); others' rows: 0
        return torch.zeros_like(flat).index_add_(0, token, out_rows).view(shape)


class ExpertSummedLayer(QwenLayer):
    """A sparse layer whose feed-forward output (experts and shared expert) is summed once."""

    shards: Shards

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.shards.all_reduce(super().feed_forward(h))  # (B, T, d) summed over ranks


def keep_experts(layer: QwenLayer, shards: Shards) -> None:
    """Shrink a meta-built sparse layer to this rank's experts, in place (others are not read)."""
    mlp = layer.mlp
    lo, hi = shards.even(len(mlp.experts))
    mlp.experts = nn.ModuleDict({str(i): mlp.experts[i] for i in range(lo, hi)})
    mlp.__class__, mlp.first, mlp.count = LocalExperts, lo, hi - lo
    layer.__class__, layer.shards = ExpertSummedLayer, shards
