"""Cache policies: each step, which canvas columns are recomputed (the active window).

Every other column's K/V come from the KVCache as they were last written; a refresh recomputes
the row's whole canvas from its first real column (its left padding is never computed).
Windows start one column early for models whose output at column i predicts column i + 1
(Dream). The policies (none, prefix, dual: Fast-dLLM; freecache: FlashDLM) are tabled in
docs/decoding.md; `refresh_interval` N > 0 adds a full refresh every N steps of a block.

A policy plans one row at a time from its own place (`StepPlace`: its block, its step in it,
how far its K/V are frozen), so rows at different places each get their own window. A guided
row needs no prediction past its draft window, so Prefix and FreeCache windows stop there
(`reach`). Suffix pruning (`suffix_window` W > 0; DPad, Streaming-dLLM) cuts what a row sees at
`limit`, W columns past its current block (and, for a row whose own gen_length is shorter than
the canvas's answer, at its own answer's end); columns first in reach (past `seen`) are
computed whatever `reach` says.
"""

from __future__ import annotations

from dataclasses import dataclass

from dllm_cli.decoding.canvas import Block


@dataclass(frozen=True)
class ForwardPlan:
    """One step's forward: recompute canvas columns [start, end)."""

    start: int
    end: int
    refresh: bool  # a full forward over the whole (pruned) canvas
    frozen: tuple[int, int] | None = None  # canvas columns whose K/V are final from now on
    keys: int | None = None  # attend only keys before this column (suffix pruning; None: all)
    lead: int = 0  # the row's first real column: keys before it are its left padding


@dataclass(frozen=True)
class StepPlace:
    """Where a row is: what a policy needs to choose its window."""

    block: Block
    step: int  # 0-based step within the block
    width: int  # canvas width S
    shift: int  # model.logit_shift (1 for Dream)
    interval: int  # refresh_interval (0: off)
    fresh: bool = False  # no forward has served the row yet (its decode's first step)
    frozen_until: int = 0  # canvas column before which the row's K/V are final (FreeCache)
    reach: int | None = None  # guided draft window: no prediction needed from this column on
    limit: int | None = None  # suffix pruning: the row's canvas ends here (None: at width)
    seen: int = 0  # columns before this one hold K/V computed at least once
    lead: int = 0  # the row's first real column (its left padding ends here)

    @property
    def last(self) -> int:
        """The end of the canvas the row sees (its pruned limit, or the canvas width)."""
        return self.width if self.limit is None else min(self.width, self.limit)

    @property
    def end(self) -> int:
        """Where a window running to the canvas end may stop (the draft window's end), but
        never short of columns that have never been computed (a limit that moved on)."""
        last = self.last
        if self.reach is None or self.seen < last:
            return last
        return min(last, self.reach)

    @property
    def keys(self) -> int | None:
        """Attended keys stop at the limit (None: the whole canvas)."""
        return None if self.limit is None or self.limit >= self.width else self.limit

    @property
    def periodic_refresh(self) -> bool:
        """Every `interval` steps counted from the block's first step (0: never)."""
        return self.interval > 0 and self.step % self.interval == 0

    def full(self, frozen: tuple[int, int] | None = None) -> ForwardPlan:
        """Every real column of the row: from its first token (not its padding) on."""
        return ForwardPlan(self.lead, self.last, True, frozen, self.keys, self.lead)

    def window(self, start: int, end: int, frozen: tuple[int, int] | None = None) -> ForwardPlan:
        """A cached step recomputing [start, end), attending up to the limit."""
        return ForwardPlan(start, end, False, frozen, self.keys, self.lead)


class NoCache:
    """Reference decoding: the whole canvas every step, no KV cache kept."""

    uses_cache = False

    def plan(self, at: StepPlace) -> ForwardPlan:
        return at.full()


class PrefixCache:
    """Fast-dLLM PrefixCache (arXiv 2505.22618): prefix K/V frozen between block refreshes."""

    uses_cache = True

    def plan(self, at: StepPlace) -> ForwardPlan:
        if at.step == 0 or at.periodic_refresh:
            return at.full()
        return at.window(at.block.start - at.shift, at.end)


class DualCache:
    """Fast-dLLM DualCache: prefix and suffix K/V frozen; only the block is recomputed."""

    uses_cache = True

    def plan(self, at: StepPlace) -> ForwardPlan:
        if at.step == 0 or at.periodic_refresh:
            return at.full()
        return at.window(at.block.start - at.shift, at.block.end)


class FreeCache:
    """FlashDLM FreeCache (arXiv 2505.21467): prompt and finished blocks never recomputed. A
    block's last forward wrote K/V that still show masks, so the next block's first step
    recomputes the unfrozen finished blocks once, from their final tokens, and freezes them."""

    uses_cache = True

    def plan(self, at: StepPlace) -> ForwardPlan:
        if at.fresh:
            return at.full(frozen=(0, at.block.start))
        if at.periodic_refresh:
            return at.full()
        done = at.frozen_until
        if at.step == 0 and done < at.block.start:
            return at.window(done - at.shift, at.end, frozen=(done, at.block.start))
        return at.window(at.block.start - at.shift, at.end)


POLICIES: dict[str, type] = {
    "none": NoCache,
    "prefix": PrefixCache,
    "dual": DualCache,
    "freecache": FreeCache,
}
