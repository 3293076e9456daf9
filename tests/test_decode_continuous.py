"""Continuous batching: every prompt decodes as it would alone, whatever shares its slots."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from decode_fixtures import SPECIAL, one_thread, prompts, settings, tiny  # noqa: F401

from dllm_cli.decoding import Committer, Engine, Finished, answer_tokens, decode
from dllm_cli.decoding.slots import static_reason
from dllm_cli.errors import InputError

CACHES = ("none", "prefix", "dual", "freecache")
RULES = (
    {},
    {"unmask": "threshold", "threshold": 0.5},
    {"unmask": "factor", "factor": 2.0},
    {"unmask": "fixed", "steps": 8},
    {"unmask": "credit", "threshold": 0.5},
)  # deterministic rules only: origin (and confidence "random") draw from the run's generator


def alone(model, ps, s) -> list[list[int]]:
    return [decode(model, SPECIAL, [p], s).tokens[0] for p in ps]


def stream(model, ps, s, slots: int, quantum: int = 8, each=lambda engine: None):
    """Decode `ps` continuously; answers by prompt index, refusals, and the engine."""
    out: dict[int, Finished] = {}
    refused: dict[int, str] = {}
    engine = Engine(model, SPECIAL, s, slots=slots, admission="continuous", quantum=quantum)
    for i, p in enumerate(ps):
        try:
            engine.add(p, key=i)
        except InputError as e:
            refused[i] = str(e)
    while engine.has_work:
        for f in engine.step().finished:
            assert f.key not in out, "a prompt answered twice"
            out[f.key] = f
            each(engine)
    return out, refused, engine


def case(seed: int):
    """A random mix: model family, prompt lengths, slots, cache policy, rule, early stop."""
    rng = random.Random(seed)
    kind = rng.choice(("llada", "dream"))
    early = rng.random() < 0.5
    # early stop needs answers that end at different places: an EOS-biased model
    loaded = tiny(kind, seed=seed % 3, eos_from=rng.randrange(8, 30)) if early else tiny(kind)
    extra = dict(rng.choice(RULES))
    if rng.random() < 0.25:
        extra["cfg_scale"] = 0.5
    s = settings(cache=rng.choice(CACHES), early_stop=early, **extra)
    lengths = [rng.randrange(1, 21) for _ in range(rng.randrange(3, 9))]
    return loaded.model, prompts(lengths, seed), s, rng.randrange(1, 5)


@pytest.mark.parametrize("seed", range(16))
def test_greedy_answers_equal_decoding_each_prompt_alone(seed):
    model, ps, s, slots = case(seed)
    out, refused, run = stream(model, ps, s, slots)
    assert not refused and sorted(out) == list(range(len(ps)))
    assert [out[i].tokens for i in range(len(ps))] == alone(model, ps, s), (s, slots)
    assert run.forwards <= 2 * run.steps  # a full and a windowed forward at most per step
    assert run.served <= slots * run.steps


@pytest.mark.parametrize("cache", CACHES)
def test_a_finished_slot_takes_the_next_prompt_on_the_next_step(cache):
    loaded = tiny("llada", eos_from=6)
    s = settings(cache=cache, early_stop=True)
    ps = prompts([4, 9, 2, 7, 5], seed=3)
    out, _, run = stream(loaded.model, ps, s, slots=1)
    # one slot: the steps each prompt held it add up to the run's, no step lost between them
    assert sum(f.steps for f in out.values()) == run.steps
    assert run.served == run.steps == run.forwards
    assert [out[i].tokens for i in range(len(ps))] == alone(loaded.model, ps, s)


def test_the_kv_cache_is_allocated_once_for_the_slots():
    loaded = tiny("dream")
    s = settings(cache="dual", cfg_scale=0.5)
    ps = prompts([3, 5, 8, 2, 6, 7, 4, 1, 8, 3, 5, 2], seed=5)  # all within one quantum
    created = []
    out, _, run = stream(
        loaded.model, ps, s, 3, quantum=64, each=lambda e: created.append(id(e.stepper.cache))
    )
    assert len(set(created)) == 1 and len(out) == len(ps)
    k = run.stepper.cache.k[0]
    assert k.shape[0] == 3 * 2  # slots x branches (classifier-free guidance), not prompts
    assert k.shape[2] == 64 + s.gen_length + 1  # prompt width (one quantum), answer, scratch


def test_a_longer_prompt_widens_the_canvas_without_changing_answers():
    loaded = tiny("llada")
    s = settings(cache="freecache")
    ps = prompts([3, 4, 30, 2, 45], seed=2)  # 30 and 45 arrive while short rows decode
    out, _, run = stream(loaded.model, ps, s, slots=2, quantum=8)
    assert run.canvas is not None and run.canvas.prompt_width == 48
    assert [out[i].tokens for i in range(len(ps))] == alone(loaded.model, ps, s)


def test_a_refused_prompt_leaves_the_others_decoding():
    loaded = tiny("llada")
    s = settings(cache="prefix")
    ps = prompts([3, 4, 5], seed=1)
    ps.insert(1, [5, 10_000])  # an id outside the vocabulary
    out, refused, _ = stream(loaded.model, ps, s, slots=2)
    assert list(refused) == [1] and "outside the vocabulary" in refused[1]
    assert [out[i].tokens for i in (0, 2, 3)] == alone(loaded.model, [ps[0], *ps[2:]], s)


def test_sampling_answers_every_prompt_once():
    loaded = tiny("dream")
    s = settings(cache="dual", temperature=1.0, top_k=5, early_stop=True)
    ps = prompts([2, 6, 3, 9, 4], seed=4)
    out, _, _ = stream(loaded.model, ps, s, slots=2)
    assert sorted(out) == list(range(len(ps)))
    assert all(len(f.tokens) == s.gen_length and SPECIAL.mask not in f.tokens for f in out.values())


def test_gemma_decodes_and_committers_without_admit_are_left_to_static_batches():
    loaded = tiny("llada")
    assert static_reason(loaded.model) is None  # (guided too: the guide's cache takes rows)

    class Gemma(torch.nn.Module):
        family = "diffusion_gemma"

    assert "DiffusionGemma" in static_reason(Gemma())

    class Verifier(Committer):
        joins = False  # a committer with one state per batch (no `admit` hook)

        def __call__(self, ctx):
            raise AssertionError("never asked")

    with pytest.raises(InputError, match="continuous batching"):
        Engine(loaded.model, SPECIAL, settings(), Verifier(), slots=2, admission="continuous")
    Engine(loaded.model, SPECIAL, settings(), Verifier(), slots=2, admission="static")


def test_abort_frees_a_slot_and_progress_is_a_growing_prefix():
    """An aborted request (waiting or running) never answers and its slot takes the next
    prompt; the others decode as alone, and `progress` only ever grows toward the answer."""
    loaded = tiny("llada")
    s = settings(cache="dual")
    ps = prompts([4, 9, 2, 7], seed=3)
    engine = Engine(loaded.model, SPECIAL, s, slots=2)
    ids = [engine.add(p, key=i) for i, p in enumerate(ps)]
    assert engine.abort(ids[3]) and engine.waiting == 3  # waiting: gone at once
    engine.step()
    assert engine.running == 2 and engine.waiting == 1
    assert engine.abort(ids[0])  # running: leaves its slot on the next step
    assert not engine.abort(ids[0]) and not engine.abort(99)
    out, seen = {}, []
    while engine.has_work:
        step = engine.step()
        assert ids[0] not in [r.id for r in engine.live]
        seen.append(engine.progress(ids[1]))
        out.update({f.key: f.tokens for f in step.finished})
    assert sorted(out) == [1, 2]
    assert [out[1], out[2]] == alone(loaded.model, [ps[1], ps[2]], s)
    final = answer_tokens(out[1], SPECIAL.stop)
    grown = [p for p in seen if p]
    assert grown and all(a == b[: len(a)] for a, b in itertools.pairwise(grown))
    assert all(p == final[: len(p)] for p in grown)
