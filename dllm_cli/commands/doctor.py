"""`dllm doctor`: check and measure the device path, into a Markdown report and a JSON file.

Imports are light on purpose (no torch at import time): the library is imported inside the
command, so `dllm --help` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from dllm_cli.options import in_panel

option = in_panel(None)  # the default Options panel
DEFAULT_BUDGET = 420.0  # seconds; with the watchdog's grace, under the 8 minutes of a lent GPU


def doctor_command(
    gpu: Annotated[
        bool,
        option(
            "Check CUDA: the device against the CPU, CUDA graphs, bfloat16, speed at "
            "LLaDA-8B's shape. Without a CUDA device, runs the CPU-sized parts and lists the "
            "skipped checks.",
            "--gpu",
        ),
    ] = False,
    out: Annotated[
        Path, option("Folder for doctor.md and doctor.json (created if missing).", "--out", "-o")
    ] = Path("dllm-doctor"),
    budget: Annotated[
        float, option("Seconds for the whole run; checks not started by then are skipped.", min=1)
    ] = DEFAULT_BUDGET,
    shapes: Annotated[
        str, option("Comma-separated model shapes to time on CUDA: llada-8b, dream-7b, small.")
    ] = "llada-8b",
) -> None:
    """Prove and measure the device path: tiny folders decoded on the device, speed at 8B shape."""
    from dllm_cli.commands.common import cli_errors, fail, stderr

    with cli_errors():
        from dllm_cli.doctor.report import JSON_NAME, MARKDOWN_NAME
        from dllm_cli.doctor.run import run_doctor

        def progress(check) -> None:
            said = f"[{check.status}] {check.section}: {check.name} ({check.seconds:.1f} s)"
            stderr.print(f"dllm: doctor: {said}: {check.detail}", highlight=False, markup=False)

        names = [s.strip() for s in shapes.split(",") if s.strip()]
        flag = " --gpu" if gpu else ""
        command = f"dllm doctor{flag} --out {out} --budget {budget:g} --shapes {','.join(names)}"
        report = run_doctor(
            out, gpu=gpu, budget=budget, shapes=names, on_check=progress, command=command
        )
        counts = report.counts()
        summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        print(f"{summary}; report: {out / MARKDOWN_NAME}, {out / JSON_NAME}")
    bad = counts["fail"] + counts["error"]
    if bad:
        raise fail(f"doctor: {bad} check(s) failed or raised (see {out / MARKDOWN_NAME})", 1)
