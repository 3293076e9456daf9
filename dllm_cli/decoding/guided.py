"""Guided diffusion as FlashDLM runs it (arXiv 2505.21467): speculative decoding, DLM drafts.

Each row walks its frontier, its first masked column; every commit happens there, so a row's
masks stay one run at the end of its answer (blocks only matter for caching). One step:

1. The diffusion model drafts the argmax of every masked column from the frontier to the end
   of the draft window (`draft_window`, default the canvas end; under Dual cache a cached step
   computes only the block, so drafts stop at its end), whatever the sampling temperature.
2. The guide, an AR model with the same tokenizer whose KV cache holds committed tokens only,
   scores `[last committed token, drafts...]` in chunks of `verify_chunk`; the longest prefix
   whose drafts pass the rule is accepted, and a fully accepted chunk goes straight on to the
   next chunk without a new diffusion forward. One guide forward per chunk serves the batch.
3. On the first rejection one more token is committed there (`on_reject`): `guide`, the
   guide's own argmax (FlashDLM's `ARVerifier`: every verification gains a token, and under
   `exact` the output is the guide's greedy decode), or `draft`, the diffusion model's draft,
   only when nothing was accepted (FlashDLM's `ARAssistant`).
4. A committed stop token ends the row (the engine fills the rest with EOS).

Rules (`exact`, `topk:K`, `prob:P`) judge a draft by the guide's scores over the ids the
diffusion model can commit (its vocabulary without [MASK]; never an embedding padding row),
and the guide's own token is the argmax over the same ids.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dllm_cli.decoding.guide_cache import GuideCache
from dllm_cli.decoding.unmask import Committer, Decision, StepContext
from dllm_cli.settings import ON_REJECT


def accept_exact(scores: torch.Tensor, target: torch.Tensor, arg: float | None) -> torch.Tensor:
    """FlashDLM's `deterministic`: the draft is the guide's argmax."""
    return scores.argmax(dim=-1) == target


def accept_topk(scores: torch.Tensor, target: torch.Tensor, arg: float | None) -> torch.Tensor:
    """FlashDLM's `topk`: at most K - 1 tokens score strictly higher than the draft."""
    mine = scores.gather(-1, target[..., None])
    return (scores > mine).sum(dim=-1) < int(arg)


def accept_prob(scores: torch.Tensor, target: torch.Tensor, arg: float | None) -> torch.Tensor:
    """The guide gives the draft probability >= P (deterministic: no stochastic fallback)."""
    prob = scores.float().softmax(dim=-1).gather(-1, target[..., None]).squeeze(-1)
    return prob >= float(arg)


# rule name (as in a profile's `[guide] accept`) -> (scores (..., V), target (...)) -> bool (...)
ACCEPT_RULES: dict[str, Callable[[torch.Tensor, torch.Tensor, float | None], torch.Tensor]] = {
    "exact": accept_exact,
    "topk": accept_topk,
    "prob": accept_prob,
}


@dataclass(frozen=True)
class GuideRules:
    """How drafts are verified: acceptance rule, the token on a rejection, chunk, window."""

    accept: str = "exact"
    arg: float | None = None  # K of topk, P of prob
    on_reject: str = "guide"  # guide | draft
    verify_chunk: int = 32
    draft_window: int | None = None  # columns drafted from the frontier (None: canvas end)


class GuidedCommitter(Committer):
    """A frontier-walking `Committer`: an AR guide verifies the drafts (FlashDLM). Reusable
    across decodes, one at a time (the engine calls `start`, `admit` as requests join, `select`
    as rows leave); `forwards` counts the guide's forwards over its lifetime."""

    frontier = True

    def __init__(self, guide, vocab_size: int, special, rules: GuideRules = GuideRules()):
        if rules.accept not in ACCEPT_RULES or rules.on_reject not in ON_REJECT:
            raise ValueError(f"bad guide rules {rules}")
        self.guide, self.rules = guide, rules
        self.accept = ACCEPT_RULES[rules.accept]
        self.vocab, self.mask, self.pad = vocab_size, special.mask, special.pad
        self.stops = tuple(special.stop)
        self.draft_window = rules.draft_window
        self.cache = GuideCache(guide)
        self.started = False
        self.allowed: torch.Tensor | None = None  # (B, L, V) grammar masks (grammar_committer.py)

    @property
    def forwards(self) -> int:
        return self.cache.forwards

    @property
    def arithmetic(self) -> tuple[int, int]:
        """The guide's (row-columns, key-columns) over its lifetime (admission prefills too)."""
        return self.cache.row_columns, self.cache.key_columns

    def start(self, batch: int) -> None:
        """A decode begins: nothing is cached (the first verification feeds the prompts)."""
        device = next(self.guide.parameters()).device
        self.cache.reset(batch, device)
        self.started = True

    def select(self, keep: torch.Tensor) -> None:
        self.cache.select(keep)

    @torch.inference_mode()
    def admit(self, prompts: list[list[int]], order: torch.Tensor) -> None:
        """Rows for `prompts` join (continuous batching), then rows are reordered as `order`
        says; the guide caches each new prompt at once (guide_cache.GuideCache.admit)."""
        self.cache.admit(prompts, order, self.pad)

    @torch.inference_mode()
    def __call__(self, ctx: StepContext) -> Decision:
        if not self.started:
            raise RuntimeError("GuidedCommitter.start() must be called when a decode begins")
        sync(ctx.drafts.device)
        began, forwards = time.perf_counter(), self.cache.forwards
        runs = Verification(self, ctx).run()
        decision = runs.decision()
        self.cache.compact()
        sync(ctx.drafts.device)
        decision.forwards = self.cache.forwards - forwards
        decision.seconds = time.perf_counter() - began
        return decision

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Guide logits over the ids the diffusion model may commit (others -inf)."""
        vocab = min(self.vocab, logits.shape[-1])
        out = logits[..., :vocab].float()
        if self.mask < vocab:
            out = out.clone()
            out[..., self.mask] = float("-inf")
        return out


class Verification:
    """One step's chunked verification of every row's drafts (see the module docstring)."""

    def __init__(self, committer: GuidedCommitter, ctx: StepContext):
        self.g, self.ctx = committer, ctx
        c = ctx.canvas
        self.first = ctx.columns[:, 0]  # (B,) frontier
        self.n = ctx.candidates.sum(dim=1)  # (B,) drafts (a run from the frontier)
        merged = c.ids.clone()  # the canvas with drafts on the masked columns
        rows, slots = ctx.candidates.nonzero(as_tuple=True)
        merged[rows, ctx.columns[rows, slots]] = ctx.drafts[rows, slots]
        self.merged, self.pads = merged, c.pad
        zero = torch.zeros_like(self.n)
        self.accepted, self.fix, self.rejected = zero.clone(), zero.clone(), zero.bool()
        self.allowed = committer.allowed  # tokens each slot may take (None: every token)

    def run(self) -> Verification:
        size, k = self.g.rules.verify_chunk, 0
        active = self.n > 0
        while bool(active.any()):
            full = self._round(k, size, active)
            active = full & (self.n > (k + 1) * size)
            k += 1
        return self

    def _round(self, k: int, size: int, active: torch.Tensor) -> torch.Tensor:
        """Verify chunk k of the active rows; returns which rows accepted all of it."""
        lo = self.first + k * size  # (B,) column of the chunk's first draft
        length = torch.clamp(self.n - k * size, 0, size)  # (B,) drafts in the chunk
        start = lo - 1 if k else self.pads + self.g.cache.cached  # first fed column
        end = lo + length - 1  # fed columns [start, end): the tokens before each draft
        fed = torch.where(active, end - start, 0)  # (B,)
        span = torch.arange(int(fed.max()), device=fed.device)  # (F,)
        cols = start[:, None] + span[None]  # (B, F)
        real = span[None] < fed[:, None]
        width = self.merged.shape[1]
        feed = self.merged.gather(1, cols.clamp(0, width - 1)).masked_fill(~real, self.g.pad)
        # Draft at column q is judged by the output at column q - 1 (feed index q - 1 - start).
        j = torch.arange(size, device=fed.device)[None]  # (1, C)
        judged = (j < length[:, None]) & active[:, None]
        index = lo[:, None] + j - 1 - start[:, None]  # (B, C)
        lowest = int(torch.where(judged, index, len(span)).min())  # only these outputs needed
        logits = self.g.cache.forward(
            feed, cols - self.pads[:, None], self.g.pad, len(span) - lowest
        )
        index = (index - lowest).clamp(0, logits.shape[1] - 1)
        scores = self.g.scores(logits.gather(1, index[..., None].expand(-1, -1, logits.shape[-1])))
        if self.allowed is not None:  # only the grammar's tokens are judged and chosen
            scores = scores.masked_fill(~self._allowed(k * size, size, scores.shape[-1]), -math.inf)
        drafts = self.merged.gather(1, (lo[:, None] + j).clamp(max=width - 1))  # (B, C)
        known = drafts < scores.shape[-1]
        ok = self.g.accept(scores, drafts.clamp(max=scores.shape[-1] - 1), self.g.rules.arg)
        passes = (ok & known & judged).long().cumprod(dim=1).sum(dim=1)  # (B,) accepted run
        full = active & (passes == length)
        stopped = active & ~full
        self.accepted += torch.where(active, passes, 0)
        guide_token = scores.argmax(dim=-1).gather(1, passes.clamp(max=size - 1)[:, None])[:, 0]
        self.fix = torch.where(stopped, guide_token, self.fix)
        self.rejected |= stopped
        last = self._last_committed()  # (B,) column of each row's last committed token
        self.g.cache.keep(
            torch.where(active, torch.clamp(last - start, min=0), 0).minimum(fed), len(span)
        )
        return full

    def _allowed(self, first: int, size: int, vocab: int) -> torch.Tensor:
        """(B, size, V) the allowed tokens of slots first.. (True past the given slots)."""
        part = self.allowed[:, first : first + size, :vocab]
        if part.shape[1] < size or part.shape[2] < vocab:
            full = part.new_ones((part.shape[0], size, vocab))
            full[:, : part.shape[1], : part.shape[2]] = part
            part = full
        return part

    def _last_committed(self) -> torch.Tensor:
        """Column of the last token committed so far this step (see `decision`)."""
        return self.first + self._committed() - 1

    def _committed(self) -> torch.Tensor:
        """(B,) tokens committed from the frontier: the accepted run, plus the extra token."""
        extra = self.rejected & (
            torch.tensor(self.g.rules.on_reject == "guide", device=self.n.device)
            | (self.accepted == 0)
        )
        return self.accepted + extra.long()

    def decision(self) -> Decision:
        ctx = self.ctx
        slots = torch.arange(ctx.drafts.shape[1], device=ctx.drafts.device)[None]
        commit = (slots < self._committed()[:, None]) & ctx.candidates
        tokens = ctx.drafts.clone()
        by_guide = (slots == self.accepted[:, None]) & self.rejected[:, None]
        if self.g.rules.on_reject == "guide":
            tokens = torch.where(by_guide, self.fix[:, None], tokens)
        else:
            by_guide = torch.zeros_like(by_guide)
        # A committed stop token ends the row: nothing after it is committed.
        stop = torch.isin(tokens, torch.tensor(self.g.stops, device=tokens.device)) & commit
        after = (stop.long().cumsum(dim=1) - stop.long()) > 0
        commit &= ~after
        accepted = int((commit & ~by_guide & (slots < self.accepted[:, None])).sum())
        return Decision(commit, accepted=accepted, tokens=tokens, corrected=by_guide & commit)


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so the guide's time is its own."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
