"""The story kinds of the rich TinyGSM generator (rich.py holds the words and the clauses).

Each kind draws one Problem: a change story (a count that grows and shrinks), groups (`4 bags
with 9 marbles in each bag`), sharing, two collections combined, a comparison, `There are ...`
with things arriving and leaving, and giving the same number to each of several people.
"""

from __future__ import annotations

import random

from recipes.tinygsm.data import Problem
from recipes.tinygsm.rich import (
    GIVEN,
    HAS,
    MORE_OBJECTS,
    PLACES,
    TAKEN,
    TOP,
    Actor,
    Story,
    actor,
    amount,
    cap,
    change,
    invented_thing,
    other,
)
from recipes.tinygsm.wide import CONTAINERS, OBJECTS

STARTS = (
    ("has", "had"),
    ("collects", "collected"),
    ("owns", "owned"),
    ("starts with", "started with"),
    ("buys", "bought"),
    ("has", "had"),
)
JOINS = (" and", " and then", ", then", " and later")
THEN = ("", "", "", "Then ", "Later, ", "After that, ", "Next, ")


def thing(rng: random.Random) -> str:
    made_up = invented_thing(rng)
    if made_up is not None:
        return made_up
    return rng.choice(OBJECTS) if rng.random() < 0.8 else rng.choice(MORE_OBJECTS)


def subject(rng: random.Random, a: Actor) -> str:
    """How a later sentence names the actor: mostly the pronoun, sometimes the name."""
    lead = rng.choice(THEN)
    who = a.he if rng.random() < 0.7 else a.start
    return lead + (who.lower() if lead and who in ("He", "She", "It") else who)


def have_question(rng: random.Random, a: Actor, obj: str, last: str) -> str:
    tail = (
        rng.choice(("now", "in the end", "in all", ""))
        if last != "-"
        else rng.choice(("now", "left", "left now"))
    )
    ask = f"How many {obj} does {a.ref} have{' ' + tail if tail else ''}?"
    if last == "-" and rng.random() < 0.25:
        ask = f"How many {obj} are left?"
    return ask


def change_story(rng: random.Random) -> Problem:
    a, obj, past = actor(rng), thing(rng), rng.random() < 0.5
    n = rng.randint(2, TOP - 1)
    opening = f"{a.start} {rng.choice(STARTS)[past]} {n} {obj}{rng.choice(PLACES)}"
    st, last = Story(n), ""
    steps = rng.choices((1, 2, 3), weights=(4, 4, 2))[0]
    if rng.random() < 0.35:  # the first change joins the opening sentence
        made = change(rng, a, obj, n, past)
        if made is not None:
            pred, last, b = made
            join = rng.choice((*JOINS, " but") if last == "-" else JOINS)
            st.say(f"{opening}{join} {pred}.", (last, b))
            steps -= 1
    if not st.sentences:
        st.say(f"{opening}.")
    while steps > 0:
        roll = rng.random()
        if roll < 0.15 and steps >= 2:  # two changes in one sentence
            first = change(rng, a, obj, st.q, past)
            if first is None:
                continue
            second = change(rng, a, obj, st.q + (first[2] if first[1] == "+" else -first[2]), past)
            if second is None:
                continue
            st.say(f"{subject(rng, a)} {first[0]} and {second[0]}.", first[1:], second[1:])
            steps, last = steps - 2, second[1]
        elif roll < 0.3:  # someone else gives or takes
            gives = rng.random() < 0.5 or st.q < 3
            top = min(40, TOP - st.q) if gives else min(40, st.q - 1)
            if top < 2:
                continue
            b = amount(rng, top)
            text = rng.choice(GIVEN if gives else TAKEN)[past]
            o = cap(other(rng, a))
            st.say(
                text.format(O=o, him=a.him, his=a.his, b=b, obj=obj, at=rng.choice(PLACES)),
                ("+" if gives else "-", b),
            )
            steps, last = steps - 1, "+" if gives else "-"
        elif roll < 0.4:  # doubling, tripling, halving
            made = scale(rng, a, obj, st.q, past)
            if made is None:
                continue
            st.say(*made)
            steps, last = steps - 1, made[1][0]
        else:
            made = change(rng, a, obj, st.q, past)
            if made is None:
                continue
            pred, last, b = made
            st.say(f"{subject(rng, a)} {pred}.", (last, b))
            steps -= 1
    return st.problem(have_question(rng, a, obj, last))


def scale(rng, a: Actor, obj: str, q: int, past: bool):
    he = a.he.lower()
    if q % 2 == 0 and q >= 4 and rng.random() < 0.5:
        verb = ("gives", "gave")[past]
        return f"{a.he} {verb} half of them to {other(rng, a)}.", ("/", 2)
    options = [k for k in (2, 3) if q * k <= TOP]
    if not options:
        return None
    k = rng.choice(options)
    word = {2: "twice", 3: "three times"}[k]
    text = rng.choice(
        (
            f"Then {he} ends up with {word} as many {obj}.",
            f"Then {he} has {word} as many {obj} as before.",
        )
    )
    return text, ("*", k)


def group_story(rng: random.Random) -> Problem:
    a, obj, past = actor(rng), thing(rng), rng.random() < 0.5
    box = rng.choice(list(CONTAINERS))
    one = CONTAINERS[box]
    n, m = rng.randint(2, 9), rng.randint(2, 12)
    while n * m > TOP:
        m -= 1
    has, buys = HAS[past], ("buys", "bought")[past]
    st = Story(n)
    forms = (
        f"{a.start} {has} {n} {box} of {obj}. Each {one} {('has', 'had')[past]} {m} {obj}.",
        f"{a.start} {has} {n} {box} with {m} {obj} in each {one}.",
        f"{a.start} {has} {n} {box} of {m} {obj} each.",
        f"{a.start} {buys} {n} {box} of {obj} with {m} {obj} in each {one}.",
        f"Each {one} holds {m} {obj}. {a.start} {buys} {n} {box}.",
    )
    st.say(rng.choice(forms), ("*", m))
    last = "*"
    if rng.random() < 0.5:
        made = change(rng, a, obj, st.q, past)
        if made is not None:
            pred, last, b = made
            st.say(f"{subject(rng, a)} {pred}.", (last, b))
    return st.problem(
        have_question(rng, a, obj, last)
        if rng.random() < 0.7
        else f"How many {obj} does {a.ref} have in total?"
    )


def rate_story(rng: random.Random) -> Problem:
    a = actor(rng, roles=False)
    verb, obj = rng.choice(
        (
            ("reads", "books"),
            ("eats", "apples"),
            ("makes", "cupcakes"),
            ("saves", "coins"),
            ("earns", "dollars"),
            ("bakes", "cookies"),
            ("collects", "stamps"),
            ("picks", "flowers"),
        )
    )
    unit = rng.choice(("day", "week", "month"))
    n, m = rng.randint(2, 9), rng.randint(2, 12)
    while n * m > TOP:
        m -= 1
    base = verb[:-1]  # reads -> read, makes -> make
    st = Story(m)
    st.say(f"{a.start} {verb} {m} {obj} every {unit}.", ("*", n))
    return st.problem(f"How many {obj} does {a.he.lower()} {base} in {n} {unit}s?")


def share_story(rng: random.Random) -> Problem:
    a, obj = actor(rng, roles=False), thing(rng)
    k = rng.randint(2, 9)
    r = rng.randint(2, TOP // k)
    n = k * r
    forms = (
        (
            f"{a.start} has {n} {obj} and shares them equally among {k} friends.",
            f"How many {obj} does each friend get?",
        ),
        (f"{a.start} puts {n} {obj} into {k} equal piles.", f"How many {obj} are in each pile?"),
        (
            f"{a.start} splits {n} {obj} evenly between {k} friends.",
            f"How many {obj} does each friend get?",
        ),
        (
            f"{a.start} has {n} {obj}. {a.he} puts them into {k} equal groups.",
            f"How many {obj} are in each group?",
        ),
    )
    if rng.random() < 0.25:
        box = rng.choice(list(CONTAINERS))
        text, ask = f"{n} {obj} are packed into {box} of {r}.", f"How many {box} are there?"
        st = Story(n)
        st.say(text, ("/", r))
        return st.problem(ask)
    text, ask = rng.choice(forms)
    st = Story(n)
    st.say(text, ("/", k))
    return st.problem(ask)
