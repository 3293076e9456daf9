"""Per-request sampling: a sampled request's text is its own, alone, in a static batch, or
continuous beside other traffic (one generator per request, per-row sampler values)."""

from __future__ import annotations

import dataclasses

import pytest
from decode_fixtures import SPECIAL, one_thread, prompts, settings, tiny  # noqa: F401

from dllm_cli.decoding import Engine, decode
from dllm_cli.errors import SettingsError
from dllm_cli.lifetimes import Sampling, request_sampling
from dllm_cli.settings import DecodeSettings

# One request per row, each with its own sampling (greedy ones beside sampled ones) and
# length (shorter and longer than the engine's).
MIX = (
    {"temperature": 1.0, "seed": 3},
    {},
    {"temperature": 0.7, "top_k": 5, "seed": 11, "confidence": "random", "gen_length": 9},
    {"temperature": 1.3, "top_p": 0.8, "seed": 5, "confidence": "margin", "gen_length": 24},
    {"temperature": 1.0, "seed": 3},  # same values as the first: same generator stream
)
CASES = (
    {"cache": "none"},
    {"cache": "dual", "unmask": "threshold", "threshold": 0.3},  # rows wait in lockstep
    {"cache": "prefix", "unmask": "origin"},  # the rule draws too
    {"cache": "freecache", "confidence": "random", "steps": 8},
)


def alone(model, p, s: DecodeSettings, own: dict) -> list[int]:
    """The request decoded by itself, its sampling values as the run's settings."""
    return decode(model, SPECIAL, [p], dataclasses.replace(s, **own)).tokens[0]


def together(model, ps, s, owns, admission: str, slots: int) -> list[list[int]]:
    engine = Engine(model, SPECIAL, s, slots=slots, admission=admission, quantum=8)
    for i, (p, own) in enumerate(zip(ps, owns, strict=True)):
        engine.add(p, key=i, sampling=own)
    out = {}
    while engine.has_work:
        for f in engine.step().finished:
            out[f.key] = f.tokens
    return [out[i] for i in range(len(ps))]


@pytest.mark.parametrize("kind", ["llada", "dream"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_a_sampled_request_decodes_as_it_does_alone(kind, case):
    model = tiny(kind).model
    s = settings(**CASES[case])
    ps = prompts([5, 9, 3, 12, 7], seed=case)
    want = [alone(model, p, s, own) for p, own in zip(ps, MIX, strict=True)]
    assert together(model, ps, s, MIX, "static", slots=5) == want
    assert together(model, ps, s, MIX, "static", slots=2) == want
    assert together(model, ps, s, MIX, "continuous", slots=2) == want  # arrivals mid-decode
    assert want[0] != want[1] or want[2] != want[1]  # sampling really changed something


def test_the_seed_is_the_requests_own():
    model, s = tiny("llada").model, settings(cache="dual")
    p = prompts([6])[0]
    base = {"temperature": 1.0}
    runs = {
        seed: together(model, [p, p], s, [{**base, "seed": seed}] * 2, "static", 2)
        for seed in (1, 2)
    }
    assert runs[1][0] == runs[1][1] and runs[2][0] == runs[2][1]  # same seed, same text
    assert runs[1][0] != runs[2][0]


def test_own_stop_ids_end_that_request_only():
    model, s = tiny("llada").model, settings()
    ps = prompts([5, 5], seed=1)
    free = together(model, ps, s, [{}, {}], "continuous", 2)
    stop = free[0][3]
    cut = free[0].index(stop)
    got = together(model, ps, s, [{"stop": [stop]}, {}], "continuous", 2)
    assert got[1] == free[1]
    assert got[0][:cut] == free[0][:cut] and set(got[0][cut:]) == {SPECIAL.eos}
    early = settings(early_stop=True)
    got = together(model, ps, early, [{"stop": [stop]}, {}], "continuous", 2)
    assert got[0][:cut] == free[0][:cut] and set(got[0][cut:]) == {SPECIAL.eos}


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"block_length": 8}, "block_length cannot change per request (schedule setting"),
        ({"cache": "dual"}, "cache cannot change per request (engine setting"),
        ({"steps": 8}, "steps cannot change per request (schedule setting"),
        ({"gen_length": 0}, "gen_length must be >= 1"),
        ({"t_min": 0.1}, "t_min cannot change per request (gemma setting"),
        ({"colour": 1}, "unknown sampling setting 'colour'"),
        ({"temperature": -1.0}, "temperature must be 0 (greedy)"),
        ({"stop": ["x"]}, "stop must be a list of token ids"),
        ({"confidence": "entropy"}, "unmask=threshold compares confidences with a probability"),
    ],
)
def test_other_settings_per_request_are_refused_in_one_line(given, named):
    model, s = tiny("llada").model, settings(unmask="threshold")
    engine = Engine(model, SPECIAL, s, slots=2)
    with pytest.raises(SettingsError) as e:
        engine.add([5, 6], sampling=given)
    assert str(e.value).startswith(named) and "\n" not in str(e.value)
    with pytest.raises(SettingsError, match=r"^unmask cannot change per request"):
        engine.add([5, 6], settings=dataclasses.replace(s, unmask="fixed"))
    assert not engine.has_work  # nothing queued


def test_whole_settings_differing_only_in_sampling_are_taken_and_family_defaults_fill():
    s = settings()
    own = request_sampling(s, "dream", dataclasses.replace(s, temperature=0.5, seed=9))
    g = s.gen_length  # the engine's, unless the request brings its own
    assert own == Sampling(0.5, None, 50, 9, gen_length=g)  # Dream's top_k 50 filled as for it
    mixed = request_sampling(s, "llada", sampling={"confidence": "margin", "stop": [3]})
    assert mixed == Sampling(confidence="margin", stop=(3,), gen_length=g)
    assert request_sampling(s, "llada", sampling={"top_k": 0}).top_k == 0
