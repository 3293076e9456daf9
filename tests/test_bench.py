"""`dllm bench`: records, speedups against the same run's baseline, outputs, the strategy table."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest
from cli_fixtures import cli_ckpt_fixture, invoke, isolated_fixture, profile_text  # noqa: F401
from guided_fixtures import shared_tinygsm_pair, tinygsm_profile

from dllm_cli import bench_batching
from dllm_cli.bench import REFERENCE, STRATEGIES, BenchPlan, plot, settings_for
from dllm_cli.errors import InputError
from dllm_cli.models import LLaDAModelLM
from dllm_cli.settings import DecodeSettings
from dllm_cli.tinygsm import evaluate

KEYS = {
    "strategy": str,
    "gen_length": int,
    "accuracy": float,
    "tokens_per_second": float,
    "forwards": int,
    "tokens_per_forward": float,
    "seconds": float,
    "speedup": float,
    "mask_violations": int,
    "settings": dict,
}


@pytest.fixture(scope="session")
def tinygsm_pair(tmp_path_factory):
    return shared_tinygsm_pair(tmp_path_factory)


@pytest.fixture
def profile(tmp_path, tinygsm_pair):
    model, guide = tinygsm_pair
    return tinygsm_profile(tmp_path / "p" / "micro.toml", model, guide)


def test_tiny_bench_run(profile, tmp_path):
    out = tmp_path / "out" / "bench.json"
    out.parent.mkdir()
    strategies = "dual+parallel,freecache+guided+early-stop"
    args = ["bench", "-p", str(profile), "--n", "2", "--shots", "1", "--gen-length", "16,32"]
    result = invoke(*args, "--strategies", strategies, "--block-length", "8", "--json", str(out))
    assert result.exit_code == 0, result.output
    records = json.loads(out.read_text())
    assert [(r["strategy"], r["gen_length"]) for r in records] == [
        (name, length)
        for length in (16, 32)
        for name in ("baseline", "dual+parallel", "freecache+guided+early-stop")
    ]
    for r in records:
        for key, kind in KEYS.items():
            assert isinstance(r[key], kind), key
        assert r["mask_violations"] == 0
        assert r["forwards"] > 0 and r["seconds"] > 0
        assert r["settings"]["gen_length"] == r["gen_length"]
        assert r["settings"]["block_length"] == 8
    base = [r for r in records if r["strategy"] == "baseline"]
    assert [r["forwards"] for r in base] == [2 * 16, 2 * 32]  # one token per step, no cache
    guided = [r for r in records if r["guided"]]
    assert guided and all(r["guide_forwards"] > 0 for r in guided)
    markdown = out.with_suffix(".md").read_text()
    assert markdown.startswith("| strategy |") and markdown.count("\n") == 2 + len(records)
    assert "freecache+guided+early-stop" in result.stdout  # the Rich table


class Clock:
    """A clock that moves only when the model runs: one second per forward."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_speedup_is_the_baseline_time_over_the_strategy_time(tmp_path, cli_ckpt, monkeypatch):
    """With every forward costing one (fake) second, a strategy's speedup is the baseline's
    forwards over its own: early stop ends these answers early, so it is well above 1."""
    clock = Clock()
    real_forward = LLaDAModelLM.forward

    def timed_forward(self, *args, **kwargs):
        clock.now += 1.0
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(LLaDAModelLM, "forward", timed_forward)
    monkeypatch.setattr(evaluate, "time", clock)
    profile = tmp_path / "p.toml"  # token 47, frequent in this model's answers, ends them
    profile.write_text(profile_text(cli_ckpt, extra="[model.special]\neos = 47\n"))
    out = tmp_path / "bench.json"
    args = ["bench", "-p", str(profile), "--n", "2", "--shots", "0", "--gen-length", "16"]
    strategies = "dual+parallel+early-stop,prefix"
    result = invoke(*args, "--block-length", "8", "--strategies", strategies, "--json", str(out))
    assert result.exit_code == 0, result.output
    base, stop, prefix = json.loads(out.read_text())
    assert base["forwards"] == 2 * 16 and stop["forwards"] < 16
    for r in (base, stop, prefix):
        assert r["seconds"] == r["forwards"]
        assert r["speedup"] == base["forwards"] / r["forwards"]
    assert stop["speedup"] > 2 and prefix["speedup"] == 1.0  # prefix: one forward per step too


def test_bench_refuses_unknown_strategies_and_lengths(profile):
    bad = invoke("bench", "-p", str(profile), "--n", "1", "--strategies", "dual,turbo")
    assert bad.exit_code == 4 and "turbo" in bad.stderr and "freecache+guided" in bad.stderr
    lengths = invoke("bench", "-p", str(profile), "--n", "1", "--gen-length", "16,x")
    assert lengths.exit_code == 4 and "--gen-length" in lengths.stderr
    nowhere = invoke("bench", "-p", str(profile), "--n", "1", "--json", "no/such/dir/b.json")
    assert nowhere.exit_code == 4 and "does not exist" in nowhere.stderr


def test_guided_strategies_need_a_guide(tmp_path, tinygsm_pair):
    model, _ = tinygsm_pair
    plain = tinygsm_profile(tmp_path / "q" / "plain.toml", model, None)
    args = ["bench", "-p", str(plain), "--n", "1", "--gen-length", "8", "--block-length", "8"]
    asked = invoke(*args, "--strategies", "freecache+guided", "--no-warmup")
    assert asked.exit_code == 4 and "guide" in asked.stderr


def test_strategy_table_changes_only_what_the_name_says():
    base = DecodeSettings(temperature=0.5, seed=3, cache="dual", unmask="threshold")
    base = replace(base, suffix_window=9)  # a profile's window: not a strategy's choice
    reference = settings_for(base, "baseline", 64, 32)
    assert reference.cache == "none" and reference.unmask == "fixed" and reference.steps is None
    assert not reference.early_stop and (reference.temperature, reference.seed) == (0.5, 3)
    assert reference.suffix_window == 0
    for name, strategy in STRATEGIES.items():
        s = settings_for(base, name, 64, 32, window=24)
        changed = {k for k in REFERENCE if getattr(s, k) != getattr(reference, k)}
        named = {k for k, v in strategy.settings.items() if REFERENCE[k] != v}
        assert changed == named | ({"suffix_window"} if strategy.pruned else set()), name
        assert s.suffix_window == (24 if strategy.pruned else 0)
        assert strategy.pruned == name.endswith("prune")
    for name in ("baseline", "dual+parallel", "freecache+guided", "dual+parallel+early-stop"):
        assert name in STRATEGIES
    plan = BenchPlan.make(["dual", "dual"], [64, 64], shots=0)
    assert plan.strategies == ("baseline", "dual") and plan.lengths == (64,)
    other = BenchPlan.make(["dual", "dual+parallel"], [64], shots=0, reference="dual+parallel")
    assert other.strategies == ("dual+parallel", "dual")
    with pytest.raises(InputError, match="turbo"):
        BenchPlan.make(["dual"], [64], shots=0, reference="turbo")
    with pytest.raises(InputError, match="suffix-window"):
        BenchPlan.make(["prune"], [64], shots=0, suffix_window=0)


def test_speedups_against_another_reference(profile, tmp_path):
    """--reference: no baseline run; speedups are that strategy's seconds over each one's."""
    out = tmp_path / "b.json"
    args = ["bench", "-p", str(profile), "--n", "2", "--shots", "0", "--gen-length", "16"]
    args += ["--block-length", "8", "--no-warmup", "--reference", "dual+parallel+early-stop"]
    result = invoke(*args, "--strategies", "freecache+guided+early-stop", "--json", str(out))
    assert result.exit_code == 0, result.output
    ref, guided = json.loads(out.read_text())
    assert (ref["strategy"], guided["strategy"]) == (
        "dual+parallel+early-stop",
        "freecache+guided+early-stop",
    )
    assert ref["speedup"] == 1.0 and ref["guide_forwards"] == 0 and guided["guide_forwards"] > 0
    assert guided["speedup"] == pytest.approx(ref["seconds"] / guided["seconds"])
    assert guided["speedup"] != 1.0  # a real ratio of two different runs
    assert 0.0 < guided["guide_share"] < 1.0 and ref["guide_share"] == 0.0


def test_plot_needs_matplotlib(tmp_path, monkeypatch):
    records = [{"strategy": "baseline", "gen_length": 8, "tokens_per_second": 5.0, "accuracy": 0.5}]
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if not installed
    with pytest.raises(InputError, match="matplotlib"):
        plot(records, tmp_path / "p.png")


def test_plot_writes_a_figure(tmp_path):
    pytest.importorskip("matplotlib")
    records = [
        {"strategy": name, "gen_length": length, "tokens_per_second": tps, "accuracy": acc}
        for name, length, tps, acc in [("baseline", 8, 5.0, 0.5), ("dual", 8, 20.0, 0.4)]
    ]
    plot(records, tmp_path / "p.svg")
    assert (tmp_path / "p.svg").read_text().lstrip().startswith("<?xml")


def test_batching_compare_times_both_batchings_on_the_same_prompts(profile, tmp_path):
    out = tmp_path / "compare.json"
    args = ["bench", "-p", str(profile), "--n", "5", "--shots", "2", "--gen-length", "16"]
    compare = ["--batching-compare", "dual+parallel+early-stop", "--batch-size", "2"]
    result = invoke(*args, *compare, "--block-length", "8", "--rounds", "2", "--json", str(out))
    assert result.exit_code == 0, result.output
    records = json.loads(out.read_text())
    assert [(r["round"], r["batching"]) for r in records] == [
        (0, "static"), (0, "continuous"), (1, "static"), (1, "continuous"),
    ]  # fmt: skip
    for r in records:
        assert r["identical"] == r["prompts"] == 5  # greedy: the same tokens either way
        assert 0 < r["occupancy"] <= 2 and r["forwards"] > 0 and r["seconds"] > 0
    static, continuous = records[0], records[1]
    assert static["answer_tokens"] == continuous["answer_tokens"]
    assert continuous["speedup"] == pytest.approx(static["seconds"] / continuous["seconds"])
    assert "| continuous |" in result.stdout


def test_batching_compare_takes_a_guided_strategy(profile, tmp_path):
    """Guided decoding batches continuously: the same text as static batches."""
    out = tmp_path / "guided.json"
    args = ["bench", "-p", str(profile), "--n", "4", "--shots", "1", "--gen-length", "16"]
    compare = ["--batching-compare", "freecache+guided+early-stop", "--batch-size", "2"]
    result = invoke(*args, *compare, "--block-length", "8", "--json", str(out))
    assert result.exit_code == 0, result.output
    records = json.loads(out.read_text())
    assert [r["batching"] for r in records] == ["static", "continuous"]
    assert all(r["identical"] == r["prompts"] == 4 for r in records)


def test_mixed_shots_cycle_from_zero_to_the_most():
    def encode(text: str) -> list[int]:
        return [len(text)]

    lengths = [p[0] for p in bench_batching.mixed_shots(encode, 6, 2)]
    fixed = [evaluate.held_out(encode, 1, i % 3, i)[0].prompt[0] for i in range(6)]
    assert lengths == fixed and lengths[0] < lengths[2]  # 0 shots shorter than 2 shots
