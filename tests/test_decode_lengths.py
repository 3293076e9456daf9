"""Per-request gen_length: rows of different answer lengths share one engine (one canvas, one
KV cache), static or continuous, and each answer is the one its request gets decoded alone."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from decode_fixtures import SPECIAL, one_thread, prompts, settings, tiny  # noqa: F401

from dllm_cli.decoding import Engine, answer_tokens, decode

CACHES = ("none", "prefix", "dual", "freecache")
RULES = (
    {},
    {"unmask": "threshold", "threshold": 0.5},
    {"unmask": "fixed", "steps": 8},
    {"unmask": "credit", "threshold": 0.5},
)


def alone(model, p: list[int], s, gen_length: int) -> list[int]:
    return decode(model, SPECIAL, [p], replace(s, gen_length=gen_length)).tokens[0]


def mixed(model, ps, lengths, s, slots: int, admission: str):
    """Every prompt with its own gen_length through one engine; answers by prompt index."""
    engine = Engine(model, SPECIAL, s, slots=slots, admission=admission, quantum=8)
    for i, (p, g) in enumerate(zip(ps, lengths, strict=True)):
        engine.add(p, key=i, sampling={"gen_length": g})
    out = {}
    while engine.has_work:
        for f in engine.step().finished:
            out[f.key] = f.tokens
    return [out[i] for i in range(len(ps))], engine


@pytest.mark.parametrize("admission", ["static", "continuous"])
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("kind", ["llada", "dream"])
def test_rows_of_different_lengths_decode_as_alone(kind, cache, admission):
    model = tiny(kind).model
    s = settings(cache=cache)  # the engine's own gen_length: 16
    ps = prompts([3, 11, 6, 2, 9], seed=5)
    lengths = [6, 16, 24, 9, 13]  # shorter, equal and longer than the engine's; ragged blocks
    got, engine = mixed(model, ps, lengths, s, slots=3, admission=admission)
    assert [len(t) for t in got] == lengths
    assert got == [alone(model, p, s, g) for p, g in zip(ps, lengths, strict=True)]
    assert engine.served <= 3 * engine.steps


def case(seed: int):
    """A random mix: family, rule, cache, early stop, suffix pruning, prompts, lengths."""
    rng = random.Random(seed)
    kind = rng.choice(("llada", "dream"))
    early = rng.random() < 0.5
    loaded = tiny(kind, seed=seed % 3, eos_from=rng.randrange(6, 24)) if early else tiny(kind)
    extra = dict(rng.choice(RULES))
    if rng.random() < 0.3:
        extra["suffix_window"] = rng.choice((2, 4, 8))
    s = settings(cache=rng.choice(CACHES), early_stop=early, **extra)
    n = rng.randrange(3, 8)
    ps = prompts([rng.randrange(1, 18) for _ in range(n)], seed)
    lengths = [rng.randrange(8, 29) for _ in range(n)]  # fixed steps 8: 2 blocks at least
    return loaded.model, ps, lengths, s, rng.randrange(1, 5)


@pytest.mark.parametrize("seed", range(8))
def test_random_mixes_of_lengths_equal_each_request_alone(seed):
    model, ps, lengths, s, slots = case(seed)
    want = [alone(model, p, s, g) for p, g in zip(ps, lengths, strict=True)]
    for admission in ("static", "continuous"):
        got, _ = mixed(model, ps, lengths, s, slots, admission)
        assert got == want, (admission, s, lengths, slots)


@pytest.mark.parametrize("kind", ["llada", "dream"])
def test_early_stop_stays_lossless_and_suffix_pruning_equals_alone_across_lengths(kind):
    """Early stop ends rows of any length at their first stop token with a full decode's text,
    in fewer forwards; suffix-pruned rows of different lengths are each their pruned alone."""
    model = tiny(kind, eos_from=9).model
    ps = prompts([4, 7, 2, 12], seed=2)
    lengths = [12, 20, 28, 16]
    full, slow = mixed(model, ps, lengths, settings(cache="dual"), 2, "continuous")
    stopped, fast = mixed(
        model, ps, lengths, settings(cache="dual", early_stop=True), 2, "continuous"
    )
    stop = SPECIAL.stop
    assert [answer_tokens(t, stop) for t in stopped] == [answer_tokens(t, stop) for t in full]
    assert fast.forwards < slow.forwards
    s = settings(cache="prefix", suffix_window=4, early_stop=True)
    for admission in ("static", "continuous"):
        pruned, _ = mixed(model, ps, lengths, s, 3, admission)
        assert pruned == [alone(model, p, s, g) for p, g in zip(ps, lengths, strict=True)]


@pytest.mark.parametrize(("kind", "cache"), [("llada", "dual"), ("dream", "freecache")])
def test_guided_rows_of_different_lengths_equal_rows_alone(kind, cache):
    """A frontier walk (the AR guide verifying drafts) over rows of their own lengths."""
    from guided_fixtures import committer
    from test_guided import PAIRS, run_guided

    model, guide = PAIRS["random"](kind)
    ps = prompts([3, 8, 5, 1, 6], seed=6)
    lengths = [10, 24, 17, 30, 6]
    s = settings(gen_length=24, block_length=6, cache=cache, early_stop=True)
    for admission in ("static", "continuous"):
        g = committer(guide, "topk", 5, verify_chunk=4)
        engine = Engine(model, SPECIAL, s, g, slots=3, admission=admission, quantum=4)
        for i, (p, n) in enumerate(zip(ps, lengths, strict=True)):
            engine.add(p, key=i, sampling={"gen_length": n})
        out = {}
        while engine.has_work:
            out.update({f.key: f.tokens for f in engine.step().finished})
        for i, (p, n) in enumerate(zip(ps, lengths, strict=True)):
            one = committer(guide, "topk", 5, verify_chunk=4)
            assert out[i] == run_guided(model, [p], replace(s, gen_length=n), one)[1].tokens[0]
