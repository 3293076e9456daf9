"""What the decoder reports: one StepEvent per step, one DecodeResult at the end.

Positions are answer positions (0 = first generated token); negative numbers in a window are
prompt columns (-1 = the last prompt column of the left-padded canvas).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from dllm_cli.decoding.answer import answer_tokens


@dataclass(frozen=True)
class RowCommit:
    """Tokens one row committed in one step."""

    row: int  # index into the prompts given to the decoder
    positions: tuple[int, ...]
    tokens: tuple[int, ...]
    confidences: tuple[float, ...]


@dataclass(frozen=True)
class StepEvent:
    """One decoding step, for streaming text, a live view or a benchmark."""

    step: int  # 0-based over the whole decode
    block: int
    block_step: int  # 0-based within the block
    window: tuple[int, int]  # answer positions recomputed this step, [start, end)
    refresh: bool  # a full forward (cache refresh) ran this step
    frozen: tuple[int, int] | None  # positions whose K/V became final this step (freecache)
    forwards: int  # model forwards so far, this step included
    commits: tuple[RowCommit, ...]
    finished: tuple[int, ...] = ()  # rows whose answer became final this step
    accepted: int | None = None  # drafts a verifying committer accepted (None: no verifier)
    # Uniform-state diffusion (DiffusionGemma) replaces tokens instead of unmasking them: the
    # positions whose draft token changed this step (not final until committed), and the rows
    # whose draft the stopping rule declared stable and confident this step.
    drafts: tuple[RowCommit, ...] = ()
    settled: tuple[int, ...] = ()

    @property
    def committed(self) -> int:
        """Tokens committed this step over all rows."""
        return sum(len(c.positions) for c in self.commits)

    @property
    def replaced(self) -> int:
        """Draft tokens replaced this step over all rows (uniform-state diffusion)."""
        return sum(len(d.positions) for d in self.drafts)


@dataclass
class DecodeResult:
    """Every generated position of every row, and what it cost."""

    tokens: list[list[int]]  # per row: gen_length ids (after an early stop: EOS fill)
    commit_steps: list[list[int]]  # per row and position: step that committed it (-1: filled)
    prompt_lengths: list[int]
    forwards: int  # model forwards (NFE)
    steps: int
    seconds: float
    finished_at: list[int] = field(default_factory=list)  # per row: step its answer was final

    @property
    def tokens_per_forward(self) -> float:
        total = sum(len(t) for t in self.tokens)
        return total / self.forwards if self.forwards else 0.0

    def answer(self, row: int, stop: Iterable[int]) -> list[int]:
        """A row's answer tokens (before its first stop token: the text a user sees)."""
        return answer_tokens(self.tokens[row], stop)
