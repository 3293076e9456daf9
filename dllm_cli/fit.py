"""Will it fit? Memory a model needs, from config.json alone, against the device's free memory.

Three parts: the weights at the chosen precision and quantization (every tensor the families'
modules hold, counted from the config's sizes), the KV cache (K and V of every layer for each
slot's whole canvas, prompt + answer), and the activations of one step (the widest
intermediate tensors of one forward over every slot's canvas). int8 follows models/quantize.py:
projections (attention, MLP, experts, output head) are int8 with one float32 scale per output
channel, their biases float32; embeddings, norms, MoE routers and the first block's MLP output
projection stay in the load dtype. int4 is counted group-wise on the same tensors (INT4_* below)
but the output head, which int4 keeps in int8 (quantize.py).
No torch here: `dllm list` judges every profile without loading anything.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from dllm_cli.errors import ModelLoadError

# int4: 4-bit values in groups of INT4_GROUP along the input, a scale and a zero per group
# (models/int4.py's DEFAULT_GROUP and bfloat16 pairs; a test holds them equal).
INT4_GROUP = 32
INT4_SCALE_BYTES = 2
INT4_ZERO_BYTES = 2
INT8_SCALE_BYTES = 4  # one float32 scale per output channel (Int8Linear)
FLOAT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PRECISIONS = ("float32", "bfloat16", "int8", "int4")  # as `dllm profiles show` lists them
PROMPT_TOKENS = 512  # the prompt budget a slot is sized for (the answer's length is known)
TIGHT = 0.9  # more than this share of free memory: "tight" (allocator slack, other buffers)
TENSOR_PARALLEL_FLAG = "--tensor-parallel"  # the flag that splits weights over N GPUs
GB = 1e9


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


@dataclass(frozen=True)
class Tensor:
    """One weight: `kind` decides how it is stored (linear: quantized; float: load dtype)."""

    kind: str  # linear | head | float | bias (a quantized linear's bias: float32)
    rows: int  # output channels (a linear's scales)
    cols: int = 1

    @property
    def numel(self) -> int:
        return self.rows * self.cols


def read_llada(c: dict) -> Arch:
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


def read_llada_moe(c: dict) -> Arch:
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


def read_llada2(c: dict) -> Arch:
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


# families.py key -> how its config.json names the sizes.
READERS: dict[str, Callable[[dict], Arch]] = {
    "llada": read_llada,
    "dream": lambda c: read_qwen(c, qkv_bias=True, qk_norm=False),
    "sdar": lambda c: read_qwen(c, qkv_bias=bool(c.get("attention_bias")), qk_norm=True),
    "llada_moe": read_llada_moe,
    "llada2": read_llada2,
}


def swiglu(d: int, width: int) -> list[Tensor]:
    return [Tensor("linear", width, d), Tensor("linear", width, d), Tensor("linear", d, width)]


def tensors(a: Arch) -> list[Tensor]:
    """Every weight of the model, as the families' modules hold them."""
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


def tensor_bytes(t: Tensor, float_bytes: int, quantize: str) -> float:
    """One tensor's bytes at the load dtype, quantized as `quantize` stores it."""
    if t.kind == "bias":
        return t.numel * (4 if quantize != "none" else float_bytes)  # Int8Linear keeps float32
    if t.kind == "float" or quantize == "none":
        return t.numel * float_bytes
    if quantize == "int8" or t.kind == "head":
        return t.numel + t.rows * INT8_SCALE_BYTES
    groups = t.rows * math.ceil(t.cols / INT4_GROUP)  # int4
    return t.numel / 2 + groups * (INT4_SCALE_BYTES + INT4_ZERO_BYTES)


def weight_bytes(a: Arch, dtype: str = "bfloat16", quantize: str = "none") -> int:
    """The weights' bytes: dtype float32 | bfloat16 | float16, quantize none | int8 | int4."""
    size = FLOAT_BYTES[dtype]
    return round(sum(tensor_bytes(t, size, quantize) for t in tensors(a)))


def precision_bytes(a: Arch, precision: str) -> int:
    """float32 / bfloat16 as they load; int8 / int4 over bfloat16 (what a GPU load keeps)."""
    if precision in FLOAT_BYTES:
        return weight_bytes(a, precision)
    return weight_bytes(a, "bfloat16", precision)


def parameters(a: Arch) -> int:
    return sum(t.numel for t in tensors(a))


def kv_bytes(a: Arch, slots: int, canvas: int, dtype: str) -> int:
    """K and V of every layer for `slots` rows of `canvas` tokens."""
    return 2 * a.layers * a.kv_heads * a.head_dim * slots * canvas * FLOAT_BYTES[dtype]


def activation_bytes(a: Arch, slots: int, canvas: int, answer: int, dtype: str) -> int:
    """One step's widest live tensors: float32 logits over the answer, then one layer's
    hidden states, q/k/v, attention scores and MLP intermediates over the canvas."""
    size, tokens = FLOAT_BYTES[dtype], slots * canvas
    width = a.ffn if a.dense_layers == a.layers else a.active_experts * a.expert_ffn + a.shared_ffn
    qkv = (a.heads + 2 * a.kv_heads) * a.head_dim
    per_token = (4 * a.hidden + qkv + 3 * width) * size
    scores = slots * a.heads * canvas * canvas * size
    return slots * answer * a.vocab * 4 + tokens * per_token + scores


@dataclass(frozen=True)
class Need:
    """What a load needs, in bytes, and what the device has free."""

    weights: int
    kv: int
    activations: int
    free: int
    precision: str
    slots: int
    canvas: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.activations

    @property
    def verdict(self) -> str:
        if self.total <= TIGHT * self.free:
            return "fits"
        return "tight" if self.total <= self.free else "will not fit"


def need(
    a: Arch, free: int, dtype: str, quantize: str, slots: int, answer: int, shards: int = 1
) -> Need:
    """The bytes of a load of `a` with `slots` rows answering `answer` tokens."""
    canvas = PROMPT_TOKENS + answer
    weights = math.ceil(weight_bytes(a, dtype, quantize) / shards)
    kv = math.ceil(kv_bytes(a, slots, canvas, dtype) / shards)
    activations = activation_bytes(a, slots, canvas, answer, dtype)
    precision = quantize if quantize != "none" else dtype
    return Need(weights, kv, activations, free, precision, slots, canvas)


def gb(n: float) -> str:
    """Bytes for people: GB, or MB below one GB."""
    return f"{n / GB:.1f} GB" if n >= GB else f"{n / 1e6:.1f} MB"


def describe(n: Need) -> str:
    """The numbers, in one clause."""
    return (
        f"needs {gb(n.total)} (weights {gb(n.weights)} in {n.precision}, KV cache "
        f"{gb(n.kv)} for {n.slots} slot(s) x {n.canvas} tokens, activations {gb(n.activations)})"
        f" but {gb(n.free)} is free"
    )


# A precision to suggest -> (quantize, dtype) of the load it means, smallest last.
CHEAPER = {
    "float32": ("none", "float32"),
    "bfloat16": ("none", "bfloat16"),
    "int8": ("int8", "bfloat16"),
    "int4": ("int4", "bfloat16"),
}


def alternatives(
    a: Arch, free: int, dtype: str, quantize: str, slots: int, answer: int, gpu: bool
) -> list[str]:
    """What would fit instead: a smaller precision, fewer slots, the weights split over GPUs."""
    out, order = [], list(CHEAPER)
    now = quantize if quantize != "none" else dtype
    for precision in order[order.index(now) + 1 if now in order else len(order) :]:
        q, d = CHEAPER[precision]
        n = need(a, free, d, q, slots, answer)
        if n.verdict == "fits":
            out.append(f"--quantize {q} ({gb(n.total)})" if q != "none" else f"--dtype {d}")
            break
    fits = [
        s for s in range(1, slots) if need(a, free, dtype, quantize, s, answer).verdict == "fits"
    ]
    if fits:
        out.append(f"--batch-size {max(fits)}")
    if gpu:
        for shards in (2, 4, 8):
            if need(a, free, dtype, quantize, slots, answer, shards).verdict == "fits":
                out.append(f"{TENSOR_PARALLEL_FLAG} {shards}")
                break
    return out


class FitError(ModelLoadError):
    """A load that cannot fit (exit 3; the message says the numbers and what would)."""


def check(
    config: dict,
    family: str,
    device: str,
    dtype: str,
    quantize: str,
    slots: int,
    answer: int,
    free: int | None = None,
    name: str = "the model",
) -> Need | None:
    """The load's needs, or FitError when it will not fit (None: a family not sized here)."""
    a = read_arch(config, family)
    if a is None:
        return None
    free = free_memory(device) if free is None else free
    if free <= 0:  # unknown (no /proc/meminfo): nothing to judge against
        return None
    n = need(a, free, dtype, quantize, slots, answer)
    if n.verdict == "will not fit":
        gpu = device.startswith("cuda")
        instead = alternatives(a, free, dtype, quantize, slots, answer, gpu)
        hint = f"try {' or '.join(instead)}" if instead else "no smaller load fits this device"
        raise FitError(f"{name} {describe(n)} on {device}: {hint}; --force to load anyway")
    return n


def read_arch(config: dict, family: str) -> Arch | None:
    """The sizes of a config.json (None: a family this check does not size)."""
    try:
        return READERS[family](config) if family in READERS else None
    except (KeyError, TypeError, ValueError):
        return None


def available_ram() -> int:
    """MemAvailable from /proc/meminfo (bytes); 0 when it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def free_memory(device: str) -> int:
    """Free bytes on `device` (cuda: torch.cuda.mem_get_info; cpu: available RAM)."""
    if device.startswith("cuda"):
        import torch

        index = int(device.partition(":")[2] or 0)
        return int(torch.cuda.mem_get_info(index)[0])
    return available_ram()
