"""`dllm bench --frontier`: each rule's sweep on the same problems, batch-1 tokens per forward."""

from __future__ import annotations

import json

import pytest
from cli_fixtures import invoke, isolated_fixture  # noqa: F401
from guided_fixtures import shared_tinygsm_pair, tinygsm_profile

from dllm_cli.decoding import decode
from dllm_cli.evaluate import held_out
from dllm_cli.runtime import open_runtime
from dllm_cli.settings import DecodeSettings


@pytest.fixture(scope="session")
def tinygsm_pair(tmp_path_factory):
    return shared_tinygsm_pair(tmp_path_factory)


@pytest.fixture
def profile(tmp_path, tinygsm_pair):
    model, guide = tinygsm_pair
    return tinygsm_profile(tmp_path / "p" / "micro.toml", model, guide)


def test_frontier_table_json_and_batch_one_forwards(profile, tmp_path):
    out = tmp_path / "frontier.json"
    args = ["bench", "-p", str(profile), "--n", "3", "--shots", "1", "--gen-length", "16"]
    frontier = "threshold=0.9,eb=0.5,klass=0.1"
    result = invoke(*args, "--block-length", "8", "--batch-size", "2", "--suffix-window", "0",
                    "--cache", "dual", "--frontier", frontier, "--json", str(out))  # fmt: skip
    assert result.exit_code == 0, result.output
    records = json.loads(out.read_text())
    assert [(r["rule"], r["value"]) for r in records] == [
        ("one-per-step", None), ("threshold", 0.9), ("eb", 0.5), ("klass", 0.1),
    ]  # fmt: skip
    assert all(r["mask_violations"] == 0 and r["settings"]["cache"] == "dual" for r in records)
    assert "| klass | kl_threshold | 0.1 |" in result.stdout
    assert "| eb | eb_gamma | 0.5 |" in out.with_suffix(".md").read_text()
    # tokens per forward is what each problem costs alone: replay one rule at batch 1
    rt = open_runtime(str(profile), {}, use_guide=False)
    s = DecodeSettings(**records[1]["settings"])
    forwards = sum(
        decode(rt.loaded.model, rt.loaded.special, [t.prompt], s).forwards
        for t in held_out(rt.encode, 3, 1)
    )
    assert records[1]["forwards"] == forwards


def test_frontier_refuses_unknown_rules_and_bad_values(profile):
    base = ["bench", "-p", str(profile), "--n", "1", "--gen-length", "16"]
    bad = invoke(*base, "--frontier", "threshold,turbo")
    assert bad.exit_code == 2 and "turbo" in bad.stderr and "klass" in bad.stderr
    value = invoke(*base, "--frontier", "eb=x")
    assert value.exit_code == 2 and "eb=x" in value.stderr
    out = invoke(*base, "--frontier", "threshold=1.5")
    assert out.exit_code != 0 and "threshold must be in (0, 1]" in out.stderr
    lengths = invoke(*base[:-1], "16,32", "--frontier", "eb")
    assert lengths.exit_code == 2 and "one --gen-length" in lengths.stderr
