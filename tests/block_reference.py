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


def sample(logits, temperature, mask_id, vocab, top_k=None, top_p=None, generator=None):
    """x0 and its probability; T = 0 argmax (the greedy patch), else SDAR's / LLaDA2's
    sampling: logits / T, top-k, then top-p, softmax, one torch.multinomial draw."""
    logits = logits.float().clone()
    logits[..., vocab:] = float("-inf")
    logits[..., mask_id] = float("-inf")
    if temperature == 0:
        probs = logits.softmax(-1)
        x0 = probs.argmax(-1)
        return x0, probs.gather(-1, x0[..., None])[..., 0]
    flat = logits.view(-1, logits.shape[-1]) / temperature
    if top_k:  # SDAR top_k_logits
        kth = flat.topk(min(top_k, flat.shape[-1]), dim=-1).values[..., -1:]
        flat = flat.masked_fill(flat < kth, float("-inf"))
    if top_p is not None and top_p < 1:  # SDAR top_p_logits (the crossing token kept)
        ordered, order = flat.sort(dim=-1, descending=True)
        drop = ordered.softmax(dim=-1).cumsum(dim=-1) > top_p
        drop[..., 1:] = drop[..., :-1].clone()
        drop[..., 0] = False
        flat = flat.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = flat.softmax(dim=-1)
    x0 = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
    return x0.view(logits.shape[:-1]), probs.gather(-1, x0).view(logits.shape[:-1])


def num_transfer_tokens(block_length, steps):
    base, rem = divmod(block_length, steps)
    n = torch.zeros(steps, dtype=torch.int64) + base
    n[:rem] += 1
    return n


@torch.no_grad()
def sdar_generate(t, cfg, prompt, mask_id, vocab, gen_length, block_length, steps,
                  threshold, strategy="low_confidence_dynamic", stop=None,
                  logp=None):  # fmt: skip
    """SDAR's block_diffusion_generate for one prompt: the whole x (prompt, answer, tail).
    `logp` (a dict, not the reference's): each committed column's log-probability under the
    step that committed it."""
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
            if logp is not None:
                logp.update({lo + int(j): float(p[j].log()) for j in transfer.nonzero()[:, 0]})
        x[lo:hi] = cur
        if stop is not None and any(s in x[p_len:] for s in stop):
            break
    return x


def llada2_moe(t, p, cfg, x):
    """LLaDA2MoeSparseMoeBlock: sigmoid gate, group-limited top-k, moe_infer, shared experts."""
    flat = x.reshape(-1, x.shape[-1])
    logits = flat.float() @ t[p + "gate.weight"].float().T
    scores = torch.sigmoid(logits)
    routing = scores + t[p + "gate.expert_bias"]
    n, groups = flat.shape[0], cfg["n_group"]
    group_scores = routing.view(n, groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=cfg["topk_group"], dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    size = cfg["num_experts"] // groups
    score_mask = group_mask.unsqueeze(-1).expand(n, groups, size).reshape(n, -1)
    masked = routing.masked_fill(~score_mask.bool(), float("-inf"))
    _, idx = torch.topk(masked, k=cfg["num_experts_per_tok"], dim=-1)
    w = scores.gather(1, idx)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * cfg["routed_scaling_factor"]

    def mlp(q, h):
        return (F.silu(h @ t[q + "gate_proj.weight"].T) * (h @ t[q + "up_proj.weight"].T)) @ t[
            q + "down_proj.weight"
        ].T

    y = torch.zeros_like(flat)
    for j in range(idx.shape[1]):  # every (token, choice), weighted in float32
        for e in idx[:, j].unique().tolist():
            rows = idx[:, j] == e
            y[rows] += (mlp(f"{p}experts.{e}.", flat[rows]).float() * w[rows, j, None]).to(y.dtype)
    return (y + mlp(p + "shared_experts.", flat)).view(x.shape)


def llada2_forward(t, cfg, ids, mask):
    """LLaDA2MoeModelLM's logits (1, T, V) for the window `ids` under the (T, T) bool mask
    (the fixed copies' `.log()` mask: 0 where allowed, -inf elsewhere)."""
    hd, eps, h_n, kv_n = (
        cfg["head_dim"],
        cfg["rms_norm_eps"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
    )
    n = len(ids)
    h = t["model.word_embeddings.weight"][ids][None]
    cos, sin = rope(torch.arange(n), int(hd * cfg["partial_rotary_factor"]), cfg["rope_theta"])
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms(h, t[p + "input_layernorm.weight"], eps)
        qkv = (x @ t[p + "attention.query_key_value.weight"].T).view(1, n, h_n + 2 * kv_n, hd)
        q, k, v = (a.transpose(1, 2) for a in qkv.split([h_n, kv_n, kv_n], dim=-2))
        q = rotate(rms(q, t[p + "attention.query_layernorm.weight"], eps), cos, sin)
        k = rotate(rms(k, t[p + "attention.key_layernorm.weight"], eps), cos, sin)
        h = h + eager(q, k, v, mask, hd**-0.5) @ t[p + "attention.dense.weight"].T
        x = rms(h, t[p + "post_attention_layernorm.weight"], eps)
        if i < cfg["first_k_dense_replace"]:
            g, u = x @ t[p + "mlp.gate_proj.weight"].T, x @ t[p + "mlp.up_proj.weight"].T
            h = h + (F.silu(g) * u) @ t[p + "mlp.down_proj.weight"].T
        else:
            h = h + llada2_moe(t, p + "mlp.", cfg, x)
    return rms(h, t["model.norm.weight"], eps) @ t["lm_head.weight"].T


@torch.no_grad()
def llada21_generate(t, cfg, prompt, mask_id, vocab, gen_length, block_length, threshold,
                     editing_threshold, max_post_steps, eos_id, eos_early_stop=False):  # fmt: skip
    """LLaDA2.1's generate (JointThreshold M2T + T2T), num_to_transfer 1, temperature 0; with
    `editing_threshold=None` it is LLaDA2.0's generate at steps = block_length (one token a
    step at least), which the same loop reduces to when nothing is ever edited."""
    p_len = len(prompt)
    num_blocks = (p_len + gen_length + block_length - 1) // block_length
    total = num_blocks * block_length
    blocks = torch.tril(torch.ones(num_blocks, num_blocks)).bool()
    full_mask = blocks.repeat_interleave(block_length, 0).repeat_interleave(block_length, 1)
    x = torch.full((total,), mask_id, dtype=torch.long)
    x[:p_len] = torch.tensor(prompt)
    for nb in range(p_len // block_length, num_blocks):
        end = (nb + 1) * block_length
        cur = x[:end]
        start = nb * block_length
        post = 0
        while True:
            old = cur[-block_length:].clone()
            active = cur[-block_length:] == mask_id
            if not active.any():
                post += 1
            if post > max_post_steps:
                break
            in_prompt = torch.zeros(block_length, dtype=torch.bool)
            if start < p_len:
                in_prompt[: min(p_len - start, block_length)] = True
            logits = llada2_forward(t, cfg, cur, full_mask[:end, :end])[0, -block_length:]
            x0, p = sample(logits, 0, mask_id, vocab)
            fill = torch.zeros_like(active)
            if active.sum() > 0:
                conf = torch.where(active, p, -torch.inf)
                high = (conf > threshold) & active
                if high.sum() >= 1:
                    fill = high
                else:
                    fill[torch.topk(conf, k=1).indices] = True
            edit = torch.zeros_like(active)
            if editing_threshold is not None:
                edit = ~active & ~in_prompt & (p > editing_threshold) & (x0 != old)
            both = fill | edit
            cur[-block_length:][both] = x0[both]
            if not active.any() and not edit.any():
                break
        if eos_early_stop:
            part = x[p_len:end]
            if (part == mask_id).sum() == 0 and (part == eos_id).any():
                break
    return x


@torch.no_grad()
def llada20_generate(t, cfg, prompt, mask_id, vocab, gen_length, block_length, steps, threshold):
    """LLaDA2.0's generate at temperature 0: `steps` per block, step i commits the masks above
    `threshold` when at least `_get_num_transfer_tokens(block_length, steps)[i]` pass, else
    that many of the most confident (no cache: the window is recomputed every step)."""
    steps = min(steps, gen_length)  # minimal_topk 1
    p_len = len(prompt)
    num_blocks = (p_len + gen_length + block_length - 1) // block_length
    blocks = torch.tril(torch.ones(num_blocks, num_blocks)).bool()
    full_mask = blocks.repeat_interleave(block_length, 0).repeat_interleave(block_length, 1)
    x = torch.full((num_blocks * block_length,), mask_id, dtype=torch.long)
    x[:p_len] = torch.tensor(prompt)
    schedule = num_transfer_tokens(block_length, steps)
    for nb in range(p_len // block_length, num_blocks):
        end = (nb + 1) * block_length
        cur = x[:end]
        for step in range(steps):
            active = cur[-block_length:] == mask_id
            if active.sum() == 0:
                break
            logits = llada2_forward(t, cfg, cur, full_mask[:end, :end])[0, -block_length:]
            x0, p = sample(logits, 0, mask_id, vocab)
            k = int(schedule[step])
            conf = torch.where(active, p, -torch.inf)
            high = conf > threshold
            transfer = torch.zeros_like(active)
            if high.sum() >= k:
                transfer = high
            else:
                transfer[torch.topk(conf, k=min(k, int(active.sum()))).indices] = True
            cur[-block_length:][transfer] = x0[transfer]
    return x
