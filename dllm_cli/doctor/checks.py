"""Check records, the time budget and the guard that turns any failure into a reported row.

A doctor run is a list of checks, each with one status:

| status | meaning                                                                 |
|--------|-------------------------------------------------------------------------|
| pass   | the property held                                                       |
| fail   | the property did not hold (the detail says where)                       |
| error  | the check itself raised (the detail has the exception; the run goes on) |
| skip   | not run here, and why (no CUDA device, the time budget was spent, ...)  |
| info   | a measurement with nothing to assert (speed, bfloat16 agreement)        |
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

STATUSES = ("pass", "fail", "error", "skip", "info")


@dataclass
class Outcome:
    """What one check found: a status, one line, and the numbers behind it."""

    status: str
    detail: str
    data: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown check status {self.status!r}")


@dataclass
class Check:
    """One row of the report."""

    section: str  # correctness | speed
    name: str
    status: str
    detail: str
    data: dict = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {
            "section": self.section,
            "name": self.name,
            "status": self.status,
            "detail": self.detail,
            "seconds": round(self.seconds, 3),
            "data": self.data,
        }


class Deadline:
    """The whole run's time budget; checks ask it before starting and between long steps."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.seconds = seconds
        self.start = clock()

    def left(self) -> float:
        return self.seconds - (self.clock() - self.start)

    @property
    def passed(self) -> bool:
        return self.left() <= 0

    def elapsed(self) -> float:
        return self.clock() - self.start


def verdict(failures: list[str], passed: str, data: dict | None = None) -> Outcome:
    """pass with `passed`, or fail naming the first failures (and how many there were)."""
    if not failures:
        return Outcome("pass", passed, data or {})
    more = f" (and {len(failures) - 3} more)" if len(failures) > 3 else ""
    return Outcome("fail", "; ".join(failures[:3]) + more, data or {})


def one_line(e: BaseException) -> str:
    """`Type: first line of the message` for a report cell."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def attempt(
    section: str,
    name: str,
    run: Callable[[], Outcome],
    deadline: Deadline,
    after: Callable[[type], None] | None = None,
) -> Check:
    """Run one check: a skip once the budget is spent, an error row (never a crash) if it
    raises; `after(error type)` tidies up after one (e.g. frees GPU memory)."""
    if deadline.passed:
        return Check(section, name, "skip", "the time budget was spent before this check")
    began, failed = time.perf_counter(), None
    try:
        out = run()
    except KeyboardInterrupt:
        raise
    except Exception as e:  # any failure is a finding; the run goes on
        tb = traceback.format_exception(type(e), e, e.__traceback__)
        out = Outcome("error", one_line(e), {"traceback": "".join(tb[-6:])})
        failed = type(e)
    if failed is not None and after is not None:
        after(failed)  # outside the except: the failed frames (and their tensors) are gone
    return Check(section, name, out.status, out.detail, out.data, time.perf_counter() - began)
