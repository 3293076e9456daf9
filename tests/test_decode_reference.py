"""The engine against independent, straightforward re-implementations of the reference loops.

Both references follow the published code line by line (LLaDA's `generate`, Dream's
`diffusion_generate` `_sample`), with one deviation shared with the engine: the [MASK] token is
never drafted (its logit is -inf), so no answer can contain a mask.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from decode_fixtures import (  # noqa: F401
    MASK,
    SPECIAL,
    dream_config,
    one_thread,
    peaked,
    prompts,
    randomize,
    settings,
    tiny,
)

from dllm_cli.decoding import decode
from dllm_cli.decoding.run import Decoder
from dllm_cli.decoding.unmask import RuleCommitter
from dllm_cli.models import DreamModel


def reference_logits(model, x: torch.Tensor, mask: int = MASK, vocab: int | None = None):
    """Logits (1, S, V) over the real vocabulary (`vocab`: the tokenizer's size when the
    embedding has padding rows), [MASK] never a draft."""
    logits = model(x)[..., : vocab or model.vocab_size].clone()  # (1, S, V)
    logits[..., mask] = float("-inf")
    return logits


@torch.inference_mode()
def llada_generate(
    model, prompt, gen_length, block_length, steps, shift=False, mask=MASK, vocab=None
):
    """LLaDA's reference loop: blocks, top-k schedule, low-confidence remasking, no cache
    (`shift`: read column i's prediction from column i-1, for a Dream-format model)."""
    MASK = mask  # the mask_id this run uses (the tiny in-memory models: 39)
    p = len(prompt)
    x = torch.full((1, p + gen_length), MASK, dtype=torch.long)
    x[0, :p] = torch.tensor(prompt)
    num_blocks = gen_length // block_length
    steps_per_block = steps // num_blocks
    for b in range(num_blocks):
        start, end = p + b * block_length, p + (b + 1) * block_length
        block_masks = int((x[0, start:end] == MASK).sum())
        base, rem = divmod(block_masks, steps_per_block)
        schedule = [base + (i < rem) for i in range(steps_per_block)]
        for i in range(steps_per_block):
            mask_index = x == MASK
            logits = reference_logits(model, x, MASK, vocab)
            if shift:
                logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
            x0 = logits.argmax(dim=-1)
            probs = torch.softmax(logits.to(torch.float64), dim=-1)
            x0_p = probs.gather(-1, x0[..., None]).squeeze(-1)
            mask_index[:, end:] = False
            confidence = torch.where(
                mask_index, x0_p, torch.tensor(float("-inf"), dtype=x0_p.dtype)
            )
            _, select = torch.topk(confidence[0], k=schedule[i])
            x[0, select] = x0[0, select]
    return x[0, p:].tolist()


def dream_top_k_logits(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Dream's `top_k_logits`: below the k-th largest logit -> the dtype's minimum (not -inf)."""
    top_k = min(top_k, logits.size(-1))
    kth = torch.topk(logits, top_k)[0][..., -1, None]
    return logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)


def global_uniform(mask_index: torch.Tensor) -> torch.Tensor:
    """Dream's `torch.rand(*x0.shape)`: one draw per masked position, from the global RNG."""
    return torch.rand(int(mask_index.sum()))


@torch.inference_mode()
def dream_generate(
    model,
    prompt,
    gen_length,
    steps,
    alg,
    eps=1e-3,
    top_k=None,
    shift=True,
    mask=MASK,
    vocab=None,
    uniform=global_uniform,
):
    """Dream's diffusion_generate `_sample` (batch 1, temperature 0, no attention mask).

    `top_k` is applied as Dream's `sample_tokens` does (after temperature and top_p, both off
    here), so every confidence is computed on the top-k renormalised distribution;
    `shift=False`: column i predicts itself, for a LLaDA-format model. alg "origin" reveals
    each mask with probability 1 - s/t, deciding with `uniform(mask_index)` (one draw per
    masked position, in order; a test may replay another generator's draws through it).
    """
    MASK = mask  # the mask_id this run uses (the tiny in-memory models: 39)
    p = len(prompt)
    x = torch.full((1, p + gen_length), MASK, dtype=torch.long)
    x[0, :p] = torch.tensor(prompt)
    timesteps = torch.linspace(1, eps, steps + 1)
    for i in range(steps):
        mask_index = x == MASK
        logits = reference_logits(model, x, MASK, vocab)
        if shift:
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        mask_logits = logits[mask_index]
        t, s = timesteps[i], timesteps[i + 1]
        if top_k is not None:
            mask_logits = dream_top_k_logits(mask_logits, top_k)
        if alg == "origin":
            p_transfer = 1 - s / t if i < steps - 1 else 1
            x0 = torch.full_like(x[mask_index], MASK)
            transfer = uniform(mask_index) < p_transfer
            x0[transfer] = torch.softmax(mask_logits[transfer], dim=-1).argmax(dim=-1)
            x[mask_index] = x0
            continue
        probs = torch.softmax(mask_logits, dim=-1)
        confidence, x0 = probs.max(dim=-1)
        if alg == "topk_margin":
            top = torch.sort(probs, dim=-1, descending=True).values
            confidence = top[:, 0] - top[:, 1]
        elif alg == "entropy":
            confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
        num_mask_token = mask_index.sum() / mask_index.shape[0]
        n = int(num_mask_token * (1 - s / t)) if i < steps - 1 else int(num_mask_token)
        full_confidence = torch.full_like(x, float("-inf"), dtype=logits.dtype)
        full_confidence[mask_index] = confidence
        if n > 0:
            _, transfer = torch.topk(full_confidence, n)
            x_ = torch.full_like(x, MASK)
            x_[mask_index] = x0
            x[0, transfer[0]] = x_[0, transfer[0]]
    return x[0, p:].tolist()


MODELS = [pytest.param(lambda k: tiny(k, seed=3), id="random"), pytest.param(peaked, id="peaked")]


@pytest.mark.parametrize("make", MODELS)
@pytest.mark.parametrize(
    ("gen", "block", "steps"), [(16, 4, 16), (16, 8, 8), (12, 12, 5), (16, 4, None)]
)
def test_llada_fixed_matches_reference_loop(make, gen, block, steps):
    lm = make("llada")
    for prompt in prompts([5, 9], seed=gen + block):
        got = decode(
            lm.model,
            lm.special,
            [prompt],
            settings(gen_length=gen, block_length=block, steps=steps),
        )
        want = llada_generate(lm.model, prompt, gen, block, steps or gen)
        assert got.tokens[0] == want


DREAM_ALGS = {"maskgit_plus": "low_confidence", "topk_margin": "margin", "entropy": "entropy"}


@pytest.mark.parametrize("make", MODELS)
@pytest.mark.parametrize("alg", list(DREAM_ALGS))
@pytest.mark.parametrize("steps", [16, 7])
def test_dream_fixed_matches_diffusion_generate(make, alg, steps):
    lm = make("dream")
    prompt = prompts([6], seed=steps)[0]
    s = settings(gen_length=16, block_length=16, steps=steps, confidence=DREAM_ALGS[alg])
    got = decode(lm.model, lm.special, [prompt], s)
    assert got.tokens[0] == dream_generate(lm.model, prompt, 16, steps, alg)


@pytest.mark.parametrize("make", MODELS)
@pytest.mark.parametrize(("gen", "block", "steps"), [(16, 4, 16), (16, 8, 8), (12, 12, 5)])
def test_linear_schedule_on_a_dream_model_matches_the_llada_loop(make, gen, block, steps):
    """`--schedule linear`: a Dream-format model decoded with LLaDA's split of each block."""
    lm = make("dream")
    for prompt in prompts([5, 9], seed=gen + block):
        s = settings(gen_length=gen, block_length=block, steps=steps, schedule="linear")
        got = decode(lm.model, lm.special, [prompt], s)
        assert got.tokens[0] == llada_generate(lm.model, prompt, gen, block, steps, shift=True)


@pytest.mark.parametrize("make", MODELS)
@pytest.mark.parametrize("steps", [16, 7])
def test_dream_schedule_on_a_llada_model_matches_diffusion_generate(make, steps):
    """`--schedule dream`: a LLaDA-format model decoded with Dream's timestep schedule."""
    lm = make("llada")
    prompt = prompts([6], seed=steps)[0]
    s = settings(gen_length=16, block_length=16, steps=steps, schedule="dream")
    got = decode(lm.model, lm.special, [prompt], s)
    assert got.tokens[0] == dream_generate(lm.model, prompt, 16, steps, "maskgit_plus", shift=False)


@torch.inference_mode()
def fast_dllm_generate(model, prompt, gen_length, block_length, steps, threshold, shift=False):
    """Fast-dLLM's `generate` with a threshold (no cache): each block runs until it has no
    masks, committing every mask whose confidence is >= tau, at least the best. With `steps`
    below gen_length a step commits at least LLaDA's schedule share k of its block (the
    masks past tau when at least k pass, else the k most confident: LLaDA2.0's rule); at
    steps = gen_length k is 1 and this is Fast-dLLM's loop exactly."""
    p = len(prompt)
    x = torch.full((1, p + gen_length), MASK, dtype=torch.long)
    x[0, :p] = torch.tensor(prompt)
    per_block = steps // (gen_length // block_length)
    for b in range(gen_length // block_length):
        start, end = p + b * block_length, p + (b + 1) * block_length
        base, rem = divmod(block_length, per_block)
        schedule = [base + (i < rem) for i in range(per_block)]
        i = 0
        while (x[0, start:end] == MASK).any():
            logits = reference_logits(model, x)
            if shift:
                logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
            x0 = logits.argmax(dim=-1)
            probs = torch.softmax(logits.to(torch.float64), dim=-1)
            x0_p = probs.gather(-1, x0[..., None]).squeeze(-1)
            mask_index = x == MASK
            mask_index[:, end:] = False
            confidence = torch.where(mask_index, x0_p, float("-inf"))[0]
            k = min(schedule[i], int(mask_index.sum()))
            passing = (confidence >= threshold) & mask_index[0]
            if int(passing.sum()) >= k:
                x[0, passing] = x0[0, passing]
            else:
                select = torch.topk(confidence, k).indices
                x[0, select] = x0[0, select]
            i += 1
    return x[0, p:].tolist()


@pytest.mark.parametrize("make", MODELS)
@pytest.mark.parametrize(("kind", "steps"), [("llada", None), ("llada", 8), ("dream", None)])
@pytest.mark.parametrize("threshold", [0.3, 0.9])
def test_threshold_matches_fast_dllm(make, kind, steps, threshold):
    """`--unmask threshold`: Fast-dLLM's rule at the default steps (one token a step at least),
    and at fewer steps the least a step commits is the schedule's share (the block families'
    rule, one rule for every family)."""
    lm = make(kind)
    for prompt in prompts([5, 9], seed=31):
        s = settings(unmask="threshold", threshold=threshold, steps=steps)
        got = decode(lm.model, lm.special, [prompt], s).tokens[0]
        want = fast_dllm_generate(lm.model, prompt, 16, 4, steps or 16, threshold, kind == "dream")
        assert got == want


@pytest.mark.parametrize("kind", ["llada", "dream"])
@pytest.mark.parametrize("cache", ["none", "dual"])
def test_threshold_above_one_is_fixed_one_token_per_step(kind, cache):
    """tau > 1 is never reached, so only the threshold rule's one-token fallback acts."""
    lm = peaked(kind)
    ps = prompts([4, 7], seed=11)
    threshold = settings(unmask="threshold", cache=cache)
    unchecked = copy.copy(threshold)  # settings refuse tau > 1 when built: set it past the check
    object.__setattr__(unchecked, "threshold", 1.5)
    above_one = RuleCommitter(unchecked, "linear")
    got = decode(lm.model, lm.special, ps, threshold, committer=above_one)
    # LLaDA's fixed schedule with steps = gen_length (Dream's own schedule is not 1 per step).
    fixed = settings(unmask="fixed", cache=cache)
    want = decode(lm.model, lm.special, ps, fixed, committer=RuleCommitter(fixed, "linear"))
    assert got.tokens == want.tokens
    assert got.forwards == want.forwards == 16


def wide_dream(seed: int = 0) -> DreamModel:
    """A tiny random Dream with 256 tokens and flat predictions: top_k = 50 drops real mass."""
    cfg = dream_config()
    cfg.vocab_size = 256
    model = DreamModel(cfg)
    randomize(model, seed, head_scale=0.5)
    return model


@pytest.mark.parametrize("alg", list(DREAM_ALGS))
def test_dream_default_top_k_is_dreams_hidden_50(alg):
    """Unset top_k on a Dream model = Dream's reference with top_k 50; top_k 0 = no filter."""
    model = wide_dream()
    changed = 0
    for steps, prompt in zip([16, 7, 5], prompts([6, 9, 4], seed=21), strict=True):
        s = settings(gen_length=16, block_length=16, steps=steps, confidence=DREAM_ALGS[alg])
        want_50 = dream_generate(model, prompt, 16, steps, alg, top_k=50)
        want_off = dream_generate(model, prompt, 16, steps, alg)
        assert decode(model, SPECIAL, [prompt], s).tokens[0] == want_50
        assert decode(model, SPECIAL, [prompt], replace(s, top_k=50)).tokens[0] == want_50
        assert decode(model, SPECIAL, [prompt], replace(s, top_k=0)).tokens[0] == want_off
        changed += want_50 != want_off
    assert changed  # the filter changes the reveal order, so the test can tell them apart


def test_top_k_family_default_only_for_dream():
    s = settings()
    dream, llada = tiny("dream"), tiny("llada")
    assert Decoder(dream.model, dream.special, s).settings.top_k == 50
    assert Decoder(llada.model, llada.special, s).settings.top_k is None  # LLaDA has none
    off = Decoder(dream.model, dream.special, replace(s, top_k=0))
    assert off.settings.top_k == 0  # explicitly off
