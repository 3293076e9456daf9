"""What the settings' declarations generate, tried end to end: every range is refused where a
user meets it (a CLI flag: exit 2; a server request: 400 naming the field), every served field
reaches the job and, per request, the engine's Sampling; every other lifetime is refused per
request; every decoder kind refuses what its declaration says, and only that.
"""

from __future__ import annotations

import dataclasses

import pytest
from cli_fixtures import error_lines, invoke
from setting_values import VALUES

from dllm_cli.errors import SettingsError
from dllm_cli.families import FAMILIES
from dllm_cli.family_settings import check_refused
from dllm_cli.lifetimes import PER_REQUEST, Lifetime, refusal, request_sampling
from dllm_cli.options import FLAGS
from dllm_cli.serve import engines, protocol
from dllm_cli.setting_spec import KINDS, Range, declared, kinds_of
from dllm_cli.settings import DecodeSettings

TYPES = kinds_of(DecodeSettings)
SPECS = dict(declared(DecodeSettings))
FAMILY_OF_KIND = {kind: next(f for f in FAMILIES.values() if f.stepper == kind) for kind in KINDS}


def outside(limits: Range, kind: type) -> list:
    """Values just outside the range: below its floor, above its ceiling."""
    values = []
    if limits.low is not None:
        values.append(limits.low if limits.open_low else limits.low - 1)
    if limits.high is not None:
        values.append(limits.high if limits.open_high else limits.high + 1)
    return [kind(v) for v in values]


def range_cases() -> list[tuple[str, str, object, str]]:
    """(setting, unmask rule or "", a value outside its range there, the message's start)."""
    cases = []
    for name, spec in SPECS.items():
        kind = TYPES[name][0]
        if spec.range is not None:
            value = outside(spec.range, kind)[0]
            cases.append((name, "", value, f"{name} must be {spec.range}"))
        for rule, limits in spec.ranges.items():  # a value only the rule's range refuses
            value = next(v for v in outside(limits, kind) if spec.range.holds(v))
            cases.append((name, rule, value, f"{name} must be {limits} under unmask={rule}"))
    return cases


RANGES = range_cases()
FLAGGED = [c for c in RANGES if c[0] in FLAGS]


def test_every_number_declares_a_range_and_every_rule_range_is_tried():
    numbers = {n for n, (kind, _) in TYPES.items() if kind in (int, float)}
    assert numbers == {n for n, s in SPECS.items() if s.range is not None}
    assert any(rule == "klass" and name == "threshold" for name, rule, _, _ in RANGES)


@pytest.mark.parametrize(("name", "rule", "value", "message"), FLAGGED, ids=lambda x: str(x))
def test_a_flag_out_of_range_exits_2_naming_the_setting(name, rule, value, message):
    args = ["--" + name.replace("_", "-"), str(value), "--unmask", rule or "fixed"]
    result = invoke("generate", "-p", "tiny-gsm", *args, "hi")
    assert result.exit_code == 2, result.output
    [line] = error_lines(result)
    assert line.startswith(f"dllm: error: {message} (") and f"got {value})" in line, line


def served(extra: dict, base: DecodeSettings | None = None) -> protocol.Job:
    body = {"prompt": "hi", **extra}
    return protocol.parse(body, "completion", base or DecodeSettings(), "m", guided=False)


@pytest.mark.parametrize(("name", "rule", "value", "message"), RANGES, ids=lambda x: str(x))
def test_a_request_out_of_range_is_a_400_naming_the_setting(name, rule, value, message):
    with pytest.raises(protocol.ApiError) as caught:
        served({name: value, **({"unmask": rule} if rule else {})})
    assert caught.value.status == 400 and caught.value.param == name
    assert caught.value.message.startswith(message), caught.value.message


@pytest.mark.parametrize("name", list(VALUES))
def test_every_served_setting_reaches_the_job_and_per_request_ones_the_engine(name):
    if not SPECS[name].served:
        with pytest.raises(protocol.ApiError, match=f"unknown field '{name}'"):
            served({name: VALUES[name]})
        return
    job = served({name: VALUES[name]})
    assert getattr(job.settings, name) == VALUES[name]
    group = engines.group_of(job).settings
    if name in PER_REQUEST:  # the engine is shared; the request's row samples with its own
        assert getattr(group, name) == getattr(DecodeSettings(), name)
        sampling = request_sampling(group, None, settings=job.settings)
        assert getattr(sampling, name) == VALUES[name]
    else:  # part of the engine the request decodes on
        assert getattr(group, name) == VALUES[name]


@pytest.mark.parametrize("name", list(VALUES))
def test_only_request_settings_may_change_per_request(name):
    engine = DecodeSettings()
    if SPECS[name].lifetime is Lifetime.REQUEST:
        sampling = request_sampling(engine, None, sampling={name: VALUES[name]})
        assert getattr(sampling, name) == VALUES[name]
        return
    with pytest.raises(SettingsError) as caught:
        request_sampling(engine, None, sampling={name: VALUES[name]})
    assert str(caught.value) == refusal(name)
    assert f"({SPECS[name].lifetime.value} setting: {SPECS[name].reason})" in str(caught.value)


@pytest.mark.parametrize("kind", KINDS)
def test_each_decoder_refuses_exactly_what_the_declarations_say(kind):
    family = FAMILY_OF_KIND[kind]
    for name, value in VALUES.items():
        s = dataclasses.replace(DecodeSettings(), **{name: value})
        why = SPECS[name].refused.get(kind)
        values, only = family.only.get(name, ((value,), None))  # some values only (block)
        if why is None and value in values:
            check_refused(family, s)
            continue
        with pytest.raises(SettingsError) as caught:
            check_refused(family, s)
        assert str(caught.value).startswith(f"{name} {value!r} does not apply to {family.title}")
        assert (why or only) in str(caught.value)
