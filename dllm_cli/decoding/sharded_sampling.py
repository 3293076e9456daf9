"""Sampling from vocabulary shards: every rank's greedy drafts and confidences from one
all-gather of a few numbers per column, so the logits of tensor parallelism are never gathered.

Each rank reduces its (rows, columns, own vocabulary) shard to a few numbers per column (its
best logit and id, its sum of exp, its top candidates) and one all-gather of those gives every
rank the same greedy drafts and confidences, so every rank takes the same decisions and runs the
same collectives in the same order; what a rule draws at random, every rank draws alike (the
same seed). Sampled drafts and the settings that need the whole distribution are refused
(`refuse_unsupported`). The block stepper (SDAR, LLaDA2.x) drafts through `block_drafter`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dllm_cli.decoding.block_rules import Drafter
from dllm_cli.decoding.row_sampling import RowDraws, uniform
from dllm_cli.decoding.sampling import Family
from dllm_cli.errors import SettingsError
from dllm_cli.models.sharding import ShardedLM, Shards

UNMASKS = ("fixed", "threshold", "factor", "prefix", "origin")  # no whole distributions
CONFIDENCES = ("low_confidence", "margin", "random")
# block_rules.draft's greedy draft: float32, p from softmax(raw logits); the schedule is unread
# (block_rules.schedule splits each block)
BLOCK = Family("block", torch.float32, tempered_confidence=False, schedule="linear")


def refuse_unsupported(settings) -> None:
    """One line for what tensor parallelism does not compute yet (rather than computing it
    wrong): sampled drafts, top-p, rules that read whole distributions."""
    why = None
    if settings.temperature > 0:
        why = "sampled drafts (--temperature above 0)"
    elif settings.top_p is not None and settings.top_p < 1.0:
        why = "top-p filtering (--top-p)"
    elif settings.alg_temp > 0:
        why = "sampled positions (alg_temp)"
    elif settings.unmask not in UNMASKS:
        why = f"--unmask {settings.unmask} (supported: {', '.join(UNMASKS)})"
    elif settings.confidence not in CONFIDENCES:
        why = f"--confidence {settings.confidence} (supported: {', '.join(CONFIDENCES)})"
    if why:
        raise SettingsError(f"--tensor-parallel does not support {why} yet")


class ShardedSampler:
    """Greedy drafts and confidences from every rank's vocabulary shard, one all-gather of a
    few numbers per column (decoding/sampling.py's Sampler computes them from whole logits).

    Each rank sends per column: its best logit and that token's id (its first maximum), its
    sum of exp(logit - best), its `k` largest logits and how many of its logits reach its
    top-k-th (ties). From these every rank gets the global first maximum and the softmax
    denominator of the whole distribution, or of the top-k filtered one (Dream's confidence).
    """

    def __init__(
        self, shards: Shards, start: int, smallest: int, settings, family, vocab, mask,
        distributions: bool = False,
    ):  # fmt: skip
        refuse_unsupported(settings)
        self.shards, self.start, self.family = shards, start, family
        self.vocab_size, self.mask_id = vocab, mask
        self.distributions = distributions  # also each column's distribution over the shard
        self.smallest, self.confidence = smallest, settings.confidence
        self.top_k = self.filter_of(settings.top_k, settings.confidence)

    @classmethod
    def of(
        cls, model: ShardedLM, settings, family, vocab: int, mask: int, distributions=False
    ) -> ShardedSampler:
        """The sampler for a split model's own range of the vocabulary."""
        start, smallest = model.vocab_start, model.vocab_smallest
        return cls(model.shards, start, smallest, settings, family, vocab, mask, distributions)

    def __call__(self, logits: torch.Tensor, generator) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, confidence, _ = self.draft(logits, generator)
        return tokens, confidence

    def draft(self, logits: torch.Tensor, generator):
        """(B, L, own vocabulary) logits -> drafts (B, L), confidences (B, L) and, when kept
        (`distributions`), the shard's part of the distribution they come from (B, L, V_r)."""
        top_k, confidence = self.values(generator)
        dtype = self.family.dtype or (logits.dtype if logits.dtype.itemsize >= 4 else None)
        work = self.working(logits, dtype or torch.float32)
        k = max(top_k, 2 if confidence == "margin" else 1)  # candidates each rank sends
        s = self.gather(work, k, top_k)
        if top_k:
            denominator, second, kth = self.filtered(s, top_k)
        else:
            denominator, second, kth = s.denominator(), s.second(), None
        probs = self.part(work, s.best, denominator, kth) if self.distributions else None
        if confidence == "random":  # LLaDA's random remasking: every rank draws the same
            return s.tokens, uniform(generator, s.tokens.shape, s.best.dtype, s.best.device), probs
        if confidence != "margin":
            return s.tokens, 1.0 / denominator, probs
        return s.tokens, (1.0 - torch.exp(second - s.best)) / denominator, probs

    @staticmethod
    def part(work, best, denominator, kth) -> torch.Tensor:
        """This shard's ids' probabilities under the whole (or top-k filtered: ids below the
        global k-th dropped) softmax: Sampler.draft's distribution, sliced (B, L, V_r)."""
        scaled = torch.exp(work - best[..., None]) / denominator[..., None]
        return scaled if kth is None else torch.where(work >= kth[..., None], scaled, 0.0)

    def values(self, generator) -> tuple[int, str]:
        """This step's top-k (0: none, or LLaDA's, which drafts from raw logits) and
        confidence: the rows' own when they bring them (requests: greedy, agreeing with each
        other), else the run's."""
        if not isinstance(generator, RowDraws):
            return self.top_k, self.confidence
        rows = generator.samplings
        values = {(self.filter_of(s.top_k, s.confidence), s.confidence) for s in rows}
        nucleus = any(s.top_p is not None and s.top_p < 1.0 for s in rows)
        sampled = not generator.all_greedy or nucleus
        if sampled or len(values) > 1 or rows[0].confidence not in CONFIDENCES:
            raise SettingsError(
                "--tensor-parallel does not support per-request temperature or top_p, rows "
                "that differ in top_k or confidence, or a confidence other than "
                f"{', '.join(CONFIDENCES)} yet"
            )
        return values.pop()

    def filter_of(self, top_k: int | None, confidence: str) -> int:
        """The top-k a confidence filters by (Dream's; 0: none), refused where a rank holds
        fewer ids than it would send."""
        top_k = (top_k or 0) if self.family.tempered_confidence else 0
        k = max(top_k, 2 if confidence == "margin" else 1)
        if k > self.smallest:
            raise SettingsError(
                f"--tensor-parallel {self.shards.world}: top_k {k} exceeds a rank's "
                f"{self.smallest} vocabulary ids"
            )
        return top_k

    def argmax(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy drafts and their probability under softmax(raw logits), at least float32."""
        dtype = logits.dtype if logits.dtype.itemsize >= 4 else torch.float32
        s = self.gather(self.working(logits, dtype), 1)
        return s.tokens, 1.0 / s.denominator()

    def working(self, logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """This rank's logits in `dtype`, ids past the real vocabulary and [MASK] at -inf (as
        Sampler.working_logits drops and masks them)."""
        ids = torch.arange(self.start, self.start + logits.shape[-1], device=logits.device)
        dropped = (ids >= self.vocab_size) | (ids == self.mask_id)  # (V_r,)
        return logits.to(dtype).masked_fill(dropped, -math.inf)

    def gather(self, work: torch.Tensor, k: int, top_k: int = 0) -> Summaries:
        """Every rank's summary of its (B, L, V_r) shard, in one all-gather: k candidates,
        ties counted with the top_k-th (the first when 0)."""
        best, index = work.max(dim=-1)  # (B, L): the first maximum
        shift = torch.where(torch.isfinite(best), best, 0.0)  # a shard of padding ids only
        total = (work - shift[..., None]).exp().sum(dim=-1)  # (B, L)
        top = work.topk(k, dim=-1).values  # (B, L, k)
        kth = top[..., (top_k or 1) - 1 : top_k or 1]
        ties = (work >= kth).sum(dim=-1).to(work.dtype)  # (B, L)
        ids = (index + self.start).to(work.dtype)  # exact: ids < 2^24
        columns = [best[..., None], ids[..., None], total[..., None], ties[..., None], top]
        every = self.shards.all_gather(torch.cat(columns, dim=-1))  # (world, B, L, 4 + k)
        return Summaries(every)

    def filtered(self, s: Summaries, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dream: the softmax denominator over the global top-k (ties with the k-th kept, as
        top_k_filter keeps them), the second largest kept logit (-inf: none), the k-th."""
        mine = s.top[..., :k]  # (world, B, L, k)
        union = mine.permute(1, 2, 0, 3).flatten(2)  # (B, L, world k)
        kth = union.topk(k, dim=-1).values[..., -1]  # (B, L)
        kept = torch.where(union >= kth[..., None], torch.exp(union - s.best[..., None]), 0.0)
        # A rank whose own k-th equals the global k-th may hold more ties than it sent.
        more = torch.where(mine[..., -1] == kth, s.ties - k, 0.0).sum(dim=0)  # (B, L)
        denominator = kept.sum(dim=-1) + more * torch.exp(kth - s.best)
        second = s.second()
        return denominator, torch.where(second >= kth, second, -math.inf), kth


def block_drafter(model: ShardedLM, settings, vocab: int, mask: int) -> Drafter:
    """The block stepper's drafts from this rank's vocabulary shard: block_rules.draft's
    temperature 0 (argmax, its softmax probability in float32) from one all-gather."""
    sampler = ShardedSampler.of(model, settings, BLOCK, vocab, mask)

    def drafted(logits: torch.Tensor, s, generator) -> tuple[torch.Tensor, torch.Tensor]:
        if not s.greedy:  # a --json-input line's own temperature (the run's is refused)
            raise SettingsError("--tensor-parallel does not support sampled drafts yet")
        summary = sampler.gather(sampler.working(logits, BLOCK.dtype), 1)  # (B, L) each
        return summary.tokens, 1.0 / summary.denominator()

    return drafted


@dataclass(frozen=True)
class VocabPart:
    """Which ids a step's distributions hold (their last dimension): one process's hold the
    whole vocabulary; a tensor-parallel rank's hold its shard, ids `start`.. of `total`."""

    start: int = 0
    total: int | None = None  # the real vocabulary (None: the distributions' own width)
    shards: Shards | None = None

    @classmethod
    def of(cls, model, vocab: int) -> VocabPart:
        """The part a model's sampler gives (`vocab`: the real vocabulary's size)."""
        if model.shards is None:
            return WHOLE
        return cls(model.vocab_start, vocab, model.shards)

    def ids(self, full: torch.Tensor, width: int, fill) -> torch.Tensor:
        """(..., width) this part's columns of a (..., whole vocabulary) tensor, `fill` past
        its end (the embedding's padding ids)."""
        mine = full[..., self.start : self.start + width]
        pad = mine.new_full((*mine.shape[:-1], width - mine.shape[-1]), fill)
        return torch.cat([mine, pad], dim=-1)

    def best(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(F, V_part) scores -> the whole vocabulary's best score and its id (the lowest
        among equals, as argmax's), (F,) each: one all-gather of two numbers a row."""
        top, index = scores.max(dim=-1)
        if self.shards is None:
            return top, index
        ids = (index + self.start).to(scores.dtype)  # exact: ids < 2^24
        every = self.shards.all_gather(torch.stack([top, ids], dim=-1))  # (world, F, 2)
        top, rank = every[..., 0].max(dim=0)  # the lowest rank among equals
        return top, every[..., 1].gather(0, rank[None])[0].long()


WHOLE = VocabPart()  # one process: every id


class Summaries:
    """The gathered per-column summaries, (world, B, L, 4 + k): best, id, sum, ties, top k."""

    def __init__(self, every: torch.Tensor):
        self.bests, ids, self.totals, self.ties = every.unbind(-1)[:4]
        self.top = every[..., 4:]  # (world, B, L, k)
        self.best, rank = self.bests.max(dim=0)  # (B, L): the lowest rank among equals
        self.tokens = ids.gather(0, rank[None])[0].long()  # so the lowest id, as argmax's

    def denominator(self) -> torch.Tensor:
        """sum of exp(logit - best) over the whole vocabulary (empty shards add 0)."""
        scale = torch.exp(self.bests - self.best)  # (world, B, L); a -inf shard: 0
        return (self.totals * scale).sum(dim=0)

    def second(self) -> torch.Tensor:
        """The second largest logit of the whole vocabulary (B, L)."""
        union = self.top.permute(1, 2, 0, 3).flatten(2)  # (B, L, world k)
        return union.topk(2, dim=-1).values[..., 1]
