"""The canvas: left-padded prompts followed by each row's gen_length masks, cut into blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dllm_cli.errors import InputError
from dllm_cli.settings import split_blocks


@dataclass(frozen=True)
class Block:
    """One block of the answer: canvas columns [start, end) and the steps it may take."""

    index: int
    start: int  # canvas column
    end: int
    steps: int

    @property
    def length(self) -> int:
        return self.end - self.start


def plan_blocks(prompt_width: int, gen_length: int, block_length: int, steps: int) -> list[Block]:
    """Blocks left to right in canvas columns, steps split as `settings.split_blocks` says."""
    blocks, start = [], prompt_width
    for b, (length, k) in enumerate(split_blocks(gen_length, block_length, steps)):
        blocks.append(Block(b, start, start + length, k))
        start += length
    return blocks


def check_prompts(prompts: list[list[int]], gen_length: int, context: int) -> None:
    """Refuse empty prompts and canvases the model cannot hold."""
    if not prompts:
        raise InputError("no prompts to decode")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise InputError(f"prompt {i} is empty (a prompt needs at least one token)")
        if len(p) + gen_length > context:
            raise InputError(
                f"prompt {i} ({len(p)} tokens) + gen_length ({gen_length}) exceeds the "
                f"model's context of {context} tokens"
            )


def check_token_ids(prompts: list[list[int]], table: int) -> None:
    """Prompt ids must index the embedding table."""
    for i, p in enumerate(prompts):
        bad = [t for t in p if not 0 <= t < table]
        if bad:
            raise InputError(
                f"prompt {i} has token id {bad[0]} outside the vocabulary (0..{table - 1})"
            )


@dataclass
class Canvas:
    """Token ids of the rows still decoding, left-padded (`pad[r]` columns) so every answer
    starts at one column; RoPE skips the padding and no key reads it: a row decodes as alone."""

    ids: torch.Tensor  # (B, S) long
    pad: torch.Tensor  # (B,) long: left padding per row
    request_ids: torch.Tensor  # (B,) long: each canvas row's request (a static batch: its index)
    marks: torch.Tensor  # (B, G) long: step that committed each answer position (-1: not yet)
    prompt_width: int  # P: first answer column
    mask_id: int
    any_pad: bool | None = None  # host copy of `(pad > 0).any()` (None: not known, ask)
    # Index tensors that depend only on `pad` and the shape (never written in place), built
    # once per canvas instead of once per step: the canvas is replaced when its rows change.
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(
        cls,
        prompts: list[list[int]],
        gen_length: int,
        mask_id: int,
        pad_id: int,
        device,
        lengths: list[int] | None = None,
    ) -> Canvas:
        """Rows of `gen_length` answer columns; a row whose own length (`lengths`) is shorter
        holds padding after its answer (never computed or attended: its canvas ends there)."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width + gen_length), mask_id, dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, : width - len(p)] = pad_id
            ids[r, width - len(p) : width] = torch.tensor(p, dtype=torch.long)
            ids[r, width + (gen_length if lengths is None else lengths[r]) :] = pad_id
        pad = torch.tensor([width - len(p) for p in prompts], dtype=torch.long)
        request_ids = torch.arange(len(prompts))
        marks = torch.full((len(prompts), gen_length), -1, dtype=torch.long)
        padded = any(len(p) < width for p in prompts)
        return cls(*(t.to(device) for t in (ids, pad, request_ids, marks)), width, mask_id, padded)

    @property
    def batch(self) -> int:
        return self.ids.shape[0]

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    @property
    def padded(self) -> bool:
        if self.any_pad is None:
            self.any_pad = bool((self.pad > 0).any())  # a device read; the engine knows
        return self.any_pad

    def _kept(self, name: str, build):
        """`build()` once per canvas (callers must not write into the tensor it returns)."""
        if name not in self._memo:
            self._memo[name] = build()
        return self._memo[name]

    def columns(self) -> torch.Tensor:
        """(S,) canvas column indices."""
        return self._kept("columns", lambda: torch.arange(self.width, device=self.ids.device))

    def positions(self) -> torch.Tensor:
        """RoPE positions (B, S): column minus the row's padding (padding itself sits at 0)."""
        return self._kept(
            "positions", lambda: (self.columns()[None] - self.pad[:, None]).clamp(min=0)
        )

    def key_mask(self) -> torch.Tensor | None:
        """(B, S) True where a key may be attended; None when no row is padded (faster SDPA)."""
        if not self.padded:
            return None
        return self._kept("keys", lambda: self.columns()[None] >= self.pad[:, None])

    def prompt_mask(self) -> torch.Tensor:
        """(B, S) True on real prompt tokens (what classifier-free guidance masks out)."""
        cols = self.columns()[None]
        return self._kept(
            "prompt", lambda: (cols >= self.pad[:, None]) & (cols < self.prompt_width)
        )

    def masked(self, block: Block) -> torch.Tensor:
        """(B, L) True where the block still holds a mask."""
        return self.ids[:, block.start : block.end] == self.mask_id

    def answer(self) -> torch.Tensor:
        return self.ids[:, self.prompt_width :]  # (B, G)

    def select(self, keep: torch.Tensor) -> Canvas:
        """Only the canvas rows in `keep` (indices into the current rows)."""
        picked = (t[keep] for t in (self.ids, self.pad, self.request_ids, self.marks))
        return Canvas(*picked, self.prompt_width, self.mask_id)
