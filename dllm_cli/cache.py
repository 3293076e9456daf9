"""KVCache: per-layer keys/values over the whole canvas, read and written by column.

One type (gpt-fast's `KVCache` is the model): `update` writes a forward's fresh K/V and returns
the K/V its queries attend; `view(rows, lo)` is the same cache seen by a forward that serves
only some rows and attends keys from column `lo` on (a row's own columns: ragged rows, see
decoding/forwards.py); `select_rows` and `pad` reshape it as rows leave and the canvas
widens. Columns are either one slice shared by every row (rows in lockstep) or a (B, T) long
tensor of canvas columns per row (rows at different places of their decode). A per-row forward
pads short rows with queries aimed at the scratch column: one extra column after the canvas
that every key mask leaves out, so padding writes land where nothing reads. The block-causal
models (models/block.py) keep their rows here too: a block-causal row is a row of per-row
columns whose key mask is block-causal (per query). So does dllm's AR guide (models/causal.py):
one column per cached slot, widened when a forward lacks room (decoding/guide_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Columns = slice | torch.Tensor  # shared slice, or (B, T) long canvas columns per row


@dataclass(eq=False, repr=False)
class KVCache:
    """Keys (after RoPE: each keeps its absolute position) and values of every canvas column,
    one tensor pair per layer; a forward recomputes its window and reads every other column here.

    `scratch`: one more column (index `width`) for padding queries, which the key mask must
    exclude. A view (`row_ids`, `lo`) shares the tensors: its forward's row i is cache row
    `row_ids[i]`, attending columns `lo` onwards (its key mask starts there).
    """

    k: list[torch.Tensor]  # per layer (N, H_kv, S (+1 scratch), D)
    v: list[torch.Tensor]
    scratch: bool = False
    row_ids: torch.Tensor | None = None  # (R,) cache rows a forward serves (None: all, in order)
    lo: int = 0  # key columns attended: [lo, hi) (None: to the end)
    # row_ids as host ints where the caller knows them: a packed forward then reads one row's
    # keys as a view instead of gathering them (decoding/packing.py)
    hosts: tuple[int, ...] | None = None
    hi: int | None = None

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

    @property
    def whole(self) -> bool:
        """Every row in order, every column: what a recorded (CUDA-graph) step may replay on."""
        return self.row_ids is None and self.lo == 0 and self.hi is None

    def view(
        self,
        rows: torch.Tensor | None = None,
        lo: int = 0,
        hosts: tuple[int, ...] | None = None,
        hi: int | None = None,
    ) -> KVCache:
        """The cache as a forward over `rows` (this view's rows; None: all) attending keys of
        columns [lo, hi) sees it; itself when that is all of it. `hosts`: `rows` as host ints."""
        if rows is not None and self.row_ids is not None:
            rows, hosts = self.row_ids[rows], None
        elif rows is None:
            rows, hosts = self.row_ids, self.hosts
        if rows is None and lo == 0 and hi is None:
            return KVCache(self.k, self.v, self.scratch) if not self.whole else self
        return KVCache(self.k, self.v, self.scratch, rows, lo, hosts, hi)

    def update(
        self, layer: int, columns: Columns, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write K/V of the active columns; return the K/V attention reads (its rows, [lo, hi))."""
        store_k, store_v, rows = self.k[layer], self.v[layer], self.row_ids
        lo, hi = self.lo, self.hi
        if rows is None and isinstance(columns, slice):
            store_k[:, :, columns] = k  # (B, H_kv, T, D)
            store_v[:, :, columns] = v
        else:
            if rows is None:
                rows = torch.arange(k.shape[0], device=k.device)
            if isinstance(columns, slice):
                span = torch.arange(store_k.shape[2], device=k.device)
                columns = span[columns].expand(len(rows), -1)  # (R, T)
            write_columns(store_k, rows, columns, k)
            write_columns(store_v, rows, columns, v)
        if self.row_ids is None:
            if lo == 0 and hi is None:  # (a slice from 0 is one more op per tensor and layer)
                return store_k, store_v
            return store_k[:, :, lo:hi], store_v[:, :, lo:hi]  # views, no copy
        return store_k[rows, :, lo:hi], store_v[rows, :, lo:hi]

    def select_rows(self, rows: torch.Tensor) -> KVCache:
        """Keep only some batch rows (rows that finished early leave the batch)."""
        return KVCache([k[rows] for k in self.k], [v[rows] for v in self.v], self.scratch)

    def pad(self, left: int = 0, right: int = 0) -> KVCache:
        """More columns before every row (the canvas grew its prompt width) or after it (wider
        block canvases joined). The old scratch column becomes a canvas column: it holds
        padding writes, so a key mask must leave it out until a forward writes it."""
        pad = torch.nn.functional.pad
        k = [pad(t, (0, 0, left, right)) for t in self.k]
        return KVCache(k, [pad(t, (0, 0, left, right)) for t in self.v], self.scratch)

    def clone(self) -> KVCache:
        return KVCache([k.clone() for k in self.k], [v.clone() for v in self.v], self.scratch)


def write_columns(
    store: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor, fresh: torch.Tensor
) -> None:
    """store[rows[r], :, columns[r, t]] = fresh[r, :, t] for (R, T) columns."""
    # (B, S, H, D) view: advanced indices on its first two dims write through to `store`.
    store.transpose(1, 2)[rows[:, None], columns] = fresh.transpose(1, 2)
