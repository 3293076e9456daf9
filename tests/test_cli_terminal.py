"""Records reach stdout (a file, a pipe) while stderr is a real terminal, and none is drawn there.

Each test runs the real `python -m dllm_cli` in a subprocess with stderr on a pseudo-terminal
(os.openpty), as a user typing `dllm generate --json < q.txt > a.jsonl` has it, so Rich's
live displays (the batch bar, eval's bar) are really drawn. The shipped model, tiny lengths.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = [
    "Sam has 3 cards. He finds 4 more cards. How many cards does Sam have now?",
    "Ben has 9 eggs. He uses 2 eggs. How many eggs does Ben have now?",
    "Mia has 4 bags of marbles. Each bag has 6 marbles. How many marbles does Mia have now?",
]
TINY = ["-p", "tiny-gsm", "--gen-length", "24", "--block-length", "8"]
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Za-z0-9]|\x1b[=>]")


def read_all(fd: int) -> bytes:
    """Everything written to a pty's master until every writer has closed it."""
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the slave side is closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def screen(raw: bytes) -> str:
    """What the terminal showed, escape sequences and carriage returns removed."""
    return _ANSI.sub("", raw.decode("utf-8", "replace")).replace("\r", "")


def run_dllm(tmp: Path, args: list[str], stdin: str = "", stdout: str = "file"):
    """(exit code, stdout text, terminal text): stderr on a pty, stdout a file/pipe/pty."""
    master, slave = os.openpty()
    out_master = None
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TERM": "xterm-256color",
        "COLUMNS": "100",
        "PYTHONPATH": str(ROOT),
    }
    env.pop("NO_COLOR", None)
    (tmp / "in.txt").write_text(stdin)
    out_path = tmp / "out.txt"
    with open(tmp / "in.txt", "rb") as inp, open(out_path, "wb") as out_file:
        if stdout == "file":
            target = out_file
        elif stdout == "pipe":
            target = subprocess.PIPE
        else:
            out_master, target = os.openpty()
        proc = subprocess.Popen(
            [sys.executable, "-m", "dllm_cli", *args],
            stdin=inp, stdout=target, stderr=slave, env=env, cwd=tmp,
        )  # fmt: skip
        os.close(slave)
        if out_master is not None:
            os.close(target)
        terminal = read_all(master)
        if stdout == "pipe":
            text = proc.stdout.read().decode()
            proc.stdout.close()
        elif stdout == "tty":
            text = screen(read_all(out_master))
        proc.wait(timeout=300)
    if stdout == "file":
        text = out_path.read_text()
    return proc.returncode, text, screen(terminal)


def assert_records_only_on_stdout(code: int, text: str, terminal: str, expected: int) -> None:
    assert code == 0, terminal
    lines = text.splitlines()
    assert len(lines) == expected, (text, terminal)
    for line in lines:
        assert line.strip(), f"an empty answer proves nothing: {text!r}"
        assert line not in terminal, f"record drawn on the terminal: {line!r}\n{terminal}"
    assert "Traceback" not in terminal


# Every mode, batching and sink at least once (each run is a fresh process: kept to four).
BATCHES = [
    ("text", "static", "file"),
    ("text", "continuous", "pipe"),
    ("json", "static", "pipe"),
    ("json", "continuous", "file"),
]


@pytest.mark.parametrize(("mode", "batching", "sink"), BATCHES)
def test_batch_records_go_to_stdout_with_stderr_a_terminal(tmp_path, mode, batching, sink):
    json_flag = ["--json"] if mode == "json" else []
    args = ["generate", *TINY, "--batching", batching, "--batch-size", "2", *json_flag]
    code, text, terminal = run_dllm(tmp_path, args, "\n".join(QUESTIONS) + "\n", sink)
    assert_records_only_on_stdout(code, text, terminal, len(QUESTIONS))
    if mode == "json":
        assert [json.loads(line)["line"] for line in text.splitlines()] == [1, 2, 3]


@pytest.mark.parametrize(("mode", "sink"), [("text", "file"), ("json", "pipe")])
def test_single_answer_goes_to_stdout_with_stderr_a_terminal(tmp_path, mode, sink):
    json_flag = ["--json"] if mode == "json" else []
    code, text, terminal = run_dllm(
        tmp_path, ["generate", *TINY, *json_flag, QUESTIONS[0]], "", sink
    )
    assert_records_only_on_stdout(code, text, terminal, 1)


def test_streamed_answer_is_on_stdouts_terminal_only(tmp_path):
    """stdout a terminal too (the answer streams there): nothing of it on stderr's terminal."""
    code, text, terminal = run_dllm(tmp_path, ["generate", *TINY, QUESTIONS[1]], "", "tty")
    assert code == 0 and text.strip(), terminal
    assert text.strip() not in terminal


def test_eval_json_goes_to_stdout_with_stderr_a_terminal(tmp_path):
    args = ["eval", *TINY, "--n", "2", "--shots", "1", "--no-warmup", "--json"]
    code, text, terminal = run_dllm(tmp_path, args, "", "file")
    assert_records_only_on_stdout(code, text, terminal, 1)
    assert json.loads(text)["n"] == 2


def test_bench_table_and_json_with_stderr_a_terminal(tmp_path):
    args = [
        "bench", "-p", "tiny-gsm", "--gen-length", "16", "--block-length", "8", "--n", "1",
        "--shots", "1", "--strategies", "baseline", "--no-warmup", "--json", "bench.json",
    ]  # fmt: skip
    code, text, terminal = run_dllm(tmp_path, args, "", "pipe")
    assert code == 0, terminal
    records = json.loads((tmp_path / "bench.json").read_text())
    assert [r["strategy"] for r in records] == ["baseline"]
    assert "baseline" in text and "accuracy" in text  # the table, on stdout
    table_rows = [line for line in text.splitlines() if "baseline" in line]
    assert all(row not in terminal for row in table_rows), terminal
