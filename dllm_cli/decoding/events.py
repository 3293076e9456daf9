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
    confidences: tuple[float, ...]  # the diffusion model's, for its draft at each position
    corrected: tuple[bool, ...] = ()  # guided: the guide's own token, not the draft (else ())


@dataclass(frozen=True)
class RowPhase:
    """Where one row was this step (rows of a batch may be at different places)."""

    row: int
    block: int
    block_step: int
    window: tuple[int, int]  # answer positions its forward recomputed
    refresh: bool  # it was served by a full forward
    tail: int = 0  # block-causal canvases: prompt columns sharing the row's first answer block


@dataclass(frozen=True)
class StepEvent:
    """One decoding step, for streaming text, a live view or a benchmark; block, block_step,
    window, refresh and frozen describe the first live row, `phases` every row's."""

    step: int  # 0-based over the whole decode
    block: int
    block_step: int  # 0-based within the block
    window: tuple[int, int]  # answer positions recomputed this step, [start, end)
    refresh: bool  # a full forward (cache refresh) ran this step
    frozen: tuple[int, int] | None  # positions whose K/V became final this step (freecache)
    forwards: int  # diffusion-model forwards so far, this step included
    commits: tuple[RowCommit, ...]
    finished: tuple[int, ...] = ()  # rows whose answer became final this step
    accepted: int | None = None  # drafts a verifying committer accepted (None: no verifier)
    guide_forwards: int = 0  # the AR guide's forwards so far, this step included
    corrected: int | None = None  # tokens the guide chose instead of a draft (None: no guide)
    phases: tuple[RowPhase, ...] = ()  # each live row's place this step
    # Uniform-state diffusion (DiffusionGemma) replaces tokens instead of unmasking them:
    drafts: tuple[RowCommit, ...] = ()  # positions whose draft changed (final once committed)
    settled: tuple[int, ...] = ()  # rows the stopping rule found stable and confident
    # (row, answer position) of each live row from which WINO's revocations or LLaDA2.1's
    # edits may still change its text (final only before it)
    revocable: tuple[tuple[int, int], ...] = ()

    @property
    def committed(self) -> int:
        """Tokens committed this step over all rows."""
        return sum(len(c.positions) for c in self.commits)

    @property
    def replaced(self) -> int:
        """Draft tokens replaced this step over all rows (uniform-state diffusion)."""
        return sum(len(d.positions) for d in self.drafts)


def row_commits(rows, positions, tokens, confidences, corrected, original) -> tuple[RowCommit, ...]:
    """RowCommits from flat (N,) tensors of committed slots, in row order (`original`: the
    prompt index of each live row; `corrected`: None without a verifier)."""
    flags = corrected.tolist() if corrected is not None else [False] * len(rows)
    grouped: dict[int, list] = {}
    every = (rows.tolist(), positions.tolist(), tokens.tolist(), confidences.tolist(), flags)
    for r, *item in zip(*every, strict=True):
        grouped.setdefault(r, []).append(item)
    out = []
    for r, items in grouped.items():
        pos, toks, confs, fixed = (tuple(x) for x in zip(*items, strict=True))
        out.append(RowCommit(original[r], pos, toks, confs, fixed if corrected is not None else ()))
    return tuple(out)


@dataclass
class DecodeResult:
    """Every generated position of every row, and what it cost."""

    tokens: list[list[int]]  # per row: gen_length ids (after an early stop: EOS fill)
    commit_steps: list[list[int]]  # per row and position: step that committed it (-1: filled)
    prompt_lengths: list[int]
    forwards: int  # diffusion-model forwards (NFE)
    steps: int
    seconds: float
    finished_at: list[int] = field(default_factory=list)  # per row: step its answer was final
    guide_forwards: int = 0  # the AR guide's forwards (guided decoding)
    guide_seconds: float = 0.0  # part of `seconds` spent in the guide
    rows_served: int = 0  # live rows summed over steps (/ forwards: mean rows per forward)

    @property
    def tokens_per_forward(self) -> float:
        total = sum(len(t) for t in self.tokens)
        return total / self.forwards if self.forwards else 0.0

    def answer(self, row: int, stop: Iterable[int]) -> list[int]:
        """A row's answer tokens (before its first stop token: the text a user sees)."""
        return answer_tokens(self.tokens[row], stop)
