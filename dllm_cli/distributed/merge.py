"""Rank 0's ledger: records in from every rank, out in input order; Ctrl-C writes what is done."""

from __future__ import annotations

import queue
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Generic, Protocol, TypeVar

from dllm_cli.distributed.exchange import Failure, Report, Silence
from dllm_cli.distributed.job import Job


class Record(Protocol):
    """One input line's outcome (a batch.Slot): its 1-based line, and its error if it failed."""

    line: int
    error: str | None


R = TypeVar("R", bound=Record)


class Merge(Generic[R]):
    """Rank 0's ledger: records in from every rank, records out in input order."""

    def __init__(
        self,
        job: Job,
        count: int,
        emit: Callable[[R], None],
        lost: Callable[[int, str], R],
        hold: Callable[[], AbstractContextManager] = nullcontext,
    ):
        self.job, self.count, self.emit, self.lost = job, count, emit, lost
        self.hold = hold  # around each record's writing: no interrupt halfway
        self.ready: dict[int, R] = {}
        self.next = 1  # the next line to write
        self.failed = 0  # error records written
        self.waiting = set(range(1, job.world))  # ranks whose last report has not come
        self.failures: dict[int, tuple[Failure, list[int]]] = {}  # rank -> why, lines lost
        self.totals: list[Any] = []  # every other rank's totals
        self.silent = False  # the listener gave up: some rank may never reach the barrier

    def add(self, records: list[R]) -> None:
        for record in records:
            self.ready[record.line] = record

    def drain(self, inbox: queue.Queue) -> None:
        """Take every message already waiting in `inbox`."""
        while not inbox.empty():
            self.take(inbox.get())

    def take(self, message: Report | Silence) -> None:
        """Apply one message from the listener."""
        if isinstance(message, Silence):
            self.silent = True
            for rank in sorted(self.waiting):
                self.give_up(rank, Failure(message.reason, 1))
            self.waiting.clear()
            return
        self.add(message.records)
        if message.last:
            self.waiting.discard(message.rank)
            if message.totals is not None:
                self.totals.append(message.totals)
            if message.failure is not None:
                self.give_up(message.rank, message.failure)

    def give_up(self, rank: int, failure: Failure) -> None:
        """A rank stopped: every line it held and never finished gets an error record."""
        held = [
            n for n in self.job.lines_of(rank, self.count) if n >= self.next and n not in self.ready
        ]
        for n in held:
            self.ready[n] = self.lost(n, f"rank {rank} failed: {failure.message}")
        self.failures[rank] = (failure, held)

    def write(self) -> None:
        """Emit every record whose line and all lines before it are finished."""
        while self.next in self.ready:
            with self.hold():
                record = self.ready.pop(self.next)
                self.failed += record.error is not None
                self.emit(record)
                self.next += 1

    def stop(self, reason: str) -> None:
        """Interrupted: write up to the last finished line (gaps as error records), no further."""
        for n in range(self.next, max(self.ready, default=0) + 1):
            self.ready.setdefault(n, self.lost(n, reason))
        self.write()


class Interrupts:
    """Rank 0's SIGTERM (torchrun stops every rank so after Ctrl-C, or when a rank died) and
    SIGINT act as Ctrl-C, so the answers it holds still get written; never halfway through
    writing a record, though: a signal then is raised once that record is out."""

    def __init__(self) -> None:
        self.holding = False
        self.caught = False

    def __call__(self, signum: int, frame: object) -> None:
        if self.holding:
            self.caught = True
        else:
            raise KeyboardInterrupt

    @contextmanager
    def held(self) -> Iterator[None]:
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.caught:
            self.caught = False
            raise KeyboardInterrupt

    @contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():  # signals go to main
            yield
            return
        previous = {sig: signal.signal(sig, self) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
