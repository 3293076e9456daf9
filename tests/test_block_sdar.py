"""SDAR on the block-causal engine: the folder loads by its names, the decode equals the
reference loop transcribed in tests/block_reference.py, the block cache is exact, and rows
decode alike alone, batched and admitted continuously."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from block_checkpoints import write_sdar
from block_reference import sdar_forward, sdar_generate

from dllm_cli.decoding import decode
from dllm_cli.decoding.run import open_engine
from dllm_cli.errors import SettingsError
from dllm_cli.models.block import block_key_mask
from dllm_cli.models.loading import load_model
from dllm_cli.settings import DecodeSettings

PROMPTS = ([5, 6, 7, 8, 9, 10], [3, 4, 5, 6, 7, 8, 9, 11], [12], [20, 21, 22, 23, 24])


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    return write_sdar(tmp_path_factory.mktemp("sdar") / "sdar")


@pytest.fixture(scope="module")
def loaded(sdar):
    torch.set_num_threads(1)
    return load_model(sdar.folder, device="cpu")


def settings(**kw) -> DecodeSettings:
    base = dict(gen_length=12, block_length=4, cache="prefix", unmask="threshold", threshold=0.05)
    return DecodeSettings(**(base | kw))


def reference(sdar, loaded, prompt, s: DecodeSettings, stop=None) -> list[int]:
    planned = s.gen_length if s.steps is None else s.steps  # over the answer: per block below
    steps = max(1, s.block_length * planned // s.gen_length)
    strategy = "low_confidence_dynamic" if s.unmask == "threshold" else "low_confidence_static"
    x = sdar_generate(
        sdar.tensors, sdar.config, prompt, loaded.special.mask, sdar.ids["vocab_size"],
        s.gen_length, s.block_length, steps, s.threshold, strategy, stop,
    )  # fmt: skip
    return x[len(prompt) : len(prompt) + s.gen_length].tolist()


def test_every_tensor_loads_by_its_name(sdar, loaded):
    state = loaded.model.state_dict()
    assert set(state) == set(sdar.tensors)
    for name, tensor in sdar.tensors.items():
        assert torch.equal(state[name], tensor), name
    assert loaded.special.mask == sdar.config["mask_token_id"]
    assert loaded.model.block_size == 4


def test_forward_matches_the_transcribed_modeling(sdar, loaded):
    ids = torch.tensor(PROMPTS[1] + PROMPTS[0][:4])
    mask = block_key_mask(len(ids), 4)
    want = sdar_forward(sdar.tensors, sdar.config, ids, torch.arange(len(ids)), mask, [], False)
    with torch.inference_mode():
        got = loaded.model(ids[None], None, key_mask=mask[None])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kw",
    [
        {},  # threshold 0.05: several tokens a step
        {"threshold": 0.9},  # one token a step
        {"unmask": "fixed", "steps": 6},  # two tokens a step, top-k
        {"steps": 6, "threshold": 0.2},
        {"block_length": 8, "gen_length": 16},
    ],
)
def test_decode_matches_the_reference_loop(sdar, loaded, kw):
    s = settings(**kw)
    got = decode(loaded.model, loaded.special, list(PROMPTS), s).tokens
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        assert tokens == reference(sdar, loaded, prompt, s), prompt


def test_early_stop_ends_at_the_stop_token_as_the_reference(sdar, loaded):
    s = settings(gen_length=16)
    full = decode(loaded.model, loaded.special, [PROMPTS[0]], s).tokens[0]
    stop = full[5]  # a token the answer really produces
    special = replace(loaded.special, eos=stop)
    early = decode(loaded.model, special, [PROMPTS[0]], replace(s, early_stop=True))
    want = reference(sdar, loaded, PROMPTS[0], s, stop=[stop])
    cut = want.index(stop)
    assert early.tokens[0][: cut + 1] == want[: cut + 1] == full[: cut + 1]
    assert set(early.tokens[0][cut + 1 :]) <= {stop}
    assert early.forwards < decode(loaded.model, special, [PROMPTS[0]], s).forwards


@pytest.mark.parametrize("kw", [{}, {"unmask": "fixed", "steps": 6}, {"block_length": 8}])
def test_cache_equals_recomputing_every_earlier_block(loaded, kw):
    cached = decode(loaded.model, loaded.special, list(PROMPTS), settings(**kw))
    full = decode(loaded.model, loaded.special, list(PROMPTS), settings(cache="none", **kw))
    assert cached.tokens == full.tokens
    # The same positions commit together in the same order (the cache adds store steps).
    assert [ranks(m) for m in cached.commit_steps] == [ranks(m) for m in full.commit_steps]
    # One prefill forward more; each finished block's store rides with the next decode.
    assert cached.forwards == full.forwards + 1


@pytest.mark.parametrize("kw", [{}, {"cache": "none", "unmask": "fixed", "steps": 6}])
def test_each_token_has_its_committing_steps_log_probability(sdar, loaded, kw):
    s = settings(**kw)
    engine = open_engine(loaded.model, loaded.special, s, slots=2, admission="continuous")
    asked = {engine.add(p, logprobs=3): p for p in PROMPTS[:2]}
    plain = engine.add(PROMPTS[2])  # a neighbour that asked for nothing
    done = {}
    while engine.has_work:
        done |= {f.id: f for f in engine.step().finished}
    for rid, prompt in asked.items():
        logp: dict[int, float] = {}
        planned = s.gen_length if s.steps is None else s.steps
        steps = max(1, s.block_length * planned // s.gen_length)
        strategy = "low_confidence_dynamic" if s.unmask == "threshold" else "low_confidence_static"
        sdar_generate(
            sdar.tensors, sdar.config, prompt, loaded.special.mask, sdar.ids["vocab_size"],
            s.gen_length, s.block_length, steps, s.threshold, strategy, logp=logp,
        )  # fmt: skip
        chosen, top_ids, top_values = done[rid].token_logprobs(3)
        want = [logp[len(prompt) + j] for j in range(s.gen_length)]
        assert chosen == pytest.approx(want, abs=1e-5)
        assert [ids[0] for ids in top_ids] == done[rid].tokens  # greedy: the top-1
        assert [v[0] for v in top_values] == pytest.approx(chosen)
        assert done[rid].tokens == reference(sdar, loaded, prompt, s)
    assert done[plain].token_logprobs(3) == ([], [], [])


def ranks(marks: list[int]) -> list[int]:
    order = sorted(set(marks))
    return [order.index(m) for m in marks]


def test_batch_equals_single(loaded):
    s = settings()
    batch = decode(loaded.model, loaded.special, list(PROMPTS), s).tokens
    alone = [decode(loaded.model, loaded.special, [p], s).tokens[0] for p in PROMPTS]
    assert batch == alone


@pytest.mark.parametrize("cache", ["prefix", "none"])
def test_continuous_equals_alone(loaded, cache):
    s = settings(cache=cache)
    engine = open_engine(loaded.model, loaded.special, s, slots=2, admission="continuous")
    ids = {engine.add(p, key=i): i for i, p in enumerate(PROMPTS[:2])}
    done, steps = {}, 0
    while engine.has_work:
        out = engine.step()
        steps += 1
        if steps == 3:  # arrivals while rows are mid-decode
            ids |= {engine.add(p, key=i + 2): i + 2 for i, p in enumerate(PROMPTS[2:])}
        for f in out.finished:
            done[f.key] = f.tokens
    alone = [decode(loaded.model, loaded.special, [p], s).tokens[0] for p in PROMPTS]
    assert [done[i] for i in range(len(PROMPTS))] == alone


def test_progress_is_a_prefix_and_abort_frees_the_slot(loaded):
    s = settings()
    want = decode(loaded.model, loaded.special, [PROMPTS[0]], s).tokens[0]
    engine = open_engine(loaded.model, loaded.special, s, slots=1)
    a, b = engine.add(PROMPTS[0]), engine.add(PROMPTS[1])
    seen = []
    for _ in range(4):
        engine.step()
        seen.append(engine.progress(a))
    assert seen[-1] and all(p == want[: len(p)] for p in seen)
    assert engine.progress(b) == []  # still waiting
    assert engine.abort(a) and not engine.abort(a)
    finished = []
    while engine.has_work:
        finished += engine.step().finished
    assert [f.id for f in finished] == [b]


@pytest.mark.parametrize(
    "kw",
    [
        {"cache": "dual"},
        {"cache": "freecache"},
        {"refresh_interval": 2},
        {"suffix_window": 8},
        {"cfg_scale": 1.0},
        {"unmask": "factor"},
        {"confidence": "margin"},
        {"schedule": "dream"},
    ],
)
def test_settings_that_do_not_apply_are_refused(loaded, kw):
    with pytest.raises(SettingsError, match="does not apply to SDAR"):
        open_engine(loaded.model, loaded.special, settings(**kw))


def test_the_folders_block_size_is_the_block_length(tmp_path):
    """`--model` without a profile decodes an SDAR folder with its config.json block_size (the
    size it was trained with), not the family's usual 4; a flag still overrides it."""
    from dllm_cli.profiles import resolve

    folder = write_sdar(tmp_path / "sdar8", block_size=8).folder
    profile, provenance = resolve(None, {"model.path": str(folder)})
    assert profile.decode.block_length == 8
    assert provenance["decode.block_length"] == "checkpoint config.json"
    flagged, _ = resolve(None, {"model.path": str(folder), "decode.block_length": 4})
    assert flagged.decode.block_length == 4
