"""A tensor-parallel rank's place in its group and its collectives, each bounded by a timeout.

A rank that exits, is killed or hangs makes the others' next collective fail (at once, or after
DLLM_COLLECTIVE_TIMEOUT: distributed/job.py), and that failure becomes one `RankLost` line
naming the rank (with two ranks, the other; with more, those that did not sign the torchrun
store's roll of survivors within a couple of seconds), never a hang or a gloo traceback.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cached_property

import torch
import torch.distributed as dist

from dllm_cli.errors import DllmError

DEFAULT_COLLECTIVE_TIMEOUT = 300.0  # seconds: far above any one forward's
ROLL_WAIT = 2.0  # seconds survivors wait for each other to sign the roll


class RankLost(DllmError):
    """A rank of this group exited, was killed or stopped answering: the job ends without it."""


@dataclass
class Counts:
    """Collectives this rank has run (tests and --stats check they stay at the minimum)."""

    all_reduce: int = 0
    all_gather: int = 0
    all_reduce_max: int = 0  # int8's row peaks before a layer holding part of its inputs
    forwards: int = 0


@dataclass
class Shards:
    """This rank's place in a tensor-parallel group of `world` ranks."""

    rank: int
    world: int
    replica: int = 0  # which group of `world` ranks (data parallelism on top)
    replicas: int = 1
    backend: str = "gloo"  # nccl on CUDA (the default group is gloo, for the job's messages)
    counts: Counts = field(default_factory=Counts)
    timeout: float = DEFAULT_COLLECTIVE_TIMEOUT  # seconds one collective may wait
    expert_parallel: bool = False  # MoE experts shared out whole (models/expert_parallel.py)

    @cached_property
    def group(self) -> dist.ProcessGroup:
        """This rank's group, made at the first collective: every replica's group is made by
        every rank in the same order (as new_group needs), with the collective timeout."""
        n, timeout = self.world, timedelta(seconds=self.timeout)
        groups = [
            dist.new_group(list(range(r * n, (r + 1) * n)), timeout=timeout, backend=self.backend)
            for r in range(self.replicas)
        ]
        return groups[self.replica]

    def join(self) -> dist.ProcessGroup:
        """Make this rank's group now, before any rank decodes."""
        return self.group

    def even(self, size: int) -> tuple[int, int]:
        """This rank's equal piece [start, stop) of `size` (the size divides by the world)."""
        piece = size // self.world
        return self.rank * piece, (self.rank + 1) * piece

    def vocabulary(self, size: int) -> tuple[int, int]:
        """This rank's contiguous range of `size` ids (the last rank's may be shorter)."""
        piece = math.ceil(size / self.world)
        return min(size, self.rank * piece), min(size, (self.rank + 1) * piece)

    def widths(self, size: int) -> list[int]:
        """How many of `size` ids each rank's `vocabulary` range holds, in rank order."""
        piece = math.ceil(size / self.world)
        return [
            max(0, min(size, (r + 1) * piece) - min(size, r * piece)) for r in range(self.world)
        ]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        self.counts.all_reduce += 1
        with self.guarded():
            dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The largest `x` over the ranks, in place."""
        self.counts.all_reduce_max += 1
        with self.guarded():
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def agree(self, ok: bool) -> bool:
        """Whether every rank says `ok` (one MIN all-reduce of a flag, on NCCL's device)."""
        device = (
            torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else None
        )
        flag = torch.tensor([float(ok)], device=device)
        with self.guarded():
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """(world, *x.shape): every rank's `x`, in rank order."""
        self.counts.all_gather += 1
        parts = [torch.empty_like(x) for _ in range(self.world)]
        with self.guarded():
            dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.stack(parts)

    @contextmanager
    def guarded(self) -> Iterator[None]:
        """A collective whose failure (gloo's timeout or closed link) ends the job in one line."""
        try:
            yield
        except RuntimeError as e:  # DistBackendError is one
            raise RankLost(self.lost_line(str(e))) from None

    def lost_line(self, error: str) -> str:
        """`rank 0: tensor parallel rank 1 of 2 left the job (...); ending the job`."""
        text = error.lower()
        if "timed out" in text or "timeout" in text:
            how = (
                f"did not answer for {self.timeout:g} s (hung, or one step took longer than "
                "DLLM_COLLECTIVE_TIMEOUT)"
            )
        else:
            how = "left the job (its connection closed: it exited or was killed)"
        silent = self.silent_ranks()
        who = f"rank {', '.join(map(str, silent))}" if silent else "a rank"
        replica = f" (replica {self.replica})" if self.replicas > 1 else ""
        me = self.replica * self.world + self.rank  # this process's rank in the job
        return f"rank {me}: tensor parallel {who} of {self.world}{replica} {how}; ending the job"

    def silent_ranks(self) -> list[int]:
        """The other ranks of this group that did not sign the survivors' roll (the other
        one, of two); [] when the store cannot say."""
        others = [r for r in range(self.world) if r != self.rank]
        if len(others) == 1:
            return others
        try:
            store = dist.distributed_c10d._get_default_store()
            key = f"dllm/survivors/{self.replica}/"
            store.set(f"{key}{self.rank}", "1")
            deadline = time.monotonic() + ROLL_WAIT
            while True:
                silent = [r for r in others if not store.check([f"{key}{r}"])]
                if not silent or time.monotonic() > deadline:
                    return silent
                time.sleep(0.1)
        except (RuntimeError, ValueError):  # no store, or its host is gone too
            return []
