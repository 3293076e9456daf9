"""Ranking candidates by confidence: the building block every unmasking rule shares."""

from __future__ import annotations

import torch


def rank_by_confidence(confidence: torch.Tensor) -> torch.Tensor:
    """(B, L) rank of each column, 0 = most confident; ties go to the leftmost column."""
    order = confidence.argsort(dim=1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    span = torch.arange(order.shape[1], device=order.device).expand_as(order)
    return ranks.scatter_(1, order, span)


def top_columns(confidence: torch.Tensor, candidates: torch.Tensor, counts) -> torch.Tensor:
    """(B, L) bool: the `counts[r]` most confident candidates of each row."""
    return (rank_by_confidence(confidence) < counts[:, None]) & candidates


def confident_columns(
    confidence: torch.Tensor,
    candidates: torch.Tensor,
    threshold: float,
    counts: torch.Tensor | None = None,
    inclusive: bool = False,
) -> torch.Tensor:
    """(B, L) bool: the one threshold rule (Fast-dLLM, arXiv 2505.22618; SDAR's
    low_confidence_dynamic; LLaDA2.x's generate): every candidate past `threshold` when at
    least `counts[r]` pass, else the `counts[r]` most confident (None: k = 1, by argmax).
    `inclusive`: Fast-dLLM's `>=` (SDAR's and LLaDA2.x's `>` otherwise). `confidence` is -inf
    off the candidates.
    """
    passed = confidence >= threshold if inclusive else confidence > threshold  # (B, L)
    if counts is None:
        # The best is the leftmost maximum (argmax's first), as ranking would pick it. A row
        # without candidates has its column 0 marked here, which the caller's guard cuts.
        best = confidence.argmax(dim=1, keepdim=True)  # (B, 1)
        return passed.scatter_(1, best, True)
    passed &= candidates
    enough = passed.sum(dim=1, keepdim=True) >= counts[:, None]  # (B, 1)
    return torch.where(enough, passed, top_columns(confidence, candidates, counts))
