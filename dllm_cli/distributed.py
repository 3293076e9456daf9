"""`dllm generate -` under torchrun: stdin shared out over ranks, rank 0 writes it all in order.

Rank 0 reads stdin and broadcasts the lines. Line n belongs to rank (n - 1) % world, so each
rank runs generate's own batch pipeline on every world-th line and reports its finished records
to rank 0 after every batch; rank 0 writes record n as soon as it holds records 1..n. Only small
pickled records cross ranks (no model tensors), so the group is gloo on every device: it can take
whichever rank's report comes first, and time out: rank 0 gives up on ranks that sent nothing
for DLLM_DIST_TIMEOUT seconds (default 1800). A rank that fails reports why; rank 0 writes an
error record for each line it held and never finished, then exits with that rank's error code.
"""

from __future__ import annotations

import os
import pickle
import queue
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import dataclass
from datetime import timedelta
from typing import Generic, NoReturn, Protocol, TextIO, TypeVar

import torch
import torch.distributed as dist
import typer

from dllm_cli.commands import common
from dllm_cli.commands.common import Totals, cli_errors, describe_error, error_line, is_debug
from dllm_cli.errors import DeviceError, DllmError, SettingsError
from dllm_cli.profiles import resolve
from dllm_cli.runtime import Runtime

TIMEOUT_ENV = "DLLM_DIST_TIMEOUT"
DEFAULT_TIMEOUT = 1800.0
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_HEAD, _BODY = 1, 2  # message tags: a report's byte count, then its pickled bytes
_SHOWN_LINES = 10  # line numbers listed in a failed rank's summary


@dataclass(frozen=True)
class Job:
    """This process's place in a torchrun launch."""

    rank: int
    world: int
    local_rank: int
    timeout: float  # seconds rank 0 waits for the next report

    @property
    def group_timeout(self) -> timedelta:
        """How long ranks wait for each other to start (model loads) and to finish."""
        return timedelta(seconds=max(self.timeout, DEFAULT_TIMEOUT))

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Job | None:
        """The launch torchrun describes in the environment; None for a one-process run."""
        world = _number(env, "WORLD_SIZE", "1", int)
        if world <= 1:
            return None
        missing = [name for name in LAUNCH_ENV if not env.get(name)]
        if missing:
            raise SettingsError(
                f"WORLD_SIZE={world} but {', '.join(missing)} not set: launch with torchrun "
                "(see the README, 'Several GPUs or machines')"
            )
        timeout = _number(env, TIMEOUT_ENV, str(DEFAULT_TIMEOUT), float)
        if not timeout > 0:
            raise SettingsError(f"{TIMEOUT_ENV} must be a number of seconds above 0")
        rank, local = _number(env, "RANK", "", int), _number(env, "LOCAL_RANK", "", int)
        if not 0 <= rank < world or local < 0:
            raise SettingsError(f"RANK={rank}, LOCAL_RANK={local} do not fit WORLD_SIZE={world}")
        return cls(rank, world, local, timeout)

    def lines_of(self, rank: int, count: int) -> range:
        """The 1-based line numbers `rank` decodes out of `count`: every world-th line."""
        return range(rank + 1, count + 1, self.world)

    def shard(self, lines: list[str]) -> Iterator[tuple[int, str]]:
        """(line number, line) for this rank's lines, in input order."""
        return ((n, lines[n - 1]) for n in self.lines_of(self.rank, len(lines)))


def _number(env: Mapping[str, str], name: str, default: str, kind: type) -> int | float:
    try:
        return kind(env.get(name, default))
    except ValueError:
        raise SettingsError(f"{name}={env.get(name)!r} is not a number") from None


# --- this rank's device and model ----------------------------------------------------------


def rank_device(job: Job, flag: str | None, configured: str) -> str:
    """This rank's device: its own GPU, cuda:LOCAL_RANK, unless the run asks for the CPU.

    `flag` is --device as given (None: not given), `configured` what it resolves to with the
    profile. An explicit --device cuda:N is refused: it would put every rank on one GPU.
    """
    if flag is not None and flag.strip().lower().startswith("cuda:"):
        raise SettingsError(
            f"--device {flag} would put every rank on one GPU: under torchrun rank r uses "
            "cuda:LOCAL_RANK, so give --device cuda (or auto) and pick GPUs with "
            "CUDA_VISIBLE_DEVICES"
        )
    wanted = configured.strip().lower()
    if wanted == "cpu" or (wanted == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if wanted in ("auto", "cuda") or wanted.startswith("cuda:"):
        count = torch.cuda.device_count()
        if 0 < count <= job.local_rank:
            raise DeviceError(
                f"LOCAL_RANK {job.local_rank} needs cuda:{job.local_rank} but this machine has "
                f"{count} GPU(s): run at most {count} processes per machine (--nproc-per-node)"
            )
        return f"cuda:{job.local_rank}"
    return configured  # another kind (mps): load_model accepts or refuses it


def load_runtime(
    job: Job, profile: str | None, flags: dict[str, object], guide: bool | None
) -> Runtime:
    """common.load_runtime on this rank's device; ranks other than 0 keep their notes quiet."""
    resolved, _ = resolve(profile, flags)
    flag = flags.get("model.device")
    device = rank_device(job, flag if isinstance(flag, str) else None, resolved.model.device)
    flags = {**flags, "model.device": device}
    quiet = common.stderr.quiet
    common.stderr.quiet = quiet or job.rank != 0
    try:
        return common.load_runtime(profile, flags, guide)
    except DllmError as e:  # say which rank could not load: ranks may sit on different machines
        raise type(e)(f"rank {job.rank}: {e}") from None
    finally:
        common.stderr.quiet = quiet


# --- the process group and the input -------------------------------------------------------


@contextmanager
def process_group(job: Job) -> Iterator[None]:
    """gloo over all ranks (MASTER_ADDR:MASTER_PORT) for the length of the job.

    Only a job that ends normally takes the group down: after an error or interrupt, rank 0's
    listener may still be inside it, and tearing it down under it aborts the process.
    """
    dist.init_process_group("gloo", rank=job.rank, world_size=job.world, timeout=job.group_timeout)
    yield
    dist.destroy_process_group()


def share_lines(job: Job, stdin: TextIO) -> list[str]:
    """Rank 0's stdin lines, on every rank (other ranks' stdin may be empty, or elsewhere)."""
    box: list[list[str] | None] = [None]
    error = None
    if job.rank == 0:
        try:
            box[0] = stdin.readlines()
        except (OSError, ValueError) as e:  # ValueError: not UTF-8
            error = e
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[0] is None:
        raise typer.Exit(1)  # rank 0 could not read stdin and says why
    return box[0]


# --- what ranks tell rank 0 ----------------------------------------------------------------


class Record(Protocol):
    """One input line's outcome (generate's Slot): its 1-based line, and its error if it failed."""

    line: int
    error: str | None


R = TypeVar("R", bound=Record)
Work = Callable[[Iterable[tuple[int, str]], Callable[[list[R]], None]], None]


@dataclass(frozen=True)
class Failure:
    """Why a rank stopped: the one line and exit code the CLI gives its error."""

    message: str
    code: int


@dataclass
class Report(Generic[R]):
    """Records a rank finished since its last report; the last one also says how it ended."""

    rank: int
    records: list[R]
    last: bool = False
    totals: Totals | None = None
    failure: Failure | None = None


@dataclass(frozen=True)
class Silence:
    """The listener stopped: no report for the whole timeout, or a rank's link broke."""

    reason: str


class Unreachable(Exception):
    """Rank 0 cannot be reached: it exited, or the link to it broke."""


class Outbox:
    """A rank's reports to rank 0, sent while decoding goes on, one in flight at a time.

    gloo finishes a send only when it is waited for; the wait comes with the next report, by
    when rank 0 (always listening) has long taken it.
    """

    def __init__(self, timeout: float):
        self.timeout = timedelta(seconds=timeout)
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []  # requests and their buffers

    def send(self, report: Report) -> None:
        self.flush()
        body = torch.frombuffer(bytearray(pickle.dumps(report)), dtype=torch.uint8)
        head = torch.tensor([body.numel(), report.rank], dtype=torch.long)
        try:
            self.pending = [
                (dist.isend(head, dst=0, tag=_HEAD), head),
                (dist.isend(body, dst=0, tag=_BODY), body),
            ]
        except RuntimeError as e:
            raise Unreachable(_first_line(e)) from None

    def flush(self) -> None:
        """Wait until rank 0 has taken the report in flight."""
        pending, self.pending = self.pending, []
        try:
            for request, _ in pending:
                request.wait(self.timeout)
        except RuntimeError as e:
            raise Unreachable(_first_line(e)) from None


def _receive(timeout: timedelta) -> Report:
    """The next report from whichever rank sends one first."""
    head = torch.zeros(2, dtype=torch.long)
    dist.irecv(head, tag=_HEAD).wait(timeout)
    size, rank = head.tolist()
    body = torch.empty(size, dtype=torch.uint8)
    dist.irecv(body, src=rank, tag=_BODY).wait(timeout)
    return pickle.loads(body.numpy().tobytes())


def _listen(job: Job, inbox: queue.Queue, advance: Callable[[int], None]) -> None:
    """Rank 0's listener thread: reports into `inbox` until every other rank sent its last."""
    waiting = set(range(1, job.world))
    timeout = timedelta(seconds=job.timeout)
    heard = time.monotonic()
    try:
        while waiting:
            report = _receive(timeout)
            heard = time.monotonic()
            advance(len(report.records))
            if report.last:
                waiting.discard(report.rank)
            inbox.put(report)
    except Exception as e:  # the timeout passed, or a rank's connection closed
        if time.monotonic() - heard >= 0.95 * job.timeout:  # (clocks differ a little)
            inbox.put(Silence(f"sent nothing for {job.timeout:g} s"))
        else:
            inbox.put(Silence(f"lost its link ({_first_line(e)})"))


def _first_line(e: BaseException) -> str:
    """An error's first line without gloo's `[file.cc:N] ` prefix."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip())
    return text.splitlines()[0] if text else type(e).__name__


# --- running the job -----------------------------------------------------------------------


def run(
    job: Job,
    lines: list[str],
    work: Work,
    emit: Callable[[R], None],
    lost: Callable[[int, str], R],
    totals: Totals,
    advance: Callable[[int], None],
) -> int:
    """This rank's part: `work` decodes the shard and passes finished records on in order.

    Rank 0 `emit`s every rank's records in input order (`lost(line, reason)` makes an error
    record for a line a failed rank never finished), `advance`s the progress by every finished
    record, sums every rank's `totals` into its own and returns how many lines failed. A failed
    rank (rank 0: any) exits with the failure's code once rank 0 has written everything.
    """
    if job.rank == 0:
        return _lead(job, lines, work, emit, lost, totals, advance)
    _follow(job, lines, work, totals)
    return 0


def _follow(job: Job, lines: list[str], work: Work, totals: Totals) -> None:
    """A rank other than 0: decode, report each batch, report how it ended, wait for the rest."""
    outbox = Outbox(job.timeout)
    failure = None
    try:
        try:
            work(job.shard(lines), lambda records: outbox.send(Report(job.rank, records)))
        except Unreachable:
            raise
        except (Exception, KeyboardInterrupt) as e:
            failure = Failure(*describe_error(e))
            if is_debug():
                traceback.print_exc()
            error_line(f"rank {job.rank}: {failure.message}")
        outbox.send(Report(job.rank, [], last=True, totals=totals, failure=failure))
        outbox.flush()
        dist.barrier()  # rank 0 has written everything: exiting now cannot cut it short
    except (Unreachable, RuntimeError) as e:  # RuntimeError: from the barrier
        error_line(f"rank {job.rank}: lost rank 0: {_first_line(e)}")
        raise typer.Exit(failure.code if failure else 1) from None
    if failure is not None:
        raise typer.Exit(failure.code)


def _lead(
    job: Job,
    lines: list[str],
    work: Work,
    emit: Callable[[R], None],
    lost: Callable[[int, str], R],
    totals: Totals,
    advance: Callable[[int], None],
) -> int:
    """Rank 0: decode its own shard while a listener thread takes the others' reports."""
    interrupts = _Interrupts()
    merge = Merge(job, len(lines), emit, lost, interrupts.held)
    inbox: queue.Queue[Report | Silence] = queue.Queue()
    listener = threading.Thread(target=_listen, args=(job, inbox, advance), daemon=True)
    listener.start()

    def done(records: list[R]) -> None:
        advance(len(records))
        merge.add(records)
        merge.drain(inbox)
        merge.write()

    try:
        with interrupts.installed():
            _gather(merge, inbox, lambda: work(job.shard(lines), done))
    except BaseException as e:
        if listener.is_alive():
            _exit_now(e)
        raise
    if not merge.silent:
        dist.barrier()  # every rank waits here, so none exits before rank 0 wrote all
    for other in merge.totals:
        _add_totals(totals, other)
    for rank, (failure, held) in sorted(merge.failures.items()):
        error_line(f"rank {rank} failed: {failure.message}; {_lines_text(held)} not decoded")
    if merge.failures:
        raise typer.Exit(min(merge.failures.items())[1][0].code)
    return merge.failed


def _gather(merge: Merge, inbox: queue.Queue, decode_own: Callable[[], None]) -> None:
    """Rank 0's own lines, then every other rank's last report; Ctrl-C writes what is done."""
    try:
        try:
            decode_own()
        except OSError:  # stdout failed (its reader left): nothing more can be written
            raise
        except Exception as e:
            if is_debug():
                traceback.print_exc()
            merge.give_up(0, Failure(*describe_error(e)))
        while merge.waiting:
            merge.take(inbox.get())
            merge.write()
        merge.write()
    except KeyboardInterrupt:
        merge.drain(inbox)
        merge.stop("not decoded: interrupted")
        raise


def _exit_now(e: BaseException) -> NoReturn:
    """Exit with the line and code cli_errors gives `e`, skipping the interpreter's shutdown:
    the listener thread still waits inside gloo, and shutting down under it aborts (SIGABRT)."""
    code = 1
    try:
        with cli_errors():
            raise e
    except typer.Exit as stop:
        code = stop.exit_code
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


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
        self.failures: dict[int, tuple[Failure, list[int]]] = {}
        self.totals: list[Totals] = []
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


class _Interrupts:
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


def _add_totals(into: Totals, other: Totals) -> None:
    """Sum another rank's --stats; seconds is the longest rank's, as ranks decode at once."""
    into.prompts += other.prompts
    into.tokens += other.tokens
    into.forwards += other.forwards
    into.steps += other.steps
    into.seconds = max(into.seconds, other.seconds)


def _lines_text(held: list[int]) -> str:
    if not held:
        return "no lines left"
    shown = ", ".join(map(str, held[:_SHOWN_LINES]))
    more = f", ... ({len(held)} lines)" if len(held) > _SHOWN_LINES else ""
    return f"line{'s' if len(held) > 1 else ''} {shown}{more}"
