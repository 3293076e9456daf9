"""Logits -> (draft token, confidence) for every column of the current block.

Drafting follows LLaDA (arXiv 2502.09992, Gumbel-max in float64) and Dream (arXiv 2508.15487,
`sample_tokens`: temperature, then top-p, then top-k); the confidence kinds are LLaDA's
`low_confidence` / `random` remasking and Dream's `maskgit_plus` / `topk_margin` / `entropy`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from dllm_cli.decoding.row_sampling import RowDraws, temperatures, top_k_rows, top_p_rows, uniform
from dllm_cli.families import family_of_model
from dllm_cli.settings import DecodeSettings


@dataclass(frozen=True)
class Family:
    """What a model family's reference sampler does differently from the other one's."""

    name: str
    dtype: torch.dtype | None  # None: the logits' own dtype, at least float32
    tempered_confidence: bool  # confidence from the tempered, filtered distribution (Dream)
    schedule: str  # which `fixed` schedule the family uses (a key of unmask.SCHEDULES)


# Keyed by a families.py entry's `sampler` (LLaDA-MoE samples as LLaDA does).
FAMILIES: dict[str, Family] = {
    # LLaDA upcasts to float64 and measures confidence on softmax(raw logits).
    "llada": Family("llada", torch.float64, tempered_confidence=False, schedule="linear"),
    # Dream samples in the logits' dtype from softmax(filtered logits / temperature).
    "dream": Family("dream", None, tempered_confidence=True, schedule="dream"),
}


def family_of(model) -> Family:
    """The sampler family of a model, by its entry in families.py."""
    return FAMILIES[family_of_model(model).sampler]


def top_p_filter(logits: torch.Tensor, top_p: float | None) -> torch.Tensor:
    """Nucleus filtering: keep the smallest set of tokens whose probability reaches top_p."""
    if top_p is None or top_p >= 1.0:
        return logits
    ordered, order = logits.sort(dim=-1, descending=True)
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative > top_p
    drop[..., 1:] = drop[..., :-1].clone()  # keep the token that crosses top_p
    drop[..., 0] = False
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def top_k_filter(logits: torch.Tensor, top_k: int | None) -> torch.Tensor:
    """Keep the k most likely tokens (ties with the k-th kept too, as in Dream); 0/None: all."""
    if not top_k:
        return logits
    kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def gumbel_argmax(scores: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Sample softmax(scores) by Gumbel-max in float64 (low precision hurts quality: LLaDA).

    LLaDA takes argmax of exp(logits) / (-log U)^T; with scores = logits / T this is the same
    argmax in log space, which cannot overflow for large logits.
    """
    u = uniform(generator, scores.shape, torch.float64, scores.device)
    return (scores.to(torch.float64) - torch.log(-torch.log(u))).argmax(dim=-1)


def chosen_probability(probs, tokens, generator) -> torch.Tensor:
    """LLaDA low_confidence / Dream maskgit_plus: probability of the drafted token."""
    return probs.gather(-1, tokens[..., None]).squeeze(-1)


def top_two_margin(probs, tokens, generator) -> torch.Tensor:
    """Dream topk_margin: top-1 minus top-2 probability."""
    top = probs.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def negative_entropy(probs, tokens, generator) -> torch.Tensor:
    """Dream entropy: sum p log p (higher is more certain)."""
    return (probs * torch.log(probs + 1e-10)).sum(dim=-1)


def uniform_confidence(probs, tokens, generator) -> torch.Tensor:
    """LLaDA random remasking: a uniform random confidence."""
    return uniform(generator, tokens.shape, probs.dtype, tokens.device)


CONFIDENCE_KINDS: dict[str, Callable[..., torch.Tensor]] = {
    "low_confidence": chosen_probability,
    "margin": top_two_margin,
    "entropy": negative_entropy,
    "random": uniform_confidence,
}


class Sampler:
    """Turns a block's logits into drafts and confidences under one run's settings."""

    def __init__(self, settings: DecodeSettings, family: Family, vocab_size: int, mask_id: int):
        self.temperature = settings.temperature
        self.top_p, self.top_k = settings.top_p, settings.top_k
        self.confidence = CONFIDENCE_KINDS[settings.confidence]
        self.family = family
        self.vocab_size, self.mask_id = vocab_size, mask_id

    def working_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Real vocabulary only (embedding padding dropped), [MASK] never a draft."""
        dtype = self.family.dtype or (logits.dtype if logits.dtype.itemsize >= 4 else torch.float32)
        out = logits[..., : self.vocab_size].to(dtype)  # (B, L, V)
        if self.mask_id < self.vocab_size:
            out = out.clone() if out.data_ptr() == logits.data_ptr() else out
            out.select(-1, self.mask_id).fill_(-math.inf)  # (a setitem makes a tensor of it)
        return out

    def argmax(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy drafts (B, L) whatever the temperature, and their probability (guided drafts).

        FlashDLM drafts the argmax of the raw logits; the probability (softmax of the raw
        logits, in at least float32) is only shown by the live view.
        """
        work = logits[..., : self.vocab_size]
        work = work if work.dtype.itemsize >= 4 else work.float()
        if self.mask_id < self.vocab_size:
            work = work.clone()
            work[..., self.mask_id] = float("-inf")
        best, tokens = work.max(dim=-1)
        return tokens, torch.exp(best - torch.logsumexp(work, dim=-1))

    def __call__(
        self, logits: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L, V) logits -> drafts (B, L) long and confidences (B, L)."""
        tokens, confidence, _ = self.draft(logits, generator)
        return tokens, confidence

    def draft(self, logits: torch.Tensor, generator: torch.Generator | RowDraws, keep=True):
        """Drafts (B, L), confidences (B, L) and the distribution they come from (B, L, V).

        With a RowDraws every row samples with its own request's values (row_sampling.py).
        `keep` is unread: the distribution is at hand (a tensor-parallel rank's is not)."""
        if isinstance(generator, RowDraws):
            return self.draft_rows(logits, generator)
        raw = self.working_logits(logits)
        scores = raw / self.temperature if self.temperature > 0 else raw
        scores = top_k_filter(top_p_filter(scores, self.top_p), self.top_k)
        probs = (scores if self.family.tempered_confidence else raw).softmax(dim=-1)
        # Greedy: argmax of probabilities, as Dream does (equal to the logits' for LLaDA).
        greedy = self.temperature == 0
        if greedy and self.confidence is chosen_probability:
            confidence, tokens = probs.max(dim=-1)  # the first maximum, as argmax's
            return tokens, confidence, probs
        tokens = probs.argmax(dim=-1) if greedy else gumbel_argmax(scores, generator)
        return tokens, self.confidence(probs, tokens, generator), probs

    def draft_rows(self, logits: torch.Tensor, rows: RowDraws):
        """`draft` with per-row temperature, top-p and top-k (scalars where rows agree)."""
        raw = self.working_logits(logits)
        temperature, top_p, top_k = (rows.value(k) for k in ("temperature", "top_p", "top_k"))
        divisor = temperatures(temperature, raw)
        scores = raw if isinstance(divisor, float) and divisor == 1.0 else raw / divisor
        scores = (
            top_p_rows(scores, top_p) if isinstance(top_p, list) else top_p_filter(scores, top_p)
        )
        scores = (
            top_k_rows(scores, top_k) if isinstance(top_k, list) else top_k_filter(scores, top_k)
        )
        probs = (scores if self.family.tempered_confidence else raw).softmax(dim=-1)
        if rows.all_greedy:
            kind = rows.value("confidence")  # (a list when rows differ)
            if isinstance(kind, str) and CONFIDENCE_KINDS[kind] is chosen_probability:
                confidence, tokens = probs.max(dim=-1)  # one op: the first maximum, as argmax's
                return tokens, confidence, probs
            tokens = probs.argmax(dim=-1)
        else:
            tokens = gumbel_argmax(scores, rows.sampled())  # greedy rows draw nothing
            if rows.any_greedy:
                tokens = torch.where(rows.greedy_rows(raw.device), probs.argmax(dim=-1), tokens)
        return tokens, row_confidence(probs, tokens, rows), probs


def row_confidence(probs, tokens, rows: RowDraws, kinds=CONFIDENCE_KINDS) -> torch.Tensor:
    """(B, L) each row's own confidence kind (one call when rows agree; `random` rows draw);
    `kinds` reads `probs` (a tensor here, a rank's gathered summaries in sharded_sampling)."""
    kind = rows.value("confidence")
    if not isinstance(kind, list):
        return kinds[kind](probs, tokens, rows)
    out = None
    for name in dict.fromkeys(kind):  # each kind present, in row order
        mine = [k == name for k in kind]
        draws = replace(rows, on=tuple(o and m for o, m in zip(rows.on, mine, strict=True)))
        conf = kinds[name](probs, tokens, draws)
        where = torch.tensor(mine, device=conf.device)[:, None]
        out = conf if out is None else torch.where(where, conf, out)
    return out
