"""`dllm generate` with one prompt: stdout holds the answer only, every flag reaches the run."""

from __future__ import annotations

import json
import runpy
import sys

import pytest
import torch
from cli_fixtures import (  # noqa: F401
    GEN,
    cli_ckpt_fixture,
    invoke,
    isolated_fixture,
    profile_file_fixture,
    profile_text,
)
from transformers import LlamaConfig, LlamaForCausalLM

from dllm_cli.commands import common, generate
from dllm_cli.decoding import RowCommit, StepEvent, decode
from dllm_cli.decoding.guided import GuidedCommitter, GuideRules
from dllm_cli.runtime import open_runtime
from dllm_cli.text_stream import TextStream


@pytest.fixture
def opened(monkeypatch) -> list:
    """Every Runtime the command opens (to check what the flags did)."""
    seen = []

    def spy(*args, **kwargs):
        seen.append(open_runtime(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(common, "open_runtime", spy)
    return seen


def test_stdout_is_the_answer_and_nothing_else(profile_file):
    result = invoke("generate", "how many apples", "-p", str(profile_file))
    assert result.exit_code == 0, result.output
    runtime = open_runtime(str(profile_file))
    expected = decode(
        runtime.loaded.model,
        runtime.loaded.special,
        [runtime.encode("how many apples")],
        runtime.settings,
    )
    text = runtime.text(expected.tokens[0])
    assert text and result.stdout == text + "\n"
    assert "dllm: error" not in result.stderr


def test_python_m_dllm_cli_runs_the_same_app(profile_file, monkeypatch, capsys):
    monkeypatch.setattr(
        sys, "argv", ["dllm", "generate", "how many apples", "-p", str(profile_file)]
    )
    with pytest.raises(SystemExit) as done:
        runpy.run_module("dllm_cli", run_name="__main__")
    assert done.value.code in (0, None)
    assert (
        capsys.readouterr().out
        == invoke("generate", "how many apples", "-p", str(profile_file)).stdout
    )


def test_profile_by_name_from_profiles_dir(profile_file, monkeypatch):
    monkeypatch.setenv("DLLM_PROFILES_DIR", str(profile_file.parent))
    named = invoke("generate", "how many apples", "--profile", "test-llada")
    assert named.exit_code == 0, named.output
    assert named.stdout == invoke("generate", "how many apples", "-p", str(profile_file)).stdout


FLAGS = [
    (["--gen-length", "12"], "gen_length", 12),
    (["--block-length", "4"], "block_length", 4),
    (["--steps", "8", "--unmask", "fixed"], "steps", 8),
    (["--cache", "none"], "cache", "none"),
    (["--cache", "prefix"], "cache", "prefix"),
    (["--cache", "freecache"], "cache", "freecache"),
    (["--unmask", "factor"], "unmask", "factor"),
    (["--unmask", "origin"], "unmask", "origin"),
    (["--confidence", "margin"], "confidence", "margin"),
    (["--confidence", "random"], "confidence", "random"),
    (["--threshold", "0.5"], "threshold", 0.5),
    (["--factor", "2.5"], "factor", 2.5),
    (["--temperature", "0.7"], "temperature", 0.7),
    (["--top-p", "0.9", "--temperature", "1"], "top_p", 0.9),
    (["--top-k", "5", "--temperature", "1"], "top_k", 5),
    (["--top-k", "0"], "top_k", 0),
    (["--cfg-scale", "0.5"], "cfg_scale", 0.5),
    (["--seed", "7"], "seed", 7),
    (["--no-early-stop"], "early_stop", False),
    (["--early-stop"], "early_stop", True),
]


@pytest.mark.parametrize(("args", "field", "value"), FLAGS, ids=["=".join(f[0][:2]) for f in FLAGS])
def test_decode_flag_reaches_settings(args, field, value, profile_file, opened):
    result = invoke("generate", "how many apples", "-p", str(profile_file), "--json-canvas", *args)
    assert result.exit_code == 0, result.output
    assert getattr(opened[-1].settings, field) == value
    assert opened[-1].provenance[f"decode.{field}"] == "cli"
    out = json.loads(result.stdout)
    assert len(out["canvas_ids"]) == opened[-1].settings.gen_length


def test_model_flags_reach_the_loaded_model(profile_file, cli_ckpt, opened, tmp_path):
    other = tmp_path / "p.toml"
    other.write_text(profile_text("/nowhere").replace('dtype = "float32"', 'dtype = "bfloat16"'))
    args = ["--model", str(cli_ckpt), "--device", "cpu", "--dtype", "float32", "--no-chat"]
    result = invoke("generate", "how many apples", "-p", str(other), *args)
    assert result.exit_code == 0, result.output
    runtime = opened[-1]
    assert runtime.loaded.path == cli_ckpt and runtime.loaded.dtype == torch.float32
    assert runtime.loaded.device == torch.device("cpu") and runtime.chat is False
    assert runtime.provenance["model.path"] == "cli"


def test_chat_flag_changes_the_prompt(profile_file):
    chat = invoke("generate", "how many apples", "-p", str(profile_file), "--json")
    plain = invoke("generate", "how many apples", "-p", str(profile_file), "--json", "--no-chat")
    assert json.loads(chat.stdout)["token_ids"] != json.loads(plain.stdout)["token_ids"]


def test_json_record_schema(profile_file):
    result = invoke("generate", "how many apples", "-p", str(profile_file), "--json")
    assert result.exit_code == 0, result.output
    (line,) = result.stdout.splitlines()
    out = json.loads(line)
    assert set(out) >= {"prompt", "text", "token_ids", "forwards", "steps", "seconds"}
    assert out["prompt"] == "how many apples" and len(out["token_ids"]) <= GEN
    assert "canvas_ids" not in out  # only with --json-canvas
    assert out["forwards"] >= 1 and out["steps"] >= 1 and out["seconds"] > 0
    runtime = open_runtime(str(profile_file))
    assert out["text"] == runtime.text(out["token_ids"])


def test_stats_go_to_stderr(profile_file):
    plain = invoke("generate", "how many apples", "-p", str(profile_file))
    result = invoke("generate", "how many apples", "-p", str(profile_file), "--stats")
    assert result.stdout == plain.stdout
    assert all(word in result.stderr for word in ("tokens", "forwards", "steps", "tok/s"))


def test_runtime_notes_go_to_stderr(profile_file):
    result = invoke("generate", "hi", "-p", str(profile_file), "--block-length", "32")
    assert result.exit_code == 0
    assert "dllm: note: block_length 32 > gen_length: one block of 16" in result.stderr


def test_guide_without_guide_section_is_an_error(profile_file):
    result = invoke("generate", "hi", "-p", str(profile_file), "--guide")
    assert result.exit_code == 2 and "has no [guide] section" in result.stderr


@pytest.fixture
def guided_profile(tmp_path, cli_ckpt) -> str:
    """The test profile plus a one-layer Llama guide sharing the checkpoint's token ids."""
    cfg = LlamaConfig(
        vocab_size=79, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "ar")
    path = tmp_path / "guided.toml"
    path.write_text(profile_text(cli_ckpt, extra=f'[guide]\npath = "{tmp_path / "ar"}"\n'))
    return str(path)


def test_guide_flags(guided_profile, opened):
    assert invoke("generate", "hi", "-p", guided_profile, "--no-guide").exit_code == 0
    assert opened[-1].guide is None and opened[-1].committer() is None
    result = invoke("generate", "hi", "-p", guided_profile, "--json")
    assert result.exit_code == 0, result.output
    assert isinstance(opened[-1].committer(), GuidedCommitter)
    out = json.loads(result.stdout)
    assert len(out["token_ids"]) <= GEN and out["guide_forwards"] > 0 and out["forwards"] > 0


@pytest.mark.parametrize("command", ["generate", "visualize"])
def test_guide_rule_flags_reach_the_committer(command, guided_profile, opened):
    args = ["--accept", "topk:3", "--on-reject", "draft", "--verify-chunk", "4"]
    result = invoke(command, "hi", "-p", guided_profile, *args, "--draft-window", "8")
    assert result.exit_code == 0, result.output
    assert opened[-1].committer().rules == GuideRules("topk", 3, "draft", 4, 8)
    assert opened[-1].provenance["guide.verify_chunk"] == "cli"
    stats = invoke("generate", "hi", "-p", guided_profile, "--stats")
    assert "guide forwards" in stats.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--on-reject", "both"], "error: --on-reject must be one of guide, draft (got 'both')"),
        (["--verify-chunk", "0"], "error: --verify-chunk must be >= 1 (got 0)"),
        (["--draft-window", "-2"], "error: --draft-window must be >= 0"),
        (["--accept", "top:2"], "error: --accept must be 'exact', 'topk:K'"),
    ],
)
def test_bad_guide_flags_are_one_line_errors(args, message, guided_profile):
    result = invoke("generate", "hi", "-p", guided_profile, *args)
    assert result.exit_code == 2 and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_guide_rules_need_a_guide(profile_file):
    result = invoke("generate", "hi", "-p", str(profile_file), "--verify-chunk", "8")
    assert result.exit_code == 2 and "has no [guide] section" in result.stderr


# --- streaming ----------------------------------------------------------------------------


def event(step: int, positions, tokens) -> StepEvent:
    commit = RowCommit(0, tuple(positions), tuple(tokens), tuple(1.0 for _ in positions))
    return StepEvent(step, 0, step, (0, 4), False, None, step + 1, (commit,))


def test_stream_prints_only_final_prefixes():
    words = {1: "one", 2: "two", 3: "three", 9: "<eos>"}

    def to_text(ids):
        cut = ids.index(9) if 9 in ids else len(ids)
        return " ".join(words[t] for t in ids[:cut])

    stream = TextStream(5, to_text)
    assert stream.feed(event(0, [1, 2], [2, 3])) == ""  # position 0 still masked
    assert stream.feed(event(1, [0], [1])) == "one two three"
    assert stream.feed(event(2, [4], [1])) == ""  # position 3 still masked
    assert stream.feed(event(3, [3], [9])) == ""  # the answer ended before position 4
    assert stream.finish("one two three") == "\n"


def test_stream_holds_back_a_split_character():
    stream = TextStream(2, lambda ids: "é"[: len(ids) - 1] + "\ufffd" * (len(ids) == 1))
    assert stream.feed(event(0, [0], [5])) == ""
    assert stream.feed(event(1, [1], [6])) == "é"


def test_streaming_on_a_terminal_prints_the_same_text(profile_file, monkeypatch):
    plain = invoke("generate", "how many apples", "-p", str(profile_file)).stdout
    chunks = []
    monkeypatch.setattr(generate, "stdout_is_terminal", lambda: True)
    monkeypatch.setattr(generate, "write", lambda text: chunks.append(text))
    assert invoke("generate", "how many apples", "-p", str(profile_file)).exit_code == 0
    assert "".join(chunks) == plain and len([c for c in chunks if c]) > 1
