"""LLaDA-MoE (inclusionAI/LLaDA-MoE-7B-A1B): an OLMoE-style mask predictor, its HF names kept.

Per the released modeling code (`modeling_lladamoe.py`; read in inclusionAI/dInfer
tools/modeling_fused_lladamoe.py and ZHZisZZ/dllm's copy): split q/k/v/o projections, q/k head
norms before RoPE, fully bidirectional; a sparse MoE FFN whose float32 softmax router's top-k
weights are used as they are (the reference hard-codes `norm_topk_prob = False` whatever
config.json says), plus a shared expert when sized (docs/profiles.md). No logit shift.

config.json says `model_type "llada"` like dense LLaDA-8B; families.py tells them apart by
`architectures ["LLaDAMoEModelLM"]`. The mask id (156895) is not in config.json: it comes from
the tokenizer's `<|mask|>` or the family table.
"""

from __future__ import annotations

from dllm_cli.models.base import DiffusionLM, QwenLayout
from dllm_cli.models.config import QwenConfig, model_config, unsupported_basics
from dllm_cli.models.layers import SwiGLU
from dllm_cli.models.moe import LLaDAMoESparseBlock
from dllm_cli.models.qwen_layers import QwenAttention, QwenLayer


@model_config
class LLaDAMoEConfig(QwenConfig):
    """LLaDA-MoE's config.json fields (the reference's `LLaDAConfig`); defaults: 7B-A1B."""

    model_type = "llada"

    vocab_size: int = 157184
    hidden_size: int = 2048
    dense_intermediate_size: int = 8192
    expert_intermediate_size: int = 1024
    shared_expert_intermediate_size: int | None = None
    num_hidden_layers: int = 16
    num_attention_heads: int = 16
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    rope_theta: float = 50000.0
    partial_rotary_factor: float = 1.0
    attention_bias: bool = False
    clip_qkv: float | None = None
    num_experts: int = 64
    num_experts_per_tok: int = 8
    norm_topk_prob: bool | None = None  # read, never used: the reference ignores it too
    qk_layernorm: bool = True
    moe_layer_freq: list[int] | None = None  # 1: MoE layer, 0: dense (None: all MoE)
    moe_router_enable_expert_bias: bool | None = False
    moe_router_score_function: str | None = "softmax"
    routed_scaling_factor: float = 1.0
    router_num_group: int | None = None
    router_topk_group: int | None = None
    mask_token_id: int | None = None
    pad_token_id: int | None = 156892
    eos_token_id: int | None = 156892
    bos_token_id: int | None = None

    def __post_init__(self, rope_scaling: dict | None) -> None:
        super().__post_init__(rope_scaling)
        if self.moe_layer_freq is None:
            self.moe_layer_freq = [1] * self.num_hidden_layers
        self.moe_router_enable_expert_bias = bool(self.moe_router_enable_expert_bias)

    def unsupported(self) -> str | None:
        """Why this config cannot run here, or None (what the reference would do otherwise)."""
        sizes = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
        sizes += ("num_experts", "num_experts_per_tok", "expert_intermediate_size")
        unset = [name for name in sizes if getattr(self, name) <= 0]
        if unset:
            return f"{unset[0]} is not set (the reference's -1 placeholder)"
        if basics := unsupported_basics(self):
            return basics
        if self.partial_rotary_factor != 1:
            return f"partial_rotary_factor {self.partial_rotary_factor} (only full RoPE)"
        if self.hidden_size % self.num_attention_heads:
            return "hidden_size does not divide by num_attention_heads"
        if self.num_experts_per_tok > self.num_experts:
            return "num_experts_per_tok exceeds num_experts"
        if len(self.moe_layer_freq) != self.num_hidden_layers:
            return "moe_layer_freq does not name every layer"
        if self.moe_router_score_function not in (None, "softmax"):
            return f"moe_router_score_function {self.moe_router_score_function!r} (softmax only)"
        if self.routed_scaling_factor != 1:  # the reference never applies it: refuse, not guess
            return f"routed_scaling_factor {self.routed_scaling_factor} (the reference ignores it)"
        if self.router_num_group not in (None, -2, 0, 1):
            return f"router_num_group {self.router_num_group} (no group-limited routing)"
        return None


def llada_moe_layer(cfg: LLaDAMoEConfig, index: int) -> QwenLayer:
    """A sparse MoE layer (plus the shared expert when sized), dense where moe_layer_freq is 0."""
    d, heads, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    bias, eps = cfg.attention_bias, cfg.rms_norm_eps
    attention = QwenAttention(
        d,
        heads,
        kv,
        cfg.head_dim,
        qkv_bias=bias,
        out_bias=bias,
        qk_norm_eps=eps if cfg.qk_layernorm else None,
        clip=cfg.clip_qkv,
    )
    if cfg.moe_layer_freq[index] == 0:
        return QwenLayer(d, eps, attention, SwiGLU(d, cfg.dense_intermediate_size))
    sparse = LLaDAMoESparseBlock(
        d,
        cfg.num_experts,
        cfg.num_experts_per_tok,
        cfg.expert_intermediate_size,
        cfg.moe_router_enable_expert_bias,
    )
    shared = cfg.shared_expert_intermediate_size
    return QwenLayer(d, eps, attention, sparse, SwiGLU(d, shared) if shared else None)


class LLaDAMoEModelLM(QwenLayout, DiffusionLM):
    """LLaDA-MoE mask predictor; logits at column i predict the token at column i."""

    config_class = LLaDAMoEConfig
    layer = staticmethod(llada_moe_layer)
    family = "llada_moe"  # families.py key

    def fuse_projections(self) -> None:
        """Fuse q/k/v and gate/up where it pays (base class); always stack the experts."""
        super().fuse_projections()
        for layer in self.model.layers:
            if isinstance(layer.mlp, LLaDAMoESparseBlock):
                layer.mlp.stack_experts()
