"""WINO (decoding/wino.py): revokable decoding with a shadow block in the same forward.

Its draft and re-mask selection against a transcription of the public reference
(Feng-Hong/WINO-DLLM, `decoding_wino`), its shadow attention against the reference's mask, the
shadow as a leave-one-out check, and on tiny models what every rule must keep: no mask in the
output, determinism, batch == single, every cache policy, early stop, suffix pruning,
continuous batching, one forward per step.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from decode_fixtures import KINDS, MASK, SPECIAL, one_thread, prompts, settings, tiny  # noqa: F401
from rule_properties import assert_rows_decode_alone, assert_stops_prunes_and_batches_continuously

import dllm_cli.decoding.wino as wino
from dllm_cli.decoding import Engine, decode, decode_steps
from dllm_cli.decoding.canvas import Canvas
from dllm_cli.decoding.policies import ForwardPlan
from dllm_cli.decoding.sampling import Sampler, sampler_rule_of
from dllm_cli.errors import SettingsError
from dllm_cli.settings import CACHES, DecodeSettings

WINO = {"unmask": "wino", "threshold": 0.2, "wino_verify": 0.99, "block_length": 8}


def reference_step(confidence, confidence_back, masks: int, last_accept: int, tau, tau_back):
    """One row of the reference's selection, as `decoding_wino` writes it (batch 1):
    confidence -inf off the block's masks, confidence_back +inf off its earlier commits."""
    max_accept = min(max(int(masks * 0.7), 5), 20)
    transfer = confidence > tau
    if transfer.sum() > max_accept:
        _, idx = torch.topk(confidence, k=max_accept)
        transfer = torch.zeros_like(transfer)
        transfer[idx] = True
    elif not transfer.any():
        transfer[torch.argmax(confidence)] = True
    accepted = int(transfer.sum())
    if accepted > 1:
        remask = confidence_back < tau_back
        if remask.sum() >= last_accept:
            _, idx = torch.topk(confidence_back, k=last_accept - 1, largest=False)
            remask = torch.zeros_like(remask)
            remask[idx] = True
    else:
        remask = torch.zeros_like(transfer)
    return transfer, remask


def test_draft_and_remask_equal_the_reference_transcription():
    gen = torch.Generator().manual_seed(0)
    for trial in range(300):
        width = int(torch.randint(4, 33, (1,), generator=gen))
        masked = torch.rand(width, generator=gen) < 0.6
        masked[int(torch.randint(width, (1,), generator=gen))] = True  # a block with a mask
        conf = torch.rand(width, generator=gen, dtype=torch.float64).masked_fill(~masked, -1e9)
        conf = conf.masked_fill(~masked, float("-inf"))
        back = torch.rand(width, generator=gen, dtype=torch.float64).masked_fill(masked, 2.0)
        back = back.masked_fill(masked, float("inf"))
        last = int(torch.randint(1, 12, (1,), generator=gen))
        tau, tau_back = float(torch.rand(1, generator=gen)) * 0.8, 0.9
        want_t, want_r = reference_step(conf, back, int(masked.sum()), last, tau, tau_back)
        got_t = wino.wide_in(conf[None], masked[None], tau)[0]
        got_r = wino.narrow_out(back[None], got_t.sum()[None], torch.tensor([last]), tau_back)
        assert torch.equal(got_t, want_t), trial
        assert torch.equal(got_r[0], want_r), trial


def reference_mask(prompt: int, gen: int, block: int, index: int) -> torch.Tensor:
    """The reference's (S + L, S + L) attention for block `index`: nothing attends the
    shadow but the shadow; shadow j attends everything but block column j."""
    s = prompt + gen
    mask = torch.ones(s + block, s + block, dtype=torch.bool)
    mask[:, -block:] = False
    mask[-block:, -block:] = True
    start = prompt + index * block
    mask[-block:, start : start + block] = ~torch.eye(block, dtype=torch.bool)
    return mask


def test_shadow_attention_equals_the_reference_mask_without_a_cache():
    prompt, gen, block = 5, 12, 4
    for index in range(gen // block):
        start = prompt + index * block
        span = torch.arange(start, start + block)[None]
        got = wino.shadow_mask(None, (1, prompt + gen), span, torch.ones_like(span, dtype=bool),
                               0, None, "cpu")  # fmt: skip
        assert torch.equal(got[0], reference_mask(prompt, gen, block, index)), index


def shadows_of(kind: str, ids: torch.Tensor):
    """Shadow logits of block 1 (columns 8..11) of a one-row canvas, on a one-layer model
    (deeper layers see column j through the other columns' states, as in the reference)."""
    loaded = tiny(kind, seed=3, head_scale=4.0, layers=1)
    model, s = loaded.model, DecodeSettings(unmask="wino", gen_length=8, block_length=4)
    sampler = Sampler(s, sampler_rule_of(model), SPECIAL.real_vocab(model.vocab_size), MASK)
    f = wino.ShadowForwards(model, sampler, 0.0, False)
    c = Canvas.build([ids[:4].tolist()], 8, MASK, 0, "cpu")
    c.ids[0] = ids
    f._verified = []
    plan = ForwardPlan(0, 12, refresh=True)
    return f.shadowed(c, None, [plan], [(8, 12)], None)


@pytest.mark.parametrize("kind", KINDS)
def test_a_shadow_never_sees_the_token_it_verifies(kind):
    ids = torch.tensor(prompts([12], seed=4)[0])
    ids[10] = MASK
    _, base, span, _ = shadows_of(kind, ids)
    assert span[0].tolist() == [8, 9, 10, 11]
    for j, col in enumerate(span[0].tolist()):
        changed = ids.clone()
        changed[col] = (int(ids[col]) + 7) % (MASK - 4) + 4 if col != 10 else 5
        _, other, _, _ = shadows_of(kind, changed)
        assert torch.allclose(other[0, j], base[0, j], atol=1e-5), j  # leave-one-out
        others = [k for k in range(4) if k != j]
        assert not torch.allclose(other[0, others], base[0, others], atol=1e-5), j


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", CACHES)
def test_wino_every_cache_batch_equals_single_no_mask_deterministic(kind, cache, monkeypatch):
    revoked = []
    real = wino.revoke
    monkeypatch.setattr(
        "dllm_cli.decoding.step.revoke",
        lambda c, remask, cols: (revoked.append(int(remask.sum())), real(c, remask, cols)),
    )
    assert_rows_decode_alone(kind, cache, WINO)
    assert sum(revoked) > 0  # the test decodes re-mask something


@pytest.mark.parametrize("kind", KINDS)
def test_wino_cache_refreshed_every_step_equals_no_cache(kind):
    model, ps = tiny(kind, seed=2, head_scale=4.0).model, prompts([3, 8], seed=5)
    want = decode(model, SPECIAL, ps, settings(cache="none", gen_length=12, **WINO)).tokens
    for cache in ("prefix", "dual", "freecache"):
        s = settings(cache=cache, refresh_interval=1, gen_length=12, **WINO)
        assert decode(model, SPECIAL, ps, s).tokens == want, cache


@pytest.mark.parametrize(
    ("kind", "cache", "window"), list(itertools.product(KINDS, ("dual", "none"), (0, 4)))
)
def test_wino_with_early_stop_suffix_pruning_and_continuous_batching(kind, cache, window):
    assert_stops_prunes_and_batches_continuously(kind, cache, window, WINO)


def test_wino_verifies_in_the_drafting_forward():
    model = tiny("llada", seed=2, head_scale=4.0).model
    engine = Engine(model, SPECIAL, settings(cache="none", gen_length=12, **WINO), slots=1)
    engine.add(prompts([4], seed=2)[0])
    while engine.has_work:
        engine.step()
    assert engine.forwards == engine.steps  # one (wider) forward per step, nothing extra


def test_wino_settings_are_checked():
    with pytest.raises(SettingsError, match="wino_verify must be in"):
        DecodeSettings(**{**WINO, "wino_verify": 1.5})
    with pytest.raises(SettingsError, match=r"threshold must be in \[0, 1\) under unmask=wino"):
        DecodeSettings(**{**WINO, "threshold": 1.0})
    with pytest.raises(SettingsError, match="does not combine with cfg_scale"):
        DecodeSettings(**{**WINO, "cfg_scale": 1.0})


@pytest.mark.parametrize("kind", KINDS)
def test_wino_progress_streams_only_tokens_no_step_can_revoke(kind, monkeypatch):
    revoked = []
    real = wino.revoke
    monkeypatch.setattr(
        "dllm_cli.decoding.step.revoke",
        lambda c, remask, cols: (revoked.append(int(remask.sum())), real(c, remask, cols)),
    )
    model = tiny(kind, seed=2, head_scale=4.0).model
    engine = Engine(model, SPECIAL, settings(cache="dual", gen_length=24, **WINO), slots=1)
    rid = engine.add(prompts([5], seed=7)[0])
    seen, final = [], None
    while engine.has_work:
        out = engine.step()
        seen.append(engine.progress(rid))
        final = next((f.tokens for f in out.finished), final)
    assert sum(revoked) > 0 and final is not None and MASK not in final
    assert any(seen) and all(final[: len(s)] == s for s in seen)  # never retracted


@pytest.mark.parametrize("kind", KINDS)
def test_wino_streamed_text_is_never_retracted(kind):
    from dllm_cli.text_stream import TextStream

    model = tiny(kind, seed=2, head_scale=4.0).model
    s = settings(cache="dual", gen_length=24, **WINO)
    run = decode_steps(model, SPECIAL, prompts([5], seed=7), s)
    stream = TextStream(s.gen_length, lambda tokens: " ".join(map(str, tokens)))
    text = "".join(stream.feed(event) for event in run)
    final = run.result().tokens[0]
    assert text == " ".join(map(str, final))
