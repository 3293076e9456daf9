"""Per-family reference defaults: values a model family's own generation code applies unasked.

A value here fills a decode setting only when neither the profile nor the command line sets
it, so `dllm` reproduces the family's reference outputs out of the box (docs/reference.md, section 4).
"""

from __future__ import annotations

import json
from dataclasses import replace

from dllm_cli.errors import ModelLoadError
from dllm_cli.models.loading import resolve_path
from dllm_cli.settings import DecodeSettings

# Keys: lowercased config.json model_type. Dream's `diffusion_generate` builds its generation
# config from the model config when the caller passes none; under the transformers version
# Dream pins (4.46) that config carries the legacy generation defaults, so top_k = 50 filters
# every distribution its confidences are computed from. LLaDA's reference has no such default.
FAMILY_DEFAULTS: dict[str, dict[str, object]] = {"dream": {"top_k": 50}}


def family_defaults(family: str | None) -> dict[str, object]:
    """The reference defaults of a model family (empty for LLaDA and unknown families)."""
    return FAMILY_DEFAULTS.get((family or "").lower(), {})


def with_family_defaults(settings: DecodeSettings, family: str | None) -> DecodeSettings:
    """A copy whose unset fields take the model family's reference defaults."""
    unset = {k: v for k, v in family_defaults(family).items() if getattr(settings, k) is None}
    return replace(settings, **unset) if unset else settings


def model_family(architecture: str | None, path: str) -> str | None:
    """Lowercased family: the profile's architecture, else the folder's config.json model_type.

    Read without loading weights; None when the folder or its config.json cannot be read.
    """
    if architecture:
        return architecture.lower()
    try:
        raw = json.loads((resolve_path(path) / "config.json").read_text())
    except (OSError, ValueError, ModelLoadError):
        return None
    kind = raw.get("model_type") if isinstance(raw, dict) else None
    return kind.lower() if isinstance(kind, str) else None


def apply_family_defaults(profile, provenance: dict[str, str]) -> None:
    """Fill decode values nothing set with the family's defaults; provenance says so."""
    family = model_family(profile.model.architecture, profile.model.path)
    unset = {
        name: value
        for name, value in family_defaults(family).items()
        if provenance.get(f"decode.{name}") == "default" and getattr(profile.decode, name) is None
    }
    if unset:
        profile.decode = replace(profile.decode, **unset)  # (settings are frozen, revalidated)
    for name in unset:
        provenance[f"decode.{name}"] = f"family default ({family})"
