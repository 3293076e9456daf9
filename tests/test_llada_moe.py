"""LLaDA-MoE: a tiny random folder in the real format decodes token for token as LLaDA's
reference `generate` running a transcription of the reference MoE forward; loading it never
builds the dense class; every cache policy's equivalences hold on the MoE model."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import test_decode_cache as cache_tests
import test_decode_suffix as suffix_tests
import torch
from checkpoints import write_llada_moe
from cli_fixtures import invoke, isolated_fixture  # noqa: F401
from decode_fixtures import SPECIAL, one_thread, peaked, prompts, settings, tiny  # noqa: F401
from llada_moe_reference import ReferenceLLaDAMoE
from test_decode_continuous import stream
from test_decode_reference import llada_generate

from dllm_cli.decoding import decode
from dllm_cli.families import FAMILIES, family_for_config, reference_settings
from dllm_cli.models.llada import LLaDAModelLM
from dllm_cli.models.llada_moe import LLaDAMoEModelLM, route
from dllm_cli.models.loading import load_model, special_ids
from dllm_cli.runtime import open_runtime

KIND = "llada_moe"


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return write_llada_moe(tmp_path_factory.mktemp("moe") / "LLaDA-MoE-tiny")


@pytest.fixture(scope="module")
def loaded(moe):
    return load_model(moe.folder, device="cpu")


@pytest.fixture(scope="module")
def reference(moe):
    return ReferenceLLaDAMoE(moe.config, moe.tensors)


# --- the model ------------------------------------------------------------------------------


def test_folder_is_llada_moe_by_architectures_and_never_builds_the_dense_class(moe, monkeypatch):
    assert moe.config["model_type"] == "llada" and "mask_token_id" not in moe.config
    assert family_for_config(moe.config, "c").name == KIND

    def refuse(*args, **kwargs):
        raise AssertionError("the dense LLaDA class was built for a LLaDA-MoE folder")

    monkeypatch.setattr(LLaDAModelLM, "__init__", refuse)
    lm = load_model(moe.folder, device="cpu")
    assert type(lm.model) is LLaDAMoEModelLM and lm.family == KIND
    assert lm.special.mask == moe.ids["mask"]  # from the tokenizer: config.json names none
    assert lm.special.eot == moe.ids["eot"]  # <|role_end|> ends a turn


def test_every_checkpoint_tensor_is_loaded_by_its_own_name(moe, loaded):
    state = loaded.model.state_dict()
    assert set(state) == set(moe.tensors)
    for name, tensor in moe.tensors.items():
        assert torch.equal(state[name], tensor), name


def test_mask_id_falls_back_to_the_family_table(loaded):
    class NoMask:  # a tokenizer that names no mask token
        eos_token_id, pad_token_id, bos_token_id, mask_token_id = 5, 5, None, None

        def get_vocab(self):
            return {}

    ids = special_ids(loaded.model.config, NoMask(), present={}, family=FAMILIES[KIND])
    assert ids.mask == FAMILIES[KIND].mask_id == 156895


def test_forward_matches_the_reference_transcription(loaded, reference):
    ids = torch.tensor([prompts([14], seed=9)[0]])
    got = loaded.model(ids)
    want = reference(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_routing_takes_top_k_probabilities_without_renormalising():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    weights, experts = route(logits, 2, None)
    probs = logits.softmax(-1)
    assert experts.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, probs[:, :2])  # sums to < 1: kept as it is
    _, chosen = route(logits, 2, torch.tensor([0.0, 0.0, 1.0, 0.0]))
    assert chosen.tolist() == [[2, 0]]


# --- decoding == LLaDA's generate on the reference forward ----------------------------------


@pytest.mark.parametrize(("gen", "block", "steps"), [(16, 4, 16), (16, 8, 8), (12, 12, 5)])
def test_decode_matches_llada_generate_on_the_reference_forward(
    loaded, reference, gen, block, steps
):
    vocab = loaded.special.real_vocab(loaded.model.vocab_size)
    mask = loaded.special.mask
    for prompt in prompts([5, 9], seed=gen + block):
        s = settings(gen_length=gen, block_length=block, steps=steps)
        got = decode(loaded.model, loaded.special, [prompt], s).tokens[0]
        want = llada_generate(reference, prompt, gen, block, steps, mask=mask, vocab=vocab)
        assert got == want


def test_model_alone_decodes_as_the_model_card(moe, reference):
    """`dllm generate --model FOLDER` with no decoding flag: LLaDA's generate with the card's
    settings (128 tokens, 128 steps, blocks of 32, low confidence, no cache)."""
    runtime = open_runtime(None, {"model.path": str(moe.folder)})
    assert runtime.settings == reference_settings(FAMILIES[KIND])
    prompt = runtime.encode("how many apples")
    result = invoke("generate", "--model", str(moe.folder), "--json", "how many apples")
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout.strip().splitlines()[-1])["token_ids"]
    special = runtime.loaded.special
    vocab = special.real_vocab(runtime.loaded.model.vocab_size)
    want = llada_generate(reference, prompt, 128, 32, 128, mask=special.mask, vocab=vocab)
    assert got == want


def test_shared_expert_and_dense_layers_match_the_reference(tmp_path):
    """The config fields 7B-A1B leaves off: a shared expert, a dense first layer, expert bias."""
    w = write_llada_moe(
        tmp_path / "variant",
        shards=1,
        seed=8,
        shared_expert_intermediate_size=24,
        moe_layer_freq=[0, 1],
        moe_router_enable_expert_bias=True,
    )
    w.tensors["model.layers.1.mlp.expert_bias"] = 0.05 * torch.randn(8)
    from safetensors.torch import save_file

    save_file(w.tensors, str(w.folder / "model.safetensors"), metadata={"format": "pt"})
    lm = load_model(w.folder, device="cpu")
    ids = torch.tensor([prompts([11], seed=3)[0]])
    torch.testing.assert_close(lm.model(ids), ReferenceLLaDAMoE(w.config, w.tensors)(ids))


# --- every cache policy and rule on the MoE model (the dense tests' own bodies) --------------

MAKERS = [pytest.param(lambda k: tiny(k, seed=5), id="random"), pytest.param(peaked, id="peaked")]


@pytest.mark.parametrize("make", MAKERS)
@pytest.mark.parametrize("cache", cache_tests.CACHED)
@pytest.mark.parametrize("unmask", ["fixed", "threshold"])
def test_refresh_every_step_equals_no_cache(make, cache, unmask):
    cache_tests.test_refresh_every_step_equals_no_cache(make, KIND, cache, unmask)


@pytest.mark.parametrize("cache", cache_tests.CACHED)
@pytest.mark.parametrize("unmask", ["fixed", "threshold"])
def test_one_layer_model_makes_every_policy_exact(cache, unmask):
    cache_tests.test_one_layer_models_make_every_policy_exact(KIND, cache, unmask)


def test_freecache_equals_prefix_with_one_block():
    cache_tests.test_freecache_equals_prefix_with_one_block(KIND)


@pytest.mark.parametrize("make", MAKERS)
@pytest.mark.parametrize("cache", cache_tests.POLICIES)
def test_batch_rows_equal_rows_alone(make, cache):
    cache_tests.test_batch_rows_equal_rows_alone(KIND, cache, make)


@pytest.mark.parametrize("cache", cache_tests.CACHED)
def test_cfg_composes_with_caches(cache):
    cache_tests.test_cfg_composes_with_caches(KIND, cache)


def test_windows_follow_the_policy_table():
    cache_tests.test_windows_follow_the_policy_table(KIND)


@pytest.mark.parametrize("cache", suffix_tests.CACHES)
@pytest.mark.parametrize("rule", suffix_tests.RULES[:2])
def test_a_window_past_the_answer_is_no_pruning(cache, rule):
    suffix_tests.test_a_window_past_the_answer_is_no_pruning_bit_for_bit(KIND, cache, rule, True)


@pytest.mark.parametrize("window", [1, 4])
def test_pruned_decoding_is_the_reference_on_a_cut_canvas(window):
    suffix_tests.test_pruned_decoding_is_the_reference_on_a_cut_canvas(KIND, window)


@pytest.mark.parametrize("cache", suffix_tests.CACHES)
def test_pruned_rows_apart_and_batched_equal_rows_alone(cache):
    suffix_tests.test_pruned_rows_apart_and_batched_equal_rows_alone(KIND, cache)


@pytest.mark.parametrize("cache", ["none", "dual", "freecache"])
def test_continuous_batching_equals_rows_alone(cache):
    model = suffix_tests.ending(KIND)
    ps = prompts([4, 9, 2, 17, 5], seed=3)
    s = settings(cache=cache, gen_length=16, block_length=8, early_stop=True)
    s = replace(s, unmask="threshold", threshold=0.5)
    out, refused, _ = stream(model, ps, s, slots=2)
    assert not refused
    alone = [decode(model, SPECIAL, [p], s).tokens[0] for p in ps]
    assert [out[i].tokens for i in range(len(ps))] == alone
