"""Tiny random checkpoints in the real LLaDA and Dream folder formats, so loader tests run offline."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

_TEXT = (
    "the a an is are of and to in on how many what if has have had more less than total "
    "apples pens books cats dogs tom ann sam day days each per left buys sells gives gets "
    "answer question user assistant system hello hi yes no 0 1 2 3 4 5 6 7 8 9 + - * / = ? . ,"
)
WORDS = tuple(_TEXT.split())

LLADA_SPECIALS = (
    "<|startoftext|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|mdm_mask|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
)
# Dream ids follow the BPE vocabulary in this order, as in Qwen2/Dream (151643...).
DREAM_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|beginoftext|>", "<|mask|>")

# LLaDA's chat format: BOS on the first message, Llama-3 style headers, <|eot_id|> after each turn.
LLADA_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if loop.first -%}{{ bos_token }}{%- endif -%}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif -%}"
)
QWEN_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if loop.first and m['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

# Small shapes that still exercise GQA (Dream), padded embedding rows (LLaDA) and several layers.
LLADA_SHAPE = {"d_model": 32, "n_heads": 4, "n_kv_heads": 4, "n_layers": 2, "mlp_hidden_size": 48}
DREAM_SHAPE = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@dataclass
class Written:
    """What a helper put on disk: the folder, the exact tensors, config.json and special ids."""

    folder: Path
    tensors: dict[str, torch.Tensor]
    config: dict
    ids: dict[str, int]


def write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _added(content: str) -> dict:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }


def _random_tensors(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, seed: int) -> dict:
    """Unit-scale activations (so logits are O(1) and attention is far from uniform); norm
    weights near 1 but not equal, so a mixed-up norm shows."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen)
        if name.endswith(".bias"):
            t = 0.1 * t
        elif len(shape) == 1:  # RMSNorm weights
            t = 1.0 + 0.1 * t
        elif "wte" not in name and "embed_tokens" not in name:
            t = t / shape[1] ** 0.5
        out[name] = t.to(dtype)
    return out


def save_weights(folder: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> None:
    """One model.safetensors, or `shards` files plus model.safetensors.index.json like HF writes."""
    if shards <= 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(folder / "model.safetensors.index.json", index)


def mlp_shapes(prefix: str, width: int, d: int) -> dict[str, tuple[int, ...]]:
    """A SwiGLU MLP's gate/up/down projection shapes under `prefix`."""
    return {
        prefix + "gate_proj.weight": (width, d),
        prefix + "up_proj.weight": (width, d),
        prefix + "down_proj.weight": (d, width),
    }


def qwen_attention_shapes(
    prefix: str, d: int, q: int, kv: int, *, bias: bool = False, head_norm: int = 0
) -> dict[str, tuple[int, ...]]:
    """A Qwen-named layer's norms and q/k/v/o shapes (q/k/v biases, q/k head norms optional)."""
    shapes = {prefix + "input_layernorm.weight": (d,)}
    shapes[prefix + "post_attention_layernorm.weight"] = (d,)
    for name, rows in (("q", q), ("k", kv), ("v", kv)):
        shapes[f"{prefix}self_attn.{name}_proj.weight"] = (rows, d)
        if bias:
            shapes[f"{prefix}self_attn.{name}_proj.bias"] = (rows,)
    shapes[prefix + "self_attn.o_proj.weight"] = (d, q)
    if head_norm:
        shapes[prefix + "self_attn.q_norm.weight"] = (head_norm,)
        shapes[prefix + "self_attn.k_norm.weight"] = (head_norm,)
    return shapes


def write_weights(
    folder: Path, ids: dict, cfg: dict, shapes: dict, dtype: torch.dtype, seed: int, shards: int
) -> Written:
    """config.json and random safetensors for `shapes`: what every folder helper ends with."""
    write_json(folder / "config.json", cfg)
    tensors = _random_tensors(shapes, dtype, seed)
    save_weights(folder, tensors, shards)
    return Written(folder, tensors, cfg, ids)


def word_level_tokenizer(folder: Path, specials: tuple[str, ...]) -> tuple[Tokenizer, dict]:
    """tokenizer.json: a word-level vocabulary of WORDS plus `specials`; their ids."""
    vocab = {"<unk>": 0} | {w: i + 1 for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.save(str(folder / "tokenizer.json"))
    return tok, {s: tok.token_to_id(s) for s in specials}


# --- LLaDA ---------------------------------------------------------------------------------


BYTE_LEVEL_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|eot_id|>", "<|mdm_mask|>"]
BYTE_LEVEL_SPECIALS += ["<|start_header_id|>", "<|end_header_id|>"]


def write_byte_level_llada(folder: Path, chat_template: str, **config) -> None:
    """A save_pretrained folder like LLaDA's own: byte-level BPE trained on WORDS, LLaDA's
    special tokens, `chat_template`; `config`: more tokenizer_config.json fields."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False, initial_alphabet=alphabet)
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainer)
    specials = BYTE_LEVEL_SPECIALS
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        additional_special_tokens=specials[2:],
        chat_template=chat_template,
        **config,
    )
    fast.save_pretrained(str(folder))


def write_llada_tokenizer(folder: Path) -> dict[str, int]:
    """tokenizer.json (word level) + tokenizer_config.json with LLaDA's specials and template."""
    tok, ids = word_level_tokenizer(folder, LLADA_SPECIALS)
    write_json(
        folder / "tokenizer_config.json",
        {
            "added_tokens_decoder": {str(i): _added(s) for s, i in ids.items()},
            "bos_token": "<|startoftext|>",
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "chat_template": LLADA_CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1000000000000000019884624838656,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    return {
        "bos": ids["<|startoftext|>"],
        "eos": ids["<|endoftext|>"],
        "pad": ids["<|endoftext|>"],
        "eot": ids["<|eot_id|>"],
        "mask": ids["<|mdm_mask|>"],
        "vocab_size": tok.get_vocab_size(),
    }


def llada_config(ids: dict[str, int], **overrides) -> dict:
    """config.json as LLaDA-8B ships it (OLMo field names, training-only fields included)."""
    cfg = {
        "activation_type": "silu",
        "alibi": False,
        "alibi_bias_max": 8.0,
        "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0,
        "attention_layer_norm": False,
        "attention_layer_norm_with_affine": True,
        "auto_map": {
            "AutoConfig": "configuration_llada.LLaDAConfig",
            "AutoModel": "modeling_llada.LLaDAModelLM",
            "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
        },
        "bias_for_layer_norm": False,
        "block_group_size": 1,
        "block_type": "llama",
        "embedding_dropout": 0.0,
        "embedding_size": ids["vocab_size"] + 7,  # padded rows, as in the real 126464 table
        "eos_token_id": ids["eos"],
        "flash_attention": False,
        "include_bias": False,
        "include_qkv_bias": False,
        "init_cutoff_factor": None,
        "init_device": "meta",
        "init_fn": "mitchell",
        "init_std": 0.02,
        "input_emb_norm": False,
        "layer_norm_type": "rms",
        "layer_norm_with_affine": True,
        "mask_token_id": ids["mask"],
        "max_sequence_length": 4096,
        "mlp_ratio": 4,
        "model_type": "llada",
        "multi_query_attention": None,
        "pad_token_id": ids["pad"],
        "precision": "amp_bf16",
        "residual_dropout": 0.0,
        "rms_norm_eps": 1e-05,
        "rope": True,
        "rope_full_precision": True,
        "rope_theta": 500000.0,
        "scale_logits": False,
        "transformers_version": "4.46.3",
        "use_cache": False,
        "vocab_size": ids["vocab_size"],
        "weight_tying": False,
        **LLADA_SHAPE,
    }
    cfg.update(overrides)
    return cfg


def llada_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """LLaDA's checkpoint names and shapes for a config (docs/reference.md, section 1)."""
    d, heads, layers = cfg["d_model"], cfg["n_heads"], cfg["n_layers"]
    kv = (cfg.get("n_kv_heads") or heads) * (d // heads)
    ffn, table = cfg["mlp_hidden_size"], cfg["embedding_size"]
    shapes = {"model.transformer.wte.weight": (table, d)}
    for i in range(layers):
        p = f"model.transformer.blocks.{i}."
        shapes |= {
            p + "attn_norm.weight": (d,),
            p + "ff_norm.weight": (d,),
            p + "q_proj.weight": (d, d),
            p + "k_proj.weight": (kv, d),
            p + "v_proj.weight": (kv, d),
            p + "attn_out.weight": (d, d),
            p + "ff_proj.weight": (ffn, d),
            p + "up_proj.weight": (ffn, d),
            p + "ff_out.weight": (d, ffn),
        }
    shapes |= {"model.transformer.ln_f.weight": (d,), "model.transformer.ff_out.weight": (table, d)}
    return shapes


def write_llada(
    folder: Path,
    *,
    shards: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    **overrides,
) -> Written:
    """A LLaDA folder: config.json, safetensors (single or sharded), tokenizer files."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = write_llada_tokenizer(folder)
    cfg = llada_config(ids, **overrides)
    return write_weights(folder, ids, cfg, llada_shapes(cfg), dtype, seed, shards)


# --- Dream ---------------------------------------------------------------------------------


def write_dream_tokenizer(folder: Path) -> dict[str, int]:
    """vocab.json + merges.txt (byte-level BPE) + a tokenizer_config.json naming DreamTokenizer."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainer)
    tok.model.save(str(folder))  # vocab.json, merges.txt
    base = tok.get_vocab_size()
    ids = {s: base + i for i, s in enumerate(DREAM_SPECIALS)}
    write_json(
        folder / "tokenizer_config.json",
        {
            "add_bos_token": False,
            "add_prefix_space": False,
            "added_tokens_decoder": {str(i): _added(s) for s, i in ids.items()},
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "auto_map": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]},
            "bos_token": "<|beginoftext|>",
            "chat_template": QWEN_CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|endoftext|>",
            "errors": "replace",
            "mask_token": "<|mask|>",
            "model_max_length": 131072,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "DreamTokenizer",
            "unk_token": None,
        },
    )
    return {
        "bos": ids["<|beginoftext|>"],
        "eos": ids["<|endoftext|>"],
        "pad": ids["<|endoftext|>"],
        "eot": ids["<|im_end|>"],
        "mask": ids["<|mask|>"],
        "vocab_size": base + len(DREAM_SPECIALS),
    }


def dream_config(ids: dict[str, int], **overrides) -> dict:
    """config.json as Dream-v0 ships it (Qwen2 field names plus mask_token_id)."""
    cfg = {
        "architectures": ["DreamModel"],
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_dream.DreamConfig",
            "AutoModel": "modeling_dream.DreamModel",
        },
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "mask_token_id": ids["mask"],
        "max_position_embeddings": 131072,
        "max_window_layers": 28,
        "model_type": "Dream",
        "pad_token_id": ids["pad"],
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.46.2",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": ids["vocab_size"] + 11,  # padded like Dream's 152064 > tokenizer size
        **DREAM_SHAPE,
    }
    cfg.update(overrides)
    return cfg


def dream_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Dream's (Qwen2) checkpoint names and shapes, q/k/v biases included (docs/reference.md, section 2)."""
    d, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv, ffn = cfg["num_key_value_heads"] * (d // heads), cfg["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= qwen_attention_shapes(p, d, d, kv, bias=True) | mlp_shapes(p + "mlp.", ffn, d)
    shapes |= {"model.norm.weight": (d,), "lm_head.weight": (cfg["vocab_size"], d)}
    return shapes


def write_dream(
    folder: Path,
    *,
    shards: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 1,
    **overrides,
) -> Written:
    """A Dream folder: config.json, safetensors, vocab.json/merges.txt tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = write_dream_tokenizer(folder)
    cfg = dream_config(ids, **overrides)
    return write_weights(folder, ids, cfg, dream_shapes(cfg), dtype, seed, shards)


# --- LLaDA-MoE -----------------------------------------------------------------------------

LLADA_MOE_SPECIALS = ("<|endoftext|>", "<|mask|>", "<|role_end|>", "<role>", "</role>")
# LLaDA-MoE's chat format: <role>HUMAN</role>...<|role_end|><role>ASSISTANT</role>.
LLADA_MOE_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{ '<role>' + ('HUMAN' if m['role'] == 'user' else m['role'] | upper) + '</role>' "
    "+ m['content'] + '<|role_end|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<role>ASSISTANT</role>' }}{%- endif -%}"
)
# Several experts per token, an expert count above it, MHA as in LLaDA-MoE-7B-A1B.
LLADA_MOE_SHAPE = {
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "num_experts": 8,
    "num_experts_per_tok": 3,
    "expert_intermediate_size": 16,
    "dense_intermediate_size": 40,
}


def write_llada_moe_tokenizer(folder: Path) -> dict[str, int]:
    """tokenizer.json (word level) + tokenizer_config.json with LLaDA-MoE's specials, template."""
    tok, ids = word_level_tokenizer(folder, LLADA_MOE_SPECIALS)
    write_json(
        folder / "tokenizer_config.json",
        {
            "added_tokens_decoder": {str(i): _added(s) for s, i in ids.items()},
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "mask_token": "<|mask|>",
            "chat_template": LLADA_MOE_CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 8192,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    return {
        "eos": ids["<|endoftext|>"],
        "pad": ids["<|endoftext|>"],
        "eot": ids["<|role_end|>"],
        "mask": ids["<|mask|>"],
        "vocab_size": tok.get_vocab_size(),
    }


def llada_moe_config(ids: dict[str, int], **overrides) -> dict:
    """config.json as LLaDA-MoE-7B-A1B ships it: model_type "llada", no mask_token_id."""
    cfg = {
        "architectures": ["LLaDAMoEModelLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_lladamoe.LLaDAConfig",
            "AutoModel": "modeling_lladamoe.LLaDAMoEModelLM",
            "AutoModelForCausalLM": "modeling_lladamoe.LLaDAMoEModelLM",
        },
        "clip_qkv": None,
        "eos_token_id": ids["eos"],
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_position_embeddings": 8192,
        "model_type": "llada",
        "moe_layer_freq": [1] * LLADA_MOE_SHAPE["num_hidden_layers"],
        "moe_router_enable_expert_bias": False,
        "moe_router_score_function": "softmax",
        "norm_topk_prob": True,  # the reference ignores it (norm_topk_prob = False in code)
        "output_router_logits": False,
        "pad_token_id": ids["pad"],
        "partial_rotary_factor": 1,
        "qk_layernorm": True,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 50000,
        "routed_scaling_factor": 1,
        "router_aux_loss_coef": 0.01,
        "router_num_group": None,
        "router_topk_group": None,
        "shared_expert_intermediate_size": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.46.2",
        "use_cache": False,
        "vocab_size": ids["vocab_size"] + 5,  # padded rows, as 157184 > the tokenizer's size
        **LLADA_MOE_SHAPE,
    }
    cfg.update(overrides)
    return cfg


def llada_moe_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """LLaDA-MoE's checkpoint names and shapes (OLMoE layout, experts one module each)."""
    d, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    hd = d // heads
    kv = cfg["num_key_value_heads"] * hd
    e, ffn = cfg["num_experts"], cfg["expert_intermediate_size"]
    shared = cfg.get("shared_expert_intermediate_size")
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= qwen_attention_shapes(p, d, d, kv, head_norm=hd)
        if cfg["moe_layer_freq"][i]:
            shapes[p + "mlp.gate.weight"] = (e, d)
            for j in range(e):
                shapes |= mlp_shapes(f"{p}mlp.experts.{j}.", ffn, d)
            if shared:
                shapes |= mlp_shapes(p + "shared_expert.", shared, d)
        else:
            shapes |= mlp_shapes(p + "mlp.", cfg["dense_intermediate_size"], d)
    shapes |= {"model.norm.weight": (d,), "lm_head.weight": (cfg["vocab_size"], d)}
    return shapes


def write_llada_moe(
    folder: Path,
    *,
    shards: int = 2,
    dtype: torch.dtype = torch.float32,
    seed: int = 3,
    **overrides,
) -> Written:
    """A LLaDA-MoE folder: config.json, sharded safetensors + index, tokenizer files; every
    norm weight (q_norm and k_norm included) randomised."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = write_llada_moe_tokenizer(folder)
    cfg = llada_moe_config(ids, **overrides)
    return write_weights(folder, ids, cfg, llada_moe_shapes(cfg), dtype, seed, shards)
