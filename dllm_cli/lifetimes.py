"""Settings by lifetime: which may change per request, and which are fixed for an engine's life.

Every setting has one lifetime, declared with its DecodeSettings field (settings.py) and
gathered in `LIFETIMES` (a name -> entry table), so what a request may vary is data that one
function (`request_sampling`) reads, not checks spread over the engine, the API and the server:

| lifetime  | fixed for                          | e.g.                                        |
|-----------|------------------------------------|---------------------------------------------|
| engine    | a loaded model and its engine      | cache, batching, slots, device, quantize    |
| request   | one request (rows sample apart)    | gen_length, temperature, top_p, seed, stops |
| schedule  | an engine (rows walk one schedule) | steps, block_length, unmask, rules' knobs   |
| gemma     | DiffusionGemma's static batch      | t_min, t_max, entropy_bound, ...            |

A request's sampling values are a `Sampling`: validated by building the DecodeSettings they
make with the engine's (DecodeSettings validates in one place: a confidence that is not a
probability is refused beside a threshold rule as on the command line), with the family's unset
defaults applied by `families.with_family_defaults` (Dream's top_k 50), as the engine's own.
`gen_length` is per request: a row's canvas is its prompt + its own gen_length columns, cut
there as suffix pruning cuts it (policies.py: nothing past the row's end is computed or
attended), its blocks and step schedule planned from its own length, so a row beside longer
or shorter ones gets the text it gets alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dllm_cli.errors import SettingsError
from dllm_cli.families import with_family_defaults
from dllm_cli.setting_spec import WHY, Lifetime, declared
from dllm_cli.settings import DecodeSettings


@dataclass(frozen=True)
class Entry:
    """One setting's lifetime, and why it cannot change per request (when it cannot)."""

    lifetime: Lifetime
    why: str = ""


# The DecodeSettings fields' lifetimes are their declarations' (settings.py); the rest are the
# profile's [model] and batch keys, and a request's own stop ids.
LIFETIMES: dict[str, Entry] = {
    **{name: Entry(spec.lifetime, spec.reason) for name, spec in declared(DecodeSettings)},
    "slots": Entry(Lifetime.ENGINE, WHY[Lifetime.ENGINE]),
    "compile": Entry(Lifetime.ENGINE, WHY[Lifetime.ENGINE]),
    "device": Entry(Lifetime.ENGINE, "the model is loaded there"),
    "threads": Entry(Lifetime.ENGINE, "torch's threads are set before the first forward"),
    "quantize": Entry(Lifetime.ENGINE, "the weights are quantized as they load"),
    "stop": Entry(Lifetime.REQUEST),
}

PER_REQUEST = tuple(k for k, e in LIFETIMES.items() if e.lifetime is Lifetime.REQUEST)
# Per-request names that are DecodeSettings fields (stop ids are not: the model's come first).
SAMPLING_FIELDS = tuple(k for k in PER_REQUEST if k != "stop")


@dataclass(frozen=True)
class Sampling:
    """One request's own values: its answer length, temperature, filters, seed, stop ids."""

    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None  # None: the family's default (families.py); 0: no top-k
    seed: int = 0
    confidence: str = "low_confidence"  # which confidence ranks its drafts (sampling.py)
    stop: tuple[int, ...] = ()  # token ids that end this answer besides the model's own
    gen_length: int = 256  # answer positions (its canvas, blocks and schedule are its own)

    @classmethod
    def of(cls, settings: DecodeSettings, stop: tuple[int, ...] = ()) -> Sampling:
        return cls(**{k: getattr(settings, k) for k in SAMPLING_FIELDS}, stop=tuple(stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
