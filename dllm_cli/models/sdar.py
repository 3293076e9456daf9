"""SDAR (JetAstra/SDAR, arXiv 2510.06303): Qwen3 decoder layers trained block-causally.

Per the released `modeling_sdar.py` (JetAstra/SDAR training/model/SDAR-4B-Chat): Qwen3's
pre-norm layers (q/k head norms before rotate-half RoPE in the model dtype, GQA, SwiGLU) under
Qwen3's names, so real folders load as they are; no logit shift; `block_size` and
`mask_token_id` from config.json.
"""

from __future__ import annotations

from dllm_cli.models.base import QwenLayout
from dllm_cli.models.block import BlockDiffusionLM
from dllm_cli.models.config import QwenConfig, model_config, unsupported_basics
from dllm_cli.models.layers import SwiGLU
from dllm_cli.models.qwen_layers import PreNormLayer, QwenAttention


@model_config
class SDARConfig(QwenConfig):
    """SDAR's config.json fields (the reference's `SDARConfig`); defaults: SDAR-4B-Chat."""

    model_type = "sdar"

    vocab_size: int = 151936
    hidden_size: int = 2560
    intermediate_size: int = 9728
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    max_position_embeddings: int = 32768
    rope_theta: float = 1e6
    attention_bias: bool = False
    use_sliding_window: bool = False
    block_size: int = 4
    mask_token_id: int | None = 151669
    bos_token_id: int | None = 151643
    eos_token_id: int | list | None = 151643
    pad_token_id: int | None = None

    def unsupported(self) -> str | None:
        """Why this config cannot run here, or None."""
        if basics := unsupported_basics(self):
            return basics
        if self.use_sliding_window:
            return "use_sliding_window (the reference decode never uses it)"
        if not isinstance(self.block_size, int) or self.block_size < 1:
            return f"block_size {self.block_size!r}"
        return None


def sdar_layer(cfg: SDARConfig, _index: int) -> PreNormLayer:
    """Qwen3's layer: q/k RMS-normed per head before RoPE (QwenAttention, never fused here)."""
    heads = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    bias, eps = cfg.attention_bias, cfg.rms_norm_eps
    attention = QwenAttention(
        cfg.hidden_size, *heads, qkv_bias=bias, out_bias=bias, qk_norm_eps=eps
    )
    mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
    return PreNormLayer(cfg.hidden_size, cfg.rms_norm_eps, attention, mlp, "self_attn")


class SDARForCausalLM(QwenLayout, BlockDiffusionLM):
    """SDAR mask predictor; logits at column i predict the token at column i."""

    config_class = SDARConfig
    layer = staticmethod(sdar_layer)
    family = "sdar"  # families.py key
