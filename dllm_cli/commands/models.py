"""`dllm pull`, `dllm list`, `dllm rm`: checkpoints by name, in the local Hugging Face cache.

Only typer, rich and the light modules at the top: huggingface_hub and torch are imported when
a command runs (hub.py, fit.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from dllm_cli import fit, hub
from dllm_cli.commands.common import cli_errors, note, page_console, write
from dllm_cli.errors import DllmError, ProfileError, UsageError
from dllm_cli.families import family_for_config
from dllm_cli.folders import read_config_json, resolve_path
from dllm_cli.profile_paths import hub_source, is_folder
from dllm_cli.profile_sections import Profile
from dllm_cli.profiles import list_profiles, load_profile

Name = Annotated[
    str,
    typer.Argument(help="A profile NAME (its [model] hub and revision) or a hub repo ORG/NAME."),
]
Revision = Annotated[
    str | None,
    typer.Option(help="Hub revision (branch, tag or commit); default: the profile's, else main."),
]


def source_of(name: str, revision: str | None) -> hub.Source:
    """A profile's hub repo and revision, or ORG/NAME as given; UsageError for neither."""
    try:
        profile = load_profile(name)
    except ProfileError:
        if not hub.HUB_NAME.match(name):
            raise UsageError(f"{name!r} is neither a profile nor a hub repo ORG/NAME") from None
        return hub.Source(name, revision or hub.DEFAULT_REVISION)
    if not profile.model.hub:
        raise UsageError(
            f"profile {profile.name!r} names no hub repo (its model: {profile.model.path})"
        )
    source = hub_source(profile)
    return source if revision is None else hub.Source(source.repo, revision, source.name)


def pull_command(name: Name, revision: Revision = None) -> None:
    """Download a checkpoint into the Hugging Face cache (resumable; HF_HOME, HF_TOKEN, HF_ENDPOINT apply); print its folder."""
    with cli_errors():
        source = source_of(name, revision)
        note(f"pulling {source.repo} (revision {source.revision}) into {hub.cache_dir()}")
        folder = hub.pull(source)
    note(f"pulled {source.repo}: {gb_on_disk(source.repo)} on disk")
    write(f"{folder}\n")


def rm_command(name: Name) -> None:
    """Delete a pulled checkpoint (every revision of its repo) from the Hugging Face cache."""
    with cli_errors():
        source = source_of(name, None)
        freed = hub.remove(source.repo)
        if not freed:
            raise DllmError(
                f"{source.repo} is not downloaded (nothing to remove in {hub.cache_dir()})"
            )
    note(f"removed {source.repo} ({fit.gb(freed)})")


@dataclass
class Row:
    """One line of `dllm list`."""

    name: str
    repo: str
    where: str  # pulled | local | not downloaded
    disk: str
    precision: str
    verdict: str


def list_command() -> None:
    """The profiles and pulled checkpoints: downloaded or not, size on disk, precision, and whether each fits this machine's free memory."""
    with cli_errors():
        device, free = this_device()
        rows = [profile_row(p, device, free) for p in profiles()]
        named = {r.repo for r in rows}
        rows += [repo_row(repo, device, free) for repo in pulled_repos() if repo not in named]
    table = Table(title=f"dllm models ({fit.gb(free)} free on {device})", title_justify="left")
    for column in ("Name", "Hub repo", "Downloaded", "On disk", "Precision", "Fit"):
        table.add_column(column, overflow="fold")
    styles = {"fits": "green", "tight": "yellow", "will not fit": "red"}
    for r in rows:
        verdict = Text(r.verdict, style=styles.get(r.verdict, "dim"))
        table.add_row(Text(r.name, style="bold"), r.repo, r.where, r.disk, r.precision, verdict)
    page_console().print(table)


def profiles() -> list[Profile]:
    out = []
    for info in list_profiles():
        try:
            out.append(load_profile(info.name))
        except DllmError:
            continue  # a broken profile file: `dllm profiles show` says why
    return out


def this_device() -> tuple[str, int]:
    """Where `auto` loads, and its free memory."""
    import torch

    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    return device, fit.free_memory(device)


def profile_row(p: Profile, device: str, free: int) -> Row:
    m = p.model
    folder = local_folder(p)
    where = "not downloaded" if folder is None else ("local" if is_folder(m.path) else "pulled")
    disk = gb_on_disk(m.hub) if where == "pulled" else folder_size(folder)
    dtype = m.dtype if m.dtype != "auto" else ("bfloat16" if device != "cpu" else "float32")
    precision = m.quantize if m.quantize != "none" else dtype
    verdict = judge(folder, free, dtype, m.quantize, p.decode.gen_length)
    return Row(p.name, m.hub or "-", where, disk, precision, verdict)


def repo_row(repo: str, device: str, free: int) -> Row:
    folder = hub.cached(hub.Source(repo))
    dtype = "bfloat16" if device != "cpu" else "float32"
    verdict = judge(folder, free, dtype, "none", 256)
    return Row(repo, repo, "pulled", gb_on_disk(repo), dtype, verdict)


def local_folder(p: Profile) -> Path | None:
    if is_folder(p.model.path):
        return Path(resolve_path(p.model.path))
    return hub.cached(hub_source(p)) if p.model.hub else None


def judge(folder: Path | None, free: int, dtype: str, quantize: str, gen: int) -> str:
    """fits / tight / will not fit for one slot, or why it cannot be judged."""
    if folder is None:
        return "- (no config.json yet)"
    try:
        raw = read_config_json(folder)
        family = family_for_config(raw, folder / "config.json")
    except DllmError:
        return "- (unreadable config)"
    arch = fit.read_arch(raw, family.name, folder)
    if arch is None or free <= 0:
        return "- (not sized)"
    return fit.need(arch, free, dtype, quantize, 1, gen).verdict


def pulled_repos() -> list[str]:
    root = hub.cache_dir()
    if not root.is_dir():
        return []
    names = sorted(p.name for p in root.glob("models--*") if p.is_dir())
    return [n.removeprefix("models--").replace("--", "/", 1) for n in names]


def gb_on_disk(repo: str) -> str:
    folder = hub.repo_folder(repo)
    return fit.gb(hub.disk_bytes(folder)) if folder.is_dir() else "-"


def folder_size(folder: Path | None) -> str:
    if folder is None:
        return "-"
    return fit.gb(sum(p.stat().st_size for p in folder.iterdir() if p.is_file()))
