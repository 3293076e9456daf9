"""Every command's --help reads well at 80 columns: paragraphs wrapped by Rich, not by hand."""

from __future__ import annotations

import inspect

import pytest
import typer
from cli_fixtures import invoke, isolated_fixture  # noqa: F401

from dllm_cli.cli import app

COMMANDS = [
    [],
    ["generate"],
    ["visualize"],
    ["eval"],
    ["bench"],
    ["profiles"],
    ["profiles", "show"],
]


def callbacks() -> list:
    group = typer.main.get_command(app)
    found = []
    for command in group.commands.values():
        found += [command.callback] + [
            c.callback for c in getattr(command, "commands", {}).values()
        ]
    return found


@pytest.mark.parametrize("callback", callbacks(), ids=lambda c: c.__name__)
def test_help_paragraphs_are_one_line_each(callback):
    """Rich wraps a paragraph itself; a hand-wrapped docstring would break mid-sentence."""
    for paragraph in (inspect.getdoc(callback) or "").split("\n\n"):
        assert "\n" not in paragraph.strip(), paragraph


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a) or "dllm")
def test_help_fits_80_columns(args, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    result = invoke(*args, "--help")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) > 5 and max(len(line.rstrip()) for line in lines) <= 80


def test_generate_help_says_what_the_built_in_model_can_do(monkeypatch):
    """A new user reads this first: a toy for grade-school math, not an assistant."""
    monkeypatch.setenv("COLUMNS", "1000")  # one paragraph per line, to match whole phrases
    text = " ".join(invoke("generate", "--help").stdout.split())
    for words in (
        "trained only on synthetic grade-school math word problems",
        "62 and 42 of two sets of 100 questions written by hand",
        "not a general assistant",
        "a profile that points at a real checkpoint",
        "--model PATH",
    ):
        assert words in text, words


def test_top_level_help_names_every_family():
    from dllm_cli.families import FAMILIES

    text = " ".join(invoke("--help").stdout.replace("│", " ").split())
    assert all(f.title in text for f in FAMILIES.values()), text
