"""TinyGSM: deterministic grade-school word problems small enough for a few-million-parameter model.

Each problem is a short story about one person's collection of objects, changed by 1 to 3
operations (+, -, *, /) on small numbers, with a step-by-step solution that restates each fact
and then works its equation, ending in a fixed answer line, e.g. `Tom has 5 apples. He buys 3
more apples. 5 + 3 = 8. He eats 2 apples. 8 - 2 = 6. The answer is 6.`. Restating makes every
step local (copy the next sentence, then compute from what was just written), which a
few-million-parameter model learns far faster than pointing back into the question.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache

NAMES_HE = ("Tom", "Sam", "Ben", "Leo", "Max", "Jack", "Omar", "Ravi", "Hugo", "Noah")
NAMES_SHE = ("Mia", "Ava", "Lily", "Emma", "Zoe", "Nina", "Sara", "Anna", "Maya", "Ruth")
OBJECTS = (
    "apples",
    "pencils",
    "books",
    "cookies",
    "marbles",
    "stickers",
    "cards",
    "eggs",
    "shells",
    "stamps",
    "candies",
    "flowers",
    "coins",
    "toys",
    "balls",
    "cupcakes",
)
CONTAINERS = ("boxes", "bags", "packs", "baskets", "jars", "trays")
SINGULAR = {"boxes": "box", "bags": "bag", "packs": "pack", "baskets": "basket"}
SINGULAR |= {"jars": "jar", "trays": "tray"}

MAX_VALUE = 50  # every intermediate result stays small: arithmetic a tiny model can learn
TEST_SEED = 20_251_129
TEST_SIZE = 1000
ANSWER_RE = re.compile(r"The answer is (-?\d+)\.")


@dataclass(frozen=True)
class Problem:
    """A word problem, its worked solution and the integer answer."""

    question: str
    solution: str
    answer: int


@dataclass(frozen=True)
class _Person:
    name: str
    he: str  # He / She
    him: str  # him / her
    his: str  # his / her


def _person(rng: random.Random) -> _Person:
    if rng.random() < 0.5:
        return _Person(rng.choice(NAMES_HE), "He", "him", "his")
    return _Person(rng.choice(NAMES_SHE), "She", "her", "her")


def _friend(rng: random.Random, who: _Person) -> str:
    return rng.choice([n for n in NAMES_HE + NAMES_SHE if n != who.name])


def _start(rng: random.Random, p: _Person, obj: str, product: bool) -> tuple[str, list[str], int]:
    """Opening sentence(s), solution steps so far, current count."""
    if product:
        box = rng.choice(CONTAINERS)
        n, each = rng.randint(2, 5), rng.randint(2, 6)
        text = f"{p.name} has {n} {box} of {obj}. Each {SINGULAR[box]} has {each} {obj}."
        return text, [f"{n} * {each} = {n * each}."], n * each
    n = rng.randint(2, 15)
    verb = rng.choice(("has", "has", "had", "collects"))
    return f"{p.name} {verb} {n} {obj}.", [], n


def _add(rng: random.Random, p: _Person, obj: str, q: int) -> tuple[str, int] | None:
    room = MAX_VALUE - q
    if room < 1:
        return None
    b = rng.randint(1, min(10, room))
    text = rng.choice(
        (
            f"{p.he} buys {b} more {obj}.",
            f"{p.he} finds {b} more {obj}.",
            f"{_friend(rng, p)} gives {p.him} {b} {obj}.",
            f"{p.he} gets {b} {obj} from {_friend(rng, p)}.",
            f"{p.he} picks up {b} more {obj}.",
        )
    )
    return text, b


def _sub(rng: random.Random, p: _Person, obj: str, q: int) -> tuple[str, int] | None:
    if q < 2:
        return None
    b = rng.randint(1, min(10, q - 1))
    text = rng.choice(
        (
            f"{p.he} gives {b} {obj} to {_friend(rng, p)}.",
            f"{p.he} loses {b} {obj}.",
            f"{p.he} sells {b} {obj}.",
            f"{p.he} uses {b} {obj}.",
            f"{_friend(rng, p)} takes {b} of {p.his} {obj}.",
        )
    )
    return text, b


def _mul(rng: random.Random, p: _Person, obj: str, q: int) -> tuple[str, int] | None:
    options = [b for b in range(2, 4) if q * b <= MAX_VALUE and q <= 10]
    if not options:
        return None
    b = rng.choice(options)
    word = {2: "twice", 3: "three times"}[b]
    text = rng.choice(
        (
            f"Then {p.he.lower()} ends up with {word} as many {obj}.",
            f"Then the number of {obj} {p.he.lower()} has grows to {word} as many.",
        )
    )
    return text, b


def _div(rng: random.Random, p: _Person, obj: str, q: int) -> tuple[str, int] | None:
    options = [b for b in range(2, 6) if q % b == 0]
    if not options:
        return None
    b = rng.choice(options)
    text = rng.choice(
        (
            f"{p.he} splits them into {b} equal piles and keeps one pile.",
            f"{p.he} shares them equally with {b - 1} friends and keeps one share.",
        )
    )
    return text, b


# symbol -> (sentence builder, arithmetic)
OPERATIONS = {
    "+": (_add, lambda a, b: a + b),
    "-": (_sub, lambda a, b: a - b),
    "*": (_mul, lambda a, b: a * b),
    "/": (_div, lambda a, b: a // b),
}
_WEIGHTS = {"+": 3, "-": 3, "*": 1, "/": 1}


def generate_problem(rng: random.Random) -> Problem:
    """One problem with 1 to 3 operations, drawn from `rng` (deterministic for its state)."""
    n_ops = rng.randint(1, 3)
    p = _person(rng)
    obj = rng.choice(OBJECTS)
    product = rng.random() < 0.25
    text, steps, q = _start(rng, p, obj, product)
    sentences = [text]
    worked = [text, *steps]  # each fact restated, then its equation
    while len(steps) < n_ops:
        symbol = rng.choices(list(_WEIGHTS), weights=list(_WEIGHTS.values()))[0]
        build, apply = OPERATIONS[symbol]
        made = build(rng, p, obj, q)
        if made is None:
            continue
        sentence, b = made
        new = apply(q, b)
        sentences.append(sentence)
        steps.append(f"{q} {symbol} {b} = {new}.")
        worked += [sentence, steps[-1]]
        q = new
    ask = rng.choice(
        (
            f"How many {obj} does {p.name} have now?",
            f"How many {obj} does {p.name} have in the end?",
        )
    )
    question = " ".join([*sentences, ask])
    solution = " ".join([*worked, f"The answer is {q}."])
    return Problem(question, solution, q)


def random_fact(rng: random.Random) -> str:
    """One equation `a op b = c.` from exactly the operand ranges the problems use (drills)."""
    if rng.random() < 0.15:
        _, steps, _ = _start(rng, _person(rng), OBJECTS[0], product=True)
        return steps[0]
    while True:
        symbol = rng.choices(list(_WEIGHTS), weights=list(_WEIGHTS.values()))[0]
        build, apply = OPERATIONS[symbol]
        q = rng.randint(1, MAX_VALUE)
        made = build(rng, _person(rng), OBJECTS[0], q)
        if made is not None:
            return f"{q} {symbol} {made[1]} = {apply(q, made[1])}."


@cache
def test_split(size: int = TEST_SIZE) -> tuple[Problem, ...]:
    """The fixed held-out problems: the first distinct questions drawn from TEST_SEED."""
    rng = random.Random(TEST_SEED)
    seen: set[str] = set()
    out: list[Problem] = []
    while len(out) < size:
        prob = generate_problem(rng)
        if prob.question not in seen:
            seen.add(prob.question)
            out.append(prob)
    return tuple(out)


@cache
def _test_questions() -> frozenset[str]:
    return frozenset(p.question for p in test_split())


def train_stream(seed: int) -> Iterator[Problem]:
    """An endless deterministic stream of problems that never repeats a held-out question."""
    rng = random.Random(seed)
    held_out = _test_questions()
    while True:
        prob = generate_problem(rng)
        if prob.question not in held_out:
            yield prob


def extract_answer(text: str) -> int | None:
    """The integer on the first `The answer is N.` line, or None if there is none."""
    m = ANSWER_RE.search(text)
    return int(m.group(1)) if m else None


def is_correct(text: str, answer: int) -> bool:
    """Exact match: the first answer line states exactly the right integer."""
    return extract_answer(text) == answer


def few_shot_prompt(question: str, shots: list[Problem] | tuple[Problem, ...]) -> str:
    """The user message: K solved examples then the question (bare question when K = 0)."""
    if not shots:
        return question
    parts = [f"Question: {s.question}\nAnswer: {s.solution}" for s in shots]
    parts.append(f"Question: {question}")
    return "\n\n".join(parts)


def shots_for(index: int, k: int) -> tuple[Problem, ...]:
    """Fixed in-context examples for held-out problem `index`: drawn from the training stream."""
    if k == 0:
        return ()
    stream = train_stream(seed=1_000_003 + index)
    return tuple(next(stream) for _ in range(k))


def vocabulary_text() -> list[str]:
    """Every word and symbol the generator can emit (the tokenizer's vocabulary is built from it)."""
    words = [*NAMES_HE, *NAMES_SHE, *OBJECTS, *CONTAINERS, *SINGULAR.values()]
    rng = random.Random(0)
    corpus = [generate_problem(rng) for _ in range(20000)]
    lines = [f"{p.question} {p.solution}" for p in corpus]
    lines.append(" ".join(words))
    lines.append(few_shot_prompt(corpus[0].question, corpus[1:3]))
    lines.append(" 0 1 2 3 4 5 6 7 8 9 00112233445566778899")
    return lines
