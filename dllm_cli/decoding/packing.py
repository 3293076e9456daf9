"""One forward for rows at different places of their decode: their columns packed end to end.

Under continuous batching a step may hold a new row's prefill beside cached rows' windows of
other widths. Packed (vLLM's and SGLang's varlen batching), every row's own columns follow one
another in one sequence (B = 1), so embeddings, projections and MLPs compute only real columns,
one GEMM per weight. Attention needs rows apart: every column's K/V are written at its row of
the KV cache, then each group of rows attends its cached keys in one SDPA call
(models/layers.attend_packed), queries padded to the group's widest and masked where keys
differ. Which rows share a call is a cost model (`attention_groups`: CPU SDPA has no varlen
kernel). Every row computes exactly its plan's columns and attends exactly its own keys, so the
output is the padded forwards' (tests/test_packing.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from dllm_cli.decoding.canvas import Canvas
from dllm_cli.decoding.policies import ForwardPlan
from dllm_cli.models.layers import AttentionGroup, PackedRows

# Costs of attention layouts, in attended query-key pairs (one pair: ~8 ns per layer on CPU
# for the shipped model): an SDPA call of its own (~30 us of ops per layer), and a key column
# of a row gathered out of the cache (K and V copied) for a group that cannot read it in place.
GROUP_COST = 4096
COPY_COST = 16
# On a GPU an SDPA call is a kernel launch of ~10 us against far cheaper pairs: rows share a
# call unless padding costs a great deal (not measured on a GPU yet).
CUDA_GROUP_COST = 1 << 20


@dataclass(frozen=True)
class PackedForward:
    """A packed forward's inputs: ids and positions (1, N), the attention layout, the logit
    picks (1, R L) that give each row's span, and the arithmetic it does."""

    ids: torch.Tensor
    positions: torch.Tensor
    layout: PackedRows
    picks: torch.Tensor
    span: int  # L: predictions per row (short spans padded by repeating their last)
    row_columns: int
    key_columns: int
    outputs: int  # the groups' outputs laid end to end (their R x T summed)


def pack(
    c: Canvas,
    cache_rows: torch.Tensor | None,
    hosts_known: tuple[int, ...] | None,
    plans: list[ForwardPlan],
    spans,
    shift: int,
) -> PackedForward:
    """The packed forward of a step's rows. `cache_rows` (B,): each canvas row's cache row
    (None: canvas row r is cache row r); `hosts_known`: the same as host ints, if known."""
    device = c.ids.device
    starts = [p.lead if p.refresh else p.start for p in plans]
    widths = [p.end - a for p, a in zip(plans, starts, strict=True)]
    offsets = [0, *accumulate(widths)]
    n = offsets[-1]
    row = torch.repeat_interleave(  # (N,) canvas row of each packed column
        torch.arange(len(plans), device=device),
        torch.tensor(widths, device=device),
        output_size=n,  # known on the host: no device read on a GPU
    )
    first = torch.tensor(offsets[:-1], device=device)
    columns = torch.tensor(starts, device=device)[row] + torch.arange(n, device=device) - first[row]
    ids = c.ids[row, columns][None]  # (1, N)
    positions = c.positions()[row, columns][None]
    rows = row if cache_rows is None else cache_rows[row]

    hosts = tuple(range(len(plans))) if cache_rows is None else hosts_known  # host cache rows
    limits = [limit(c, p) for p in plans]
    groups, back_of, shapes, key_columns = [], [None] * len(plans), [], 0
    cost = GROUP_COST if device.type == "cpu" else CUDA_GROUP_COST
    for members in attention_groups(plans, widths, limits, hosts is not None, cost):
        t = max(widths[r] for r in members)
        g = group(c, cache_rows, hosts, plans, limits, members, offsets, widths, t)
        for i, r in enumerate(members):
            back_of[r] = (len(groups), i)
        groups.append(g)
        shapes.append((len(members), t))
        key_columns += len(members) * t * (g.hi - g.lo)

    # Each packed column's output among the groups' (R, T) outputs laid end to end.
    bases = [0, *accumulate(rows_in * t for rows_in, t in shapes)]
    back = []
    for r, (gi, i) in enumerate(back_of):
        origin = bases[gi] + i * shapes[gi][1]
        back.extend(range(origin, origin + widths[r]))

    span = max(e - a for a, e in spans)
    picks = []
    for r, (a, e) in enumerate(spans):
        at = offsets[r] + a - shift - starts[r]
        picks.extend(at + min(j, e - a - 1) for j in range(span))
    return PackedForward(
        ids,
        positions,
        PackedRows(rows, columns, tuple(groups), torch.tensor(back, device=device)),
        torch.tensor(picks, device=device)[None],
        span,
        n,
        key_columns,
        bases[-1],
    )


def group(c, cache_rows, hosts, plans, limits, members, offsets, widths, t) -> AttentionGroup:
    """One SDPA call's rows: queries (R, T) into the packed sequence, keys from the members'
    first real column to their furthest limit, masked by the canvas and each row's limit (a
    row alone attends exactly its own real keys: no mask)."""
    device = c.ids.device
    lo = min(plans[r].lead for r in members)
    ends = [limits[r] for r in members]
    hi = max(ends)
    if len(members) == 1 and hosts is not None:
        (r,) = members
        queries = slice(offsets[r], offsets[r] + widths[r])
        rows, mask = slice(hosts[r], hosts[r] + 1), None
    else:
        queries = torch.tensor(
            [[offsets[r] + min(j, widths[r] - 1) for j in range(t)] for r in members], device=device
        )  # padding repeats a row's last query (its output is never read)
        index = torch.tensor(members, device=device)
        rows = index if cache_rows is None else cache_rows[index]
        mask = c.key_mask()
        mask = None if mask is None else mask[index]
        if any(n < hi for n in ends):
            inside = c.columns()[None] < torch.tensor(ends, device=device)[:, None]
            mask = inside if mask is None else mask & inside
        if mask is not None:
            mask = mask[:, lo:hi]
    return AttentionGroup(queries, rows, lo, hi, mask)


def limit(c: Canvas, plan: ForwardPlan) -> int:
    """The end of the keys a row attends (its suffix-pruning limit, else the canvas end)."""
    return c.width if plan.keys is None else plan.keys


def attention_groups(
    plans: list[ForwardPlan], widths: list[int], keys: list[int], views: bool, own: int = GROUP_COST
) -> list[list[int]]:
    """Rows in SDPA groups, cheapest split of the rows in order of attended keys: a group's
    queries are padded to its widest row and attend its widest key range; a lone row reads
    its keys in place when its cache row is known on the host (`views`), others gather theirs
    (`own`: what a call of its own costs; COPY_COST)."""
    order = sorted(range(len(plans)), key=lambda r: (keys[r] - plans[r].lead, widths[r]))
    leads = [p.lead for p in plans]

    def cost(count: int, wide: int, hi: int, lo: int) -> float:
        copy = 0 if views and count == 1 else COPY_COST * count * (hi - lo)
        return own + count * wide * (hi - lo) + copy

    return cheapest_split(order, widths, keys, leads, cost)


def cheapest_split(order: list[int], widths, his, los, cost) -> list[list[int]]:
    """`order` cut into consecutive groups of least total cost (dynamic programming over the
    cut points, O(n^2)): `cost(count, widest, furthest end, first start)` of a group, from
    each row's width, end and start (`widths`, `his`, `los`, by row). Members sorted."""
    n = len(order)
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        wide, hi, lo = 0, 0, None
        for i in range(j - 1, -1, -1):  # group order[i:j], grown leftwards
            r = order[i]
            wide, hi = max(wide, widths[r]), max(hi, his[r])
            lo = los[r] if lo is None else min(lo, los[r])
            total = best[i] + cost(j - i, wide, hi, lo)
            if total < best[j]:
                best[j], cut[j] = total, i
    groups, j = [], n
    while j > 0:
        groups.append(sorted(order[cut[j] : j]))
        j = cut[j]
    return groups[::-1]
