"""int4 weights (models/int4.py): the group-wise format against a float reference, torch's own
int4 kernel on the same codes, the kernel choice per device, group-size refusals, memory, and
quantized folders of every family decoding."""

from __future__ import annotations

import copy

import pytest
import torch
from checkpoints import write_dream, write_llada, write_llada_moe
from cli_fixtures import error_lines, invoke
from decode_fixtures import one_thread, prompts, settings, tiny  # noqa: F401

from dllm_cli.decoding import decode
from dllm_cli.errors import ModelLoadError
from dllm_cli.models.int4 import (
    Int4Linear,
    Narrowed,
    check_group,
    kernel_for,
    pack_halves,
    pack_nibbles,
    quantize_groups,
    unpack_halves,
)
from dllm_cli.models.loading import load_model
from dllm_cli.models.quantize import Int8Linear, quantize_model, weight_bytes

# Folders whose every projection input is a multiple of 32 (the default group size).
WIDE = {
    "llada": lambda p: write_llada(p, dtype=torch.float32, mlp_hidden_size=64),
    "dream": lambda p: write_dream(p, dtype=torch.float32, intermediate_size=64),
    "llada_moe": lambda p: write_llada_moe(
        p, expert_intermediate_size=32, dense_intermediate_size=64
    ),
}


def weight(out: int = 40, k: int = 96, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(out, k)


def test_codes_and_pairs_reproduce_each_weight_within_half_a_step():
    """|w - dequantized| <= scale / 2 per weight (min/max rounding, no search), plus bfloat16's
    rounding of the zero; codes are 0..15 and pack two a byte losslessly."""
    w = weight()
    codes, pairs = quantize_groups(w, 32, search=False)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    assert torch.equal(unpack_halves(pack_halves(codes, 32), 32), codes)
    pairs_of_inputs = pack_nibbles(codes)  # tinygemm's order: input 2i high, 2i + 1 low
    assert torch.equal(pairs_of_inputs >> 4, codes[:, ::2]) and torch.equal(
        pairs_of_inputs & 15, codes[:, 1::2]
    )
    scale, zero = pairs.float().unbind(-1)  # (out, G) each
    step = scale.repeat_interleave(32, dim=1)  # (out, in)
    slack = zero.abs().repeat_interleave(32, dim=1) * 2**-8
    err = ((codes.float() - 8) * step + zero.repeat_interleave(32, dim=1) - w).abs()
    assert (err <= step / 2 + slack + 1e-6).all()


@pytest.mark.parametrize("bias", [True, False])
def test_int4_matmul_matches_its_float_reference(bias):
    """The layer's output equals x @ W_q^T (+ b) in float64 within bfloat16's rounding of the
    activations and the products (relative 1%: 2^-8 each, measured 0.3%)."""
    w = weight(seed=2)
    b = torch.randn(40) if bias else None
    layer = Int4Linear.of(w, b)
    x = torch.randn(3, 5, 96)
    want = x.double() @ layer.dequantized(torch.float32).double().t()
    if bias:
        want = want + b.double()
    got = layer(x)
    assert got.shape == (3, 5, 40) and got.dtype == torch.float32
    rel = (got.double() - want).norm() / want.norm()
    assert rel < 0.01
    # ... and the float32 layer it replaces, within int4's own error (7.8% on these weights).
    exact = torch.nn.functional.linear(x, w, b)
    assert (got - exact).norm() / exact.norm() < 0.12


def test_torch_int4_kernel_reads_the_same_codes_and_pairs():
    """torch's tinygemm CPU twin (the "tinygemm-cpu" kernel), on the codes and (G, out, 2)
    pairs the CUDA path hands its kernel, multiplies by the same weights (the layout and the
    zero's sign are right), its fused parts narrowed."""
    w = weight(out=64, k=128, seed=5)
    x = torch.randn(7, 128)
    ours = Int4Linear.of(w)(x)
    layer = Int4Linear.of(w, kernel="tinygemm-cpu")
    theirs = layer(x)
    assert layer.kernel == "tinygemm-cpu" and theirs.dtype == torch.float32
    assert (theirs - ours).norm() / ours.norm() < 0.01
    assert torch.equal(layer.part(8, 40)(x), theirs[:, 8:40])


def test_kernel_choice_per_device_and_shape():
    """CPU runs the dequant path; CUDA runs tinygemm where its tiles fit, dequant elsewhere."""
    assert kernel_for("cpu", 1408, 512, 32) == "dequant"
    assert kernel_for("cuda", 1408, 512, 32) == "tinygemm"
    assert kernel_for(torch.device("cuda", 1), 512, 512, 128) == "tinygemm"
    assert kernel_for("cuda", 405, 512, 32) == "dequant"  # outputs not a multiple of 8
    assert kernel_for("cuda", 512, 48, 32) == "dequant"  # inputs not a multiple of 32
    assert kernel_for("mps", 512, 512, 32) == "dequant"


@pytest.mark.parametrize("group", [0, 16, 48, 512])
def test_unsupported_group_sizes_are_refused(group):
    with pytest.raises(ModelLoadError, match=f"int4 group size {group} is not supported"):
        check_group(group, 1024)


def test_a_group_size_that_does_not_divide_a_layer_is_refused_before_any_change(tmp_path):
    """LLaDA's test folder has 48 MLP channels: group 32 cannot cover its ff_out."""
    folder = write_llada(tmp_path / "l").folder
    with pytest.raises(ModelLoadError, match=r"group size 32 does not divide .*ff_out's 48"):
        load_model(folder, device="cpu", quantize="int4")
    with pytest.raises(ModelLoadError, match="group size 64 does not divide a layer's 96"):
        Int4Linear.of(weight(k=96), group=64)


def test_cli_refuses_a_bad_group_and_unknown_scheme_in_one_line(tmp_path):
    folder = write_llada(tmp_path / "l").folder
    cases = (("int4", "does not divide", 3), ("int3", "must be one of none, int8, int4", 2))
    for value, message, code in cases:  # a load error (3), a bad flag value (2)
        result = invoke("generate", "hi", "--model", str(folder), "--quantize", value)
        assert result.exit_code == code, result.output
        assert len(error_lines(result)) == 1 and message in result.stderr
        assert "Traceback" not in result.output


def test_weights_are_stored_in_four_bits():
    """Per layer: in/2 bytes of codes per output plus 4 bytes (bfloat16 scale and zero) per
    group of 32; the pairs stay bfloat16 bits through a model's `.to(float32)`."""
    layer = Int4Linear.of(weight(out=64, k=128))
    assert layer.packed.dtype == torch.uint8 and layer.packed.numel() == 64 * 128 // 2
    assert weight_bytes(layer) == 64 * 128 // 2 + 64 * (128 // 32) * 4
    layer.to(torch.float32)
    assert layer.pairs.dtype == torch.int16
    lm = tiny("dream", seed=1)
    f32, int8, int4 = (copy.deepcopy(lm.model) for _ in range(3))
    quantize_model(int8, "int8")
    assert quantize_model(int4, "int4") == quantize_model(copy.deepcopy(lm.model), "int8")
    assert weight_bytes(int4) < weight_bytes(int8) < weight_bytes(f32)
    # the output head in int8, as llama.cpp's Q4_0 keeps it at Q6_K; the blocks in int4
    assert isinstance(int4.lm_head, Int8Linear) and isinstance(int8.lm_head, Int8Linear)
    assert isinstance(int4.model.layers[1].mlp.down_proj, Int4Linear)


def test_parts_and_narrowed_parts_equal_the_joined_layer():
    """A fused group's views give its columns (sliced storage, or tinygemm's narrowed product)."""
    joined = Int4Linear.of(weight(out=96, k=64, seed=7), torch.randn(96))
    x = torch.randn(4, 64)
    whole = joined(x)
    assert torch.equal(joined.part(32, 96)(x), whole[:, 32:96])
    assert torch.equal(Narrowed(joined, 0, 32)(x), whole[:, :32])
    assert weight_bytes(Narrowed(joined, 0, 32)) == weight_bytes(joined)


@pytest.mark.parametrize("kind", ["llada", "dream", "llada_moe"])
def test_int4_folder_decodes_batched_as_alone(kind, tmp_path, record_property):
    """Every family int8 runs: a real folder quantized at load decodes, batch rows equal their
    single decodes, fused groups equal their separate views; agreement with float32 recorded."""
    folder = WIDE[kind](tmp_path / kind).folder
    q = load_model(folder, device="cpu", quantize="int4")
    f = load_model(folder, device="cpu")
    assert any(isinstance(m, Int4Linear) for m in q.model.modules())
    ps = prompts([5, 8], seed=2)
    s = settings(cache="dual", unmask="threshold", threshold=0.3)
    got = decode(q.model, q.special, ps, s)
    alone = [decode(q.model, q.special, [p], s).tokens[0] for p in ps]
    assert got.tokens == alone
    ids = torch.tensor([[5, 9, 12, 30, 7, q.special.mask]])
    with torch.inference_mode():
        fused = q.model(ids)
        for m in q.model.modules():
            if m.__dict__.get("fusion") is not None:
                assert m.fusion.intact()
                m.fusion = None
        torch.testing.assert_close(q.model(ids), fused)
    ref = decode(f.model, f.special, ps, s).tokens
    same = sum(
        a == b for r, g in zip(ref, got.tokens, strict=True) for a, b in zip(r, g, strict=True)
    )
    record_property("agreement_with_float32", same / sum(map(len, ref)))


def test_int4_on_a_bfloat16_load_keeps_the_model_dtype(tmp_path):
    folder = write_dream(tmp_path / "d", intermediate_size=64).folder
    lm = load_model(folder, device="cpu", dtype="bfloat16", quantize="int4")
    logits = lm.model(torch.tensor([[5, 6, 7, lm.special.mask]]))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


@pytest.mark.slow
def test_cli_shipped_model_under_int4_writes_float32s_answer():
    """The shipped Dream model in 4 bits, unguided, answers what float32 answers for this problem
    (a wrong 9 in both: the diffusion model alone; the guide's 7 is int8's test). The text may
    differ in a token (int4 writes "9.." where float32 writes "9."): its accuracy is measured
    on 100 problems (docs/quantization.md)."""
    texts = []
    for quantize in ("none", "int4"):
        result = invoke(
            "generate", "Tom has 3 apples and buys 4 more. How many apples does he have?",
            "-p", "tiny-gsm-dream", "--quantize", quantize, "--gen-length", "64", "--no-guide",
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        texts.append(result.stdout.strip())
    assert all(t.endswith("The answer is 9.") for t in texts), texts
    assert texts[1].startswith("Tom has 3 apples and buys 4 more. 3 + 4 = 9"), texts
