"""Independent transcriptions of the block-causal references, from a folder's raw tensors.

`sdar_forward` follows SDAR's modeling_sdar.py (Qwen3 layers, eager attention over a list
cache that `store` appends to, as its DynamicCache with store_kv); `sdar_generate` follows
JetAstra/SDAR generate.py `block_diffusion_generate` line by line, with the deviations the
engine shares (docs/block-diffusion.md): temperature 0 is argmax (diffusers' greedy branch;
the reference has none), [MASK] and padding rows are never drafted, and top-k is capped at
the masks left (diffusers' fix of the uncapped `torch.topk`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms(x, w, eps):
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate(x, cos, sin):
    n = cos.shape[-1]
    r, rest = x[..., :n], x[..., n:]
    half = torch.cat((-r[..., n // 2 :], r[..., : n // 2]), dim=-1)
    return torch.cat([r * cos + half * sin, rest], dim=-1)


def rope(positions, dim, theta):
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    f = positions.float()[:, None] * inv[None]
    emb = torch.cat((f, f), dim=-1)
    return emb.cos()[None, None], emb.sin()[None, None]  # (1, 1, T, dim)


def eager(q, k, v, mask, scale):
    """q (1, H, T, D), k/v (1, Hkv, S, D), mask (T, S) bool."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    w = (q @ k.transpose(2, 3)) * scale
    w = w.masked_fill(~mask, float("-inf")).softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    return (w @ v).transpose(1, 2).reshape(1, q.shape[2], -1)


def sdar_forward(t, cfg, ids, positions, mask, cache, store):
    """Logits (1, T, V); `cache` a list of per-layer [k, v] (appended to when `store`)."""
    hd, eps = cfg["head_dim"], cfg["rms_norm_eps"]
    h = t["model.embed_tokens.weight"][ids]
    cos, sin = rope(positions, hd, cfg["rope_theta"])
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms(h, t[p + "input_layernorm.weight"], eps)
        q = (x @ t[p + "self_attn.q_proj.weight"].T).view(1, len(positions), -1, hd)
        k = (x @ t[p + "self_attn.k_proj.weight"].T).view(1, len(positions), -1, hd)
        v = (x @ t[p + "self_attn.v_proj.weight"].T).view(1, len(positions), -1, hd)
        q = rotate(rms(q, t[p + "self_attn.q_norm.weight"], eps).transpose(1, 2), cos, sin)
        k = rotate(rms(k, t[p + "self_attn.k_norm.weight"], eps).transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        if len(cache) > i:
            pk, pv = cache[i]
            if store:
                cache[i] = [torch.cat([pk, k], 2), torch.cat([pv, v], 2)]
            k, v = torch.cat([pk, k], 2), torch.cat([pv, v], 2)
        elif store:
            cache.append([k, v])
        a = eager(q, k, v, mask, hd**-0.5)
        h = h + a @ t[p + "self_attn.o_proj.weight"].T
        x = rms(h, t[p + "post_attention_layernorm.weight"], eps)
        gate, up = x @ t[p + "mlp.gate_proj.weight"].T, x @ t[p + "mlp.up_proj.weight"].T
        h = h + (F.silu(gate) * up) @ t[p + "mlp.down_proj.weight"].T
    return rms(h, t["model.norm.weight"], eps) @ t["lm_head.weight"].T


def sample(logits, temperature, mask_id, vocab):
    """x0 and its probability; T = 0 argmax (the greedy patch), else multinomial at T."""
    logits = logits.float().clone()
    logits[..., vocab:] = float("-inf")
    logits[..., mask_id] = float("-inf")
    if temperature == 0:
        probs = logits.softmax(-1)
        x0 = probs.argmax(-1)
        return x0, probs.gather(-1, x0[..., None])[..., 0]
    raise NotImplementedError("the tests compare greedy decodes")


def num_transfer_tokens(block_length, steps):
    base, rem = divmod(block_length, steps)
    n = torch.zeros(steps, dtype=torch.int64) + base
    n[:rem] += 1
    return n


@torch.no_grad()
def sdar_generate(t, cfg, prompt, mask_id, vocab, gen_length, block_length, steps,
                  threshold, strategy="low_confidence_dynamic", stop=None):  # fmt: skip
    """SDAR's block_diffusion_generate for one prompt: the whole x (prompt, answer, tail)."""
    p_len = len(prompt)
    num_blocks = (p_len + gen_length + block_length - 1) // block_length
    total = num_blocks * block_length
    blocks = torch.tril(torch.ones(num_blocks, num_blocks))
    full_mask = blocks.repeat_interleave(block_length, 0).repeat_interleave(block_length, 1)
    full_mask = full_mask.bool()
    x = torch.full((total,), mask_id, dtype=torch.long)
    x[:p_len] = torch.tensor(prompt)
    cache: list = []
    prefill_blocks = p_len // block_length
    pre = prefill_blocks * block_length
    if pre > 0:
        sdar_forward(t, cfg, x[:pre], torch.arange(pre), full_mask[:pre, :pre], cache, True)
    schedule = num_transfer_tokens(block_length, steps)
    for nb in range(prefill_blocks, num_blocks):
        lo, hi = nb * block_length, (nb + 1) * block_length
        cur = x[lo:hi].clone()
        mask = full_mask[lo:hi, :hi]
        for step in range(steps + 1):
            masked = cur == mask_id
            if masked.sum() == 0:
                sdar_forward(t, cfg, cur, torch.arange(lo, hi), mask, cache, True)
                break
            logits = sdar_forward(t, cfg, cur, torch.arange(lo, hi), mask, cache, False)[0]
            x0, p = sample(logits, 0, mask_id, vocab)
            conf = torch.where(masked, p, -torch.inf)
            k = min(int(schedule[step]), int(masked.sum()))  # capped (diffusers)
            transfer = torch.zeros_like(masked)
            if strategy == "low_confidence_dynamic" and (conf > threshold).sum() >= k:
                transfer = conf > threshold
            else:
                transfer[torch.topk(conf, k).indices] = True
            cur[transfer] = x0[transfer]
        x[lo:hi] = cur
        if stop is not None and any(s in x[p_len:] for s in stop):
            break
    return x
