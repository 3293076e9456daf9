"""Parallel unmasking rules from the literature beyond Fast-dLLM's threshold and factor.

KLASS (Kim et al., arXiv 2511.05664, "KL-Adaptive Stability Sampling", NeurIPS 2025; public
code shkim0116/KLASS, `stable_confident_decode`): a mask is ready when its confidence is above
a threshold and the KL divergence between its distributions at consecutive steps stayed below
`kl_threshold` for the last `kl_history` steps; every ready mask is committed, and a step with
none ready commits the family schedule's number of most confident masks instead.

EB-Sampler (Ben-Hamu et al., arXiv 2505.24857, "Accelerated Sampling from Masked Diffusion
Models via Entropy Bounded Unmasking"): order the masked columns by an error proxy (the run's
confidence kind: the paper's confidence, margin or entropy) and commit the longest prefix U of
that order whose entropies satisfy sum_{l in U} H_l - max_{l in U} H_l <= gamma, at least
one column. The public transcriptions order by entropy (`--confidence entropy` here), where
the max is the last column taken. gamma = 0 commits one token per step (plus any exactly
certain ones); larger gamma commits more. Entropies are those of the distribution the
confidence comes from (sampling.Sampler.draft), inside the current block as every rule of the
engine works (block_length = gen_length is the reference's single pass).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm_cli.decoding.ranking import top_columns
from dllm_cli.decoding.shard_summaries import Last, realigned

KL_EPS = 1e-12  # the reference's: log(p + eps) on both sides
INF = float("inf")


def entropy_bounded_counts(
    entropy: torch.Tensor, confidence: torch.Tensor, candidates: torch.Tensor, gamma: float
) -> torch.Tensor:
    """(B,) how many candidates EB-Sampler commits: the longest prefix of the confidence order
    whose entropies, all but the largest, sum to <= gamma; at least one where a row has a mask."""
    conf = confidence.masked_fill(~candidates, float("-inf"))
    order = conf.argsort(dim=1, descending=True, stable=True)  # (B, L), as top_columns ranks
    inside = candidates.gather(1, order)
    h = entropy.gather(1, order).masked_fill(~inside, 0.0)
    spent = h.cumsum(dim=1) - h.cummax(dim=1).values  # non-decreasing along the order
    passes = (spent <= gamma) & inside
    masks = candidates.sum(dim=1)
    return passes.sum(dim=1).clamp(min=1).minimum(masks)


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """(B, L, V) distributions -> (B, L) entropies in nats (0 log 0 = 0)."""
    return -torch.special.xlogy(probs, probs).sum(dim=-1)


def eb_rule(p, ctx) -> torch.Tensor:
    """EB-Sampler's step: the most confident candidates while their entropy stays under gamma
    (`ctx.entropy`: the step measures it, from whole distributions or a rank's shard sums)."""
    h = ctx.entropy  # (B, L) float64
    counts = entropy_bounded_counts(h, ctx.confidence, ctx.candidates, p.s.eb_gamma)
    return top_columns(ctx.confidence, ctx.candidates, counts)


@dataclass
class Track:
    """One request's KLASS history in its current block: last distribution, recent KLs."""

    first: int | None  # canvas column of slot 0 at its last step (None: no step yet)
    # last step's distribution: (L, V) float64 on one process; a tensor-parallel rank's
    # shard of it (`Last`, kept by its sampler, which measures the KL)
    last: torch.Tensor | Last | None
    kls: torch.Tensor | None  # (L, H) float64, the last H step-to-step KLs (inf: not seen yet)


class KlassMemory:
    """Every request's KLASS history, keyed by request id: its one owner on one process and on
    a tensor-parallel rank (whose sampler keeps its shard here), freed by `forget` alone."""

    def __init__(self) -> None:
        self.tracks: dict[int, Track] = {}

    def last(self, key: int | None) -> torch.Tensor | Last | None:
        """A request's last step's distribution (None: no step yet)."""
        track = self.tracks.get(key)
        return None if track is None else track.last

    def keep(self, key: int, last: Last) -> None:
        """A tensor-parallel sampler's shard of this step's distribution, for the next KL."""
        track = self.tracks.get(key)
        if track is None:
            self.tracks[key] = Track(None, last, None)
        else:
            track.last = last

    def stable(self, ctx, history: int) -> torch.Tensor:
        """(B, L, H) each slot's last H step-to-step KLs (inf before the block's H+1-th step),
        after recording this step's distributions (or, under tensor parallelism, the step's KLs
        the sampler measured from its shards: `ctx.kl`). History follows canvas columns: a
        frontier walk's window (a grammar) moves and narrows between steps."""
        measured = None if ctx.kl is None else ctx.kl.cpu()  # (B, L) None: from the distributions
        probs = None if measured is not None else ctx.probs.to(torch.float64)  # (B, L, V)
        slots = ctx.drafts.shape[1]
        out = []
        for r, key in enumerate(ctx.canvas.request_ids.tolist()):
            first = ctx.block.start if ctx.block is not None else int(ctx.columns[r, 0])
            step = ctx.block_step if isinstance(ctx.block_step, int) else int(ctx.block_step[r])
            p = None if probs is None else probs[r]  # (L, V)
            track = self.tracks.get(key)
            last = None if track is None else track.last  # (the sampler's, under TP: kept)
            if step == 0 or track is None or track.kls is None:
                # A new block (or the request's first step): no history yet.
                where = "cpu" if p is None else p.device
                kls = torch.full((slots, history), INF, dtype=torch.float64, device=where)
            else:
                by = first - track.first  # slot i was slot i + by at the last step
                kl = measured[r] if p is None else step_kl(p, realigned(last, by, slots, 1.0))
                kl = torch.where(seen(by, track.kls.shape[0], slots, kl.device), kl, INF)
                kls = torch.cat([realigned(track.kls, by, slots, INF)[:, 1:], kl[:, None]], dim=1)
            self.tracks[key] = Track(first, last if p is None else p, kls)
            out.append(kls)
        return torch.stack(out).to(ctx.drafts.device)  # (B, L, H)

    def forget(self, requests: list[int]) -> None:
        """Requests that left (finished, aborted, dropped: `Committer.leave`): their tracks go,
        a slot's (L, V) distributions or a rank's shard of them."""
        for key in requests:
            self.tracks.pop(key, None)


def seen(by: int, before: int, slots: int, device) -> torch.Tensor:
    """(slots,) bool: which of this step's slots the last step's `before` slots covered."""
    at = torch.arange(slots, device=device) + by
    return (at >= 0) & (at < before)


def step_kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(..., V) this step's and last step's distributions -> (...) KL(p || q), the reference's
    log(p + eps) on both sides."""
    return (p * (torch.log(p + KL_EPS) - torch.log(q + KL_EPS))).sum(-1)


def klass_rule(p, ctx) -> torch.Tensor:
    """KLASS's step: every mask confident (> threshold) and stable (KL < kl_threshold for the
    last kl_history steps); none ready: the schedule's count of most confident masks."""
    kls = p.memory.stable(ctx, p.s.kl_history)  # (B, L, H)
    stable = (kls < p.s.kl_threshold).all(dim=-1)
    ready = stable & (ctx.confidence > p.s.threshold) & ctx.candidates  # (B, L)
    fallback = p.fallback(p, ctx)  # the schedule's top-k (everything on the block's last step)
    return torch.where(ready.any(dim=1, keepdim=True), ready, fallback)
