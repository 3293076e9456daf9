"""Guided diffusion (FlashDLM, arXiv 2505.21467): an autoregressive model verifies the drafts.

Each step the diffusion model drafts every masked column of the block. The guide keeps its own
KV cache of each row's committed prefix and scores, in one forward per step for the whole
batch, `[committed tokens it has not cached yet, block columns left to right]`, where masked
columns carry the diffusion drafts. Usually the first part is only the last committed token.

What a row commits each step (the acceptance semantics):
1. The verified run. Walk the block left to right from the row's first masked column; a draft
   is accepted while the acceptance rule holds for it given everything to its left (committed
   tokens and the drafts accepted before it). Committed columns inside the run pass through.
   Rules: `exact` (the draft is the guide's argmax; ties count), `topk` K (at most K-1 tokens
   score strictly higher), `prob` P (the guide gives the draft probability >= P). Only ids
   below both vocabularies can pass.
2. Progress. The diffusion model's own most confident candidate (ties: leftmost) is committed
   too, whatever the guide says: the token the unguided one-token-per-step decoder would
   commit. When it is the first masked column this is exactly FlashDLM's rule ("if the first
   draft disagrees, commit the DLM's token anyway"). When it is not, it is committed out of
   order as unguided decoding would, the verified run still starts at the first masked
   column, and the guide's cache only advances once the gap before it is filled. So a guide
   that never agrees reproduces one-token-per-step decoding with the run's confidence
   measure, and one that always agrees finishes a block in one verification.
`Decision.accepted` counts the drafts passed by (1), summed over rows; a token committed only
by (2) is not counted. The end of an answer is the engine's business: with early stop a row
leaves the batch once a stop token is committed with everything before it, and its tail is
filled with EOS; without it the row is decoded (guided) to the end of the canvas, and its
text is cut at the first stop token as usual.

Cache bookkeeping. The guide's cache never holds a draft that was not committed. After each
forward a row keeps the fed tokens up to, not including, the last token of its contiguous
committed prefix; that token is fed again next step, where its output judges the next draft.
Rows keep different numbers of tokens: the batch keeps as many slots as the row that kept the
most, and the extra slots of other rows are masked out (`valid`), so one batched forward
serves rows of any prefix length, left padding included. Rows that finish early are dropped
by following `canvas.rows`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dllm_cli.decoding.unmask import Decision, StepContext, commit_top


def guide_rank(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """How many tokens the guide scores strictly above `target` (0: target is an argmax)."""
    score = logits.gather(-1, target[..., None])  # (..., 1)
    return (logits > score).sum(-1)


def accept_exact(logits: torch.Tensor, target: torch.Tensor, arg: float | None) -> torch.Tensor:
    return guide_rank(logits, target) == 0


def accept_topk(logits: torch.Tensor, target: torch.Tensor, arg: float | None) -> torch.Tensor:
    return guide_rank(logits, target) < int(arg)


def accept_prob(logits: torch.Tensor, target: torch.Tensor, arg: float | None) -> torch.Tensor:
    prob = logits.float().softmax(-1).gather(-1, target[..., None]).squeeze(-1)
    return prob >= float(arg)


# rule name (as in a profile's `[guide] accept`) -> (logits (..., V), target (...)) -> bool (...)
ACCEPT_RULES: dict[str, Callable[[torch.Tensor, torch.Tensor, float | None], torch.Tensor]] = {
    "exact": accept_exact,
    "topk": accept_topk,
    "prob": accept_prob,
}


@dataclass
class GuideState:
    """The guide's view of one decode: per live row, what its KV cache covers."""

    rows: torch.Tensor  # (B,) original batch row of each cache row
    frontier: torch.Tensor  # (B,) canvas column of the first committed token not yet cached
    valid: torch.Tensor  # (B, T) bool: cache slots holding this row's tokens (others: holes)
    kv: object | None = None  # the guide's past_key_values (a transformers Cache)


class GuidedCommitter:
    """A `Committer` that commits the drafts an AR guide accepts (FlashDLM guided diffusion).

    Reusable across decodes (it starts afresh on each decode's first step), one at a time.
    `forwards` counts the guide's forwards over its lifetime.
    """

    def __init__(
        self,
        guide: torch.nn.Module,
        vocab_size: int,
        pad_id: int,
        rule: str = "exact",
        arg: float | None = None,
    ):
        if rule not in ACCEPT_RULES:
            raise ValueError(f"unknown acceptance rule {rule!r} (use {', '.join(ACCEPT_RULES)})")
        self.guide = guide
        self.vocab = vocab_size
        self.pad_id = pad_id
        self.accept = ACCEPT_RULES[rule]
        self.arg = arg
        self.forwards = 0
        self.state: GuideState | None = None
        self.cache_kw = cache_keyword(guide)

    def __call__(self, ctx: StepContext) -> Decision:
        state = self._sync(ctx)
        feed, columns, lengths = self._feed(ctx, state)
        logits = self._score(state, feed, columns - ctx.canvas.pad[:, None])  # (B, F, V)
        verified = self._verify(ctx, state, logits, feed, lengths)  # (B, L) bool
        commit = (verified | commit_top(ctx, torch.ones_like(ctx.masks_now))) & ctx.candidates
        self._advance(ctx, state, commit, lengths)
        return Decision(commit, accepted=int(verified.sum()))

    # --- steps ------------------------------------------------------------------------
    def _sync(self, ctx: StepContext) -> GuideState:
        """A fresh cache on a decode's first step; afterwards drop rows that left the batch."""
        c = ctx.canvas
        if ctx.block.index == 0 and ctx.block_step == 0:
            empty = torch.zeros((c.batch, 0), dtype=torch.bool, device=c.ids.device)
            self.state = GuideState(c.rows.clone(), c.pad.clone(), empty)
        state = self.state
        if state is None or not bool(torch.isin(c.rows, state.rows).all()):
            raise RuntimeError("GuidedCommitter must see every step of a decode from its first")
        if len(state.rows) != c.batch:
            keep = (c.rows[:, None] == state.rows[None, :]).long().argmax(dim=1)  # (B,)
            state.rows, state.frontier, state.valid = (
                c.rows,
                state.frontier[keep],
                state.valid[keep],
            )
            if state.kv is not None:
                state.kv.batch_select_indices(keep)
        return state

    def _feed(self, ctx: StepContext, state: GuideState):
        """Tokens (B, F) from each row's frontier to the block end (drafts on masked columns).

        Rows with nothing to verify in this block feed nothing; shorter rows are padded at the
        end, where causal attention keeps the padding away from every real token.
        """
        c, block = ctx.canvas, ctx.block
        merged = c.ids.clone()  # (B, S)
        merged[:, block.start : block.end] = torch.where(
            ctx.candidates, ctx.drafts, merged[:, block.start : block.end]
        )
        has_drafts = ctx.candidates.any(dim=1)  # (B,)
        lengths = torch.where(has_drafts, block.end - state.frontier, 0)  # (B,)
        span = torch.arange(int(lengths.max()), device=merged.device)  # (F,)
        columns = state.frontier[:, None] + span[None]  # (B, F)
        real = span[None] < lengths[:, None]
        feed = merged.gather(1, columns.clamp(max=c.width - 1)).masked_fill(~real, self.pad_id)
        return feed, columns, lengths

    def _score(self, state: GuideState, feed: torch.Tensor, positions: torch.Tensor):
        """One guide forward over the fed tokens, on top of the cached prefixes."""
        attend = torch.cat([state.valid, torch.ones_like(feed, dtype=torch.bool)], dim=1)
        out = self.guide(
            input_ids=feed,
            attention_mask=attend.long(),
            position_ids=positions.clamp(min=0),
            use_cache=True,
            **{self.cache_kw: state.kv},
        )
        self.forwards += 1
        kv = out.get("cache")
        state.kv = kv if kv is not None else out.get("past_key_values")
        return out.logits

    def _verify(self, ctx: StepContext, state, logits, feed, lengths) -> torch.Tensor:
        """(B, L) candidates in each row's verified run (see the module docstring)."""
        vocab = min(self.vocab, logits.shape[-1])
        nxt = feed[:, 1:]  # (B, F-1): the token fed after each output position
        known = nxt < vocab
        passes = self.accept(logits[:, :-1, :vocab], nxt.clamp(max=vocab - 1), self.arg) & known
        passes = torch.cat([passes, passes.new_zeros((passes.shape[0], 1))], dim=1)  # (B, F)
        # the block column q is judged by the output at column q - 1 (feed index q-1-frontier)
        cols = torch.arange(ctx.block.start, ctx.block.end, device=feed.device)[None]  # (1, L)
        index = cols - 1 - state.frontier[:, None]  # (B, L)
        judged = (index >= 0) & (index < lengths[:, None] - 1)
        ok = passes.gather(1, index.clamp(0, feed.shape[1] - 1)) & judged
        ok = ok | ~ctx.candidates  # committed columns pass through
        return ok.long().cumprod(dim=1).bool() & ctx.candidates

    def _advance(self, ctx: StepContext, state, commit, lengths) -> None:
        """Keep the fed tokens before each row's new first mask, minus its last one."""
        left = ctx.candidates & ~commit  # (B, L)
        block = ctx.block
        span = torch.arange(block.start, block.end, device=left.device)[None]
        first = torch.where(left, span, block.end).min(dim=1).values  # (B,) new first mask
        keep = torch.where(lengths > 0, first - 1 - state.frontier, 0)  # (B,)
        most = int(keep.max())
        drop = int(lengths.max()) - most  # fed slots beyond what any row keeps
        if drop > 0:
            state.kv.crop(-drop)  # negative: remove that many slots from the end
        slots = torch.arange(most, device=left.device)[None] < keep[:, None]
        state.valid = torch.cat([state.valid, slots], dim=1)
        state.frontier = state.frontier + keep


def cache_keyword(model: torch.nn.Module) -> str:
    """The forward's cache argument: `cache` in recent transformers 5, `past_key_values` before."""
    for cls in type(model).__mro__:
        params = inspect.signature(cls.forward).parameters if "forward" in vars(cls) else {}
        for name in ("cache", "past_key_values"):
            if name in params:
                return name
    return "past_key_values"
