"""Diffusion LM architectures; which folder builds which class is families.py's table.

Plain torch modules: nothing here imports transformers (its import is most of a start-up),
and nothing registers with its Auto* classes; loading.py reads folders by families.py."""

from dllm_cli.models.base import DiffusionLM
from dllm_cli.models.dream import DreamConfig, DreamModel
from dllm_cli.models.llada import LLaDAConfig, LLaDAModelLM

__all__ = ["DiffusionLM", "DreamConfig", "DreamModel", "LLaDAConfig", "LLaDAModelLM"]
