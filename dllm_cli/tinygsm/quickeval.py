"""Cheap held-out accuracy during training (greedy AR; LLaDA-style one-token-per-step diffusion)."""

from __future__ import annotations

import torch

from dllm_cli.tinygsm.batches import Encoder
from dllm_cli.tinygsm.data import is_correct, shots_for, test_split


def _prompts(enc: Encoder, n: int, shots: int) -> tuple[list[list[int]], list[int]]:
    probs = test_split()[:n]
    prompts = [enc.prompt(p.question, shots_for(i, shots)) for i, p in enumerate(probs)]
    return prompts, [p.answer for p in probs]


def _text(enc: Encoder, ids: list[int]) -> str:
    stops = {enc.ids.eos, enc.ids.eot}
    cut = next((i for i, t in enumerate(ids) if t in stops), len(ids))
    return enc.tok.decode(ids[:cut], skip_special_tokens=True)


def eval_ar(model, enc: Encoder, n: int, shots: int = 0, max_new: int = 48) -> float:
    """Greedy decoding with the causal LM, left-padded batch."""
    prompts, answers = _prompts(enc, n, shots)
    width = max(map(len, prompts))
    ids = torch.full((n, width), enc.ids.eos, dtype=torch.long)
    att = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        att[i, width - len(p) :] = 1
    out = model.generate(
        input_ids=ids,
        attention_mask=att,
        max_new_tokens=max_new,
        do_sample=False,
        pad_token_id=enc.ids.eos,
        eos_token_id=[enc.ids.eos, enc.ids.eot],
    )
    texts = [_text(enc, row[width:].tolist()) for row in out]
    return sum(is_correct(t, a) for t, a in zip(texts, answers, strict=True)) / n


def eval_mdm(
    model, enc: Encoder, n: int, shots: int = 0, gen_length: int = 64, block_length: int = 32
) -> float:
    """Semi-autoregressive blocks, one token per step by confidence, no cache (LLaDA baseline)."""
    prompts, answers = _prompts(enc, n, shots)
    width = max(map(len, prompts))
    total = width + gen_length
    x = torch.full((n, total), enc.ids.mask, dtype=torch.long)
    pad = torch.tensor([width - len(p) for p in prompts])
    for i, p in enumerate(prompts):
        x[i, : pad[i]] = enc.ids.eos
        x[i, pad[i] : width] = torch.tensor(p)
    cols = torch.arange(total)
    key_mask = cols[None, :] >= pad[:, None]  # (B, S)
    positions = (cols[None, :] - pad[:, None]).clamp(min=0)
    vocab = model.config.vocab_size
    for start in range(width, total, block_length):
        end = min(start + block_length, total)
        for _ in range(end - start):
            logits = model(x, positions=positions, key_mask=key_mask)[:, start:end, :vocab]
            probs = logits.float().softmax(-1)
            conf, tok = probs.max(-1)  # (B, blk)
            masked = x[:, start:end] == enc.ids.mask
            conf = conf.masked_fill(~masked, -1.0)
            pick = conf.argmax(-1)  # (B,)
            rows = torch.arange(n)
            ok = masked[rows, pick]
            x[rows[ok], start + pick[ok]] = tok[rows[ok], pick[ok]]
    texts = [_text(enc, row[width:].tolist()) for row in x]
    return sum(is_correct(t, a) for t, a in zip(texts, answers, strict=True)) / n
