"""Our AR guide (models/causal.py) against transformers' Llama / Qwen2 / Qwen3 on random folders."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from dllm_cli.cache import KVCache
from dllm_cli.decoding.guide_cache import GuideCache
from dllm_cli.errors import ModelLoadError
from dllm_cli.models.causal import CausalLM, guide_config
from dllm_cli.models.guide import guide_config_of
from dllm_cli.models.weights import check_weights, meta_skeleton, read_weights

SHAPE = dict(
    vocab_size=50,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    max_position_embeddings=256,
)
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CASES = {
    "llama": (LlamaForCausalLM, LlamaConfig, {}),
    "llama-tied-llama3": (
        LlamaForCausalLM,
        LlamaConfig,
        {"rope_parameters": LLAMA3, "tie_word_embeddings": True},
    ),
    "llama-linear-bias": (
        LlamaForCausalLM,
        LlamaConfig,
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}
        | {"attention_bias": True, "mlp_bias": True},
    ),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, {}),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, {"head_dim": 16}),
}


def write_folder(tmp_path, case: str):
    """A random transformers model saved as a folder, and the model itself (float32)."""
    cls, config_cls, extra = CASES[case]
    torch.manual_seed(0)
    ref = cls(config_cls(**SHAPE, **extra)).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    ref.save_pretrained(tmp_path)
    return ref


def ours(folder) -> CausalLM:
    config = guide_config_of(folder)
    assert config is not None
    with meta_skeleton():
        model = CausalLM(config)
    check_weights(folder, model)
    return read_weights(folder, model, torch.float32).eval()


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_transformers(tmp_path, case):
    """Same logits as transformers' class on every attended slot (left padding, offset positions)."""
    ref = write_folder(tmp_path, case)
    model = ours(tmp_path)
    ids = torch.randint(0, 50, (2, 9))
    positions = torch.arange(9)[None].expand(2, 9) + 3
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :2] = 0  # row 1 is left-padded; its padding queries attend nothing
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        got = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1, 2:], want[1, 2:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_cached_incremental_logits_equal_the_full_forward(tmp_path, case):
    """Feeding a sequence in chunks through the cache (cropping one slot on the way, as the
    guide cache does) gives the full forward's logits; a forward the cache has room for
    writes into it (no copy of the cache), the attention mask saying how much is cached."""
    write_folder(tmp_path, case)
    model = ours(tmp_path)
    ids = torch.randint(0, 50, (1, 14))
    with torch.no_grad():
        full = model(input_ids=ids).logits
        first = model(input_ids=ids[:, :5])
        kv = first.past_key_values
        kv = KVCache([k[:, :, :-1] for k in kv.k], [v[:, :, :-1] for v in kv.v])  # fed again
        rest = model(input_ids=ids[:, 4:12], past_key_values=kv, logits_to_keep=8).logits
        assert kv.width == 15  # 12 slots and a quarter more room
        store = kv.k[0].data_ptr()
        mask = torch.ones((1, 14), dtype=torch.long)
        last = model(input_ids=ids[:, 12:], attention_mask=mask, past_key_values=kv).logits
        assert kv.k[0].data_ptr() == store
    torch.testing.assert_close(first.logits, full[:, :5], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rest, full[:, 4:12], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last, full[:, 12:], rtol=1e-5, atol=1e-5)


def test_guide_cache_drives_ours_like_transformers(tmp_path):
    """GuideCache (admission, forward, keep, compact's crop and repack, a row dropped) gives
    the same logits on both models (ours on a KVCache, transformers' on its DynamicCache)."""
    ref = write_folder(tmp_path, "qwen2")
    model = ours(tmp_path)
    outs = []
    for m in (ref, model):
        cache = GuideCache(m)
        cache.reset(0, torch.device("cpu"))
        with torch.no_grad():
            cache.admit([[5, 6, 7, 8], [9]], torch.tensor([0, 1]), pad_id=0)
            feed = torch.tensor([[8, 10, 11], [9, 12, 0]])
            positions = torch.tensor([[3, 4, 5], [0, 1, 2]])
            first = cache.forward(feed, positions, pad_id=0, last=3)
            cache.keep(torch.tensor([2, 1]), fed=3)  # a hole in row 1, the last slot cropped
            cache.compact()
            second = cache.forward(
                torch.tensor([[11, 13], [12, 14]]), positions[:, :2] + 2, 0, last=2
            )
            cache.keep(torch.tensor([0, 2]), fed=2)
            cache.compact()  # 2 of 7 slots are holes: repacked
            assert cache.valid.tolist() == [[True] * 5, [True] * 3 + [False] * 2]
            cache.select(torch.tensor([1]))  # row 0 leaves: dropped at the next forward
            third = cache.forward(torch.tensor([[15, 16]]), torch.tensor([[4, 5]]), 0, last=2)
            assert len(cache.valid) == 1
        outs.append((first, second, third))
    torch.testing.assert_close(outs[1][0][0], outs[0][0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1][0][1, :2], outs[0][0][1, :2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1][1:], outs[0][1:], rtol=1e-5, atol=1e-5)


def test_other_types_and_rope_scalings_go_to_transformers(tmp_path):
    """A config this module does not implement is left to transformers (None), not run wrongly."""
    base = {**SHAPE, "model_type": "llama"}
    assert guide_config(base) is not None
    assert guide_config({**base, "model_type": "gpt2"}) is None
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    assert guide_config({**base, "rope_parameters": yarn}) is None
    assert guide_config({**base, "rope_scaling": {"type": "dynamic", "factor": 2.0}}) is None
    assert guide_config({**base, "model_type": "qwen2", "use_sliding_window": True}) is None


def test_a_config_missing_a_field_is_one_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelLoadError, match=r"bad config\.json"):
        guide_config_of(tmp_path)


@pytest.mark.parametrize(
    "name", ["dream", "llada", "llada_moe", "tiny-gsm", "tiny-gsm-dream", "tiny-gsm-ar"]
)
def test_guide_vocab_equals_autotokenizers(tmp_path, name):
    """The guide's vocabulary read by `tokenizers` is AutoTokenizer's get_vocab()."""
    import checkpoints

    from dllm_cli.folders import BUILTIN_DIR
    from dllm_cli.models.guide import guide_vocab
    from dllm_cli.models.loading import load_tokenizer

    writers = {
        "dream": checkpoints.write_dream_tokenizer,
        "llada": checkpoints.write_llada_tokenizer,
        "llada_moe": checkpoints.write_llada_moe_tokenizer,
    }
    if name in writers:
        writers[name](tmp_path)
        folder = tmp_path
    else:
        folder = BUILTIN_DIR / name  # the shipped folders
    assert guide_vocab(folder) == load_tokenizer(folder).get_vocab()
