"""The autoregressive guide of guided diffusion (FlashDLM): any local causal LM folder.

It must share the diffusion model's tokenizer, since it scores the diffusion model's drafts
token for token; we check that instead of trusting it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from dllm_cli.errors import ModelLoadError
from dllm_cli.folders import read_config_json
from dllm_cli.models.causal import CausalLM, guide_config
from dllm_cli.models.loading import (
    LoadedModel,
    load_tokenizer,
    quiet_transformers,
    resolve_path,
    weight_files,
)
from dllm_cli.models.weights import check_weights, meta_skeleton, read_weights


@dataclass
class GuideModel:
    """A causal LM ready to verify drafts on the diffusion model's device."""

    model: nn.Module  # models.causal.CausalLM, or a transformers causal LM for other types
    path: Path


def load_guide(path: str | os.PathLike, diffusion: LoadedModel) -> GuideModel:
    """Load a causal LM folder (no remote code) and check it shares the diffusion tokenizer."""
    folder = resolve_path(path)
    if not folder.is_dir():
        raise ModelLoadError(f"guide model folder not found: {folder}")
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"no config.json in guide folder {folder}")
    weight_files(folder)  # a clear error when the weights are missing
    config = guide_config_of(folder)
    if config is None:
        model = load_with_transformers(folder, diffusion)
    else:
        with meta_skeleton():
            model = CausalLM(config)
        check_weights(folder, model)
        model = read_weights(folder, model, diffusion.dtype)
    check_same_tokenizer(folder, diffusion)
    model.to(diffusion.device).eval()
    return GuideModel(model=model, path=folder)


def guide_config_of(folder: Path):
    """Our CausalLM's config for a llama/qwen2/qwen3 folder, None for any other."""
    raw = read_config_json(folder)
    try:
        return guide_config(raw)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(
            f"cannot load guide model from {folder}: bad config.json ({e})"
        ) from None


def load_with_transformers(folder: Path, diffusion: LoadedModel) -> nn.Module:
    """Any other causal LM folder (no remote code), through transformers' Auto classes."""
    quiet_transformers()
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
        return AutoModelForCausalLM.from_pretrained(
            str(folder), config=config, dtype=diffusion.dtype, trust_remote_code=False
        )
    except Exception as e:  # transformers raises many kinds; the message is what matters
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"cannot load guide model from {folder}: {first}") from None


def check_same_tokenizer(folder: Path, diffusion: LoadedModel) -> None:
    """The guide's vocabulary must map the same strings to the same ids as the diffusion model's."""
    try:
        theirs = guide_vocab(folder)
    except ModelLoadError:
        return  # a folder without tokenizer files: trust the ids (e.g. Qwen2.5 shares Dream's)
    ours = diffusion.tokenizer.get_vocab()
    clash = next((tok for tok, i in ours.items() if tok in theirs and theirs[tok] != i), None)
    missing = len(set(ours) - set(theirs))
    if clash is not None or missing > len(ours) // 100:
        detail = f"token {clash!r} has another id" if clash else f"{missing} tokens missing"
        raise ModelLoadError(
            f"guide {folder} does not share the diffusion model's tokenizer ({detail})"
        )


def guide_vocab(folder: Path) -> dict[str, int]:
    """The guide's token -> id map. From tokenizer.json by the `tokenizers` library when there
    is one (what a transformers fast tokenizer's get_vocab returns, plus the added tokens of
    tokenizer_config.json), since AutoTokenizer would build the folder's transformers config
    class first (about 0.7 s of imports); other folders through AutoTokenizer."""
    file = folder / "tokenizer.json"
    if not file.is_file():
        return load_tokenizer(folder).get_vocab()
    from tokenizers import Tokenizer

    try:
        vocab = Tokenizer.from_file(str(file)).get_vocab(with_added_tokens=True)
        extra = folder / "tokenizer_config.json"
        added = (
            json.loads(extra.read_text()).get("added_tokens_decoder", {}) if extra.is_file() else {}
        )
        return vocab | {entry["content"]: int(i) for i, entry in added.items()}
    except Exception as e:  # tokenizers raises its own Exception type; JSON errors too
        raise ModelLoadError(f"cannot read the guide's tokenizer {file}: {e}") from None
