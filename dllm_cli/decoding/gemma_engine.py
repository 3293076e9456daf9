"""DiffusionGemma behind the engine's interface: static admission, one decode per batch.

transformers' own sampler decodes a whole batch, so requests are admitted as static batches of
up to `slots`. Each `step()` runs one denoising step of that batch's decode (gemma_loop.py: the
steps of transformers' `generate`, in this thread), and a request's answer is handed on the
step its last canvas is final (a stop token, or its last canvas), not when the batch ends.
"""

from __future__ import annotations

from typing import Any

from dllm_cli.decoding import gemma
from dllm_cli.decoding.canvas import check_prompts, check_token_ids
from dllm_cli.decoding.request import (
    Finished,
    Request,
    RequestQueue,
    Status,
    check_slots,
    one_prompt,
)
from dllm_cli.decoding.step import StepOutput
from dllm_cli.errors import SettingsError
from dllm_cli.lifetimes import Sampling, request_sampling


class GemmaEngine(RequestQueue):
    """add / step / abort / has_work over DiffusionGemma decodes of whole batches; an abort of
    every request of the running batch stops its decode at the next step."""

    def __init__(self, model, special, settings, committer=None, *, slots: int = 8, **_):
        if committer is not None:
            raise SettingsError(f"a guide model does not apply to {gemma.FAMILY}")
        check_slots(slots)
        self.model, self.special, self.slots = model, special, slots
        self.settings = gemma.check_settings(settings.validate(), model.canvas_length)
        super().__init__()  # the queue and requests by id
        self.live: list[Request] = []
        self.run = self.events = None
        self.steps = self.forwards = self.guide_forwards = self.served = 0
        self.seconds = self.guide_seconds = 0.0

    def add(self, prompt: list[int], key: Any = None, settings=None, sampling=None) -> int:
        if settings is not None or sampling is not None:
            own = request_sampling(self.settings, self.model.family, settings, sampling)
            if own != Sampling.of(self.settings):
                raise SettingsError(
                    "per-request sampling: not supported for DiffusionGemma (one generation "
                    "config decodes its whole static batch)"
                )
        length = gemma.denoised_length(self.settings.gen_length, self.model.canvas_length)
        context, vocab = self.model.context_length, self.model.config.text_config.vocab_size
        ids = one_prompt(
            prompt,
            lambda batch: check_prompts(batch, length, context),
            lambda batch: check_token_ids(batch, vocab),
        )
        return self.enqueue(ids, key)

    @property
    def has_work(self) -> bool:
        return bool(self.requests) or self.run is not None

    @property
    def running(self) -> int:
        return len(self.live)

    def progress(self, rid: int) -> list[int]:
        """The answer's finished canvases so far (cut at a stop token); drafts are not shown."""
        for i, r in enumerate(self.live):
            if r.id == rid and r.status is Status.RUNNING:
                return list(self.run.streamer.answers[i])
        return []

    def step(self) -> StepOutput:
        if self.run is not None and all(r.status is Status.ABORTED for r in self.live):
            self._end_run()  # nobody waits for this batch any more
        if self.run is None and not self._start_run():
            return StepOutput(-1)
        before = self.run.seconds
        try:
            event = next(self.events)  # one denoising step of the batch (one decoder forward)
        except BaseException:
            for r in self.live:  # a failed decode is not resumed: its requests are dropped
                self.requests.pop(r.id, None)
                r.status = Status.ABORTED
            self._end_run()
            raise
        self.seconds += self.run.seconds - before
        self.steps += 1
        self.forwards += 1
        self.served += len(self.live)
        finished = [self._answer(i, event.step) for i in event.finished]
        finished = [f for f in finished if f is not None]
        if self.run.done:
            self._end_run()
        return StepOutput(self.steps - 1, finished, lambda: event)

    def _start_run(self) -> bool:
        """The next static batch from the queue (False when the queue is empty)."""
        if not self.queue:
            return False
        self.live = [self.queue.popleft() for _ in range(min(self.slots, len(self.queue)))]
        for r in self.live:
            r.admit(self.steps)
        self.run = gemma.GemmaRun(
            self.model, self.special, [r.prompt for r in self.live], self.settings
        )
        self.events = iter(self.run)
        return True

    def _end_run(self) -> None:
        self.events.close()  # stops the decode where it is (nothing runs in the background)
        self.run = self.events = None
        self.live = []

    def _answer(self, i: int, step: int) -> Finished | None:
        """Row i's record: its committed canvases, EOS after a stop; None if it was aborted."""
        r = self.live[i]
        if r.status is not Status.RUNNING:
            return None
        g, canvas = self.settings.gen_length, self.model.canvas_length
        answer = self.run.streamer.answers[i][:g]
        ends = self.run.streamer.canvas_step  # per finished canvas: its last step
        marks = [ends[p // canvas] if p < len(answer) else -1 for p in range(g)]
        r.steps = r.forwards = step + 1
        self.requests.pop(r.id, None)
        return r.finish(answer + [self.special.eos] * (g - len(answer)), marks, r.first_step + step)
