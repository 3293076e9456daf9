"""Which TinyGSM problems are trained on and which are held out, for all three generators.

Five held-out sets, none ever trained on:
- `narrow`: the first 1000 distinct problems of the narrow generator (data.test_split; the set
  every earlier figure was measured on, kept unchanged for comparison);
- `wide`: 1000 problems of the wide generator (wide.py: counts up to 99, more names);
- `rich`: 1000 problems of the rich generator (rich.py, stories.py, scenes.py: many phrasings);
- `hand`: 100 questions written by hand in phrasings no generator produces (handwritten.jsonl),
  with their answers and the names they mention. Written before the rich generator, whose
  design then looked at how the wide-trained guide failed on them: not a blind set any more;
- `hand2`: 100 more hand-written questions (handwritten2.jsonl), written after the rich
  generator was frozen and before any model trained on it was run: the blind set.
The training stream mixes the generators and skips every held-out question.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path

from recipes.tinygsm.data import TEST_SIZE, Problem, generate_problem, shots_for, test_split
from recipes.tinygsm.scenes import generate_rich_problem
from recipes.tinygsm.wide import generate_wide_problem

WIDE_TEST_SEED = 20_261_130
RICH_TEST_SEED = 20_261_201
HERE = Path(__file__).resolve().parent
HAND_FILES = {"hand": HERE / "handwritten.jsonl", "hand2": HERE / "handwritten2.jsonl"}


@dataclass(frozen=True)
class HandProblem(Problem):
    """A hand-written question: no worked solution, but the names it mentions."""

    names: tuple[str, ...] = ()


NOT_NAMES = frozenset(("A", "An", "The", "There", "Each"))  # story openings, not names


@cache
def hand_split(name: str = "hand") -> tuple[HandProblem, ...]:
    lines = HAND_FILES[name].read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    return tuple(
        HandProblem(r["question"], r["work"], r["answer"], tuple(r["names"])) for r in rows
    )


def drawn_split(maker, seed: int, before: tuple[Problem, ...], size: int) -> tuple[Problem, ...]:
    """The first `size` distinct problems `maker` draws from `seed`, none of them in `before`."""
    rng = random.Random(seed)
    seen = {p.question for p in before}
    out: list[Problem] = []
    while len(out) < size:
        prob = maker(rng)
        if prob.question not in seen:
            seen.add(prob.question)
            out.append(prob)
    return tuple(out)


@cache
def wide_test_split(size: int = TEST_SIZE) -> tuple[Problem, ...]:
    return drawn_split(generate_wide_problem, WIDE_TEST_SEED, test_split(), size)


@cache
def rich_test_split(size: int = TEST_SIZE) -> tuple[Problem, ...]:
    return drawn_split(
        generate_rich_problem, RICH_TEST_SEED, test_split() + wide_test_split(), size
    )


@cache
def held_out_questions() -> frozenset[str]:
    """Every question of every held-out set."""
    sets = (test_split(), wide_test_split(), rich_test_split(), hand_split(), hand_split("hand2"))
    return frozenset(p.question for s in sets for p in s)


def mixed_stream(seed: int, wide_frac: float, rich_frac: float = 0.0) -> Iterator[Problem]:
    """Training problems: wide with probability `wide_frac`, rich with `rich_frac`, else narrow
    (one draw decides, so rich_frac 0 is the stream the wide-only recipe trained on);
    held-out questions are skipped."""
    rng = random.Random(seed)
    held = held_out_questions()
    while True:
        u = rng.random()
        if u < wide_frac:
            maker = generate_wide_problem
        elif u < wide_frac + rich_frac:
            maker = generate_rich_problem
        else:
            maker = generate_problem
        prob = maker(rng)
        if prob.question not in held:
            yield prob


def wide_shots_for(index: int, k: int) -> tuple[Problem, ...]:
    """Fixed in-context examples for wide problem `index`, from the wide training stream."""
    if k == 0:
        return ()
    stream = mixed_stream(seed=2_000_003 + index, wide_frac=1.0)
    return tuple(next(stream) for _ in range(k))


def rich_shots_for(index: int, k: int) -> tuple[Problem, ...]:
    """Fixed in-context examples for rich and hand-written problem `index`: rich problems."""
    if k == 0:
        return ()
    stream = mixed_stream(seed=3_000_017 + index, wide_frac=0.0, rich_frac=1.0)
    return tuple(next(stream) for _ in range(k))


@dataclass(frozen=True)
class Split:
    """A held-out set and where its in-context examples come from."""

    problems: Callable[[], tuple[Problem, ...]]
    shots: Callable[[int, int], tuple[Problem, ...]]


SPLITS: dict[str, Split] = {
    "narrow": Split(test_split, shots_for),
    "wide": Split(wide_test_split, wide_shots_for),
    "rich": Split(rich_test_split, rich_shots_for),
    "hand": Split(hand_split, rich_shots_for),
    "hand2": Split(partial(hand_split, "hand2"), rich_shots_for),
}
