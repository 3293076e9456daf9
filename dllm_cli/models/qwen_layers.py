"""Layers under Hugging Face's Llama / Qwen parameter names (`self_attn.q_proj`, `mlp`,
`input_layernorm`, `post_attention_layernorm`), shared by Dream, LLaDA-MoE, SDAR, LLaDA2 and
the guide."""

from __future__ import annotations

import torch
from torch import nn

from dllm_cli.models.fused import Fusion
from dllm_cli.models.layers import RMSNorm, SwiGLU, attend_qkv, residual


class QwenAttention(nn.Module):
    """Qwen-named q/k/v/o projections, RoPE in the model dtype, attend(); optionally q and k
    RMS-normed over the head dimension then q, k, v clipped (LLaDA-MoE's reference order)."""

    def __init__(
        self,
        d: int,
        n_heads: int,
        n_kv: int,
        head_dim: int,
        *,
        qkv_bias: bool,
        out_bias: bool,
        qk_norm_eps: float | None = None,
        clip: float | None = None,
    ):
        super().__init__()
        self.n_heads, self.n_kv = n_heads, n_kv
        self.q_proj = nn.Linear(d, n_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(d, n_kv * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(d, n_kv * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * head_dim, d, bias=out_bias)
        self.clip = clip
        normed = qk_norm_eps is not None
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if normed else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if normed else None
        self.fusion: Fusion | None = None  # after fuse()

    def fuse(self) -> None:
        self.fusion = Fusion(qkv=(self.q_proj, self.k_proj, self.v_proj), out=(self.o_proj,))

    def normed(self, qkv: torch.Tensor) -> torch.Tensor:
        """(B, T, (H + 2 H_kv) D) with q and k head-normed, then q, k, v clipped."""
        b, t, _ = qkv.shape
        heads = qkv.view(b, t, self.n_heads + 2 * self.n_kv, -1)  # (B, T, H + 2 H_kv, D)
        if self.q_norm is not None:
            q = self.q_norm(heads[:, :, : self.n_heads])
            k = self.k_norm(heads[:, :, self.n_heads : self.n_heads + self.n_kv])
            heads = torch.cat([q, k, heads[:, :, self.n_heads + self.n_kv :]], dim=2)
        if self.clip is not None:
            heads = heads.clamp(-self.clip, self.clip)
        return heads.view(b, t, -1)

    def forward(self, x, rope, *, cache, layer, columns, key_mask):
        f = self.fusion if self.fusion is not None and self.fusion.intact() else None
        if f is not None:
            qkv = f.qkv(x)  # (B, T, (H + 2 H_kv) D)
        else:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        if self.q_norm is not None or self.clip is not None:
            qkv = self.normed(qkv)
        a = attend_qkv(qkv, self.n_heads, self.n_kv, rope, False, cache, layer, columns, key_mask)
        return f.out(a) if f is not None else self.o_proj(a)


class QwenLayer(nn.Module):
    """Pre-norm x + attention(norm(x)), then x + mlp(norm(x)), plus a shared expert's output
    beside a MoE mlp (LLaDA-MoE)."""

    def __init__(self, d: int, eps: float, attention: QwenAttention, mlp: nn.Module, shared=None):
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.shared_expert = shared
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)

    def fuse(self) -> None:
        self.self_attn.fuse()
        for mlp in (self.mlp, self.shared_expert):
            if isinstance(mlp, SwiGLU):  # a dense layer or the shared expert
                mlp.fuse()

    def forward(self, x, rope, **kw):
        # Submodules read from `_modules` and their forward called directly (nothing hooks
        # them): no Module.__getattr__ or hook check per call, as LLaDA's block does.
        m = self._modules
        x = residual(x, m["self_attn"].forward(m["input_layernorm"].forward(x), rope, **kw))
        return residual(x, self.feed_forward(m["post_attention_layernorm"].forward(x)))

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        """The mlp plus the shared expert (the hook expert parallelism sums over ranks)."""
        out = self._modules["mlp"].forward(h)
        return out if self.shared_expert is None else out + self.shared_expert(h)


class PreNormLayer(nn.Module):
    """x + attention(norm(x)), then x + mlp(norm(x)), out of place, the attention under its
    checkpoint name (`self_attn`, LLaDA2's `attention`): SDAR's, LLaDA2's and the guide's."""

    def __init__(self, d: int, eps: float, attention: nn.Module, mlp: nn.Module, name: str):
        super().__init__()
        self.attention_name = name
        setattr(self, name, attention)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)

    def fuse(self) -> None:
        """Nothing to join (`quantize_model` calls it): every projection is its own int8 layer."""

    def forward(self, x: torch.Tensor, rope, *where, **kw) -> torch.Tensor:
        attention = getattr(self, self.attention_name)
        x = x + attention(self.input_layernorm(x), rope, *where, **kw)
        return x + self.mlp(self.post_attention_layernorm(x))
