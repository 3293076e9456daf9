"""KVCache: per-layer keys/values over the whole canvas, read and written by column."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every canvas column, one tensor pair per layer.

    Keys are stored after RoPE, so a cached key keeps the absolute position it was computed at.
    The cache is the only state a cache policy needs: a policy decides which columns a forward
    recomputes (the active window); every other column is read from here.
    """

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]):
        self.k = k  # per layer (B, H_kv, S, D)
        self.v = v

    @classmethod
    def empty(
        cls,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        length: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVCache:
        shape = (batch, n_kv_heads, length, head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        return cls(k, v)

    @classmethod
    def for_model(cls, model, batch: int, length: int) -> KVCache:
        """A cache shaped for `model` (any of our diffusion architectures)."""
        n_layers, n_kv, head_dim = model.kv_shape()
        p = next(model.parameters())
        return cls.empty(n_layers, batch, n_kv, length, head_dim, p.dtype, p.device)

    def update(
        self, layer: int, columns: slice, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write K/V of the active columns; return K/V of the whole canvas for attention."""
        self.k[layer][:, :, columns] = k  # (B, H_kv, T, D)
        self.v[layer][:, :, columns] = v
        return self.k[layer], self.v[layer]

    def select_rows(self, rows: torch.Tensor) -> KVCache:
        """Keep only some batch rows (rows that finished early leave the batch)."""
        return KVCache([k[rows] for k in self.k], [v[rows] for v in self.v])

    def clone(self) -> KVCache:
        return KVCache([k.clone() for k in self.k], [v.clone() for v in self.v])
