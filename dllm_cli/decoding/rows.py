"""Per-row progress: where each row (batch slot) is in its own decode.

A row keeps its block, its step in it, the masks the block held when the row entered it, how
far its K/V are frozen (FreeCache) and whether a forward has served it yet. Block walk (the
unmasking rules): a row leaves a block with no masks left, in lockstep (a static batch, as LLaDA
and Fast-dLLM decode) once no row has masks left in it. Frontier walk (guided decoding,
FlashDLM): a row's block is the one holding its first mask, so it may skip blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm_cli.decoding.canvas import Block, Canvas
from dllm_cli.decoding.policies import ForwardPlan, StepPlace


@dataclass
class RowState:
    """One row's place in its decode."""

    block: int  # index of the row's current block
    step: int = 0  # steps taken in that block
    masks_at_start: int = 0  # masks the block held at the row's first step in it
    frozen_until: int = 0  # canvas column before which its K/V are final (FreeCache)
    fresh: bool = True  # no forward has served the row yet
    seen: int = 0  # canvas column before which its K/V were computed at least once
    first: int = 0  # frontier walk: canvas column of its first mask (host copy)
    lead: int = 0  # canvas column of its first prompt token (left padding before it)
    blocks: tuple[Block, ...] = ()  # its own answer's blocks (its gen_length, canvas columns)

    def place(
        self, width: int, shift: int, interval: int, reach: int | None = None, suffix: int = 0
    ) -> StepPlace:
        """Where the row is; its canvas ends at its own answer's end, and `suffix` W > 0
        prunes it W columns past its block (a shorter answer: a canvas cut for good)."""
        block = self.current
        limit = min(block.end + suffix, self.end) if suffix > 0 else self.end
        return StepPlace(
            block, self.step, width, shift, interval, self.fresh, self.frozen_until, reach,
            limit, self.seen, self.lead,
        )  # fmt: skip

    def where(self) -> tuple[Block, int, int, bool, int, int]:
        """Every field that places the row's next forward (not its mask count or first mask)."""
        return self.current, self.step, self.frozen_until, self.fresh, self.seen, self.end

    @property
    def current(self) -> Block:
        return self.blocks[self.block]

    @property
    def end(self) -> int:
        """Canvas column where its answer (and so its canvas) ends."""
        return self.blocks[-1].end

    def served(self, plan: ForwardPlan) -> None:
        """After a forward: the row is no longer fresh; frozen columns stay frozen."""
        self.fresh = False
        if plan.frozen is not None:
            self.frozen_until = max(self.frozen_until, plan.frozen[1])
        if plan.refresh or plan.start <= self.seen:  # joined to what was computed
            self.seen = max(self.seen, plan.end)

    def shift(self, extra: int) -> None:
        """The canvas grew `extra` columns on the left (continuous batching)."""
        self.frozen_until += extra
        self.seen += extra
        self.first += extra
        self.lead += extra

    def enter(self, block: int) -> None:
        """Move to another block (step 0 there)."""
        self.block, self.step = block, 0


def first_masks(canvas: Canvas) -> torch.Tensor:
    """(B,) canvas column of each row's first mask (the canvas width when it has none)."""
    masked = canvas.ids == canvas.mask_id  # (B, S)
    columns = canvas.columns()[None].expand_as(masked)
    return torch.where(masked, columns, canvas.width).min(dim=1).values


def block_of(column: int, blocks: tuple[Block, ...]) -> int:
    """Index of the block holding canvas `column` (the last block past the end)."""
    for b in blocks:
        if column < b.end:
            return b.index
    return blocks[-1].index


class BlockWalk:
    """Rows leave a block once it has no masks (all rows together when in lockstep)."""

    frontier = False

    def __init__(self, lockstep: bool):
        self.lockstep = lockstep

    def begin(self, rows: list[RowState], canvas: Canvas) -> None:
        """A row starting a block counts the block's masks (LLaDA's schedule needs them): all
        of its columns, as a block walk commits only inside the row's current block."""
        for row in rows:
            if row.step == 0:
                row.masks_at_start = row.current.length

    def pending(self, canvas: Canvas, rows: list[RowState]) -> torch.Tensor:
        """(B,) on the device: masks left in each row's block (what `advance` reads)."""
        return block_masks(canvas, rows)

    def advance(self, rows: list[RowState], counts: list[int]) -> None:
        """Move rows on from `counts`, the host copy of `pending` after the step's commits."""
        if not rows:
            return
        left = [n > 0 for n in counts]
        if self.lockstep:
            move = not any(left)
            left = [not move] * len(rows)
        for row, open_ in zip(rows, left, strict=True):
            if open_ or row.block + 1 == len(row.blocks):
                row.step += 1
            else:
                row.enter(row.block + 1)


class FrontierWalk:
    """A row's block is the one holding its first mask (guided decoding)."""

    frontier = True

    def begin(self, rows: list[RowState], canvas: Canvas) -> None:
        pass

    def pending(self, canvas: Canvas, rows: list[RowState]) -> torch.Tensor:
        """(B,) on the device: each row's first masked column (what `advance` reads)."""
        return first_masks(canvas)

    def advance(self, rows: list[RowState], firsts: list[int]) -> None:
        if not rows:
            return
        for row, first in zip(rows, firsts, strict=True):
            row.first = first
            block = block_of(first, row.blocks)
            if block == row.block:
                row.step += 1
            else:
                row.enter(block)


def block_masks(canvas: Canvas, rows: list[RowState]) -> torch.Tensor:
    """(B,) masks left in each row's current block, on the device."""
    head = rows[0].current
    if all(row.current == head for row in rows):  # one shared block: a slice
        return canvas.masked(head).sum(dim=1)
    device = canvas.ids.device
    starts = torch.tensor([row.current.start for row in rows], device=device)
    ends = torch.tensor([row.current.end for row in rows], device=device)
    cols = canvas.columns()[None]
    inside = (cols >= starts[:, None]) & (cols < ends[:, None])  # (B, S)
    return ((canvas.ids == canvas.mask_id) & inside).sum(dim=1)


def same_place(rows: list[RowState]) -> bool:
    """Every row at the same block and step (one shared plan serves them all)."""
    first = rows[0].where()
    return all(row.where() == first for row in rows)
