"""--threads N (and [model] threads): torch's CPU thread pool is sized before the first forward."""

from __future__ import annotations

import pytest
import torch
from cli_fixtures import (  # noqa: F401
    cli_ckpt_fixture,
    error_lines,
    invoke,
    isolated_fixture,
    profile_file_fixture,
    profile_text,
)

from dllm_cli.models import LLaDAModelLM


@pytest.fixture
def first_forward(monkeypatch) -> list[int]:
    """The thread count each forward ran with; the suite's one thread restored afterwards."""
    seen: list[int] = []
    real = LLaDAModelLM.forward

    def counted(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(LLaDAModelLM, "forward", counted)
    torch.set_num_threads(1)
    yield seen
    torch.set_num_threads(1)


@pytest.mark.parametrize("command", [["generate", "hi"], ["visualize", "hi"]])
def test_threads_flag_sizes_the_pool_before_the_first_forward(command, profile_file, first_forward):
    result = invoke(*command, "-p", str(profile_file), "--threads", "2")
    assert result.exit_code == 0, result.output
    assert first_forward and set(first_forward) == {2}


def test_threads_from_the_profile(tmp_path, cli_ckpt, first_forward):
    path = tmp_path / "t.toml"
    path.write_text(profile_text(cli_ckpt).replace('device = "cpu"', 'device = "cpu"\nthreads = 2'))
    result = invoke("generate", "hi", "-p", str(path))
    assert result.exit_code == 0, result.output
    assert set(first_forward) == {2}
    flag = invoke("generate", "hi", "-p", str(path), "--threads", "1")  # the flag wins
    assert flag.exit_code == 0 and first_forward[-1] == 1


def test_zero_keeps_torchs_default(profile_file, first_forward):
    torch.set_num_threads(1)
    result = invoke("generate", "hi", "-p", str(profile_file), "--threads", "0")
    assert result.exit_code == 0 and set(first_forward) == {1}


@pytest.mark.parametrize(
    ("value", "words"),
    [("-1", "--threads must be >= 0"), ("two", "Invalid value for '--threads'")],
)
def test_bad_thread_counts_are_one_line_usage_errors(value, words, profile_file):
    result = invoke("generate", "hi", "-p", str(profile_file), "--threads", value)
    assert result.exit_code == 2 and "Traceback" not in result.output
    (line,) = error_lines(result)
    assert words in line


def test_bad_thread_count_in_a_profile(tmp_path, cli_ckpt):
    path = tmp_path / "t.toml"
    path.write_text(
        profile_text(cli_ckpt).replace('device = "cpu"', 'device = "cpu"\nthreads = -2')
    )
    result = invoke("generate", "hi", "-p", str(path))
    assert result.exit_code == 2
    assert "threads in [model] must be >= 0" in error_lines(result)[0]


@pytest.mark.parametrize("command", ["generate", "visualize", "eval", "bench"])
def test_every_decoding_command_takes_threads(command):
    result = invoke(command, "--help")
    assert "--threads" in result.stdout
