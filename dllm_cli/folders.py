"""Where a model folder is and what its config.json says, read without torch or transformers."""

from __future__ import annotations

import json
import os
from pathlib import Path

from dllm_cli.errors import ModelLoadError

BUILTIN_PREFIX = "builtin:"
BUILTIN_DIR = Path(__file__).resolve().parent / "tinygsm" / "weights"


def resolve_path(path: str | os.PathLike) -> Path:
    """`builtin:NAME` -> the shipped folder; otherwise an expanded local path."""
    text = str(path)
    if text.startswith(BUILTIN_PREFIX):
        name = text[len(BUILTIN_PREFIX) :]
        folder = BUILTIN_DIR / name
        if not folder.is_dir():
            known = sorted(p.name for p in BUILTIN_DIR.iterdir()) if BUILTIN_DIR.is_dir() else []
            raise ModelLoadError(
                f"no built-in model {name!r} (built-in: {', '.join(known) or 'none'})"
            )
        return folder
    return Path(os.path.expandvars(os.path.expanduser(text)))


def read_config_json(folder: Path) -> dict:
    """config.json as a dict; errors name the folder or file and the problem."""
    if not folder.exists():
        raise ModelLoadError(f"model folder not found: {folder}")
    if not folder.is_dir():
        raise ModelLoadError(f"model path is not a folder: {folder}")
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"no config.json in {folder} (is this a model folder?)")
    try:
        raw = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{cfg_file} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{cfg_file} is not a JSON object")
    return raw


HEADER_LIMIT = 100 * 2**20  # a safetensors header past this is not one (a damaged file)


def stored_shapes(folder: Path) -> dict[str, list[int]]:
    """Each stored tensor's shape from the folder's safetensors headers (an 8-byte length, then
    JSON; no torch): the index's shards, else model.safetensors. ModelLoadError if unreadable."""
    index = folder / "model.safetensors.index.json"
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except FileNotFoundError:
        names = ["model.safetensors"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelLoadError(f"{index}: no readable weight_map ({e})") from None
    shapes: dict[str, list[int]] = {}
    for name in names:
        path = folder / name
        try:
            with path.open("rb") as f:
                size = int.from_bytes(f.read(8), "little")
                if not 0 < size <= HEADER_LIMIT:
                    raise ValueError(f"a header of {size} bytes")
                header = json.loads(f.read(size))
            shapes |= {k: list(v["shape"]) for k, v in header.items() if k != "__metadata__"}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{path}: no readable safetensors header ({e})") from None
    return shapes
