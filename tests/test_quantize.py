"""int8 weights (models/quantize.py): exact integer arithmetic, a bounded error against float32,
every cache policy and batching on quantized folders, and one-line refusals (int4: test_int4.py)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from checkpoints import write_dream, write_llada
from cli_fixtures import invoke
from decode_fixtures import KINDS, one_thread, prompts, settings, tiny  # noqa: F401

from dllm_cli.decoding import decode
from dllm_cli.errors import ModelLoadError, ProfileError
from dllm_cli.models.loading import load_model, weight_files
from dllm_cli.models.quantize import (
    SCHEMES,
    Int8Linear,
    load_dtype,
    quantize_model,
    quantize_rows,
    weight_bytes,
)
from dllm_cli.profiles import resolve

POLICIES = ("none", "prefix", "dual", "freecache")
WRITERS = {"llada": write_llada, "dream": write_dream}


def linear_pair(k: int = 96, n: int = 40, bias: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias)
    return lin, Int8Linear.of(lin.weight, lin.bias)


def test_int8_linear_is_exact_integer_arithmetic_rescaled():
    """Output = (q_x . q_w) * s_x * s_w + b, the int32 sums exact (checked in float64)."""
    lin, q = linear_pair()
    x = torch.randn(3, 5, 96)
    qx, sx = quantize_rows(x.reshape(-1, 96))
    acc = qx.double() @ q.qweight.double()  # (15, 40): integers, exact in float64
    want = acc * sx.double() * q.scale.double() + lin.bias.double()
    got = q(x)
    assert got.shape == (3, 5, 40) and got.dtype == torch.float32
    torch.testing.assert_close(got.reshape(-1, 40).double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_error_within_the_rounding_bound(bias):
    """|y_q - y| <= (s_x |w|_1 + s_w |x|_1) / 2 + K s_x s_w / 4 per element: each factor is off
    by at most half its step (the documented tolerance, docs/quantization.md)."""
    lin, q = linear_pair(bias=bias, seed=3)
    x = torch.randn(7, 96) * 3
    want = lin(x).detach()
    _, sx = quantize_rows(x)  # (7, 1)
    sw = q.scale  # (1, 40)
    w1 = lin.weight.detach().abs().sum(-1)[None]  # (1, 40)
    x1 = x.abs().sum(-1, keepdim=True)  # (7, 1)
    bound = (sx * w1 + sw * x1) / 2 + 96 * sx * sw / 4 + 1e-5
    err = (q(x) - want).abs()
    assert (err <= bound).all()
    assert err.max() < 0.02 * want.abs().max()  # and small in practice (about 1% here)


def test_quantize_model_swaps_projections_and_cuts_weight_memory():
    lm = tiny("dream", seed=1)
    model = copy.deepcopy(lm.model)
    before = weight_bytes(model)
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert linears == 2 * 7 + 1  # 7 per layer, and the head
    assert quantize_model(model, "int8") == linears - 1  # all but the first block's down_proj
    left = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    assert left == ["model.layers.0.mlp.down_proj"]
    assert weight_bytes(model) < before


@pytest.mark.parametrize("kind", [*KINDS, "llada_moe"])
def test_fused_int8_groups_equal_their_separate_layers(kind):
    """q/k/v (and gate/up) quantized as one layer give bit for bit the separate layers' output."""
    model = copy.deepcopy(tiny(kind, seed=4).model)
    quantize_model(model, "int8")
    ids = torch.tensor([[5, 9, 12, 30, 7, 39]])
    with torch.inference_mode():
        fused = model(ids)
        for m in model.modules():
            if m.__dict__.get("fusion") is not None:
                assert m.fusion.intact()
                m.fusion = None  # the separate (view) layers
        separate = model(ids)
    assert torch.equal(fused, separate)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", POLICIES)
def test_quantized_folder_decodes_with_every_policy(kind, cache, tmp_path, record_property):
    """A real folder quantized at load: every policy decodes, exact where float is (refreshing
    every step equals no cache), batch rows equal their single decodes; agreement with float32
    is recorded."""
    folder = WRITERS[kind](tmp_path / kind, dtype=torch.float32).folder
    q = load_model(folder, device="cpu", quantize="int8")
    f = load_model(folder, device="cpu")
    left = {n.rpartition(".")[2] for n, m in q.model.named_modules() if type(m) is torch.nn.Linear}
    assert left <= {"down_proj", "ff_out"}  # the first block's MLP output projection only
    ps = prompts([5, 8], seed=2)
    s = settings(cache=cache, unmask="threshold", threshold=0.3)
    got = decode(q.model, q.special, ps, s)
    alone = [decode(q.model, q.special, [p], s).tokens[0] for p in ps]
    assert got.tokens == alone
    if cache != "none":
        fresh = settings(cache=cache, unmask="threshold", threshold=0.3, refresh_interval=1)
        none = settings(unmask="threshold", threshold=0.3)
        want = decode(q.model, q.special, ps, none).tokens
        assert decode(q.model, q.special, ps, fresh).tokens == want
    ref = decode(f.model, f.special, ps, s).tokens
    same = sum(
        a == b for r, g in zip(ref, got.tokens, strict=True) for a, b in zip(r, g, strict=True)
    )
    record_property("agreement_with_float32", same / sum(map(len, ref)))


def test_unknown_quantization_is_refused(tmp_path):
    folder = write_dream(tmp_path / "d").folder
    with pytest.raises(ModelLoadError, match="unknown quantization 'int3'"):
        load_model(folder, device="cpu", quantize="int3")


def test_int8_on_a_bfloat16_load_keeps_the_model_dtype(tmp_path):
    """Loading in bfloat16 halves the peak before quantizing; activations stay bfloat16."""
    folder = write_llada(tmp_path / "l").folder
    lm = load_model(folder, device="cpu", dtype="bfloat16", quantize="int8")
    logits = lm.model(torch.tensor([[5, 6, 7, lm.special.mask]]))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_cli_guided_batch_with_int8_on_the_shipped_pair():
    """The shipped Dream model quantized, its AR guide as loaded, two prompts in one batch."""
    prompts = (
        "Tom has 3 apples and buys 4 more. How many apples does he have?\n"
        "Ann has 5 pens and gives away 2. How many pens are left?\n"
    )
    result = invoke(
        "generate", "-", "-p", "tiny-gsm-dream", "--quantize", "int8", "--gen-length", "64",
        "--batch-size", "2", "--json", input=prompts,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["text"].endswith(("7.", "3.")) for r in rows] == [True, True], rows
    assert all(r["guide_forwards"] > 0 for r in rows)


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_folder_read_as_stored_quantizes_as_float32_would(kind, tmp_path):
    """A bfloat16 folder under int8 is read in bfloat16 (half the peak) and cast after: the
    logits equal quantizing its float32 load."""
    folder = WRITERS[kind](tmp_path / kind).folder  # bfloat16 weights, as real folders
    files = weight_files(folder)
    assert load_dtype(SCHEMES["int8"], torch.float32, files) == torch.bfloat16
    assert load_dtype(SCHEMES["none"], torch.float32, files) == torch.float32
    q = load_model(folder, device="cpu", quantize="int8")
    f = load_model(folder, device="cpu")
    quantize_model(f.model, "int8")
    assert q.model.get_input_embeddings().weight.dtype == torch.float32
    fusions = [m.fusion for m in q.model.modules() if m.__dict__.get("fusion") is not None]
    assert fusions and all(f.intact() for f in fusions)  # the cast float group joined again
    ids = torch.tensor([[5, 6, 7, 8, q.special.mask, q.special.mask]])
    with torch.inference_mode():
        assert torch.equal(q.model(ids), f.model(ids))


def test_profile_key_quantize_is_read_and_checked(tmp_path):
    folder = write_dream(tmp_path / "d").folder
    good = tmp_path / "good.toml"
    good.write_text(f'name = "q"\n[model]\npath = "{folder}"\nquantize = "int8"\n')
    prof, provenance = resolve(str(good))
    assert prof.model.quantize == "int8" and provenance["model.quantize"].startswith("profile ")
    bad = tmp_path / "bad.toml"
    bad.write_text(f'name = "q"\n[model]\npath = "{folder}"\nquantize = "fp4"\n')
    with pytest.raises(ProfileError, match="quantize in \\[model\\] must be one of none, int8"):
        resolve(str(bad))


@pytest.mark.parametrize("kind", ["sdar", "llada2"])
def test_block_families_quantize_to_int8_and_decode(kind, tmp_path):
    """SDAR and LLaDA2.x folders load with --quantize int8 (every projection but the router and
    the first block's down_proj an int8 layer), decode, and batch rows equal their single runs."""
    from block_checkpoints import write_llada2, write_sdar

    folder = {"sdar": write_sdar, "llada2": write_llada2}[kind](tmp_path / kind).folder
    q = load_model(folder, device="cpu", quantize="int8")
    left = [n for n, m in q.model.named_modules() if type(m) is torch.nn.Linear]
    assert left == ["model.layers.0.mlp.down_proj"]
    assert sum(isinstance(m, Int8Linear) for m in q.model.modules()) > 0
    ps = prompts([5, 8], seed=2)
    s = settings(gen_length=8, block_length=4, cache="prefix", unmask="threshold")
    got = decode(q.model, q.special, ps, s)
    assert got.tokens == [decode(q.model, q.special, [p], s).tokens[0] for p in ps]
    result = invoke(
        "generate", "--model", str(folder), "--quantize", "int8", "--gen-length", "8", "hi"
    )
    assert result.exit_code == 0, result.output
