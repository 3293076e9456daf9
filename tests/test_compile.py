"""`--compile`: CUDA-graph replay of cached block steps, and its eager fallback on CPU."""

from __future__ import annotations

import copy

import pytest
from cli_fixtures import (  # noqa: F401
    cli_ckpt_fixture,
    invoke,
    isolated_fixture,
    profile_file_fixture,
)
from decode_fixtures import SPECIAL, prompts, settings, tiny

from dllm_cli.decoding import Decoder, decode
from dllm_cli.models.compiled import StepGraphs, enable_compile


def replaying_recorder(run):
    """CPU stand-in for a CUDA graph: a replay reruns the recorded call on the recorded buffers
    and writes into the same output buffer, so stale inputs or outputs would show."""
    out = run()
    buffer = out.clone()
    return out, lambda: buffer.copy_(run()), buffer


def test_cpu_falls_back_to_eager_with_a_note():
    model = copy.deepcopy(tiny("llada").model)
    before = model.forward
    note = enable_compile(model)
    assert note.startswith("--compile: CUDA graphs need a CUDA device; decoding eagerly on cpu")
    assert model.forward == before  # nothing wrapped


@pytest.mark.parametrize("kind", ["llada", "dream"])
@pytest.mark.parametrize("cache", ["dual", "prefix", "freecache"])
def test_replayed_steps_decode_the_same_tokens(kind, cache):
    plain = tiny(kind, seed=5)
    model = copy.deepcopy(plain.model)
    assert enable_compile(model, replaying_recorder) is None
    ps = prompts([5, 9, 3], seed=8)  # padded rows; threshold rows finish at different steps
    s = settings(cache=cache, unmask="threshold", threshold=0.4, gen_length=16, block_length=8)
    want = decode(plain.model, SPECIAL, ps, s).tokens
    assert decode(model, SPECIAL, ps, s).tokens == want
    steps: StepGraphs = model.forward
    assert steps.recordings >= 2 and steps.replays > 0 and steps.failed is None


def test_a_failing_recording_decodes_eagerly():
    plain = tiny("llada", seed=5)
    model = copy.deepcopy(plain.model)

    def broken(run):
        raise RuntimeError("capture not supported")

    enable_compile(model, broken)
    s = settings(cache="dual")
    with pytest.warns(RuntimeWarning, match="recording failed"):
        got = decode(model, SPECIAL, prompts([6], seed=1), s)
    assert got.tokens == decode(plain.model, SPECIAL, prompts([6], seed=1), s).tokens


def test_cli_compile_flag_notes_the_fallback(profile_file):
    result = invoke("generate", "how many apples", "-p", str(profile_file), "--compile")
    assert result.exit_code == 0, result.output
    assert "--compile: CUDA graphs need a CUDA device" in result.stderr


@pytest.mark.parametrize("cache", ["dual", "prefix"])
def test_rows_apart_replay_or_run_eagerly_the_same(cache):
    """Rows leaving blocks one by one: per-row column forwards stay eager, lockstep ones replay."""
    plain = tiny("llada", seed=3)
    model = copy.deepcopy(plain.model)
    enable_compile(model, replaying_recorder)
    ps = prompts([4, 8, 6], seed=2)
    s = settings(cache=cache, unmask="threshold", threshold=0.5, gen_length=16, block_length=4)
    want = Decoder(plain.model, SPECIAL, s).run(ps, lockstep=False).result().tokens
    assert Decoder(model, SPECIAL, s).run(ps, lockstep=False).result().tokens == want


@pytest.mark.parametrize("kind", ["llada", "dream"])
@pytest.mark.parametrize("cache", ["dual", "prefix", "freecache"])
def test_pruned_refreshes_run_eagerly_and_cached_steps_replay(kind, cache):
    """Under suffix pruning a refresh computes the whole kept canvas: it is not recorded."""
    plain = tiny(kind, seed=5)
    model = copy.deepcopy(plain.model)
    enable_compile(model, replaying_recorder)
    ps = prompts([5, 9, 3], seed=8)
    s = settings(cache=cache, gen_length=32, block_length=8, suffix_window=4)
    eager = Decoder(plain.model, SPECIAL, s).run(ps)
    want = eager.result()
    assert decode(model, SPECIAL, ps, s).tokens == want.tokens
    steps: StepGraphs = model.forward
    refreshes = {"dual": 4, "prefix": 4, "freecache": 1}[cache]  # full forwards: never recorded
    cached_kinds = 4 if cache != "freecache" else 2 * 4  # a block's window (FreeCache: 2 a block)
    assert steps.recordings <= cached_kinds and steps.replays > 0
    assert steps.recordings + steps.replays == want.forwards - refreshes
