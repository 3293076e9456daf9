"""Likelihood scoring: log p(continuation | context) of a masked diffusion LM, as an estimate.

A masked diffusion LM has no left-to-right factorisation to read a likelihood from; its papers
score a continuation by a Monte-Carlo estimate of the ELBO: mask a random share of the
continuation, ask the model for the masked tokens, and weight each masked token's
cross-entropy by 1 / (share masked). Each family follows its own reference:

- LLaDA (and LLaDA-MoE): ML-GSAI/LLaDA `get_log_likelihood.py`. A batch of `batch` rows takes
  stratified mask counts (a random start k in [1, T], then k + i * T / batch, wrapped into
  [1, T]), each row masks that many continuation tokens at random places; `samples // batch`
  batches are averaged. cfg_scale > 0 adds the reference's unconditional branch (context
  masked).
- Dream: DreamLM/Dream `eval/eval.py` (`nll_type=mc`, `log_type=ftb`). The scored sequence ends
  in Dream's EOS (its `_encode_pair` appends it); each row's mask ratio is
  (1 - 1e-3) * ((u + i / batch) mod 1) + 1e-3 and every token of the whole sequence is masked
  with that chance (its first and last column never), of which only the continuation's masks
  are kept; logits are shifted one column right (Dream predicts the next column).
- Block-diffusion families and DiffusionGemma are refused with the family table's reason.

Random draws come from a CPU generator seeded with `seed`, in the references' order (they draw
from torch's global generator after `torch.manual_seed(seed)`), so an estimate is the same
number for the same seed on every device. Besides the total, each continuation position gets
its share (the batches' mean of its weighted cross-entropy when masked): the shares sum to the
estimate, but only the sum is the estimator's; a share alone is no token probability.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dllm_cli.errors import InputError
from dllm_cli.families import FAMILIES
from dllm_cli.family_settings import refuse_feature

ROWS_PER_FORWARD = 64  # masked rows forwarded together (draws never depend on this)


@dataclass(frozen=True)
class Estimate:
    """A continuation's estimated log-likelihood and each continuation position's share."""

    total: float
    shares: list[float]  # per continuation token; sum == total (to float rounding)


@dataclass(frozen=True)
class Estimator:
    """One family's reference rule: how rows are masked, how logits align, their defaults."""

    masks: Callable[[int, int, int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    shift: int  # 1: column i's logits predict column i + 1 (Dream)
    samples: int  # the reference's mc_num
    batch: int  # the reference's batch size (part of the estimator: draws are per batch)
    append_eos: bool  # the reference scores context + continuation + EOS
    cfg: bool  # the reference has an unconditional branch (cfg_scale)
    source: str


def llada_masks(
    context: int, target: int, batch: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaDA's forward_process: (batch, context + target) masks and (batch,) mask ratios."""
    k = torch.randint(1, target + 1, (), generator=g)
    counts = torch.round(torch.linspace(float(k), k + (batch - 1) * (target / batch), steps=batch))
    counts = ((counts.long() - 1) % target) + 1  # (batch,) in [1, target]
    masked = torch.arange(target).repeat(batch, 1) < counts[:, None]  # (batch, T)
    for i in range(batch):
        masked[i] = masked[i][torch.randperm(target, generator=g)]
    head = torch.zeros(batch, context, dtype=torch.bool)
    return torch.cat([head, masked], dim=1), counts / target


def dream_masks(
    context: int, target: int, batch: int, g: torch.Generator, eps: float = 1e-3
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dream's _forward_process (ftb): masks over the whole row, kept on the target only."""
    length = context + target
    u = torch.rand(1, generator=g)
    t = (u + torch.arange(batch).float() / batch) % 1
    ratio = (1 - eps) * t + eps  # (batch,)
    masked = torch.rand((batch, length), generator=g) < ratio[:, None]
    masked[:, 0] = False
    masked[:, -1] = False
    masked[:, :context] = False  # ftb: only the target's masks are used
    return masked, ratio


ESTIMATORS: dict[str, Estimator] = {
    "llada": Estimator(llada_masks, 0, 128, 16, False, True, "ML-GSAI/LLaDA get_log_likelihood.py"),
    "llada_moe": Estimator(
        llada_masks, 0, 128, 16, False, True, "ML-GSAI/LLaDA get_log_likelihood.py"
    ),
    "dream": Estimator(dream_masks, 1, 128, 1, True, False, "DreamLM/Dream eval/eval.py (mc, ftb)"),
}


def estimator_for(family: str) -> Estimator:
    """The family's estimator, or InputError with why it has none (the family table's
    reason: families.py `cannot`)."""
    if family in ESTIMATORS:
        return ESTIMATORS[family]
    if family in FAMILIES:
        refuse_feature(FAMILIES[family], "scoring", "scoring", InputError)
    raise InputError(f"scoring: no likelihood estimator is known for {family}")


def column_logits(model, rows: torch.Tensor, shift: int) -> torch.Tensor:
    """(R, S, V) logits aligned so column i predicts column i (Dream's shifted right)."""
    logits = model(rows)
    if shift:
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    return logits


def guided_logits(model, rows, context: int, cfg: float, mask: int, shift: int) -> torch.Tensor:
    """LLaDA's get_logits: with cfg > 0, un + (cfg + 1) * (cond - un), the context masked."""
    if cfg <= 0:
        return column_logits(model, rows, shift)
    bare = rows.clone()
    bare[:, :context] = mask
    both = column_logits(model, torch.cat([rows, bare]), shift)
    cond, un = both.chunk(2)
    return un + (cfg + 1) * (cond - un)


def check_pair(context: list[int], continuation: list[int]) -> None:
    if not context:
        raise InputError("scoring needs a context of at least one token")
    if not continuation:
        raise InputError("scoring needs a continuation of at least one token")


def estimate(
    model,
    mask: int,
    family: str,
    context: list[int],
    continuation: list[int],
    *,
    samples: int | None = None,
    batch: int | None = None,
    seed: int = 0,
    cfg: float = 0.0,
    eos: int | None = None,
) -> Estimate:
    """The reference estimate of log p(continuation | context) for the model's family."""
    check_pair(context, continuation)
    rule = estimator_for(family)
    samples = samples or rule.samples
    batch = min(batch or rule.batch, samples)
    if cfg > 0 and not rule.cfg:
        raise InputError("scoring with cfg_scale is only defined for LLaDA's estimator")
    target = list(continuation) + ([eos] if rule.append_eos and eos is not None else [])
    seq = torch.tensor([*context, *target])  # (S,)
    g = torch.Generator().manual_seed(seed)
    draws = [
        rule.masks(len(context), len(target), batch, g) for _ in range(max(samples // batch, 1))
    ]
    masked = torch.cat([m for m, _ in draws])  # (N * batch, S)
    ratio = torch.cat([r for _, r in draws])  # (N * batch,)
    device = next(model.parameters()).device
    weighted = torch.zeros(masked.shape, dtype=torch.float64)  # (N * batch, S)
    with torch.inference_mode():
        for lo in range(0, masked.shape[0], ROWS_PER_FORWARD):
            part = masked[lo : lo + ROWS_PER_FORWARD].to(device)
            rows = torch.where(part, mask, seq.to(device)[None])  # (R, S)
            logits = guided_logits(model, rows, len(context), cfg, mask, rule.shift)
            truth = seq.to(device)[None].expand_as(rows)[part]
            loss = F.cross_entropy(logits[part], truth, reduction="none")
            own = ratio[lo : lo + ROWS_PER_FORWARD].to(device)[:, None].expand_as(rows)[part]
            weighted[lo : lo + ROWS_PER_FORWARD][part.cpu()] = (loss / own).double().cpu()
    per_batch = weighted.view(len(draws), batch, -1).sum(dim=1) / batch  # (N, S)
    shares = (-per_batch.mean(dim=0))[len(context) : len(context) + len(continuation)]
    totals = per_batch.sum(dim=1)  # (N,): each batch's loss, as the reference sums it
    return Estimate(-float(totals.mean()), shares.tolist())


def greedy_flags(
    model, mask: int, family: str, ids: list[int], start: int = 1
) -> tuple[list[bool], torch.Tensor]:
    """Per position j >= start: is ids[j] the argmax at j with ids[:j] given and the rest
    masked (what a left-to-right decode committing one token per step picks)? And each such
    row's log-probabilities (n - start, V) at its position."""
    rule = estimator_for(family)
    n = len(ids)
    seq = torch.tensor(ids)
    at = torch.arange(start, n)  # (R,) the position each row asks for
    rows = seq.repeat(len(at), 1)  # (R, n)
    rows[torch.arange(n)[None, :] >= at[:, None]] = mask
    device = next(model.parameters()).device
    with torch.inference_mode():
        logits = column_logits(model, rows.to(device), rule.shift)  # (R, n, V)
        picked = logits[torch.arange(len(at)), at.to(device)].float()  # (R, V)
        picked[:, mask] = -torch.inf
        logp = picked.log_softmax(dim=-1).cpu()
    return (logp.argmax(dim=-1) == seq[start:]).tolist(), logp


def next_token(model, mask: int, family: str, ids: list[int]) -> tuple[int, torch.Tensor]:
    """The token a one-token decode commits after `ids` (one masked column, its argmax) and
    that column's log-probabilities (V,)."""
    rule = estimator_for(family)
    rows = torch.tensor([*ids, mask])[None]  # (1, n + 1)
    with torch.inference_mode():
        logits = column_logits(model, rows.to(next(model.parameters()).device), rule.shift)
        last = logits[0, -1].float()
        last[mask] = -torch.inf
        logp = last.log_softmax(dim=-1).cpu()
    return int(logp.argmax()), logp
