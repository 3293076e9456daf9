"""LLaDA2.0 / LLaDA2.1 (inclusionAI, `LLaDA2MoeModelLM`): a block-causal BailingMoeV2 MoE.

Per the released modeling code (`modeling_llada2_moe.py`; read in ZHZisZZ/dllm's copies of
LLaDA2.0 and LLaDA2.1 at ca176752): one fused `query_key_value` projection, q/k head norms,
partial rotate-half RoPE, dense first `first_k_dense_replace` layers, then a MoE with a float32
sigmoid, group-limited router whose `expert_bias` decides only the selection, plus shared
experts (docs/block-diffusion.md, "Models"). No logit shift. The mask id (156895, `<|mask|>`)
is not in config.json; the block length (32) is generate's default.
"""

from __future__ import annotations

import torch
from torch import nn

from dllm_cli.models.base import QwenLayout
from dllm_cli.models.block import BlockDiffusionLM, rope_partial
from dllm_cli.models.config import QwenConfig, model_config, unsupported_basics
from dllm_cli.models.layers import RMSNorm, SwiGLU, attend
from dllm_cli.models.moe import each_expert
from dllm_cli.models.qwen_layers import PreNormLayer


@model_config
class LLaDA2MoeConfig(QwenConfig):
    """LLaDA2's config.json fields; defaults: LLaDA2.0-mini / LLaDA2.1-mini."""

    model_type = "llada2_moe"

    vocab_size: int = 157184
    hidden_size: int = 2048
    intermediate_size: int = 5120
    num_hidden_layers: int = 20
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int | None = 128
    use_qkv_bias: bool = False
    use_qk_norm: bool = True
    use_bias: bool = False
    norm_head: bool = False
    max_position_embeddings: int = 16384
    rope_theta: float = 600000.0
    partial_rotary_factor: float = 0.5
    num_experts: int = 256
    num_shared_experts: int | None = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    moe_intermediate_size: int = 512
    first_k_dense_replace: int = 1
    block_size: int = 32  # not in config.json: generate's block_length
    pad_token_id: int | None = 156892
    eos_token_id: int | None = 156892

    def unsupported(self) -> str | None:
        """Why this config cannot run here, or None."""
        if basics := unsupported_basics(self):
            return basics
        if self.norm_head:
            return "norm_head (not in the released inference code)"
        if self.num_experts % self.n_group or self.num_experts // self.n_group < 2:
            return "num_experts must split into n_group groups of at least 2"
        if self.topk_group * (self.num_experts // self.n_group) < self.num_experts_per_tok:
            return "topk_group groups hold fewer experts than num_experts_per_tok"
        return None


class LLaDA2Gate(nn.Module):
    """The sigmoid, group-limited router (`mlp.gate.weight`, `mlp.gate.expert_bias`)."""

    def __init__(self, cfg: LLaDA2MoeConfig):
        super().__init__()
        self.k, self.groups, self.keep = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.scale = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts))

    def forward(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, d) -> experts (N, k) and float32 weights (N, k)."""
        scores = torch.sigmoid(flat.float() @ self.weight.float().T)  # (N, E)
        biased = scores + self.expert_bias.float()  # the bias steers selection only
        n = scores.shape[0]
        groups = biased.view(n, self.groups, -1).topk(2, dim=-1).values.sum(dim=-1)  # (N, G)
        kept = torch.zeros_like(groups).scatter_(
            1, groups.topk(self.keep, dim=-1, sorted=False).indices, 1.0
        )
        allowed = kept.bool()[:, :, None].expand(-1, -1, biased.shape[1] // self.groups)
        experts = biased.masked_fill(~allowed.reshape(n, -1), float("-inf")).topk(self.k).indices
        w = scores.gather(1, experts)
        if self.k > 1:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, w * self.scale


class LLaDA2MoE(nn.Module):
    """Router + experts (each run once on its tokens, grouped by one sort) + shared experts."""

    def __init__(self, cfg: LLaDA2MoeConfig):
        super().__init__()
        d, ffn = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = LLaDA2Gate(cfg)
        self.experts = nn.ModuleList(SwiGLU(d, ffn) for _ in range(cfg.num_experts))
        shared = cfg.num_shared_experts
        self.shared_experts = SwiGLU(d, ffn * shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, d)
        experts, w = self.gate(flat)  # (N, k) each
        k = experts.shape[1]
        back = self.routed(flat, experts)  # (N k, d) in (token, choice) order
        y = (back.view(-1, k, shape[-1]).float() * w[..., None]).sum(dim=1).to(x.dtype)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        return y.view(shape)

    def routed(self, flat: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """(N k, d): each (token, choice) pair's expert output, every expert run once on its
        rows (grouped by the reference's unstable sort)."""
        k = experts.shape[1]
        order = experts.reshape(-1).argsort()
        rows = flat[order // k]  # (N k, d), grouped by expert
        counts = torch.bincount(experts.reshape(-1), minlength=len(self.experts)).tolist()
        outs = each_expert(list(self.experts), rows, counts)
        back = torch.empty_like(outs)
        back[order] = outs
        return back


class LLaDA2Attention(nn.Module):
    def __init__(self, cfg: LLaDA2MoeConfig):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        width = (self.n_heads + 2 * self.n_kv) * hd
        self.query_key_value = nn.Linear(d, width, bias=cfg.use_qkv_bias)
        self.dense = nn.Linear(self.n_heads * hd, d, bias=cfg.use_bias)
        self.query_layernorm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.use_qk_norm else None
        self.key_layernorm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.use_qk_norm else None

    def forward(self, x, rope, **where) -> torch.Tensor:
        b, t, _ = x.shape
        heads = self.query_key_value(x).view(b, t, self.n_heads + 2 * self.n_kv, -1)
        q, k, v = (h.transpose(1, 2) for h in heads.split([self.n_heads, self.n_kv, self.n_kv], 2))
        if self.query_layernorm is not None:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        q, k = rope_partial(q, rope), rope_partial(k, rope)
        return self.dense(attend(q, k, v, **where))


def llada2_layer(cfg: LLaDA2MoeConfig, index: int) -> PreNormLayer:
    """The first `first_k_dense_replace` layers with a dense SwiGLU MLP, the others a MoE."""
    d = cfg.hidden_size
    attention = LLaDA2Attention(cfg)
    dense = index < cfg.first_k_dense_replace or not cfg.num_experts
    mlp = SwiGLU(d, cfg.intermediate_size) if dense else LLaDA2MoE(cfg)
    return PreNormLayer(d, cfg.rms_norm_eps, attention, mlp, "attention")


class LLaDA2MoeModelLM(QwenLayout, BlockDiffusionLM):
    """LLaDA2.x mask predictor; logits at column i predict the token at column i."""

    config_class = LLaDA2MoeConfig
    layer = staticmethod(llada2_layer)
    family = "llada2"  # families.py key
    embeddings_name = "word_embeddings"

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, LLaDA2Gate):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.expert_bias)

    @property
    def rope_dim(self) -> int:
        return int(self.config.head_dim * self.config.partial_rotary_factor)
