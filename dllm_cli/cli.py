"""The `dllm` command: a thin Typer app wiring one module per subcommand.

Start-up stays light: `dllm --help`, `--version`, `dllm profiles` and usage errors answer
without importing torch, transformers or the model code (tests/test_cli_startup.py). So a
command module imports only typer, rich, `options` and the light `dllm_cli` modules at its top;
torch, transformers, `runtime`, `decoding`, `models`, `batch`, `view` and the like are imported
inside the command function (or the helpers it calls), and type hints of them go under
`if TYPE_CHECKING:`. Keep it so when adding a command (serve, chat, doctor, ...).
"""

from __future__ import annotations

import sys
from contextlib import suppress
from typing import Annotated

import typer
from typer.core import TyperGroup

from dllm_cli import __version__
from dllm_cli.commands.bench import bench_command
from dllm_cli.commands.chat import chat_command
from dllm_cli.commands.common import INTERRUPTED, USAGE, error_line, set_debug, stderr
from dllm_cli.commands.doctor import doctor_command
from dllm_cli.commands.eval import eval_command
from dllm_cli.commands.generate import generate_command
from dllm_cli.commands.models import list_command, pull_command, rm_command
from dllm_cli.commands.profiles import profiles_app
from dllm_cli.commands.serve import serve_command
from dllm_cli.commands.visualize import visualize_command
from dllm_cli.families import FAMILIES
from dllm_cli.omp import spin_briefly


class OneLineErrors(TyperGroup):
    """Click's usage errors (a bad value for a typed option, a misspelt option, a missing
    argument) as one `dllm: error:` line and exit code 2, as every other usage error, instead
    of Typer's boxed panel; `dllm` alone still prints the help."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except typer.TyperException as e:  # click's UsageError, BadParameter, NoSuchOption
            sys.exit(show_usage_error(e))
        except typer.Abort:
            stderr.print("dllm: interrupted")
            sys.exit(INTERRUPTED)
        sys.exit(code if isinstance(code, int) else 0)


def show_usage_error(e: typer.TyperException) -> int:
    """Print a click error as one line (`dllm` with no arguments: the help); its exit code."""
    if type(e).__name__ == "NoArgsIsHelpError":  # `dllm` alone: the help is already printed
        return e.exit_code  # (matched by name, as Typer's own handler does: a private class)
    ctx = getattr(e, "ctx", None)
    text = " ".join(e.format_message().split())
    hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
    error_line(f"{text}{hint}")
    return e.exit_code if e.exit_code else USAGE


FAMILY_TITLES = [f.title for f in FAMILIES.values()]

app = typer.Typer(
    cls=OneLineErrors,
    name="dllm",
    help=f"Fast decoding for diffusion language models ({', '.join(FAMILY_TITLES)}).",
    epilog="Exit codes: 0 ok, 1 failed after it started (an output not written), 2 usage "
    "(flags, profile, settings, output paths), 3 model cannot load, 4 bad input (or some stdin "
    "line failed), 5 device not on this machine, 70 internal, 130 Ctrl-C, 141 stdout closed.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"dllm {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    debug: Annotated[
        bool, typer.Option("--debug", help="Show tracebacks instead of one-line errors.")
    ] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version."
        ),
    ] = False,
) -> None:
    """Fast decoding for diffusion language models (every family in families.py)."""
    set_debug(debug)


app.command("generate")(generate_command)
app.command("visualize")(visualize_command)
app.add_typer(profiles_app, name="profiles")

app.command("eval")(eval_command)
app.command("bench")(bench_command)
app.command("serve")(serve_command)
app.command("chat")(chat_command)
app.command("doctor")(doctor_command)
app.command("pull")(pull_command)
app.command("list")(list_command)
app.command("rm")(rm_command)


def main() -> None:
    """Console-script entry point (`dllm`) and `python -m dllm_cli`."""
    spin_briefly()  # before anything imports torch (dllm_cli/omp.py)
    use_utf8()
    app()


def use_utf8() -> None:
    """Answers go out as UTF-8 whatever the locale, as prompts come in (a text answer in
    Hebrew under a Latin-1 locale must not end the run); stderr shows what it cannot encode
    as escapes."""
    for stream, kind in ((sys.stdout, {"encoding": "utf-8"}), (sys.stderr, {})):
        with suppress(AttributeError, ValueError):  # not a text file, or closed
            stream.reconfigure(errors="backslashreplace", **kind)
