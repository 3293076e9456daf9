"""TinyGSM v2: the wide generator, the held-out sets, the spelling tokenizer, Dream-format
initialisation from the guide, and a vocabulary that grows without moving old ids."""

from __future__ import annotations

import itertools
import json
import operator
import random
import re

import pytest
import torch

from dllm_cli.problems import restates
from recipes.tinygsm import data
from recipes.tinygsm.architectures import ar_to_dream, build_ar, build_dream, grow_into
from recipes.tinygsm.batches import Encoder, ExampleSource, masked_batch
from recipes.tinygsm.data import generate_problem, vocabulary_text
from recipes.tinygsm.freeze import frozen
from recipes.tinygsm.phases import weighted_ce
from recipes.tinygsm.scenes import KINDS, generate_rich_problem
from recipes.tinygsm.splits import (
    HAND_FILES,
    SPLITS,
    hand_split,
    held_out_questions,
    mixed_stream,
    rich_test_split,
    wide_test_split,
)
from recipes.tinygsm.tokenizer import (
    ROLES,
    build_tokenizer,
    build_vocab,
    spelling_pieces,
    words_of,
)
from recipes.tinygsm.train import PRESETS
from recipes.tinygsm.wide import (
    WIDE_MAX,
    generate_wide_problem,
    wide_fact,
    wide_vocabulary_text,
)

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}
EQUATION = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)\.")


def check_solution(question: str, solution: str, answer: int) -> None:
    """Every equation is true, chains from the previous result, and every number it starts
    from (or adds) was written in the question."""
    equations = EQUATION.findall(solution)
    assert equations and solution.endswith(f"The answer is {answer}.")
    numbers = set(re.findall(r"\d+", question))
    for a, op, b, c in equations:
        assert OPS[op](int(a), int(b)) == int(c)
        assert 0 <= int(c) <= WIDE_MAX
        if op == "/":
            assert int(a) % int(b) == 0
    assert int(equations[-1][3]) == answer
    assert equations[0][0] in numbers


def test_wide_problems_are_consistent_and_restate_the_question():
    rng = random.Random(0)
    for _ in range(800):
        p = generate_wide_problem(rng)
        check_solution(p.question, p.solution, p.answer)
        story = p.question.rsplit("How many", 1)[0]
        rest = re.sub(r" ?" + EQUATION.pattern, "", p.solution)  # the solution minus equations
        assert rest.startswith(story.strip())  # each sentence restated verbatim, in order


def test_wide_problems_reach_two_digit_counts_and_many_phrasings():
    rng = random.Random(1)
    probs = [generate_wide_problem(rng) for _ in range(2000)]
    starts = [int(re.search(r"\d+", p.question).group()) for p in probs]
    assert max(starts) >= 90 and sum(s > 15 for s in starts) > len(starts) / 2
    assert any(" and " in p.question.split(".")[0] for p in probs)  # joined first step
    assert any("a friend" in p.question for p in probs)
    assert len({p.question.split()[0] for p in probs}) > 80  # names, invented ones included


def test_rich_problems_are_consistent_and_restate_the_question():
    rng = random.Random(5)
    kinds = set()
    for _ in range(3000):
        p = generate_rich_problem(rng)
        equations = EQUATION.findall(p.solution)
        assert equations and p.solution.endswith(f"The answer is {p.answer}.")
        for a, op, b, c in equations:
            assert OPS[op](int(a), int(b)) == int(c) and 0 <= int(c) <= WIDE_MAX
            assert op != "/" or int(a) % int(b) == 0
        assert int(equations[-1][3]) == p.answer
        story = p.question.rsplit("How many", 1)[0].strip()
        rest = re.sub(r" ?" + EQUATION.pattern, "", p.solution)
        assert rest.startswith(story)  # every sentence restated verbatim, in order
        assert restates(
            frozen(p), p.solution
        )  # every number of the question appears in the solution
        kinds.add(p.question.split()[0])
    assert len(KINDS) == 8 and len(kinds) > 100


def test_wide_drills_are_true_equations():
    rng = random.Random(2)
    for _ in range(300):
        a, op, b, c = EQUATION.fullmatch(wide_fact(rng)).groups()
        assert OPS[op](int(a), int(b)) == int(c)


def test_held_out_sets_are_fixed_and_never_trained_on():
    wide, rich, hand = wide_test_split(), rich_test_split(), hand_split()
    for split in (wide, rich):
        assert len(split) == 1000 and len({p.question for p in split}) == 1000
    assert len(hand) == 100 and len(hand_split("hand2")) == 100 and wide == wide_test_split()
    narrow = {p.question for p in data.test_split()}
    assert not {p.question for p in wide} & narrow
    assert not {p.question for p in rich} & (narrow | {p.question for p in wide})
    seen = [p.question for p in itertools.islice(mixed_stream(0, 0.3, 0.5), 20000)]
    assert not held_out_questions().intersection(seen)
    shots = {q.question for i in range(30) for q in SPLITS["wide"].shots(i, 8)}
    assert not held_out_questions() & shots


@pytest.mark.parametrize("name", ["hand", "hand2"])
def test_hand_written_answers_follow_their_work(name):
    for row in map(json.loads, HAND_FILES[name].read_text().splitlines()):
        work = row["work"].replace("/", "//")
        assert eval(work, {"__builtins__": {}}) == row["answer"]
        assert all(who in row["question"] for who in row["names"])
        assert all(int(n) <= WIDE_MAX for n in re.findall(r"\d+", row["question"]))
    # no generator writes these phrasings
    rng = random.Random(3)
    made = {generate_wide_problem(rng).question for _ in range(5000)}
    made |= {generate_problem(rng).question for _ in range(5000)}
    made |= {generate_rich_problem(rng).question for _ in range(5000)}
    assert not made & {p.question for p in hand_split(name)}


def test_vocabulary_is_append_only_over_each_release():
    first = build_vocab(words_of(vocabulary_text(), "\n", *ROLES))
    second = build_vocab(
        words_of(vocabulary_text(), "\n", *ROLES),
        words_of(wide_vocabulary_text()),
        spelling_pieces(),
    )
    full = build_tokenizer().get_vocab()
    assert (len(first), len(second)) == (167, 582)  # the first release's and the wide release's
    assert all(full[piece] == i for piece, i in second.items())
    assert all(second[piece] == i for piece, i in first.items())


@pytest.mark.parametrize(
    "text",
    [
        "Tom has 28 eggs. He gives 8 eggs to a friend.",
        "Xavier's 12 feathers cost $5 (really!) #1 ##x a##b",
        "Sophie wants to give 11 of them to her brother; ok?",
        "two  spaces and a trailing space ",
        "Question: Q\nAnswer: 3 + 4 = 7.",
    ],
)
def test_tokenizer_spells_unknown_words_and_round_trips(text):
    tok = build_tokenizer()
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text


def test_generator_words_are_single_tokens():
    tok = build_tokenizer()
    rng = random.Random(4)
    for _ in range(200):
        p = generate_wide_problem(rng, invented=False)
        pieces = tok.tokenize(f"{p.question} {p.solution}")
        assert not [t for t in pieces if t.startswith("##")], p.question


def test_guide_weights_map_onto_dream_exactly():
    tok = build_tokenizer()
    cfg = PRESETS["micro"]
    torch.manual_seed(0)
    ar = build_ar(cfg, tok).eval()
    dream = build_dream(cfg, tok).eval()
    dream.load_state_dict(ar_to_dream(ar.state_dict()))  # strict: every name maps
    x = torch.randint(0, 100, (2, 1))  # one token: causal and bidirectional agree
    with torch.no_grad():
        torch.testing.assert_close(ar(input_ids=x).logits, dream(x))
    assert dream.config.vocab_size > len(tok)  # padded rows that no draft may take


def test_grow_into_keeps_old_rows_and_refuses_other_shapes():
    tok = build_tokenizer()
    cfg = PRESETS["micro"]
    big = build_ar(cfg, tok)
    state = {k: v.clone() for k, v in big.state_dict().items()}
    rows = ("model.embed_tokens.weight", "lm_head.weight")
    old = {k: (v[:168] if k in rows else v) * 2 for k, v in state.items()}
    grown = grow_into(big, old)
    assert sorted(grown) == ["lm_head.weight", "model.embed_tokens.weight"]
    emb = big.state_dict()["model.embed_tokens.weight"]
    assert torch.equal(emb[:168], old["model.embed_tokens.weight"])
    assert torch.equal(emb[168:], state["model.embed_tokens.weight"][168:])
    bad = dict(old, **{"model.norm.weight": torch.ones(3)})
    with pytest.raises(ValueError, match="cannot grow"):
        grow_into(big, bad)


def test_dream_loss_is_shifted_by_one_column():
    tok = build_tokenizer()
    enc = Encoder(tok)
    cfg = PRESETS["micro"]
    torch.manual_seed(0)
    model = build_dream(cfg, tok).eval()
    items = [ExampleSource(enc, seed=1, wide_frac=0.5).take(0) for _ in range(2)]
    length = max(len(e.prompt) for e in items) + 80
    batch = masked_batch(items, length, enc.ids, random.Random(0))
    with torch.no_grad():
        logits = model(batch.noisy)
        got = weighted_ce(model, batch, shift=1)
    total = 0.0
    for r in range(2):
        for i in range(1, length):
            if batch.weight[r, i] > 0:  # masked token i is predicted by the output at i - 1
                ce = torch.nn.functional.cross_entropy(logits[r, i - 1], batch.target[r, i])
                total += float(ce) * float(batch.weight[r, i])
    assert got.item() == pytest.approx(total / 2, rel=1e-5)
