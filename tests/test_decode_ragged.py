"""Ragged rows: a refresh computes and attends only its row's own columns (continuous
batching), and gives the tokens the padded forward gives, with less arithmetic."""

from __future__ import annotations

import pytest
import torch
from decode_fixtures import SPECIAL, one_thread, prompts, settings, tiny  # noqa: F401

from dllm_cli.cache import KVCache
from dllm_cli.decoding import Engine, packing


def run(model, ps, s, slots: int, ragged: bool, quantum: int = 64, packs: bool | None = None):
    """Every prompt through a continuous engine, its padded forwards kept (`ragged` False);
    `packs` False: ragged rows in grouped padded forwards instead of one packed forward."""
    engine = Engine(model, SPECIAL, s, slots=slots, admission="continuous", quantum=quantum)
    engine.stepper.executor.ragged = ragged
    if packs is not None:
        engine.stepper.executor.packs = packs
    for i, p in enumerate(ps):
        engine.add(p, key=i)
    out = {}
    while engine.has_work:
        for f in engine.step().finished:
            out[f.key] = f.tokens
    return [out[i] for i in range(len(ps))], engine


@pytest.mark.parametrize(
    ("kind", "cache", "extra"),
    [
        ("dream", "dual", {}),
        ("dream", "prefix", {"unmask": "threshold", "threshold": 0.5}),
        ("llada", "freecache", {}),
        ("llada", "dual", {"cfg_scale": 0.5}),
        ("dream", "none", {}),
        ("llada", "dual", {"suffix_window": 4}),
    ],
)
def test_ragged_rows_give_the_padded_rows_tokens_with_less_arithmetic(kind, cache, extra):
    model = tiny(kind).model
    s = settings(cache=cache, **extra)
    ps = prompts([2, 190, 5, 230, 3, 110, 1, 170], seed=4)  # far apart: padding to spare
    padded, slow = run(model, ps, s, slots=3, ragged=False)
    ragged, fast = run(model, ps, s, slots=3, ragged=True)
    assert ragged == padded
    assert fast.stepper.executor.row_columns < slow.stepper.executor.row_columns
    assert fast.stepper.executor.key_columns < slow.stepper.executor.key_columns


def test_a_static_batch_stays_one_padded_forward():
    """Static admission (LLaDA / Fast-dLLM's batch): every refresh of the batch in one forward."""
    model = tiny("dream").model
    s = settings(cache="dual")
    ps = prompts([2, 19, 5, 23], seed=4)
    engine = Engine(model, SPECIAL, s, slots=4, admission="static")
    assert not engine.stepper.executor.ragged
    for p in ps:
        engine.add(p)
    out = engine.step()
    assert out.step == 0 and engine.forwards == 1
    assert engine.stepper.executor.row_columns == 4 * (
        23 + s.gen_length
    )  # padded to the longest prompt


def test_a_cache_view_writes_its_rows_and_reads_from_its_first_key():
    cache = KVCache.empty(1, 3, 1, 6, 2, torch.float32, "cpu")
    view = cache.view(torch.tensor([2, 0]), lo=2)
    fresh = torch.arange(2 * 3 * 2, dtype=torch.float32).view(2, 1, 3, 2)
    k, v = view.update(0, slice(3, 6), fresh, fresh + 100)
    assert v.shape == k.shape
    assert k.shape == (2, 1, 4, 2)  # columns 2..5 of cache rows 2 and 0
    torch.testing.assert_close(cache.k[0][2, :, 3:6], fresh[0])
    torch.testing.assert_close(cache.v[0][0, :, 3:6], fresh[1] + 100)
    assert cache.k[0][1].abs().sum() == 0  # row 1 untouched
    assert cache.view() is cache and cache.whole and not view.whole
    again = view.view(torch.tensor([1]))  # rows of a view are the view's rows
    assert again.row_ids.tolist() == [0]
    one = fresh[:1, :, :1]  # (1, 1, 1, 2)
    k, _ = cache.view(torch.tensor([2]), hi=5).update(0, slice(0, 1), one, one)
    assert k.shape == (1, 1, 5, 2)  # keys [0, 5) only (a block-causal row's end)
    wider = cache.pad(left=1, right=2)  # a longer prompt, then wider block canvases
    assert wider.width == 9 and torch.equal(wider.k[0][:, :, 1:7], cache.k[0])


@pytest.mark.parametrize(
    ("cache", "packed", "extra"),
    [(c, p, {}) for p in (False, True) for c in ("none", "prefix", "dual", "freecache")]
    + [("dual", True, {"unmask": "wino", "threshold": 0.5})],
)
def test_steps_with_rows_apart_still_read_the_device_once(monkeypatch, cache, packed, extra):
    """Padded (`packed` False: two forwards where refreshes sit beside windows) or packed into
    one forward in attention groups (packing.py; WINO's shadows too)."""
    from test_decode_syncs import count_reads

    model = tiny("dream", eos_from=6).model
    refresh = 3 if cache != "none" else 0
    s = settings(cache=cache, early_stop=True, refresh_interval=refresh, **extra)
    engine = Engine(model, SPECIAL, s, slots=3, admission="continuous", quantum=64)
    engine.stepper.executor.packs = packed
    for p in prompts([2, 190, 5, 230, 3], seed=2):
        engine.add(p)
    groups, split = [], packing.attention_groups

    def grouped(plans, *rest):
        groups.append(split(plans, *rest))
        return groups[-1]

    monkeypatch.setattr(packing, "attention_groups", grouped)  # the executor's own lookup
    reads = count_reads(monkeypatch)
    per_step = []
    while engine.has_work:
        before = len(reads)
        engine.step()
        per_step.append(reads[before:])
    monkeypatch.undo()
    assert not packed or max(len(g) for g in groups) >= 2  # attention groups of several rows
    # padded: refreshes in forwards of their own beside windows (none: every row refreshes)
    assert packed or cache == "none" or engine.forwards > engine.steps
    assert all(len(r) <= 1 for r in per_step), [r for r in per_step if len(r) > 1][:3]
