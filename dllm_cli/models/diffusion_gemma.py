"""DiffusionGemma (config.json model_type "diffusion_gemma"): transformers' own model, loaded locally.

Google's block-diffusion Mixture-of-Experts (google/diffusiongemma-26B-A4B-it): a causal encoder
reads the prompt and every finished canvas into a KV cache; a bidirectional decoder refines a
fixed-length canvas that starts as uniform random tokens (no [MASK]), conditioned on its own
previous logits. transformers (>= 5.11) ships the model and its sampler; dllm loads
`DiffusionGemmaForBlockDiffusion` through the thin subclass below (no remote code) and decodes
with the model's own `generate` (dllm_cli/decoding/gemma.py).

The subclass adds only what dllm needs: the context length, and two hook points a running
decode may fill: one swaps transformers' sampler for a copy that draws from per-row generators,
one observes the stopping rule. Neither changes what the sampler or the rule computes.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Protocol

import torch
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
from transformers.utils import is_accelerate_available

from dllm_cli.errors import ModelLoadError
from dllm_cli.models.loading import (
    LoadedModel,
    SpecialIds,
    _one_line,
    load_tokenizer,
    special_ids,
    weight_files,
)

FAMILY = "diffusion_gemma"
EOT_NAMES = ("<turn|>", "<end_of_turn>")  # Gemma 4's end of turn; Gemma 1-3's


class DecodeHooks(Protocol):
    """What a running decode plugs into `generate` (dllm_cli/decoding/gemma.py implements it)."""

    def sampler(self, sampler, generation_config): ...

    def stopping(self, criteria): ...


class DiffusionGemmaLM(DiffusionGemmaForBlockDiffusion):
    """transformers' DiffusionGemma with dllm's two hook points; weights and algorithm unchanged."""

    family = FAMILY  # decode_steps hands this model to dllm_cli/decoding/gemma.py
    hooks: DecodeHooks | None = None  # set by a decode for the length of one generate call

    @property
    def context_length(self) -> int:
        return self.config.text_config.max_position_embeddings

    @property
    def canvas_length(self) -> int:
        return self.config.canvas_length

    @property
    def vocab_size(self) -> int:
        """Rows of the token embedding (the text vocabulary), as the other families report."""
        return self.config.text_config.vocab_size

    def _prepare_sampler(self, generation_config):
        sampler = super()._prepare_sampler(generation_config)
        return sampler if self.hooks is None else self.hooks.sampler(sampler, generation_config)

    def _prepare_diffusion_stopping_criteria(self, generation_config):
        criteria = super()._prepare_diffusion_stopping_criteria(generation_config)
        if self.hooks is None or criteria is None:
            return criteria
        return self.hooks.stopping(criteria)


def read_config(raw: dict, cfg_file: Path) -> DiffusionGemmaConfig:
    """config.json -> DiffusionGemmaConfig; transformers' validation errors as one line."""
    fields = {k: v for k, v in raw.items() if k not in ("auto_map", "model_type")}
    try:
        return DiffusionGemmaConfig(**fields)
    except Exception as e:  # strict dataclass validation raises several types
        raise ModelLoadError(f"{cfg_file}: invalid {FAMILY} config: {_one_line(e)}") from None


def load(
    folder: Path,
    raw: dict,
    device: torch.device,
    dtype: torch.dtype,
    special_overrides: dict | None = None,
) -> LoadedModel:
    """A local DiffusionGemma folder -> LoadedModel (weights checked by transformers' own report)."""
    config = read_config(raw, folder / "config.json")
    weight_files(folder)  # no weights at all: our one-line error before transformers'
    model = load_weights(folder, config, device, dtype)
    # generate calls torch.compiler.cudagraph_mark_step_begin() every step, and the first call
    # imports torch._inductor (seconds): pay that while loading, not in the first timed decode.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, about torch.jit
        import torch._inductor.cudagraph_trees  # noqa: F401

    tokenizer = load_tokenizer(folder)
    special = gemma_special_ids(model, raw, tokenizer, special_overrides)
    return LoadedModel(model, tokenizer, special, folder, FAMILY, device, dtype)


def load_weights(
    folder: Path, config: DiffusionGemmaConfig, device: torch.device, dtype: torch.dtype
) -> DiffusionGemmaLM:
    """from_pretrained, refusing a checkpoint with missing, unexpected or mis-shaped tensors.

    transformers maps checkpoint names itself, so its loading report is the check here (our
    name-by-name check assumes the model's own names). With accelerate installed the weights
    stream straight onto a GPU; without it they pass through host memory (26B in bf16: ~52 GB).
    """
    direct = (
        {"device_map": {"": device}} if device.type == "cuda" and is_accelerate_available() else {}
    )
    try:
        model, info = DiffusionGemmaLM.from_pretrained(
            str(folder),
            config=config,
            dtype=dtype,
            output_loading_info=True,
            ignore_mismatched_sizes=True,  # reported below, in one line
            **direct,
        )
    except Exception as e:  # anything transformers raises for a damaged or mismatched folder
        raise ModelLoadError(f"cannot load weights from {folder}: {_one_line(e)}") from None
    mismatched = sorted(info.get("mismatched_keys") or [], key=str)
    if mismatched:
        name, found, wanted = mismatched[0]
        raise ModelLoadError(
            f"{folder}: parameter {name} has shape {list(found)} in the checkpoint, but the "
            f"config implies {list(wanted)}{more(mismatched)}"
        )
    for kind in ("missing", "unexpected"):
        keys = sorted(info.get(f"{kind}_keys") or [], key=str)
        if keys:
            raise ModelLoadError(f"{folder}: checkpoint has {kind} parameter {keys[0]}{more(keys)}")
    return model.to(device).eval()


def more(items: list) -> str:
    return f" (and {len(items) - 1} more)" if len(items) > 1 else ""


def gemma_special_ids(
    model: DiffusionGemmaLM, raw: dict, tokenizer, overrides: dict | None
) -> SpecialIds:
    """Special ids from text_config, the tokenizer and generation_config.json's stop tokens.

    Uniform-state diffusion has no mask token: the mask role is None (so no output token is
    ever counted as a leftover mask). generation_config.json's `eos_token_id` list (the model
    card's stop tokens) joins EOS and end-of-turn as stops.
    """
    vocab = tokenizer.get_vocab()
    text = model.config.text_config
    eot = next((vocab[n] for n in EOT_NAMES if n in vocab), None)
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    present = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    found = {"eot": eot, "mask": text.pad_token_id or 0}  # mask: a placeholder, dropped below
    ids = special_ids(text, tokenizer, found | given, present=present, table_size=text.vocab_size)
    listed = model.generation_config.eos_token_id
    listed = [listed] if isinstance(listed, int) else list(listed or [])
    extra = tuple(int(t) for t in listed if t not in ids.stop and 0 <= t < text.vocab_size)
    return dataclasses.replace(ids, mask=None, extra_stop=extra, vocab=len(tokenizer))
