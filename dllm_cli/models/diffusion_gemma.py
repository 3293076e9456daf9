"""DiffusionGemma (config.json model_type "diffusion_gemma"): transformers' own model, loaded locally.

Google's block-diffusion Mixture-of-Experts (google/diffusiongemma-26B-A4B-it): a causal encoder
reads the prompt and every finished canvas into a KV cache; a bidirectional decoder refines a
fixed-length canvas that starts as uniform random tokens (no [MASK]). transformers (>= 5.24)
ships the model and its sampler; dllm loads it through the thin subclass below (no remote code:
it adds only the sizes dllm reads) and steps its `generate` loop (decoding/gemma_loop.py).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
from transformers.utils import is_accelerate_available

from dllm_cli.errors import ModelLoadError
from dllm_cli.family_settings import gemma_keeps_float as keeps_float
from dllm_cli.models import quantize as quant
from dllm_cli.models.quantize import Scheme

FAMILY = "diffusion_gemma"
EOT_NAMES = ("<turn|>", "<end_of_turn>")  # Gemma 4's end of turn; Gemma 1-3's


class DiffusionGemmaLM(DiffusionGemmaForBlockDiffusion):
    """transformers' DiffusionGemma with the sizes dllm reads; weights and algorithm unchanged."""

    family = FAMILY  # decode_steps hands this model to dllm_cli/decoding/gemma.py

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


def read_config(raw: dict) -> DiffusionGemmaConfig:
    """config.json -> DiffusionGemmaConfig (transformers validates; loading.py words errors)."""
    return DiffusionGemmaConfig(
        **{k: v for k, v in raw.items() if k not in ("auto_map", "model_type")}
    )


def load_weights(
    folder: Path, config: DiffusionGemmaConfig, device: torch.device, dtype: torch.dtype
) -> DiffusionGemmaLM:
    """from_pretrained, refusing a checkpoint with missing, unexpected or mis-shaped tensors
    (transformers maps the names itself, so its loading report is the check). Without accelerate
    the weights pass through host memory (26B in bf16: ~52 GB); errors propagate to loading.py."""
    direct = (
        {"device_map": {"": device}} if device.type == "cuda" and is_accelerate_available() else {}
    )
    model, info = DiffusionGemmaLM.from_pretrained(
        str(folder),
        config=config,
        dtype=dtype,
        output_loading_info=True,
        ignore_mismatched_sizes=True,  # reported below, in one line
        **direct,
    )
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
    # generate calls torch.compiler.cudagraph_mark_step_begin() every step, and the first call
    # imports torch._inductor (seconds): pay that while loading, not in the first timed decode.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, about torch.jit
        import torch._inductor.cudagraph_trees  # noqa: F401
    return model.to(device).eval()


def quantize(model: DiffusionGemmaLM, scheme: Scheme, dtype: torch.dtype) -> int:
    """dllm's int8 / int4 layers (quantize.py) for the model's linears but `keeps_float`'s
    (family_settings.py: fit.py counts by it too), then the rest cast to `dtype` (as
    quantize_loaded does); returns how many."""
    count = quant.quantize_linears(model, scheme, keeps_float)
    model.to(dtype)
    quant.release_freed_memory()
    return count


def more(items: list) -> str:
    return f" (and {len(items) - 1} more)" if len(items) > 1 else ""


def role_defaults(model: DiffusionGemmaLM, tokenizer) -> dict[str, int | None]:
    """Special roles the tokenizer names Gemma's way: end of turn, and a mask placeholder
    (uniform-state diffusion has no mask token; loading.py sets the role to None)."""
    vocab = tokenizer.get_vocab()
    eot = next((vocab[n] for n in EOT_NAMES if n in vocab), None)
    return {"eot": eot, "mask": model.config.text_config.pad_token_id or 0}


def extra_stops(model: DiffusionGemmaLM, stop: tuple[int, ...]) -> tuple[int, ...]:
    """generation_config.json's stop tokens (the model card's `eos_token_id` list) beyond `stop`."""
    listed = model.generation_config.eos_token_id
    listed = [listed] if isinstance(listed, int) else list(listed or [])
    size = model.config.text_config.vocab_size
    return tuple(int(t) for t in listed if t not in stop and 0 <= t < size)
