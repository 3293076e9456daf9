"""Quantized weights at load time: int8 per output channel (activations quantized per row), or
int4 group-wise (models/int4.py).

`quantize_model` swaps each projection (attention, MLP, experts, output head) of a loaded model
for an `Int8Linear` (nothing is written back): symmetric int8 with one float scale per output
channel (LLM.int8()'s vector-wise scheme without its outlier split, Dettmers et al. 2022), each
input row quantized the same way and multiplied int8 x int8 -> int32 by `torch._int_mm`
(SmoothQuant's W8A8 without the smoothing, Xiao et al. 2023; docs/quantization.md). Embeddings,
norms, MoE routers and the first block's MLP output projection stay in the load dtype.

`--quantize int4` stores the same layers in 4 bits, one bfloat16 scale and zero per group of 32
inputs (tinygemm's format), and multiplies in bfloat16 (models/int4.py says why and how); the
output head takes int8 there, as llama.cpp's `llama-quantize` keeps `output.weight` at Q6_K
when it writes Q4_0 (6.6 bits a weight: the logits are what sampling reads).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dllm_cli.errors import ModelLoadError
from dllm_cli.models.base import DiffusionLM
from dllm_cli.models.fused import FusedLinear, Fusion
from dllm_cli.models.int4 import DEFAULT_GROUP, Int4Linear, check_group

INT8_MAX = 127


# Linears kept in the load dtype: a MoE router's few logits decide which experts run.
KEEP_FLOAT = ("gate",)
# The first block's MLP output projection stays in the load dtype too: its input carries the
# largest activation outliers of the network (the "massive activations" that early MLPs
# create, Sun et al. 2024, arXiv:2402.17762), which one int8 scale per row flattens. On the
# shipped model this one layer is 2/3 of int8's error in the logits (docs/quantization.md).
FIRST_BLOCK_FLOAT = ("down",)  # the fused group (fused.py) of the MLP output projection
MLP_OUT = ("down_proj", "ff_out")  # its linears' names in the families, fused or not


@dataclass(frozen=True)
class Scheme:
    """One `--quantize` value: what it stores and how a layer is made."""

    name: str
    bits: int
    make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module] | None = None
    group: int = 0  # inputs per scale (0: one scale per output channel)
    head: Callable[[torch.Tensor, torch.Tensor | None], nn.Module] | None = None  # else `make`


def scheme_for(name: str) -> Scheme:
    """The scheme named, or a ModelLoadError naming the known ones."""
    scheme = SCHEMES.get(str(name).strip().lower())
    if scheme is None:
        known = ", ".join(SCHEMES)
        raise ModelLoadError(f"unknown quantization {name!r} (use {known})")
    return scheme


def row_peaks(x: torch.Tensor) -> torch.Tensor:
    """(N, K) -> float32 (N, 1): max |x| per row."""
    x = x.float()  # max(-min, max): two reductions, no |x| buffer (faster than abs().amax())
    return torch.maximum(x.amin(dim=-1, keepdim=True).neg_(), x.amax(dim=-1, keepdim=True))


def quantize_rows(
    x: torch.Tensor, peak: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> int8 (N, K) and float32 scales (N, 1): x ~= q * scale, |q| <= 127;
    `peak` (N, 1): each row's max |x| when the row is wider than x (tensor parallelism)."""
    x = x.float()
    peak = row_peaks(x) if peak is None else peak.clone()
    scale = peak.clamp_(min=1e-12).div_(INT8_MAX)  # (N, 1)
    q = x.div(scale).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def int_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 @ (K, M) int8 -> (N, M) int32, exactly; CUDA's kernel wants N > 16 and K, M
    multiples of 8, so there the operands are zero-padded and the result cut back."""
    if a.device.type != "cuda":
        return torch._int_mm(a, b)
    n, k = a.shape
    m = b.shape[1]
    pad_k, pad_m = -k % 8, -m % 8
    if pad_k or pad_m:  # never for real checkpoints' widths (multiples of 8)
        b = torch.nn.functional.pad(b, (0, pad_m, 0, pad_k))
    if pad_k or n <= 16:
        a = torch.nn.functional.pad(a, (0, pad_k, 0, max(0, 17 - n)))
    return torch._int_mm(a, b)[:n, :m]


class Int8Linear(nn.Module):
    """y = x W^T + b with W int8 per output channel and x quantized per row at each call."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = qweight.shape
        self.register_buffer("qweight", qweight)  # (in, out) int8: _int_mm's layout
        self.register_buffer("scale", scale)  # (1, out) float32
        self.register_buffer("bias", bias)  # (out,) float32, or None

    @classmethod
    def of(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        peak: torch.Tensor | None = None,
    ) -> Int8Linear:
        """Quantize a float (out, in) weight (and keep its bias in float32); `peak` (out, 1):
        its whole rows' max |w| where it holds some of their inputs (tensor parallelism)."""
        with torch.no_grad():
            q, scale = quantize_rows(weight.detach(), peak)
            kept = None if bias is None else bias.detach().float().clone()
        return cls(q.t().contiguous(), scale.view(1, -1), kept)

    def part(self, start: int, stop: int) -> Int8Linear:
        """Output channels start..stop as a layer of their own, sharing this one's storage."""
        bias = None if self.bias is None else self.bias[start:stop]
        return Int8Linear(self.qweight[:, start:stop], self.scale[:, start:stop], bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N, in)
        q, row_scale = quantize_rows(flat, self.peaks(flat))
        acc = int_matmul(q, self.qweight)  # (N, out) int32
        out = acc.float().mul_(row_scale).mul_(self.scale)  # faster than int32 * float32
        if self.bias is not None:
            out.add_(self.bias)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def peaks(self, flat: torch.Tensor) -> torch.Tensor | None:
        """Each input row's max |x| (None: its own; tensor parallelism's shards reduce theirs)."""
        return None

    def dequantized(self) -> torch.Tensor:
        """The float (out, in) weight this layer multiplies by (for tests and error bounds)."""
        return (self.qweight.t().float() * self.scale.t()).contiguous()

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 per channel, W8A8"


SCHEMES: dict[str, Scheme] = {
    "none": Scheme("none", 0),
    "int8": Scheme("int8", 8, Int8Linear.of),
    "int4": Scheme("int4", 4, Int4Linear.of, group=DEFAULT_GROUP, head=Int8Linear.of),
}


# (the float linears a layer replaces, its (out, in) weight, its bias) -> the quantized layer;
# tensor parallelism's (models/sharded_load.py) knows which linears hold part of their inputs
Maker = Callable[[Sequence[nn.Linear], torch.Tensor, torch.Tensor | None], nn.Module]


def quantize_model(model: DiffusionLM, scheme: str | Scheme, make: Maker | None = None) -> int:
    """Replace the model's projections in place (instead of `fuse_projections`): how many. Each
    fused group (q/k/v, gate/up) becomes one layer; a tied head stays the embedding's float
    view; `make` (else the scheme's) makes the layers but the output head."""
    scheme = scheme if isinstance(scheme, Scheme) else scheme_for(scheme)
    if scheme.bits == 0:
        return 0
    for name, child in model.named_modules() if scheme.group else ():  # refused before changes
        if isinstance(child, nn.Linear):
            check_group(scheme.group, child.in_features, name)
    make = make or (lambda linears, weight, bias: scheme.make(weight, bias))
    count = 0
    kept: set[int] = set()  # the first block's MLP output linears
    for i, block in enumerate(model.blocks()):  # one block at a time: one float copy at most
        block.fuse()  # float groups first: their weights joined, the linears views of them
        skip = FIRST_BLOCK_FLOAT if i == 0 else ()
        owners = [m for m in block.modules() if isinstance(m.__dict__.get("fusion"), Fusion)]
        count += sum(quantize_fusion(owner, owner.fusion, skip, make) for owner in owners)
        if i == 0:
            kept = {id(m) for n, m in block.named_modules() if n.rpartition(".")[2] in MLP_OUT}
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
        and name not in KEEP_FLOAT
        and id(child.weight) not in tied
        and id(child) not in kept
    ]
    heads = {id(m) for m in output_heads(model)}
    for parent, name, child in targets:
        head = scheme.head if id(child) in heads and scheme.head else None
        layer = head(child.weight, child.bias) if head else make([child], child.weight, child.bias)
        setattr(parent, name, layer)
    model.quantized = scheme.name
    return count + len(targets)


def quantize_loaded(
    model: DiffusionLM, scheme: Scheme, dtype: torch.dtype, make: Maker | None = None
) -> None:
    """Quantize a model read in `load_dtype`'s dtype, cast the rest to `dtype`, free the floats."""
    quantize_model(model, scheme, make)
    model.to(dtype)
    refuse_float_groups(model)
    release_freed_memory()


def release_freed_memory() -> None:
    """Hand the freed float weights back to the OS (glibc keeps freed heap pages otherwise)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def quantize_linears(model: nn.Module, scheme: Scheme, keep: Callable[[str], bool]) -> int:
    """Every nn.Linear of a model dllm did not build (transformers' DiffusionGemma) as the
    scheme's layer, but those `keep(name)` holds and those tied to an embedding (kept float);
    returns how many. No fused groups: each linear is quantized alone, and linears that share
    one weight (DiffusionGemma's encoder and decoder) share one quantized layer."""
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    targets = [
        (name, child)
        for name, child in model.named_modules()
        if isinstance(child, nn.Linear) and id(child.weight) not in tied and not keep(name)
    ]
    for name, child in targets:  # refuse a group size before any layer changes
        if scheme.group:
            check_group(scheme.group, child.in_features, name)
    made: dict[tuple[int, int], nn.Module] = {}  # ids of a float weight and bias -> its layer
    for name, child in targets:
        key = (id(child.weight), id(child.bias))
        layer = made.get(key)
        if layer is None:
            layer = made[key] = scheme.make(child.weight, child.bias)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, layer)
    model.quantized = scheme.name
    return len(targets)


def output_heads(model: DiffusionLM) -> list[nn.Linear]:
    """The linears outside the blocks that write one logit per vocabulary entry."""
    inside = {id(m) for block in model.blocks() for m in block.modules()}
    vocab = {e.weight.shape[0] for e in model.modules() if isinstance(e, nn.Embedding)}
    return [
        m
        for m in model.modules()
        if isinstance(m, nn.Linear) and id(m) not in inside and m.out_features in vocab
    ]


def quantize_fusion(owner: nn.Module, fusion: Fusion, skip: tuple[str, ...], make: Maker) -> int:
    """One quantized layer per fused group but those in `skip`; the owner's linears view it."""
    names = {id(child): name for name, child in owner.named_children()}
    views: list[nn.Module] = []
    kept = 0
    for group, fused in list(fusion.groups.items()):
        if group in skip:
            views.extend(fused.linears)
            kept += len(fused.linears)
            continue
        joined = make(fused.linears, fused.weight.t(), fused.bias)  # (sum out, in)
        fusion.set(group, joined)
        start = 0
        for lin in fused.linears:
            view = joined.part(start, start + lin.out_features)
            setattr(owner, names[id(lin)], view)
            views.append(view)
            start += lin.out_features
    fusion.linears = views
    fusion.pointers = fusion.current()
    return len(views) - kept


def refuse_float_groups(model: DiffusionLM) -> None:
    """Join the float groups kept by `quantize_model` again after a dtype cast (`.to()` gives
    their linears new storage, which would send the block back to its separate linears)."""
    for block in model.blocks():
        for owner in block.modules():
            fusion = owner.__dict__.get("fusion")
            if not isinstance(fusion, Fusion) or fusion.intact():
                continue
            for group, fused in list(fusion.groups.items()):
                if isinstance(fused, FusedLinear):
                    fusion.set(group, FusedLinear(*fused.linears))
            fusion.pointers = fusion.current()


def load_dtype(scheme: Scheme, dtype: torch.dtype, files: list[Path]) -> torch.dtype:
    """The dtype to read a folder in before quantizing: its stored bfloat16 when float32 is
    asked for (the same values, half the peak memory), else `dtype` (cast to after quantizing)."""
    if not scheme.bits or dtype != torch.float32:
        return dtype
    from safetensors import safe_open

    with safe_open(str(files[0]), framework="pt") as st:
        stored = {st.get_slice(name).get_dtype() for name in st.keys()}  # noqa: SIM118
    return torch.bfloat16 if stored == {"BF16"} else dtype


def weight_bytes(model: nn.Module) -> int:
    """Bytes held by parameters and buffers (what the weights cost resident)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers()) if t is not None}
    return sum(t.numel() * t.element_size() for t in tensors.values())
