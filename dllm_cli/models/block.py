"""What block-causal diffusion models (SDAR, LLaDA2.x) share: the block-causal key mask,
partial RoPE, and the model base.

Attention is bidirectional inside a block and causal across blocks (SDAR, arXiv 2510.06303;
LLaDA2.0, arXiv 2512.15745), so a finished block's K/V never change and a cache of them is
exact. These models run DiffusionLM's one forward over the same KVCache as LLaDA and Dream;
only their key mask (`block_keys`: each query sees its own block and every earlier one) differs.
"""

from __future__ import annotations

import torch

from dllm_cli.models.base import DiffusionLM
from dllm_cli.models.layers import apply_rope


def block_key_mask(length: int, block: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(T, T) bool: query column i may see key column j when j's block is not after i's."""
    columns = torch.arange(length, device=device)
    return block_keys(columns[None], torch.tensor([length], device=device), block, length)[0]


def block_keys(columns: torch.Tensor, ends: torch.Tensor, block: int, keys: int) -> torch.Tensor:
    """(N, T, keys) bool key mask of queries at canvas `columns` (N, T): key column j is seen
    when its block is not after the query's and j is before the row's end (N,). A query at
    the cache's scratch column (past every block) sees all of its row's keys."""
    j = torch.arange(keys, device=columns.device)
    same_or_earlier = (j // block)[None, None] <= (columns // block)[..., None]  # (N, T, K)
    return same_or_earlier & (j[None] < ends[:, None])[:, None]


def rope_partial(x: torch.Tensor, rope: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Rotate-half RoPE (layers.apply_rope, model dtype) on the first cos.shape[-1] dims of
    (B, H, T, D); the rest pass (LLaDA2's partial_rotary_factor)."""
    n = rope[0].shape[-1]
    turned = apply_rope(x[..., :n], *rope[:2], False, *rope[2:])
    return turned if n == x.shape[-1] else torch.cat([turned, x[..., n:]], dim=-1)


class BlockDiffusionLM(DiffusionLM):
    """Base of the block-causal models: DiffusionLM's forward under a `block_keys` mask."""

    def fuse_projections(self) -> None:
        """Nothing to fuse: these classes keep the checkpoints' own projections."""

    @property
    def block_size(self) -> int:
        return self.config.block_size
