"""`dllm visualize` as a user meets it: the live view on a real terminal (a pty), the saved
HTML player in a real headless browser (Chromium over the DevTools protocol), the SVG.

The shipped model and its guide decode the answer, so the words on screen are real ones.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

import pytest
from browser import Browser, find_chromium
from cli_fixtures import invoke, isolated_fixture  # noqa: F401

QUESTION = "Tom has 3 rolls. He buys 45 more rolls. How many rolls does he have?"
ARGS = ("visualize", QUESTION, "--gen-length", "64")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")
CHROMIUM = find_chromium()


def on_a_terminal(args: list[str], stdout: Path, columns: int = 120) -> str:
    """Run the CLI with stderr on a pseudo-terminal (stdout to a file); what the pty showed."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = os.environ | {"COLUMNS": str(columns), "OMP_NUM_THREADS": "1", "TERM": "xterm-256color"}
    with stdout.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dllm_cli", *args], stdout=out, stderr=slave, env=env
        )
    os.close(slave)
    shown, deadline = b"", time.monotonic() + 300
    while time.monotonic() < deadline:
        if not select.select([master], [], [], 1.0)[0]:
            continue
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        shown += chunk
    else:
        proc.kill()
    os.close(master)
    assert proc.wait(timeout=120) == 0, shown.decode(errors="replace")[-2000:]
    return ANSI.sub("", shown.decode("utf-8", errors="replace"))


@pytest.mark.slow
def test_live_view_on_a_terminal_shows_words_numbers_and_the_guided_order(tmp_path):
    answer = tmp_path / "answer.txt"
    shown = on_a_terminal(list(ARGS), answer)
    text = answer.read_text().strip()
    assert "48" in text.split()[-1]  # the shipped pair answers this one right
    final = shown[shown.rindex("(done)") :]
    assert "guided: left to right (--no-guide: diffusion order)" in final
    assert "rolls." in final and "45" in final and "48." in final
    assert "r o l l s" not in shown and "4 5" not in shown and "4 8" not in shown
    assert all(set(cells) <= {"░"} for cells in waiting_rows(shown))  # `·`: nothing in it yet
    assert "▶ B1" in shown  # block 1 was current at some step
    assert canvas_words(final[final.index("\n") + 1 :]) == text  # the canvas spells the answer


def waiting_rows(shown: str) -> list[list[str]]:
    """The cells of every row marked `·` (waiting) in every frame drawn."""
    rows, lines = [], shown.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"· B\d+ ", line):
            cells = line.split()[2:]
            for more in lines[i + 1 :]:
                if not more.startswith("     ") or not more.strip():
                    break
                cells += more.split()
            rows.append(cells)
    return rows


def canvas_words(frame: str) -> str:
    """A frame's canvas as plain words: block markers, masks, ends, header, legend dropped."""
    lines = frame.splitlines()
    first = next(i for i, line in enumerate(lines) if re.match(r"[❄✓▶·✂] B\d+ ", line))
    body = lines[first:]
    body = body[: next(i for i, line in enumerate(body) if line.startswith("░ mask"))]
    body = [line for line in body if not re.match(r"\S B\d+(-B\d+)? ∎ × \d+\s*$", line)]
    drop = {"❄", "✓", "▶", "·", "✂", "░", "∎"}
    words = " ".join(body).split()
    return " ".join(w for w in words if w not in drop and not re.fullmatch(r"B\d+", w))


def save(tmp_path: Path, name: str) -> tuple[Path, str, str]:
    path = tmp_path / name
    result = invoke(*ARGS, "--save", str(path))
    assert result.exit_code == 0, result.output
    return path, result.stdout.strip(), result.stderr


def test_svg_names_only_local_fonts(tmp_path):
    path, _, stderr = save(tmp_path, "run.svg")
    svg = path.read_text()
    assert f"wrote {path}" in stderr
    assert re.findall(r"https?://[^\"' )]*", svg) == ["http://www.w3.org/2000/svg"]  # xmlns
    assert re.findall(r"url\((?!#)", svg) == [] and "@import" not in svg and "@font-face" not in svg
    assert "DejaVu Sans Mono" in svg and "monospace" in svg and "(done)" in svg


@pytest.fixture(name="browser")
def browser_fixture():
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium; .ci/run does)")
    with tempfile.TemporaryDirectory() as profile:
        browser = Browser(CHROMIUM, Path(profile))
        try:
            yield browser
        finally:
            browser.close()


def frame_text(browser: Browser) -> str:
    return browser.js("document.querySelector('#frames .frame:not([hidden])').innerText")


@pytest.mark.slow
def test_html_player_plays_to_the_answer_in_a_real_browser(tmp_path, browser):
    path, answer, stderr = save(tmp_path, "run.html")
    page = path.read_text()
    assert f"wrote {path}: a player of" in stderr
    assert re.search(r"https?://|src=|@import|url\(", page) is None  # nothing to fetch
    browser.call("Network.enable")
    browser.open(path.as_uri())
    frames = browser.js("document.querySelectorAll('#frames .frame').length")
    assert frames >= 3
    assert browser.js("document.getElementById('prompt').textContent") == QUESTION
    settings = browser.js("document.getElementById('headline').textContent")
    assert "tiny-gsm-dream" in settings and "gen_length 64" in settings and "guided" in settings
    first = frame_text(browser)
    assert "step 1" in first and "░" in first and "(done)" not in first
    assert browser.js("document.getElementById('answer-box').hidden")

    browser.js("document.getElementById('speed').value = '150'")
    browser.click("#play")
    assert "Pause" in browser.js("document.getElementById('play').textContent")
    browser.wait_for(f"document.body.dataset.frame === '{frames - 1}'")
    assert "Play" in browser.js("document.getElementById('play').textContent")  # it stopped
    browser.screenshot(tmp_path / "final.png")
    last = frame_text(browser)
    assert "(done)" in last
    assert canvas_words(last) == answer  # the whole answer, word for word
    assert browser.js("document.getElementById('answer').textContent") == answer
    assert not browser.js("document.getElementById('answer-box').hidden")

    browser.key("ArrowLeft")
    assert browser.js("document.body.dataset.frame") == str(frames - 2)
    browser.key("Home")
    assert frame_text(browser) == first
    browser.key("End")
    assert frame_text(browser) == last
    browser.js("document.getElementById('slider').value = '1'")
    browser.js("document.getElementById('slider').dispatchEvent(new Event('input'))")
    assert "step 2" in frame_text(browser)

    fetched = [e["params"]["request"]["url"] for e in browser.events if e.get("method") == "Network.requestWillBeSent"]  # fmt: skip
    assert fetched == [path.as_uri()]  # the page itself, nothing else
    png = (tmp_path / "final.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    keep = os.environ.get("DLLM_KEEP_SCREENSHOT")  # to look at it: DLLM_KEEP_SCREENSHOT=out.png
    if keep:
        Path(keep).write_bytes(png)
