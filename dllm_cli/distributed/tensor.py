"""--tensor-parallel's ranks: which of a torchrun job's processes form each model replica.

Under R x N processes, ranks rN .. rN + N - 1 form replica r (its own process group, made by
models/sharding.py's Shards). The split model lives in models/ (sharding.py, sharded_load.py),
its sampler in decoding/sharded_sampling.py; nothing here knows of models.
"""

from __future__ import annotations

from dataclasses import dataclass

from dllm_cli.errors import SettingsError


@dataclass(frozen=True)
class Placement:
    """A rank's place under --tensor-parallel: its rank in its replica of `world` ranks."""

    rank: int
    world: int  # the degree: ranks per replica
    replica: int = 0
    replicas: int = 1


def place(rank: int, world: int, degree: int) -> Placement:
    """Rank `rank` of `world` processes under --tensor-parallel `degree` (N): replica r's."""
    if degree < 1:
        raise SettingsError(f"--tensor-parallel must be at least 1 (got {degree})")
    if world % degree:
        raise SettingsError(
            f"--tensor-parallel {degree} needs {degree} processes or a multiple (this run has "
            f"{world}): launch with torchrun --nproc-per-node {degree}"
        )
    return Placement(rank % degree, degree, rank // degree, world // degree)
