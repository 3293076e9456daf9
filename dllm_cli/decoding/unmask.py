"""Which masked positions of the current block to commit this step.

The engine asks a `Committer` for a decision each step. The built-in one applies a rule from
`UNMASK_RULES`; a guided-diffusion committer (FlashDLM, arXiv 2505.21467: an AR model verifies
the drafts) plugs in at the same seam and reports how many drafts it accepted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from dllm_cli.decoding.canvas import Block, Canvas
from dllm_cli.settings import DecodeSettings


@dataclass
class StepContext:
    """Everything a committer may look at; tensors cover the current block's columns."""

    drafts: torch.Tensor  # (B, L) long: proposed token per column
    confidence: torch.Tensor  # (B, L): -inf where the column is not a candidate
    candidates: torch.Tensor  # (B, L) bool: still masked (only these may be committed)
    block: Block
    block_step: int  # 0-based step within the block
    masks_at_start: torch.Tensor  # (B,) long: masks in the block when it began
    canvas: Canvas  # state before this step's commits (rows map to the original batch)
    generator: torch.Generator

    @property
    def last_step(self) -> bool:
        """The block's final planned step: schedules reveal everything left."""
        return self.block_step >= self.block.steps - 1

    @property
    def masks_now(self) -> torch.Tensor:
        return self.candidates.sum(dim=1)  # (B,)


@dataclass
class Decision:
    """Columns to commit (B, L) and, for verifying committers, how many drafts passed."""

    commit: torch.Tensor
    accepted: int | None = None


class Committer(Protocol):
    """Who decides which drafts become tokens (a rule, or a guide model)."""

    def __call__(self, ctx: StepContext) -> Decision: ...


def rank_by_confidence(confidence: torch.Tensor) -> torch.Tensor:
    """(B, L) rank of each column, 0 = most confident; ties go to the leftmost column."""
    order = confidence.argsort(dim=1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    span = torch.arange(order.shape[1], device=order.device).expand_as(order)
    return ranks.scatter_(1, order, span)


def commit_top(ctx: StepContext, counts: torch.Tensor, confidence=None) -> torch.Tensor:
    """Commit the `counts[r]` most confident candidates of each row."""
    conf = ctx.confidence if confidence is None else confidence
    return (rank_by_confidence(conf) < counts[:, None]) & ctx.candidates


def llada_counts(ctx: StepContext, eps: float) -> torch.Tensor:
    """LLaDA's linear schedule: masks // steps each step, the first masks % steps one more."""
    base = ctx.masks_at_start // ctx.block.steps
    extra = (ctx.block_step < ctx.masks_at_start % ctx.block.steps).long()
    return base + extra


def dream_counts(ctx: StepContext, eps: float) -> torch.Tensor:
    """Dream's schedule: t, s from linspace(1, eps, steps + 1); reveal int(masks * (1 - s/t))."""
    times = torch.linspace(1, eps, ctx.block.steps + 1, device=ctx.drafts.device)
    t, s = times[ctx.block_step], times[ctx.block_step + 1]
    return (ctx.masks_now.float() * (1 - s / t)).long()


# `schedule` setting -> counts per step ("family" means the model family's own, see sampling.py)
SCHEDULES: dict[str, Callable[[StepContext, float], torch.Tensor]] = {
    "linear": llada_counts,
    "dream": dream_counts,
}


@dataclass(frozen=True)
class RuleParams:
    threshold: float
    factor: float
    eps: float
    alg_temp: float
    schedule: Callable[[StepContext, float], torch.Tensor]


def fixed_rule(p: RuleParams, ctx: StepContext) -> torch.Tensor:
    """A planned number per step (the family's schedule), everything left on the last step."""
    counts = ctx.masks_now if ctx.last_step else p.schedule(ctx, p.eps)
    if p.alg_temp > 0:
        # Dream's alg_temp: positions sampled from softmax(conf / alg_temp) without replacement,
        # drawn here by Gumbel-top-k.
        u = torch.rand(ctx.confidence.shape, generator=ctx.generator, device=ctx.drafts.device)
        noisy = ctx.confidence.double() / p.alg_temp - torch.log(-torch.log(u.double()))
        return commit_top(ctx, counts, noisy)
    return commit_top(ctx, counts)


def threshold_rule(p: RuleParams, ctx: StepContext) -> torch.Tensor:
    """Fast-dLLM (arXiv 2505.22618): every candidate with confidence >= tau, at least the best."""
    best = commit_top(ctx, torch.ones_like(ctx.masks_now))
    return ((ctx.confidence >= p.threshold) & ctx.candidates) | best


def factor_rule(p: RuleParams, ctx: StepContext) -> torch.Tensor:
    """Fast-dLLM's factor rule: the largest n with (n + 1) * (1 - c_n) < f, at least one."""
    ordered = ctx.confidence.sort(dim=1, descending=True).values  # (B, L), -inf last
    n = torch.arange(1, ordered.shape[1] + 1, device=ordered.device)
    passes = ((n + 1) * (1 - ordered) < p.factor).long().cumprod(dim=1)
    counts = passes.sum(dim=1).clamp(min=1)
    return commit_top(ctx, counts)


def origin_rule(p: RuleParams, ctx: StepContext) -> torch.Tensor:
    """Dream's origin: each mask revealed independently with probability 1 - s/t."""
    if ctx.last_step:
        return ctx.candidates.clone()
    times = torch.linspace(1, p.eps, ctx.block.steps + 1, device=ctx.drafts.device)
    chance = 1 - times[ctx.block_step + 1] / times[ctx.block_step]
    u = torch.rand(ctx.candidates.shape, generator=ctx.generator, device=ctx.drafts.device)
    return (u < chance) & ctx.candidates


UNMASK_RULES: dict[str, Callable[[RuleParams, StepContext], torch.Tensor]] = {
    "fixed": fixed_rule,
    "threshold": threshold_rule,
    "factor": factor_rule,
    "origin": origin_rule,
}


class RuleCommitter:
    """The default committer: one of UNMASK_RULES with this run's parameters."""

    def __init__(self, settings: DecodeSettings, family_schedule: str):
        self.rule = UNMASK_RULES[settings.unmask]
        schedule = family_schedule if settings.schedule == "family" else settings.schedule
        self.params = RuleParams(
            threshold=settings.threshold,
            factor=settings.factor,
            eps=settings.eps,
            alg_temp=settings.alg_temp,
            schedule=SCHEDULES[schedule],
        )

    def __call__(self, ctx: StepContext) -> Decision:
        return Decision(self.rule(self.params, ctx))
