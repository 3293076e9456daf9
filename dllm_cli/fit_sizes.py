"""Each family's sizes, from its config.json (DiffusionGemma: and its safetensors headers).

The readers name the sizes a family's modules are built from (`Arch`); `tensors` lists every
weight those modules hold, as fit.py counts them. No torch here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from dllm_cli.errors import ModelLoadError
from dllm_cli.family_settings import gemma_keeps_float
from dllm_cli.folders import stored_shapes


@dataclass(frozen=True)
class Arch:
    """The sizes of a decoder stack that decide its memory."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int  # embedding rows (with any padding rows)
    tied: bool  # output head shares the embedding
    ffn: int  # SwiGLU width of the dense layers
    dense_layers: int  # the first dense_layers are dense, the rest MoE (all dense: == layers)
    experts: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0  # the shared experts' SwiGLU width (0: none)
    active_experts: int = 0
    qkv_bias: bool = False
    qk_norm: bool = False
    router_bias: bool = False
    stored: tuple[Tensor, ...] = ()  # the checkpoint's own tensors (headers), when counted so
    kv_layers: tuple[tuple[int, int], ...] = ()  # per cached layer: (K width, tokens kept or 0)
    step_tokens: int = 0  # tokens one forward reads per slot (0: the whole canvas)
    splits: bool = True  # --tensor-parallel can split it (models/sharding.py has a layout)


@dataclass(frozen=True)
class Tensor:
    """One weight: `kind` decides how it is stored (linear: quantized; float: load dtype)."""

    kind: str  # linear | head | float | bias (a quantized linear's bias: float32)
    rows: int  # output channels (a linear's scales)
    cols: int = 1

    @property
    def numel(self) -> int:
        return self.rows * self.cols


def read_llada(c: dict, folder: Path | None = None) -> Arch:
    d, heads = c["d_model"], c["n_heads"]
    return Arch(
        hidden=d,
        layers=c["n_layers"],
        heads=heads,
        kv_heads=c.get("n_kv_heads") or heads,
        head_dim=d // heads,
        vocab=c.get("embedding_size") or c["vocab_size"],
        tied=bool(c.get("weight_tying", False)),
        ffn=c.get("mlp_hidden_size") or c.get("mlp_ratio", 4) * d,
        dense_layers=c["n_layers"],
        qkv_bias=bool(c.get("include_qkv_bias") or c.get("include_bias")),
    )


def hf_shape(c: dict) -> dict:
    """The attention and vocabulary shape under Hugging Face's config names (Qwen2 and the MoE
    families spell them alike)."""
    heads = c["num_attention_heads"]
    return {
        "hidden": c["hidden_size"],
        "layers": c["num_hidden_layers"],
        "heads": heads,
        "kv_heads": c.get("num_key_value_heads") or heads,
        "head_dim": c.get("head_dim") or c["hidden_size"] // heads,
        "vocab": c["vocab_size"],
        "tied": bool(c.get("tie_word_embeddings", False)),
    }


def read_qwen(c: dict, qkv_bias: bool, qk_norm: bool) -> Arch:
    shape = {"ffn": c["intermediate_size"], "dense_layers": c["num_hidden_layers"]}
    return Arch(**hf_shape(c), **shape, qkv_bias=qkv_bias, qk_norm=qk_norm)


def read_llada_moe(c: dict, folder: Path | None = None) -> Arch:
    layers = c["num_hidden_layers"]
    moe = c.get("moe_layer_freq") or [1] * layers
    return Arch(
        **hf_shape(c),
        ffn=c.get("dense_intermediate_size") or 0,
        dense_layers=layers - sum(moe),  # the dense ones lead (moe_layer_freq [0, 1, 1, ...])
        experts=c["num_experts"],
        expert_ffn=c["expert_intermediate_size"],
        shared_ffn=c.get("shared_expert_intermediate_size") or 0,
        active_experts=c.get("num_experts_per_tok", 8),
        qkv_bias=bool(c.get("attention_bias", False)),
        qk_norm=bool(c.get("qk_layernorm", True)),
        router_bias=bool(c.get("moe_router_enable_expert_bias", False)),
    )


def read_llada2(c: dict, folder: Path | None = None) -> Arch:
    layers = c["num_hidden_layers"]
    experts = c.get("num_experts") or 0
    dense = min(c.get("first_k_dense_replace", 1), layers) if experts else layers
    return Arch(
        **hf_shape(c),
        ffn=c["intermediate_size"],
        dense_layers=dense,
        experts=experts,
        expert_ffn=c.get("moe_intermediate_size") or 0,
        shared_ffn=(c.get("moe_intermediate_size") or 0) * (c.get("num_shared_experts") or 0),
        active_experts=c.get("num_experts_per_tok", 8),
        qkv_bias=bool(c.get("use_qkv_bias", False)),
        qk_norm=bool(c.get("use_qk_norm", True)),
        router_bias=True,  # the expert_bias buffer is always there
    )


# a text layer's query or key projection (the vision tower's are filtered by name)
PROJECTION = re.compile(r"\.layers\.(\d+)\.self_attn\.([qk])_proj\.weight$")


def read_gemma(c: dict, folder: Path | None) -> Arch:
    """DiffusionGemma: the tensors its headers hold (linears as transformers builds them, kept
    float as quantizing keeps them), the encoder's cache per layer (its K width from k_proj; a
    sliding layer keeps its window), one decoder forward over a canvas."""
    if folder is None:
        raise ValueError("sized from its safetensors headers")
    t, shapes = c["text_config"], stored_shapes(folder)
    tied = "lm_head.weight" if t.get("tie_word_embeddings", True) else None  # an embedding
    linears = {
        name.removesuffix(".weight")
        for name, shape in shapes.items()
        if name.endswith(".weight")
        and len(shape) == 2
        and "embed_tokens" not in name
        and name != tied
    }  # the embeddings and vision tables are not nn.Linear; the 3-D experts neither
    stored = tuple(stored_tensor(name, shape, linears) for name, shape in shapes.items())
    layers, window = t["num_hidden_layers"], t.get("sliding_window") or 0
    kinds = t.get("layer_types") or ["full_attention"] * layers
    rows = text_projections(shapes)  # (layer, "q" | "k") -> output rows
    kept = max(window - 1, 1)  # transformers' sliding cache layer keeps window - 1 tokens
    kv = tuple((rows[i, "k"], kept * (k == "sliding_attention")) for i, k in enumerate(kinds))
    widest = max(rows[i, "q"] for i in range(layers))
    heads = t["num_attention_heads"]
    return Arch(
        **hf_shape(t) | {"head_dim": widest // heads},  # the widest layer's (global) heads
        ffn=0,
        dense_layers=0,  # every layer: a dense MLP beside its routed experts
        experts=t.get("num_experts") or 0,
        expert_ffn=t.get("moe_intermediate_size") or 0,
        shared_ffn=t["intermediate_size"],
        active_experts=t.get("top_k_experts") or 0,
        stored=stored,
        kv_layers=kv,
        step_tokens=c["canvas_length"],
        splits=False,
    )


def text_projections(shapes: dict[str, list[int]]) -> dict[tuple[int, str], int]:
    """(layer, "q" | "k") -> the text stack's projection rows, under the encoder's names or the
    decoder's (the two share them; a checkpoint stores one)."""
    found = {}
    for name, shape in shapes.items():
        hit = PROJECTION.search(name)
        if hit and "vision" not in name:
            found[int(hit[1]), hit[2]] = shape[0]
    return found


def stored_tensor(name: str, shape: list[int], linears: set[str]) -> Tensor:
    """One header entry as fit counts it: a linear's weight quantizes unless kept float."""
    module, _, what = name.rpartition(".")
    if module in linears and not gemma_keeps_float(module):
        return (
            Tensor("linear", shape[0], shape[1]) if what == "weight" else Tensor("bias", shape[0])
        )
    return Tensor("float", math.prod(shape))


# families.py key -> how its config.json (and, where named, its headers) gives the sizes.
READERS: dict[str, Callable[[dict, Path | None], Arch]] = {
    "llada": read_llada,
    "dream": lambda c, _: read_qwen(c, qkv_bias=True, qk_norm=False),
    "sdar": lambda c, _: read_qwen(c, qkv_bias=bool(c.get("attention_bias")), qk_norm=True),
    "llada_moe": read_llada_moe,
    "llada2": read_llada2,
    "diffusion_gemma": read_gemma,
}


def swiglu(d: int, width: int) -> list[Tensor]:
    return [Tensor("linear", width, d), Tensor("linear", width, d), Tensor("linear", d, width)]


def tensors(a: Arch) -> list[Tensor]:
    """Every weight of the model, as the families' modules hold them."""
    if a.stored:
        return list(a.stored)
    d, q, kv = a.hidden, a.heads * a.head_dim, a.kv_heads * a.head_dim
    out = [Tensor("float", a.vocab, d)]  # the embedding
    for i in range(a.layers):
        out += [Tensor("float", d), Tensor("float", d)]  # the two block norms
        out += [Tensor("linear", q + 2 * kv, d), Tensor("linear", d, q)]
        if a.qkv_bias:
            out.append(Tensor("bias", q + 2 * kv))
        if a.qk_norm:
            out += [Tensor("float", a.head_dim), Tensor("float", a.head_dim)]
        if i < a.dense_layers:
            mlp = swiglu(d, a.ffn)
            if i == 0:  # the first block's MLP output projection stays float (quantize.py)
                mlp[2] = replace(mlp[2], kind="float")
            out += mlp
            continue
        out.append(Tensor("float", a.experts, d))  # the router
        if a.router_bias:
            out.append(Tensor("float", a.experts))
        out += [t for _ in range(a.experts) for t in swiglu(d, a.expert_ffn)]
        if a.shared_ffn:
            out += swiglu(d, a.shared_ffn)
    out.append(Tensor("float", d))  # the final norm
    if not a.tied:
        out.append(Tensor("head", a.vocab, d))  # the output head: int8 under int4 too
    return out


def read_arch(config: dict, family: str, folder: Path | None = None) -> Arch | None:
    """The sizes of a config.json, and of the headers in `folder` where the family is counted
    from them (None: a family or folder this check does not size)."""
    try:
        return READERS[family](config, folder) if family in READERS else None
    except (KeyError, TypeError, ValueError, IndexError, ModelLoadError):
        return None
