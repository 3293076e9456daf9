"""LLaDA2.x on the block-causal engine: the MoE folder loads by its names, the forward equals a
transcription of the modeling code, LLaDA2.0's and LLaDA2.1's generate (M2T + T2T editing)
are reproduced token for token, the cache is exact, and rows decode alike batched, alone and
admitted continuously."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from block_checkpoints import write_llada2
from block_reference import llada2_forward, llada20_generate, llada21_generate

from dllm_cli.decoding import decode, decode_steps
from dllm_cli.decoding.run import open_engine
from dllm_cli.errors import SettingsError
from dllm_cli.models.block import block_key_mask
from dllm_cli.models.loading import load_model
from dllm_cli.settings import DecodeSettings

PROMPTS = ([5, 6, 7, 8, 9, 10], [3, 4, 5, 6, 7, 8, 9, 11], [12], [20, 21, 22, 23, 24])


@pytest.fixture(scope="module")
def llada2(tmp_path_factory):
    return write_llada2(tmp_path_factory.mktemp("llada2") / "llada2")


@pytest.fixture(scope="module")
def loaded(llada2):
    torch.set_num_threads(1)
    return load_model(llada2.folder, device="cpu")


def settings(**kw) -> DecodeSettings:
    base = dict(gen_length=12, block_length=4, cache="prefix", unmask="threshold", threshold=0.1)
    return DecodeSettings(**(base | kw))


def reference(llada2, loaded, prompt, s: DecodeSettings) -> list[int]:
    x = llada21_generate(
        llada2.tensors, llada2.config, prompt, loaded.special.mask, llada2.ids["vocab_size"],
        s.gen_length, s.block_length, s.threshold, s.edit_threshold, s.max_post_steps,
        loaded.special.eos,
    )  # fmt: skip
    return x[len(prompt) : len(prompt) + s.gen_length].tolist()


def test_every_tensor_loads_by_its_name(llada2, loaded):
    state = loaded.model.state_dict()
    assert set(state) == set(llada2.tensors)
    for name, tensor in llada2.tensors.items():
        assert torch.equal(state[name], tensor), name
    assert loaded.special.mask == llada2.ids["mask"]


def test_forward_matches_the_transcribed_modeling(llada2, loaded):
    ids = torch.tensor(PROMPTS[1] + PROMPTS[0][:4])
    mask = block_key_mask(len(ids), 4)
    want = llada2_forward(llada2.tensors, llada2.config, ids, mask)
    with torch.inference_mode():
        got = loaded.model(ids[None], None, key_mask=mask[None])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kw",
    [
        {},  # LLaDA2.0: threshold, one token a step at least
        {"threshold": 0.95},
        {"edit_threshold": 0.1},  # LLaDA2.1 editing
        {"edit_threshold": 0.0, "threshold": 0.05, "max_post_steps": 3},  # S mode's 0.0
        {"edit_threshold": 0.2, "block_length": 8, "gen_length": 16},
    ],
)
@pytest.mark.parametrize("cache", ["prefix", "none"])
def test_decode_matches_the_reference_loop(llada2, loaded, kw, cache):
    s = settings(cache=cache, **kw)
    got = decode(loaded.model, loaded.special, list(PROMPTS), s).tokens
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        assert tokens == reference(llada2, loaded, prompt, s), prompt


def test_edits_happen_and_show_as_drafts(loaded):
    s = settings(edit_threshold=0.0, threshold=0.05, max_post_steps=3)
    run = decode_steps(loaded.model, loaded.special, list(PROMPTS), s)
    events = list(run)
    assert sum(e.replaced for e in events) > 0  # tokens really replaced
    result = run.result()
    plain = decode(loaded.model, loaded.special, list(PROMPTS), replace(s, edit_threshold=None))
    assert result.tokens != plain.tokens


@pytest.mark.parametrize("kw", [{}, {"edit_threshold": 0.1}])
def test_batch_and_continuous_equal_alone(loaded, kw):
    s = settings(**kw)
    alone = [decode(loaded.model, loaded.special, [p], s).tokens[0] for p in PROMPTS]
    assert decode(loaded.model, loaded.special, list(PROMPTS), s).tokens == alone
    engine = open_engine(loaded.model, loaded.special, s, slots=2, admission="continuous")
    done = {}
    for i, p in enumerate(PROMPTS):
        engine.add(p, key=i)
    while engine.has_work:
        for f in engine.step().finished:
            done[f.key] = f.tokens
    assert [done[i] for i in range(len(PROMPTS))] == alone


def test_early_stop_cuts_at_eos(loaded):
    s = settings(gen_length=16)
    full = decode(loaded.model, loaded.special, [PROMPTS[0]], s).tokens[0]
    special = replace(loaded.special, eos=full[6])
    early = decode(loaded.model, special, [PROMPTS[0]], replace(s, early_stop=True)).tokens[0]
    cut = full.index(full[6])
    assert early[: cut + 1] == full[: cut + 1] and set(early[cut + 1 :]) <= {full[6]}


def test_bad_edit_settings_and_approximate_caches_are_refused(loaded):
    with pytest.raises(SettingsError, match="edit_threshold"):
        settings(edit_threshold=1.5)
    with pytest.raises(SettingsError, match="max_post_steps"):
        settings(max_post_steps=-1)
    with pytest.raises(SettingsError, match="does not apply to LLaDA2"):
        open_engine(loaded.model, loaded.special, settings(cache="dual"))


@pytest.mark.parametrize("steps", [12, 6, 3])  # per block (of 4): 4, 2, 1 steps
@pytest.mark.parametrize("threshold", [0.1, 0.95])
def test_steps_set_the_least_a_threshold_step_commits_as_llada20_does(
    llada2, loaded, steps, threshold
):
    """`--steps` (over the answer, split over its blocks) is LLaDA2.0's `steps` per block under
    the threshold rule: step i commits at least the schedule's share of the block."""
    s = settings(steps=steps, threshold=threshold)
    got = decode(loaded.model, loaded.special, list(PROMPTS), s).tokens
    per_block = steps * s.block_length // s.gen_length
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        x = llada20_generate(
            llada2.tensors, llada2.config, prompt, loaded.special.mask,
            llada2.ids["vocab_size"], s.gen_length, s.block_length, per_block, s.threshold,
        )  # fmt: skip
        assert tokens == x[len(prompt) : len(prompt) + s.gen_length].tolist(), prompt


def test_steps_below_the_block_count_are_refused(loaded):
    with pytest.raises(SettingsError, match="fewer than the number of blocks"):
        decode(loaded.model, loaded.special, [PROMPTS[0]], settings(steps=2))
