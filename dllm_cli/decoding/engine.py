"""The decoding loop: blocks -> steps -> one forward on the active window -> commit.

Each step: the cache policy picks the columns to recompute, the model predicts the current
block, the sampler drafts tokens with confidences, a committer picks which drafts become
tokens, finished rows leave the batch. The loop prints nothing; it yields StepEvents.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch

from dllm_cli.cache import KVCache
from dllm_cli.decoding.canvas import Block, Canvas, check_prompts, plan_blocks
from dllm_cli.decoding.events import DecodeResult, RowCommit, StepEvent
from dllm_cli.decoding.policies import POLICIES, Forward, StepPlace
from dllm_cli.decoding.sampling import Sampler, family_of
from dllm_cli.decoding.unmask import Committer, Decision, RuleCommitter, StepContext
from dllm_cli.errors import InputError
from dllm_cli.models.loading import LoadedModel
from dllm_cli.settings import DecodeSettings


class Decoder:
    """A loaded model with validated settings; `run(prompts)` starts one decode."""

    def __init__(
        self,
        loaded: LoadedModel,
        settings: DecodeSettings,
        committer: Committer | None = None,
    ):
        self.model = loaded.model
        # Unset values take the family's reference defaults (Dream: top_k 50).
        settings = settings.with_family_defaults(self.model.config.model_type)
        self.settings = settings.validate()
        self.special = loaded.special
        family = family_of(self.model)
        self.sampler = Sampler(settings, family, self.model.vocab_size, self.special.mask)
        self.committer = committer or RuleCommitter(settings, family.schedule)
        self.policy = POLICIES[settings.cache]()

    def run(self, prompts: list[list[int]]) -> DecodeRun:
        return DecodeRun(self, prompts)


class DecodeRun:
    """One decode in progress: iterate it for StepEvents; `result()` once (or to finish) it."""

    def __init__(self, decoder: Decoder, prompts: list[list[int]]):
        began = time.perf_counter()
        self.d, s, model = decoder, decoder.settings, decoder.model
        prompts = [list(map(int, p)) for p in prompts]
        check_prompts(prompts, s.gen_length, model.context_length)
        check_token_ids(prompts, model.get_input_embeddings().num_embeddings)
        self.prompt_lengths = [len(p) for p in prompts]
        self.gen_length = s.gen_length
        self.device = next(model.parameters()).device
        with torch.inference_mode():
            self.canvas = Canvas.build(
                prompts, s.gen_length, decoder.special.mask, decoder.special.pad, self.device
            )
        width = self.canvas.prompt_width
        self.blocks = plan_blocks(width, s.gen_length, s.block_length, s.total_steps)
        self.generator = torch.Generator(device=self.device).manual_seed(s.seed)
        self.branches = 2 if s.cfg_scale > 0 else 1  # classifier-free guidance doubles the batch
        self.cache = (
            KVCache.for_model(model, self.canvas.batch * self.branches, self.canvas.width)
            if decoder.policy.uses_cache
            else None
        )
        self.stop_ids = torch.tensor(decoder.special.stop, device=self.device)
        batch = len(prompts)
        self.tokens = torch.full((batch, s.gen_length), decoder.special.eos, device=self.device)
        self.commit_steps = torch.full_like(self.tokens, -1)
        self.finished_at = [-1] * batch
        self.forwards = self.steps = 0
        self.seconds = time.perf_counter() - began  # decoding time: setup and steps, no waits
        self.masks_at_start = torch.zeros(batch, dtype=torch.long, device=self.device)
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
        )

    # --- the loop ---------------------------------------------------------------------
    def _loop(self) -> Iterator[StepEvent]:
        """Blocks left to right; steps until the block has no masks in any live row."""
        for previous, block in zip([None, *self.blocks[:-1]], self.blocks, strict=True):
            step = 0
            while self._block_open(block, step):
                began = time.perf_counter()
                event = self._step(block, previous, step)
                self.seconds += time.perf_counter() - began
                yield event
                step += 1

    @torch.inference_mode()
    def _block_open(self, block: Block, step: int) -> bool:
        if self.canvas.batch == 0:
            return False
        if step == 0:
            self.masks_at_start = self.canvas.masked(block).sum(dim=1)
        return bool(self.canvas.masked(block).any())

    @torch.inference_mode()
    def _step(self, block: Block, previous: Block | None, step: int) -> StepEvent:
        """One forward, one commit decision, then retire finished rows."""
        c, s = self.canvas, self.d.settings
        place = StepPlace(
            block, previous, step, c.width, self.d.model.logit_shift, s.refresh_interval
        )
        plan = self.d.policy.plan(place)
        logits = self._predict(plan, block)  # (B, L, V)
        drafts, confidence = self.d.sampler(logits, self.generator)  # (B, L) each
        candidates = c.masked(block)
        confidence = confidence.masked_fill(~candidates, float("-inf"))
        ctx = StepContext(
            drafts, confidence, candidates, block, step, self.masks_at_start, c, self.generator
        )
        decision = self.d.committer(ctx)
        commit = self._guard(decision, ctx)
        commits = self._apply(commit, drafts, confidence, block)
        finished = self._retire()
        self.steps += 1
        p = c.prompt_width
        return StepEvent(
            step=self.steps - 1,
            block=block.index,
            block_step=step,
            window=(plan.start - p, plan.end - p),
            refresh=plan.refresh,
            frozen=None if plan.frozen is None else (plan.frozen[0] - p, plan.frozen[1] - p),
            forwards=self.forwards,
            commits=commits,
            finished=finished,
            accepted=decision.accepted,
        )

    def _predict(self, plan: Forward, block: Block) -> torch.Tensor:
        """Logits (B, L, V) predicting the block's columns, whatever the logit shift."""
        c, model, cfg = self.canvas, self.d.model, self.d.settings.cfg_scale
        cols = slice(plan.start, plan.end)
        ids, pos = c.ids[:, cols], c.positions()[:, cols]  # (B, T)
        keys = c.key_mask()  # (B, S) or None
        if self.cache is None and keys is not None:
            keys = keys[:, cols]
        if self.branches == 2:
            # Classifier-free guidance (LLaDA): a second branch with the prompt masked out.
            uncond = ids.masked_fill(c.prompt_mask()[:, cols], c.mask_id)
            ids, pos = torch.cat([ids, uncond]), torch.cat([pos, pos])
            keys = None if keys is None else torch.cat([keys, keys])
        shift = model.logit_shift  # Dream: output at column i predicts column i + 1
        wanted = slice(block.start - shift - plan.start, block.end - shift - plan.start)
        logits = model(ids, pos, self.cache, keys, columns=cols, logits_slice=wanted)
        self.forwards += 1
        if self.branches == 2:
            cond, un = logits.chunk(2)
            logits = un + (cfg + 1) * (cond - un)
        return logits

    def _guard(self, decision: Decision, ctx: StepContext) -> torch.Tensor:
        """Only masked in-block columns; everything left once a block has had L steps."""
        commit = decision.commit.to(torch.bool) & ctx.candidates
        if ctx.block_step >= ctx.block.length - 1:
            commit = ctx.candidates  # no-op for built-in rules; stops any committer looping
        return commit

    def _apply(self, commit, drafts, confidence, block: Block) -> tuple[RowCommit, ...]:
        """Write committed drafts into the canvas and record them for the event."""
        c = self.canvas
        span = slice(block.start, block.end)
        c.ids[:, span] = torch.where(commit, drafts, c.ids[:, span])
        answer_span = slice(block.start - c.prompt_width, block.end - c.prompt_width)
        c.steps[:, answer_span] = c.steps[:, answer_span].masked_fill(commit, self.steps)
        where = commit.nonzero().tolist()
        tokens, confs = drafts[commit].tolist(), confidence[commit].tolist()
        rows = c.rows.tolist()
        grouped: dict[int, list] = {}
        for (r, j), tok, conf in zip(where, tokens, confs, strict=True):
            grouped.setdefault(r, []).append((block.start - c.prompt_width + j, tok, conf))
        return tuple(
            RowCommit(rows[r], *(tuple(col) for col in zip(*items, strict=True)))
            for r, items in grouped.items()
        )

    def _retire(self) -> tuple[int, ...]:
        """Rows whose answer is final leave the batch (and stop costing compute)."""
        c = self.canvas
        answer = c.answer()  # (B, G)
        done = ~(answer == c.mask_id).any(dim=1)
        cut = torch.full_like(c.rows, answer.shape[1])
        if self.d.settings.early_stop:
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
        self.masks_at_start = self.masks_at_start[keep]
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


def first_stop(answer: torch.Tensor, stop_ids: torch.Tensor, mask_id: int) -> torch.Tensor:
    """(B,) position of each row's first stop token if everything before it is committed, else G.

    Such a row's text is final: no later step can change a token before the stop.
    """
    g = answer.shape[1]
    span = torch.arange(g, device=answer.device)[None]
    stop_at = torch.where(torch.isin(answer, stop_ids), span, g).min(dim=1).values
    mask_at = torch.where(answer == mask_id, span, g).min(dim=1).values
    return torch.where(mask_at > stop_at, stop_at, torch.full_like(stop_at, g))


def check_token_ids(prompts: list[list[int]], table: int) -> None:
    """Prompt ids must index the embedding table."""
    for i, p in enumerate(prompts):
        bad = [t for t in p if not 0 <= t < table]
        if bad:
            raise InputError(
                f"prompt {i} has token id {bad[0]} outside the vocabulary (0..{table - 1})"
            )


def decode_steps(
    loaded: LoadedModel,
    prompts: list[list[int]],
    settings: DecodeSettings,
    *,
    committer: Committer | None = None,
) -> DecodeRun:
    """Start a decode; iterate the returned run for StepEvents, then call `.result()`."""
    return Decoder(loaded, settings, committer).run(prompts)


def decode(
    loaded: LoadedModel,
    prompts: list[list[int]],
    settings: DecodeSettings,
    *,
    on_step: Callable[[StepEvent], None] | None = None,
    committer: Committer | None = None,
) -> DecodeResult:
    """Decode a batch of prompts to the end; `on_step` sees every StepEvent on the way."""
    run = decode_steps(loaded, prompts, settings, committer=committer)
    for event in run:
        if on_step is not None:
            on_step(event)
    return run.result()
