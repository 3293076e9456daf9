"""KVCache: per-layer keys/values over the whole canvas, read and written by column.

Columns are either one slice shared by every row (the fast path: rows in lockstep) or a
(B, T) long tensor of canvas columns per row (rows at different places of their decode). A
per-row forward pads short rows with queries aimed at the scratch column: one extra column
after the canvas that every key mask leaves out, so padding writes land where nothing reads.
"""

from __future__ import annotations

import torch

Columns = slice | torch.Tensor  # shared slice, or (B, T) long canvas columns per row


class KVCache:
    """Keys and values of every canvas column, one tensor pair per layer.

    Keys are stored after RoPE, so a cached key keeps the absolute position it was computed at.
    The cache is the only state a cache policy needs: a policy decides which columns a forward
    recomputes (the active window); every other column is read from here. With `scratch` the
    tensors hold one more column (index `width`) for padding queries; callers must then pass a
    key mask that excludes it.
    """

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], scratch: bool = False):
        self.k = k  # per layer (B, H_kv, S (+1 scratch), D)
        self.v = v
        self.scratch = scratch

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
        scratch: bool = False,
    ) -> KVCache:
        shape = (batch, n_kv_heads, length + int(scratch), head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        return cls(k, v, scratch)

    @classmethod
    def for_model(cls, model, batch: int, length: int, scratch: bool = False) -> KVCache:
        """A cache shaped for `model` (any of our diffusion architectures)."""
        n_layers, n_kv, head_dim = model.kv_shape()
        p = next(model.parameters())
        return cls.empty(n_layers, batch, n_kv, length, head_dim, p.dtype, p.device, scratch)

    @property
    def width(self) -> int:
        """Canvas columns held (the scratch column not counted); it is also the scratch index."""
        return self.k[0].shape[2] - int(self.scratch)

    def update(
        self, layer: int, columns: Columns, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write K/V of the active columns; return K/V of the whole canvas for attention."""
        if isinstance(columns, slice):
            self.k[layer][:, :, columns] = k  # (B, H_kv, T, D)
            self.v[layer][:, :, columns] = v
        else:
            every = torch.arange(columns.shape[0], device=columns.device)
            write_columns(self.k[layer], every, columns, k)
            write_columns(self.v[layer], every, columns, v)
        return self.k[layer], self.v[layer]

    def rows(self, rows: torch.Tensor) -> CacheRows:
        """A view of some batch rows for a forward that serves only those rows."""
        return CacheRows(self, rows)

    def select_rows(self, rows: torch.Tensor) -> KVCache:
        """Keep only some batch rows (rows that finished early leave the batch)."""
        return KVCache([k[rows] for k in self.k], [v[rows] for v in self.v], self.scratch)

    def clone(self) -> KVCache:
        return KVCache([k.clone() for k in self.k], [v.clone() for v in self.v], self.scratch)


class CacheRows:
    """Rows `rows` of a KVCache: writes go to those rows, attention reads only them."""

    def __init__(self, cache: KVCache, rows: torch.Tensor):
        self.cache, self.row_ids = cache, rows

    def update(
        self, layer: int, columns: Columns, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(columns, slice):
            span = torch.arange(self.cache.width + int(self.cache.scratch), device=k.device)
            columns = span[columns].expand(len(self.row_ids), -1)  # (R, T)
        write_columns(self.cache.k[layer], self.row_ids, columns, k)
        write_columns(self.cache.v[layer], self.row_ids, columns, v)
        return self.cache.k[layer][self.row_ids], self.cache.v[layer][self.row_ids]


def write_columns(
    store: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor, fresh: torch.Tensor
) -> None:
    """store[rows[r], :, columns[r, t]] = fresh[r, :, t] for (R, T) columns."""
    # (B, S, H, D) view: advanced indices on its first two dims write through to `store`.
    store.transpose(1, 2)[rows[:, None], columns] = fresh.transpose(1, 2)
