"""Dataclasses from TOML tables, strictly: a typo or a wrong type is a one-line error that names
the key, its section and the file, never a silently ignored setting."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path

import tomli

from dllm_cli.errors import ProfileError, SettingsError

_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def read_toml(path: Path) -> dict:
    """A TOML file as a dict; errors name the file (and the line, for syntax errors)."""
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise ProfileError(f"cannot read profile {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ProfileError(f"{path}: not a UTF-8 text file") from None
    try:
        return tomli.loads(text)
    except tomli.TOMLDecodeError as e:
        line = getattr(e, "lineno", None)
        msg = getattr(e, "msg", None) or str(e)
        at = f":{line}" if line else ""
        raise ProfileError(f"{path}{at}: invalid TOML: {msg}") from None


def build(cls: type, table: dict, section: str, where: str):
    """A dataclass from a TOML table; unknown keys, wrong types and values the class refuses
    (a SettingsError from its own checks) name the key or section and the file."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values = {}
    for key, value in table.items():
        if key not in names:
            raise ProfileError(
                f"{where}: unknown key {key!r} in [{section}]{did_you_mean(key, names)}"
            )
        expected = hints[key]
        if dataclasses.is_dataclass(expected):
            if not isinstance(value, dict):
                raise ProfileError(f"{where}: {key} in [{section}] must be a table")
            values[key] = build(expected, value, f"{section}.{key}", where)
            continue
        try:
            values[key] = check_type(value, expected)
        except TypeError as e:
            raise ProfileError(f"{where}: {key} in [{section}] must be {e}") from None
    try:
        return cls(**values)
    except SettingsError as e:
        raise ProfileError(f"{where}: [{section}] {e}") from None


def check_type(value, hint):
    """`value` if it fits `hint` (ints widen to floats); else TypeError('<what it must be>')."""
    options = typing.get_args(hint) if _is_union(hint) else (hint,)
    for option in options:
        if option is type(None):
            continue
        if option is bool:
            if isinstance(value, bool):
                return value
        elif isinstance(value, bool):
            continue  # TOML true/false is never a number or a string here
        elif option is float and isinstance(value, int | float):
            return float(value)
        elif isinstance(value, typing.get_origin(option) or option):  # list[int] -> list
            return value
    wanted = " or ".join(_TYPE_NAMES.get(o, str(o)) for o in options if o is not type(None))
    raise TypeError(f"{wanted} (got {show(value)})")


def _is_union(hint) -> bool:
    return isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union


def show(value) -> str:
    """A TOML value as an error message names it: `integer 3`, `string 'x'`, `boolean true`."""
    kind = {bool: "boolean", int: "integer", float: "number", str: "string"}.get(type(value))
    kind = kind or ("table" if isinstance(value, dict) else type(value).__name__)
    shown = str(value).lower() if isinstance(value, bool) else repr(value)
    return f"{kind} {shown}"


def did_you_mean(key: str, valid) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else f" (valid: {', '.join(valid)})"
