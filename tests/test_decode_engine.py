"""The loop: termination without masks, events, early stop, seeding, the committer seam."""

from __future__ import annotations

import pytest
import torch
from decode_fixtures import EOS, KINDS, MASK, SPECIAL, one_thread, peaked, prompts, settings, tiny  # noqa: F401
from hypothesis import HealthCheck, assume, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from dllm_cli.decoding import Committer, Decision, StepContext, answer_tokens, decode, decode_steps
from dllm_cli.decoding.unmask import UNMASK_RULES
from dllm_cli.errors import SettingsError
from dllm_cli.settings import CACHES, CONFIDENCES, UNMASKS, DecodeSettings


def check_run(lm, ps, s: DecodeSettings) -> None:
    """Run to the end and check every invariant the events and result promise."""
    run = decode_steps(lm.model, lm.special, ps, s)
    events = list(run)
    result = run.result()
    assert result.steps == len(events) == result.forwards
    assert [e.step for e in events] == list(range(len(events)))
    seen: dict[tuple[int, int], tuple[int, int]] = {}
    size = min(s.block_length, s.gen_length)
    for e in events:
        for c in e.commits:
            for pos, tok, conf in zip(c.positions, c.tokens, c.confidences, strict=True):
                assert e.block * size <= pos < (e.block + 1) * size, "committed outside block"
                # a revoking rule (WINO) may commit a position again after masking it
                assert UNMASK_RULES[s.unmask].remasking or (c.row, pos) not in seen, (
                    "committed twice"
                )
                assert tok != MASK and conf == conf  # a real token, confidence not NaN
                seen[(c.row, pos)] = (e.step, tok)
    for row, tokens in enumerate(result.tokens):
        assert len(tokens) == s.gen_length and MASK not in tokens
        for pos, step in enumerate(result.commit_steps[row]):
            if step >= 0:
                assert seen[(row, pos)] == (step, tokens[pos])
            else:  # only the EOS fill after an early stop is uncommitted
                assert s.early_stop and tokens[pos] == EOS
        assert 0 <= result.finished_at[row] <= result.steps


@hyp_settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(KINDS),
    peak=st.booleans(),
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    gen=st.integers(1, 10),
    block=st.integers(1, 12),
    steps=st.none() | st.integers(1, 12),
    cache=st.sampled_from(CACHES),
    unmask=st.sampled_from(UNMASKS),
    confidence=st.sampled_from(CONFIDENCES),
    temperature=st.sampled_from([0.0, 0.8]),
    early_stop=st.booleans(),
    cfg=st.sampled_from([0.0, 1.0]),
    refresh=st.integers(0, 2),
    alg_temp=st.sampled_from([0.0, 0.5]),
)
def test_any_settings_terminate_without_masks(
    kind, peak, lengths, gen, block, steps, cache, unmask, confidence, temperature, early_stop,
    cfg, refresh, alg_temp,
):  # fmt: skip
    try:
        s = DecodeSettings(
            gen_length=gen, block_length=block, steps=steps, cache=cache, unmask=unmask,
            confidence=confidence, temperature=temperature, early_stop=early_stop, cfg_scale=cfg,
            refresh_interval=refresh, threshold=0.6, factor=1.5, alg_temp=alg_temp, top_k=5,
        )  # fmt: skip
    except SettingsError:
        assume(False)
    lm = peaked(kind) if peak else tiny(kind)
    check_run(lm, prompts(lengths, seed=gen), s)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", ["none", "dual", "freecache"])
def test_early_stop_same_text_fewer_forwards(kind, cache):
    """A model sure of EOS from position 12 on: rows stop as soon as their text is final."""
    lm = tiny(kind, seed=1, head_scale=6.0, eos_from=12)
    ps = prompts([4, 7, 5], seed=9)
    s = {"gen_length": 24, "block_length": 4, "cache": cache}
    full = decode(lm.model, lm.special, ps, settings(**s))
    run = decode_steps(lm.model, lm.special, ps, settings(early_stop=True, **s))
    events = list(run)
    early = run.result()
    for row in range(len(ps)):
        cut = early.answer(row, SPECIAL.stop)
        assert cut == full.answer(row, SPECIAL.stop)
        assert early.tokens[row][len(cut) + 1 :] == [EOS] * (23 - len(cut))
    assert early.forwards < full.forwards
    finished = [r for e in events for r in e.finished]
    assert sorted(finished) == [0, 1, 2]
    # Finished rows leave the batch: later steps commit only for rows still decoding.
    for e in events:
        done_before = {r for f in events[: e.step] for r in f.finished}
        assert not done_before & {c.row for c in e.commits}
    check_run(lm, ps, settings(early_stop=True, **s))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("unmask", ["fixed", "origin"])
def test_seeded_sampling_is_reproducible(kind, unmask):
    lm, ps = tiny(kind), prompts([5, 3], seed=2)
    s = settings(temperature=0.9, top_p=0.95, top_k=20, unmask=unmask, cache="dual", seed=7)
    torch.manual_seed(1)
    first = decode(lm.model, lm.special, ps, s)
    torch.manual_seed(2)  # the global RNG plays no part
    assert decode(lm.model, lm.special, ps, s).tokens == first.tokens
    other = decode(lm.model, lm.special, ps, settings(**{**s.to_dict(), "seed": 8}))
    assert other.tokens != first.tokens


def test_sampling_respects_top_k():
    """top_k=1 samples the argmax, so temperature makes no difference."""
    lm, ps = tiny("llada"), prompts([5])
    greedy = decode(lm.model, lm.special, ps, settings())
    assert (
        decode(lm.model, lm.special, ps, settings(temperature=2.0, top_k=1)).tokens == greedy.tokens
    )


class LeftmostFirst(Committer):
    """A verifying-committer stand-in: accepts the leftmost draft, reports 1 accepted."""

    def __call__(self, ctx: StepContext) -> Decision:
        first = ctx.candidates.long().argmax(dim=1, keepdim=True)  # (B, 1)
        commit = torch.zeros_like(ctx.candidates).scatter_(1, first, True) & ctx.candidates
        return Decision(commit, accepted=int(commit.sum()))


class CommitsNothing(Committer):
    def __call__(self, ctx: StepContext) -> Decision:
        return Decision(torch.zeros_like(ctx.candidates))


class CommitsEverything(Committer):
    def __call__(self, ctx: StepContext) -> Decision:
        return Decision(torch.ones_like(ctx.candidates))


@pytest.mark.parametrize("kind", KINDS)
def test_committer_seam(kind):
    lm, ps = tiny(kind), prompts([4, 6])
    run = decode_steps(lm.model, lm.special, ps, settings(cache="dual"), committer=LeftmostFirst())
    events = list(run)
    assert all(e.accepted == 2 for e in events)  # one per row
    for row in (0, 1):
        order = [c.positions for e in events for c in e.commits if c.row == row]
        assert order == [(i,) for i in range(16)]  # strictly left to right
    # A committer that never commits still ends (everything left at a block's L-th step) ...
    stuck = decode(lm.model, lm.special, ps, settings(), committer=CommitsNothing())
    assert stuck.steps == 16 and all(MASK not in t for t in stuck.tokens)
    # ... and one that asks for everything gets only the current block's masks.
    eager = list(decode_steps(lm.model, lm.special, ps, settings(), committer=CommitsEverything()))
    assert [e.committed for e in eager] == [8, 8, 8, 8]


def test_events_describe_the_step():
    lm, ps = peaked("llada"), prompts([3, 5])
    run = decode_steps(
        lm.model, lm.special, ps, settings(unmask="threshold", threshold=0.5, cache="prefix")
    )
    events = list(run)
    result = run.result()
    assert [e.forwards for e in events] == list(range(1, len(events) + 1))
    assert all(e.accepted is None for e in events)
    assert max(e.committed for e in events) > 2  # the peaked model commits in parallel
    assert result.tokens_per_forward == 32 / result.forwards
    assert result.prompt_lengths == [3, 5] and result.seconds > 0
    assert result.answer(0, [result.tokens[0][0]]) == []
    assert answer_tokens([5, 6, 1, 7], [1, 3]) == [5, 6]
