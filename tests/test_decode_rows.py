"""Per-row progress: rows at different places of their decode, served together."""

from __future__ import annotations

import pytest
import torch
from decode_fixtures import KINDS, MASK, SPECIAL, one_thread, peaked, prompts, settings, tiny  # noqa: F401

from dllm_cli.cache import KVCache
from dllm_cli.decoding import Decoder, decode
from dllm_cli.settings import CACHES

CACHED = ("prefix", "dual", "freecache")


def spread(kind: str, layers: int = 2, scale: float = 4.0):
    """A model sure of EOS from position 8 on: a row with a long prompt finishes each block in
    one step, a row with a short one takes several, so rows drift into different blocks."""
    return tiny(kind, seed=1, head_scale=scale, layers=layers, eos_from=8).model


def apart(model, ps, s):
    """Decode with every row moving on by itself; events and result."""
    run = Decoder(model, SPECIAL, s).run(ps, lockstep=False)
    events = list(run)
    return events, run.result()


def rows_apart(events) -> int:
    """Steps in which the rows were not all in the same block."""
    return sum(len({p.block for p in e.phases}) > 1 for e in events)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(
    ("unmask", "cfg"), [("threshold", 0.0), ("factor", 0.0), ("threshold", 1.5)]
)
def test_rows_apart_equal_rows_alone(kind, cache, unmask, cfg):
    """Each row leaves its block when it is done with it; every row is still its decode alone."""
    model, ps = spread(kind), prompts([3, 9, 5, 1], seed=1)
    s = settings(
        cache=cache, unmask=unmask, threshold=0.5, factor=1.5, cfg_scale=cfg, gen_length=12
    )
    events, batch = apart(model, ps, s)
    assert rows_apart(events) > 0
    assert batch.forwards <= 2 * batch.steps  # at most two forwards a step
    if cache == "dual":  # a row's block-start refresh beside others' cached steps
        assert batch.forwards > batch.steps
    elif cache == "prefix":  # ... which folds into windows that run to the canvas end
        assert batch.forwards >= batch.steps
    else:  # none: every row full every step; freecache: only the first step is full
        assert batch.forwards == batch.steps
    for row, prompt in enumerate(ps):
        assert batch.tokens[row] == decode(model, SPECIAL, [prompt], s).tokens[0], f"row {row}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", CACHED)
def test_refresh_every_step_equals_no_cache_for_rows_apart(kind, cache):
    """Refreshing every step makes each policy recompute everything for every row: exactly no
    cache, whichever blocks the rows are in (the per-row windows and picks are right)."""
    model, ps = spread(kind), prompts([5, 8, 2], seed=1)
    base = {"unmask": "threshold", "threshold": 0.5, "gen_length": 16}
    want_events, want = apart(model, ps, settings(**base))
    _, got = apart(model, ps, settings(cache=cache, refresh_interval=1, **base))
    assert rows_apart(want_events) > 0
    assert got.tokens == want.tokens
    assert got.forwards == want.forwards == want.steps


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", CACHED)
def test_one_layer_models_make_every_policy_exact_for_rows_apart(kind, cache):
    """One layer: a cached column is stale only where its token changed, so every policy
    equals no cache; with rows apart this checks per-row windows, picks and FreeCache's
    per-row frozen part (test_decode_cache.py has the lockstep version)."""
    model, ps = spread(kind, layers=1, scale=1.0), prompts([6, 3, 9], seed=4)
    base = {"unmask": "threshold", "threshold": 0.9, "gen_length": 20}
    _, want = apart(model, ps, settings(**base))
    got_events, got = apart(model, ps, settings(cache=cache, **base))
    assert rows_apart(got_events) > 0
    assert got.tokens == want.tokens


@pytest.mark.parametrize("kind", KINDS)
def test_lockstep_waits_for_the_slowest_row(kind):
    """The default static batch leaves a block together (as today); apart, rows move on."""
    model, ps = peaked(kind).model, prompts([3, 9, 5], seed=2)
    s = settings(unmask="threshold", threshold=0.4, cache="dual")
    together = list(Decoder(model, SPECIAL, s).run(ps))
    assert rows_apart(together) == 0 and all(e.forwards == i + 1 for i, e in enumerate(together))
    events, _ = apart(model, ps, s)
    assert rows_apart(events) > 0


@pytest.mark.parametrize("kind", KINDS)
def test_forward_with_per_row_columns_equals_each_row_alone(kind):
    """The forward's (B, T) columns: each row writes and reads its own window; padding goes
    to the scratch column, which no key mask allows."""
    model = tiny(kind, seed=1).model
    ids = torch.randint(4, MASK, (3, 12))
    pos = torch.arange(12).expand(3, 12)
    windows = [(2, 9), (5, 12), (0, 4)]
    full = KVCache.for_model(model, 3, 12, scratch=True)
    keys = torch.ones(3, 13, dtype=torch.bool)
    keys[:, 12] = False
    model(ids, pos, full, keys, columns=slice(0, 12))  # fill the cache
    width = max(e - s for s, e in windows)
    cols = torch.tensor([[s + j if s + j < e else 12 for j in range(width)] for s, e in windows])
    fresh = torch.randint(4, MASK, (3, 12))
    feed = fresh.gather(1, cols.clamp(max=11))
    got = model(feed, cols.clamp(max=11), full, keys, columns=cols)
    for r, (s, e) in enumerate(windows):
        alone = KVCache.for_model(model, 1, 12)
        model(ids[r : r + 1], pos[r : r + 1], alone, None, columns=slice(0, 12))
        want = model(fresh[r : r + 1, s:e], pos[r : r + 1, s:e], alone, None, columns=slice(s, e))
        torch.testing.assert_close(got[r, : e - s], want[0], rtol=1e-5, atol=1e-5)
        for layer in range(len(alone.k)):
            torch.testing.assert_close(full.k[layer][r, :, :12], alone.k[layer][0])


def test_a_refresh_folds_into_the_windows_only_where_padding_costs_nothing():
    """One forward for a full row and cached rows when it computes no more row-columns than
    two would (wide Prefix windows), two when the windows are narrow (DualCache's block)."""
    from dllm_cli.decoding.forwards import folds
    from dllm_cli.decoding.policies import ForwardPlan

    model = spread("llada")
    full = ForwardPlan(0, 40, refresh=True)
    wide = [full, *[ForwardPlan(8, 40, refresh=False)] * 3]  # windows to the canvas end
    narrow = [full, *[ForwardPlan(8, 12, refresh=False)] * 3]  # one block of 4
    spans = [(8, 12)] * 4
    assert folds(wide, spans, [0], model)
    assert not folds(narrow, spans, [0], model)
