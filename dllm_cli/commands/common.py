"""What every command shares: turning errors into one stderr line and an exit code.

Exit codes (the table in docs/usage.md): 0 ok; 1 the run failed after it started (an output file not
written); 2 usage, profile or setting error, an unwritable output path (2 as click uses);
3 model cannot be loaded; 4 bad input (a prompt; in batch mode: some line failed);
5 device not on this machine; 70 internal error (a bug); 130 interrupted (Ctrl-C); 141 stdout
closed by its reader.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from dllm_cli.errors import DllmError, UsageError
from dllm_cli.options import Choices

if TYPE_CHECKING:  # torch and the models load only when a command decodes (cli.py)
    from dllm_cli.models.sharding import Shards
    from dllm_cli.runtime import Runtime

stderr = Console(stderr=True, highlight=False, soft_wrap=True)

USAGE = 2
INTERRUPTED = 130
INTERNAL = 70
BROKEN_PIPE = 141  # as a shell reports a process killed by SIGPIPE


_debug = False


def set_debug(on: bool) -> None:
    """Called by the root command for every invocation."""
    global _debug
    _debug = on


def is_debug() -> bool:
    """--debug was given to the app: show tracebacks instead of one-line errors (a module flag
    set on every invocation: typer >= 0.2x vendors click and exposes no get_current_context)."""
    return _debug


def error_line(message: str) -> None:
    """`dllm: error: ...` on stderr (message text is never read as markup)."""
    stderr.print(Text.assemble(("dllm: error:", "bold red"), " ", message), highlight=False)


def fail(message: str, code: int) -> typer.Exit:
    """Print `dllm: error: ...` on stderr and return the Exit to raise."""
    error_line(message)
    return typer.Exit(code)


def note(message: str) -> None:
    """A diagnostic on stderr that does not stop the command."""
    stderr.print(Text.assemble(("dllm: note:", "dim"), " ", message), highlight=False)


# Control characters a model may emit (a random checkpoint's byte tokens: NUL, ESC, ...) that
# would corrupt a terminal or a text pipe; newline and tab are text.
CONTROLS = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)] if c not in (9, 10)}


def write(text: str) -> None:
    """Results on stdout, flushed at once (a reader downstream sees each as it comes); control
    characters are written as `\\xNN` escapes."""
    if text:
        sys.stdout.write(text.translate(CONTROLS))
        sys.stdout.flush()


def check_output(path: Path | None, flag: str) -> None:
    """Refuse an output file that cannot be written before any model loads or decodes (a
    usage error, exit 2), not after a long run."""
    if path is None:
        return
    folder = path.parent
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a folder, not a file")
    if not folder.is_dir():
        raise UsageError(f"{flag} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{flag} {path}: not writable")


def show_prompt(runtime: Runtime, ids: list[int], line: int | None = None) -> None:
    """--verbose-prompt: the prompt as the model sees it, one token per line, on stderr, each
    as a Python string literal (spaces and unprintables visible, nothing drives the terminal)."""
    where = "prompt" if line is None else f"prompt of line {line}"
    stderr.print(Text(f"dllm: {where}: {len(ids)} tokens"), highlight=False)
    width = len(str(max(ids, default=0)))
    for token, piece in zip(ids, runtime.pieces(ids), strict=True):
        stderr.print(Text(f"  {token:>{width}}  {piece!r}"), highlight=False)


def stdin_is_terminal() -> bool:
    return sys.stdin is None or sys.stdin.isatty()


def stdout_is_terminal() -> bool:
    return sys.stdout.isatty()


def stderr_is_terminal() -> bool:
    return sys.stderr.isatty()


def progress_bar(label: str, visible: bool = True) -> Progress:
    """A transient bar on stderr (a terminal only, not on another rank; gone when done). It must
    not redirect stdout (Rich's default): records meant for a file or a pipe were drawn instead."""
    return Progress(
        TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=stderr, disable=not (visible and stderr_is_terminal()), transient=True,
        redirect_stdout=False,
    )  # fmt: skip


def open_runtime(*args, **kwargs) -> Runtime:
    """`runtime.open_runtime`, imported on first use (it brings in torch and the models)."""
    from dllm_cli.runtime import open_runtime as opened

    return opened(*args, **kwargs)


def load_runtime(
    choices: Choices,
    *,
    place: Callable[[str], str] | None = None,
    quiet: bool = False,
    slots: int = 1,
    shards: Shards | None = None,
) -> Runtime:
    """open_runtime for the shared flags, with a spinner on a terminal; notes go to stderr.

    A --model replaces the profile's model, so the profile's guide (sharing its tokenizer) is
    left out unless --guide asks for it. `quiet`: no spinner, no notes (torchrun's other ranks);
    `slots`: rows decoded at once (the fit check sizes the KV cache); `shards`: --tensor-parallel.
    """
    guide, overrides = choices.guide, choices.overrides
    swapped = "model.path" in overrides and guide is None
    use_guide = guide is True or (guide is None and not swapped)
    show = not quiet and stderr_is_terminal()
    with stderr.status("loading model...") if show else nullcontext():
        runtime = open_runtime(
            choices.profile, overrides, use_guide=use_guide, require_guide=guide is True,
            place=place, slots=slots, force=choices.force, shards=shards,
        )  # fmt: skip
    if quiet:
        return runtime
    if swapped and runtime.profile.guide is not None:
        note("--model given: decoding without the profile's guide (add --guide to use it)")
    for line in runtime.notes:
        note(line)
    return runtime


@contextmanager
def cli_errors() -> Iterator[None]:
    """Library errors -> one clear line + exit code; --debug shows the traceback instead."""
    try:
        yield
    except (typer.Exit, typer.Abort):
        raise
    except KeyboardInterrupt as e:  # batch mode says how far it got (generate_runs.interrupted_at)
        stderr.print(Text(f"dllm: interrupted: {e}" if str(e) else "dllm: interrupted"))
        raise typer.Exit(INTERRUPTED) from None
    except BrokenPipeError:  # stdout's reader left (`dllm generate - | head`): stop quietly
        with suppress(OSError, ValueError):  # no flush error at exit (stdout may be no file)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(BROKEN_PIPE) from None
    except Exception as e:  # ours (DllmError) or a bug: one line unless --debug
        if is_debug():
            traceback.print_exc(file=sys.stderr)
        message, code = describe_error(e)
        bug = "" if isinstance(e, DllmError) else " (rerun with --debug for the traceback)"
        raise fail(message + bug, code) from None


def describe_error(e: BaseException) -> tuple[str, int]:
    """The one-line message and exit code cli_errors gives `e`, for a rank reporting to rank 0."""
    if isinstance(e, DllmError):
        return str(e), e.exit_code
    if isinstance(e, KeyboardInterrupt):
        return "interrupted", INTERRUPTED
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"internal error: {type(e).__name__}: {first}", INTERNAL


def exit_now(e: BaseException) -> NoReturn:
    """Exit with the line and code cli_errors gives `e`, skipping the interpreter's shutdown
    (torchrun's rank 0 whose listener thread still waits inside gloo: a normal shutdown under
    it aborts with SIGABRT)."""
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


PIPED_WIDTH = 400  # columns a piped table (profiles show, list) may use: wide enough for any row


def page_console() -> Console:
    """A terminal's width; piped (no COLUMNS set) the table's own, never 80 columns of cells
    folded into fragments."""
    out = Console(highlight=False)
    if out.is_terminal or "COLUMNS" in os.environ:
        return out
    return Console(highlight=False, width=PIPED_WIDTH)
