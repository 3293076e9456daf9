"""One doctor run: environment, correctness on tiny folders, speed at real shapes, in a budget.

Checks run in order of what they prove per second (tiny correctness first, the long baseline
decode last), each inside `attempt` (an exception is an error row, the run goes on) and each
asking the deadline first. A watchdog stops the process `GRACE` seconds past the budget, for a
GPU call that never returns; the report written after the last finished check stays.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from collections.abc import Callable
from contextlib import suppress
from functools import partial
from pathlib import Path

import torch

from dllm_cli.doctor import correctness, multi_gpu, speed
from dllm_cli.doctor.checks import Check, Deadline, Outcome, attempt
from dllm_cli.doctor.env import environment
from dllm_cli.doctor.fixtures import make_fixtures
from dllm_cli.doctor.report import Report
from dllm_cli.errors import InputError

GRACE = 30.0  # seconds past the budget before the watchdog ends the process
WATCHDOG_EXIT = 124  # as timeout(1) exits
CPU_SHAPE = "small"


def check_shapes(names: list[str]) -> list[speed.Shape]:
    unknown = [n for n in names if n not in speed.SHAPES]
    if unknown:
        known = ", ".join(speed.SHAPES)
        raise InputError(f"--shapes: unknown shape {unknown[0]!r} (known: {known})")
    return [speed.SHAPES[n] for n in names]


def why_cpu(gpu: bool) -> str | None:
    """Why the device under test is the CPU (None: it is CUDA)."""
    if not gpu:
        return "--gpu not given"
    return None if torch.cuda.is_available() else "no CUDA device"


class Doctor:
    """The run's device, deadline and report; `add` runs one check into the report."""

    def __init__(self, out: Path, gpu: bool, budget: float, on_check: Callable[[Check], None]):
        self.cpu_reason = why_cpu(gpu)
        self.target = "cpu" if self.cpu_reason else "cuda"
        self.device = torch.device(self.target)
        self.deadline = Deadline(budget)
        self.report = Report(out, self.target, budget)
        self.on_check = on_check

    def add(self, section: str, name: str, run: Callable[[], Outcome]) -> Check:
        check = attempt(section, name, run, self.deadline, after=self.tidy)
        self.report.add(check, self.deadline.elapsed())
        self.on_check(check)
        return check

    def tidy(self, error: type) -> None:
        """After a check raised: free what the GPU still caches (an out-of-memory error)."""
        with suppress(Exception):  # a broken CUDA context: the next check reports it
            speed.release(self.device)

    def skip(self, section: str, name: str, why: str) -> None:
        self.add(section, name, lambda: Outcome("skip", why))

    # --- sections ---------------------------------------------------------------------
    def correctness(self) -> None:
        undo = correctness.exact_matmuls()
        try:
            with tempfile.TemporaryDirectory(prefix="dllm-doctor-") as tmp:
                made: dict = {}
                self.add("correctness", "tiny folders", partial(self._fixtures, Path(tmp), made))
                for title, check in correctness.CHECKS.items():
                    for kind, fx in made.items():
                        name = f"{title} ({kind})"
                        self.add("correctness", name, partial(check, fx, self.target))
        finally:
            undo()

    def _fixtures(self, root: Path, made: dict) -> Outcome:
        made |= make_fixtures(root)
        kinds = ", ".join(made)
        return Outcome("pass", f"wrote and loaded tiny random float32 folders: {kinds} + guides")

    def speed(self, shapes: list[speed.Shape]) -> None:
        if self.cpu_reason:
            for shape in shapes:
                why = f"{self.cpu_reason}: timed the CPU-sized {CPU_SHAPE!r} shape instead"
                self.skip("speed", f"{shape.name}: all", why)
            shapes = [speed.SHAPES[CPU_SHAPE]]
        for shape in shapes:
            self.time_shape(shape)

    def several_gpus(self) -> None:
        """Tensor parallelism over NCCL on 1, 2 and 4 GPUs, or one skip row (multi_gpu.py)."""
        gpus = torch.cuda.device_count()
        why = multi_gpu.skipped(gpus, self.cpu_reason)
        if why is not None:
            return self.skip("multi-GPU", "tensor parallel", why)
        with tempfile.TemporaryDirectory(prefix="dllm-doctor-") as tmp:
            root = Path(tmp)
            self.add("multi-GPU", "tokens == one GPU", partial(multi_gpu.tokens_check, root, gpus))
            self.add("multi-GPU", "seconds per step", partial(multi_gpu.speed_check, root, gpus))

    def time_shape(self, shape: speed.Shape) -> None:
        """Build the shape's model, time every variant, then free it for the next shape."""
        held: dict = {}

        def make() -> Outcome:
            held["model"] = speed.build(shape, self.device)
            gib = sum(p.numel() * p.element_size() for p in held["model"].parameters()) / 2**30
            return Outcome("info", f"random {shape.dtype} weights on {self.target}: {gib:.2f} GiB")

        self.add("speed", f"{shape.name}: build", make)
        if "model" in held:
            for name, run in timings(shape, held["model"], self.device, self.deadline):
                self.add("speed", f"{shape.name}: {name}", run)
        held.clear()
        speed.release(self.device)


def timings(shape: speed.Shape, model, device, deadline):
    """(name, check) of every speed measurement of one built model, in run order."""
    at = (device, deadline)
    for gen, v in speed.plan(shape):
        yield f"gen {gen} {v.name}", partial(speed.time_variant, model, shape, v, gen, *at)
    yield (
        f"{shape.slots} slots static vs continuous",
        partial(speed.time_batching, model, shape, *at),
    )
    yield "kernel share", partial(speed.profile_steps, model, shape, device)


def run_doctor(
    out: Path,
    *,
    gpu: bool,
    budget: float,
    shapes: list[str],
    on_check: Callable[[Check], None] = lambda c: None,
    command: str = "",
) -> Report:
    """Every check into `out`/doctor.md and doctor.json; returns the report."""
    wanted = check_shapes(shapes)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"cannot create the report folder {out}: {e.strerror or e}") from None
    doc = Doctor(out, gpu, budget, on_check)
    doc.report.environment = environment() | {"device_under_test": doc.target}
    if command:
        doc.report.environment["command"] = command
    if doc.cpu_reason:
        doc.report.environment["why_cpu"] = doc.cpu_reason
    doc.report.write()
    stop = watchdog(doc, budget + GRACE)
    try:
        doc.correctness()
        doc.speed(wanted)
        doc.several_gpus()
    finally:
        stop.cancel()
    return doc.report


def watchdog(doc: Doctor, seconds: float) -> threading.Timer:
    """End the process when a check hangs past the budget (the report so far is kept)."""

    def fire() -> None:
        late = Check("run", "watchdog", "error", f"still running {seconds:.0f} s in: stopped")
        try:
            doc.report.add(late, doc.deadline.elapsed())
        finally:
            said = f"dllm: error: doctor stopped by its watchdog after {seconds:.0f} s"
            print(said, file=sys.stderr)
            os._exit(WATCHDOG_EXIT)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer
