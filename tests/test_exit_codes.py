"""One rule for errors: one `dllm: error:` line, every usage error exit 2 before anything loads,
and every code of the exit-code table (docs/usage.md) triggered here."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from cli_fixtures import (  # noqa: F401
    cli_ckpt_fixture,
    error_lines,
    invoke,
    isolated_fixture,
    profile_file_fixture,
)

from dllm_cli import batch
from dllm_cli.commands import common, generate

USAGE = (Path(__file__).resolve().parent.parent / "docs" / "usage.md").read_text()


def readme_codes() -> set[int]:
    """The codes of the exit-code table in docs/usage.md (rows `| N | meaning |`)."""
    table = USAGE[USAGE.index("| code | meaning |") :].split("\n\n")[0]
    return {int(m) for m in re.findall(r"^\| (\d+) \|", table, flags=re.MULTILINE)}


@pytest.fixture
def loads(monkeypatch) -> list:
    """Records every model load (a command that fails before loading leaves it empty)."""
    calls = []
    real = common.open_runtime

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(common, "open_runtime", spy)
    return calls


def one_error_line(result) -> str:
    """The only stderr line, which must be the error (no panel, no usage block)."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("dllm: error: ") and "╭" not in result.stderr
    return lines[0]


# --- usage errors: one line, exit 2 ---------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["generate", "--gen-length", "abc", "x"], "Invalid value for '--gen-length'"),
        (["generate", "--gen-lenght", "8", "x"], "No such option: --gen-lenght"),
        (["generat", "x"], "No such command 'generat'"),
        (["visualize"], "Missing argument"),
        (["eval", "--n", "many"], "Invalid value for '--n'"),
        (["generate", "--batch-size", "0", "-"], "Invalid value for '--batch-size'"),
        (["eval", "--batch-size", "0"], "Invalid value for '--batch-size'"),
        (["profiles", "show", "--bad"], "No such option: --bad"),
    ],
    ids=lambda a: " ".join(a) if isinstance(a, list) else a[:12],
)
def test_click_errors_are_one_line_with_code_2(args, words, loads):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    line = one_error_line(result)
    assert words in line and "--help" in line  # where to look next
    assert loads == []


def test_an_invalid_device_is_a_usage_error_and_a_missing_one_is_5(profile_file):
    bad = invoke("generate", "hi", "-p", str(profile_file), "--device", "tpu")
    assert bad.exit_code == 2 and "unknown device 'tpu'" in one_error_line(bad)
    if not torch.cuda.is_available():
        absent = invoke("generate", "hi", "-p", str(profile_file), "--device", "cuda")
        assert absent.exit_code == 5 and "no CUDA GPU" in one_error_line(absent)


def test_accept_message_names_the_flag(profile_file, tmp_path):
    guided = tmp_path / "guided.toml"
    guided.write_text(profile_file.read_text() + f'\n[guide]\npath = "{tmp_path}"\n')
    result = invoke("generate", "hi", "-p", str(guided), "--accept", "topk:0")
    assert result.exit_code == 2
    assert one_error_line(result) == (
        "dllm: error: --accept must be 'exact', 'topk:K' (K >= 1) or 'prob:P' (0 < P <= 1) "
        "(got 'topk:0')"
    )


def test_steps_apply_only_to_the_step_rules(profile_file):
    """The profile decodes with the threshold rule: unset steps (one token a step at least)
    need no note; set steps are the least a step commits, explained and checked as under
    fixed; factor ignores them."""
    threshold = invoke("generate", "hi", "-p", str(profile_file), "--steps", "1")
    assert threshold.exit_code == 2, threshold.output
    assert "fewer than the number of blocks" in one_error_line(threshold)
    factor = invoke("generate", "hi", "-p", str(profile_file), "--steps", "1", "--unmask", "factor")
    assert factor.exit_code == 0, factor.output
    assert "step" not in factor.stderr
    planned = invoke(
        "generate", "hi", "-p", str(profile_file), "--block-length", "7", "--steps", "16"
    )
    assert planned.exit_code == 0 and "steps 16 over 3 blocks" in planned.stderr
    blocks = invoke("generate", "hi", "-p", str(profile_file), "--block-length", "7")
    assert blocks.exit_code == 0, blocks.output
    notes = [line for line in blocks.stderr.splitlines() if line.startswith("dllm: note:")]
    assert notes == ["dllm: note: the last block has 2 tokens, not 7"]
    fixed = invoke("generate", "hi", "-p", str(profile_file), "--block-length", "7", "--unmask")
    assert fixed.exit_code == 2  # (--unmask needs a value: a usage error, one line)
    fixed = invoke(
        "generate", "hi", "-p", str(profile_file), "--block-length", "7", "--unmask", "fixed"
    )
    assert fixed.exit_code == 0 and "steps 16 over 3 blocks" in fixed.stderr
    refused = invoke("generate", "hi", "-p", str(profile_file), "--steps", "1", "--unmask", "fixed")
    assert refused.exit_code == 2 and "fewer than the number of blocks" in one_error_line(refused)


# --- output paths: checked before anything loads --------------------------------------------


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["visualize", "hi", "--save", "nodir/run.svg"], "--save"),
        (["visualize", "hi", "--save", "nodir/run.html"], "--save"),
        (["bench", "--json", "nodir/b.json"], "--json"),
        (["bench", "--markdown", "nodir/b.md"], "--markdown"),
        (["bench", "--plot", "nodir/b.png"], "--plot"),
        (["bench", "--json", "out/b.json", "--markdown", "nodir/b.md"], "--markdown"),
        (["visualize", "hi", "--save", "."], "--save"),
    ],
    ids=lambda a: " ".join(a) if isinstance(a, list) else a,
)
def test_output_paths_are_checked_before_any_loading(args, flag, profile_file, tmp_path, loads):
    (tmp_path / "out").mkdir()
    result = invoke(*args, "-p", str(profile_file))
    assert result.exit_code == 2, result.output
    assert flag in one_error_line(result)
    assert loads == [] and result.stdout == ""


def test_plot_without_matplotlib_is_a_usage_error_before_loading(
    profile_file, tmp_path, monkeypatch, loads
):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if not installed
    result = invoke("bench", "-p", str(profile_file), "--plot", str(tmp_path / "b.png"))
    assert result.exit_code == 2
    assert "[plot]" in one_error_line(result) and loads == []


# --- every code of the usage table ----------------------------------------------------------


def broken_runtime(*args, **kwargs):
    raise ZeroDivisionError("a bug")


def interrupted_decode(*args, **kwargs):
    raise KeyboardInterrupt


def closed_stdout(text):
    raise BrokenPipeError(32, "Broken pipe")


def full_disk(ctx):
    """A write that fails after the run (ENOSPC from /dev/full): exit 1."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    md = ctx["tmp"] / "b.md"
    args = ["bench", "-p", "tiny-gsm", "--n", "1", "--shots", "0", "--gen-length", "8"]
    args += ["--block-length", "8", "--strategies", "baseline", "--no-warmup"]
    return invoke(*args, "--json", "/dev/full", "--markdown", str(md))


def patched(target, name, value, *args, stdin=None):
    def run(ctx):
        ctx["monkeypatch"].setattr(target, name, value)
        return invoke(*args, "-p", str(ctx["profile"]), input=stdin)

    return run


def plain(*args, stdin=None):
    return lambda ctx: invoke(*args, "-p", str(ctx["profile"]), input=stdin)


def no_gpu(ctx):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    return invoke("generate", "hi", "-p", str(ctx["profile"]), "--device", "cuda")


TRIGGERS = {
    0: plain("generate", "how many apples"),
    1: full_disk,
    2: plain("generate", "--gen-length", "abc", "x"),
    3: plain("generate", "hi", "--model", "/no/such/folder"),
    4: plain("generate", "  "),
    5: no_gpu,
    70: patched(common, "open_runtime", broken_runtime, "generate", "hi"),
    130: patched(
        batch, "open_engine", interrupted_decode, "generate", "--batching", "static", stdin="a\n"
    ),
    141: patched(generate, "write", closed_stdout, "generate", "hi"),
}


def test_the_readme_table_lists_exactly_the_codes_triggered_here():
    assert readme_codes() == set(TRIGGERS)


@pytest.mark.parametrize("code", sorted(TRIGGERS))
def test_each_exit_code_of_the_table(code, profile_file, tmp_path, monkeypatch):
    ctx = {"profile": profile_file, "tmp": tmp_path, "monkeypatch": monkeypatch}
    result = TRIGGERS[code](ctx)
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    if code not in (0, 141):
        assert result.stderr.strip(), "a failure says why on stderr"
