"""Exact-match accuracy on a problem set under any decoding settings.

The library behind `dllm eval` and `dllm bench` (and the recipe's learning curves): problems
(problems.py: a frozen built-in set, or a GSM8K-style data file) become
`few_shot_prompt(question, shots)`, encoded by the caller (the runtime's chat template),
decoded in batches by the real engine, and their answers extracted and compared to the gold
number: built-in sets by their own rule (the first `The answer is N.` line, the rule every
measurement of the shipped models used), data files by GSM8K harnesses' rule
(`problems.extract_gsm8k`).

Throughput, defined once for every command:
- `tokens`: per problem, `decoding.answer_length`: the generated tokens up to and including the
  answer's end, i.e. the first stop token (EOS or end-of-turn) counts, the EOS filling after it
  does not; an answer without a stop token counts all `gen_length` positions. This is the text
  a user waits for, and it does not reward decoders for padding faster (`generate --stats`
  counts the same).
- `tokens_per_second` = sum of `tokens` / `seconds`, where `seconds` is the wall time of the
  decode calls (model and guide forwards, sampling, commits; not tokenization or checking),
  after an untimed warm-up decode of one block when asked (`dllm eval` and `dllm bench` do).
- `gen_tokens_per_second` = n * gen_length / seconds: canvas positions per second, the number
  that grows with gen_length when a decoder stops early.
- `forwards`: diffusion-model forwards (NFE) over all batches (one forward serves a batch);
  `guide_forwards`: the AR guide's forwards; `tokens_per_forward` = tokens / forwards (per
  diffusion forward); `guide_seconds`: the part of `seconds` spent in the guide (its
  forwards and the verification), `guide_share` = guide_seconds / seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from decimal import Decimal
from pathlib import Path

from dllm_cli.decoding import Committer, DecodeResult, answer_length, decode
from dllm_cli.errors import InputError, UsageError
from dllm_cli.models.base import DiffusionLM
from dllm_cli.models.loading import SpecialIds
from dllm_cli.problems import (
    BadLine,
    Problem,
    builtin_problems,
    builtin_shots,
    extract_gsm8k,
    extract_tinygsm,
    few_shot_prompt,
    json_number,
    read_problems,
    restates,
)
from dllm_cli.runtime import Runtime
from dllm_cli.settings import DecodeSettings

Extract = Callable[[str], Decimal | None]


@dataclass(frozen=True)
class Task:
    """One problem, ready to decode."""

    index: int  # position in its set (built-in) or 1-based line (data file)
    prompt: list[int]
    answer: Decimal | int
    problem: Problem | None = None  # the question, to check that the answer restates it
    extract: Extract = extract_tinygsm  # how an answer's number is read from its text


@dataclass(frozen=True)
class ProblemResult:
    """What the decoder answered for one problem."""

    index: int
    answer: Decimal | int
    predicted: Decimal | None  # the extracted number, None when there is none
    correct: bool
    tokens: int  # generated tokens up to and including the answer's end
    text: str
    restated: bool | None = None  # repeated every number and name of the question
    question: str | None = None


@dataclass
class Cost:
    """What decoding a set of prompts cost, and the throughput figures defined above (shared
    by `Score` and bench's throughput mode); subclasses say what `n` and `tokens` are."""

    gen_length: int
    forwards: int = 0
    guide_forwards: int = 0
    steps: int = 0
    seconds: float = 0.0
    guide_seconds: float = 0.0
    mask_violations: int = 0  # answers whose text still held a mask token (must stay 0)

    def add_run(self, result: DecodeResult, seconds: float) -> None:
        """One timed decode call's counts."""
        self.seconds += seconds
        self.forwards += result.forwards
        self.guide_forwards += result.guide_forwards
        self.guide_seconds += result.guide_seconds
        self.steps += result.steps

    def check(
        self, task: Task, tokens: list[int], special: SpecialIds, text: str, restate: bool = True
    ) -> None:
        """One answer against its task's number (and, with `restate`, its question's facts)."""
        length = self.answer_tokens(tokens, special)
        predicted = task.extract(text)
        right = predicted is not None and predicted == task.answer
        problem = task.problem if restate else None
        restated = None if problem is None else restates(problem, text)
        question = None if problem is None else problem.question
        fields = (task.index, task.answer, predicted, right, length, text, restated, question)
        self.results.append(ProblemResult(*fields))

    def answer_tokens(self, tokens: list[int], special: SpecialIds) -> int:
        """An answer's token count (decoding.answer_length); a mask inside it is a violation."""
        length = answer_length(tokens, special.stop)
        self.mask_violations += special.mask in tokens[:length]
        return length

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def gen_tokens_per_second(self) -> float:
        return self.n * self.gen_length / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0

    def costs(self) -> dict:
        """The cost keys of every report (JSON-ready)."""
        return {
            "tokens": self.tokens,
            "tokens_per_second": self.tokens_per_second,
            "gen_tokens_per_second": self.gen_tokens_per_second,
            "forwards": self.forwards,
            "guide_forwards": self.guide_forwards,
            "tokens_per_forward": self.tokens_per_forward,
            "guide_seconds": self.guide_seconds,
            "guide_share": self.guide_seconds / self.seconds if self.seconds > 0 else 0.0,
            "steps": self.steps,
            "seconds": self.seconds,
            "mask_violations": self.mask_violations,
        }


@dataclass
class Score(Cost):
    """Accuracy and cost of one pass over a problem set with one set of settings."""

    results: list[ProblemResult] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.results)

    @property
    def correct(self) -> int:
        return sum(r.correct for r in self.results)

    @property
    def restated(self) -> int | None:
        """Answers that restate their question's facts (None when no problem says what)."""
        marks = [r.restated for r in self.results if r.restated is not None]
        return sum(marks) if marks else None

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else 0.0

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.results)

    def summary(self) -> dict:
        """The numbers every report shares (JSON-ready)."""
        return {
            "accuracy": self.accuracy,
            "n": self.n,
            "correct": self.correct,
            "restated": self.restated,
            **self.costs(),
        }


def check_counts(n: int | None, shots: int, start: int) -> None:
    if n is not None and n < 1:
        raise UsageError(f"--n must be at least 1 (got {n})")
    if shots < 0:
        raise UsageError(f"--shots must be >= 0 (got {shots})")
    if start < 0:
        raise UsageError(f"--start must be >= 0 (got {start})")


def held_out(
    encode: Callable[[str], list[int]], n: int, shots: int, start: int = 0, split: str = "narrow"
) -> list[Task]:
    """Problems start .. start+n-1 of a built-in held-out set with K fixed shots each, encoded."""
    problems = builtin_problems(split)  # an unknown split: UsageError naming the known ones
    check_counts(n, shots, start)
    if start + n > len(problems):
        raise UsageError(
            f"problems {start}..{start + n - 1} are outside the {split} split's "
            f"0..{len(problems) - 1}"
        )

    def task(i: int, p: Problem) -> Task:
        prompt = few_shot_prompt(p.question, builtin_shots(split, i, shots))
        return Task(i, encode(prompt), int(p.answer), p)

    return [task(start + i, p) for i, p in enumerate(problems[start : start + n])]


def from_file(
    encode: Callable[[str], list[int]],
    path: Path,
    n: int | None,
    shots: int,
    start: int = 0,
    shots_from: Path | None = None,
) -> tuple[list[Task], list[BadLine]]:
    """A data file's problems (after `start` of them), the same K examples in every prompt:
    the first K problems of `shots_from`, else of the file itself (then not scored)."""
    check_counts(n, shots, start)
    problems, bad = read_problems(path)
    if shots_from is None:
        examples, problems = problems[:shots], problems[shots:]
    else:
        examples, bad_shots = read_problems(shots_from)
        examples, bad = examples[:shots], bad_shots + bad
    if len(examples) < shots:
        where = shots_from or path
        raise InputError(f"--shots {shots}: {where} has only {len(examples)} usable problems")
    chosen = problems[start:] if n is None else problems[start : start + n]
    if not chosen and not bad:
        raise InputError(f"{path}: no problems to score after the first {start + shots}")
    tasks = [
        Task(p.line, encode(few_shot_prompt(p.question, examples)), p.answer, p, extract_gsm8k)
        for p in chosen
    ]
    return tasks, bad


def score(
    model: DiffusionLM,
    special: SpecialIds,
    tasks: Sequence[Task],
    settings: DecodeSettings,
    text: Callable[[list[int]], str],
    *,
    committer: Committer | None = None,
    batch_size: int = 1,
    on_batch: Callable[[int], None] | None = None,
) -> Score:
    """Decode `tasks` in batches of `batch_size` and check each answer; `text` decodes ids."""
    if batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1 (got {batch_size})")
    out = Score(gen_length=settings.gen_length)
    for first in range(0, len(tasks), batch_size):
        batch = tasks[first : first + batch_size]
        began = time.perf_counter()
        prompts = [t.prompt for t in batch]
        result = decode(model, special, prompts, settings, committer=committer)
        out.add_run(result, time.perf_counter() - began)
        for task, tokens in zip(batch, result.tokens, strict=True):
            out.check(task, tokens, special, text(tokens))
        if on_batch is not None:
            on_batch(len(batch))
    return out


def warm_up(
    model: DiffusionLM,
    special: SpecialIds,
    task: Task,
    settings: DecodeSettings,
    committer: Committer | None = None,
) -> None:
    """One untimed decode of one block, so one-off setup (kernels, allocations) is not timed."""
    short = replace(settings, gen_length=min(settings.block_length, settings.gen_length))
    decode(model, special, [task.prompt], short, committer=committer)


def evaluate(
    runtime: Runtime,
    tasks: Sequence[Task],
    *,
    batch_size: int = 1,
    warmup: bool = False,
    on_batch: Callable[[int], None] | None = None,
) -> Score:
    """A Runtime's accuracy on `tasks`, with its settings and guide."""
    model, special = runtime.loaded.model, runtime.loaded.special
    committer = runtime.committer()
    if warmup:
        warm_up(model, special, tasks[0], runtime.settings, committer)
    options = {"committer": committer, "batch_size": batch_size, "on_batch": on_batch}
    return score(model, special, tasks, runtime.settings, runtime.text, **options)


def details(score_: Score) -> list[dict]:
    """Per-problem results (JSON-ready), as `eval --json --details` has always written them."""
    out = []
    for r in score_.results:
        row = asdict(r) | {"answer": json_number(r.answer), "predicted": json_number(r.predicted)}
        del row["question"]
        out.append(row)
    return out


def records(score_: Score, line_numbers: bool) -> list[dict]:
    """`--records` lines: one per problem, in order (`line` for data files, else `index`)."""
    key = "line" if line_numbers else "index"
    return [
        {
            key: r.index,
            "question": r.question,
            "gold": json_number(r.answer),
            "extracted": json_number(r.predicted),
            "right": r.correct,
            "text": r.text,
        }
        for r in score_.results
    ]
