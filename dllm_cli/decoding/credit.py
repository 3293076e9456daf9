"""Credit decoding (dInfer, arXiv 2510.08666): a prediction that holds still earns credit.

dInfer's `CreditThresholdParallelDecoder` (inclusionAI/dInfer,
python/dinfer/decoding/parallel_strategy.py) keeps, per block, a credit for every (slot,
token): each step the credits decay by `decay` and every masked slot's top-1 token gains its
probability raised to `boost`. The step runs Fast-dLLM's threshold rule on the fused logits
`logits + alpha * log(1 + credit)`, whose argmax is the draft. A block's credits start at zero.

Here a row's credits live in its block's slots as the top-1 token and its decayed gain of each
of the block's last `depth` steps (depth = block length keeps every step: a step commits at
least one mask); their sum is dInfer's running `credit = decay * credit + gain`. State is
matched to the canvas rows by request id and block start on the device, so rows move through
blocks at their own pace without a device read. Under tensor parallelism
(`sharded_fused_drafts`) the fused softmax's summaries come from one all-gather a step, and the
credits, which depend only on gathered values, are the same on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dllm_cli.decoding.row_sampling import RowDraws
from dllm_cli.decoding.sampling import row_confidence
from dllm_cli.decoding.shard_summaries import Needs, Summaries, summarize
from dllm_cli.decoding.sharded_sampling import KINDS

TIE = 1e-5  # dInfer: with no mask above the threshold, every mask within 1e-5 of the best


@dataclass
class Credits:
    """The rows' credits after a step, on the device (canvas row order of that step)."""

    rows: torch.Tensor  # (B,) request ids
    starts: torch.Tensor  # (B,) canvas column of each row's block
    tokens: torch.Tensor  # (B, L, S) long: a slot's top-1 token at each of the last S steps
    gains: torch.Tensor  # (B, L, S) float32: what that step gained, decayed since


class CreditMemory:
    """One decoder's credit state and parameters (alpha, boost gamma, decay beta)."""

    def __init__(self, alpha: float, boost: float, decay: float, depth: int):
        self.alpha, self.boost, self.decay, self.depth = alpha, boost, decay, depth
        self.held: Credits | None = None

    def forget(self, requests: list[int]) -> None:
        """Requests that left (their credits go with the next step's rows: nothing kept)."""

    def carried(self, ctx, starts: torch.Tensor, length: int) -> tuple[torch.Tensor, ...]:
        """(B, L, S) tokens and gains each current row brings from its last step in this block
        (zeros for a row at its block's first step, a new request or a new block)."""
        rows = ctx.canvas.request_ids
        shape = (rows.shape[0], length, self.depth)
        old = self.held
        if old is None:
            return (torch.zeros(shape, dtype=torch.long, device=rows.device),
                    torch.zeros(shape, dtype=torch.float32, device=rows.device))  # fmt: skip
        fresh = torch.as_tensor(ctx.block_step, device=rows.device).reshape(-1) == 0
        same = (rows[:, None] == old.rows[None, :]) & (starts[:, None] == old.starts[None, :])
        same &= ~fresh[:, None]  # (B, B_old)
        which = same.long().argmax(dim=1)  # (B,) the row's previous canvas row
        keep = same.any(dim=1)[:, None, None]
        width = min(length, old.tokens.shape[1])  # rows apart: padded spans may change width
        tokens = torch.zeros(shape, dtype=torch.long, device=rows.device)
        gains = torch.zeros(shape, dtype=torch.float32, device=rows.device)
        tokens[:, :width] = old.tokens[which, :width]
        gains[:, :width] = torch.where(keep, old.gains[which, :width], 0.0)
        return tokens, gains

    def update(self, ctx, top: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
        """(B, L, V) each slot's credit after this step (dInfer's `_apply_credit_fusion`)."""
        probs = ctx.probs
        tokens, gains = self.advance(ctx, top, best)
        credit = torch.zeros(probs.shape, dtype=torch.float32, device=probs.device)
        return credit.scatter_add_(2, tokens, gains)  # (B, L, V)

    def advance(self, ctx, top: torch.Tensor, best: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(B, L, S) tokens and gains after this step, kept for the next: older steps' decayed,
        the masks' top-1 `best` gaining top^boost."""
        starts = block_starts(ctx)
        tokens, gains = self.carried(ctx, starts, top.shape[1])
        gain = top.float().pow(self.boost) * ctx.candidates  # (B, L): masked slots only
        tokens = torch.cat([tokens[..., 1:], best[..., None]], dim=-1)
        gains = torch.cat([gains[..., 1:] * self.decay, gain[..., None]], dim=-1)
        self.held = Credits(ctx.canvas.request_ids, starts, tokens, gains)
        return tokens, gains


def block_starts(ctx) -> torch.Tensor:
    """(B,) canvas column of each row's block."""
    if ctx.columns is not None:
        return ctx.columns[:, 0]
    return torch.full_like(ctx.canvas.request_ids, ctx.block.start)


def fused_drafts(ctx, credit: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) drafts and confidences under softmax(log p + alpha log(1 + credit)): the fused
    argmax for greedy rows (a sampled row keeps its draw), each row's confidence kind measured
    on the fused distribution (low_confidence: the draft's fused probability, dInfer's)."""
    probs = ctx.probs
    fused = (probs.log() + alpha * torch.log1p(credit).to(probs.dtype)).softmax(dim=-1)
    confidence, tokens = fused.max(dim=-1)  # the first maximum, as argmax's
    draws = ctx.generator
    if not isinstance(draws, RowDraws):  # a bare context (greedy, low_confidence)
        return tokens, confidence
    if not draws.all_greedy:
        tokens = torch.where(draws.greedy_rows(probs.device), tokens, ctx.drafts)
    return tokens, row_confidence(fused, tokens, draws)


def shard_credit(shape, tokens: torch.Tensor, gains: torch.Tensor, start: int) -> torch.Tensor:
    """(B, L, V_r) float32 credit of a shard's ids from (B, L, S) tokens and gains (ids that
    other ranks hold add 0 at the shard's first: the same sums, in the same order)."""
    at = tokens - start
    own = (at >= 0) & (at < shape[-1])
    credit = torch.zeros(shape, dtype=torch.float32, device=tokens.device)
    return credit.scatter_add_(2, torch.where(own, at, 0), torch.where(own, gains, 0.0))


@dataclass(frozen=True)
class FusedView:
    """The fused distribution as sharded_sampling.KINDS read a View: its gathered summaries
    (no filter), and each draft's fused logit."""

    s: Summaries
    drafted: torch.Tensor  # (B, L) the draft's fused logit (a greedy row's: the maximum)
    dtype: torch.dtype
    tempered = True  # the confidences read the summarized distribution itself

    @property
    def cut(self) -> torch.Tensor:
        return torch.full_like(self.s.best, -math.inf)

    def basis(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.s.best, self.s.total()

    def chosen(self) -> torch.Tensor:
        return self.drafted


def sharded_fused_drafts(ctx, memory: CreditMemory, sampler) -> tuple[torch.Tensor, ...]:
    """fused_drafts on a tensor-parallel rank, ctx.probs its shard's part (B, L, V_r), through
    one all-gather: each rank summarizes the fused logits twice, without and with this step's
    gain on its own favourite (the whole vocabulary's favourite, which earns it, is some
    rank's), with its favourite and each draft's fused logit; every rank then keeps the same
    credits (CreditMemory.advance) and reads the one-process drafts and confidences."""
    part, start = ctx.probs, sampler.start
    width = part.shape[-1]
    tokens, gains = memory.carried(ctx, block_starts(ctx), part.shape[1])
    older = shard_credit(part.shape, tokens[..., 1:], gains[..., 1:] * memory.decay, start)
    top, at = part.max(dim=-1)  # (B, L) this shard's favourite (the first maximum)
    gain = top.float().pow(memory.boost) * ctx.candidates
    drafts = ctx.drafts - start
    own = (drafts >= 0) & (drafts < width)
    draws = ctx.generator
    asked = [s.confidence for s in draws.samplings] if isinstance(draws, RowDraws) else []
    needs = Needs(entropy="entropy" in asked)  # (the settings refuse it: not a probability)
    sent = []
    for credit in (older, older.scatter_add(2, at[..., None], gain[..., None])):
        fused = part.log() + memory.alpha * torch.log1p(credit).to(part.dtype)  # (B, L, V_r)
        drafted = fused.gather(-1, drafts.clamp(0, width - 1)[..., None])[..., 0]
        summary = summarize(fused, fused, None, 2, start, needs)
        drafted = torch.where(own, drafted.double(), -math.inf)
        sent.append(torch.cat([summary, drafted[..., None]], dim=-1))
    n = sent[0].shape[-1]
    mine = torch.cat([*sent, top.double()[..., None], (at + start).double()[..., None]], -1)
    every = sampler.gather(mine)  # (world, B, L, 2n + 2)
    tops, owner = every[..., -2].max(dim=0)  # the lowest rank among equals: the lowest id
    best = every[..., -1].gather(0, owner[None])[0].long()
    memory.advance(ctx, tops.to(part.dtype), best)
    ranks = torch.arange(every.shape[0], device=every.device)[:, None, None]
    picked = torch.where((ranks == owner)[..., None], every[..., n : 2 * n], every[..., :n])
    s = Summaries(picked[..., :-1], 2)
    drafted = picked[..., -1].max(dim=0).values  # the draft's owner's
    if not isinstance(draws, RowDraws):  # a bare context (greedy, low_confidence)
        return s.first, (1.0 / s.total()).to(part.dtype)
    tokens = s.first
    if not draws.all_greedy:
        greedy = draws.greedy_rows(part.device)
        tokens = torch.where(greedy, tokens, ctx.drafts)
        drafted = torch.where(greedy, s.best, drafted)
    else:
        drafted = s.best
    view = FusedView(s, drafted, part.dtype)
    return tokens, row_confidence(view, tokens, draws, KINDS).to(part.dtype)


def credit_rule(p, ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """dInfer's credit step: the threshold rule on credit-fused confidences, (commit, tokens)."""
    memory = p.memory
    if p.shard is not None:  # a tensor-parallel rank: ctx.probs is its vocabulary's part
        tokens, confidence = sharded_fused_drafts(ctx, memory, p.shard)
    else:
        top, best = ctx.probs.max(dim=-1)  # (B, L): the unfused favourite and its probability
        credit = memory.update(ctx, top, best)
        tokens, confidence = fused_drafts(ctx, credit, memory.alpha)
    confidence = confidence.masked_fill(~ctx.candidates, float("-inf"))
    # dInfer's bar: the threshold, or just under the best mask when none reaches it
    best_mask = confidence.max(dim=1, keepdim=True).values
    bar = (best_mask - TIE).clamp(-1000.0, p.s.threshold)
    return (confidence >= bar) & ctx.candidates, tokens


def credit_memory(s) -> CreditMemory:
    """Credit decoding's state: one per decoder, a row's reset at each of its blocks."""
    return CreditMemory(s.credit_alpha, s.credit_boost, s.credit_decay, s.block_length)
