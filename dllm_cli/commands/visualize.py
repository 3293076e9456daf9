"""`dllm visualize`: watch the canvas fill in, live on stderr, while the real decoder runs."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.live import Live

from dllm_cli import options as o
from dllm_cli.commands.common import (
    check_output,
    cli_errors,
    load_runtime,
    note,
    show_prompt,
    stderr,
    stderr_is_terminal,
    write,
)
from dllm_cli.errors import SettingsError
from dllm_cli.prompt_text import from_argv

if TYPE_CHECKING:  # torch and the models: imported by the command (cli.py)
    from dllm_cli.decoding import DecodeRun, StepEvent
    from dllm_cli.view import CanvasView
    from dllm_cli.view_export import Recorder

view = o.in_panel("View")
Delay = Annotated[float, view("Seconds to pause after each step, to watch it.")]
Replay = Annotated[bool, view("Decode first, then play the recorded steps.", "--replay")]
Save = Annotated[
    Path | None,
    view(
        "Write FILE.svg (the final frame) or FILE.html (a step-by-step player; offline).",
        dir_okay=False,
    ),
]
Width = Annotated[int, view("Width of the --save export in columns.", min=40)]


@o.shared("model", "decode", "guide")
def visualize_command(
    prompt: Annotated[str, typer.Argument(help="The prompt to decode.", show_default=False)],
    *,
    choices: o.Choices,
    delay: Delay = 0.0,
    replay: Replay = False,
    save: Save = None,
    width: Width = 120,
    verbose_prompt: o.VerbosePrompt = False,
) -> None:
    """Decode PROMPT showing every step: masks, commits by step and confidence, blocks, caches."""
    with cli_errors():
        from dllm_cli.decoding import decode_steps
        from dllm_cli.view import CanvasView, check_save_path
        from dllm_cli.view_export import Recorder, run_headline, run_settings

        if delay < 0:
            raise SettingsError(f"--delay must be >= 0 (got {delay})")
        if save is not None:
            check_save_path(save)
            check_output(save, "--save")
        runtime = load_runtime(choices)
        text = from_argv(prompt)
        ids = runtime.prepare(text)
        if verbose_prompt:
            show_prompt(runtime, ids)
        model, special = runtime.loaded.model, runtime.loaded.special
        run = decode_steps(model, special, [ids], runtime.settings, committer=runtime.committer())
        view = CanvasView.for_runtime(runtime)
        recorder = None
        if save is not None:
            recorder = Recorder(save, width, text, run_settings(runtime), run_headline(runtime))
        steps_seen = recorded(run) if replay else timed(run)
        with drawn(view) as redraw:
            for event, seconds in steps_seen:
                show(view, event, seconds, recorder, delay)
                redraw()
            result = run.result()
            view.finish(result)
        answer = runtime.text(result.tokens[0])
        if recorder is not None:
            saved(recorder, view, answer)
        write(answer + "\n")


@contextmanager
def drawn(view: CanvasView) -> Iterator[Callable[[], None]]:
    """`redraw()` shows the view on stderr: in place on a terminal (drawn once more at the
    end), else one summary line per call (`visualize`, `chat --visual`)."""
    if not stderr_is_terminal():
        yield lambda: stderr.print(view.summary(), highlight=False)
        return
    screen = Console(stderr=True, highlight=False)  # its own: `stderr` soft-wraps, Live wraps
    with Live(view.render(), console=screen, auto_refresh=False) as live:
        yield lambda: live.update(view.render(), refresh=True)
        live.update(view.render(), refresh=True)


def saved(recorder: Recorder, view: CanvasView, answer: str) -> None:
    """Write the --save file and say on stderr where it went and what it holds."""
    path = recorder.save(view, answer).resolve()
    if recorder.html:
        steps = len(recorder.frames) - 1
        note(f"wrote {path}: a player of {steps} steps (open it in a browser; works offline)")
    else:
        note(f"wrote {path}: the final frame")


def timed(run: DecodeRun) -> Iterator[tuple[StepEvent, float]]:
    """Each event as the decoder yields it, with decoding time so far."""
    for event in run:
        yield event, run.seconds


def recorded(run: DecodeRun) -> Iterable[tuple[StepEvent, float]]:
    """Run the decode to the end first (a spinner meanwhile), then hand back its events."""
    terminal = stderr_is_terminal()
    with stderr.status("decoding (replay follows)...") if terminal else nullcontext():
        return list(timed(run))


def show(
    view: CanvasView, event: StepEvent, seconds: float, recorder: Recorder | None, delay: float
) -> None:
    """Advance the view one step, keep the frame for --save, pause for --delay."""
    view.update(event, seconds)
    if recorder is not None:
        recorder.frame(view)
    if delay > 0:
        time.sleep(delay)
