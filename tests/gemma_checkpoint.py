"""A tiny random DiffusionGemma folder in the real format: transformers' save_pretrained output
(config.json with text and vision sub-configs, model.safetensors), a generation_config.json like
the model card's, and a Gemma-style byte-fallback BPE tokenizer with Gemma 4's chat template."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from checkpoints import WORDS, Written, _added, write_json
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

# Gemma's first ids (pad 0, eos 1, bos 2, unk 3, mask 4), then Gemma 4's turn and tool tokens.
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<|tool_response>")
MULTIMODAL = ("<|image>", "<image|>", "<|image|>")  # ids the config names (boi, eoi, image)

# Gemma 4's turn format (<|turn>ROLE ... <turn|>), without its tool and thinking branches.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for m in messages -%}"
    "{{ '<|turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' }}"
    "{{ m['content'] | trim }}{{ '<turn|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|turn>model\\n' }}{%- endif -%}"
)

# Sizes that keep every code path (sliding + full attention, MoE routing, self-conditioning, a
# vision tower) at a few hundred thousand parameters; the canvas is 16 tokens.
TEXT_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "global_head_dim": 32,
    "num_global_key_value_heads": 1,
    "num_experts": 4,
    "top_k_experts": 2,
    "moe_intermediate_size": 32,
    "sliding_window": 8,
    "max_position_embeddings": 512,
    "layer_types": ["sliding_attention", "full_attention"],
}
VISION_SHAPE = {
    "model_type": "gemma4_vision",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "patch_size": 4,
    "position_embedding_size": 16,
}
CANVAS = 16
# The model card's generation settings (generation_config.json), fewer steps for speed.
GENERATION = {
    "max_new_tokens": 256,
    "max_denoising_steps": 12,
    "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},
    "t_min": 0.4,
    "t_max": 0.8,
    "stability_threshold": 1,
    "confidence_threshold": 0.005,
}


def write_gemma_tokenizer(folder: Path) -> dict[str, int]:
    """tokenizer.json (BPE with Gemma's byte fallback, spaces as ▁) + tokenizer_config.json."""
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=[*SPECIALS, *MULTIMODAL], show_progress=False
    )
    draft = Tokenizer(models.BPE(unk_token="<unk>"))
    draft.normalizer = normalizers.Replace(" ", "▁")
    draft.train_from_iterator([" ".join(WORDS)] * 4, trainer)
    draft.model.save(str(folder))  # vocab.json + merges.txt, read back below
    vocab = json.loads((folder / "vocab.json").read_text())
    vocab |= {f"<0x{b:02X}>": len(vocab) + b for b in range(256)}  # Gemma's 256 byte tokens
    merges = [tuple(line.split()) for line in (folder / "merges.txt").read_text().splitlines()]
    merges = [m for m in merges if len(m) == 2 and not m[0].startswith("#")]
    for name in ("vocab.json", "merges.txt"):
        (folder / name).unlink()
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    specials = [AddedToken(t, special=True, normalized=False) for t in (*SPECIALS, *MULTIMODAL)]
    tok.add_special_tokens(specials)
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.save(str(folder / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in (*SPECIALS, *MULTIMODAL)}
    write_json(
        folder / "tokenizer_config.json",
        {
            "added_tokens_decoder": {str(i): _added(s) for s, i in ids.items()},
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "mask_token": "<mask>",
            "chat_template": CHAT_TEMPLATE,
            "model_max_length": 512,
            "padding_side": "left",
            "tokenizer_class": "GemmaTokenizer",
        },
    )
    return {
        "pad": ids["<pad>"],
        "eos": ids["<eos>"],
        "bos": ids["<bos>"],
        "mask": ids["<mask>"],
        "eot": ids["<turn|>"],
        "tool": ids["<|tool_response>"],
        "boi": ids["<|image>"],
        "eoi": ids["<image|>"],
        "image": ids["<|image|>"],
        "vocab_size": tok.get_vocab_size(),
    }


def gemma_config(ids: dict[str, int], **overrides) -> DiffusionGemmaConfig:
    text = {**TEXT_SHAPE, "vocab_size": ids["vocab_size"], "pad_token_id": ids["pad"]}
    text |= {"eos_token_id": ids["eos"], "bos_token_id": ids["bos"]}
    text |= overrides.pop("text", {})
    return DiffusionGemmaConfig(
        text_config=text,
        vision_config=VISION_SHAPE,
        canvas_length=overrides.pop("canvas_length", CANVAS),
        boi_token_id=ids["boi"],
        eoi_token_id=ids["eoi"],
        image_token_id=ids["image"],
        **overrides,
    )


def sharpen(model: torch.nn.Module, gain: float) -> None:
    """Scale random projections up, so a random model's logits are peaked, not near uniform:
    the entropy-bound sampler then accepts several tokens a step and drafts can settle."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "vision" not in name:
                p.mul_(gain)


def write_gemma(
    folder: Path, *, seed: int = 0, gain: float = 4.0, generation: dict | None = None, **overrides
) -> Written:
    """A DiffusionGemma folder: save_pretrained output plus tokenizer and generation config."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = write_gemma_tokenizer(folder)
    config = gemma_config(ids, **overrides)
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    sharpen(model, gain)
    model.save_pretrained(str(folder))
    stops = [ids["eos"], ids["eot"], ids["tool"]]
    write_json(
        folder / "generation_config.json",
        {**GENERATION, "eos_token_id": stops, "pad_token_id": ids["pad"], **(generation or {})},
    )
    tensors = {k: v.clone() for k, v in model.state_dict().items()}
    return Written(folder, tensors, config.to_dict(), ids)
