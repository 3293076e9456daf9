"""DiffusionGemma through the CLI: generate (single, batch, --json, --stats), refused settings,
visualize and its view of replaced tokens, profiles show, bench, torchrun."""

from __future__ import annotations

import io
import json
import re

import pytest
from cli_fixtures import (  # noqa: F401
    cli_ckpt_fixture,
    error_lines,
    invoke,
    isolated_fixture,
    profile_file_fixture,
)
from gemma_fixtures import (  # noqa: F401
    TEXTS,
    gemma_ckpt_fixture,
    gemma_fixture,
    gemma_profile,
    gemma_profile_file_fixture,
)
from rich.console import Console

from dllm_cli.commands.common import CONTROLS
from dllm_cli.decoding import DecodeResult, RowCommit, StepEvent
from dllm_cli.settings import DecodeSettings
from dllm_cli.view import CanvasView

# --- generate -------------------------------------------------------------------------------


def test_generate_prints_the_answer_json_and_stats(gemma_profile_file):
    args = ["-p", str(gemma_profile_file)]
    text = invoke("generate", TEXTS[0], *args)
    assert text.exit_code == 0, text.output
    record = invoke("generate", TEXTS[0], *args, "--json", "--stats")
    assert record.exit_code == 0, record.output
    data = json.loads(record.stdout)
    shown = data["text"].translate(CONTROLS)  # text mode escapes control characters
    assert shown + "\n" == text.stdout and len(data["token_ids"]) <= 24
    assert data["forwards"] == data["steps"] and 0 < data["forwards"] <= 2 * 5
    assert f"{data['forwards']} forwards" in record.stderr and "tok/s" in record.stderr
    assert "whole canvases of 16 tokens: 2 for gen_length 24" in record.stderr


def test_batch_mode_keeps_order_isolates_bad_lines_and_matches_single_runs(gemma_profile_file):
    args = ["-p", str(gemma_profile_file), "--json"]
    singles = [json.loads(invoke("generate", t, *args).stdout) for t in TEXTS]
    stdin = "\n".join([TEXTS[0], TEXTS[1], "", TEXTS[2], TEXTS[3]]) + "\n"
    result = invoke("generate", "-", *args, "--batch-size", "3", input=stdin)
    assert result.exit_code == 4, result.output
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["line"] for r in records] == [1, 2, 3, 4, 5]
    assert records[2] == {"line": 3, "prompt": "", "error": "empty prompt"}
    answers = [r for r in records if "text" in r]
    assert [(r["text"], r["token_ids"]) for r in answers] == [
        (s["text"], s["token_ids"]) for s in singles
    ]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--cache", "dual"], "cache 'dual' (from the command line) does not apply to"),
        (["--unmask", "threshold"], "unmask 'threshold' (from the command line) does not apply"),
        (["--temperature", "0.7"], "temperature 0.7 (from the command line) does not apply"),
        (["--top-p", "0.9"], "top_p 0.9 (from the command line) does not apply"),
        (["--cfg-scale", "1"], "cfg_scale 1.0 (from the command line) does not apply"),
        (["--block-length", "8"], "block_length 8 (from the command line) does not apply"),
    ],
)
def test_settings_without_meaning_are_refused_in_one_line(gemma_profile_file, flags, message):
    result = invoke("generate", "hi", "-p", str(gemma_profile_file), *flags)
    assert result.exit_code == 2 and result.stdout == ""
    assert error_lines(result) == [line for line in result.stderr.splitlines() if line]
    assert len(error_lines(result)) == 1 and message in result.stderr
    assert "DiffusionGemma" in result.stderr


def test_a_profile_for_another_family_and_a_guide_are_refused(gemma_ckpt, profile_file, tmp_path):
    other = invoke("generate", "hi", "-p", str(profile_file), "--model", str(gemma_ckpt.folder))
    assert other.exit_code == 2
    assert f"cache 'dual' (from profile {profile_file}) does not apply" in error_lines(other)[0]
    guided = tmp_path / "guided.toml"
    guided.write_text(
        gemma_profile(gemma_ckpt.folder, extra="[guide]\npath = 'builtin:tiny-gsm-ar'\n")
    )
    refused = invoke("generate", "hi", "-p", str(guided))
    assert refused.exit_code == 2
    assert error_lines(refused) == [
        "dllm: error: a guide model does not apply to DiffusionGemma (use --no-guide)"
    ]
    knob = invoke("generate", "hi", "-p", str(profile_file), "--t-min", "0.3")
    assert knob.exit_code == 2 and "it is DiffusionGemma's own knob" in knob.stderr


def test_family_knobs_reach_transformers(gemma_profile_file):
    args = ["hi", "-p", str(gemma_profile_file), "--json"]
    base = json.loads(invoke("generate", *args).stdout)
    loose = invoke("generate", *args, "--stability-threshold", "0", "--confidence-threshold", "100")
    assert json.loads(loose.stdout)["forwards"] == 2 < base["forwards"]  # 2 canvases, 1 step each
    hot = json.loads(invoke("generate", *args, "--t-max", "3.0", "--t-min", "2.0").stdout)
    assert hot["token_ids"] != base["token_ids"]


# --- visualize and the view -----------------------------------------------------------------


def test_visualize_streams_the_refining_canvas_and_saves_it(gemma_profile_file, tmp_path):
    args = [TEXTS[0], "-p", str(gemma_profile_file)]
    answer = invoke("generate", *args).stdout
    page = tmp_path / "run.html"
    result = invoke("visualize", *args, "--save", str(page))
    assert result.exit_code == 0, result.output
    assert result.stdout == answer
    lines = [line for line in result.stderr.splitlines() if line.startswith("step ")]
    assert lines[0].startswith("step 1 block 1/2: +0 tokens, ~16 replaced, 0/24 committed")
    assert any(re.search(r": \+[1-9]\d* tokens", line) for line in lines)  # a canvas committed
    html = page.read_text()
    assert "step 1" in html and "replaced" in html and "final" in html
    svg = tmp_path / "run.svg"
    assert invoke("visualize", *args, "--save", str(svg)).exit_code == 0 and svg.is_file()


WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 9: "<eos>"}


def spoken(ids: list[int]) -> str:
    """A word-level tokenizer's decode: every token is a word of its own."""
    return "".join(f" {WORDS[t]}" for t in ids)


def draw(view: CanvasView, styles: bool = False) -> str:
    console = Console(record=True, width=200, file=io.StringIO(), force_terminal=True)
    console.print(view.render())
    return console.export_text(styles=styles)


def draft_step(n: int, drafts: dict[int, int], settled=(), commits=None) -> StepEvent:
    row = RowCommit(0, tuple(drafts), tuple(drafts.values()), tuple(0.8 for _ in drafts))
    done = (
        ()
        if commits is None
        else (RowCommit(0, tuple(commits), tuple(commits.values()), (0.9,) * len(commits)),)
    )
    return StepEvent(n, 0, n, (0, 4), n == 0, None, n + 1, done, drafts=(row,), settled=settled)


def test_the_view_shows_a_token_being_replaced_and_the_canvas_settling():
    s = DecodeSettings(gen_length=4, block_length=4)
    view = CanvasView(s, spoken, stop_ids=(9,), uniform=True)
    view.update(draft_step(0, {0: 1, 1: 2, 2: 3, 3: 1}), seconds=0.1)
    first = draw(view)
    assert "▶ B0 one two three one" in first and "~4 replaced" in first
    view.update(draft_step(1, {1: 4}), seconds=0.2)  # position 1: "two" replaced by "four"
    second = draw(view)
    assert "one four three one" in second and "two" not in second and "~1 replaced" in second
    styled = draw(view, styles=True)
    assert "\x1b[3;4;" in styled.split("four", 1)[0].rsplit("one", 1)[1]  # italic+underlined
    view.update(draft_step(2, {}, settled=(0,), commits={0: 1, 1: 4, 2: 3, 3: 9}), seconds=0.3)
    third = draw(view)
    assert "settled at step 3 (stable and confident)" in third and "+4 tokens" in third
    view.finish(DecodeResult([[1, 4, 3, 9]], [[2] * 4], [3], 3, 3, 0.3))
    assert "one four three ∎" in draw(view) and "(done)" in draw(view)


# --- profiles, bench, torchrun --------------------------------------------------------------


def test_profiles_show_says_which_settings_apply(gemma_profile_file):
    result = invoke("profiles", "show", str(gemma_profile_file))
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if "│" in line}
    assert "model family: diffusion_gemma" in result.stdout
    assert "max_new_tokens" in rows["decode.gen_length"]
    assert "max_denoising_steps" in rows["decode.steps"]
    assert "not used" in rows["decode.cache"] and "not used" in rows["decode.temperature"]
    shipped = invoke("profiles", "show", "diffusiongemma-26b-a4b-it")
    assert "diffusion_gemma" in shipped.stdout and "t_min" in shipped.stdout
    llada = invoke("profiles", "show", "tiny-gsm")
    assert "LLaDA does not use t_min" in llada.stdout


def test_bench_runs_the_baseline(gemma_profile_file, tmp_path):
    out = tmp_path / "bench.json"
    args = [
        "bench",
        "-p",
        str(gemma_profile_file),
        "--gen-length",
        "16",
        "--n",
        "2",
        "--shots",
        "0",
    ]
    result = invoke(*args, "--json", str(out))
    assert result.exit_code == 0, result.output
    assert "only the baseline applies" in result.stderr
    (record,) = json.loads(out.read_text())
    assert record["strategy"] == "baseline" and record["n"] == 2
    assert record["forwards"] > 0 and record["tokens_per_forward"] > 0
    refused = invoke(*args, "--strategies", "baseline,dual")
    assert refused.exit_code == 2 and "strategy 'dual': cache 'dual'" in error_lines(refused)[0]
    # throughput mode (synthetic prompts) goes through the same check
    synthetic = invoke(*args, "--prompt-length", "6", "--strategies", "baseline,dual")
    assert synthetic.exit_code == 2 and "strategy 'dual'" in error_lines(synthetic)[0]


def test_profiles_show_model_says_where_steps_come_from(gemma_ckpt, monkeypatch):
    """--model FOLDER: steps per canvas from generation_config.json; piped (no COLUMNS), no
    cell is folded at 80 columns (the folder's own values: tests/test_family_matrix.py)."""
    monkeypatch.delenv("COLUMNS")
    result = invoke("profiles", "show", "--model", str(gemma_ckpt.folder))
    assert result.exit_code == 0, result.output
    rows = {
        line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
        for line in result.stdout.splitlines()
        if "│" in line
    }
    assert rows["decode.steps"][0] == "unset (12 per canvas from generation_config.json)"
    assert rows["model.path"][0] == str(gemma_ckpt.folder)  # one line, not folded


@pytest.mark.slow
def test_text_output_never_writes_control_bytes(gemma_ckpt):
    """A random checkpoint's byte tokens (NUL, 0x01 here) reach stdout as `\\xNN` escapes."""
    result = invoke("generate", "--model", str(gemma_ckpt.folder), "--gen-length", "32", "hi")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert not [c for c in out if (ord(c) < 32 and c not in "\n\t") or 0x7F <= ord(c) < 0xA0]
    assert "\\x00" in out  # this folder's answer holds a NUL, shown escaped
