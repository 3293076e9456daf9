"""Checkpoints by name: Hugging Face Hub repos pulled into, and found offline in, the local HF cache.

`dllm pull` is the only command that reaches the network (huggingface_hub's snapshot_download:
resumable, a progress bar on stderr, HF_HOME / HF_HUB_CACHE / HF_TOKEN / HF_ENDPOINT as the hub
library reads them). Every other command finds a pulled checkpoint in the cache without any
request (local_files_only), and names the command to run when it is not there. Only what dllm
loads is pulled: config, tokenizer and template files and safetensors; never code or .bin files.
huggingface_hub is imported inside the functions, so start-up stays light.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from dllm_cli.errors import DllmError, ModelLoadError, UsageError

HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
DEFAULT_REVISION = "main"


@dataclass(frozen=True)
class Source:
    """A hub checkpoint: the repo, the revision, and the name to give `dllm pull`."""

    repo: str
    revision: str = DEFAULT_REVISION
    name: str = ""  # a profile's name, else the repo

    @property
    def pull_name(self) -> str:
        return self.name or self.repo


def is_hub_name(text: str) -> bool:
    """ORG/NAME and not a folder on this machine (a local path wins)."""
    return bool(HUB_NAME.match(text)) and not Path(text).expanduser().exists()


def cache_dir() -> Path:
    """The hub cache as huggingface_hub finds it, read from the environment now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def repo_folder(repo: str) -> Path:
    """The cache's folder for one repo (all its revisions)."""
    return cache_dir() / ("models--" + repo.replace("/", "--"))


def cached(source: Source) -> Path | None:
    """The pulled snapshot folder, complete, found without a request; None when not pulled."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = snapshot(source, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        return None
    return folder if complete(folder) else None


def snapshot(source: Source, **options) -> Path:
    """The hub's snapshot_download of the files a folder needs, into our cache."""
    from huggingface_hub import snapshot_download

    return Path(
        snapshot_download(
            source.repo,
            revision=source.revision,
            cache_dir=cache_dir(),
            allow_patterns=FILES,
            **options,
        )
    )


def complete(folder: Path) -> bool:
    """config.json and every weight file the folder's index names (or one model.safetensors)."""
    if not (folder / "config.json").is_file():
        return False
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError):
            return False
        return all((folder / s).is_file() for s in shards)
    return any(folder.glob("*.safetensors"))


def local_folder(source: Source) -> Path:
    """The pulled folder, or ModelLoadError (exit 3) saying exactly what to run."""
    folder = cached(source)
    if folder is None:
        here = "" if source.name else " (nor is it a folder here)"
        raise ModelLoadError(
            f"{source.repo} (revision {source.revision}) is not downloaded in {cache_dir()}"
            f"{here}: run `dllm pull {source.pull_name}`"
        )
    return folder


def pull(source: Source) -> Path:
    """Download (or finish downloading) the checkpoint; a progress bar on stderr."""
    from huggingface_hub import errors as hf

    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise UsageError("HF_HUB_OFFLINE is set: `dllm pull` needs the network (unset it)")
    endpoint = os.environ.get("HF_ENDPOINT") or None
    try:
        folder = snapshot(source, endpoint=endpoint)
    except hf.GatedRepoError:
        raise DllmError(
            f"{source.repo} is gated: accept its terms on the hub, set HF_TOKEN"
        ) from None
    except hf.RepositoryNotFoundError:
        raise UsageError(f"no hub repo {source.repo!r} (or it is private: set HF_TOKEN)") from None
    except hf.RevisionNotFoundError:
        raise UsageError(f"{source.repo} has no revision {source.revision!r}") from None
    except (OSError, hf.HfHubHTTPError, ValueError) as e:
        where = endpoint or "the hub"
        raise DllmError(f"cannot download {source.repo} from {where}: {one_line(e)}") from None
    if not complete(folder):
        raise DllmError(f"{source.repo}: the download has no config.json or safetensors weights")
    return folder


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def remove(repo: str) -> int:
    """Delete every pulled revision of `repo`; the bytes freed (0: nothing was there)."""
    folder = repo_folder(repo)
    if not folder.is_dir():
        return 0
    freed = disk_bytes(folder)
    shutil.rmtree(folder)
    return freed


def disk_bytes(folder: Path) -> int:
    """Bytes a cache folder holds (blobs counted once, not through the snapshot links)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
