"""Tiny random SDAR and LLaDA2.x folders in their real formats (names, config.json fields)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.checkpoints import (
    Written,
    _random_tensors,
    mlp_shapes,
    qwen_attention_shapes,
    save_weights,
    write_dream_tokenizer,
    write_json,
    write_llada_moe_tokenizer,
    write_weights,
)

SDAR_SHAPE = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


def write_sdar(folder: Path, *, seed: int = 5, block_size: int = 4, **overrides) -> Written:
    """An SDAR folder (Qwen3 names, `block_size` and `mask_token_id` in config.json); every norm
    weight, q_norm and k_norm included, randomised; float32."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = write_dream_tokenizer(folder)  # Qwen2 byte-level BPE with <|mask|> and <|im_end|>
    tok_cfg = folder / "tokenizer_config.json"
    data = json.loads(tok_cfg.read_text())
    data.pop("auto_map")
    data["tokenizer_class"] = "Qwen2Tokenizer"
    write_json(tok_cfg, data)
    cfg = {
        "architectures": ["SDARForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig"},
        "attention_bias": False,
        "block_size": block_size,
        "bos_token_id": ids["eos"],
        "eos_token_id": ids["eos"],
        "hidden_act": "silu",
        "mask_token_id": ids["mask"],
        "max_position_embeddings": 512,
        "model_type": "sdar",
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_sliding_window": False,
        "vocab_size": ids["vocab_size"] + 3,  # padded rows past the tokenizer
        **SDAR_SHAPE,
    }
    cfg.update(overrides)
    d, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv, ffn = (
        cfg["num_attention_heads"] * hd,
        cfg["num_key_value_heads"] * hd,
        cfg["intermediate_size"],
    )
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= qwen_attention_shapes(p, d, q, kv, head_norm=hd) | mlp_shapes(p + "mlp.", ffn, d)
    shapes |= {"model.norm.weight": (d,), "lm_head.weight": (cfg["vocab_size"], d)}
    return write_weights(folder, ids, cfg, shapes, torch.float32, seed, 1)


LLADA2_SHAPE = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 3,  # layer 0 dense, then MoE
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 3,
    "n_group": 4,
    "topk_group": 2,
    "moe_intermediate_size": 12,
    "num_shared_experts": 1,
    "first_k_dense_replace": 1,
}


def write_llada2(folder: Path, *, seed: int = 7, **overrides) -> Written:
    """A LLaDA2.x folder (fused QKV, q/k norms, partial RoPE, grouped sigmoid router with an
    expert bias, shared expert, dense first layer); norms and expert_bias randomised."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = write_llada_moe_tokenizer(folder)  # the same tokenizer family (<|mask|>, eos)
    cfg = {
        "architectures": ["LLaDA2MoeModelLM"],
        "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig"},
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "model_type": "llada2_moe",
        "moe_router_enable_expert_bias": True,
        "norm_topk_prob": True,
        "pad_token_id": ids["pad"],
        "eos_token_id": ids["eos"],
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 600000,
        "routed_scaling_factor": 2.5,
        "router_dtype": "fp32",
        "score_function": "sigmoid",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_bias": False,
        "use_qk_norm": True,
        "use_qkv_bias": False,
        "vocab_size": ids["vocab_size"] + 3,
        **LLADA2_SHAPE,
    }
    cfg.update(overrides)
    write_json(folder / "config.json", cfg)
    d, hd, e = cfg["hidden_size"], cfg["head_dim"], cfg["num_experts"]
    h, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    ffn, dense = cfg["moe_intermediate_size"], cfg["intermediate_size"]
    shapes = {"model.word_embeddings.weight": (cfg["vocab_size"], d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "attention.query_key_value.weight": ((h + 2 * kv) * hd, d),
            p + "attention.query_layernorm.weight": (hd,),
            p + "attention.key_layernorm.weight": (hd,),
            p + "attention.dense.weight": (d, h * hd),
        }
        if i < cfg["first_k_dense_replace"]:
            shapes |= mlp_shapes(p + "mlp.", dense, d)
            continue
        shapes |= {p + "mlp.gate.weight": (e, d), p + "mlp.gate.expert_bias": (e,)}
        for j in [*range(e), "shared"]:
            q = f"{p}mlp.experts.{j}." if j != "shared" else f"{p}mlp.shared_experts."
            shapes |= mlp_shapes(q, ffn * cfg["num_shared_experts"] if j == "shared" else ffn, d)
    shapes |= {"model.norm.weight": (d,), "lm_head.weight": (cfg["vocab_size"], d)}
    tensors = _random_tensors(shapes, torch.float32, seed)
    for name in [n for n in tensors if n.endswith("expert_bias")]:  # router bias: O(0.1)
        tensors[name] = 0.3 * torch.randn(e, generator=torch.Generator().manual_seed(seed + 1))
    save_weights(folder, tensors, 1)
    return Written(folder, tensors, cfg, ids)
