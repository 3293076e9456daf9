"""Building blocks shared by the architectures: RMSNorm, RoPE, cached attention, SwiGLU."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from dllm_cli.cache import Columns, KVCache
from dllm_cli.models.fused import Fusion


@cache
def cpu_constants(*values: float) -> tuple[torch.Tensor, ...]:
    """`values` as 0-dim float32 CPU tensors, made once: a CPU op takes a tensor operand in about
    a third of the time it takes a Python number (which it wraps in a fresh tensor each call)."""
    with torch.inference_mode(False):  # (normal tensors: autograd code may read them too)
        # (on the CPU even where a model is built under torch.device("meta"))
        return tuple(torch.tensor(v, dtype=torch.float32, device="cpu") for v in values)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, cast back, then scaled (LLaDA and Qwen2 agree on this order)."""

    def __init__(self, dim: int, eps: float, affine: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.constants = cpu_constants(dim, eps)  # (the CPU float32 path's dim and eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self._parameters.get("weight")  # (a dict read: Module.__getattr__ costs a call a step)
        if x.is_cpu and w is not None and x.dtype == w.dtype == torch.float32:
            if not torch.is_grad_enabled():
                # The formula below with its scale and products written in place, and mean as
                # the sum and division CPU's mean runs, then + eps, in one addcdiv, over tensor
                # constants: 4 buffers fewer than F.rms_norm's CPU composite, 9.1 -> 5.0 us at
                # 32 x 64, the same floats (tests/test_fused.py).
                n, eps = self.constants
                r = torch.addcdiv(eps, torch.sum(x * x, -1, keepdim=True), n).rsqrt_()
                return torch.mul(x, r).mul_(w)
            # The same arithmetic in one call (bit-identical on CPU float32: tests/test_fused.py).
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = h.to(dtype)
        return h * self.weight if self.weight is not None else h


def rope_tables(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for rotate-half RoPE at explicit positions, in float32: (B, 1, T, D) each."""
    inv_freq = 1.0 / (
        theta
        ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    )
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, D)
    return emb.cos()[:, None], emb.sin()[:, None]


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: rotate_half(x) * sin == roll(x, D/2) * signed_sin(sin)."""
    half = sin.shape[-1] // 2
    return torch.cat((sin[..., :half].neg(), sin[..., half:]), dim=-1)


def apply_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    full_precision: bool,
    signed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate (B, H, T, D) by position; LLaDA rotates in float32, Qwen2/Dream in the model dtype.

    `signed` (signed_sin(sin), from a model's table) turns rotate_half's chunk, neg and cat
    into one roll: (-b) * s and b * (-s) are the same float, so the result is bit-identical.
    """
    dtype = x.dtype
    if dtype != cos.dtype:  # (casts that would change nothing are skipped: one op each)
        if full_precision:
            x = x.float()
        else:
            cos, sin = cos.to(dtype), sin.to(dtype)
            signed = None if signed is None else signed.to(dtype)
    # x * cos + rotate_half(x) * sin, in three buffers instead of five (every in-place op
    # here writes a fresh buffer autograd does not keep, so gradients flow through it
    # unchanged).
    if signed is not None:
        rotated = x.roll(x.shape[-1] // 2, dims=-1).mul_(signed)
    else:
        first, second = x.chunk(2, dim=-1)
        rotated = torch.cat((second.neg(), first), dim=-1).mul_(sin)
    out = x * cos
    out = out.add_(rotated)
    return out if out.dtype == dtype else out.to(dtype)


def attend_qkv(
    qkv: torch.Tensor,
    n_heads: int,
    n_kv: int,
    rope: tuple[torch.Tensor, ...],
    full_precision: bool,
    cache: KVCache | None,
    layer: int,
    columns: Columns,
    key_mask: torch.Tensor | None,
) -> torch.Tensor:
    """(B, T, (H + 2 H_kv) D) projections -> (B, T, H*D): q and k rotated, then attend().

    One transpose puts every head in (B, heads, T, D) order before the split, and one RoPE
    pass covers the queries and keys together (the same arithmetic per element as rotating
    them one at a time). `rope` is (cos, sin) or (cos, sin, signed sin), (B, 1, T, D) each.
    """
    b, t, _ = qkv.shape
    heads = qkv.view(b, t, n_heads + 2 * n_kv, -1).transpose(1, 2)  # (B, H + 2 H_kv, T, D)
    qk, v = heads.split_with_sizes((n_heads + n_kv, n_kv), dim=1)
    cos, sin, *signed = rope
    rotated = apply_rope(qk, cos, sin, full_precision, *signed)  # (B, H + H_kv, T, D)
    q, k = rotated.split_with_sizes((n_heads, n_kv), dim=1)
    return attend(q, k, v, cache, layer, columns, key_mask)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, the product in silu's fresh buffer (same arithmetic, one buffer less)."""
    return F.silu(gate).mul_(up)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), every family's feed-forward (a dense layer, an expert, a
    shared expert); `fuse` joins gate and up into one GEMM (fused.py)."""

    def __init__(self, d: int, hidden: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden, bias=bias)
        self.up_proj = nn.Linear(d, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, d, bias=bias)
        self.fusion: Fusion | None = None  # after fuse()

    def fuse(self) -> None:
        self.fusion = Fusion(gate_up=(self.gate_proj, self.up_proj), down=(self.down_proj,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.fusion  # checked inline: this runs once per expert of a MoE layer
        if f is not None and f.intact():
            gate, up = f.gate_up(x).chunk(2, dim=-1)
            return f.down(swiglu(gate, up))
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def residual(x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """x + branch, added into the branch's fresh buffer (addition commutes exactly)."""
    return branch.add_(x)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: KVCache | None,
    layer: int,
    columns: Columns,
    key_mask: torch.Tensor | ShadowMask | PackedRows | None,
) -> torch.Tensor:
    """Bidirectional attention of the active columns over every key the mask allows.

    q: (B, H, T, D); k, v: (B, H_kv, T, D) for the active columns. With a cache the fresh K/V
    are written at `columns` (a slice, or (B, T) per row) and the queries attend over all
    cached columns. key_mask: (B, S) bool, True where a key may be attended (padding and the
    cache's scratch column are False), or (B, T, S) per query (block-causal rows: models/block.py);
    a narrower mask (B, K), K < S, also cuts the keys at K (suffix pruning: the canvas past K is
    neither attended nor read). Returns (B, T, H*D).
    """
    if key_mask is None or isinstance(key_mask, torch.Tensor):
        if cache is not None:
            k, v = cache.update(layer, columns, k, v)  # (B, H_kv, S, D)
            if key_mask is not None and key_mask.shape[-1] < k.shape[2]:
                width = key_mask.shape[-1]
                k, v = k[:, :, :width], v[:, :, :width]  # (B, H_kv, K, D)
        if key_mask is not None:  # (B, 1, 1, S) for every query alike, or (B, 1, T, S) per query
            key_mask = key_mask[:, None, None, :] if key_mask.dim() == 2 else key_mask[:, None]
        return sdpa(q, k, v, key_mask)
    if isinstance(key_mask, ShadowMask):
        return attend_shadowed(q, k, v, cache, layer, columns, key_mask)
    return attend_packed(q, k, v, cache, layer, key_mask)


def sdpa(q, k, v, mask=None, causal: bool = False) -> torch.Tensor:
    """q (B, H, T, D), k/v (B, H_kv, S, D) -> (B, T, H*D): SDPA over grouped-query heads."""
    gqa = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    b, h, t, d = out.shape  # (B, H, T, D)
    return out.transpose(1, 2).reshape(b, t, h * d)


@dataclass(frozen=True)
class ShadowMask:
    """WINO's shadow block (arXiv 2507.18578): the last `n` queries of a forward are masked
    copies of the current block that verify its committed tokens. Their K/V are attended only
    by each other and never written to the cache; `mask` (B, T, K + n) says what every query
    attends: the canvas keys (K: the cache's, or the forward's own columns) then the shadows'.
    """

    mask: torch.Tensor  # (B, T, K + n) bool
    n: int


def attend_shadowed(q, k, v, cache, layer: int, columns: Columns, shadow: ShadowMask):
    """attend() for a forward ending in a shadow block: canvas queries write and read the cache
    as usual; the shadows' K/V join the keys for this forward only."""
    n = shadow.n
    k_main, v_main, k_shadow, v_shadow = k[:, :, :-n], v[:, :, :-n], k[:, :, -n:], v[:, :, -n:]
    if cache is not None:
        k_main, v_main = cache.update(layer, columns, k_main, v_main)  # (B, H_kv, S, D)
    width = shadow.mask.shape[2] - n  # canvas keys attended (suffix pruning cuts them)
    k = torch.cat([k_main[:, :, :width], k_shadow], dim=2)  # (B, H_kv, K + n, D)
    v = torch.cat([v_main[:, :, :width], v_shadow], dim=2)
    return sdpa(q, k, v, shadow.mask[:, None])


@dataclass(frozen=True)
class AttentionGroup:
    """Rows of a packed forward whose queries attend in one SDPA call (decoding/packing.py)."""

    queries: torch.Tensor | slice  # (R, T) long packed columns (padding repeats one), or
    # one row's run of them
    rows: torch.Tensor | slice  # (R,) cache rows, or a slice of them (read in place)
    lo: int  # keys attended: cache columns [lo, hi)
    hi: int
    mask: torch.Tensor | None  # (R, hi - lo) bool, True where a key may be attended; with
    # `extra`, (R, T, hi - lo + n) per query
    extra: torch.Tensor | None = None  # (R, n) packed columns whose fresh K/V (in no cache
    # row: WINO's shadow block) each row attends after its cached keys


@dataclass(frozen=True)
class PackedRows:
    """A forward over many rows' columns packed into one sequence (B = 1, no padding): the
    projections and MLPs see only real columns; attention runs per group of rows."""

    rows: torch.Tensor  # (N,) long: the cache row of each packed column
    columns: torch.Tensor  # (N,) long: its canvas column (where its K/V are written)
    groups: tuple[AttentionGroup, ...]
    back: torch.Tensor  # (N,) long: each packed column's output among the groups' outputs


def attend_packed(q, k, v, cache: KVCache, layer: int, packed: PackedRows) -> torch.Tensor:
    """attend() for a packed forward: q (1, H, N, D); k, v (1, H_kv, N, D). Every column's K/V
    go to its own cache row and column first (columns past `packed.rows`, WINO's shadows, go
    nowhere); then each group's queries attend their rows' cached keys and their `extra`
    ones. Returns (1, N, H*D)."""
    store_k, store_v = cache.k[layer], cache.v[layer]  # (rows, H_kv, S, D)
    at, n = (packed.rows, packed.columns), packed.rows.shape[0]
    store_k.transpose(1, 2)[at] = k[0, :, :n].transpose(0, 1)  # (N, H_kv, D) into (rows, S, ...)
    store_v.transpose(1, 2)[at] = v[0, :, :n].transpose(0, 1)
    tokens = q[0].transpose(0, 1)  # (N, H, D)
    h, d = tokens.shape[1], tokens.shape[2]
    outs = []
    for g in packed.groups:
        if isinstance(g.queries, slice):
            queries = tokens[g.queries][None].transpose(1, 2)  # (1, H, T, D), a view
        else:
            queries = tokens[g.queries].transpose(1, 2)  # (R, H, T, D)
        keys, values = store_k[g.rows, :, g.lo : g.hi], store_v[g.rows, :, g.lo : g.hi]
        if g.extra is None:
            mask = None if g.mask is None else g.mask[:, None, None, :]  # (R, 1, 1, K)
        else:  # keys (R, H_kv, K + n, D), the mask (R, 1, T, K + n) per query
            keys = torch.cat([keys, k[0][:, g.extra].transpose(0, 1)], dim=2)
            values = torch.cat([values, v[0][:, g.extra].transpose(0, 1)], dim=2)
            mask = g.mask[:, None]
        gqa = queries.shape[1] != keys.shape[1]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=gqa)
        outs.append(out.transpose(1, 2).reshape(-1, h * d))  # (R T, H*D)
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out[packed.back][None]


def default_positions(input_ids: torch.Tensor, columns: Columns) -> torch.Tensor:
    """Positions equal to canvas columns (no left padding)."""
    if isinstance(columns, torch.Tensor):
        return columns
    b, t = input_ids.shape
    start = columns.start or 0
    return torch.arange(start, start + t, device=input_ids.device).expand(b, t)
