"""The batch pipeline behind `dllm generate -`: numbered prompt lines in, one record per line out.

Lines come in as bytes and each is decoded on its own (prompt_text.py), so a bad one (not
UTF-8, a control character, empty, too long, not JSON with --json-input) becomes its own error
record instead of sinking a batch. Valid lines are decoded `batch_size` at a time, and
finished records go to the caller's `done` in input order: record n as soon as records 1..n
are all finished. The caller decides where records go (stdout; rank 0 under torchrun) and
what a progress bar shows; the pipeline prints nothing. An interrupt or an error from the
decoder stops it with every record before the failed batch already handed on.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from dllm_cli.decoding import Decoder, DecodeResult, answer_length, decode
from dllm_cli.decoding.continuous import ContinuousRun, Finished, static_reason
from dllm_cli.errors import DllmError, InputError, SettingsError
from dllm_cli.prompt_text import decode_line, escape_bytes, strip_line_end
from dllm_cli.runtime import Runtime


@dataclass
class Slot:
    """One input line on its way to one output record."""

    line: int
    prompt: str
    raw: str | None = None  # a line that is not UTF-8: its bytes, escaped (escape_bytes)
    ids: list[int] | None = None
    error: str | None = None
    output: str | None = None  # its stdout line, once finished (text mode, failed: "")


@dataclass
class Totals:
    """What --stats reports, summed over every decode (tokens: see decoding/answer.py)."""

    prompts: int = 0
    tokens: int = 0
    forwards: int = 0
    guide_forwards: int = 0
    steps: int = 0
    seconds: float = 0.0
    rows_served: int = 0  # live rows summed over steps: / forwards = mean rows per forward

    def add(self, result: DecodeResult, stop: Iterable[int]) -> None:
        for row in result.tokens:
            self.add_answer(row, stop)
        self.add_run(result.forwards, result.guide_forwards, result.steps, result.seconds)
        self.rows_served += result.rows_served

    def add_answer(self, tokens: list[int], stop: Iterable[int]) -> None:
        self.prompts += 1
        self.tokens += answer_length(tokens, stop)

    def add_run(self, forwards: int, guide_forwards: int, steps: int, seconds: float) -> None:
        self.forwards += forwards
        self.guide_forwards += guide_forwards
        self.steps += steps
        self.seconds += seconds

    def merge(self, other: Totals) -> None:
        """Another rank's totals: counts add up; seconds is the longest, as ranks run at once."""
        self.prompts += other.prompts
        self.tokens += other.tokens
        self.forwards += other.forwards
        self.guide_forwards += other.guide_forwards
        self.steps += other.steps
        self.rows_served += getattr(other, "rows_served", 0)
        self.seconds = max(self.seconds, other.seconds)

    @property
    def occupancy(self) -> float:
        """Mean live rows per diffusion forward (slot occupancy)."""
        return self.rows_served / self.forwards if self.forwards else 0.0

    def line(self) -> str:
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        prompts = self.prompts / self.seconds if self.seconds > 0 else 0.0
        guide = f"{self.guide_forwards} guide forwards, " if self.guide_forwards else ""
        return (
            f"{self.prompts} prompt(s), {self.tokens} tokens, {self.forwards} forwards, {guide}"
            f"{self.steps} steps, {self.seconds:.2f} s, {rate:.1f} tok/s, "
            f"{prompts:.2f} prompts/s"
            + (f", {self.occupancy:.2f} rows/forward" if self.rows_served else "")
        )


@dataclass
class Pipeline:
    """A runtime and how to batch and format: `run` turns numbered lines into records."""

    runtime: Runtime
    batch_size: int = 8
    json_out: bool = False
    json_input: bool = False
    canvas: bool = False  # --json-canvas: records carry every generated position too
    totals: Totals = field(default_factory=Totals)
    finished: Callable[[Slot], None] = lambda slot: None  # a record is final (progress)

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise SettingsError(f"--batch-size must be at least 1 (got {self.batch_size})")

    def run(
        self, numbered: Iterable[tuple[int, bytes]], done: Callable[[list[Slot]], None]
    ) -> None:
        """Read (number, line) pairs, decode, hand finished slots to `done` in input order."""
        if self.batching() == "continuous":
            Stream(self, done).run(numbered)
            return
        pending: list[Slot] = []  # read, not yet handed on (input order)
        batch: list[Slot] = []  # valid, not yet decoded

        def flush() -> None:
            finished = []
            while pending and pending[0].output is not None:
                finished.append(pending.pop(0))
            if finished:
                done(finished)

        for number, raw in numbered:
            slot = self.read(number, raw)
            pending.append(slot)
            if slot.error is None:
                batch.append(slot)
            else:
                self.finished(slot)
            if len(batch) == self.batch_size:
                self.decode_batch(batch)
                batch = []
            flush()
        if batch:
            self.decode_batch(batch)
        flush()

    def batching(self) -> str:
        """continuous, unless the settings ask for static or the decode cannot be served so."""
        if self.runtime.settings.batching == "static" or self.static_reason() is not None:
            return "static"
        return "continuous"

    def static_reason(self) -> str | None:
        """Why continuous batching falls back to static batches here (None: it does not)."""
        return static_reason(self.runtime.loaded.model, guided=self.runtime.guide is not None)

    def read(self, number: int, raw: bytes) -> Slot:
        """Decode, parse and encode one input line; any problem makes it an error record."""
        line = strip_line_end(raw)
        slot = Slot(number, "")
        try:
            slot.prompt = decode_line(line, first=number == 1)
        except InputError as e:
            slot.raw = escape_bytes(line)
            self.fail(slot, str(e))
            return slot
        try:
            if self.json_input:
                slot.prompt = prompt_from_json(slot.prompt)
            slot.ids = self.runtime.prepare(slot.prompt)
        except DllmError as e:
            self.fail(slot, str(e))
        return slot

    def lost(self, number: int, raw: bytes, reason: str) -> Slot:
        """The error record of a line that was never decoded (its prompt as read)."""
        slot = self.read(number, raw)
        self.fail(slot, reason)
        return slot

    def fail(self, slot: Slot, reason: str) -> None:
        slot.error = reason
        shown = {"prompt": slot.prompt} if slot.raw is None else {"raw": slot.raw}
        slot.output = (
            json.dumps({"line": slot.line, **shown, "error": reason}) if self.json_out else ""
        )

    def decode_batch(self, batch: list[Slot]) -> None:
        """Decode valid slots together; an input error the checks missed fails this batch only."""
        rt = self.runtime
        prompts = [s.ids for s in batch]
        try:
            model, special = rt.loaded.model, rt.loaded.special
            result = decode(model, special, prompts, rt.settings, committer=rt.committer())
        except InputError as e:
            for slot in batch:
                self.fail(slot, str(e))
                self.finished(slot)
            return
        self.totals.add(result, rt.loaded.special.stop)
        for row, slot in enumerate(batch):
            self.finish(slot, result, row)

    def finish(self, slot: Slot, result: DecodeResult, row: int) -> None:
        """A decoded slot's record (text or --json)."""
        text = self.runtime.text(result.tokens[row])
        if self.json_out:
            stop = self.runtime.loaded.special.stop
            shown = record(slot.prompt, text, result, row, stop, self.canvas)
            slot.output = json.dumps({"line": slot.line, **shown})
        else:
            slot.output = one_line(text)
        self.finished(slot)


class Stream:
    """Continuous batching of one pipeline run: `batch_size` slots, refilled as rows finish.

    Lines are read only when a slot is free; a line's record is final the step its row is,
    and records still leave in input order (decoding/continuous.py has the scheduler).
    """

    def __init__(self, pipeline: Pipeline, done: Callable[[list[Slot]], None]):
        self.p, self.done = pipeline, done
        self.pending: deque[Slot] = deque()  # read, not yet handed on (input order)

    def run(self, numbered: Iterable[tuple[int, bytes]]) -> None:
        rt = self.p.runtime
        decoder = Decoder(rt.loaded.model, rt.loaded.special, rt.settings, rt.committer())
        run = ContinuousRun(
            decoder, self.prompts(numbered), self.p.batch_size, self.answered, self.refused
        )
        try:
            run.finish()
        except KeyboardInterrupt:
            self.rescue("not decoded: interrupted")
            raise
        except DllmError as e:
            self.rescue(f"not decoded: {e}")
            raise
        finally:
            self.p.totals.add_run(run.forwards, run.guide_forwards, run.steps, run.seconds)
            self.p.totals.rows_served += run.served
        self.flush()

    def rescue(self, reason: str) -> None:
        """The run stopped: answers that finished behind a line still decoding go out anyway,
        that line as an error record (output line N stays input line N's)."""
        finished = [i for i, slot in enumerate(self.pending) if slot.output is not None]
        for slot in list(self.pending)[: finished[-1] if finished else 0]:
            if slot.output is None:
                self.p.fail(slot, reason)
                self.p.finished(slot)
        self.flush()

    def prompts(self, numbered: Iterable[tuple[int, bytes]]) -> Iterator[tuple[Slot, list[int]]]:
        """Valid lines for the scheduler; bad ones become error records on the way."""
        for number, raw in numbered:
            slot = self.p.read(number, raw)
            self.pending.append(slot)
            if slot.error is None:
                yield slot, slot.ids
            else:
                self.p.finished(slot)
                self.flush()

    def answered(self, done: Finished) -> None:
        slot = done.key
        self.p.totals.add_answer(done.tokens, self.p.runtime.loaded.special.stop)
        steps = done.steps
        alone = DecodeResult([done.tokens], [], [len(slot.ids)], steps, steps, done.seconds)
        self.p.finish(slot, alone, 0)
        self.flush()

    def refused(self, slot: Slot, reason: str) -> None:
        self.p.fail(slot, reason)
        self.p.finished(slot)
        self.flush()

    def flush(self) -> None:
        finished = []
        while self.pending and self.pending[0].output is not None:
            finished.append(self.pending.popleft())
        if finished:
            self.done(finished)


def prompt_from_json(text: str) -> str:
    """The "prompt" string of a JSON-lines input."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"not a JSON object: {e.msg}") from None
    except ValueError:  # Python refuses integers of over 4300 digits
        raise InputError("not a JSON object: a number too long to read") from None
    except RecursionError:
        raise InputError("not a JSON object: nested too deeply") from None
    if not isinstance(data, dict) or not isinstance(data.get("prompt"), str):
        raise InputError('expected a JSON object with a string "prompt" field')
    return data["prompt"]


def record(
    prompt: str, text: str, result: DecodeResult, row: int, stop: Iterable[int], canvas: bool
) -> dict:
    """The --json object for one answer of `result` (a batch, or one prompt alone).

    token_ids: the answer's ids (what `text` decodes); `canvas`: every generated position too.
    steps: the row's own, until its answer was final; seconds: the row's share of the run's
    (a batch's seconds over its rows, so records add up); forwards: the run's, which served it.
    """
    finished = result.finished_at[row] if row < len(result.finished_at) else -1
    shown = {
        "prompt": prompt,
        "text": text,
        "token_ids": result.answer(row, stop),
        "forwards": result.forwards,
        "guide_forwards": result.guide_forwards,
        "steps": finished + 1 if finished >= 0 else result.steps,  # finished_at: 0-based
        "seconds": round(result.seconds / len(result.tokens), 4),
    }
    return shown | ({"canvas_ids": result.tokens[row]} if canvas else {})


def one_line(text: str) -> str:
    """Text-mode batch output: one line per answer, reversibly escaped."""
    return text.replace("\\", "\\\\").replace("\r", "\\r").replace("\n", "\\n")
