"""Diffusion LM architectures, chosen by config.json's model_type."""

from transformers import AutoConfig, AutoModel

from dllm_cli.models.base import DiffusionLM
from dllm_cli.models.dream import DreamConfig, DreamModel
from dllm_cli.models.llada import LLaDAConfig, LLaDAModelLM

# model_type -> (config class, model class)
ARCHITECTURES: dict[str, tuple[type, type[DiffusionLM]]] = {
    "llada": (LLaDAConfig, LLaDAModelLM),
    "Dream": (DreamConfig, DreamModel),
}

for _kind, (_cfg, _model) in ARCHITECTURES.items():
    try:
        AutoConfig.register(_kind, _cfg)
        AutoModel.register(_cfg, _model)
    except ValueError:  # already registered (module reloaded)
        pass

__all__ = [
    "ARCHITECTURES",
    "DiffusionLM",
    "DreamConfig",
    "DreamModel",
    "LLaDAConfig",
    "LLaDAModelLM",
]
