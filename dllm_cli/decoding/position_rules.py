"""Position-aware parallel unmasking: rules that look at where a mask sits, not only how sure.

The diagnosis in docs/decoding-rules.md found the threshold rule's wrong commits far from the
decoded left context (block columns 16-31) and at confidence 0.90-0.95; a block's first
masked column was never wrong. These rules commit left to right first:

`prefix`: SDLM's longest-prefix decoding (Liu et al., "Sequential Diffusion Language Models",
arXiv 2509.24007; public code OpenGVLab/SDLM, `find_longest_sequence` in
sdlm/model/sdlm_qwen2_5/generate_utils.py): commit the longest run of the window's leftmost
slots whose confidence is above a threshold, at least the first. Here the window is the
current block's masks from its leftmost one (already committed columns inside the run are
passed over), and, dllm's own addition, any mask past the run whose confidence is above a
second, high bar (`jump_threshold`; 1 turns it off and leaves SDLM's rule).

`localleap`: LocalLeap ("Accelerating Diffusion LLM Inference via Local
Determinism Propagation", arXiv 2510.07081): masks at least `threshold` confident are
anchors; a mask within `leap_radius` columns of an anchor is committed at the relaxed
`leap_threshold`, any other at `threshold`, and the most confident mask always.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    run = longest_run(conf > p.threshold, cand)  # empty when the leftmost mask fails
    return run | leftmost(cand) | ((conf > p.jump_threshold) & cand)


def near_anchor(anchors: torch.Tensor, radius: int) -> torch.Tensor:
    """(B, L) bool: slots within `radius` columns of an anchor (the anchor itself included)."""
    if radius == 0:
        return anchors
    hit = F.max_pool1d(anchors.float()[:, None], 2 * radius + 1, stride=1, padding=radius)
    return hit[:, 0] > 0


def localleap_rule(p, ctx) -> torch.Tensor:
    """LocalLeap's step: every mask above its bar (relaxed near an anchor), at least the best."""
    conf, cand = ctx.confidence, ctx.candidates  # (B, L)
    anchors = (conf >= p.threshold) & cand
    relaxed = torch.tensor(p.leap_threshold, dtype=conf.dtype, device=conf.device)
    strict = torch.tensor(p.threshold, dtype=conf.dtype, device=conf.device)
    bar = torch.where(near_anchor(anchors, p.leap_radius), relaxed, strict)
    best = torch.zeros_like(cand).scatter_(1, conf.argmax(dim=1, keepdim=True), True)
    return ((conf >= bar) | best) & cand
