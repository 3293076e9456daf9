"""Suffix pruning (`suffix_window`, DPad / Streaming-dLLM): the canvas a row sees ends W columns
past its block; nothing beyond is computed or attended, and a window past the answer is a no-op.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from decode_fixtures import KINDS, MASK, SPECIAL, one_thread, prompts, settings, tiny  # noqa: F401
from guided_fixtures import committer, pointed, pointed_guide, random_guide
from test_decode_continuous import stream
from test_decode_reference import reference_logits
from test_guided import guide_greedy

from dllm_cli.cache import KVCache
from dllm_cli.decoding import Decoder, decode, decode_steps
from dllm_cli.errors import SettingsError
from dllm_cli.settings import CACHES

RULES = (
    {"unmask": "threshold", "threshold": 0.5},
    {"unmask": "fixed", "steps": 12},
    {"unmask": "factor", "factor": 1.5, "early_stop": True},
)


def ending(kind: str):
    """A confident model that ends its answers (EOS from position 14): blocks take several
    steps, rows drift apart, early stop retires rows at different places."""
    return tiny(kind, seed=1, head_scale=4.0, eos_from=14).model


def trace(model, ps, s, lockstep: bool = True, guided=None):
    """Every commit of a decode (row, column, token, confidence) and its result."""
    if guided is None:
        run = Decoder(model, SPECIAL, s).run(ps, lockstep=lockstep)
    else:
        run = decode_steps(model, SPECIAL, ps, s, committer=guided)
    events = list(run)
    commits = [(e.step, c) for e in events for c in e.commits]  # RowCommits compare by value
    return events, commits, replace(run.result(), seconds=0.0, guide_seconds=0.0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("lockstep", [True, False])
def test_a_window_past_the_answer_is_no_pruning_bit_for_bit(kind, cache, rule, lockstep):
    """W >= gen_length: every commit, confidence, forward and step as without pruning."""
    model, ps = ending(kind), prompts([3, 9, 5], seed=1)
    s = settings(cache=cache, gen_length=24, block_length=8, **rule)
    want = trace(model, ps, s, lockstep)
    for w in (24, 25, 1000):
        got = trace(model, ps, settings(**{**s.to_dict(), "suffix_window": w}), lockstep)
        assert got[1] == want[1], w  # the confidences too: bit for bit
        assert got[2] == want[2], w
        assert [e.phases for e in got[0]] == [e.phases for e in want[0]]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", ["none", "dual", "freecache"])
def test_guided_window_past_the_answer_is_no_pruning(kind, cache):
    model, guide = pointed(kind), pointed_guide("every3")
    ps = prompts([2, 9, 5], seed=5)
    s = settings(gen_length=18, block_length=8, cache=cache)
    rules = {"verify_chunk": 3, "draft_window": 5}
    want = trace(model, ps, s, guided=committer(guide, **rules))
    wide = settings(**{**s.to_dict(), "suffix_window": 18})
    got = trace(model, ps, wide, guided=committer(guide, **rules))
    assert got[1] == want[1] and got[2] == want[2]


@torch.inference_mode()
def cut_canvas_reference(model, prompt, gen, block, steps_per_block, window, shift):
    """LLaDA's reference loop (no cache, top-k schedule, low confidence) on a canvas cut W
    columns past the block: the forward sees x[:, :block_end + W] at its true positions."""
    p = len(prompt)
    x = torch.full((1, p + gen), MASK, dtype=torch.long)
    x[0, :p] = torch.tensor(prompt)
    for b in range(gen // block):
        end = p + (b + 1) * block
        cut = min(p + gen, end + window)
        base, rem = divmod(block, steps_per_block)
        for i in range(steps_per_block):
            logits = reference_logits(model, x[:, :cut])  # (1, cut, V)
            if shift:  # Dream: column i's prediction comes from column i - 1
                logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
            probs = torch.softmax(logits.to(torch.float64), dim=-1)
            x0 = logits.argmax(dim=-1)
            conf = probs.gather(-1, x0[..., None]).squeeze(-1)[0]
            masked = x[0, :cut] == MASK
            masked[end:] = False
            conf = torch.where(masked, conf, torch.tensor(float("-inf"), dtype=conf.dtype))
            select = torch.topk(conf, k=base + (i < rem)).indices
            x[0, select] = x0[0, select]
    return x[0, p:].tolist()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("window", [1, 4, 11])
def test_pruned_decoding_is_the_reference_on_a_cut_canvas(kind, window):
    """Pruning means a shorter canvas with true positions, nothing else (LLaDA's loop; the
    Dream model with the shift and the linear schedule)."""
    lm = tiny(kind, seed=2, head_scale=3.0)
    for prompt in prompts([5, 9], seed=window):
        s = settings(
            gen_length=24, block_length=8, steps=12, schedule="linear", suffix_window=window
        )
        got = decode(lm.model, SPECIAL, [prompt], s).tokens[0]
        shift = kind == "dream"
        assert got == cut_canvas_reference(lm.model, prompt, 24, 8, 4, window, shift)


def poisoned_empty(monkeypatch) -> None:
    """KV caches start full of large random values instead of zeros: any read of a column
    that no forward has written would change the attention output."""
    plain = KVCache.empty.__func__

    def empty(cls, *args, **kw):
        cache = plain(cls, *args, **kw)
        gen = torch.Generator().manual_seed(7)
        for t in [*cache.k, *cache.v]:
            t.copy_(torch.randn(t.shape, generator=gen) * 50)
        return cache

    monkeypatch.setattr(KVCache, "empty", classmethod(empty))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", ["prefix", "dual", "freecache"])
@pytest.mark.parametrize("lockstep", [True, False])
def test_no_pruned_column_is_computed_or_attended(kind, cache, lockstep, monkeypatch):
    """Forwards stop at the limit (block end + W), and never-computed cache columns (poisoned
    here) change nothing: a pruned column is neither computed nor attended."""
    model, ps = ending(kind), prompts([3, 9, 5], seed=1)
    w, block, gen = 5, 8, 32
    s = settings(cache=cache, gen_length=gen, block_length=block, suffix_window=w, **RULES[0])
    events, commits, result = trace(model, ps, s, lockstep)
    for e in events:
        for phase in e.phases:
            limit = min(gen, (phase.block + 1) * block + w)
            assert phase.window[1] <= limit, (e.step, phase)
    poisoned_empty(monkeypatch)
    _, dirty, dirty_result = trace(model, ps, s, lockstep)
    assert dirty == commits
    assert dirty_result.tokens == result.tokens


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", ["prefix", "freecache"])
def test_guided_rows_compute_columns_coming_into_reach(kind, cache, monkeypatch):
    """A guided row's draft window stops Prefix/FreeCache windows short of the limit, but the
    columns a moving limit brings in are computed before anything attends them."""
    model, guide = tiny(kind, seed=1, head_scale=6.0).model, random_guide(seed=3)
    ps = prompts([2, 9, 5], seed=5)
    s = settings(gen_length=24, block_length=4, cache=cache, suffix_window=6)
    rules = {"verify_chunk": 3, "draft_window": 2}
    _, commits, result = trace(model, ps, s, guided=committer(guide, **rules))
    for row, prompt in enumerate(ps):  # the exact rule still writes the guide's greedy text
        assert result.answer(row, SPECIAL.stop) == guide_greedy(guide, prompt, 24)
    poisoned_empty(monkeypatch)
    _, dirty, _ = trace(model, ps, s, guided=committer(guide, **rules))
    assert dirty == commits


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", CACHES)
def test_pruned_rows_apart_and_batched_equal_rows_alone(kind, cache):
    model, ps = ending(kind), prompts([3, 9, 5, 1], seed=2)
    s = settings(cache=cache, gen_length=24, block_length=8, suffix_window=3, **RULES[0])
    alone = [decode(model, SPECIAL, [p], s).tokens[0] for p in ps]
    assert trace(model, ps, s, lockstep=False)[2].tokens == alone
    assert decode(model, SPECIAL, ps, s).tokens == alone


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", ["none", "dual", "freecache"])
def test_pruned_classifier_free_guidance_rows_apart_equal_rows_alone(kind, cache):
    """LLaDA's CFG doubles the batch (a prompt-masked branch): both branches are cut alike."""
    model, ps = ending(kind), prompts([3, 9, 5], seed=4)
    s = settings(cache=cache, gen_length=24, block_length=8, suffix_window=5, cfg_scale=1.5)
    s = settings(**{**s.to_dict(), **RULES[0]})
    alone = [decode(model, SPECIAL, [p], s).tokens[0] for p in ps]
    assert trace(model, ps, s, lockstep=False)[2].tokens == alone
    wide = settings(**{**s.to_dict(), "suffix_window": 24})
    plain = settings(**{**s.to_dict(), "suffix_window": 0})
    assert trace(model, ps, wide)[1] == trace(model, ps, plain)[1]


@pytest.mark.parametrize("cache", CACHES)
def test_pruned_continuous_batching_equals_rows_alone(cache):
    model = ending("dream")
    ps = prompts([4, 9, 2, 17, 5, 11], seed=3)
    s = settings(cache=cache, gen_length=24, block_length=8, suffix_window=4, early_stop=True)
    out, refused, _ = stream(model, ps, s, slots=2)
    assert not refused
    alone = [decode(model, SPECIAL, [p], s).tokens[0] for p in ps]
    assert [out[i].tokens for i in range(len(ps))] == alone


def test_pruning_saves_work_where_the_suffix_is_long():
    """Forwards cover fewer columns: the summed window widths drop with the window."""
    model, ps = ending("llada"), prompts([3], seed=1)

    def columns(w: int) -> int:
        s = settings(cache="prefix", gen_length=48, block_length=8, suffix_window=w, **RULES[0])
        events, _, _ = trace(model, ps, s)
        return sum(p.window[1] - p.window[0] for e in events for p in e.phases)

    assert columns(2) < columns(16) < columns(0)


@pytest.mark.parametrize("bad", [-1, 1.5, "8", True])
def test_suffix_window_is_validated(bad):
    with pytest.raises(SettingsError, match="suffix_window"):
        settings(suffix_window=bad)
