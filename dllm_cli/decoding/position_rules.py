"""Position-aware parallel unmasking: rules that look at where a mask sits, not only how sure.

The diagnosis in docs/decoding-rules.md found the threshold rule's wrong commits far from the
decoded left context (block columns 16-31) and at confidence 0.90-0.95; a block's first
masked column was never wrong. So this rule commits left to right first.

`prefix`: SDLM's longest-prefix decoding (Liu et al., "Sequential Diffusion Language Models",
arXiv 2509.24007; public code OpenGVLab/SDLM, `find_longest_sequence` in
sdlm/model/sdlm_qwen2_5/generate_utils.py): commit the longest run of the window's leftmost
slots whose confidence is above a threshold, at least the first. Here the window is the
current block's masks from its leftmost one (already committed columns inside the run are
passed over), and, dllm's own addition, any mask past the run whose confidence is above a
second, high bar (`jump_threshold`; 1 turns it off and leaves SDLM's rule).
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


def prefix_rule(p, ctx) -> torch.Tensor:
    """SDLM's step: the longest run of masks from the block's leftmost above tau (at least
    the leftmost), plus any mask above `jump_threshold`."""
    conf, cand = ctx.confidence, ctx.candidates  # (B, L)
    run = longest_run(conf > p.s.threshold, cand)  # empty when the leftmost mask fails
    return run | leftmost(cand) | ((conf > p.s.jump_threshold) & cand)
