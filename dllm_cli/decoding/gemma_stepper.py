"""The DiffusionGemma stepper: transformers' own denoising loop, one step per engine step.

transformers' sampler decodes a whole batch with one generation config, so this stepper takes
static batches only (`whole_batches`) and shares that config over the batch (`batch_wide`), but
each row has its own seed (one generator a row), stop ids and length: the batch denoises the
longest row's canvases, and a row's answer is final on the step its own last canvas is (cut at
its length), not when the batch ends. Placing a batch starts its decode (gemma_loop.denoise
with gemma_stream's sampler, observer and streamer).
Rows that leave stay in transformers' batch; when none is left the decode is closed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType

import torch

from dllm_cli.decoding import gemma, gemma_loop, logprobs
from dllm_cli.decoding import gemma_stream as gs
from dllm_cli.decoding.events import StepEvent
from dllm_cli.decoding.gemma_grammar import CanvasGrammar
from dllm_cli.decoding.request import Request
from dllm_cli.decoding.slots import Admission
from dllm_cli.decoding.stepper import Commit
from dllm_cli.errors import SettingsError
from dllm_cli.family_settings import TRAITS
from dllm_cli.settings import DecodeSettings

_ONE_CONFIG = "one generation config decodes its whole static batch"


class GemmaStepper:
    """One static batch at a time through transformers' denoising loop."""

    whole_batches = True
    batch_wide: Mapping[str, str] = MappingProxyType(
        dict.fromkeys(TRAITS["gemma"].batch_wide, _ONE_CONFIG)
    )
    who = "DiffusionGemma"
    canvas = None

    def __init__(
        self,
        model,
        special,
        settings: DecodeSettings,
        committer,
        admission: Admission,
        slots: int,
        *,
        lockstep: bool | None = None,  # (no choice here: transformers' loop moves the batch)
    ):
        if committer is not None and not isinstance(committer, CanvasGrammar):
            raise SettingsError(f"a guide model does not apply to {self.who}: it samples itself")
        self.committer = committer  # structured output: each canvas chosen under its grammar
        self.model, self.special = model, special
        self.settings = gemma.check_settings(settings.validate(), model.canvas_length)
        self.vocabulary = model.config.text_config.vocab_size
        self.device = next(model.parameters()).device
        self.steps_left = None  # the running decode (a suspended gemma_loop.denoise)
        self.streamer: gs.EventStreamer | None = None
        self.outbox: list[StepEvent] = []
        self.batch_rows: list[int] = []  # live row -> its row in transformers' batch
        self.requests: list[Request] = []  # live row -> its request (for its logprobs)
        self.lengths: list[int] = []  # batch row -> its answer length
        self.first = 0  # the engine step the batch began

    # --- the Stepper protocol ----------------------------------------------------------------
    def room(self, gen_length: int) -> int:
        """Context positions an answer of gen_length takes: whole canvases."""
        return gemma.denoised_length(gen_length, self.model.canvas_length)

    def place(self, live: list[Request], new: list[Request], order: list[int], at: int) -> int:
        """The batch's decode starts: left-padded prompts, one generator per row, as many
        canvases as the longest answer takes."""
        self._close()
        self.lengths = [r.sampling.gen_length for r in new]
        s = replace(self.settings, gen_length=max(self.lengths))
        special, canvas = self.special, self.model.canvas_length
        prompts = [r.prompt for r in new]
        width = max(map(len, prompts))
        ids = torch.tensor([[special.pad] * (width - len(p)) + p for p in prompts])
        ids = ids.to(self.device)  # (B, W) left-padded
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        mask = torch.arange(width, device=self.device)[None] >= (width - lengths)[:, None]
        config = gemma.resolve_config(
            self.model, gemma.generation_kwargs(special.stop, special.pad, s)
        )
        generators = [torch.Generator(device=self.device).manual_seed(r.sampling.seed) for r in new]
        ends = [frozenset((*special.stop, *r.sampling.stop)) for r in new]  # a request's own too
        stops = tuple(e if s.early_stop else frozenset() for e in ends)
        plan = gs.CanvasPlan(canvas, tuple(self.lengths), stops)
        rule = self.model._prepare_diffusion_stopping_criteria(config)
        observer = None if rule is None else gs.StopObserver(rule)
        frozen = lambda: None if observer is None else observer.finished  # noqa: E731
        sampler = gs.RowSampler(config.sampler_config, canvas, self.model.vocab_size,
                                config.max_denoising_steps, generators, frozen)  # fmt: skip
        self.outbox = []
        self.streamer = gs.EventStreamer(plan, len(prompts), lambda: observer, self.outbox.append)
        choose = None
        if self.committer is not None:
            matchers = self.committer.matchers([r.id for r in new])
            choose = lambda c, logits: self.committer.choose(matchers, c, logits)  # noqa: E731
        self.steps_left = gemma_loop.denoise(self.model, ids, mask, config, sampler, observer,
                                             self.streamer, self._record, choose)  # fmt: skip
        self.batch_rows, self.requests, self.first = list(range(len(new))), list(new), at
        return 0

    def plan(self, live: list[Request], at: int) -> int:
        return at  # (transformers' loop holds the rest)

    def forward(self, plan: int) -> StepEvent:
        """One denoising step of the batch (one decoder forward); its StepEvent."""
        try:
            next(self.steps_left)
        except StopIteration:
            self.steps_left = None  # the decode ended with this step
        except BaseException:
            self._close()  # a failed decode is not resumed
            raise
        self.streamer.flush()  # the canvas goes on: its step has no commits to wait for
        (event,) = self.outbox
        self.outbox.clear()
        return event

    def commit(self, plan: int, event: StepEvent) -> Commit:
        """The rows whose last canvas ended this step: their answers and commit steps."""
        rows = {b: i for i, b in enumerate(self.batch_rows)}
        final = [rows[b] for b in event.finished if b in rows]
        out = Commit(forwards=1, event=lambda _: event)
        if final:
            width = max(self.lengths[self.batch_rows[i]] for i in final)  # (R, G): G the longest
            answers, marks, cuts = zip(*(self._answer(i, width) for i in final), strict=True)
            out.final, out.answers, out.marks = final, torch.stack(answers), torch.stack(marks)
            out.cut = torch.tensor(cuts)
        return out

    def keep(self, live: list[Request], kept: list[int]) -> None:
        self.batch_rows = [self.batch_rows[i] for i in kept]
        self.requests = [self.requests[i] for i in kept]
        if not kept:
            self._close()  # nobody waits for this batch any more

    def move_on(self, live: list[Request]) -> None:
        """transformers' loop moves every row on itself."""

    def progress(self, live: list[Request], i: int) -> list[int]:
        """The answer's finished canvases so far (cut at a stop token); drafts are not shown."""
        return list(self.streamer.answers[self.batch_rows[i]])

    # --- the decode --------------------------------------------------------------------------
    def _answer(self, i: int, width: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Live row i's committed canvases (EOS after a stop, and on to `width` columns), each
        column's last step, and where the answer ends: at its request's own first stop id (the
        engine writes EOS from there, early stop or not), else its last committed token."""
        b, canvas = self.batch_rows[i], self.model.canvas_length
        answer = self.streamer.answers[b][: self.lengths[b]]
        ends = self.streamer.canvas_step  # per finished canvas: its last step
        marks = [self.first + ends[p // canvas] if p < len(answer) else -1 for p in range(width)]
        tokens = answer + [self.special.eos] * (width - len(answer))
        own = set(self.requests[i].sampling.stop)
        cut = next((p for p, t in enumerate(answer) if t in own), max(len(answer) - 1, 0))
        return torch.tensor(tokens), torch.tensor(marks), cut

    def _record(self, canvas: torch.Tensor, logits: torch.Tensor) -> None:
        """A finished (B, L) canvas's log-probabilities for the live rows that asked: each
        token's under the step that committed it, the softmax its sampler draws from
        (logprobs.py); nothing is computed when no row asked."""
        asking = [i for i, r in enumerate(self.requests) if r.logprobs is not None]
        if not asking:
            return
        rows = torch.tensor([self.batch_rows[i] for i in asking], device=canvas.device)
        probs = torch.softmax(logits[rows], dim=-1, dtype=torch.float32)  # (R, L, V)
        start = len(self.streamer.canvas_step) * self.model.canvas_length  # this canvas's column
        positions = torch.arange(start, start + canvas.shape[1], device=canvas.device)
        positions = positions.expand(len(asking), -1)  # (R, L) answer columns
        lengths = torch.tensor([self.lengths[self.batch_rows[i]] for i in asking])
        commit = positions < lengths.to(canvas.device)[:, None]  # a last canvas may reach past G
        requests = [self.requests[i] for i in asking]
        logprobs.write(requests, probs, commit, canvas[rows], positions)

    def _close(self) -> None:
        """Stop the decode where it is (nothing runs in the background)."""
        if self.steps_left is not None:
            self.steps_left.close()
        self.steps_left = None
