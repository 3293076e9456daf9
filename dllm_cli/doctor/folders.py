"""Tiny random checkpoint folders, written on the spot in the real LLaDA, Dream and Llama formats.

The doctor loads them through `load_model` / `load_guide` exactly as a user's folder is loaded
(config.json by model_type, safetensors, tokenizer files), so every device check runs the real
loading path. The tokenizer is a word-level `tokenizer.json` with the family's special tokens;
no folder is ever downloaded.

Weights are N(0, 1/fan_in) (embeddings N(0, 1)), so context matters. The LM head's rows are
scaled to one length (`HEAD_SCALE`: no row dominates, and predictions are confident enough for
the threshold and factor rules to commit several tokens in some steps), and the EOS row is a
copy of the row of the word the model drafts second most often (`EOS_RANK`), a little longer
(`EOS_BOOST`), so EOS wins where that word would: some answers end early, others do not, and
early stop has work to do.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM

from dllm_cli.models import DreamConfig, DreamModel, LLaDAConfig, LLaDAModelLM

WORDS = tuple(f"w{i}" for i in range(80))
HEAD_SCALE = 8.0
EOS_BOOST = 1.05
EOS_RANK = 1


@dataclass(frozen=True)
class TinyFolder:
    """How one family's tiny folder is spelled: special tokens, config and model class."""

    specials: tuple[str, ...]  # added after WORDS, in this order
    roles: dict[str, str]  # role -> special token (mask, eos, pad, bos, eot)
    config: type
    model: type
    shape: Callable[[int], dict]  # the vocabulary size -> the tiny config's fields
    head: Callable[[torch.nn.Module], torch.Tensor]  # the model's LM head weight


def llada_shape(size: int) -> dict:
    """Two layers of width 32, seven padded embedding rows."""
    shape = {"d_model": 32, "n_heads": 4, "n_kv_heads": 4, "n_layers": 2}
    shape |= {"mlp_hidden_size": 48, "vocab_size": size, "embedding_size": size + 7}
    return shape | {"max_sequence_length": 512}


def dream_shape(size: int) -> dict:
    """Two layers of width 32 with grouped-query attention, eleven padded rows."""
    shape = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2}
    shape |= {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": size + 11}
    return shape | {"max_position_embeddings": 512}


TINY_FOLDERS: dict[str, TinyFolder] = {
    "llada": TinyFolder(
        ("<|startoftext|>", "<|endoftext|>", "<|eot_id|>", "<|mdm_mask|>"),
        {
            "bos": "<|startoftext|>",
            "eos": "<|endoftext|>",
            "pad": "<|endoftext|>",
            "mask": "<|mdm_mask|>",
        },
        LLaDAConfig,
        LLaDAModelLM,
        llada_shape,
        lambda model: model.model.transformer.ff_out.weight,
    ),
    "dream": TinyFolder(
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|beginoftext|>", "<|mask|>"),
        {
            "bos": "<|beginoftext|>",
            "eos": "<|endoftext|>",
            "pad": "<|endoftext|>",
            "mask": "<|mask|>",
        },
        DreamConfig,
        DreamModel,
        dream_shape,
        lambda model: model.lm_head.weight,
    ),
}


def write_tokenizer(folder: Path, family: TinyFolder) -> dict[str, int]:
    """tokenizer.json + tokenizer_config.json; returns role -> id and the vocabulary size."""
    vocab = {"<unk>": 0} | {w: i + 1 for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in family.specials])
    tok.save(str(folder / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in family.specials}
    added = {
        str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False}
        | {"single_word": False, "special": True}
        for s, i in ids.items()
    }
    roles = family.roles
    config = {
        "added_tokens_decoder": added,
        "bos_token": roles["bos"],
        "eos_token": roles["eos"],
        "pad_token": roles["pad"],
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {role: ids[name] for role, name in roles.items()} | {"size": tok.get_vocab_size()}


def tiny_config(kind: str, ids: dict[str, int]):
    """The family's tiny shape (`TinyFolder.shape`) with the folder's special token ids."""
    family = TINY_FOLDERS[kind]
    common = {f"{role}_token_id": ids[role] for role in ("mask", "eos", "pad", "bos")}
    return family.config(**family.shape(ids["size"]), **common)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """N(0, 1/fan_in) matrices, N(0, 1) embeddings, norms near 1, small biases."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.dim() == 2:
                embedding = "wte" in name or "embed_tokens" in name
                p.copy_(noise if embedding else noise * p.shape[1] ** -0.5)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:  # RMSNorm weights
                p.copy_(1.0 + 0.1 * noise)


def save(folder: Path, model: torch.nn.Module) -> None:
    """config.json and one model.safetensors, as transformers writes them."""
    model.config.save_pretrained(str(folder))
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def write_diffusion(folder: Path, kind: str, seed: int = 0) -> Path:
    """A tiny random LLaDA or Dream folder (float32) that `load_model` loads as a real one."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(folder, TINY_FOLDERS[kind])
    model = TINY_FOLDERS[kind].model(tiny_config(kind, ids)).float()
    randomize(model, seed)
    head = TINY_FOLDERS[kind].head(model)
    with torch.no_grad():
        head.copy_(HEAD_SCALE * head / head.norm(dim=1, keepdim=True))  # no row dominates
        head[ids["eos"]] = EOS_BOOST * head[understudy(model, ids, EOS_RANK)]
    save(folder, model)
    return folder


def understudy(model, ids: dict[str, int], rank: int) -> int:
    """The word the model drafts `rank`-th most often on a masked canvas (0: most often)."""
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, len(WORDS) + 1, (4, 8), generator=gen)
    canvas = torch.cat([prompts, torch.full((4, 16), ids["mask"])], dim=1)  # (4, 24)
    with torch.no_grad():
        drafts = model(canvas)[:, 8:, 1 : len(WORDS) + 1].argmax(dim=-1) + 1  # words only
    counts = torch.bincount(drafts.flatten(), minlength=len(WORDS) + 1)
    return int(counts.argsort(descending=True, stable=True)[rank])


def write_guide(folder: Path, diffusion: Path, seed: int = 7) -> Path:
    """A tiny random Llama guide sharing the diffusion folder's tokenizer files."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_text((diffusion / name).read_text())
    size = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    config = LlamaConfig(
        vocab_size=-(-size // 8) * 8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).float()
    randomize(model, seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    save(folder, model)
    return folder
