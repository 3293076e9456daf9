"""Library clients of the engine: decode a list of prompts as one static batch.

    run = decode_steps(model, special, prompts, settings)  # iterate for StepEvents
    result = run.result()                                  # or decode(...) in one call

A `DecodeRun` adds every prompt to an engine with as many slots (static admission: the rows
walk the blocks in lockstep, as LLaDA and Fast-dLLM decode) and steps it to the end; its
`DecodeResult` lists the answers in prompt order. `Decoder(...).run(prompts, lockstep=False)`
lets each row move on by itself.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Iterator

from dllm_cli.decoding.canvas import check_prompts, check_token_ids
from dllm_cli.decoding.engine import Engine
from dllm_cli.decoding.events import DecodeResult, StepEvent
from dllm_cli.decoding.request import Finished
from dllm_cli.decoding.step import StepOutput
from dllm_cli.decoding.unmask import Committer
from dllm_cli.families import family_of_model, with_family_defaults
from dllm_cli.models.base import DiffusionLM
from dllm_cli.models.loading import SpecialIds
from dllm_cli.settings import DecodeSettings

# Family.stepper -> its engine ("module:Class"), and the steppers whose one-batch run is their
# own (DiffusionGemma's GemmaRun); imported on first use.
ENGINES = {
    "masked": "dllm_cli.decoding.engine:Engine",
    "block": "dllm_cli.decoding.block_engine:BlockEngine",
    "gemma": "dllm_cli.decoding.gemma_engine:GemmaEngine",
}
RUNS = {"gemma": "dllm_cli.decoding.gemma:start_run"}


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
        """The family's engine (ENGINES); `options` reach the masked engine's own knobs."""
        return engine_class(self.model)(
            self.model, self.special, self.settings, self.committer,
            slots=slots, admission=admission, **options,
        )  # fmt: skip

    def run(self, prompts: list[list[int]], lockstep: bool = True) -> DecodeRun:
        return DecodeRun(self, prompts, lockstep)


class DecodeRun:
    """One batch in progress: iterate it for StepEvents; `result()` once (or to finish) it."""

    def __init__(self, decoder: Decoder, prompts: list[list[int]], lockstep: bool = True):
        began = time.perf_counter()
        model, s = decoder.model, decoder.settings
        prompts = [list(map(int, p)) for p in prompts]
        check_prompts(prompts, s.gen_length, model.context_length)
        check_token_ids(prompts, model.get_input_embeddings().num_embeddings)
        self.prompt_lengths = [len(p) for p in prompts]
        self.engine = decoder.engine(len(prompts), "static", lockstep=lockstep)
        self.ids = [self.engine.add(p) for p in prompts]
        self.done: dict[int, Finished] = {}
        self.setup = time.perf_counter() - began
        self._steps = self._loop()
        self._events = (out.event for out in self._steps)  # built only for who iterates

    def _loop(self) -> Iterator[StepOutput]:
        while self.engine.has_work:
            out = self.engine.step()
            for f in out.finished:
                self.done[f.id] = f
            if out.step >= 0:
                yield out

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


def open_engine(
    model: DiffusionLM,
    special: SpecialIds,
    settings: DecodeSettings,
    committer: Committer | None = None,
    *,
    slots: int = 8,
    admission: str = "continuous",
):
    """An engine for this model: its family's stepper's (ENGINES), the one dispatch."""
    cls = engine_class(model)
    return cls(model, special, settings, committer, slots=slots, admission=admission)


def engine_class(model: DiffusionLM) -> type:
    """The engine class of the model's family (imported on first use)."""
    module, _, name = ENGINES[family_of_model(model).stepper].partition(":")
    return getattr(importlib.import_module(module), name)


def decode_steps(
    model: DiffusionLM,
    special: SpecialIds,
    prompts: list[list[int]],
    settings: DecodeSettings,
    *,
    committer: Committer | None = None,
) -> DecodeRun:
    """Start a decode; iterate the returned run for StepEvents, then call `.result()`."""
    own = RUNS.get(family_of_model(model).stepper)  # a stepper with a run type of its own
    if own is not None:
        module, _, name = own.partition(":")
        start = getattr(importlib.import_module(module), name)
        return start(model, special, prompts, settings, committer)
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
