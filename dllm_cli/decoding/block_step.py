"""One step of the block-causal engine: one forward serves every live row's active block.

A row's forward is either a decode (drafts, then the rule commits masks and, for LLaDA2.1,
edits tokens) or a store (its block is final: the forward writes the block's K/V into the
cache and the row moves to its next block). Both kinds ride in the same batched forward.
(`e` below is the BlockEngine of block_engine.py, which imports this module.)
"""

from __future__ import annotations

import torch

from dllm_cli.decoding.answer import first_stop
from dllm_cli.decoding.block_rules import draft, edits, fills
from dllm_cli.decoding.events import RowCommit, RowPhase, StepEvent
from dllm_cli.decoding.step import StepOutput
from dllm_cli.models.block import BlockContext, block_causal


def block_step(e) -> StepOutput:
    """Settle, forward, draft, commit, finish: one engine step."""
    rule, b = e.rule, e.rule.block
    editing = rule.edit_threshold is not None
    finished, stored = [], []
    for r in list(e.live):  # LLaDA2.1: a block ends after max_post_steps editing steps
        if editing and not r.store and not bool((block_of(r, b) == e.special.mask).any()):
            r.post += 1
            if r.post > rule.max_post_steps:
                settle(e, r, finished)
    gone = {f.id for f in finished}
    e.live = rows = [r for r in e.live if r.request.id not in gone]
    if not rows:
        return StepOutput(-1, finished)  # rows ended without a forward
    ctx, ids, positions, index = inputs(e, rows)
    logits = e.model(ids, positions, ctx, logits_slice=index)  # (N, B, V)
    e.forwards += 1
    e.served += len(rows)
    for r in rows:
        r.request.steps += 1
        r.request.forwards += 1
    decoding = [i for i, r in enumerate(rows) if not r.store]
    storing = [i for i, r in enumerate(rows) if r.store]  # before decisions set new ones
    phases = tuple(place(e, r) for r in rows)  # where each row was, before it moves on
    at = [rows[i].block * b - rows[i].prompt for i in decoding]
    commits, drafts = [], []
    if decoding:
        x0, p = draft(logits[decoding], e.settings, e.special.mask, e.real_vocab, e.generator)
        block = torch.stack([block_of(rows[i], b) for i in decoding])  # (N, B)
        active = block == e.special.mask
        k = torch.tensor([rule.k(rows[i].step) for i in decoding], device=e.device)
        cols = torch.stack([columns(rows[i], b) for i in decoding])
        fixed = cols < torch.tensor([rows[i].prompt for i in decoding], device=e.device)[:, None]
        fill, edit = fills(rule, active, p, k), edits(rule, block, active, x0, p, fixed)
        for j, i in enumerate(decoding):
            decide(e, rows[i], i, ctx, fill[j], edit[j], x0[j], active[j], finished)
        ids = [rows[i].request.id for i in decoding]
        commits = list(zip(ids, at, fill, x0, p, strict=True))
        drafts = list(zip(ids, at, edit, x0, p, strict=True))
    for i in storing:
        r = rows[i]
        e.write(ctx, i, r, r.block * b, (r.block + 1) * b)
        stored.append(r.block * b - r.prompt)
        advance(e, r)
    done = {f.id for f in finished}
    e.live = [r for r in e.live if r.request.id not in done]
    step = e.steps
    e.steps += 1
    return StepOutput(step, finished, lambda: event(e, step, phases, commits, drafts, stored, done))


def block_of(r, b: int) -> torch.Tensor:
    return r.x[r.block * b : (r.block + 1) * b]


def columns(r, b: int) -> torch.Tensor:
    return torch.arange(r.block * b, (r.block + 1) * b, device=r.x.device)


def inputs(e, rows):
    """Context, ids (N, T), positions (N, T) and the logits' columns for this forward."""
    b = e.rule.block
    cols = torch.stack([columns(r, b) for r in rows])  # (N, B)
    if e.cached:
        ids = torch.stack([block_of(r, b) for r in rows])
        lengths = torch.tensor([r.cached for r in rows], device=e.device)
        width = int(lengths.max())
        if width == 0:
            return BlockContext(), ids, cols, None
        slots = torch.tensor([r.slot for r in rows], device=e.device)
        past = [(k[slots, :, :width], v[slots, :, :width]) for k, v in e.kv]
        valid = None
        if bool((lengths < width).any()):
            valid = torch.arange(width, device=e.device)[None] < lengths[:, None]
        return BlockContext(past=past, past_valid=valid), ids, cols, None
    # Recompute: each row's whole window [0, end of its block) under the block-causal mask.
    ends = [(r.block + 1) * b for r in rows]
    width = max(ends)
    ids = torch.full((len(rows), width), e.special.pad, dtype=torch.long, device=e.device)
    for i, (r, n) in enumerate(zip(rows, ends, strict=True)):
        ids[i, :n] = r.x[:n]
    valid = (
        torch.arange(width, device=e.device)[None] < torch.tensor(ends, device=e.device)[:, None]
    )
    own = block_causal(width, b, e.device)[None] & valid[:, None, :]
    positions = torch.arange(width, device=e.device).expand(len(rows), width)
    return BlockContext(self_mask=own), ids, positions, cols


def decide(e, r, i, ctx, fill, edit, x0, active, finished) -> None:
    """Commit one row's fills and edits; settle or finish its block when it is final."""
    b = e.rule.block
    editing = e.rule.edit_threshold is not None
    if editing and not bool(active.any()) and not bool(edit.any()):
        # Settled: this forward saw the final tokens, so its K/V are the block's final K/V.
        if e.cached and not last(r):
            e.write(ctx, i, r, r.block * b, (r.block + 1) * b)
        settle(e, r, finished, stored=True)
        return
    change = fill | edit
    view = block_of(r, b)
    view[change] = x0[change]
    r.marks[r.block * b : (r.block + 1) * b][change] = e.steps
    r.step += 1
    if editing:
        return
    if stops(e, r):
        finish(e, r, finished)
    elif not bool((view == e.special.mask).any()):
        settle(e, r, finished)


def last(r) -> bool:
    return r.block == r.blocks - 1


def stops(e, r) -> bool:
    """Early stop: a stop token with no mask before it in the answer (its text is final)."""
    if not e.settings.early_stop:
        return False
    answer = e.answer(r)[None]
    return int(first_stop(answer, e.stop_ids, e.special.mask)[0]) < answer.shape[1]


def settle(e, r, finished, stored: bool = False) -> None:
    """The active block is final: the row ends, or its K/V get written and it moves on."""
    if last(r) or stops(e, r):
        finish(e, r, finished)
    elif stored or not e.cached:
        advance(e, r)
    else:
        r.store = True  # the next forward writes the block's K/V


def advance(e, r) -> None:
    r.cached = (r.block + 1) * e.rule.block if e.cached else 0
    r.block += 1
    r.step = r.post = 0
    r.store = False


def finish(e, r, finished) -> None:
    """The row's answer is final: its Finished (EOS after an early stop)."""
    g = e.settings.gen_length
    answer = e.answer(r)
    marks = r.marks[r.prompt : r.prompt + g] - r.request.first_step
    marks = torch.where(marks >= 0, marks, -1)
    cut = int(first_stop(answer[None], e.stop_ids, e.special.mask)[0])
    if e.settings.early_stop and cut < g:
        past = torch.arange(g, device=answer.device) > cut
        answer = answer.masked_fill(past, e.special.eos)
        marks = marks.masked_fill(past, -1)
    r.store = False
    finished.append(r.request.finish(answer.tolist(), marks.tolist(), e.steps))
    e.requests.pop(r.request.id, None)


def place(e, r) -> RowPhase:
    """Where a row is: its answer block (0 = the block after the prompt's whole blocks)."""
    b = e.rule.block
    start = r.block * b - r.prompt
    shown = min(r.block - r.prompt // b, -(-e.settings.gen_length // b) - 1)
    return RowPhase(r.request.id, shown, r.step, (start, start + b), not e.cached)


def event(e, step, phases, commits, drafts, stored, done) -> StepEvent:
    """The step's StepEvent: commits (fills), drafts (LLaDA2.1's edits) and places per row."""
    g = e.settings.gen_length

    def records(items) -> tuple[RowCommit, ...]:
        out = []
        for rid, start, chosen, x0, p in items:
            picked = chosen.nonzero().squeeze(1)
            picked = picked[picked + start < g]  # the last block's columns past the answer
            if picked.numel():
                pos = (picked + start).tolist()
                out.append(
                    RowCommit(
                        rid, tuple(pos), tuple(x0[picked].tolist()), tuple(p[picked].tolist())
                    )
                )
        return tuple(out)

    head = phases[0]
    return StepEvent(
        step=step,
        block=head.block,
        block_step=head.block_step,
        window=head.window,
        refresh=not e.cached,
        frozen=(stored[0], stored[0] + e.rule.block) if stored else None,
        forwards=e.forwards,
        commits=records(commits),
        finished=tuple(sorted(done)),
        phases=phases,
        drafts=records(drafts),
    )
