"""The engine: requests come in at any step, each step decodes every request holding a slot.

    engine = Engine(model, special, settings, slots=8, admission="continuous")
    rid = engine.add(prompt_ids)          # refused at once (InputError) if it cannot decode
    while engine.has_work:
        out = engine.step()               # admits, then one decoding step of every live row
        for done in out.finished: ...     # Finished: tokens and the request's own counts
    engine.abort(rid)                     # waiting or running; its slot is free next step

The shape is nano-vllm's LLMEngine / Scheduler / Sequence: a `Request` (request.py) holds a
prompt's ids and progress, an admission policy (slots.py) decides when it takes a free slot,
and a step is the family's stepper's `plan`, `forward` and `commit` (stepper.py). The engine
owns what the kinds share: the queue, slots, admission, the prompt check, per-request
sampling, counters and finishing. It prints nothing; a step's `StepEvent` is built only when
a consumer asks for it. One thread owns an engine.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from dllm_cli.decoding.canvas import check_prompts, check_token_ids
from dllm_cli.decoding.events import StepEvent
from dllm_cli.decoding.request import (
    Finished,
    Request,
    RequestQueue,
    Status,
    check_slots,
    one_prompt,
)
from dllm_cli.decoding.slots import ADMISSIONS
from dllm_cli.decoding.stepper import Commit, Stepper, stepper_class
from dllm_cli.decoding.unmask import Committer
from dllm_cli.errors import InputError, SettingsError
from dllm_cli.families import family_of_model, with_family_defaults
from dllm_cli.family_settings import refuse_feature
from dllm_cli.lifetimes import Sampling, request_sampling
from dllm_cli.models.base import DiffusionLM
from dllm_cli.models.loading import SpecialIds
from dllm_cli.settings import DecodeSettings

LABELS = {"stop": "stop ids"}  # Sampling field -> how a refusal names it


@dataclass
class StepOutput:
    """What one step did: answers that became final, and (on request) its StepEvent."""

    step: int  # the engine's 0-based step (-1: nothing was decoding)
    finished: list[Finished] = field(default_factory=list)
    build: Any = None  # () -> StepEvent, run at most once
    _event: StepEvent | None = None

    @property
    def event(self) -> StepEvent | None:
        """The step's StepEvent (commits per row, phases): materialised on first access."""
        if self._event is None and self.build is not None:
            self._event, self.build = self.build(), None
        return self._event


class Engine(RequestQueue):
    """A loaded model decoding requests in `slots` slots; `add`, `step`, `abort`."""

    def __init__(
        self,
        model: DiffusionLM,
        special: SpecialIds,
        settings: DecodeSettings,
        committer: Committer | None = None,
        *,
        slots: int = 8,
        admission: str = "continuous",
        **options: Any,
    ):
        check_slots(slots)
        if admission not in ADMISSIONS:
            raise SettingsError(f"admission must be one of {', '.join(ADMISSIONS)}")
        # Unset values take the family's reference defaults (Dream: top_k 50; families.py).
        settings = with_family_defaults(settings, model.family)
        self.family = family_of_model(model)
        kind, policy = stepper_class(self.family.stepper), ADMISSIONS[admission]
        self.stepper: Stepper = kind(model, special, settings, committer, policy, slots, **options)
        self.admission = ADMISSIONS["static"] if self.stepper.whole_batches else policy
        self.settings = self.stepper.settings
        self.model, self.special, self.slots = model, special, slots
        super().__init__()  # the queue and requests by id
        self.device = next(model.parameters()).device
        self.sampling = Sampling.of(self.settings)  # a request's unless `add` is given its own
        self.live: list[Request] = []  # running, in slot order
        self.steps = self.forwards = self.guide_forwards = self.served = 0
        self.seconds = self.guide_seconds = 0.0  # time inside step(): admissions and steps

    # --- the public interface --------------------------------------------------------------
    def add(
        self,
        prompt: list[int],
        key: Any = None,
        settings: DecodeSettings | None = None,
        sampling: Sampling | dict | None = None,
        logprobs: int | None = None,
    ) -> int:
        """Queue a prompt; its id (InputError: it cannot decode). `sampling` (or whole `settings`)
        gives it its own Sampling values (lifetimes.py) where the stepper takes them, any other
        setting differing from the engine's refused; `logprobs` k: each answer token's
        log-probability and k alternatives (logprobs.py)."""
        own = self.sampling
        if settings is not None or sampling is not None:
            own = request_sampling(self.settings, self.model.family, settings, sampling)
            self._check_sampling(own)
        if logprobs is not None:
            refuse_feature(self.family, "logprobs", "logprobs", InputError)
        ids = one_prompt(prompt, lambda p: self.check_prompts(p, own.gen_length))
        rid = self.enqueue(ids, key, own)
        self.requests[rid].logprobs = logprobs
        return rid

    def check_prompts(self, prompts: list[list[int]], gen_length: int | None = None) -> None:
        """Refuse prompts that cannot decode (answers of `gen_length`; None: the engine's)."""
        room = self.stepper.room(gen_length or self.settings.gen_length)
        check_prompts(prompts, room, self.model.context_length)
        check_token_ids(prompts, self.stepper.vocabulary)

    def _check_sampling(self, own: Sampling) -> None:
        """A request's own value of a field the stepper shares over its batch is refused."""
        for name, why in self.stepper.batch_wide.items():
            if getattr(own, name) != getattr(self.sampling, name):
                raise SettingsError(
                    f"{LABELS.get(name, name)} per request: not supported by "
                    f"{self.stepper.who}: {why}"
                )

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    @property
    def running(self) -> int:
        return sum(r.status is Status.RUNNING for r in self.live)

    @property
    def canvas(self):
        """The live rows' shared canvas (the masked stepper's; None for the others)."""
        return self.stepper.canvas

    def progress(self, rid: int) -> list[int]:
        """A running request's committed answer so far, up to its first mask or stop token."""
        request = self.requests.get(rid)
        if request is None or request.status is not Status.RUNNING:
            return []
        return self.stepper.progress(self.live, self.live.index(request))

    def step(self) -> StepOutput:
        """Admit waiting requests into free slots, then one decoding step of every live row."""
        began = time.perf_counter()
        held = torch.is_inference_mode_enabled()  # (a caller's: no second context per step)
        with nullcontext() if held else torch.inference_mode():
            out = self._step()
        self.seconds += time.perf_counter() - began
        return out

    def _step(self) -> StepOutput:
        self._drop_aborted()
        try:
            self._admit()
            if not self.live:
                return StepOutput(-1)
            plan = self.stepper.plan(self.live, self.steps)
            pred = self.stepper.forward(plan)
            out = self.stepper.commit(plan, pred)
        except BaseException:
            self._drop_live()  # a failed step is not resumed: its requests are dropped
            raise
        return self._finish(out)

    # --- admission -------------------------------------------------------------------------
    def _admit(self) -> None:
        """Waiting requests take free slots, as the admission policy allows."""
        if not self.queue or (self.admission.whole_batches and self.live):
            return
        room = self.slots - len(self.live)
        new = [self.queue.popleft() for _ in range(min(room, len(self.queue)))]
        if not new:
            return
        taken = {r.slot for r in self.live}
        free = [i for i in range(self.slots) if i not in taken]
        for r, slot in zip(new, free, strict=False):
            r.slot = slot
            r.admit(self.steps)
            r.generator = torch.Generator(device=self.device).manual_seed(r.sampling.seed)
        merged = self.live + new
        order = sorted(range(len(merged)), key=lambda i: merged[i].slot)  # rows in slot order
        self.forwards += self.stepper.place(self.live, new, order, self.steps)
        self.live = [merged[i] for i in order]

    # --- finishing -------------------------------------------------------------------------
    def _finish(self, out: Commit) -> StepOutput:
        """Counters, the final rows' Finished records, the rest move on."""
        served = self.live if out.served is None else [self.live[i] for i in out.served]
        for r in served:
            r.steps += 1
            r.forwards += out.forwards
            r.guide_forwards += out.guide_forwards
            r.guide_seconds += out.guide_seconds
        self.served += len(served)
        self.forwards += out.forwards
        self.guide_forwards += out.guide_forwards
        self.guide_seconds += out.guide_seconds
        finished = []
        if out.final:
            finished, gone = self._records(out), set(out.final)
            self._keep([i for i in range(len(self.live)) if i not in gone])
        self.stepper.move_on(self.live)
        if not out.stepped:
            return StepOutput(-1, finished)
        step = self.steps
        self.steps += 1
        if out.event is None:
            return StepOutput(step, finished)
        event = out.event
        return StepOutput(step, finished, lambda: event(tuple(f.id for f in finished)))

    def _records(self, out: Commit) -> list[Finished]:
        """Finished records of the final rows: EOS after each answer's end (a stop token, a
        request's own stop id), commit steps from admission (tokens on the device until read)."""
        answer, cut = out.answers, out.cut  # (R, G), (R,)
        rows = [self.live[i] for i in out.final]
        if cut is None:
            past = torch.zeros_like(answer, dtype=torch.bool)
        else:
            past = torch.arange(answer.shape[1], device=answer.device)[None] > cut[:, None]
        if cut is not None and any(r.sampling.stop for r in rows):  # not in the text
            past = past | own_stop_at(answer, cut, [r.sampling.stop for r in rows])
        tokens = answer.masked_fill(past, self.special.eos)
        first = torch.tensor([r.first_step for r in rows], device=answer.device)
        marks = torch.where((out.marks >= 0) & ~past, out.marks - first[:, None], -1)
        finished = []
        for j, r in enumerate(rows):
            g = r.sampling.gen_length  # its own answer (a canvas may hold longer ones)
            finished.append(r.finish(tokens[j, :g], marks[j, :g], self.steps))
            self.requests.pop(r.id, None)
        return finished

    def _drop_aborted(self) -> None:
        if any(r.status is Status.ABORTED for r in self.live):
            self._keep([i for i, r in enumerate(self.live) if r.status is not Status.ABORTED])

    def _keep(self, kept: list[int]) -> None:
        """Only live rows `kept` (indices) go on: the stepper's state, then the engine's."""
        self.stepper.keep(self.live, kept)
        self.live = [self.live[i] for i in kept]

    def _drop_live(self) -> None:
        for r in self.live:
            self.requests.pop(r.id, None)
            r.status = Status.ABORTED
        self._drop_aborted()


def own_stop_at(answer: torch.Tensor, cut: torch.Tensor, stops: list[tuple[int, ...]]):
    """(R, G) bool: the cut column of rows whose answer ends at one of their own stop ids."""
    k = max(1, *(len(x) for x in stops))
    own = torch.tensor([[*x, *[-1] * (k - len(x))] for x in stops], device=answer.device)
    at = answer.gather(1, cut.clamp(max=answer.shape[1] - 1)[:, None])  # (R, 1)
    hit = (at == own).any(dim=1, keepdim=True) & (cut < answer.shape[1])[:, None]
    return hit & (torch.arange(answer.shape[1], device=answer.device)[None] == cut[:, None])
