"""Structured output's commit: a grammar (llguidance) verifies the drafts in front of it.

The grammar stands where guided decoding's AR guide stands (guided.py): every row walks its
frontier, its first masked column. Each step the row's matcher accepts the longest run `a` of
its drafts; `min(a, r)` are committed (`r`: the unmask rule's run); where the rule wanted more,
the first rejected column takes the grammar-masked argmax (or sample) of its distribution; then
the tokens the grammar forces are committed as far as the drafts reach (fast-forward). A stop
token is a grammar token: allowed only where the grammar accepts, forced once it is complete.
docs/structured-output.md has the steps and their costs.

Each row's matcher is keyed by its request id (the canvas's `rows`), made when the request
first appears in a step and dropped when it no longer does (no engine hook).
`bind(rid, grammar)` gives a request its own grammar (the server), `default` serves every
other row (the CLI); a row with neither is unconstrained but still walks its frontier.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from dllm_cli.decoding.gemma_grammar import CanvasGrammar
from dllm_cli.decoding.grammar import (
    Grammar,
    GrammarError,
    GrammarVocab,
    next_tokens,
    vocab_of,
)
from dllm_cli.decoding.row_sampling import RowDraws
from dllm_cli.decoding.sampling import sampler_rule_of
from dllm_cli.decoding.shard_summaries import WHOLE, VocabPart
from dllm_cli.decoding.unmask import Committer, Decision, RuleCommitter, StepContext
from dllm_cli.families import family_of_model, with_family_defaults


class GrammarCommitter(Committer):
    """A frontier-walking `Committer`: each row's grammar (its matcher, by request id) verifies
    its drafts (module doc); `rule`: how far the unmask rule would commit unconstrained."""

    frontier = True
    greedy_drafts = False  # drafts are sampled as the request samples
    needs_probs = True  # a rejected column's masked token comes from its distribution
    walks_blocks = True  # the block stepper walks each row's active block through `walk`

    def __init__(
        self,
        rule: Committer,
        vocab: GrammarVocab,
        tempered: bool,
        default: Grammar | None = None,
        fast_forward: bool = True,
        part: VocabPart = WHOLE,
    ):
        if rule.needs_shadow or rule.redrafts:
            raise GrammarError(
                "a grammar cannot follow an unmask rule that re-masks or re-drafts its "
                "commits (wino, credit): use threshold, factor, fixed, eb, klass or prefix"
            )
        self.rule, self.vocab, self.default = rule, vocab, default
        self.reads_entropy, self.reads_kl = rule.reads_entropy, rule.reads_kl  # (its rule's)
        self.tempered = tempered  # the distributions are already tempered (Dream's sampler)
        self.fast_forward = fast_forward  # commit the tokens the grammar forces after a run
        self.part = part  # which vocabulary ids the step's distributions hold
        self.bound: dict[int, Grammar] = {}  # request id -> its grammar, until it appears
        self.matchers: dict[int, Any] = {}  # request id -> its llguidance matcher
        self.masked = 0  # tokens the grammar chose over a rejected draft (lifetime)
        self.forced = 0  # tokens committed because the grammar allowed nothing else (lifetime)

    def leave(self, requests: list[int]) -> None:
        self.rule.leave(requests)  # (its matchers go when their rows no longer appear)

    def shard(self, sampler) -> None:
        self.rule.shard(sampler)  # (a KLASS rule's sampler keeps its shards in its memory)

    def bind(self, rid: int, grammar: Grammar) -> None:
        """Request `rid` decodes under `grammar` (call before its first step)."""
        self.bound[rid] = grammar

    def __call__(self, ctx: StepContext) -> Decision:
        runs = self.rule(ctx).commit.bool() & ctx.candidates  # (B, L)
        wanted = runs.long().cumprod(dim=1).sum(dim=1).clamp(min=1)  # (B,) the rule's run
        counts = ctx.candidates.sum(dim=1)  # (B,) drafts from the frontier
        draws = ctx.generator if isinstance(ctx.generator, RowDraws) else None
        tokens, corrected, lengths, accepted = self.walk(
            ctx.canvas.request_ids, counts, wanted, ctx.drafts, ctx.probs, draws
        )
        slots = torch.arange(ctx.drafts.shape[1], device=ctx.drafts.device)[None]
        commit = (slots < lengths[:, None]) & ctx.candidates
        return Decision(commit, accepted=accepted, tokens=tokens, corrected=corrected & commit)

    def walk(self, rids, counts, wanted, drafts, probs, draws: RowDraws | None):
        """Each row's run from its frontier as the grammar allows (`drafts` (B, L) and `probs`
        (B, L, V) from the frontier, `counts` (B,) of them masks, the rule's run `wanted` (B,)):
        tokens (B, L), the columns the grammar chose, each row's run (B,), the drafts accepted."""
        host = torch.cat([rids[:, None], counts[:, None], wanted[:, None], drafts], 1)
        table = host.tolist()  # the step's read of the drafts
        matchers = self._matchers([row[0] for row in table])
        plans = [
            verify(m, row[3 : 3 + row[1]], row[2]) for m, row in zip(matchers, table, strict=True)
        ]
        tokens = drafts.clone()
        corrected = torch.zeros(drafts.shape, dtype=torch.bool, device=drafts.device)
        lengths = self._fix(probs, draws, plans, matchers, tokens, corrected)
        if self.fast_forward:
            rooms = [row[1] - n for row, n in zip(table, lengths, strict=True)]
            self._forced(matchers, rooms, lengths, tokens, corrected)
        accepted = sum(n for n, _ in plans)
        return tokens, corrected, torch.tensor(lengths, device=drafts.device), accepted

    def _fix(self, probs, draws, plans, matchers, tokens, corrected) -> list[int]:
        """Rows whose run stopped at a rejection take the masked token there; each row's run."""
        fixes = [r for r, (_, fix) in enumerate(plans) if fix]
        if fixes:
            slots = [plans[r][0] for r in fixes]
            chosen = self._masked_tokens(probs, draws, fixes, slots, matchers)
            for r, token in zip(fixes, chosen, strict=True):
                tokens[r, plans[r][0]] = token
                corrected[r, plans[r][0]] = True
                if matchers[r] is not None:
                    matchers[r].consume_token(token)
            self.masked += len(fixes)
        return [n + bool(fix) for n, fix in plans]

    def _forced(self, matchers, rooms, lengths, tokens, corrected) -> None:
        """After each row's commit, the tokens its grammar forces, as far as its drafts reach."""
        for r, (m, room) in enumerate(zip(matchers, rooms, strict=True)):
            run = forced_tokens(m, room)
            if run:
                at = lengths[r]
                tokens[r, at : at + len(run)] = torch.tensor(run, device=tokens.device)
                corrected[r, at : at + len(run)] = True
                lengths[r] += len(run)
                self.forced += len(run)

    def _matchers(self, rids: list[int]) -> list:
        """Each row's matcher (None: unconstrained); departed requests' are dropped, and grammars
        bound to requests older than every live one (first come, first served: aborted)."""
        live, oldest = set(rids), min(rids)
        for rid in [r for r in self.matchers if r not in live]:
            del self.matchers[rid]
        for rid in [r for r in self.bound if r < oldest]:
            del self.bound[rid]
        out = []
        for rid in rids:
            if rid not in self.matchers:
                grammar = self.bound.pop(rid, self.default)
                self.matchers[rid] = None if grammar is None else self.vocab.matcher(grammar)
            out.append(self.matchers[rid])
        return out

    def _masked_tokens(self, probs, draws, rows: list[int], slots: list[int], matchers):
        """The grammar-masked argmax (or sample) at each row's first rejected slot; under
        tensor parallelism each rank scores its vocabulary shard (`part`)."""
        device, part = probs.device, self.part
        width = probs.shape[-1]  # the part's ids (one process: every real id)
        bits = np.stack([next_tokens(matchers[r], self.vocab) for r in rows])
        allow = part.ids(torch.from_numpy(bits).to(device), width, False)  # (F, V) bool
        index = torch.tensor(rows, device=device)
        probs = probs[index, torch.tensor(slots, device=device)].double()  # (F, V)
        # Allowed tokens the filters zeroed stay above disallowed ones (never -inf).
        scores = torch.where(allow, probs.log().clamp(min=-1e30), -math.inf)
        for j, r in enumerate(rows):
            t = 0.0 if draws is None else draws.samplings[r].temperature
            if t > 0:
                scale = 1.0 if self.tempered else t  # LLaDA's probs are softmax(raw logits)
                u = torch.rand(part.total or width, generator=draws.generators[r],
                               dtype=torch.float64, device=device)  # fmt: skip
                scores[j] = scores[j] / scale - torch.log(-torch.log(part.ids(u, width, 0.5)))
        top, best = part.best(scores)
        none = top == -math.inf  # a dead grammar (no allowed token): end the answer
        stop = torch.full_like(best, self.vocab.stops[0])
        return torch.where(none, stop, best).tolist()


class GuidedGrammarCommitter(Committer):
    """The grammar filters what the AR guide verifies (guided.py, FlashDLM): a row's drafts are
    cut at the first its grammar rejects (replaced by an id no token has, which the guide must
    reject), the guide chooses among the grammar's tokens only, then the forced run follows."""

    frontier = True

    def __init__(self, guide, grammar: GrammarCommitter):
        if guide.rules.on_reject != "guide":
            raise GrammarError(
                "a grammar with the AR guide needs on_reject = guide (the diffusion draft "
                "committed on a rejection would not follow the grammar)"
            )
        self.guide, self.grammar = guide, grammar
        self.draft_window = guide.draft_window
        self.start, self.select, self.admit = guide.start, guide.select, guide.admit
        self.bind = grammar.bind  # a request's own grammar, as GrammarCommitter.bind

    @property
    def forwards(self) -> int:
        return self.guide.forwards

    def __call__(self, ctx: StepContext) -> Decision:
        counts = ctx.candidates.sum(dim=1)  # (B,)
        table = torch.cat(
            [ctx.canvas.request_ids[:, None], counts[:, None], ctx.drafts], 1
        ).tolist()
        matchers = self.grammar._matchers([row[0] for row in table])
        runs = [row_masks(m, row[2 : 2 + row[1]], self.grammar.vocab) for m, row in
                zip(matchers, table, strict=True)]  # fmt: skip
        drafts, candidates = ctx.drafts.clone(), ctx.candidates.clone()
        width = max(1, *(len(masks) for _, masks in runs))
        vocab = self.grammar.vocab.words * 32
        allowed = np.ones((len(runs), width, vocab), dtype=bool)
        for r, (good, masks) in enumerate(runs):
            if masks:
                allowed[r, : len(masks)] = np.stack(masks)
            if good < table[r][1]:  # the first rejected draft: the guide must reject it
                drafts[r, good] = vocab
                candidates[r, good + 1 :] = False
        self.guide.allowed = torch.from_numpy(allowed).to(ctx.drafts.device)
        try:
            decision = self.guide(replace(ctx, drafts=drafts, candidates=candidates))
        finally:
            self.guide.allowed = None
        return self._consume(decision, matchers, [row[1] for row in table])

    def _consume(self, decision: Decision, matchers, counts: list[int]) -> Decision:
        """The matchers take the committed tokens, then the forced run is committed too."""
        taken = decision.commit.sum(dim=1)
        host = torch.cat([taken[:, None], decision.tokens], 1).tolist()
        tokens, corrected = decision.tokens.clone(), decision.corrected.clone()
        lengths = []
        for m, row in zip(matchers, host, strict=True):
            for token in row[1 : 1 + row[0]] if m is not None else ():
                if not m.is_stopped() and not m.consume_token(token):
                    raise RuntimeError(f"grammar matcher: {m.get_error()}")
            lengths.append(row[0])
        rooms = [n - k for n, k in zip(counts, lengths, strict=True)]
        self.grammar._forced(matchers, rooms, lengths, tokens, corrected)
        slots = torch.arange(tokens.shape[1], device=tokens.device)[None]
        commit = slots < torch.tensor(lengths, device=tokens.device)[:, None]
        decision.commit, decision.tokens, decision.corrected = commit, tokens, corrected & commit
        return decision


def row_masks(matcher, drafts: list[int], vocab: GrammarVocab) -> tuple[int, list[np.ndarray]]:
    """(the grammar's run of drafts, each slot's allowed tokens up to the first rejected one)."""
    if matcher is None or not drafts:
        return len(drafts), []
    good = 0 if matcher.is_stopped() else matcher.validate_tokens(drafts)
    masks = []
    for k in range(min(good + 1, len(drafts))):
        masks.append(next_tokens(matcher, vocab))
        if k < good:
            matcher.consume_token(drafts[k])
    if good:
        matcher.rollback(min(good, len(drafts)))
    return good, masks


def verify(matcher, drafts: list[int], wanted: int) -> tuple[int, bool]:
    """(drafts committed, whether the next slot takes a masked token) for one row; the matcher
    consumes the committed drafts, the caller the masked token."""
    if not drafts:
        return 0, False
    if matcher is None:  # unconstrained: the rule's run
        return min(wanted, len(drafts)), False
    if matcher.is_stopped():  # complete: nothing but a stop token may follow
        return 0, True
    good = matcher.validate_tokens(drafts)  # the longest run the grammar accepts
    take = min(good, wanted)
    if take and not matcher.consume_tokens(drafts[:take]):
        raise RuntimeError(f"grammar matcher: {matcher.get_error()}")
    return take, take < wanted and take < len(drafts)


def forced_tokens(matcher, room: int) -> list[int]:
    """Up to `room` tokens the grammar forces next (nothing else is allowed: llguidance's
    fast-forward tokens), consumed; [] for an unconstrained or complete row."""
    if matcher is None or room <= 0 or matcher.is_stopped():
        return []
    run = matcher.compute_ff_tokens()[:room]
    if run and not matcher.consume_tokens(run):
        raise RuntimeError(f"grammar matcher: {matcher.get_error()}")
    return run


def runtime_committer(
    runtime, default: Grammar | None = None, guided: bool = True, fast_forward: bool = True
) -> GrammarCommitter | CanvasGrammar:
    """The grammar committer for this runtime's model and settings, as its family's traits say
    a grammar steers it."""
    kind = family_of_model(runtime.loaded.model)
    return GRAMMAR_COMMITTERS[kind.traits.grammar](runtime, default, guided, fast_forward)


def frontier_committer(runtime, default, guided, fast_forward) -> GrammarCommitter:
    """A GrammarCommitter over the settings' unmask rule (the guide verifying what it allows)."""
    model = runtime.loaded.model
    settings = with_family_defaults(runtime.settings, model.family)
    family = sampler_rule_of(model)
    rule = RuleCommitter(settings, family.schedule)
    tempered = family.tempered_confidence
    # the ids its distributions span: the real vocabulary, or (the block families' draw) the
    # whole table, so a rank's slice of a sampled mask's noise is one process's
    real = runtime.loaded.special.real_vocab(model.vocab_size)
    part = VocabPart.of(
        model, model.get_input_embeddings().num_embeddings if family.whole_width else real
    )
    committer = GrammarCommitter(rule, vocab_of(runtime), tempered, default, fast_forward, part)
    if guided and runtime.guide is not None:  # the guide verifies what the grammar allows
        return GuidedGrammarCommitter(runtime.guide_committer(), committer)
    return committer


def canvas_grammar(runtime, default, guided, fast_forward) -> CanvasGrammar:
    """DiffusionGemma's: each finished canvas chosen under the grammar (it has no guide)."""
    return CanvasGrammar(vocab_of(runtime), default, runtime.loaded.special.eos)


# StepperTraits.grammar -> how that kind of decoder is given a grammar
GRAMMAR_COMMITTERS = {"frontier": frontier_committer, "canvas": canvas_grammar}
