"""What each model family does with the decode settings, declared as data (torch-free): what
its decoding kind means outside its stepper (`TRAITS`), the settings it refuses and why, the
values it reads from the model folder itself, and the ones its one-line run summary names.
families.py's table points each family at these.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Protocol

from dllm_cli.errors import ModelLoadError, SettingsError
from dllm_cli.setting_spec import refusals
from dllm_cli.settings import DecodeSettings


@dataclass(frozen=True)
class StepperTraits:
    """What a decoding kind (Family.stepper) means outside its stepper, declared once."""

    frontier: bool = False  # frontier-walking committers apply (an AR guide, a grammar)
    # how a grammar steers it: "frontier", it verifies each row's run from its first mask
    # (grammar_committer.py); "canvas", it picks each finished canvas's tokens left to right
    # (gemma_grammar.py); a family that cannot follow one says so in its `cannot` table
    grammar: str = "frontier"
    prompt_blocks: bool = False  # blocks start at the prompt's block boundary (block-causal)
    uniform: bool = False  # uniform-state diffusion: drafts replace tokens, there are no masks
    whole_canvases: bool = False  # the answer is denoised in whole canvases of the checkpoint's
    own_model: bool = False  # transformers builds, samples and decodes the model itself
    # request settings one batch shares (transformers' sampler decodes it with one generation
    # config): a request cannot set its own, and the server groups requests by them
    batch_wide: tuple[str, ...] = ()


# Family.stepper -> its traits (decoding/stepper.py STEPPERS: the classes)
TRAITS: Mapping[str, StepperTraits] = MappingProxyType(
    {
        "masked": StepperTraits(frontier=True),
        "block": StepperTraits(prompt_blocks=True),
        "gemma": StepperTraits(
            grammar="canvas",
            uniform=True,
            whole_canvases=True,
            own_model=True,
            batch_wide=("confidence", "temperature", "top_p", "top_k"),
        ),
    }
)


class Family(Protocol):
    """The parts of a families.py row these functions read."""

    title: str
    traits: StepperTraits
    cannot: Mapping[str, str]
    refuses: Mapping[str, str]
    only: Mapping[str, tuple[tuple[str, ...], str]]
    folder_values: Mapping[str, tuple[str, str]]
    summary: tuple[str, ...]


DEFAULTS = DecodeSettings()

# Settings a family cannot use, with the reason its refusal gives (a value other than the
# default is refused in one line: `check_refused`), one table per kind of decoder, generated
# from each field's declaration (`refused` in settings.py).
GEMMA_REFUSES = refusals(DecodeSettings, "gemma")
MASKED_REFUSES = refusals(DecodeSettings, "masked")
BLOCK_REFUSES = refusals(DecodeSettings, "block")
# Settings a family takes only some values of: setting -> (those values, why another is
# refused); the refusal names the values to use instead.
BLOCK_ONLY: Mapping[str, tuple[tuple[str, ...], str]] = MappingProxyType(
    {
        "cache": (
            ("prefix", "none"),
            "its block cache is exact, approximate caches are not offered",
        ),
        "unmask": (
            ("threshold", "fixed"),
            "the references commit by a confidence threshold or a fixed count per step",
        ),
        "confidence": (("low_confidence",), "the references rank by the draft's probability"),
    }
)
# The features a family's `cannot` table may name (feature -> why), each refused in one line
# where it starts (`refuse_feature`): "quantize" in models/loading.py, "logprobs" (answer
# log-probabilities) in batch.py, serve/scores.py and the engine, "grammar" (a grammar or JSON
# schema) in commands/generate.py, api.py and serve/engines.py, "scoring" in scoring.py. Today
# every family runs every feature but DiffusionGemma scoring; the guards stand for the
# next row.
FEATURES = ("quantize", "logprobs", "grammar", "scoring")
GEMMA_CANNOT: Mapping[str, str] = MappingProxyType(
    {
        "scoring": "transformers' own generate scores no likelihood",
    }
)
GENERATION_CONFIG = "generation_config.json"
# The settings a run's summary line names (eval); set-only extras are added where they apply.
MASKED_SUMMARY = ("cache", "unmask", "block_length", "steps", "early_stop")
BLOCK_SUMMARY = ("cache", "unmask", "threshold", "block_length", "steps", "early_stop")
GEMMA_SUMMARY = ("block_length", "steps", "t_min", "t_max", "entropy_bound", "early_stop")
SUMMARY_EXTRAS = ("suffix_window", "edit_threshold")  # shown when set (not 0 / None)
# The fields SDAR's and LLaDA2.x's families.py rows share: the block-causal stepper, its tables.
BLOCK_CAUSAL: Mapping[str, object] = MappingProxyType(
    {
        "stepper": "block",
        "refuses": BLOCK_REFUSES,
        "only": BLOCK_ONLY,
        "summary": BLOCK_SUMMARY,
    }
)
# DiffusionGemma's steps per canvas when `steps` is unset (dllm's steps count the whole answer)
GEMMA_STEPS = (GENERATION_CONFIG, "max_denoising_steps")


def refusal(family: Family, key: str, value: object) -> str | None:
    """Why the family refuses `key` = `value` (None: it takes it): a setting in `refuses` at
    a value other than its default, or one in `only` at a value not listed."""
    if key in family.refuses and value != getattr(DEFAULTS, key):
        return family.refuses[key]
    values, why = family.only.get(key, ((value,), ""))
    return None if value in values else f"{why} (use {' or '.join(values)})"


def check_refused(family: Family, s: DecodeSettings, where=lambda key: "") -> None:
    """A setting the family cannot use at its value is refused in one line naming where the
    value came from (`where`) and why (families.py `refuses` and `only`)."""
    for key in dict.fromkeys([*family.refuses, *family.only]):
        value = getattr(s, key)
        why = refusal(family, key, value)
        if why is not None:
            hint = "" if key in family.only else " (leave it out)"
            raise SettingsError(
                f"{key} {value!r}{where(key)} does not apply to {family.title}: {why}{hint}"
            )


def refuse_feature(family: Family, feature: str, what: str, error=SettingsError) -> None:
    """`what` (a flag, a request field) in one line naming why, when the family `cannot`
    run `feature`."""
    assert feature in FEATURES, feature
    if feature in family.cannot:
        raise error(f"{what} does not apply to {family.title}: {family.cannot[feature]}")


def summary_line(family: Family, s: Mapping[str, object]) -> str:
    """`key=value` for the settings the family's summary shows (unset: the checkpoint's own),
    then any set extra (suffix_window, LLaDA2.1's edit_threshold with its max_post_steps)."""
    shown = [*family.summary, *(k for k in SUMMARY_EXTRAS if s.get(k))]
    if s.get("edit_threshold") is not None:
        shown = [*dict.fromkeys([*shown, "edit_threshold", "max_post_steps"])]

    def value(key: str) -> object:
        if s[key] is not None:
            return s[key]
        if family.traits.own_model:  # generation_config.json, then transformers' defaults
            return "checkpoint"
        return s["gen_length"] if key == "steps" else "unset"  # steps: one token a step

    return " ".join(f"{k}={value(k)}" for k in shown)


def read_folder_values(family: Family, folder: Path) -> dict[str, tuple[object, str]]:
    """setting -> (value, file) for the family's `folder_values` the folder's files hold (a
    missing file or key is skipped)."""
    found = {}
    for setting, (name, dotted) in family.folder_values.items():
        value = read_json_value(folder, name, dotted)
        if value is not None:
            found[setting] = (value, name)
    return found


def read_json_value(folder: Path, name: str, dotted: str) -> object:
    """The value at `dotted` in the folder's JSON file `name`; None when the file or key is
    missing (a file that is not JSON is a ModelLoadError)."""
    path = folder / name
    if not path.is_file():
        return None
    try:
        node = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


# DiffusionGemma's linears kept in the load dtype under --quantize (models/diffusion_gemma.py
# quantizes by this, fit.py counts by it): the vision tower and its projection (dllm sends no
# images), each MoE router's projection (its few logits pick the experts: KEEP_FLOAT), and each
# stack's first layer's dense MLP output projection (encoder and decoder: FIRST_BLOCK_FLOAT's
# massive activations). The output head is tied to the embedding (float, as for the other
# families); the experts are 3-D parameters, not nn.Linear, and stay float (transformers
# picks their kernel: `use_experts_implementation`).
GEMMA_FLOAT_PARTS = ("vision_tower.", "embed_vision.", "router.proj")
GEMMA_FIRST_MLP_OUT = ("language_model.layers.0.mlp.down_proj", "decoder.layers.0.mlp.down_proj")


def gemma_keeps_float(name: str) -> bool:
    """Whether the linear named `name` stays in the load dtype when the model is quantized."""
    return any(part in name for part in GEMMA_FLOAT_PARTS) or name.endswith(GEMMA_FIRST_MLP_OUT)
