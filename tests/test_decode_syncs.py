"""Cheap steps: an unguided step reads the device at most once, whatever its policy and rule.

Every Python-level way a tensor reaches the host is counted (patched on CPU, where they are
ordinary calls): `.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `.nonzero()` (its size), and
`bool()` / `int()` / `float()` / index use of a tensor. Steps that admit a request, finish
one, cross a block or refresh are all among those counted.
"""

from __future__ import annotations

import pytest
import torch
from decode_fixtures import SPECIAL, one_thread, prompts, settings, tiny  # noqa: F401

from dllm_cli.decoding import Engine
from dllm_cli.settings import CACHES

COUNTED = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__")
RULES = {
    "fixed": {"unmask": "fixed", "steps": 8},
    "threshold": {"unmask": "threshold", "threshold": 0.5},
    "factor": {"unmask": "factor", "factor": 2.0},
    "origin": {"unmask": "origin", "steps": 8},
    "wino": {"unmask": "wino", "threshold": 0.5},
    "sdlm": {"unmask": "sdlm", "threshold": 0.5, "jump_threshold": 0.9},
    "credit": {"unmask": "credit", "threshold": 0.5},
}


def count_reads(monkeypatch) -> list[str]:
    reads: list[str] = []
    for name in (*COUNTED, "__index__"):
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            reads.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


def assert_one_read_per_step(engine, monkeypatch, requests: int) -> None:
    """Step the engine until it is done; no step reads the device more than once."""
    reads = count_reads(monkeypatch)
    per_step, finished = [], 0
    while engine.has_work:
        before = len(reads)
        out = engine.step()
        per_step.append(reads[before:])
        finished += len(out.finished)
    monkeypatch.undo()
    assert finished == requests and len(per_step) >= 3
    assert all(len(r) <= 1 for r in per_step), [r for r in per_step if len(r) > 1][:3]


@pytest.mark.parametrize("admission", ["static", "continuous"])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("kind", ["llada", "dream"])
def test_an_unguided_step_reads_the_device_at_most_once(monkeypatch, kind, cache, rule, admission):
    loaded = tiny(kind, eos_from=6)  # answers end early and apart: rows finish, slots refill
    extra = {"refresh_interval": 3} if cache != "none" else {}
    s = settings(cache=cache, early_stop=True, block_length=4, **RULES[rule], **extra)
    engine = Engine(loaded.model, SPECIAL, s, slots=2, admission=admission, quantum=4)
    for p in prompts([3, 7, 2, 5, 4], seed=2):
        engine.add(p)
    assert_one_read_per_step(engine, monkeypatch, requests=5)


# Per-request sampling beside greedy rows: per-row values, own generators, own stop ids, own
# lengths (shorter and longer than the engine's 16: the canvas grows on the right).
OWN = (
    {"temperature": 1.0, "seed": 1, "stop": [9], "gen_length": 10},
    {},
    {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 2, "confidence": "random"},
    {"confidence": "margin", "gen_length": 24},
    {"temperature": 1.2, "seed": 3, "gen_length": 13},
)


@pytest.mark.parametrize("admission", ["static", "continuous"])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("cache", CACHES)
def test_per_request_sampling_reads_the_device_at_most_once(monkeypatch, cache, rule, admission):
    loaded = tiny("dream", eos_from=6)
    s = settings(cache=cache, early_stop=True, block_length=4, **RULES[rule])
    engine = Engine(loaded.model, SPECIAL, s, slots=3, admission=admission, quantum=4)
    for p, own in zip(prompts([3, 7, 2, 5, 4], seed=2), OWN, strict=True):
        engine.add(p, sampling=own)
    assert_one_read_per_step(engine, monkeypatch, requests=5)


def test_events_and_answers_are_read_only_when_asked(monkeypatch):
    loaded = tiny("llada")
    engine = Engine(loaded.model, SPECIAL, settings(cache="dual"), slots=2)
    engine.add(prompts([4], seed=1)[0])
    reads = count_reads(monkeypatch)
    out = engine.step()
    assert len(reads) == 1
    event = out.event  # built now: its commits are read from the device
    assert len(reads) > 1 and event.commits and out.event is event
    monkeypatch.undo()
