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
