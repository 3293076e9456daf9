"""Decode settings: every bad value is a SettingsError naming the field; how blocks and steps
combine; the selection rules on hand-made confidences; prompt errors."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest
import torch
from decode_fixtures import one_thread, prompts, settings, tiny  # noqa: F401

from dllm_cli.decoding import decode
from dllm_cli.decoding.canvas import Block, plan_blocks
from dllm_cli.decoding.ranking import rank_by_confidence
from dllm_cli.decoding.unmask import RuleCommitter, StepContext, dream_counts, llada_counts
from dllm_cli.errors import InputError, SettingsError
from dllm_cli.settings import DecodeSettings

BAD = [
    ({"gen_length": 0}, "gen_length must be >= 1"),
    ({"gen_length": "64"}, "gen_length must be an integer"),
    ({"gen_length": True}, "gen_length must be an integer"),
    ({"block_length": 0}, "block_length must be >= 1"),
    ({"steps": 0}, "steps must be >= 1"),
    ({"steps": 2.5}, "steps must be an integer or unset"),
    (
        {"steps": 4, "gen_length": 64, "block_length": 8},
        "steps (4) is fewer than the number of blocks (8",
    ),
    ({"cache": "full"}, "cache must be one of none, prefix, dual, freecache"),
    ({"unmask": "greedy"}, "unmask must be one of fixed, threshold, factor, origin"),
    ({"confidence": "max"}, "confidence must be one of"),
    ({"unmask": "threshold", "threshold": 0.0}, "threshold must be in (0, 1]"),
    ({"unmask": "threshold", "threshold": 1.5}, "threshold must be in (0, 1]"),
    ({"unmask": "threshold", "confidence": "entropy"}, "confidence=entropy is not"),
    ({"unmask": "factor", "confidence": "entropy"}, "unmask=factor compares confidences"),
    ({"factor": 0}, "factor must be > 0"),
    ({"factor": float("nan")}, "factor must be finite"),
    ({"temperature": -0.1}, "temperature must be 0 (greedy) or in [1e-06, 1e+06]"),
    ({"temperature": 1e300}, "temperature must be 0 (greedy) or in"),  # drafted only [MASK]
    ({"temperature": 1e-40}, "temperature must be 0 (greedy) or in"),  # overflowed to NaN
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"top_p": 1.2}, "top_p must be in (0, 1]"),
    ({"top_p": "x"}, "top_p must be a number or unset"),
    ({"top_k": -1}, "top_k must be >= 0 (0 turns it off"),
    ({"cfg_scale": -1.0}, "cfg_scale must be in [0, 100]"),
    ({"cfg_scale": 1e300}, "cfg_scale must be in [0, 100]"),  # overflowed to NaN
    ({"refresh_interval": -1}, "refresh_interval must be >= 0"),
    ({"eps": 0.0}, "eps must be in (0, 1)"),
    ({"eps": 1.0}, "eps must be in (0, 1)"),
    ({"alg_temp": -1.0}, "alg_temp must be >= 0"),
    ({"seed": -1}, "seed must be in [0, 2**63)"),
    ({"early_stop": "yes"}, "early_stop must be true or false"),
    ({"threshold": 2.0}, "threshold must be in [0, 1] (got 2.0)"),  # the fixed rule ignores it
    ({"threshold": -0.5, "unmask": "eb"}, "threshold must be in [0, 1] (got -0.5)"),
]


@pytest.mark.parametrize(("kw", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_settings_raise_settings_error(kw, message):
    with pytest.raises(SettingsError) as err:
        DecodeSettings(**kw).validate()
    assert message in str(err.value)


def test_settings_are_valid_by_construction():
    """Checked once, when built (so the decoder never checks again), and never changed after."""
    with pytest.raises(SettingsError, match="cache must be one of"):
        settings(cache="bogus")
    good = settings()
    with pytest.raises(SettingsError, match="threshold must be in"):
        replace(good, unmask="threshold", threshold=1.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        good.cache = "bogus"  # type: ignore[misc]


def test_defaults_and_edge_values_are_valid():
    DecodeSettings().validate()
    DecodeSettings(gen_length=1, block_length=1, steps=1, threshold=1.0, top_p=1.0).validate()
    DecodeSettings(unmask="threshold", confidence="margin").validate()
    DecodeSettings(unmask="origin", confidence="entropy").validate()


def spans(blocks: list[Block]) -> list[tuple[int, int, int]]:
    return [(b.start, b.end, b.steps) for b in blocks]


def test_block_plan_even_split_is_llada():
    assert spans(plan_blocks(10, 64, 16, 32)) == [(10 + 16 * i, 26 + 16 * i, 8) for i in range(4)]


def test_block_plan_adjusts_what_does_not_divide():
    # steps 10 over 4 blocks: 3, 3, 2, 2 (first remainder blocks get one more)
    assert [b.steps for b in plan_blocks(0, 32, 8, 10)] == [3, 3, 2, 2]
    # gen_length 20 in blocks of 8: the last block is shorter; its steps are capped at 4
    assert spans(plan_blocks(0, 20, 8, 20)) == [(0, 8, 7), (8, 16, 7), (16, 20, 4)]
    # block_length beyond gen_length: one block
    assert spans(plan_blocks(3, 6, 32, 6)) == [(3, 9, 6)]
    # more steps than tokens would commit nothing: capped at one token per step
    assert [b.steps for b in plan_blocks(0, 8, 4, 100)] == [4, 4]


def test_adjustments_are_explained():
    assert DecodeSettings(gen_length=256, block_length=32, steps=128).adjustments() == []
    notes = DecodeSettings(gen_length=20, block_length=8, steps=10).adjustments()
    assert notes == [
        "the last block has 4 tokens, not 8",
        "steps 10 over 3 blocks: 4 for the first 1, 3 after",
    ]
    assert DecodeSettings(gen_length=8, block_length=32, steps=9).adjustments() == [
        "block_length 32 > gen_length: one block of 8",
        "8 steps, not 9: no block takes more steps than tokens",
    ]
    short_last = DecodeSettings(gen_length=20, block_length=8, steps=20)
    assert short_last.block_plan() == [(8, 7), (8, 7), (4, 4)]
    assert short_last.adjustments()[-1] == "18 steps, not 20: no block takes more steps than tokens"


def test_uneven_settings_decode_every_position():
    lm = tiny("llada")
    result = decode(
        lm.model, lm.special, prompts([4]), settings(gen_length=10, block_length=4, steps=5)
    )
    assert result.steps == 5 and len(result.tokens[0]) == 10


def context(confidence: list[list[float]], step=0, steps=4, masks=None) -> StepContext:
    conf = torch.tensor(confidence, dtype=torch.float64)
    cand = conf > float("-inf")
    block = Block(0, 0, conf.shape[1], steps)
    start = cand.sum(1) if masks is None else torch.tensor(masks)
    drafts = torch.zeros_like(cand, dtype=torch.long)
    return StepContext(drafts, conf, cand, block, step, start, None, torch.Generator())


def chosen(rule: str, ctx: StepContext, **kw) -> list[list[int]]:
    committer = RuleCommitter(DecodeSettings(unmask=rule, **kw), "linear")
    return committer(ctx).commit.long().tolist()


NEG = float("-inf")


def test_threshold_rule_commits_confident_or_the_best():
    ctx = context([[0.95, 0.2, 0.91, NEG], [0.3, 0.5, 0.1, 0.4]])
    assert chosen("threshold", ctx, threshold=0.9) == [[1, 0, 1, 0], [0, 1, 0, 0]]


def test_factor_rule_takes_the_longest_passing_prefix():
    # (n+1)(1-c_n): 0.02, 0.15, 0.4, 2.5 -> n = 3 for f = 1; a low row still commits one
    ctx = context([[0.5, 0.99, 0.9, 0.95], [0.2, 0.1, 0.3, NEG]])
    assert chosen("factor", ctx, factor=1.0) == [[0, 1, 1, 1], [0, 0, 1, 0]]


def test_ranks_break_ties_leftmost():
    assert rank_by_confidence(torch.tensor([[0.5, 0.7, 0.5, 0.7]])).tolist() == [[2, 0, 3, 1]]


def test_llada_schedule_spreads_the_remainder_first():
    counts = [int(llada_counts(context([[0.1] * 10], step=i), 1e-3)[0]) for i in range(4)]
    assert counts == [3, 3, 2, 2]


def test_dream_schedule_is_linspace_of_timesteps():
    t = torch.linspace(1, 1e-3, 5)
    ctx = context([[0.1] * 10], step=1)
    assert int(dream_counts(ctx, 1e-3)[0]) == int(10 * (1 - t[2] / t[1]))
    assert chosen("fixed", context([[0.1] * 3 + [0.9]], step=3)) == [[1, 1, 1, 1]]  # last step


def test_prompt_errors_are_input_errors():
    lm = tiny("llada")
    with pytest.raises(InputError, match="prompt 1 is empty"):
        decode(lm.model, lm.special, [[5], []], settings())
    with pytest.raises(InputError, match="exceeds the model's context of 512"):
        decode(lm.model, lm.special, [[5] * 500], settings(gen_length=16))
    with pytest.raises(InputError, match="token id 99 outside the vocabulary"):
        decode(lm.model, lm.special, [[5, 99]], settings())
