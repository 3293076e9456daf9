"""Dream (model_type "Dream"): Qwen2 names and layout, q/k/v biases, grouped-query attention.

Dream is a Qwen2.5 network trained as a mask predictor with a one-position logit shift: the
output at column i predicts column i + 1 (`logit_shift = 1`); the decoder turns that into
per-column predictions for every cache policy.
"""

from __future__ import annotations

from dataclasses import InitVar

import torch
from torch import nn

from dllm_cli.models.base import DiffusionLM, QwenLayout, output_head, qwen_backbone
from dllm_cli.models.config import ModelConfig, model_config, unsupported_basics
from dllm_cli.models.fused import Fusion
from dllm_cli.models.layers import RMSNorm, SwiGLU, attend, residual, rotated_qkv

# Dream's generation code refuses prompt + output beyond this many tokens.
DREAM_CONTEXT = 2048


@model_config
class DreamConfig(ModelConfig):
    """Dream's config.json fields (Qwen2 names plus mask_token_id)."""

    model_type = "Dream"

    vocab_size: int = 152064
    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int | None = 4
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    rope_scaling: InitVar[dict | None] = None
    tie_word_embeddings: bool = False
    mask_token_id: int | None = 151666
    pad_token_id: int | None = 151643
    eos_token_id: int | None = 151643
    bos_token_id: int | None = 151665

    def __post_init__(self, rope_scaling: dict | None) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.rope_parameters = rope_scaling  # transformers 5 name for rope_scaling

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def unsupported(self) -> str | None:
        """Why this config cannot run here, or None."""
        if basics := unsupported_basics(self):
            return basics
        if self.hidden_size % self.num_attention_heads:
            return "hidden_size does not divide by num_attention_heads"
        return None


class DreamAttention(nn.Module):
    def __init__(self, cfg: DreamConfig):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=True)
        self.k_proj = nn.Linear(d, self.n_kv * hd, bias=True)
        self.v_proj = nn.Linear(d, self.n_kv * hd, bias=True)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)
        self.fusion: Fusion | None = None  # after fuse()

    def fuse(self) -> None:
        self.fusion = Fusion(qkv=(self.q_proj, self.k_proj, self.v_proj), out=(self.o_proj,))

    def forward(self, x, rope, *, cache, layer, columns, key_mask):
        f = self.fusion if self.fusion is not None and self.fusion.intact() else None
        if f is not None:
            qkv = f.qkv(x)  # (B, T, (H + 2 H_kv) D)
        else:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        q, k, v = rotated_qkv(qkv, self.n_heads, self.n_kv, rope, full_precision=False)
        a = attend(
            q,
            k,
            v,
            None,  # already rotated
            full_precision_rope=False,
            cache=cache,
            layer=layer,
            columns=columns,
            key_mask=key_mask,
        )
        return f.out(a) if f is not None else self.o_proj(a)


class DreamLayer(nn.Module):
    def __init__(self, cfg: DreamConfig):
        super().__init__()
        self.self_attn = DreamAttention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def fuse(self) -> None:
        self.self_attn.fuse()
        self.mlp.fuse()

    def forward(self, x, rope, **kw):
        x = residual(x, self.self_attn(self.input_layernorm(x), rope, **kw))
        return residual(x, self.mlp(self.post_attention_layernorm(x)))


class DreamModel(QwenLayout, DiffusionLM):
    """Dream mask predictor; raw logits at column i predict column i + 1."""

    config_class = DreamConfig

    logit_shift = 1
    family = "dream"  # families.py key

    def __init__(self, config: DreamConfig):
        super().__init__(config)
        self.model = qwen_backbone(config, lambda i: DreamLayer(config))
        self.lm_head = output_head(self.model.embed_tokens, config.tie_word_embeddings)
        self.post_init()

    def rope_dtype(self, dtype):
        return dtype  # Qwen2 rotates in the model dtype

    @property
    def context_length(self):
        return min(self.config.max_position_embeddings, DREAM_CONTEXT)
