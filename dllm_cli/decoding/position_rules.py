"""Position-aware parallel unmasking: rules that look at where a mask sits, not only how sure.

The threshold rule's wrong commits sat far from the decoded left context, and a block's first
masked column was never wrong (docs/decoding-rules.md), so this rule commits left to right.

`sdlm`: SDLM's longest-prefix decoding (Liu et al., "Sequential Diffusion Language Models",
arXiv 2509.24007; OpenGVLab/SDLM, `find_longest_sequence` in
sdlm/model/sdlm_qwen2_5/generate_utils.py): commit the longest run of the window's leftmost
slots above a threshold, at least the first. Here the window is the current block's masks from
its leftmost one (committed columns inside the run are passed over), and, dllm's own addition,
any mask past the run above a second bar (`jump_threshold`; 1 leaves SDLM's rule).
"""

from __future__ import annotations

import torch


def leftmost(candidates: torch.Tensor) -> torch.Tensor:
    """(B, L) bool: each row's first candidate slot (none where a row has none)."""
    first = candidates.long().cumsum(dim=1) == 1
    return first & candidates


def longest_run(passes: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """(B, L) bool: the candidates before a row's first candidate that fails `passes`;
    non-candidate slots neither fail nor count."""
    ok = passes | ~candidates
    return ok.long().cumprod(dim=1).bool() & candidates


def sdlm_rule(p, ctx) -> torch.Tensor:
    """SDLM's step: the longest run of masks from the block's leftmost above tau (at least
    the leftmost), plus any mask above `jump_threshold`."""
    conf, cand = ctx.confidence, ctx.candidates  # (B, L)
    run = longest_run(conf > p.s.threshold, cand)  # empty when the leftmost mask fails
    return run | leftmost(cand) | ((conf > p.s.jump_threshold) & cand)
