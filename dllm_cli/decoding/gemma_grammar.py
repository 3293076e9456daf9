"""DiffusionGemma's structured output: each finished canvas chosen left to right under a grammar.

transformers' loop denoises a canvas with no masks and no commit order (gemma_loop.py), so no
grammar can verify its steps; what it keeps of a canvas is the argmax of the committing step's
processed logits. Under a grammar dllm keeps, instead, that argmax where the grammar allows it
and, at the first column it does not, the most likely token the grammar allows there, then goes
on from that column (llguidance: `try_consume_tokens`, then the masked argmax). Once the grammar
is complete (a stop token consumed) the rest of the answer is EOS. The next canvas is denoised
after the kept one, and its row's matcher goes on from where this one ended. Rows without a
grammar, or with the grammar the argmax already satisfies, keep transformers' tokens.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dllm_cli.decoding.grammar import Grammar, GrammarVocab, next_tokens


class CanvasGrammar:
    """The grammars of a DiffusionGemma engine's requests: `bind(rid, grammar)` (the server),
    `default` for every other request (the CLI); `matchers` makes a batch's, `choose` applies
    them to a finished canvas."""

    def __init__(self, vocab: GrammarVocab, default: Grammar | None, eos: int):
        self.vocab, self.default, self.eos = vocab, default, eos
        self.bound: dict[int, Grammar] = {}  # request id -> its grammar, until its batch starts
        self.masked = 0  # tokens the grammar chose over the model's argmax (lifetime)

    def bind(self, rid: int, grammar: Grammar) -> None:
        """Request `rid` decodes under `grammar` (call before its batch starts)."""
        self.bound[rid] = grammar

    def matchers(self, rids: list[int]) -> list[Any]:
        """One matcher per batch row (None: unconstrained), from its request's grammar."""
        grammars = [self.bound.pop(rid, self.default) for rid in rids]
        return [None if g is None else self.vocab.matcher(g) for g in grammars]

    def choose(self, matchers: list[Any], canvas: torch.Tensor, logits: torch.Tensor):
        """The finished (B, L) canvas with each constrained row's tokens chosen under its
        grammar from the (B, L, V) logits that committed it (module doc)."""
        rows = [b for b, m in enumerate(matchers) if m is not None]
        if not rows:
            return canvas
        out = canvas.clone()
        host = canvas[rows].tolist()
        for b, tokens in zip(rows, host, strict=True):
            chosen = self.walk(matchers[b], tokens, logits[b])
            out[b] = torch.tensor(chosen, dtype=canvas.dtype, device=canvas.device)
        return out

    def walk(self, matcher, tokens: list[int], logits: torch.Tensor) -> list[int]:
        """One row: the argmax run the grammar accepts, the masked argmax where it stops."""
        out: list[int] = []
        while len(out) < len(tokens):
            if matcher.is_stopped():  # complete: the answer ends here
                return out + [self.eos] * (len(tokens) - len(out))
            at = len(out)
            run = matcher.try_consume_tokens(tokens[at:])
            out += tokens[at : at + run]
            if len(out) == len(tokens) or matcher.is_stopped():
                continue
            allowed = torch.from_numpy(next_tokens(matcher, self.vocab))  # (words * 32,)
            width = min(allowed.numel(), logits.shape[-1])
            if not bool(allowed[:width].any()):  # nothing may follow: keep the model's tokens
                return out + tokens[at:]
            row = torch.full_like(logits[at], -math.inf)
            row[:width] = torch.where(allowed[:width], logits[at, :width], -math.inf)
            token = int(row.argmax())
            if not matcher.consume_token(token):
                raise RuntimeError(f"grammar matcher: {matcher.get_error()}")
            out.append(token)
            self.masked += 1
        return out
