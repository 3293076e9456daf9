"""Problem sets to score: the built-in model's frozen held-out sets, or any GSM8K-style file.

Built-in sets (`dllm eval --split NAME`) are JSONL files frozen from the TinyGSM generators
(`recipes/tinygsm/freeze.py` writes them, a recipe test checks they still match), with each
problem's fixed few-shot examples beside them, so scoring never runs a generator:

- `heldout/NAME.jsonl`: one `{"question", "solution", "answer", "names"}` per line;
- `heldout/shots-SOURCE.jsonl.gz`: line i holds problem i's first MAX_SHOTS solved examples
  as `[question, solution]` pairs (`hand` and `hand2` share the `rich` examples).

A data file (`dllm eval --data FILE`) holds one `{"question", "answer"}` object per line, as
GSM8K does: the gold number follows `####` in the answer text (a bare number works too).
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from functools import cache
from pathlib import Path

from dllm_cli.errors import InputError, UsageError

HELDOUT = Path(__file__).resolve().parent / "tinygsm" / "heldout"
MAX_SHOTS = 8  # solved examples frozen per built-in problem


@dataclass(frozen=True)
class Problem:
    """A question, its gold answer, a worked solution to show as an example, and (built-in sets)
    the names an answer must repeat to count as restating it."""

    question: str
    answer: Decimal
    solution: str
    names: tuple[str, ...] | None = None  # None: not a built-in problem, no restatement check
    line: int = 0  # 1-based line in its file


@dataclass(frozen=True)
class BadLine:
    """A line of a data file that is not a problem, and why."""

    file: str
    line: int
    error: str

    def record(self) -> dict:
        return {"file": self.file, "line": self.line, "error": self.error}


@dataclass(frozen=True)
class BuiltinSet:
    """A frozen held-out set and the file its few-shot examples come from."""

    size: int
    shots_from: str
    about: str


BUILTIN: dict[str, BuiltinSet] = {
    "narrow": BuiltinSet(1000, "narrow", "the first-round generator (1000 problems)"),
    "wide": BuiltinSet(1000, "wide", "counts to 99, more names and objects (1000)"),
    "rich": BuiltinSet(1000, "rich", "many phrasings, invented names (1000)"),
    "hand": BuiltinSet(100, "rich", "written by hand (100)"),
    "hand2": BuiltinSet(100, "rich", "written by hand, blind (100)"),
}


def solution_text(work: str, answer: Decimal) -> str:
    """A worked solution as the examples show it: the work, then `The answer is N.`."""
    end = f"The answer is {number_text(answer)}."
    return f"{work} {end}" if work else end


def number_text(value: Decimal) -> str:
    """72, not 72.00 or 7.2E+1 (what records and prompts show)."""
    if value == value.to_integral_value():
        return str(value.quantize(Decimal(1)))
    return format(value.normalize(), "f")


def json_number(value: Decimal | int | None) -> int | float | None:
    """A number as the JSON number it is (int when whole)."""
    if value is None or isinstance(value, int):
        return value
    return int(value) if value == value.to_integral_value() else float(value)


@cache
def builtin_problems(name: str) -> tuple[Problem, ...]:
    """A frozen built-in set, in order."""
    if name not in BUILTIN:
        raise UsageError(f"unknown split {name!r} (choose from {', '.join(BUILTIN)})")
    rows = read_lines(HELDOUT / f"{name}.jsonl")
    return tuple(
        Problem(r["question"], Decimal(r["answer"]), r["solution"], tuple(r["names"]), i + 1)
        for i, r in enumerate(rows)
    )


@cache
def _builtin_shots(source: str) -> tuple[tuple[Problem, ...], ...]:
    with gzip.open(HELDOUT / f"shots-{source}.jsonl.gz", "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return tuple(tuple(Problem(q, Decimal(0), s) for q, s in row) for row in rows)


def builtin_shots(name: str, index: int, k: int) -> tuple[Problem, ...]:
    """Built-in problem `index`'s first k solved examples (the same k-prefix for every k)."""
    if k > MAX_SHOTS:
        raise UsageError(f"--shots {k}: the built-in sets carry {MAX_SHOTS} examples a problem")
    return _builtin_shots(BUILTIN[name].shots_from)[index][:k]


def read_lines(path: Path) -> list[dict]:
    """A JSONL file written by the recipe (trusted: every line is a JSON object)."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


# --- data files -----------------------------------------------------------------------------
NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?"
CALCULATOR = re.compile(r"<<[^>]*>>")  # GSM8K's calculator annotations, e.g. <<48/2=24>>


def parse_number(text: str) -> Decimal | None:
    """`$1,234.50` -> 1234.50: commas and `$` stripped, a trailing period dropped."""
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def parse_problem(raw: str, file: str, line: int) -> Problem | BadLine:
    """One data-file line as a problem, or the reason it is not one."""
    try:
        row = json.loads(raw)
    except (json.JSONDecodeError, RecursionError, ValueError) as e:
        return BadLine(file, line, f"not JSON ({e})")
    if not isinstance(row, dict):
        return BadLine(file, line, "not a JSON object")
    question, answer = row.get("question"), row.get("answer")
    if not isinstance(question, str) or not question.strip():
        return BadLine(file, line, 'no string "question"')
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        return BadLine(file, line, 'no "answer" (a string or a number)')
    work, _, gold = str(answer).rpartition("####")
    value = parse_number(gold)
    if value is None:
        where = "after ####" if "####" in str(answer) else "as the answer"
        return BadLine(file, line, f"no number {where}: {gold.strip()[:40]!r}")
    work = " ".join(CALCULATOR.sub("", work).split())
    return Problem(question, value, solution_text(work, value), line=line)


def read_problems(path: Path) -> tuple[list[Problem], list[BadLine]]:
    """Every line of a data file: the problems, and an error for each line that is not one."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror or e}") from None
    problems: list[Problem] = []
    bad: list[BadLine] = []
    for i, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue  # blank lines (a trailing newline) are not problems
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            bad.append(BadLine(str(path), i, f"not UTF-8 (byte offset {e.start})"))
            continue
        parsed = parse_problem(text, str(path), i)
        (bad if isinstance(parsed, BadLine) else problems).append(parsed)
    return problems, bad


# --- answers --------------------------------------------------------------------------------
TINYGSM_ANSWER = re.compile(r"The answer is (-?\d+)\.")
ANSWER_LINE = re.compile(rf"The answer is\s*:?\s*({NUMBER})")
ANY_NUMBER = re.compile(NUMBER)


def extract_tinygsm(text: str) -> Decimal | None:
    """The built-in sets' rule: the integer on the first `The answer is N.` line, else none."""
    m = TINYGSM_ANSWER.search(text)
    return Decimal(m.group(1)) if m else None


def extract_gsm8k(text: str) -> Decimal | None:
    """GSM8K harnesses' rule: the number after the first "The answer is", else the last number
    in the text (commas and `$` stripped)."""
    m = ANSWER_LINE.search(text)
    if m is not None:
        return parse_number(m.group(1))
    found = ANY_NUMBER.findall(text)
    return parse_number(found[-1]) if found else None


NAME_WORDS = re.compile(r"[A-Za-z]+")
DIGITS = re.compile(r"\d+")


def restates(problem: Problem, text: str) -> bool | None:
    """The answer's work (before its answer line) repeats every number of the question and
    every name it mentions, exactly; None for problems that name none (data files)."""
    if problem.names is None:
        return None
    worked = text.split("The answer is", 1)[0]
    written = set(DIGITS.findall(worked))
    words = set(NAME_WORDS.findall(worked))
    return set(DIGITS.findall(problem.question)) <= written and set(problem.names) <= words


def few_shot_prompt(question: str, shots: tuple[Problem, ...] | list[Problem]) -> str:
    """The user message: K solved examples then the question (the bare question when K = 0)."""
    if not shots:
        return question
    parts = [f"Question: {s.question}\nAnswer: {s.solution}" for s in shots]
    parts.append(f"Question: {question}")
    return "\n\n".join(parts)
