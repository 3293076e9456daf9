"""What one decoding setting is, declared once as metadata on its `DecodeSettings` field.

A `Setting` says everything the rest of the package needs to know about a field besides its
name, type and default: its command-line help and panel (options.py builds the flag), its
lifetime (lifetimes.py builds `LIFETIMES`), whether a server request may set it
(serve/protocol.py), its ranges, overall and under particular unmask rules (checked here, by
`check_field`), the unmask rules that read it, and the decoders that cannot use it
(family_settings.py builds each family's refusals). Torch-free, like settings.py.
"""

from __future__ import annotations

import functools
import math
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from types import MappingProxyType
from typing import Any

from dllm_cli.errors import SettingsError

# help panels of `--help` (options.py adds its own)
DECODE = "Decoding"
GEMMA = "DiffusionGemma"
INPUT = "Input"
KINDS = ("masked", "block", "gemma")  # the decoders a family's `stepper` names


class Lifetime(Enum):
    ENGINE = "engine"  # how the engine runs: one value while it is loaded
    REQUEST = "request"  # per request: each row samples with its own values
    SCHEDULE = "schedule"  # how rows walk the canvas: shared by every row of an engine
    GEMMA = "gemma"  # DiffusionGemma's own knobs (its static batch is one generate call)


# why a setting of each lifetime cannot change per request (a Setting may say it better)
WHY = {
    Lifetime.ENGINE: "the engine's cache and forwards are built for it",
    Lifetime.REQUEST: "",
    Lifetime.SCHEDULE: "every row of an engine walks one schedule",
    Lifetime.GEMMA: "DiffusionGemma decodes a whole static batch with one generation config",
}


@dataclass(frozen=True)
class Range:
    """The values a number may take: [low, high], either end open or absent."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    off: str = ""  # 0 is allowed too, outside the interval, and means this ("greedy")
    note: str = ""  # said with a refusal ("0 turns it off")

    def holds(self, value: float) -> bool:
        if self.off and value == 0:
            return True
        low_ok = self.low is None or (value > self.low if self.open_low else value >= self.low)
        high_ok = self.high is None or (value < self.high if self.open_high else value <= self.high)
        return low_ok and high_ok

    def __str__(self) -> str:
        if self.high is None:
            text = f"{'>' if self.open_low else '>='} {number(self.low)}"
        else:
            left, right = "(" if self.open_low else "[", ")" if self.open_high else "]"
            text = f"in {left}{number(self.low)}, {number(self.high)}{right}"
        return f"0 ({self.off}) or {text}" if self.off else text


def number(x: float | None) -> str:
    """A bound as people write it: 1, 0.5, 1e-06, 2**63."""
    if isinstance(x, int) and x > 2**32 and x & (x - 1) == 0:
        return f"2**{x.bit_length() - 1}"
    return f"{x:g}"


# Threshold and factor compare a confidence with a probability; negative entropy is not one.
PROBABILITY_CONFIDENCES = ("low_confidence", "random", "margin")


@dataclass(frozen=True)
class Rule:
    """One `--unmask` choice as the settings see it (its step is in decoding/unmask.py)."""

    follows_steps: bool = False  # a step schedule says how many commit (`steps` applies)
    least: bool = False  # the schedule is the least a step commits (steps None: one token)
    probability: bool = False  # it compares confidences with a probability
    one_forward: bool = False  # it verifies against the conditional forward alone (no CFG)


RULES = {
    "fixed": Rule(follows_steps=True),
    "threshold": Rule(follows_steps=True, least=True, probability=True),
    "factor": Rule(probability=True),
    "origin": Rule(follows_steps=True),
    "eb": Rule(),
    "klass": Rule(probability=True),
    "wino": Rule(probability=True, one_forward=True),
    "sdlm": Rule(probability=True),
    "credit": Rule(probability=True),
}
UNMASKS = tuple(RULES)
# (setting, an old value) -> (its new name, why it changed): refused naming the new one
RENAMED = {("unmask", "prefix"): ("sdlm", "'prefix' names a cache policy")}
STEP_RULES = tuple(n for n, r in RULES.items() if r.follows_steps)


# What a decoder kind says when it cannot use a setting (the fields' `refused`).
_RULE = "an unmask rule's parameter (transformers' sampler picks the tokens)"
GEMMA_CACHE = "its encoder keeps its own KV cache of the prompt and of every finished canvas"
_ACCEPT = "transformers' entropy-bound sampler picks the tokens to accept (see entropy_bound)"
GEMMA_WHOLE = "it samples from the whole temperature-scaled distribution"
_EDIT = "it is LLaDA2.1's token editing"
_KNOB = "it is DiffusionGemma's own knob"
RULE_ONLY = MappingProxyType({"gemma": _RULE})  # a rule's parameter: no rules in DiffusionGemma
GEMMA_ONLY = MappingProxyType({"masked": _KNOB, "block": _KNOB})
EDIT_ONLY = MappingProxyType({"masked": _EDIT, "gemma": _EDIT})  # LLaDA2.1's (block) editing
GEMMA_ACCEPTS = MappingProxyType({"gemma": _ACCEPT})


@dataclass(frozen=True)
class Setting:
    """One decoding setting beyond its name, type and default (see the module docstring)."""

    help: str | None = None  # the CLI flag's help ({choices}: the choices); None: no flag
    lifetime: Lifetime = Lifetime.SCHEDULE
    why: str = ""  # why it cannot change per request ("": the lifetime's reason)
    panel: str = DECODE  # the flag's --help panel
    group: str = "decode"  # the options.shared group its flag belongs to
    choices: tuple[str, ...] = ()  # the values a str setting may take
    range: Range | None = None  # numbers: what any rule accepts
    ranges: Mapping[str, Range] = field(default_factory=dict)  # unmask rule -> its narrower range
    rules: tuple[str, ...] = ()  # the unmask rules that read it (): not a rule's parameter
    refused: Mapping[str, str] = field(default_factory=dict)  # decoder kind -> why it cannot use it
    served: bool = True  # a server request may set it (batching: the server's own)

    def __post_init__(self) -> None:
        unknown = set(self.rules) - set(RULES) or set(self.ranges) - set(self.rules)
        if unknown or set(self.refused) - set(KINDS):  # a typo in a declaration: fail on import
            raise ValueError(f"a setting declares unknown rules or kinds: {self}")

    @property
    def reason(self) -> str:
        """Why it cannot change per request."""
        return self.why or WHY[self.lifetime]

    def flag_help(self) -> str | None:
        return None if self.help is None else self.help.format(choices=" | ".join(self.choices))


def setting(default: object, **declared: Any) -> Any:
    """A DecodeSettings field with its declaration (typed Any: dataclass fields are)."""
    return field(default=default, metadata={"setting": Setting(**declared)})


def declared(cls: type) -> Iterator[tuple[str, Setting]]:
    """(name, Setting) for every field of `cls`, in field order."""
    for f in fields(cls):
        yield f.name, f.metadata.get("setting", Setting())


def refusals(cls: type, kind: str) -> Mapping[str, str]:
    """setting -> why decoder `kind` (masked | block | gemma) cannot use it."""
    return MappingProxyType({n: s.refused[kind] for n, s in declared(cls) if kind in s.refused})


def check_fields(settings: object, rule: object) -> None:
    """Every declared field of `settings` checked by `check_field` (`rule`: the unmask rule)."""
    kinds, rule = kinds_of(type(settings)), rule if isinstance(rule, str) else ""  # a bad rule
    for name, spec in declared(type(settings)):
        check_field(name, getattr(settings, name), kinds[name], spec, rule)


@functools.cache
def kinds_of(cls: type) -> dict[str, tuple[type, bool]]:
    """name -> (base type, may be unset) from the class's annotations."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        out[name] = (next(a for a in args if a is not type(None)), type(None) in args)
    return out


WHAT = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def check_field(
    name: str, value: object, kind: tuple[type, bool], spec: Setting, rule: str
) -> None:
    """Raise SettingsError (one line naming the setting) unless `value` is of its type, among
    its choices and within its range, and within the narrower range of unmask `rule`."""
    base, optional = kind
    if value is None and optional:
        return
    if spec.choices:
        if isinstance(value, str) and (name, value) in RENAMED:  # (a list: unhashable)
            new, why = RENAMED[name, value]
            bad(f"{name} {value!r} is now {new!r} ({why})")
        if value not in spec.choices:
            bad(f"{name} must be one of {', '.join(spec.choices)} (got {value!r})")
        return
    if not is_a(value, base):
        bad(f"{name} must be {WHAT[base]}{' or unset' if optional else ''} (got {value!r})")
    if isinstance(value, float) and not math.isfinite(value):  # (a huge int is finite)
        bad(f"{name} must be finite (got {value!r})")
    for limits, under in ((spec.ranges.get(rule), f" under unmask={rule}"), (spec.range, "")):
        if limits is not None and not limits.holds(value):  # type: ignore[arg-type]
            said = f"{limits.note}; " if limits.note else ""
            bad(f"{name} must be {limits}{under} ({said}got {value})")


def is_a(value: object, base: type) -> bool:
    """Of the type, as settings count types: a bool is no number, an int is a float."""
    if base is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    return isinstance(value, int | float) if base is float else isinstance(value, base)


def bad(message: str) -> typing.NoReturn:
    raise SettingsError(message)
