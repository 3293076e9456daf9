"""Straightforward re-implementations of the references' likelihood estimators, written from
reading them: ML-GSAI/LLaDA get_log_likelihood.py (forward_process, get_logits,
get_log_likelihood) and DreamLM/Dream eval/eval.py (_forward_process, get_logits,
_eval_target_nll_mc with log_type ftb). They draw from torch's global generator after
torch.manual_seed(seed), one batch after another, as the references do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def llada_forward_process(batch, prompt_index, mask_id):
    b, length = batch.shape
    target_len = (length - prompt_index.sum()).item()
    k = torch.randint(1, target_len + 1, ())
    x = torch.round(torch.linspace(float(k), k + (b - 1) * (target_len / b), steps=b)).long()
    x = ((x - 1) % target_len) + 1
    assert x.min() >= 1 and x.max() <= target_len
    indices = torch.arange(target_len).repeat(b, 1)
    is_mask = indices < x.unsqueeze(1)
    for i in range(b):
        is_mask[i] = is_mask[i][torch.randperm(target_len)]
    is_mask = torch.cat((torch.zeros(b, int(prompt_index.sum()), dtype=torch.bool), is_mask), 1)
    return torch.where(is_mask, mask_id, batch), (x / target_len).unsqueeze(1).repeat(1, length)


def llada_logits(model, batch, prompt_index, cfg_scale, mask_id):
    if cfg_scale > 0.0:
        un_batch = batch.clone()
        un_batch[prompt_index.unsqueeze(0).repeat(batch.shape[0], 1)] = mask_id
        batch = torch.cat([batch, un_batch])
    logits = model(batch)
    if cfg_scale > 0.0:
        logits, un_logits = torch.chunk(logits, 2, dim=0)
        logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
    return logits


@torch.no_grad()
def llada_log_likelihood(model, prompt, answer, mc_num, batch_size, cfg_scale, mask_id, seed):
    torch.manual_seed(seed)
    seq = torch.cat([torch.tensor(prompt), torch.tensor(answer)])[None, :]
    seq = seq.repeat((batch_size, 1))
    prompt_index = torch.arange(seq.shape[1]) < len(prompt)
    losses = []
    for _ in range(mc_num // batch_size):
        perturbed, p_mask = llada_forward_process(seq, prompt_index, mask_id)
        mask_index = perturbed == mask_id
        logits = llada_logits(model, perturbed, prompt_index, cfg_scale, mask_id)
        loss = F.cross_entropy(logits[mask_index], seq[mask_index], reduction="none")
        losses.append((loss / p_mask[mask_index]).sum().item() / batch_size)
    return -sum(losses) / len(losses)


def dream_forward_process(batch, mask_id, sampling_eps=1e-3):
    b, length = batch.shape
    u0 = torch.rand(1, dtype=torch.float32)
    t = (u0 + torch.arange(b).float() / b) % 1
    p_mask = ((1 - sampling_eps) * t + sampling_eps)[:, None].repeat(1, length)
    mask_indices = torch.rand((b, length)) < p_mask
    mask_indices[:, 0] = False
    mask_indices[:, -1] = False
    return torch.where(mask_indices, mask_id, batch), p_mask


@torch.no_grad()
def dream_log_likelihood(model, prefix, target, mc_num, batch_size, mask_id, seed):
    """`target` already ends in EOS, as Dream's _encode_pair appends it."""
    torch.manual_seed(seed)
    seq = torch.cat([torch.tensor(prefix), torch.tensor(target)])[None, :]
    seq = seq.repeat((batch_size, 1))
    losses = []
    for _ in range(max(mc_num // batch_size, 1)):
        perturbed = seq.clone()
        noisy, p_mask = dream_forward_process(seq, mask_id)
        perturbed[:, -len(target) :] = noisy[:, -len(target) :]
        mask_indices = perturbed == mask_id
        logits = model(perturbed)
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        loss = F.cross_entropy(logits[mask_indices], seq[mask_indices], reduction="none")
        losses.append((loss / p_mask[mask_indices]).sum().item() / batch_size)
    return -sum(losses) / len(losses)
