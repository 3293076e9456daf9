"""Freeze the five held-out sets into the files `dllm eval --split NAME` reads.

    python -m recipes.tinygsm.freeze [--out dllm_cli/tinygsm/heldout]

The package scores the built-in sets from these files and never imports a generator;
`recipes/tinygsm/tests/test_freeze.py` checks that the shipped files are exactly what the
generators produce (the format is described in `dllm_cli/problems.py`).
"""

from __future__ import annotations

import gzip
import io
import json
import sys
from decimal import Decimal
from pathlib import Path

from dllm_cli.problems import BUILTIN, HELDOUT, MAX_SHOTS
from dllm_cli.problems import Problem as FrozenProblem
from recipes.tinygsm.data import Problem
from recipes.tinygsm.splits import NOT_NAMES, SPLITS


def names_of(problem: Problem) -> list[str]:
    """The names an answer must repeat: the hand-written set's, else a story's first word."""
    names = getattr(problem, "names", None)
    if names is not None:
        return list(names)
    first = problem.question.split()[0]
    return [] if not first.isalpha() or first in NOT_NAMES else [first]


def frozen(problem: Problem) -> FrozenProblem:
    """A generator's problem as the package reads it back from the frozen files."""
    names = tuple(names_of(problem))
    return FrozenProblem(problem.question, Decimal(problem.answer), problem.solution, names)


def jsonl(rows) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode("ascii")


def problems_file(name: str) -> bytes:
    """heldout/NAME.jsonl: one problem a line."""
    return jsonl(
        {"question": p.question, "solution": p.solution, "answer": p.answer, "names": names_of(p)}
        for p in SPLITS[name].problems()
    )


def shots_file(source: str) -> bytes:
    """heldout/shots-SOURCE.jsonl (uncompressed): problem i's first MAX_SHOTS examples."""
    size = max(s.size for s in BUILTIN.values() if s.shots_from == source)
    shots = SPLITS[source].shots
    return jsonl([[s.question, s.solution] for s in shots(i, MAX_SHOTS)] for i in range(size))


def gzipped(data: bytes) -> bytes:
    """Reproducible gzip (no timestamp, no file name)."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=9, mtime=0, filename="") as f:
        f.write(data)
    return buf.getvalue()


def freeze(out: Path = HELDOUT) -> list[Path]:
    """Write every built-in set and its examples; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in BUILTIN:
        written.append(out / f"{name}.jsonl")
        written[-1].write_bytes(problems_file(name))
    for source in sorted({s.shots_from for s in BUILTIN.values()}):
        written.append(out / f"shots-{source}.jsonl.gz")
        written[-1].write_bytes(gzipped(shots_file(source)))
    return written


if __name__ == "__main__":
    target = Path(sys.argv[sys.argv.index("--out") + 1]) if "--out" in sys.argv else HELDOUT
    for path in freeze(target):
        print(path)
