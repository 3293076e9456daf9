"""Profiles: TOML files naming a model and how to decode it; strict keys, CLI > profile > default.

A profile is looked up as a path to a .toml file, or as a NAME searched in $DLLM_PROFILES_DIR,
then ./profiles, then the profiles shipped with the package. Every key is checked against the
dataclasses of profile_sections.py (the [decode] keys are exactly `DecodeSettings`' fields), so a typo is an
error that names the key, its section and the file instead of a silently ignored setting.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from pathlib import Path

from dllm_cli import hub
from dllm_cli.errors import ProfileError
from dllm_cli.families import (
    FAMILIES,
    Family,
    apply_family_defaults,
    folder_family,
    reference_settings,
)
from dllm_cli.family_settings import read_folder_values
from dllm_cli.folders import resolve_path
from dllm_cli.hub import HUB_NAME, is_hub_name
from dllm_cli.profile_paths import resolve_model_path, unset_variables, use_pulled
from dllm_cli.profile_sections import (
    GuideSection,
    ModelSection,
    Profile,
    ProfileInfo,
    SpecialOverrides,
)
from dllm_cli.settings import DecodeSettings

# `dllm profiles` lists the files without torch: models.loading (DTYPES) is imported inside
# the function that checks a profile.
from dllm_cli.strict_toml import build, check_type, did_you_mean, read_toml, show

DEFAULT_PROFILE = "tiny-gsm-dream"
ENV_DIR = "DLLM_PROFILES_DIR"
BUILTIN_SOURCE = "built-in"


# --- reading one file -----------------------------------------------------------------------

SECTIONS: dict[str, type] = {"model": ModelSection, "decode": DecodeSettings, "guide": GuideSection}
TOP_KEYS = ("name", "description", *SECTIONS)


def load_profile(name_or_path: str | os.PathLike | None = None) -> Profile:
    """Find, parse and validate a profile; every problem is a one-line ProfileError."""
    return _parse(find_profile(name_or_path))[0]


def _parse(path: Path) -> tuple[Profile, dict]:
    """The profile and the raw TOML it came from (provenance needs to know what was set)."""
    data = read_toml(path)
    where = str(path)
    for key in data:
        if key not in TOP_KEYS:
            hint = did_you_mean(key, TOP_KEYS)
            kind = "section" if isinstance(data[key], dict) else "key"
            raise ProfileError(f"{where}: unknown top-level {kind} {key!r}{hint}")
    for key in ("name", "description"):
        if key in data and not isinstance(data[key], str):
            raise ProfileError(f"{where}: {key} must be a string (got {show(data[key])})")
    tables = {}
    for section in SECTIONS:
        if section in data and not isinstance(data[section], dict):
            raise ProfileError(f"{where}: {section} must be a [{section}] table")
        tables[section] = data.get(section)
    model = build(ModelSection, tables["model"] or {}, "model", where)
    decode = build(DecodeSettings, tables["decode"] or {}, "decode", where)  # validated here
    guide = (
        None if tables["guide"] is None else build(GuideSection, tables["guide"], "guide", where)
    )
    name, description = data.get("name", path.stem), data.get("description", "")
    profile = Profile(name, description, model, decode, guide, source=path)
    _check_values(profile, where)
    profile.model.path = resolve_model_path(profile.model.path, path.parent)
    if profile.guide:
        profile.guide.path = resolve_model_path(profile.guide.path, path.parent)
    return profile, data


def _check_values(profile: Profile, where: str | None) -> None:
    """Allowed values beyond types (decode: DecodeSettings' own); `where`: the file, or None for
    command-line values (the message names the flag). Model tables: imported here, not at start."""
    from dllm_cli.models.loading import DTYPES
    from dllm_cli.models.quantize import SCHEMES as QUANTIZE

    def bad(section: str, problem: str) -> ProfileError:
        """`problem` starts with the key it is about: "dtype must be one of ..."."""
        key, _, rest = problem.partition(" ")
        if where is None:
            return ProfileError(f"--{key.replace('_', '-')} {rest}")
        return ProfileError(f"{where}: {key} in [{section}] {rest}")

    m = profile.model
    if not m.path:
        raise bad("model", "path must not be empty")
    if m.architecture is not None:
        m.architecture = m.architecture.lower()
        if m.architecture not in FAMILIES:
            known = ", ".join(FAMILIES)
            raise bad("model", f"architecture must be one of {known} (got {m.architecture!r})")
    dtypes = ("auto", *DTYPES)
    if m.dtype not in dtypes:
        raise bad("model", f"dtype must be one of {', '.join(dtypes)} (got {m.dtype!r})")
    if m.quantize not in QUANTIZE:
        raise bad("model", f"quantize must be one of {', '.join(QUANTIZE)} (got {m.quantize!r})")
    if m.hub and not HUB_NAME.match(m.hub):
        raise bad("model", f"hub must be ORG/NAME, a Hugging Face Hub repo (got {m.hub!r})")
    if not m.revision:
        raise bad("model", "revision must not be empty (a branch, tag or commit; default main)")
    if not all(isinstance(t, str) and t for t in m.stop_tokens):
        raise bad("model", "stop_tokens must be a list of token strings")
    if m.threads < 0:
        raise bad("model", f"threads must be >= 0 (0: torch's default; got {m.threads})")
    for role, value in dataclasses.asdict(m.special).items():
        if value is not None and value < 0:
            raise bad("model.special", f"{role} must be >= 0 (got {value})")
    if profile.guide:
        if not profile.guide.path:
            raise ProfileError(f"{where or 'command line'}: [guide] needs a path (or leave it out)")
        problem = profile.guide.problem()
        if problem:
            raise bad("guide", problem)


# --- finding profiles -----------------------------------------------------------------------


def builtin_dir() -> Path:
    """The shipped profiles: the installed package's copy, else the checkout's profiles/."""
    package = Path(__file__).resolve().parent
    installed = package / "builtin_profiles"
    return installed if installed.is_dir() else package.parent / "profiles"


def search_path() -> list[tuple[str, Path]]:
    """(source label, folder) in lookup order: $DLLM_PROFILES_DIR, ./profiles, built-in."""
    dirs = [
        (str(Path(d).expanduser()), Path(d).expanduser())
        for d in os.environ.get(ENV_DIR, "").split(os.pathsep)
        if d.strip()
    ]
    builtin, local = builtin_dir(), Path.cwd() / "profiles"
    if not (local.is_dir() and builtin.is_dir() and local.samefile(builtin)):
        dirs.append((str(local), local))  # (in a checkout, ./profiles is the built-in folder)
    dirs.append((BUILTIN_SOURCE, builtin))
    return dirs


def _is_file_reference(text: str) -> bool:
    return text.endswith(".toml") or "/" in text or os.sep in text


def find_profile(name_or_path: str | os.PathLike | None = None) -> Path:
    """A profile's file: an explicit .toml path, or the first NAME.toml on the search path."""
    text = str(name_or_path) if name_or_path is not None else DEFAULT_PROFILE
    if isinstance(name_or_path, os.PathLike) or _is_file_reference(text):
        path = Path(os.path.expandvars(text)).expanduser()
        if not path.is_file():
            raise ProfileError(f"profile file not found: {path}")
        return path.resolve()
    for _, folder in search_path():
        candidate = folder / f"{text}.toml"
        if candidate.is_file():
            return candidate.resolve()
    names = sorted({p.name for p in list_profiles()})
    close = difflib.get_close_matches(text, names, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ProfileError(
        f"unknown profile {text!r} ({hint}available: {', '.join(names) or 'none'}; "
        f"or give a path to a .toml file)"
    )


def list_profiles() -> list[ProfileInfo]:
    """Every profile on the search path, sorted by name; earlier folders shadow later ones."""
    found: dict[str, ProfileInfo] = {}
    for label, folder in search_path():
        if not folder.is_dir():
            continue
        for file in sorted(folder.glob("*.toml")):
            if file.stem in found:
                continue
            source = label if label == BUILTIN_SOURCE else str(file.resolve())
            found[file.stem] = ProfileInfo(file.stem, _description(file), source)
    return [found[name] for name in sorted(found)]


def _description(file: Path) -> str:
    try:
        description = read_toml(file).get("description", "")
    except ProfileError as e:
        return f"(invalid: {e})"
    return description if isinstance(description, str) else ""


# --- CLI flag > profile > default -----------------------------------------------------------

ALIASES = {"model": "model.path", "guide": "guide.path", "accept": "guide.accept"}


def setting_keys() -> list[str]:
    """Every dotted key a CLI override may name (model.*, model.special.*, decode.*, guide.*)."""
    keys = [f"model.{f.name}" for f in dataclasses.fields(ModelSection) if f.name != "special"]
    keys += [f"model.special.{f.name}" for f in dataclasses.fields(SpecialOverrides)]
    keys += [f"decode.{f.name}" for f in dataclasses.fields(DecodeSettings)]
    keys += [f"guide.{f.name}" for f in dataclasses.fields(GuideSection)]
    return keys


def _canonical(key: str, keys: list[str]) -> str:
    """A dotted key from an override's name: dotted, an alias, or a unique bare field name."""
    if key in keys:
        return key
    if key in ALIASES:
        return ALIASES[key]
    matches = [k for k in keys if k.rsplit(".", 1)[-1] == key]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise ProfileError(f"ambiguous setting {key!r} (use one of {', '.join(matches)})")
    bare = sorted({k.rsplit(".", 1)[-1] for k in keys} | set(ALIASES) | set(keys))
    raise ProfileError(f"unknown setting {key!r}{did_you_mean(key, bare)}")


def resolve(
    name_or_path: str | os.PathLike | None, cli_overrides: dict[str, object] | None = None
) -> tuple[Profile, dict[str, str]]:
    """Apply CLI overrides (None = not given) to a profile; say where each value came from.

    Provenance maps every dotted key (e.g. "decode.gen_length") to "cli", "profile <file>",
    "default" or "family default (<family>)" (`families.py`; with the family unknown, e.g. no
    model folder yet, the value stays unset and the decoder fills it once the model is loaded).
    A guide path of "" or "none" from the CLI turns the profile's guide off.

    No profile named but a model path given (`--model PATH`): the run starts from that model
    family's reference settings (families.py), not from the default profile, which is tuned
    for the shipped tiny model.
    """
    keys = setting_keys()
    given = {_canonical(k, keys): v for k, v in (cli_overrides or {}).items() if v is not None}
    if is_hub_name(str(given.get("model.path", ""))):  # --model ORG/NAME: the pulled folder
        given["model.path"] = str(hub.local_folder(hub.Source(str(given["model.path"]))))
    family, found = None, {}
    if name_or_path is None and "model.path" in given:
        path = None
        folder = resolve_model_path(str(given["model.path"]), Path.cwd())
        family = folder_family(folder)
        found = read_folder_values(family, resolve_path(folder))
        profile, raw = family_profile(family), {}
    else:
        path = find_profile(name_or_path)
        profile, raw = _parse(path)
    decode = {k: v for k, (v, _) in found.items()}  # the folder's own values; flags override
    for key in sorted(given, key=lambda k: k != "guide.path"):  # a guide first, then its rules
        _apply(profile, key, given[key], decode)
    from_cli = set(given)
    provenance = {}
    for key in keys:
        if key.startswith("guide.") and profile.guide is None:
            continue
        if key in from_cli:
            provenance[key] = "cli"
        elif _lookup(raw, key) is not _MISSING:
            provenance[key] = f"profile {path}"
        elif key.removeprefix("decode.") in found:
            provenance[key] = f"checkpoint {found[key.removeprefix('decode.')][1]}"
        elif family is not None and key.removeprefix("decode.") in family.reference_keys():
            provenance[key] = f"family default ({family.name})"
        else:
            provenance[key] = "default"
    _check_values(profile, None)  # only command-line values can fail here
    m = profile.model
    if "model.path" not in from_cli:
        use_pulled(profile)
    for key, section in (("model.path", profile.model), ("guide.path", profile.guide)):
        unset = unset_variables(section.path) if section else []
        if unset:
            pull = f" or run `dllm pull {profile.name}`" if key == "model.path" and m.hub else ""
            raise ProfileError(
                f"{key} {section.path!r} uses ${unset[0]}, which is not set "
                f"(set {unset[0]} to the folder holding your models, give another path{pull})"
            )
    if family is not None and family.whole_answer and "decode.block_length" not in from_cli:
        decode.setdefault("block_length", decode.get("gen_length", profile.decode.gen_length))
    if decode:  # the run's settings are built (and so validated) here, once
        profile.decode = dataclasses.replace(profile.decode, **decode)
    apply_family_defaults(profile, provenance)
    return profile, provenance


def family_profile(family: Family) -> Profile:
    """The profile `--model PATH` starts from: the family's reference settings, no guide."""
    return Profile(
        name=f"{family.name}-reference",
        description=f"{family.title}'s own reference settings (--model without --profile)",
        decode=reference_settings(family),
    )


_MISSING = object()


def _lookup(data: dict, dotted: str):
    node = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _apply(profile: Profile, key: str, value, decode: dict[str, object]) -> None:
    """Set one dotted setting from the CLI, type-checked like a profile value; decode settings
    are collected in `decode` (they are immutable: resolve builds them once, at the end)."""
    section, *rest = key.split(".")
    if section == "guide":
        if rest == ["path"] and isinstance(value, str) and value.strip().lower() in ("", "none"):
            profile.guide = None
            return
        if profile.guide is None:
            if rest != ["path"]:
                raise ProfileError(
                    f"{key} given, but profile {profile.name!r} has no [guide] section "
                    "(no AR guide to set up)"
                )
            profile.guide = GuideSection()
        target = profile.guide
    elif section == "model":
        target = profile.model.special if rest[0] == "special" else profile.model
        rest = rest[1:] if rest[0] == "special" else rest
    else:
        target = profile.decode
    field_name = rest[0]
    try:
        value = check_type(value, typing.get_type_hints(type(target))[field_name])
    except TypeError as e:
        raise ProfileError(f"command-line value for {key} must be {e}") from None
    if field_name == "path":
        value = resolve_model_path(value, base=Path.cwd())
    if target is profile.decode:
        decode[field_name] = value
    else:
        setattr(target, field_name, value)
