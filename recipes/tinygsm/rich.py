"""Rich TinyGSM: the many ways a person phrases a grade-school question.

The wide generator (wide.py) varies names and numbers but keeps a few sentence frames, and a
model trained on it answers a question in any other phrasing with a template's sentences
(`Tom had 28 eggs, then bought 8 more.` came back as `Ravi has 2 eggs. He sells 8 eggs.`).
This one composes questions from parts: subjects (people, invented names, `A farmer`), present
or past tense, a large verb inventory for each operation, places and times (`at the market`,
`on Monday`), steps joined with `and`, `then`, `but`, two changes in one sentence, groups
(`4 bags with 9 marbles in each bag`), sharing, comparisons (`15 more than`, `3 times as many`),
`There are 37 books on the shelf`, and the matching question forms. Solutions keep the recipe:
restate each sentence, work its equations, end with `The answer is N.`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from recipes.tinygsm.data import Problem
from recipes.tinygsm.wide import FOOD, RELATIVES, words

TOP = 99  # every number stays in 0..99

HE_NAMES = words(
    "Tom Sam Ben Leo Max Jack Omar Ravi Hugo Noah Liam Ethan Lucas Owen Adam Ryan Kai Eli Finn "
    "Jake Luis Amir Ivan Theo Carlos Daniel David Henry Oscar Peter Paul Mark Alex Chris Diego "
    "Felix Jamal Kenji Marco Victor Kevin Brian Mateo Nick Aaron Hassan Tyler Jordan Simon Lars"
)
SHE_NAMES = words(
    "Mia Ava Lily Emma Zoe Nina Sara Anna Maya Ruth Olivia Sophia Grace Chloe Ella Ivy Ruby Lucy "
    "Rosa Aisha Priya Hana Lena Julia Kate Amy Jane Laura Megan Nora Alice Clara Elena Fatima "
    "Iris Jenny Leila Mei Sofia Tara Maria Sophie Rita Zara Yuki Ana Beth Molly Wendy Dana"
)
# a common noun as the subject: (sentence start, reference inside a sentence, pronoun)
ROLES = (
    ("A farmer", "the farmer", "He"),
    ("A baker", "the baker", "She"),
    ("The teacher", "the teacher", "She"),
    ("A shop", "the shop", "It"),
    ("A library", "the library", "It"),
    ("The coach", "the coach", "He"),
)
MORE_OBJECTS = words(
    "pages dollars birds chairs cans points stones feathers shirts pies sandwiches pizzas "
    "crackers carrots bricks nails boxes bottles jars trees roses tulips"
)
FAMILY = (*RELATIVES, "aunt", "uncle", "grandpa")
PLACES = (
    "",
    "",
    "",
    " at the market",
    " at school",
    " at the park",
    " on Monday",
    " in the morning",
    " at the fair",
    " on the beach",
    " in the garden",
    " at the store",
    " last week",
    " today",
)


@dataclass(frozen=True)
class Actor:
    """Who the story is about: how a sentence starts with it, refers to it, and its pronouns."""

    start: str  # `Tom`, `A farmer`
    ref: str  # `Tom`, `the farmer`
    he: str  # He / She / It
    him: str
    his: str


PRONOUNS = {"He": ("He", "him", "his"), "She": ("She", "her", "her"), "It": ("It", "it", "its")}


ROLE_SHARE = 0.12  # stories about `A farmer` and the like
# made-up names and things (spelled letter by letter); 0 while listing the vocabulary
INVENTED_SHARE = [0.2]
VOWELS, CONSONANTS = "aeiouy", "bcdfghjklmnprstvwxz"


@contextmanager
def no_invented_names() -> Iterator[None]:
    """Draw only listed names and things (the vocabulary is built from such problems)."""
    saved, INVENTED_SHARE[0] = INVENTED_SHARE[0], 0.0
    try:
        yield
    finally:
        INVENTED_SHARE[0] = saved


def invented_word(rng: random.Random, low: int = 3, high: int = 8) -> str:
    """Random letters, mostly alternating consonants and vowels: any word a person might type.

    No fixed syllable set: copying such a word means copying its letters (a model trained on
    a few syllables learns to make up names from them instead: `Jasmine` -> `Jovenmi`).
    """
    vowel = rng.random() < 0.3
    letters = []
    for _ in range(rng.randint(low, high)):
        letters.append(rng.choice(VOWELS if vowel else CONSONANTS))
        vowel = not vowel if rng.random() < 0.85 else vowel
    return "".join(letters)


def invented_thing(rng: random.Random) -> str | None:
    """Sometimes (a share of INVENTED_SHARE) a made-up plural noun, else None."""
    return invented_word(rng, 3, 7) + "s" if rng.random() < INVENTED_SHARE[0] / 2 else None


def actor(rng: random.Random, roles: bool = True) -> Actor:
    roll = rng.random()
    if roles and roll < ROLE_SHARE:
        start, ref, he = ROLES[rng.randrange(len(ROLES))]
        return Actor(start, ref, *PRONOUNS[he])
    he = rng.random() < 0.5
    invented = ROLE_SHARE <= roll < ROLE_SHARE + INVENTED_SHARE[0]
    name = (
        invented_word(rng).capitalize() if invented else rng.choice(HE_NAMES if he else SHE_NAMES)
    )
    return Actor(name, name, *(("He", "him", "his") if he else ("She", "her", "her")))


def other(rng: random.Random, a: Actor) -> str:
    """Someone else, inside a sentence: `a friend`, `his sister`, `Ben`."""
    roll = rng.random()
    if roll < 0.2:
        return "a friend"
    if roll < 0.5 and a.his != "its":
        return f"{a.his} {rng.choice(FAMILY)}"
    if roll < 0.6:
        return rng.choice(("the teacher", "a neighbor", "the coach"))
    return rng.choice([n for n in HE_NAMES + SHE_NAMES if n != a.ref])


def cap(text: str) -> str:
    return text[0].upper() + text[1:]


def amount(rng: random.Random, top: int) -> int:
    """2..top, small ones more likely."""
    top = max(2, top)
    return rng.randint(2, min(10, top)) if rng.random() < 0.5 else rng.randint(2, top)


# --- predicates: (present, past) templates of a clause without its subject ------------------
# {b} the amount, {obj} the things, {o} someone else, {at} a place or time, {his} possessive.
GAIN = (
    ("buys {b} more {obj}{at}", "bought {b} more {obj}{at}"),
    ("finds {b} more {obj}{at}", "found {b} more {obj}{at}"),
    ("finds {b} {obj}{at}", "found {b} {obj}{at}"),
    ("gets {b} more {obj}", "got {b} more {obj}"),
    ("gets {b} {obj} from {o}", "got {b} {obj} from {o}"),
    ("picks {b} more {obj}", "picked {b} more {obj}"),
    ("wins {b} {obj}{at}", "won {b} {obj}{at}"),
    ("receives {b} {obj} from {o}", "received {b} {obj} from {o}"),
    ("collects {b} more {obj}{at}", "collected {b} more {obj}{at}"),
    ("makes {b} more {obj}", "made {b} more {obj}"),
    ("saves {b} more {obj}", "saved {b} more {obj}"),
    ("borrows {b} {obj} from {o}", "borrowed {b} {obj} from {o}"),
    ("adds {b} {obj}", "added {b} {obj}"),
    ("buys {b} more", "bought {b} more"),
    ("gets {b} more", "got {b} more"),
)
LOSS = (
    ("gives {b} {obj} to {o}", "gave {b} {obj} to {o}"),
    ("gives {b} of them to {o}", "gave {b} of them to {o}"),
    ("gives {o} {b} {obj}", "gave {o} {b} {obj}"),
    ("gives away {b} {obj}", "gave away {b} {obj}"),
    ("loses {b} {obj}{at}", "lost {b} {obj}{at}"),
    ("loses {b} of them", "lost {b} of them"),
    ("sells {b} {obj}{at}", "sold {b} {obj}{at}"),
    ("sells {b} of them", "sold {b} of them"),
    ("uses {b} {obj}", "used {b} {obj}"),
    ("drops {b} {obj}", "dropped {b} {obj}"),
    ("spends {b} {obj}", "spent {b} {obj}"),
    ("throws away {b} {obj}", "threw away {b} {obj}"),
    ("donates {b} {obj}", "donated {b} {obj}"),
    ("mails {b} {obj} to {o}", "mailed {b} {obj} to {o}"),
    ("breaks {b} {obj}", "broke {b} {obj}"),
)
EAT = (("eats {b} {obj}", "ate {b} {obj}"), ("eats {b} of them", "ate {b} of them"))
GIVEN = (  # someone else is the subject
    ("{O} gives {him} {b} {obj}{at}.", "{O} gave {him} {b} {obj}{at}."),
    ("{O} gives {him} {b} more {obj}.", "{O} gave {him} {b} more {obj}."),
)
TAKEN = (("{O} takes {b} of {his} {obj}.", "{O} took {b} of {his} {obj}."),)
HAS = ("has", "had")


def clause(rng, templates, past: bool, a: Actor, obj: str, b: int) -> str:
    text = rng.choice(templates)[past]
    return text.format(b=b, obj=obj, o=other(rng, a), at=rng.choice(PLACES), his=a.his.lower())


def change(rng, a: Actor, obj: str, q: int, past: bool) -> tuple[str, str, int] | None:
    """(predicate, operator, amount) of one gain or loss from count q, or None."""
    if rng.random() < 0.5 and q <= TOP - 2:
        b = amount(rng, min(40, TOP - q))
        return clause(rng, GAIN, past, a, obj, b), "+", b
    if q >= 3:
        b = amount(rng, min(40, q - 1))
        loss = LOSS + (EAT if obj in FOOD else ())
        return clause(rng, loss, past, a, obj, b), "-", b
    return None


class Story:
    """A story under construction: question sentences and the worked solution."""

    def __init__(self, q: int):
        self.q = q
        self.sentences: list[str] = []
        self.worked: list[str] = []

    def aside(self, a: int, op: str, b: int) -> int:
        """Work an equation that does not start from the running count (`7 * 3 = 21.`)."""
        c = OPS[op](a, b)
        self.worked.append(f"{a} {op} {b} = {c}.")
        return c

    def say(self, sentence: str, *steps: tuple[str, int]) -> None:
        """Add a sentence and apply its operations in order, each worked as an equation."""
        self.sentences.append(sentence)
        self.worked.append(sentence)
        for op, b in steps:
            new = OPS[op](self.q, b)
            self.worked.append(f"{self.q} {op} {b} = {new}.")
            self.q = new

    def problem(self, ask: str) -> Problem:
        solution = " ".join([*self.worked, f"The answer is {self.q}."])
        return Problem(" ".join([*self.sentences, ask]), solution, self.q)


OPS: dict[str, Callable[[int, int], int]] = {
    "+": lambda x, y: x + y,
    "-": lambda x, y: x - y,
    "*": lambda x, y: x * y,
    "/": lambda x, y: x // y,
}
