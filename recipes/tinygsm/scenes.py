"""More rich story kinds (two people, comparisons, `There are ...`, giving to each of several),
and `generate_rich_problem`, which draws a kind by weight."""

from __future__ import annotations

import random

from recipes.tinygsm.data import Problem
from recipes.tinygsm.rich import (
    FAMILY,
    HE_NAMES,
    MORE_OBJECTS,
    PLACES,
    SHE_NAMES,
    TOP,
    Story,
    actor,
    amount,
    cap,
    no_invented_names,
    other,
)
from recipes.tinygsm.stories import (
    change_story,
    group_story,
    rate_story,
    share_story,
    thing,
)

COLOURS = ("red", "blue", "green", "yellow", "big", "small")
DAYS = (("on Monday", "on Tuesday"), ("in the morning", "in the afternoon"), ("yesterday", "today"))
PAST_VERBS = (
    ("picked", "pick"),
    ("collected", "collect"),
    ("found", "find"),
    ("sold", "sell"),
    ("baked", "bake"),
    ("counted", "count"),
    ("bought", "buy"),
)
SPOTS = (
    "on the shelf",
    "in the tree",
    "at the park",
    "in the box",
    "in the jar",
    "on the table",
    "in the basket",
    "in the parking lot",
)
ARRIVE = (
    "{b} more {obj} are put {spot}.",
    "Then {b} more {obj} arrive.",
    "{b} more {obj} are added.",
)
LEAVE = (
    "{b} {obj} are taken away.",
    "Then {b} {obj} are sold.",
    "{b} of them are removed.",
    "{b} {obj} go away.",
)


def two(rng: random.Random):
    a = actor(rng, roles=False)
    b = actor(rng, roles=False)
    while b.ref == a.ref:
        b = actor(rng, roles=False)
    return a, b


def together_story(rng: random.Random) -> Problem:
    a, b = two(rng)
    obj = thing(rng)
    x = rng.randint(2, TOP - 2)
    y = rng.randint(2, TOP - x)
    kind = rng.randrange(4)
    st = Story(x)
    if kind == 0:
        st.say(f"{a.start} has {x} {obj}.")
        st.say(f"{b.start} has {y} {obj}.", ("+", y))
        ask = f"How many {obj} do they have {rng.choice(('together', 'in all', 'altogether'))}?"
    elif kind == 1:
        done, base = rng.choice(PAST_VERBS)
        rel = other(rng, a) if rng.random() < 0.5 else b.start
        st.say(f"{a.start} {done} {x} {obj} and {rel} {done} {y} {obj}.", ("+", y))
        ask = f"How many {obj} did they {base} in all?"
    elif kind == 2:
        c1, c2 = rng.sample(COLOURS, 2)
        st.say(f"{a.start} has {x} {c1} {obj} and {y} {c2} {obj}.", ("+", y))
        ask = f"How many {obj} does {a.ref} have?"
    else:
        done, base = rng.choice(PAST_VERBS)
        d1, d2 = rng.choice(DAYS)
        st.say(f"{a.start} {done} {x} {obj} {d1} and {y} {obj} {d2}.", ("+", y))
        ask = f"How many {obj} did {a.ref} {base} {rng.choice(('in all', 'altogether'))}?"
    if st.q >= 4 and rng.random() < 0.3:
        c = amount(rng, min(40, st.q - 1))
        st.say(f"They {rng.choice(('gave away', 'lost', 'used'))} {c} of them.", ("-", c))
        ask = f"How many {obj} are left?"
    return st.problem(ask)


def compare_story(rng: random.Random) -> Problem:
    a, b = two(rng)
    obj = thing(rng)
    other_one = b.start if rng.random() < 0.6 else cap(other(rng, a))
    ref = other_one if other_one[0].isupper() and " " not in other_one else other_one.lower()
    x = rng.randint(2, TOP - 2)
    kind = rng.randrange(4)
    st = Story(x)
    if kind == 0:
        k = amount(rng, min(40, TOP - x))
        st.say(f"{a.start} has {x} {obj}.")
        st.say(f"{other_one} has {k} more {obj} than {a.ref}.", ("+", k))
        return st.problem(f"How many {obj} does {ref} have?")
    if kind == 1 and x >= 4:
        k = amount(rng, min(40, x - 1))
        st.say(f"{a.start} has {x} {obj}.")
        st.say(f"{other_one} has {k} fewer {obj} than {a.ref}.", ("-", k))
        return st.problem(f"How many {obj} does {ref} have?")
    if kind == 2 and x <= TOP // 2:
        k = rng.choice([k for k in (2, 3, 4, 5) if x * k <= TOP])
        word = {2: rng.choice(("twice", "2 times")), 3: "3 times", 4: "4 times", 5: "5 times"}[k]
        first, second = (
            f"{a.start} has {x} {obj}.",
            f"{other_one} has {word} as many {obj} as {a.ref}.",
        )
        if rng.random() < 0.3:  # the relation first, then the known count
            first, second = (
                f"{other_one} has {word} as many {obj} as {a.ref}.",
                f"{cap(a.ref)} has {x} {obj}.",
            )
        st.sentences += [first, second]
        st.worked += [first, second]
        st.aside(x, "*", k)
        st.q = x * k
        return st.problem(f"How many {obj} does {ref} have?")
    y = rng.randint(x + 2, TOP) if x <= TOP - 2 else TOP
    st.say(f"{a.start} has {x} {obj}.")
    st.say(f"{other_one} has {y} {obj}.")
    st.q = st.aside(y, "-", x)
    return st.problem(f"How many more {obj} does {ref} have than {a.ref}?")


def there_story(rng: random.Random) -> Problem:
    obj, spot = thing(rng), rng.choice(SPOTS)
    past = rng.random() < 0.5
    n = rng.randint(2, TOP - 1)
    st = Story(n)
    st.say(f"There {('are', 'were')[past]} {n} {obj} {spot}.")
    last = ""
    for _ in range(rng.choice((1, 1, 2))):
        if st.q <= TOP - 2 and (rng.random() < 0.5 or st.q < 3):
            b = amount(rng, min(40, TOP - st.q))
            if rng.random() < 0.3:
                a = actor(rng, roles=False)
                text = f"{a.start} puts {b} more {obj} {spot}."
            else:
                text = rng.choice(ARRIVE).format(b=b, obj=obj, spot=spot)
            st.say(cap(text), ("+", b))
            last = "+"
        else:
            b = amount(rng, min(40, st.q - 1))
            st.say(cap(rng.choice(LEAVE).format(b=b, obj=obj)), ("-", b))
            last = "-"
    ask = f"How many {obj} are {spot} now?"
    if last == "-" and rng.random() < 0.5:
        ask = rng.choice((f"How many {obj} are still {spot}?", f"How many {obj} are left?"))
    return st.problem(ask)


def each_story(rng: random.Random) -> Problem:
    a, obj = actor(rng, roles=False), thing(rng)
    k, m = rng.randint(2, 6), rng.randint(1, 9)
    given = k * m
    n = rng.randint(given + 1, TOP) if given < TOP else TOP
    st = Story(n)
    st.say(f"{a.start} has {n} {obj}{rng.choice(PLACES)}.")
    sentence = f"{a.he} gives {m} {obj} to each of {a.his} {k} friends."
    st.sentences.append(sentence)
    st.worked.append(sentence)
    st.aside(m, "*", k)
    st.q = st.aside(n, "-", given)
    return st.problem(f"How many {obj} does {a.ref} have left?")


KINDS = {
    change_story: 40,
    group_story: 12,
    rate_story: 5,
    share_story: 8,
    together_story: 12,
    compare_story: 10,
    there_story: 9,
    each_story: 4,
}


def generate_rich_problem(rng: random.Random) -> Problem:
    """One rich problem (deterministic for `rng`'s state)."""
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    return kind(rng)


def rich_vocabulary_text(n: int = 8000) -> list[str]:
    """Every word the rich generator writes (invented names are spelled, so drawn without)."""
    rng = random.Random(0)
    with no_invented_names():
        problems = [generate_rich_problem(rng) for _ in range(n)]
    lines = [f"{p.question} {p.solution}" for p in problems]
    return [*lines, " ".join([*HE_NAMES, *SHE_NAMES, *MORE_OBJECTS, *FAMILY, *COLOURS])]
