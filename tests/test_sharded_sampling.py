"""Sampling from vocabulary shards, in one process: fake ranks (threads) split random logits,
gather their summaries through a stub, and draft what one process drafts from the whole
logits: sampled tokens (same seed), top-k / top-p in both families' orders, every confidence
kind, per-row values (RowDraws), the block families' multinomial draw, EB's entropies and
KLASS's step-to-step KLs."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from block_reference import sample

from dllm_cli.decoding import shard_summaries, sharded_sampling
from dllm_cli.decoding.row_sampling import RowDraws
from dllm_cli.decoding.rules import KlassMemory, entropy, step_kl
from dllm_cli.decoding.sampling import SAMPLERS, Reads, Sampler
from dllm_cli.decoding.sharded_sampling import ShardedSampler, block_drafter
from dllm_cli.lifetimes import Sampling
from dllm_cli.models.collectives import Shards
from dllm_cli.settings import DecodeSettings

V, VOCAB, MASK = 101, 99, 7  # 101 logits split unevenly over ranks; ids 99, 100 padding


@dataclass
class Board:
    """What the fake ranks put down at each all-gather (a barrier between rounds)."""

    world: int
    pieces: list = field(default_factory=list)
    gathers: int = 0

    def __post_init__(self):
        self.pieces = [None] * self.world
        self.barrier = threading.Barrier(self.world)


@dataclass
class StubShards(Shards):
    """A rank whose all_gather stacks every fake rank's piece (threads of one process)."""

    board: Board | None = None

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self.counts.all_gather += 1
        self.board.pieces[self.rank] = x.clone()
        self.board.barrier.wait()
        out = torch.stack(self.board.pieces)
        self.board.barrier.wait()  # every rank read before the next round writes
        return out


def on_ranks(world: int, job) -> list:
    """job(shards) on `world` fake ranks at once; their results in rank order."""
    board, results, errors = Board(world), [None] * world, []

    def run(rank: int) -> None:
        try:
            results[rank] = job(StubShards(rank, world, board=board))
        except Exception as e:  # (re-raised below)
            errors.append(e)
            board.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def logits_for(seed: int, shape=(2, 5, V), scale=3.0) -> torch.Tensor:
    torch.manual_seed(seed)
    x = torch.randn(shape) * scale
    x[0, 0, 10] = x[0, 0, 60] = 20.0  # a tie across ranks
    x[-1, 1, MASK] = 30.0  # the mask id is never drafted
    return x


def sharded(settings, family, logits, world=2, seed=3, rows=None, keep=False):
    """Every fake rank's drafts of its slice of `logits` (rows: a RowDraws factory)."""

    def job(shards):
        lo, hi = shards.vocabulary(V)
        s = ShardedSampler(shards, lo, V, settings, family, VOCAB, MASK)
        g = torch.Generator().manual_seed(seed) if rows is None else rows()
        tokens, conf, probs = s.draft(logits[..., lo:hi], g, keep=keep)
        return (tokens, conf, shards.counts.all_gather, probs)[: 4 if keep else 3]

    return on_ranks(world, job)


CASES = [
    (family, DecodeSettings(temperature=t, top_k=k, top_p=p, confidence=c))
    for family in ("llada", "dream")
    for t, k, p in ((0.0, 0, None), (0.7, 0, None), (0.7, 3, None), (1.3, 0, 0.8), (0.5, 4, 0.6))
    for c in ("low_confidence", "margin", "entropy", "random")
]


@pytest.mark.parametrize(("family", "settings"), CASES)
def test_shards_draft_the_one_process_tokens_and_confidences(family, settings):
    logits = logits_for(0)
    whole = Sampler(settings, SAMPLERS[family], VOCAB, MASK)
    tokens, conf, _ = whole.draft(logits, torch.Generator().manual_seed(3))
    for world in (2, 3):
        for mine, mine_conf, gathers in sharded(settings, SAMPLERS[family], logits, world):
            assert torch.equal(mine, tokens)
            assert mine_conf.dtype == conf.dtype
            torch.testing.assert_close(mine_conf, conf, rtol=1e-5, atol=2e-6)
            assert gathers == 1  # one gather per draft


def test_top_p_of_a_flat_distribution_gathers_more_candidates_and_stays_exact(monkeypatch):
    monkeypatch.setattr(sharded_sampling, "NUCLEUS", 16)  # (64 would hold a shard of 51 whole)
    logits = logits_for(1, scale=0.05)  # near uniform: 0.95 of the mass needs most ids
    settings = DecodeSettings(temperature=1.0, top_p=0.95, confidence="margin")
    whole = Sampler(settings, SAMPLERS["dream"], VOCAB, MASK)
    tokens, conf, _ = whole.draft(logits, torch.Generator().manual_seed(3))
    for mine, mine_conf, gathers in sharded(settings, SAMPLERS["dream"], logits):
        assert torch.equal(mine, tokens)
        torch.testing.assert_close(mine_conf, conf, rtol=1e-5, atol=1e-6)
        assert gathers > 1  # its 16 candidates per rank did not reach 0.95


def test_rows_sample_with_their_own_values_and_generators():
    logits = logits_for(2)
    run = DecodeSettings(temperature=0.5)
    own = [
        Sampling(temperature=0.9, top_p=0.7, confidence="margin"),
        Sampling(temperature=0.0, top_k=2, confidence="random"),
    ]

    def rows() -> RowDraws:
        generators = tuple(torch.Generator().manual_seed(s) for s in (11, 12))
        return RowDraws(generators, tuple(own), (5, 4), (True, True))

    for family in ("llada", "dream"):
        whole = Sampler(run, SAMPLERS[family], VOCAB, MASK)
        tokens, conf, _ = whole.draft(logits, rows())
        for mine, mine_conf, _ in sharded(run, SAMPLERS[family], logits, rows=rows):
            assert torch.equal(mine, tokens), family
            torch.testing.assert_close(mine_conf, conf, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_logprobs_read_the_one_process_values_from_the_gathered_candidates(family):
    logits = logits_for(5)
    settings = DecodeSettings(temperature=0.9, top_k=30, top_p=0.95)
    whole = Sampler(settings, SAMPLERS[family], VOCAB, MASK)
    tokens, _, probs = whole.draft(logits, torch.Generator().manual_seed(3))
    want = torch.log(probs.double())
    for mine, _, _, kept in sharded(settings, SAMPLERS[family], logits, keep=True):
        lp = torch.log(kept.double())
        chosen = lp.gather(-1, mine[..., None])
        torch.testing.assert_close(chosen, want.gather(-1, tokens[..., None]))
        values, ids = lp.topk(20, dim=-1)  # logprobs' most (here: past the 30 of top-k)
        torch.testing.assert_close(values, want.topk(20, dim=-1).values)
        assert torch.equal(ids, want.topk(20, dim=-1).indices)


@pytest.mark.parametrize(("t", "k", "p"), [(0.0, None, None), (1.0, None, None), (0.8, 5, 0.7)])
def test_shards_draw_the_block_families_multinomial_draft(t, k, p):
    logits = logits_for(4, shape=(2, 6, V))  # (N, B, V): two rows, blocks of 6
    own = [Sampling(t, p, k), Sampling(0.0)]  # the second row greedy
    seeded = lambda: [torch.Generator().manual_seed(s) for s in (5, 6)]  # noqa: E731
    whole = Sampler(DecodeSettings(), SAMPLERS["block"], VOCAB, MASK)
    tokens, probs, _ = whole.drafts(logits.clone(), own, seeded())
    for i, (s, g) in enumerate(zip(own, seeded(), strict=True)):  # the references' multinomial
        want, want_p = sample(logits[i], s.temperature, MASK, VOCAB, s.top_k, s.top_p, g)
        assert torch.equal(tokens[i], want) and torch.equal(probs[i], want_p)
    alone = whole.drafts(logits[:1].clone(), own[:1], seeded()[:1])  # every row draws
    assert torch.equal(alone[0], tokens[:1]) and torch.equal(alone[1], probs[:1])

    def job(shards):
        lo, hi = shards.vocabulary(V)
        model = SimpleNamespace(shards=shards, vocab_start=lo, vocab_width=V)
        drafted = block_drafter(model, DecodeSettings(), VOCAB, MASK)
        return (*drafted(logits[..., lo:hi], own, seeded())[:2], shards.counts.all_gather)

    for mine, mine_p, gathers in on_ranks(2, job):
        assert torch.equal(mine, tokens)
        assert mine_p.dtype == torch.float32
        torch.testing.assert_close(mine_p, probs, rtol=1e-5, atol=1e-6)
        assert gathers == 1  # every row drafted from one gather


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize(
    "settings", [DecodeSettings(top_k=3), DecodeSettings(temperature=0.7, top_k=5, top_p=0.8)]
)
def test_a_grammar_reads_each_shards_part_of_the_one_process_distribution(family, settings):
    logits = logits_for(6)
    allow = torch.rand(VOCAB) < 0.3  # a grammar's allowed ids
    whole = Sampler(settings, SAMPLERS[family], VOCAB, MASK)
    _, _, probs = whole.draft(logits, torch.Generator().manual_seed(3))
    want = torch.where(allow, probs.double(), -1.0).flatten(0, 1).max(dim=-1)  # (B L,)

    def job(shards):
        lo, hi = shards.vocabulary(V)
        s = ShardedSampler(shards, lo, V, settings, SAMPLERS[family], VOCAB, MASK, True)
        _, _, part = s.draft(logits[..., lo:hi], torch.Generator().manual_seed(3))
        where = shard_summaries.VocabPart(lo, VOCAB, shards)
        mine = torch.where(where.ids(allow, hi - lo, False), part.double(), -1.0)
        return lo, part, where.best(mine.flatten(0, 1))

    for lo, part, (top, best) in on_ranks(2, job):
        real = min(lo + part.shape[-1], VOCAB) - lo
        torch.testing.assert_close(part[..., :real], probs[..., lo : lo + real])
        assert not part[..., real:].any()  # the embedding's padding ids
        assert torch.equal(best, want.indices)  # the allowed argmax over every rank's part
        torch.testing.assert_close(top, want.values)


@pytest.mark.parametrize(("vocab", "world"), [(10, 4), (40, 3)])  # slices 3, 3, 3, 1; 14, 14, 12
def test_logprobs_pick_the_whole_vocabularys_largest_from_slices_narrower_than_k(vocab, world):
    g = torch.Generator().manual_seed(5)
    lp = torch.randn(2, 3, vocab, dtype=torch.float64, generator=g).log_softmax(dim=-1)
    tokens = torch.randint(0, vocab, (2, 3), generator=g)
    want, k = lp.topk(5, dim=-1), 5

    def job(shards):
        lo, hi = shards.vocabulary(vocab)
        return shard_summaries.VocabPart(lo, vocab, shards).pick(lp[..., lo:hi], tokens, k)

    for chosen, values, ids in on_ranks(world, job):
        assert torch.equal(chosen, lp.gather(-1, tokens[..., None])[..., 0])
        assert torch.equal(values, want.values) and torch.equal(ids, want.indices)


@pytest.mark.parametrize("world", [2, 3])
def test_winos_shadow_probability_rides_the_drafts_one_gather(world):
    logits, shadows = logits_for(7), logits_for(8, shape=(2, 4, V))  # a shadow block's own L
    tokens = torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(9))
    tokens[0, 0] = 100  # a padding id (the softmax covers every logit, as one process's)
    want = torch.softmax(shadows.double(), dim=-1).gather(-1, tokens[..., None])[..., 0]
    settings = DecodeSettings(temperature=0.7, top_k=3)
    whole = Sampler(settings, SAMPLERS["dream"], VOCAB, MASK)
    drafted, conf, _ = whole.draft(logits, torch.Generator().manual_seed(3))

    def job(shards):
        lo, hi = shards.vocabulary(V)
        s = ShardedSampler(shards, lo, V, settings, SAMPLERS["dream"], VOCAB, MASK)
        every = s.ride(shard_summaries.shadow_summary(shadows[..., lo:hi], tokens, lo))
        mine, mine_conf, _ = s.draft(logits[..., lo:hi], torch.Generator().manual_seed(3))
        p = shard_summaries.shadow_probability(every())
        return mine, mine_conf, p, shards.counts.all_gather, s.riders

    for mine, mine_conf, p, gathers, riders in on_ranks(world, job):
        assert torch.equal(mine, drafted)  # the drafts' summaries untouched by the rider
        torch.testing.assert_close(mine_conf, conf, rtol=1e-5, atol=2e-6)
        torch.testing.assert_close(p, want, rtol=1e-12, atol=0)
        assert gathers == 1 and riders == []  # one collective, the rider sent once


CREDIT_ROWS = [  # (temperature, confidence) of the two rows (credit's: probabilities)
    ((0.0, "low_confidence"), (0.0, "low_confidence")),
    ((0.8, "margin"), (0.0, "random")),
    ((0.0, "margin"), (1.1, "low_confidence")),
]


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("rows", CREDIT_ROWS)
def test_credits_fused_drafts_and_confidences_are_the_one_process_ones(family, rows):
    from dllm_cli.decoding.canvas import Block
    from dllm_cli.decoding.credit import credit_memory, fused_drafts, sharded_fused_drafts
    from dllm_cli.decoding.unmask import StepContext

    run = DecodeSettings(unmask="credit", block_length=5, top_k=40, credit_alpha=2.0)
    own = tuple(Sampling(temperature=t, top_k=40, confidence=c) for t, c in rows)
    base = logits_for(10) * 0.3  # flat, and near from step to step: credit moves favourites
    steps = [base + 0.2 * logits_for(11 + i) for i in range(3)]
    masked = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    left = [masked, masked & torch.tensor([1, 0, 1, 1, 0]).bool(), masked.clone()]
    left[2][:, :3] = False

    def decode(draft, fuse) -> list:
        """Three steps of one block: each step's drafts, confidences and kept credits."""
        memory, seen = credit_memory(run), []
        generators = tuple(torch.Generator().manual_seed(s) for s in (21, 22))
        for step, (logits, candidates) in enumerate(zip(steps, left, strict=True)):
            draws = RowDraws(generators, own, (5, 5), (True, True))
            drafts, conf, probs = draft(logits, draws)
            ctx = StepContext(
                drafts, conf, candidates, Block(0, 0, 5, 5), step, torch.full((2,), 5),
                SimpleNamespace(request_ids=torch.tensor([4, 9])), draws, probs=probs,
            )  # fmt: skip
            tokens, confidence = fuse(ctx, memory)
            seen.append((tokens, confidence, memory.held.tokens, memory.held.gains))
            moved.append(bool((tokens != drafts).any()))
        return seen

    moved = []  # a step whose fused drafts differ from the sampler's

    whole = Sampler(run, SAMPLERS[family], VOCAB, MASK)
    want = decode(
        lambda x, g: whole.draft(x, g),
        lambda ctx, m: fused_drafts(ctx, m.update(ctx, *ctx.probs.max(dim=-1)), m.alpha),
    )

    def job(shards):
        lo, hi = shards.vocabulary(V)
        s = ShardedSampler(shards, lo, V, run, SAMPLERS[family], VOCAB, MASK, True)
        seen = decode(
            lambda x, g: s.draft(x[..., lo:hi], g), lambda ctx, m: sharded_fused_drafts(ctx, m, s)
        )
        return seen, shards.counts.all_gather

    assert any(moved)  # the credits decide some drafts
    for seen, gathers in on_ranks(2, job):
        assert gathers == 6  # a draft's and the fused summaries', each step
        for (tokens, conf, held, gains), (w_tokens, w_conf, w_held, w_gains) in zip(
            seen, want, strict=True
        ):
            assert torch.equal(tokens, w_tokens)
            assert conf.dtype == w_conf.dtype
            torch.testing.assert_close(conf, w_conf, rtol=1e-5, atol=2e-6)
            assert torch.equal(held, w_held)
            torch.testing.assert_close(gains, w_gains)


MEASURED = [
    (family, DecodeSettings(temperature=t, top_k=k, top_p=p))
    for family in ("llada", "dream")
    for t, k, p in ((0.0, 0, None), (0.7, 0, None), (0.0, 3, None), (0.5, 4, 0.6), (1.3, 0, 0.8))
]


@pytest.mark.parametrize(("family", "settings"), MEASURED)
def test_shards_measure_eb_entropies_and_klass_kls_in_the_one_gather(family, settings):
    steps = [logits_for(7), logits_for(8), logits_for(8) * 1.05]  # three steps of two rows
    whole = Sampler(settings, SAMPLERS[family], VOCAB, MASK)
    probs = [whole.draft(x, torch.Generator().manual_seed(3))[2].double() for x in steps]
    entropies = [entropy(p) for p in probs]  # (B, L) as eb reads them
    kls = [step_kl(p, q) for p, q in zip(probs[1:], probs, strict=False)]  # as KLASS's memory
    reads = Reads(entropy=True, kl=True)

    def job(shards):
        lo, hi = shards.vocabulary(V)
        s = ShardedSampler(shards, lo, V, settings, SAMPLERS[family], VOCAB, MASK)
        s.memory = memory = KlassMemory()  # (RuleCommitter.shard hands it the rule's)
        seen = []
        for i, x in enumerate(steps):
            # (id, first column); row 1's third step: neither read nor kept; row 0's window
            # moves one column right there (a grammar's frontier): its slot j was slot j + 1
            keys = [(10, 0), (11, 4)] if i < 2 else [(10, 1), None]
            g = torch.Generator().manual_seed(3)
            before = shards.counts.all_gather
            *_, h, kl = s.measured(x[..., lo:hi], g, i == 1, keys, reads)  # (2nd: logprobs)
            seen.append((h, kl, shards.counts.all_gather - before))
        kept = sorted(memory.tracks)
        memory.forget([11, 12])  # requests that left (12: never kept)
        return seen, kept, sorted(memory.tracks)

    for seen, kept, left in on_ranks(2, job):
        assert kept == [10, 11] and left == [10]
        for i, (h, kl, gathers) in enumerate(seen):
            assert gathers == 1  # entropy and KL ride in the drafts' gather
            torch.testing.assert_close(h, entropies[i], rtol=1e-5, atol=1e-5)
            if i == 1:  # (the first step has no last one: the rule reads no KL there)
                torch.testing.assert_close(kl[0], kls[0][0], rtol=1e-5, atol=1e-6)
        moved = step_kl(probs[2][0, :-1], probs[1][0, 1:])  # (the last slot: not seen before)
        torch.testing.assert_close(seen[2][1][0, :-1], moved, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(seen[1][1][1], kls[0][1], rtol=1e-5, atol=1e-6)


def test_a_last_distribution_is_looked_up_by_id_and_its_slots_by_column():
    last = shard_summaries.Last(
        torch.zeros(2, 3),
        torch.tensor([[9, -1, 4], [5, 2, -1]]),
        torch.tensor([[0.3, 0.0, 0.7], [0.6, 0.4, 0.0]], dtype=torch.float64),
        first=20,
    )
    ids = torch.tensor([[4, 8, -1, 9], [2, 5, 7, -1], [4, 9, 5, 2]])  # a third slot: none last
    q = shard_summaries.looked_up(last, ids)
    assert q.tolist() == [[0.7, 0.0, 0.0, 0.3], [0.4, 0.6, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    # A window one column to the right (a grammar's frontier moved): slot 0 is the last
    # step's slot 1, and the last step had nothing at the new slots 1 and 2.
    q = shard_summaries.looked_up(last, ids, by=1)
    assert q.tolist() == [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    q = shard_summaries.looked_up(last, ids[[1, 0]], by=1)
    assert q.tolist()[0] == [0.4, 0.6, 0.0, 0.0]


@pytest.mark.parametrize(("world", "size"), [(2, 64), (4, 30), (8, 70)])  # slices of 8, 6; 9, 7
def test_echo_scores_alternatives_are_the_whole_tables_even_from_slices_narrower_than_k(
    world, size
):
    from dllm_cli.scoring import CANDIDATES, VocabLogProbs

    torch.manual_seed(4)
    logits = torch.randn(3, size) * 4  # (N, V)
    own = torch.tensor([0, size - 1, size // 2])
    whole = logits.double().log_softmax(dim=-1)

    def job(shards):
        lo, hi = shards.vocabulary(size)
        model = SimpleNamespace(shards=shards, vocab_start=lo, vocab_width=size)
        return VocabLogProbs(model).table(logits[:, lo:hi].clone(), own)

    for table in on_ranks(world, job):
        k = min(CANDIDATES, size)
        top = whole.topk(k, dim=-1).indices  # every one of the whole vocabulary's top k is there
        torch.testing.assert_close(table.gather(1, top).double(), whole.gather(1, top))
        torch.testing.assert_close(
            table.gather(1, own[:, None]).double(), whole.gather(1, own[:, None])
        )
