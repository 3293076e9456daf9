"""The masked-diffusion stepper (LLaDA, Dream, LLaDA-MoE): one canvas, one KV cache, rules.

Every live row is a row of one `Canvas` (prompts left-padded to a shared width, each row's
answer of its own gen_length) and, under a cache policy, of one `KVCache` with `slots` rows per
guidance branch. A step (step.py): each row's policy plans its columns from its own place
(rows.py), forwards.py serves all rows in one forward, a committer picks which drafts become
tokens, and the rows move on: in lockstep under static admission (as LLaDA and Fast-dLLM
decode a batch), each on its own otherwise, each at its first mask under a frontier committer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType

import torch

from dllm_cli.cache import KVCache
from dllm_cli.decoding import step
from dllm_cli.decoding.answer import answer_tokens, first_stop
from dllm_cli.decoding.canvas import Canvas, plan_blocks
from dllm_cli.decoding.forwards import Forwards
from dllm_cli.decoding.policies import POLICIES
from dllm_cli.decoding.request import Request
from dllm_cli.decoding.row_sampling import RowDraws
from dllm_cli.decoding.rows import BlockWalk, FrontierWalk
from dllm_cli.decoding.sampling import Reads, Sampler, sampler_rule_of
from dllm_cli.decoding.sharded_sampling import ShardedSampler
from dllm_cli.decoding.slots import Admission, cat_canvases, empty_canvas, pad_canvas
from dllm_cli.decoding.unmask import Committer, RuleCommitter
from dllm_cli.decoding.wino import ShadowForwards
from dllm_cli.errors import InputError
from dllm_cli.models.base import DiffusionLM
from dllm_cli.models.loading import SpecialIds
from dllm_cli.settings import DecodeSettings


class MaskedStepper:
    """A canvas of `slots` rows decoded by cache policies, forwards and a committer."""

    whole_batches = False
    batch_wide: Mapping[str, str] = MappingProxyType({})  # every Sampling field per request
    who = "the masked-diffusion decoder"

    def __init__(
        self,
        model: DiffusionLM,
        special: SpecialIds,
        settings: DecodeSettings,
        committer: Committer | None,
        admission: Admission,
        slots: int,
        *,
        lockstep: bool | None = None,
        quantum: int | None = None,
    ):
        self.settings, self.model, self.special = settings, model, special
        self.admission, self.slots, self.quantum = admission, slots, quantum or admission.quantum
        self.vocabulary = model.get_input_embeddings().num_embeddings
        family = sampler_rule_of(model)
        self.committer = committer or RuleCommitter(settings, family.schedule)
        # A tensor-parallel model samples from its vocabulary shard (models/sharding.py); a
        # committer that reads distributions (a grammar's) gets the shard's part of them, and
        # KLASS's KL is measured there (one process: from the distributions the step keeps).
        vocab, sharded = special.real_vocab(model.vocab_size), model.shards is not None
        rule = self.committer
        probs = rule.needs_probs or (rule.reads_kl and not sharded)
        reads = Reads(rule.reads_entropy, rule.reads_kl and sharded)
        if not sharded:
            self.sampler = Sampler(settings, family, vocab, special.mask)
        else:
            self.sampler = ShardedSampler.of(model, settings, family, vocab, special.mask, probs)
            self.committer.shard(self.sampler)
        self.frontier, self.draft_window = self.committer.frontier, self.committer.draft_window
        if not self.committer.joins and not admission.whole_batches:
            raise InputError(
                "continuous batching cannot serve this decode: "
                "its committer keeps one state per batch (no `admit` hook)"
            )
        self.policy = POLICIES[settings.cache]()
        self.keeps_probs = probs  # klass, a grammar read them (so does a logprobs step)
        # WINO's committer verifies earlier commits with a shadow block in the same forward.
        self.revokes = self.committer.needs_shadow
        kind = ShadowForwards if self.revokes else Forwards
        ragged = not admission.whole_batches  # rows apart: each refresh over its own columns
        # A frontier walk drafts argmax (the guide) unless its committer samples (a grammar).
        greedy = self.frontier and self.committer.greedy_drafts
        self.executor = kind(
            model, self.sampler, settings.cfg_scale, greedy, probs, ragged=ragged, reads=reads
        )
        self.lockstep = admission.lockstep if lockstep is None else lockstep
        self.walk = FrontierWalk() if self.frontier else BlockWalk(self.lockstep)
        self.device = next(model.parameters()).device
        self.branches = 2 if settings.cfg_scale > 0 else 1  # classifier-free guidance
        self.stop_ids = torch.tensor(special.stop, device=self.device)
        self.canvas: Canvas | None = None
        self.cache: KVCache | None = None  # `slots` rows per branch
        self.slot_rows = torch.zeros(0, dtype=torch.long, device=self.device)  # live row -> slot
        self.plans: dict[int, tuple] = {}  # gen_length -> its blocks at this prompt width
        self.step_tensors: dict = {}  # small host tuples -> device tensors (step.on_device)
        self.counts: list[int] = []  # masks left in each row's block after the last commit
        self.forwards = self.guide_forwards = 0  # totals so far, for the events

    # --- the Stepper protocol ----------------------------------------------------------------
    def room(self, gen_length: int) -> int:
        """Context positions an answer of gen_length takes."""
        return gen_length

    def place(self, live: list[Request], new: list[Request], order: list[int], at: int) -> int:
        """New rows into the canvas (allocated, or widened for a longer prompt) and the cache."""
        prompts, lengths = [r.prompt for r in new], [r.sampling.gen_length for r in new]
        longest = max(map(len, prompts))
        if self.admission.whole_batches:
            self._allocate(longest, max(lengths), len(new), mixed=len(set(lengths)) > 1)
            self.committer.start(len(new))  # the committer learns that a decode begins
        elif self.canvas is None:
            answer = self._answer_for(max(lengths))
            self._allocate(self._width_for(longest, answer), answer, self.slots)
            self.committer.start(0)  # rows join through `admit`
        else:
            if max(lengths) > self.answer_width:
                self._lengthen(self._answer_for(max(lengths)))
            if longest > self.canvas.prompt_width:
                self._widen(live, self._width_for(longest, self.answer_width))
        c, mask, pad = self.canvas, self.special.mask, self.special.pad
        fresh = Canvas.build(prompts, self.answer_width, mask, pad, c.ids.device, lengths)
        fresh = pad_canvas(fresh, pad, left=c.prompt_width - fresh.prompt_width)
        fresh.request_ids = torch.tensor([r.id for r in new], device=self.device)
        for r in new:
            r.row.first = c.prompt_width  # its first mask: the answer's first column
            r.row.lead = c.prompt_width - len(r.prompt)  # its first prompt token
            r.row.blocks = self._blocks(r.sampling.gen_length)
        ranks = torch.tensor(order, dtype=torch.long, device=self.device)
        self.canvas = cat_canvases(c, fresh).select(ranks)
        if not self.admission.whole_batches:
            self.committer.admit(prompts, ranks)
        merged = live + new
        rows = [merged[i] for i in order]
        self._note_padding(rows)
        self.slot_rows = torch.tensor([r.slot for r in rows], device=self.device)
        return 0

    plan, forward, commit = step.plan, step.forward, step.commit  # this stepper as their `m`

    def keep(self, live: list[Request], kept: list[int]) -> None:
        """Only live rows `kept` (indices) go on: canvas rows, cache rows, the guide's rows."""
        whole = self.admission.whole_batches
        keep = torch.tensor(kept, dtype=torch.long, device=self.device)
        if self.cache is not None and whole:  # a static batch's cache shrinks with it
            n = self.cache.k[0].shape[0] // self.branches
            self.cache = self.cache.select_rows(
                torch.cat([self.slot_rows[keep] + b * n for b in range(self.branches)])
            )
            self.slot_rows = torch.arange(len(kept), device=self.device)
            for slot, i in enumerate(kept):
                live[i].slot = slot
        else:
            self.slot_rows = self.slot_rows[keep]
        self.committer.select(keep)
        staying = set(kept)
        left = [r.id for i, r in enumerate(live) if i not in staying]
        self.committer.leave(left)
        self.canvas = self.canvas.select(keep)
        self.counts = [self.counts[i] for i in kept] if self.counts else []
        self._note_padding([live[i] for i in kept])
        if whole and not kept:  # the batch is over: its cache goes
            self.cache = None

    def move_on(self, live: list[Request]) -> None:
        """The kept rows leave finished blocks (lockstep: together); an idle row draws nothing."""
        if not self.counts:
            return
        counts, self.counts = self.counts, []
        self.walk.advance([r.row for r in live], counts)
        if not self.frontier:  # a row left waiting in an empty block (lockstep) draws nothing
            for r, n in zip(live, counts, strict=True):
                r.idle = n == 0 and r.row.step > 0

    def progress(self, live: list[Request], i: int) -> list[int]:
        """Row i's committed answer so far, up to its first mask or stop token."""
        request = live[i]
        row = self.canvas.answer()[i, : request.sampling.gen_length].tolist()
        first = row.index(self.special.mask) if self.special.mask in row else len(row)
        if self.revokes:  # WINO may mask a commit of the current block again: final before it
            first = min(first, request.row.current.start - self.canvas.prompt_width)
        return answer_tokens(row[:first], (*self.special.stop, *request.sampling.stop))

    # --- the canvas and cache ------------------------------------------------------------------
    @property
    def answer_width(self) -> int:
        """Answer columns of the canvas: the longest gen_length it holds room for."""
        return self.canvas.width - self.canvas.prompt_width

    def _width_for(self, longest: int, answer: int) -> int:
        """The prompt width for a prompt of `longest` tokens: rounded up, within the context."""
        room = self.model.context_length - answer
        return max(longest, min(-(-longest // self.quantum) * self.quantum, room))

    def _answer_for(self, longest: int) -> int:
        """Answer columns for a gen_length of `longest`: rounded up as the prompt width is (so
        the canvas grows at most once per quantum), not past the engine's own gen_length."""
        return max(
            longest, min(-(-longest // self.quantum) * self.quantum, self.settings.gen_length)
        )

    def _blocks(self, gen_length: int) -> tuple:
        """A row's blocks for its own gen_length (steps split as its own settings split them)."""
        if gen_length not in self.plans:
            own = replace(self.settings, gen_length=gen_length)
            width, size, steps = self.canvas.prompt_width, own.block_length, own.total_steps
            self.plans[gen_length] = tuple(plan_blocks(width, gen_length, size, steps))
        return self.plans[gen_length]

    def _allocate(self, width: int, answer: int, slots: int, mixed: bool = False) -> None:
        """An empty canvas and (cache policies) the KV cache for `slots` rows."""
        self.canvas = empty_canvas(width, answer, self.special.mask, self.device)
        self.plans, self.cache = {}, None
        if self.policy.uses_cache:
            # Rows apart, or ending apart (`mixed` gen_lengths), need per-row columns, whose
            # padding writes go to a scratch column.
            apart = self.frontier or not self.lockstep or mixed
            scratch = not self.admission.whole_batches or (slots > 1 and apart)
            rows = slots * self.branches
            self.cache = KVCache.for_model(self.model, rows, width + answer, scratch)

    def _widen(self, live: list[Request], width: int) -> None:
        """A longer prompt arrived: shift every live row right (canvas, cache, frozen marks)."""
        extra = width - self.canvas.prompt_width
        self.canvas = pad_canvas(self.canvas, self.special.pad, left=extra)
        self.plans = {}
        for r in live:
            r.row.shift(extra)
            r.row.blocks = self._blocks(r.sampling.gen_length)
        self._note_padding(live)
        if self.cache is not None:
            self.cache = self.cache.pad(left=extra)

    def _lengthen(self, answer: int) -> None:
        """A longer answer arrived: answer columns added after every row (canvas, cache)."""
        extra = answer - self.answer_width
        self.canvas = pad_canvas(self.canvas, self.special.pad, right=extra)
        if self.cache is not None:
            self.cache = self.cache.pad(right=extra)  # old scratch: past every live row's end

    def cache_view(self, live: list[Request]) -> KVCache | None:
        """The cache as this step's canvas rows see it: canvas row r (branch b) is cache row
        `slot_rows[r] + b * slots`; the cache itself when every slot is busy (the identity)."""
        if self.cache is None:
            return None
        n = self.cache.k[0].shape[0] // self.branches
        if len(live) == n:
            return self.cache
        hosts = tuple(r.slot + b * n for b in range(self.branches) for r in live)
        rows = torch.cat([self.slot_rows + b * n for b in range(self.branches)])
        return self.cache.view(rows, hosts=hosts)

    def _note_padding(self, live: list[Request]) -> None:
        """The canvas learns from the host whether any row is padded (no device read)."""
        width = self.canvas.prompt_width
        self.canvas.any_pad = any(len(r.prompt) < width for r in live)

    # --- sampling and stops --------------------------------------------------------------------
    def draws(self, live: list[Request], spans: list[tuple[int, int]]) -> RowDraws:
        """The live rows' sampling this step: own generators and values, spans, who draws."""
        return RowDraws(
            tuple(r.generator for r in live),
            tuple(r.sampling for r in live),
            tuple(e - a for a, e in spans),
            tuple(not r.idle for r in live),
        )

    def done(self, live: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """(B,) rows whose answer is final, and (B,) where each answer ends, on the device."""
        c = self.canvas
        answer = c.answer()  # (B, G)
        done = ~(answer == c.mask_id).any(dim=1)
        cut = torch.full_like(c.request_ids, answer.shape[1])
        own = self.own_stops(live)
        if self.settings.early_stop or self.frontier:  # guided: a stop token ends the row
            cut = first_stop(answer, self.stop_ids if own is None else own, c.mask_id)
            done = done | (cut < answer.shape[1])
        elif own is not None:  # a request's own stop ids cut its answer (EOS after them)
            cut = first_stop(answer, own, c.mask_id)
        return done, cut

    def own_stops(self, live: list[Request]) -> torch.Tensor | None:
        """(B, K) each live row's stop ids (the model's and its own, -1 padded); None: none has."""
        if not any(r.sampling.stop for r in live):
            return None
        rows = [(*self.special.stop, *r.sampling.stop) for r in live]
        k = max(len(row) for row in rows)
        return torch.tensor([[*row, *[-1] * (k - len(row))] for row in rows], device=self.device)
