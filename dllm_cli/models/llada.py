"""LLaDA (model_type "llada"): exact HF parameter names, so real LLaDA-8B folders load unchanged.

Architecture per LLaDA's released modeling code (OLMo "llama" block): pre-norm attention and a
SwiGLU MLP whose gated branch is `ff_proj`; RoPE rotated in float32; fully bidirectional.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dllm_cli.models.base import DiffusionLM
from dllm_cli.models.config import ModelConfig, model_config
from dllm_cli.models.fused import Fusion
from dllm_cli.models.layers import RMSNorm, attend_qkv, residual, swiglu


@model_config
class LLaDAConfig(ModelConfig):
    """LLaDA's config.json fields (OLMo ModelConfig names); unused training fields pass through."""

    model_type = "llada"

    d_model: int = 4096
    n_heads: int = 32
    n_kv_heads: int | None = None
    n_layers: int = 32
    mlp_ratio: int = 4
    mlp_hidden_size: int | None = None
    activation_type: str = "silu"
    block_type: str = "llama"
    alibi: bool = False
    rope: bool = True
    rope_full_precision: bool = True
    rope_theta: float = 500000.0
    layer_norm_type: str = "rms"
    layer_norm_with_affine: bool = True
    rms_norm_eps: float = 1e-5
    max_sequence_length: int = 4096
    include_bias: bool = False
    include_qkv_bias: bool | None = False
    scale_logits: bool = False
    input_emb_norm: bool = False
    vocab_size: int = 126464
    embedding_size: int | None = 126464
    weight_tying: bool = False
    tie_word_embeddings: bool = False
    mask_token_id: int | None = 126336
    eos_token_id: int | None = 126081
    pad_token_id: int | None = 126081
    bos_token_id: int | None = None

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_size(self) -> int:
        return self.mlp_hidden_size or self.mlp_ratio * self.d_model

    @property
    def table_size(self) -> int:
        return self.embedding_size or self.vocab_size

    def unsupported(self) -> str | None:
        """Why this config cannot run here, or None (we implement the LLaDA-8B variant)."""
        if self.block_type != "llama":
            return f"block_type {self.block_type!r} (only 'llama' is implemented)"
        if self.activation_type not in ("silu", "swiglu"):
            return f"activation_type {self.activation_type!r}"
        if self.alibi or not self.rope:
            return "ALiBi / no RoPE"
        if self.layer_norm_type != "rms":
            return f"layer_norm_type {self.layer_norm_type!r} (only 'rms')"
        if self.d_model % self.n_heads or self.n_heads % self.kv_heads:
            return "d_model / n_heads / n_kv_heads do not divide"
        return None


class LLaDABlock(nn.Module):
    """One "llama" block: x + attn_out(attn(attn_norm(x))), then + ff_out(silu(ff_proj) * up)."""

    def __init__(self, cfg: LLaDAConfig):
        super().__init__()
        d, hd, kv = cfg.d_model, cfg.head_dim, cfg.kv_heads
        qkv_bias = bool(cfg.include_bias or cfg.include_qkv_bias)
        self.n_heads, self.n_kv = cfg.n_heads, kv
        self.full_precision_rope = cfg.rope_full_precision
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.layer_norm_with_affine)
        self.ff_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.layer_norm_with_affine)
        self.q_proj = nn.Linear(d, d, bias=qkv_bias)
        self.k_proj = nn.Linear(d, kv * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(d, kv * hd, bias=qkv_bias)
        self.attn_out = nn.Linear(d, d, bias=cfg.include_bias)
        self.ff_proj = nn.Linear(d, cfg.ffn_size, bias=cfg.include_bias)
        self.up_proj = nn.Linear(d, cfg.ffn_size, bias=cfg.include_bias)
        self.ff_out = nn.Linear(cfg.ffn_size, d, bias=cfg.include_bias)
        self.fusion: Fusion | None = None  # after fuse()

    def fuse(self) -> None:
        """One GEMM for q/k/v and one for ff_proj/up_proj, on views of the same weights."""
        self.fusion = Fusion(
            qkv=(self.q_proj, self.k_proj, self.v_proj),
            gate_up=(self.ff_proj, self.up_proj),
            out=(self.attn_out,),
            down=(self.ff_out,),
        )

    def forward(self, x, rope, *, cache, layer, columns, key_mask):
        f = self.fusion
        f = f if f is not None and f.intact() else None
        # The norms' forward is called directly: nothing hooks them, and a module call
        # costs its hook checks at every layer of every step (and read from `_modules`: a
        # Module.__getattr__ call per read, the price of a small op at d_model 64).
        norms = self._modules
        n = norms["attn_norm"].forward(x)
        if f is not None:
            qkv = f.qkv(n)  # (B, T, (H + 2 H_kv) D)
        else:
            qkv = torch.cat([self.q_proj(n), self.k_proj(n), self.v_proj(n)], dim=-1)
        fp = self.full_precision_rope
        a = attend_qkv(qkv, self.n_heads, self.n_kv, rope, fp, cache, layer, columns, key_mask)
        x = residual(x, f.out(a) if f is not None else self.attn_out(a))
        n = norms["ff_norm"].forward(x)
        if f is not None:
            gate, up = f.gate_up(n).chunk(2, dim=-1)
            return residual(x, f.down(swiglu(gate, up)))
        return residual(x, self.ff_out(swiglu(self.ff_proj(n), self.up_proj(n))))


class LLaDATransformer(nn.Module):
    """Holds the `transformer.*` submodules under their checkpoint names."""

    def __init__(self, cfg: LLaDAConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.table_size, cfg.d_model)
        self.blocks = nn.ModuleList(LLaDABlock(cfg) for _ in range(cfg.n_layers))
        self.ln_f = RMSNorm(cfg.d_model, cfg.rms_norm_eps, cfg.layer_norm_with_affine)
        if not cfg.weight_tying:
            self.ff_out = nn.Linear(cfg.d_model, cfg.table_size, bias=cfg.include_bias)


class LLaDAModelLM(DiffusionLM):
    """LLaDA mask predictor; logits at column i predict the token at column i."""

    config_class = LLaDAConfig

    logit_shift = 0
    family = "llada"  # families.py key

    def __init__(self, config: LLaDAConfig):
        super().__init__(config)
        self.model = nn.Module()  # the `model.` level of LLaDA's state dict
        self.model.transformer = LLaDATransformer(config)
        self.post_init()

    def embed(self, input_ids):
        h = self.parts()["wte"].forward(input_ids)  # (no hooks: as the norms)
        if self.config.input_emb_norm:
            h = h * (self.config.d_model**0.5)
        return h

    def parts(self) -> dict[str, nn.Module]:
        """The transformer's submodules by name (read each step: dict reads, not getattrs)."""
        return self._modules["model"]._modules["transformer"]._modules

    def blocks(self):
        return self.parts()["blocks"]

    def head(self, h):
        t = self.parts()
        h = t["ln_f"].forward(h)
        if self.config.weight_tying:
            logits = F.linear(h, t["wte"].weight)
        else:
            logits = t["ff_out"].forward(h)
        if self.config.scale_logits:
            logits = logits * (1.0 / self.config.d_model**0.5)
        return logits

    def output_linear(self):
        head = None if self.config.weight_tying else self.model.transformer.ff_out
        return head if type(head) is nn.Linear else None

    def kv_shape(self):
        c = self.config
        return c.n_layers, c.kv_heads, c.head_dim

    def rope_dtype(self, dtype):
        return torch.float32 if self.config.rope_full_precision else dtype

    @property
    def context_length(self):
        return self.config.max_sequence_length

    def get_input_embeddings(self):
        return self.model.transformer.wte
