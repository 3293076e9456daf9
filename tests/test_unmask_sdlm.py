"""Position-aware rules (decoding/position_rules.py): SDLM's longest prefix (`sdlm`).

The selection against a transcription of the public reference's step, the jump bar, and on
tiny models what every rule must keep: no mask in the output, determinism, batch == single
(lockstep, rows apart, continuous batching), every cache policy, early stop, suffix pruning.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from decode_fixtures import KINDS, MASK, SPECIAL, one_thread, prompts, settings, tiny  # noqa: F401
from rule_properties import assert_rows_decode_alone, assert_stops_prunes_and_batches_continuously

from dllm_cli.decoding import Decoder
from dllm_cli.decoding.canvas import Block
from dllm_cli.decoding.unmask import RuleCommitter, StepContext
from dllm_cli.errors import SettingsError
from dllm_cli.frontier import parse_frontier, settings_at
from dllm_cli.settings import CACHES, DecodeSettings

SDLM = {"unmask": "sdlm", "threshold": 0.5}


def reference_accept_count(confidence: torch.Tensor, threshold: float, n: int) -> int:
    """SDLM's step (OpenGVLab/SDLM `find_longest_sequence` and its caller), one row: the
    length of the leading run of the window's confidences above threshold, in [1, n]."""
    passes = confidence > threshold
    first_false = int(torch.argmax((~passes).int()))
    length = len(confidence) if bool(passes.all()) else first_false
    return max(1, min(length, n))


def context(conf: torch.Tensor, cand: torch.Tensor) -> StepContext:
    """A step of rows (B, L) in block 0 with these confidences and masks."""
    conf = conf.double().masked_fill(~cand, float("-inf"))
    drafts = torch.zeros(conf.shape, dtype=torch.long)
    block = Block(0, 0, conf.shape[1], conf.shape[1])
    canvas = SimpleNamespace(request_ids=torch.arange(conf.shape[0]))
    masks = cand.sum(dim=1)
    return StepContext(drafts, conf, cand, block, 0, masks, canvas, torch.Generator())


def select(conf, cand, **kw) -> torch.Tensor:
    committer = RuleCommitter(DecodeSettings(**{**SDLM, **kw}), "linear")
    return committer(context(torch.as_tensor(conf), torch.as_tensor(cand))).commit


def test_sdlm_equals_the_reference_step_on_a_block_whose_masks_are_its_tail():
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        length = int(torch.randint(2, 12, (1,), generator=gen))
        done = int(torch.randint(0, length, (1,), generator=gen))  # committed prefix
        # confidences near the bar and at it: ties decide nothing (strictly above passes)
        conf = torch.rand(length, generator=gen).round(decimals=1)
        cand = torch.arange(length) >= done
        tau = float(torch.rand(1, generator=gen).round(decimals=1).clamp(max=0.9))
        pick = select(conf[None], cand[None], threshold=tau)[0]
        k = reference_accept_count(conf[done:], tau, length - done)
        want = torch.zeros(length, dtype=torch.bool)
        want[done : done + k] = True
        assert pick.tolist() == want.tolist(), (conf.tolist(), done, tau)


def test_sdlm_commits_the_run_from_the_leftmost_mask_and_stops_at_the_first_miss():
    conf = [[0.95, 0.92, 0.99, 0.3, 0.99]]
    assert select(conf, [[True] * 5], threshold=0.9)[0].tolist() == [1, 1, 1, 0, 0]
    # an unsure leftmost mask is committed alone (SDLM: a run of length 0 accepts one)
    conf = [[0.2, 0.95, 0.99, 0.3, 0.99]]
    assert select(conf, [[True] * 5], threshold=0.9)[0].tolist() == [1, 0, 0, 0, 0]
    # the most confident mask is not the first: the threshold rule would take it, not this
    assert select([[0.1, 0.2, 0.99]], [[True] * 3], threshold=0.9)[0].tolist() == [1, 0, 0]


def test_sdlm_passes_over_committed_columns_and_jumps_to_confident_masks():
    conf = [[0.0, 0.95, 0.0, 0.96, 0.5, 0.995, 0.97]]
    cand = [[False, True, False, True, True, True, True]]  # columns 0 and 2 committed
    plain = select(conf, cand, threshold=0.9)[0].tolist()
    assert plain == [0, 1, 0, 1, 0, 0, 0]
    jump = select(conf, cand, threshold=0.9, jump_threshold=0.99)[0].tolist()
    assert jump == [0, 1, 0, 1, 0, 1, 0]
    assert select(conf, cand, threshold=0.9, jump_threshold=1.0)[0].tolist() == plain


def test_sdlm_rows_decide_alone_and_a_row_without_masks_commits_nothing():
    conf = torch.tensor([[0.95, 0.5, 0.99], [0.1, 0.99, 0.99], [0.9, 0.9, 0.9]])
    cand = torch.tensor([[True, True, True], [False, True, True], [False, False, False]])
    pick = select(conf, cand, threshold=0.9)
    assert pick.tolist() == [[1, 0, 0], [0, 1, 1], [0, 0, 0]]
    for r in range(3):
        assert select(conf[r : r + 1], cand[r : r + 1], threshold=0.9)[0].tolist() == (
            pick[r].tolist()
        )


def test_sdlm_settings_are_checked():
    with pytest.raises(SettingsError, match="jump_threshold must be in"):
        DecodeSettings(**SDLM, jump_threshold=1.5)
    with pytest.raises(SettingsError, match=r"threshold must be in \[0, 1\) under unmask=sdlm"):
        DecodeSettings(unmask="sdlm", threshold=1.0)
    with pytest.raises(SettingsError, match="compares confidences with a probability"):
        DecodeSettings(**SDLM, confidence="entropy")
    with pytest.raises(SettingsError, match="unmask 'prefix' is now 'sdlm'"):
        DecodeSettings(unmask="prefix")  # (its old name, the prefix cache's word)
    with pytest.raises(SettingsError, match="unmask must be one of"):
        DecodeSettings(unmask=["prefix"])  # (not a name: refused as any such value)
    points = parse_frontier("sdlm=0.9")
    s = settings_at(DecodeSettings(jump_threshold=0.99), points[1])
    assert (s.unmask, s.threshold, s.jump_threshold) == ("sdlm", 0.9, 0.99)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", CACHES)
def test_sdlm_every_cache_batch_equals_single_no_mask_deterministic(kind, cache):
    assert_rows_decode_alone(kind, cache, {**SDLM, "threshold": 0.2, "jump_threshold": 0.4})


@pytest.mark.parametrize(
    ("kind", "cache", "window"),
    list(itertools.product(KINDS, ("dual", "freecache"), (0, 4))),
)
def test_sdlm_with_early_stop_suffix_pruning_and_continuous_batching(kind, cache, window):
    assert_stops_prunes_and_batches_continuously(kind, cache, window, SDLM)


def test_sdlm_commits_left_to_right_without_a_jump():
    """With no jump bar each step commits the masks right after the row's last commit."""
    model, ps = tiny("dream", seed=2, head_scale=4.0).model, prompts([4, 6], seed=5)
    s = settings(cache="dual", gen_length=12, block_length=6, **SDLM)
    written: dict[int, list[int]] = {0: [], 1: []}
    for e in Decoder(model, SPECIAL, s).run(ps):
        for c in e.commits:
            got = sorted(c.positions)
            assert got == list(range(len(written[c.row]), len(written[c.row]) + len(got)))
            written[c.row] += got
    assert all(w == list(range(12)) for w in written.values())
