"""Every bad input gives one `dllm: error:` line and its exit code, never a traceback."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from cli_fixtures import (  # noqa: F401
    CONTEXT,
    cli_ckpt_fixture,
    error_lines,
    invoke,
    isolated_fixture,
    profile_file_fixture,
    profile_text,
)

from dllm_cli.commands import common, generate


def bad_toml(tmp, ckpt) -> list[str]:
    (tmp / "bad.toml").write_text("name = 'x'\n[model\npath = 1\n")
    return ["-p", str(tmp / "bad.toml")]


def unknown_key(tmp, ckpt) -> list[str]:
    (tmp / "typo.toml").write_text(profile_text(ckpt, decode="treshold = 0.5"))
    return ["-p", str(tmp / "typo.toml")]


def corrupt_weights(tmp, ckpt) -> list[str]:
    folder = tmp / "corrupt"
    shutil.copytree(ckpt, folder)
    (folder / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    return ["--model", str(folder)]


# (case, extra args or a function (tmp_path, ckpt) -> args, exit code, words in the message)
CASES = [
    ("unknown profile", ["-p", "no-such-profile"], 2, "unknown profile 'no-such-profile'"),
    ("bad TOML", bad_toml, 2, "invalid TOML"),
    ("unknown key", unknown_key, 2, "unknown key 'treshold' in [decode]"),
    ("missing model folder", ["--model", "/no/such/folder"], 3, "model folder not found"),
    ("corrupt weights", corrupt_weights, 3, "cannot read weights"),
    ("negative length", ["--gen-length", "-4"], 2, "gen_length must be >= 1"),
    ("threshold above 1", ["--threshold", "1.5"], 2, "threshold must be in (0, 1]"),
    ("threshold zero", ["--threshold", "0"], 2, "threshold must be in (0, 1]"),
    ("huge temperature", ["--temperature", "1e300"], 2, "temperature must be 0 (greedy) or in"),
    ("tiny temperature", ["--temperature", "1e-40"], 2, "temperature must be 0 (greedy) or in"),
    ("huge cfg scale", ["--cfg-scale", "1e300"], 2, "cfg_scale must be in [0, 100]"),
    (
        "blocks need steps",
        ["--steps", "1", "--block-length", "4", "--unmask", "fixed"],
        2,
        "fewer than",
    ),
    ("unknown cache", ["--cache", "lru"], 2, "cache must be one of"),
    ("negative top-k", ["--top-k", "-1"], 2, "top_k must be >= 0 (0 turns it off"),
    ("prompt too long", ["--gen-length", str(CONTEXT)], 4, "exceeds the model's context"),
    ("unknown device", ["--device", "tpu"], 2, "unknown device 'tpu'"),
    ("guide without [guide]", ["--guide"], 2, "has no [guide] section"),
]


@pytest.mark.parametrize(("case", "extra", "code", "words"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_gives_one_line_and_exit_code(
    case, extra, code, words, profile_file, cli_ckpt, tmp_path
):
    args = extra(tmp_path, cli_ckpt) if callable(extra) else extra
    result = invoke("generate", "how many apples", "-p", str(profile_file), *args)
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output and result.stdout == ""
    (line,) = error_lines(result)
    assert words in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu(profile_file):
    result = invoke("generate", "hi", "-p", str(profile_file), "--device", "cuda")
    assert result.exit_code == 5 and "no CUDA GPU" in error_lines(result)[0]


def test_empty_prompt(profile_file):
    result = invoke("generate", "  ", "-p", str(profile_file))
    assert result.exit_code == 4 and error_lines(result) == ["dllm: error: empty prompt"]


def test_a_failed_prompt_with_json_gives_an_error_record(profile_file):
    result = invoke("generate", "", "-p", str(profile_file), "--json")
    assert result.exit_code == 4 and json.loads(result.stdout) == {
        "prompt": "",
        "error": "empty prompt",
    }
    assert error_lines(result) == ["dllm: error: empty prompt"]


def test_no_prompt_and_stdin_a_terminal(profile_file, monkeypatch):
    monkeypatch.setattr(generate, "stdin_is_terminal", lambda: True)
    result = invoke("generate", "-p", str(profile_file))
    assert result.exit_code == 2 and "no prompt" in error_lines(result)[0]


def test_click_usage_errors_keep_code_2(profile_file):
    result = invoke("generate", "hi", "-p", str(profile_file), "--gen-length", "many")
    assert result.exit_code == 2 and "Traceback" not in result.output


def test_debug_shows_the_traceback(profile_file):
    result = invoke("--debug", "generate", "hi", "-p", str(profile_file), "--gen-length", "-4")
    assert result.exit_code == 2 and "Traceback" in result.stderr
    assert error_lines(result)[-1] == "dllm: error: gen_length must be >= 1 (got -4)"
    assert "Traceback" not in invoke("generate", "hi", "-p", "nope").output  # not sticky


def test_a_bug_is_one_line_with_code_70(profile_file, monkeypatch):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("oops")

    monkeypatch.setattr(common, "open_runtime", broken)
    result = invoke("generate", "hi", "-p", str(profile_file))
    assert result.exit_code == 70 and "Traceback" not in result.output
    assert error_lines(result)[0].startswith("dllm: error: internal error: ZeroDivisionError: oops")


def test_a_closed_stdout_ends_quietly(profile_file, monkeypatch):
    def closed(*args, **kwargs):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(generate, "write", closed)
    result = invoke("generate", "hi", "-p", str(profile_file))
    assert result.exit_code == 141 and "error" not in result.stderr


def test_profiles_show_unknown_profile():
    result = invoke("profiles", "show", "nope")
    assert result.exit_code == 2 and "unknown profile" in error_lines(result)[0]


def test_a_threshold_the_rule_ignores_is_still_range_checked():
    result = invoke("generate", "-p", "tiny-gsm", "--unmask", "fixed", "--threshold", "2", "hi")
    assert result.exit_code == 2, result.output
    assert error_lines(result) == ["dllm: error: threshold must be in [0, 1] (got 2.0)"]
