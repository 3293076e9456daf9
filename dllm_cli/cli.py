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

from dllm_cli import __version__
from dllm_cli.commands.bench import bench_command
from dllm_cli.commands.common import set_debug
from dllm_cli.commands.eval import eval_command
from dllm_cli.commands.generate import generate_command
from dllm_cli.commands.profiles import profiles_app
from dllm_cli.commands.visualize import visualize_command

app = typer.Typer(
    name="dllm",
    help="Fast decoding for masked diffusion language models (LLaDA, Dream).",
    epilog="Exit codes: 0 ok, 1 other error, 2 usage/profile/setting, 3 model cannot load, "
    "4 bad input (or some stdin line failed), 5 device unavailable, 70 internal, 130 Ctrl-C.",
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
    """Fast decoding for masked diffusion language models (LLaDA, Dream)."""
    set_debug(debug)


app.command("generate")(generate_command)
app.command("visualize")(visualize_command)
app.add_typer(profiles_app, name="profiles")

app.command("eval")(eval_command)
app.command("bench")(bench_command)


def main() -> None:
    """Console-script entry point (`dllm`) and `python -m dllm_cli`."""
    use_utf8()
    app()


def use_utf8() -> None:
    """Answers go out as UTF-8 whatever the locale, as prompts come in (a text answer in
    Hebrew under a Latin-1 locale must not end the run); stderr shows what it cannot encode
    as escapes."""
    for stream, kind in ((sys.stdout, {"encoding": "utf-8"}), (sys.stderr, {})):
        with suppress(AttributeError, ValueError):  # not a text file, or closed
            stream.reconfigure(errors="backslashreplace", **kind)
