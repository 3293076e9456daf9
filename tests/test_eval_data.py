"""`dllm eval --data FILE`: any GSM8K-style JSONL file, its own or another file's examples,
per-problem records, and malformed lines as error records (exit 4), never a crash."""

from __future__ import annotations

import json

import pytest
from cli_fixtures import invoke
from guided_fixtures import shared_tinygsm_pair, tinygsm_profile

from dllm_cli.evaluate import from_file
from dllm_cli.runtime import Runtime


@pytest.fixture(scope="session")
def tinygsm_pair(tmp_path_factory):
    return shared_tinygsm_pair(tmp_path_factory)


@pytest.fixture
def profile(tmp_path, tinygsm_pair):
    model, _ = tinygsm_pair
    return tinygsm_profile(tmp_path / "p" / "micro.toml", model, None)


def line(question: str, answer) -> str:
    return json.dumps({"question": question, "answer": answer})


def data_file(tmp_path, *lines: str):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_first_k_lines_are_the_shots_and_are_not_scored(tmp_path):
    path = data_file(tmp_path, *(line(f"q{i}?", f"w{i} <<1+1=2>>. #### {i}") for i in range(5)))
    tasks, bad = from_file(lambda text: [text], path, None, shots=2)
    assert [t.index for t in tasks] == [3, 4, 5] and not bad  # lines 3..5
    prompt = tasks[0].prompt[0]
    assert prompt.startswith("Question: q0?\nAnswer: w0 . The answer is 0.\n\nQuestion: q1?")
    assert prompt.endswith("Question: q2?") and tasks[0].answer == 2
    (tmp_path / "o").mkdir()
    other = data_file(tmp_path / "o", line("s?", 9))
    tasks, _ = from_file(lambda text: [text], path, 2, shots=1, start=1, shots_from=other)
    assert [t.index for t in tasks] == [2, 3]
    assert tasks[0].prompt[0] == "Question: s?\nAnswer: The answer is 9.\n\nQuestion: q1?"


def test_eval_data_scores_records_and_reports_bad_lines(tmp_path, profile, monkeypatch):
    """Scripted answers: the answer line, the last-number fallback, a wrong one; a malformed
    line is an error record naming its line and the exit code is 4 after scoring the rest."""
    path = data_file(
        tmp_path,
        line("shot question?", "1 + 1 = 2. #### 2"),
        line("How many?", "#### 1,000"),
        "{broken",
        line("And now?", 7),
        line("Last?", "#### 3.5"),
    )
    said = iter(["So the answer is clear. The answer is $1,000.", "3 and then 7", "4"])
    monkeypatch.setattr(Runtime, "text", lambda self, tokens: next(said))
    records = tmp_path / "records.jsonl"
    args = ["eval", "-p", str(profile), "--data", str(path), "--shots", "1", "--no-warmup"]
    result = invoke(*args, "--json", "--records", str(records))
    assert result.exit_code == 4, result.output
    report = json.loads(result.stdout)
    assert (report["n"], report["correct"], report["restated"]) == (3, 2, None)
    assert report["split"] is None and report["data"] == str(path) and report["shots"] == 1
    assert report["errors"] == [
        {"file": str(path), "line": 3, "error": report["errors"][0]["error"]}
    ]
    assert f"{path}:3: not JSON" in result.stderr and "1 malformed line" in result.stderr
    rows = [json.loads(r) for r in records.read_text().splitlines()]
    assert [(r.get("line"), r.get("gold"), r.get("extracted"), r.get("right")) for r in rows] == [
        (2, 1000, 1000, True),
        (4, 7, 7, True),
        (5, 3.5, 4, False),
        (3, None, None, None),
    ]
    assert rows[0]["question"] == "How many?" and rows[1]["text"] == "3 and then 7"
    assert "error" in rows[3] and "restated" not in json.dumps(rows)


def test_eval_data_summary_names_the_file(tmp_path, profile, monkeypatch):
    path = data_file(tmp_path, line("a?", 1), line("b?", 2))
    monkeypatch.setattr(Runtime, "text", lambda self, tokens: "The answer is 2.")
    result = invoke("eval", "-p", str(profile), "--data", str(path), "--shots", "1")
    assert result.exit_code == 0, result.output
    assert f"(1/1 {path}, 1-shot)" in result.stdout and "restated" not in result.stdout


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--shots", "5"], "has only 2 usable problems"),
        (["--shots", "2"], "no problems to score"),
        (["--shots-from", "{missing}"], "cannot read"),
        (["--n", "0"], "--n must be at least 1"),  # a flag out of range: exit 2
        (["--records", "{missing}/r.jsonl"], "does not exist"),
    ],
)
def test_eval_data_refuses_what_cannot_be_scored(tmp_path, profile, extra, message):
    path = data_file(tmp_path, line("a?", 1), line("b?", 2))
    extra = [e.replace("{missing}", str(tmp_path / "nope.jsonl")) for e in extra]
    result = invoke("eval", "-p", str(profile), "--data", str(path), *extra)
    code = 2 if extra[0] in ("--n", "--records") else 4  # usage errors; bad input
    assert result.exit_code == code and message in result.stderr, result.output
    assert "Traceback" not in result.output


def test_shots_from_needs_data_and_built_in_shots_stop_at_eight(profile, tmp_path):
    result = invoke("eval", "-p", str(profile), "--shots-from", str(tmp_path / "x.jsonl"))
    assert result.exit_code == 2 and "--shots-from needs --data" in result.stderr
    result = invoke("eval", "-p", str(profile), "--n", "1", "--shots", "9")
    assert result.exit_code == 2 and "carry 8 examples" in result.stderr
    both = invoke("eval", "-p", str(profile), "--data", "x.jsonl", "--split", "wide")
    assert both.exit_code == 2 and "choose one" in both.stderr
    missing = invoke("eval", "-p", str(profile), "--data", str(tmp_path / "none.jsonl"))
    assert missing.exit_code == 4 and "cannot read" in missing.stderr
