"""Every shared flag of every command reaches the run: the settings, the model, the guide choice.

One test over all commands: each invocation stops right after the profile is resolved (the
settings are built there), so nothing is loaded or decoded. The decoding flags are every field
that declares a help text, each tried with its one value from tests/setting_values.py; the
other flags each command must take are listed here, so a flag dropped from one command fails.
"""

from __future__ import annotations

import dataclasses

import pytest
import typer
from cli_fixtures import cli_ckpt_fixture, invoke, isolated_fixture, profile_text  # noqa: F401
from setting_values import VALUES

from dllm_cli import runtime
from dllm_cli.cli import app
from dllm_cli.commands import common
from dllm_cli.errors import DllmError
from dllm_cli.options import FLAGS
from dllm_cli.setting_spec import declared
from dllm_cli.settings import DecodeSettings

MODEL = ("profile", "model", "device", "force", "dtype", "quantize", "chat", "compile", "threads")
# every decoding flag: the DecodeSettings fields that declare a help text (settings.py)
DECODE = tuple(n for n, spec in declared(DecodeSettings) if spec.help and spec.group == "decode")
GUIDE = ("guide", "accept", "on_reject", "verify_chunk", "draft_window")
BENCH = (
    "temperature", "seed", "cache", "early_stop", "top_k", "threshold", "kl_history",
    "wino_verify", "jump_threshold", "credit_alpha", "credit_boost", "credit_decay",
    "edit_threshold", "max_post_steps",
)  # fmt: skip
TAKES = {
    "generate": (*MODEL, *DECODE, *GUIDE, "batching"),
    "visualize": (*MODEL, *DECODE, *GUIDE),
    "eval": (*MODEL, *DECODE, *GUIDE),
    "bench": (*MODEL, *GUIDE[1:], *BENCH),
}
COMMAND_LINES = {
    "generate": ["generate", "hi"],
    "visualize": ["visualize", "hi"],
    "eval": ["eval"],
    "bench": ["bench"],
}
# flag -> (arguments, what to look at, the value it must have); the profile sets other values
OWN_CASES = {
    "profile": ([], "source", None),  # every run names its profile file with -p
    "model": (["--model", "{ckpt}"], "model.path", "{ckpt}"),
    "device": (["--device", "auto"], "model.device", "auto"),
    "force": (["--force"], "force", True),  # open_runtime skips the fit check
    "dtype": (["--dtype", "bfloat16"], "model.dtype", "bfloat16"),
    "quantize": (["--quantize", "int8"], "model.quantize", "int8"),
    "chat": (["--no-chat"], "model.chat_template", False),
    "compile": (["--compile"], "model.compile", True),
    "threads": (["--threads", "3"], "model.threads", 3),
    "guide": (["--no-guide"], "use_guide", False),
    "accept": (["--accept", "topk:3"], "guide.accept", "topk:3"),
    "on_reject": (["--on-reject", "draft"], "guide.on_reject", "draft"),
    "verify_chunk": (["--verify-chunk", "8"], "guide.verify_chunk", 8),
    "draft_window": (["--draft-window", "16"], "guide.draft_window", 16),
}


def setting_case(name: str) -> tuple[list[str], str, object]:
    """A decoding flag's case from its one test value (tests/setting_values.py)."""
    value, flag = VALUES[name], "--" + name.replace("_", "-")
    args = (
        [flag if value else f"--no-{flag[2:]}"] if isinstance(value, bool) else [flag, str(value)]
    )
    return args, f"decode.{name}", value


CASES = {**OWN_CASES, **{n: setting_case(n) for n, f in FLAGS.items() if f.key == f"decode.{n}"}}


class Stop(DllmError):
    """Raised once the profile is resolved: the test has what it needs."""

    exit_code = 99


@pytest.fixture
def resolved(monkeypatch) -> dict:
    """What the command asked open_runtime for, and the profile resolve built from it."""
    seen: dict = {}
    real_open, real_resolve = runtime.open_runtime, runtime.resolve

    def open_spy(*args, **kwargs):
        seen["kwargs"] = kwargs
        return real_open(*args, **kwargs)

    def resolve_spy(*args, **kwargs):
        seen["profile"], seen["provenance"] = real_resolve(*args, **kwargs)
        raise Stop("resolved")

    monkeypatch.setattr(common, "open_runtime", open_spy)
    monkeypatch.setattr(runtime, "resolve", resolve_spy)
    return seen


def flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        out |= flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value}
    return out


def test_every_setting_has_a_flag_and_one_test_value():
    """A new DecodeSettings field needs its value in tests/setting_values.py, nothing else."""
    assert set(VALUES) == {f.name for f in dataclasses.fields(DecodeSettings)}
    flagged = {n for n, f in FLAGS.items() if f.key == f"decode.{n}"}
    assert flagged == {n for n, spec in declared(DecodeSettings) if spec.help} == set(VALUES)
    assert set(CASES) == set(FLAGS)


@pytest.mark.parametrize("command", list(TAKES))
def test_each_command_takes_exactly_its_shared_flags(command):
    """Shared flags are told apart from a command's own same-named option by their help."""
    params = typer.main.get_command(app).commands[command].params
    shared = {p.name for p in params if p.name in FLAGS and p.help == help_of(p.name)}
    assert shared == set(TAKES[command])


def help_of(flag: str) -> str:
    return FLAGS[flag].option.__metadata__[0].help


@pytest.mark.parametrize(("command", "flag"), [(c, f) for c, flags in TAKES.items() for f in flags])
def test_flag_reaches_the_run(command, flag, tmp_path, cli_ckpt, resolved):
    path = tmp_path / "p.toml"
    path.write_text(profile_text(cli_ckpt, extra='[guide]\npath = "ar"\n'))
    args, key, value = CASES[flag]
    args = [a.replace("{ckpt}", str(cli_ckpt)) for a in args]
    result = invoke(*COMMAND_LINES[command], "-p", str(path), *args)
    assert result.exit_code == Stop.exit_code, result.output
    if key in ("use_guide", "force"):
        assert resolved["kwargs"][key] is value
    elif key == "source":
        assert resolved["profile"].source == path.resolve()
    else:
        expected = str(cli_ckpt) if value == "{ckpt}" else value
        assert flat(resolved["profile"].to_dict())[key] == expected
        assert resolved["provenance"][key] == "cli"
