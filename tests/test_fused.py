"""Fused projections and the other forward shortcuts give the very same numbers, in less work."""

from __future__ import annotations

import copy

import pytest
import torch
from decode_fixtures import SPECIAL, prompts, settings, tiny

from dllm_cli.cache import KVCache
from dllm_cli.decoding import Decoder, decode
from dllm_cli.models.fused import MKL_PACKED, ONEDNN_PACKED, FusedLinear, PackedWeight
from dllm_cli.models.layers import RMSNorm, apply_rope, rope_tables


def fused_copy(model):
    twin = copy.deepcopy(model)
    twin.fuse_projections()
    return twin


def forwards(model, ids):
    """A full forward, then a cached window in the middle (what decoding runs)."""
    s, e = 8, 14
    cache = KVCache.for_model(model, ids.shape[0], ids.shape[1])
    full = model(ids, cache=cache)
    window = model(ids[:, s:e], cache=cache, columns=slice(s, e))
    return full, window, cache


@pytest.mark.parametrize("kind", ["llada", "dream"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_fused_forward_is_bit_identical(kind, dtype):
    plain = copy.deepcopy(tiny(kind, seed=4).model).to(dtype)
    fused = fused_copy(plain)
    ids = torch.randint(4, 39, (2, 20), generator=torch.Generator().manual_seed(0))
    want, got = forwards(plain, ids), forwards(fused, ids)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for k_got, k_want in zip(got[2].k, want[2].k, strict=True):
        assert torch.equal(k_got, k_want)


@pytest.mark.parametrize("kind", ["llada", "dream"])
def test_fusing_keeps_names_values_and_memory(kind):
    plain = tiny(kind, seed=4).model
    fused = fused_copy(plain)
    want, got = plain.state_dict(), fused.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    block = fused.blocks()[0]
    qkv = (block.fusion if kind == "llada" else block.self_attn.fusion).qkv
    storage = qkv.weight.untyped_storage().data_ptr()
    for lin in qkv.linears:  # views into one matrix: no second copy of the weights
        assert lin.weight.untyped_storage().data_ptr() == storage
    assert fused.output_linear().weight.t().is_contiguous()  # the head stored (in, out)
    size = sum(p.numel() for p in plain.parameters())
    storages = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in fused.parameters()
    }
    assert sum(storages.values()) == size * 4  # float32 bytes, nothing duplicated


@torch.inference_mode()
def test_replaced_weights_fall_back_to_the_separate_linears():
    """A fused layer whose parameters were swapped out (e.g. by .to()) must not use stale weights."""
    plain = copy.deepcopy(tiny("llada", seed=4).model)
    fused = fused_copy(plain)
    new = torch.randn_like(plain.blocks()[0].k_proj.weight)
    for model in (plain, fused):
        model.blocks()[0].k_proj.weight = torch.nn.Parameter(new.clone())
    assert not fused.blocks()[0].fusion.intact()
    ids = torch.randint(4, 39, (1, 12), generator=torch.Generator().manual_seed(1))
    assert torch.equal(fused(ids), plain(ids))


@pytest.mark.parametrize("length", [32, 511])
def test_cpu_float32_rms_norm_shortcut_is_the_formula(length):
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(64))
    x = torch.randn(2, length, 64)
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    with torch.inference_mode():  # the in-place formula
        assert torch.equal(norm(x), h * norm.weight)
    with torch.enable_grad():  # F.rms_norm's one call (autograd keeps what it needs)
        assert torch.equal(norm(x), h * norm.weight)


def test_rope_table_rows_equal_direct_tables():
    model = tiny("llada", seed=4).model
    positions = torch.tensor([[0, 1, 2, 300, 511], [7, 5, 3, 1, 0]])
    direct = rope_tables(positions, model.config.head_dim, model.rope_theta)
    cos, sin, signed = model.rope_at(positions, torch.float32)
    assert torch.equal(cos, direct[0]) and torch.equal(sin, direct[1])
    half = sin.shape[-1] // 2
    assert torch.equal(signed, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1))


def test_rope_by_roll_is_rotate_half_bit_for_bit():
    """The signed-sin roll (layers.apply_rope with a model's table) is the textbook rotation."""
    model = tiny("llada", seed=4).model
    positions = torch.tensor([[3, 4, 5, 6], [0, 9, 40, 511]])
    cos, sin, signed = model.rope_at(positions, torch.float32)
    x = torch.randn(2, 4, 6, model.config.head_dim).transpose(1, 2)  # (B, H, T, D), strided
    half = x.shape[-1] // 2
    textbook = x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
    for got in (apply_rope(x, cos, sin, True, signed), apply_rope(x, cos, sin, True)):
        assert torch.equal(got, textbook)


def test_fused_model_decodes_the_same_tokens():
    plain = tiny("dream", seed=2).model
    fused = fused_copy(plain)
    ps = prompts([5, 9, 3], seed=4)
    for cache in ("dual", "freecache"):
        s = settings(cache=cache, unmask="threshold", threshold=0.5)
        assert decode(fused, SPECIAL, ps, s).tokens == decode(plain, SPECIAL, ps, s).tokens
        # rows apart: per-row (B, T) columns and logit picks through the fused forward
        apart = Decoder(fused, SPECIAL, s).run(ps, lockstep=False).result().tokens
        assert apart == Decoder(plain, SPECIAL, s).run(ps, lockstep=False).result().tokens


def test_loaded_checkpoints_are_fused(llada, dream):
    assert llada.model.blocks()[0].fusion is not None
    assert dream.model.blocks()[0].self_attn.fusion is not None


def test_wide_models_stay_unfused_on_cpu():
    """Fusing was measured to cost on CPU past d_model 512 (models/fused.py); CUDA fuses."""
    from dllm_cli.models.fused import CPU_FUSE_MAX_WIDTH, worth_fusing

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert worth_fusing(CPU_FUSE_MAX_WIDTH, cpu) and not worth_fusing(CPU_FUSE_MAX_WIDTH + 1, cpu)
    assert worth_fusing(4096, cuda)
    wide = copy.deepcopy(tiny("llada").model)
    wide.get_input_embeddings = lambda: torch.nn.Embedding(1, CPU_FUSE_MAX_WIDTH + 1)
    wide.fuse_projections()
    assert wide.blocks()[0].fusion is None


@pytest.mark.skipif(not ONEDNN_PACKED, reason="torch built without oneDNN")
@torch.no_grad()  # as decoding runs (inference mode would keep no count of weight writes)
def test_onednn_packed_gemm_serves_every_row_count_and_follows_weight_writes():
    """oneDNN's packed weight is made on the first call, serves any row count, matches the
    plain GEMM to float32 rounding, and is remade after an in-place write to the weight."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(1408, 96, bias=True)
    fused = FusedLinear(lin)
    plain = lambda x: torch.addmm(fused.bias, x, fused.weight)  # noqa: E731
    x, other = torch.randn(32, 1408), torch.randn(40, 1408)  # over PACK_MIN_MACS
    assert torch.allclose(fused(x), plain(x), rtol=1e-5, atol=1e-5)
    pack = fused.packed.pack
    assert pack is not None
    assert torch.allclose(fused(other), plain(other), rtol=1e-5, atol=1e-5)
    assert fused.packed.pack is pack  # one pack for every row count
    lin.weight.mul_(2)  # the view writes the fused storage
    assert torch.allclose(fused(x), plain(x), rtol=1e-5, atol=1e-5)
    assert fused.packed.version == fused.weight._version and fused.packed.pack is not pack
    with torch.enable_grad():
        assert fused(x.requires_grad_()).requires_grad  # autograd takes the plain GEMM


@pytest.mark.skipif(not MKL_PACKED, reason="torch built without MKL")
@torch.no_grad()  # as decoding runs (inference mode would keep no count of weight writes)
def test_packed_gemm_serves_a_repeated_row_count_and_follows_weight_writes():
    """MKL's packed weight (where torch has no oneDNN) is made on the second call in a row at
    one row count, matches the plain GEMM to float32 rounding, and is remade after an in-place
    write to the weight."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(1408, 96, bias=True)
    fused = FusedLinear(lin)
    fused.packed = PackedWeight(fused.weight)
    plain = lambda x: torch.addmm(fused.bias, x, fused.weight)  # noqa: E731
    x, other = torch.randn(32, 1408), torch.randn(5, 1408)  # 32 rows: over PACK_MIN_MACS
    assert torch.equal(fused(x), plain(x)) and fused.packed.pack is None  # first call: plain
    assert torch.allclose(fused(x), plain(x), rtol=1e-5, atol=1e-5)
    assert fused.packed.rows == 32
    assert torch.equal(fused(other), plain(other))  # a one-off row count: the plain GEMM
    lin.weight.mul_(2)  # the view writes the fused storage
    assert torch.allclose(fused(x), plain(x), rtol=1e-5, atol=1e-5)
    assert fused.packed.version == fused.weight._version
