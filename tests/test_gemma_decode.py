"""DiffusionGemma through transformers' own model and sampler: loading, faithfulness to
transformers' `generate`, batch independence, events, stopping, early stop, refusals."""

from __future__ import annotations

import dataclasses
import inspect
import json
import shutil

import pytest
import torch
from gemma_checkpoint import CANVAS
from gemma_fixtures import (  # noqa: F401
    SETTLING,
    TEXTS,
    encode,
    gemma_ckpt_fixture,
    gemma_fixture,
    gemma_settings,
)

from dllm_cli.decoding import decode, decode_steps
from dllm_cli.decoding.gemma import USED, generation_kwargs
from dllm_cli.errors import InputError, ModelLoadError, SettingsError
from dllm_cli.families import FAMILIES
from dllm_cli.family_settings import check_refused
from dllm_cli.models.diffusion_gemma import DiffusionGemmaLM
from dllm_cli.models.loading import load_model
from dllm_cli.settings import DecodeSettings

# --- loading --------------------------------------------------------------------------------


def test_loads_a_saved_folder_with_its_tokenizer_and_stop_tokens(gemma, gemma_ckpt):
    ids = gemma_ckpt.ids
    assert isinstance(gemma.model, DiffusionGemmaLM) and gemma.architecture == "diffusion_gemma"
    assert gemma.dtype == torch.float32 and gemma.model.canvas_length == CANVAS
    state = gemma.model.state_dict()
    for name, tensor in gemma_ckpt.tensors.items():
        assert torch.equal(state[name], tensor), name
    special = gemma.special
    assert (special.eos, special.pad, special.bos, special.eot) == (
        ids["eos"], ids["pad"], ids["bos"], ids["eot"]
    )  # fmt: skip
    assert special.stop == (ids["eos"], ids["eot"], ids["tool"])  # generation_config.s list
    assert special.mask is None  # uniform-state diffusion has no mask token
    text = gemma.tokenizer.decode(encode(gemma, "how many apples"))
    assert text == "<bos><|turn>user\nhow many apples<turn|>\n<|turn>model\n"


def test_broken_folders_fail_with_one_line(gemma_ckpt, tmp_path):
    def copy(name: str):
        folder = tmp_path / name
        shutil.copytree(gemma_ckpt.folder, folder)
        return folder

    no_weights = copy("no-weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weights in"):
        load_model(no_weights, device="cpu")
    wider = copy("wider")
    config = json.loads((wider / "config.json").read_text())
    config["text_config"]["hidden_size"] = 96
    (wider / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"wider: parameter .* has shape \[\d+, 64\] in the"):
        load_model(wider, device="cpu")
    bad = copy("bad-config")
    config["text_config"]["hidden_size"] = "wide"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="invalid diffusion_gemma config"):
        load_model(bad, device="cpu")


# --- faithfulness and batches ---------------------------------------------------------------


@pytest.mark.parametrize("knobs", [{}, SETTLING], ids=["card-settings", "settling"])
def test_a_single_row_is_transformers_generate(gemma, knobs):
    """One row with seed s draws exactly what transformers' generate draws after
    torch.manual_seed(s): the same tokens, whatever stops the canvases."""
    s = gemma_settings(seed=3, **knobs)
    ids = encode(gemma, TEXTS[1])
    ours = decode(gemma.model, gemma.special, [ids], s)
    torch.manual_seed(s.seed)
    kwargs = generation_kwargs(gemma.special.stop, gemma.special.pad, s)
    ref = gemma.model.generate(torch.tensor([ids]), **kwargs).sequences[0, len(ids) :]
    assert ours.tokens[0] == ref[: s.gen_length].tolist()


@pytest.mark.parametrize("knobs", [{}, SETTLING], ids=["card-settings", "settling"])
def test_batch_rows_equal_single_runs(gemma, knobs):
    """Rows of different lengths, left-padded, whose canvases settle at different steps."""
    s = gemma_settings(gen_length=32, steps=8, **knobs)
    prompts = [encode(gemma, t) for t in TEXTS]
    batch = decode(gemma.model, gemma.special, prompts, s)
    singles = [decode(gemma.model, gemma.special, [p], s).tokens[0] for p in prompts]
    assert batch.tokens == singles
    assert len({tuple(t) for t in singles}) == len(singles)


def test_seed_decides_the_draws(gemma):
    ids = [encode(gemma, TEXTS[0])]
    first = decode(gemma.model, gemma.special, ids, gemma_settings(seed=1)).tokens
    assert decode(gemma.model, gemma.special, ids, gemma_settings(seed=1)).tokens == first
    assert decode(gemma.model, gemma.special, ids, gemma_settings(seed=2)).tokens != first


# --- events ---------------------------------------------------------------------------------


def test_events_replay_to_the_result(gemma):
    """Steps in order; drafts replay to each canvas's commits; commits build the result."""
    s = gemma_settings(gen_length=40, steps=6, **SETTLING)
    prompts = [encode(gemma, t) for t in TEXTS[:3]]
    run = decode_steps(gemma.model, gemma.special, prompts, s)
    events = list(run)
    result = run.result()
    assert [e.step for e in events] == list(range(len(events))) == [e.forwards - 1 for e in events]
    assert result.steps == result.forwards == len(events)
    drafts = {r: [None] * s.gen_length for r in range(3)}
    committed = {}
    for e in events:
        start, end = e.block * CANVAS, min((e.block + 1) * CANVAS, s.gen_length)
        assert e.window == (start, end) and e.refresh == (e.block_step == 0)
        assert e.frozen == ((start - CANVAS, start) if e.block_step == 0 and e.block else None)
        for d in e.drafts:
            assert all(start <= p < end for p in d.positions) and d.tokens
            for p, t in zip(d.positions, d.tokens, strict=True):
                assert drafts[d.row][p] != t  # a draft event is a replaced token
                drafts[d.row][p] = t
        for c in e.commits:
            assert list(c.positions) == list(range(start, start + len(c.positions)))
            for p, t in zip(c.positions, c.tokens, strict=True):
                assert drafts[c.row][p] == t and (c.row, p) not in committed
                committed[(c.row, p)] = (e.step, t)
    assert sum(e.block_step == 0 for e in events) == 3  # canvases of 16: 16 + 16 + 8
    for row, tokens in enumerate(result.tokens):
        for pos, step in enumerate(result.commit_steps[row]):
            assert committed[(row, pos)] == (step, tokens[pos])
    assert {r for e in events for r in e.finished} == {0, 1, 2}
    assert any(e.settled for e in events)


def test_the_stopping_rule_ends_a_canvas_early(gemma):
    """stability 0 with a loose confidence bound: every canvas stops after its first step."""
    ids = [encode(gemma, TEXTS[0])]
    loose = gemma_settings(stability_threshold=0, confidence_threshold=100.0)
    events = list(run := decode_steps(gemma.model, gemma.special, ids, loose))
    assert [e.settled for e in events] == [(0,), (0,)] and run.result().forwards == 2
    strict = gemma_settings(stability_threshold=1, confidence_threshold=1e-9)
    assert (
        decode(gemma.model, gemma.special, ids, strict).forwards == 2 * strict.steps
    )  # never stable and confident


def test_early_stop_cuts_at_the_stop_token_and_skips_later_canvases(gemma):
    """The same text as a full run; positions after the stop hold EOS and no commit step."""
    ids = [encode(gemma, TEXTS[2])]
    full = decode(gemma.model, gemma.special, ids, gemma_settings(gen_length=40))
    stop = full.tokens[0][5]  # make a token of the first canvas the stop token
    first = full.tokens[0].index(stop)
    special = dataclasses.replace(gemma.special, eos=stop, eot=None, extra_stop=())
    plain = decode(gemma.model, special, ids, gemma_settings(gen_length=40))
    assert plain.tokens == full.tokens  # the stop set changes nothing without early stop
    early = decode(gemma.model, special, ids, gemma_settings(gen_length=40, early_stop=True))
    assert early.tokens[0] == full.tokens[0][: first + 1] + [stop] * (39 - first)
    assert early.commit_steps[0][first] >= 0 and set(early.commit_steps[0][first + 1 :]) == {-1}
    assert early.forwards == gemma_settings().steps < full.forwards  # canvas 2 and 3 skipped


def test_closing_a_run_stops_the_decode(gemma):
    """Two steps, then close: the stepping loop is closed there, nothing ran past step 2."""
    run = decode_steps(gemma.model, gemma.special, [encode(gemma, TEXTS[0])], gemma_settings())
    events = iter(run)
    next(events), next(events)
    loop = run.engine.stepper.steps_left
    events.close()
    assert inspect.getgeneratorstate(loop) == inspect.GEN_CLOSED
    assert run.steps == run.forwards == 2 and not run.engine.has_work
    with pytest.raises(Exception, match="stopped before it finished"):
        run.result()


# --- refusals and bad input -----------------------------------------------------------------


def test_every_setting_is_either_mapped_or_refused():
    """A DecodeSettings field added later must say what it means for DiffusionGemma."""
    names = {f.name for f in dataclasses.fields(DecodeSettings)}
    refused = set(FAMILIES["diffusion_gemma"].refuses)
    assert set(USED) | refused == names and not set(USED) & refused


@pytest.mark.parametrize(
    "change",
    [
        {"cache": "dual"},
        {"unmask": "threshold"},
        {"temperature": 0.5},
        {"top_k": 3},
        {"cfg_scale": 1.0},
        {"block_length": 8},
    ],
)
def test_settings_that_mean_nothing_are_refused(gemma, change):
    key = next(iter(change))
    with pytest.raises(SettingsError, match=f"^{key} .* does not apply to DiffusionGemma"):
        decode(gemma.model, gemma.special, [encode(gemma, "hi")], gemma_settings(**change))


def test_masked_families_refuse_gemma_knobs():
    check_refused(FAMILIES["llada"], gemma_settings())
    with pytest.raises(SettingsError, match=r"t_min 0\.3 does not apply to LLaDA: it is Diff"):
        check_refused(FAMILIES["llada"], gemma_settings(t_min=0.3))


def test_generation_settings_transformers_refuses(gemma):
    with pytest.raises(SettingsError, match="t_max"):
        decode(
            gemma.model, gemma.special, [encode(gemma, "hi")], gemma_settings(t_min=0.9)
        )  # above t_max 0.8


def test_bad_prompts_are_input_errors(gemma):
    s = gemma_settings()
    with pytest.raises(InputError, match="empty"):
        decode(gemma.model, gemma.special, [[2], []], s)
    with pytest.raises(InputError, match="outside the vocabulary"):
        decode(gemma.model, gemma.special, [[2, 10**6]], s)
    with pytest.raises(InputError, match="exceeds the model's context"):
        decode(gemma.model, gemma.special, [[2] * 490], s)  # 490 + two canvases of 16 > 512
