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
- SDAR and LLaDA2.x (block-causal): no reference scores a likelihood, so dllm reads one from
  what these models are trained on (SDAR arXiv 2510.06303, LLaDA2.0 arXiv 2512.15745, after
  BD3-LM arXiv 2503.09573): log p(continuation | context) is the sum over the continuation's
  blocks (the model's `block_size`, aligned to absolute positions as decoding aligns them) of
  log p(block | everything before it), each bounded by the masked-diffusion ELBO of that block
  with the earlier blocks clean and later ones unseen (the block-causal key mask). Each block
  takes LLaDA's draws (stratified counts, random places) over its own continuation tokens,
  `samples // batch` batches per block; a block holding one continuation token is exact.
- DiffusionGemma is refused with the family table's reason.

Under --tensor-parallel the model's logits are this rank's slice of the vocabulary: the
cross-entropies and log-probabilities here come from one all-gather per forward of each row's
log-sum-exp, the logit of its own token and its top candidates (`VocabLogProbs`), never the
logits themselves.

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

from dllm_cli.decoding.shard_summaries import held
from dllm_cli.errors import InputError
from dllm_cli.families import FAMILIES
from dllm_cli.family_settings import refuse_feature
from dllm_cli.models.block import block_key_mask

ROWS_PER_FORWARD = 64  # masked rows forwarded together (draws never depend on this)
CANDIDATES = 20  # alternatives a split model's ranks send per row (the server's most)


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
    blocks: bool = False  # block-causal: `masks` draws in one block at a time (`block_draws`)


@dataclass(frozen=True)
class VocabLogProbs:
    """Log-probabilities of rows of logits, whole or split over the vocabulary (`model.shards`).

    A split model's rows are this rank's ids [start, start + V_r); one all-gather of
    (log-sum-exp, the own token's logit, the top CANDIDATES logits and their ids) per row makes
    every rank's answer the whole vocabulary's: the own token's log-probability exactly, and a
    (N, V) table whose ids outside every rank's candidates read -inf (alternatives and argmax
    only ever read the candidates)."""

    model: torch.nn.Module

    @property
    def split(self) -> bool:
        return self.model.shards is not None

    def hide(self, logits: torch.Tensor, token: int) -> torch.Tensor:
        """(N, V_r) logits with `token` (a global id) at -inf wherever this rank holds it."""
        at = token - (self.model.vocab_start if self.split else 0)
        if 0 <= at < logits.shape[-1]:
            logits[..., at] = -torch.inf
        return logits

    def losses(self, logits: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
        """(N, V_r) logits, (N,) token ids -> (N,) cross-entropies."""
        if not self.split:
            return F.cross_entropy(logits, truth, reduction="none")
        lse, own, _, _ = self.gathered(logits, truth, 0)
        return (lse - own).to(logits.dtype)

    def table(self, logits: torch.Tensor, own: torch.Tensor | None = None) -> torch.Tensor:
        """(N, V_r) logits -> (N, V) float32 log-probabilities on the host; split: exact at the
        rows' `own` ids (N,) and at every rank's top candidates, -inf elsewhere."""
        logits = logits.float()
        if not self.split:
            return logits.log_softmax(dim=-1).cpu()
        lse, mine, values, ids = self.gathered(logits, own, CANDIDATES)
        out = torch.full((logits.shape[0], self.model.vocab_width), -torch.inf)  # (N, V) float32
        real = (ids >= 0).cpu()  # (a slice narrower than k pads with id -1)
        rows = torch.arange(out.shape[0])[:, None].expand_as(real)
        out[rows[real], ids.cpu()[real]] = (values - lse[:, None]).float().cpu()[real]
        if own is not None:
            out.scatter_(1, own.cpu()[:, None], (mine - lse).float().cpu()[:, None])
        return out

    def gathered(self, logits: torch.Tensor, own: torch.Tensor | None, k: int):
        """Every rank's (N,) log-sum-exp and `own` logit and (N, k) top logits and ids
        combined: (N,) lse, (N,) own logit (-inf without `own`), (N, world k) candidate logits
        and their global ids."""
        shards, start = self.model.shards, self.model.vocab_start
        x = logits.double()  # (N, V_r)
        absent = torch.full(x.shape[:1], -torch.inf, dtype=x.dtype, device=x.device)
        mine = absent if own is None else held(x, own, start)
        n = min(k, x.shape[-1])  # a slice narrower than k sends every id it holds ...
        values, ids = x.topk(n, dim=-1)  # (N, n)
        pad = (x.shape[0], k - n)  # ... and -inf fillers of id -1: one shape on every rank
        values = torch.cat([values, values.new_full(pad, -torch.inf)], dim=1)  # (N, k)
        ids = torch.cat([ids + start, ids.new_full(pad, -1)], dim=1)
        packed = torch.cat([x.logsumexp(dim=-1)[:, None], mine[:, None], values, ids.double()], 1)
        every = shards.all_gather(packed)  # (world, N, 2 + 2k)
        lse = every[..., 0].logsumexp(dim=0)  # (N,)
        own_logit = every[..., 1].max(dim=0).values  # the holder's; -inf from the others
        rows = every.shape[1]
        values = every[..., 2 : 2 + k].permute(1, 0, 2).reshape(rows, -1)
        ids = every[..., 2 + k :].permute(1, 0, 2).reshape(rows, -1).long()
        return lse, own_logit, values, ids


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
    masked[:, [0, -1]] = False
    masked[:, :context] = False  # ftb: only the target's masks are used
    return masked, ratio


def block_draws(
    rule: Estimator, block: int, context: int, target: int, batch: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks * batch, context + target) masks and ratios: the rule's draws over the
    continuation tokens of each block in turn (blocks aligned to absolute positions), the rest
    clean."""
    length = context + target
    masks, ratios = [], []
    for lo in range(context // block * block, length, block):
        start, end = max(lo, context), min(lo + block, length)
        masked, ratio = rule.masks(start, end - start, batch, g)  # (batch, end)
        masks.append(F.pad(masked, (0, length - end)))
        ratios.append(ratio)
    return torch.cat(masks), torch.cat(ratios)


def draws(rule: Estimator, model, context: int, target: int, samples: int, batch: int, g):
    """Every mask row of one estimate and its ratio, in the draw order its batches average."""
    n = max(samples // batch, 1)
    if rule.blocks:
        block = model.block_size
        return [block_draws(rule, block, context, target, batch, g) for _ in range(n)]
    return [rule.masks(context, target, batch, g) for _ in range(n)]


def forwards(rule: Estimator, model, context: int, target: int, samples: int, batch: int) -> int:
    """Model forwards one estimate takes."""
    rows = max(samples // batch, 1) * batch
    if rule.blocks:
        block = model.block_size
        rows *= -(-(context + target) // block) - context // block
    return -(-rows // ROWS_PER_FORWARD)


BLOCK = Estimator(
    llada_masks, 0, 128, 16, False, False, "dllm's own (no reference scores)", blocks=True
)
LLADA = Estimator(llada_masks, 0, 128, 16, False, True, "ML-GSAI/LLaDA get_log_likelihood.py")
ESTIMATORS: dict[str, Estimator] = {
    "llada": LLADA,
    "llada_moe": LLADA,
    "dream": Estimator(dream_masks, 1, 128, 1, True, False, "DreamLM/Dream eval/eval.py (mc, ftb)"),
    "sdar": BLOCK,
    "llada2": BLOCK,
}


def estimator_for(family: str) -> Estimator:
    """The family's estimator, or InputError with why it has none (the family table's
    reason: families.py `cannot`)."""
    if family in ESTIMATORS:
        return ESTIMATORS[family]
    if family in FAMILIES:
        refuse_feature(FAMILIES[family], "scoring", "scoring", InputError)
    raise InputError(f"scoring: no likelihood estimator is known for {family}")


def column_logits(model, rows: torch.Tensor, shift: int, blocks: bool = False) -> torch.Tensor:
    """(R, S, V) logits aligned so column i predicts column i (Dream's shifted right); `blocks`:
    under the block-causal key mask the model decodes with."""
    keys = block_key_mask(rows.shape[1], model.block_size, rows.device)[None] if blocks else None
    logits = model(rows, key_mask=keys)
    if shift:
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    return logits


def guided_logits(
    model, rows, context: int, cfg: float, mask: int, shift: int, blocks: bool = False
) -> torch.Tensor:
    """LLaDA's get_logits: with cfg > 0, un + (cfg + 1) * (cond - un), the context masked."""
    if cfg <= 0:
        return column_logits(model, rows, shift, blocks)
    bare = rows.clone()
    bare[:, :context] = mask
    both = column_logits(model, torch.cat([rows, bare]), shift, blocks)
    cond, un = both.chunk(2)
    return un + (cfg + 1) * (cond - un)


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
    if not context:
        raise InputError("scoring needs a context of at least one token")
    if not continuation:
        raise InputError("scoring needs a continuation of at least one token")
    rule = estimator_for(family)
    samples = samples or rule.samples
    batch = min(batch or rule.batch, samples)
    if cfg > 0 and not rule.cfg:
        raise InputError("scoring with cfg_scale is only defined for LLaDA's estimator")
    target = list(continuation) + ([eos] if rule.append_eos and eos is not None else [])
    seq = torch.tensor([*context, *target])  # (S,)
    g = torch.Generator().manual_seed(seed)
    drawn = draws(rule, model, len(context), len(target), samples, batch, g)
    masked = torch.cat([m for m, _ in drawn])  # (N * batch * blocks, S)
    ratio = torch.cat([r for _, r in drawn])  # (N * batch * blocks,)
    device = next(model.parameters()).device
    weighted = torch.zeros(masked.shape, dtype=torch.float64)  # (N * batch * blocks, S)
    with torch.inference_mode():
        for lo in range(0, masked.shape[0], ROWS_PER_FORWARD):
            part = masked[lo : lo + ROWS_PER_FORWARD].to(device)
            rows = torch.where(part, mask, seq.to(device)[None])  # (R, S)
            logits = guided_logits(model, rows, len(context), cfg, mask, rule.shift, rule.blocks)
            truth = seq.to(device)[None].expand_as(rows)[part]
            loss = VocabLogProbs(model).losses(logits[part], truth)
            own = ratio[lo : lo + ROWS_PER_FORWARD].to(device)[:, None].expand_as(rows)[part]
            weighted[lo : lo + ROWS_PER_FORWARD][part.cpu()] = (loss / own).double().cpu()
    per_batch = weighted.view(len(drawn), -1, len(seq)).sum(dim=1) / batch  # (N, S)
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
        logits = column_logits(model, rows.to(device), rule.shift, rule.blocks)  # (R, n, V)
        vocab = VocabLogProbs(model)
        picked = vocab.hide(logits[torch.arange(len(at)), at.to(device)].float(), mask)  # (R, V)
        logp = vocab.table(picked, seq[start:].to(device))
    return (logp.argmax(dim=-1) == seq[start:]).tolist(), logp


def next_token(model, mask: int, family: str, ids: list[int]) -> tuple[int, torch.Tensor]:
    """The token a one-token decode commits after `ids` (one masked column, its argmax) and
    that column's log-probabilities (V,)."""
    rule = estimator_for(family)
    rows = torch.tensor([*ids, mask])[None]  # (1, n + 1)
    with torch.inference_mode():
        device = next(model.parameters()).device
        logits = column_logits(model, rows.to(device), rule.shift, rule.blocks)
        vocab = VocabLogProbs(model)
        logp = vocab.table(vocab.hide(logits[0, -1:].float(), mask))[0]  # (V,)
    return int(logp.argmax()), logp
