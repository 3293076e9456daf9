"""Model families as declared records: how a folder is recognised, which classes build it, how
its sampler differs, and the decode settings its own reference code uses when asked nothing.

`--model PATH` without `--profile` starts from the family's `reference` settings (never from
another model's profile), so a user's own LLaDA or Dream folder decodes as its reference code
does; flags still override. Where each reference value comes from is in `source` (and in
docs/profiles.md, "Model families and their reference settings"; Dream's hidden top-k:
docs/reference.md, section 4).

A folder's family is read from config.json without importing torch: `architectures` first,
then `model_type` (LLaDA-MoE says `model_type "llada"` like LLaDA-8B; only its
`architectures ["LLaDAMoEModelLM"]` tells them apart). Classes are named by import path and
imported only when a model is built, so `dllm --help` and `dllm profiles` stay light.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType

from dllm_cli.errors import ModelLoadError
from dllm_cli.family_settings import (
    BLOCK_CAUSAL,
    FEATURES,
    GEMMA_CANNOT,
    GEMMA_REFUSES,
    GEMMA_SUMMARY,
    GENERATION_CONFIG,
    MASKED_REFUSES,
    MASKED_SUMMARY,
    TRAITS,
    StepperTraits,
)
from dllm_cli.folders import read_config_json, resolve_path
from dllm_cli.settings import DecodeSettings


@dataclass(frozen=True)
class Family:
    """One model family: recognition, classes, sampler, reference settings, refused settings."""

    name: str  # the registry key; a profile's [model] architecture
    title: str  # for messages
    model_types: tuple[str, ...]  # config.json model_type values it answers to
    architectures: tuple[str, ...]  # config.json architectures names it answers to
    config_class: str  # "module:Class", imported on use
    model_class: str
    logit_shift: int  # 0: column i predicts itself; 1: it predicts column i + 1
    sampler: str  # key of decoding/sampling.py SAMPLERS (how drafts and confidences are made)
    reference: Mapping[str, object]  # DecodeSettings values of the family's own generate code
    source: str  # where `reference` was read
    whole_answer: bool = False  # the reference has no blocks: block_length = gen_length
    mask_id: int | None = None  # when neither config.json nor the tokenizer names the mask
    # setting -> why this family cannot use it (a value other than the default is refused)
    refuses: Mapping[str, str] = field(default_factory=lambda: MASKED_REFUSES)
    # setting -> (the only values this family takes, why another is refused)
    only: Mapping[str, tuple[tuple[str, ...], str]] = field(default_factory=dict)
    cannot: Mapping[str, str] = field(default_factory=dict)  # feature -> why it is refused
    static_batches: str | None = None  # why batch mode always runs whole static batches
    notes: tuple[str, ...] = field(default=())  # deviations and facts worth a line in docs
    stepper: str = "masked"  # TRAITS here, decoding/stepper.py STEPPERS: masked | block | gemma
    # setting -> (file, dotted key) read from the folder itself: what decoding it uses when no
    # profile sets it (`--model PATH`), and what `profiles show --model` reports
    folder_values: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    summary: tuple[str, ...] = MASKED_SUMMARY  # settings a run's one-line summary shows

    def __post_init__(self) -> None:
        unknown = sorted(set(self.cannot) - set(FEATURES))
        if unknown:
            raise ValueError(f"{self.name}: `cannot` names no feature {unknown} ({FEATURES})")

    @property
    def traits(self) -> StepperTraits:
        return TRAITS[self.stepper]

    def classes(self) -> tuple[type, type]:
        """(config class, model class), imported now (the first model build pays for torch)."""
        return _load(self.config_class), _load(self.model_class)

    def unset_defaults(self) -> dict[str, object]:
        """Reference values for settings whose built-in default is "unset" (Dream's top_k 50):
        they fill a profile that leaves them unset, and the decoder fills them likewise."""
        return {
            k: v
            for k, v in self.reference.items()
            if v is not None and getattr(DEFAULTS, k) is None
        }

    def reference_keys(self) -> tuple[str, ...]:
        """The decode settings the reference sets (block_length too where it is the answer)."""
        return (*self.reference, *(("block_length",) if self.whole_answer else ()))


def _load(path: str) -> type:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


DEFAULTS = DecodeSettings()

LLADA_SOURCE = (
    "ML-GSAI/LLaDA generate.py main() and chat.py: gen_length 128, steps 128, block_length 32, "
    "temperature 0, cfg_scale 0, remasking low_confidence; no cache, no early stop"
)
# LLaDA's generate() as its repository and the LLaDA-MoE model card call it.
LLADA_REFERENCE: Mapping[str, object] = MappingProxyType(
    {
        "gen_length": 128,
        "steps": None,  # one token per step: the reference's 128 steps for 128 tokens
        "block_length": 32,
        "cache": "none",
        "unmask": "fixed",
        "schedule": "linear",
        "confidence": "low_confidence",
        "temperature": 0.0,
        "cfg_scale": 0.0,
        "early_stop": False,
    }
)
FAMILIES: dict[str, Family] = {
    "llada": Family(
        name="llada",
        title="LLaDA",
        model_types=("llada",),
        architectures=("LLaDAModelLM",),
        config_class="dllm_cli.models.llada:LLaDAConfig",
        model_class="dllm_cli.models.llada:LLaDAModelLM",
        logit_shift=0,
        sampler="llada",
        reference=LLADA_REFERENCE,
        source=LLADA_SOURCE,
    ),
    "dream": Family(
        name="dream",
        title="Dream",
        model_types=("Dream",),
        architectures=("DreamModel",),
        config_class="dllm_cli.models.dream:DreamConfig",
        model_class="dllm_cli.models.dream:DreamModel",
        logit_shift=1,
        sampler="dream",
        reference={
            "gen_length": 512,
            "steps": None,  # one token per step: the reference's 512 steps for 512 tokens
            "cache": "none",
            "unmask": "origin",
            "schedule": "dream",
            "temperature": 0.0,
            "top_k": 50,
            "eps": 1e-3,
            "alg_temp": 0.0,
            "early_stop": False,
        },
        source=(
            "Dream's generation_utils.py DreamGenerationConfig: steps 512, alg origin, eps 1e-3, "
            "temperature 0, top_p None, alg_temp None; top_k 50 from the legacy generation "
            "defaults transformers 4.46 puts on every model config, which diffusion_generate "
            "copies when the caller passes no generation_config; max_new_tokens 512 as in "
            "Dream's README; the whole answer is one block"
        ),
        notes=(
            "the legacy defaults diffusion_generate copies also bring temperature 1.0 when the "
            "caller passes none (measured under transformers 4.46.2, 4.51.3, 4.52.4); every call in Dream's README and "
            "demos passes a temperature and the README documents 0.0 as the default, so the "
            "family default stays 0 (greedy), while top_k, which no call passes, is 50",
        ),
        whole_answer=True,
    ),
    "llada_moe": Family(
        name="llada_moe",
        title="LLaDA-MoE",
        model_types=("llada", "lladamoe"),  # "lladamoe": the rename some training code uses
        architectures=("LLaDAMoEModelLM",),
        config_class="dllm_cli.models.llada_moe:LLaDAMoEConfig",
        model_class="dllm_cli.models.llada_moe:LLaDAMoEModelLM",
        logit_shift=0,
        sampler="llada",
        reference=LLADA_REFERENCE,
        source=(
            "the LLaDA-MoE-7B-A1B model card runs LLaDA's generate with steps 128, gen_length "
            "128, block_length 32, temperature 0, cfg_scale 0, remasking low_confidence"
        ),
        mask_id=156895,  # <|mask|>: not in config.json; the card passes generate(mask_id=156895)
    ),
    "diffusion_gemma": Family(
        name="diffusion_gemma",
        title="DiffusionGemma",
        model_types=("diffusion_gemma",),
        architectures=("DiffusionGemmaForBlockDiffusion", "DiffusionGemmaModel"),
        config_class="transformers:DiffusionGemmaConfig",
        model_class="dllm_cli.models.diffusion_gemma:DiffusionGemmaLM",
        logit_shift=0,
        sampler="transformers",
        reference={"early_stop": True},
        source=(
            "transformers' DiffusionGemma generate: the checkpoint's generation_config.json for "
            "every knob left unset; a row ends at its eos_token_id"
        ),
        stepper="gemma",
        refuses=GEMMA_REFUSES,
        cannot=GEMMA_CANNOT,
        summary=GEMMA_SUMMARY,
        folder_values={
            "block_length": ("config.json", "canvas_length"),
            "t_min": (GENERATION_CONFIG, "t_min"),
            "t_max": (GENERATION_CONFIG, "t_max"),
            "entropy_bound": (GENERATION_CONFIG, "sampler_config.entropy_bound"),
            "stability_threshold": (GENERATION_CONFIG, "stability_threshold"),
            "confidence_threshold": (GENERATION_CONFIG, "confidence_threshold"),
        },
        static_batches="DiffusionGemma decodes whole batches with transformers' own sampler",
    ),
    "sdar": Family(
        name="sdar",
        title="SDAR",
        model_types=("sdar",),
        architectures=("SDARForCausalLM",),
        config_class="dllm_cli.models.sdar:SDARConfig",
        model_class="dllm_cli.models.sdar:SDARForCausalLM",
        logit_shift=0,
        sampler="block",
        reference={
            "gen_length": 256,
            "block_length": 4,
            "steps": None,  # 4 steps per block of 4: one token per step at least
            "cache": "prefix",  # exact: the reference's DynamicCache with store_kv
            "unmask": "threshold",  # low_confidence_dynamic
            "threshold": 0.85,
            "temperature": 1.0,
            "top_k": 0,
            "top_p": 1.0,
            "early_stop": True,
        },
        source=(
            "JetAstra/SDAR generate.py block_diffusion_generate and its CLI: block_length 4, "
            "denoising_steps 4, low_confidence_dynamic with confidence_threshold 0.85, "
            "temperature 1.0, top_k 0, top_p 1.0; stop at the generation_config eos ids "
            "after each block; gen_length 256 as the README's example (the CLI says 20480)"
        ),
        folder_values={"block_length": ("config.json", "block_size")},  # as trained
        **BLOCK_CAUSAL,
    ),
    "llada2": Family(
        name="llada2",
        title="LLaDA2",
        model_types=("llada2_moe",),
        architectures=("LLaDA2MoeModelLM",),
        config_class="dllm_cli.models.llada2:LLaDA2MoeConfig",
        model_class="dllm_cli.models.llada2:LLaDA2MoeModelLM",
        logit_shift=0,
        sampler="block",
        reference={
            "gen_length": 2048,
            "block_length": 32,
            "steps": None,  # 32 steps per block of 32: one token per step at least
            "cache": "prefix",  # exact; the reference recomputes the window (cache = "none")
            "unmask": "threshold",
            "threshold": 0.95,
            "temperature": 0.0,
            "early_stop": True,
        },
        source=(
            "LLaDA2.0's modeling_llada2_moe.py generate: temperature 0, block_length 32, steps "
            "32, gen_length 2048, threshold 0.95, minimal_topk 1, eos 156892, mask 156895; it "
            "stops after the block holding eos. LLaDA2.1's editing (edit_threshold, "
            "max_post_steps) is set by its profiles"
        ),
        mask_id=156895,  # <|mask|>: not in config.json
        **BLOCK_CAUSAL,
    ),
}


def by_name(name: str | None) -> Family | None:
    """The family a profile's `architecture` names (case-insensitive), or None."""
    return FAMILIES.get((name or "").lower())


def family_for_config(raw: dict, where: Path | str) -> Family:
    """The family of a config.json dict: a known `architectures` name (agreeing with any
    model_type), else without architectures the first family listing its `model_type` (dense
    LLaDA for "llada"); anything else is refused naming both fields."""
    kind = raw.get("model_type")
    names = raw.get("architectures") or []
    names = [n for n in names if isinstance(n, str)] if isinstance(names, list) else []
    for family in FAMILIES.values():
        if any(n in family.architectures for n in names):
            if kind is None or kind in family.model_types:
                return family
            break
    else:
        if not names:
            for family in FAMILIES.values():
                if kind in family.model_types:
                    return family
    if kind is None and not names:
        raise ModelLoadError(f"{where} has no model_type (cannot tell the architecture)")
    known = ", ".join(f"{f.architectures[0]} ({f.model_types[0]})" for f in FAMILIES.values())
    raise ModelLoadError(
        f"unknown architecture {kind!r} with architectures {names or None} in {where} "
        f"(supported: {known})"
    )


def folder_family(path: str) -> Family:
    """The family of a model folder, from its config.json alone (no weights, no torch)."""
    folder = resolve_path(path)
    return family_for_config(read_config_json(folder), folder / "config.json")


def model_family(architecture: str | None, path: str) -> Family | None:
    """A profile's family: its [model] architecture, else its folder's (None if unreadable)."""
    if architecture:
        return by_name(architecture)
    try:
        return folder_family(path)
    except (OSError, ValueError, ModelLoadError):
        return None


def family_of_model(model) -> Family:
    """The family of a built model (every model class declares `family`)."""
    return FAMILIES[model.family]


def with_family_defaults(settings: DecodeSettings, family: str | None) -> DecodeSettings:
    """A copy whose unset fields take the model family's reference values (Dream: top_k 50)."""
    entry = by_name(family)
    fill = entry.unset_defaults() if entry else {}
    unset = {k: v for k, v in fill.items() if getattr(settings, k) is None}
    return replace(settings, **unset) if unset else settings


def apply_family_defaults(profile, provenance: dict[str, str]) -> None:
    """Fill a resolved profile's decode values nothing set with its family's "unset" defaults
    (Dream: top_k 50); provenance says so."""
    family = model_family(profile.model.architecture, profile.model.path)
    unset = {
        name: value
        for name, value in (family.unset_defaults() if family else {}).items()
        if provenance.get(f"decode.{name}") == "default" and getattr(profile.decode, name) is None
    }
    if unset:
        profile.decode = replace(profile.decode, **unset)  # (settings are frozen, revalidated)
    for name in unset:
        provenance[f"decode.{name}"] = f"family default ({family.name})"


def batching_reason(family: Family | None) -> str | None:
    """Why batch mode runs whole static batches whatever `batching` says (None: it does not)."""
    return family.static_batches if family is not None else None


def reference_settings(family: Family) -> DecodeSettings:
    """The family's reference decode settings (one block over the whole answer where it has
    no blocks)."""
    settings = replace(DEFAULTS, **family.reference)
    if family.whole_answer:
        settings = replace(settings, block_length=settings.gen_length)
    return settings
