"""A rank's summary of its vocabulary shard, and what the gathered summaries of every rank say
about the whole distribution: its maximum and softmax denominator, sum p log p, the top-k
and top-p thresholds, the perturbed maximum of a sampled draw (sharded_sampling.py).

Per column a rank sends (float64, ids exact below 2^53): its best score and that id (its
first maximum), its sum of exp(score - best) and of exp(score - best) (score - best), the
same for the raw logits with their second largest, how many of its scores tie with its K-th
that it did not send, its floor (its K-th, -inf when it sent its whole shard), its best
perturbed score over the shard and over the scores reaching its K-th (each as noisy, id,
score, raw), its top-K candidates by score (the same four), then what the step's rule asks
besides (`extra`: KLASS's sum of exp(score - best) log(q + eps) over its last distribution q).

Also here: KLASS's last distributions per row (`Last`), WINO's shadow summaries, and which ids
a step's distributions hold (`VocabPart`: one process's whole vocabulary or a rank's slice).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dllm_cli.models.collectives import Shards

FIELDS = 18  # numbers per column before the candidates
EPS = 1e-10  # Dream's entropy: p log(p + eps)


@dataclass(frozen=True)
class Needs:
    """What the rows' settings read, so a rank computes only that (the rest is sent as 0)."""

    separate: bool = False  # raw logits and filter scores differ (LLaDA sampled)
    entropy: bool = False  # some row's confidence is sum p log p
    filters: bool = False  # some row filters by top-k or top-p (ties at a cut count)


def exp_sums(x: torch.Tensor, best: torch.Tensor, entropy: bool) -> tuple[torch.Tensor, ...]:
    """(B, L, V), its best (B, L) -> sum exp(x - best) and (`entropy`; else 0) sum e log e of
    e = exp(x - best)."""
    shift = torch.where(torch.isfinite(best), best, 0.0)  # a shard of dropped ids only
    e = (x - shift[..., None]).exp()
    plogp = torch.special.xlogy(e, e).sum(dim=-1) if entropy else torch.zeros_like(best)
    return e.sum(dim=-1), plogp


def winner(noisy: torch.Tensor, ids, scores, raw) -> torch.Tensor:
    """(B, L, 4): the first maximum of `noisy` over the shard, as (noisy, id, score, raw)."""
    top, at = noisy.max(dim=-1, keepdim=True)
    picked = [top, (at + ids).double(), scores.gather(-1, at).double(), raw.gather(-1, at).double()]
    return torch.cat(picked, dim=-1)


def summarize(
    raw, scores, noisy, k: int, start: int, needs: Needs = Needs(), extra=None
) -> torch.Tensor:
    """(B, L, V_r) raw logits, filter scores (raw / T) and perturbed scores (None: greedy) ->
    (B, L, FIELDS + 4k + e) this rank's summary (`extra`: (B, L, e) more numbers, sent last)."""
    b, length, v = scores.shape
    best, index = scores.max(dim=-1)  # the first maximum
    total, plogp = exp_sums(scores, best, needs.entropy)
    n = min(k, v)
    top, at = scores.topk(n, dim=-1)  # (B, L, n)
    if needs.separate:
        raw_top = raw.topk(min(2, v), dim=-1).values
        raw_best = raw_top[..., 0]
        raw_total, raw_plogp = exp_sums(raw, raw_best, needs.entropy)
    else:
        raw_top, raw_best, raw_total, raw_plogp = top, best, total, plogp
    raw_second = raw_top[..., 1] if raw_top.shape[-1] > 1 else torch.full_like(best, -math.inf)
    kth = top[..., -1:]
    unseen = (scores >= kth).sum(dim=-1) - n if needs.filters else torch.zeros_like(index)
    floor = kth[..., 0] if v > k else torch.full_like(best, -math.inf)
    double = lambda x: x.double()  # noqa: E731
    nothing = torch.full((b, length, 4), -math.inf, dtype=torch.float64, device=top.device)
    if noisy is None:  # greedy: no draw to send
        picked = torch.full_like(top, -math.inf, dtype=torch.float64)
        whole = reach = nothing
    else:
        picked = noisy.gather(-1, at)
        whole = winner(noisy, start, scores, raw)
        reach = nothing  # the best draw among the ties with the K-th: only a cut there reads it
        if needs.filters:
            reach = winner(noisy.masked_fill(scores < kth, -math.inf), start, scores, raw)
    cand = [picked, at + start, top, raw.gather(-1, at)]
    cand = torch.stack([double(x) for x in cand], dim=-1)  # (B, L, n, 4)
    if n < k:  # a shard shorter than k: -inf candidates
        filler = torch.tensor([-math.inf, -1.0, -math.inf, -math.inf], dtype=torch.float64)
        cand = torch.cat([cand, filler.to(cand.device).expand(b, length, k - n, 4)], dim=2)
    head = [best, index + start, total, plogp, raw_best, raw_second, raw_total, raw_plogp]
    head = torch.stack([double(x) for x in (*head, unseen, floor)], dim=-1)  # (B, L, 10)
    tail = [] if extra is None else [extra.double()]
    return torch.cat([head, whole, reach, cand.flatten(2), *tail], dim=-1)


def first_best(entries: torch.Tensor) -> torch.Tensor:
    """(..., n, 4) entries -> (..., 4): the largest noisy, the lowest id among equals (as one
    process's argmax takes the first maximum)."""
    noisy, ids = entries[..., 0], entries[..., 1]
    top = noisy.max(dim=-1, keepdim=True).values
    at = torch.where(noisy == top, ids, math.inf).argmin(dim=-1)  # (...)
    index = at[..., None, None].expand(*at.shape, 1, entries.shape[-1])
    return entries.gather(-2, index).squeeze(-2)


class Summaries:
    """Every rank's summary, gathered: (world, B, L, FIELDS + 4k)."""

    def __init__(self, every: torch.Tensor, k: int):
        f = every[..., :10].unbind(-1)
        self.bests, ids, self.totals, self.plogps = f[:4]
        self.raw_bests, self.raw_seconds, self.raw_totals, self.raw_plogps = f[4:8]
        self.unseen, floors = f[8], f[9]
        self.whole, self.reach = every[..., 10:14], every[..., 14:18]  # (world, B, L, 4)
        self.cand = every[..., FIELDS : FIELDS + 4 * k].unflatten(-1, (k, 4))  # (world, B, L, k, 4)
        self.extra = every[..., FIELDS + 4 * k :]  # (world, B, L, e) what summarize's `extra` sent
        self.kth = self.cand[..., -1, 2]  # (world, B, L) each rank's K-th score
        self.floor = floors.max(dim=0).values  # (B, L) below it the candidates may miss some
        self.best, rank = self.bests.max(dim=0)  # (B, L): the lowest rank among equals
        self.first = ids.gather(0, rank[None])[0].long()  # so the lowest id, as argmax's
        self.raw_best = self.raw_bests.max(dim=0).values
        # (B, L, world k) every candidate's score, and its weight exp(score - best)
        self.union = self.cand[..., 2].permute(1, 2, 0, 3).flatten(2)
        self.weights = torch.exp(self.union - self.best[..., None])

    def total(self) -> torch.Tensor:
        """sum of exp(score - best) over the whole vocabulary (empty shards add 0)."""
        return (self.totals * torch.exp(self.bests - self.best)).sum(dim=0)

    def raw_total(self) -> torch.Tensor:
        return (self.raw_totals * torch.exp(self.raw_bests - self.raw_best)).sum(dim=0)

    def raw_second(self) -> torch.Tensor:
        """The second largest raw logit of the whole vocabulary (B, L)."""
        both = torch.cat([self.raw_bests, self.raw_seconds]).movedim(0, -1)  # (B, L, 2 world)
        return both.topk(2, dim=-1).values[..., 1]

    def ties(self, cut: torch.Tensor) -> torch.Tensor:
        """(B, L) scores equal to `cut` that no rank sent (a rank's K-th may tie with more)."""
        return torch.where(self.kth == cut, self.unseen, 0.0).sum(dim=0)

    def mass(self, cut: torch.Tensor) -> torch.Tensor:
        """sum of exp(score - best) over the scores >= cut (-inf: all of them)."""
        kept = torch.where(self.union >= cut[..., None], self.weights, 0.0).sum(dim=-1)
        kept = kept + self.ties(cut) * torch.exp(cut - self.best)
        return torch.where(cut > -math.inf, kept, self.total())

    def kth_largest(self, ks: list[int]) -> torch.Tensor:
        """(B, L) each row's top-k threshold, ties with the k-th kept (-inf: k = 0)."""
        b, length, n = self.union.shape
        most = min(max(ks), n)
        if most == 0:
            return torch.full((b, length), -math.inf, dtype=torch.float64, device=self.union.device)
        top = self.union.topk(most, dim=-1).values  # (B, L, most)
        index = torch.tensor([min(max(k, 1), most) - 1 for k in ks], device=top.device)
        kth = top.gather(-1, index.view(b, 1, 1).expand(b, length, 1))[..., 0]
        off = torch.tensor([k == 0 for k in ks], device=top.device)[:, None]
        return kth.masked_fill(off, -math.inf)

    def nucleus(self, top_p: torch.Tensor, first: torch.Tensor | None) -> torch.Tensor:
        """(B, L) top-p's threshold: the score of the candidate whose cumulative probability
        first passes top_p (kept, as top_p_filter keeps it), over the distribution filtered by
        `first` (block_rules.draft's top-k; None: the whole one); -inf: off or not reached."""
        order = self.union.argsort(dim=-1, descending=True, stable=True)
        ordered, weights = self.union.gather(-1, order), self.weights.gather(-1, order)
        cut = torch.full_like(self.best, -math.inf) if first is None else first
        weights = torch.where(ordered >= cut[..., None], weights, 0.0)
        cumulative = weights.cumsum(dim=-1) / self.mass(cut)[..., None]
        crossing = (cumulative <= top_p[..., None]).sum(dim=-1, keepdim=True)  # (B, L, 1)
        found = crossing[..., 0] < ordered.shape[-1]
        at = ordered.gather(-1, crossing.clamp(max=ordered.shape[-1] - 1))[..., 0]
        return torch.where(found & (top_p <= 1), at, -math.inf)

    def drawn(self, cut: torch.Tensor) -> torch.Tensor:
        """(B, L, 4) the sampled draw: the largest perturbed score among the kept (>= cut)."""
        kept = self.cand[..., 2] >= cut[None, ..., None]  # (world, B, L, k)
        noisy = torch.where(kept, self.cand[..., 0], -math.inf)
        mine = first_best(torch.cat([noisy[..., None], self.cand[..., 1:]], dim=-1))
        # a rank whose K-th is the cut may hold unsent ties: its best over those counts
        mine = torch.where((self.kth == cut)[..., None], self.reach, mine)
        mine = torch.where((cut > -math.inf)[None, ..., None], mine, self.whole)
        return first_best(mine.movedim(0, -2))  # over ranks: the lowest id among equals

    def second(self, cut: torch.Tensor) -> torch.Tensor:
        """The second largest kept score (B, L) (-inf: none)."""
        second = self.union.topk(2, dim=-1).values[..., 1]
        return torch.where(second >= cut, second, -math.inf)

    def plogp(self, raw: bool) -> torch.Tensor:
        """sum p log p of the unfiltered softmax (of the scores, or of the raw logits), from
        each rank's sums: (1/Z) sum exp(x - M)(x - M) - log Z."""
        bests, totals, sums = (
            (self.raw_bests, self.raw_totals, self.raw_plogps)
            if raw
            else (self.bests, self.totals, self.plogps)
        )
        top = bests.max(dim=0).values
        gap = torch.where(torch.isfinite(bests), bests - top, 0.0)
        scale = torch.exp(bests - top)
        z = (totals * scale).sum(dim=0)
        return (scale * (sums + gap * totals)).sum(dim=0) / z - torch.log(z)

    def filtered_plogp(self, cut: torch.Tensor, eps: float = EPS) -> torch.Tensor:
        """sum p log(p + eps) of the filtered softmax: every kept score is a candidate (or
        an unsent tie with the cut); eps 0: sum p log p (0 log 0 = 0, EB's entropy)."""
        z = self.mass(cut)[..., None]
        p = torch.where(self.union >= cut[..., None], self.weights, 0.0) / z
        at = torch.exp(cut - self.best) / z[..., 0]
        if eps:
            return (p * torch.log(p + eps)).sum(dim=-1) + self.ties(cut) * at * torch.log(at + eps)
        xlogy = torch.special.xlogy
        return xlogy(p, p).sum(dim=-1) + self.ties(cut) * xlogy(at, at)


@dataclass(frozen=True)
class Last:
    """A row's last step's distribution (KLASS): this shard's part, and its value on every
    rank's candidates (all of a filtered distribution)."""

    part: torch.Tensor  # (L, V_r) float64
    ids: torch.Tensor  # (L, n) long, the candidates' ids (-1: a shard's filler)
    probs: torch.Tensor  # (L, n) float64
    first: int  # canvas column of slot 0 (a grammar's frontier window moves)


def realigned(x: torch.Tensor, by: int, slots: int, fill: float) -> torch.Tensor:
    """(L', ...) a last step's slots -> (slots, ...) this step's, slot i taking slot i + by's
    value (the same canvas column) and `fill` where the last step had no such slot."""
    if by == 0 and x.shape[0] == slots:
        return x
    out = x.new_full((slots, *x.shape[1:]), fill)
    lo, hi = max(by, 0), min(x.shape[0], slots + by)  # the last step's slots still here
    if hi > lo:
        out[lo - by : hi - by] = x[lo:hi]
    return out


def rows_of(keys) -> list[tuple[int, tuple[int, int]]]:
    """(row, (request id, first column)) of each drafted row a KLASS step measures."""
    return [(r, key) for r, key in enumerate(keys) if key is not None]


def looked_up(last: Last, ids: torch.Tensor, by: int = 0) -> torch.Tensor:
    """(L, n) the last step's probability of each of this step's candidate ids (0: not among
    its candidates, so outside a filtered distribution); slot i was the last step's i + by."""
    known = realigned(last.ids, by, ids.shape[0], -1)  # (L, n')
    probs = realigned(last.probs, by, ids.shape[0], 0.0)
    order = known.argsort(dim=-1)
    known, probs = known.gather(-1, order), probs.gather(-1, order)
    at = torch.searchsorted(known, ids).clamp(max=known.shape[-1] - 1)  # (L, n)
    found = (known.gather(-1, at) == ids) & (ids >= 0)  # (a real id is one rank's: unique)
    return torch.where(found, probs.gather(-1, at), 0.0)


def held(x: torch.Tensor, tokens: torch.Tensor, start: int) -> torch.Tensor:
    """(..., V_r) values of this rank's ids start.., (...) global ids -> (...) each id's value
    where this rank holds it, -inf elsewhere (so the max over ranks is the holder's)."""
    local = tokens - start
    holds = (local >= 0) & (local < x.shape[-1])
    value = x.gather(-1, local.clamp(0, x.shape[-1] - 1)[..., None])[..., 0]
    return value.masked_fill(~holds, -math.inf)


def shadow_summary(shadows: torch.Tensor, tokens: torch.Tensor, start: int) -> torch.Tensor:
    """(R, L, V_r) shadow logits, (R, L) the held tokens -> (R, L, 3) this rank's (max, sum of
    exp(logit - max), the token's logit or -inf where another rank holds it), float64: what
    WINO's softmax over every logit (wino.ShadowForwards._verify) needs from the shard."""
    x = shadows.double()
    top = x.max(dim=-1).values  # (R, L)
    total = (x - top[..., None]).exp().sum(dim=-1)
    return torch.stack([top, total, held(x, tokens, start)], dim=-1)


def shadow_probability(every: torch.Tensor) -> torch.Tensor:
    """(world, R, L, 3) every rank's shadow_summary -> (R, L) softmax(logits)[token] over the
    whole vocabulary: exp(z - M) / sum_r s_r exp(m_r - M)."""
    tops, totals, own = every.unbind(-1)
    top = tops.max(dim=0).values
    return torch.exp(own.max(dim=0).values - top) / (totals * torch.exp(tops - top)).sum(dim=0)


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

    def pick(self, lp: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
        """(R, L, V_part) log-probabilities and (R, L) tokens -> each token's (R, L) and the
        whole vocabulary's k largest (R, L, k) with their ids: one all-gather of 2k + 1
        numbers a slot (a slice narrower than k sends all it holds, -inf fillers after)."""
        chosen = held(lp, tokens, self.start)  # the holder's alone
        n = min(k, lp.shape[-1])  # a narrow slice: every id it holds
        values, ids = lp.topk(n, dim=-1)
        pad = (*values.shape[:-1], k - n)  # one shape on every rank: -inf fillers, id -1
        values = torch.cat([values, values.new_full(pad, -math.inf)], dim=-1)
        ids = torch.cat([ids + self.start, ids.new_full(pad, -1)], dim=-1)
        packed = torch.cat([chosen[..., None], values, ids.double()], dim=-1)
        every = self.shards.all_gather(packed)  # (world, R, L, 1 + 2k)
        rows, cols = tokens.shape
        values = every[..., 1 : 1 + k].permute(1, 2, 0, 3).reshape(rows, cols, -1)
        ids = every[..., 1 + k :].permute(1, 2, 0, 3).reshape(rows, cols, -1).long()
        values, at = values.topk(k, dim=-1)
        return every[..., 0].max(dim=0).values, values, ids.gather(-1, at)

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
