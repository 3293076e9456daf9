"""`dllm eval` and the evaluate library: JSON schema, accounting, the checker, guided runs."""

from __future__ import annotations

import json
import re

import pytest
from cli_fixtures import GEN, cli_ckpt_fixture, invoke, isolated_fixture, profile_text  # noqa: F401
from decode_fixtures import prompts, tiny
from guided_fixtures import shared_tinygsm_pair, tinygsm_profile

from dllm_cli.evaluate import Task, held_out, score
from dllm_cli.problems import (
    BUILTIN,
    builtin_problems,
    builtin_shots,
    extract_tinygsm,
    few_shot_prompt,
)
from dllm_cli.runtime import Runtime
from dllm_cli.settings import DecodeSettings

NARROW = builtin_problems("narrow")


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
        ("split", str),
        ("restated", int),
        ("settings", dict),
    ]:
        assert isinstance(report[key], kind), key
    assert report["n"] == 3 and report["shots"] == 1 and report["guide"] is None
    assert report["forwards"] > 0 and report["guide_forwards"] == 0
    assert 3 <= report["tokens"] <= 3 * 32 and report["mask_violations"] == 0
    for i, p in enumerate(report["problems"]):
        assert p["index"] == i and p["answer"] == NARROW[i].answer
        assert p["correct"] == (extract_tinygsm(p["text"]) == p["answer"])
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
    bad = [["--n", "0"], ["--batch-size", "0"], ["--start", "999"], ["--split", "easy"]]
    bad += [["--split", "hand2", "--start", "99"]]  # hand2 has problems 0..99
    for extra in bad:
        args = ["eval", "-p", str(guided_profile), "--n", "2", "--no-guide", *extra]
        result = invoke(*args)
        assert result.exit_code == 2, (extra, result.output)


def test_held_out_prompts_use_fixed_shots():
    tasks = held_out(lambda text: [len(text)], n=3, shots=2, start=5)
    for t in tasks:
        p = NARROW[t.index]
        assert t.answer == p.answer
        assert t.prompt == [len(few_shot_prompt(p.question, builtin_shots("narrow", t.index, 2)))]
    assert [t.index for t in tasks] == [5, 6, 7]


@pytest.mark.parametrize("split", list(BUILTIN))
def test_held_out_splits_carry_their_problems_and_shots(split):
    """Each split's problems in order, with the shots its own table names, and the problem kept
    for the restatement check (recipes/tinygsm/tests/test_freeze.py: the same as generated)."""
    tasks = held_out(lambda text: [len(text)], n=2, shots=1, start=3, split=split)
    for t in tasks:
        p = builtin_problems(split)[t.index]
        assert t.problem == p and t.answer == p.answer and len(builtin_problems(split)) > 99
        assert t.prompt == [len(few_shot_prompt(p.question, builtin_shots(split, t.index, 1)))]
    assert builtin_shots("hand", 5, 3) == builtin_shots("rich", 5, 3)  # hand sets: rich shots
    assert len(builtin_shots(split, 0, 8)) == 8 and builtin_shots(split, 0, 2)[1].solution


def test_restated_counts_answers_that_repeat_the_facts():
    """An answer that repeats every number and name of its question counts as restated; one
    that drops a number does not; tasks without a problem leave the count unset."""
    lm = tiny("llada")
    problem = builtin_problems("hand2")[0]
    numbers = " ".join(re.findall(r"\d+", problem.question))
    good = f"{' '.join(problem.names)} {numbers}. The answer is {problem.answer}."
    said = iter([good, f"The answer is {problem.answer}."])
    tasks = [Task(i, p, problem.answer, problem) for i, p in enumerate(prompts([3, 4]))]
    s = DecodeSettings(gen_length=4, block_length=4)
    out = score(lm.model, lm.special, tasks, s, text=lambda tokens: next(said))
    assert [r.restated for r in out.results] == [True, False] and out.restated == 1
    assert out.correct == 2 and out.summary()["restated"] == 1
    bare = score(lm.model, lm.special, [Task(0, prompts([3])[0], 1)], s, text=lambda t: "1")
    assert bare.restated is None and bare.summary()["restated"] is None


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


def test_eval_accuracy_is_the_share_of_right_answers(guided_profile, monkeypatch):
    """Scripted answers (one right, one wrong, one without an answer line): 1 of 3, exactly."""
    truth = [int(p.answer) for p in NARROW[:3]]
    said = iter([f"The answer is {truth[0]}.", f"The answer is {truth[1] + 1}.", "no idea"])
    monkeypatch.setattr(Runtime, "text", lambda self, tokens: next(said))
    args = ["eval", "-p", str(guided_profile), "--n", "3", "--shots", "0", "--no-guide"]
    report = json.loads(invoke(*args, "--no-warmup", "--json", "--details").stdout)
    assert (report["correct"], report["accuracy"]) == (1, 1 / 3)
    assert [p["predicted"] for p in report["problems"]] == [truth[0], truth[1] + 1, None]


def test_generate_stats_and_eval_count_answer_tokens_alike(tmp_path, cli_ckpt):
    """One definition of an answer's end: the same answers count the same tokens in `generate
    --stats` and `eval`, through the first stop token, which here often comes early."""
    stop = (47, 68)  # token 47 (frequent in this model's answers) made EOS, and end-of-turn
    profile = tmp_path / "p.toml"
    profile.write_text(profile_text(cli_ckpt, extra=f"[model.special]\neos = {stop[0]}\n"))
    report = json.loads(
        invoke("eval", "-p", str(profile), "--n", "3", "--shots", "0", "--json").stdout
    )
    questions = [json.dumps({"prompt": p.question}) for p in NARROW[:3]]
    stdin = "\n".join(questions) + "\n"
    args = ["generate", "-", "-p", str(profile), "--json-input", "--json-canvas", "--stats"]
    generated = invoke(*args, input=stdin)
    answers = [json.loads(line)["canvas_ids"] for line in generated.stdout.splitlines()]
    through_stop = [next((i + 1 for i, t in enumerate(a) if t in stop), len(a)) for a in answers]
    assert sum(through_stop) < 3 * GEN  # some answers end early, so the stop's own count shows
    assert f" {sum(through_stop)} tokens," in generated.stderr
    assert report["tokens"] == sum(through_stop)


def test_eval_summary_counts_answer_tokens_as_bench_does(guided_profile):
    """One speed: answer tokens up to their end (the EOS padding past them is no output)."""
    args = ["eval", "-p", str(guided_profile), "--n", "2", "--shots", "0", "--no-guide"]
    summary = invoke(*args, "--no-warmup")
    report = json.loads(invoke(*args, "--no-warmup", "--json").stdout)
    (speed,) = [line for line in summary.stdout.splitlines() if line.startswith("speed")]
    assert "answer tokens" in speed and "positions" not in speed
    assert speed.count("tok/s") == 1 and report["tokens_per_second"] > 0
