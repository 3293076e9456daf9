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
    prompt_blocks: bool = False  # blocks start at the prompt's block boundary (block-causal)
    uniform: bool = False  # uniform-state diffusion: drafts replace tokens, there are no masks
    whole_canvases: bool = False  # the answer is denoised in whole canvases of the checkpoint's
    own_model: bool = False  # transformers builds, samples and decodes the model itself
    per_request_sampling: bool = True  # rows of one engine may sample with their own values
    logprobs: str | None = None  # why answer logprobs are refused (None: they are recorded)


# Family.stepper -> its traits (decoding/stepper.py STEPPERS: the classes)
TRAITS: Mapping[str, StepperTraits] = MappingProxyType(
    {
        "masked": StepperTraits(frontier=True),
        "block": StepperTraits(
            prompt_blocks=True, logprobs="by the block-causal engine (SDAR, LLaDA2)"
        ),
        "gemma": StepperTraits(
            uniform=True,
            whole_canvases=True,
            own_model=True,
            per_request_sampling=False,
            logprobs="for DiffusionGemma (its own sampler)",
        ),
    }
)


class Family(Protocol):
    """The parts of a families.py row these functions read."""

    title: str
    traits: StepperTraits
    refuses: Mapping[str, str]
    folder_values: Mapping[str, tuple[str, str]]
    summary: tuple[str, ...]


DEFAULTS = DecodeSettings()

# Settings a family cannot use, with the reason its refusal gives (a value other than the
# default is refused in one line: `check_refused`), one table per kind of decoder, generated
# from each field's declaration (`refused` in settings.py).
GEMMA_REFUSES = refusals(DecodeSettings, "gemma")
MASKED_REFUSES = refusals(DecodeSettings, "masked")
BLOCK_REFUSES = refusals(DecodeSettings, "block")
GENERATION_CONFIG = "generation_config.json"
# The settings a run's summary line names (eval); set-only extras are added where they apply.
MASKED_SUMMARY = ("cache", "unmask", "block_length", "steps", "early_stop")
BLOCK_SUMMARY = ("cache", "unmask", "threshold", "block_length", "steps", "early_stop")
GEMMA_SUMMARY = ("block_length", "steps", "t_min", "t_max", "entropy_bound", "early_stop")
SUMMARY_EXTRAS = ("suffix_window", "edit_threshold")  # shown when set (not 0 / None)
# DiffusionGemma's steps per canvas when `steps` is unset (dllm's steps count the whole answer)
GEMMA_STEPS = (GENERATION_CONFIG, "max_denoising_steps")


def check_refused(family: Family, s: DecodeSettings, where=lambda key: "") -> None:
    """A setting the family cannot use, given a value other than its default, is refused in
    one line naming where the value came from (`where`) and why."""
    for key, why in family.refuses.items():
        value = getattr(s, key)
        if value != getattr(DEFAULTS, key):
            raise SettingsError(
                f"{key} {value!r}{where(key)} does not apply to {family.title}: {why} "
                "(leave it out)"
            )


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
