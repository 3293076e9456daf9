"""Tiny random SDAR and LLaDA2.x folders in their real formats (names, config.json fields)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.checkpoints import (
    Written,
    _random_tensors,
    save_weights,
    write_dream_tokenizer,
    write_json,
    write_llada_moe_tokenizer,
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
    write_json(folder / "config.json", cfg)
    d, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv, ffn = (
        cfg["num_attention_heads"] * hd,
        cfg["num_key_value_heads"] * hd,
        cfg["intermediate_size"],
    )
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (ffn, d),
            p + "mlp.up_proj.weight": (ffn, d),
            p + "mlp.down_proj.weight": (d, ffn),
        }
    shapes |= {"model.norm.weight": (d,), "lm_head.weight": (cfg["vocab_size"], d)}
    tensors = _random_tensors(shapes, torch.float32, seed)
    save_weights(folder, tensors, 1)
    return Written(folder, tensors, cfg, ids)
