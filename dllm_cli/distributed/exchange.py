"""What ranks tell rank 0: reports of finished records, sent over gloo while decoding goes on."""

from __future__ import annotations

import pickle
import queue
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from dllm_cli.distributed.job import Job

_HEAD, _BODY = 1, 2  # message tags: a report's byte count, then its pickled bytes

R = TypeVar("R")


@dataclass(frozen=True)
class Failure:
    """Why a rank stopped: the one line and exit code the command gives its error."""

    message: str
    code: int


@dataclass
class Report(Generic[R]):
    """Records a rank finished since its last report; the last one also says how it ended."""

    rank: int
    records: list[R]
    last: bool = False
    totals: Any = None  # the rank's own totals (last report only)
    failure: Failure | None = None


@dataclass(frozen=True)
class Silence:
    """The listener stopped: no report for the whole timeout, or a rank's link broke."""

    reason: str


class Unreachable(Exception):
    """Rank 0 cannot be reached: it exited, or the link to it broke."""


class Outbox:
    """A rank's reports to rank 0, sent while decoding goes on, one in flight at a time (gloo
    finishes a send when waited for: at the next report, long after rank 0 took it)."""

    def __init__(self, timeout: float):
        self.timeout = timedelta(seconds=timeout)
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []  # requests and their buffers

    def send(self, report: Report) -> None:
        self.flush()
        body = torch.frombuffer(bytearray(pickle.dumps(report)), dtype=torch.uint8)
        # the sender's own rank in the world (a replica's lead under --tensor-parallel)
        head = torch.tensor([body.numel(), dist.get_rank()], dtype=torch.long)
        try:
            self.pending = [
                (dist.isend(head, dst=0, tag=_HEAD), head),
                (dist.isend(body, dst=0, tag=_BODY), body),
            ]
        except RuntimeError as e:
            raise Unreachable(first_line(e)) from None

    def flush(self) -> None:
        """Wait until rank 0 has taken the report in flight."""
        pending, self.pending = self.pending, []
        try:
            for request, _ in pending:
                request.wait(self.timeout)
        except RuntimeError as e:
            raise Unreachable(first_line(e)) from None


def receive(timeout: timedelta) -> Report:
    """The next report from whichever rank sends one first."""
    head = torch.zeros(2, dtype=torch.long)
    dist.irecv(head, tag=_HEAD).wait(timeout)
    size, rank = head.tolist()  # (the sender's rank in the world)
    body = torch.empty(size, dtype=torch.uint8)
    dist.irecv(body, src=rank, tag=_BODY).wait(timeout)
    return pickle.loads(body.numpy().tobytes())


def listen(job: Job, inbox: queue.Queue, advance: Callable[[int], None]) -> None:
    """Rank 0's listener thread: reports into `inbox` until every other rank sent its last."""
    waiting = set(range(1, job.world))
    timeout = timedelta(seconds=job.timeout)
    heard = time.monotonic()
    try:
        while waiting:
            report = receive(timeout)
            heard = time.monotonic()
            advance(len(report.records))
            if report.last:
                waiting.discard(report.rank)
            inbox.put(report)
    except Exception as e:  # the timeout passed, or a rank's connection closed
        if time.monotonic() - heard >= 0.95 * job.timeout:  # (clocks differ a little)
            inbox.put(Silence(f"sent nothing for {job.timeout:g} s"))
        else:
            inbox.put(Silence(f"lost its link ({first_line(e)})"))


def first_line(e: BaseException) -> str:
    """An error's first line without gloo's `[file.cc:N] ` prefix."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip())
    return text.splitlines()[0] if text else type(e).__name__
