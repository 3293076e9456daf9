"""One step of the masked stepper (masked.py): plan -> forward -> commit.

`plan`: every row's cache policy plans the columns it recomputes from the row's own place
(rows.py) and each row's sampling draws are set up (host data). `forward`: forwards.py serves
all rows (one windowed forward, refreshes in their own) and drafts tokens. `commit`: the
committer picks which drafts become tokens, they are written into the canvas, and one device
read says which rows are final and what the walk needs to move the others on (the engine
finishes them, then `MaskedStepper.move_on`). The step's StepEvent is built only when someone
asks for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dllm_cli.cache import KVCache
from dllm_cli.decoding import logprobs
from dllm_cli.decoding.canvas import Canvas
from dllm_cli.decoding.events import RowCommit, RowPhase, StepEvent, row_commits
from dllm_cli.decoding.forwards import Prediction
from dllm_cli.decoding.policies import ForwardPlan, StepPlace
from dllm_cli.decoding.request import Request
from dllm_cli.decoding.row_sampling import RowDraws
from dllm_cli.decoding.rows import RowState, same_place
from dllm_cli.decoding.stepper import Commit
from dllm_cli.decoding.unmask import Decision, StepContext
from dllm_cli.decoding.wino import revoke


class MaskedState(Protocol):
    """What a step reads and writes of masked.MaskedStepper (its state between steps)."""

    settings: Any  # DecodeSettings
    model: Any  # DiffusionLM
    device: torch.device
    canvas: Canvas
    walk: Any  # rows.BlockWalk | rows.FrontierWalk
    policy: Any  # a policies.POLICIES entry
    executor: Any  # forwards.Forwards | wino.ShadowForwards
    committer: Any  # unmask.Committer
    sampler: Any  # sampling.Sampler | sharded_sampling.ShardedSampler
    frontier: bool
    draft_window: int | None
    keeps_probs: bool
    revokes: bool
    step_tensors: dict
    counts: list[int]
    forwards: int
    guide_forwards: int

    def cache_view(self, live: list[Request]) -> KVCache | None: ...

    def draws(self, live: list[Request], spans: list[tuple[int, int]]) -> RowDraws: ...

    def done(self, live: list[Request]) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class Plan:
    """One step's plan, host data but the draws' generators: each row's place and columns."""

    live: list[Request]
    rows: list[RowState]
    places: list[StepPlace]
    plans: list[ForwardPlan]
    decoded: list[tuple[int, int]]  # columns each row decodes
    draws: RowDraws
    asked: bool  # some row records logprobs
    at: int  # the engine's step


def plan(m: MaskedState, live: list[Request], at: int) -> Plan:
    """Every row's cache policy plans the columns it recomputes from the row's own place."""
    c, s, model = m.canvas, m.settings, m.model
    rows = [r.row for r in live]
    m.walk.begin(rows, c)
    shift, every, suffix = model.logit_shift, s.refresh_interval, s.suffix_window
    firsts = [r.first for r in rows] if m.frontier else [None] * c.batch
    places = [
        r.place(c.width, shift, every, reach(m, f), suffix)
        for r, f in zip(rows, firsts, strict=True)
    ]
    plans = [m.policy.plan(p) for p in places]
    decoded = spans(m, places, plans, firsts)
    draws = m.draws(live, decoded)  # each row samples with its own request's values, generator
    asked = any(r.logprobs is not None for r in live)  # (logprobs.py: opt-in per request)
    return Plan(live, rows, places, plans, decoded, draws, asked, at)


def forward(m: MaskedState, p: Plan) -> Prediction:
    """All rows in one windowed forward (refreshes in their own), drafts sampled."""
    m.executor.probs = m.keeps_probs or p.asked
    return m.executor(m.canvas, m.cache_view(p.live), p.plans, p.decoded, p.draws)


def commit(m: MaskedState, p: Plan, pred: Prediction) -> Commit:
    """One commit decision, the rows' places served; which rows are final.

    Unguided, the step reads the device once: after the commits, one small tensor says which
    rows are done and what the walk needs to move the others on (masks left in their block).
    """
    c, s, live, rows, places, plans = m.canvas, m.settings, p.live, p.rows, p.places, p.plans
    decoded = p.decoded
    shared = decoded[0] if len(set(decoded)) == 1 else None  # one span, no padding slots
    if shared is None:
        candidates = pred.valid & (c.ids.gather(1, pred.columns) == c.mask_id)
    else:
        candidates = c.ids[:, shared[0] : shared[1]] == c.mask_id
    confidence = torch.where(candidates, pred.confidence, -math.inf)
    ctx = context(m, rows, pred, confidence, candidates, p.draws)
    decision = m.committer(ctx)
    commit = guard(m, decision, ctx, places)
    tokens = pred.drafts if decision.tokens is None else decision.tokens
    if p.asked:
        logprobs.record(c, live, pred.probs, commit, tokens, pred.columns, m.sampler.kept_part)
    if shared is None:
        write(c, commit, tokens, pred.columns, p.at)
    else:
        write_span(c, commit, tokens, shared, p.at)
    if decision.remask is not None:  # WINO: earlier commits the shadow no longer supports
        remask = decision.remask & ~ctx.candidates
        force = forced(m, places)
        revoke(c, remask if force is None else remask & ~force, pred.columns)
    for row, plan in zip(rows, plans, strict=True):
        row.served(plan)
    if shared is not None and not m.frontier and decision.remask is None:
        # One shared block, nothing masked again: what is left is the candidates not committed
        # (commit is a subset of them), without reading the canvas's block again.
        walk = (candidates ^ commit).sum(dim=1)  # (B,)
    else:
        walk = m.walk.pending(c, rows)
    if m.frontier or s.early_stop or any(r.sampling.stop for r in live):
        # a stop token may end (or, a request's own, cut) a row: the device says which
        done, cut = m.done(live)
        flags, counts = torch.stack([done.long(), walk]).tolist()  # the step's one read
    else:  # a block walk's answer is final once its last block has no masks left
        counts, cut = walk.tolist(), None  # the step's one read from the device
        flags = [n == 0 and r.block == len(r.blocks) - 1 for n, r in zip(counts, rows, strict=True)]
    m.counts = counts  # the walk moves the kept rows on after finishing (move_on)
    final = [i for i, f in enumerate(flags) if f]
    numbers = c.request_ids  # request ids of this step's rows (the canvas is replaced on retire)
    width = c.prompt_width

    def build(finished: tuple[int, ...]) -> StepEvent:
        first = places[0]
        ids = numbers.tolist()
        phases = tuple(
            RowPhase(n, at.block.index, at.step, (f.start - width, f.end - width), f.refresh)
            for n, at, f in zip(ids, places, plans, strict=True)
        )
        fixed = decision.corrected
        corrected = None if fixed is None else int((fixed & commit).sum())
        frozen = plans[0].frozen
        return StepEvent(
            step=p.at,
            block=first.block.index,
            block_step=first.step,
            window=phases[0].window,
            refresh=plans[0].refresh,
            frozen=None if frozen is None else tuple(f - width for f in frozen),
            forwards=forwards,
            commits=committed(commit, tokens, confidence, pred.columns, fixed, width, ids),
            finished=finished,
            accepted=decision.accepted,
            guide_forwards=guide_forwards,
            corrected=corrected,
            phases=phases,
            revocable=revocable(m, ids, places, finished, width),
        )

    forwards, guide_forwards = m.forwards + pred.forwards, m.guide_forwards + decision.forwards
    m.forwards, m.guide_forwards = forwards, guide_forwards
    out = Commit(
        forwards=pred.forwards,
        guide_forwards=decision.forwards,
        guide_seconds=decision.seconds,
        final=final,
        event=build,
    )
    if final:  # their answers, commit steps and ends (tokens stay on the device)
        picked = torch.tensor(final, device=m.device)
        out.answers, out.marks = c.answer()[picked], c.marks[picked]
        out.cut = None if cut is None else cut[picked]
    return out


def revocable(m: MaskedState, ids, places, finished, p: int) -> tuple[tuple[int, int], ...]:
    """(row, answer position) from which a revoking rule may still mask a live row's commits."""
    if not m.revokes:
        return ()
    done = set(finished)
    return tuple(
        (n, at.block.start - p) for n, at in zip(ids, places, strict=True) if n not in done
    )


def reach(m: MaskedState, first: int | None) -> int | None:
    """A guided row with a draft window needs predictions only up to the window's end."""
    window = m.draft_window
    return None if first is None or not window else first + window


def spans(m: MaskedState, places, plans, firsts) -> list[tuple[int, int]]:
    """Columns each row decodes: its block, or (guided) its first mask to its draft end."""
    if not m.frontier:
        return [(p.block.start, p.block.end) for p in places]
    window = m.draft_window or m.canvas.width
    # Drafts reach as far as this step's forward computes fresh logits (Dual cache: the
    # block on cached steps) and the draft window allows.
    return [(f, min(f + window, plan.end)) for f, plan in zip(firsts, plans, strict=True)]


def on_device(m: MaskedState, kind: str, values: tuple) -> torch.Tensor:
    """A tensor of host `values`, made once per distinct tuple (nothing writes into it): a
    block's steps reuse it instead of building a tensor from a list every step."""
    memo, key = m.step_tensors, (kind, values)
    if key not in memo:
        if len(memo) >= 256:
            memo.clear()
        memo[key] = torch.tensor(values, device=m.device)
    return memo[key]


def context(m: MaskedState, rows, pred: Prediction, confidence, candidates, draws) -> StepContext:
    masks = on_device(m, "masks", tuple(r.masks_at_start for r in rows))
    if same_place(rows):  # one shared block and step (rows in lockstep)
        block, step, planned, host = rows[0].current, rows[0].step, None, None
    else:
        block = None
        host = [(r.step, r.current.steps) for r in rows]
        step = on_device(m, "steps", tuple(k for k, _ in host))
        planned = on_device(m, "planned", tuple(n for _, n in host))
    return StepContext(
        pred.drafts, confidence, candidates, block, step, masks, m.canvas,
        draws, pred.columns, planned, host, pred.probs, pred.verify, pred.entropy, pred.kl,
    )  # fmt: skip


def guard(m: MaskedState, decision: Decision, ctx: StepContext, places) -> torch.Tensor:
    """Only masked columns of the row's span; progress guaranteed in either walk."""
    commit = decision.commit
    commit = (commit if commit.dtype == torch.bool else commit.to(torch.bool)) & ctx.candidates
    if m.frontier:
        # A frontier walk commits a run from the first mask, at least that first column.
        commit[:, 0] |= ctx.candidates[:, 0]
        return commit.long().cumprod(dim=1).bool()
    force = forced(m, places)
    return commit if force is None else torch.where(force, ctx.candidates, commit)


def forced(m: MaskedState, places) -> torch.Tensor | None:
    """(B, 1) rows whose block has had L steps: everything left is committed (no-op for the
    built-in rules but WINO, whose re-masking may otherwise keep a block open); None: none."""
    late = tuple(p.step >= p.block.length - 1 for p in places)
    if not any(late):
        return None
    return on_device(m, "late", late)[:, None]


def write(c, commit, tokens, columns, step: int) -> None:
    """Committed tokens into the canvas, without asking the device which ones.

    Padding slots repeat a span's first column, so per-column sums (each committed column
    appears once among the committed slots; padding adds nothing) stand in for a scatter.
    """
    every = torch.zeros_like(c.ids)
    hit = every.scatter_add(1, columns, commit.long()) > 0  # (B, S)
    chosen = every.scatter_add(1, columns, torch.where(commit, tokens, 0))
    c.ids.copy_(torch.where(hit, chosen, c.ids))
    c.marks.masked_fill_(hit[:, c.prompt_width :], step)


def write_span(c, commit, tokens, span: tuple[int, int], step: int) -> None:
    """`write` for rows that share one span with no padding slots: in place, by slices."""
    a, b = span
    p = c.prompt_width
    block = c.ids[:, a:b]  # (B, L) view
    torch.where(commit, tokens, block, out=block)  # elementwise, in place
    c.marks[:, a - p : b - p].masked_fill_(commit, step)


def committed(commit, tokens, confidence, columns, corrected, p: int, ids) -> tuple[RowCommit, ...]:
    """The step's RowCommits (for an event: read from the device only when one is built)."""
    rows, slots = commit.nonzero(as_tuple=True)
    cols, toks = columns[rows, slots], tokens[rows, slots]
    flags = None if corrected is None else corrected[rows, slots]
    return row_commits(rows, cols - p, toks, confidence[rows, slots], flags, ids)
