"""Drafts and commit decisions of the block-causal decode (SDAR, LLaDA2.0, LLaDA2.1).

One block of B columns per row; a draft is every column's token and probability (sampling.py,
the "block" family). `fills`: `threshold` (SDAR's `low_confidence_dynamic`, LLaDA2.x's
generate and M2T: ranking.confident_columns, strictly past the threshold) or `fixed` (SDAR's
`low_confidence_static`: the same rule with a threshold no mask passes), at least k, the step's
share of the block (remainder first), never more than the masks left. LLaDA2.1's T2T editing
(`edits`): a committed non-prompt column whose new draft differs and passes `edit_threshold`
is replaced in the same step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dllm_cli.decoding.ranking import confident_columns
from dllm_cli.families import Family
from dllm_cli.family_settings import check_refused
from dllm_cli.lifetimes import Sampling
from dllm_cli.setting_spec import RULES
from dllm_cli.settings import DecodeSettings, even_split

# (N, B, V) logits, each row's sampling and generator, keep the distribution? -> tokens (N, B),
# p (N, B), the distribution or None: sampling.Sampler.drafts, sharded_sampling.block_drafter.
Drafter = Callable[
    [torch.Tensor, Sequence[Sampling], Sequence[torch.Generator | None], bool],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
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
    """The settings as a BlockRule; what does not apply is refused in one line (families.py)."""
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
