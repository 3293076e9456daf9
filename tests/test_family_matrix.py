"""Every feature on every family (issue 36, item 4), at the CLI: one row per families.py family
(and LLaDA2.1's editing), each on its tiny random folder; a cell either decodes or is refused
in one line, exit 2, with the reason the family table gives. The serve, Python API and
torchrun cells are in test_family_matrix_serve.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from cli_fixtures import error_lines, invoke, isolated_fixture  # noqa: F401
from family_matrix import (  # noqa: F401
    GEN,
    PROMPTS,
    WORD_LEVEL,
    WRITERS,
    expected_refusal,
    folder_fixture,
    matrix_folders_fixture,
    model_args,
    row_fixture,
)

from dllm_cli import bench
from dllm_cli.commands.common import CONTROLS
from dllm_cli.families import FAMILIES
from dllm_cli.family_settings import read_json_value
from dllm_cli.settings import CACHES, UNMASKS

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gen_family_table.py"


def test_every_family_has_a_tiny_folder_writer():
    assert set(FAMILIES) <= set(WRITERS), set(FAMILIES) - set(WRITERS)


def test_the_docs_feature_table_is_the_family_tables():
    """docs/families.md's table is what the script writes from families.py (not by hand)."""
    spec = importlib.util.spec_from_file_location("gen_family_table", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    page = script.TARGET.read_text(encoding="utf-8")
    assert script.render(page) == page, "docs/families.md is stale: run the script"


def generate_json(args: list[str], *prompts: str, stdin: str | None = None) -> list[dict]:
    """`dllm generate --json ARGS PROMPT` (or stdin lines): its records, after exit 0."""
    result = invoke("generate", *prompts, *args, "--json", input=stdin)
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.stdout.splitlines()]


def answer(record: dict) -> tuple[str, list[int]]:
    return record["text"], record["token_ids"]


def check_decoded(record: dict) -> None:
    """A real answer: tokens within the length, at least one forward."""
    assert 0 < len(record["token_ids"]) <= GEN and record["forwards"] > 0, record


def test_generate_text_is_the_json_answer(row, folder):
    args = model_args(row, folder)
    text = invoke("generate", PROMPTS[0], *args)
    assert text.exit_code == 0, text.output
    (record,) = generate_json(args, PROMPTS[0])
    check_decoded(record)
    assert text.stdout == record["text"].translate(CONTROLS) + "\n"


def test_chat_answers_the_first_turn_as_generate_does(row, folder):
    """`dllm chat`, piped: the first answer is generate's for the same prompt (both through
    the chat template), LLaDA2.1's edits included."""
    args = model_args(row, folder)
    (record,) = generate_json(args, PROMPTS[0])
    result = invoke("chat", *args, input=f"{PROMPTS[0]}\n/exit\n")
    assert result.exit_code == 0, result.output
    check_decoded(record)
    assert result.stdout == record["text"].translate(CONTROLS) + "\n", (record, result.stdout)


def test_stdin_batch_static_and_continuous_equal_each_prompt_alone(row, folder):
    args, stdin = model_args(row, folder), "".join(f"{p}\n" for p in PROMPTS)
    alone = [answer(r) for r in generate_json([*args, "--batch-size", "1"], "-", stdin=stdin)]
    for batching in ("static", "continuous"):
        batch = [*args, "--batch-size", "2", "--batching", batching]
        assert [answer(r) for r in generate_json(batch, "-", stdin=stdin)] == alone, batching


def test_lines_of_their_own_lengths_each_equal_their_alone_decode(row, folder):
    """--json-input lines of different gen_lengths in one run: each the single run's answer at
    its own --gen-length."""
    lengths = (GEN // 2, GEN, GEN // 2 + 3)
    lines = [
        json.dumps({"prompt": p, "gen_length": g}) for p, g in zip(PROMPTS, lengths, strict=True)
    ]
    stdin = "\n".join(lines) + "\n"
    args = [*model_args(row, folder), "--json", "--json-input", "--batch-size", "3"]
    result = invoke("generate", "-", *args, input=stdin)
    records = [json.loads(line) for line in result.stdout.splitlines()]
    for p, g, record in zip(PROMPTS, lengths, records, strict=True):
        own = ["--model", str(folder), "--gen-length", str(g), *row.flags()]
        assert answer(record) == answer(generate_json(own, p)[0]), (g, record)


def test_visualize_saves_the_player_and_the_final_frame(row, folder, tmp_path):
    for name in ("steps.html", "final.svg"):
        out = tmp_path / name
        result = invoke("visualize", PROMPTS[0], *model_args(row, folder), "--save", str(out))
        assert result.exit_code == 0, result.output
        assert "<svg" in out.read_text() if name.endswith("svg") else "<html" in out.read_text()


def test_eval_data_scores_a_jsonl_file_and_names_the_family_settings(row, folder, tmp_path):
    data = tmp_path / "data.jsonl"
    lines = [{"question": q, "answer": f"#### {i}"} for i, q in enumerate(PROMPTS)]
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["--data", str(data), "--shots", "1", "--no-warmup"]
    result = invoke("eval", *model_args(row, folder), *args)
    assert result.exit_code == 0, result.output
    summary = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    assert "/2 " in summary["accuracy"], summary  # the first line is the shot
    shown = [*FAMILIES[row.family].summary, *row.settings]
    assert all(f" {key}=" in summary["settings"] for key in shown), summary["settings"]


def test_profiles_show_model_reports_the_folders_own_values(row, folder, monkeypatch):
    """The settings the family reads from its folder, with the file they came from."""
    monkeypatch.delenv("COLUMNS")  # piped: cells stay whole
    result = invoke("profiles", "show", "--model", str(folder))
    assert result.exit_code == 0, result.output
    rows = {
        line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
        for line in result.stdout.splitlines()
        if "│" in line
    }
    family = FAMILIES[row.family]
    for key, (name, dotted) in family.folder_values.items():
        value = read_json_value(folder, name, dotted)
        assert rows[f"decode.{key}"][:2] == [str(value), f"checkpoint {name}"], key
    assert f"{family.name} reference:" in result.stdout


def test_bench_runs_one_tiny_baseline(row, folder, tmp_path):
    out = tmp_path / "bench.json"
    args = ["--n", "1", "--shots", "0", "--strategies", "baseline", "--no-warmup"]
    result = invoke("bench", *model_args(row, folder), *args, "--json", str(out))
    assert result.exit_code == 0, result.output
    (record,) = json.loads(out.read_text())
    assert record["strategy"] == "baseline" and record["forwards"] > 0, record
    kept = {k: v for k, v in row.settings.items() if k not in bench.REFERENCE}  # strategy's own
    assert {k: record["settings"][k] for k in kept} == kept, record["settings"]


def check_cell(row, folder, key: str, value: str) -> None:
    """`--KEY VALUE` decodes, or is refused in one line (exit 2) with the table's reason."""
    args = [*model_args(row, folder), f"--{key}", value]
    why = expected_refusal(row, key, value)
    if why is None:
        check_decoded(generate_json(args, PROMPTS[1])[0])
        return
    result = invoke("generate", PROMPTS[1], *args)
    assert result.exit_code == 2, result.output
    (line,) = error_lines(result)
    assert f"{key} {value!r} (from the command line) does not apply" in line and why in line
    assert "Traceback" not in result.output


@pytest.mark.parametrize("cache", CACHES)
def test_every_cache_policy_decodes_or_is_refused_by_the_family_table(row, folder, cache):
    check_cell(row, folder, "cache", cache)


@pytest.mark.parametrize("unmask", UNMASKS)
def test_every_unmask_rule_decodes_or_is_refused_by_the_family_table(row, folder, unmask):
    check_cell(row, folder, "unmask", unmask)


@pytest.mark.parametrize(
    "feature, flags",
    [("quantize", ["--quantize", "int8"]), ("logprobs", ["--logprobs", "2"])],
    ids=["quantize-int8", "logprobs"],
)
def test_a_feature_decodes_or_is_refused_by_the_family_table(row, folder, feature, flags):
    """`--quantize int8`, `--logprobs K`: an answer (with a log-probability per token), or
    one line, exit 2, with the family's `cannot` reason."""
    args = [*model_args(row, folder), *flags]
    why = FAMILIES[row.family].cannot.get(feature)
    if why is None:
        (record,) = generate_json(args, PROMPTS[1])
        check_decoded(record)
        assert feature != "logprobs" or len(record["logprobs"]) == len(record["token_ids"])
        return
    result = invoke("generate", PROMPTS[1], *args)
    assert result.exit_code == 2, result.output
    (line,) = error_lines(result)
    assert f"{flags[0]} " in line and "does not apply" in line and why in line, line


def test_json_schema_answers_are_valid_or_refused_by_the_family_table(row, folder, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "integer"}')
    args = [*model_args(row, folder), "--json-schema", str(schema)]
    result = invoke("generate", PROMPTS[1], *args, "--json")
    why = FAMILIES[row.family].cannot.get("grammar")
    if why is not None:
        assert result.exit_code == 2, result.output
        (line,) = error_lines(result)
        assert "--json-schema does not apply" in line and why in line, line
    elif row.family in WORD_LEVEL:  # every word begins with a space: no integer can begin
        assert result.exit_code == 4, result.output  # the input cannot be decoded
        (line,) = error_lines(result)
        assert "vocabulary cannot write" in line, line
    else:
        assert isinstance(json.loads(json.loads(result.stdout)["text"]), int), result.stdout
