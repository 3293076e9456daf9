"""The step stream: one request's canvas delta per engine step, for `include_canvas` clients.

A client that sends `"stream": true, "stream_options": {"include_canvas": true}` gets, between
the usual text chunks, one chunk per engine step whose `canvas` object says what that step did
to its own answer: the positions committed (with token id, spelled text and confidence), the
guide's corrections, LLaDA2.1's edits, DiffusionGemma's drafts, the block it worked in, what
its forward recomputed and which columns are cached, frozen or pruned. The first one also
carries the layout (generation length, blocks) so a client can draw the empty canvas. Only
deltas travel: a 64-step decode of 256 positions sends well under 200 KB of them. Frames are built
only for the requests that asked, from the engine's own StepEvent (built lazily, only then).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate, pairwise
from typing import TYPE_CHECKING

from dllm_cli.decoding.events import RowCommit, RowPhase, StepEvent
from dllm_cli.families import family_of_model
from dllm_cli.settings import DecodeSettings

if TYPE_CHECKING:
    from dllm_cli.runtime import Runtime
    from dllm_cli.serve.protocol import Job

DIGITS = 3  # confidences are rounded to this many decimals (they only colour a cell)


@dataclass
class Frames:
    """One request's canvas stream: spells tokens once, counts its own steps and commits."""

    settings: DecodeSettings
    spell: Callable[[int], str]  # token id -> its text as the tokenizer decodes it alone
    guided: bool
    uniform: bool  # DiffusionGemma: drafts replace noise instead of unmasking
    stop: tuple[int, ...] = ()  # ids that end the answer (drawn as its end)
    prompt_blocks: bool = False  # SDAR, LLaDA2.x: blocks start at the prompt's block boundary
    started: float = field(default_factory=time.perf_counter)
    steps: int = 0
    committed: int = 0
    spelled: dict[int, str] = field(default_factory=dict)
    blocks: list[list[int]] = field(default_factory=list)  # [start, end) answer positions

    def layout(self, window: tuple[int, int]) -> dict:
        """What a client needs to draw the empty canvas (sent with the first frame)."""
        s = self.settings
        self.blocks = plan(s, window if self.prompt_blocks else None)
        return {
            "gen_length": s.gen_length,
            "blocks": self.blocks,
            "cache": s.cache,
            "unmask": s.unmask,
            "suffix_window": s.suffix_window,
            "edit_threshold": s.edit_threshold,
            "guided": self.guided,
            "uniform": self.uniform,
            "stop": list(self.stop),
        }

    def frame(self, event: StepEvent, row: int, forwards: int, guide_forwards: int) -> dict:
        """This step's delta for the request decoded in row `row` of the event."""
        commits = [c for c in event.commits if c.row == row]
        changed = [d for d in event.drafts if d.row == row]
        phase = phase_of(event, row)
        cells = [cell for c in commits for cell in self.cells(c, flags=True)]
        fixed = sum(cell[4] for cell in cells)
        self.committed += len(cells)
        layout = self.layout(phase.window) if self.steps == 0 else None
        out = {
            "step": self.steps,
            "block": self.block_of(phase),
            "block_step": phase.block_step,
            "window": list(phase.window),
            "refresh": phase.refresh,
            "frozen": frozen(event, row),
            "commits": cells,
            "committed": self.committed,
            "forwards": forwards,
            "guide_forwards": guide_forwards,
            "seconds": round(time.perf_counter() - self.started, 4),
            "final": row in event.finished,
        }
        if self.guided:  # accepted drafts and the guide's own tokens, this request's only
            out |= {"accepted": len(cells) - fixed, "corrected": fixed}
        if changed:
            key = "drafts" if self.uniform else "edits"
            out[key] = [cell for d in changed for cell in self.cells(d, flags=False)]
        if self.uniform and row in event.settled:
            out["settled"] = True
        held = dict(event.revocable).get(row)  # WINO may still mask commits from here on
        extra = {"revocable_from": held, "pruned_from": self.pruned_from(out["block"])}
        out |= {k: v for k, v in (extra | {"layout": layout}).items() if v is not None}
        self.steps += 1
        return out

    def cells(self, commit: RowCommit, flags: bool) -> list[list]:
        """[position, token id, text, confidence(, corrected)] per committed position."""
        fixed = commit.corrected or (False,) * len(commit.positions)
        every = zip(commit.positions, commit.tokens, commit.confidences, fixed, strict=True)
        out = []
        for pos, tok, conf, corrected in every:
            cell = [pos, tok, self.text(tok), round(float(conf), DIGITS)]
            out.append([*cell, int(corrected)] if flags else cell)
        return out

    def pruned_from(self, block: int) -> int | None:
        """Suffix pruning: positions from here on were neither computed nor attended."""
        w, g = self.settings.suffix_window, self.settings.gen_length
        if not w or self.prompt_blocks or self.uniform or block >= len(self.blocks):
            return None
        start = self.blocks[block][1] + w
        return start if start < g else None

    def block_of(self, phase: RowPhase) -> int:
        """The answer block the step worked in (block-causal engines number their blocks from
        the prompt's first; their window is that block)."""
        if not self.prompt_blocks:
            return phase.block
        at = max(0, phase.window[0])
        return next((i for i, (a, b) in enumerate(self.blocks) if a <= at < b), phase.block)

    def text(self, token: int) -> str:
        if token not in self.spelled:
            self.spelled[token] = self.spell(token)
        return self.spelled[token]


def frames_for(runtime: Runtime, job: Job) -> Frames:
    """A request's canvas stream, spelling tokens with the served tokenizer."""
    loaded = runtime.loaded
    traits = family_of_model(loaded.model).traits
    uniform, causal = traits.uniform, traits.prompt_blocks
    guided = job.guide and runtime.guide is not None
    stop = tuple(loaded.special.stop)
    return Frames(
        job.settings, lambda t: loaded.tokenizer.decode([t]), guided, uniform, stop, causal
    )


def draw(engine, out, watching: list) -> None:
    """This step's frame to each (request id, ticket) watching; the event is built here."""
    event = out.event
    if event is None:  # a step without a forward (rows retired): nothing to draw
        return
    done = {f.id: f for f in out.finished}
    seen = {p.row for p in event.phases} | {c.row for c in event.commits}
    for rid, ticket in watching:
        ticket.row = event_row(engine, rid) if ticket.row is None else ticket.row
        if ticket.row is None or (event.phases and ticket.row not in seen):
            continue  # not decoding yet (waiting for a slot)
        counts = done.get(rid) or engine.requests.get(rid)
        forwards = getattr(counts, "forwards", 0)
        guide = getattr(counts, "guide_forwards", 0)
        ticket.post("canvas", ticket.frames.frame(event, ticket.row, forwards, guide))


def plan(settings: DecodeSettings, window: tuple[int, int] | None) -> list[list[int]]:
    """The answer's blocks: the settings' block plan, or (block-causal) blocks of the first
    window's size from that window's end, the first one cut at the answer's start."""
    g = settings.gen_length
    if window is None:
        edges = [0, *accumulate(length for length, _ in settings.block_plan())]
        return [[a, b] for a, b in pairwise(edges)]
    size, end = window[1] - window[0], min(window[1], g)
    blocks = [[0, end]] if end > 0 else []
    while end < g:
        blocks.append([end, min(end + size, g)])
        end += size
    return blocks


def event_row(engine, rid: int) -> int | None:
    """The row a request has in its engine's StepEvents: its id, or (DiffusionGemma, whose
    events number the rows of its static batch) its index in that batch; None: not decoding."""
    if not hasattr(engine, "run"):
        return rid
    return next((i for i, r in enumerate(engine.live) if r.id == rid), None)


def frozen(event: StepEvent, row: int) -> list[int] | None:
    """Positions whose K/V became final: the event reports them for its first live row only."""
    head = event.phases[0].row if event.phases else row
    return list(event.frozen) if event.frozen is not None and head == row else None


def phase_of(event: StepEvent, row: int) -> RowPhase:
    """The row's own place this step (the event's head when it has no phases)."""
    found = next((p for p in event.phases if p.row == row), None)
    return found or RowPhase(row, event.block, event.block_step, event.window, event.refresh)


def chunk(model_id: str, rid: str, kind: str, frame: dict, index: int = 0) -> dict:
    """A canvas frame as a stream chunk: OpenAI's chunk shape with no choices (so clients
    that do not know it skip it, as they skip the usage chunk) and dllm's `canvas` field,
    which names the choice it draws (`index`, as a choice's own; n > 1 has several)."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    out = {"id": rid, "object": obj, "created": int(time.time()), "model": model_id}
    return out | {"choices": [], "canvas": {"index": index} | frame}
