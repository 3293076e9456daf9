"""Several linears on one input as one matmul (q/k/v, gate/up), without a second weight copy.

After loading, a block's projections are fused once: their weights are concatenated into one
matrix stored transposed, (in, sum of outs), and each nn.Linear's parameters become views into
it. Checkpoint names, `state_dict()` and memory stay as they were; one GEMM replaces several,
and the transposed layout is the one MKL multiplies fastest for a block step's few rows. Each
output element is the same dot product as before, so results are bit-identical to the separate
linears on CPU (tests/test_fused.py; cuBLAS may pick another kernel for the wider matrix).
Models built for training are never fused, and a fused layer whose parameters were replaced
(e.g. moved with `.to()`) quietly runs the separate linears again.
"""

from __future__ import annotations

import torch
from torch import nn


class FusedLinear:
    """One (in, sum out) weight for `linears`; `__call__` returns their outputs side by side."""

    def __init__(self, *linears: nn.Linear):
        self.linears = linears
        self.sizes = [lin.out_features for lin in linears]
        with torch.no_grad():
            self.weight = torch.cat([lin.weight for lin in linears]).t().contiguous()  # (in, out)
            has_bias = [lin.bias is not None for lin in linears]
            if any(has_bias) and not all(has_bias):
                raise ValueError("cannot fuse linears of which only some have a bias")
            self.bias = torch.cat([lin.bias for lin in linears]) if all(has_bias) else None
        start = 0
        for lin, size in zip(linears, self.sizes, strict=True):
            part = slice(start, start + size)
            lin.weight = nn.Parameter(self.weight[:, part].t(), lin.weight.requires_grad)
            if self.bias is not None:
                lin.bias = nn.Parameter(self.bias[part], lin.bias.requires_grad)
            start += size
        self.pointers = self._pointers()

    def intact(self) -> bool:
        """Every linear still reads its parameters where fusing put them (a cheap check)."""
        return self.pointers == self._pointers()

    def _pointers(self) -> list[int]:
        params = [lin.weight for lin in self.linears]
        params += [lin.bias for lin in self.linears] if self.bias is not None else []
        return [p.data_ptr() for p in params]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., sum out): one GEMM, or the separate linears if not intact."""
        if not self.intact():
            return torch.cat([lin(x) for lin in self.linears], dim=-1)
        flat = x.reshape(-1, x.shape[-1])  # the 2-D GEMM F.linear runs for a contiguous input
        if self.bias is None:
            out = torch.mm(flat, self.weight)
        else:
            out = torch.addmm(self.bias, flat, self.weight)
        return out.view(*x.shape[:-1], out.shape[-1])
