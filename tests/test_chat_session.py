"""`dllm chat` in a real pseudo-terminal: prompt_toolkit's line, two questions, /reset, /set,
Ctrl-C during an answer (the session goes on, the stopped answer is not kept), /exit."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import subprocess
import sys
import termios
import time
from pathlib import Path

from cli_fixtures import invoke

ROOT = Path(__file__).resolve().parent.parent
# Escape sequences, carriage returns and backspaces (prompt_toolkit draws its prompt as `>`,
# a backspace, then "cursor forward 2": that move becomes spaces).
FORWARD = re.compile(r"\x1b\[(\d*)C")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\x1b[=>]|\r|\x08")


def plain(text: str) -> str:
    text = FORWARD.sub(lambda m: " " * int(m.group(1) or 1), text)
    return ANSI.sub("", text)


FIRST = "Tom has 3 apples and buys 2 more. How many apples does he have?"
SECOND = "Ann has 10 pens and gives 4 away. How many pens are left?"


def take_terminal() -> None:
    """In the child: the pty becomes its controlling terminal, so Ctrl-C is a SIGINT."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    """A process on the slave side of a pty; what it wrote, escapes removed."""

    def __init__(self, args: list[str]):
        self.master, slave = pty.openpty()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        env |= {"TERM": "xterm-256color", "PROMPT_TOOLKIT_NO_CPR": "1", "COLUMNS": "200"}
        self.proc = subprocess.Popen(
            args, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=ROOT,
            start_new_session=True, preexec_fn=take_terminal,
        )  # fmt: skip
        os.close(slave)
        self.seen = ""

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    def expect(self, pattern: str, timeout: float = 120) -> str:
        """Read until `pattern` appears after what earlier calls consumed; that text."""
        deadline = time.monotonic() + timeout
        while True:
            found = re.search(pattern, self.seen)
            if found:
                before, self.seen = self.seen[: found.end()], self.seen[found.end() :]
                return before
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} in {self.seen[-2000:]!r}"
            ready, _, _ = select.select([self.master], [], [], min(left, 1.0))
            if ready:
                try:
                    chunk = os.read(self.master, 65536).decode(errors="replace")
                except OSError:  # the process closed the terminal
                    chunk = ""
                self.seen += plain(chunk)


def test_chat_through_a_pty():
    expected = invoke("generate", "--gen-length", "16", FIRST)
    assert expected.exit_code == 0
    answer = expected.stdout.strip()
    term = Terminal([sys.executable, "-m", "dllm_cli", "chat", "--gen-length", "16"])
    try:
        term.expect(r"to leave\n> ")
        term.send(FIRST + "\r")
        assert answer in term.expect(r"\n> ")  # alone in the conversation: generate's answer
        term.send(SECOND + "\r")
        second = term.expect(r"\n> ")
        assert SECOND in second and len(second.strip()) > len(SECOND)
        term.send("/reset\r")
        term.expect(r"conversation cleared\n> ")
        slow = ("gen_length=1536", "guide=false", "cache=none", "unmask=fixed", "early_stop=false")
        for setting in slow:
            term.send(f"/set {setting}\r")
            term.expect(r"for the next answers\n> ")
        term.send(FIRST + "\r")  # a slow answer: one token per step over 1536 positions
        term.expect(re.escape(FIRST))  # the line as typed
        time.sleep(2)
        term.send("\x03")
        term.expect(r"answer stopped[^\n]*\n> ")
        back = ("gen_length=16", "guide=true", "cache=freecache", "unmask=threshold")
        for setting in (*back, "early_stop=true"):
            term.send(f"/set {setting}\r")
            term.expect(r"for the next answers\n> ")
        term.send(FIRST + "\r")  # the stopped answer was not kept: generate's answer again
        assert answer in term.expect(r"\n> ")
        term.send("/exit\r")
        assert term.proc.wait(timeout=30) == 0
    finally:
        term.proc.kill()
        os.close(term.master)
