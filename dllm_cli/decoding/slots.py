"""Slots: the rows decoding side by side, their canvas and KV cache, and who may take one.

| admission  | admits                                   | rows walk blocks | canvas, cache        |
|------------|------------------------------------------|------------------|----------------------|
| static     | only when every slot is free (a batch)   | in lockstep      | per batch, exact     |
| continuous | into any free slot, on the next step     | each on its own  | once, for the slots  |

Static is how LLaDA and Fast-dLLM decode a batch: a canvas exactly as wide as its longest
prompt, a freshly seeded generator per batch. Continuous batching keeps one canvas and one KV
cache of B slots: its prompt width is the longest prompt seen, rounded up to `quantum` columns
(a longer prompt shifts every row right), its answer width likewise the longest gen_length; a
finished row's cache row takes the next prompt. Rows are left-padded and RoPE positions count
from each row's first token, so a row decodes as it would alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm_cli.decoding.canvas import Canvas
from dllm_cli.families import batching_reason, family_of_model

QUANTUM = 64  # continuous batching: prompt width grows in steps of this many columns


@dataclass(frozen=True)
class Admission:
    """When waiting requests take free slots, and what a batch keeps between them."""

    name: str
    whole_batches: bool  # admit only into an empty engine (every slot free)
    lockstep: bool  # rows of a batch leave a block together (unmasking rules)
    quantum: int  # prompt width rounding (1: exactly the longest prompt)


ADMISSIONS: dict[str, Admission] = {
    "static": Admission("static", whole_batches=True, lockstep=True, quantum=1),
    "continuous": Admission("continuous", whole_batches=False, lockstep=False, quantum=QUANTUM),
}


def empty_canvas(width: int, gen_length: int, mask_id: int, device) -> Canvas:
    """A canvas of no rows, prompt width `width`."""
    none = torch.zeros(0, dtype=torch.long, device=device)
    ids = torch.zeros((0, width + gen_length), dtype=torch.long, device=device)
    steps = torch.zeros((0, gen_length), dtype=torch.long, device=device)
    return Canvas(ids, none, none.clone(), steps, width, mask_id)


def pad_canvas(c: Canvas, pad_id: int, left: int = 0, right: int = 0) -> Canvas:
    """The canvas with `left` more padding columns before every row (prompt width + left) and
    `right` more after (room for a longer answer; each row's own still ends where it did)."""
    if left == right == 0:
        return c
    ids = torch.nn.functional.pad(c.ids, (left, right), value=pad_id)
    marks = torch.nn.functional.pad(c.marks, (0, right), value=-1)
    return Canvas(ids, c.pad + left, c.request_ids, marks, c.prompt_width + left, c.mask_id)


def cat_canvases(a: Canvas, b: Canvas) -> Canvas:
    """Rows of `a` then rows of `b` (same prompt width)."""
    parts = [
        torch.cat([getattr(a, f), getattr(b, f)]) for f in ("ids", "pad", "request_ids", "marks")
    ]
    return Canvas(*parts, a.prompt_width, a.mask_id)


def static_reason(model) -> str | None:
    """Why a decode must run as static batches (None: continuous batching serves it): only the
    family says (DiffusionGemma); guidance never does (the guide's cache takes rows as they come)."""
    return batching_reason(family_of_model(model))
