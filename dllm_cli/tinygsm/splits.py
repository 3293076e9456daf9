"""Which TinyGSM problems are trained on and which are held out, for both generators.

Three held-out sets, none ever trained on:
- `narrow`: the first 1000 distinct problems of the narrow generator (data.test_split; the set
  every earlier figure was measured on, kept unchanged for comparison);
- `wide`: 1000 problems of the wide generator (wide.py: counts up to 99, more names and
  phrasings);
- `hand`: 100 questions written by hand in phrasings neither generator produces
  (handwritten.jsonl), with their answers and the names they mention.
The training stream mixes the two generators and skips every held-out question.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from dllm_cli.tinygsm.data import TEST_SIZE, Problem, generate_problem, shots_for, test_split
from dllm_cli.tinygsm.wide import generate_wide_problem

WIDE_TEST_SEED = 20_261_130
HAND_FILE = Path(__file__).resolve().parent / "handwritten.jsonl"


@dataclass(frozen=True)
class HandProblem(Problem):
    """A hand-written question: no worked solution, but the names it mentions."""

    names: tuple[str, ...] = ()


NUMBER = re.compile(r"\d+")


def restates(problem: Problem, text: str) -> bool:
    """The answer repeats every number of the question and every name it mentions, exactly.

    Only the part before the answer line counts (the worked restatement); names come from the
    hand-written set's `names`, or the question's first word for generated problems.
    """
    worked = text.split("The answer is", 1)[0]
    names = getattr(problem, "names", None)
    if names is None:
        names = (problem.question.split()[0],)
    written = set(NUMBER.findall(worked))
    words = set(re.findall(r"[A-Za-z]+", worked))
    return set(NUMBER.findall(problem.question)) <= written and set(names) <= words


@cache
def hand_split() -> tuple[HandProblem, ...]:
    rows = [json.loads(line) for line in HAND_FILE.read_text().splitlines() if line.strip()]
    return tuple(
        HandProblem(r["question"], r["work"], r["answer"], tuple(r["names"])) for r in rows
    )


@cache
def wide_test_split(size: int = TEST_SIZE) -> tuple[Problem, ...]:
    """The first distinct wide problems drawn from WIDE_TEST_SEED (never a narrow held-out one)."""
    rng = random.Random(WIDE_TEST_SEED)
    seen = {p.question for p in test_split()}
    out: list[Problem] = []
    while len(out) < size:
        prob = generate_wide_problem(rng)
        if prob.question not in seen:
            seen.add(prob.question)
            out.append(prob)
    return tuple(out)


@cache
def held_out_questions() -> frozenset[str]:
    """Every question of every held-out set."""
    sets = (test_split(), wide_test_split(), hand_split())
    return frozenset(p.question for s in sets for p in s)


def mixed_stream(seed: int, wide_frac: float) -> Iterator[Problem]:
    """Training problems: wide with probability `wide_frac`, else narrow; held-out ones skipped."""
    rng = random.Random(seed)
    held = held_out_questions()
    while True:
        maker = generate_wide_problem if rng.random() < wide_frac else generate_problem
        prob = maker(rng)
        if prob.question not in held:
            yield prob


def wide_shots_for(index: int, k: int) -> tuple[Problem, ...]:
    """Fixed in-context examples for wide/hand problem `index`, from the wide training stream."""
    if k == 0:
        return ()
    stream = mixed_stream(seed=2_000_003 + index, wide_frac=1.0)
    return tuple(next(stream) for _ in range(k))


@dataclass(frozen=True)
class Split:
    """A held-out set and where its in-context examples come from."""

    problems: Callable[[], tuple[Problem, ...]]
    shots: Callable[[int, int], tuple[Problem, ...]]


SPLITS: dict[str, Split] = {
    "narrow": Split(test_split, shots_for),
    "wide": Split(wide_test_split, wide_shots_for),
    "hand": Split(hand_split, wide_shots_for),
}
