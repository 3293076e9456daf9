"""Continuous batching: B slots decode side by side; a finished row's slot takes the next prompt.

Prompts come from an iterator and leave through `on_done` as soon as each is final, so a long
answer never holds a short one back and a slot never idles while prompts are waiting. Each row
keeps its own place (rows.py: block, step, frozen K/V); a newly admitted row is `fresh`, so its
cache policy plans a full forward for it (its prefill) while the other rows take their cached
steps. forwards.py serves both groups with at most two forwards a step: one full-canvas
forward for the new and refreshing rows, one windowed forward for the rest.

Memory is allocated once, for the B slots: a KV cache of B rows (x2 under classifier-free
guidance) over a canvas of prompt width P + gen_length (+1 scratch column). P is the longest
prompt seen, rounded up to `quantum` columns; rows are left-padded to P, and RoPE positions
count from each row's first token, so a row decodes as it would alone. A later, longer prompt
widens P (a copy, shifting every column right); that happens at most once per quantum of
prompt length, never per input line. Finished rows leave the canvas; their cache rows stay
where they are and the next prompt is written over them (`SlotCache` maps live rows to slots).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dllm_cli.cache import KVCache
from dllm_cli.decoding.answer import first_stop
from dllm_cli.decoding.canvas import Canvas, check_prompts, check_token_ids, plan_blocks
from dllm_cli.decoding.engine import Decoder, DecodeRun
from dllm_cli.decoding.events import StepEvent
from dllm_cli.decoding.rows import BlockWalk, RowState
from dllm_cli.errors import InputError
from dllm_cli.families import batching_reason, family_of_model

QUANTUM = 64  # prompt width grows in steps of this many columns


@dataclass(frozen=True)
class Finished:
    """One prompt's answer, handed on the step it became final."""

    key: Any  # what the source gave with the prompt
    tokens: list[int]  # gen_length ids; after an early stop, EOS fill
    steps: int  # steps it spent in a slot (one forward served it in each)
    seconds: float  # wall time from admission to its last step


def static_reason(model, guided: bool) -> str | None:
    """Why a decode must run as static batches (None: continuous batching serves it)."""
    return batching_reason(family_of_model(model), guided)


class SlotCache:
    """A KVCache with `slots` rows per branch, addressed through the live canvas rows.

    Canvas row r (branch b) lives in cache row `live[r] + b * slots`. `live` is kept sorted,
    so with every slot busy the mapping is the identity and forwards use the cache directly.
    """

    def __init__(self, cache: KVCache, slots: int, branches: int):
        self.cache, self.slots, self.branches = cache, slots, branches
        self.live = torch.zeros(0, dtype=torch.long, device=cache.k[0].device)

    @property
    def scratch(self) -> bool:
        return self.cache.scratch

    @property
    def width(self) -> int:
        return self.cache.width

    def _map(self, rows: torch.Tensor) -> torch.Tensor:
        n = len(self.live)
        return self.live[rows % n] + torch.div(rows, n, rounding_mode="floor") * self.slots

    def rows(self, rows: torch.Tensor):
        """Canvas rows (branch-major, as forwards.py numbers them) -> their cache rows."""
        return self.cache.rows(self._map(rows))

    def update(self, layer: int, columns, k: torch.Tensor, v: torch.Tensor):
        if len(self.live) == self.slots:  # every slot busy, in slot order: the cache itself
            return self.cache.update(layer, columns, k, v)
        every = torch.arange(len(self.live) * self.branches, device=k.device)
        return self.rows(every).update(layer, columns, k, v)

    def widen(self, extra: int) -> None:
        """`extra` more columns on the left (the canvas grew its prompt width)."""
        old = self.cache
        k = [torch.nn.functional.pad(t, (0, 0, extra, 0)) for t in old.k]
        v = [torch.nn.functional.pad(t, (0, 0, extra, 0)) for t in old.v]
        self.cache = KVCache(k, v, old.scratch)


class ContinuousRun(DecodeRun):
    """A decode over a stream of prompts in `slots` slots; iterate it for StepEvents.

    `on_done(Finished)` receives each answer the step it is final; `on_error(key, reason)` a
    prompt the decoder refuses (the others go on). Canvas rows are numbered in admission
    order (StepEvent rows). The per-step logic (plan, forwards, commit) is DecodeRun's.
    """

    def __init__(
        self,
        decoder: Decoder,
        source: Iterable[tuple[Any, list[int]]],
        slots: int,
        on_done: Callable[[Finished], None],
        on_error: Callable[[Any, str], None],
        quantum: int = QUANTUM,
    ):
        if slots < 1:
            raise InputError(f"batch size must be at least 1 (got {slots})")
        reason = static_reason(decoder.model, getattr(decoder.committer, "start", None) is not None)
        if reason is not None:
            raise InputError(f"continuous batching cannot serve this decode: {reason}")
        began = time.perf_counter()
        self.d, s = decoder, decoder.settings
        self.source: Iterator = iter(source)
        self.slots, self.quantum = slots, quantum
        self.on_done, self.on_error = on_done, on_error
        self.device = next(decoder.model.parameters()).device
        self.walk = BlockWalk(lockstep=False)
        self.rows: list[RowState] = []
        self.generator = torch.Generator(device=self.device).manual_seed(s.seed)
        self.branches = 2 if s.cfg_scale > 0 else 1
        self.canvas: Canvas | None = None
        self.cache: SlotCache | None = None
        self.blocks = []
        self.stop_ids = torch.tensor(decoder.special.stop, device=self.device)
        self.forwards = self.steps = self.guide_forwards = self.served = 0
        self.guide_seconds = 0.0
        self.admitted = 0  # prompts admitted so far (the next canvas row number)
        self.meta: dict[int, tuple[Any, int, float]] = {}  # row -> key, first step, start time
        self.ready: list[Finished] = []  # finished this step, handed on outside the timing
        self.seconds = time.perf_counter() - began
        self._events = self._loop()

    def finish(self) -> ContinuousRun:
        """Run every remaining step (answers still go to `on_done`)."""
        for _ in self._events:
            pass
        return self

    def result(self):
        raise TypeError("a continuous run hands answers to on_done; call finish()")

    @property
    def live(self) -> int:
        return 0 if self.canvas is None else self.canvas.batch

    def _loop(self) -> Iterator[StepEvent]:
        """Admit prompts into free slots, step, hand finished rows on; until the source ends."""
        while True:
            self._admit()
            if self.live == 0:
                return
            began = time.perf_counter()
            event = self._step()
            self.seconds += time.perf_counter() - began
            for done in self.ready:
                self.on_done(done)
            self.ready = []
            yield event

    # --- admission ---------------------------------------------------------------------
    def _admit(self) -> None:
        """Fill free slots from the source (its reading time is not decoding time)."""
        s, model = self.d.settings, self.d.model
        table = model.get_input_embeddings().num_embeddings
        new: list[tuple[Any, list[int]]] = []
        while self.live + len(new) < self.slots:
            item = next(self.source, None)
            if item is None:
                break
            key, ids = item[0], [int(t) for t in item[1]]
            try:
                check_prompts([ids], s.gen_length, model.context_length)
                check_token_ids([ids], table)
            except InputError as e:
                self.on_error(key, str(e).replace("prompt 0 ", "prompt ", 1))
                continue
            new.append((key, ids))
        if new:
            began = time.perf_counter()
            with torch.inference_mode():
                self._place(new)
            self.seconds += time.perf_counter() - began

    def _place(self, new: list[tuple[Any, list[int]]]) -> None:
        """New rows into the canvas (widened if needed) and free slots, rows kept slot-sorted."""
        s, special = self.d.settings, self.d.special
        longest = max(len(ids) for _, ids in new)
        if self.canvas is None:
            self._allocate(self._width_for(longest))
        elif longest > self.canvas.prompt_width:
            self._widen(self._width_for(longest))
        c = self.canvas
        fresh = Canvas.build(
            [ids for _, ids in new], s.gen_length, special.mask, special.pad, self.device
        )
        fresh = pad_left(fresh, c.prompt_width - fresh.prompt_width, special.pad)
        numbers = torch.arange(self.admitted, self.admitted + len(new), device=self.device)
        fresh.rows = numbers
        now = time.perf_counter()
        for n, (key, _) in zip(numbers.tolist(), new, strict=True):
            self.meta[n] = (key, self.steps, now)
        self.admitted += len(new)
        taken = set(self.cache.live.tolist()) if self.cache is not None else set()
        if self.cache is None:  # no cache policy: slots are only a count
            taken = set(range(self.live))
        free = [i for i in range(self.slots) if i not in taken][: len(new)]
        slots = torch.cat([self._slots(), torch.tensor(free, device=self.device)])
        merged = cat_canvases(c, fresh)
        self.rows += [RowState(0) for _ in new]
        order = slots.argsort()
        self.canvas = merged.select(order)
        self.rows = [self.rows[i] for i in order.tolist()]
        if self.cache is not None:
            self.cache.live = slots[order]

    def _slots(self) -> torch.Tensor:
        if self.cache is not None:
            return self.cache.live
        return torch.arange(self.live, device=self.device)

    def _width_for(self, longest: int) -> int:
        """The prompt width for a prompt of `longest` tokens: rounded up, within the context."""
        room = self.d.model.context_length - self.d.settings.gen_length
        return max(longest, min(-(-longest // self.quantum) * self.quantum, room))

    def _allocate(self, width: int) -> None:
        """An empty canvas and (cache policies) the one KV cache for every slot."""
        s, special = self.d.settings, self.d.special
        empty = torch.zeros(0, dtype=torch.long, device=self.device)
        ids = torch.zeros((0, width + s.gen_length), dtype=torch.long, device=self.device)
        steps = torch.zeros((0, s.gen_length), dtype=torch.long, device=self.device)
        self.canvas = Canvas(ids, empty, empty.clone(), steps, width, special.mask)
        self.blocks = plan_blocks(width, s.gen_length, s.block_length, s.total_steps)
        if self.d.policy.uses_cache:
            model, rows = self.d.model, self.slots * self.branches
            cache = KVCache.for_model(model, rows, width + s.gen_length, scratch=True)
            self.cache = SlotCache(cache, self.slots, self.branches)

    def _widen(self, width: int) -> None:
        """A longer prompt arrived: shift every live row right (canvas, cache, frozen marks)."""
        s, c = self.d.settings, self.canvas
        extra = width - c.prompt_width
        self.canvas = pad_left(c, extra, self.d.special.pad)
        self.blocks = plan_blocks(width, s.gen_length, s.block_length, s.total_steps)
        for row in self.rows:
            row.shift(extra)
        if self.cache is not None:
            self.cache.widen(extra)

    # --- retirement --------------------------------------------------------------------
    def _retire(self) -> tuple[int, ...]:
        """Finished rows leave the canvas and free their slots; their answers are handed on."""
        c, s = self.canvas, self.d.settings
        answer = c.answer()  # (B, G)
        done = ~(answer == c.mask_id).any(dim=1)
        cut = torch.full_like(c.rows, answer.shape[1])
        if s.early_stop:
            cut = first_stop(answer, self.stop_ids, c.mask_id)
            done |= cut < answer.shape[1]
        if not bool(done.any()):
            return ()
        gone = done.nonzero().squeeze(1)
        past = torch.arange(answer.shape[1], device=answer.device)[None] > cut[gone][:, None]
        tokens = answer[gone].masked_fill(past, self.d.special.eos).tolist()
        now = time.perf_counter()
        numbers = c.rows[gone].tolist()
        for n, row_tokens in zip(numbers, tokens, strict=True):
            key, first, since = self.meta.pop(n)
            self.ready.append(Finished(key, row_tokens, self.steps + 1 - first, now - since))
        keep = (~done).nonzero().squeeze(1)
        if self.cache is not None:
            self.cache.live = self.cache.live[keep]
        self.rows = [self.rows[i] for i in keep.tolist()]
        self.canvas = c.select(keep)
        return tuple(numbers)


def pad_left(c: Canvas, extra: int, pad_id: int) -> Canvas:
    """The canvas with `extra` more padding columns before every row (prompt width + extra)."""
    if extra == 0:
        return c
    padding = torch.full((c.batch, extra), pad_id, dtype=c.ids.dtype, device=c.ids.device)
    ids = torch.cat([padding, c.ids], dim=1)
    return Canvas(ids, c.pad + extra, c.rows, c.steps, c.prompt_width + extra, c.mask_id)


def cat_canvases(a: Canvas, b: Canvas) -> Canvas:
    """Rows of `a` then rows of `b` (same prompt width)."""
    parts = [torch.cat([x, y]) for x, y in zip(fields(a), fields(b), strict=True)]
    return Canvas(*parts, a.prompt_width, a.mask_id)


def fields(c: Canvas) -> tuple[torch.Tensor, ...]:
    return c.ids, c.pad, c.rows, c.steps
