"""Domain errors: raised by the library, turned into one line + exit code by the CLI."""

import json
from pathlib import Path


class DllmError(Exception):
    """Base class: a user-facing problem with a clear one-line message (exit 1: a run that
    failed after it started, e.g. an output file that could not be written)."""

    exit_code = 1


class ProfileError(DllmError):
    """A profile is missing, malformed, or has unknown keys."""

    exit_code = 2


class SettingsError(DllmError):
    """A decoding setting is out of range or inconsistent."""

    exit_code = 2


class UsageError(DllmError):
    """The command line cannot run as given: an output path that cannot be written, a flag
    whose optional extra is not installed (checked before any decoding)."""

    exit_code = 2


class ModelLoadError(DllmError):
    """A checkpoint folder cannot be turned into a model."""

    exit_code = 3


class InputError(DllmError):
    """A prompt cannot be decoded (empty, too long, ...)."""

    exit_code = 4


class DeviceError(DllmError):
    """The requested device does not exist on this machine."""

    exit_code = 5


def write_text(path: Path, text: str) -> None:
    """Write an output file; one that cannot be written is a DllmError saying why (exit 1)."""
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise DllmError(f"cannot write {path}: {e.strerror or e}") from None


def write_json(path: Path | None, records: list[dict]) -> None:
    """--json FILE: the records as one JSON list (no path: nothing)."""
    if path is not None:
        write_text(path, json.dumps(records, indent=2) + "\n")
