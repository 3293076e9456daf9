"""DiffusionGemma decoding by transformers' own `generate` loop, stepped (gemma_loop.py).

dllm's settings map onto its generation config where they mean the same thing (`USED`):
gen_length -> max_new_tokens (whole canvases are denoised, the answer is cut at gen_length),
steps -> max_denoising_steps (per canvas; the stopping rule may end a canvas sooner),
early_stop -> eos_token_id (a row stops at the canvas holding its first stop token), seed ->
one generator per row (gemma_stream.RowSampler), and the family's own knobs under their
transformers names (t_min, t_max, entropy_bound, stability_threshold, confidence_threshold).
Unset knobs take the checkpoint's generation_config.json, then transformers' defaults.
block_length is the canvas length, fixed by the checkpoint. Every other setting means nothing
here (families.py `GEMMA_REFUSES`) and is refused when it differs from its default, never
silently ignored.

This module imports transformers' DiffusionGemma code only when a run starts, so the checks
cost nothing for the other families.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import fields, replace

import torch

from dllm_cli.decoding.answer import answer_length
from dllm_cli.decoding.canvas import check_prompts, check_token_ids
from dllm_cli.decoding.events import DecodeResult, StepEvent
from dllm_cli.errors import DllmError, SettingsError
from dllm_cli.families import FAMILIES, Family
from dllm_cli.family_settings import check_refused
from dllm_cli.settings import DecodeSettings

FAMILY = "diffusion_gemma"
PROFILE = "diffusiongemma-26b-a4b-it"
USED: dict[str, str] = {
    "gen_length": "max_new_tokens",
    "block_length": "canvas_length (fixed by the checkpoint)",
    "steps": "max_denoising_steps (per canvas)",
    "seed": "seeds one generator per row",
    "early_stop": "eos_token_id (stop tokens end a row)",
    "batching": "batch mode: always static batches (transformers' sampler decodes a batch)",
    "t_min": "t_min",
    "t_max": "t_max",
    "entropy_bound": "sampler_config.entropy_bound",
    "stability_threshold": "stability_threshold",
    "confidence_threshold": "confidence_threshold",
}
Where = Callable[[str], str]  # setting -> " (from ...)" for error messages


def uses(family: Family | None) -> dict[str, str]:
    """decode.* setting -> how `family` uses it: DiffusionGemma's transformers names, else the
    settings the family refuses (empty when the family is unknown)."""
    if family is None:
        return {}
    if family.own_sampler:
        return {f.name: USED.get(f.name, "not used") for f in fields(DecodeSettings)}
    return dict.fromkeys(family.refuses, "not used")


def nowhere(key: str) -> str:
    return ""


def check_settings(s: DecodeSettings, canvas: int, where: Where = nowhere) -> DecodeSettings:
    """Refuse settings that mean nothing here; block_length becomes the canvas length."""
    check_refused(FAMILIES[FAMILY], s, where)
    if s.block_length not in (canvas, DecodeSettings().block_length):
        raise SettingsError(
            f"block_length {s.block_length}{where('block_length')} does not apply to "
            f"DiffusionGemma: its canvas length is fixed by the checkpoint ({canvas}); leave it out"
        )
    return replace(s, block_length=canvas)


def denoised_length(gen_length: int, canvas: int) -> int:
    """Positions generate fills for gen_length: whole canvases."""
    return math.ceil(gen_length / canvas) * canvas


def notes(s: DecodeSettings, canvas: int) -> list[str]:
    """What the user should know about how the settings map (shown on stderr)."""
    out = []
    if s.gen_length % canvas:
        n = math.ceil(s.gen_length / canvas)
        out.append(
            f"{FAMILY} denoises whole canvases of {canvas} tokens: {n} for gen_length "
            f"{s.gen_length}, the answer is cut after {s.gen_length}"
        )
    return out


def generation_kwargs(stop: tuple[int, ...], pad: int, s: DecodeSettings) -> dict:
    """Keyword arguments of `generate` that set its generation config from dllm's settings.

    Passed as kwargs because those override every level (a generation_config object's unset
    fields would be refilled from the checkpoint's, e.g. its stop tokens with early stop off).
    """
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        EntropyBoundSamplerConfig,
    )

    kw = {
        "max_new_tokens": s.gen_length,
        "max_length": None,  # or a checkpoint's max_length could win over max_new_tokens
        "cache_implementation": None,  # dynamic cache: the compiled static path is not used
        # No stop tokens is [] rather than None: 5.11's generate fails on None (fixed in 5.12).
        "eos_token_id": list(stop) if s.early_stop else [],
        "pad_token_id": pad,
    }
    if s.steps is not None:
        kw["max_denoising_steps"] = s.steps
    for name in ("t_min", "t_max", "confidence_threshold"):
        if getattr(s, name) is not None:
            kw[name] = float(getattr(s, name))
    if s.stability_threshold is not None:
        kw["stability_threshold"] = int(s.stability_threshold)
    if s.entropy_bound is not None:
        kw["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=float(s.entropy_bound))
    return kw


def resolve_config(model, kwargs: dict):
    """The generation config `generate` will use (its own resolution), or a SettingsError."""
    try:
        config, unused = model._prepare_generation_config(None, **kwargs)
    except ValueError as e:
        raise SettingsError(f"{FAMILY} generation settings: {e}") from None
    if unused:
        raise SettingsError(f"{FAMILY}: transformers does not know {sorted(unused)}")
    return config


class GemmaRun:
    """One DiffusionGemma decode with DecodeRun's interface: iterate it for StepEvents, then
    `result()`. Each event is one denoising step of transformers' loop (gemma_loop.denoise),
    run in the caller's thread when the event is asked for; `seconds` counts only those steps."""

    def __init__(self, model, special, prompts: list[list[int]], settings: DecodeSettings):
        began = time.perf_counter()
        from dllm_cli.decoding import gemma_loop
        from dllm_cli.decoding import gemma_stream as gs

        self.model = model
        canvas = model.canvas_length
        self.settings = s = check_settings(settings.validate(), canvas)
        prompts = [list(map(int, p)) for p in prompts]
        canvases = math.ceil(s.gen_length / canvas)
        check_prompts(prompts, denoised_length(s.gen_length, canvas), model.context_length)
        check_token_ids(prompts, model.config.text_config.vocab_size)
        self.prompt_lengths = [len(p) for p in prompts]
        self.width = max(self.prompt_lengths)
        device = next(model.parameters()).device
        rows = [[special.pad] * (self.width - len(p)) + p for p in prompts]
        ids = torch.tensor(rows, device=device)  # (B, W) left-padded
        lengths = torch.tensor(self.prompt_lengths, device=device)
        mask = torch.arange(self.width, device=device)[None] >= (self.width - lengths)[:, None]
        self.config = config = resolve_config(
            model, generation_kwargs(special.stop, special.pad, s)
        )
        generators = [torch.Generator(device=device).manual_seed(s.seed) for _ in prompts]
        self.stop, self.eos = frozenset(special.stop), special.eos
        plan = gs.CanvasPlan(
            canvas, s.gen_length, self.stop if s.early_stop else frozenset(), canvases
        )
        rule = model._prepare_diffusion_stopping_criteria(config)
        self.observer = None if rule is None else gs.StopObserver(rule)
        frozen = lambda: None if self.observer is None else self.observer.finished  # noqa: E731
        sampler = gs.RowSampler(config.sampler_config, canvas, model.vocab_size,
                                config.max_denoising_steps, generators, frozen)  # fmt: skip
        self.outbox: list[StepEvent] = []
        self.streamer = gs.EventStreamer(
            plan, len(prompts), lambda: self.observer, self.outbox.append
        )
        self.steps_left = gemma_loop.denoise(model, ids, mask, config, sampler, self.observer,
                                             self.streamer)  # fmt: skip
        self.sequences: torch.Tensor | None = None
        self.forwards = self.steps = 0
        self.seconds = time.perf_counter() - began
        self._events = self._stream()

    @property
    def done(self) -> bool:
        """The last step has run: `result()` reads no more of the model."""
        return self.sequences is not None

    def _stream(self) -> Iterator[StepEvent]:
        """Run one denoising step per event asked for; closing this stops the decode there."""
        try:
            while self.sequences is None:
                began = time.perf_counter()
                try:
                    next(self.steps_left)
                except StopIteration as end:
                    self.sequences = end.value.cpu()
                self.streamer.flush()  # the canvas goes on: its step has no commits to wait for
                self.seconds += time.perf_counter() - began
                events, self.outbox[:] = list(self.outbox), []
                for event in events:
                    self.forwards = self.steps = event.step + 1
                    yield event
        finally:
            self.steps_left.close()

    def __iter__(self) -> Iterator[StepEvent]:
        return self._events

    def result(self) -> DecodeResult:
        """The finished decode (runs any remaining steps first)."""
        for _ in self._events:
            pass
        if self.sequences is None:
            raise DllmError("the decode was stopped before it finished")
        tokens, steps = self._answers()
        return DecodeResult(
            tokens=tokens,
            commit_steps=steps,
            prompt_lengths=self.prompt_lengths,
            forwards=self.forwards,
            steps=self.steps,
            seconds=self.seconds,
            finished_at=list(self.streamer.finished_at),
        )

    def _answers(self) -> tuple[list[list[int]], list[list[int]]]:
        """Per row: gen_length tokens (after an early stop: EOS fill) and their commit steps."""
        g, canvas = self.settings.gen_length, self.model.canvas_length
        ends = self.streamer.canvas_step
        answers = self.sequences[:, self.width : self.width + g].tolist()
        tokens, steps = [], []
        for answer in answers:
            cut = answer_length(answer, self.stop) if self.settings.early_stop else len(answer)
            tokens.append(answer[:cut] + [self.eos] * (g - cut))
            steps.append([ends[p // canvas] if p < cut else -1 for p in range(g)])
        return tokens, steps


def start_run(model, special, prompts, settings, committer=None) -> GemmaRun:
    """decode_steps for this family (guided decoding's committer does not apply)."""
    if committer is not None:
        raise SettingsError(f"a guide model does not apply to {FAMILY}: it uses its own sampler")
    return GemmaRun(model, special, prompts, settings)
