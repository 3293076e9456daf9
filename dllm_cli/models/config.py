"""A config.json as attributes: the base of our architectures' configs, without transformers.

transformers' `PretrainedConfig` costs its package import (about 1 s of a start-up) for what
these configs use of it: the shared token-id and tying fields, the other keys as attributes,
and `to_dict` / `save_pretrained`.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
from dataclasses import InitVar, dataclass
from pathlib import Path
from typing import Any, ClassVar


@dataclass(kw_only=True, repr=False, eq=False)
class ModelConfig:
    """Named fields declared by the subclass; every further config.json key kept as an attribute."""

    model_type: ClassVar[str] = ""

    tie_word_embeddings: bool = True
    pad_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None
    architectures: list[str] | None = None

    def to_dict(self) -> dict[str, Any]:
        """config.json's content: every attribute, model_type first."""
        fields = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return {"model_type": self.model_type, **fields}

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        """Write `folder`/config.json (the file a checkpoint folder carries)."""
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True)
        (path / "config.json").write_text(text + "\n", encoding="utf-8")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({json.dumps(self.to_dict(), sort_keys=True)})"


@dataclass(kw_only=True, repr=False, eq=False)
class QwenConfig(ModelConfig):
    """The Qwen-named fields of Dream, LLaDA-MoE, SDAR and LLaDA2 (each declares its sizes)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None  # None: one per attention head
    hidden_act: str = "silu"
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float
    rope_scaling: InitVar[dict | None] = None
    tie_word_embeddings: bool = False

    def __post_init__(self, rope_scaling: dict | None) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.rope_parameters = rope_scaling  # transformers 5 name for rope_scaling
        if "head_dim" in self.__dataclass_fields__:  # declared (SDAR, LLaDA2): null is d / H
            self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """d / H, where a subclass declares no head_dim field (Dream, LLaDA-MoE)."""
        return self.hidden_size // self.num_attention_heads


def model_config(cls: type[ModelConfig]) -> type[ModelConfig]:
    """`cls` as a dataclass whose constructor takes a whole config.json: the keys it does not
    declare (e.g. rope_parameters, dtype, training-only fields) are kept as attributes."""
    cls = dataclass(kw_only=True, repr=False, eq=False)(cls)
    declared = inspect.signature(cls.__init__).parameters.keys() - {"self"}
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, **kwargs: Any) -> None:
        init(self, **{k: kwargs.pop(k) for k in declared & kwargs.keys()})
        for key, value in kwargs.items():
            setattr(self, key, value)

    cls.__init__ = __init__
    return cls


def unsupported_basics(cfg: ModelConfig) -> str | None:
    """The checks every Qwen-style config shares: default RoPE, SiLU, whole KV-head groups."""
    scaling = cfg.rope_parameters or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind != "default":
        return f"rope_scaling {kind!r} (only default RoPE)"
    if cfg.hidden_act != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        return "num_attention_heads does not divide by num_key_value_heads"
    return None
