"""This process's place in a torchrun launch: rank, device, process group, its input lines."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import BinaryIO

import torch
import torch.distributed as dist

from dllm_cli.errors import DeviceError, DllmError, SettingsError

TIMEOUT_ENV = "DLLM_DIST_TIMEOUT"
DEFAULT_TIMEOUT = 1800.0
COLLECTIVE_ENV = "DLLM_COLLECTIVE_TIMEOUT"  # --tensor-parallel: one collective's limit
DEFAULT_COLLECTIVE = 300.0
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Job:
    """This process's place in a torchrun launch."""

    rank: int
    world: int
    local_rank: int
    timeout: float  # seconds rank 0 waits for the next report
    collective_timeout: float = DEFAULT_COLLECTIVE  # seconds a split model's collective waits

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
                "(see docs/distributed.md)"
            )
        timeout = _seconds(env, TIMEOUT_ENV, DEFAULT_TIMEOUT)
        collective = _seconds(env, COLLECTIVE_ENV, DEFAULT_COLLECTIVE)
        rank, local = _number(env, "RANK", "", int), _number(env, "LOCAL_RANK", "", int)
        if not 0 <= rank < world or local < 0:
            raise SettingsError(f"RANK={rank}, LOCAL_RANK={local} do not fit WORLD_SIZE={world}")
        return cls(rank, world, local, timeout, collective)

    def lines_of(self, rank: int, count: int) -> range:
        """The 1-based line numbers `rank` decodes out of `count`: every world-th line."""
        return range(rank + 1, count + 1, self.world)

    def shard(self, lines: list[bytes]) -> Iterator[tuple[int, bytes]]:
        """(line number, line) for this rank's lines, in input order."""
        return ((n, lines[n - 1]) for n in self.lines_of(self.rank, len(lines)))


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    seconds = _number(env, name, str(default), float)
    if not seconds > 0:
        raise SettingsError(f"{name} must be a number of seconds above 0")
    return seconds


def _number(env: Mapping[str, str], name: str, default: str, kind: type) -> int | float:
    try:
        return kind(env.get(name, default))
    except ValueError:
        raise SettingsError(f"{name}={env.get(name)!r} is not a number") from None


def rank_device(job: Job, flag: str | None, configured: str) -> str:
    """This rank's device: cuda:LOCAL_RANK unless the run asks for the CPU (`flag`: --device as
    given, else None; `configured`: with the profile); --device cuda:N is refused."""
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


class Ended(DllmError):
    """torchrun stopped this rank (SIGTERM), as it stops every rank once one has exited."""


@contextmanager
def ended_by_sigterm(rank: int) -> Iterator[None]:
    """SIGTERM (torchrun's, after another rank exited) -> one `Ended` line, not a silent
    death; the main thread only (signals go there)."""

    def end(signum: int, frame: object) -> None:
        raise Ended(
            f"rank {rank}: stopped by torchrun (SIGTERM): another rank exited, and the "
            "summary below names it"
        )

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, end)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def process_group(job: Job) -> Iterator[None]:
    """gloo over all ranks (MASTER_ADDR:MASTER_PORT) for the job; only a normal end takes it
    down (after an error rank 0's listener may still be inside it: tearing it down aborts)."""
    dist.init_process_group("gloo", rank=job.rank, world_size=job.world, timeout=job.group_timeout)
    yield
    dist.destroy_process_group()


def share_lines(job: Job, stdin: BinaryIO) -> list[bytes] | None:
    """Rank 0's input lines as bytes on every rank (others' stdin may be empty or elsewhere),
    each decoded later on its own; rank 0 raises what reading stdin raised, the others get None."""
    box: list[list[bytes] | None] = [None]
    error = None
    if job.rank == 0:
        try:
            box[0] = stdin.readlines()
        except (OSError, ValueError) as e:  # ValueError: stdin is closed
            error = e
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    return box[0]
