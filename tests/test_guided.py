"""Guided diffusion (FlashDLM): the frontier walk, chunked verification, the guide's cache."""

from __future__ import annotations

import copy

import pytest
import torch
from decode_fixtures import EOS, KINDS, MASK, SPECIAL, one_thread, prompts, settings, tiny  # noqa: F401
from guided_fixtures import (
    committer,
    other,
    pointed,
    pointed_guide,
    random_guide,
    target,
)
from transformers import LlamaForCausalLM

from dllm_cli.decoding import Engine, decode, decode_steps
from dllm_cli.decoding.guided import ACCEPT_RULES
from dllm_cli.settings import CACHES


def run_guided(model, ps, s, guided):
    run = decode_steps(model, SPECIAL, ps, s, committer=guided)
    events = list(run)
    return events, run.result()


def guide_greedy(guide, prompt: list[int], n: int) -> list[int]:
    """The guide's own greedy decode (transformers `generate`), cut before its first stop."""
    out = guide.generate(
        input_ids=torch.tensor([prompt]),
        max_new_tokens=n,
        do_sample=False,
        suppress_tokens=[MASK],  # the guided decoder never commits [MASK]
        eos_token_id=list(SPECIAL.stop),
        pad_token_id=EOS,
    )
    tokens = out[0, len(prompt) :].tolist()
    return next((tokens[:i] for i, t in enumerate(tokens) if t in SPECIAL.stop), tokens)


PAIRS = {
    # a random diffusion model and a random guide: they rarely agree (corrections)
    "random": lambda kind: (tiny(kind, seed=1, head_scale=6.0).model, random_guide(seed=3)),
    # the guide accepts two drafts in three (accepted runs, corrections, several chunks)
    "agreeing": lambda kind: (pointed(kind), pointed_guide("every3")),
}


WINDOWS = [("none", None), ("prefix", 5), ("dual", None), ("dual", 5), ("freecache", None)]


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("cache", "window"), [*WINDOWS, ("freecache", 5)])
def test_exact_rule_reproduces_the_guides_greedy_decode(pair, kind, cache, window):
    model, guide = PAIRS[pair](kind)
    ps = prompts([2, 9, 5], seed=5)
    s = settings(gen_length=18, block_length=8, cache=cache)
    events, result = run_guided(model, ps, s, committer(guide, verify_chunk=3, draft_window=window))
    for row, prompt in enumerate(ps):
        assert result.answer(row, SPECIAL.stop) == guide_greedy(guide, prompt, 18), f"row {row}"
    if pair == "agreeing":
        assert sum(e.accepted for e in events) > sum(e.corrected for e in events) > 0
        assert result.steps <= 9  # two drafts and a correction per verification


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", CACHES)
def test_agreeing_guide_commits_whole_chunks(kind, cache):
    """Every draft to the canvas end passes: one diffusion step, ceil(16 / 5) guide forwards."""
    ps = prompts([3, 7, 5])
    g = committer(pointed_guide("agree"), verify_chunk=5)
    events, result = run_guided(pointed(kind), ps, settings(cache=cache), g)
    assert result.steps == result.forwards == 1
    assert result.guide_forwards == g.forwards == 4  # chunks of 5, 5, 5, 1 for all rows at once
    assert [e.accepted for e in events] == [16 * 3] and [e.corrected for e in events] == [0]
    assert result.tokens == [target(torch.arange(n, n + 16)).tolist() for n in (3, 7, 5)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", CACHES)
def test_draft_window_and_dual_cache_reach(kind, cache):
    """Drafts reach the window's end; on Dual cache's cached steps, only the block's end."""
    g = committer(pointed_guide("agree"), verify_chunk=4, draft_window=6)
    events, result = run_guided(
        pointed(kind), prompts([4]), settings(block_length=8, cache=cache), g
    )
    per_step = [e.committed for e in events]
    assert per_step == ([6, 2, 6, 2] if cache == "dual" else [6, 6, 4])
    assert result.guide_forwards == sum(-(-n // 4) for n in per_step)  # chunks of at most 4
    # Prefix and FreeCache windows stop at the draft window's end (nothing later is predicted).
    frontiers = [sum(per_step[:i]) for i in range(len(events))]
    cached = [(e.window[1], min(f + 6, 16)) for e, f in zip(events, frontiers, strict=True)]
    if cache in ("prefix", "freecache"):
        assert all(
            end == want for (end, want), e in zip(cached, events, strict=True) if not e.refresh
        )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("on_reject", ["draft", "guide"])
def test_disagreeing_guide_commits_one_token_per_step_at_the_first_mask(kind, cache, on_reject):
    ps = prompts([3, 7, 5], seed=4)
    g = committer(pointed_guide("never"), on_reject=on_reject)
    events, result = run_guided(pointed(kind), ps, settings(cache=cache), g)
    assert result.steps == 16
    for step, e in enumerate(events):
        assert e.accepted == 0 and [c.positions for c in e.commits] == [(step,)] * 3
        assert e.corrected == (3 if on_reject == "guide" else 0)
    chosen = target if on_reject == "draft" else other  # the draft, or the guide's own token
    assert result.tokens == [chosen(torch.arange(n, n + 16)).tolist() for n in (3, 7, 5)]


def test_drafts_are_argmax_whatever_the_temperature():
    """Under `draft` the diffusion model's drafts are committed: sampling would change them."""
    model, ps = tiny("llada", seed=2).model, prompts([4, 6], seed=1)

    def guided(t: float) -> list[list[int]]:
        g = committer(pointed_guide("never"), on_reject="draft")
        return decode(model, SPECIAL, ps, settings(temperature=t, seed=3), committer=g).tokens

    assert guided(2.0) == guided(0.0)
    unguided = [decode(model, SPECIAL, ps, settings(temperature=t, seed=3)) for t in (0.0, 2.0)]
    assert unguided[0].tokens != unguided[1].tokens  # this model does sample at 2.0


def cached_logits(g, row: int, token: int, position: int) -> torch.Tensor:
    """The guide's next-token logits for `token` fed on top of row `row`'s cache (a copy)."""
    kv = copy.deepcopy(g.cache.kv)
    valid = g.cache.valid
    row = g.cache.rows[row]  # the canvas row's cache row
    kv.batch_select_indices(torch.tensor([row]))
    mask = torch.cat([valid[row : row + 1], torch.ones((1, 1), dtype=torch.bool)], dim=1)
    out = g.guide(
        input_ids=torch.tensor([[token]]),
        attention_mask=mask.long(),
        position_ids=torch.tensor([[position]]),
        use_cache=True,
        **{g.cache.keyword: kv},
    )
    return out.logits[0, -1]


@pytest.mark.parametrize("pair", [*PAIRS, "ending"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", ["none", "freecache"])
def test_guide_cache_holds_exactly_the_committed_prefix(pair, kind, cache):
    """After every step each row's cache is its committed tokens but the last, as a fresh
    forward over the committed prefix computes them (padding, holes, repacking, rows leaving)."""
    if pair == "ending":  # rows end (EOS at position 14) at different steps
        model, guide = pointed(kind), pointed_guide("every3", eos_at=14)
    else:
        model, guide = PAIRS[pair](kind)
    ps = prompts([2, 9, 5], seed=8)
    g = committer(guide, verify_chunk=3)
    run = decode_steps(model, SPECIAL, ps, settings(gen_length=20, cache=cache), committer=g)
    checked = 0
    for _ in run:
        c = run.canvas
        for r in range(c.batch):
            row = c.ids[r, int(c.pad[r]) :].tolist()
            prefix = row[: row.index(MASK)] if MASK in row else row
            assert int(g.cache.cached[r]) == len(prefix) - 1
            fresh = guide(input_ids=torch.tensor([prefix])).logits[0, -1]
            cached = cached_logits(g, r, prefix[-1], len(prefix) - 1)
            torch.testing.assert_close(cached, fresh, rtol=1e-9, atol=1e-9)
            checked += 1
    assert checked > 5


BATCH_CASES = [("agreeing", "exact", None, cache) for cache in CACHES] + [
    ("random", rule, arg, cache)
    for rule, arg in (("topk", 5), ("prob", 0.05))
    for cache in ("dual", "freecache")
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("pair", "rule", "arg", "cache"), BATCH_CASES)
def test_batch_rows_equal_rows_alone(kind, pair, rule, arg, cache):
    """Rows verify different runs, so their frontiers sit in different blocks; each row's
    output is still exactly its output alone."""
    model, guide = PAIRS[pair](kind)
    ps = prompts([3, 8, 5, 1], seed=6)
    s = settings(gen_length=24, block_length=6, cache=cache)
    events, batch = run_guided(model, ps, s, committer(guide, rule, arg, verify_chunk=4))
    assert any(len({p.block for p in e.phases}) > 1 for e in events)  # rows in different blocks
    assert sum(e.accepted for e in events) > 0
    for i, p in enumerate(ps):
        _, alone = run_guided(model, [p], s, committer(guide, rule, arg, verify_chunk=4))
        assert batch.tokens[i] == alone.tokens[0], f"row {i}"


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
    g = committer(pointed_guide(mode), rule, arg)
    events, result = run_guided(pointed("llada"), prompts([4, 6]), settings(), g)
    assert sum(e.accepted for e in events) == (32 if all_accepted else 0)
    assert result.steps == (1 if all_accepted else 16)


def test_rules_rank_the_draft():
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.5]])
    assert ACCEPT_RULES["exact"](scores, torch.tensor([1]), None).item()  # argmax (first max)
    assert not ACCEPT_RULES["exact"](scores, torch.tensor([0]), None).item()
    assert ACCEPT_RULES["topk"](scores, torch.tensor([0]), 3).item()  # two score higher
    assert not ACCEPT_RULES["topk"](scores, torch.tensor([3]), 3).item()
    p = scores.softmax(-1)[0, 0].item()
    assert ACCEPT_RULES["prob"](scores, torch.tensor([0]), p - 1e-6).item()
    assert not ACCEPT_RULES["prob"](scores, torch.tensor([0]), p + 1e-6).item()


def test_mask_and_padding_ids_are_never_committed():
    """A guide (48 ids) that prefers [MASK] and an id past the 40-id vocabulary above all still
    commits only real ids: its best among the ids the diffusion model may commit."""
    guide = pointed_guide("never", vocab=48, loves=(MASK, 45))
    model = tiny("llada", seed=3).model
    result = decode(model, SPECIAL, prompts([5]), settings(), committer=committer(guide))
    assert result.tokens[0] == other(torch.arange(5, 21)).tolist()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", ["none", "dual", "freecache"])
def test_a_committed_stop_token_ends_the_row(kind, cache):
    """The guide wants EOS at position 12: rows end there, at different answer positions and
    steps, and the rows still decoding go on with their own guide cache rows."""
    ps = prompts([3, 7, 5], seed=9)
    g = committer(pointed_guide("every3", eos_at=12), verify_chunk=4)
    events, result = run_guided(pointed(kind), ps, settings(gen_length=24, cache=cache), g)
    for row, n in enumerate((3, 7, 5)):
        end = 12 - n  # answer position of the EOS
        want = [int(target(p)) if p % 3 else int(other(p)) for p in torch.arange(n, 12)]
        assert result.tokens[row][:end] == want
        assert result.tokens[row][end:] == [EOS] * (24 - end)
        assert result.commit_steps[row][end + 1 :] == [-1] * (23 - end)
    assert sorted(r for e in events for r in e.finished) == [0, 1, 2]
    assert len({e.step for e in events if e.finished}) > 1  # not all in the same step
    assert all(p <= 12 for e in events for c in e.commits for p in c.positions)


def test_committer_is_told_when_a_decode_starts():
    model, ps = tiny("dream", seed=1, head_scale=6.0).model, prompts([4, 9, 6], seed=9)
    g = committer(random_guide(seed=1), verify_chunk=2)
    first = decode(model, SPECIAL, ps, settings(), committer=g)
    again = decode(model, SPECIAL, ps[:2], settings(), committer=g)  # fresh state, fewer rows
    assert again.tokens == first.tokens[:2]
    fresh = committer(random_guide(seed=1), verify_chunk=2)
    with pytest.raises(RuntimeError, match="start"):
        fresh(None)


@pytest.mark.slow
def test_shipped_pair_guided_decoding_is_the_shipped_guides_greedy_decode():
    """On the shipped Dream pair (real tokenizer, chat template, 2-shot prompts), a batch of three
    guided FreeCache decodes under `exact` equals the guide's own `generate` (transformers'
    LlamaForCausalLM on the same folder), row by row, and the same decode guided by that
    transformers model commits the same tokens as with our CausalLM (models/causal.py)."""
    from dllm_cli.evaluate import held_out
    from dllm_cli.models.causal import CausalLM
    from dllm_cli.runtime import open_runtime

    rt = open_runtime("tiny-gsm-dream", {"decode.cache": "freecache", "decode.gen_length": 96})
    assert isinstance(rt.guide.model, CausalLM)
    tasks = held_out(rt.encode, 3, 2, start=40)
    special = rt.loaded.special
    guide = LlamaForCausalLM.from_pretrained(str(rt.guide.path), dtype=torch.float32).eval()
    prompts = [t.prompt for t in tasks]
    result = decode(rt.loaded.model, special, prompts, rt.settings, committer=rt.committer())
    rt.guide.model = guide  # the same profile's committer, on transformers' model
    ref = decode(rt.loaded.model, special, prompts, rt.settings, committer=rt.committer())
    assert result.tokens == ref.tokens
    for row, task in enumerate(tasks):
        out = guide.generate(
            input_ids=torch.tensor([task.prompt]),
            max_new_tokens=96,
            do_sample=False,
            eos_token_id=list(special.stop),
            pad_token_id=special.pad,
        )
        want = out[0, len(task.prompt) :].tolist()
        want = next((want[:i] for i, t in enumerate(want) if t in special.stop), want)
        assert result.answer(row, special.stop) == want
    assert result.forwards * 3 < sum(len(result.answer(r, special.stop)) for r in range(3))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("pair", "rule", "arg", "cache"), [*BATCH_CASES, ("agreeing", "exact", None, "none")]
)
def test_continuous_rows_equal_rows_alone(kind, pair, rule, arg, cache):
    """Guided decoding batches continuously: requests join a running batch (their rows of
    the guide's cache start empty) and each answer is still its answer alone; under `exact`
    it is the guide's greedy decode whatever shares the slots."""
    model, guide = PAIRS[pair](kind)
    ps = prompts([3, 8, 5, 1, 6, 2], seed=6)
    s = settings(gen_length=24, block_length=6, cache=cache, early_stop=True)
    g = committer(guide, rule, arg, verify_chunk=4)
    engine = Engine(model, SPECIAL, s, g, slots=2, admission="continuous", quantum=4)
    for i, p in enumerate(ps):
        engine.add(p, key=i)
    out, joined = {}, 0
    while engine.has_work:
        step = engine.step()
        joined += any(r.first_step == step.step and r.first_step > 0 for r in engine.live)
        out.update({f.key: f.tokens for f in step.finished})
    assert joined > 0  # some request joined rows already decoding
    for i, p in enumerate(ps):
        _, alone = run_guided(model, [p], s, committer(guide, rule, arg, verify_chunk=4))
        assert out[i] == alone.tokens[0], f"prompt {i}"
        if rule == "exact":
            n = len(guide_greedy(guide, p, s.gen_length))
            assert out[i][:n] == guide_greedy(guide, p, s.gen_length)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", ["none", "freecache"])
def test_continuous_guide_rows_stay_put_and_hold_the_committed_prefix(kind, cache):
    """Continuous batching: a request keeps its guide cache row while others leave and join
    (a new request's prompt is written over a finished one's row, the cache never holds
    more rows than slots), and after every step each row is exactly its committed prefix."""
    model, guide = pointed(kind), pointed_guide("every3", eos_at=14)
    ps = prompts([2, 9, 5, 1, 7], seed=8)
    g = committer(guide, verify_chunk=3)
    s = settings(gen_length=20, cache=cache, early_stop=True)
    engine = Engine(model, SPECIAL, s, g, slots=2, admission="continuous", quantum=4)
    for i, p in enumerate(ps):
        engine.add(p, key=i)
    home: dict[int, int] = {}  # request id -> its cache row
    reused = checked = 0
    while engine.has_work:
        engine.step()
        c = engine.canvas
        assert len(g.cache.valid) <= 2
        for r, request in enumerate(engine.live):
            row = g.cache.rows[r]
            reused += request.id not in home and row in home.values()
            assert home.setdefault(request.id, row) == row
            ids = c.ids[r, int(c.pad[r]) :].tolist()
            prefix = ids[: ids.index(MASK)] if MASK in ids else ids
            assert int(g.cache.cached[r]) == len(prefix) - 1
            fresh = guide(input_ids=torch.tensor([prefix])).logits[0, -1]
            cached = cached_logits(g, r, prefix[-1], len(prefix) - 1)
            torch.testing.assert_close(cached, fresh, rtol=1e-9, atol=1e-9)
            checked += 1
    assert reused > 0 and checked > 5
