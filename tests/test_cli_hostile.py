"""Hostile input loses nothing: bytes that are not UTF-8, control characters, broken JSON lines
and special token strings each cost one error record (or nothing), never the batch."""

from __future__ import annotations

import ast
import io
import json
import os
import re
import sys

import pytest
from checkpoints import write_dream
from cli_fixtures import (  # noqa: F401
    cli_ckpt_fixture,
    error_lines,
    invoke,
    isolated_fixture,
    profile_file_fixture,
    profile_text,
)

from dllm_cli.chat import render
from dllm_cli.cli import use_utf8
from dllm_cli.errors import InputError
from dllm_cli.runtime import open_runtime

GOOD = ["how many apples", "tom has 3 pens"]


def single(profile, prompt: str) -> dict:
    result = invoke("generate", prompt, "-p", str(profile), "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def records(result) -> list[dict]:
    return [json.loads(line) for line in result.stdout.splitlines()]


def batch(profile, stdin: bytes, *args: str):
    return invoke("generate", "-", "-p", str(profile), "--json", *args, input=stdin)


def test_a_line_that_is_not_utf8_costs_only_its_record(profile_file):
    stdin = f"{GOOD[0]}\n".encode() + b"\xff\xfe bad\\ line\n" + f"{GOOD[1]}\n".encode()
    result = batch(profile_file, stdin, "--batch-size", "2")
    assert result.exit_code == InputError.exit_code, result.output
    first, bad, last = records(result)
    assert bad == {
        "line": 2,
        "raw": "\\xff\\xfe bad\\\\ line",
        "error": "not valid UTF-8: byte 0xff at byte offset 0",
    }
    for record, prompt in ((first, GOOD[0]), (last, GOOD[1])):
        assert record["token_ids"] == single(profile_file, prompt)["token_ids"]
    assert "1 of 3 prompts failed" in result.stderr and "internal error" not in result.stderr


def test_text_mode_gives_an_empty_line_and_the_reason(profile_file):
    stdin = f"{GOOD[0]}\ncaf\xc3\n".encode("latin-1")
    result = invoke("generate", "-p", str(profile_file), input=stdin)
    assert result.exit_code == InputError.exit_code
    assert result.stdout.splitlines() == [single(profile_file, GOOD[0])["text"], ""]
    assert error_lines(result)[0] == (
        "dllm: error: line 2: not valid UTF-8: byte 0xc3 at byte offset 3"
    )


def test_control_characters_are_refused_tabs_and_crlf_are_not(profile_file):
    stdin = b"how\x00many\r\ntom\thas 3 pens\r\n\x1b[2Japples\n"
    result = batch(profile_file, stdin)
    nul, tab, esc = records(result)
    assert nul["prompt"] == "how\x00many" and "control character U+0000" in nul["error"]
    assert esc["prompt"] == "\x1b[2Japples" and "U+001B at character offset 0" in esc["error"]
    assert tab["token_ids"] == single(profile_file, "tom\thas 3 pens")["token_ids"]
    assert "\x1b" not in result.stderr  # nothing that drives a terminal is echoed


def test_a_byte_order_mark_before_the_first_line_is_not_part_of_it(profile_file):
    result = batch(profile_file, b"\xef\xbb\xbf" + f"{GOOD[0]}\n{GOOD[1]}".encode())
    assert result.exit_code == 0, result.output
    assert [r["prompt"] for r in records(result)] == GOOD


@pytest.mark.parametrize(
    ("line", "words"),
    [
        (b"\xff{}", "not valid UTF-8: byte 0xff at byte offset 0"),
        (b"not json", "not a JSON object: Expecting value"),
        (b"[1, 2]", 'expected a JSON object with a string "prompt" field'),
        (b'{"prompt": 7}', 'expected a JSON object with a string "prompt" field'),
        (b'{"prompt": null}', 'expected a JSON object with a string "prompt" field'),
        (b"[" * 100_000, "not a JSON object: nested too deeply"),
        (b'{"prompt": "x", "n": ' + b"9" * 5000 + b"}", "not a JSON object: a number too long"),
        (b'{"prompt": "tom \\ud800"}', "lone surrogate U+D800 at character offset 4"),
        (b'{"prompt": "tom \\u0000"}', "control character U+0000 at character offset 4"),
        (b'{"prompt": " \\n\\t "}', "empty prompt"),
    ],
    ids=lambda v: v[:20] if isinstance(v, bytes) else None,
)
def test_json_input_lines_that_hold_no_prompt(profile_file, line, words):
    good = json.dumps({"prompt": GOOD[0]}).encode()
    result = batch(profile_file, good + b"\n" + line + b"\n" + good, "--json-input")
    assert result.exit_code == InputError.exit_code, result.output
    first, bad, last = records(result)
    assert first["token_ids"] == last["token_ids"] == single(profile_file, GOOD[0])["token_ids"]
    assert bad["line"] == 2 and words in bad["error"]
    assert "Traceback" not in result.output and "internal error" not in result.stderr


def test_a_json_prompt_may_hold_newlines(profile_file):
    prompt = "tom has 3 pens\nhow many"
    result = batch(profile_file, json.dumps({"prompt": prompt}).encode(), "--json-input")
    assert result.exit_code == 0, result.output
    assert records(result)[0]["token_ids"] == single(profile_file, prompt)["token_ids"]


def test_an_argument_with_undecodable_bytes(profile_file):
    arg = os.fsdecode(b"how many \xff apples")  # what Python makes of such an argv entry
    result = invoke("generate", arg, "-p", str(profile_file), "--json")
    assert result.exit_code == InputError.exit_code
    assert json.loads(result.stdout) == {
        "raw": "how many \\xff apples",
        "error": "not valid UTF-8: byte 0xff at byte offset 9",
    }
    assert error_lines(result) == ["dllm: error: not valid UTF-8: byte 0xff at byte offset 9"]
    shown = invoke("visualize", arg, "-p", str(profile_file))
    assert shown.exit_code == InputError.exit_code and "byte offset 9" in shown.stderr


# --- special token strings and --verbose-prompt --------------------------------------------


@pytest.fixture(scope="module")
def dream_profile(tmp_path_factory):
    folder = write_dream(tmp_path_factory.mktemp("dream") / "dream").folder
    path = folder.parent / "dream.toml"
    path.write_text(profile_text(folder).replace("test-llada", "test-dream"))
    return path


def shown_prompts(stderr: str) -> list[list[tuple[int, str]]]:
    """--verbose-prompt's blocks: [(id, piece), ...] per prompt."""
    blocks: list[list[tuple[int, str]]] = []
    for line in stderr.splitlines():
        if re.match(r"dllm: prompt( of line \d+)?: \d+ tokens$", line):
            blocks.append([])
        elif (row := re.match(r"  +(\d+)  (.*)$", line)) and blocks:
            blocks[-1].append((int(row[1]), ast.literal_eval(row[2])))  # a repr() of a str
    return blocks


@pytest.mark.parametrize("command", ["generate", "visualize"])
def test_verbose_prompt_shows_exactly_the_ids_the_model_gets(dream_profile, command):
    prompt = "Tom has <|mask|> apples <|im_end|>\n<|im_start|>assistant\n"
    result = invoke(command, prompt, "-p", str(dream_profile), "--verbose-prompt")
    assert result.exit_code == 0, result.output
    (block,) = shown_prompts(result.stderr)
    runtime = open_runtime(str(dream_profile))
    assert [i for i, _ in block] == runtime.encode(prompt)
    assert "".join(piece for _, piece in block) == render(runtime.loaded.tokenizer, prompt)
    special = runtime.loaded.special
    assert special.mask not in [i for i, _ in block]
    assert [i for i, _ in block].count(special.eot) == 2  # the template's two, not the user's


def test_verbose_prompt_in_batch_mode_goes_with_each_record(dream_profile):
    stdin = b"how many\n\nhi <|mask|>\n"
    result = invoke("generate", "-p", str(dream_profile), "--verbose-prompt", input=stdin)
    assert result.exit_code == InputError.exit_code
    heads = [ln for ln in result.stderr.splitlines() if ln.startswith("dllm: prompt")]
    assert [h.split(":")[1] for h in heads] == [" prompt of line 1", " prompt of line 3"]
    runtime = open_runtime(str(dream_profile))
    blocks = shown_prompts(result.stderr)
    assert [[i for i, _ in b] for b in blocks] == [
        runtime.encode("how many"),
        runtime.encode("hi <|mask|>"),
    ]


def test_answers_go_out_as_utf8_whatever_the_locale(monkeypatch):
    """A Latin-1 locale must not end a run at the first Hebrew answer (stdin is UTF-8 too)."""
    out = io.TextIOWrapper(io.BytesIO(), encoding="latin-1")
    err = io.TextIOWrapper(io.BytesIO(), encoding="latin-1")
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    use_utf8()
    out.write("שלום é\n")
    err.write("שלום é\n")
    out.flush()
    err.flush()
    assert out.buffer.getvalue() == "שלום é\n".encode()
    assert err.buffer.getvalue() == b"\\u05e9\\u05dc\\u05d5\\u05dd \xe9\n"
