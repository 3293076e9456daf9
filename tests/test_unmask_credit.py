"""Credit decoding (decoding/credit.py): dInfer's threshold rule on credit-fused logits.

Its selection and drafts step for step against a transcription of the public reference
(inclusionAI/dInfer, `CreditThresholdParallelDecoder`), the credits' reset at a block start
and their independence from batch order, and on tiny models what every rule must keep: no
mask in the output, determinism, batch == single (lockstep, rows apart, continuous), every
cache policy, early stop, suffix pruning.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from decode_fixtures import KINDS, MASK, SPECIAL, one_thread, prompts, settings, tiny  # noqa: F401
from rule_properties import assert_rows_decode_alone, assert_stops_prunes_and_batches_continuously

from dllm_cli.decoding import decode
from dllm_cli.decoding.canvas import Block
from dllm_cli.decoding.unmask import RuleCommitter, StepContext
from dllm_cli.errors import SettingsError
from dllm_cli.frontier import parse_frontier, settings_at
from dllm_cli.settings import CACHES, DecodeSettings

CREDIT = {"unmask": "credit", "threshold": 0.5}


class ReferenceCredit:
    """A transcription of dInfer's CreditThresholdParallelDecoder.decode at temperature 0 for
    one block of B rows: `x` (B, L) tokens with `mask` where masked, logits (B, L, V)."""

    def __init__(self, alpha, boost, decay, threshold, mask):
        self.alpha, self.boost, self.decay, self.threshold, self.mask = (
            alpha, boost, decay, threshold, mask,
        )  # fmt: skip
        self.credit = None
        self.calls = 0

    def decode(self, logits, x):
        masked = x == self.mask
        if self.credit is None:
            self.credit = torch.zeros(logits.shape, dtype=torch.float32)
        if self.calls > 0:
            self.credit *= self.decay
        p = torch.softmax(logits.float(), dim=-1)
        top, index = p.max(dim=-1)
        gain = top.pow(self.boost) * masked.float()
        self.credit.scatter_add_(2, index[..., None], gain[..., None])
        fused = logits + self.alpha * torch.log(self.credit + 1)
        self.calls += 1
        # the threshold step (get_transfer_index_threshold, no Gumbel noise at temperature 0)
        x0 = fused.argmax(dim=-1)
        q = torch.softmax(fused.float(), dim=-1)
        conf = q.gather(-1, x0[..., None]).squeeze(-1)
        masked = masked & (x0 != self.mask)
        x0 = torch.where(masked, x0, x)
        conf = torch.where(masked, conf, -float("inf"))
        bar = (conf.max(dim=1).values - 1e-5).clamp(-1000, self.threshold)[:, None]
        transfer = (conf >= bar) & masked
        return torch.where(transfer, x0, x), transfer


def context(probs, candidates, step, rows, start=0, columns=None) -> StepContext:
    """A step of rows in lockstep (block at `start`) or apart (`columns`, per-row `step`)."""
    conf, drafts = probs.max(dim=-1)
    conf = conf.masked_fill(~candidates, float("-inf"))
    batch, width = candidates.shape
    block = None if columns is not None else Block(0, start, start + width, width)
    return StepContext(
        drafts, conf, candidates, block, step, torch.full((batch,), width),
        SimpleNamespace(request_ids=torch.as_tensor(rows)), torch.Generator(), columns=columns,
        probs=probs,
    )  # fmt: skip


def test_selection_and_drafts_equal_the_reference_transcription_step_for_step():
    gen = torch.Generator().manual_seed(0)
    params = [
        (0.7, 0.2, 0.8, 0.9),
        (0.7, 0.2, 0.8, 0.6),
        (1.5, 0.5, 0.9, 0.95),
        (0.3, 1.0, 0.5, 0.8),
    ]
    vocab, mask = 12, 12  # [MASK] outside the real vocabulary, as the sampler excludes it
    changed = 0
    for trial in range(120):
        alpha, boost, decay, tau = params[trial % len(params)]
        batch, width = 1 + trial % 3, int(torch.randint(2, 17, (1,), generator=gen))
        s = DecodeSettings(unmask="credit", threshold=tau, credit_alpha=alpha,
                           credit_boost=boost, credit_decay=decay, block_length=width)  # fmt: skip
        committer = RuleCommitter(s, "linear")
        ref = ReferenceCredit(alpha, boost, decay, tau, mask)
        x = torch.full((batch, width), mask)
        base = torch.randn(batch, width, vocab, generator=gen, dtype=torch.float64) * 3
        for step in range(width):
            if not (x == mask).any():
                break
            noise = torch.randn(batch, width, vocab, generator=gen, dtype=torch.float64)
            logits = base + noise * 1.5  # favourites that mostly hold, sometimes switch
            want, _ = ref.decode(logits, x)
            cand = x == mask
            ctx = context(logits.softmax(dim=-1), cand, step, list(range(batch)))
            decision = committer(ctx)
            got = torch.where(decision.commit & cand, decision.tokens, x)
            assert torch.equal(got, want), (trial, step)
            changed += int((decision.tokens != ctx.drafts)[cand].sum())
            x = got
    assert changed > 0  # credit changed some drafts away from the plain argmax


def test_alpha_zero_is_the_threshold_rule_on_a_model():
    model, ps = tiny("dream", seed=2, head_scale=4.0).model, prompts([3, 8, 5], seed=3)
    s = settings(cache="dual", gen_length=12, **CREDIT, credit_alpha=0.0)
    plain = settings(cache="dual", gen_length=12, unmask="threshold", threshold=0.5)
    assert decode(model, SPECIAL, ps, s).tokens == decode(model, SPECIAL, ps, plain).tokens


def test_credits_reset_at_a_block_start_and_follow_their_row_not_its_slot():
    gen = torch.Generator().manual_seed(1)
    s = DecodeSettings(unmask="credit", threshold=0.9, block_length=6)
    steps = [torch.randn(2, 6, 9, generator=gen).softmax(-1).double() for _ in range(4)]
    cand = torch.ones(2, 6, dtype=torch.bool)
    # rows 7 and 3 together, then swapped in the canvas; each alone, in its own memory
    both = RuleCommitter(s, "linear")
    alone = {key: RuleCommitter(s, "linear") for key in (7, 3)}
    for k, p in enumerate(steps[:3]):
        order = [0, 1] if k % 2 == 0 else [1, 0]
        keys = [[7, 3][i] for i in order]
        got = both(context(p[order], cand, k, keys)).tokens
        for slot, (i, key) in enumerate(zip(order, keys, strict=True)):
            own = alone[key](context(p[i : i + 1], cand[:1], k, [key])).tokens
            assert torch.equal(got[slot], own[0]), (k, key)
    # the next block (step 0, a new start): no credit, as a fresh memory
    fresh = RuleCommitter(s, "linear")(context(steps[3], cand, 0, [7, 3], start=6))
    later = both(context(steps[3], cand, 0, [7, 3], start=6))
    assert torch.equal(later.tokens, fresh.tokens) and torch.equal(later.commit, fresh.commit)
    # rows apart: row 7 in a new block (step 0), row 3 carrying on in its old one (step 3)
    columns = torch.tensor([[6 + j for j in range(6)], list(range(6))])
    steps_now = torch.tensor([0, 3])
    mixed, first = RuleCommitter(s, "linear"), torch.tensor([list(range(6))] * 2)
    for k, p in enumerate(steps[:3]):
        mixed(context(p, cand, k, [7, 3], columns=first))
    got = mixed(context(steps[3], cand, steps_now, [7, 3], columns=columns)).tokens
    want7 = RuleCommitter(s, "linear")(context(steps[3][:1], cand[:1], 0, [7], start=6)).tokens
    cont = alone[3](context(steps[3][1:], cand[:1], 3, [3])).tokens
    assert torch.equal(got[0], want7[0]) and torch.equal(got[1], cont[0])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", CACHES)
def test_credit_every_cache_batch_equals_single_no_mask_deterministic(kind, cache):
    assert_rows_decode_alone(kind, cache, CREDIT)


@pytest.mark.parametrize(
    ("kind", "cache", "window"), list(itertools.product(KINDS, ("dual", "freecache"), (0, 4)))
)
def test_credit_with_early_stop_suffix_pruning_and_continuous_batching(kind, cache, window):
    assert_stops_prunes_and_batches_continuously(kind, cache, window, CREDIT)


def test_sampled_rows_keep_their_draw_and_stay_equal_alone():
    model, ps = tiny("llada", seed=2, head_scale=4.0).model, prompts([3, 8], seed=4)
    s = settings(cache="dual", gen_length=12, temperature=0.8, seed=5, **CREDIT)
    batch = decode(model, SPECIAL, ps, s)
    assert all(MASK not in row for row in batch.tokens)
    for row, prompt in enumerate(ps):
        assert batch.tokens[row] == decode(model, SPECIAL, [prompt], s).tokens[0], row


def test_credit_settings_are_checked():
    for key, value, message in [
        ("credit_alpha", -0.1, "credit_alpha must be >= 0"),
        ("credit_boost", -1.0, "credit_boost must be >= 0"),
        ("credit_decay", 1.5, "credit_decay must be in"),
        ("threshold", 0.0, "threshold must be in"),
        ("confidence", "entropy", "confidence=entropy is not"),
    ]:
        with pytest.raises(SettingsError, match=message):
            DecodeSettings(**{**CREDIT, key: value})


def test_frontier_sweeps_credits_threshold():
    points = parse_frontier("credit=0.97/0.99")
    s = settings_at(DecodeSettings(cache="dual", credit_alpha=1.5), points[2])
    assert (s.unmask, s.threshold, s.credit_alpha) == ("credit", 0.99, 1.5)
