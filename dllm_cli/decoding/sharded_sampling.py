"""Sampling from vocabulary shards: every rank's drafts and confidences from one all-gather of
a few numbers per column, so the logits of tensor parallelism are never gathered.

Each rank reduces its (rows, columns, own vocabulary) shard to a few numbers per column (its
best score and id, its sums of exp and of p log p, its top-K candidates, its best perturbed
score) and one all-gather of those gives every rank the same drafts and confidences, so every
rank takes the same decisions and runs the same collectives in the same order. A sampled draft
is the reference's own draw: every rank draws the noise of the whole vocabulary from the same
generator state (as one process draws it), keeps its own columns, perturbs its scores and the
gather's (max, argmax) is the draw (Gumbel-max for LLaDA and Dream, torch.multinomial's
argmax(p / q), q ~ Exp(1), for the block families). top-k and top-p are thresholds found from
the gathered candidates (top-p gathers more candidates, rarely, when they do not reach its
mass). The block stepper (SDAR, LLaDA2.x) drafts through `block_drafter`. A committer that
reads distributions (a grammar's, the credit rule's) gets the shard's part of them
(`distributions`); a grammar finds its masked token over every rank's part with `VocabPart`
(credit: credit.sharded_fused_drafts). WINO's shadow check rides the same gather (`ride`,
`shadow_summary`): each rank's (max, sum of exp, the token's logit if it holds it) per
shadow column. EB's entropy comes from the gathered sums; KLASS's KL from each rank's shard of
the row's last distribution (`Last`, kept in the rule's `KlassMemory` with the row's history):
one more number per column in the same gather, or the gathered candidates of a filtered one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dllm_cli.decoding.block_rules import Drafter
from dllm_cli.decoding.row_sampling import RowDraws, uniform
from dllm_cli.decoding.rules import KL_EPS, KlassMemory
from dllm_cli.decoding.sampling import NO_READS, SAMPLERS, Reads, row_confidence
from dllm_cli.decoding.shard_summaries import (
    EPS,
    Last,
    Needs,
    Summaries,
    VocabPart,
    looked_up,
    realigned,
    rows_of,
    summarize,
)  # fmt: skip
from dllm_cli.lifetimes import Sampling
from dllm_cli.models.sharding import ShardedLM, Shards

NUCLEUS = 64  # candidates each rank sends for top-p (times 8 per extra round)
LOGPROBS = 20  # candidates each rank sends when a request asks for logprobs (its most)


@dataclass(frozen=True)
class Rows:
    """Each row's sampling values as (B, 1) tensors, and what the host decides from them."""

    divisor: torch.Tensor  # (B, 1, 1) temperature, 1 for greedy rows
    greedy: torch.Tensor  # (B, 1) bool
    top_k: list[int]  # 0: off
    top_p: torch.Tensor  # (B, 1) above 1: off
    sampled: bool  # some row draws
    nucleus: bool  # some row filters by top-p
    entropy: bool  # some row's confidence is the entropy

    @classmethod
    def of(cls, samplings, filters_greedy: bool, device) -> Rows:
        def on(s) -> bool:  # the row's filters apply (block: not at temperature 0)
            return filters_greedy or not s.greedy

        top_p = [
            s.top_p if on(s) and s.top_p is not None and s.top_p < 1 else 2.0 for s in samplings
        ]
        return cls(
            torch.tensor([[[s.temperature if s.temperature > 0 else 1.0]] for s in samplings],
                         dtype=torch.float64, device=device),
            torch.tensor([[s.greedy] for s in samplings], device=device),
            [(s.top_k or 0) if on(s) else 0 for s in samplings],
            torch.tensor(top_p, dtype=torch.float64, device=device)[:, None],
            not all(s.greedy for s in samplings),
            any(p <= 1 for p in top_p),
            any(s.confidence == "entropy" for s in samplings),
        )  # fmt: skip


class ShardedSampler:
    """Drafts and confidences from every rank's vocabulary shard, one all-gather of a few
    numbers per column (decoding/sampling.py's Sampler computes them from whole logits)."""

    def __init__(
        self, shards: Shards, start: int, width: int, settings, family, vocab, mask,
        distributions: bool = False,
    ):  # fmt: skip
        self.shards, self.start, self.width, self.family = shards, start, width, family
        self.vocab_size, self.mask_id = vocab, mask
        self.distributions = distributions  # kept: each column's distribution over the shard
        self.run = Sampling.of(settings)
        self.drawing = family  # its draw: noise, width, filter order (sampling.SAMPLERS)
        self.largest = max(shards.widths(width))
        self.riders: list[tuple[torch.Tensor, dict]] = []  # sent with the next gather (`ride`)
        # KLASS's memory (the rule's: `RuleCommitter.shard`): each request's last step's
        # shard, kept there with its history, freed with it when the request leaves
        self.memory: KlassMemory | None = None

    @property
    def kept_part(self) -> VocabPart | None:
        """What logprobs read of a kept distribution: this rank's slice of the vocabulary
        (`distributions`), or None: the gathered candidates, over the whole vocabulary."""
        return VocabPart(self.start, self.vocab_size, self.shards) if self.distributions else None

    @classmethod
    def of(
        cls, model: ShardedLM, settings, family, vocab: int, mask: int, distributions=False
    ) -> ShardedSampler:
        """The sampler for a split model's own range of the vocabulary."""
        start, width = model.vocab_start, model.vocab_width
        return cls(model.shards, start, width, settings, family, vocab, mask, distributions)

    def draft(self, logits: torch.Tensor, generator, samplings=None, keep: bool = False):
        """(B, L, own vocabulary) logits -> drafts (B, L), confidences (B, L) and, when `keep`,
        the drafts' distribution: the shard's part of it (B, L, V_r) when the sampler keeps
        `distributions`, else on the gathered candidates (`kept`, B, L, V); each row samples
        with its own values when `generator` is a RowDraws (or `samplings`)."""
        return self.measured(logits, generator, keep, samplings=samplings)[:3]

    def measured(
        self, logits, generator, keep=False, keys=None, reads: Reads = NO_READS, samplings=None
    ):
        """draft's, then what `reads` asks of each slot's distribution, (B, L) float64 (None:
        not asked): its entropy, and its KL from the last step's of the row `keys` names (the
        request ids; a None key is neither measured nor kept), from the same one gather."""
        if samplings is None:
            samplings = generator.samplings if isinstance(generator, RowDraws) else None
        samplings = samplings or (self.run,) * logits.shape[0]
        rows = Rows.of(samplings, self.drawing.greedy_filters, logits.device)
        dtype = self.family.dtype or (logits.dtype if logits.dtype.itemsize >= 4 else None)
        dtype = dtype or torch.float32
        raw = self.working(logits, dtype)  # (B, L, V_r)
        scores = raw if not rows.sampled else raw / rows.divisor.to(dtype)
        noisy = self.noisy(scores, generator) if rows.sampled else None
        least = LOGPROBS if keep and not self.distributions else 0  # (a grammar's: the part)
        basis = scores if self.family.tempered_confidence else raw  # what confidences read
        extra = self.cross(basis, keys)[..., None] if reads.kl else None  # (B, L, 1)
        sums = reads.entropy or reads.kl  # sum p log p of every shard
        view = self.reduce(raw, scores, noisy, rows, least, extra, sums)
        h = -plogp(view, 0.0) if reads.entropy else None
        kl = self.step_kl(view, raw, scores, keys, dtype) if reads.kl else None
        tokens = view.tokens
        if isinstance(generator, RowDraws):
            confidence = row_confidence(view, tokens, generator, KINDS)
        else:
            confidence = KINDS[samplings[0].confidence](view, tokens, generator)
        if self.distributions:
            return tokens, confidence.to(dtype), part(view, raw, scores).to(dtype), h, kl
        return tokens, confidence.to(dtype), self.kept(view, dtype) if keep else None, h, kl

    def cross(self, basis: torch.Tensor, keys) -> torch.Tensor:
        """(B, L) this shard's sum of exp(x - best) log(q + eps) over the row's last step's
        distribution q (KLASS's cross term, before the gather gives the denominator; 0: no
        last step), x the scores confidences read."""
        x = basis.double()  # (B, L, V_r)
        best = x.max(dim=-1).values  # (as summarize's)
        e = (x - torch.where(torch.isfinite(best), best, 0.0)[..., None]).exp()
        q = torch.ones_like(x)  # log(1 + eps): about 0 (a row with no last step)
        for r, (key, first) in rows_of(keys):
            last = self.memory.last(key)
            if last is not None:
                q[r] = realigned(last.part, first - last.first, x.shape[1], 1.0)
        return (e * torch.log(q + KL_EPS)).sum(dim=-1)

    def step_kl(self, view: View, raw, scores, keys, dtype) -> torch.Tensor:
        """(B, L) KL(p || q) of each slot's distribution from its last step's, the last
        step's then replaced by this one in the memory (the shard's part, and every rank's
        candidates)."""
        s = view.s
        bests, totals = (s.bests, s.totals) if view.tempered else (s.raw_bests, s.raw_totals)
        top = bests.max(dim=0).values
        scale = torch.exp(bests - top)  # (world, B, L)
        cross = (scale * s.extra[..., 0]).sum(dim=0) / (totals * scale).sum(dim=0)
        dense = plogp(view, 0.0) - cross  # (the reference's log(p + eps): log p here)
        ids, p = candidates(view)  # (B, L, world k)
        p = p.to(dtype).double()  # as one process's distribution, in the sampler's dtype
        q = torch.zeros_like(p)
        for r, (key, first) in rows_of(keys):
            last = self.memory.last(key)
            if last is not None:
                q[r] = looked_up(last, ids[r], first - last.first)
        sparse = (p * (torch.log(p + KL_EPS) - torch.log(q + KL_EPS))).sum(dim=-1)
        at = torch.exp(view.cut - s.best) / s.mass(view.cut)  # each unsent tie's (q unknown: 0)
        sparse = sparse + s.ties(view.cut) * at * (torch.log(at + KL_EPS) - math.log(KL_EPS))
        filtered = (view.cut > -math.inf) if view.tempered else torch.zeros_like(top, dtype=bool)
        mine = part(view, raw, scores).to(dtype).double()  # (B, L, V_r)
        for r, (key, first) in rows_of(keys):
            self.memory.keep(key, Last(mine[r].clone(), ids[r].clone(), p[r].clone(), first))
        return torch.where(filtered, sparse, dense)

    def kept(self, view: View, dtype: torch.dtype) -> torch.Tensor:
        """(B, L, V) the distribution confidences read, on every rank's candidates (its top
        ones, all that logprobs.record reads) and each draft's own; 0 elsewhere. Built when a
        request asks for logprobs."""
        ids, p = candidates(view)
        real = (ids >= 0) & (ids < self.vocab_size)  # (a shard's padding ids, -inf scores)
        out = torch.zeros((*ids.shape[:2], self.vocab_size), dtype=dtype, device=ids.device)
        out.scatter_add_(-1, torch.where(real, ids, 0), torch.where(real, p, 0.0).to(dtype))
        mine = chosen_probability(view, view.tokens, None).to(dtype)  # a draw's own, sampled
        return out.scatter_(-1, view.tokens[..., None], mine[..., None])

    def argmax(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy drafts and their probability under softmax(raw logits), at least float32."""
        dtype = logits.dtype if logits.dtype.itemsize >= 4 else torch.float32
        work = self.working(logits, dtype)
        s = Summaries(self.gather(summarize(work, work, None, 1, self.start)), 1)
        return s.first, (1.0 / s.total()).to(dtype)

    def ride(self, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Send this rank's `x` with the next gather of summaries (a forward's other numbers:
        WINO's shadow sums), so they cost no collective of their own; a getter of every
        rank's, (world, *x.shape) float64, once that gather ran."""
        box: dict[str, torch.Tensor] = {}
        self.riders.append((x.double(), box))
        return lambda: box["every"]

    def gather(self, mine: torch.Tensor) -> torch.Tensor:
        """(world, *mine.shape) every rank's summaries, the riders' numbers in the same
        all-gather (one flat float64 tensor: rows and columns may differ)."""
        riders, self.riders = self.riders, []
        if not riders:
            return self.shards.all_gather(mine)
        flat = torch.cat([mine.flatten(), *(x.flatten() for x, _ in riders)])
        every = self.shards.all_gather(flat)  # (world, n)
        at = mine.numel()
        for x, box in riders:
            box["every"] = every[:, at : at + x.numel()].view(-1, *x.shape)
            at += x.numel()
        return every[:, : mine.numel()].view(-1, *mine.shape)

    def working(self, logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """This rank's logits in `dtype`, ids past the real vocabulary and [MASK] at -inf (as
        Sampler.working_logits drops and masks them)."""
        ids = torch.arange(self.start, self.start + logits.shape[-1], device=logits.device)
        dropped = (ids >= self.vocab_size) | (ids == self.mask_id)  # (V_r,)
        return logits.to(dtype).masked_fill(dropped, -math.inf)

    def noisy(self, scores: torch.Tensor, generator) -> torch.Tensor:
        """(B, L, V_r) float64 perturbed scores: the whole vocabulary's noise drawn as one
        process draws it (same generator, same shape), this rank's columns kept."""
        width = self.width if self.drawing.whole_width else self.vocab_size
        draws = generator.sampled() if isinstance(generator, RowDraws) else generator
        noise = self.drawing.noise(draws, scores.shape[:2], width, scores.device)
        mine = noise[..., self.start : self.start + scores.shape[-1]]  # (B, L, <= V_r)
        pad = scores.shape[-1] - mine.shape[-1]  # ids past the noise: -inf scores anyway
        mine = torch.nn.functional.pad(mine, (0, pad)) if pad else mine
        return scores.double() + mine

    def reduce(self, raw, scores, noisy, rows: Rows, least=0, extra=None, sums=False) -> View:
        """The gathered summaries (at least `least` candidates a rank, `extra` numbers per
        column, `sums`: sum p log p whatever the confidence) and the rows' filter thresholds;
        top-p gathers more candidates while theirs do not decide its threshold exactly (one
        host read a round)."""
        k = max([*rows.top_k, 2, least])
        filters = rows.nucleus or any(rows.top_k)
        separate = raw is not scores and not self.family.tempered_confidence  # LLaDA's raw
        needs = Needs(separate, rows.entropy or sums, filters)
        if rows.nucleus:
            k = max(k, NUCLEUS)
        while True:
            k = min(k, self.largest)
            mine = summarize(raw, scores, noisy, k, self.start, needs, extra)
            s = Summaries(self.gather(mine), k)
            view = View(
                s, rows, self.family.tempered_confidence, self.drawing.top_k_first, raw.dtype
            )
            if view.exact is None or k == self.largest or bool(view.exact.all()):
                return view
            k *= 8


class View:
    """What every rank knows after the gather: thresholds, the draws, each confidence kind."""

    def __init__(self, s: Summaries, rows: Rows, tempered: bool, top_k_first: bool, dtype):
        self.s, self.rows, self.tempered = s, rows, tempered
        self.dtype = dtype  # the sampler's (the `random` confidence draws in it)
        k_cut = s.kth_largest(rows.top_k)  # (B, L) -inf: off
        self.cut, self.exact = k_cut, None
        if rows.nucleus:
            first = k_cut if top_k_first else None
            p_cut = s.nucleus(rows.top_p.expand_as(k_cut), first)
            self.cut = torch.maximum(k_cut, p_cut)
            self.exact = (self.cut >= s.floor) | (rows.top_p > 1)
        self.tokens = s.first
        if rows.sampled:
            drawn = s.drawn(self.cut)  # (B, L, 4): noisy, id, score, raw
            self.tokens = torch.where(rows.greedy, s.first, drawn[..., 1].long())
            self.drawn = drawn

    def basis(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(max, denominator) of the distribution confidences read: softmax of the filtered
        scores (Dream, the block families) or of the raw logits (LLaDA)."""
        s = self.s
        return (s.best, s.mass(self.cut)) if self.tempered else (s.raw_best, s.raw_total())

    def chosen(self) -> torch.Tensor:
        """Each draft's basis value (a greedy draft's is the maximum)."""
        top, _ = self.basis()
        if not self.rows.sampled:
            return top
        return torch.where(self.rows.greedy, top, self.drawn[..., 2 if self.tempered else 3])


def candidates(view: View) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L, world k) every rank's candidates' ids and their probability under the
    distribution confidences read (a filtered one's: 0 past its threshold)."""
    top, total = view.basis()
    union = view.s.cand.permute(1, 2, 0, 3, 4).flatten(2, 3)  # (B, L, world k, 4)
    p = torch.exp(union[..., 2 if view.tempered else 3] - top[..., None]) / total[..., None]
    if view.tempered:  # the filtered distribution
        p = torch.where(union[..., 2] >= view.cut[..., None], p, 0.0)
    return union[..., 1].long(), p


def plogp(view: View, eps: float) -> torch.Tensor:
    """sum p log(p + eps) of the distribution confidences read (eps 0: sum p log p, 0 log 0
    = 0): from each rank's sums for an unfiltered one, the candidates for a filtered one."""
    s = view.s
    if not view.tempered:
        return s.plogp(raw=True)
    return torch.where(view.cut > -math.inf, s.filtered_plogp(view.cut, eps), s.plogp(raw=False))


def part(view: View, raw: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """This shard's ids' probabilities under the distribution confidences read (the filtered,
    tempered scores' softmax, or LLaDA's raw one): Sampler.draft's, sliced (B, L, V_r)."""
    top, total = view.basis()
    x = scores if view.tempered else raw
    p = torch.exp(x.double() - top[..., None]) / total[..., None]
    return torch.where(scores >= view.cut[..., None], p, 0.0) if view.tempered else p


def chosen_probability(view: View, tokens, generator) -> torch.Tensor:
    """LLaDA low_confidence / Dream maskgit_plus: probability of the drafted token."""
    top, total = view.basis()
    return torch.exp(view.chosen() - top) / total


def top_two_margin(view: View, tokens, generator) -> torch.Tensor:
    """Dream topk_margin: top-1 minus top-2 probability."""
    top, total = view.basis()
    s = view.s
    second = s.second(view.cut) if view.tempered else s.raw_second()
    return (1.0 - torch.exp(second - top)) / total


def negative_entropy(view: View, tokens, generator) -> torch.Tensor:
    """Dream entropy: sum p log p (the reference adds 1e-10 inside the log: kept exactly for
    a filtered distribution, left out of the per-shard sums of an unfiltered one)."""
    return plogp(view, EPS)


def uniform_confidence(view: View, tokens, generator) -> torch.Tensor:
    """LLaDA random remasking: a uniform random confidence (every rank draws the same)."""
    return uniform(generator, tokens.shape, view.dtype, tokens.device)


KINDS: dict[str, Callable[..., torch.Tensor]] = {
    "low_confidence": chosen_probability,
    "margin": top_two_margin,
    "entropy": negative_entropy,
    "random": uniform_confidence,
}


def block_drafter(
    model: ShardedLM, settings, vocab: int, mask: int, distributions: bool = False
) -> Drafter:
    """The block stepper's drafts from this rank's vocabulary shard: the block family's
    argmax, or its top-k, top-p, multinomial draw, and the draft's p (float32); a kept
    distribution is the shard's part with `distributions` (a grammar's), else the gathered
    candidates (logprobs')."""
    sampler = ShardedSampler.of(model, settings, SAMPLERS["block"], vocab, mask, distributions)

    def drafted(logits: torch.Tensor, samplings, generators, keep: bool = False):
        own = tuple(Sampling(s.temperature, s.top_p, s.top_k) for s in samplings)  # p: chosen
        draws = tuple(None if s.greedy else g for s, g in zip(own, generators, strict=True))
        return sampler.draft(logits, draws, own, keep=keep)  # kept: on the gathered candidates

    return drafted
