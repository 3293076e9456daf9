"""One decoding step over the engine's live rows: plan -> forwards -> drafts -> commit -> move on.

Every row's cache policy plans the columns it recomputes from the row's own place (rows.py),
forwards.py serves all rows (one windowed forward, refreshes in their own), the sampler drafts tokens, the
committer picks which drafts become tokens, finished rows leave (engine.retire) and the rest
move on. Rows decoded by an unmasking rule walk their blocks in lockstep under static
admission (the whole batch leaves a block together, as LLaDA and Fast-dLLM do) and each on
its own otherwise; a verifying committer with `frontier = True` (guided decoding) makes every
row walk its own first mask. The step's StepEvent is built only when someone asks for it. (`e` below
is the Engine of engine.py, which imports this module.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from dllm_cli.decoding import logprobs
from dllm_cli.decoding.events import RowCommit, RowPhase, StepEvent, row_commits
from dllm_cli.decoding.forwards import Prediction
from dllm_cli.decoding.request import Finished
from dllm_cli.decoding.rows import same_place
from dllm_cli.decoding.unmask import Decision, StepContext
from dllm_cli.decoding.wino import revoke


@dataclass
class StepOutput:
    """What one step did: answers that became final, and (on request) its StepEvent."""

    step: int  # the engine's 0-based step (-1: nothing was decoding)
    finished: list[Finished] = field(default_factory=list)
    build: Any = None  # () -> StepEvent, run at most once
    _event: StepEvent | None = None

    @property
    def event(self) -> StepEvent | None:
        """The step's StepEvent (commits per row, phases): materialised on first access."""
        if self._event is None and self.build is not None:
            self._event, self.build = self.build(), None
        return self._event


def decode_step(e) -> StepOutput:
    """The step's forwards, one commit decision, rows move on, finished rows retire.

    Unguided, the step reads the device once: after the commits, one small tensor says which
    rows are done and what the walk needs to move the others on (masks left in their block).
    """
    c, s, model = e.canvas, e.settings, e.model
    rows = [r.row for r in e.live]
    e.walk.begin(rows, c, e.blocks)
    e.served += c.batch  # every live row is served by exactly one forward
    shift, every, suffix = model.logit_shift, s.refresh_interval, s.suffix_window
    firsts = [r.first for r in rows] if e.frontier else [None] * c.batch
    places = [
        r.place(e.blocks, c.width, shift, every, reach(e, f), suffix)
        for r, f in zip(rows, firsts, strict=True)
    ]
    plans = [e.policy.plan(p) for p in places]
    cache = e.cache_view()
    decoded = spans(e, places, plans, firsts)
    draws = e.draws(decoded)  # each row samples with its own request's values and generator
    asked = any(r.logprobs is not None for r in e.live)  # (logprobs.py: opt-in per request)
    e.executor.probs = e.keeps_probs or asked
    pred = e.executor(c, cache, plans, decoded, draws)
    e.forwards += pred.forwards
    shared = decoded[0] if len(set(decoded)) == 1 else None  # one span, no padding slots
    if shared is None:
        candidates = pred.valid & (c.ids.gather(1, pred.columns) == c.mask_id)
    else:
        candidates = c.ids[:, shared[0] : shared[1]] == c.mask_id
    confidence = torch.where(candidates, pred.confidence, -math.inf)
    ctx = context(e, rows, pred, confidence, candidates, draws)
    decision = e.committer(ctx)
    e.guide_forwards += decision.forwards
    e.guide_seconds += decision.seconds
    commit = guard(e, decision, ctx, places)
    tokens = pred.drafts if decision.tokens is None else decision.tokens
    if asked:
        logprobs.record(e, pred.probs, commit, tokens, pred.columns)
    if shared is None:
        write(c, commit, tokens, pred.columns, e.steps)
    else:
        write_span(c, commit, tokens, shared, e.steps)
    if decision.remask is not None:  # WINO: earlier commits the shadow no longer supports
        remask = decision.remask & ~ctx.candidates
        force = forced(e, places)
        revoke(c, remask if force is None else remask & ~force, pred.columns)
    for r in e.live:
        r.steps += 1
        r.forwards += pred.forwards
        r.guide_forwards += decision.forwards
        r.guide_seconds += decision.seconds
    for row, plan in zip(rows, plans, strict=True):
        row.served(plan)
    if shared is not None and not e.frontier and decision.remask is None:
        # One shared block, nothing masked again: what is left is the candidates not committed
        # (commit is a subset of them), without reading the canvas's block again.
        walk = (candidates ^ commit).sum(dim=1)  # (B,)
    else:
        walk = e.walk.pending(c, rows, e.blocks)
    if e.frontier or s.early_stop or any(r.sampling.stop for r in e.live):
        # a stop token may end (or, a request's own, cut) a row: the device says which
        done, cut = e.done()
        flags, counts = torch.stack([done.long(), walk]).tolist()  # the step's one read
    else:  # a block walk's answer is final once its last block has no masks left
        counts, cut = walk.tolist(), None  # the step's one read from the device
        last = len(e.blocks) - 1
        flags = [n == 0 and r.block == last for n, r in zip(counts, rows, strict=True)]
    numbers = c.rows  # request ids of this step's rows (the canvas is replaced on retire)
    finished, kept = e.retire(flags, cut)  # before moving on: lockstep waits for live rows
    e.walk.advance([r.row for r in e.live], [counts[i] for i in kept], e.blocks)
    if not e.frontier:  # a row left waiting in an empty block (lockstep) draws nothing
        for r, i in zip(e.live, kept, strict=True):
            r.idle = counts[i] == 0 and r.row.step > 0
    step, forwards, guide_forwards = e.steps, e.forwards, e.guide_forwards
    e.steps += 1
    p = c.prompt_width

    def build() -> StepEvent:
        first = places[0]
        ids = numbers.tolist()
        phases = tuple(
            RowPhase(n, at.block.index, at.step, (f.start - p, f.end - p), f.refresh)
            for n, at, f in zip(ids, places, plans, strict=True)
        )
        fixed = decision.corrected
        corrected = None if fixed is None else int((fixed & commit).sum())
        return StepEvent(
            step=step,
            block=first.block.index,
            block_step=first.step,
            window=phases[0].window,
            refresh=plans[0].refresh,
            frozen=None if plans[0].frozen is None else tuple(f - p for f in plans[0].frozen),
            forwards=forwards,
            commits=committed(commit, tokens, confidence, pred.columns, fixed, p, ids),
            finished=tuple(f.id for f in finished),
            accepted=decision.accepted,
            guide_forwards=guide_forwards,
            corrected=corrected,
            phases=phases,
            revocable=revocable(e, ids, places, finished, p),
        )

    return StepOutput(step, finished, build)


def revocable(e, ids, places, finished, p: int) -> tuple[tuple[int, int], ...]:
    """(row, answer position) from which a revoking rule may still mask a live row's commits."""
    if not e.revokes:
        return ()
    done = {f.id for f in finished}
    return tuple(
        (n, at.block.start - p) for n, at in zip(ids, places, strict=True) if n not in done
    )


def reach(e, first: int | None) -> int | None:
    """A guided row with a draft window needs predictions only up to the window's end."""
    window = e.draft_window
    return None if first is None or not window else first + window


def spans(e, places, plans, firsts) -> list[tuple[int, int]]:
    """Columns each row decodes: its block, or (guided) its first mask to its draft end."""
    if not e.frontier:
        return [(p.block.start, p.block.end) for p in places]
    window = e.draft_window or e.canvas.width
    # Drafts reach as far as this step's forward computes fresh logits (Dual cache: the
    # block on cached steps) and the draft window allows.
    return [(f, min(f + window, plan.end)) for f, plan in zip(firsts, plans, strict=True)]


def on_device(e, kind: str, values: tuple) -> torch.Tensor:
    """A tensor of host `values`, made once per distinct tuple (nothing writes into it): a
    block's steps reuse it instead of building a tensor from a list every step."""
    memo, key = e.step_tensors, (kind, values)
    if key not in memo:
        if len(memo) >= 256:
            memo.clear()
        memo[key] = torch.tensor(values, device=e.device)
    return memo[key]


def context(e, rows, pred: Prediction, confidence, candidates, draws) -> StepContext:
    masks = on_device(e, "masks", tuple(r.masks_at_start for r in rows))
    if same_place(rows):  # one shared block and step (rows in lockstep)
        block, step, planned, host = e.blocks[rows[0].block], rows[0].step, None, None
    else:
        block = None
        host = [(r.step, e.blocks[r.block].steps) for r in rows]
        step = on_device(e, "steps", tuple(k for k, _ in host))
        planned = on_device(e, "planned", tuple(n for _, n in host))
    return StepContext(
        pred.drafts, confidence, candidates, block, step, masks, e.canvas,
        draws, pred.columns, planned, host, pred.probs, pred.verify,
    )  # fmt: skip


def guard(e, decision: Decision, ctx: StepContext, places) -> torch.Tensor:
    """Only masked columns of the row's span; progress guaranteed in either walk."""
    commit = decision.commit
    commit = (commit if commit.dtype == torch.bool else commit.to(torch.bool)) & ctx.candidates
    if e.frontier:
        # A frontier walk commits a run from the first mask, at least that first column.
        commit[:, 0] |= ctx.candidates[:, 0]
        return commit.long().cumprod(dim=1).bool()
    force = forced(e, places)
    return commit if force is None else torch.where(force, ctx.candidates, commit)


def forced(e, places) -> torch.Tensor | None:
    """(B, 1) rows whose block has had L steps: everything left is committed (no-op for the
    built-in rules but WINO, whose re-masking may otherwise keep a block open); None: none."""
    late = tuple(p.step >= p.block.length - 1 for p in places)
    if not any(late):
        return None
    return on_device(e, "late", late)[:, None]


def write(c, commit, tokens, columns, step: int) -> None:
    """Committed tokens into the canvas, without asking the device which ones.

    Padding slots repeat a span's first column, so per-column sums (each committed column
    appears once among the committed slots; padding adds nothing) stand in for a scatter.
    """
    every = torch.zeros_like(c.ids)
    hit = every.scatter_add(1, columns, commit.long()) > 0  # (B, S)
    chosen = every.scatter_add(1, columns, torch.where(commit, tokens, 0))
    c.ids.copy_(torch.where(hit, chosen, c.ids))
    c.steps.masked_fill_(hit[:, c.prompt_width :], step)


def write_span(c, commit, tokens, span: tuple[int, int], step: int) -> None:
    """`write` for rows that share one span with no padding slots: in place, by slices."""
    a, b = span
    p = c.prompt_width
    block = c.ids[:, a:b]  # (B, L) view
    torch.where(commit, tokens, block, out=block)  # elementwise, in place
    c.steps[:, a - p : b - p].masked_fill_(commit, step)


def committed(commit, tokens, confidence, columns, corrected, p: int, ids) -> tuple[RowCommit, ...]:
    """The step's RowCommits (for an event: read from the device only when one is built)."""
    rows, slots = commit.nonzero(as_tuple=True)
    cols, toks = columns[rows, slots], tokens[rows, slots]
    flags = None if corrected is None else corrected[rows, slots]
    return row_commits(rows, cols - p, toks, confidence[rows, slots], flags, ids)
