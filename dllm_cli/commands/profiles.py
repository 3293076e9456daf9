"""`dllm profiles`: which profiles exist, and what one sets and where each value comes from."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from dllm_cli.commands.common import cli_errors, page_console
from dllm_cli.errors import DllmError, ModelLoadError
from dllm_cli.families import batching_reason, model_family
from dllm_cli.family_settings import GEMMA_STEPS, read_json_value
from dllm_cli.folders import BUILTIN_PREFIX, resolve_path
from dllm_cli.profile_paths import unset_variables
from dllm_cli.profiles import DEFAULT_PROFILE, Profile, list_profiles, load_profile, resolve

profiles_app = typer.Typer(
    help="List the profiles dllm can find, or show one with where each value comes from.",
    invoke_without_command=True,
)


@profiles_app.callback()
def list_command(ctx: typer.Context) -> None:
    """List profiles: name, description and where the file lives."""
    if ctx.invoked_subcommand is not None:
        return
    with cli_errors():
        found = list_profiles()
    table = Table(title="dllm profiles", title_justify="left")
    # Names stay whole; at 80 columns (a pipe) the description keeps its room and wraps, and a
    # long source path folds onto further lines instead of squeezing the description out.
    table.add_column("Name", no_wrap=True)
    table.add_column("Description", max_width=56)
    table.add_column("Source", overflow="fold")
    for info in found:
        name = f"{info.name} (default)" if info.name == DEFAULT_PROFILE else info.name
        table.add_row(Text(name, style="bold"), Text(info.description), Text(info.source))
    Console(highlight=False).print(table)


@profiles_app.command("show")
def show_command(
    name: Annotated[
        str | None, typer.Argument(help="Profile NAME or path to a .toml file.", show_default=False)
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            help="A checkpoint folder: show what `--model PATH` runs with (no profile: the "
            "model family's reference settings).",
        ),
    ] = None,
) -> None:
    """Every setting of one profile, and where it comes from (file, flag, family, default)."""
    from dllm_cli.decoding import gemma

    with cli_errors():
        profile, provenance, unset = describe(name, model)
    out = page_console()
    out.print(Text(profile.name, style="bold"), Text(f"- {profile.description}"))
    if profile.source is not None:
        out.print(Text(f"file: {profile.source}", style="dim"))
    values = flatten(profile.to_dict())
    family = model_family(profile.model.architecture, profile.model.path)
    uses = gemma.uses(family)  # decode setting -> how this model family uses it
    if family:
        out.print(Text(f"model family: {family.name}", style="dim"))
    static = batching_reason(family)
    own = family is not None and family.traits.own_model  # every setting's use in a column
    table = Table(title=None)
    table.add_column("Setting", no_wrap=True)
    table.add_column("Value", overflow="fold")
    table.add_column("From", no_wrap=True)
    if own:
        table.add_column("Use")
    for key, origin in provenance.items():
        shown = "unset" if values.get(key) is None else str(values[key])
        if key.endswith(".path"):
            shown += path_remark(values[key])
        if key == "decode.steps" and own and values[key] is None:
            shown += canvas_steps(profile.model.path)
        if key == "decode.batching" and static and values[key] != "static":
            shown = f"static ({static}; the setting says {values[key]})"
        use = [uses.get(key.removeprefix("decode."), "")] if own else []
        table.add_row(key, Text(shown), shown_origin(origin), *use)
    out.print(table)
    sizes = weight_sizes(profile.model.path)
    if sizes:
        out.print(Text(f"weights: {sizes}", style="dim"))
    for var in unset:
        out.print(
            Text(f"note: ${var} is not set; set it to the folder that holds your models "
                 "(or edit the path) before using this profile", style="yellow")
        )  # fmt: skip
    decode, notes = profile.decode, []
    if uses and not own:
        notes.append(f"{family.title} does not use {', '.join(uses)}")
    if family is not None and any(o.startswith("family default") for o in provenance.values()):
        notes += [f"{family.name} reference: {family.source}", *family.notes]
    notes += gemma.notes(decode, decode.block_length) if own else decode.adjustments()
    if family is None:
        notes.append(
            "the model folder cannot be read, so its family is unknown here; family defaults "
            "(Dream: top_k 50) apply when the model loads"
        )
    for line in notes:
        out.print(Text(f"note: {line}", style="dim"))


def weight_sizes(path: str) -> str:
    """The model's weights at each precision, from its config.json ("" when unreadable)."""
    from dllm_cli import fit
    from dllm_cli.families import family_for_config
    from dllm_cli.folders import read_config_json

    if unset_variables(path):
        return ""
    try:
        folder = resolve_path(path)
        raw = read_config_json(folder)
        arch = fit.read_arch(raw, family_for_config(raw, folder / "config.json").name, folder)
    except DllmError:
        return ""
    if arch is None:
        return ""
    return ", ".join(f"{p} {fit.gb(fit.precision_bytes(arch, p))}" for p in fit.PRECISIONS)


def canvas_steps(path: str) -> str:
    """DiffusionGemma's denoising steps per canvas from the folder, for an unset `steps`."""
    try:
        steps = read_json_value(resolve_path(path), *GEMMA_STEPS)
    except ModelLoadError:
        return ""
    return "" if steps is None else f" ({steps} per canvas from {GEMMA_STEPS[0]})"


def shown_origin(origin: str) -> str:
    """The file of a "profile <file>" origin is printed above the table; others as they are."""
    return "profile" if origin.startswith("profile ") else origin


def describe(
    name: str | None, model: str | None = None
) -> tuple[Profile, dict[str, str], list[str]]:
    """The resolved profile with provenance (paths naming unset variables kept raw); `model`
    alone: what `--model PATH` runs with (its family's reference), with `name`: model replaced."""
    # --model replaces the profile's model and so drops its guide, as in `dllm generate`.
    overrides = {"model.path": model, "guide.path": "none"} if model else None
    if model and name is None:
        return (*resolve(None, overrides), [])
    plain = load_profile(name)
    paths = [plain.model.path, plain.guide.path if plain.guide else ""]
    unset = sorted({var for p in paths for var in unset_variables(p)})
    with placeholders(unset):
        profile, provenance = resolve(name, overrides)
    if unset_variables(plain.model.path) and not model:
        profile.model.path = plain.model.path
    if profile.guide and plain.guide and unset_variables(plain.guide.path):
        profile.guide.path = plain.guide.path
    return profile, provenance, unset


@contextmanager
def placeholders(names: list[str]) -> Iterator[None]:
    """Give unset variables a stand-in value while resolving, so resolve can report the rest."""
    for var in names:
        os.environ[var] = f"/unset-{var}"
    try:
        yield
    finally:
        for var in names:
            os.environ.pop(var, None)


def flatten(data: dict, prefix: str = "") -> dict[str, object]:
    """{"model": {"path": p}} -> {"model.path": p}."""
    out: dict[str, object] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out |= flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def path_remark(path: object) -> str:
    """Why a model path will not load, when we can tell without loading it."""
    if not isinstance(path, str) or not path:
        return ""
    if unset_variables(path):
        return f" (${unset_variables(path)[0]} is not set)"
    try:
        folder = resolve_path(path)
    except ModelLoadError:
        return " (not installed)"
    if path.startswith(BUILTIN_PREFIX):
        return f" ({folder})"
    return "" if Path(folder).is_dir() else " (not found)"
