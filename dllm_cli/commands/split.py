"""--tensor-parallel for the commands that decode a fixed workload (eval, bench): every rank of
one replica loads its slices and steps the same decode; rank 0 alone prints and writes.

The workload is the same on every rank (the same problems, settings and seeds), so the ranks take
the same decisions and run the same collectives without any message between them; only the
split model's collectives cross ranks (generate's batch mode shares stdin, generate_runs.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated

import typer

from dllm_cli import options as o
from dllm_cli.commands.common import USAGE, load_runtime
from dllm_cli.errors import DllmError, SettingsError

if TYPE_CHECKING:
    from dllm_cli.runtime import Runtime


parallelism = o.in_panel("Parallelism")


def option(what: str) -> object:
    """The --tensor-parallel option, its help saying what every rank does in this command."""
    return parallelism(
        f"Under torchrun: split the model over N ranks (heads, MLP columns, vocabulary); "
        f"{what} (docs/tensor-parallel.md). LLaDA, Dream and LLaDA-MoE, greedy.",
        "--tensor-parallel",
    )


TensorParallel = Annotated[int, option("every rank decodes every problem, rank 0 prints")]
ExpertParallel = Annotated[
    bool,
    parallelism(
        "With --tensor-parallel N: share LLaDA-MoE's or LLaDA2.x's experts out whole over "
        "the N ranks (each holds E/N experts; attention stays split by heads) instead of "
        "splitting every expert's columns.",
        "--expert-parallel",
    ),
]


def check_experts(degree: int, experts: bool) -> None:
    """--expert-parallel shares experts out over the --tensor-parallel ranks: it needs them."""
    if experts and degree == 1:
        raise SettingsError(
            "--expert-parallel shares the experts out over the --tensor-parallel ranks: "
            "give --tensor-parallel N too"
        )


@contextmanager
def split_runtime(
    choices: o.Choices, degree: int, experts: bool = False, slots: int = 1
) -> Iterator[Runtime]:
    """The runtime of this rank's slices (the whole model at degree 1), inside the job's
    process group; what rank 0 refuses, the other ranks exit on with its code, silently."""
    check_experts(degree, experts)
    if degree == 1:
        yield load_runtime(choices, slots=slots)
        return
    from dllm_cli import distributed
    from dllm_cli.commands.generate_runs import load_on_rank, tensor_shards

    job = distributed.Job.from_env()
    shards = tensor_shards(job, degree, experts)
    if shards.replicas > 1:
        if job.rank:
            raise typer.Exit(USAGE)  # rank 0 says why
        raise SettingsError(
            f"this command runs one replica: launch {degree} processes for --tensor-parallel "
            f"{degree} (this run has {job.world})"
        )
    runtime = load_on_rank(job, choices, shards)
    try:
        with distributed.process_group(job), distributed.ended_by_sigterm(job.rank):
            shards.join()
            yield runtime
    except DllmError as e:  # rank 0 says it; the others leave with its code
        if job.rank and e.exit_code == USAGE:
            raise typer.Exit(e.exit_code) from None
        raise


def leads() -> bool:
    """Whether this process prints: rank 0 of a torchrun job, or the only process."""
    from dllm_cli import distributed

    job = distributed.Job.from_env()
    return job is None or job.rank == 0
