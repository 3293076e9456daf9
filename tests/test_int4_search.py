"""The int4 scale and zero search (models/int4.py `fit_groups`): per group never more squared
error than plain min/max, on ordinary and outlier-heavy weights; shapes and chunking; the
same codes and tokens every time."""

from __future__ import annotations

import copy

import pytest
import torch
from decode_fixtures import one_thread, prompts, settings, tiny  # noqa: F401

from dllm_cli.decoding import decode
from dllm_cli.models import int4
from dllm_cli.models.int4 import quantize_groups
from dllm_cli.models.quantize import quantize_model


def group_errors(w: torch.Tensor, codes: torch.Tensor, pairs: torch.Tensor, group: int):
    """(out, G) squared error of each group's reconstruction (q - 8) * scale + zero, float64."""
    out_features = w.shape[0]
    q = codes.view(out_features, -1, group).double()  # (out, G, group)
    scale, zero = pairs.double().unbind(-1)  # (out, G) each
    rebuilt = (q - 8) * scale[..., None] + zero[..., None]
    return (rebuilt - w.double().view(out_features, -1, group)).square().sum(-1)


def normal(seed: int, shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def heavy(seed: int, shape) -> torch.Tensor:
    """Student-t with 2 degrees of freedom: a few weights per group far out."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) / torch.rand(*shape, generator=g).sqrt().clamp(0.05)


def spiked(seed: int, shape) -> torch.Tensor:
    """Normal weights with one in 64 multiplied by 40 (outlier channels and single spikes)."""
    w = normal(seed, shape)
    spikes = torch.rand(*shape, generator=torch.Generator().manual_seed(seed + 1)) < 1 / 64
    return torch.where(spikes, w * 40, w)


def flat(seed: int, shape) -> torch.Tensor:
    """Groups of one repeated value, or two, beside ordinary ones (degenerate least squares)."""
    w = normal(seed, shape)
    w[: shape[0] // 3] = 0.25
    w[shape[0] // 3 : shape[0] // 2, ::2] = -1.0
    return w


@pytest.mark.parametrize("make", [normal, heavy, spiked, flat])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_search_never_has_more_error_than_min_max(make, group, seed):
    """Per group, in float64: the searched codes, scale and zero reconstruct the weights at
    least as well as min/max's (float32 arithmetic inside: slack of 1e-5 relative)."""
    w = make(seed, (48, 256)) * 0.02
    plain = group_errors(w, *quantize_groups(w, group, search=False), group)
    searched = group_errors(w, *quantize_groups(w, group), group)
    assert (searched <= plain * (1 + 1e-5) + 1e-12).all()
    if make is not flat:  # and it pays: a fifth less error on these weights
        assert searched.sum() < 0.9 * plain.sum()


@pytest.mark.parametrize("shape", [(1, 32), (7, 96), (40, 512), (300, 64)])
def test_round_trip_shapes_and_chunks(shape, monkeypatch):
    """Codes (out, in) uint8 in 0..15 and bfloat16 (out, in / 32, 2) pairs for any shape; rows
    searched a slice at a time give what one slice gives."""
    w = heavy(3, shape)
    codes, pairs = quantize_groups(w, 32)
    assert codes.shape == shape and codes.dtype == torch.uint8 and int(codes.max()) <= 15
    assert pairs.shape == (shape[0], shape[1] // 32, 2) and pairs.dtype == torch.bfloat16
    assert (pairs[..., 0] > 0).all()
    monkeypatch.setattr(int4, "SEARCH_CHUNK", 64)  # one row (or less) per slice
    small_codes, small_pairs = quantize_groups(w, 32)
    assert torch.equal(small_codes, codes) and torch.equal(small_pairs, pairs)


def test_codes_and_tokens_are_the_same_every_time(one_thread):  # noqa: F811
    """Quantizing twice gives the same bytes, and two quantized copies the same tokens."""
    w = spiked(4, (64, 128))
    first, again = quantize_groups(w, 32), quantize_groups(w.clone(), 32)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    lm = tiny("dream", seed=1)
    ps, s = prompts([5, 8], seed=3), settings(cache="none", unmask="fixed")
    tokens = []
    for _ in range(2):
        model = copy.deepcopy(lm.model)  # the fixture's model is shared: quantize a copy
        assert quantize_model(model, "int4") > 0
        tokens.append(decode(model, lm.special, ps, s).tokens)
        assert decode(model, lm.special, ps, s).tokens == tokens[-1]
    assert tokens[0] == tokens[1]
