"""DiffusionGemma decoding by transformers' own `generate` loop, stepped (gemma_loop.py).

dllm's settings map onto its generation config where they mean the same thing (`USED`):
gen_length -> max_new_tokens (the answer is cut at gen_length), steps -> max_denoising_steps
(per canvas), early_stop -> eos_token_id, seed -> one generator per row
(gemma_stream.RowSampler), and the family's own knobs under their transformers names. Unset
knobs take the checkpoint's generation_config.json, then transformers' defaults; block_length
is the checkpoint's canvas length. Any other setting that differs from its default is refused
(families.py `GEMMA_REFUSES`), never silently ignored. transformers is imported at run start.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import fields, replace

from dllm_cli.errors import SettingsError
from dllm_cli.families import FAMILIES, Family
from dllm_cli.family_settings import check_refused
from dllm_cli.settings import DecodeSettings

FAMILY = "diffusion_gemma"
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
    if family.traits.own_model:
        return {f.name: USED.get(f.name, "not used") for f in fields(DecodeSettings)}
    return dict.fromkeys(family.refuses, "not used")


def check_settings(s: DecodeSettings, canvas: int, where: Where = lambda k: "") -> DecodeSettings:
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
    if not s.gen_length % canvas:
        return []
    n = math.ceil(s.gen_length / canvas)
    return [
        f"{FAMILY} denoises whole canvases of {canvas} tokens: {n} for gen_length "
        f"{s.gen_length}, the answer is cut after {s.gen_length}"
    ]


def generation_kwargs(stop: tuple[int, ...], pad: int, s: DecodeSettings) -> dict:
    """`generate`'s keyword arguments for dllm's settings: kwargs override every level (a
    generation_config's unset fields would be refilled from the checkpoint's, e.g. its stops)."""
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
