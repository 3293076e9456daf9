"""`--quantize int8 / int4` on transformers' DiffusionGemma: its linears become dllm's own
quantized layers of the same weights (the ones kept float named), and the model still decodes:
the same seed the same tokens, batch rows their single runs."""

from __future__ import annotations

import pytest
import torch
from gemma_fixtures import (  # noqa: F401
    TEXTS,
    encode,
    gemma_ckpt_fixture,
    gemma_fixture,
    gemma_settings,
)

from dllm_cli.decoding import decode
from dllm_cli.models.diffusion_gemma import keeps_float
from dllm_cli.models.int4 import Int4Linear
from dllm_cli.models.loading import load_model
from dllm_cli.models.quantize import Int8Linear

LAYERS = {"int8": Int8Linear, "int4": Int4Linear}


@pytest.fixture(scope="module", name="quantized", params=["int8", "int4"])
def quantized_fixture(request, gemma_ckpt):
    return request.param, load_model(
        gemma_ckpt.folder, dtype="float32", device="cpu", quantize=request.param
    )


def linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    kinds = (torch.nn.Linear, Int8Linear, Int4Linear)
    every = model.named_modules(remove_duplicate=False)  # the decoder's names too
    return {name: m for name, m in every if isinstance(m, kinds)}


def test_every_linear_is_dllms_layer_of_the_same_weight_but_the_named_float_ones(gemma, quantized):
    """Each quantized linear holds the integers and scales dllm's layer makes of the float
    weight and computes what that layer computes; the rest are the float layers unchanged."""
    scheme, loaded = quantized
    floats, ours = linears(gemma.model), linears(loaded.model)
    assert floats.keys() == ours.keys()
    kept = {name for name in floats if keeps_float(name) or name == "lm_head"}
    assert any("router" in n for n in kept) and any(n.endswith("0.mlp.down_proj") for n in kept)
    torch.manual_seed(0)
    for name, layer in ours.items():
        weight = floats[name].weight
        if name in kept:
            assert type(layer) is torch.nn.Linear and torch.equal(layer.weight, weight), name
            continue
        assert type(layer) is LAYERS[scheme], name
        reference = LAYERS[scheme].of(weight)
        for (key, mine), (_, theirs) in zip(
            layer.state_dict().items(), reference.state_dict().items(), strict=True
        ):
            assert torch.equal(mine, theirs), (name, key)
        x = torch.randn(3, 5, weight.shape[1])
        assert torch.equal(layer(x), reference(x)), name
    tied = loaded.model.lm_head.weight is loaded.model.get_input_embeddings().weight
    assert tied and sum(type(m) is LAYERS[scheme] for m in ours.values()) == len(ours) - len(kept)


def test_the_quantized_model_decodes_deterministically_and_rows_equal_single_runs(gemma, quantized):
    """Under int8, rows of one prompt length equal their single runs. Prompts of other lengths
    are left-padded in transformers' batch, which moves float bits (logprobs agree to 1e-4
    unquantized), and int8's per-token activation rounding can turn that into another token
    (one row of TEXTS' four on an AVX2 CPU, one thread), so ragged rows are not compared here;
    on two threads even rows of one length can differ (conftest keeps every test on one).
    int4's are not compared at all: it multiplies in bfloat16, where this family's batch rows
    are not their single runs even unquantized (`--dtype bfloat16`, float weights)."""
    scheme, loaded = quantized
    s = gemma_settings(gen_length=32, steps=8, seed=4)
    prompts = [encode(loaded, t) for t in TEXTS]
    batch = decode(loaded.model, loaded.special, prompts, s).tokens
    assert all(0 < len(t) <= s.gen_length for t in batch)
    if scheme == "int8":
        even = [p for p in prompts if len(p) == len(prompts[0])]  # no padding between them
        assert len(even) >= 2
        together = decode(loaded.model, loaded.special, even, s).tokens
        assert together == [decode(loaded.model, loaded.special, [p], s).tokens[0] for p in even]
    assert decode(loaded.model, loaded.special, prompts, s).tokens == batch
    assert batch != decode(gemma.model, gemma.special, prompts, s).tokens  # the weights changed


def test_linears_the_encoder_and_decoder_share_stay_one_quantized_layer(gemma, quantized):
    """transformers ties the decoder's layers to the encoder's: each shared float weight
    becomes one quantized layer under both names (not two copies of its integers)."""
    _, loaded = quantized
    floats, ours = linears(gemma.model), linears(loaded.model)
    by_weight: dict[int, list[str]] = {}
    for name, layer in floats.items():
        by_weight.setdefault(id(layer.weight), []).append(name)
    shared = [names for names in by_weight.values() if len(names) > 1]
    assert any("decoder.layers.0.self_attn" in n for names in shared for n in names)
    for names in shared:
        first = ours[names[0]]
        if type(first) is torch.nn.Linear:  # kept float: one Parameter, as transformers ties it
            assert all(ours[n].weight is first.weight for n in names), names
            continue
        assert all(ours[n] is first for n in names), names
