"""Library clients of the engine: decode a list of prompts as one static batch.

    run = decode_steps(model, special, prompts, settings)  # iterate for StepEvents
    result = run.result()                                  # or decode(...) in one call

The rows walk the blocks in lockstep, as LLaDA and Fast-dLLM decode; `Decoder(...).run(prompts,
lockstep=False)` lets each row move on by itself. Answers come back in prompt order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from dllm_cli.decoding.engine import Engine, StepOutput
from dllm_cli.decoding.events import DecodeResult, StepEvent
from dllm_cli.decoding.request import Finished
from dllm_cli.decoding.unmask import Committer
from dllm_cli.errors import DllmError
from dllm_cli.families import with_family_defaults
from dllm_cli.models.base import DiffusionLM
from dllm_cli.models.loading import SpecialIds
from dllm_cli.settings import DecodeSettings


class Decoder:
    """A model, its special ids and (validated) settings: engines and one-batch runs of it."""

    def __init__(
        self,
        model: DiffusionLM,
        special: SpecialIds,
        settings: DecodeSettings,
        committer: Committer | None = None,
    ):
        self.settings = with_family_defaults(settings, model.family)
        self.model, self.special, self.committer = model, special, committer

    def engine(self, slots: int, admission: str, **options) -> Engine:
        """An engine with the family's stepper; `options` reach the stepper's own knobs."""
        return Engine(
            self.model, self.special, self.settings, self.committer,
            slots=slots, admission=admission, **options,
        )  # fmt: skip

    def run(self, prompts: list[list[int]], lockstep: bool = True) -> DecodeRun:
        return DecodeRun(self, prompts, lockstep)


class DecodeRun:
    """One batch in progress: iterate it for StepEvents; `result()` once (or to finish) it."""

    def __init__(self, decoder: Decoder, prompts: list[list[int]], lockstep: bool = True):
        began = time.perf_counter()
        prompts = [list(map(int, p)) for p in prompts]
        self.engine = decoder.engine(max(1, len(prompts)), "static", lockstep=lockstep)
        self.engine.check_prompts(prompts)
        self.prompt_lengths = [len(p) for p in prompts]
        self.ids = [self.engine.add(p) for p in prompts]
        self.done: dict[int, Finished] = {}
        self.setup = time.perf_counter() - began
        self._steps = self._loop()
        self._events = self._stream()  # events built only for who iterates

    def _loop(self) -> Iterator[StepOutput]:
        while self.engine.has_work:
            out = self.engine.step()
            for f in out.finished:
                self.done[f.id] = f
            if out.step >= 0:
                yield out

    def _stream(self) -> Iterator[StepEvent]:
        """The steps' events; closing this before the end stops the decode there."""
        ended = False
        try:
            for out in self._steps:
                yield out.event
            ended = True
        finally:
            if not ended:
                self._stop()

    def _stop(self) -> None:
        """Abort every request; the next step frees their rows (DiffusionGemma: its loop)."""
        self._steps.close()
        for rid in self.ids:
            self.engine.abort(rid)
        self.engine.step()

    def __iter__(self) -> Iterator[StepEvent]:
        return self._events

    @property
    def canvas(self):
        """The live rows' canvas (rows that finished have left it)."""
        return self.engine.canvas

    @property
    def forwards(self) -> int:
        return self.engine.forwards

    @property
    def steps(self) -> int:
        return self.engine.steps

    @property
    def seconds(self) -> float:
        return self.setup + self.engine.seconds

    def result(self) -> DecodeResult:
        """The finished decode (runs any remaining steps first, building no StepEvents)."""
        for _ in self._steps:
            pass
        if any(i not in self.done for i in self.ids):
            raise DllmError("the decode was stopped before it finished")
        e, rows = self.engine, [self.done[i] for i in self.ids]
        return DecodeResult(
            tokens=[f.tokens for f in rows],
            commit_steps=[f.commit_steps for f in rows],
            prompt_lengths=self.prompt_lengths,
            forwards=e.forwards,
            steps=e.steps,
            seconds=self.seconds,
            finished_at=[f.finished_at for f in rows],
            guide_forwards=e.guide_forwards,
            guide_seconds=e.guide_seconds,
            rows_served=e.served,
        )


open_engine = Engine  # an engine for this model, its family's stepper inside (stepper.py STEPPERS)


def decode_steps(
    model: DiffusionLM,
    special: SpecialIds,
    prompts: list[list[int]],
    settings: DecodeSettings,
    *,
    committer: Committer | None = None,
) -> DecodeRun:
    """Start a decode; iterate the returned run for StepEvents, then call `.result()`."""
    return Decoder(model, special, settings, committer).run(prompts)


def decode(
    model: DiffusionLM,
    special: SpecialIds,
    prompts: list[list[int]],
    settings: DecodeSettings,
    *,
    committer: Committer | None = None,
    on_step: Callable[[StepEvent], None] | None = None,
) -> DecodeResult:
    """Decode a batch of prompts to the end; `on_step` sees every StepEvent on the way."""
    run = decode_steps(model, special, prompts, settings, committer=committer)
    if on_step is not None:
        for event in run:
            on_step(event)
    return run.result()
