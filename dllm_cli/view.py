"""Rendering StepEvents: answer text streamed as it becomes final, and the Rich canvas view.

Both consume the decoder's events and never drive it, so the live view, a replay of recorded
events and the SVG/HTML export (view_export.py) all draw the same frames.
"""

from __future__ import annotations

import colorsys
import math
from bisect import bisect_right
from collections.abc import Callable
from itertools import accumulate
from pathlib import Path

from rich.color import Color
from rich.console import Group, RenderableType
from rich.style import Style
from rich.table import Table
from rich.text import Text

from dllm_cli.decoding import DecodeResult, RowCommit, StepEvent, answer_end
from dllm_cli.errors import SettingsError
from dllm_cli.families import FAMILIES
from dllm_cli.runtime import Runtime
from dllm_cli.settings import DecodeSettings
from dllm_cli.view_words import Speller

MASK_GLYPH = "░"
END_GLYPH = "∎"
SAVE_KINDS = (".svg", ".html")


class CanvasView:
    """One answer's canvas as the events build it, drawn as rows of blocks."""

    def __init__(
        self,
        settings: DecodeSettings,
        decode: Callable[[list[int]], str],
        stop_ids: tuple[int, ...] = (),
        uniform: bool = False,
        guided: bool = False,
    ):
        self.s = settings
        self.uniform = uniform  # uniform-state diffusion: drafts replace tokens (DiffusionGemma)
        self.guided = guided  # an AR guide commits at the first mask: the answer grows in order
        self.speller = Speller(decode)  # ids -> text as the tokenizer detokenises them
        self.stop_ids = tuple(stop_ids)
        g = settings.gen_length
        self.tokens: list[int | None] = [None] * g
        self.steps = [-1] * g
        self.confidence = [0.0] * g
        self.drafts: list[int | None] = [None] * g  # latest draft token, not yet final
        self.drafted = [-1] * g  # step that last replaced the draft
        self.settled: int | None = None  # step the stopping rule settled row 0's canvas
        self.lay_out(0)
        self.frozen: list[tuple[int, int]] = []
        self.event: StepEvent | None = None
        self.block = 0  # the block the last step worked in (see `update`)
        self.committed = 0
        self.end = g  # where the answer ends (its first stop token), as far as committed
        self.accepted: int | None = None
        self.corrected: int | None = None
        self.by_guide: set[int] = set()  # positions holding the guide's own token
        self.edited: set[int] = set()  # positions whose token an edit replaced (LLaDA2.1)
        self.edits = 0
        self.seconds = 0.0
        self.done = False

    @classmethod
    def for_runtime(cls, runtime: Runtime) -> CanvasView:
        """A view that spells tokens with the runtime's tokenizer."""
        tok, special = runtime.loaded.tokenizer, runtime.loaded.special
        uniform = FAMILIES[runtime.loaded.family].traits.uniform
        guided = runtime.guide is not None
        return cls(runtime.settings, tok.decode, special.stop, uniform, guided)

    def lay_out(self, offset: int) -> None:
        """Answer blocks: the settings' plan, or (a block-causal canvas, whose blocks start at
        the prompt's whole blocks) a first block `offset` columns short."""
        g, size = self.s.gen_length, self.s.block_length
        if offset:
            edges = [*range(size - offset, g, size), g]
        else:
            edges = list(accumulate(length for length, _ in self.s.block_plan()))
        self.blocks = list(zip([0, *edges[:-1]], edges, strict=True))
        self.starts = [a for a, _ in self.blocks]

    def update(self, event: StepEvent, seconds: float) -> None:
        """Take one step's commits (row 0); `seconds` is decoding time so far."""
        tail = next((ph.tail for ph in event.phases if ph.row == 0), 0)
        if self.event is None and tail:  # the prompt's tail opens the first answer block
            self.lay_out(tail)
        for c in event.commits:
            if c.row != 0:
                continue
            for pos, tok, conf in zip(c.positions, c.tokens, c.confidences, strict=True):
                self.tokens[pos], self.steps[pos], self.confidence[pos] = tok, event.step, conf
            fixed = c.corrected or (False,) * len(c.positions)
            self.by_guide.update(p for p, by in zip(c.positions, fixed, strict=True) if by)
            self.committed += len(c.positions)
        self.end = answer_end(self.tokens, self.stop_ids)
        # A guided step starts in the frontier's block and may commit past its end: the block
        # it committed into last is the one it left off in.
        mine = [p for c in event.commits if c.row == 0 for p in c.positions]
        self.block = max(event.block, self.block_of(max(mine))) if mine else event.block
        for draft in event.drafts:
            if draft.row == 0 and self.uniform:
                self._redraft(draft, event.step)
            elif draft.row == 0:  # token editing (LLaDA2.1): committed tokens replaced
                self._edit(draft, event.step)
        if event.block_step == 0:
            self.settled = None
        if 0 in event.settled:
            self.settled = event.step
        if event.frozen is not None:
            self.frozen.append(event.frozen)
        if event.accepted is not None:
            self.accepted = (self.accepted or 0) + event.accepted
        if event.corrected is not None:
            self.corrected = (self.corrected or 0) + event.corrected
        self.event, self.seconds = event, seconds

    def _edit(self, edit: RowCommit, step: int) -> None:
        """Token-to-token editing: these committed tokens were replaced by new drafts."""
        for pos, tok, conf in zip(edit.positions, edit.tokens, edit.confidences, strict=True):
            self.tokens[pos], self.steps[pos], self.confidence[pos] = tok, step, conf
            self.edited.add(pos)
        self.edits += len(edit.positions)
        self.end = answer_end(self.tokens, self.stop_ids)

    def _redraft(self, draft: RowCommit, step: int) -> None:
        """Uniform-state diffusion: the denoiser replaced these draft tokens."""
        for pos, tok, conf in zip(draft.positions, draft.tokens, draft.confidences, strict=True):
            self.drafts[pos], self.drafted[pos], self.confidence[pos] = tok, step, conf

    def finish(self, result: DecodeResult) -> None:
        """The final canvas: positions filled after an early stop show as ended."""
        for pos, tok in enumerate(result.tokens[0]):
            if self.tokens[pos] is None:
                self.tokens[pos] = tok
        self.end = answer_end(self.tokens, self.stop_ids)
        self.seconds, self.done = result.seconds, True

    # --- drawing ------------------------------------------------------------------------
    def block_of(self, pos: int) -> int:
        return bisect_right(self.starts, pos) - 1

    def header(self) -> Text:
        """Two lines: where the decode is, and how it decodes."""
        e, s = self.event, self.s
        rate = self.committed / self.seconds if self.seconds > 0 else 0.0
        rule = {
            "threshold": f" {s.threshold:g}",
            "factor": f" {s.factor:g}",
            "eb": f" gamma {s.eb_gamma:g}",
            "klass": f" {s.threshold:g}, kl {s.kl_threshold:g}",
            "wino": f" {s.threshold:g}, verify {s.wino_verify:g}",
            "sdlm": f" {s.threshold:g}, jump {s.jump_threshold:g}",
            "credit": f" {s.threshold:g}, alpha {s.credit_alpha:g}",
        }.get(s.unmask, "")
        progress = [
            f"step {e.step + 1 if e else 0}" + (" (done)" if self.done else ""),
            f"block {self.block + 1}/{len(self.blocks)}",
            f"+{e.committed if e else 0} tokens",
            f"{self.committed}/{s.gen_length} committed",
            f"forwards {e.forwards if e else 0}" + guide_forwards(e),
            f"{rate:.1f} tok/s",
        ]
        method = [] if self.uniform else [f"cache {s.cache}"]
        if self.uniform:
            progress.insert(3, f"~{e.replaced if e else 0} replaced")
            if self.settled is not None:
                method.append(f"settled at step {self.settled + 1} (stable and confident)")
        elif self.guided:  # the guide, not the unmask rule, picks what is committed
            method.append("guided: left to right (--no-guide: diffusion order)")
        else:
            method.append(f"unmask {s.unmask}{rule}")
        if s.edit_threshold is not None:
            method.append(f"edit {s.edit_threshold:g}: {self.edits} tokens replaced")
        if self.accepted is not None:
            method.append(f"accepted {self.accepted}")
        if self.corrected is not None:
            method.append(f"corrected {self.corrected}")
        return Text("\n".join("  ".join(line) for line in (progress, method) if line), "bold")

    def block_state(self, index: int) -> tuple[str, str]:
        """(marker, style) of a block: current, finished, cached K/V or waiting."""
        start, end = self.blocks[index]
        filled = all(t is not None for t in self.tokens[start:end])
        if self.event is not None and self.block == index and not self.done:
            return "▶", "bold yellow"
        if filled and self._cached(start, end):
            return "❄", "cyan"
        if filled:
            return "✓", "green"
        if self._pruned(start):
            return "✂", "dim"
        return "·", "dim"

    def _pruned(self, start: int) -> bool:
        """Past the suffix window this step: neither computed nor attended (suffix pruning)."""
        w, e = self.s.suffix_window, self.event
        if not w or e is None or self.done:
            return False
        return start >= self.blocks[e.block][1] + w

    def _cached(self, start: int, end: int) -> bool:
        if self.s.cache == "freecache" or self.frozen:
            return any(a <= start and end <= b for a, b in self.frozen)
        if self.s.cache in ("prefix", "dual") and self.event is not None:
            w0, w1 = self.event.window
            return end <= w0 or start >= w1
        return False

    def word_token(self, pos: int) -> int | None:
        """The committed answer token at `pos`, or None (a mask, a draft, the answer's end)."""
        tok = self.tokens[pos]
        return None if tok is None or pos >= self.end or self.steps[pos] < 0 else tok

    def token_style(self, pos: int) -> Style:
        """Hue: commit step; underlined: this step's; inverse: the guide's own token; italic: an
        edit replaced it."""
        style = step_style(self.steps[pos], self.confidence[pos])
        if self.event is not None and self.steps[pos] == self.event.step and not self.done:
            style += Style(underline=True)
        if pos in self.by_guide:
            style += Style(reverse=True)  # the guide's own token, not the diffusion draft
        if pos in self.edited:
            style += Style(italic=True)  # an edit replaced the token committed here
        return style

    def token_cell(self, pos: int) -> Text:
        tok = self.tokens[pos]
        if tok is None and self.drafts[pos] is not None:
            return self.draft_cell(pos)
        if tok is None:
            return Text(MASK_GLYPH, style="dim")
        if self.word_token(pos) is None:  # the stop token itself, or past it
            return Text(END_GLYPH, style="dim")
        return Text(spell(self.speller.text((tok,))), style=self.token_style(pos))

    def word_cell(self, start: int, end: int) -> Text:
        """Sub-word pieces as one cell, spelled as the tokenizer joins them, each piece in
        its own token's style (a cell never wraps inside)."""
        if end - start == 1:
            return self.token_cell(start)
        pieces = self.speller.pieces(tuple(self.tokens[start:end]))  # type: ignore[arg-type]
        cell = Text()
        for pos, piece in zip(range(start, end), pieces, strict=True):
            cell.append(escape(piece), style=self.token_style(pos))
        cell.rstrip()
        lead = len(cell.plain) - len(cell.plain.lstrip())  # a blank token joined its word
        return cell[lead:] if lead < len(cell) else Text("␣", style=self.token_style(start))

    def draft_cell(self, pos: int) -> Text:
        """A token the denoiser may still replace: italic; underlined when it just changed."""
        tok = self.drafts[pos]
        style = step_style(self.drafted[pos], self.confidence[pos]) + Style(italic=True)
        if self.event is not None and self.drafted[pos] == self.event.step and not self.done:
            style += Style(underline=True)
        return Text(spell(self.speller.text((tok,))), style=style)  # type: ignore[arg-type]

    def rows(self) -> list[Text]:
        """Each block's cells; a word running past its block's end is drawn whole in the row
        where it starts, so a number or a word is never cut in two."""
        shown = [self.word_token(p) for p in range(self.s.gen_length)]
        cells: list[list[Text]] = [[] for _ in self.blocks]
        for start, end in self.speller.words(shown):
            cells[self.block_of(start)].append(self.word_cell(start, end))
        return [Text(" ").join(row) for row in cells]

    def ended_from(self) -> int:
        """The first of the trailing blocks that hold only the answer's end (stop token or
        early-stop fill), all drawn the same way; len(blocks) when there are none."""
        first = len(self.blocks)
        while first > 0:
            start, end = self.blocks[first - 1]
            if start < self.end or any(t is None for t in self.tokens[start:end]):
                break
            if self.block_state(first - 1)[0] != self.block_state(len(self.blocks) - 1)[0]:
                break
            first -= 1
        return first

    def render(self) -> RenderableType:
        """Header, one table row per block, legend."""
        table = Table.grid(padding=(0, 1))
        table.add_column(no_wrap=True)
        table.add_column(ratio=1)
        rows, tail = self.rows(), self.ended_from()
        for b, cells in enumerate(rows[:tail]):
            marker, style = self.block_state(b)
            row_style = "on grey11" if marker == "▶" else None
            table.add_row(Text(f"{marker} B{b}", style=style), cells, style=row_style)
        if tail < len(rows):  # blocks past the answer's end: one row, not a screen of ∎
            marker, style = self.block_state(tail)
            last, n = len(rows) - 1, self.s.gen_length - self.blocks[tail][0]
            label = f"{marker} B{tail}" + (f"-B{last}" if last > tail else "")
            table.add_row(Text(label, style=style), Text(f"{END_GLYPH} × {n}", style="dim"))
        blank = "random noise, not drafted yet" if self.uniform else "mask"
        legend = Text(
            f"{MASK_GLYPH} {blank} · colour: commit step, bright = confident · "
            f"▶ current ✓ done ❄ cached K/V {END_GLYPH} end"
            + (" · inverse: the guide's token" if self.corrected is not None else "")
            + (" · ✂ pruned suffix" if self.s.suffix_window else ""),
            style="dim",
        )
        if self.uniform:
            legend.append(" · italic: draft (replaced until final), underlined: changed this step")
        elif self.s.edit_threshold is not None:
            legend.append(" · italic: replaced by a token edit")
        return Group(self.header(), table, legend)

    def summary(self) -> str:
        """One plain line per step, for a stderr that is not a terminal."""
        e = self.event
        if e is None:
            return "no steps"
        tail = f", accepted {self.accepted}" if self.accepted is not None else ""
        tail += f", corrected {self.corrected}" if self.corrected is not None else ""
        if self.uniform:
            tail += "" if self.settled is None else f", settled at step {self.settled + 1}"
        edited = self.s.edit_threshold is not None
        replaced = f"~{e.replaced} replaced, " if self.uniform or edited else ""
        past = e.window[1] - self.s.gen_length  # the last block's columns past the answer
        tail += f", {past} columns past the answer in this block" if past > 0 else ""
        return (
            f"step {e.step + 1} block {self.block + 1}/{len(self.blocks)}: +{e.committed} tokens, "
            f"{replaced}{self.committed}/{self.s.gen_length} committed, forwards {e.forwards}"
            f"{guide_forwards(e)}{tail}"
        )


def guide_forwards(event: StepEvent | None) -> str:
    """ " (+N guide)" once a guide has run, else nothing."""
    return f" (+{event.guide_forwards} guide)" if event and event.guide_forwards else ""


def escape(text: str) -> str:
    """Control characters as escapes, so no token can drive the terminal."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def spell(text: str) -> str:
    """A token as one visible cell: newline ↵, blank ␣, control characters escaped."""
    return escape(text.replace("\n", "↵").strip() or "␣")


def step_style(step: int, confidence: float) -> Style:
    """Hue from the commit step (golden-ratio spread), brightness from the confidence."""
    shade = confidence if confidence >= 0 else math.exp(confidence)  # entropy is <= 0
    shade = min(max(shade, 0.0), 1.0)
    r, g, b = colorsys.hsv_to_rgb((step * 0.618034) % 1.0, 0.6, 0.5 + 0.5 * shade)
    return Style(color=Color.from_rgb(r * 255, g * 255, b * 255))


def check_save_path(path: Path) -> None:
    """Refuse an export format we cannot write before any decoding starts."""
    if path.suffix.lower() not in SAVE_KINDS:
        raise SettingsError(f"--save {path}: use a .svg (final frame) or .html (every step) file")
