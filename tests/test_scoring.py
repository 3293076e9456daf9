"""Likelihood scoring (scoring.py) against the references' estimators re-implemented in
scoring_reference.py, on tiny folders, for the same seed."""

from __future__ import annotations

import math

import pytest
import scoring_reference as ref
import torch

from dllm_cli import scoring
from dllm_cli.errors import InputError

CONTEXT = [5, 9, 12, 7, 30]
CONTINUATION = [14, 22, 8, 17]


@pytest.mark.parametrize(("samples", "batch", "cfg"), [(32, 8, 0.0), (12, 4, 0.0), (8, 8, 1.5)])
def test_llada_estimate_equals_the_reference(llada, samples, batch, cfg):
    model, mask = llada.model, llada.special.mask
    for seed in (0, 7):
        want = ref.llada_log_likelihood(
            model, CONTEXT, CONTINUATION, samples, batch, cfg, mask, seed
        )
        got = scoring.estimate(
            model, mask, "llada", CONTEXT, CONTINUATION, samples=samples, batch=batch, seed=seed,
            cfg=cfg,
        )  # fmt: skip
        assert got.total == pytest.approx(want, rel=1e-5, abs=1e-5)
        assert sum(got.shares) == pytest.approx(got.total, rel=1e-6, abs=1e-6)
        assert len(got.shares) == len(CONTINUATION)


@pytest.mark.parametrize(("samples", "batch"), [(16, 1), (16, 4)])
def test_dream_estimate_equals_the_reference(dream, samples, batch):
    model, mask, eos = dream.model, dream.special.mask, dream.special.eos
    want = ref.dream_log_likelihood(model, CONTEXT, [*CONTINUATION, eos], samples, batch, mask, 3)
    got = scoring.estimate(
        model, mask, "dream", CONTEXT, CONTINUATION, samples=samples, batch=batch, seed=3, eos=eos
    )
    assert got.total == pytest.approx(want, rel=1e-5, abs=1e-5)


def test_fixed_seed_is_deterministic_and_seeds_differ(llada):
    model, mask = llada.model, llada.special.mask
    one = scoring.estimate(model, mask, "llada", CONTEXT, CONTINUATION, samples=16, seed=1)
    again = scoring.estimate(model, mask, "llada", CONTEXT, CONTINUATION, samples=16, seed=1)
    other = scoring.estimate(model, mask, "llada", CONTEXT, CONTINUATION, samples=16, seed=2)
    assert one == again and one.total != other.total and one.total < 0


def test_greedy_flags_follow_the_argmax(llada):
    model, mask = llada.model, llada.special.mask
    ids = [*CONTEXT, *CONTINUATION]
    flags, logp = scoring.greedy_flags(model, mask, "llada", ids)
    assert len(flags) == len(ids) - 1 and logp.shape[0] == len(ids) - 1
    for j in range(1, len(ids)):
        x = torch.tensor(ids)[None].clone()
        x[0, j:] = mask
        logits = model(x)[0, j].clone()
        logits[mask] = -math.inf
        assert flags[j - 1] == (int(logits.argmax()) == ids[j])


@pytest.mark.parametrize("family", ["sdar", "llada2", "diffusion_gemma"])
def test_block_and_gemma_families_are_refused_with_the_reason(family):
    with pytest.raises(InputError, match="scoring does not apply to"):
        scoring.estimator_for(family)


def test_empty_context_or_continuation_is_refused(llada):
    with pytest.raises(InputError, match="context"):
        scoring.estimate(llada.model, llada.special.mask, "llada", [], [1])
    with pytest.raises(InputError, match="continuation"):
        scoring.estimate(llada.model, llada.special.mask, "llada", [1], [])
