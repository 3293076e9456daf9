"""Diffusion LM architectures; which folder builds which class is families.py's table."""

from transformers import AutoConfig, AutoModel

from dllm_cli.models.base import DiffusionLM
from dllm_cli.models.dream import DreamConfig, DreamModel
from dllm_cli.models.llada import LLaDAConfig, LLaDAModelLM

# transformers' Auto* lookups by model_type: the dense classes own their model_type strings
# (LLaDA-MoE shares "llada", so it is built from families.py only, never through AutoModel).
for _cfg, _model in ((LLaDAConfig, LLaDAModelLM), (DreamConfig, DreamModel)):
    try:
        AutoConfig.register(_cfg.model_type, _cfg)
        AutoModel.register(_cfg, _model)
    except ValueError:  # already registered (module reloaded)
        pass

__all__ = [
    "DiffusionLM",
    "DreamConfig",
    "DreamModel",
    "LLaDAConfig",
    "LLaDAModelLM",
]
