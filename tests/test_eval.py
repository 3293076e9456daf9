"""`dllm eval` and the evaluate library: JSON schema, accounting, the checker, guided runs."""

from __future__ import annotations

import json

import pytest
from cli_fixtures import invoke, isolated_fixture  # noqa: F401
from decode_fixtures import EOS, EOT, MASK, SPECIAL, prompts, tiny
from guided_fixtures import shared_tinygsm_pair, tinygsm_profile

from dllm_cli.decoding import answer_length
from dllm_cli.settings import DecodeSettings
from dllm_cli.tinygsm import data
from dllm_cli.tinygsm.evaluate import Task, held_out, score


@pytest.fixture(scope="session")
def tinygsm_pair(tmp_path_factory):
    return shared_tinygsm_pair(tmp_path_factory)


@pytest.fixture
def guided_profile(tmp_path, tinygsm_pair):
    model, guide = tinygsm_pair
    return tinygsm_profile(tmp_path / "p" / "micro.toml", model, guide)


def test_eval_json_schema_and_checker(guided_profile):
    args = ["eval", "-p", str(guided_profile), "--n", "3", "--shots", "1", "--no-guide"]
    result = invoke(*args, "--batch-size", "2", "--json", "--details")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    for key, kind in [
        ("accuracy", float),
        ("n", int),
        ("correct", int),
        ("tokens", int),
        ("tokens_per_second", float),
        ("gen_tokens_per_second", float),
        ("forwards", int),
        ("seconds", float),
        ("shots", int),
        ("settings", dict),
    ]:
        assert isinstance(report[key], kind), key
    assert report["n"] == 3 and report["shots"] == 1 and report["guide"] is None
    assert 0.0 <= report["accuracy"] <= 1.0
    assert report["accuracy"] == report["correct"] / 3
    assert report["forwards"] > 0 and report["guide_forwards"] == 0
    assert 3 <= report["tokens"] <= 3 * 32 and report["mask_violations"] == 0
    assert report["tokens_per_second"] == pytest.approx(report["tokens"] / report["seconds"])
    for i, p in enumerate(report["problems"]):
        assert p["index"] == i and p["answer"] == data.test_split()[i].answer
        assert p["correct"] == data.is_correct(p["text"], p["answer"])
    assert report["correct"] == sum(p["correct"] for p in report["problems"])


def test_eval_guided_summary(guided_profile):
    result = invoke("eval", "-p", str(guided_profile), "--n", "2", "--shots", "0")
    assert result.exit_code == 0, result.output
    assert "accuracy" in result.stdout and "guide" in result.stdout
    as_json = invoke("eval", "-p", str(guided_profile), "--n", "2", "--shots", "0", "--json")
    report = json.loads(as_json.stdout)
    assert report["guide"]["accept"] == "exact" and report["guide_forwards"] > 0
    rule = invoke("eval", "-p", str(guided_profile), "--n", "1", "--accept", "topk:0")
    assert rule.exit_code == 2 and "topk:K" in rule.stderr


def test_eval_refuses_bad_counts(guided_profile):
    for flag, value in [("--n", "0"), ("--batch-size", "0"), ("--start", "999")]:
        args = ["eval", "-p", str(guided_profile), "--n", "2", "--no-guide", flag, value]
        result = invoke(*args)
        assert result.exit_code == 4, (flag, result.output)


def test_held_out_prompts_use_fixed_shots():
    tasks = held_out(lambda text: [len(text)], n=3, shots=2, start=5)
    for t in tasks:
        p = data.test_split()[t.index]
        assert t.answer == p.answer
        assert t.prompt == [len(data.few_shot_prompt(p.question, data.shots_for(t.index, 2)))]
    assert [t.index for t in tasks] == [5, 6, 7]


def test_score_counts_in_order_across_batches():
    """The checker sees each row's text in task order, whatever the batch size."""
    lm = tiny("llada")
    answers = [3, 8, 5, 13, 21]
    tasks = [
        Task(i, p, a)
        for i, (p, a) in enumerate(zip(prompts([3, 5, 4, 2, 6]), answers, strict=True))
    ]
    said = iter(["The answer is 3.", "The answer is 9.", "no idea", "The answer is 13.", "8"])
    s = DecodeSettings(gen_length=8, block_length=4)
    out = score(lm.model, lm.special, tasks, s, text=lambda tokens: next(said), batch_size=2)
    assert [r.correct for r in out.results] == [True, False, False, True, False]
    assert [r.predicted for r in out.results] == [3, 9, None, 13, None]
    assert out.accuracy == 0.4 and out.n == 5
    assert out.forwards == 3 * 8  # three batches, one token per step, no early stop


def test_answer_length_counts_through_the_first_stop():
    assert answer_length([5, 6, EOT, EOS, EOS], SPECIAL.stop) == 3
    assert answer_length([EOS, 7], SPECIAL.stop) == 1
    assert answer_length([5, 6, 7], SPECIAL.stop) == 3
    assert MASK not in SPECIAL.stop
