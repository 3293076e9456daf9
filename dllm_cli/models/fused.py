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

from collections.abc import Callable

import torch
from torch import nn

# On CPU the fused, transposed GEMMs paid at d_model 256 and cost at d_model 1024 (a random
# LLaDA folder, dual cache, gen 128, 2 threads, interleaved: d256 fused 2.18 s vs separate
# 2.66 s; d1024 fused 18.25 s vs separate 13.20 s, identical tokens), so CPU models wider than
# this keep their separate linears. CUDA always fuses (one wider GEMM, as vLLM's QKV linear).
CPU_FUSE_MAX_WIDTH = 512


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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., sum out) in one GEMM (the one F.linear runs for 2-D input)."""
        if self.bias is None:
            # matmul folds the leading dims into one mm, as the reshape below, in one call.
            return torch.matmul(x, self.weight)
        flat = x.reshape(-1, x.shape[-1])
        out = torch.addmm(self.bias, flat, self.weight)
        return out.view(*x.shape[:-1], out.shape[-1])


class Fusion:
    """A block's fused groups by name (`fusion.qkv(x)`), and whether they are still current."""

    def __init__(self, **groups: tuple[nn.Linear, ...]):
        self.groups: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
            name: FusedLinear(*linears) for name, linears in groups.items()
        }
        self.linears: list[nn.Module] = [lin for linears in groups.values() for lin in linears]
        self.pointers = self.current()

    def __getattr__(self, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        try:
            return self.__dict__["groups"][name]
        except KeyError:
            raise AttributeError(name) from None

    def intact(self) -> bool:
        """Every linear still reads the fused storage (one cheap check per block forward)."""
        return self.current() == self.pointers

    def current(self) -> list[int]:
        """Where each linear's tensors live now (parameters, or an int8 layer's buffers)."""
        held = [(*lin._parameters.values(), *lin._buffers.values()) for lin in self.linears]
        return [t.data_ptr() for tensors in held for t in tensors if t is not None]
