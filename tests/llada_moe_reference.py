"""An independent transcription of LLaDA-MoE's reference forward, for token-identity tests.

Written from the released modeling code (`modeling_lladamoe.py`, as in inclusionAI/dInfer
tools/modeling_fused_lladamoe.py @ fce4e328 and ZHZisZZ/dllm @ ca176752), line by line in
plain torch on the checkpoint's own tensors (nothing from dllm_cli.models): OLMoE RMSNorm
(float32, cast back, then scaled), q/k norm over `reshape(-1, head_dim)` before RoPE, the
rotary embedding's `inv_freq @ positions` in float32 with cos/sin cast to the activations'
dtype, eager attention (matmul / sqrt(D), softmax in float32, no mask), and the sparse MoE
block's loop over experts with `one_hot`, `torch.where` and `index_add_`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class ReferenceLLaDAMoE:
    """`model(x)` -> logits (1, S, V) of LLaDAMoEModelLM for a config.json and its tensors."""

    def __init__(self, cfg: dict, tensors: dict[str, torch.Tensor]):
        self.cfg, self.t = cfg, tensors
        self.vocab_size = cfg["vocab_size"]

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x @ self.t[name].T

    def mlp(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        gate = F.silu(self.linear(x, prefix + "gate_proj.weight"))
        return self.linear(
            gate * self.linear(x, prefix + "up_proj.weight"), prefix + "down_proj.weight"
        )

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype):
        c = self.cfg
        dim = int(c["hidden_size"] // c["num_attention_heads"] * c.get("partial_rotary_factor", 1))
        inv_freq = 1.0 / (
            c["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        )
        freqs = (inv_freq[None, :, None] @ positions[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def attention(self, x: torch.Tensor, p: str, cos, sin) -> torch.Tensor:
        c = self.cfg
        b, q_len, _ = x.shape
        heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        hd = c["hidden_size"] // heads
        eps = c["rms_norm_eps"]
        q = self.linear(x, p + "q_proj.weight")
        k = self.linear(x, p + "k_proj.weight")
        if c["qk_layernorm"]:
            q = rms_norm(q.reshape(-1, hd), self.t[p + "q_norm.weight"], eps).reshape(b, q_len, -1)
            k = rms_norm(k.reshape(-1, hd), self.t[p + "k_norm.weight"], eps).reshape(b, q_len, -1)
        v = self.linear(x, p + "v_proj.weight")
        q = q.view(b, q_len, heads, hd).transpose(1, 2)
        k = k.view(b, q_len, kv_heads, hd).transpose(1, 2)
        v = v.view(b, q_len, kv_heads, hd).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        weights = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(hd)
        weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(weights, v).transpose(1, 2).reshape(b, q_len, -1)
        return self.linear(out, p + "o_proj.weight")

    def moe(self, x: torch.Tensor, p: str) -> torch.Tensor:
        c = self.cfg
        b, s, d = x.shape
        h = x.view(-1, d)
        routing = F.softmax(self.linear(h, p + "mlp.gate.weight"), dim=1, dtype=torch.float)
        if c.get("moe_router_enable_expert_bias"):
            routing = routing + self.t[p + "mlp.expert_bias"]
        routing, selected = torch.topk(routing, c["num_experts_per_tok"], dim=-1)
        routing = routing.to(h.dtype)  # no renormalisation (norm_topk_prob is False in code)
        final = torch.zeros((b * s, d), dtype=h.dtype)
        mask = F.one_hot(selected, num_classes=c["num_experts"]).permute(2, 1, 0)
        for e in range(c["num_experts"]):
            idx, top_x = torch.where(mask[e])
            current = h[None, top_x].reshape(-1, d)
            out = self.mlp(current, f"{p}mlp.experts.{e}.") * routing[top_x, idx, None]
            final.index_add_(0, top_x, out.to(h.dtype))
        return final.reshape(b, s, d)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        eps = c["rms_norm_eps"]
        h = self.t["model.embed_tokens.weight"][input_ids]
        positions = torch.arange(input_ids.shape[1])[None].expand(input_ids.shape[0], -1)
        cos, sin = self.rotary(positions, h.dtype)
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            normed = rms_norm(h, self.t[p + "input_layernorm.weight"], eps)
            h = h + self.attention(normed, p + "self_attn.", cos, sin)
            x = rms_norm(h, self.t[p + "post_attention_layernorm.weight"], eps)
            if c["moe_layer_freq"][i]:
                out = self.moe(x, p)
                if c.get("shared_expert_intermediate_size"):
                    out = out + self.mlp(x, p + "shared_expert.")
            else:
                out = self.mlp(x, p + "mlp.")
            h = h + out
        h = rms_norm(h, self.t["model.norm.weight"], eps)
        return self.linear(h, "lm_head.weight")
