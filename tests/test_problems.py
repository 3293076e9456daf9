"""Problem sets: GSM8K-style data files (`dllm eval --data`), answer extraction, restatement,
and the frozen built-in sets the package ships instead of their generators."""

from __future__ import annotations

import json
import re
from decimal import Decimal
from pathlib import Path

import pytest
import tomli

from dllm_cli.problems import (
    BUILTIN,
    HELDOUT,
    BadLine,
    Problem,
    builtin_problems,
    extract_gsm8k,
    extract_tinygsm,
    parse_problem,
    read_problems,
    restates,
)

ROOT = Path(__file__).resolve().parent.parent
GSM8K_LINE = {
    "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many"
    " clips in May. How many clips did Natalia sell altogether in April and May?",
    "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72"
    " clips altogether in April and May.\n#### 72",
}


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("So 5 + 3 = 8. The answer is 8.", "8"),
        ("The answer is $1,234.50 in total", "1234.50"),
        ("The answer is: 18", "18"),
        ("First 3, then 4. The answer is 7. Later 9.", "7"),  # the answer line wins
        ("The answer is 5. The answer is 6.", "5"),  # the first one
        ("She has 3 and buys 4, so 7", "7"),  # no answer line: the last number
        ("It costs $2,000.", "2000"),
        ("-4 degrees", "-4"),
        ("no number here", None),
    ],
)
def test_gsm8k_extraction(text, number):
    assert extract_gsm8k(text) == (None if number is None else Decimal(number))


def test_builtin_rule_is_the_first_answer_line_only():
    assert extract_tinygsm("3 + 4 = 7. The answer is 7.") == 7
    assert extract_tinygsm("3 + 4 = 7") is None  # no fallback: the rule the tables used
    assert extract_tinygsm("The answer is 7 apples.") is None


def test_gsm8k_line_parses_with_its_worked_solution():
    p = parse_problem(json.dumps(GSM8K_LINE), "f.jsonl", 3)
    assert isinstance(p, Problem) and p.answer == 72 and p.line == 3 and p.names is None
    assert "<<" not in p.solution and p.solution.endswith("April and May. The answer is 72.")
    bare = parse_problem('{"question": "1 + 1?", "answer": 2}', "f.jsonl", 1)
    assert bare.answer == 2 and bare.solution == "The answer is 2."
    assert parse_problem('{"question": "q", "answer": "#### 1,000"}', "f", 1).answer == 1000
    assert parse_problem('{"question": "q", "answer": "2.50"}', "f", 1).answer == Decimal("2.5")


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"answer": "#### 3"}', 'no string "question"'),
        ('{"question": "  ", "answer": 3}', 'no string "question"'),
        ('{"question": "q"}', 'no "answer"'),
        ('{"question": "q", "answer": true}', 'no "answer"'),
        ('{"question": "q", "answer": "so #### many"}', "no number after ####"),
        ('{"question": "q", "answer": "lots"}', "no number as the answer"),
        ('{"question": "q", "answer": "#### NaN"}', "no number after ####"),
        ("[" * 100_000, "not JSON"),
    ],
)
def test_malformed_lines_are_reasons_not_crashes(line, reason):
    bad = parse_problem(line, "f.jsonl", 7)
    assert isinstance(bad, BadLine) and bad.line == 7 and reason in bad.error


def test_file_lines_are_numbered_and_bad_ones_kept(tmp_path):
    path = tmp_path / "d.jsonl"
    good = json.dumps(GSM8K_LINE).encode()
    path.write_bytes(good + b"\n\n{oops\n" + b'{"question": "\xff", "answer": 1}\n' + good)
    problems, bad = read_problems(path)
    assert [p.line for p in problems] == [1, 5]
    assert [(b.line, b.error.split(" (")[0]) for b in bad] == [(3, "not JSON"), (4, "not UTF-8")]
    assert bad[0].record() == {"file": str(path), "line": 3, "error": bad[0].error}


def test_restated_counts_numbers_and_names_exactly():
    tom = builtin_problems("hand")[32]  # Tom has 28 eggs. He gives 8 ... then buys 12 more.
    assert tom.names == ("Tom",)
    good = "Tom has 28 eggs. He gives 8 eggs to a friend. 28 - 8 = 20. Then 12 more. 20 + 12 = 32."
    assert restates(tom, good + " The answer is 32.")
    assert not restates(tom, "Ravi has 2 eggs. He sells 8 eggs. 2 - 8 = 1. 12. The answer is 28.")
    assert not restates(tom, "Tom has 2 eggs. 8 12. The answer is 28.")  # 28 only in the answer
    assert not restates(tom, "Tommy has 28 eggs, 8 and 12.")  # the name, exactly
    file_problem = parse_problem(json.dumps(GSM8K_LINE), "f", 1)
    assert restates(file_problem, "48 24 72") is None  # data files: not counted


def test_builtin_sets_have_their_sizes_and_integer_answers():
    for name, about in BUILTIN.items():
        problems = builtin_problems(name)
        assert len(problems) == about.size
        assert all(p.answer == int(p.answer) and p.question for p in problems)
    assert len({p.question for p in builtin_problems("narrow")}) == 1000


def test_the_wheel_carries_the_frozen_sets_and_no_training_logs():
    """pyproject's package-data globs match every file of the built-in model's folder, and that
    folder holds only what `dllm` runs (weights, tokenizer, config, the frozen sets)."""
    config = tomli.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = config["package-data"]["dllm_cli.tinygsm"]
    base = ROOT / "dllm_cli" / "tinygsm"
    files = [f for f in base.rglob("*") if f.is_file() and "__pycache__" not in f.parts]
    data = [f for f in files if f.suffix != ".py"]
    assert all(any(f.relative_to(base).match(g) for g in globs) for f in data)
    assert not [f for f in data if f.name == "training.json"]
    assert [f.name for f in files if f.suffix == ".py"] == ["__init__.py"]
    assert {f.name for f in HELDOUT.iterdir()} >= {f"{n}.jsonl" for n in BUILTIN}
    assert not re.search(r"recipes", "\n".join(config["packages"]))
