"""The batch pipeline behind `dllm generate -`: numbered prompt lines in, one record per line out.

Lines come in as bytes and each is decoded on its own (prompt_text.py), so a bad one (not
UTF-8, a control character, empty, too long, not JSON with --json-input) becomes its own error
record instead of sinking a batch. Valid lines go to one engine (decoding/engine.py) of
`batch_size` slots, admitted statically (whole batches) or continuously (any free slot), and
finished records go to the caller's `done` in input order: record n as soon as records 1..n
are all finished. The caller decides where records go (stdout; rank 0 under torchrun) and
what a progress bar shows; the pipeline prints nothing. An interrupt or an error from the
decoder stops it with every finished record handed on (behind an error record for a line
still decoding).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from dllm_cli.decoding import DecodeResult, Finished, answer_length, answer_tokens
from dllm_cli.decoding.run import open_engine
from dllm_cli.errors import DllmError, InputError, SettingsError
from dllm_cli.families import FAMILIES
from dllm_cli.family_settings import refuse_feature
from dllm_cli.lifetimes import LIFETIMES, PER_REQUEST, refusal
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
    sampling: dict | None = None  # --json-input: the line's own temperature, seed, ... (or None)


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
        self.add_run(other.forwards, other.guide_forwards, other.steps, 0.0)
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
    logprobs: int | None = None  # --logprobs K: records carry each answer token's logprobs
    totals: Totals = field(default_factory=Totals)
    finished: Callable[[Slot], None] = lambda slot: None  # a record is final (progress)

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise SettingsError(f"--batch-size must be at least 1 (got {self.batch_size})")

    def run(
        self, numbered: Iterable[tuple[int, bytes]], done: Callable[[list[Slot]], None]
    ) -> None:
        """Read (number, line) pairs, decode, hand finished slots to `done` in input order;
        lines are read only while a slot is free (static: until a batch is full), so a line
        typed at a terminal is answered without waiting for the next."""
        rt = self.runtime
        model, special = rt.loaded.model, rt.loaded.special
        engine = open_engine(
            model, special, rt.settings, rt.committer(),
            slots=self.batch_size, admission=rt.admission(),
        )  # fmt: skip
        order = Order(done)
        lines = iter(numbered)
        try:
            while True:
                while engine.waiting + engine.running < self.batch_size:
                    item = next(lines, None)
                    if item is None:
                        break
                    self.admit(engine, order, self.read(*item))
                if not engine.has_work:
                    break
                self.step(engine, order)
        except (KeyboardInterrupt, DllmError) as e:
            why = "interrupted" if isinstance(e, KeyboardInterrupt) else e
            order.rescue(self, f"not decoded: {why}")
            raise
        finally:
            self.totals.add_run(
                engine.forwards, engine.guide_forwards, engine.steps, engine.seconds
            )
            self.totals.rows_served += engine.served
        order.flush()

    def admit(self, engine, order: Order, slot: Slot) -> None:
        """A read line joins the output order and, when valid, the engine's queue."""
        order.pending.append(slot)
        if slot.error is None:
            try:
                asked = {} if self.logprobs is None else {"logprobs": self.logprobs}
                engine.add(slot.ids, key=slot, sampling=slot.sampling, **asked)
                return
            except DllmError as e:  # a bad prompt, or a line's own sampling values
                self.fail(slot, str(e))
        self.finished(slot)
        order.flush()

    def step(self, engine, order: Order) -> None:
        """One engine step; its answers become records. An input error the checks missed
        fails the requests decoding at the time (their batch) and the others go on."""
        try:
            out = engine.step()
        except InputError as e:
            for request in list(engine.live):
                engine.abort(request.id)
                self.fail(request.key, str(e))
                self.finished(request.key)
            order.flush()
            return
        for f in out.finished:
            self.totals.add_answer(f.tokens, self.runtime.loaded.special.stop)
            self.finish(f.key, f)
        order.flush()

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
                slot.prompt, slot.sampling = json_line(slot.prompt)
            own = slot.sampling is not None and "gen_length" in slot.sampling
            slot.ids = self.runtime.prepare(slot.prompt, own_length=own)
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
        failed = {"line": slot.line, **shown, "error": reason}
        slot.output = json.dumps(failed) if self.json_out else ""

    def finish(self, slot: Slot, done: Finished) -> None:
        """A decoded slot's record (text or --json)."""
        text = self.runtime.text(done.tokens)
        if self.json_out:
            stop = self.runtime.loaded.special.stop
            shown = record(slot.prompt, text, done, stop, self.canvas)
            if self.logprobs is not None:
                shown["logprobs"] = token_logprobs(self.runtime, done, self.logprobs)
            slot.output = json.dumps({"line": slot.line, **shown})
        else:
            slot.output = one_line(text)
        self.finished(slot)


class Order:
    """Records leave in input order: record n as soon as records 1..n are all final."""

    def __init__(self, done: Callable[[list[Slot]], None]):
        self.done = done
        self.pending: deque[Slot] = deque()  # read, not yet handed on (input order)

    def flush(self) -> None:
        finished = []
        while self.pending and self.pending[0].output is not None:
            finished.append(self.pending.popleft())
        if finished:
            self.done(finished)

    def rescue(self, pipeline: Pipeline, reason: str) -> None:
        """The run stopped: answers that finished behind a line still decoding go out anyway,
        that line as an error record (output line N stays input line N's)."""
        finished = [i for i, slot in enumerate(self.pending) if slot.output is not None]
        for slot in list(self.pending)[: finished[-1] if finished else 0]:
            if slot.output is None:
                pipeline.fail(slot, reason)
                pipeline.finished(slot)
        self.flush()


def json_line(text: str) -> tuple[str, dict | None]:
    """A JSON-lines input's "prompt" and its per-request settings (lifetimes.py: gen_length,
    temperature, top_p, top_k, seed, stop ids; None when it has none). Other keys are the line's own, except
    settings that cannot change per request, refused by name."""
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
    for name in data:
        if name in LIFETIMES and name not in PER_REQUEST:
            raise SettingsError(refusal(name))
    own = {k: v for k, v in data.items() if k in PER_REQUEST}
    return data["prompt"], own or None


def record(prompt: str, text: str, done: Finished, stop: Iterable[int], canvas: bool) -> dict:
    """The --json object for one answer: forwards/steps/seconds of the steps it spent in a slot,
    token_ids what `text` decodes; `canvas`: every generated position too."""
    shown = {
        "prompt": prompt,
        "text": text,
        "token_ids": answer_tokens(done.tokens, stop),
        "forwards": done.forwards,
        "guide_forwards": done.guide_forwards,
        "steps": done.steps,
        "seconds": round(done.seconds, 4),
    }
    return shown | ({"canvas_ids": done.tokens} if canvas else {})


def token_logprobs(runtime: Runtime, done: Finished, k: int) -> list[dict]:
    """Per answer token: its text, its log-probability under the step that committed it, and
    that step's k most likely tokens (decoding/logprobs.py)."""
    chosen, ids, values = done.token_logprobs(k)
    piece = runtime.loaded.tokenizer.decode
    answer = answer_tokens(done.tokens, runtime.loaded.special.stop)

    def entry(token: int, logprob: float) -> dict:
        return {"token": piece([token], skip_special_tokens=False), "logprob": logprob}

    tops = [
        [entry(a, v) for a, v in zip(ids[i], values[i], strict=True)] for i in range(len(answer))
    ]
    return [entry(t, chosen[i]) | {"top_logprobs": tops[i]} for i, t in enumerate(answer)]


def check_logprobs(runtime: Runtime) -> None:
    """--logprobs: distributions exist only in an unguided masked-diffusion decode."""
    if runtime.guide is not None:
        raise SettingsError("--logprobs needs an unguided decode (add --no-guide)")
    refuse_feature(FAMILIES[runtime.loaded.family], "logprobs", "--logprobs")


def solo(result: DecodeResult) -> Finished:
    """A one-prompt decode's result as that prompt's Finished record."""
    return Finished(
        id=0,
        key=None,
        answer=result.tokens[0],
        marks=result.commit_steps[0] if result.commit_steps else [],
        prompt_length=result.prompt_lengths[0],
        steps=result.steps,
        forwards=result.forwards,
        guide_forwards=result.guide_forwards,
        seconds=result.seconds,
        guide_seconds=result.guide_seconds,
    )


def one_line(text: str) -> str:
    """Text-mode batch output: one line per answer, reversibly escaped."""
    return text.replace("\\", "\\\\").replace("\r", "\\r").replace("\n", "\\n")
