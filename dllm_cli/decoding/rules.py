"""Parallel unmasking rules from the literature beyond Fast-dLLM's threshold and factor.

EB-Sampler (Ben-Hamu et al., arXiv 2505.24857, "Accelerated Sampling from Masked Diffusion
Models via Entropy Bounded Unmasking"): order the masked columns by an error proxy and commit
the longest prefix U of that order whose entropies satisfy sum_{l in U} H_l - max_{l in U} H_l
<= gamma, at least one column. With the columns ordered by entropy (the proxy of the public
transcriptions), the max is the last one taken, so the bound reads: the entropies of all but
the last column taken add up to at most gamma. gamma = 0 commits one token per step (plus
any exactly certain ones); larger gamma commits more.

Here the run's confidence must be `entropy` (negative entropy, sampling.negative_entropy), so
the order and the bound use the same numbers; the rule works inside the current block, as
every rule of the engine does (block_length = gen_length is the reference's single pass).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dllm_cli.decoding.ranking import top_columns

if TYPE_CHECKING:
    from dllm_cli.decoding.unmask import RuleParams, StepContext


def entropy_bounded_counts(entropy: torch.Tensor, candidates: torch.Tensor, gamma: float):
    """(B,) how many candidates EB-Sampler commits: the longest entropy-ascending prefix whose
    entropies, all but the largest, sum to <= gamma; at least one where a row has a mask."""
    h = entropy.masked_fill(~candidates, float("inf"))  # (B, L)
    ordered = h.sort(dim=1, stable=True).values  # ascending; non-candidates last
    taken = ordered.masked_fill(ordered.isinf(), 0.0)
    spent = taken.cumsum(dim=1) - taken.cummax(dim=1).values  # (B, L)
    passes = (spent <= gamma) & ~ordered.isinf()
    masks = candidates.sum(dim=1)
    return passes.sum(dim=1).clamp(min=1).minimum(masks)


def eb_rule(p: RuleParams, ctx: StepContext) -> torch.Tensor:
    """EB-Sampler's step: the most certain candidates while their entropy stays under gamma."""
    entropy = -ctx.confidence  # confidence is negative entropy (settings require it)
    counts = entropy_bounded_counts(entropy, ctx.candidates, p.eb_gamma)
    return top_columns(ctx.confidence, ctx.candidates, counts)
