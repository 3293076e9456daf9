"""Cache policies: each step, which canvas columns are recomputed (the active window).

Every other column's K/V come from the KVCache as they were last written. A full forward
(refresh) recomputes the whole canvas. Windows start one column early for models whose output
at column i predicts column i + 1 (Dream), so the block's first column gets a fresh prediction.

| policy    | refresh                  | window on other steps                              |
|-----------|--------------------------|----------------------------------------------------|
| none      | every step               | (whole canvas)                                     |
| prefix    | block start (Fast-dLLM)  | block start .. canvas end                          |
| dual      | block start (Fast-dLLM)  | current block; suffix K/V frozen from the refresh  |
| freecache | first step only (FlashDLM)| block start .. canvas end; on a block's first step |
|           |                          | from the previous block's start, so the finished   |
|           |                          | block's K/V are computed once from its final tokens|
|           |                          | and frozen from then on                            |

`refresh_interval` N > 0 adds a full refresh every N steps within a block, counted from its
first step (N = 1: every step, which makes every policy compute exactly what `none` computes).
"""

from __future__ import annotations

from dataclasses import dataclass

from dllm_cli.decoding.canvas import Block


@dataclass(frozen=True)
class Forward:
    """One step's forward: recompute canvas columns [start, end)."""

    start: int
    end: int
    refresh: bool  # a full forward over the whole canvas
    frozen: tuple[int, int] | None = None  # canvas columns whose K/V are final from now on


@dataclass(frozen=True)
class StepPlace:
    """Where the loop is: what a policy needs to choose a window."""

    block: Block
    previous: Block | None  # the block before, None for the first
    step: int  # 0-based step within the block
    width: int  # canvas width S
    shift: int  # model.logit_shift (1 for Dream)
    interval: int  # refresh_interval (0: off)

    @property
    def periodic_refresh(self) -> bool:
        """Every `interval` steps counted from the block's first step (0: never)."""
        return self.interval > 0 and self.step % self.interval == 0

    def full(self, frozen: tuple[int, int] | None = None) -> Forward:
        return Forward(0, self.width, refresh=True, frozen=frozen)


class NoCache:
    """Reference decoding: the whole canvas every step, no KV cache kept."""

    uses_cache = False

    def plan(self, at: StepPlace) -> Forward:
        return at.full()


class PrefixCache:
    """Fast-dLLM PrefixCache (arXiv 2505.22618): prefix K/V frozen between block refreshes."""

    uses_cache = True

    def plan(self, at: StepPlace) -> Forward:
        if at.step == 0 or at.periodic_refresh:
            return at.full()
        return Forward(at.block.start - at.shift, at.width, refresh=False)


class DualCache:
    """Fast-dLLM DualCache: prefix and suffix K/V frozen; only the block is recomputed."""

    uses_cache = True

    def plan(self, at: StepPlace) -> Forward:
        if at.step == 0 or at.periodic_refresh:
            return at.full()
        return Forward(at.block.start - at.shift, at.block.end, refresh=False)


class FreeCache:
    """FlashDLM FreeCache (arXiv 2505.21467): prompt and finished blocks never recomputed.

    A block's last step commits tokens after its forward, so the K/V that forward wrote still
    show masks. The next block's first step therefore recomputes the finished block once, from
    its final tokens, and freezes it; the prompt is frozen by the one full forward at the start.
    """

    uses_cache = True

    def plan(self, at: StepPlace) -> Forward:
        if at.previous is None and at.step == 0:
            return at.full(frozen=(0, at.block.start))
        if at.periodic_refresh:
            return at.full()
        if at.step == 0:
            prev = at.previous
            return Forward(prev.start - at.shift, at.width, False, frozen=(prev.start, prev.end))
        return Forward(at.block.start - at.shift, at.width, refresh=False)


POLICIES: dict[str, type] = {
    "none": NoCache,
    "prefix": PrefixCache,
    "dual": DualCache,
    "freecache": FreeCache,
}
