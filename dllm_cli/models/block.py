"""What block-causal diffusion models (SDAR, LLaDA2.x) share: the block-causal mask, one
attention over cached K/V plus the forward's own tokens, partial RoPE, and the model base.

Attention is bidirectional inside a block and causal across blocks (SDAR, arXiv 2510.06303;
LLaDA2.0, arXiv 2512.15745), so the K/V of a finished block never change: a cache of them is
exact. A forward gets the earlier blocks' K/V (`BlockContext.past`, per row a valid length)
and attends to them and to its own tokens under `self_mask`; it hands back the K/V it
computed (`fresh`), which the engine writes into its cache once a block has settled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dllm_cli.models.base import DiffusionLM
from dllm_cli.models.layers import sdpa


def block_causal(length: int, block: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(T, T) bool: query column i may see key column j when j's block is not after i's."""
    blocks = torch.arange(length, device=device) // block
    return blocks[:, None] >= blocks[None, :]


@dataclass
class BlockContext:
    """One forward's view of the cache: earlier blocks' K/V and which of them each row has."""

    past: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer (B, H_kv, S, D)
    past_valid: torch.Tensor | None = None  # (B, S) bool: cached columns a row may attend
    self_mask: torch.Tensor | None = None  # (B, T, T) or (T, T) bool; None: all see all
    fresh: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    offset: int = 0  # where the active block starts among the forward's own columns
    _mask: torch.Tensor | None = None

    def mask(self, b: int, t: int) -> torch.Tensor | None:
        """(B, 1, T, S + T) bool over [cached keys, own keys], built once per forward."""
        if self._mask is None and (self.self_mask is not None or self.past_valid is not None):
            own = self.self_mask
            device = (own if own is not None else self.past_valid).device
            if own is None:
                own = torch.ones(t, t, dtype=torch.bool, device=device)
            own = own.expand(b, t, t)
            valid = self.past_valid
            if valid is None and self.past is not None:  # every row has every cached column
                valid = torch.ones(b, self.past[0][0].shape[2], dtype=torch.bool, device=device)
            if valid is not None:
                own = torch.cat([valid[:, None, :].expand(b, t, valid.shape[1]), own], dim=2)
            self._mask = own[:, None]
        return self._mask

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope):
        """q (B, H, T, D), k/v (B, H_kv, T, D) -> (B, T, H*D), q and k rotated by `rope`
        (cos, sin) first; keeps the rotated k and v as fresh."""
        q, k = rope_partial(q, *rope), rope_partial(k, *rope)
        self.fresh.append((k, v))
        if self.past is not None:
            pk, pv = self.past[layer]
            k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
        return sdpa(q, k, v, self.mask(q.shape[0], q.shape[2]))


def rope_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first cos.shape[-1] dims of (B, H, T, D); the rest pass."""
    n = cos.shape[-1]
    rot, rest = x[..., :n], x[..., n:]
    half = n // 2
    turned = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos + turned * sin
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


class BlockDiffusionLM(DiffusionLM):
    """Base of the block-causal models: `forward(ids, positions, ctx)` -> logits (B, T, V)."""

    packs = False  # their layers attend through a BlockContext

    def fuse_projections(self) -> None:
        """Nothing to fuse: these classes keep the checkpoints' own projections."""

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def rope_dim(self) -> int:
        _, _, head_dim = self.kv_shape()
        return head_dim

    def rope_at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos/sin (B, 1, T, rope_dim) in float32 then cast, as transformers' RoPE does."""
        n = self.rope_dim
        inv = 1.0 / (
            self.rope_theta
            ** (torch.arange(0, n, 2, device=positions.device, dtype=torch.float32) / n)
        )
        freqs = positions.to(torch.float32)[..., None] * inv  # (B, T, n/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        ctx: BlockContext | None = None,
        logits_slice: slice | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, T', V) of the given columns; ctx.fresh gets every layer's K/V."""
        ctx = ctx if ctx is not None else BlockContext()
        if positions is None:
            t = input_ids.shape[1]
            positions = torch.arange(t, device=input_ids.device).expand(input_ids.shape[0], t)
        h = self.embed(input_ids)  # (B, T, d)
        rope = self.rope_at(positions, h.dtype)
        for i, layer in enumerate(self.blocks()):
            h = layer(h, rope, ctx, i)
        return self.logits_of(h, logits_slice)
