"""CLI test helpers: a tiny real-format checkpoint, a profile TOML naming it, and `invoke`.

Test modules import the fixtures by their function names (`*_fixture`, noqa F401); tests
use the short names. The checkpoint is LLaDA with seed 1 (its greedy answers are words, not an instant EOS) and a
64-token context, so a too-long prompt is cheap to write.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from checkpoints import write_llada
from typer.testing import CliRunner

from dllm_cli import profiles
from dllm_cli.cli import app

CONTEXT = 64
GEN = 16
PROMPTS = ["how many apples", "tom has 3 pens", "what is 2 + 2 ?"]


@pytest.fixture(scope="session", name="cli_ckpt")
def cli_ckpt_fixture(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cli") / "llada"
    return write_llada(folder, seed=1, max_sequence_length=CONTEXT).folder


def profile_text(model: Path, *, decode: str = "", extra: str = "") -> str:
    """A profile for the test checkpoint: small dual-cache threshold decoding on CPU."""
    return textwrap.dedent(
        f"""\
        name = "test-llada"
        description = "tiny test model"

        [model]
        path = "{model}"
        dtype = "float32"
        device = "cpu"

        [decode]
        gen_length = {GEN}
        block_length = 8
        cache = "dual"
        unmask = "threshold"
        threshold = 0.9
        early_stop = true
        {decode}
        """
    ) + textwrap.dedent(extra)


@pytest.fixture(name="profile_file")
def profile_file_fixture(tmp_path, cli_ckpt) -> Path:
    path = tmp_path / "profiles" / "test-llada.toml"
    path.parent.mkdir()
    path.write_text(profile_text(cli_ckpt))
    return path


@pytest.fixture(autouse=True, name="isolated")
def isolated_fixture(tmp_path, monkeypatch):
    """No user profiles or model folders leak in; cwd is empty; wide, plain Rich output."""
    monkeypatch.delenv(profiles.ENV_DIR, raising=False)
    monkeypatch.delenv("DLLM_MODELS_DIR", raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.chdir(tmp_path)


def invoke(*args: str, input: str | bytes | None = None):
    """Run `dllm ARGS` in-process; result has exit_code, stdout, stderr, output."""
    return CliRunner().invoke(app, list(args), input=input)


def error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("dllm: error:")]
