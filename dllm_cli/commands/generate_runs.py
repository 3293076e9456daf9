"""The batch and torchrun run paths of `dllm generate`: stdin through the pipeline, records out.

Split from generate.py (the command: flags, checks, one prompt) so each stays readable; typer
only for exit codes.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import typer

from dllm_cli import options as o
from dllm_cli.commands.common import (
    USAGE,
    describe_error,
    error_line,
    exit_now,
    is_debug,
    load_runtime,
    note,
    progress_bar,
    show_prompt,
    write,
)
from dllm_cli.errors import DllmError, InputError

if TYPE_CHECKING:  # the decoding modules (torch) are imported when a run starts
    from dllm_cli import distributed
    from dllm_cli.batch import Pipeline, Slot
    from dllm_cli.models.sharding import Shards
    from dllm_cli.runtime import Runtime

_SHOWN_LINES = 10  # line numbers listed in a failed rank's summary


def run_batch(pipeline: Pipeline, shown: Runtime | None = None) -> int:
    """The pipeline on stdin, records to stdout as they are ready; returns how many failed.
    Ctrl-C says how far it got (records go out whole, in input order)."""
    failed = read = written = 0

    def numbered():
        nonlocal read
        for number, raw in enumerate(sys.stdin.buffer, start=1):
            read = number
            progress.update(task, total=number)
            yield number, raw

    def write_out(slots: list[Slot]) -> None:
        nonlocal failed, written
        for slot in slots:
            failed += slot.error is not None
            emit(slot, pipeline.json_out, shown)
            written = slot.line

    with progress_bar("decoding") as progress:
        task = progress.add_task("decoding", total=None)
        pipeline.finished = lambda slot: progress.advance(task)  # as each prompt finishes
        try:
            pipeline.run(numbered(), write_out)
        except KeyboardInterrupt:
            raise KeyboardInterrupt(interrupted_at(written, read)) from None
    return failed


def interrupted_at(written: int, read: int) -> str:
    """`12 lines written; lines 13-16 read but not written; stdin past line 16 not read`."""
    done = f"{written} line{'s' if written != 1 else ''} written"
    if read > written:
        span = f"line {read}" if read == written + 1 else f"lines {written + 1}-{read}"
        done += f"; {span} read but not written"
    return f"{done}; stdin past line {read} not read"


def emit(slot: Slot, json_out: bool, shown: Runtime | None = None) -> None:
    """Write one record (and flush) so a reader sees each answer as soon as it is ready;
    with `shown` (--verbose-prompt), its prompt's tokens first, on stderr."""
    if shown is not None and slot.ids is not None:
        show_prompt(shown, slot.ids, slot.line)
    if slot.error is not None and not json_out:
        error_line(f"line {slot.line}: {slot.error}")
    write(f"{slot.output}\n")


# --- under torchrun -------------------------------------------------------------------------


def load_on_rank(job: distributed.Job, choices: o.Choices, shards: Shards | None = None) -> Runtime:
    """The runtime on this rank's own device; only rank 0 shows notes. With `shards`
    (--tensor-parallel) only this rank's slices load, and a split every rank refuses (a
    degree, int4 groups) is said on rank 0 alone (the other ranks exit with its code,
    silently)."""
    from dllm_cli import distributed

    flag = choices.overrides.get("model.device")
    place = partial(distributed.rank_device, job, flag if isinstance(flag, str) else None)
    try:
        runtime = load_runtime(choices, place=place, quiet=job.rank != 0, shards=shards)
        if shards is not None:
            check_split(runtime, shards)
        return runtime
    except DllmError as e:  # say which rank could not load: ranks may sit on different machines
        if shards is not None and e.exit_code == USAGE:  # every rank refuses it: rank 0 says so
            if job.rank:
                raise typer.Exit(e.exit_code) from None
            raise
        raise type(e)(f"rank {job.rank}: {e}") from None


def tensor_shards(job: distributed.Job | None, degree: int, experts: bool = False) -> Shards:
    """This rank's place in --tensor-parallel N: ranks r N .. r N + N - 1 hold replica r;
    `experts`: --expert-parallel."""
    from dllm_cli.distributed.tensor import place
    from dllm_cli.models.sharding import Shards

    p = place(0 if job is None else job.rank, 1 if job is None else job.world, degree)
    shards = Shards(p.rank, p.world, p.replica, p.replicas, expert_parallel=experts)
    if job is not None:
        shards.timeout = job.collective_timeout
    return shards


def check_split(runtime: Runtime, shards: Shards) -> None:
    """NCCL between GPUs, and the split's bytes said."""
    if runtime.loaded.device.type == "cuda":
        import torch

        torch.cuda.set_device(runtime.loaded.device)  # NCCL's communicator on this rank's GPU
        shards.backend = "nccl"
    mine, whole = runtime.loaded.model.weight_bytes
    mib, scheme = 2**20, runtime.profile.model.quantize
    replica = f" (replica {shards.replica} of {shards.replicas})" if shards.replicas > 1 else ""
    held, of = "weights", f"{whole / mib:.2f} MiB"
    if scheme != "none":  # the whole model's bytes are its float ones
        dtype = str(runtime.loaded.dtype).removeprefix("torch.")
        held, of = f"{scheme} weights", f"the {of} {dtype} model"
    note(
        f"tensor parallel rank {shards.rank} of {shards.world}{replica}: {mine / mib:.2f} MiB "
        f"of {held} ({100 * mine / whole:.1f}% of {of})"
    )


def run_split(
    job: distributed.Job,
    pipeline: Pipeline,
    shards: Shards,
    shown: Runtime | None = None,
    stats: bool = False,
) -> int:
    """Every line through every rank's share of the model; rank 0 writes the records."""
    from dllm_cli import distributed

    with distributed.process_group(job), distributed.ended_by_sigterm(job.rank):
        lines = distributed.share_lines(job, sys.stdin.buffer)
        if lines is None:
            raise typer.Exit(1)  # rank 0 could not read stdin and says why
        shards.join()
        failed = 0

        def write_out(slots: list[Slot]) -> None:
            nonlocal failed
            for slot in slots:
                failed += slot.error is not None
                if job.rank == 0:
                    emit(slot, pipeline.json_out, shown)

        with progress_bar("decoding", visible=job.rank == 0) as progress:
            task = progress.add_task("decoding", total=len(lines))
            pipeline.finished = lambda slot: progress.advance(task)
            pipeline.run(enumerate(lines, start=1), write_out)
        if stats and job.rank == 0:
            note_collectives(shards)
    return failed if job.rank == 0 else 0


def run_split_prompt(
    job: distributed.Job, shards: Shards, stats: bool, decode: Callable[..., None]
) -> None:
    """One prompt through every rank's share of the model: rank 0 writes it as one process
    does (streamed on a terminal), the others `decode(shown=False)` alongside; a bad prompt,
    which every rank meets, is rank 0's to say."""
    from dllm_cli import distributed

    with distributed.process_group(job), distributed.ended_by_sigterm(job.rank):
        shards.join()
        try:
            decode(shown=job.rank == 0)
        except InputError as e:
            if job.rank:
                raise typer.Exit(e.exit_code) from None
            raise
        if stats and job.rank == 0:
            note_collectives(shards)


def note_collectives(shards: Shards) -> None:
    """--stats: rank 0's forwards and collectives."""
    c = shards.counts
    maxima = f", {c.all_reduce_max} row-peak maxima (int8)" if c.all_reduce_max else ""
    note(
        f"tensor parallel: {c.forwards} forwards, {c.all_reduce} all-reduces, "
        f"{c.all_gather} all-gathers{maxima} on rank 0"
    )


def run_sharded(
    job: distributed.Job,
    pipeline: Pipeline,
    shown: Runtime | None = None,
    shards: Shards | None = None,
) -> int:
    """This rank's share of stdin through the pipeline; rank 0 writes every rank's records. With
    `shards` the lines go to replicas: a replica's first rank reports, the others decode along."""
    from dllm_cli import distributed

    with distributed.process_group(job):
        lines = distributed.share_lines(job, sys.stdin.buffer)
        if lines is None:
            raise typer.Exit(1)  # rank 0 could not read stdin and says why
        if shards is not None:
            job = replica_job(job, shards)
            if shards.rank:
                return follow_replica(job, pipeline, lines)

        def lost(line: int, reason: str) -> Slot:
            return pipeline.lost(line, lines[line - 1], reason)

        with progress_bar("decoding", visible=job.rank == 0) as progress:
            task = progress.add_task("decoding", total=len(lines))
            try:
                outcome = distributed.run(
                    job, lines, pipeline.run,
                    emit=partial(emit, json_out=pipeline.json_out, shown=shown),
                    lost=lost, totals=pipeline.totals, advance=partial(progress.advance, task),
                    describe=describe_failure,
                )  # fmt: skip
            except distributed.Stranded as stranded:
                exit_now(stranded.cause)
        return settle(job, outcome)


def replica_job(job: distributed.Job, shards: Shards) -> distributed.Job:
    """The job over replicas: replica r is one rank of it (its lines: every R-th)."""
    from dllm_cli import distributed

    shards.join()
    return distributed.Job(shards.replica, shards.replicas, job.local_rank, job.timeout)


def follow_replica(job: distributed.Job, pipeline: Pipeline, lines: list[bytes]) -> int:
    """A replica's rank other than its first: the same lines through its share of the
    model, nothing reported (the first rank reports them); then the job's closing barrier."""
    import torch.distributed as dist

    pipeline.run(job.shard(lines), lambda slots: None)
    dist.barrier()
    return 0


def describe_failure(e: BaseException) -> tuple[str, int]:
    """A rank's error as its report carries it (--debug: the traceback first, on stderr)."""
    if is_debug():
        traceback.print_exc()
    return describe_error(e)


def settle(job: distributed.Job, outcome: distributed.Outcome) -> int:
    """Say on stderr how the ranks ended; exit with the lowest failed rank's code, if any."""
    if outcome.failure is not None:
        error_line(f"rank {job.rank}: {outcome.failure.message}")
    if outcome.lost is not None:
        error_line(f"rank {job.rank}: lost rank 0: {outcome.lost}")
        raise typer.Exit(outcome.failure.code if outcome.failure else 1)
    if outcome.failure is not None:
        raise typer.Exit(outcome.failure.code)
    for rank, (failure, held) in sorted(outcome.stopped.items()):
        error_line(f"rank {rank} failed: {failure.message}; {lines_text(held)} not decoded")
    if outcome.stopped:
        raise typer.Exit(min(outcome.stopped.items())[1][0].code)
    return outcome.failed


def lines_text(held: list[int]) -> str:
    """`line 8`, `lines 3, 6, 9` or the first ten and a count."""
    if not held:
        return "no lines left"
    shown = ", ".join(map(str, held[:_SHOWN_LINES]))
    more = f", ... ({len(held)} lines)" if len(held) > _SHOWN_LINES else ""
    return f"line{'s' if len(held) > 1 else ''} {shown}{more}"
