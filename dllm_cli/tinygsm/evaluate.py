"""Exact-match accuracy on held-out TinyGSM problems under any decoding settings.

The library behind `dllm eval` and `dllm bench` (and training's learning curve): problems are
`few_shot_prompt(question, shots_for(i, K))`, encoded by the caller (the runtime's chat
template), decoded in batches by the real engine and checked with `tinygsm.data.is_correct`.

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

from dllm_cli.decoding import Committer, DecodeResult, answer_length, decode
from dllm_cli.errors import UsageError
from dllm_cli.models.base import DiffusionLM
from dllm_cli.models.loading import SpecialIds
from dllm_cli.runtime import Runtime
from dllm_cli.settings import DecodeSettings
from dllm_cli.tinygsm.data import Problem, extract_answer, few_shot_prompt, is_correct
from dllm_cli.tinygsm.splits import SPLITS, restates


@dataclass(frozen=True)
class Task:
    """One held-out problem, ready to decode."""

    index: int  # position in the held-out split
    prompt: list[int]
    answer: int
    problem: Problem | None = None  # the question, to check that the answer restates it


@dataclass(frozen=True)
class ProblemResult:
    """What the decoder answered for one problem."""

    index: int
    answer: int
    predicted: int | None  # the integer on the first answer line, None when there is none
    correct: bool
    tokens: int  # generated tokens up to and including the answer's end
    text: str
    restated: bool | None = None  # repeated every number and name of the question (splits.py)


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


def held_out(
    encode: Callable[[str], list[int]], n: int, shots: int, start: int = 0, split: str = "narrow"
) -> list[Task]:
    """Problems start .. start+n-1 of a held-out split with K fixed shots each, encoded."""
    if split not in SPLITS:
        raise UsageError(f"unknown split {split!r} (choose from {', '.join(SPLITS)})")
    if n < 1:
        raise UsageError(f"--n must be at least 1 (got {n})")
    if shots < 0:
        raise UsageError(f"--shots must be >= 0 (got {shots})")
    chosen = SPLITS[split]
    problems = chosen.problems()
    if start < 0 or start + n > len(problems):
        raise UsageError(
            f"problems {start}..{start + n - 1} are outside the {split} split's "
            f"0..{len(problems) - 1}"
        )
    return [
        Task(
            start + i,
            encode(few_shot_prompt(p.question, chosen.shots(start + i, shots))),
            p.answer,
            p,
        )
        for i, p in enumerate(problems[start : start + n])
    ]


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
            length = out.answer_tokens(tokens, special)
            answer_text = text(tokens)
            predicted = extract_answer(answer_text)
            correct = is_correct(answer_text, task.answer)
            restated = None if task.problem is None else restates(task.problem, answer_text)
            out.results.append(
                ProblemResult(
                    task.index, task.answer, predicted, correct, length, answer_text, restated
                )
            )
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
    n: int,
    shots: int,
    *,
    batch_size: int = 1,
    start: int = 0,
    split: str = "narrow",
    warmup: bool = False,
    on_batch: Callable[[int], None] | None = None,
) -> Score:
    """A Runtime's accuracy on n held-out problems, with its settings and guide."""
    tasks = held_out(runtime.encode, n, shots, start, split)
    model, special = runtime.loaded.model, runtime.loaded.special
    committer = runtime.committer()
    if warmup:
        warm_up(model, special, tasks[0], runtime.settings, committer)
    return score(
        model,
        special,
        tasks,
        runtime.settings,
        runtime.text,
        committer=committer,
        batch_size=batch_size,
        on_batch=on_batch,
    )


def details(score_: Score) -> list[dict]:
    """Per-problem results (JSON-ready)."""
    return [asdict(r) for r in score_.results]
