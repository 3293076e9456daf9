"""WINO: Wide-In, Narrow-Out revokable decoding (Hong et al., arXiv 2507.18578).

Each step commits every mask of the block above a low draft threshold (at most `max_accept`, at
least the best one); the same forward runs a shadow block, a masked copy of the current block
whose column j attends to the whole canvas except column j, and an earlier commit whose shadow
probability falls below `wino_verify` is masked again (at most one fewer than the previous step
committed, only in a step that commits more than one). Public code: Feng-Hong/WINO-DLLM,
`decoding_wino` in LLaDA/decoding.py; docs/decoding-rules.md.

The shadows are one forward's extra L queries (models/layers.ShadowMask) whose K/V never reach
the cache, so every cache policy serves WINO in one forward per step. A shifted model (Dream)
adds L readers, copies of column j - 1 that see shadow j in column j's place (`shadow_mask`).
Packed rows attend their shadows in one more group (models/layers.AttentionGroup.extra); under
tensor parallelism each rank's shadow summaries ride the drafts' one all-gather.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from dllm_cli.decoding.forwards import Forwards, Prediction, row_columns, span_picks, take
from dllm_cli.decoding.packing import pack
from dllm_cli.decoding.ranking import top_columns
from dllm_cli.decoding.shard_summaries import shadow_probability, shadow_summary
from dllm_cli.decoding.sharded_sampling import ShardedSampler
from dllm_cli.models.layers import AttentionGroup, ShadowMask

ACCEPT_SHARE, ACCEPT_MIN, ACCEPT_MAX = 0.7, 5, 20  # the reference's max_accept clamp


def max_accept(masks: torch.Tensor) -> torch.Tensor:
    """(B,) the reference's cap on a step's commits: int(masks * 0.7) clamped to [5, 20]."""
    return (masks.double() * ACCEPT_SHARE).long().clamp(ACCEPT_MIN, ACCEPT_MAX)


def wide_in(confidence, candidates, threshold: float) -> torch.Tensor:
    """(B, L) WINO's draft: every candidate above `threshold`, capped at max_accept, the best
    one when none is above; rows without candidates commit nothing."""
    masks = candidates.sum(dim=1)
    above = ((confidence > threshold) & candidates).sum(dim=1)
    cap = max_accept(masks)
    counts = torch.where(above > cap, cap, above.clamp(min=1)).minimum(masks)
    return top_columns(confidence, candidates, counts)


def last_accepted(ctx, committed: torch.Tensor) -> torch.Tensor:
    """(B,) tokens the row's previous step committed in this block (the reference's
    `last_accept`), from the canvas's commit marks (re-masked columns lose theirs): no state."""
    c = ctx.canvas
    marks = c.marks.gather(1, (ctx.columns - c.prompt_width).clamp(min=0))  # (B, L)
    marks = marks.masked_fill(~committed, -1)
    latest = marks.max(dim=1, keepdim=True).values
    return ((marks == latest) & committed).sum(dim=1)


def narrow_out(verify, accepted: torch.Tensor, last: torch.Tensor, bar: float) -> torch.Tensor:
    """(B, L) earlier commits to mask again: shadow probability below `bar`, at most
    last - 1 of the least supported, and only in rows that committed more than one now."""
    low = verify < bar  # verify is +inf off the block's earlier commits
    n = low.sum(dim=1)
    counts = torch.where(n >= last, last - 1, n).clamp(min=0)
    counts = torch.where(accepted > 1, counts, 0)
    return top_columns(-verify, low, counts)


def wino_rule(p, ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """WINO's step: (commit, remask) over the row's block slots."""
    commit = wide_in(ctx.confidence, ctx.candidates, p.s.threshold)
    committed = torch.isfinite(ctx.verify)  # the block's columns committed in earlier steps
    last = last_accepted(ctx, committed)
    remask = narrow_out(ctx.verify, commit.sum(dim=1), last, p.s.wino_verify)
    return commit, remask


def revoke(c, remask: torch.Tensor, columns: torch.Tensor) -> None:
    """Mask again the canvas columns marked in `remask` (B, L) and clear their commit marks."""
    hit = torch.zeros_like(c.ids).scatter_add(1, columns, remask.long()) > 0  # (B, S)
    c.ids.masked_fill_(hit, c.mask_id)
    c.marks.masked_fill_(hit[:, c.prompt_width :], -1)


class ShadowForwards(Forwards):
    """Forwards whose every forward ends in WINO's shadow block; the Prediction's `verify`
    (B, L) holds each earlier-committed slot's shadow probability (+inf elsewhere)."""

    def __call__(self, canvas, cache, plans, spans, generator):
        self._verified = []
        pred = super().__call__(canvas, cache, plans, spans, generator)
        verify = torch.full(
            pred.valid.shape, float("inf"), dtype=torch.float64, device=pred.valid.device
        )
        for rows, earlier, probability in self._verified:  # every row, each refresh group's
            v = torch.where(earlier, probability(), float("inf"))  # (after the gathers)
            if rows is None:
                verify = v.to(verify.dtype).clone()
                continue
            verify[rows] = float("inf")
            verify[rows, : v.shape[1]] = v.to(verify.dtype)
        pred.verify = verify
        return pred

    def _logits(self, c, cache, plans, spans, rows):
        """The span's logits; each slot's shadow probability of its token is kept aside."""
        drafts, shadows, span, valid = self.shadowed(c, cache, plans, spans, rows)
        self._verify(c, rows, shadows, span, valid)
        return drafts

    def _verify(self, c, rows, shadows, span, valid) -> None:
        """Keep each earlier commit's shadow probability (+inf on every other slot)."""
        tokens = (c.ids if rows is None else c.ids[rows]).gather(1, span)  # (R, L) held now
        earlier = valid & (tokens != c.mask_id)
        if isinstance(self.sampler, ShardedSampler):  # a vocabulary shard: sums ride the gather
            every = self.sampler.ride(shadow_summary(shadows, tokens, self.sampler.start))
            self._verified.append((rows, earlier, lambda: shadow_probability(every())))
            return
        p = torch.softmax(shadows.double(), dim=-1).gather(2, tokens[..., None])[..., 0]
        self._verified.append((rows, earlier, lambda: p))

    def _packed(self, c, cache, plans, spans, generator, columns, valid):
        """The rows packed (packing.py), their shadows after every row's own columns in one more
        attention group over each row's cached keys then its shadows' (K/V written nowhere)."""
        device, shift = c.ids.device, self.model.logit_shift
        p = pack(c, cache.row_ids, cache.hosts, plans, spans, shift)
        span, real = span_slots(spans, device)  # (B, L)
        ids, pos = shadow_tokens(c.ids, c.positions(), span, c.mask_id, shift)  # (B, n)
        b, n = ids.shape
        keys = self._keys(c, cache, None, None, [q.keys for q in plans], 0)  # (B, K)
        mask = shadow_mask(keys, (b, 0), span, real, shift, cache, device)  # (B, n, K + n)
        base = p.ids.shape[1]  # the shadows' packed columns follow the rows' own
        extra = base + torch.arange(b * n, device=device).view(b, n)
        rows = torch.arange(b, device=device) if cache.row_ids is None else cache.row_ids
        shadows = AttentionGroup(extra, rows, 0, mask.shape[2] - n, mask, extra)
        back = torch.cat([p.layout.back, p.outputs + torch.arange(b * n, device=device)])
        layout = replace(p.layout, groups=(*p.layout.groups, shadows), back=back)
        read = extra[:, n - span.shape[1] :]  # the last L shadows (readers, when shifted)
        logits = self.model(
            torch.cat([p.ids, ids.view(1, -1)], dim=1),
            torch.cat([p.positions, pos.view(1, -1)], dim=1),
            cache,
            layout,
            logits_slice=torch.cat([p.picks, read.reshape(1, -1)], dim=1),
        )[0]
        self.row_columns += p.row_columns + b * n
        self.key_columns += p.key_columns + b * n * mask.shape[2]
        main, verify = logits[: b * p.span], logits[b * p.span :]
        self._verify(c, None, verify.view(b, span.shape[1], -1), span, real)
        drafts, confidence, probs, _, _ = self._draft(main.view(b, p.span, -1), generator)
        return Prediction(drafts, confidence, columns, valid, forwards=1, probs=probs)

    def shadowed(self, c, cache, plans, spans, rows):
        """One forward for `rows` with a shadow of each row's span: the span's logits, the
        shadows' logits (R, L, V), each slot's canvas column and which slots are real."""
        model, shift, device = self.model, self.model.logit_shift, c.ids.device
        pick = (lambda t: t) if rows is None else (lambda t: t[rows])
        ids_all, pos_all = pick(c.ids), pick(c.positions())
        starts, ends = [p.start for p in plans], [p.end for p in plans]
        if all(p.refresh for p in plans):  # refreshes: the whole canvas, as before ragged rows
            starts = [0] * len(starts)  # (the shadow mask reads keys by canvas column)
        if cache is None:
            ends = [max(ends)] * len(ends)
        if len(set(starts)) == 1 and len(set(ends)) == 1:
            cols = slice(starts[0], ends[0])
            ids, pos = ids_all[:, cols], pos_all[:, cols]
        else:
            cols = row_columns(starts, ends, c.width, device)  # (R, T)
            ids, pos = take(ids_all, cols, c.mask_id), take(pos_all, cols, 0)
        keys = self._keys(c, cache, rows, cols, [p.keys for p in plans], 0)  # every key
        span, valid = span_slots(spans, device)  # (R, L) canvas columns, real slots
        shadow_ids, shadow_pos = shadow_tokens(ids_all, pos_all, span, c.mask_id, shift)
        mask = shadow_mask(keys, ids.shape, span, valid, shift, cache, device)
        picks = span_picks(starts, spans, shift, device)
        main = picks if isinstance(picks, torch.Tensor) else expand(picks, span.shape[0], device)
        t, n, m = ids.shape[1], shadow_ids.shape[1], span.shape[1]
        read = t + n - m + torch.arange(m, device=device).expand_as(span)  # the last L queries
        logits = model(
            torch.cat([ids, shadow_ids], dim=1),
            torch.cat([pos, shadow_pos], dim=1),
            None if cache is None else cache.view(rows, 0),
            ShadowMask(mask, n),
            columns=cols,
            logits_slice=torch.cat([main, read], dim=1),
        )
        return logits[:, : main.shape[1]], logits[:, main.shape[1] :], span, valid


def span_slots(spans, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, L) canvas column of each slot (padding: the span's first) and which are real."""
    starts = torch.tensor([a for a, _ in spans], device=device)
    lengths = torch.tensor([e - a for a, e in spans], device=device)
    slots = torch.arange(int(max(e - a for a, e in spans)), device=device)
    valid = slots[None] < lengths[:, None]
    return torch.where(valid, starts[:, None] + slots, starts[:, None]), valid


def shadow_tokens(ids, positions, span, mask_id: int, shift: int):
    """(R, n) ids and positions of the shadows: the reference's mask at each slot's position;
    a shifted model reads slot j from a second query, a copy of column j - shift."""
    shadow_ids, shadow_pos = torch.full_like(span, mask_id), positions.gather(1, span)
    if not shift:
        return shadow_ids, shadow_pos
    carried = (span - shift).clamp(min=0)
    shadow_ids = torch.cat([shadow_ids, ids.gather(1, carried)], dim=1)
    return shadow_ids, torch.cat([shadow_pos, positions.gather(1, carried)], dim=1)


def expand(picks: slice, rows: int, device) -> torch.Tensor:
    """A shared logits slice as (R, L) per-row picks."""
    return torch.arange(picks.start, picks.stop, device=device).expand(rows, -1)


def shadow_mask(keys, shape, span, valid, shift: int, cache, device) -> torch.Tensor:
    """(R, T + n, K + n) what each query attends. Canvas queries: the canvas keys `keys`
    allows, no shadow. Shadow j (a mask at slot j's position, n = L): the same keys but its
    own column span[j], and every real shadow (the reference's mask). A shifted model adds L
    readers (n = 2L): reader j, a copy of column span[j] - shift, attends the canvas keys but
    span[j] and, in its place, shadow j: the canvas as it would be with column j masked."""
    r, t = shape
    m = span.shape[1]
    n = m * (2 if shift else 1)
    if keys is None:
        width = t if cache is None else cache.width + int(cache.scratch)  # (its scratch key)
        keys = torch.ones(r, width, dtype=torch.bool, device=device)
    width = keys.shape[1]
    canvas = keys[:, None, :].expand(r, t + n, width).clone()  # (R, T + n, K)
    own = torch.arange(width, device=device)[None, None] == span[:, :, None]  # (R, L, K)
    canvas[:, t : t + m] &= ~own
    tails = torch.zeros(r, t + n, n, dtype=torch.bool, device=device)
    tails[:, t : t + m, :m] = valid[:, None, :].expand(r, m, m)  # shadow -> every shadow
    if shift:
        canvas[:, t + m :] &= ~own
        tails[:, t + m :, :m] = torch.eye(m, dtype=torch.bool, device=device)  # reader j -> j
    return torch.cat([canvas, tails], dim=2)
