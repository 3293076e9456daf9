"""`dllm generate`: prompts in (an argument, or stdin lines), answers out on stdout, nothing else.

Batch mode (prompt "-" or omitted with stdin piped): one prompt per line, or with --json-input
one JSON object per line with a "prompt" field. Valid lines are decoded --batch-size at a time;
output i always answers input line i and is written as soon as it and all before it are done.
A bad line gets an error record instead of sinking its batch: with --json a
{"line", "prompt", "error"} object; in text mode an empty stdout line plus `dllm: error: line
N: ...` on stderr. Text mode writes each answer on one line (newlines as \\n, backslashes as
\\\\); use --json for the exact text. The exit code is 4 when any line failed.
Under torchrun the same pipeline runs on each rank's share of the lines (dllm_cli/distributed.py).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dllm_cli import distributed
from dllm_cli import options as o
from dllm_cli.commands.common import (
    USAGE,
    Totals,
    cli_errors,
    error_line,
    fail,
    load_runtime,
    note,
    stderr,
    stderr_is_terminal,
    stdin_is_terminal,
    stdout_is_terminal,
    write,
)
from dllm_cli.decoding import DecodeResult, decode, decode_steps
from dllm_cli.errors import DllmError, InputError
from dllm_cli.runtime import Runtime
from dllm_cli.view import TextStream

INPUT = "Input"
BatchSize = Annotated[
    int,
    typer.Option(min=1, help="Prompts decoded together in batch mode.", rich_help_panel=INPUT),
]
JsonInput = Annotated[
    bool,
    typer.Option(
        "--json-input",
        help='Batch mode: each stdin line is a JSON object with a "prompt" field.',
        rich_help_panel=INPUT,
    ),
]
Prompt = Annotated[
    str | None,
    typer.Argument(
        help="The prompt. '-' (or none, with stdin piped) reads one prompt per stdin line.",
        show_default=False,
    ),
]


def generate_command(
    prompt: Prompt = None,
    profile: o.Profile = None,
    model: o.ModelPath = None,
    device: o.Device = None,
    dtype: o.Dtype = None,
    gen_length: o.GenLength = None,
    block_length: o.BlockLength = None,
    steps: o.Steps = None,
    cache: o.Cache = None,
    unmask: o.Unmask = None,
    confidence: o.Confidence = None,
    threshold: o.Threshold = None,
    factor: o.Factor = None,
    temperature: o.Temperature = None,
    top_p: o.TopP = None,
    top_k: o.TopK = None,
    cfg_scale: o.CfgScale = None,
    seed: o.Seed = None,
    early_stop: o.EarlyStop = None,
    chat: o.Chat = None,
    compile: o.Compile = None,
    guide: o.Guide = None,
    stats: o.Stats = False,
    json_out: o.Json = False,
    batch_size: BatchSize = 8,
    json_input: JsonInput = False,
) -> None:
    """Generate an answer to PROMPT (or to every line of stdin) and print it on stdout.

    Batch mode ('-', or no PROMPT with stdin piped): output line N answers input line N. A bad
    line gets an error record (--json: {"line", "prompt", "error"}; text: an empty line, the
    reason on stderr) and the exit code is 4 at the end. Text mode writes newlines inside an
    answer as \\n; --json keeps the exact text.
    """
    with cli_errors():
        job = distributed.Job.from_env()
        leader = job is None or job.rank == 0  # the process that reads stdin and writes stdout
        batch = prompt is None or prompt == "-"
        if job is not None and not batch:
            raise fail("under torchrun, prompts come from stdin: give '-' and pipe them", USAGE)
        if batch and leader and stdin_is_terminal():
            raise fail(
                "no prompt: give one as an argument, or pipe prompts on stdin (one per line)",
                USAGE,
            )
        if json_input and not batch:
            raise fail("--json-input reads prompts from stdin: give '-' instead of a prompt", USAGE)
        flags = o.overrides(
            model=model, device=device, dtype=dtype, chat=chat, gen_length=gen_length,
            block_length=block_length, steps=steps, cache=cache, unmask=unmask,
            confidence=confidence, threshold=threshold, factor=factor, temperature=temperature,
            top_p=top_p, top_k=top_k, cfg_scale=cfg_scale, seed=seed, early_stop=early_stop,
            compile=compile,
        )  # fmt: skip
        if job is None:
            runtime = load_runtime(profile, flags, guide)
        else:
            runtime = distributed.load_runtime(job, profile, flags, guide)
        totals = Totals()
        if job is not None:
            failed = run_sharded(job, runtime, batch_size, json_out, json_input, totals)
        elif batch:
            failed = run_batch(runtime, sys.stdin, batch_size, json_out, json_input, totals)
        else:
            failed = 0
            run_single(runtime, prompt, json_out, totals)
        if stats and leader:
            note(totals.line())
        if failed:
            raise fail(
                f"{failed} of {totals.prompts + failed} prompts failed", InputError.exit_code
            )


# --- one prompt ---------------------------------------------------------------------------


def run_single(runtime: Runtime, prompt: str, json_out: bool, totals: Totals) -> None:
    """Decode one prompt; on a terminal, print text as soon as its prefix is final."""
    try:
        ids = runtime.prepare(prompt)
    except InputError as e:
        if json_out:  # the record says what failed; the error line and exit code follow
            write(json.dumps({"prompt": prompt, "error": str(e)}) + "\n")
        raise
    run = decode_steps(runtime.loaded, [ids], runtime.settings, committer=runtime.committer())
    stream = None
    if stdout_is_terminal() and not json_out:
        stream = TextStream(runtime.settings.gen_length, runtime.text)
    for event in run:
        if stream is not None:
            write(stream.feed(event))
    result = run.result()
    text = runtime.text(result.tokens[0])
    totals.add(runtime, result)
    if json_out:
        write(json.dumps(record(prompt, text, result, 0)) + "\n")
    elif stream is not None:
        write(stream.finish(text))
    else:
        write(text + "\n")


# --- stdin batches ------------------------------------------------------------------------


@dataclass
class Slot:
    """One input line on its way to one output record."""

    line: int
    prompt: str
    ids: list[int] | None = None
    error: str | None = None
    output: str | None = None


def run_batch(
    runtime: Runtime,
    lines: Iterable[str],
    batch_size: int,
    json_out: bool,
    json_input: bool,
    totals: Totals,
) -> int:
    """Decode stdin lines in batches; returns how many lines failed."""
    failed = 0

    def numbered() -> Iterable[tuple[int, str]]:
        for number, raw in enumerate(lines, start=1):
            progress.update(task, total=number)
            yield number, raw

    def write_out(slots: list[Slot]) -> None:
        nonlocal failed
        for slot in slots:
            failed += slot.error is not None
            emit(slot, json_out)
            progress.advance(task)

    with decoding_progress() as progress:
        task = progress.add_task("decoding", total=None)
        decode_lines(runtime, numbered(), batch_size, json_out, json_input, totals, write_out)
    return failed


def run_sharded(
    job: distributed.Job,
    runtime: Runtime,
    batch_size: int,
    json_out: bool,
    json_input: bool,
    totals: Totals,
) -> int:
    """Batch mode under torchrun: this rank's share of the lines, through the same pipeline."""
    with distributed.process_group(job):
        lines = distributed.share_lines(job, sys.stdin)

        def work(shard: Iterable[tuple[int, str]], done: Callable[[list[Slot]], None]) -> None:
            decode_lines(runtime, shard, batch_size, json_out, json_input, totals, done)

        def lost(line: int, reason: str) -> Slot:  # prompt as the line's own record has it
            return Slot(
                line, read_slot(runtime, line, lines[line - 1], json_input).prompt, error=reason
            )

        with decoding_progress(visible=job.rank == 0) as progress:
            task = progress.add_task("decoding", total=len(lines))
            advance = partial(progress.advance, task)
            return distributed.run(
                job, lines, work, partial(emit, json_out=json_out), lost, totals, advance
            )


def decoding_progress(visible: bool = True) -> Progress:
    """The batch progress bar on stderr (a terminal only; gone when done)."""
    return Progress(
        TextColumn("decoding"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=stderr, disable=not (visible and stderr_is_terminal()), transient=True,
    )  # fmt: skip


def decode_lines(
    runtime: Runtime,
    numbered: Iterable[tuple[int, str]],
    batch_size: int,
    json_out: bool,
    json_input: bool,
    totals: Totals,
    done: Callable[[list[Slot]], None],
) -> None:
    """The batch pipeline: check each (number, line), decode valid ones batch_size at a time,
    and hand finished slots to `done` in order, each once it and all before it are finished."""
    pending: list[Slot] = []  # read, not yet handed on (input order)
    batch: list[Slot] = []  # valid, not yet decoded

    def flush() -> None:
        finished = []
        while pending and (pending[0].output is not None or pending[0].error is not None):
            finished.append(pending.pop(0))
        if finished:
            done(finished)

    for number, raw in numbered:
        slot = read_slot(runtime, number, raw, json_input)
        pending.append(slot)
        if slot.error is None:
            batch.append(slot)
        if len(batch) == batch_size:
            decode_batch(runtime, batch, json_out, totals)
            batch = []
        flush()
    if batch:
        decode_batch(runtime, batch, json_out, totals)
    flush()


def read_slot(runtime: Runtime, number: int, raw: str, json_input: bool) -> Slot:
    """Parse and encode one input line; any problem becomes the slot's error."""
    text = raw.rstrip("\r\n")
    slot = Slot(number, text)
    try:
        if json_input:
            slot.prompt = prompt_from_json(text)
        slot.ids = runtime.prepare(slot.prompt)
    except DllmError as e:
        slot.error = str(e)
    return slot


def prompt_from_json(text: str) -> str:
    """The "prompt" string of a JSON-lines input."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"not a JSON object: {e.msg}") from None
    if not isinstance(data, dict) or not isinstance(data.get("prompt"), str):
        raise InputError('expected a JSON object with a string "prompt" field')
    return data["prompt"]


def decode_batch(runtime: Runtime, batch: list[Slot], json_out: bool, totals: Totals) -> None:
    """Decode valid slots together; an input error the checks missed fails just this batch."""
    try:
        result = decode(
            runtime.loaded, [s.ids for s in batch], runtime.settings, committer=runtime.committer()
        )
    except InputError as e:
        for slot in batch:
            slot.error = str(e)
        return
    totals.add(runtime, result)
    for row, slot in enumerate(batch):
        text = runtime.text(result.tokens[row])
        if json_out:
            slot.output = json.dumps({"line": slot.line, **record(slot.prompt, text, result, row)})
        else:
            slot.output = one_line(text)


def emit(slot: Slot, json_out: bool) -> None:
    """Write one record (and flush) so a reader sees each answer as soon as it is ready."""
    if slot.error is not None:
        if json_out:
            write(json.dumps({"line": slot.line, "prompt": slot.prompt, "error": slot.error}))
        else:
            error_line(f"line {slot.line}: {slot.error}")
        write("\n")
    else:
        write(f"{slot.output}\n")


# --- output -------------------------------------------------------------------------------


def record(prompt: str, text: str, result: DecodeResult, row: int) -> dict:
    """The --json object for one answer (forwards/steps/seconds are its batch's)."""
    return {
        "prompt": prompt,
        "text": text,
        "token_ids": result.tokens[row],
        "forwards": result.forwards,
        "steps": result.steps,
        "seconds": round(result.seconds, 4),
    }


def one_line(text: str) -> str:
    """Text-mode batch output: one line per answer, reversibly escaped."""
    return text.replace("\\", "\\\\").replace("\r", "\\r").replace("\n", "\\n")
