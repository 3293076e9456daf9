"""One step of the block-causal stepper (block_stepper.py): plan -> forward -> commit.

`plan` settles LLaDA2.1's edited blocks and puts a row's just-finished block in front of its
next one, so the same forward writes the finished block's K/V (no forward of its own).
`forward`: one forward serves every live row's active block. `commit`: each row drafts its
active block, the rule commits masks (LLaDA2.1: and edits tokens), final rows go to the engine.
Host reads: a few `.any()` checks per row and step (a GPU would want them batched).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.nn.functional import pad

from dllm_cli.cache import KVCache
from dllm_cli.decoding import logprobs
from dllm_cli.decoding.answer import first_stop
from dllm_cli.decoding.block_rules import BlockRule, Drafter, edits, fills
from dllm_cli.decoding.events import RowCommit, RowPhase, StepEvent, row_commits
from dllm_cli.decoding.request import Request
from dllm_cli.decoding.row_sampling import RowDraws
from dllm_cli.decoding.stepper import Commit
from dllm_cli.models.block import block_keys


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


class BlockState(Protocol):
    """What a step reads and writes of block_stepper.BlockStepper."""

    settings: Any  # DecodeSettings
    model: Any  # a block-causal model (models/block.py)
    special: Any  # SpecialIds
    device: torch.device
    rule: BlockRule
    drafter: Drafter  # whole logits, or a tensor-parallel rank's vocabulary shard
    kept_part: Any  # shard_summaries.VocabPart: the drafts' kept distributions are a slice
    rows: list[BlockRow]
    cache: KVCache | None
    cached: bool
    stop_ids: torch.Tensor
    forwards: int

    def answer(self, row: BlockRow) -> torch.Tensor: ...


@dataclass
class BlockPlan:
    """The step's rows: those forwarded (`rows`), those final before any forward."""

    at: int  # the engine's step
    rows: list[BlockRow]
    previous: dict[int, torch.Tensor]  # row index -> its finished block's tokens (a store)
    stored: list[int]  # answer positions of the blocks stored this step
    final: list[BlockRow] = field(default_factory=list)


def plan(e: BlockState, live: list[Request], at: int) -> BlockPlan:
    """Settle LLaDA2.1's edited blocks; rows with a finished block store it in this forward."""
    rule, b = e.rule, e.rule.block
    editing = rule.edit_threshold is not None
    final: list[BlockRow] = []
    for r in e.rows:  # LLaDA2.1: a block ends after max_post_steps editing steps
        if editing and not r.store and not bool((block_tokens(r, b) == e.special.mask).any()):
            r.post += 1
            if r.post > rule.max_post_steps:
                settle(e, r, final)
    rows = [r for r in e.rows if not any(r is f for f in final)]
    # A finished block's store rides with its next block's first decode (one forward).
    storing = [i for i, r in enumerate(rows) if r.store]
    previous = {i: block_tokens(rows[i], b).clone() for i in storing}
    stored = []
    for i in storing:
        stored.append(rows[i].block * b - rows[i].prompt)
        advance(e, rows[i])
    return BlockPlan(at, rows, previous, stored, final)


def forward(e: BlockState, p: BlockPlan) -> torch.Tensor | None:
    """Logits (N, B, V) of every forwarded row's active block (None: no row is left)."""
    if not p.rows:
        return None
    return e.model(*inputs(e, p.rows, p.previous))


def commit(e: BlockState, p: BlockPlan, logits: torch.Tensor | None) -> Commit:
    """Draft, fill and edit every forwarded row; the rows whose answer is final."""
    if logits is None:
        return final_rows(e, p.final, Commit(stepped=False))
    rule, b, rows, final = e.rule, e.rule.block, p.rows, p.final
    phases = tuple(place(e, r) for r in rows)  # where each row was, before it moves on
    at = [r.block * b - r.prompt for r in rows]
    asked = any(r.request.logprobs is not None for r in rows)  # (logprobs.py: opt-in)
    # (N, B) tokens and p (and their distribution, kept for logprobs or a grammar): each row
    # samples with its own request's values and generator
    x0, probs, dist = e.drafter(
        logits, [r.request.sampling for r in rows], [r.request.generator for r in rows],
        asked or e.committer is not None,
    )  # fmt: skip
    block = torch.stack([block_tokens(r, b) for r in rows])  # (N, B)
    active = block == e.special.mask
    k = torch.tensor([r.rule.k(r.step) for r in rows], device=e.device)
    cols = torch.stack([columns(r, b) for r in rows])
    prompts = torch.tensor([r.prompt for r in rows], device=e.device)[:, None]  # (N, 1)
    fixed = cols < prompts
    fill, edit = fills(rule, active, probs, k), edits(rule, block, active, x0, probs, fixed)
    if e.committer is not None:  # structured output: a run from each row's first mask
        fill, x0 = grammar_runs(e, rows, fill, x0, dist, active)
    if asked:  # each token's log-probability under the step that wrote it (fill or edit)
        logprobs.write(
            [r.request for r in rows], dist, fill | edit, x0, cols - prompts, e.kept_part
        )
    for i, r in enumerate(rows):
        decide(e, r, fill[i], edit[i], x0[i], active[i], final, p.at)
    ends = [r.request.sampling.gen_length for r in rows]  # each row's own answer length
    drawn = (torch.tensor(at, device=e.device), x0, probs, [r.request.id for r in rows], ends)
    index = {id(r): i for i, r in enumerate(e.rows)}
    out = Commit(served=[index[id(r)] for r in rows], forwards=1)
    e.forwards += 1
    forwards, stored = e.forwards, p.stored
    out.event = lambda done: event(e, p.at, forwards, phases, (fill, edit), drawn, stored, done)
    return final_rows(e, final, out)


def final_rows(e: BlockState, final: list[BlockRow], out: Commit) -> Commit:
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


def grammar_runs(e: BlockState, rows, fill, x0, dist, active) -> tuple[torch.Tensor, ...]:
    """The grammar's commits (grammar_committer.py): each row's run from its first mask in the
    active block, at most the rule's leading run of fills there (at least one); the fills
    (N, B) and tokens (N, B) it leaves."""
    n, b = active.shape
    slots = torch.arange(b, device=active.device)[None]  # (1, B)
    first = torch.where(active.any(dim=1), active.long().argmax(dim=1), b)[:, None]  # (N, 1)
    at = first + slots  # (N, B): run column j is block column first + j
    inside = at < b
    at = at.clamp(max=b - 1)
    wanted = (fill.gather(1, at) & inside).long().cumprod(dim=1).sum(dim=1).clamp(min=1)
    counts = (active & (slots >= first)).sum(dim=1)  # masks from the first one on
    rids = torch.tensor([r.request.id for r in rows], device=active.device)
    draws = RowDraws(
        tuple(r.request.generator for r in rows), tuple(r.request.sampling for r in rows),
        (b,) * n, (True,) * n,
    )  # fmt: skip
    probs = dist.gather(1, at[..., None].expand(-1, -1, dist.shape[-1]))  # (N, B, V)
    tokens, _, lengths, _ = e.committer.walk(rids, counts, wanted, x0.gather(1, at), probs, draws)
    taken = (slots < lengths[:, None]) & inside & (slots < counts[:, None])  # (N, B) run slots
    rows_at, run = taken.nonzero(as_tuple=True)
    fill = torch.zeros_like(fill)
    fill[rows_at, at[rows_at, run]] = True
    x0 = x0.clone()
    x0[rows_at, at[rows_at, run]] = tokens[rows_at, run]
    return fill, x0


def block_tokens(r, b: int) -> torch.Tensor:
    """Row r's active block of tokens (a view of its canvas)."""
    return r.x[r.block * b : (r.block + 1) * b]


def columns(r, b: int) -> torch.Tensor:
    return torch.arange(r.block * b, (r.block + 1) * b, device=r.x.device)


def inputs(e: BlockState, rows, previous: dict[int, torch.Tensor]) -> tuple:
    """The model's arguments: ids and positions (N, T), the cache rows, the block-causal key
    mask, the canvas columns written and the logits' columns. Cached: each row's active block,
    after the finished block of rows in `previous` (its final K/V written by the same forward;
    other rows' first B queries aim at the scratch column). Recompute: each row's whole window.
    """
    b, n = e.rule.block, len(rows)
    cols = torch.stack([columns(r, b) for r in rows])  # (N, B)
    host = [(r.block + 1) * b for r in rows]  # each row's end
    hi = max(host)
    if e.cached:
        ids, positions, index = torch.stack([block_tokens(r, b) for r in rows]), cols, None
        if previous:
            ahead = torch.full_like(ids, e.special.pad)
            storing = torch.zeros(n, 1, dtype=torch.bool, device=e.device)
            for i, tokens in previous.items():
                ahead[i], storing[i] = tokens, True
            ids = torch.cat([ahead, ids], dim=1)  # (N, 2B)
            positions = torch.cat([(cols - b).clamp(min=0), cols], dim=1)
            cols = torch.cat([torch.where(storing, cols - b, e.cache.width), cols], dim=1)
            index = slice(b, 2 * b)
        keys = block_keys(cols, torch.tensor(host, device=e.device), b, hi)  # (N, T, hi)
        if len({r.block for r in rows}) == 1 and len(previous) in (0, n):  # rows in lockstep
            cols = slice(hi - cols.shape[1], hi)  # one slice: written in place, no index
        return ids, positions, rows_view(e, rows, hi), keys, cols, index
    ids, keys = windows(e, rows, host)
    return ids, None, None, keys, slice(0, hi), cols


def windows(e: BlockState, rows, ends: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids (N, W) of each row's columns [0, end), padded, and their block-causal mask (N, W, W)."""
    width = max(ends)
    ids = torch.full((len(rows), width), e.special.pad, dtype=torch.long, device=e.device)
    for i, (r, end) in enumerate(zip(rows, ends, strict=True)):
        ids[i, :end] = r.x[:end]
    every = torch.arange(width, device=e.device).expand(len(rows), width)
    return ids, block_keys(every, torch.tensor(ends, device=e.device), e.rule.block, width)


def rows_view(e: BlockState, rows, hi: int) -> KVCache:
    """The cache as a forward over `rows` (their slots) attending columns [0, hi) sees it."""
    held = [r.slot for r in rows]
    slots = None if held == list(range(e.cache.k[0].shape[0])) else torch.tensor(held)
    return e.cache.view(None if slots is None else slots.to(e.device), hi=hi)


def decide(e: BlockState, r, fill, edit, x0, active, final, at: int) -> None:
    """Commit one row's fills and edits; settle or finish its block when it is final."""
    b = e.rule.block
    editing = e.rule.edit_threshold is not None
    if editing and not bool(active.any()) and not bool(edit.any()):
        # Settled: this forward saw the final tokens, so the K/V it wrote are the block's.
        settle(e, r, final, stored=True)
        return
    change = fill | edit
    view = block_tokens(r, b)
    view[change] = x0[change]
    r.marks[r.block * b : (r.block + 1) * b][change] = at
    r.step += 1
    if editing:
        return
    if stops(e, r):
        final.append(r)
    elif not bool((view == e.special.mask).any()):
        settle(e, r, final)


def stops(e: BlockState, r) -> bool:
    """Early stop: a stop token with no mask before it in the answer (its text is final)."""
    if not e.settings.early_stop:
        return False
    answer = e.answer(r)[None]
    return int(first_stop(answer, e.stop_ids, e.special.mask)[0]) < answer.shape[1]


def settle(e: BlockState, r, final: list, stored: bool = False) -> None:
    """The active block is final: the row ends, or its K/V get written and it moves on."""
    if r.block == r.blocks - 1 or stops(e, r):  # its last block, or an early stop
        final.append(r)
    elif stored or not e.cached:
        advance(e, r)
    else:
        r.store = True  # the next forward writes the block's K/V


def advance(e: BlockState, r) -> None:
    r.cached = (r.block + 1) * e.rule.block if e.cached else 0
    r.block += 1
    r.step = r.post = 0
    r.store = False


def place(e: BlockState, r) -> RowPhase:
    """Where a row is: its answer block (0 = the block after the prompt's whole blocks)."""
    b = e.rule.block
    start = r.block * b - r.prompt  # < 0: the prompt's tail shares the first answer block
    index, window = r.block - r.prompt // b, (start, start + b)
    return RowPhase(r.request.id, index, r.step, window, not e.cached, r.prompt % b)


def event(e: BlockState, step, forwards, phases, chosen, drawn, stored, done) -> StepEvent:
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


def editable(e: BlockState, phases, done) -> tuple[tuple[int, int], ...]:
    """(row, answer position) from which LLaDA2.1's edits may still change a live row's
    tokens (its active block): text is final only before it (none without editing)."""
    if e.rule.edit_threshold is None:
        return ()
    return tuple((ph.row, max(0, ph.window[0])) for ph in phases if ph.row not in done)
