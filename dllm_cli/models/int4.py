"""4-bit weights, group-wise: two weights a byte, one bfloat16 scale and zero per group of inputs.

The format is tinygemm's (torch's int4 weight-only kernels, `aten._weight_int4pack_mm*`, the one
torchao's int4 weight-only config stores too): per output channel and group of `group` inputs,
w ~= (q - 8) * scale + zero with q in 0..15 (asymmetric, no calibration data). Each group's
scale and zero are searched for the least squared error (`fit_groups`: llama.cpp's Q4_K
search), never worse than min/max's. At the default group of 32: 5 bits a weight on average
(GGUF's Q4_0 stores 4.5: one float16 scale per 32, no zero).

Kernels (`kernel_for`): "dequant" (CPU: each call unpacks one layer's weight to bfloat16 for
one bfloat16 GEMM), "tinygemm" (CUDA where the shape fits its tiles; its layout is checked on
CPU through the `_for_cpu` twin) and "tinygemm-cpu" (by name only; docs/quantization.md).

The scale and zero tensor is held as int16 (the bfloat16 bits): a model's `.to(dtype)` casts
floating buffers, which would double it to float32; the bits are read back as bfloat16 free.
"""

from __future__ import annotations

import torch
from torch import nn

from dllm_cli.errors import ModelLoadError

GROUP_SIZES = (32, 64, 128, 256)  # the group sizes tinygemm's kernels take
DEFAULT_GROUP = 32
LEVELS = 15  # q in 0..15
MID = 8  # tinygemm's codes are centred on 8
SEARCH_STEPS = 10  # candidate scales per group past min/max (llama.cpp's Q4_K search: 20)
SEARCH_CHUNK = 1 << 18  # weights searched at once (a few float32 copies of them in scratch)


def kernel_for(device: torch.device | str, out_features: int, in_features: int, group: int) -> str:
    """tinygemm on CUDA where it has the kernel and the shape fits its tiles (outputs by 8,
    inputs by 16 x at least 2 inner tiles), else the dequant path."""
    cuda = torch.device(device).type == "cuda" and hasattr(torch.ops.aten, "_weight_int4pack_mm")
    fits = out_features % 8 == 0 and in_features % 32 == 0 and group in GROUP_SIZES
    return "tinygemm" if cuda and fits else "dequant"


def check_group(group: int, in_features: int, name: str = "a layer") -> None:
    """Refuse a group size tinygemm does not take, or one that does not divide the inputs."""
    if group not in GROUP_SIZES:
        sizes = ", ".join(map(str, GROUP_SIZES))
        raise ModelLoadError(f"int4 group size {group} is not supported (use one of {sizes})")
    if in_features % group:
        raise ModelLoadError(
            f"int4 group size {group} does not divide {name}'s {in_features} inputs "
            "(use a group size that does)"
        )


def quantize_groups(
    weight: torch.Tensor, group: int, search: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float -> uint8 codes (out, in) and bfloat16 (out, in / group, 2) scale and zero
    pairs, by `fit_groups` (min/max with search off), codes rounded against the bfloat16 pairs."""
    in_features = weight.shape[1]
    rows = max(1, SEARCH_CHUNK // in_features)  # a slice of rows at a time: scratch in cache
    codes, pairs = [], []
    for chunk in weight.detach().float().split(rows):
        # (group, rows * G): a group's weights down a column, so its sums are row adds
        columns = chunk.reshape(-1, group).t().contiguous()
        c, scale, zero = fit_groups(columns, search)
        codes.append(c.t().reshape(chunk.shape))
        pairs.append(torch.cat((scale, zero)).t().reshape(chunk.shape[0], -1, 2))
    return torch.cat(codes), torch.cat(pairs).bfloat16()


def fit_groups(w: torch.Tensor, search: bool = True) -> tuple[torch.Tensor, ...]:
    """(group, M) groups as columns -> uint8 codes (group, M) and (1, M) scales and zeros: per
    group the least squared error among min/max, the searched fit and its refit.

    The search is llama.cpp's for Q4_K (`make_qkx2_quants`), unweighted (no calibration data):
    codes rounded at SEARCH_STEPS + 1 scales spanning 15 +- 1 levels, each least-squares fitted;
    the best one rounded to bfloat16, its codes rounded again and fitted once more (the refit).
    """
    low, high = w.amin(0, keepdim=True), w.amax(0, keepdim=True)  # (1, M)
    scale = ((high - low) / LEVELS).clamp_(min=1e-8).bfloat16().float()
    best = rounded(w, scale, low + MID * scale)  # plain min/max: (codes, scale, zero, error)
    if not search:
        return best[:3]
    sw = w.sum(0, keepdim=True)  # (1, M)
    searched = rounded(w, *searched_fit(w, low, high, sw, best[1], best[2]))
    best = least(searched, best)
    fit_scale, fit_zero, _, ok = least_squares(w, best[0].float(), sw)
    refit = rounded(w, torch.where(ok, fit_scale, best[1]), torch.where(ok, fit_zero, best[2]))
    return least(refit, best)[:3]


def least(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Per group (column), the (codes, scale, zero, error) of `a` or `b` with less error."""
    better = a[3] < b[3]  # (1, M)
    return tuple(torch.where(better, x, y) for x, y in zip(a, b, strict=True))


def searched_fit(
    w: torch.Tensor,
    low: torch.Tensor,
    high: torch.Tensor,
    sw: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The least-squares scale and zero of the candidate codes with the least error (before
    bfloat16 rounding); a group whose every candidate is degenerate keeps `scale`, `zero`."""
    span = (high - low).clamp_(min=1e-8)  # (1, M)
    best_err = torch.full_like(sw, float("inf"))
    shifted = w - low  # (group, M)
    codes = torch.empty_like(w)
    for step in range(SEARCH_STEPS + 1):
        levels = LEVELS - 1 + 2 * step / SEARCH_STEPS  # 14 .. 16 levels over the range
        torch.mul(shifted, levels / span, out=codes).round_().clamp_(0, LEVELS)
        fit_scale, fit_zero, err, ok = least_squares(w, codes, sw)
        take = ok & (err < best_err)
        best_err = torch.where(take, err, best_err)
        scale = torch.where(take, fit_scale, scale)
        zero = torch.where(take, fit_zero, zero)
    return scale, zero


def least_squares(
    w: torch.Tensor, codes: torch.Tensor, sw: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Per column, the a, b minimising sum (w - (a * codes + b))^2, as (scale a, zero b + 8 a,
    that error less sum w^2, whether it is a fit: the codes not all equal and a > 0)."""
    n = w.shape[0]
    sc, scw = codes.sum(0, keepdim=True), (codes * w).sum(0, keepdim=True)  # (1, M)
    scc = codes.square().sum(0, keepdim=True)
    det = n * scc - sc * sc  # 0 when every code is equal
    safe = torch.where(det > 0, det, torch.ones_like(det))
    a = (n * scw - sc * sw) / safe
    b = (scc * sw - sc * scw) / safe
    err = -(a * scw + b * sw)  # at the optimum: sum (w - a c - b)^2 = sum w^2 - a scw - b sw
    return a, b + MID * a, err, (det > 0) & (a > 0)


def rounded(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(codes, scale, zero, squared error per group): each weight's nearest code against the
    bfloat16-rounded scale and zero."""
    scale = scale.clamp(min=1e-8).bfloat16().float()
    zero = zero.bfloat16().float()
    codes = ((w - zero) / scale + MID).round_().clamp_(0, LEVELS)
    error = ((codes - MID) * scale + zero - w).square_().sum(0, keepdim=True)
    return codes.to(torch.uint8), scale, zero, error


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(out, in) codes -> (out, in / 2) uint8 as tinygemm's packer reads them: input 2i in the
    high nibble of byte i, 2i + 1 in the low."""
    return (codes[:, ::2] << 4 | codes[:, 1::2]).contiguous()


def pack_halves(codes: torch.Tensor, group: int) -> torch.Tensor:
    """(out, in) codes -> (out, in / 2) uint8 for the dequant path: byte j of a group holds its
    input j (low nibble) and j + group / 2 (high), so unpacking writes two contiguous runs."""
    out_features, in_features = codes.shape
    runs = codes.view(out_features, in_features // group, 2, group // 2)  # (out, G, 2, g/2)
    return (runs[:, :, 0] | runs[:, :, 1] << 4).view(out_features, -1).contiguous()


def unpack_halves(packed: torch.Tensor, group: int) -> torch.Tensor:
    """(out, in / 2) uint8 -> (out, in) codes (inverse of pack_halves)."""
    runs = packed.view(packed.shape[0], -1, group // 2)  # (out, G, g/2)
    return torch.stack((runs & 15, runs >> 4), dim=2).view(packed.shape[0], -1)


def pack(codes: torch.Tensor, group: int, kernel: str) -> torch.Tensor:
    """(out, in) codes as `kernel` stores them: two a byte (dequant), tinygemm's tiles (torch >=
    2.5 takes the codes two a byte), or torch's CPU int4 layout (int32 in, uint8 tiles out)."""
    if kernel == "dequant":
        return pack_halves(codes, group)
    if kernel == "tinygemm":
        inner_tiles = next(t for t in (8, 4, 2) if codes.shape[1] % (16 * t) == 0)
        return torch.ops.aten._convert_weight_to_int4pack(pack_nibbles(codes), inner_tiles)
    if kernel == "tinygemm-cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    raise KeyError(kernel)  # (a kernel name of none of the three)


class Int4Linear(nn.Module):
    """y = x W^T + b with W stored in 4 bits, group-wise (module docstring)."""

    def __init__(
        self,
        packed: torch.Tensor,
        pairs: torch.Tensor,
        bias: torch.Tensor | None,
        in_features: int,
        group: int,
        kernel: str,
    ):
        super().__init__()
        self.in_features, self.group, self.kernel = in_features, group, kernel
        self.out_features = pairs.shape[0] if kernel == "dequant" else pairs.shape[1]
        self.register_buffer("packed", packed)  # dequant: (out, in/2) uint8; tinygemm: its tiles
        self.register_buffer("pairs", pairs.view(torch.int16))  # bfloat16 bits (docstring)
        self.register_buffer("bias", bias)  # (out,) float32, or None

    @classmethod
    def of(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        group: int = DEFAULT_GROUP,
        kernel: str | None = None,
    ) -> Int4Linear:
        """Quantize a float (out, in) weight on its device (its bias kept in float32); `kernel`
        names a kernel instead of the device's choice (`kernel_for`)."""
        out_features, in_features = weight.shape
        check_group(group, in_features)
        kernel = kernel or kernel_for(weight.device, out_features, in_features, group)
        with torch.no_grad():
            codes, pairs = quantize_groups(weight, group)
            packed = pack(codes, group, kernel)
            if kernel != "dequant":
                pairs = pairs.transpose(0, 1).contiguous()  # (in / group, out, 2): tinygemm's
            kept = None if bias is None else bias.detach().float().clone()
        return cls(packed, pairs, kept, in_features, group, kernel)

    def part(self, start: int, stop: int) -> nn.Module:
        """Output channels start..stop as a layer of their own (views of this one's storage;
        tinygemm's tiles cannot be cut, so there the whole product is narrowed)."""
        if self.kernel != "dequant":
            return Narrowed(self, start, stop)
        bias = None if self.bias is None else self.bias[start:stop]
        pairs = self.pairs[start:stop].view(torch.bfloat16)
        packed = self.packed[start:stop]
        return Int4Linear(packed, pairs, bias, self.in_features, self.group, self.kernel)

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The (out, in) weight this layer multiplies by, in `dtype` (dequant kernel only):
        scaled in float32 (bfloat16 elementwise ops are slower), rounded to `dtype` once."""
        out_features, g = self.out_features, self.in_features // self.group
        pairs = self.pairs.view(torch.bfloat16).float()  # (out, G, 2)
        scale, zero = pairs[..., :1], pairs[..., 1:]
        offset = zero - MID * scale  # (out, G, 1): small next to the weight
        codes = unpack_halves(self.packed, self.group).view(out_features, g, self.group)
        w = codes.float().mul_(scale).add_(offset)  # (out, G, group)
        return w.view(out_features, self.in_features).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N, in)
        out = self.products(flat)  # (N, out) bfloat16
        if self.bias is not None:  # added in float32, as Int8Linear does
            out = out.float().add_(self.bias)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def products(self, flat: torch.Tensor) -> torch.Tensor:
        """(N, in) -> (N, out) bfloat16: x W^T on this layer's kernel."""
        x = flat.to(torch.bfloat16)
        if self.kernel == "dequant":
            return torch.mm(x, self.dequantized(torch.bfloat16).t())
        aten, cpu = torch.ops.aten, self.kernel == "tinygemm-cpu"  # tiles, (G, out, 2) pairs
        mm = aten._weight_int4pack_mm_for_cpu if cpu else aten._weight_int4pack_mm
        return mm(x, self.packed, self.group, self.pairs.view(torch.bfloat16))

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, int4 group {self.group}, "
            f"{self.kernel}"
        )


class Narrowed(nn.Module):
    """Output channels start..stop of a layer whose storage cannot be sliced."""

    def __init__(self, whole: Int4Linear, start: int, stop: int):
        super().__init__()
        self.__dict__["whole"] = whole  # not a child: its bytes are counted once, by its owner
        self.start, self.stop = start, stop
        self.out_features = stop - start
        for name in ("packed", "pairs", "bias"):  # the same tensors: counted once, and
            self.register_buffer(name, getattr(whole, name))  # what Fusion.intact() reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.whole(x)[..., self.start : self.stop]
