"""dllm: fast decoding for masked diffusion language models (LLaDA, Dream)."""

__version__ = "0.1.0"
