"""The cache-aware forward: cached windows, left padding and RoPE positions match a full forward."""

from __future__ import annotations

import pytest
import torch

from dllm_cli.cache import KVCache

TOL = 1e-5


def batch(lengths: list[int], vocab: int, seed: int = 0):
    """Left-padded random rows: (ids, positions, key_mask, pads); pads hold junk, not pad ids."""
    gen = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), t), generator=gen)
    pads = torch.tensor([t - n for n in lengths])
    cols = torch.arange(t)[None]
    positions = (cols - pads[:, None]).clamp(min=0)  # padding at 0, as the canvas has it
    key_mask = cols >= pads[:, None]
    return ids, positions, key_mask, pads


def spoil(cache: KVCache, columns: slice) -> None:
    """Overwrite cached K/V with noise, so a forward that fails to rewrite them shows."""
    for k, v in zip(cache.k, cache.v, strict=True):
        k[:, :, columns] = torch.randn_like(k[:, :, columns]) * 10
        v[:, :, columns] = torch.randn_like(v[:, :, columns]) * 10


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


CASES = {"batch1": [24], "padded": [24, 17, 9]}


@pytest.mark.parametrize("lengths", CASES.values(), ids=CASES.keys())
@torch.no_grad()
def test_full_prefix_dual_agree(loaded, lengths):
    model = loaded.model
    ids, pos, mask, _ = batch(lengths, model.vocab_size)
    b, t = ids.shape
    s, e = 12, 18  # a middle block; the suffix [e, t) stays frozen in the cache
    full = model(ids, pos, key_mask=mask)

    cache = KVCache.for_model(model, b, t)
    refreshed = model(ids, pos, cache=cache, key_mask=mask)
    assert max_diff(refreshed, full) < TOL

    prefix = cache.clone()
    spoil(prefix, slice(s, t))
    tail = model(ids[:, s:], pos[:, s:], cache=prefix, key_mask=mask, columns=slice(s, t))
    assert tail.shape == (b, t - s, full.shape[-1])
    assert max_diff(tail, full[:, s:]) < TOL

    dual = cache.clone()
    spoil(dual, slice(s, e))
    block = model(ids[:, s:e], pos[:, s:e], cache=dual, key_mask=mask, columns=slice(s, e))
    assert max_diff(block, full[:, s:e]) < TOL
    for k_ref, k_new in zip(cache.k, dual.k, strict=True):
        assert max_diff(k_new, k_ref) < TOL  # the block's keys were rewritten in place


@torch.no_grad()
def test_logits_slice_keeps_requested_columns(loaded):
    model = loaded.model
    ids, pos, mask, _ = batch([16, 11], model.vocab_size)
    full = model(ids, pos, key_mask=mask)
    part = model(ids, pos, key_mask=mask, logits_slice=slice(4, 10))
    assert max_diff(part, full[:, 4:10]) < TOL


@torch.no_grad()
def test_padded_rows_match_rows_alone(loaded):
    model = loaded.model
    lengths = [20, 13, 6]
    ids, pos, mask, pads = batch(lengths, model.vocab_size, seed=3)
    together = model(ids, pos, key_mask=mask)
    unmasked = model(ids, pos)  # the junk in the pads leaks in without the key mask
    for row, pad in enumerate(pads.tolist()):
        alone = model(ids[row : row + 1, pad:])  # positions 0.. by default
        assert max_diff(together[row, pad:], alone[0]) < TOL
        if pad:
            assert max_diff(unmasked[row, pad:], alone[0]) > 1e-3


@torch.no_grad()
def test_cached_padded_rows_match_rows_alone(loaded):
    model = loaded.model
    lengths = [22, 15]
    ids, pos, mask, pads = batch(lengths, model.vocab_size, seed=4)
    cache = KVCache.for_model(model, 2, ids.shape[1])
    model(ids, pos, cache=cache, key_mask=mask)
    s, e = 16, 20
    block = model(ids[:, s:e], pos[:, s:e], cache=cache, key_mask=mask, columns=slice(s, e))
    for row, pad in enumerate(pads.tolist()):
        alone = model(ids[row : row + 1, pad:])
        assert max_diff(block[row], alone[0, s - pad : e - pad]) < TOL


@torch.no_grad()
def test_window_needs_true_absolute_positions(loaded):
    model = loaded.model
    ids = batch([24], model.vocab_size, seed=5)[0]
    full = model(ids)
    cache = KVCache.for_model(model, 1, 24)
    model(ids, cache=cache)
    s, e = 8, 16
    # Default positions of a window are its columns, i.e. its true absolute positions.
    window = model(ids[:, s:e], cache=cache.clone(), columns=slice(s, e))
    assert max_diff(window, full[:, s:e]) < TOL
    wrong = torch.arange(0, e - s)[None]  # positions restarting at 0 inside the window
    shifted = model(ids[:, s:e], wrong, cache=cache.clone(), columns=slice(s, e))
    assert max_diff(shifted, full[:, s:e]) > 1e-3


@torch.no_grad()
def test_rope_is_relative_across_a_whole_sequence(loaded):
    model = loaded.model
    ids, pos, _, _ = batch([20], model.vocab_size, seed=6)
    base = model(ids, pos)
    moved = model(ids, pos + 37)
    assert max_diff(moved, base) < 1e-4  # same relative offsets: equal up to float error
