"""Logits -> (draft token, confidence) for every column of the current block, for every family.

One sampler, each family's reference declared in `SAMPLERS` (docs/decoding-rules.md#sampling):
LLaDA (arXiv 2502.09992, generate.py `add_gumbel_noise`: Gumbel-max in float64), Dream (arXiv
2508.15487, `sample_tokens`: temperature, then top-p, then top-k) and the block families
(SDAR's and LLaDA2.x's generate: float32, temperature, then top-k, then top-p, one
torch.multinomial draw). The confidence kinds are LLaDA's `low_confidence` / `random`
remasking and Dream's `maskgit_plus` / `topk_margin` / `entropy`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from dllm_cli.decoding.row_sampling import RowDraws, exponentials, per_row, temperatures, uniform
from dllm_cli.decoding.rules import entropy
from dllm_cli.families import family_of_model
from dllm_cli.settings import DecodeSettings


def gumbel_argmax(scores: torch.Tensor, probs, generator) -> torch.Tensor:
    """Sample softmax(scores) by Gumbel-max in float64 (low precision hurts quality: LLaDA).

    LLaDA takes argmax of exp(logits) / (-log U)^T; with scores = logits / T this is the same
    argmax in log space, which cannot overflow for large logits.
    """
    noise = gumbel(generator, scores.shape[:2], scores.shape[-1], scores.device)
    return (scores.to(torch.float64) + noise).argmax(dim=-1)


def exponential_argmax(scores, probs: torch.Tensor, generator) -> torch.Tensor:
    """torch.multinomial(probs, 1, generator)'s own draw, bit for bit (aten Distributions.cpp,
    one sample: argmax(probs / q), q ~ Exp(1) drawn like probs); each row from its own."""
    q = uniform(generator, probs.shape, probs.dtype, probs.device, exponentials)  # (B, L, V)
    return (probs / q).argmax(dim=-1)


def gumbel(generator, shape: tuple[int, int], width: int, device) -> torch.Tensor:
    """(B, L, width) Gumbel noise: float64 uniforms, -log(-log u) (a shard keeps its part)."""
    u = uniform(generator, (*shape, width), torch.float64, device)
    return -torch.log(-torch.log(u))


def exponential(generators, shape: tuple[int, int], width: int, device) -> torch.Tensor:
    """exponential_argmax's noise for a vocabulary shard, a row from its own generator (None:
    greedy, no draw): -log q, so argmax(log p - log q) is its draw."""
    rows, columns = shape
    out = torch.zeros((rows, columns, width), dtype=torch.float64, device=device)
    for r, g in enumerate(generators):
        if g is not None:
            out[r] = -torch.log(exponentials((columns, width), g, torch.float32, device).double())
    return out


@dataclass(frozen=True)
class SamplerRule:
    """How a family's reference sampler drafts: dtype, filter order, draw, confidence."""

    name: str
    dtype: torch.dtype | None  # None: the logits' own dtype, at least float32
    tempered_confidence: bool  # confidence from the tempered, filtered distribution (Dream)
    schedule: str  # which `fixed` schedule the family uses (a key of unmask.SCHEDULES)
    draw: Callable[..., torch.Tensor]  # (scores, probs, generator) -> (B, L) sampled drafts
    noise: Callable[..., torch.Tensor]  # the draw's noise for a vocabulary shard (log scale)
    whole_width: bool  # the draw covers every logit (padding at -inf), else the real vocab
    top_k_first: bool  # filters top-k then top-p (the block families), else top-p then top-k
    greedy_filters: bool  # a greedy draft's confidence reads the filtered distribution (Dream)


# Keyed by a families.py entry's `sampler` (LLaDA-MoE samples as LLaDA does).
SAMPLERS: dict[str, SamplerRule] = {
    # LLaDA upcasts to float64 and measures confidence on softmax(raw logits).
    "llada": SamplerRule("llada", torch.float64, False, "linear", gumbel_argmax, gumbel,
                    whole_width=False, top_k_first=False, greedy_filters=True),
    # Dream samples in the logits' dtype from softmax(filtered logits / temperature).
    "dream": SamplerRule("dream", None, True, "dream", gumbel_argmax, gumbel,
                    whole_width=False, top_k_first=False, greedy_filters=True),
    # SDAR / LLaDA2.x: float32, top-k then top-p, multinomial; T = 0 is the plain argmax (its
    # p from the unfiltered softmax). The schedule is unread (block_rules splits each block).
    "block": SamplerRule("block", torch.float32, True, "linear", exponential_argmax, exponential,
                    whole_width=True, top_k_first=True, greedy_filters=False),
}  # fmt: skip


def sampler_rule_of(model) -> SamplerRule:
    """The sampler family of a model, by its entry in families.py."""
    return SAMPLERS[family_of_model(model).sampler]


def top_p_filter(logits: torch.Tensor, top_p) -> torch.Tensor:
    """Nucleus filtering: keep the smallest set of tokens whose probability reaches top_p
    (None or >= 1: off; a list: each row's own)."""
    if isinstance(top_p, list):
        cut = per_row([p if p is not None and p < 1 else 2.0 for p in top_p], logits, 2.0)
    elif top_p is None or top_p >= 1.0:
        return logits
    else:
        cut = top_p
    ordered, order = logits.sort(dim=-1, descending=True)
    drop = ordered.softmax(dim=-1).cumsum(dim=-1) > cut
    drop[..., 1:] = drop[..., :-1].clone()  # keep the token that crosses top_p
    drop[..., 0] = False
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def top_k_filter(logits: torch.Tensor, top_k) -> torch.Tensor:
    """Keep the k most likely tokens (ties with the k-th kept too, as in Dream); 0/None: all;
    a list: each row's own k."""
    ks = [min(k or 0, logits.shape[-1]) for k in (top_k if isinstance(top_k, list) else [top_k])]
    if max(ks) == 0:
        return logits
    values = logits.topk(max(ks), dim=-1).values  # (B, L, most), descending
    kth = values[..., -1:]
    if len(set(ks)) > 1:  # each row's k-th (-inf: the row's top-k is off)
        index = per_row([max(k, 1) - 1 for k in ks], values, 0).long()
        kth = values.gather(-1, index.expand(*values.shape[:-1], 1))
        kth = kth.masked_fill(per_row([k == 0 for k in ks], kth, 0.0).bool(), float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


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


@dataclass(frozen=True)
class Reads:
    """What a step's rule reads of each slot's distribution besides drafts and confidences,
    measured where the drafts are (a tensor-parallel rank holds only its shard of it)."""

    entropy: bool = False  # its entropy (eb)
    kl: bool = False  # its KL from the row's last step's (klass under tensor parallelism)


NO_READS = Reads()


class Sampler:
    """Turns a block's logits into drafts and confidences under one run's settings."""

    kept_part = None  # its kept distributions cover the whole vocabulary (logprobs.record)

    def __init__(
        self, settings: DecodeSettings, family: SamplerRule, vocab_size: int, mask_id: int
    ):
        self.temperature = settings.temperature
        self.top_p, self.top_k = settings.top_p, settings.top_k
        self.kind = settings.confidence  # (a key of CONFIDENCE_KINDS)
        self.family = family
        self.vocab_size, self.mask_id = vocab_size, mask_id

    def working_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Real vocabulary only (embedding padding dropped, or at -inf where the family's draw
        covers every logit), [MASK] never a draft."""
        dtype = self.family.dtype or (logits.dtype if logits.dtype.itemsize >= 4 else torch.float32)
        if self.family.whole_width:  # (B, L, V_embedding)
            ids = torch.arange(logits.shape[-1], device=logits.device)
            dropped = (ids >= self.vocab_size) | (ids == self.mask_id)
            return logits.to(dtype).masked_fill(dropped, -math.inf)
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

    def draft(self, logits: torch.Tensor, generator: torch.Generator | RowDraws, keep=True):
        """Drafts (B, L), confidences (B, L) and the distribution they come from (B, L, V).

        With a RowDraws every row samples with its own request's values (row_sampling.py).
        `keep` is unread: the distribution is at hand (a tensor-parallel rank's is not)."""
        rows = self.own_rows(generator) if isinstance(generator, RowDraws) else None
        temperature, top_p, top_k, kind, greedy = self.values(rows)
        raw = self.working_logits(logits)
        divisor = temperatures(temperature, raw)
        scores = raw if isinstance(divisor, float) and divisor == 1.0 else raw / divisor
        scores = self.filtered(scores, top_p, top_k)
        probs = (scores if self.family.tempered_confidence else raw).softmax(dim=-1)
        # Greedy: argmax of probabilities, as Dream does (equal to the logits' for LLaDA).
        if greedy:
            if isinstance(kind, str) and CONFIDENCE_KINDS[kind] is chosen_probability:
                confidence, tokens = probs.max(dim=-1)  # one op: the first maximum, as argmax's
                return tokens, confidence, probs
            tokens = probs.argmax(dim=-1)
        else:  # greedy rows draw nothing
            tokens = self.family.draw(scores, probs, generator if rows is None else rows.sampled())
            if rows is not None and rows.any_greedy:
                tokens = torch.where(rows.greedy_rows(raw.device), probs.argmax(dim=-1), tokens)
        if rows is None:
            return tokens, CONFIDENCE_KINDS[kind](probs, tokens, generator), probs
        return tokens, row_confidence(probs, tokens, rows), probs

    def measured(self, logits, generator, keep=True, keys=None, reads: Reads = NO_READS):
        """draft's, then each slot's entropy (B, L) float64 when `reads` asks (as eb reads
        it) and None: one process's KLASS measures its KL from the distributions (`keys`
        unread)."""
        tokens, confidence, probs = self.draft(logits, generator, keep)
        h = entropy(probs.to(torch.float64)) if reads.entropy else None
        return tokens, confidence, probs, h, None

    def values(self, rows: RowDraws | None) -> tuple:
        """(temperature, top-p, top-k, confidence, all greedy): the run's (a greedy run's
        filters off where the family's reference skips them), or the rows' (scalars where
        they agree, else per-row lists)."""
        if rows is not None:
            names = ("temperature", "top_p", "top_k", "confidence")
            return (*(rows.value(k) for k in names), rows.all_greedy)
        greedy = self.temperature == 0
        if greedy and not self.family.greedy_filters:
            return 0.0, None, None, self.kind, True
        return self.temperature, self.top_p, self.top_k, self.kind, greedy

    def own_rows(self, rows: RowDraws) -> RowDraws:
        """The rows as the family's reference samples them: a greedy row unfiltered where the
        reference skips the filters at temperature 0 (the block families)."""
        if self.family.greedy_filters or not rows.any_greedy:
            return rows
        own = tuple(replace(s, top_p=None, top_k=None) if s.greedy else s for s in rows.samplings)
        return replace(rows, samplings=own)

    def filtered(self, scores: torch.Tensor, top_p, top_k) -> torch.Tensor:
        """top-p and top-k (scalars or per-row lists) in the family's reference order."""
        if self.family.top_k_first:
            return top_p_filter(top_k_filter(scores, top_k), top_p)
        return top_k_filter(top_p_filter(scores, top_p), top_k)

    def drafts(self, logits: torch.Tensor, samplings, generators, keep: bool = False):
        """The block stepper's Drafter (block_rules.py): (N, B, V) -> tokens, p (N, B) and,
        when `keep`, their distribution (N, B, V); every row with its own request's values and
        generator."""
        n, b = logits.shape[:2]
        rows = RowDraws(tuple(generators), tuple(samplings), (b,) * n, (True,) * n)
        tokens, p, probs = self.draft(logits, rows)
        return tokens, p, probs if keep else None


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
