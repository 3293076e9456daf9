"""Packed forwards (decoding/packing.py): rows at different places in one forward give every
row what its own padded forward gives, write the same K/V, and group attention sensibly."""

from __future__ import annotations

import pytest
import torch
from decode_fixtures import MASK, SPECIAL, one_thread, prompts, settings, tiny  # noqa: F401
from test_decode_ragged import run

from dllm_cli.cache import KVCache
from dllm_cli.decoding import packing
from dllm_cli.decoding.canvas import Canvas
from dllm_cli.decoding.forwards import Forwards
from dllm_cli.decoding.packing import attention_groups
from dllm_cli.decoding.policies import ForwardPlan
from dllm_cli.decoding.sampling import Sampler
from dllm_cli.families import family_of_model

GEN = 24


def executor(model, packs: bool) -> Forwards:
    sampler = Sampler(settings(), family_of_model(model), model.vocab_size, MASK)
    f = Forwards(model, sampler, 0.0, greedy_drafts=True, ragged=True)
    f.packs = packs
    return f


def step_plans(c: Canvas, keys: int | None):
    """Row 0 refreshes; rows 1 and 2 recompute windows of different widths (Dream's window
    starts one column early); `keys`: a suffix-pruning limit on row 2."""
    w = c.prompt_width
    lead = [int(p) for p in c.pad]
    plans = [
        ForwardPlan(lead[0], c.width, True, lead=lead[0]),
        ForwardPlan(w - 1, w + 8, False, lead=lead[1]),
        ForwardPlan(w + 3, w + 6, False, keys=keys, lead=lead[2]),
    ]
    spans = [(w, w + 8), (w, w + 8), (w + 4, w + 6)]
    return plans, spans


def filled(model, c: Canvas, slots: int, rows: torch.Tensor | None = None) -> KVCache:
    """A cache with every row's K/V from one refresh (each row from its first real column);
    canvas row r in cache row rows[r]."""
    cache = KVCache.for_model(model, slots, c.width, scratch=True)
    refresh = [ForwardPlan(int(p), c.width, True, lead=int(p)) for p in c.pad]
    seen = cache if rows is None else cache.view(rows)
    executor(model, packs=False)(c, seen, refresh, [(c.prompt_width, c.width)] * c.batch, None)
    return cache


@pytest.mark.parametrize("kind", ["dream", "llada", "llada_moe"])
@pytest.mark.parametrize("keys", [None, 40])
@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("lone", [False, True])  # every row its own SDPA call, or one call
def test_a_packed_forward_gives_every_row_its_padded_forwards_result(
    monkeypatch, kind, keys, view, lone
):
    monkeypatch.setattr(packing, "GROUP_COST", 0 if lone else 10**9)
    model = tiny(kind).model
    c = Canvas.build(prompts([9, 17, 4], seed=3), GEN, MASK, SPECIAL.pad, "cpu")
    c.ids[:, c.prompt_width : c.prompt_width + 4] = torch.tensor([[5, 6, 7, 8]])  # committed
    plans, spans = step_plans(c, keys)
    # view: rows 2, 0, 3 of a four-slot cache (continuous batching with a slot free)
    rows, hosts = (torch.tensor([2, 0, 3]), (2, 0, 3)) if view else (None, None)
    cache = filled(model, c, 4 if view else 3, rows)
    padded_cache, packed_cache = cache.clone(), cache.clone()
    if view:
        padded_cache = padded_cache.view(rows)
        packed_cache = packed_cache.view(rows, hosts=hosts)
    want = executor(model, packs=False)(c, padded_cache, plans, spans, None)
    got = executor(model, packs=True)(c, packed_cache, plans, spans, None)
    assert want.forwards == 2 and got.forwards == 1
    assert torch.equal(got.drafts, want.drafts)
    torch.testing.assert_close(got.confidence, want.confidence, atol=1e-5, rtol=1e-5)
    for a, b in zip(packed_cache.k + packed_cache.v, padded_cache.k + padded_cache.v, strict=True):
        # every real column of every row (the padded path's scratch column holds junk)
        torch.testing.assert_close(a[:, :, : c.width], b[:, :, : c.width], atol=1e-5, rtol=1e-5)


def test_a_packed_step_computes_only_real_columns():
    model = tiny("dream").model
    c = Canvas.build(prompts([9, 17, 4], seed=3), GEN, MASK, SPECIAL.pad, "cpu")
    plans, spans = step_plans(c, None)
    f = executor(model, packs=True)
    f(c, filled(model, c, 3), plans, spans, None)
    real = sum(p.end - (p.lead if p.refresh else p.start) for p in plans)
    assert f.row_columns == real


def test_attention_groups_keep_far_apart_rows_alone_and_share_close_ones():
    wide, narrow = ForwardPlan(0, 900, True, lead=0), ForwardPlan(600, 900, True, lead=600)
    windows = [ForwardPlan(860, 900, False, lead=k) for k in (0, 2, 4)]
    plans = [wide, narrow, *windows]
    widths = [900, 300, 40, 40, 40]
    limits = [900] * 5
    # A lone row reads its keys in place; a shared group gathers them (COPY_COST).
    assert attention_groups(plans, widths, limits, views=True) == [[1], [4], [3], [2], [0]]
    # Without host rows every group gathers: the windows over the same keys share one call,
    # and a prefill still pads nobody.
    assert attention_groups(plans, widths, limits, views=False) == [[1], [2, 3, 4], [0]]


def test_lone_rows_read_their_keys_in_place_and_shared_groups_mask_padding(monkeypatch):
    monkeypatch.setattr(packing, "GROUP_COST", 0)
    model = tiny("dream").model
    c = Canvas.build(prompts([9, 17, 4], seed=3), GEN, MASK, SPECIAL.pad, "cpu")
    plans, spans = step_plans(c, None)
    p = packing.pack(c, None, None, plans, spans, model.logit_shift)
    groups = p.layout.groups
    assert all(isinstance(g.rows, slice) and g.mask is None for g in groups)
    assert sorted((g.lo, g.hi) for g in groups) == sorted((x.lead, c.width) for x in plans)
    monkeypatch.setattr(packing, "GROUP_COST", 10**9)
    (g,) = packing.pack(c, None, None, plans, spans, model.logit_shift).layout.groups
    assert torch.equal(g.rows, torch.arange(3)) and (g.lo, g.hi) == (0, c.width)
    assert torch.equal(g.mask, c.key_mask())  # each row's left padding is off


WINO = {"unmask": "wino", "threshold": 0.5}
KINDS = [("dream", {}), ("llada", {}), ("llada", {"cfg_scale": 0.5}), ("dream", WINO)]


@pytest.mark.parametrize(("kind", "extra"), KINDS)
@pytest.mark.parametrize("cache", ["prefix", "dual", "freecache"])
@pytest.mark.parametrize("lone", [False, True])
def test_continuous_batching_packed_gives_the_padded_tokens(monkeypatch, kind, extra, cache, lone):
    """Guidance packs its prompt-masked branch as more rows (forwards.both_branches), WINO its
    shadows as one more attention group (wino.ShadowForwards)."""
    monkeypatch.setattr(packing, "GROUP_COST", 0 if lone else 10**9)
    model = tiny(kind).model
    s = settings(cache=cache, suffix_window=4 if cache == "dual" else 0, **extra)
    ps = prompts([2, 190, 5, 230, 3, 110, 1, 170], seed=5)  # far apart: padded, several forwards
    out = {}
    for packs in (False, True):
        tokens, engine = run(model, ps, s, slots=3, ragged=True, quantum=8, packs=packs)
        out[packs] = (tokens, engine.forwards, engine.steps)
    assert out[True][0] == out[False][0]
    assert out[True][1] == out[True][2] <= out[False][1]  # one forward a step


@pytest.mark.parametrize(("kind", "extra"), [*KINDS, ("llada", WINO)])
def test_without_a_cache_rows_pack_into_one_forward_over_shared_layer_buffers(kind, extra):
    """--cache none: every row refreshes every step; one packed forward, the padded tokens."""
    model = tiny(kind).model
    s = settings(cache="none", suffix_window=4, **extra)
    ps = prompts([2, 190, 5, 230, 3], seed=6)  # far apart: the padded path groups them
    padded, slow = run(model, ps, s, slots=3, ragged=True, packs=False)
    packed, fast = run(model, ps, s, slots=3, ragged=True)
    assert packed == padded
    assert fast.forwards == fast.steps <= slow.forwards
    buffers = fast.stepper.executor._buffers[1]
    assert all(k is buffers.k[0] for k in buffers.k)  # one layer's memory, not every layer's
