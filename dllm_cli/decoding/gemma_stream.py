"""What dllm plugs into DiffusionGemma's denoising loop (gemma_loop.py), and what it gets back.

- `RowSampler`: transformers' `EntropyBoundSampler` whose random draws come from one generator
  per row, so a prompt's output does not depend on the rest of its batch.
- `StopObserver`: transformers' `StableAndConfidentStoppingCriteria`, passed through unchanged,
  keeping each step's verdict and each token's confidence for the events.
- `EventStreamer`: transformers' streamer protocol (`put` per finished canvas, `put_draft` per
  denoising step) turned into StepEvents: a token the denoiser replaces is a draft, a finished
  canvas is a commit; it also keeps each row's committed answer so far (`answers`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSampler

from dllm_cli.decoding.answer import answer_length
from dllm_cli.decoding.events import RowCommit, StepEvent


class RowSampler(EntropyBoundSampler):
    """transformers' entropy-bound sampler; row r draws its noise and samples from generators[r]
    (the reference's global generator makes a row's draws depend on the rows before it), and a
    row the stopping rule froze draws nothing, so its later canvases see a run alone's numbers."""

    def __init__(self, config, canvas_length, vocab_size, max_denoising_steps, generators, frozen):
        super().__init__(config, canvas_length, vocab_size, max_denoising_steps)
        self.generators = generators
        self.frozen = frozen  # () -> (B,) bool: rows the stopping rule froze, or None
        self.renoising = False

    def _skip(self) -> list[bool]:
        frozen = self.frozen()
        return [False] * len(self.generators) if frozen is None else frozen.tolist()

    def initialize_canvas(self, batch_size: int, device: torch.device) -> torch.Tensor:
        """Uniform random tokens, (B, L), one row per generator (zeros for frozen rows, whose
        renoised canvas generate discards)."""
        skip = self._skip() if self.renoising else [False] * len(self.generators)
        shape = (1, self.canvas_length)
        rows = [
            torch.zeros(shape, dtype=torch.long, device=device)
            if s
            else torch.randint(0, self.vocab_size, shape, generator=g, device=device)
            for g, s in zip(self.generators, skip, strict=True)
        ]
        return torch.cat(rows)

    def renoise_canvas(self, accepted_canvas, cur_step):
        self.renoising = True
        try:
            return super().renoise_canvas(accepted_canvas, cur_step)
        finally:
            self.renoising = False

    def accept_canvas(self, current_canvas, denoiser_canvas, logits, cur_step):
        """Redraw the denoiser's sample per row from the same distribution, then accept as the
        reference does (its own sample came from the global generator and is not used)."""
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (B, L, V), as generate has it
        draws = [
            current_canvas[r : r + 1] if s else torch.multinomial(probs[r], 1, generator=g).T
            for r, (g, s) in enumerate(zip(self.generators, self._skip(), strict=True))
        ]
        return super().accept_canvas(current_canvas, torch.cat(draws), logits, cur_step)


class StopObserver:
    """The stopping rule, unchanged; keeps its per-row verdict and per-token confidences."""

    def __init__(self, rule):
        self.rule = rule
        self.finished: torch.Tensor | None = None  # (B,) rows stopped so far in this canvas
        self.stopped: torch.Tensor | None = None  # (B,) the rule's verdict this step (CPU)
        self.confidence: torch.Tensor | None = None  # (B, L) probability of the argmax token

    def __call__(self, argmax_canvas, logits, **kwargs):
        stop = self.rule(argmax_canvas, logits, **kwargs)
        self.finished = stop.clone() if self.finished is None else self.finished | stop
        logits = logits.float()
        top = logits.max(dim=-1).values - torch.logsumexp(logits, dim=-1)  # (B, L) log p(argmax)
        self.stopped, self.confidence = stop.cpu(), top.exp().cpu()
        return stop

    def reset(self) -> None:
        """A new canvas: generate resets the rule, and every row denoises again."""
        self.rule.reset()
        self.finished = None


@dataclasses.dataclass
class CanvasPlan:
    """Where each canvas sits in the answer, and what ends a row."""

    canvas: int  # canvas length L
    lengths: tuple[int, ...]  # per row its answer positions G (its last canvas may reach past G)
    stops: tuple[frozenset[int], ...]  # per row the tokens that end it; empty: early stop off

    @property
    def gen_length(self) -> int:
        """The longest row's G: the batch denoises ceil(G / L) canvases."""
        return max(self.lengths)

    def last(self, row: int, canvas: int) -> bool:
        """Canvas `canvas` (0-based) is row's last: ceil(G_row / L) canvases hold its answer."""
        return (canvas + 1) * self.canvas >= self.lengths[row]


class EventStreamer:
    """transformers' streamer protocol -> StepEvents (one per denoising step), handed to `send`;
    a step's event waits for a `put` (the canvas is final: its commits) or a `flush`."""

    def __init__(self, plan: CanvasPlan, rows: int, observer: Callable[[], StopObserver | None],
                 send: Callable[[StepEvent], None]):  # fmt: skip
        self.plan, self.rows, self.observer, self.send = plan, rows, observer, send
        self.done: set[int] = set()  # rows whose answer is final
        self.canvas_step: list[int] = []  # per finished canvas: its last step
        self.puts = self.steps = self.block_step = 0
        self.previous: torch.Tensor | None = None  # (B, L) last draft of this canvas
        self.settled = torch.zeros(rows, dtype=torch.bool)
        self.pending: StepEvent | None = None
        self.answers: list[list[int]] = [[] for _ in range(rows)]  # committed, cut at a stop

    # --- the streamer protocol ----------------------------------------------------------
    def put_draft(self, value: torch.Tensor, **_) -> None:
        """One denoising step: its argmax canvas (B, L)."""
        self.flush()
        self.pending = self._step_event(value.reshape(self.rows, -1))
        self.previous = value.reshape(self.rows, -1).clone()
        self.steps += 1
        self.block_step += 1

    def put(self, value: torch.Tensor) -> None:
        """First call: the prompt (ignored). Then one finished canvas (B, L), pads filled in."""
        self.puts += 1
        if self.puts == 1:
            return
        event, self.pending = self.pending, None
        commits, finished = self._finish_canvas(value.reshape(self.rows, -1))
        self.canvas_step.append(event.step)
        self.send(dataclasses.replace(event, commits=commits, finished=finished))
        self.previous, self.block_step = None, 0
        self.settled = torch.zeros(self.rows, dtype=torch.bool)

    def end(self) -> None:
        self.flush()  # nothing is pending here: a canvas always ends in put

    def flush(self) -> None:
        """Send the held-back step event, if any (the canvas goes on: no commits in it)."""
        if self.pending is not None:
            event, self.pending = self.pending, None
            self.send(event)

    # --- building events ----------------------------------------------------------------

    def _span(self) -> tuple[int, int]:
        """Answer positions of the current canvas, [start, end) within gen_length."""
        c = len(self.canvas_step)
        start = c * self.plan.canvas
        return start, min(start + self.plan.canvas, self.plan.gen_length)

    def _step_event(self, draft: torch.Tensor) -> StepEvent:
        observed = self.observer()
        confidence = observed.confidence if observed else None
        fresh = self.previous is None  # (B, L) changed: against the random start, everything
        changed = torch.ones_like(draft, dtype=torch.bool) if fresh else draft != self.previous
        start, end = self._span()
        drafts = []
        for r in range(self.rows):
            width = min(end, self.plan.lengths[r]) - start  # the row's columns of this canvas
            cols = [] if r in self.done else changed[r, :width].nonzero().flatten().tolist()
            if cols:
                conf = confidence[r, cols].tolist() if confidence is not None else [1.0] * len(cols)
                drafts.append(RowCommit(r, tuple(start + j for j in cols),
                                        tuple(draft[r, cols].tolist()), tuple(conf)))  # fmt: skip
        settled = ()
        if observed is not None and observed.stopped is not None:
            new = observed.stopped & ~self.settled
            self.settled |= observed.stopped
            settled = tuple(r for r in new.nonzero().flatten().tolist() if r not in self.done)
        c = len(self.canvas_step)
        first = self.block_step == 0
        return StepEvent(
            step=self.steps,
            block=c,
            block_step=self.block_step,
            window=(start, end),
            refresh=first,  # the encoder ran for this canvas (prompt, or the previous canvas)
            frozen=(start - self.plan.canvas, start) if first and c > 0 else None,
            forwards=self.steps + 1,
            commits=(),
            drafts=tuple(drafts),
            settled=settled,
        )

    def _finish_canvas(self, canvas: torch.Tensor):
        """The final tokens of live rows (up to and including a stop token), and who finished."""
        start, end = self._span()
        c = len(self.canvas_step)
        observed = self.observer()
        conf = observed.confidence if observed else None
        commits, finished = [], []
        for r in range(self.rows):
            if r in self.done:
                continue
            last = self.plan.last(r, c)
            tokens = canvas[r, : min(end, self.plan.lengths[r]) - start].tolist()
            stop = self.plan.stops[r]
            cut = answer_length(tokens, stop)  # through its first stop token
            scores = conf[r, :cut].tolist() if conf is not None else [1.0] * cut
            commits.append(RowCommit(r, tuple(range(start, start + cut)), tuple(tokens[:cut]),
                                     tuple(scores)))  # fmt: skip
            self.answers[r] += tokens[:cut]
            if last or (cut > 0 and tokens[cut - 1] in stop):
                finished.append(r)
                self.done.add(r)
        return tuple(commits), tuple(finished)
