"""Will it fit? Memory a model needs, from config.json, against the device's free memory.

Three parts: the weights at the chosen precision and quantization (every tensor the families'
modules hold, counted from the config's sizes: fit_sizes.py), the KV cache (K and V of every layer for each
slot's whole canvas, prompt + answer), and the activations of one step (the widest
intermediate tensors of one forward over every slot's canvas). int8 follows models/quantize.py:
projections (attention, MLP, experts, output head) are int8 with one float32 scale per output
channel, their biases float32; embeddings, norms, MoE routers and the first block's MLP output
projection stay in the load dtype. int4 is counted group-wise on the same tensors (INT4_* below)
but the output head, which int4 keeps in int8 (quantize.py).
DiffusionGemma is counted from its safetensors headers instead (fit_sizes.read_gemma): its encoder and
decoder share one set of tensors, and a layer's K/V width is its k_proj's.
No torch here: `dllm list` judges every profile without loading anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from dllm_cli.errors import ModelLoadError
from dllm_cli.fit_sizes import Arch, Tensor, read_arch, tensors

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
    """K and V of every layer for `slots` rows of `canvas` tokens (a sliding window's layer:
    at most the tokens it keeps)."""
    layers = a.kv_layers or ((a.kv_heads * a.head_dim, 0),) * a.layers
    width = sum(k * min(canvas, window or canvas) for k, window in layers)
    return 2 * width * slots * FLOAT_BYTES[dtype]


def activation_bytes(a: Arch, slots: int, canvas: int, answer: int, dtype: str) -> int:
    """One step's widest live tensors: float32 logits over the answer, then one layer's
    hidden states, q/k/v, attention scores and MLP intermediates over the canvas. DiffusionGemma
    reads one canvas a forward (`step_tokens`) against the whole cache, and holds about three
    float32 logit tensors of it (the logits, the sampler's softmax, self-conditioning)."""
    size, queries = FLOAT_BYTES[dtype], a.step_tokens or canvas
    width = a.ffn if a.dense_layers == a.layers else a.active_experts * a.expert_ffn + a.shared_ffn
    kv_width = max((k for k, _ in a.kv_layers), default=a.kv_heads * a.head_dim)
    qkv = a.heads * a.head_dim + 2 * kv_width
    per_token = (4 * a.hidden + qkv + 3 * width) * size
    scores = slots * a.heads * queries * (canvas + a.step_tokens) * size
    logits = slots * (3 * queries if a.step_tokens else answer) * a.vocab * 4
    return logits + slots * queries * per_token + scores


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
    if a.step_tokens:  # whole canvases are denoised
        answer = math.ceil(answer / a.step_tokens) * a.step_tokens
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
    if gpu and a.splits:
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
    folder: Path | None = None,
) -> Need | None:
    """The load's needs, or FitError when it will not fit (None: a family not sized here)."""
    a = read_arch(config, family, folder)
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
