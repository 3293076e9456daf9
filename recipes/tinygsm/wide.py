"""Wide TinyGSM: the grade-school questions people type, not only the narrow generator's own.

The narrow generator (data.py) starts every story with 2 to 15 things, names 20 people and 16
objects, and always names the friend who gives or takes. This one draws counts up to 99 (so
two-digit numbers must be copied whole), about 80 names plus invented ones that the tokenizer
spells letter by letter (so the model learns to copy any name, not only the ones it saw), 55
objects, relatives and "a friend" as the other person, and several phrasings for each step,
including a first step joined to the opening sentence with "and". Solutions keep the narrow
recipe: restate each sentence, then work its equation, then `The answer is N.`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from recipes.tinygsm.data import Problem

WIDE_MAX = 99  # every count, intermediate result and answer stays in 0..99


def words(text: str) -> list[str]:
    """A word list written as text."""
    return text.split()


HE = words(
    "Tom Sam Ben Leo Max Jack Omar Ravi Hugo Noah Liam Ethan Lucas Owen Adam Ryan Kai Eli Finn "
    "Jake Luis Amir Ivan Theo Carlos Daniel David Henry Oscar Peter Paul Mark Alex Chris Diego "
    "Felix Jamal Kenji Marco Victor"
)
SHE = words(
    "Mia Ava Lily Emma Zoe Nina Sara Anna Maya Ruth Olivia Sophia Grace Chloe Ella Ivy Ruby Lucy "
    "Rosa Aisha Priya Hana Lena Julia Kate Amy Jane Laura Megan Nora Alice Clara Elena Fatima "
    "Iris Jenny Leila Mei Sofia Tara"
)
OBJECTS = words(
    "apples pencils books cookies marbles stickers cards eggs shells stamps candies flowers coins "
    "toys balls cupcakes oranges bananas crayons erasers markers rocks leaves beads buttons "
    "blocks cars dolls kites pens socks hats shirts muffins grapes cherries lemons peaches pears "
    "plums carrots potatoes nuts seeds ribbons balloons puzzles games photos letters postcards "
    "bottles cups plates tickets"
)
FOOD = frozenset(
    words(
        "apples cookies eggs candies cupcakes oranges bananas muffins grapes cherries lemons "
        "peaches pears plums carrots potatoes nuts"
    )
)
CONTAINERS = {
    "boxes": "box",
    "bags": "bag",
    "packs": "pack",
    "baskets": "basket",
    "jars": "jar",
    "trays": "tray",
    "bowls": "bowl",
    "buckets": "bucket",
    "crates": "crate",
    "cartons": "carton",
}
RELATIVES = words("friend sister brother mom dad cousin neighbor classmate teacher grandma")
_SYLLABLES = words("ka lo mi ra ti ven dor bel sa nu ro li ta zen mar kin jo pe su fa")


@dataclass(frozen=True)
class Person:
    name: str
    he: str  # He / She
    him: str  # him / her
    his: str  # his / her


def invented_name(rng: random.Random) -> str:
    """A made-up name (2-3 syllables) that no word list holds: it must be copied letter by letter."""
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def person(rng: random.Random, invented: bool = True) -> Person:
    he = rng.random() < 0.5
    spelled = invented and rng.random() < 0.12
    name = invented_name(rng) if spelled else rng.choice(HE if he else SHE)
    return Person(name, "He", "him", "his") if he else Person(name, "She", "her", "her")


def other(rng: random.Random, p: Person) -> str:
    """The other person in a sentence, lower case: a friend, a relative, or someone by name."""
    roll = rng.random()
    if roll < 0.25:
        return "a friend"
    if roll < 0.55:
        return f"{p.his.lower()} {rng.choice(RELATIVES)}"
    if roll < 0.65:
        return f"the {rng.choice(RELATIVES[:-1])}"  # not "the grandma"
    return rng.choice([n for n in HE + SHE if n != p.name])


def capital(text: str) -> str:
    return text[0].upper() + text[1:]


def count_up_to(rng: random.Random, top: int) -> int:
    """2..top (plural objects), small numbers more likely (people type 3 more more than 37)."""
    if top <= 10 or rng.random() < 0.5:
        return rng.randint(2, min(10, top))
    return rng.randint(2, top)


# --- sentences for each operation: (rng, person, object, q, first) -> (text, b) or None -------
# `first` is True when the step is joined to the opening sentence with "and" (no subject).


def add_step(rng, p: Person, obj: str, q: int, first: bool):
    room = WIDE_MAX - q
    if room < 2:
        return None
    b = count_up_to(rng, min(40, room))
    o = other(rng, p)
    if first:
        verb = rng.choice(("buys", "finds", "gets", "picks up", "wins", "makes"))
        return f"and {verb} {b} more", b
    options = [
        f"{p.he} buys {b} more {obj}.",
        f"{p.he} finds {b} more {obj}.",
        f"{p.he} gets {b} more {obj}.",
        f"{capital(o)} gives {p.him} {b} {obj}.",
        f"{capital(o)} gives {p.him} {b} more {obj}.",
        f"{p.he} gets {b} {obj} from {o}.",
        f"{p.he} picks up {b} more {obj}.",
        f"{p.he} wins {b} {obj}.",
        f"{p.he} receives {b} {obj} from {o}.",
        f"Then {p.he.lower()} buys {b} more.",
    ]
    return rng.choice(options), b


def sub_step(rng, p: Person, obj: str, q: int, first: bool):
    if q < 3:
        return None
    b = count_up_to(rng, min(40, q - 1))
    o = other(rng, p)
    if first:
        verb = rng.choice(
            ("gives away", "loses", "sells", "uses") + (("eats",) if obj in FOOD else ())
        )
        return f"and {verb} {b} of them", b
    options = [
        f"{p.he} gives {b} {obj} to {o}.",
        f"{p.he} gives {b} of them to {o}.",
        f"{p.he} gives away {b} {obj}.",
        f"{p.he} loses {b} {obj}.",
        f"{p.he} sells {b} {obj}.",
        f"{p.he} uses {b} {obj}.",
        f"{p.he} drops {b} {obj}.",
        f"{capital(o)} takes {b} of {p.his} {obj}.",
        f"{p.he} gives {o} {b} {obj}.",
    ]
    if obj in FOOD:
        options += [f"{p.he} eats {b} {obj}.", f"{p.he} eats {b} of them."]
    return rng.choice(options), b


def mul_step(rng, p: Person, obj: str, q: int, first: bool):
    options = [b for b in (2, 3) if q * b <= WIDE_MAX]
    if first or not options:
        return None
    b = rng.choice(options)
    word = {2: "twice", 3: "three times"}[b]
    he = p.he.lower()
    text = rng.choice(
        (
            f"Then {he} ends up with {word} as many {obj}.",
            f"Then the number of {obj} {he} has grows to {word} as many.",
            f"Then {he} has {word} as many {obj} as before.",
        )
    )
    return text, b


def div_step(rng, p: Person, obj: str, q: int, first: bool):
    options = [b for b in range(2, 6) if q % b == 0]
    if first or not options:
        return None
    b = rng.choice(options)
    friends = "a friend" if b == 2 else f"{b - 1} friends"
    text = rng.choice(
        (
            f"{p.he} splits them into {b} equal piles and keeps one pile.",
            f"{p.he} shares them equally with {friends} and keeps one share.",
            f"{p.he} puts them into {b} equal groups and keeps one group.",
        )
    )
    return text, b


OPERATIONS = {
    "+": (add_step, lambda a, b: a + b),
    "-": (sub_step, lambda a, b: a - b),
    "*": (mul_step, lambda a, b: a * b),
    "/": (div_step, lambda a, b: a // b),
}
WEIGHTS = {"+": 3, "-": 3, "*": 1, "/": 1}


def opening(rng: random.Random, p: Person, obj: str, product: bool):
    """(opening sentence without its final period, equations so far, current count)."""
    if product:
        box = rng.choice(list(CONTAINERS))
        n, each = rng.randint(2, 9), rng.randint(2, 12)
        while n * each > WIDE_MAX:
            each -= 1
        one = CONTAINERS[box]
        text = rng.choice(
            (
                f"{p.name} has {n} {box} of {obj}. Each {one} has {each} {obj}",
                f"{p.name} buys {n} {box} of {obj}. There are {each} {obj} in each {one}",
                f"{p.name} has {n} {box}. Each {one} holds {each} {obj}",
            )
        )
        return text, [f"{n} * {each} = {n * each}."], n * each
    n = rng.randint(2, WIDE_MAX - 1)
    verb = rng.choice(("has", "has", "had", "collects", "owns", "starts with", "bought"))
    return f"{p.name} {verb} {n} {obj}", [], n


def question(rng: random.Random, p: Person, obj: str, last: str) -> str:
    options = [
        f"How many {obj} does {p.name} have now?",
        f"How many {obj} does {p.name} have in the end?",
        f"How many {obj} does {p.name} have in all?",
        f"How many {obj} does {p.name} have?",
        f"How many {obj} does {p.he.lower()} have now?",
    ]
    if last == "-":
        options += [f"How many {obj} does {p.name} have left?", f"How many {obj} are left?"]
    return rng.choice(options)


def two_people(rng: random.Random, invented: bool) -> Problem:
    """Two collections added up: `Ana has 12 shells. Ben has 30 shells. How many ... together?`"""
    a = person(rng, invented)
    b = person(rng, invented)
    while b.name == a.name:
        b = person(rng, invented)
    obj = rng.choice(OBJECTS)
    x = rng.randint(2, WIDE_MAX - 2)
    y = rng.randint(2, WIDE_MAX - x)
    first, second = f"{a.name} has {x} {obj}.", f"{b.name} has {y} {obj}."
    ask = rng.choice(("together", "in all", "altogether"))
    story = f"{first} {second} How many {obj} do they have {ask}?"
    solution = f"{first} {second} {x} + {y} = {x + y}. The answer is {x + y}."
    return Problem(story, solution, x + y)


def generate_wide_problem(rng: random.Random, invented: bool = True) -> Problem:
    """One wide problem with 1 to 3 operations (deterministic for `rng`'s state)."""
    if rng.random() < 0.1:
        return two_people(rng, invented)
    n_ops = rng.choices((1, 2, 3), weights=(4, 4, 2))[0]
    p = person(rng, invented)
    obj = rng.choice(OBJECTS)
    product = rng.random() < 0.2
    text, equations, q = opening(rng, p, obj, product)
    facts = [(text + ".", equations)]  # (sentence, its equations), in story order
    joined = not product and rng.random() < 0.3  # "Tom has 28 eggs and gives away 8 of them."
    done, last = len(equations), ""
    while done < n_ops:
        symbol = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
        build, apply = OPERATIONS[symbol]
        first = joined and len(facts) == 1 and not facts[0][1]
        made = build(rng, p, obj, q, first)
        if made is None:
            continue
        sentence, b = made
        new = apply(q, b)
        equation = f"{q} {symbol} {b} = {new}."
        if first:
            facts[0] = (f"{text} {sentence}.", [equation])
        else:
            facts.append((sentence, [equation]))
        done, last, q = done + 1, symbol, new
    story = " ".join([*(s for s, _ in facts), question(rng, p, obj, last)])
    worked = [part for s, eqs in facts for part in (s, *eqs)]
    return Problem(story, " ".join([*worked, f"The answer is {q}."]), q)


def wide_fact(rng: random.Random) -> str:
    """One equation `a op b = c.` from the wide generator's operand ranges (drills)."""
    if rng.random() < 0.15:
        _, equations, _ = opening(rng, person(rng, False), OBJECTS[0], product=True)
        return equations[0]
    while True:
        symbol = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
        build, apply = OPERATIONS[symbol]
        q = rng.randint(2, WIDE_MAX)
        made = build(rng, person(rng, False), OBJECTS[0], q, False)
        if made is not None:
            return f"{q} {symbol} {made[1]} = {apply(q, made[1])}."


def wide_vocabulary_text(n: int = 20000) -> list[str]:
    """Every word the wide generator writes (invented names excluded: those are spelled)."""
    rng = random.Random(0)
    lines = [
        f"{p.question} {p.solution}" for p in (generate_wide_problem(rng, False) for _ in range(n))
    ]
    words = [*HE, *SHE, *OBJECTS, *CONTAINERS, *CONTAINERS.values(), *RELATIVES]
    lines.append(" ".join(words))
    return lines
