"""`dllm bench --prompt-length`: synthetic prompts on any checkpoint, bench's records and table."""

from __future__ import annotations

import json

from cli_fixtures import (  # noqa: F401
    CONTEXT,
    cli_ckpt_fixture,
    invoke,
    isolated_fixture,
    profile_file_fixture,
)

from dllm_cli.decoding import decode
from dllm_cli.models.loading import load_model
from dllm_cli.settings import DecodeSettings
from dllm_cli.throughput import ordinary_ids, synthetic_tasks


def test_synthetic_prompts_are_ordinary_and_deterministic(cli_ckpt):
    loaded = load_model(cli_ckpt, dtype="float32", device="cpu")
    tasks = synthetic_tasks(loaded, 3, 20, seed=5)
    assert [len(t.prompt) for t in tasks] == [20, 20, 20]
    assert [t.prompt for t in synthetic_tasks(loaded, 3, 20, seed=5)] == [t.prompt for t in tasks]
    assert tasks[0].prompt != synthetic_tasks(loaded, 1, 20, seed=6)[0].prompt
    special = set(loaded.tokenizer.all_special_ids) | {loaded.special.mask, loaded.special.eos}
    ids = ordinary_ids(loaded)
    assert special.isdisjoint(ids) and max(ids) < loaded.model.vocab_size
    words = loaded.tokenizer.convert_ids_to_tokens(tasks[0].prompt)
    assert not any(w.startswith("<|") for w in words)  # real words, no special tokens


def test_throughput_bench_run(profile_file, cli_ckpt, tmp_path):
    out = tmp_path / "t.json"
    args = ["bench", "-p", str(profile_file), "--prompt-length", "24", "--n", "2"]
    args += ["--gen-length", "16", "--block-length", "8", "--strategies", "dual+parallel"]
    result = invoke(*args, "--json", str(out))
    assert result.exit_code == 0, result.output
    records = json.loads(out.read_text())
    assert [r["strategy"] for r in records] == ["baseline", "dual+parallel"]
    for r in records:
        assert r["accuracy"] is None and r["correct"] is None and r["prompt_length"] == 24
        assert r["n"] == 2 and r["forwards"] > 0 and r["seconds"] > 0 and r["tokens"] > 0
        assert r["mask_violations"] == 0
    assert records[0]["forwards"] == 2 * 16  # baseline: one token per step
    # The timed decodes are the real ones: the same prompts decode to the same forwards.
    loaded = load_model(cli_ckpt, dtype="float32", device="cpu")
    prompts = [t.prompt for t in synthetic_tasks(loaded, 2, 24, seed=0)]
    s = DecodeSettings(**records[1]["settings"])
    runs = [decode(loaded.model, loaded.special, [p], s) for p in prompts]
    assert sum(r.forwards for r in runs) == records[1]["forwards"]
    table = out.with_suffix(".md").read_text().splitlines()
    assert table[0].startswith("| strategy |") and "| - |" in table[2]  # no accuracy
    assert "synthetic prompts of 24 tokens" in result.stdout


def test_throughput_bad_input(profile_file, tmp_path):
    base = ["bench", "-p", str(profile_file), "--n", "1", "--gen-length", "16"]
    zero = invoke(*base, "--prompt-length", "0")
    assert zero.exit_code != 0 and "--prompt-length must be at least 1" in zero.stderr
    long = invoke(*base, "--prompt-length", str(CONTEXT))
    assert long.exit_code != 0 and "exceeds the model's context" in long.stderr
    plot = invoke(*base, "--prompt-length", "8", "--plot", str(tmp_path / "p.svg"))
    assert plot.exit_code != 0 and "--plot" in plot.stderr


def test_pruned_strategies_take_the_bench_window(profile_file, tmp_path):
    out = tmp_path / "p.json"
    args = ["bench", "-p", str(profile_file), "--prompt-length", "8", "--n", "1"]
    args += ["--gen-length", "32", "--block-length", "8", "--suffix-window", "4"]
    args += ["--strategies", "prefix+parallel+early-stop,prefix+parallel+early-stop+prune"]
    result = invoke(*args, "--reference", "prefix+parallel+early-stop", "--json", str(out))
    assert result.exit_code == 0, result.output
    plain, pruned = json.loads(out.read_text())
    assert plain["settings"]["suffix_window"] == 0 and pruned["settings"]["suffix_window"] == 4
    zero = invoke(*args[:-2], "--suffix-window", "0")
    assert zero.exit_code == 2 and "suffix-window" in zero.stderr
