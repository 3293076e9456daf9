"""`dllm generate -`: stdin batches keep input order, isolate bad lines, keep finished output."""

from __future__ import annotations

import json
import re

import pytest
from cli_fixtures import (  # noqa: F401
    CONTEXT,
    GEN,
    PROMPTS,
    cli_ckpt_fixture,
    error_lines,
    invoke,
    isolated_fixture,
    profile_file_fixture,
)
from guided_fixtures import shared_tinygsm_pair, tinygsm_profile

from dllm_cli import batch
from dllm_cli.decoding import Finished, StepOutput
from dllm_cli.errors import DeviceError, InputError
from dllm_cli.runtime import open_runtime

TOO_LONG = " ".join(["apples"] * CONTEXT)


def singles(profile) -> list[dict]:
    return [json.loads(invoke("generate", p, "-p", str(profile), "--json").stdout) for p in PROMPTS]


@pytest.mark.parametrize("size", [1, 2, 8])
def test_batches_answer_in_input_order_like_single_runs(profile_file, size):
    stdin = "\n".join(PROMPTS) + "\n"
    result = invoke(
        "generate", "-", "-p", str(profile_file), "--json", "--batch-size", str(size), input=stdin
    )
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["line"] for r in records] == [1, 2, 3]
    for record, single in zip(records, singles(profile_file), strict=True):
        assert record["prompt"] == single["prompt"]
        assert record["token_ids"] == single["token_ids"] and record["text"] == single["text"]


def test_piped_stdin_without_a_prompt_is_batch_mode(profile_file):
    stdin = "\n".join(PROMPTS) + "\n"
    dash = invoke("generate", "-", "-p", str(profile_file), input=stdin)
    piped = invoke("generate", "-p", str(profile_file), input=stdin)
    assert dash.exit_code == piped.exit_code == 0
    assert piped.stdout == dash.stdout
    assert piped.stdout.splitlines() == [s["text"] for s in singles(profile_file)]


def test_bad_lines_get_error_records_in_json(profile_file):
    stdin = f"{PROMPTS[0]}\n\n{TOO_LONG}\n{PROMPTS[1]}\n"
    result = invoke("generate", "-p", str(profile_file), "--json", "--batch-size", "2", input=stdin)
    assert result.exit_code == InputError.exit_code
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["line"] for r in records] == [1, 2, 3, 4]
    assert "text" in records[0] and "text" in records[3]
    assert records[1] == {"line": 2, "prompt": "", "error": "empty prompt"}
    assert records[2]["prompt"] == TOO_LONG and "prompt too long" in records[2]["error"]
    expected = singles(profile_file)
    assert records[3]["token_ids"] == expected[1]["token_ids"]
    assert "2 of 4 prompts failed" in result.stderr and "Traceback" not in result.output


def test_bad_lines_in_text_mode_keep_line_numbers(profile_file):
    stdin = f"{PROMPTS[0]}\n\n{PROMPTS[1]}\n"
    result = invoke("generate", "-p", str(profile_file), input=stdin)
    assert result.exit_code == InputError.exit_code
    texts = [s["text"] for s in singles(profile_file)]
    assert result.stdout.splitlines() == [texts[0], "", texts[1]]
    assert error_lines(result)[0] == "dllm: error: line 2: empty prompt"


def test_json_input_reads_the_prompt_field(profile_file):
    lines = [json.dumps({"prompt": PROMPTS[0], "id": 7}), "not json", json.dumps({"q": 1})]
    result = invoke(
        "generate", "-", "-p", str(profile_file), "--json", "--json-input", input="\n".join(lines)
    )
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert (
        records[0]["prompt"] == PROMPTS[0]
        and records[0]["text"] == singles(profile_file)[0]["text"]
    )
    assert records[1]["prompt"] == "not json" and "not a JSON object" in records[1]["error"]
    assert '"prompt" field' in records[2]["error"]
    assert result.exit_code == InputError.exit_code


def test_json_input_lines_bring_their_own_sampling(profile_file):
    """A line's gen_length / temperature / seed are its own: its answer is the single run's
    with those flags, beside lines that decode otherwise; settings that cannot change per line
    are refused."""
    own = [{"temperature": 1.0, "seed": 3}, {}, {"temperature": 1.0, "seed": 4}, {"gen_length": 5}]
    lines = [json.dumps({"prompt": PROMPTS[i % 2], **o}) for i, o in enumerate(own)]
    lines.append(json.dumps({"prompt": PROMPTS[0], "cache": "dual"}))
    result = invoke(
        "generate", "-", "-p", str(profile_file), "--json", "--json-input", "--batch-size", "3",
        input="\n".join(lines),
    )  # fmt: skip
    records = [json.loads(line) for line in result.stdout.splitlines()]
    for i, o in enumerate(own):
        flags = [x for k, v in o.items() for x in ("--" + k.replace("_", "-"), str(v))]
        single = invoke("generate", PROMPTS[i % 2], "-p", str(profile_file), "--json", *flags)
        assert records[i]["token_ids"] == json.loads(single.stdout)["token_ids"]
    assert records[0]["token_ids"] != records[2]["token_ids"]
    assert len(records[3]["token_ids"]) <= 5 < len(records[1]["token_ids"])
    assert records[4]["error"].startswith("cache cannot change per request (engine setting")
    assert result.exit_code == InputError.exit_code


class FailingEngine:
    """A real engine that raises `exc` once, on the first step that decodes request `first`
    (0-based input order of the valid lines)."""

    def __init__(self, engine, exc: BaseException, first: int):
        self.engine, self.exc, self.first, self.raised = engine, exc, first, False

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self):
        out = self.engine.step()
        if not self.raised and any(r.id >= self.first for r in self.engine.live):
            self.raised = True
            raise self.exc
        return out


def failing_engines(monkeypatch, exc: BaseException, first: int) -> None:
    real = batch.open_engine
    monkeypatch.setattr(
        batch, "open_engine", lambda *a, **k: FailingEngine(real(*a, **k), exc, first)
    )


def test_an_input_error_from_the_engine_fails_only_its_batch(profile_file, monkeypatch):
    failing_engines(monkeypatch, InputError("engine says no"), first=0)
    stdin = "\n".join(PROMPTS) + "\n"
    args = ("--json", "--batch-size", "2", "--batching", "static")
    result = invoke("generate", "-p", str(profile_file), *args, input=stdin)
    assert result.exit_code == InputError.exit_code
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r.get("error") for r in records] == ["engine says no", "engine says no", None]


@pytest.mark.parametrize(
    ("exc", "code", "message"),
    [
        (RuntimeError("out of memory"), 70, "internal error"),
        (KeyboardInterrupt(), 130, "interrupted"),
    ],
)
def test_a_later_batch_failing_keeps_finished_output(profile_file, monkeypatch, exc, code, message):
    failing_engines(monkeypatch, exc, first=2)  # the second batch
    stdin = "\n".join(PROMPTS) + "\n"
    args = ("--json", "--batch-size", "2", "--batching", "static")
    result = invoke("generate", "-p", str(profile_file), *args, input=stdin)
    assert result.exit_code == code
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["line"] for r in records] == [1, 2]
    assert message in result.stderr and "Traceback" not in result.output


@pytest.mark.parametrize(
    ("exc", "code", "message"),
    [
        (RuntimeError("out of memory"), 70, "internal error"),
        (KeyboardInterrupt(), 130, "interrupted"),
    ],
)
def test_continuous_failure_keeps_every_finished_line(
    profile_file, monkeypatch, exc, code, message
):
    failing_engines(monkeypatch, exc, first=1)  # the step after the first answer
    stdin = "\n".join(PROMPTS) + "\n"
    args = ("--json", "--batch-size", "1", "--batching", "continuous")
    result = invoke("generate", "-p", str(profile_file), *args, input=stdin)
    assert result.exit_code == code
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert records, "the first finished answer must have been written"
    assert [r["line"] for r in records] == list(range(1, len(records) + 1))
    assert len(records) < len(PROMPTS)
    assert message in result.stderr and "Traceback" not in result.output


class OutOfOrderEngine:
    """An engine whose second prompt finishes first, then `exc` stops it."""

    exc: BaseException = KeyboardInterrupt()
    forwards = guide_forwards = steps = served = 0
    seconds = 0.0

    def __init__(self, *args, **kwargs):
        self.keys, self.calls = [], 0

    def add(self, ids, key=None, settings=None, sampling=None):
        self.keys.append(key)
        return len(self.keys) - 1

    waiting = property(lambda self: 0)
    running = property(lambda self: len(self.keys))
    has_work = property(lambda self: bool(self.keys))

    def step(self):
        self.calls += 1
        if self.calls > 1:
            raise self.exc
        done = Finished(1, self.keys[1], [5, 6], [0, 0], 1, 1, 1, 0, 0.1)  # line 2, not line 1
        return StepOutput(0, [done])


@pytest.mark.parametrize(
    ("exc", "code", "reason"),
    [(KeyboardInterrupt(), 130, "not decoded: interrupted"), (DeviceError("no"), 5, "no")],
)
def test_a_stopped_continuous_run_keeps_answers_finished_out_of_order(
    profile_file, monkeypatch, exc, code, reason
):
    """Line 2 finished while line 1 was decoding: line 2's answer still goes out, behind an
    error record for line 1; line 3 (never finished) gets none. (An InputError from a step
    fails only the requests it was decoding: test_an_input_error_from_the_engine_...)"""
    monkeypatch.setattr(OutOfOrderEngine, "exc", exc)
    monkeypatch.setattr(batch, "open_engine", OutOfOrderEngine)
    stdin = "\n".join(PROMPTS) + "\n"
    args = ("--json", "--batch-size", "2", "--batching", "continuous")
    result = invoke("generate", "-p", str(profile_file), *args, input=stdin)
    assert result.exit_code == code
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["line"] for r in records] == [1, 2]
    assert reason in records[0]["error"] and "error" not in records[1]
    assert records[1]["token_ids"] == [5, 6]
    text = invoke("generate", "-p", str(profile_file), *args[1:], input=stdin)
    assert text.stdout.split("\n")[0] == "" and f"line 1: {reason}" in text.stderr


@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_both_batchings_give_the_single_run_answers(profile_file, batching):
    stdin = "\n".join(PROMPTS) + "\n"
    args = ("--json", "--batch-size", "2", "--batching", batching, "--stats")
    result = invoke("generate", "-", "-p", str(profile_file), *args, input=stdin)
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["token_ids"] for r in records] == [s["token_ids"] for s in singles(profile_file)]
    assert "prompts/s" in result.stderr and "rows/forward" in result.stderr


def test_one_line_escapes_newlines_reversibly():
    assert batch.one_line("a\nb\\n\r") == "a\\nb\\\\n\\r"


def test_guided_batches_decode_continuously_with_the_static_text(tmp_path_factory, tmp_path):
    model, guide = shared_tinygsm_pair(tmp_path_factory)
    profile = tinygsm_profile(tmp_path / "p" / "guided.toml", model, guide)
    stdin = "1 + 1\n2 + 2\n3 + 3\n"
    args = ("--batch-size", "2", "--json")
    asked = invoke("generate", "-p", str(profile), "--batching", "continuous", *args, input=stdin)
    static = invoke("generate", "-p", str(profile), "--batching", "static", *args, input=stdin)
    assert asked.exit_code == static.exit_code == 0, asked.output
    texts = [[json.loads(line)["text"] for line in r.stdout.splitlines()] for r in (asked, static)]
    assert texts[0] == texts[1] and len(texts[0]) == 3
    assert "falls back" not in asked.stderr + static.stderr


def test_json_token_ids_are_the_answer_and_the_canvas_on_request(profile_file):
    """token_ids: what `text` decodes (cut before the first stop token); --json-canvas adds
    canvas_ids, every generated position."""
    # token 47, frequent in this model's answers, made EOS: answers end early (test_eval.py)
    profile_file.write_text(profile_file.read_text() + "\n[model.special]\neos = 47\n")
    stdin = "\n".join(PROMPTS) + "\n"
    result = invoke("generate", "-p", str(profile_file), "--json-canvas", input=stdin)
    assert result.exit_code == 0, result.output
    runtime = open_runtime(str(profile_file))
    stop = runtime.loaded.special.stop
    for line in result.stdout.splitlines():
        r = json.loads(line)
        ids, canvas = r["token_ids"], r["canvas_ids"]
        assert len(canvas) == GEN and canvas[: len(ids)] == ids
        assert not set(ids) & set(stop) and runtime.text(ids) == r["text"]
        assert len(ids) == GEN or canvas[len(ids)] in stop
    plain = invoke("generate", "-p", str(profile_file), "--json", input=stdin)
    for line, canvas_line in zip(
        plain.stdout.splitlines(), result.stdout.splitlines(), strict=True
    ):
        r, c = json.loads(line), json.loads(canvas_line)
        assert "canvas_ids" not in r and r["token_ids"] == c["token_ids"]
    assert any(len(json.loads(x)["token_ids"]) < GEN for x in plain.stdout.splitlines())


def test_static_batch_records_carry_per_prompt_figures(profile_file):
    """One static batch of three: each record's steps and seconds are its own (the longest
    answer's steps are the batch's), not the batch's totals on every row."""
    stdin = "\n".join(PROMPTS) + "\n"
    args = ("--json", "--batch-size", "3", "--batching", "static", "--stats")
    result = invoke("generate", "-p", str(profile_file), *args, input=stdin)
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.splitlines()]
    stats = re.search(r"(\d+) steps, ([\d.]+) s,", result.stderr)
    steps, seconds = int(stats[1]), float(stats[2])
    assert max(r["steps"] for r in records) == steps
    assert all(1 <= r["steps"] <= steps for r in records)
    assert all(0 < r["seconds"] <= seconds + 0.01 for r in records)


def test_ctrl_c_says_how_many_lines_were_written(profile_file, monkeypatch):
    failing_engines(monkeypatch, KeyboardInterrupt(), first=2)  # the second batch
    stdin = "\n".join(PROMPTS) + "\n"
    args = ("--batch-size", "2", "--batching", "static")
    result = invoke("generate", "-p", str(profile_file), *args, input=stdin)
    assert result.exit_code == 130
    assert len(result.stdout.splitlines()) == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "dllm: interrupted: 2 lines written; line 3 read but not written; "
        "stdin past line 3 not read"
    )
