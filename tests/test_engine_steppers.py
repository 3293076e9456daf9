"""One Engine for every family: the family table names the stepper; the engine alone admits,
refuses what a stepper shares over its batch (naming the field), and drops a failed step's rows."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from block_checkpoints import write_sdar
from decode_fixtures import prompts, settings, tiny
from gemma_fixtures import encode, gemma_ckpt_fixture, gemma_fixture, gemma_settings  # noqa: F401

from dllm_cli.decoding import Engine, decode, open_engine
from dllm_cli.decoding.stepper import STEPPERS
from dllm_cli.errors import SettingsError
from dllm_cli.families import family_of_model
from dllm_cli.models.loading import load_model
from dllm_cli.settings import DecodeSettings

BLOCK = DecodeSettings(gen_length=12, block_length=4, cache="prefix", unmask="threshold")


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    torch.set_num_threads(1)
    return load_model(write_sdar(tmp_path_factory.mktemp("sdar") / "sdar").folder, device="cpu")


def test_every_family_gets_the_one_engine_with_its_stepper(sdar, gemma):
    cases = [
        (tiny("llada"), settings(), "MaskedStepper"),
        (sdar, BLOCK, "BlockStepper"),
        (gemma, gemma_settings(gen_length=16, steps=3), "GemmaStepper"),
    ]
    for loaded, s, name in cases:
        engine = open_engine(loaded.model, loaded.special, s, slots=2, admission="continuous")
        assert type(engine) is Engine and type(engine.stepper).__name__ == name
        assert STEPPERS[family_of_model(loaded.model).stepper].endswith(f":{name}")
        # DiffusionGemma's stepper declares static batches: the engine admits only those
        assert engine.admission.whole_batches == (name == "GemmaStepper")


def test_what_a_stepper_shares_over_its_batch_is_refused_by_name(gemma):
    engine = open_engine(gemma.model, gemma.special, gemma_settings(gen_length=16), slots=2)
    ids = encode(gemma, "hi")
    assert engine.add(ids, sampling={"seed": 0}) == 0  # the engine's own value is no change
    assert engine.add(ids, sampling={"gen_length": 8}) == 1  # a length is each row's own
    assert engine.add(ids, sampling={"seed": 3}) == 2  # and a seed (one generator a row)
    assert engine.add(ids, sampling={"stop": [5]}) == 3  # and its own stop ids
    assert set(engine.stepper.batch_wide) == {"confidence", "temperature", "top_p", "top_k"}
    with pytest.raises(SettingsError, match=r"^temperature per request: not supported by Diff"):
        engine.add(ids, sampling={"temperature": 0.5})


@pytest.mark.parametrize(
    "extra", [{"cache": "prefix"}, {"cache": "none", "steps": 6, "unmask": "fixed"}]
)
def test_block_rows_of_different_lengths_share_an_engine_each_as_alone(sdar, extra):
    """SDAR rows with their own gen_length (their own blocks and steps per block), static and
    continuous, each equal to its request decoded alone."""
    s = replace(BLOCK, **extra)
    ps, lengths = [[5, 6, 7], [3, 4, 5, 6, 7, 8], [12, 20]], [5, 16, 9]
    want = [
        decode(sdar.model, sdar.special, [p], replace(s, gen_length=g))
        for p, g in zip(ps, lengths, strict=True)
    ]  # tokens and the step (from its first) that committed each: its own schedule
    for admission in ("static", "continuous"):
        engine = open_engine(sdar.model, sdar.special, s, slots=2, admission=admission)
        for i, (p, g) in enumerate(zip(ps, lengths, strict=True)):
            engine.add(p, key=i, sampling={"gen_length": g})
        got = {}
        while engine.has_work:
            got.update({f.key: (f.tokens, f.commit_steps) for f in engine.step().finished})
        assert [got[i] for i in range(3)] == [(w.tokens[0], w.commit_steps[0]) for w in want]
    if s.steps is None:
        return
    with pytest.raises(SettingsError, match="fewer than the number of blocks"):  # 10 blocks
        open_engine(sdar.model, sdar.special, s, slots=2).add(ps[0], sampling={"gen_length": 40})


def test_a_failing_step_drops_its_rows_and_the_queue_goes_on(monkeypatch):
    """An error inside the masked stepper's forward reaches the caller once; the rows of that
    step never answer, a request still waiting decodes as it would alone."""
    model, special = (lm := tiny("llada")).model, lm.special
    s = settings()
    ps = prompts([4, 6, 5], seed=3)
    engine = Engine(model, special, s, slots=2, admission="continuous")
    ids = [engine.add(p) for p in ps]
    forward = type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        engine.step()
    monkeypatch.setattr(type(model), "forward", forward)
    done = {}
    while engine.has_work:
        done.update({f.id: f.tokens for f in engine.step().finished})
    assert list(done) == [ids[2]] and engine.progress(ids[0]) == []
    assert done[ids[2]] == decode(model, special, [ps[2]], s).tokens[0]
