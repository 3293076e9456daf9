"""The step stream: one request's canvas delta per engine step, for `include_canvas` clients.

A client that sends `"stream": true, "stream_options": {"include_canvas": true}` gets, between
the usual text chunks, one chunk per engine step whose `canvas` object says what that step did
to its own answer: the positions committed (with token id, spelled text and confidence), the
guide's corrections, LLaDA2.1's edits, DiffusionGemma's drafts, the block it worked in, what
its forward recomputed and which columns are cached, frozen or pruned. The first one also
carries the layout (generation length, blocks) so a client can draw the empty canvas. Only
deltas travel, so a 64-step decode of 256 positions costs a few tens of KB. Frames are built
only for the requests that asked, from the engine's own StepEvent (built lazily, only then).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from dllm_cli.decoding.events import RowCommit, RowPhase, StepEvent
from dllm_cli.settings import DecodeSettings

DIGITS = 3  # confidences are rounded to this many decimals (they only colour a cell)


@dataclass
class Frames:
    """One request's canvas stream: spells tokens once, counts its own steps and commits."""

    settings: DecodeSettings
    spell: object  # (token id) -> its text as the tokenizer decodes it alone
    guided: bool
    uniform: bool  # DiffusionGemma: drafts replace noise instead of unmasking
    stop: tuple[int, ...] = ()  # ids that end the answer (drawn as its end)
    started: float = field(default_factory=time.perf_counter)
    steps: int = 0
    committed: int = 0
    spelled: dict[int, str] = field(default_factory=dict)

    def layout(self) -> dict:
        """What a client needs to draw the empty canvas (sent with the first frame)."""
        s, start, blocks = self.settings, 0, []
        for length, _ in s.block_plan():
            blocks.append([start, start + length])
            start += length
        return {
            "gen_length": s.gen_length,
            "blocks": blocks,
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
        out = {
            "step": self.steps,
            "block": phase.block,
            "block_step": phase.block_step,
            "window": list(phase.window),
            "refresh": phase.refresh,
            "frozen": list(event.frozen) if event.frozen is not None else None,
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
        held = dict(event.revocable).get(row)
        if held is not None:  # WINO may still mask commits from here on
            out["revocable_from"] = held
        if self.steps == 0:
            out["layout"] = self.layout()
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

    def text(self, token: int) -> str:
        if token not in self.spelled:
            self.spelled[token] = self.spell(token)  # type: ignore[operator]
        return self.spelled[token]


def event_row(engine, rid: int) -> int | None:
    """The row a request has in its engine's StepEvents: its id, or (DiffusionGemma, whose
    events number the rows of its static batch) its index in that batch; None: not decoding."""
    if not hasattr(engine, "run"):
        return rid
    return next((i for i, r in enumerate(engine.live) if r.id == rid), None)


def phase_of(event: StepEvent, row: int) -> RowPhase:
    """The row's own place this step (the event's head when it has no phases)."""
    found = next((p for p in event.phases if p.row == row), None)
    if found is not None:
        return found
    return RowPhase(row, event.block, event.block_step, event.window, event.refresh)


def chunk(model_id: str, rid: str, kind: str, frame: dict) -> dict:
    """A canvas frame as a stream chunk: OpenAI's chunk shape with no choices (so clients
    that do not know it skip it, as they skip the usage chunk) and dllm's `canvas` field."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    out = {"id": rid, "object": obj, "created": int(time.time()), "model": model_id}
    return out | {"choices": [], "canvas": frame}
