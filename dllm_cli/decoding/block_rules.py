"""Drafts and commit decisions of the block-causal decode (SDAR, LLaDA2.0, LLaDA2.1).

One block of B columns per row. A draft is every column's token and its probability
(`draft`); which masks become tokens is the references' rule (`fills`):
- `threshold` (SDAR's `low_confidence_dynamic`, LLaDA2.0's generate, LLaDA2.1's M2T): the
  one threshold rule of every family (ranking.confident_columns), strictly past the threshold;
- `fixed` (SDAR's `low_confidence_static`): the k most confident, the same rule with a
  threshold no mask passes;
k is the step's share of the block (an even split of B over the block's steps, remainder
first); no step commits more than the masks left. LLaDA2.1 adds token-to-token editing (T2T):
a committed, non-prompt column whose new draft differs and passes `edit_threshold` is
replaced, in the same step as the mask fills.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dllm_cli.decoding.ranking import confident_columns
from dllm_cli.decoding.sampling import top_k_filter, top_p_filter
from dllm_cli.families import Family
from dllm_cli.family_settings import check_refused
from dllm_cli.lifetimes import Sampling
from dllm_cli.setting_spec import RULES
from dllm_cli.settings import DecodeSettings, even_split

# The block stepper's drafting: (N, B, V) logits, each row's request's sampling and generator
# -> tokens (N, B), p (N, B). `whole_drafter` drafts from whole logits; a tensor-parallel
# model's from its vocabulary shard (sharded_sampling.block_drafter).
Drafter = Callable[
    [torch.Tensor, Sequence[Sampling], Sequence[torch.Generator | None]],
    tuple[torch.Tensor, torch.Tensor],
]


@dataclass(frozen=True)
class BlockRule:
    """The decode's rule, resolved once: tokens per step, thresholds, editing."""

    block: int  # B
    schedule: tuple[int, ...]  # tokens per step within a block (sums to B)
    threshold: float  # fixed: inf, never passed, so a step fills exactly its k
    edit_threshold: float | None  # None: no token-to-token editing
    max_post_steps: int

    def k(self, step: int) -> int:
        return self.schedule[min(step, len(self.schedule) - 1)]


def check_block_settings(s: DecodeSettings, family: Family, where=lambda k: "") -> BlockRule:
    """The settings as a BlockRule; anything that does not apply is refused in one line
    (cache, unmask and confidence by the family's `only` table)."""
    check_refused(family, s, where)
    block = s.block_length
    # steps over the answer -> per block, the references' `steps` (both rules' schedule); the
    # settings refuse fewer steps than blocks when they are built
    steps = max(1, min(block, block * s.total_steps // s.gen_length))
    return BlockRule(
        block=block,
        schedule=tuple(even_split(block, steps)),
        threshold=s.threshold if RULES[s.unmask].least else math.inf,
        edit_threshold=s.edit_threshold,
        max_post_steps=s.max_post_steps,
    )


def draft(
    logits: torch.Tensor,
    s: DecodeSettings,
    mask_id: int,
    real_vocab: int,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, B, V) logits -> tokens (N, B) and their probabilities (N, B), as the references
    sample: temperature 0 is argmax with p from the plain softmax; otherwise logits / T, top-k,
    top-p, softmax, one multinomial draw. [MASK] and the embedding's padding rows are never
    drafted (their logits are -inf before anything else)."""
    logits = logits.float()
    logits[..., real_vocab:] = float("-inf")
    logits[..., mask_id] = float("-inf")
    if s.temperature == 0:
        probs = logits.softmax(dim=-1)
        token = probs.argmax(dim=-1)
        return token, probs.gather(-1, token[..., None])[..., 0]
    n, b, v = logits.shape
    flat = logits.view(n * b, v) / s.temperature
    flat = top_p_filter(top_k_filter(flat, s.top_k), s.top_p)
    probs = flat.softmax(dim=-1)
    token = torch.multinomial(probs, 1, generator=generator)  # (N B, 1)
    return token.view(n, b), probs.gather(-1, token).view(n, b)


def whole_drafter(mask_id: int, real_vocab: int) -> Drafter:
    """`draft` over whole logits: each row samples with its own request's values and
    generator, so a sampled row's draws do not depend on what shares the step (greedy: one
    call)."""

    def drafted(logits, samplings, generators):
        if all(s.greedy for s in samplings):
            return draft(logits, samplings[0], mask_id, real_vocab, None)
        rows = [
            draft(logits[i : i + 1], s, mask_id, real_vocab, g)
            for i, (s, g) in enumerate(zip(samplings, generators, strict=True))
        ]
        return torch.cat([x for x, _ in rows]), torch.cat([p for _, p in rows])

    return drafted


def fills(rule: BlockRule, active, p, k) -> torch.Tensor:
    """(N, B) bool: the masks this step commits, never more than the masks left (diffusers'
    cap on SDAR's top-k); SDAR's and LLaDA2.x's threshold is strict (`>`)."""
    conf = torch.where(active, p, float("-inf"))  # (N, B)
    return confident_columns(conf, active, rule.threshold, k)


def edits(rule: BlockRule, block, active, x0, p, fixed) -> torch.Tensor:
    """(N, B) bool: LLaDA2.1's T2T edits (committed, non-prompt, changed, p > threshold)."""
    if rule.edit_threshold is None:
        return torch.zeros_like(active)
    return ~active & ~fixed & (x0 != block) & (p > rule.edit_threshold)
