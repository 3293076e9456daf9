"""Per-family reference defaults: values a model family's own generation code applies unasked.

A value here fills a decode setting only when neither the profile nor the command line sets
it, so `dllm` reproduces the family's reference outputs out of the box (REFERENCE.md section 4).
"""

from __future__ import annotations

import json

from dllm_cli.errors import ModelLoadError

# Keys: lowercased config.json model_type. Dream's `diffusion_generate` builds its generation
# config from the model config when the caller passes none; under the transformers version
# Dream pins (4.46) that config carries the legacy generation defaults, so top_k = 50 filters
# every distribution its confidences are computed from. LLaDA's reference has no such default.
FAMILY_DEFAULTS: dict[str, dict[str, object]] = {"dream": {"top_k": 50}}


def family_defaults(family: str | None) -> dict[str, object]:
    """The reference defaults of a model family (empty for LLaDA and unknown families)."""
    return FAMILY_DEFAULTS.get((family or "").lower(), {})


def model_family(architecture: str | None, path: str) -> str | None:
    """Lowercased family: the profile's architecture, else the folder's config.json model_type.

    Read without loading weights; None when the folder or its config.json cannot be read.
    """
    if architecture:
        return architecture.lower()
    from dllm_cli.models.loading import resolve_path  # (imports torch; only needed here)

    try:
        raw = json.loads((resolve_path(path) / "config.json").read_text())
    except (OSError, ValueError, ModelLoadError):
        return None
    kind = raw.get("model_type") if isinstance(raw, dict) else None
    return kind.lower() if isinstance(kind, str) else None


def apply_family_defaults(profile, provenance: dict[str, str]) -> None:
    """Fill decode values nothing set with the family's defaults; provenance says so."""
    family = model_family(profile.model.architecture, profile.model.path)
    for name, value in family_defaults(family).items():
        key = f"decode.{name}"
        if provenance.get(key) == "default" and getattr(profile.decode, name) is None:
            setattr(profile.decode, name, value)
            provenance[key] = f"family default ({family})"
