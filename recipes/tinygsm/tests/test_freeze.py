"""The held-out sets the package ships are exactly what the generators produce."""

from __future__ import annotations

import gzip
from dataclasses import replace

import pytest

from dllm_cli.evaluate import held_out
from dllm_cli.problems import BUILTIN, HELDOUT, MAX_SHOTS, builtin_problems, builtin_shots
from recipes.tinygsm.data import few_shot_prompt
from recipes.tinygsm.freeze import frozen, gzipped, problems_file, shots_file
from recipes.tinygsm.splits import SPLITS


@pytest.mark.parametrize("name", list(BUILTIN))
def test_shipped_set_is_byte_identical_to_the_generators(name):
    assert (HELDOUT / f"{name}.jsonl").read_bytes() == problems_file(name)


@pytest.mark.parametrize("source", sorted({s.shots_from for s in BUILTIN.values()}))
def test_shipped_examples_are_byte_identical_to_the_generators(source):
    """Compared uncompressed (another zlib may pack the same bytes differently)."""
    shipped = gzip.decompress((HELDOUT / f"shots-{source}.jsonl.gz").read_bytes())
    assert shipped == shots_file(source)


def test_gzip_is_reproducible():
    assert gzipped(b"abc\n") == gzipped(b"abc\n")
    assert gzip.decompress(gzipped(b"abc\n")) == b"abc\n"


@pytest.mark.parametrize("name", list(BUILTIN))
def test_package_reads_back_the_generators_problems_and_shots(name):
    """What `dllm eval --split NAME` scores: the same problems, shots and prompts as the
    generators (every k-prefix of the frozen examples is the generator's k shots)."""
    split = SPLITS[name]
    generated = split.problems()
    expected = tuple(replace(frozen(p), line=i + 1) for i, p in enumerate(generated))
    assert builtin_problems(name) == expected
    for index in (0, len(generated) - 1):
        for k in (0, 1, MAX_SHOTS):
            shots = builtin_shots(name, index, k)
            drawn = split.shots(index, k)
            assert [(s.question, s.solution) for s in shots] == [
                (s.question, s.solution) for s in drawn
            ]
    tasks = held_out(lambda text: [len(text)], n=2, shots=3, start=1, split=name)
    for t in tasks:
        p = generated[t.index]
        assert t.answer == p.answer
        assert t.prompt == [len(few_shot_prompt(p.question, split.shots(t.index, 3)))]
