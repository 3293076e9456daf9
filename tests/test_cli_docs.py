"""The CLI reference cannot drift: docs/cli.md is exactly what scripts/gen_cli_docs.py writes from
every command's `--help`, and every option of every command is described somewhere in docs/
beyond that generated reference."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import typer

from dllm_cli.cli import app

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
GENERATED = DOCS / "cli.md"
CLICK_OWN = {"--help", "--install-completion", "--show-completion"}


def commands(command, path=("dllm",)):
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from commands(sub, (*path, name))


def options() -> list[tuple[str, str]]:
    """(command, long option) for every option of every command."""
    out = []
    for path, command in commands(typer.main.get_command(app)):
        for param in command.params:
            names = [n for n in param.opts if n.startswith("--") and n not in CLICK_OWN]
            out += [(" ".join(path), n) for n in names[:1]]  # the primary name; --no-X follows
    return out


def test_cli_reference_is_generated_from_the_current_help():
    """One clean process (fixed width, no colour), as a contributor runs the script."""
    script = ROOT / "scripts" / "gen_cli_docs.py"
    result = subprocess.run(
        [sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, (
        f"{result.stdout}{result.stderr}\n"
        "docs/cli.md does not match the commands' --help: run `python scripts/gen_cli_docs.py` "
        "and commit docs/cli.md"
    )


def test_every_option_is_described_in_the_docs():
    prose = "\n".join(
        p.read_text(encoding="utf-8") for p in sorted(DOCS.rglob("*.md")) if p != GENERATED
    )
    missing = [
        f"{command} {name}"
        for command, name in options()
        if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", prose)
    ]
    assert not missing, (
        "options described nowhere in docs/*.md (docs/cli.md, generated from --help, does not "
        f"count): {', '.join(missing)}. Say what each does on its command's page "
        "(docs/usage.md, docs/decoding.md, ...), then run `python scripts/gen_cli_docs.py`."
    )
