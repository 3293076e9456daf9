"""DiffusionGemma behind the engine's interface: static admission, one `generate` per batch.

transformers' own sampler decodes a whole batch (gemma.py), so requests are admitted as
static batches of up to `slots`: each `step()` hands on one of the batch's denoising steps,
and the step after its last one hands on the batch's answers.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Any

from dllm_cli.decoding import gemma
from dllm_cli.decoding.canvas import check_prompts
from dllm_cli.decoding.request import Request, Status
from dllm_cli.decoding.step import StepOutput
from dllm_cli.errors import InputError, SettingsError
from dllm_cli.lifetimes import Sampling, request_sampling


class GemmaEngine:
    """add / step / abort / has_work over DiffusionGemma decodes of whole batches."""

    def __init__(self, model, special, settings, committer=None, *, slots: int = 8, **_):
        if committer is not None:
            raise SettingsError(f"a guide model does not apply to {gemma.FAMILY}")
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise InputError(f"batch size must be at least 1 (got {slots})")
        self.model, self.special, self.slots = model, special, slots
        self.settings = gemma.check_settings(settings.validate(), model.canvas_length)
        self.queue: deque[Request] = deque()
        self.requests: dict[int, Request] = {}
        self.live: list[Request] = []
        self.run = self.events = None
        self.next_id = 0
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
        ids = [int(t) for t in prompt]
        length = gemma.denoised_length(self.settings.gen_length, self.model.canvas_length)
        try:
            check_prompts([ids], length, self.model.context_length)
            gemma.check_vocabulary([ids], self.model.config.text_config.vocab_size)
        except InputError as e:
            raise InputError(str(e).replace("prompt 0 ", "prompt ", 1)) from None
        request = Request(self.next_id, ids, key)
        self.next_id += 1
        self.queue.append(request)
        self.requests[request.id] = request
        return request.id

    def abort(self, rid: int) -> bool:
        """A waiting request leaves the queue; a running one's answer is dropped at its end."""
        request = self.requests.pop(rid, None)
        if request is None:
            return False
        if request.status is Status.WAITING:
            self.queue.remove(request)
        request.status = Status.ABORTED
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.requests) or self.run is not None

    @property
    def waiting(self) -> int:
        return len(self.queue)

    @property
    def running(self) -> int:
        return len(self.live)

    def progress(self, rid: int) -> list[int]:
        return []  # drafts are replaced until the batch ends: nothing is committed before

    def step(self) -> StepOutput:
        if self.run is None:
            if not self.queue:
                return StepOutput(-1)
            self.live = [self.queue.popleft() for _ in range(min(self.slots, len(self.queue)))]
            for r in self.live:
                r.admit(self.steps)
            self.run = gemma.GemmaRun(
                self.model, self.special, [r.prompt for r in self.live], self.settings
            )
            self.events = iter(self.run)
        event = next(self.events, None)
        if event is not None:
            self.steps += 1
            self.forwards += 1
            self.served += len(self.live)
            return StepOutput(self.steps - 1, [], lambda: event)
        result, live = self.run.result(), self.live
        self.seconds += result.seconds
        self.run = self.events = None
        self.live = []
        finished = []
        for i, r in enumerate(live):
            if r.status is Status.ABORTED:
                continue
            r.steps = r.forwards = result.steps
            done = r.finish(result.tokens[i], result.commit_steps[i], r.first_step)
            at = result.finished_at[i] if result.finished_at else result.steps - 1
            finished.append(replace(done, seconds=result.seconds, finished_at=at))
            self.requests.pop(r.id, None)
        return StepOutput(-1, finished)
