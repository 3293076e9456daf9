"""A profile's model and guide paths: expanded, unset variables found, or the pulled hub copy.

Split from profiles.py (reading and resolving profiles): the folder a path names, wherever it lives.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from dllm_cli import hub
from dllm_cli.folders import BUILTIN_PREFIX, resolve_path

if TYPE_CHECKING:
    from dllm_cli.profile_sections import Profile

UNSET_VAR = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")


def resolve_model_path(text: str, base: Path | None) -> str:
    """builtin:NAME stays; ~ and $VARS expand; a relative path is taken from `base`."""
    if text.startswith(BUILTIN_PREFIX):
        return text
    expanded = os.path.expanduser(os.path.expandvars(text))
    if UNSET_VAR.search(expanded):
        return expanded  # an unset variable: leave it visible for `unset_variables`
    path = Path(expanded)
    if base is not None and not path.is_absolute():
        path = base / path
    return str(path.resolve()) if base is not None else str(path)


def unset_variables(path: str) -> list[str]:
    """Environment variables a (resolved) model path still names because they are unset."""
    return [] if path.startswith(BUILTIN_PREFIX) else UNSET_VAR.findall(path)


def use_pulled(profile: Profile) -> None:
    """A profile naming a hub repo loads the pulled copy when its path is not there."""
    m = profile.model
    if not m.hub or is_folder(m.path):
        return
    folder = hub.cached(hub_source(profile))
    if folder is not None:
        m.path = str(folder)


def is_folder(path: str) -> bool:
    return not unset_variables(path) and Path(resolve_path(path)).is_dir()


def hub_source(profile: Profile) -> hub.Source:
    return hub.Source(profile.model.hub, profile.model.revision, profile.name)


def require_model_folder(profile: Profile) -> None:
    """A hub profile whose folder is neither at its path nor pulled: say what to run."""
    if profile.model.hub and not is_folder(profile.model.path):
        hub.local_folder(hub_source(profile))
