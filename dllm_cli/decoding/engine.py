"""The decoding loop: per-row places -> at most two forwards -> drafts -> commit -> retire.

Each step: every row's cache policy plans the columns it recomputes (rows.py keeps each row's
block, step and frozen K/V), forwards.py serves all rows with at most two forwards, the
sampler drafts tokens, a committer picks which drafts become tokens, rows move on and finished
rows leave the batch. The loop prints nothing; it yields StepEvents.

Rows decoded by an unmasking rule walk their blocks in lockstep by default (the whole batch
leaves a block together, as LLaDA and Fast-dLLM do); `run(prompts, lockstep=False)` lets each
row move on by itself. A verifying committer with `frontier = True` (guided decoding) makes
every row walk its own first mask.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch

from dllm_cli.cache import KVCache
from dllm_cli.decoding.answer import first_stop
from dllm_cli.decoding.canvas import Canvas, check_prompts, check_token_ids, plan_blocks
from dllm_cli.decoding.events import DecodeResult, RowCommit, RowPhase, StepEvent, row_commits
from dllm_cli.decoding.forwards import Forwards, Prediction
from dllm_cli.decoding.policies import POLICIES, Forward, StepPlace
from dllm_cli.decoding.rows import BlockWalk, FrontierWalk, RowState, first_masks, same_place
from dllm_cli.decoding.sampling import Sampler, family_of
from dllm_cli.decoding.unmask import Committer, Decision, RuleCommitter, StepContext
from dllm_cli.families import with_family_defaults
from dllm_cli.models.base import DiffusionLM
from dllm_cli.models.loading import SpecialIds
from dllm_cli.settings import DecodeSettings


class Decoder:
    """A model, its special ids and (already validated) settings; `run(prompts)` decodes."""

    def __init__(
        self,
        model: DiffusionLM,
        special: SpecialIds,
        settings: DecodeSettings,
        committer: Committer | None = None,
    ):
        # Unset values take the family's reference defaults (Dream: top_k 50; families.py).
        settings = with_family_defaults(settings, getattr(model.config, "model_type", None))
        self.settings, self.model, self.special = settings, model, special
        family = family_of(model)
        vocab = special.real_vocab(model.vocab_size)
        self.sampler = Sampler(settings, family, vocab, special.mask)
        self.committer = committer or RuleCommitter(settings, family.schedule)
        self.frontier = bool(getattr(self.committer, "frontier", False))
        self.draft_window = getattr(self.committer, "draft_window", None)
        self.policy = POLICIES[settings.cache]()
        probs = bool(getattr(self.committer, "needs_probs", False))  # KLASS compares them
        self.forwards = Forwards(model, self.sampler, settings.cfg_scale, self.frontier, probs)

    def run(self, prompts: list[list[int]], lockstep: bool = True) -> DecodeRun:
        return DecodeRun(self, prompts, lockstep)


class DecodeRun:
    """One decode in progress: iterate it for StepEvents; `result()` once (or to finish) it."""

    def __init__(self, decoder: Decoder, prompts: list[list[int]], lockstep: bool = True):
        began = time.perf_counter()
        self.d, s, model = decoder, decoder.settings, decoder.model
        prompts = [list(map(int, p)) for p in prompts]
        check_prompts(prompts, s.gen_length, model.context_length)
        check_token_ids(prompts, model.get_input_embeddings().num_embeddings)
        self.prompt_lengths = [len(p) for p in prompts]
        self.device = next(model.parameters()).device
        special = decoder.special
        with torch.inference_mode():
            self.canvas = Canvas.build(
                prompts, s.gen_length, special.mask, special.pad, self.device
            )
        width = self.canvas.prompt_width
        self.blocks = plan_blocks(width, s.gen_length, s.block_length, s.total_steps)
        self.walk = FrontierWalk() if decoder.frontier else BlockWalk(lockstep)
        self.rows = [RowState(0) for _ in prompts]
        self.generator = torch.Generator(device=self.device).manual_seed(s.seed)
        self.branches = 2 if s.cfg_scale > 0 else 1  # classifier-free guidance doubles the batch
        batch = len(prompts)
        # Rows apart need per-row columns, whose padding writes go to a scratch column.
        scratch = batch > 1 and not (isinstance(self.walk, BlockWalk) and lockstep)
        self.cache = None
        if decoder.policy.uses_cache:
            self.cache = KVCache.for_model(model, batch * self.branches, self.canvas.width, scratch)
        self.stop_ids = torch.tensor(special.stop, device=self.device)
        self.tokens = torch.full((batch, s.gen_length), special.eos, device=self.device)
        self.commit_steps = torch.full_like(self.tokens, -1)
        self.finished_at = [-1] * batch
        self.forwards = self.steps = self.guide_forwards = self.served = 0
        self.guide_seconds = 0.0
        start = getattr(decoder.committer, "start", None)
        if start is not None:
            start(batch)  # the committer learns that a decode begins (fresh guide state)
        self.seconds = time.perf_counter() - began  # decoding time: setup and steps, no waits
        self._events = self._loop()

    def __iter__(self) -> Iterator[StepEvent]:
        return self._events

    def result(self) -> DecodeResult:
        """The finished decode (runs any remaining steps first)."""
        for _ in self._events:
            pass
        return DecodeResult(
            tokens=self.tokens.tolist(),
            commit_steps=self.commit_steps.tolist(),
            prompt_lengths=self.prompt_lengths,
            forwards=self.forwards,
            steps=self.steps,
            seconds=self.seconds,
            finished_at=self.finished_at,
            guide_forwards=self.guide_forwards,
            guide_seconds=self.guide_seconds,
            rows_served=self.served,
        )

    # --- the loop ---------------------------------------------------------------------
    def _loop(self) -> Iterator[StepEvent]:
        """Steps until every row has left the batch."""
        while self.canvas.batch > 0:
            began = time.perf_counter()
            event = self._step()
            self.seconds += time.perf_counter() - began
            yield event

    @torch.inference_mode()
    def _step(self) -> StepEvent:
        """At most two forwards, one commit decision, rows move on, finished rows retire."""
        c, s, model = self.canvas, self.d.settings, self.d.model
        self.walk.begin(self.rows, c, self.blocks)
        self.served += c.batch  # every live row is served by exactly one forward
        shift, every, suffix = model.logit_shift, s.refresh_interval, s.suffix_window
        firsts = first_masks(c).tolist() if self.d.frontier else [None] * c.batch
        places = [
            r.place(self.blocks, c.width, shift, every, self._reach(f), suffix)
            for r, f in zip(self.rows, firsts, strict=True)
        ]
        plans = [self.d.policy.plan(p) for p in places]
        spans = self._spans(places, plans, firsts)
        pred = self.d.forwards(c, self.cache, plans, spans, self.generator)
        self.forwards += pred.forwards
        candidates = pred.valid & (c.ids.gather(1, pred.columns) == c.mask_id)
        confidence = pred.confidence.masked_fill(~candidates, float("-inf"))
        ctx = self._context(pred, confidence, candidates)
        decision = self.d.committer(ctx)
        self.guide_forwards += decision.forwards
        self.guide_seconds += decision.seconds
        commit = self._guard(decision, ctx, places)
        tokens = pred.drafts if decision.tokens is None else decision.tokens
        commits = self._apply(commit, tokens, confidence, pred.columns, decision.corrected)
        phases = self._phases(places, plans)
        for row, plan in zip(self.rows, plans, strict=True):
            row.served(plan)
        finished = self._retire()  # before moving on: lockstep waits only for live rows
        self.walk.advance(self.rows, self.canvas, self.blocks)
        self.steps += 1
        first, p = phases[0], c.prompt_width
        corrected = None if decision.corrected is None else int((decision.corrected & commit).sum())
        return StepEvent(
            step=self.steps - 1,
            block=first.block,
            block_step=first.block_step,
            window=first.window,
            refresh=first.refresh,
            frozen=None if plans[0].frozen is None else tuple(f - p for f in plans[0].frozen),
            forwards=self.forwards,
            commits=commits,
            finished=finished,
            accepted=decision.accepted,
            guide_forwards=self.guide_forwards,
            corrected=corrected,
            phases=phases,
        )

    def _reach(self, first: int | None) -> int | None:
        """A guided row with a draft window needs predictions only up to the window's end."""
        window = self.d.draft_window
        return None if first is None or not window else first + window

    def _spans(self, places, plans, firsts) -> list[tuple[int, int]]:
        """Columns each row decodes: its block, or (guided) its first mask to its draft end."""
        if not self.d.frontier:
            return [(p.block.start, p.block.end) for p in places]
        window = self.d.draft_window or self.canvas.width
        # Drafts reach as far as this step's forward computes fresh logits (Dual cache: the
        # block on cached steps) and the draft window allows.
        return [(f, min(f + window, plan.end)) for f, plan in zip(firsts, plans, strict=True)]

    def _context(self, pred: Prediction, confidence, candidates) -> StepContext:
        device = self.device
        masks = torch.tensor([r.masks_at_start for r in self.rows], device=device)
        if same_place(self.rows):  # one shared block and step (rows in lockstep)
            block, step, planned = self.blocks[self.rows[0].block], self.rows[0].step, None
        else:
            block = None
            step = torch.tensor([r.step for r in self.rows], device=device)
            planned = torch.tensor([self.blocks[r.block].steps for r in self.rows], device=device)
        return StepContext(
            pred.drafts, confidence, candidates, block, step, masks, self.canvas,
            self.generator, pred.columns, planned, pred.probs,
        )  # fmt: skip

    def _guard(self, decision: Decision, ctx: StepContext, places) -> torch.Tensor:
        """Only masked columns of the row's span; progress guaranteed in either walk."""
        commit = decision.commit.to(torch.bool) & ctx.candidates
        if self.d.frontier:
            # A frontier walk commits a run from the first mask, at least that first column.
            commit[:, 0] |= ctx.candidates[:, 0]
            return commit.long().cumprod(dim=1).bool()
        # Everything left once a block has had L steps (no-op for built-in rules).
        late = [p.step >= p.block.length - 1 for p in places]
        force = torch.tensor(late, device=commit.device)[:, None]
        return torch.where(force, ctx.candidates, commit)

    def _apply(self, commit, tokens, confidence, columns, corrected) -> tuple[RowCommit, ...]:
        """Write committed tokens into the canvas and record them for the event."""
        c, p = self.canvas, self.canvas.prompt_width
        rows, slots = commit.nonzero(as_tuple=True)
        cols, toks = columns[rows, slots], tokens[rows, slots]
        c.ids[rows, cols] = toks
        c.steps[rows, cols - p] = self.steps
        flags = None if corrected is None else corrected[rows, slots]
        every = (rows, cols - p, toks, confidence[rows, slots])
        return row_commits(*every, flags, c.rows.tolist())

    def _phases(self, places: list[StepPlace], plans: list[Forward]) -> tuple[RowPhase, ...]:
        p, rows = self.canvas.prompt_width, self.canvas.rows.tolist()
        return tuple(
            RowPhase(row, at.block.index, at.step, (f.start - p, f.end - p), f.refresh)
            for row, at, f in zip(rows, places, plans, strict=True)
        )

    def _retire(self) -> tuple[int, ...]:
        """Rows whose answer is final leave the batch (and stop costing compute)."""
        c = self.canvas
        answer = c.answer()  # (B, G)
        done = ~(answer == c.mask_id).any(dim=1)
        cut = torch.full_like(c.rows, answer.shape[1])
        if self.d.settings.early_stop or self.d.frontier:  # guided: a stop token ends the row
            cut = first_stop(answer, self.stop_ids, c.mask_id)
            done |= cut < answer.shape[1]
        if not bool(done.any()):
            return ()
        gone = done.nonzero().squeeze(1)
        self._store(gone, cut[gone])
        keep = (~done).nonzero().squeeze(1)
        if self.cache is not None:
            offset = c.batch
            branch_rows = torch.cat([keep + offset * b for b in range(self.branches)])
            self.cache = self.cache.select_rows(branch_rows)
        self.rows = [self.rows[i] for i in keep.tolist()]
        select = getattr(self.d.committer, "select", None)
        if select is not None:
            select(keep)
        self.canvas = c.select(keep)
        return tuple(c.rows[gone].tolist())

    def _store(self, gone: torch.Tensor, cut: torch.Tensor) -> None:
        """Final tokens of finished rows; after an early stop everything past it is EOS."""
        c = self.canvas
        answer, steps = c.answer()[gone], c.steps[gone]  # (R, G)
        past = torch.arange(answer.shape[1], device=answer.device)[None] > cut[:, None]
        rows = c.rows[gone]
        self.tokens[rows] = answer.masked_fill(past, self.d.special.eos)
        self.commit_steps[rows] = steps.masked_fill(past, -1)
        for r in rows.tolist():
            self.finished_at[r] = self.steps


def decode_steps(
    model: DiffusionLM,
    special: SpecialIds,
    prompts: list[list[int]],
    settings: DecodeSettings,
    *,
    committer: Committer | None = None,
) -> DecodeRun:
    """Start a decode; iterate the returned run for StepEvents, then call `.result()`."""
    if getattr(model, "family", None) == "diffusion_gemma":  # transformers' own sampler
        from dllm_cli.decoding.gemma import start_run

        return start_run(model, special, prompts, settings, committer)
    return Decoder(model, special, settings, committer).run(prompts)


def decode(
    model: DiffusionLM,
    special: SpecialIds,
    prompts: list[list[int]],
    settings: DecodeSettings,
    *,
    committer: Committer | None = None,
    on_step: Callable[[StepEvent], None] | None = None,
) -> DecodeResult:
    """Decode a batch of prompts to the end; `on_step` sees every StepEvent on the way."""
    run = decode_steps(model, special, prompts, settings, committer=committer)
    for event in run:
        if on_step is not None:
            on_step(event)
    return run.result()
