"""Cache policies: exact where they must be, and batch rows independent of their batch."""

from __future__ import annotations

import pytest
from decode_fixtures import KINDS, MASK, one_thread, peaked, prompts, settings, tiny  # noqa: F401

from dllm_cli.decoding import decode, decode_steps

CACHED = ("prefix", "dual", "freecache")
POLICIES = ("none", *CACHED)
MODELS = [pytest.param(lambda k: tiny(k, seed=5), id="random"), pytest.param(peaked, id="peaked")]


@pytest.mark.parametrize("make", MODELS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", CACHED)
@pytest.mark.parametrize("unmask", ["fixed", "threshold"])
def test_refresh_every_step_equals_no_cache(make, kind, cache, unmask):
    lm, ps = make(kind), prompts([5, 8], seed=1)
    want = decode(lm.model, lm.special, ps, settings(unmask=unmask, threshold=0.3))
    got = decode(
        lm.model,
        lm.special,
        ps,
        settings(unmask=unmask, threshold=0.3, cache=cache, refresh_interval=1),
    )
    assert got.tokens == want.tokens
    assert got.forwards == want.forwards


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", CACHED)
@pytest.mark.parametrize("unmask", ["fixed", "threshold"])
def test_one_layer_models_make_every_policy_exact(kind, cache, unmask):
    """With one layer a column's K/V depend only on its own token, so a cache is stale only
    where a token changed since it was written: every policy must then equal no cache. This
    checks the windows (Dream's one-column shift included) and FreeCache's recomputation of a
    finished block from its final tokens."""
    lm, ps = tiny(kind, seed=2, head_scale=4.0, layers=1), prompts([6, 3], seed=4)
    want = decode(lm.model, lm.special, ps, settings(unmask=unmask, threshold=0.5, gen_length=20))
    got = decode(
        lm.model, lm.special, ps, settings(unmask=unmask, threshold=0.5, gen_length=20, cache=cache)
    )
    assert got.tokens == want.tokens


@pytest.mark.parametrize("kind", KINDS)
def test_freecache_equals_prefix_with_one_block(kind):
    """One block: both do one full forward, then feed the block against the frozen prompt."""
    lm, ps = peaked(kind), prompts([5, 7], seed=3)
    one_block = {"gen_length": 12, "block_length": 12, "unmask": "threshold", "threshold": 0.5}
    prefix = decode(lm.model, lm.special, ps, settings(cache="prefix", **one_block))
    free = decode(lm.model, lm.special, ps, settings(cache="freecache", **one_block))
    assert free.tokens == prefix.tokens


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", POLICIES)
@pytest.mark.parametrize("make", MODELS)
def test_batch_rows_equal_rows_alone(kind, cache, make):
    """Left padding is masked and RoPE counts from each row's first token (Fast-dLLM #39/#40)."""
    lm, ps = make(kind), prompts([3, 9, 5, 1], seed=7)
    s = settings(cache=cache, unmask="threshold", threshold=0.4, gen_length=12)
    batch = decode(lm.model, lm.special, ps, s)
    for row, prompt in enumerate(ps):
        assert batch.tokens[row] == decode(lm.model, lm.special, [prompt], s).tokens[0], (
            f"row {row}"
        )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", CACHED)
def test_cfg_composes_with_caches(kind, cache):
    """Guidance runs a prompt-masked branch with its own cache rows; refreshing every step makes
    it exactly the uncached guided decode, which differs from the unguided one."""
    lm, ps = tiny(kind, seed=4), prompts([4, 6], seed=2)
    want = decode(lm.model, lm.special, ps, settings(cfg_scale=1.5))
    got = decode(lm.model, lm.special, ps, settings(cfg_scale=1.5, cache=cache, refresh_interval=1))
    assert got.tokens == want.tokens
    assert want.tokens != decode(lm.model, lm.special, ps, settings()).tokens
    cached = decode(lm.model, lm.special, ps, settings(cfg_scale=1.5, cache=cache))
    assert all(len(t) == 16 and MASK not in t for t in cached.tokens)


@pytest.mark.parametrize("kind", KINDS)
def test_windows_follow_the_policy_table(kind):
    """Event windows (answer positions; negative = prompt) match the active-window table."""
    lm, ps = tiny(kind), prompts([5])
    shift = lm.model.logit_shift
    s = {"gen_length": 8, "block_length": 4}

    def windows(cache: str) -> list[tuple[tuple[int, int], bool]]:
        return [
            (e.window, e.refresh)
            for e in decode_steps(lm.model, lm.special, ps, settings(cache=cache, **s))
        ]

    full = ((-5, 8), True)
    assert windows("none") == [full] * 8
    prefix_steps = [((-shift, 8), False)] * 3 + [full] + [((4 - shift, 8), False)] * 3
    assert windows("prefix") == [full, *prefix_steps]
    dual_steps = [((-shift, 4), False)] * 3 + [full] + [((4 - shift, 8), False)] * 3
    assert windows("dual") == [full, *dual_steps]
    free = list(decode_steps(lm.model, lm.special, ps, settings(cache="freecache", **s)))
    assert [e.window for e in free] == [(-5, 8)] + [(-shift, 8)] * 4 + [(4 - shift, 8)] * 3
    assert [e.frozen for e in free if e.frozen] == [(-5, 0), (0, 4)]
    assert [e.refresh for e in free] == [True] + [False] * 7
