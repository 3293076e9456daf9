"""Several linears on one input as one matmul (q/k/v, gate/up), without a second weight copy.

After loading, a block's projections are fused once: their weights are concatenated into one
matrix stored transposed, (in, sum of outs), and each nn.Linear's parameters become views into
it. Checkpoint names, `state_dict()` and memory stay as they were; one GEMM replaces several,
and the transposed layout is the one MKL multiplies fastest for a block step's few rows. Each
output element is the same dot product as before, so results are bit-identical to the separate
linears on CPU (tests/test_fused.py; cuBLAS may pick another kernel for the wider matrix).
Only loading fuses (for inference: the views are frozen parameters), and a block whose
parameters were replaced (e.g. moved with `.to()`) runs its separate linears again
(`Fusion.intact`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

# On CPU the fused, transposed GEMMs paid at d_model 256 and cost at d_model 1024 (a random
# LLaDA folder, dual cache, gen 128, 2 threads, interleaved: d256 fused 2.18 s vs separate
# 2.66 s; d1024 fused 18.25 s vs separate 13.20 s, identical tokens), so CPU models wider than
# this keep their separate linears. CUDA always fuses (one wider GEMM, as vLLM's QKV linear).
CPU_FUSE_MAX_WIDTH = 512

# MKL's packed float32 GEMM (cblas_sgemm_pack/compute, as Inductor's CPU freezing uses): the
# weight is laid out once in the kernel's own blocks instead of at every call. Measured on the
# peer's shape (192 rows, one thread, CPU time): q/k/v 1.85 -> 1.69 ms, gate/up 5.26 -> 4.34,
# down 2.53 -> 2.02, o 0.91 -> 0.80; a whole forward 115 -> 103 ms (medians of 8, alternating).
MKL_PACKED = torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
# oneDNN's packed float32 linear (the weight reordered once into its blocked layout, as
# Inductor's CPU freezing does with `mkldnn._linear_pointwise`): 2.2-2.5x MKL's GEMM here at
# the peer's shapes (192 x 512 @ 512 x 2816, one thread: 3.0 against 7.0-7.3 ms; 1 or 2
# threads, 32 to 320 rows alike; float32 throughout, relative error 4e-7 against float64) on
# an AMD EPYC, where MKL runs a slower path; on the Intel Xeon of earlier rounds the two were
# equal. Its pack does not depend on the row count, so it serves every call; preferred to MKL's.
ONEDNN_PACKED = (
    torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
)
# Below this many multiply-adds a GEMM costs less than the packed call's extra dispatch (a
# d_model-64 block step: 32 x 64 x 192), so small products keep the one-call matmul.
PACK_MIN_MACS = 1 << 22


def worth_fusing(width: int, device: torch.device) -> bool:
    """Whether fusing a model of hidden size `width` on `device` was measured to pay."""
    return device.type != "cpu" or width <= CPU_FUSE_MAX_WIDTH


class FusedLinear:
    """One (in, sum out) weight for `linears`; `__call__` returns their outputs side by side."""

    def __init__(self, *linears: nn.Linear):
        self.linears = linears
        has_bias = [lin.bias is not None for lin in linears]
        if any(has_bias) and not all(has_bias):
            raise ValueError("cannot fuse linears of which only some have a bias")
        with torch.no_grad():
            self.weight = torch.cat([lin.weight for lin in linears]).t().contiguous()  # (in, out)
            self.bias = torch.cat([lin.bias for lin in linears]) if all(has_bias) else None
        start = 0
        for lin in linears:
            part = slice(start, start + lin.out_features)
            lin.weight = nn.Parameter(self.weight[:, part].t(), requires_grad=False)
            if self.bias is not None:
                lin.bias = nn.Parameter(self.bias[part], requires_grad=False)
            start = part.stop
        self.packed = packer_for(self.weight)
        # Inputs of at least this many elements take the packed GEMM (PACK_MIN_MACS).
        self.pack_from = math.inf if self.packed is None else PACK_MIN_MACS / self.weight.shape[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., sum out) in one GEMM (the one F.linear runs for 2-D input)."""
        if x.numel() >= self.pack_from:
            inner, outer = self.weight.shape
            out = self.packed(x.reshape(-1, inner), self.bias)
            if out is not None:
                return out.view(*x.shape[:-1], outer)
        if self.bias is None:
            # matmul folds the leading dims into one mm, as a reshape would, in one call.
            return torch.matmul(x, self.weight)
        inner, outer = self.weight.shape
        out = torch.addmm(self.bias, x.reshape(-1, inner), self.weight)
        return out.view(*x.shape[:-1], outer)


def lay_out_transposed(linear: nn.Linear) -> None:
    """Its weight as a view of (in, out) storage, as FusedLinear lays out a group's: F.linear's
    GEMM then reads it untransposed (an LM head at 32 x 64 x 79: 6.1 -> 4.2 us), each output
    the same dot product (bit-identical: tests/test_fused.py); the same bytes, no copy kept."""
    with torch.no_grad():
        rows_in = linear.weight.t().contiguous()  # (in, out)
    linear.weight = nn.Parameter(rows_in.t(), requires_grad=False)


def packer_for(weight: torch.Tensor) -> OneDnnWeight | PackedWeight | None:
    """For a CPU float32 weight, oneDNN's packed weight where torch has it, else MKL's; else
    None (the plain GEMM)."""
    cpu_float = weight.device.type == "cpu" and weight.dtype == torch.float32
    if not (cpu_float and (ONEDNN_PACKED or MKL_PACKED)):
        return None
    return OneDnnWeight(weight) if ONEDNN_PACKED else PackedWeight(weight)


def version(t: torch.Tensor) -> int:
    """How often `t` was written in place (inference tensors keep no count: always 0)."""
    return 0 if t.is_inference() else t._version


class PackedWeight:
    """A fused weight in MKL's packed layout for one row count, made once a row count repeats.

    MKL packs B for a given M: the pack is made on the second call in a row with the same rows
    (a no-cache decode's every forward, a cached decode's block steps) and replaced when another
    row count repeats; other calls (one-off shapes, autograd) return None for the plain GEMM.
    The pack holds a second copy of the weight, about 1.25 times its bytes (fusing is limited
    to d_model <= 512 on CPU, so this stays small). The same dot products summed in MKL's
    packed kernel's order: equal to the plain GEMM within float32 rounding (bit-identical at
    K = 512 here, not at K = 1408), and tokens identical on the models checked (docs/cpu.md).
    """

    def __init__(self, weight: torch.Tensor):
        self.weight = weight  # (in, out), the fused storage
        self.rows: int | None = None  # the row count `pack` is for
        self.seen: int | None = None  # the last row count that had no pack
        self.pack: torch.Tensor | None = None
        self.version = -1  # the weight's version counter when packed (in-place writes bump it)

    def __call__(self, flat: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """flat (M, in) @ weight (+ bias) with the packed weight, or None: not packed for M."""
        m = flat.shape[0]
        if flat.requires_grad or flat.dtype != torch.float32:
            return None
        if m != self.rows or version(self.weight) != self.version:
            if m != self.seen and m != self.rows:
                self.seen = m
                return None
            rows_out = self.weight.t().contiguous()  # (out, in): the layout the packer reads
            self.pack, self.rows = torch.ops.mkl._mkl_reorder_linear_weight(rows_out, m), m
            self.version = version(self.weight)
        return torch.ops.mkl._mkl_linear(flat, self.pack, self.weight.t(), bias, m)


class OneDnnWeight:
    """A fused weight reordered once into oneDNN's blocked layout, for every row count.

    Made on the first float32 call without autograd and remade after an in-place write to the
    weight. A second copy of the weight (its bytes again; fusing is limited to d_model <= 512
    on CPU, so this stays small). The same dot products summed in oneDNN's order: equal to the
    plain GEMM within float32 rounding, not bit for bit (tests/test_fused.py).
    """

    def __init__(self, weight: torch.Tensor):
        self.weight = weight  # (in, out), the fused storage
        self.pack: torch.Tensor | None = None
        self.version = -1  # the weight's version counter when packed (in-place writes bump it)

    def __call__(self, flat: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """flat (M, in) @ weight (+ bias) through the packed weight, or None (autograd, or
        another dtype: the plain GEMM)."""
        if flat.requires_grad or flat.dtype != torch.float32:
            return None
        if self.pack is None or version(self.weight) != self.version:
            rows_out = self.weight.t().contiguous()  # (out, in): the layout the reorder reads
            self.pack = torch.ops.mkldnn._reorder_linear_weight(rows_out)
            self.version = version(self.weight)
        return torch.ops.mkldnn._linear_pointwise(flat, self.pack, bias, "none", [], "")


class Fusion:
    """A block's fused groups by name (`fusion.qkv(x)`), and whether they are still current.

    Each group is also a plain attribute (read at every layer of every step, with no
    `__getattr__` call); `set` replaces one in both places."""

    def __init__(self, **groups: tuple[nn.Linear, ...]):
        self.groups: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
        for name, linears in groups.items():
            self.set(name, FusedLinear(*linears))
        self.linears = [lin for linears in groups.values() for lin in linears]
        self.pointers = self.current()

    def set(self, name: str, group: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Group `name` is now `group` (quantized, or summed across shards)."""
        self.groups[name] = group
        self.__dict__[name] = group

    @property
    def linears(self) -> list[nn.Module]:
        return self._linears

    @linears.setter
    def linears(self, linears: list[nn.Module]) -> None:
        self._linears = linears
        # The linears' own tensor tables, looked up once (each forward reads them).
        self._held = [d for lin in linears for d in (lin._parameters, lin._buffers)]

    def intact(self) -> bool:
        """Every linear still reads the fused storage (one cheap check per block forward)."""
        return self.current() == self.pointers

    def current(self) -> list[int]:
        """Where each linear's tensors live now (parameters, or an int8 layer's buffers)."""
        return [t.data_ptr() for held in self._held for t in held.values() if t is not None]
