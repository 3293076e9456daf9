"""The engine: requests come in at any step, each step decodes every request holding a slot.

    engine = Engine(model, special, settings, slots=8, admission="continuous")
    rid = engine.add(prompt_ids)          # refused at once (InputError) if it cannot decode
    while engine.has_work:
        out = engine.step()               # admits, then one decoding step of every live row
        for done in out.finished: ...     # Finished: tokens and the request's own counts
    engine.abort(rid)                     # waiting or running; its slot is free next step

The shape is nano-vllm's LLMEngine / Scheduler / Sequence: a `Request` (request.py) holds a
prompt's ids and all its progress, an admission policy (slots.py: static | continuous, one
code path) decides when a waiting request takes a free slot, and a step runs what step.py
says: each live row's cache policy plans its columns, forwards.py serves all rows (one
windowed forward; refreshes over their own columns), a committer picks which drafts become
tokens, rows move on, and finished rows leave their slots. The engine prints nothing; a step's `StepEvent` (for a live view) is
built only when a consumer asks for it. One thread owns an engine (it is not thread-safe).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from dllm_cli.cache import KVCache
from dllm_cli.decoding.answer import answer_tokens, first_stop
from dllm_cli.decoding.canvas import Canvas, plan_blocks
from dllm_cli.decoding.forwards import Forwards
from dllm_cli.decoding.policies import POLICIES
from dllm_cli.decoding.request import (
    Finished,
    Request,
    RequestQueue,
    Status,
    canvas_prompt,
    check_slots,
)
from dllm_cli.decoding.row_sampling import RowDraws
from dllm_cli.decoding.rows import BlockWalk, FrontierWalk
from dllm_cli.decoding.sampling import Sampler, family_of
from dllm_cli.decoding.sharded_sampling import ShardedSampler
from dllm_cli.decoding.slots import ADMISSIONS, cat_canvases, empty_canvas, pad_left
from dllm_cli.decoding.step import StepOutput, decode_step
from dllm_cli.decoding.unmask import Committer, RuleCommitter
from dllm_cli.decoding.wino import ShadowForwards
from dllm_cli.errors import InputError, SettingsError
from dllm_cli.families import with_family_defaults
from dllm_cli.lifetimes import Sampling, request_sampling
from dllm_cli.models.base import DiffusionLM
from dllm_cli.models.loading import SpecialIds
from dllm_cli.settings import DecodeSettings


class Engine(RequestQueue):
    """A loaded model decoding requests in `slots` slots; `add`, `step`, `abort`."""

    def __init__(
        self,
        model: DiffusionLM,
        special: SpecialIds,
        settings: DecodeSettings,
        committer: Committer | None = None,
        *,
        slots: int = 8,
        admission: str = "continuous",
        lockstep: bool | None = None,
        quantum: int | None = None,
    ):
        check_slots(slots)
        if admission not in ADMISSIONS:
            raise SettingsError(f"admission must be one of {', '.join(ADMISSIONS)}")
        # Unset values take the family's reference defaults (Dream: top_k 50; families.py).
        settings = with_family_defaults(settings, model.family)
        self.settings, self.model, self.special = settings, model, special
        self.admission = policy = ADMISSIONS[admission]
        self.slots, self.quantum = slots, quantum or policy.quantum
        family = family_of(model)
        # A tensor-parallel model samples from its vocabulary shard (models/sharding.py).
        vocab = special.real_vocab(model.vocab_size)
        if model.shards is None:
            self.sampler = Sampler(settings, family, vocab, special.mask)
        else:
            self.sampler = ShardedSampler.of(model, settings, family, vocab, special.mask)
        self.committer = committer or RuleCommitter(settings, family.schedule)
        self.frontier = bool(getattr(self.committer, "frontier", False))
        self.draft_window = getattr(self.committer, "draft_window", None)
        # Optional committer hooks (a guide's per-row cache): a decode starts, rows leave,
        # rows join a running decode (unmask.Committer says more).
        self.on_start = getattr(self.committer, "start", None)
        self.on_select = getattr(self.committer, "select", None)
        self.on_admit = getattr(self.committer, "admit", None)
        if self.on_start is not None and self.on_admit is None and not policy.whole_batches:
            raise InputError(
                "continuous batching cannot serve this decode: "
                "its committer keeps one state per batch (no `admit` hook)"
            )
        self.policy = POLICIES[settings.cache]()
        probs = bool(getattr(self.committer, "needs_probs", False))  # eb, klass read them
        self.keeps_probs = probs  # (a step where a request asks for logprobs keeps them too)
        # WINO's committer verifies earlier commits with a shadow block in the same forward.
        self.revokes = bool(getattr(self.committer, "needs_shadow", False))
        kind = ShadowForwards if self.revokes else Forwards
        ragged = not policy.whole_batches  # rows apart: each refresh over its own columns
        # A frontier walk drafts argmax (the guide) unless its committer samples (a grammar).
        greedy = self.frontier and getattr(self.committer, "greedy_drafts", True)
        self.executor = kind(model, self.sampler, settings.cfg_scale, greedy, probs, ragged=ragged)
        self.lockstep = policy.lockstep if lockstep is None else lockstep
        self.walk = FrontierWalk() if self.frontier else BlockWalk(self.lockstep)
        super().__init__()  # the queue and requests by id
        self.device = next(model.parameters()).device
        self.sampling = Sampling.of(settings)  # a request's unless `add` is given its own
        self.branches = 2 if settings.cfg_scale > 0 else 1  # classifier-free guidance
        self.stop_ids = torch.tensor(special.stop, device=self.device)
        self.table = model.get_input_embeddings().num_embeddings
        self.live: list[Request] = []  # running, in canvas row order
        self.canvas: Canvas | None = None
        self.cache: KVCache | None = None  # `slots` rows per branch
        self.slot_rows = torch.zeros(0, dtype=torch.long, device=self.device)  # live row -> slot
        self.blocks: list = []
        self.steps = self.forwards = self.guide_forwards = self.served = 0
        self.step_tensors: dict = {}  # small host tuples -> device tensors (step.on_device)
        self.seconds = self.guide_seconds = 0.0  # time inside step(): admissions and steps

    # --- the public interface --------------------------------------------------------------
    def add(
        self,
        prompt: list[int],
        key: Any = None,
        settings: DecodeSettings | None = None,
        sampling: Sampling | dict | None = None,
        logprobs: int | None = None,
    ) -> int:
        """Queue a prompt; its id. A prompt that cannot decode is refused here (InputError).

        `sampling` (or whole `settings`) gives the request its own temperature, top_p, top_k,
        seed and stop ids (lifetimes.py); any other setting differing from the engine's is
        refused (SettingsError naming it). `logprobs` (k >= 0) records each answer token's
        log-probability and k alternatives (logprobs.py; Finished.token_logprobs)."""
        own = self.sampling
        if settings is not None or sampling is not None:
            own = request_sampling(self.settings, self.model.family, settings, sampling)
        ids = canvas_prompt(prompt, self.settings.gen_length, self.model.context_length, self.table)
        rid = self.enqueue(ids, key, own)
        self.requests[rid].logprobs = logprobs
        return rid

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    @property
    def running(self) -> int:
        return sum(r.status is Status.RUNNING for r in self.live)

    @property
    def row_columns(self) -> int:
        """Columns forwarded over the engine's life (rows x columns; load-independent work)."""
        return self.executor.row_columns

    @property
    def key_columns(self) -> int:
        """Query-key pairs attended per layer over the engine's life."""
        return self.executor.key_columns

    def progress(self, rid: int) -> list[int]:
        """A running request's committed answer so far, up to its first mask or stop token."""
        request = self.requests.get(rid)
        if request is None or request.status is not Status.RUNNING:
            return []
        row = self.canvas.answer()[self.live.index(request)].tolist()
        first = row.index(self.special.mask) if self.special.mask in row else len(row)
        if self.revokes:  # WINO may mask a commit of the current block again: final before it
            first = min(first, self.blocks[request.row.block].start - self.canvas.prompt_width)
        return answer_tokens(row[:first], (*self.special.stop, *request.sampling.stop))

    def step(self) -> StepOutput:
        """Admit waiting requests into free slots, then one decoding step of every live row."""
        began = time.perf_counter()
        if torch.is_inference_mode_enabled():  # (a caller's: no second context per step)
            out = self._step()
        else:
            with torch.inference_mode():
                out = self._step()
        self.seconds += time.perf_counter() - began
        return out

    def _step(self) -> StepOutput:
        self._drop_aborted()
        self._admit()
        return decode_step(self) if self.live else StepOutput(-1)

    # --- admission -------------------------------------------------------------------------
    def _admit(self) -> None:
        """Waiting requests take free slots, as the admission policy allows."""
        if not self.queue or (self.admission.whole_batches and self.live):
            return
        room = self.slots - len(self.live)
        new = [self.queue.popleft() for _ in range(min(room, len(self.queue)))]
        if not new:
            return
        longest = max(len(r.prompt) for r in new)
        if self.admission.whole_batches:
            self._allocate(longest, len(new))
            if self.on_start is not None:
                self.on_start(len(new))  # the committer learns that a decode begins
        elif self.canvas is None:
            self._allocate(self._width_for(longest), self.slots)
            if self.on_start is not None:
                self.on_start(0)  # rows join through `admit`
        elif longest > self.canvas.prompt_width:
            self._widen(self._width_for(longest))
        self._place(new)

    def _place(self, new: list[Request]) -> None:
        """New rows into the canvas and free slots, rows kept in slot order."""
        c, special = self.canvas, self.special
        s = self.settings
        fresh = Canvas.build(
            [r.prompt for r in new], s.gen_length, special.mask, special.pad, c.ids.device
        )
        fresh = pad_left(fresh, c.prompt_width - fresh.prompt_width, special.pad)
        fresh.rows = torch.tensor([r.id for r in new], device=self.device)
        for r in new:
            r.admit(self.steps)
            r.generator = torch.Generator(device=self.device).manual_seed(r.sampling.seed)
            r.row.first = c.prompt_width  # its first mask: the answer's first column
            r.row.lead = c.prompt_width - len(r.prompt)  # its first prompt token
        taken = {r.slot for r in self.live}
        free = [i for i in range(self.slots) if i not in taken]
        for r, slot in zip(new, free, strict=False):
            r.slot = slot
        merged = self.live + new
        ranks = sorted(range(len(merged)), key=lambda i: merged[i].slot)  # rows in slot order
        order = torch.tensor(ranks, dtype=torch.long, device=self.device)
        self.canvas = cat_canvases(c, fresh).select(order)
        if self.on_admit is not None and not self.admission.whole_batches:
            self.on_admit([r.prompt for r in new], order)
        self.live = [merged[i] for i in ranks]
        self._note_padding()
        self.slot_rows = torch.tensor([r.slot for r in self.live], device=self.device)

    def _width_for(self, longest: int) -> int:
        """The prompt width for a prompt of `longest` tokens: rounded up, within the context."""
        room = self.model.context_length - self.settings.gen_length
        return max(longest, min(-(-longest // self.quantum) * self.quantum, room))

    def _allocate(self, width: int, slots: int) -> None:
        """An empty canvas and (cache policies) the KV cache for `slots` rows."""
        s = self.settings
        self.canvas = empty_canvas(width, s.gen_length, self.special.mask, self.device)
        self.blocks = plan_blocks(width, s.gen_length, s.block_length, s.total_steps)
        self.cache = None
        if self.policy.uses_cache:
            # Rows apart need per-row columns, whose padding writes go to a scratch column.
            apart = self.frontier or not self.lockstep
            scratch = not self.admission.whole_batches or (slots > 1 and apart)
            rows = slots * self.branches
            self.cache = KVCache.for_model(self.model, rows, width + s.gen_length, scratch)

    def _widen(self, width: int) -> None:
        """A longer prompt arrived: shift every live row right (canvas, cache, frozen marks)."""
        s, c = self.settings, self.canvas
        extra = width - c.prompt_width
        self.canvas = pad_left(c, extra, self.special.pad)
        self.blocks = plan_blocks(width, s.gen_length, s.block_length, s.total_steps)
        for r in self.live:
            r.row.shift(extra)
        self._note_padding()
        if self.cache is not None:
            self.cache = self.cache.pad_left(extra)

    def draws(self, spans: list[tuple[int, int]]) -> RowDraws:
        """The live rows' sampling this step: own generators and values, spans, who draws."""
        return RowDraws(
            tuple(r.generator for r in self.live),
            tuple(r.sampling for r in self.live),
            tuple(e - a for a, e in spans),
            tuple(not r.idle for r in self.live),
        )

    # --- leaving -----------------------------------------------------------------------------
    def done(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(B,) rows whose answer is final, and (B,) where each answer ends, on the device."""
        c = self.canvas
        answer = c.answer()  # (B, G)
        done = ~(answer == c.mask_id).any(dim=1)
        cut = torch.full_like(c.rows, answer.shape[1])
        own = self.own_stops()
        if self.settings.early_stop or self.frontier:  # guided: a stop token ends the row
            cut = first_stop(answer, self.stop_ids if own is None else own, c.mask_id)
            done = done | (cut < answer.shape[1])
        elif own is not None:  # a request's own stop ids cut its answer (EOS after them)
            cut = first_stop(answer, own, c.mask_id)
        return done, cut

    def own_stops(self) -> torch.Tensor | None:
        """(B, K) each live row's stop ids (the model's and its own, -1 padded); None when no
        request has its own (the model's `stop_ids` serve every row)."""
        if not any(r.sampling.stop for r in self.live):
            return None
        rows = [(*self.special.stop, *r.sampling.stop) for r in self.live]
        k = max(len(row) for row in rows)
        return torch.tensor([[*row, *[-1] * (k - len(row))] for row in rows], device=self.device)

    def retire(self, done: list[int], cut: torch.Tensor | None) -> tuple[list[Finished], list[int]]:
        """Rows whose answer is final (`done`, host flags) leave their slots; their Finished
        records (tokens stay on the device until read) and the indices of the rows kept.
        `cut` (B,): where each answer ends (None: at gen_length, no stop token cuts it)."""
        gone = [i for i, d in enumerate(done) if d]
        kept = [i for i, d in enumerate(done) if not d]
        if not gone:
            return [], kept
        c = self.canvas
        rows = torch.tensor(gone, device=self.device)
        answer = c.answer()[rows]  # (R, G)
        if cut is None:
            past = torch.zeros_like(answer, dtype=torch.bool)
        else:
            past = torch.arange(answer.shape[1], device=answer.device)[None] > cut[rows][:, None]
        if any(self.live[i].sampling.stop for i in gone):  # own stop ids are not in the text
            past = past | own_stop_at(answer, cut[rows], [self.live[i].sampling.stop for i in gone])
        tokens = answer.masked_fill(past, self.special.eos)
        first = torch.tensor([self.live[i].first_step for i in gone], device=self.device)
        marks = c.steps[rows]
        marks = torch.where((marks >= 0) & ~past, marks - first[:, None], -1)
        finished = []
        for j, i in enumerate(gone):
            r = self.live[i]
            finished.append(r.finish(tokens[j], marks[j], self.steps))
            self.requests.pop(r.id, None)
        self._keep(kept)
        return finished, kept

    def _drop_aborted(self) -> None:
        if any(r.status is Status.ABORTED for r in self.live):
            self._keep([i for i, r in enumerate(self.live) if r.status is not Status.ABORTED])

    def _keep(self, kept: list[int]) -> None:
        """Only live rows `kept` (indices) go on."""
        whole = self.admission.whole_batches
        keep = torch.tensor(kept, dtype=torch.long, device=self.device)
        if self.cache is not None and whole:  # a static batch's cache shrinks with it
            n = self.cache.k[0].shape[0] // self.branches
            self.cache = self.cache.select_rows(
                torch.cat([self.slot_rows[keep] + b * n for b in range(self.branches)])
            )
            self.slot_rows = torch.arange(len(kept), device=self.device)
            for slot, i in enumerate(kept):
                self.live[i].slot = slot
        else:
            self.slot_rows = self.slot_rows[keep]
        if self.on_select is not None:
            self.on_select(keep)
        self.live = [self.live[i] for i in kept]
        self.canvas = self.canvas.select(keep)
        self._note_padding()
        if whole and not self.live:  # the batch is over: its cache goes
            self.cache = None

    def cache_view(self) -> KVCache | None:
        """The cache as this step's canvas rows see it: canvas row r (branch b) is cache row
        `slot_rows[r] + b * slots`; the cache itself when every slot is busy (rows are kept in
        slot order, so the mapping is then the identity)."""
        if self.cache is None:
            return None
        n = self.cache.k[0].shape[0] // self.branches
        if len(self.live) == n:
            return self.cache
        hosts = tuple(r.slot + b * n for b in range(self.branches) for r in self.live)
        rows = torch.cat([self.slot_rows + b * n for b in range(self.branches)])
        return self.cache.view(rows, hosts=hosts)

    def _note_padding(self) -> None:
        """The canvas learns from the host whether any row is padded (no device read)."""
        width = self.canvas.prompt_width
        self.canvas.any_pad = any(len(r.prompt) < width for r in self.live)


def own_stop_at(answer: torch.Tensor, cut: torch.Tensor, stops: list[tuple[int, ...]]):
    """(R, G) bool: the cut column of rows whose answer ends at one of their own stop ids."""
    k = max(1, *(len(x) for x in stops))
    own = torch.tensor([[*x, *[-1] * (k - len(x))] for x in stops], device=answer.device)
    at = answer.gather(1, cut.clamp(max=answer.shape[1] - 1)[:, None])  # (R, 1)
    hit = (at == own).any(dim=1, keepdim=True) & (cut < answer.shape[1])[:, None]
    return hit & (torch.arange(answer.shape[1], device=answer.device)[None] == cut[:, None])
