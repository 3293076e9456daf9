"""LLaDA-MoE's sparse feed-forward: a softmax top-k router and SwiGLU experts, dispatched by
expert (one sort, then one grouped GEMM over stacked weights, or one call per expert).

The router follows the released modeling code (OLMoE's sparse block with `norm_topk_prob`
hard-coded False); the dispatch is ours: the reference loops over experts with `torch.where`
and `index_add_`, and so do we in the fallback, in the same order of additions per token.
"""

from __future__ import annotations

import torch
from torch import nn

from dllm_cli.models.layers import SwiGLU, swiglu


def route(
    logits: torch.Tensor, k: int, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (N, E) -> top-k (weights (N, k) float32, experts (N, k)): float32 softmax,
    plus the expert bias (if any), no renormalisation (the reference's top-k probabilities)."""
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    if bias is not None:
        probs = probs + bias
    return torch.topk(probs, k, dim=-1)


class ExpertStack:
    """Every expert's weights in two stacked (in, out) tensors, each expert's Linear a view
    into them, so one grouped GEMM (`torch._grouped_mm`) runs all experts without a Python loop
    or a host sync; names, `state_dict()` and memory stay as they were."""

    def __init__(self, experts: list[nn.Module]):
        with torch.no_grad():
            self.w1 = torch.stack(
                [torch.cat([e.gate_proj.weight, e.up_proj.weight]).t() for e in experts]
            ).contiguous()  # (E, d, 2I)
            self.w2 = torch.stack([e.down_proj.weight.t() for e in experts]).contiguous()
        self.hidden = experts[0].gate_proj.out_features
        for i, e in enumerate(experts):
            parts = {
                e.gate_proj: self.w1[i, :, : self.hidden],
                e.up_proj: self.w1[i, :, self.hidden :],
                e.down_proj: self.w2[i],
            }
            for lin, view in parts.items():
                lin.weight = nn.Parameter(view.t(), lin.weight.requires_grad)
        self.linears = [lin for e in experts for lin in (e.gate_proj, e.up_proj, e.down_proj)]
        self.pointers = self._pointers()

    def intact(self) -> bool:
        """Every expert still reads the stacked storage (not moved or replaced since)."""
        return self._pointers() == self.pointers

    def _pointers(self) -> list[int]:
        return [lin._parameters["weight"].data_ptr() for lin in self.linears]

    def __call__(self, rows: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """rows (M, d) grouped by expert, ends (E,) int32 cumulative counts -> (M, d)."""
        h = torch._grouped_mm(rows, self.w1, offs=ends)  # (M, 2I)
        act = swiglu(h[:, : self.hidden], h[:, self.hidden :]).contiguous()
        return torch._grouped_mm(act, self.w2, offs=ends)


def each_expert(experts: list[nn.Module], rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The grouped GEMM's result one expert at a time on its contiguous rows (M, d)."""
    out = torch.empty_like(rows)
    start = 0
    for expert, n in zip(experts, counts, strict=True):
        if n:
            out[start : start + n] = expert(rows[start : start + n])
            start += n
    return out


def grouped_kernel(x: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM runs here: CPU, or CUDA in bfloat16 on compute 9.0+."""
    if x.device.type == "cpu":
        return True
    return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)


class LLaDAMoESparseBlock(nn.Module):
    """Router + experts; tokens are grouped by expert (one sort) and each expert runs once."""

    def __init__(self, d: int, experts: int, top_k: int, hidden: int, expert_bias: bool):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(d, hidden) for _ in range(experts))
        self.register_buffer("expert_bias", torch.zeros(experts) if expert_bias else None)
        self.stack: ExpertStack | None = None  # after stack_experts()

    def stack_experts(self) -> None:
        """Stack the experts' weights once after loading, for the grouped GEMM."""
        self.stack = ExpertStack(self.members())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, d)
        weights, experts = route(self.gate(flat), self.top_k, self.expert_bias)  # (N, k) each
        weights = weights.to(x.dtype)
        # Every (token, choice) pair, sorted by expert (stable: each expert's tokens in order).
        chosen = experts.reshape(-1)  # (N k,)
        order = chosen.argsort(stable=True)
        token = order // self.top_k  # (N k,) the token each sorted pair reads
        counts = torch.bincount(chosen, minlength=len(self.experts))  # (E,)
        rows = flat[token]  # (N k, d), grouped by expert
        out_rows = self.dispatch(rows, counts)
        out_rows.mul_(weights.reshape(-1)[order, None])
        # Sum each token's k expert outputs in expert order (as the reference's index_add_).
        return torch.zeros_like(flat).index_add_(0, token, out_rows).view(shape)

    def members(self) -> list[nn.Module]:
        """The experts this block runs, in the order their rows are grouped."""
        return list(self.experts)

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows (M, d) grouped by expert, counts (E,) -> (M, d): one grouped GEMM where it
        runs, else one call per expert (rows past the counted ones are left unset)."""
        stack = self.stack
        if stack is not None and stack.intact() and grouped_kernel(rows):
            return stack(rows, counts.cumsum(0).to(torch.int32))
        return each_expert(self.members(), rows, counts.tolist())
