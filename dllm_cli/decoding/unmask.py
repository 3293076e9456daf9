"""Which masked positions of the current block to commit this step.

The engine asks a `Committer` for a decision each step. The built-in one applies a rule from
`UNMASK_RULES`; a guided-diffusion committer (FlashDLM, arXiv 2505.21467: an AR model verifies
the drafts) plugs in at the same seam and reports how many drafts it accepted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from dllm_cli.decoding.canvas import Block, Canvas
from dllm_cli.decoding.credit import credit_memory, credit_rule
from dllm_cli.decoding.position_rules import sdlm_rule
from dllm_cli.decoding.ranking import confident_columns, top_columns
from dllm_cli.decoding.row_sampling import RowDraws, uniform
from dllm_cli.decoding.rules import KlassMemory, eb_rule, klass_rule
from dllm_cli.decoding.wino import wino_rule
from dllm_cli.settings import DecodeSettings


@dataclass
class StepContext:
    """Everything a committer may look at; tensors cover each row's columns this step.

    Rows in lockstep share one block: `block` is it and `block_step` an int. Rows at their own
    places (guided decoding, per-row progress) have `block` None, `block_step` and `planned`
    (B,) tensors, and `columns` says which canvas column each slot is (padding: not a
    candidate). A row's slots are its block's columns, or for a frontier walk (guided) the
    masked columns from its first mask to the end of its draft window.
    """

    drafts: torch.Tensor  # (B, L) long: proposed token per column
    confidence: torch.Tensor  # (B, L): -inf where the column is not a candidate
    candidates: torch.Tensor  # (B, L) bool: still masked (only these may be committed)
    block: Block | None  # the rows' shared block (None: each row has its own)
    block_step: int | torch.Tensor  # 0-based step within the block (per row: (B,) long)
    masks_at_start: torch.Tensor  # (B,) long: masks in the block when it began
    canvas: Canvas  # state before this step's commits (rows map to the original batch)
    generator: torch.Generator | RowDraws  # RowDraws: each row draws from its own request's
    columns: torch.Tensor | None = None  # (B, L) long canvas columns (None: the block's)
    planned: torch.Tensor | None = None  # (B,) steps planned for each row's block
    host_steps: list[tuple[int, int]] | None = None  # (block_step, planned) per row, on host
    probs: torch.Tensor | None = None  # (B, L, V) each slot's distribution (rules that ask)
    verify: torch.Tensor | None = None  # (B, L) WINO: shadow probability of earlier commits
    entropy: torch.Tensor | None = None  # (B, L) float64 each slot's entropy (rules that ask)
    kl: torch.Tensor | None = None  # (B, L) float64 KL from each slot's last step (TP: KLASS)

    @property
    def steps_planned(self) -> int | torch.Tensor:
        """Steps the row's block may take: the shared block's, or per row."""
        return self.block.steps if self.planned is None else self.planned

    @property
    def last_step(self) -> bool | torch.Tensor:
        """The block's final planned step: schedules reveal everything left."""
        return self.block_step >= self.steps_planned - 1

    @property
    def masks_now(self) -> torch.Tensor:
        return self.candidates.sum(dim=1)  # (B,)


@dataclass
class Decision:
    """Columns to commit (B, L) and, for verifying committers, what the verifier did.

    `tokens` (B, L), when given, replaces the drafts at committed columns (a guide's own
    token on a rejection); `corrected` (B, L) marks those columns. `accepted` counts drafts a
    verifier passed, `forwards` the verifier's model forwards and `seconds` its time.
    """

    commit: torch.Tensor
    accepted: int | None = None
    tokens: torch.Tensor | None = None
    corrected: torch.Tensor | None = None
    forwards: int = 0
    seconds: float = 0.0
    remask: torch.Tensor | None = None  # (B, L) committed columns to mask again (WINO)


class Committer:
    """Who decides which drafts become tokens (a rule, or a guide model): subclass it.

    Traits are declared here with their defaults, and a committer overrides what differs (the
    masked stepper reads them directly): `frontier = True` walks each row's first mask (guided
    decoding, guided.py), drafting `draft_window` columns from it (None: to the canvas end),
    argmax unless `greedy_drafts = False` (sampled as the request samples: grammar_committer.py);
    `needs_probs`: the step keeps each slot's distribution; `needs_shadow`: WINO's shadow block
    verifies earlier commits; `redrafts`: it may replace drafts (credit); `joins = False`: it
    keeps one state per batch, so it is served in static batches only; `walks_blocks`: it
    verifies runs the block stepper hands it (`walk`: a grammar), so block-causal models take it;
    `reads_entropy`: the step gives each slot's entropy (`StepContext.entropy`); `reads_kl`:
    each slot's KL from its last step's distribution, which a tensor-parallel sampler measures
    from its shards (`StepContext.kl`; one process keeps the distributions and the rule
    measures it).

    Hooks (no-ops here): `start(batch)` when a decode of `batch` rows begins (0: rows join
    through `admit`), `select(keep)` when only the rows at indices `keep` go on, `admit(prompts,
    order)` when rows for `prompts` (token ids) join after the current ones and rows are then
    reordered as `order` says (continuous batching), `leave(ids)` when requests left the
    decode, `shard(sampler)` on a tensor-parallel rank.
    """

    frontier: bool = False
    draft_window: int | None = None
    greedy_drafts: bool = True
    needs_probs: bool = False
    needs_shadow: bool = False
    redrafts: bool = False
    joins: bool = True
    walks_blocks: bool = False
    reads_entropy: bool = False
    reads_kl: bool = False

    def start(self, batch: int) -> None:
        """A decode of `batch` rows begins."""

    def select(self, keep: torch.Tensor) -> None:
        """Only the rows at indices `keep` go on."""

    def admit(self, prompts: list[list[int]], order: torch.Tensor) -> None:
        """Rows for `prompts` join, then rows are reordered as `order` says."""

    def leave(self, requests: list[int]) -> None:
        """Requests (ids) that left the decode: state kept for them can go."""

    def shard(self, sampler) -> None:
        """A tensor-parallel rank's sampler (sharded_sampling.ShardedSampler): the
        distributions this committer reads are its vocabulary's part."""

    def __call__(self, ctx: StepContext) -> Decision:
        raise NotImplementedError


def llada_counts(ctx: StepContext, eps: float) -> torch.Tensor:
    """LLaDA's linear schedule: masks // steps each step, the first masks % steps one more."""
    steps = ctx.steps_planned
    base = ctx.masks_at_start // steps
    extra = (ctx.block_step < ctx.masks_at_start % steps).long()
    return base + extra


def timesteps(ctx: StepContext, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dream's (t, s) = ts[step], ts[step + 1] of ts = linspace(1, eps, steps + 1), per row."""
    device = ctx.drafts.device
    if ctx.planned is None:
        times = torch.linspace(1, eps, ctx.block.steps + 1, device=device)
        return times[ctx.block_step], times[ctx.block_step + 1]
    # Each row's own linspace (blocks may plan different numbers of steps), so a row gets
    # exactly the numbers it would get decoded alone.
    host = ctx.host_steps
    if host is None:  # a context built without host copies: read them (a device read)
        host = list(zip(ctx.block_step.tolist(), ctx.planned.tolist(), strict=True))
    pairs = [torch.linspace(1, eps, n + 1, device=device)[min(k, n - 1) :][:2] for k, n in host]
    both = torch.stack(pairs)  # (B, 2)
    return both[:, 0], both[:, 1]


def dream_counts(ctx: StepContext, eps: float) -> torch.Tensor:
    """Dream's schedule: t, s from linspace(1, eps, steps + 1); reveal int(masks * (1 - s/t))."""
    t, s = timesteps(ctx, eps)
    return (ctx.masks_now.float() * (1 - s / t)).long()


def per_row(flag: bool | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A shared or per-row flag as a (B, 1) bool tensor."""
    return torch.as_tensor(flag, device=like.device).reshape(-1, 1).expand(like.shape[0], 1)


# `schedule` setting -> counts per step ("family" means the model family's own, see sampling.py)
SCHEDULES: dict[str, Callable[[StepContext, float], torch.Tensor]] = {
    "linear": llada_counts,
    "dream": dream_counts,
}


@dataclass(frozen=True)
class RuleParams:
    """What a rule reads besides the step: the run's settings (its parameters are fields
    there: threshold, factor, eps, ...) and what they resolve to once."""

    s: DecodeSettings
    schedule: Callable[[StepContext, float], torch.Tensor]  # the family's or `schedule`'s
    fallback: Callable | None = None  # klass: the rule of a step with nothing ready (fixed)
    memory: object | None = None  # the rule's state across steps (klass: KL histories)
    one_per_step: bool = True  # every block plans a step per token: threshold's k is 1
    shard: object | None = None  # a tensor-parallel rank's ShardedSampler: probs are its part


def planned_counts(p: RuleParams, ctx: StepContext) -> torch.Tensor:
    """(B,) the step's share of the block by the family's schedule, everything left on the
    block's last planned step (so a block ends within its planned steps)."""
    last = ctx.last_step
    if isinstance(last, bool):
        return ctx.masks_now if last else p.schedule(ctx, p.s.eps)
    return torch.where(last, ctx.masks_now, p.schedule(ctx, p.s.eps))


def fixed_rule(p: RuleParams, ctx: StepContext) -> torch.Tensor:
    """A planned number per step (the family's schedule), everything left on the last step."""
    counts = planned_counts(p, ctx)
    if p.s.alg_temp > 0:
        # Dream's alg_temp: positions sampled from softmax(conf / alg_temp) without replacement,
        # drawn here by Gumbel-top-k.
        u = uniform(ctx.generator, ctx.confidence.shape, device=ctx.drafts.device)
        noisy = ctx.confidence.double() / p.s.alg_temp - torch.log(-torch.log(u.double()))
        return top_columns(noisy, ctx.candidates, counts)
    return top_columns(ctx.confidence, ctx.candidates, counts)


def threshold_rule(p: RuleParams, ctx: StepContext) -> torch.Tensor:
    """The one threshold rule (ranking.confident_columns) with k = the schedule's share of the
    step, at least one; Fast-dLLM's `>=` (its reference commits a confidence equal to tau)."""
    counts = None if p.one_per_step else planned_counts(p, ctx).clamp(min=1)
    return confident_columns(ctx.confidence, ctx.candidates, p.s.threshold, counts, inclusive=True)


def factor_rule(p: RuleParams, ctx: StepContext) -> torch.Tensor:
    """Fast-dLLM's factor rule: the largest n with (n + 1) * (1 - c_n) < f, at least one."""
    ordered = ctx.confidence.sort(dim=1, descending=True).values  # (B, L), -inf last
    n = torch.arange(1, ordered.shape[1] + 1, device=ordered.device)
    passes = ((n + 1) * (1 - ordered) < p.s.factor).long().cumprod(dim=1)
    counts = passes.sum(dim=1).clamp(min=1)
    return top_columns(ctx.confidence, ctx.candidates, counts)


def origin_rule(p: RuleParams, ctx: StepContext) -> torch.Tensor:
    """Dream's origin: each mask revealed independently with probability 1 - s/t."""
    last = ctx.last_step
    if isinstance(last, bool) and last:
        return ctx.candidates.clone()
    t, s = timesteps(ctx, p.s.eps)
    chance = 1 - s / t
    if isinstance(chance, torch.Tensor) and chance.dim() == 1:
        chance = chance[:, None]  # (B, 1)
    draws = ctx.generator
    if isinstance(draws, RowDraws) and ctx.host_steps is not None:
        # a row at its block's last step reveals everything and draws nothing, as alone
        draws = draws.without([r for r, (k, n) in enumerate(ctx.host_steps) if k >= n - 1])
    u = uniform(draws, ctx.candidates.shape, device=ctx.drafts.device)
    return ((u < chance) | per_row(last, u)) & ctx.candidates


@dataclass(frozen=True)
class UnmaskRule:
    """One `--unmask` choice: its step and what it asks of the engine.

    `select(params, ctx)` returns the (B, L) columns to commit, or (commit, remask) for a
    re-masking rule (the settings it reads declare it: settings.py `rules`); `needs_probs`: it
    reads each slot's whole distribution (`StepContext.probs`); `remasking`: it masks earlier
    commits again and reads a shadow block's `StepContext.verify` (WINO); `redrafts`: it
    returns (commit, tokens), its own drafts (credit); `memory(settings)` builds the state it
    keeps across steps (None: stateless); `reads_entropy`: it reads each slot's entropy
    (`StepContext.entropy`, eb), not its distribution; `reads_kl`: each slot's step-to-step KL
    (klass: `StepContext.kl` under tensor parallelism, else from `probs`).
    """

    select: Callable[[RuleParams, StepContext], torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
    needs_probs: bool = False
    remasking: bool = False
    redrafts: bool = False
    memory: Callable[[DecodeSettings], object] | None = None
    reads_entropy: bool = False
    reads_kl: bool = False


UNMASK_RULES: dict[str, UnmaskRule] = {
    "fixed": UnmaskRule(fixed_rule),
    "threshold": UnmaskRule(threshold_rule),
    "factor": UnmaskRule(factor_rule),
    "origin": UnmaskRule(origin_rule),
    "eb": UnmaskRule(eb_rule, reads_entropy=True),
    # KLASS's history; a row's restarts at each block's first step, so one memory serves
    # every decode (no `start` hook: continuous batching serves this committer).
    "klass": UnmaskRule(klass_rule, reads_kl=True, memory=lambda s: KlassMemory()),
    "wino": UnmaskRule(wino_rule, remasking=True),
    "sdlm": UnmaskRule(sdlm_rule),
    "credit": UnmaskRule(credit_rule, needs_probs=True, redrafts=True, memory=credit_memory),
}


class RuleCommitter(Committer):
    """The default committer: one of UNMASK_RULES with this run's parameters."""

    def __init__(self, settings: DecodeSettings, family_schedule: str):
        entry = UNMASK_RULES[settings.unmask]
        self.rule = entry.select
        schedule = family_schedule if settings.schedule == "family" else settings.schedule
        self.params = RuleParams(
            settings,
            SCHEDULES[schedule],
            fallback=fixed_rule,
            memory=None if entry.memory is None else entry.memory(settings),
            one_per_step=settings.one_per_step,
        )
        self.needs_probs = entry.needs_probs
        self.needs_shadow = entry.remasking
        self.redrafts = entry.redrafts
        self.reads_entropy, self.reads_kl = entry.reads_entropy, entry.reads_kl

    def leave(self, requests: list[int]) -> None:
        """The one release of a rule's state per request (KLASS's tracks, a tensor-parallel
        rank's shards in them too)."""
        if self.params.memory is not None:
            self.params.memory.forget(requests)

    def shard(self, sampler) -> None:
        """The rule gathers what it reads of the distributions through `sampler` (credit); a
        KL-reading rule's sampler keeps each row's shard in the rule's memory (KLASS)."""
        self.params = replace(self.params, shard=sampler)
        if self.reads_kl:
            sampler.memory = self.params.memory

    def __call__(self, ctx: StepContext) -> Decision:
        if self.needs_shadow:
            commit, remask = self.rule(self.params, ctx)
            return Decision(commit, remask=remask)
        if self.redrafts:
            commit, tokens = self.rule(self.params, ctx)
            return Decision(commit, tokens=tokens)
        return Decision(self.rule(self.params, ctx))
