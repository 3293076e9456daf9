"""The literature's parallel unmasking rules (decoding/rules.py): EB-Sampler and KLASS.

Each rule's defining property on hand-made tensors, its selection step against a transcription of the
public reference code, and, on tiny models, what every rule must keep: no mask in the output,
determinism, batch == single (lockstep, rows apart, continuous batching), every cache policy,
early stop and suffix pruning.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from decode_fixtures import KINDS, MASK, SPECIAL, one_thread, prompts, settings, tiny  # noqa: F401
from rule_properties import assert_rows_decode_alone, assert_stops_prunes_and_batches_continuously
from test_decode_continuous import stream

from dllm_cli.decoding import Decoder, decode
from dllm_cli.decoding.canvas import Block
from dllm_cli.decoding.ranking import confident_columns, top_columns
from dllm_cli.decoding.rules import entropy_bounded_counts, step_kl
from dllm_cli.decoding.sampling import SAMPLERS, Reads, Sampler
from dllm_cli.decoding.unmask import UNMASK_RULES, RuleCommitter, StepContext
from dllm_cli.errors import SettingsError
from dllm_cli.frontier import REFERENCE, parse_frontier, settings_at
from dllm_cli.settings import CACHES, UNMASKS, DecodeSettings

EB = {"unmask": "eb", "eb_gamma": 2.0}


def test_one_threshold_rule_for_every_family():
    """ranking.confident_columns: the least per step k, ties with tau by the family's
    comparison (Fast-dLLM's >=, SDAR's and LLaDA2's >), and k = 1 by argmax = by ranking."""
    conf = torch.tensor([[0.5, 0.9, 0.95, -math.inf], [0.2, 0.9, 0.1, 0.3]])
    cand = conf > -math.inf
    ones, twos = torch.ones(2, dtype=torch.long), torch.full((2,), 2)
    assert confident_columns(conf, cand, 0.9, ones, inclusive=True).tolist() == [
        [False, True, True, False],
        [False, True, False, False],
    ]
    assert confident_columns(conf, cand, 0.9, ones).tolist() == [
        [False, False, True, False],
        [False, True, False, False],
    ]
    # row 0 has two past 0.9 (>=): those; row 1 one: the two most confident instead
    assert confident_columns(conf, cand, 0.9, twos, inclusive=True).tolist() == [
        [False, True, True, False],
        [False, True, False, True],
    ]
    g = torch.Generator().manual_seed(0)
    tied = torch.randint(0, 4, (64, 8), generator=g) / 4  # many ties, some with tau
    cand = torch.rand(64, 8, generator=g) < 0.7
    cand[:, 0] = True
    tied = tied.masked_fill(~cand, -math.inf)
    for inclusive in (True, False):
        fast = confident_columns(tied, cand, 0.5, None, inclusive)
        ranked = confident_columns(tied, cand, 0.5, torch.ones(64, dtype=torch.long), inclusive)
        assert torch.equal(fast, ranked)


def test_every_unmask_choice_is_one_implemented_rule():
    """settings.py's torch-free rule table names the choices; each has its step here."""
    assert tuple(UNMASK_RULES) == UNMASKS
    for name, rule in UNMASK_RULES.items():
        c = RuleCommitter(DecodeSettings(unmask=name), "linear")
        assert (c.needs_probs, c.needs_shadow) == (rule.needs_probs, rule.remasking)
        assert (c.params.memory is None) == (rule.memory is None)


def reference_eb_count(entropy: torch.Tensor, gamma: float) -> int:
    """The selection step of the public EB-Sampler code (one row, masked entries only):
    sort by entropy, k = #(cumsum - cummax <= gamma), clamped to [1, masks]."""
    ordered = entropy[torch.argsort(entropy)]
    spent = torch.cumsum(ordered, dim=0) - torch.cummax(ordered, dim=0).values
    return int(torch.clamp((spent <= gamma).sum(), min=1, max=len(ordered)))


def test_eb_commits_the_longest_prefix_whose_entropy_all_but_the_last_fits_the_bound():
    h = torch.tensor([[0.0, 0.3, 0.05, 2.0, 0.2, 9.0]])
    every = torch.ones_like(h, dtype=torch.bool)
    # ordered by entropy: 0, 0.05, 0.2, 0.3, 2.0, 9.0; all but the last: 0, 0, 0.05, 0.25, 0.55
    for gamma, want in [(0.0, 2), (0.04, 2), (0.05, 3), (0.25, 4), (0.5, 4), (0.55, 5)]:
        assert entropy_bounded_counts(h, -h, every, gamma).tolist() == [want], gamma
    assert entropy_bounded_counts(h, -h, every, 100.0).tolist() == [6]


def test_eb_in_confidence_order_leaves_out_the_largest_entropy_taken_so_far():
    h = torch.tensor([[0.2, 0.5, 0.1, 0.05]])
    conf = torch.tensor([[0.9, 0.8, 0.7, 0.6]])  # this order: entropies 0.2, 0.5, 0.1, 0.05
    every = torch.ones_like(h, dtype=torch.bool)
    # sums minus the running max: 0, 0.2, 0.3, 0.35
    for gamma, want in [(0.1, 1), (0.2, 2), (0.3, 3), (0.35, 4)]:
        assert entropy_bounded_counts(h, conf, every, gamma + 1e-6).tolist() == [want], gamma


def test_eb_counts_only_candidates_and_always_at_least_one():
    h = torch.tensor([[5.0, 0.0, 0.0, 7.0], [3.0, 4.0, 0.1, 0.1]])
    cand = torch.tensor([[True, False, False, True], [False, False, False, True]])
    # row 0: the certain columns are not candidates; 5 alone exceeds nothing -> 1, then 5 > 0.1
    assert entropy_bounded_counts(h, -h, cand, 0.1).tolist() == [1, 1]
    assert entropy_bounded_counts(h, -h, cand, 5.0).tolist() == [2, 1]
    none = torch.zeros_like(cand)
    assert entropy_bounded_counts(h, -h, none, 1.0).tolist() == [0, 0]  # nothing to commit


def test_eb_reads_entropies_from_the_drafts_distributions():
    probs = torch.tensor([[[1.0, 0.0], [0.5, 0.5], [0.9, 0.1]]], dtype=torch.float64)
    conf = probs.max(dim=-1).values
    cand = torch.ones(1, 3, dtype=torch.bool)
    settings = DecodeSettings(**EB)
    sampler = Sampler(settings, SAMPLERS["llada"], 2, 5)  # (the step measures the entropy)
    _, _, _, h, _ = sampler.measured(torch.log(probs), torch.Generator(), reads=Reads(True))
    assert not sampler.measured(torch.log(probs), torch.Generator())[3]  # not asked: None
    ctx = StepContext(
        probs.argmax(-1), conf, cand, Block(0, 0, 3, 3), 0, torch.tensor([3]),
        SimpleNamespace(request_ids=torch.tensor([0])), torch.Generator(), entropy=h,
    )  # fmt: skip
    h09 = -(0.9 * math.log(0.9) + 0.1 * math.log(0.1))  # 0.325 nats: the second column taken
    pick = [RuleCommitter(DecodeSettings(**{**EB, "eb_gamma": g}), "linear")(ctx).commit
            for g in (h09 - 1e-6, h09 + 1e-6)]  # fmt: skip
    # columns in confidence order: 0 (H 0), 2 (H 0.325), 1 (H 0.693)
    # taking 0 and 2 leaves out 0.325 (spent 0); taking 1 too leaves out 0.693 (spent 0.325)
    assert pick[0][0].tolist() == [True, False, True]
    assert pick[1][0].tolist() == [True, True, True]


def test_eb_selection_equals_the_reference_transcription_token_for_token():
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        n = int(torch.randint(1, 33, (1,), generator=gen))
        h = torch.rand(n, generator=gen, dtype=torch.float64) * 3
        h[torch.rand(n, generator=gen) < 0.3] = 0.0  # exactly certain columns, as EOS runs
        h = h + torch.arange(n, dtype=torch.float64) * 1e-9  # no ties: argsort is then unique
        gamma = [0.0, 0.01, 0.1, 0.5, 2.0][trial % 5]
        mask = torch.rand(n, generator=gen) < 0.7
        mask[int(torch.randint(0, n, (1,), generator=gen))] = True
        k = reference_eb_count(h[mask], gamma)
        want = set(mask.nonzero().squeeze(1)[torch.argsort(h[mask])[:k]].tolist())
        # this library: confidence is negative entropy (-inf off the candidates, as the
        # engine gives it), committed by rank
        conf = (-h).masked_fill(~mask, float("-inf"))[None]
        counts = entropy_bounded_counts(h[None], conf, mask[None], gamma)
        got = top_columns(conf, mask[None], counts)[0].nonzero().squeeze(1).tolist()
        assert set(got) == want, (trial, h, mask, gamma)


def test_eb_needs_a_non_negative_gamma():
    with pytest.raises(SettingsError, match="eb_gamma must be >= 0"):
        DecodeSettings(**{**EB, "eb_gamma": -0.1})
    DecodeSettings(**{**EB, "eb_gamma": 0.0})


def test_eb_gamma_zero_commits_one_uncertain_token_per_step():
    """gamma = 0: a step commits its least uncertain mask and any exactly certain ones only."""
    model, ps = tiny("llada").model, prompts([5])
    run = Decoder(model, SPECIAL, settings(**{**EB, "eb_gamma": 0.0})).run(ps)
    sizes = [len(e.commits[0].positions) for e in run if e.commits]
    assert max(sizes) == 1  # a random model is never exactly certain
    small, large = (
        decode(model, SPECIAL, ps, settings(**{**EB, "eb_gamma": g})).steps for g in (0.0, 50.0)
    )
    assert large < small


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", CACHES)
def test_eb_every_cache_batch_equals_single_no_mask_deterministic(kind, cache):
    assert_rows_decode_alone(kind, cache, EB)


@pytest.mark.parametrize(
    ("kind", "cache", "window"),
    list(itertools.product(KINDS, ("dual", "freecache"), (0, 4))),
)
def test_eb_with_early_stop_suffix_pruning_and_continuous_batching(kind, cache, window):
    assert_stops_prunes_and_batches_continuously(kind, cache, window, EB)


@pytest.mark.parametrize("kind", KINDS)
def test_threshold_with_fewer_steps_keeps_every_rule_property(kind):
    """Set steps raise the threshold rule's least per step, each row's own (per-row progress)."""
    rule = {"unmask": "threshold", "threshold": 0.9, "steps": 6}
    assert_rows_decode_alone(kind, "dual", rule)
    assert_stops_prunes_and_batches_continuously(kind, "dual", 4, {**rule, "steps": 8})


def test_frontier_points_and_settings():
    points = parse_frontier("threshold=0.9/0.95,eb")
    assert points[0].rule == REFERENCE and [p.rule for p in points[1:3]] == ["threshold"] * 2
    base = DecodeSettings(cache="dual", early_stop=True)
    eb = settings_at(base, points[3])
    assert (eb.unmask, eb.eb_gamma, eb.cache) == ("eb", 0.01, "dual")
    ref = settings_at(base, points[0])
    assert (ref.unmask, ref.steps, ref.early_stop) == ("fixed", None, True)


# --- KLASS ---------------------------------------------------------------------------------

KLASS = {"unmask": "klass", "threshold": 0.6, "kl_threshold": 0.05}


def klass_context(probs, candidates, step: int, masks: int, steps: int) -> StepContext:
    """One row's step in block 0 (columns 0..L-1) with these distributions (L, V)."""
    probs = torch.as_tensor(probs, dtype=torch.float64)[None]
    cand = torch.as_tensor(candidates)[None]
    conf, drafts = probs.max(dim=-1)
    conf = conf.masked_fill(~cand, float("-inf"))
    block = Block(0, 0, probs.shape[1], steps)
    canvas = SimpleNamespace(request_ids=torch.tensor([0]))
    return StepContext(
        drafts, conf, cand, block, step, torch.tensor([masks]), canvas, torch.Generator(),
        probs=probs,
    )  # fmt: skip


def test_klass_commits_only_masks_confident_and_stable_for_the_history():
    committer = RuleCommitter(DecodeSettings(**KLASS), "linear")
    steady = [0.9, 0.05, 0.05]  # confident, and the same every step: KL 0
    drifting = [[0.7, 0.2, 0.1], [0.9, 0.05, 0.05], [0.7, 0.2, 0.1]]  # confident, moving
    shy = [0.5, 0.3, 0.2]  # stable but under the threshold
    cand = [True, True, True, True]
    picks = []
    for step in range(3):
        probs = [steady, drifting[step], shy, shy]
        ctx = klass_context(probs, cand, step, masks=4, steps=4)
        picks.append(committer(ctx).commit[0].tolist())
    # steps 0, 1: no history of 2 KLs yet -> the schedule's one most confident (column 0, the
    # leftmost of the ties); step 2: column 0 is stable and confident, the others are not.
    assert picks[0] == [True, False, False, False]
    assert picks[1] == [True, False, False, False]
    assert picks[2] == [True, False, False, False]
    cand = [False, True, True, True]
    probs = [steady, drifting[0], shy, shy]
    late = committer(klass_context(probs, cand, 3, masks=4, steps=4)).commit[0].tolist()
    assert late == [False, True, True, True]  # the block's last planned step: everything


def test_klass_reads_the_steps_measured_kls_as_it_reads_the_distributions():
    """Under tensor parallelism the sampler measures each slot's KL (StepContext.kl) and no
    distribution reaches the rule: the same commits as from the distributions."""
    gen = torch.Generator().manual_seed(5)
    settings = DecodeSettings(**{**KLASS, "kl_threshold": 0.02, "threshold": 0.3})
    whole, measured = (RuleCommitter(settings, "linear") for _ in range(2))
    base, cand, last, seen = torch.randn(6, 5, generator=gen) * 3, [True] * 6, None, 0
    for step in range(5):
        moved = torch.randn(6, 5, generator=gen) * torch.linspace(0, 0.5, 6)[:, None]
        probs = torch.softmax(base + moved, dim=-1).double()  # slots 0, 1 about stable
        ctx = klass_context(probs, cand, step, masks=6, steps=6)
        kl = ctx.probs.new_zeros(1, 6) if last is None else step_kl(ctx.probs, last)
        last, want = ctx.probs, whole(ctx).commit
        got = measured(replace(ctx, probs=None, kl=kl)).commit
        assert torch.equal(got, want), step
        seen += int(want.sum()) > 1  # (a step with more than the schedule's one: stable ones)
        cand = [c and not w for c, w in zip(cand, want[0].tolist(), strict=True)]
    assert seen


def reference_klass(steps_probs, masked, conf_threshold, kl_threshold, history, counts):
    """A transcription of the public KLASS code's per-step selection (one row, one block,
    decode start: its KL history and previous distribution start at zero)."""
    length, vocab = steps_probs[0].shape
    kl_hist = torch.zeros(length, history, dtype=torch.float64)
    p_prev = torch.zeros(length, vocab, dtype=torch.float64)
    mask = masked.clone()
    chosen = []
    for step, p_curr in enumerate(steps_probs):
        if not mask.any():
            break
        x0 = p_curr.argmax(dim=-1)
        conf = p_curr.gather(-1, x0[:, None]).squeeze(-1)
        kl = (p_curr * (torch.log(p_curr + 1e-12) - torch.log(p_prev + 1e-12))).sum(-1)
        kl_hist = torch.roll(kl_hist, shifts=-1, dims=-1)
        kl_hist[:, -1] = kl
        p_prev = p_curr.clone()
        if step >= history - 1:
            stable = torch.all(kl_hist < kl_threshold, dim=-1)
        else:
            stable = torch.zeros(length, dtype=torch.bool)
        ready = stable & (conf > conf_threshold) & mask
        if ready.any():
            transfer = ready
        else:
            top = torch.topk(torch.where(mask, conf, -torch.inf), k=counts[step]).indices
            transfer = torch.zeros(length, dtype=torch.bool)
            transfer[top] = True
        chosen.append(sorted(transfer.nonzero().squeeze(1).tolist()))
        mask &= ~transfer
    return chosen


def test_klass_selection_equals_the_reference_transcription_step_for_step():
    gen = torch.Generator().manual_seed(3)
    length, vocab, steps = 8, 5, 8
    for trial in range(40):
        # distributions that settle: each slot moves towards a fixed peaked target
        target = torch.softmax(torch.randn(length, vocab, generator=gen) * 4, dim=-1).double()
        noise = [torch.softmax(torch.randn(length, vocab, generator=gen), -1).double()
                 for _ in range(steps)]  # fmt: skip
        mix = [0.5 ** (k + 1) * (trial % 3) for k in range(steps)]
        seq = [(1 - m) * target + m * n for m, n in zip(mix, noise, strict=True)]
        masked = torch.ones(length, dtype=torch.bool)
        counts = [1] * steps  # LLaDA's linear split of 8 masks over 8 steps
        want = reference_klass(seq, masked, 0.6, 0.01, 2, counts)
        s = DecodeSettings(unmask="klass", threshold=0.6, kl_threshold=0.01, kl_history=2)
        committer = RuleCommitter(s, "linear")
        left, got = masked.clone(), []
        for step, p in enumerate(seq):
            if not left.any():
                break
            pick = committer(klass_context(p, left, step, masks=length, steps=steps)).commit[0]
            got.append(sorted(pick.nonzero().squeeze(1).tolist()))
            left &= ~pick
        assert got == want, trial


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", CACHES)
def test_klass_every_cache_batch_equals_single_no_mask_deterministic(kind, cache):
    model, ps = tiny(kind, seed=2, head_scale=6.0).model, prompts([3, 8, 5], seed=3)
    s = settings(cache=cache, gen_length=12, **KLASS)
    batch = decode(model, SPECIAL, ps, s)
    assert batch.tokens == decode(model, SPECIAL, ps, s).tokens
    assert all(MASK not in row for row in batch.tokens)
    apart = Decoder(model, SPECIAL, s).run(ps, lockstep=False).result()
    for row, prompt in enumerate(ps):
        alone = decode(model, SPECIAL, [prompt], s).tokens[0]
        assert batch.tokens[row] == alone == apart.tokens[row], row


@pytest.mark.parametrize(("kind", "window"), list(itertools.product(KINDS, (0, 4))))
def test_klass_with_early_stop_suffix_pruning_and_continuous_batching(kind, window):
    model = tiny(kind, seed=1, head_scale=6.0, eos_from=9).model
    ps = prompts([3, 9, 5, 1], seed=1)
    s = settings(cache="dual", gen_length=16, early_stop=True, suffix_window=window, **KLASS)
    want = [decode(model, SPECIAL, [p], s).tokens[0] for p in ps]
    assert decode(model, SPECIAL, ps, s).tokens == want
    out, refused, _ = stream(model, ps, s, slots=2)
    assert not refused
    assert [out[i].tokens for i in range(len(ps))] == want


def test_klass_drops_a_finished_requests_distributions():
    from dllm_cli.decoding.engine import Engine

    model = tiny("llada", seed=1, head_scale=6.0).model
    s = settings(cache="dual", gen_length=8, **KLASS)
    engine = Engine(model, SPECIAL, s, slots=2, admission="continuous")
    tracks = engine.stepper.committer.params.memory.tracks
    for p in prompts([3, 9, 5], seed=1):
        engine.add(p)
    seen = 0
    while engine.has_work:
        engine.step()
        seen = max(seen, len(tracks))
    assert seen == 2 and tracks == {}  # two rows at a time, none kept once they left


def test_klass_history_follows_canvas_columns_as_a_frontier_window_moves():
    """A grammar's frontier walk drafts from each row's first mask: its window moves right and
    narrows between steps, and each column's KLs stay that column's (slots are not columns)."""
    from dllm_cli.decoding.rules import KlassMemory

    gen = torch.Generator().manual_seed(2)
    by_step = [torch.softmax(torch.randn(16, 5, generator=gen), -1).double() for _ in range(3)]
    windows = [range(10, 16), range(11, 16), range(11, 15)]  # canvas columns of the slots
    memory, got = KlassMemory(), []
    for step, cols in enumerate(windows):
        columns = torch.tensor([list(cols)])
        ctx = SimpleNamespace(
            kl=None, probs=by_step[step][columns], drafts=columns, block=None,
            columns=columns, block_step=torch.tensor([step]),
            canvas=SimpleNamespace(request_ids=torch.tensor([7])),
        )  # fmt: skip
        got.append(memory.stable(ctx, history=2)[0])  # (L, 2)
    inf = float("inf")
    for step, cols in enumerate(windows):
        for slot, col in enumerate(cols):
            kls = [
                step_kl(by_step[t][col], by_step[t - 1][col]).item() if t >= 1 else inf
                for t in (step - 1, step)
            ]
            assert got[step][slot].tolist() == pytest.approx(kls), (step, col)
    assert got[2][:, 0].isfinite().all()  # (both earlier steps drafted every column still here)
