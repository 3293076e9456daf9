"""dllm: fast decoding for diffusion language models (the families in families.py).

`from dllm_cli import LLM` is the Python API (api.py); it is loaded on first use, so importing
the package (or starting the CLI) does not import torch.
"""

from dllm_cli.version import __version__

__all__ = ["LLM", "Completion", "__version__"]


def __getattr__(name: str):
    if name in ("LLM", "Completion"):
        from dllm_cli import api

        return getattr(api, name)
    raise AttributeError(f"module 'dllm_cli' has no attribute {name!r}")
