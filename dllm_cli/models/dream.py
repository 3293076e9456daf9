"""Dream (model_type "Dream"): Qwen2 names and layout, q/k/v biases, grouped-query attention.

Dream is a Qwen2.5 network trained as a mask predictor with a one-position logit shift: the
output at column i predicts column i + 1 (`logit_shift = 1`); the decoder turns that into
per-column predictions for every cache policy.
"""

from __future__ import annotations

from dllm_cli.models.base import DiffusionLM, QwenLayout
from dllm_cli.models.config import QwenConfig, model_config, unsupported_basics
from dllm_cli.models.layers import SwiGLU
from dllm_cli.models.qwen_layers import QwenAttention, QwenLayer

# Dream's generation code refuses prompt + output beyond this many tokens.
DREAM_CONTEXT = 2048


@model_config
class DreamConfig(QwenConfig):
    """Dream's config.json fields (Qwen2 names plus mask_token_id)."""

    model_type = "Dream"

    vocab_size: int = 152064
    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int | None = 4
    max_position_embeddings: int = 131072
    rope_theta: float = 1000000.0
    mask_token_id: int | None = 151666
    pad_token_id: int | None = 151643
    eos_token_id: int | None = 151643
    bos_token_id: int | None = 151665

    def unsupported(self) -> str | None:
        """Why this config cannot run here, or None."""
        if basics := unsupported_basics(self):
            return basics
        if self.hidden_size % self.num_attention_heads:
            return "hidden_size does not divide by num_attention_heads"
        return None


def dream_layer(cfg: DreamConfig, _index: int) -> QwenLayer:
    """Qwen2's layer: biased q/k/v, an unbiased output projection, a SwiGLU MLP."""
    d, heads, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    attention = QwenAttention(d, heads, kv, cfg.head_dim, qkv_bias=True, out_bias=False)
    return QwenLayer(d, cfg.rms_norm_eps, attention, SwiGLU(d, cfg.intermediate_size))


class DreamModel(QwenLayout, DiffusionLM):
    """Dream mask predictor; raw logits at column i predict column i + 1."""

    config_class = DreamConfig
    layer = staticmethod(dream_layer)

    logit_shift = 1
    family = "dream"  # families.py key

    @property
    def context_length(self):
        return min(self.config.max_position_embeddings, DREAM_CONTEXT)
