"""What a decoding kind plugs into the one Engine (engine.py): the `Stepper` protocol.

The engine owns requests, slots, admission, counters and finishing; a stepper owns the rows'
device state and decodes them one step at a time, as nano-vllm's schedule -> run -> postprocess:

    plan = stepper.plan(live, step)     # host data: what each row computes this step
    pred = stepper.forward(plan)        # the model's forward(s)
    out = stepper.commit(plan, pred)    # drafts become tokens; which rows are final (Commit)

A stepper is built as `cls(model, special, settings, committer, admission, slots, *,
lockstep=None, ...)`; families.py's `Family.stepper` names it in `STEPPERS` (imported on first
use, so DiffusionGemma's transformers code loads only for it).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from dllm_cli.decoding.events import StepEvent
from dllm_cli.decoding.request import Request
from dllm_cli.settings import DecodeSettings

# Family.stepper -> its class ("module:Class")
STEPPERS: dict[str, str] = {
    "masked": "dllm_cli.decoding.masked:MaskedStepper",
    "block": "dllm_cli.decoding.block_stepper:BlockStepper",
    "gemma": "dllm_cli.decoding.gemma_stepper:GemmaStepper",
}


@dataclass
class Commit:
    """What a step's commit hands the engine: the rows served, the rows final, and the event;
    `answers`, `marks` and `cut` describe the final rows only (in `final` order)."""

    stepped: bool = True  # a forward ran (the engine's step counter moves on)
    served: list[int] | None = None  # live rows the step's forwards served (None: all)
    forwards: int = 0
    guide_forwards: int = 0
    guide_seconds: float = 0.0
    final: list[int] = field(default_factory=list)  # live rows whose answer is final
    answers: torch.Tensor | None = None  # (R, G): G the longest row's gen_length
    marks: torch.Tensor | None = None  # (R, G): the engine step that wrote each column, -1
    cut: torch.Tensor | None = None  # (R,) where each answer ends (EOS after it; None: no cut)
    event: Callable[[tuple[int, ...]], StepEvent] | None = None  # finished ids -> StepEvent


class Stepper(Protocol):
    """One decoding kind under the engine; the traits below are declared, never probed."""

    settings: DecodeSettings  # resolved (DiffusionGemma: block_length = its canvas)
    vocabulary: int  # token ids a prompt may hold
    whole_batches: bool  # admits only static batches, whatever the engine's admission
    batch_wide: Mapping[str, str]  # Sampling field -> why a request cannot set its own
    who: str  # names the decoder in refusals
    canvas: Any  # the live rows' shared canvas (masked), else None

    def room(self, gen_length: int) -> int:
        """Context positions an answer of gen_length takes (DiffusionGemma: whole canvases)."""

    def place(self, live: list[Request], new: list[Request], order: list[int], step: int) -> int:
        """New requests (slots given) join the live rows; `order` sorts `live + new` into the
        new live order. Returns the forwards it ran (a block prefill)."""

    def plan(self, live: list[Request], step: int) -> Any:
        """This step's work for every live row, from host data."""

    def forward(self, plan: Any) -> Any:
        """The model's forward(s) of the plan."""

    def commit(self, plan: Any, pred: Any) -> Commit:
        """Drafts become tokens; which rows are final."""

    def keep(self, live: list[Request], kept: list[int]) -> None:
        """Only live rows `kept` (indices into `live`) go on."""

    def move_on(self, live: list[Request]) -> None:
        """After finishing: the rows kept (`live`) move on."""

    def progress(self, live: list[Request], i: int) -> list[int]:
        """Live row i's answer so far that no later step can change."""


def stepper_class(kind: str) -> type:
    """The stepper class a family's `stepper` names (imported on first use)."""
    module, _, name = STEPPERS[kind].partition(":")
    return getattr(importlib.import_module(module), name)
