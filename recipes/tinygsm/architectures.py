"""The three shipped TinyGSM networks and how weights move between them.

All three have the same shapes (a Llama block), so an AR guide's weights initialise either
diffusion format: LLaDA's names (no logit shift, so the AR output mapping must be relearned) or
Dream's Qwen2 names (zero q/k/v biases; Dream keeps the AR shift, as Dream-7B kept Qwen2.5's).
A model trained with an older, smaller vocabulary grows into the current one: the tokenizer is
append-only, so old rows keep their ids and new rows start from a small random init.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from dllm_cli.models import DreamConfig, DreamModel, LLaDAConfig, LLaDAModelLM


def padded_vocab(n: int) -> int:
    """Embedding rows rounded up to a multiple of 8 (like LLaDA's embedding_size > vocab_size)."""
    return -(-n // 8) * 8


def llama_shape(cfg, tok) -> dict:
    """The Llama/Qwen2 config fields the guide and the Dream model share (so weights map 1:1)."""
    return {
        "vocab_size": padded_vocab(len(tok)),
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "max_position_embeddings": cfg.max_len,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": 1e-5,
    }


def build_ar(cfg, tok) -> LlamaForCausalLM:
    conf = LlamaConfig(
        **llama_shape(cfg, tok),
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("<|eot_id|>")],
        pad_token_id=tok.eos_token_id,
    )
    return LlamaForCausalLM(conf)


def build_llada(cfg, tok) -> LLaDAModelLM:
    conf = LLaDAConfig(
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_heads,
        n_layers=cfg.n_layers,
        mlp_hidden_size=cfg.mlp_hidden,
        mlp_ratio=4,
        rope_theta=cfg.rope_theta,
        max_sequence_length=cfg.max_len,
        vocab_size=len(tok),
        embedding_size=padded_vocab(len(tok)),
        mask_token_id=tok.mask_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        architectures=["LLaDAModelLM"],
    )
    return LLaDAModelLM(conf)


def build_dream(cfg, tok) -> DreamModel:
    """Dream's config has one vocab_size: the padded table (ids past the tokenizer are padding)."""
    conf = DreamConfig(
        **llama_shape(cfg, tok),  # the guide's: with a causal view Dream reproduces its logits
        mask_token_id=tok.mask_token_id,
        pad_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        architectures=["DreamModel"],
    )
    return DreamModel(conf)


# Llama parameter name -> LLaDA parameter name (the two blocks compute the same function).
_AR_TO_LLADA = {
    "self_attn.q_proj": "q_proj",
    "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj",
    "self_attn.o_proj": "attn_out",
    "mlp.gate_proj": "ff_proj",
    "mlp.up_proj": "up_proj",
    "mlp.down_proj": "ff_out",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ff_norm",
}


def ar_to_llada(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a Llama state dict to LLaDA's names (AR initialisation of the diffusion model)."""
    out = {}
    for name, w in state.items():
        if name == "model.embed_tokens.weight":
            out["model.transformer.wte.weight"] = w
        elif name == "model.norm.weight":
            out["model.transformer.ln_f.weight"] = w
        elif name == "lm_head.weight":
            out["model.transformer.ff_out.weight"] = w
        elif name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module, _, kind = rest.rpartition(".")
            out[f"model.transformer.blocks.{i}.{_AR_TO_LLADA[module]}.{kind}"] = w
    return out


def ar_to_dream(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Llama state dict in Dream's (Qwen2) names: the same names, plus zero q/k/v biases."""
    out = dict(state)
    for name, w in state.items():
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            out[name.replace(".weight", ".bias")] = torch.zeros(w.shape[0], dtype=w.dtype)
    return out


def grow_into(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> list[str]:
    """Load `state` into `model`; tensors whose first dim is smaller (vocabulary rows of an older
    tokenizer) fill the first rows and keep the model's fresh init for the rest. Returns the
    names that grew."""
    own = model.state_dict()
    merged, grown = {}, []
    for name, target in own.items():
        w = state[name]
        if w.shape != target.shape:
            rows_only = w.dim() == 2 and w.shape[1:] == target.shape[1:]
            if not rows_only or w.shape[0] > target.shape[0]:
                raise ValueError(f"{name}: {list(w.shape)} cannot grow into {list(target.shape)}")
            w = torch.cat([w.to(target.dtype), target[w.shape[0] :]])
            grown.append(name)
        merged[name] = w
    model.load_state_dict(merged)
    return grown


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """model.safetensors of an exported folder (a shipped model to continue training from)."""
    return load_file(str(Path(folder) / "model.safetensors"))
