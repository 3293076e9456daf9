"""The block-causal engine (SDAR, LLaDA2.x): requests, slots and an exact block KV cache.

Per request, as the references decode one prompt (SDAR generate.py `block_diffusion_generate`,
LLaDA2.x `generate`): the canvas is the prompt then masks up to whole blocks; the prompt's
whole blocks are prefilled once under the block-causal mask; the block holding the prompt's
tail (or the next one) is active, and each step forwards only the active block against the
cached K/V of every earlier block (exact: a finished block never sees later ones). When a
block has no masks left (LLaDA2.1: and its edits have settled) one forward of its final
tokens writes its K/V (LLaDA2.1's settling check is that forward), and the next block is
active. A row ends after its last block, or at its first stop token once no mask is left
before it (early_stop; LLaDA2.1: once its block has settled).

Every row is at its own block, so continuous admission serves these models like the others:
a step admits (and prefills) new rows, then one forward serves every live row's block.
`cache = "none"` recomputes every earlier block each step instead (LLaDA2.x's own loop).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from dllm_cli.decoding import block_rules
from dllm_cli.decoding.answer import answer_tokens
from dllm_cli.decoding.block_step import block_step
from dllm_cli.decoding.request import Request, RequestQueue, Status, canvas_prompt, check_slots
from dllm_cli.decoding.slots import ADMISSIONS
from dllm_cli.decoding.step import StepOutput
from dllm_cli.errors import SettingsError
from dllm_cli.families import family_of_model, with_family_defaults
from dllm_cli.lifetimes import Sampling, request_sampling
from dllm_cli.models.block import BlockContext, block_causal


@dataclass
class BlockRow:
    """One request's canvas and place: its block, steps in it, what the cache holds."""

    request: Request
    slot: int
    x: torch.Tensor  # (nb B,) prompt, then masks to whole blocks
    marks: torch.Tensor  # (nb B,) engine step that last wrote each column, -1
    prompt: int  # P
    blocks: int  # nb
    block: int  # the active block
    cached: int = 0  # columns whose K/V the cache holds (whole blocks)
    step: int = 0  # steps taken in the active block
    post: int = 0  # LLaDA2.1: steps of the active block after its masks were filled
    store: bool = False  # the next forward writes the active block's final K/V


class BlockEngine(RequestQueue):
    """add / step / abort over block-causal decodes in `slots` slots."""

    def __init__(
        self, model, special, settings, committer=None, *, slots=8, admission="continuous", **_
    ):
        family = family_of_model(model)
        if committer is not None:
            raise SettingsError(f"a guide model does not apply to {family.title}")
        check_slots(slots)
        if admission not in ADMISSIONS:
            raise SettingsError(f"admission must be one of {', '.join(ADMISSIONS)}")
        settings = with_family_defaults(settings, model.family)
        self.rule = block_rules.check_block_settings(settings, family)
        self.settings, self.model, self.special, self.slots = settings, model, special, slots
        self.admission = ADMISSIONS[admission]
        self.cached = settings.cache == "prefix"
        self.device = next(model.parameters()).device
        self.real_vocab = special.real_vocab(model.vocab_size)
        self.stop_ids = torch.tensor(special.stop, device=self.device)
        self.table = model.get_input_embeddings().num_embeddings
        super().__init__()  # the queue and requests by id
        self.live: list[BlockRow] = []
        self.kv: list[list[torch.Tensor]] | None = None  # per layer [k, v] (slots, H, S, D)
        self.steps = self.forwards = self.guide_forwards = self.served = 0
        self.seconds = self.guide_seconds = 0.0
        self.canvas = None  # no shared canvas: every row has its own

    # --- the public interface --------------------------------------------------------------
    def add(self, prompt: list[int], key: Any = None, settings=None, sampling=None) -> int:
        """Queue a prompt; its id. A prompt that cannot decode is refused here (InputError).
        `sampling` / `settings`: the request's own temperature, top_p, top_k, seed (as Engine)."""
        own = Sampling.of(self.settings)
        if settings is not None or sampling is not None:
            own = request_sampling(self.settings, self.model.family, settings, sampling)
        if own.stop:
            raise SettingsError(
                "stop ids per request: not supported by the block-causal engine (SDAR, LLaDA2); "
                "its early stop is the model's stop tokens"
            )
        if own.confidence != self.settings.confidence:
            raise SettingsError(
                "confidence per request: not supported by the block-causal engine (SDAR, "
                "LLaDA2), whose rules rank the drafted tokens' probabilities"
            )
        ids = canvas_prompt(prompt, self.settings.gen_length, self.model.context_length, self.table)
        return self.enqueue(ids, key, own)

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    @property
    def running(self) -> int:
        return sum(r.request.status is Status.RUNNING for r in self.live)

    def progress(self, rid: int) -> list[int]:
        """A running request's committed answer so far, up to its first mask or stop token."""
        row = next((r for r in self.live if r.request.id == rid), None)
        if row is None or row.request.status is not Status.RUNNING:
            return []
        end = row.block * self.rule.block  # edits may still change the active block
        tokens = self.answer(row)[
            : None if self.rule.edit_threshold is None else max(0, end - row.prompt)
        ]
        tokens = tokens.tolist()
        first = tokens.index(self.special.mask) if self.special.mask in tokens else len(tokens)
        return answer_tokens(tokens[:first], self.special.stop)

    def step(self) -> StepOutput:
        """Admit (and prefill) waiting requests, then one forward of every live row's block."""
        began = time.perf_counter()
        with torch.inference_mode():
            self.live = [r for r in self.live if r.request.status is not Status.ABORTED]
            self._admit()
            out = block_step(self) if self.live else StepOutput(-1)
        self.seconds += time.perf_counter() - began
        return out

    def answer(self, row: BlockRow) -> torch.Tensor:
        return row.x[row.prompt : row.prompt + self.settings.gen_length]

    # --- admission -------------------------------------------------------------------------
    def _admit(self) -> None:
        if not self.queue or (self.admission.whole_batches and self.live):
            return
        taken = {r.slot for r in self.live}
        free = [i for i in range(self.slots) if i not in taken]
        new = [self._row(self.queue.popleft(), slot) for slot in free[: len(self.queue)]]
        if not new:
            return
        if self.cached:
            self._reserve(max(r.blocks for r in new) * self.rule.block)
            self._prefill([r for r in new if r.block > 0])
        self.live = sorted(self.live + new, key=lambda r: r.slot)

    def _row(self, request: Request, slot: int) -> BlockRow:
        b, n = self.rule.block, len(request.prompt)
        blocks = -(-(n + self.settings.gen_length) // b)
        x = torch.full((blocks * b,), self.special.mask, dtype=torch.long, device=self.device)
        x[:n] = torch.tensor(request.prompt, device=self.device)
        marks = torch.full_like(x, -1)
        request.admit(self.steps)
        request.generator = torch.Generator(device=self.device).manual_seed(request.sampling.seed)
        return BlockRow(request, slot, x, marks, n, blocks, block=n // b)

    def _reserve(self, width: int) -> None:
        """Cache room for `width` columns in every slot (grown, never shrunk)."""
        have = 0 if self.kv is None else self.kv[0][0].shape[2]
        if have >= width:
            return
        n_layers, n_kv, head_dim = self.model.kv_shape()
        p = next(self.model.parameters())
        shape = (self.slots, n_kv, width, head_dim)
        fresh = [
            [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(2)]
            for _ in range(n_layers)
        ]
        if self.kv is not None:
            for new, old in zip(fresh, self.kv, strict=True):
                for a, b in zip(new, old, strict=True):
                    a[:, :, :have] = b
        self.kv = fresh

    def _prefill(self, rows: list[BlockRow]) -> None:
        """One block-causal forward over the new rows' whole prompt blocks; their K/V cached."""
        if not rows:
            return
        b = self.rule.block
        lengths = [r.block * b for r in rows]
        width = max(lengths)
        ids = torch.full((len(rows), width), self.special.pad, dtype=torch.long, device=self.device)
        for i, (r, n) in enumerate(zip(rows, lengths, strict=True)):
            ids[i, :n] = r.x[:n]
        valid = (
            torch.arange(width, device=self.device)[None]
            < torch.tensor(lengths, device=self.device)[:, None]
        )
        own = block_causal(width, b, self.device)[None] & valid[:, None, :]
        ctx = BlockContext(self_mask=own)
        self.model(ids, None, ctx, logits_slice=slice(0, 0))
        self.forwards += 1
        for i, (r, n) in enumerate(zip(rows, lengths, strict=True)):
            self.write(ctx, i, r, 0, n)
            r.cached = n
            r.request.forwards += 1

    def write(self, ctx: BlockContext, i: int, row: BlockRow, start: int, end: int, at=0) -> None:
        """Batch row i's fresh K/V (its own columns from `at`) into cache columns [start, end)."""
        for layer, (k, v) in zip(self.kv, ctx.fresh, strict=True):
            layer[0][row.slot, :, start:end] = k[i, :, at : at + end - start]
            layer[1][row.slot, :, start:end] = v[i, :, at : at + end - start]
