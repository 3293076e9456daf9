"""One step of the block-causal engine: one forward serves every live row's active block.

Each row drafts its active block and the rule commits masks (and, for LLaDA2.1, edits
tokens). A row whose block became final last step puts that block in front of its next one
in the same forward, which so also computes the finished block's K/V (written to the cache
afterwards): no forward of its own for a store. Host reads per row and step are a few
`.any()` checks (CPU decoding; a GPU would want them batched).
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
    # A finished block's store rides with its next block's first decode (one forward).
    storing = {i for i, r in enumerate(rows) if r.store}
    previous = {i: block_of(rows[i], b).clone() for i in storing}
    for i in storing:
        stored.append(rows[i].block * b - rows[i].prompt)
        advance(e, rows[i])
    ctx, ids, positions, index = inputs(e, rows, previous)
    logits = e.model(ids, positions, ctx, logits_slice=index)  # (N, B, V)
    for i in storing:
        r = rows[i]
        e.write(ctx, i, r, (r.block - 1) * b, r.block * b)
    e.forwards += 1
    e.served += len(rows)
    for r in rows:
        r.request.steps += 1
        r.request.forwards += 1
    phases = tuple(place(e, r) for r in rows)  # where each row was, before it moves on
    at = [r.block * b - r.prompt for r in rows]
    x0, p = draft_rows(e, rows, logits)
    block = torch.stack([block_of(r, b) for r in rows])  # (N, B)
    active = block == e.special.mask
    k = torch.tensor([rule.k(r.step) for r in rows], device=e.device)
    cols = torch.stack([columns(r, b) for r in rows])
    fixed = cols < torch.tensor([r.prompt for r in rows], device=e.device)[:, None]
    fill, edit = fills(rule, active, p, k), edits(rule, block, active, x0, p, fixed)
    for i, r in enumerate(rows):
        decide(e, r, i, ctx, fill[i], edit[i], x0[i], active[i], finished)
    ids = [r.request.id for r in rows]
    commits = list(zip(ids, at, fill, x0, p, strict=True))
    drafts = list(zip(ids, at, edit, x0, p, strict=True))
    done = {f.id for f in finished}
    e.live = [r for r in e.live if r.request.id not in done]
    step = e.steps
    e.steps += 1
    return StepOutput(step, finished, lambda: event(e, step, phases, commits, drafts, stored, done))


def draft_rows(e, rows, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, B, V) -> tokens, p: each row samples with its own request's values and generator,
    so a sampled row's draws do not depend on what shares the step (greedy: one call)."""
    own = [r.request.sampling for r in rows]
    mask, vocab = e.special.mask, e.real_vocab
    if all(s.greedy for s in own):
        return draft(logits, own[0], mask, vocab, None)
    drafted = [
        draft(logits[i : i + 1], s, mask, vocab, r.request.generator)
        for i, (r, s) in enumerate(zip(rows, own, strict=True))
    ]
    return torch.cat([x for x, _ in drafted]), torch.cat([p for _, p in drafted])


def block_of(r, b: int) -> torch.Tensor:
    return r.x[r.block * b : (r.block + 1) * b]


def columns(r, b: int) -> torch.Tensor:
    return torch.arange(r.block * b, (r.block + 1) * b, device=r.x.device)


def inputs(e, rows, previous: dict[int, torch.Tensor]):
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


def decide(e, r, i, ctx, fill, edit, x0, active, finished) -> None:
    """Commit one row's fills and edits; settle or finish its block when it is final."""
    b = e.rule.block
    editing = e.rule.edit_threshold is not None
    if editing and not bool(active.any()) and not bool(edit.any()):
        # Settled: this forward saw the final tokens, so its K/V are the block's final K/V.
        if e.cached and not last(r):
            e.write(ctx, i, r, r.block * b, (r.block + 1) * b, ctx.offset)
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
    start = r.block * b - r.prompt  # < 0: the prompt's tail shares the first answer block
    index, window = r.block - r.prompt // b, (start, start + b)
    return RowPhase(r.request.id, index, r.step, window, not e.cached, r.prompt % b)


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
        revocable=editable(e, phases, done),
    )


def editable(e, phases, done) -> tuple[tuple[int, int], ...]:
    """(row, answer position) from which LLaDA2.1's edits may still change a live row's
    tokens (its active block): text is final only before it (none without editing)."""
    if e.rule.edit_threshold is None:
        return ()
    return tuple((ph.row, max(0, ph.window[0])) for ph in phases if ph.row not in done)
