"""One step's model forwards for rows at different places: one, or a few at most.

Each row brings its plan (the canvas columns its cache policy recomputes, policies.py) and its
span (the columns it decodes: its block, or a guided row's draft window).

Rows in lockstep (the common static batch, as LLaDA and Fast-dLLM decode one) share one
forward over one slice of columns; a static batch's refresh runs every row in one forward
padded to its longest prompt.

Rows apart (continuous batching: `ragged`) run as one packed forward (packing.py, vLLM's and
SGLang's varlen batching): every row's own columns end to end in one sequence, a new row's
prefill beside the cached rows' windows, so no row is padded to another's width and a step
pays one forward's fixed cost; attention runs per group of rows (with no cache policy, over
one layer's K/V buffers that every layer reuses). Classifier-free guidance packs its second
branch as more rows (each with its own cache rows), WINO its shadow block as one more
attention group: measured no slower than the padded forwards below in every case at d256
(benchmarks/packed_layouts.py), so rows apart always pack. Rows in lockstep whose plans
differ (a static batch) keep the padded layout:

- rows whose plan is a full refresh share one forward from their first real column;
- every other row shares one windowed forward, each row feeding its own columns padded to the
  longest window with queries aimed at the KV cache's scratch column. Beside refreshes it runs
  over every row (the full rows with their span as a stand-in window, rewritten by their full
  forward right after), so it uses the cache in place;
- where one forward over every row's own columns computes no more row-columns than the two
  together (`folds`), the refreshes ride along in the cached rows' forward.

Every forward attends keys only from its rows' first real column. (Measured on CPU, a
forward's cost grows with its row-columns and attended keys: 8 rows x 600 columns took 13.6x
the time of 8 x 32 on the shipped Dream model.) Logits are computed only for each row's span
(per-row picks when spans differ), and the sampler runs on each group's logits, so memory
stays at one group's (R, L, V).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from dllm_cli.cache import KVCache
from dllm_cli.decoding.canvas import Canvas
from dllm_cli.decoding.packing import pack
from dllm_cli.decoding.policies import ForwardPlan
from dllm_cli.decoding.row_sampling import RowDraws
from dllm_cli.decoding.sampling import NO_READS, Reads, Sampler


@dataclass
class Prediction:
    """Drafts for every row's span, left-aligned: slot j of row r is canvas column a_r + j."""

    drafts: torch.Tensor  # (B, L) long
    confidence: torch.Tensor  # (B, L): -inf on padding slots
    columns: torch.Tensor  # (B, L) long canvas columns (padding: the span's first column)
    valid: torch.Tensor  # (B, L) bool: a real slot of the row's span
    forwards: int  # model forwards this step
    probs: torch.Tensor | None = None  # (B, L, V) the drafts' distributions, when asked for
    verify: torch.Tensor | None = None  # (B, L) WINO's shadow check of earlier commits
    entropy: torch.Tensor | None = None  # (B, L) float64 each slot's entropy, when read (eb)
    kl: torch.Tensor | None = None  # (B, L) float64 KL from each slot's last step (TP klass)


class Forwards:
    """Runs a step's forwards and turns their logits into drafts per row.

    `ragged` (rows at their own places: continuous batching): rows that do not share one slice
    run as one packed forward (`packs`: packing.py; False only in tests, which compare it with
    the padded forwards); not ragged, one forward serves them all, padded to the widest (a
    static batch, as LLaDA and Fast-dLLM decode one), or two where refreshes sit beside
    windows and do not fold. `row_columns` and `key_columns` count
    the arithmetic done: columns forwarded (rows x columns, both CFG branches) and
    query-key pairs attended per layer. `reads`: what the rule reads besides the drafts,
    measured with them (sampling.Reads).
    """

    def __init__(
        self,
        model,
        sampler: Sampler,
        cfg_scale: float,
        greedy_drafts: bool,
        probs: bool = False,
        ragged: bool = False,
        reads: Reads = NO_READS,
    ):
        self.model, self.sampler = model, sampler
        self.cfg, self.branches = cfg_scale, 2 if cfg_scale > 0 else 1
        self.greedy = greedy_drafts  # guided: drafts are argmax whatever the temperature
        self.probs = probs  # keep each slot's distribution (a rule that compares them: KLASS)
        self.ragged = ragged
        self.reads = reads
        # Ragged rows share one packed forward (packing.py; every model's layers attend through
        # layers.attend), guidance's second branch as more rows, WINO's shadows as one more
        # attention group (wino.ShadowForwards). False: the padded forwards (tests).
        self.packs = True
        self.row_columns = self.key_columns = 0
        self._span_memo: dict = {}  # spans -> (columns, valid), see _slots
        self._buffers: tuple | None = None  # (canvas shape, KVCache): see _layer_buffers

    def __call__(
        self,
        canvas: Canvas,
        cache: KVCache | None,
        plans: list[ForwardPlan],
        spans: list[tuple[int, int]],
        generator: torch.Generator | RowDraws,  # RowDraws: each row's own (row_sampling.py)
    ) -> Prediction:
        if not torch.is_inference_mode_enabled():  # (the engine's step already is)
            with torch.inference_mode():
                return self(canvas, cache, plans, spans, generator)
        device = canvas.ids.device
        columns, valid = self._slots(spans, device)
        full, _ = split(plans)
        every = len(full) == len(plans)
        if self.ragged and self.packs and apart(plans, full):
            cache = cache if cache is not None else self._layer_buffers(canvas)
            return self._packed(canvas, cache, plans, spans, generator, columns, valid)
        if not full or every or folds(plans, spans, full, self.model):
            # one forward serves every row (full rows' prefills folded in with the windows)
            drafts, confidence, probs, h, kl = self._group(
                canvas, cache, plans, spans, None, generator
            )
            return Prediction(
                drafts, confidence, columns, valid, forwards=1, probs=probs, entropy=h, kl=kl
            )
        # The windowed forward serves every row, so it reads and writes the cache in place (a
        # forward for some rows gathers their K/V). Rows due a full forward take their span as
        # a stand-in window there; the full forward that follows rewrites all their columns
        # and gives their drafts.
        shift = self.model.logit_shift
        stand = [
            replace(p, start=a - shift, end=e, refresh=False) if p.refresh else p
            for p, (a, e) in zip(plans, spans, strict=True)
        ]
        draws = generator.without(full) if isinstance(generator, RowDraws) else generator
        drafts, confidence, probs, h, kl = self._group(
            canvas, cache, stand, spans, None, draws, skip=full
        )
        rows = torch.tensor(full, device=device)
        sub = ([plans[r] for r in full], [spans[r] for r in full])
        draws = generator.subset(full) if isinstance(generator, RowDraws) else generator
        d, conf, p, h_full, kl_full = self._group(canvas, cache, *sub, rows, draws)
        drafts[rows], confidence[rows] = canvas.mask_id, float("-inf")
        drafts[rows, : d.shape[1]] = d
        confidence[rows, : d.shape[1]] = conf.to(confidence.dtype)
        if p is not None:  # (kept for every row or none)
            probs[rows] = 0.0
            probs[rows, : p.shape[1]] = p.to(probs.dtype)
        for measure, part in ((h, h_full), (kl, kl_full)):  # (B, L) float64, when read
            if part is not None:
                measure[rows] = 0.0
                measure[rows, : part.shape[1]] = part
        return Prediction(
            drafts, confidence, columns, valid, forwards=2, probs=probs, entropy=h, kl=kl
        )

    def _slots(self, spans: list[tuple[int, int]], device) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L) canvas columns of each row's span and which slots are real, built once per
        distinct set of spans (a block's steps reuse them; nothing writes into them)."""
        key = (tuple(spans), device)
        memo = self._span_memo
        if key not in memo:
            if len(memo) >= 64:
                memo.clear()
            starts = torch.tensor([a for a, _ in spans], device=device)
            lengths = torch.tensor([e - a for a, e in spans], device=device)
            slots = torch.arange(max(e - a for a, e in spans), device=device)  # (L,)
            valid = slots[None] < lengths[:, None]  # (B, L)
            memo[key] = (torch.where(valid, starts[:, None] + slots, starts[:, None]), valid)
        return memo[key]

    def _packed(self, c: Canvas, cache: KVCache, plans, spans, generator, columns, valid):
        """One forward over every row's own columns, packed (packing.py); under guidance the
        prompt-masked branch's rows follow (cache rows B.. of the view, as padded)."""
        keys = self._row_keys(c, None, spans)
        if self.branches == 2:
            c = both_branches(c)
            plans, spans = plans * 2, spans * 2
        p = pack(c, cache.row_ids, cache.hosts, plans, spans, self.model.logit_shift)
        self.row_columns += p.row_columns
        self.key_columns += p.key_columns
        logits = self.model(p.ids, p.positions, cache, p.layout, logits_slice=p.picks)
        logits = logits.view(len(plans), p.span, -1)  # (branches B, L, V)
        if self.branches == 2:
            cond, un = logits.chunk(2)
            logits = un + (self.cfg + 1) * (cond - un)
        drafts, confidence, probs, h, kl = self._draft(logits, generator, keys)
        return Prediction(
            drafts, confidence, columns, valid, forwards=1, probs=probs, entropy=h, kl=kl
        )

    def _layer_buffers(self, c: Canvas) -> KVCache:
        """No cache policy: one layer's K/V buffers, shared by every layer, for a packed
        forward (each layer writes its rows' keys there and attends them before the next
        layer overwrites them; every row refreshes, so every key it attends is written), kept
        while the canvas keeps its shape."""
        shape = (c.batch * self.branches, c.width)
        if self._buffers is None or self._buffers[0] != shape:
            n_layers, n_kv, head_dim = self.model.kv_shape()
            p = next(self.model.parameters())
            one = KVCache.empty(1, shape[0], n_kv, c.width, head_dim, p.dtype, p.device)
            self._buffers = (shape, KVCache(one.k * n_layers, one.v * n_layers))
        return self._buffers[1]

    def _group(self, canvas, cache, plans, spans, rows, generator, skip=()):
        keys = self._row_keys(canvas, rows, spans, skip)
        return self._draft(self._logits(canvas, cache, plans, spans, rows), generator, keys)

    def _draft(self, logits: torch.Tensor, generator, keys=None):
        """Drafts, confidence, (when kept) distributions of logits (R, L, V), and what the
        rule reads besides (each slot's entropy, KL; None where it reads none)."""
        if self.greedy:
            return (*self.sampler.argmax(logits), None, None, None)
        tokens, confidence, probs, h, kl = self.sampler.measured(
            logits, generator, self.probs, keys, self.reads
        )
        return tokens, confidence, probs if self.probs else None, h, kl

    def _row_keys(self, c: Canvas, rows, spans, skip=()) -> list[tuple[int, int] | None] | None:
        """Each drafted row's (request id, first drafted column): a tensor-parallel KLASS keeps
        each row's last distribution shard by request and lines its slots up by column (None:
        nothing reads them); `skip` rows' None (their drafts are a full forward's, which
        follows)."""
        if not self.reads.kl:
            return None
        ids = (c.request_ids if rows is None else c.request_ids[rows]).tolist()
        return [
            None if r in skip else (key, span[0])
            for r, (key, span) in enumerate(zip(ids, spans, strict=True))
        ]

    def _logits(self, c: Canvas, cache, plans, spans, rows) -> torch.Tensor:
        """One forward for `rows` (None: every row), logits for each row's span.

        Keys before `lo`, the group's first real column, are every row's padding: the
        forward neither computes nor attends them.
        """
        model, width, shift = self.model, c.width, self.model.logit_shift
        pick = (lambda t: t) if rows is None else (lambda t: t[rows])
        ids_all, pos_all = pick(c.ids), pick(c.positions())
        lo = min(p.lead for p in plans)
        starts = [p.start for p in plans]
        ends = [p.end for p in plans]
        if all(p.refresh for p in plans):  # refreshes share one slice from the group's lo
            starts = [lo] * len(starts)
        if cache is None:  # no cache: every plan is the canvas from lo (pruned per row)
            ends = [max(ends)] * len(ends)
        if len(set(starts)) == 1 and len(set(ends)) == 1:
            cols = slice(starts[0], ends[0])
            ids, pos = ids_all[:, cols], pos_all[:, cols]
        else:  # every row its own window, padding aimed at the scratch column `width`
            cols = row_columns(starts, ends, width, c.ids.device)  # (R, T)
            ids = take(ids_all, cols, c.mask_id)
            pos = take(pos_all, cols, 0)
        keys = self._keys(c, cache, rows, cols, [p.keys for p in plans], lo)
        picks = span_picks(starts, spans, shift, c.ids.device)
        branch_cache = cache
        if cache is not None:
            every = (
                None
                if rows is None
                else torch.cat([rows + b * c.batch for b in range(self.branches)])
            )
            branch_cache = cache.view(every, lo)
        if self.branches == 2:
            # Classifier-free guidance (LLaDA): a second branch with the prompt masked out.
            prompt = pick(c.prompt_mask())
            prompt = prompt[:, cols] if isinstance(cols, slice) else take(prompt, cols, False)
            uncond = ids.masked_fill(prompt, c.mask_id)  # (as both_branches masks it)
            ids, pos = torch.cat([ids, uncond]), torch.cat([pos, pos])
            keys = None if keys is None else torch.cat([keys, keys])
            if isinstance(cols, torch.Tensor):
                cols = torch.cat([cols, cols])
            if isinstance(picks, torch.Tensor):
                picks = torch.cat([picks, picks])
        self._count(ids, keys, cache, lo)
        logits = model(ids, pos, branch_cache, keys, columns=cols, logits_slice=picks)
        if self.branches == 2:
            cond, un = logits.chunk(2)
            logits = un + (self.cfg + 1) * (cond - un)
        return logits

    def _count(self, ids: torch.Tensor, keys, cache: KVCache | None, lo: int) -> None:
        """Add this forward's row-columns and query-key pairs (host shapes only)."""
        n, t = ids.shape
        if keys is not None:
            attended = keys.shape[1]
        else:
            attended = t if cache is None else cache.width + int(cache.scratch) - lo
        self.row_columns += n * t
        self.key_columns += n * t * attended

    def _keys(self, c: Canvas, cache: KVCache | None, rows, cols, limits, lo: int):
        """(R, S - lo) key mask from column lo: padding off; with a scratch column, (R, S + 1 -
        lo) with it off.

        Under suffix pruning (a row's plan has `keys`) the mask is (R, K - lo), K the furthest
        row's limit: attention reads no column from K on (models/layers.attend), and each row's
        columns past its own limit are off.
        """
        keys = c.key_mask()  # (B, S) or None
        if keys is not None and rows is not None:
            keys = keys[rows]
        if any(limit is not None for limit in limits):
            host = [c.width if n is None else n for n in limits]
            ends = torch.tensor(host, device=c.ids.device)
            inside = c.columns()[None] < ends[:, None]  # (R, S)
            if keys is not None:
                inside &= keys
            return inside[:, lo : max(host)]
        if cache is None:  # no cache: keys are the forward's own columns
            return None if keys is None else keys[:, cols]
        if cache.scratch:
            if keys is None:
                n = c.batch if rows is None else len(rows)
                keys = torch.ones((n, c.width), dtype=torch.bool, device=c.ids.device)
            keys = torch.cat([keys, torch.zeros_like(keys[:, :1])], dim=1)
        return None if keys is None else keys[:, lo:]


def both_branches(c: Canvas) -> Canvas:
    """Guidance's canvas of 2B rows: the rows, then each with its prompt masked out."""
    uncond = c.ids.masked_fill(c.prompt_mask(), c.mask_id)
    twice = (
        torch.cat([c.ids, uncond]),
        c.pad.repeat(2),
        c.request_ids.repeat(2),
        c.marks.repeat(2, 1),
    )
    return Canvas(*twice, c.prompt_width, c.mask_id, c.any_pad)


def folds(plans: list[ForwardPlan], spans, full: list[int], model) -> bool:
    """Whether one forward over every row's own columns (windows padded to the longest plan)
    computes no more row-columns than the windowed forward plus the full one: wide windows
    (Prefix/FreeCache early in the answer, short prompts) take a new row's prefill along."""
    shift = model.logit_shift
    longest = max(p.end - p.start for p in plans)
    windows = max(
        (e - a + shift) if p.refresh else (p.end - p.start)
        for p, (a, e) in zip(plans, spans, strict=True)
    )
    fulls = max(plans[r].end - plans[r].start for r in full)
    return len(plans) * longest <= len(plans) * windows + len(full) * fulls


def apart(plans: list[ForwardPlan], full: list[int]) -> bool:
    """Whether rows need more than one padded forward's layout: a refresh beside other rows
    or another refresh, or cached windows that differ."""
    if full:
        return len(plans) > 1
    return len({(p.start, p.end) for p in plans}) > 1


def split(plans: list[ForwardPlan]) -> tuple[list[int], list[int]]:
    """Row indices needing a full forward, and the rest (windowed)."""
    full = [r for r, p in enumerate(plans) if p.refresh]
    return full, [r for r, p in enumerate(plans) if not p.refresh]


def row_columns(starts, ends, width: int, device) -> torch.Tensor:
    """(R, T) canvas columns of each row's window, padded with the scratch column `width`."""
    start = torch.tensor(starts, device=device)
    length = torch.tensor(ends, device=device) - start
    span = torch.arange(max(e - a for a, e in zip(starts, ends, strict=True)), device=device)
    return torch.where(span[None] < length[:, None], start[:, None] + span, width)


def take(values: torch.Tensor, cols: torch.Tensor, fill) -> torch.Tensor:
    """values (R, S) at per-row columns (R, T); `fill` where a column is the scratch one."""
    width = values.shape[1]
    return values.gather(1, cols.clamp(max=width - 1)).masked_fill(cols >= width, fill)


def span_picks(starts, spans, shift: int, device) -> slice | torch.Tensor:
    """Which outputs of the forward predict each row's span (Dream: one column to the left)."""
    offsets = [a - shift - s for s, (a, _) in zip(starts, spans, strict=True)]
    lengths = [e - a for a, e in spans]
    if len(set(offsets)) == 1 and len(set(lengths)) == 1:
        return slice(offsets[0], offsets[0] + lengths[0])
    off = torch.tensor(offsets, device=device)
    n = torch.tensor(lengths, device=device)
    j = torch.arange(max(lengths), device=device)[None]
    return off[:, None] + torch.minimum(j, n[:, None] - 1)  # padding repeats the last pick
