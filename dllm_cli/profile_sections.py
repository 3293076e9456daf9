"""The sections of a profile as dataclasses: their fields are the keys a profile may set."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from dllm_cli.errors import SettingsError
from dllm_cli.settings import ON_REJECT, DecodeSettings


@dataclass
class SpecialOverrides:
    """Token-id overrides for folders whose config/tokenizer name a role wrongly or not at all."""

    mask: int | None = None
    eos: int | None = None
    pad: int | None = None
    bos: int | None = None
    eot: int | None = None


@dataclass
class ModelSection:
    """Which checkpoint to load and how; architecture None means config.json's model_type."""

    path: str = "builtin:tiny-gsm"
    hub: str = ""  # ORG/NAME on the Hugging Face Hub (`dllm pull`), used when path is not there
    revision: str = "main"  # the hub revision pulled and loaded (a branch, tag or commit)
    architecture: str | None = None  # a families.py key, e.g. dream (None: config.json's)
    dtype: str = "auto"
    device: str = "auto"
    quantize: str = "none"  # none | int8 | int4: quantized as they load (models/quantize.py)
    chat_template: bool = True
    compile: bool = False  # CUDA-graph replay of cached block steps (models/compiled.py)
    threads: int = 0  # torch's CPU threads, set before the first forward (0: torch's default)
    stop_tokens: list[str] = field(default_factory=list)  # more tokens that end an answer
    special: SpecialOverrides = field(default_factory=SpecialOverrides)


@dataclass
class GuideSection:
    """An autoregressive model that verifies the diffusion model's drafts (FlashDLM)."""

    path: str = ""
    accept: str = "exact"  # exact | topk:K | prob:P
    on_reject: str = "guide"  # guide: the guide's own token | draft: the diffusion model's
    verify_chunk: int = 32  # drafts the guide scores per forward
    draft_window: int = 0  # drafts from the first mask (0: to the end of the canvas)

    def acceptance(self) -> tuple[str, float | None]:
        """("exact", None), ("topk", K) or ("prob", P), parsed from `accept`."""
        return parse_accept(self.accept)

    def problem(self) -> str | None:
        """Why these values cannot run (one line), or None."""
        return guide_problem(self.accept, self.on_reject, self.verify_chunk, self.draft_window)


@dataclass
class Profile:
    """A named, complete run configuration: model, decode settings, optional guide."""

    name: str
    description: str = ""
    model: ModelSection = field(default_factory=ModelSection)
    decode: DecodeSettings = field(default_factory=DecodeSettings)
    guide: GuideSection | None = None
    source: Path | None = None  # the file it was read from

    def special_overrides(self) -> dict[str, int | None]:
        """The `special_overrides` argument of `dllm_cli.models.loading.load_model`."""
        return dataclasses.asdict(self.model.special)

    def to_dict(self) -> dict:
        """Plain data for display (`dllm profiles show`)."""
        out = dataclasses.asdict(self)
        out["source"] = str(self.source) if self.source else None
        return out


class ProfileInfo(NamedTuple):
    """One row of `list_profiles`: source is "built-in" or the file's path."""

    name: str
    description: str
    source: str


def parse_accept(accept: str) -> tuple[str, float | None]:
    """A guide's acceptance rule: ("exact", None), ("topk", K) or ("prob", P)."""
    kind, _, arg = accept.partition(":")
    try:
        if kind == "exact" and not arg:
            return "exact", None
        if kind == "topk" and int(arg) >= 1:
            return "topk", int(arg)
        if kind == "prob" and 0.0 < float(arg) <= 1.0:
            return "prob", float(arg)
    except ValueError:
        pass
    raise SettingsError(
        f"accept must be 'exact', 'topk:K' (K >= 1) or 'prob:P' (0 < P <= 1) (got {accept!r})"
    )


def guide_problem(accept: str, on_reject: str, verify_chunk: int, draft_window: int) -> str | None:
    """Why these guided-decoding settings cannot run (one line), or None."""
    try:
        parse_accept(accept)
    except SettingsError as e:
        return str(e)
    if on_reject not in ON_REJECT:
        return f"on_reject must be one of {', '.join(ON_REJECT)} (got {on_reject!r})"
    if verify_chunk < 1:
        return f"verify_chunk must be >= 1 (got {verify_chunk})"
    if draft_window < 0:
        return f"draft_window must be >= 0 (0: to the canvas end; got {draft_window})"
    return None
