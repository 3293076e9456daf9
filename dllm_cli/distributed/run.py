"""One rank's part of a sharded job: decode its lines, report them; rank 0 also writes them all."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch.distributed as dist

from dllm_cli.distributed.exchange import (
    Failure,
    Outbox,
    Report,
    Silence,
    Unreachable,
    first_line,
    listen,
)
from dllm_cli.distributed.job import Job
from dllm_cli.distributed.merge import Interrupts, Merge, Record

R = TypeVar("R", bound=Record)
Work = Callable[[Iterable[tuple[int, bytes]], Callable[[list[R]], None]], None]
Describe = Callable[[BaseException], tuple[str, int]]  # an error -> (one line, exit code)


class Tally(Protocol):
    """A rank's running totals (batch.Totals): rank 0 merges every other rank's into its own."""

    def merge(self, other: Tally) -> None: ...


@dataclass
class Outcome:
    """How this rank's part ended; the command turns it into stderr lines and an exit code."""

    failed: int = 0  # rank 0: error records written
    stopped: dict[int, tuple[Failure, list[int]]] = field(default_factory=dict)  # rank 0
    failure: Failure | None = None  # another rank: why its own work stopped
    lost: str | None = None  # another rank: why rank 0 could not be reached


class Stranded(BaseException):
    """Rank 0 stopped on `cause` while its listener thread still waits inside gloo: the process
    must leave with os._exit, as an interpreter shutdown under that thread aborts (SIGABRT)."""

    def __init__(self, cause: BaseException):
        super().__init__(cause)
        self.cause = cause


def run(
    job: Job,
    lines: list[bytes],
    work: Work,
    *,
    emit: Callable[[R], None],
    lost: Callable[[int, str], R],
    totals: Tally,
    advance: Callable[[int], None],
    describe: Describe,
) -> Outcome:
    """This rank's part: `work` decodes the shard and passes finished records on in order; rank
    0 `emit`s every rank's records in input order (`lost(line, reason)`: a failed rank's
    unfinished line), `advance`s the progress and merges every rank's `totals`. `describe`: an
    error -> its report's line and exit code (may print a trace)."""
    if job.rank != 0:
        return _follow(job, lines, work, totals, describe)
    # rank 0: decode its own shard while a listener thread takes the others' reports
    interrupts = Interrupts()
    merge = Merge(job, len(lines), emit, lost, interrupts.held)
    inbox: queue.Queue[Report | Silence] = queue.Queue()
    listener = threading.Thread(target=listen, args=(job, inbox, advance), daemon=True)
    listener.start()

    def done(records: list[R]) -> None:
        advance(len(records))
        merge.add(records)
        merge.drain(inbox)
        merge.write()

    try:
        with interrupts.installed():
            _gather(merge, inbox, lambda: work(job.shard(lines), done), describe)
    except BaseException as e:
        if listener.is_alive():
            raise Stranded(e) from e
        raise
    if not merge.silent:
        dist.barrier()  # every rank waits here, so none exits before rank 0 wrote all
    for other in merge.totals:
        totals.merge(other)
    return Outcome(failed=merge.failed, stopped=merge.failures)


def _follow(job: Job, lines: list[bytes], work: Work, totals: Tally, describe: Describe) -> Outcome:
    """A rank other than 0: decode, report each batch, report how it ended, wait for the rest."""
    outbox = Outbox(job.timeout)
    outcome = Outcome()
    try:
        try:
            work(job.shard(lines), lambda records: outbox.send(Report(job.rank, records)))
        except Unreachable:
            raise
        except (Exception, KeyboardInterrupt) as e:
            outcome.failure = Failure(*describe(e))
        report = Report(job.rank, [], last=True, totals=totals, failure=outcome.failure)
        outbox.send(report)
        outbox.flush()
        dist.barrier()  # rank 0 has written everything: exiting now cannot cut it short
    except (Unreachable, RuntimeError) as e:  # RuntimeError: from the barrier
        outcome.lost = first_line(e)
    return outcome


def _gather(
    merge: Merge, inbox: queue.Queue, decode_own: Callable[[], None], describe: Describe
) -> None:
    """Rank 0's own lines, then every other rank's last report; Ctrl-C writes what is done."""
    try:
        try:
            decode_own()
        except OSError:  # stdout failed (its reader left): nothing more can be written
            raise
        except Exception as e:
            merge.give_up(0, Failure(*describe(e)))
        while merge.waiting:
            merge.take(inbox.get())
            merge.write()
        merge.write()
    except KeyboardInterrupt:
        merge.drain(inbox)
        merge.stop("not decoded: interrupted")
        raise
