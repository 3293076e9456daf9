"""A request: one prompt on its way through the engine, with everything it has done so far.

The engine keeps one `Request` per prompt from `add` until its answer is final (or it is
aborted): its ids, its place in its decode (`RowState`), its slot and what it cost. It ends as
a `Finished`, the record every client reads, whose counts are the request's own whatever
shared its batch.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from dllm_cli.decoding.rows import RowState
from dllm_cli.errors import InputError
from dllm_cli.lifetimes import Sampling


class Status(Enum):
    WAITING = "waiting"  # added, not yet in a slot
    RUNNING = "running"  # in a slot, decoding
    FINISHED = "finished"  # its answer is final
    ABORTED = "aborted"  # dropped by `abort` (leaves its slot on the next step)


@dataclass
class Request:
    """One prompt in the engine (nano-vllm's Sequence): ids, progress, counters, timings."""

    id: int
    prompt: list[int]
    key: Any = None  # what the caller gave with it (handed back in Finished)
    status: Status = Status.WAITING
    row: RowState = field(default_factory=lambda: RowState(0))  # its place in its decode
    first_step: int = -1  # engine step at which it was admitted
    steps: int = 0  # steps it spent in a slot (one forward served it in each)
    forwards: int = 0  # model forwards of those steps
    guide_forwards: int = 0  # the AR guide's forwards of those steps (guided decoding)
    guide_seconds: float = 0.0
    slot: int = -1  # its slot while running
    added_at: float = field(default_factory=time.perf_counter)
    admitted_at: float = 0.0
    sampling: Sampling = field(default_factory=Sampling)  # its own temperature, seed, stops
    generator: Any = None  # its torch.Generator, seeded from sampling.seed at admission
    idle: bool = False  # waits in a finished block for its lockstep batch (draws nothing)
    logprobs: int | None = None  # top alternatives per token it asked for (None: no logprobs)
    logprob_buffers: Any = None  # logprobs.Buffers, made on its first recorded step

    def admit(self, step: int) -> None:
        self.status, self.first_step = Status.RUNNING, step
        self.admitted_at = time.perf_counter()

    def finish(self, tokens, commit_steps, step: int) -> Finished:
        """Its answer is final at engine step `step`: the record clients read."""
        self.status = Status.FINISHED
        return Finished(
            id=self.id,
            key=self.key,
            answer=tokens,
            marks=commit_steps,
            prompt_length=len(self.prompt),
            steps=self.steps,
            forwards=self.forwards,
            guide_forwards=self.guide_forwards,
            seconds=time.perf_counter() - self.admitted_at,
            guide_seconds=self.guide_seconds,
            finished_at=step - self.first_step,
            waited=self.admitted_at - self.added_at,
            logprobs=self.logprob_buffers,
        )


@dataclass
class Finished:
    """A request's answer, handed on the step it became final; every count is its own.
    `tokens` and `commit_steps` arrive as (G,) tensors, read from the device on first use."""

    id: int
    key: Any  # what `add` was given with the prompt
    answer: Any  # gen_length ids (list, or a (G,) tensor until read); after a stop, EOS fill
    marks: Any  # per position: its step (from admission) that committed it; -1: filled
    prompt_length: int
    steps: int  # steps it spent in a slot
    forwards: int  # model forwards that ran in those steps
    guide_forwards: int  # guide forwards that ran in those steps (shared by the batch)
    seconds: float  # wall time from admission to its last step
    guide_seconds: float = 0.0
    finished_at: int = 0  # its 0-based step (from admission) at which the answer was final
    waited: float = 0.0  # seconds between `add` and admission
    logprobs: Any = None  # logprobs.Buffers of a request that asked (read with `token_logprobs`)

    def token_logprobs(self, k: int) -> tuple[list[float], list[list[int]], list[list[float]]]:
        """Per answer column: the token's log-probability, the step's k most likely and theirs."""
        if self.logprobs is None:
            return [], [], []
        return self.logprobs.read(k)

    @property
    def tokens(self) -> list[int]:
        if not isinstance(self.answer, list):
            self.answer = self.answer.tolist()
        return self.answer

    @property
    def commit_steps(self) -> list[int]:
        if not isinstance(self.marks, list):
            self.marks = self.marks.tolist()
        return self.marks


class RequestQueue:
    """The requests an engine holds: queued in arrival order, found by id, aborted."""

    def __init__(self) -> None:
        self.queue: deque[Request] = deque()  # waiting, in arrival order
        self.requests: dict[int, Request] = {}  # waiting or running, by id
        self.next_id = 0

    def enqueue(self, ids: list[int], key: Any, sampling: Sampling | None = None) -> int:
        """Queue a checked prompt; its id."""
        own = Sampling() if sampling is None else sampling
        request = Request(self.next_id, ids, key, sampling=own)
        self.next_id += 1
        self.queue.append(request)
        self.requests[request.id] = request
        return request.id

    def abort(self, rid: int) -> bool:
        """Drop a waiting or running request (False: it was not there); no Finished for it. A
        running one leaves its slot on the engine's next step."""
        request = self.requests.pop(rid, None)
        if request is None:
            return False
        if request.status is Status.WAITING:
            self.queue.remove(request)
        request.status = Status.ABORTED
        return True

    @property
    def waiting(self) -> int:
        return len(self.queue)


def check_slots(slots: object, name: str = "batch size") -> None:
    """A slot count is a whole number of at least 1 (InputError naming `name` otherwise)."""
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise InputError(f"{name} must be at least 1 (got {slots!r})")


def one_prompt(prompt: list[int], *checks: Callable[[list[list[int]]], None]) -> list[int]:
    """A prompt's ids, run through batch checks as a batch of one (errors name no index)."""
    ids = [int(t) for t in prompt]
    try:
        for check in checks:
            check([ids])
    except InputError as e:
        raise InputError(str(e).replace("prompt 0 ", "prompt ", 1)) from None
    return ids
