"""dllm: fast decoding for masked diffusion language models (LLaDA, Dream).

`from dllm_cli import LLM` is the Python API (api.py); it is loaded on first use, so importing
the package (or starting the CLI) does not import torch.
"""

__version__ = "0.1.0"

__all__ = ["LLM", "Completion"]


def __getattr__(name: str):
    if name in __all__:
        from dllm_cli import api

        return getattr(api, name)
    raise AttributeError(f"module 'dllm_cli' has no attribute {name!r}")
