"""Where an answer ends, defined once: at its first stop token (EOS, or end-of-turn).

Lists for finished answers (text, token counts, the live view), a tensor test for rows still
being decoded (early stop). Throughput counts `answer_length` tokens: up to and including the
stop token (the EOS filling after it does not count), or every position when there is none.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def answer_end(tokens: Sequence[int | None], stop: Iterable[int]) -> int:
    """Index of the first stop token; len(tokens) when there is none (None: not yet decoded)."""
    stops = set(stop)
    return next((i for i, t in enumerate(tokens) if t in stops), len(tokens))


def answer_tokens(tokens: Sequence[int], stop: Iterable[int]) -> list[int]:
    """The answer's tokens: those before the first stop token (the text a user sees)."""
    return list(tokens[: answer_end(tokens, stop)])


def answer_length(tokens: Sequence[int], stop: Iterable[int]) -> int:
    """Tokens the answer took to generate: through its first stop token (all without one)."""
    return min(answer_end(tokens, stop) + 1, len(tokens))


def first_stop(answer: torch.Tensor, stop_ids: torch.Tensor, mask_id: int) -> torch.Tensor:
    """(B,) position of each row's first stop token if everything before it is committed (its
    text is final), else G; `stop_ids`: (K,) for every row, or (B, K) each row's (-1 padded)."""
    g = answer.shape[1]
    span = torch.arange(g, device=answer.device)[None]
    if stop_ids.dim() == 2:  # (B, K): each row's own stop ids (-1 padded)
        hit = (answer[:, :, None] == stop_ids[:, None, :]).any(dim=-1)
    else:
        hit = torch.isin(answer, stop_ids)
    stop_at = torch.where(hit, span, g).min(dim=1).values
    mask_at = torch.where(answer == mask_id, span, g).min(dim=1).values
    return torch.where(mask_at > stop_at, stop_at, torch.full_like(stop_at, g))
