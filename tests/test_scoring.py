"""Likelihood scoring (scoring.py) against the references' estimators re-implemented in
scoring_reference.py, on tiny folders, for the same seed."""

from __future__ import annotations

import math

import pytest
import scoring_reference as ref
import torch
from block_checkpoints import write_llada2, write_sdar

from dllm_cli import scoring
from dllm_cli.errors import InputError
from dllm_cli.models.block import block_key_mask
from dllm_cli.models.loading import load_model

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


def test_diffusion_gemma_is_refused_with_the_reason():
    with pytest.raises(InputError, match="scoring does not apply to DiffusionGemma"):
        scoring.estimator_for("diffusion_gemma")


@pytest.fixture(scope="module", params=["sdar", "llada2"])
def block_model(request, tmp_path_factory):
    write = {"sdar": write_sdar, "llada2": write_llada2}[request.param]
    written = write(tmp_path_factory.mktemp("score") / request.param)
    return load_model(written.folder, dtype="float32", device="cpu")


def block_logp(model, ids: list[int], hide: int | None = None) -> torch.Tensor:
    """(S, V) log-probabilities of one row under the block-causal mask (`hide`: never that id)."""
    keys = block_key_mask(len(ids), model.block_size)[None]
    with torch.inference_mode():
        logits = model(torch.tensor(ids)[None], key_mask=keys)[0].double()
        if hide is not None:
            logits[:, hide] = -math.inf
        return logits.log_softmax(-1)


def test_a_block_models_one_token_continuation_is_scored_exactly(block_model):
    """One continuation token: every draw masks it alone, so the estimate is its log p under
    the block-causal forward, whatever the samples."""
    model, mask = block_model.model, block_model.special.mask
    family = model.family
    want = float(block_logp(model, [*CONTEXT, mask])[len(CONTEXT), CONTINUATION[0]])
    for samples, batch in ((16, 4), (3, 3)):
        got = scoring.estimate(
            model, mask, family, CONTEXT, CONTINUATION[:1], samples=samples, batch=batch
        )
        assert got.total == pytest.approx(want, rel=1e-5, abs=1e-5)


def test_a_block_models_blocks_are_scored_on_what_came_before_them_only(block_model):
    """Block-causal conditioning: a token changed in the last block leaves every earlier
    block's shares as they were and moves the last block's."""
    model, mask = block_model.model, block_model.special.mask
    family, block = model.family, model.block_size
    length = 2 * block + 1 - len(CONTEXT) % block  # the last block holds one token
    continuation = [(7 * i) % 37 + 3 for i in range(length)]
    changed = [*continuation[:-1], continuation[-1] + 1]
    one = scoring.estimate(model, mask, family, CONTEXT, continuation, samples=8, batch=4)
    other = scoring.estimate(model, mask, family, CONTEXT, changed, samples=8, batch=4)
    # (to 1e-6, not bits: LLaDA2.x's experts see other token groups when a token routes anew)
    assert one.shares[:-1] == pytest.approx(other.shares[:-1], rel=1e-6, abs=1e-6)
    assert abs(one.shares[-1] - other.shares[-1]) > 1e-3
    assert sum(one.shares) == pytest.approx(one.total, rel=1e-6, abs=1e-6) and one.total < 0
    rule = scoring.estimator_for(family)
    blocks = -(-(len(CONTEXT) + len(continuation)) // block) - len(CONTEXT) // block
    assert blocks == 3 and scoring.forwards(rule, model, 5, len(continuation), 8, 4) == 1


def test_a_block_models_greedy_flags_follow_its_block_causal_argmax(block_model):
    model, mask = block_model.model, block_model.special.mask
    ids = [*CONTEXT, *CONTINUATION]
    flags, _ = scoring.greedy_flags(model, mask, model.family, ids)
    for j in range(1, len(ids)):
        row = ids[:j] + [mask] * (len(ids) - j)
        assert flags[j - 1] == (int(block_logp(model, row, hide=mask)[j].argmax()) == ids[j])


def test_empty_context_or_continuation_is_refused(llada):
    with pytest.raises(InputError, match="context"):
        scoring.estimate(llada.model, llada.special.mask, "llada", [], [1])
    with pytest.raises(InputError, match="continuation"):
        scoring.estimate(llada.model, llada.special.mask, "llada", [1], [])
