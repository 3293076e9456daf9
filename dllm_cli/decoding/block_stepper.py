"""The block-causal stepper (SDAR, LLaDA2.x): per-row block canvases, an exact block KV cache.

Per request, as the references decode one prompt (SDAR generate.py `block_diffusion_generate`,
LLaDA2.x `generate`): the canvas is the prompt then masks up to whole blocks; the prompt's
whole blocks are prefilled once under the block-causal mask; each step forwards only a row's
active block against the cached K/V of every earlier block (exact: a finished block never sees
later ones). A block with no masks left (LLaDA2.1: whose edits have settled) has its K/V
written by one forward of its final tokens, riding with the next block's first step. A row
ends after its last block, or at its first stop token with no mask before it (early_stop).
Every row is at its own block, so continuous admission serves these models like the others.
`cache = "none"` recomputes every earlier block each step instead (LLaDA2.x's own loop).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType

import torch

from dllm_cli.cache import KVCache
from dllm_cli.decoding import block_rules, block_step
from dllm_cli.decoding.answer import answer_tokens
from dllm_cli.decoding.block_step import BlockRow
from dllm_cli.decoding.request import Request
from dllm_cli.decoding.sampling import Sampler, sampler_rule_of
from dllm_cli.decoding.shard_summaries import VocabPart
from dllm_cli.decoding.sharded_sampling import block_drafter
from dllm_cli.decoding.slots import Admission
from dllm_cli.errors import SettingsError
from dllm_cli.families import family_of_model
from dllm_cli.settings import DecodeSettings


class BlockStepper:
    """Block-causal decodes, one canvas per row, over an exact block KV cache of `slots` rows."""

    whole_batches = False
    batch_wide: Mapping[str, str] = MappingProxyType(
        {
            "stop": "its early stop is the model's stop tokens",
            "confidence": "its rules rank the drafted tokens' probabilities",
        }
    )
    who = "the block-causal decoder (SDAR, LLaDA2)"
    canvas = None  # no shared canvas: every row has its own

    def __init__(
        self,
        model,
        special,
        settings: DecodeSettings,
        committer,
        admission: Admission,
        slots: int,
        *,
        lockstep: bool | None = None,  # (no choice here: every row walks its own blocks)
    ):
        family = family_of_model(model)
        if committer is not None and not committer.walks_blocks:
            raise SettingsError(f"a guide model does not apply to {family.title}")
        if committer is not None and settings.edit_threshold is not None:
            raise SettingsError(
                "a grammar cannot follow LLaDA2.1's token editing (an edit would change tokens "
                "the grammar has read): drop --edit-threshold"
            )
        self.committer = committer  # a grammar (structured output: grammar_committer.py)
        self.rule = block_rules.check_block_settings(settings, family)
        self.family, self.rules = family, {settings.gen_length: self.rule}  # by gen_length
        self.settings, self.model, self.special, self.slots = settings, model, special, slots
        self.vocabulary = model.get_input_embeddings().num_embeddings
        self.cached = settings.cache == "prefix"
        self.device = next(model.parameters()).device
        self.real_vocab = special.real_vocab(model.vocab_size)
        self.stop_ids = torch.tensor(special.stop, device=self.device)
        self.kept_part: VocabPart | None = None  # logprobs read whole distributions
        if model.shards is None:
            self.drafter = Sampler(
                settings, sampler_rule_of(model), self.real_vocab, special.mask
            ).drafts
        else:  # a tensor-parallel rank drafts from its vocabulary shard (models/sharding.py)
            grammar = committer is not None  # it reads the shard's part of each distribution
            self.drafter = block_drafter(model, settings, self.real_vocab, special.mask, grammar)
            if grammar:  # logprobs then read that part too (logprobs.write)
                self.kept_part = VocabPart.of(model, self.real_vocab)
        self.rows: list[BlockRow] = []  # the live rows, in the engine's order
        self.cache: KVCache | None = None  # `slots` rows, a scratch column for padding
        self.forwards = 0  # forwards so far, prefills included (for the events)

    # --- the Stepper protocol ----------------------------------------------------------------
    def room(self, gen_length: int) -> int:
        """Context positions an answer of gen_length takes."""
        return gen_length

    def place(self, live: list[Request], new: list[Request], order: list[int], at: int) -> int:
        """New rows (their prompts' whole blocks prefilled into the cache)."""
        fresh = [self._row(r) for r in new]
        forwards = 0
        if self.cached:
            self._reserve(max(r.blocks for r in fresh) * self.rule.block)
            forwards = self._prefill([r for r in fresh if r.block > 0])
        merged = self.rows + fresh
        self.rows = [merged[i] for i in order]
        self.forwards += forwards
        return forwards

    plan, forward, commit = block_step.plan, block_step.forward, block_step.commit  # `e`: self

    def keep(self, live: list[Request], kept: list[int]) -> None:
        self.rows = [self.rows[i] for i in kept]

    def move_on(self, live: list[Request]) -> None:
        """Rows move on inside commit (each row is at its own block)."""

    def progress(self, live: list[Request], i: int) -> list[int]:
        """Row i's committed answer so far, up to its first mask or stop token (LLaDA2.1:
        before its active block, which edits may still change)."""
        row, editing = self.rows[i], self.rule.edit_threshold is not None
        end = max(0, row.block * self.rule.block - row.prompt) if editing else None
        tokens = self.answer(row)[:end].tolist()
        first = tokens.index(self.special.mask) if self.special.mask in tokens else len(tokens)
        return answer_tokens(tokens[:first], self.special.stop)

    def answer(self, row: BlockRow) -> torch.Tensor:
        return row.x[row.prompt : row.prompt + row.request.sampling.gen_length]

    def rule_for(self, gen_length: int) -> block_rules.BlockRule:
        """The rule of rows of this gen_length: their own steps per block (checked at `add`)."""
        if gen_length not in self.rules:
            own = replace(self.settings, gen_length=gen_length)
            self.rules[gen_length] = block_rules.check_block_settings(own, self.family)
        return self.rules[gen_length]

    # --- rows and the cache ------------------------------------------------------------------
    def _row(self, request: Request) -> BlockRow:
        b, n, g = self.rule.block, len(request.prompt), request.sampling.gen_length
        blocks = -(-(n + g) // b)
        x = torch.full((blocks * b,), self.special.mask, dtype=torch.long, device=self.device)
        x[:n] = torch.tensor(request.prompt, device=self.device)
        marks = torch.full_like(x, -1)
        return BlockRow(request, request.slot, x, marks, n, blocks, n // b, rule=self.rule_for(g))

    def _reserve(self, width: int) -> None:
        """Cache room for `width` columns in every slot (grown, never shrunk)."""
        if self.cache is None:
            self.cache = KVCache.for_model(self.model, self.slots, width, scratch=True)
        elif self.cache.width < width:
            self.cache = self.cache.pad(right=width - self.cache.width)

    def _prefill(self, rows: list[BlockRow]) -> int:
        """One block-causal forward over the new rows' whole prompt blocks, which writes their
        K/V into the cache (a shorter row's padding columns are rewritten before any read)."""
        if not rows:
            return 0
        lengths = [r.block * self.rule.block for r in rows]
        ids, keys = block_step.windows(self, rows, lengths)  # (R, W), (R, W, W)
        cache = block_step.rows_view(self, rows, max(lengths))
        self.model(ids, None, cache, keys, slice(0, max(lengths)), logits_slice=slice(0, 0))
        for r, n in zip(rows, lengths, strict=True):
            r.cached = n
            r.request.forwards += 1  # (the engine counts the forward itself)
        return 1
