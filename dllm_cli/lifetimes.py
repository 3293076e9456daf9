"""Settings by lifetime: which may change per request, and which are fixed for an engine's life.

Every setting has one lifetime, declared in `LIFETIMES` (a name -> entry table), so what a
request may vary is data that one function (`request_sampling`) reads, not checks spread over
the engine, the API and the server:

| lifetime  | fixed for                          | settings                                      |
|-----------|------------------------------------|-----------------------------------------------|
| engine    | a loaded model and its engine      | cache, refresh interval, suffix window, slots, |
|           |                                    | batching, compile, device, threads, quantize  |
| request   | one request (rows sample apart)    | temperature, top_p, top_k, seed, confidence,  |
|           |                                    | stop ids                                      |
| schedule  | an engine (rows walk one schedule) | gen_length, block length, steps, unmask rule, |
|           |                                    | threshold, factor, the rules' parameters      |
| gemma     | DiffusionGemma's static batch      | t_min, t_max, entropy bound, stability, ...   |

A request's sampling values are a `Sampling`: validated by building the DecodeSettings they
make with the engine's (DecodeSettings validates in one place: a confidence that is not a
probability is refused beside a threshold rule as on the command line), with the family's unset
defaults applied by `families.with_family_defaults` (Dream's top_k 50), as the engine's own.
`gen_length` is a schedule setting on purpose: a row's canvas is prompt + gen_length columns,
and a shorter or longer canvas is a different model input, so a request decoding beside
others at another length would not get the text it gets alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum

from dllm_cli.errors import SettingsError
from dllm_cli.families import with_family_defaults
from dllm_cli.settings import DecodeSettings


class Lifetime(Enum):
    ENGINE = "engine"  # how the engine runs: one value while it is loaded
    REQUEST = "request"  # per request: each row samples with its own values
    SCHEDULE = "schedule"  # how rows walk the canvas: shared by every row of an engine
    GEMMA = "gemma"  # DiffusionGemma's own knobs (its static batch is one generate call)


@dataclass(frozen=True)
class Entry:
    """One setting's lifetime, and why it cannot change per request (when it cannot)."""

    lifetime: Lifetime
    why: str = ""


_ENGINE = "the engine's cache and forwards are built for it"
_SCHEDULE = "every row of an engine walks one schedule"
_GEMMA = "DiffusionGemma decodes a whole static batch with one generation config"
_CANVAS = (
    "a row's canvas is prompt + gen_length columns, and another length is another model "
    "input, so the answer would depend on what shares the batch"
)

LIFETIMES: dict[str, Entry] = {
    # engine: DecodeSettings fields, then the profile's [model] and batch keys
    "cache": Entry(Lifetime.ENGINE, _ENGINE),
    "refresh_interval": Entry(Lifetime.ENGINE, _ENGINE),
    "suffix_window": Entry(Lifetime.ENGINE, _ENGINE),
    "batching": Entry(Lifetime.ENGINE, "admission is the engine's policy"),
    "cfg_scale": Entry(Lifetime.ENGINE, "guidance doubles every row of the engine's forward"),
    "early_stop": Entry(Lifetime.ENGINE, "the engine decides once how rows leave"),
    "slots": Entry(Lifetime.ENGINE, _ENGINE),
    "compile": Entry(Lifetime.ENGINE, _ENGINE),
    "device": Entry(Lifetime.ENGINE, "the model is loaded there"),
    "threads": Entry(Lifetime.ENGINE, "torch's threads are set before the first forward"),
    "quantize": Entry(Lifetime.ENGINE, "the weights are quantized as they load"),
    # request: each row's own sampler inputs and generator
    "temperature": Entry(Lifetime.REQUEST),
    "top_p": Entry(Lifetime.REQUEST),
    "top_k": Entry(Lifetime.REQUEST),
    "seed": Entry(Lifetime.REQUEST),
    "confidence": Entry(Lifetime.REQUEST),  # validated with the engine's rule (threshold: a p)
    "stop": Entry(Lifetime.REQUEST),
    # schedule
    "gen_length": Entry(Lifetime.SCHEDULE, _CANVAS),
    "block_length": Entry(Lifetime.SCHEDULE, _SCHEDULE),
    "steps": Entry(Lifetime.SCHEDULE, _SCHEDULE),
    "unmask": Entry(Lifetime.SCHEDULE, _SCHEDULE),
    "schedule": Entry(Lifetime.SCHEDULE, _SCHEDULE),
    "threshold": Entry(Lifetime.SCHEDULE, _SCHEDULE),
    "factor": Entry(Lifetime.SCHEDULE, _SCHEDULE),
    "eb_gamma": Entry(Lifetime.SCHEDULE, _SCHEDULE),
    "kl_threshold": Entry(Lifetime.SCHEDULE, _SCHEDULE),
    "kl_history": Entry(Lifetime.SCHEDULE, _SCHEDULE),
    "wino_verify": Entry(Lifetime.SCHEDULE, _SCHEDULE),
    "jump_threshold": Entry(Lifetime.SCHEDULE, _SCHEDULE),
    "credit_alpha": Entry(Lifetime.SCHEDULE, _SCHEDULE),
    "credit_boost": Entry(Lifetime.SCHEDULE, _SCHEDULE),
    "credit_decay": Entry(Lifetime.SCHEDULE, _SCHEDULE),
    "eps": Entry(Lifetime.SCHEDULE, _SCHEDULE),
    "alg_temp": Entry(Lifetime.SCHEDULE, _SCHEDULE),
    "edit_threshold": Entry(Lifetime.SCHEDULE, _SCHEDULE),
    "max_post_steps": Entry(Lifetime.SCHEDULE, _SCHEDULE),
    # DiffusionGemma
    "t_min": Entry(Lifetime.GEMMA, _GEMMA),
    "t_max": Entry(Lifetime.GEMMA, _GEMMA),
    "entropy_bound": Entry(Lifetime.GEMMA, _GEMMA),
    "stability_threshold": Entry(Lifetime.GEMMA, _GEMMA),
    "confidence_threshold": Entry(Lifetime.GEMMA, _GEMMA),
}

PER_REQUEST = tuple(k for k, e in LIFETIMES.items() if e.lifetime is Lifetime.REQUEST)
# Per-request names that are DecodeSettings fields (stop ids are not: the model's come first).
SAMPLING_FIELDS = tuple(k for k in PER_REQUEST if k != "stop")


@dataclass(frozen=True)
class Sampling:
    """One request's sampling: its temperature, filters, seed and extra stop token ids."""

    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None  # None: the family's default (families.py); 0: no top-k
    seed: int = 0
    confidence: str = "low_confidence"  # which confidence ranks its drafts (sampling.py)
    stop: tuple[int, ...] = ()  # token ids that end this answer besides the model's own

    @classmethod
    def of(cls, settings: DecodeSettings, stop: tuple[int, ...] = ()) -> Sampling:
        return cls(**{k: getattr(settings, k) for k in SAMPLING_FIELDS}, stop=tuple(stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def lifetime_of(name: str) -> Lifetime:
    return LIFETIMES[name].lifetime


def refusal(name: str) -> str:
    """One line: why setting `name` cannot be given per request."""
    entry = LIFETIMES[name]
    return f"{name} cannot change per request ({entry.lifetime.value} setting: {entry.why})"


def split(values: dict[str, object]) -> tuple[dict[str, object], dict[str, object]]:
    """(per-request values, the rest) of a dict of settings by name."""
    mine = {k: v for k, v in values.items() if k in PER_REQUEST}
    return mine, {k: v for k, v in values.items() if k not in PER_REQUEST}


def request_sampling(
    engine: DecodeSettings,
    family: str | None,
    settings: DecodeSettings | None = None,
    sampling: Sampling | dict | None = None,
) -> Sampling:
    """A request's Sampling: from whole DecodeSettings (any field other than a per-request
    one must equal the engine's, else SettingsError naming it) or from per-request values;
    validated as DecodeSettings validates, the family's unset defaults applied."""
    if settings is not None:
        settings = with_family_defaults(settings, family)  # as the engine's were filled
        for f in dataclasses.fields(DecodeSettings):
            if f.name not in PER_REQUEST and getattr(settings, f.name) != getattr(engine, f.name):
                raise SettingsError(refusal(f.name))
        base = settings
    else:
        base = engine
    if sampling is None:
        given: dict = {}
    elif isinstance(sampling, Sampling):
        given = {k: getattr(sampling, k) for k in PER_REQUEST}
    else:
        given = dict(sampling)
    for name in given:
        if name not in PER_REQUEST:
            if name in LIFETIMES:
                raise SettingsError(refusal(name))
            raise SettingsError(
                f"unknown sampling setting {name!r} (per request: {', '.join(PER_REQUEST)})"
            )
    stop = check_stop(given.pop("stop", ()))
    merged = dataclasses.replace(base, **given) if given else base  # validated here
    return Sampling.of(with_family_defaults(merged, family), stop)


def check_stop(stop: object) -> tuple[int, ...]:
    """Stop token ids: a list of non-negative integers."""
    if stop is None:
        return ()
    items = list(stop) if isinstance(stop, list | tuple) else [stop]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in items):
        raise SettingsError(
            f"stop must be a list of token ids (non-negative integers; got {stop!r})"
        )
    return tuple(items)
