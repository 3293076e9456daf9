"""Guided diffusion: what an AR guide accepts, its cache against a full recompute, batches, stops."""

from __future__ import annotations

import pytest
import torch
from decode_fixtures import EOS, KINDS, MASK, SPECIAL, one_thread, prompts, settings, tiny  # noqa: F401
from guided_fixtures import VOCAB, committer, random_guide, steered

from dllm_cli.decoding import Decision, StepContext, decode, decode_steps
from dllm_cli.decoding.guided import ACCEPT_RULES, GuidedCommitter
from dllm_cli.decoding.unmask import commit_top
from dllm_cli.settings import CACHES

# The unguided decoder at one token per step: LLaDA's fixed schedule with steps = gen_length;
# Dream's fixed schedule commits unevenly, so for it the threshold rule that no token passes.
ONE_PER_STEP = {"llada": {"unmask": "fixed"}, "dream": {"unmask": "threshold", "threshold": 1.0}}


def run_guided(lm, ps, s, guide_committer):
    run = decode_steps(lm.model, lm.special, ps, s, committer=guide_committer)
    events = list(run)
    return events, run.result()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", CACHES)
def test_agreeing_guide_finishes_each_block_in_one_verification(kind, cache):
    lm, ps = tiny(kind), prompts([3, 7, 5])
    g = committer(steered("agree"))
    events, result = run_guided(lm, ps, settings(cache=cache), g)
    assert result.steps == 4 and g.forwards == 4  # 16 tokens, blocks of 4
    assert [e.accepted for e in events] == [12] * 4  # every draft of every row
    assert all(MASK not in row for row in result.tokens)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", CACHES)
def test_disagreeing_guide_equals_unguided_one_token_per_step(kind, cache):
    lm, ps = tiny(kind, seed=3), prompts([3, 7, 5], seed=4)
    s = settings(cache=cache, **ONE_PER_STEP[kind])
    plain = decode(lm.model, lm.special, ps, s)
    events, guided = run_guided(lm, ps, s, committer(steered("never")))
    assert guided.tokens == plain.tokens
    assert guided.steps == plain.steps == 16
    assert all(e.accepted == 0 and e.committed == 3 for e in events)


class FullRecompute:
    """Reference verifier: the guide re-reads each row's whole text every step, no cache."""

    def __init__(self, guide, rule: str, arg):
        self.guide, self.rule, self.arg = guide, rule, arg

    def passes(self, logits: torch.Tensor, token: int) -> bool:
        logits = logits[:VOCAB]
        if self.rule == "exact":
            return bool(logits[token] == logits.max())
        if self.rule == "topk":
            return int((logits > logits[token]).sum()) < self.arg
        return float(logits.softmax(-1)[token]) >= self.arg

    def __call__(self, ctx: StepContext) -> Decision:
        c, b = ctx.canvas, ctx.block
        verified = torch.zeros_like(ctx.candidates)
        for r in range(c.batch):
            row = c.ids[r].clone()
            row[b.start : b.end] = torch.where(
                ctx.candidates[r], ctx.drafts[r], row[b.start : b.end]
            )
            pad = int(c.pad[r])
            logits = self.guide(input_ids=row[None, pad : b.end]).logits[0]  # (T, V)
            ok = True
            for j in range(b.length):
                if ctx.candidates[r, j]:
                    q = b.start + j
                    ok = ok and self.passes(logits[q - 1 - pad], int(row[q]))
                    verified[r, j] = ok
        top = commit_top(ctx, torch.ones_like(ctx.masks_now))
        return Decision((verified | top) & ctx.candidates, accepted=int(verified.sum()))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(("rule", "arg"), [("topk", 10), ("prob", 0.01)])
def test_cached_guide_matches_a_full_recompute(kind, cache, rule, arg):
    """A random Llama guide: cached, batched, padded scoring == re-reading everything."""
    lm = tiny(kind, seed=1, head_scale=6.0, eos_from=14)
    ps = prompts([2, 9, 5], seed=5)
    s = settings(gen_length=20, cache=cache, early_stop=True)
    guide = random_guide(seed=3)
    events, cached = run_guided(lm, ps, s, GuidedCommitter(guide, VOCAB, EOS, rule, arg))
    ref_events, full = run_guided(lm, ps, s, FullRecompute(guide, rule, arg))
    assert cached.tokens == full.tokens
    assert [e.accepted for e in events] == [e.accepted for e in ref_events]
    assert sum(e.accepted for e in events) > 0  # the guide does accept some drafts
    assert any(e.accepted < e.committed for e in events)  # ... and rejects some


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", ["none", "dual", "freecache"])
def test_batch_rows_are_independent(kind, cache):
    """Rows accept different runs (agreement depends on the position), batch == one by one."""
    lm = tiny(kind, seed=2)
    ps = prompts([3, 8, 5, 1], seed=6)
    s = settings(gen_length=24, cache=cache)
    _, batch = run_guided(lm, ps, s, committer(steered("every3")))
    for i, p in enumerate(ps):
        _, alone = run_guided(lm, [p], s, committer(steered("every3")))
        assert batch.tokens[i] == alone.tokens[0]


@pytest.mark.parametrize(
    ("mode", "rule", "arg", "all_accepted"),
    [
        ("second", "exact", None, False),
        ("second", "topk", 1, False),
        ("second", "topk", 2, True),
        ("even", "prob", 0.4, True),
        ("even", "prob", 0.6, False),
        ("agree", "prob", 0.99, True),
    ],
)
def test_acceptance_rules(mode, rule, arg, all_accepted):
    lm, ps = tiny("llada"), prompts([4, 6])
    g = committer(steered(mode), rule, arg)
    events, result = run_guided(lm, ps, settings(), g)
    accepted = sum(e.accepted for e in events)
    assert accepted == (32 if all_accepted else 0)
    assert result.steps == (4 if all_accepted else 16)


def test_rule_ranks_count_ties_as_agreement():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5]])
    target = torch.tensor([2])
    assert ACCEPT_RULES["exact"](logits, target, None).item()  # tied for the maximum
    assert not ACCEPT_RULES["exact"](logits, torch.tensor([0]), None).item()
    assert ACCEPT_RULES["topk"](logits, torch.tensor([0]), 3).item()  # two score higher
    assert not ACCEPT_RULES["topk"](logits, torch.tensor([3]), 3).item()
    p = logits.softmax(-1)[0, 0].item()
    assert ACCEPT_RULES["prob"](logits, torch.tensor([0]), p - 1e-6).item()
    assert not ACCEPT_RULES["prob"](logits, torch.tensor([0]), p + 1e-6).item()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", ["none", "freecache"])
def test_guided_with_early_stop(kind, cache):
    """Rows end at different EOS positions and leave the batch; texts are unchanged."""
    lm = tiny(kind, seed=1, head_scale=6.0, eos_from=12)
    ps = prompts([4, 9, 6], seed=9)
    s = {"gen_length": 24, "cache": cache}
    _, full = run_guided(lm, ps, settings(**s), committer(steered("every3")))
    g = committer(steered("every3"))
    events, early = run_guided(lm, ps, settings(early_stop=True, **s), g)
    assert early.forwards < full.forwards
    assert sorted(r for e in events for r in e.finished) == [0, 1, 2]
    assert len({tuple(e.finished) for e in events if e.finished}) > 1  # not all at once
    for row in range(len(ps)):
        cut = early.answer(row, SPECIAL.stop)
        assert cut == full.answer(row, SPECIAL.stop)
        assert len(cut) < 24
        assert early.tokens[row][len(cut) :] == [EOS] * (24 - len(cut))
    # The same committer decodes again from scratch (it resets on a decode's first step).
    _, again = run_guided(lm, ps, settings(early_stop=True, **s), g)
    assert again.tokens == early.tokens
