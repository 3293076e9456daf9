"""What every command shares: turning errors into one stderr line and an exit code."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console

from dllm_cli.errors import DllmError

stderr = Console(stderr=True, highlight=False, soft_wrap=True)

INTERRUPTED = 130
INTERNAL = 70


def is_debug() -> bool:
    """--debug was given to the app (the root command stores it in the click context)."""
    ctx = typer.get_current_context(silent=True)
    while ctx is not None:
        if isinstance(ctx.obj, dict) and ctx.obj.get("debug"):
            return True
        ctx = ctx.parent
    return False


def fail(message: str, code: int) -> typer.Exit:
    """Print `dllm: error: ...` on stderr and return the Exit to raise."""
    stderr.print(f"[bold red]dllm: error:[/] {message}", markup=True, highlight=False)
    return typer.Exit(code)


@contextmanager
def cli_errors() -> Iterator[None]:
    """Library errors -> one clear line + exit code; --debug shows the traceback instead."""
    try:
        yield
    except (typer.Exit, typer.Abort):
        raise
    except DllmError as e:
        if is_debug():
            traceback.print_exc(file=sys.stderr)
        raise fail(str(e), e.exit_code) from None
    except KeyboardInterrupt:
        stderr.print("dllm: interrupted")
        raise typer.Exit(INTERRUPTED) from None
    except Exception as e:  # a bug of ours: still one line unless --debug
        if is_debug():
            traceback.print_exc(file=sys.stderr)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise fail(
            f"internal error: {type(e).__name__}: {first} (rerun with --debug for the traceback)",
            INTERNAL,
        ) from None
