"""The AR guide as a plain torch module: Llama-layout causal LMs (llama, qwen2, qwen3).

transformers' AutoModelForCausalLM costs `transformers.modeling_utils` at start-up (about 2 s
on one core) for a model of a dozen lines. This one is laid out as theirs
(model.embed_tokens / layers / norm + lm_head), so a folder's safetensors load by name
(models/weights.py), and it takes the call `guide_cache.GuideCache` makes of a transformers
causal LM: a 2-D attention mask over cached + fed slots, explicit positions, a KV cache (ours:
cache.py's `KVCache`, one column per slot, with room for more) and `logits_to_keep`.
Folders this module does not cover (other types, RoPE scalings not written here, sliding
windows) return None from `guide_config` and load through transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dllm_cli.cache import KVCache
from dllm_cli.models.base import Backbone, output_head
from dllm_cli.models.layers import RMSNorm, SwiGLU, apply_rope, sdpa
from dllm_cli.models.qwen_layers import PreNormLayer


@dataclass(frozen=True)
class Variant:
    """What differs between the Llama-layout model types (transformers' defaults where absent);
    not a dllm family (families.py): every one of them is the guide."""

    qkv_bias: bool | None  # None: config.attention_bias decides (q, k, v and o)
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before RoPE
    head_dim: int | None  # None: hidden_size // num_attention_heads


VARIANTS: dict[str, Variant] = {  # config.json's model_type -> its variant
    "llama": Variant(qkv_bias=None, qk_norm=False, head_dim=None),
    "qwen2": Variant(qkv_bias=True, qk_norm=False, head_dim=None),
    "qwen3": Variant(qkv_bias=None, qk_norm=True, head_dim=128),
}


@dataclass(frozen=True)
class GuideConfig:
    """The fields of a config.json the forward needs."""

    variant: Variant
    vocab: int
    hidden: int
    inner: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    attention_bias: bool
    mlp_bias: bool
    tied: bool
    inv_freq: torch.Tensor  # (D/2,) float32


def rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers 5's `rope_parameters`, or the older `rope_theta` + `rope_scaling`."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def default_freq(p: dict, head_dim: int) -> torch.Tensor:
    """1 / theta^(2i/D), float32 as transformers computes it."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (p["rope_theta"] ** steps)


def linear_freq(p: dict, head_dim: int) -> torch.Tensor:
    """Position interpolation (Chen et al. 2023): positions divided by `factor`."""
    return default_freq(p, head_dim) / p["factor"]


def llama3_freq(p: dict, head_dim: int) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths / factor, short kept, smoothed
    in between (Meta's llama-models reference, as transformers computes it)."""
    inv = default_freq(p, head_dim)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


# rope_type -> inverse frequencies; other types (dynamic, yarn, longrope) load via transformers
ROPE_TYPES = {"default": default_freq, "linear": linear_freq, "llama3": llama3_freq}


def guide_config(raw: dict[str, Any]) -> GuideConfig | None:
    """A config.json this module can run, or None (the caller loads it with transformers)."""
    variant = VARIANTS.get(raw.get("model_type", ""))
    rope = rope_parameters(raw)
    if (
        variant is None
        or rope["rope_type"] not in ROPE_TYPES
        or rope.get("partial_rotary_factor", 1.0) != 1.0
        or raw.get("use_sliding_window", False)
        or raw.get("hidden_act", "silu") != "silu"
    ):
        return None
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or variant.head_dim or raw["hidden_size"] // heads
    return GuideConfig(
        variant=variant,
        vocab=raw["vocab_size"],
        hidden=raw["hidden_size"],
        inner=raw["intermediate_size"],
        layers=raw["num_hidden_layers"],
        heads=heads,
        kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        eps=raw.get("rms_norm_eps", 1e-6),
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        tied=bool(raw.get("tie_word_embeddings", False)),
        inv_freq=ROPE_TYPES[rope["rope_type"]](rope, head_dim),
    )


@dataclass
class GuideOutput:
    logits: torch.Tensor  # (B, T', V)
    past_key_values: KVCache  # one column per cached then fed slot

    def get(self, name: str, default=None):
        return getattr(self, name, default)


class Attention(nn.Module):
    def __init__(self, c: GuideConfig):
        super().__init__()
        bias = c.attention_bias if c.variant.qkv_bias is None else c.variant.qkv_bias
        out_bias = c.attention_bias if c.variant.qkv_bias is None else False
        self.heads, self.kv_heads, self.head_dim = c.heads, c.kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden, c.heads * c.head_dim, bias=bias)
        self.k_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=bias)
        self.v_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=bias)
        self.o_proj = nn.Linear(c.heads * c.head_dim, c.hidden, bias=out_bias)
        if c.variant.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.eps)
            self.k_norm = RMSNorm(c.head_dim, c.eps)

    def heads_of(self, proj: nn.Linear, x: torch.Tensor, norm: str | None) -> torch.Tensor:
        """(B, T, C) -> (B, H, T, D), normed per head first where the variant does (Qwen3)."""
        b, t, _ = x.shape
        h = proj(x).view(b, t, -1, self.head_dim)
        if norm is not None and hasattr(self, norm):
            h = getattr(self, norm)(h)
        return h.transpose(1, 2)

    def forward(self, x, rope, mask, kv: KVCache, fed: slice, i: int) -> torch.Tensor:
        cos, sin = rope
        q = apply_rope(self.heads_of(self.q_proj, x, "q_norm"), cos, sin, full_precision=False)
        k = apply_rope(self.heads_of(self.k_proj, x, "k_norm"), cos, sin, full_precision=False)
        k, v = kv.update(i, fed, k, self.heads_of(self.v_proj, x, None))  # (B, H_kv, S + T, D)
        # mask None: a prompt fed alone, causal attention by the kernel's own rule
        return self.o_proj(sdpa(q, k, v, mask, causal=mask is None))


def causal_mask(attention_mask: torch.Tensor | None, past: int, t: int, device) -> torch.Tensor:
    """(B or 1, 1, T, S + T) bool: each fed slot sees the cache slots the attention mask
    allows and the fed slots up to its own."""
    slots = torch.arange(past + t, device=device)
    mask = slots[None] <= (past + torch.arange(t, device=device))[:, None]  # (T, S + T)
    if attention_mask is not None:
        mask = mask[None] & attention_mask.bool()[:, None]  # (B, T, S + T)
    # a query with no key to attend (a padding row in admission) attends to itself, so its
    # K/V in later layers stay finite; no real query ever gives it weight
    own = slots == past + torch.arange(t, device=device)[:, None]  # (T, S + T)
    mask = mask | (own & ~mask.any(dim=-1, keepdim=True))
    return mask[:, None] if mask.dim() == 3 else mask[None, None]


def grow(kv: KVCache, width: int) -> None:
    """Widen `kv` to `width` columns in place, a tensor at a time (one tensor's copy in memory
    at once); the room past a forward's slots spares the next forwards a copy of the cache."""
    for store in (kv.k, kv.v):
        for i, old in enumerate(store):
            store[i] = nn.functional.pad(old, (0, 0, 0, width - old.shape[2]))


def guide_layer(c: GuideConfig) -> PreNormLayer:
    attention = Attention(c)  # built first: the random init's order stays
    return PreNormLayer(
        c.hidden, c.eps, attention, SwiGLU(c.hidden, c.inner, c.mlp_bias), "self_attn"
    )


class CausalLM(nn.Module):
    """A Llama / Qwen2 / Qwen3 causal LM with transformers' parameter names and cache call."""

    def __init__(self, c: GuideConfig):
        super().__init__()
        self.config = c
        self.model = Backbone(c.vocab, c.hidden, c.eps, c.layers, lambda i: guide_layer(c))
        self.lm_head = output_head(self.model.embed_tokens, c.tied)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos/sin (B, 1, T, D) in float32, cast to the model dtype (as transformers does)."""
        inv = self.config.inv_freq.to(positions.device)
        freqs = positions.float()[..., None] * inv  # (B, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, T, D)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        use_cache: bool = True,
        logits_to_keep: int = 0,
    ) -> GuideOutput:
        """Logits of the fed tokens (the last `logits_to_keep` when > 0) on top of the cache.

        attention_mask: (B, S + T) over cached then fed slots, True where a key may be attended,
        causal by slot as transformers builds it; with neither a mask nor a cache SDPA's own
        causal rule runs (no mask tensor: the flash kernel skips the blocks above the diagonal).
        The cache's first S columns are the cached slots (every column without a mask); the fed
        slots' K/V are written after them, the cache grown in place first when it lacks room.
        """
        (b, t), c, device = input_ids.shape, self.config, input_ids.device
        x = self.model.embed_tokens(input_ids)  # (B, T, C)
        kv = past_key_values
        if kv is None:
            kv, past = KVCache.empty(c.layers, b, c.kv_heads, t, c.head_dim, x.dtype, device), 0
        else:  # the mask's cached slots (the cache may hold more columns), else every column
            past = kv.width if attention_mask is None else attention_mask.shape[1] - t
            if kv.width < past + t:  # room for a quarter more
                grow(kv, (past + t) * 5 // 4)
        if position_ids is None:
            position_ids = torch.arange(past, past + t, device=device)[None].expand(b, t)
        alone = attention_mask is None and past == 0
        mask = None if alone else causal_mask(attention_mask, past, t, device)
        rope = self.rope(position_ids, x.dtype)
        view = kv.view(hi=past + t)  # the cached slots', then the fed slots' columns
        for i, layer in enumerate(self.model.layers):
            x = layer(x, rope, mask, view, slice(past, past + t), i)
        x = self.model.norm(x[:, -logits_to_keep:] if logits_to_keep > 0 else x)
        return GuideOutput(logits=self.lm_head(x), past_key_values=kv)
