"""One step of the block-causal stepper (block_stepper.py): plan -> forward -> commit.

`plan`: LLaDA2.1's settled blocks end, and a row whose block became final last step puts that
block in front of its next one, so the same forward also computes the finished block's K/V
(written to the cache afterwards): no forward of its own for a store. `forward`: one forward
serves every live row's active block. `commit`: each row drafts its active block and the rule
commits masks (and, for LLaDA2.1, edits tokens); rows whose answer is final go to the
engine. Host reads per row and step are a few `.any()` checks (CPU decoding; a GPU would
want them batched).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.nn.functional import pad

from dllm_cli.decoding.answer import first_stop
from dllm_cli.decoding.block_rules import BlockRule, Drafter, edits, fills
from dllm_cli.decoding.events import RowCommit, RowPhase, StepEvent, row_commits
from dllm_cli.decoding.request import Request
from dllm_cli.decoding.stepper import Commit
from dllm_cli.models.block import BlockContext, block_causal


@dataclass
class BlockRow:
    """One request's canvas and place: its block, steps in it, what the cache holds."""

    request: Request
    slot: int
    x: torch.Tensor  # (nb B,) prompt, then masks to whole blocks
    marks: torch.Tensor  # (nb B,) engine step that last wrote each column, -1
    prompt: int  # P
    blocks: int  # nb
    block: int  # the active block
    cached: int = 0  # columns whose K/V the cache holds (whole blocks)
    step: int = 0  # steps taken in the active block
    post: int = 0  # LLaDA2.1: steps of the active block after its masks were filled
    store: bool = False  # the next forward writes the active block's final K/V
    rule: BlockRule | None = None  # its own gen_length's (its steps per block)


class BlockStepper(Protocol):
    """What a step reads and writes of block_stepper.BlockStepper."""

    settings: Any  # DecodeSettings
    model: Any  # a block-causal model (models/block.py)
    special: Any  # SpecialIds
    device: torch.device
    rule: BlockRule
    drafter: Drafter  # whole logits, or a tensor-parallel rank's vocabulary shard
    rows: list[BlockRow]
    kv: list[list[torch.Tensor]] | None
    cached: bool
    stop_ids: torch.Tensor
    forwards: int

    def answer(self, row: BlockRow) -> torch.Tensor: ...

    def write(self, ctx: BlockContext, i: int, row: BlockRow, start: int, end: int, at=0): ...


@dataclass
class BlockPlan:
    """The step's rows: those forwarded (`rows`), those final before any forward."""

    at: int  # the engine's step
    rows: list[BlockRow]
    previous: dict[int, torch.Tensor]  # row index -> its finished block's tokens (a store)
    stored: list[int]  # answer positions of the blocks stored this step
    final: list[BlockRow] = field(default_factory=list)


@dataclass
class BlockPrediction:
    ctx: BlockContext
    logits: torch.Tensor  # (N, B, V)


def plan(e: BlockStepper, at: int) -> BlockPlan:
    """Settle LLaDA2.1's edited blocks; rows with a finished block store it in this forward."""
    rule, b = e.rule, e.rule.block
    editing = rule.edit_threshold is not None
    final: list[BlockRow] = []
    for r in e.rows:  # LLaDA2.1: a block ends after max_post_steps editing steps
        if editing and not r.store and not bool((block_of(r, b) == e.special.mask).any()):
            r.post += 1
            if r.post > rule.max_post_steps:
                settle(e, r, final)
    rows = [r for r in e.rows if not any(r is f for f in final)]
    # A finished block's store rides with its next block's first decode (one forward).
    storing = [i for i, r in enumerate(rows) if r.store]
    previous = {i: block_of(rows[i], b).clone() for i in storing}
    stored = []
    for i in storing:
        stored.append(rows[i].block * b - rows[i].prompt)
        advance(e, rows[i])
    return BlockPlan(at, rows, previous, stored, final)


def forward(e: BlockStepper, p: BlockPlan) -> BlockPrediction | None:
    """One forward of every forwarded row's active block (None: no row is left to forward)."""
    if not p.rows:
        return None
    b = e.rule.block
    ctx, ids, positions, index = inputs(e, p.rows, p.previous)
    logits = e.model(ids, positions, ctx, logits_slice=index)  # (N, B, V)
    for i in p.previous:
        r = p.rows[i]
        e.write(ctx, i, r, (r.block - 1) * b, r.block * b)
    return BlockPrediction(ctx, logits)


def commit(e: BlockStepper, p: BlockPlan, pred: BlockPrediction | None) -> Commit:
    """Draft, fill and edit every forwarded row; the rows whose answer is final."""
    if pred is None:
        return final_rows(e, p.final, Commit(stepped=False))
    rule, b, rows, final = e.rule, e.rule.block, p.rows, p.final
    phases = tuple(place(e, r) for r in rows)  # where each row was, before it moves on
    at = [r.block * b - r.prompt for r in rows]
    x0, probs = draft_rows(e, rows, pred.logits)
    block = torch.stack([block_of(r, b) for r in rows])  # (N, B)
    active = block == e.special.mask
    k = torch.tensor([r.rule.k(r.step) for r in rows], device=e.device)
    cols = torch.stack([columns(r, b) for r in rows])
    fixed = cols < torch.tensor([r.prompt for r in rows], device=e.device)[:, None]
    fill, edit = fills(rule, active, probs, k), edits(rule, block, active, x0, probs, fixed)
    for i, r in enumerate(rows):
        decide(e, r, i, pred.ctx, fill[i], edit[i], x0[i], active[i], final, p.at)
    ends = [r.request.sampling.gen_length for r in rows]  # each row's own answer length
    drawn = (torch.tensor(at, device=e.device), x0, probs, [r.request.id for r in rows], ends)
    index = {id(r): i for i, r in enumerate(e.rows)}
    out = Commit(served=[index[id(r)] for r in rows], forwards=1)
    e.forwards += 1
    forwards, stored = e.forwards, p.stored
    out.event = lambda done: event(e, p.at, forwards, phases, (fill, edit), drawn, stored, done)
    return final_rows(e, final, out)


def final_rows(e: BlockStepper, final: list[BlockRow], out: Commit) -> Commit:
    """The final rows' answers, commit steps and (early stop) where each ends, into `out`."""
    if not final:
        return out
    index = {id(r): i for i, r in enumerate(e.rows)}
    g = max(r.request.sampling.gen_length for r in final)  # rows' own, padded to the longest
    out.final = [index[id(r)] for r in final]
    answers = [e.answer(r) for r in final]
    out.answers = torch.stack([pad(a, (0, g - len(a)), value=e.special.pad) for a in answers])
    marks = [r.marks[r.prompt : r.prompt + len(a)] for r, a in zip(final, answers, strict=True)]
    out.marks = torch.stack([pad(m, (0, g - len(m)), value=-1) for m in marks])  # (R, G)
    if e.settings.early_stop:
        out.cut = first_stop(out.answers, e.stop_ids, e.special.mask)
    for r in final:
        r.store = False
    return out


def draft_rows(e: BlockStepper, rows, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, B, V) -> tokens, p: each row samples with its own request's values and generator."""
    return e.drafter(
        logits, [r.request.sampling for r in rows], [r.request.generator for r in rows]
    )


def block_of(r, b: int) -> torch.Tensor:
    return r.x[r.block * b : (r.block + 1) * b]


def columns(r, b: int) -> torch.Tensor:
    return torch.arange(r.block * b, (r.block + 1) * b, device=r.x.device)


def inputs(e: BlockStepper, rows, previous: dict[int, torch.Tensor]):
    """Context, ids (N, T), positions (N, T) and the logits' columns for this forward.

    Cached: each row's active block against its cached K/V; rows in `previous` (index -> the
    finished block's tokens) put that block before it, so the forward also computes its
    final K/V (block-causal: the finished block never sees the new one). Recompute: each
    row's whole window [0, end of its block) under the block-causal mask.
    """
    b, n = e.rule.block, len(rows)
    cols = torch.stack([columns(r, b) for r in rows])  # (N, B)
    if e.cached:
        ids = torch.stack([block_of(r, b) for r in rows])
        lengths = torch.tensor(
            [r.cached - b * (i in previous) for i, r in enumerate(rows)], device=e.device
        )
        ctx = BlockContext()
        if previous:
            ahead = torch.full_like(ids, e.special.pad)
            for i, tokens in previous.items():
                ahead[i] = tokens
            ids = torch.cat([ahead, ids], dim=1)  # (N, 2B)
            cols = torch.cat([(cols - b).clamp(min=0), cols], dim=1)
            known = torch.zeros(n, 2 * b, dtype=torch.bool, device=e.device)
            known[:, b:] = True
            known[list(previous), :b] = True
            ctx.self_mask = block_causal(2 * b, b, e.device)[None] & known[:, None, :]
            ctx.offset = b
        width = int(lengths.max())
        if width > 0:
            held = [r.slot for r in rows]
            if held == list(range(len(held))):  # slots 0..N-1: views, no copy
                ctx.past = [(k[: len(held), :, :width], v[: len(held), :, :width]) for k, v in e.kv]
            else:
                slots = torch.tensor(held, device=e.device)
                ctx.past = [(k[slots, :, :width], v[slots, :, :width]) for k, v in e.kv]
            if bool((lengths < width).any()):
                ctx.past_valid = torch.arange(width, device=e.device)[None] < lengths[:, None]
        return ctx, ids, cols, slice(b, 2 * b) if previous else None
    ends = [(r.block + 1) * b for r in rows]
    width = max(ends)
    ids = torch.full((n, width), e.special.pad, dtype=torch.long, device=e.device)
    for i, (r, end) in enumerate(zip(rows, ends, strict=True)):
        ids[i, :end] = r.x[:end]
    valid = (
        torch.arange(width, device=e.device)[None] < torch.tensor(ends, device=e.device)[:, None]
    )
    own = block_causal(width, b, e.device)[None] & valid[:, None, :]
    positions = torch.arange(width, device=e.device).expand(n, width)
    return BlockContext(self_mask=own), ids, positions, cols


def decide(e: BlockStepper, r, i, ctx, fill, edit, x0, active, final, at: int) -> None:
    """Commit one row's fills and edits; settle or finish its block when it is final."""
    b = e.rule.block
    editing = e.rule.edit_threshold is not None
    if editing and not bool(active.any()) and not bool(edit.any()):
        # Settled: this forward saw the final tokens, so its K/V are the block's final K/V.
        if e.cached and not last(r):
            e.write(ctx, i, r, r.block * b, (r.block + 1) * b, ctx.offset)
        settle(e, r, final, stored=True)
        return
    change = fill | edit
    view = block_of(r, b)
    view[change] = x0[change]
    r.marks[r.block * b : (r.block + 1) * b][change] = at
    r.step += 1
    if editing:
        return
    if stops(e, r):
        final.append(r)
    elif not bool((view == e.special.mask).any()):
        settle(e, r, final)


def last(r) -> bool:
    return r.block == r.blocks - 1


def stops(e: BlockStepper, r) -> bool:
    """Early stop: a stop token with no mask before it in the answer (its text is final)."""
    if not e.settings.early_stop:
        return False
    answer = e.answer(r)[None]
    return int(first_stop(answer, e.stop_ids, e.special.mask)[0]) < answer.shape[1]


def settle(e: BlockStepper, r, final: list, stored: bool = False) -> None:
    """The active block is final: the row ends, or its K/V get written and it moves on."""
    if last(r) or stops(e, r):
        final.append(r)
    elif stored or not e.cached:
        advance(e, r)
    else:
        r.store = True  # the next forward writes the block's K/V


def advance(e: BlockStepper, r) -> None:
    r.cached = (r.block + 1) * e.rule.block if e.cached else 0
    r.block += 1
    r.step = r.post = 0
    r.store = False


def place(e: BlockStepper, r) -> RowPhase:
    """Where a row is: its answer block (0 = the block after the prompt's whole blocks)."""
    b = e.rule.block
    start = r.block * b - r.prompt  # < 0: the prompt's tail shares the first answer block
    index, window = r.block - r.prompt // b, (start, start + b)
    return RowPhase(r.request.id, index, r.step, window, not e.cached, r.prompt % b)


def event(e: BlockStepper, step, forwards, phases, chosen, drawn, stored, done) -> StepEvent:
    """The step's StepEvent: commits (fills), drafts (LLaDA2.1's edits) and places per row."""
    at, x0, probs, ids, ends = drawn
    g = torch.tensor(ends, device=at.device)[:, None]  # (N, 1) each row's answer length

    def records(picked: torch.Tensor) -> tuple[RowCommit, ...]:
        """(N, B) picked columns -> RowCommits (not the last block's columns past the answer)."""
        cols = torch.arange(picked.shape[1], device=picked.device)[None] + at[:, None]  # (N, B)
        rows, slots = (picked & (cols < g)).nonzero(as_tuple=True)
        pos = cols[rows, slots]
        return row_commits(rows, pos, x0[rows, slots], probs[rows, slots], None, ids)

    head = phases[0]
    return StepEvent(
        step=step,
        block=head.block,
        block_step=head.block_step,
        window=head.window,
        refresh=not e.cached,
        frozen=(stored[0], stored[0] + e.rule.block) if stored else None,
        forwards=forwards,
        commits=records(chosen[0]),
        finished=tuple(sorted(done)),
        phases=phases,
        drafts=records(chosen[1]),
        revocable=editable(e, phases, done),
    )


def editable(e: BlockStepper, phases, done) -> tuple[tuple[int, int], ...]:
    """(row, answer position) from which LLaDA2.1's edits may still change a live row's
    tokens (its active block): text is final only before it (none without editing)."""
    if e.rule.edit_threshold is None:
        return ()
    return tuple((ph.row, max(0, ph.window[0])) for ph in phases if ph.row not in done)
