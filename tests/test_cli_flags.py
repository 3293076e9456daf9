"""Every shared flag of every command reaches the run: the settings, the model, the guide choice.

One test over all commands: each invocation stops right after the profile is resolved (the
settings are built there), so nothing is loaded or decoded. The flags each command must take
are listed here, not read from the code, so a flag dropped from one command fails this test.
"""

from __future__ import annotations

import pytest
import typer
from cli_fixtures import cli_ckpt_fixture, invoke, isolated_fixture, profile_text  # noqa: F401

from dllm_cli import runtime
from dllm_cli.cli import app
from dllm_cli.commands import common
from dllm_cli.errors import DllmError
from dllm_cli.options import FLAGS

MODEL = ("profile", "model", "device", "force", "dtype", "quantize", "chat", "compile", "threads")
DECODE = (
    "gen_length", "block_length", "steps", "cache", "unmask", "confidence", "schedule", "threshold",
    "factor", "temperature", "top_p", "top_k", "cfg_scale", "seed", "early_stop", "suffix_window",
    "t_min", "t_max", "entropy_bound", "stability_threshold", "confidence_threshold",
    "eb_gamma", "kl_threshold", "kl_history", "wino_verify", "jump_threshold",
    "credit_alpha", "credit_boost", "credit_decay",
    "edit_threshold", "max_post_steps",
)  # fmt: skip
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
CASES = {
    "profile": ([], "source", None),  # every run names its profile file with -p
    "model": (["--model", "{ckpt}"], "model.path", "{ckpt}"),
    "device": (["--device", "auto"], "model.device", "auto"),
    "force": (["--force"], "force", True),  # open_runtime skips the fit check
    "dtype": (["--dtype", "bfloat16"], "model.dtype", "bfloat16"),
    "quantize": (["--quantize", "int8"], "model.quantize", "int8"),
    "chat": (["--no-chat"], "model.chat_template", False),
    "compile": (["--compile"], "model.compile", True),
    "threads": (["--threads", "3"], "model.threads", 3),
    "gen_length": (["--gen-length", "12"], "decode.gen_length", 12),
    "block_length": (["--block-length", "4"], "decode.block_length", 4),
    "steps": (["--steps", "8"], "decode.steps", 8),
    "cache": (["--cache", "prefix"], "decode.cache", "prefix"),
    "unmask": (["--unmask", "factor"], "decode.unmask", "factor"),
    "confidence": (["--confidence", "margin"], "decode.confidence", "margin"),
    "schedule": (["--schedule", "dream"], "decode.schedule", "dream"),
    "threshold": (["--threshold", "0.5"], "decode.threshold", 0.5),
    "factor": (["--factor", "2.5"], "decode.factor", 2.5),
    "eb_gamma": (["--eb-gamma", "0.3"], "decode.eb_gamma", 0.3),
    "kl_threshold": (["--kl-threshold", "0.02"], "decode.kl_threshold", 0.02),
    "kl_history": (["--kl-history", "3"], "decode.kl_history", 3),
    "wino_verify": (["--wino-verify", "0.95"], "decode.wino_verify", 0.95),
    "jump_threshold": (["--jump-threshold", "0.99"], "decode.jump_threshold", 0.99),
    "credit_alpha": (["--credit-alpha", "1.5"], "decode.credit_alpha", 1.5),
    "credit_boost": (["--credit-boost", "0.5"], "decode.credit_boost", 0.5),
    "credit_decay": (["--credit-decay", "0.9"], "decode.credit_decay", 0.9),
    "temperature": (["--temperature", "0.7"], "decode.temperature", 0.7),
    "top_p": (["--top-p", "0.8"], "decode.top_p", 0.8),
    "top_k": (["--top-k", "5"], "decode.top_k", 5),
    "cfg_scale": (["--cfg-scale", "0.5"], "decode.cfg_scale", 0.5),
    "seed": (["--seed", "7"], "decode.seed", 7),
    "early_stop": (["--no-early-stop"], "decode.early_stop", False),
    "suffix_window": (["--suffix-window", "24"], "decode.suffix_window", 24),
    "batching": (["--batching", "static"], "decode.batching", "static"),
    "t_min": (["--t-min", "0.3"], "decode.t_min", 0.3),
    "t_max": (["--t-max", "0.9"], "decode.t_max", 0.9),
    "entropy_bound": (["--entropy-bound", "0.2"], "decode.entropy_bound", 0.2),
    "stability_threshold": (["--stability-threshold", "2"], "decode.stability_threshold", 2),
    "confidence_threshold": (
        ["--confidence-threshold", "0.01"],
        "decode.confidence_threshold",
        0.01,
    ),
    "edit_threshold": (["--edit-threshold", "0.5"], "decode.edit_threshold", 0.5),
    "max_post_steps": (["--max-post-steps", "3"], "decode.max_post_steps", 3),
    "guide": (["--no-guide"], "use_guide", False),
    "accept": (["--accept", "topk:3"], "guide.accept", "topk:3"),
    "on_reject": (["--on-reject", "draft"], "guide.on_reject", "draft"),
    "verify_chunk": (["--verify-chunk", "8"], "guide.verify_chunk", 8),
    "draft_window": (["--draft-window", "16"], "guide.draft_window", 16),
}


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


def test_every_shared_flag_has_a_case():
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
