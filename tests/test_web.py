"""The chat page of `dllm serve` in a real headless Chromium against a real server process on a
loopback port (the shipped tiny model): a question typed, its canvas drawn frame by frame, the
answer equal to `dllm generate`'s, a stop that aborts the request on the server, two tabs
decoding at once, the server's 400s shown, and no request leaving the server's origin.

DLLM_KEEP_SCREENSHOTS=DIR keeps a mid-decode and a settled screenshot (docs/web.md shows them).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from browser import Browser, find_chromium
from served import launch

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = find_chromium()
# One token per step over the whole canvas: 64 steps, so the canvas has many frames to show.
FLAGS = ("--gen-length", "64", "--no-guide", "--cache", "none", "--unmask", "fixed")
QUESTIONS = (
    "Tom has 3 apples and buys 2 more. How many apples does he have?",
    "Ann has 10 pens and gives 4 away. How many pens are left?",
)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
# Every canvas the page draws, as text, recorded by a MutationObserver (a page-side probe).
PROBE = """
window.seen = []; window.times = [];
new MutationObserver(() => {
  const canvases = document.querySelectorAll('.msg.assistant .canvas');
  const c = canvases[canvases.length - 1];
  if (!c) return;
  const text = c.innerText;
  if (!text.trim()) return;
  if (window.seen[window.seen.length - 1] !== text) {
    window.seen.push(text); window.times.push(performance.timeOrigin + performance.now());
  }
}).observe(document.getElementById('log'), {subtree: true, childList: true,
  characterData: true, attributes: true});
"""
pytestmark = pytest.mark.slow


def serve(*flags: str) -> tuple[subprocess.Popen, str]:
    """`dllm serve --port 0 FLAGS`; its URL from the note on stderr."""
    args = [sys.executable, "-m", "dllm_cli", "serve", "--port", "0", *FLAGS, *flags]
    return launch(args, ENV)


def generated(questions: tuple[str, ...], *flags: str) -> list[str]:
    """`dllm generate --json` answers with the server's flags (one batch run)."""
    args = [sys.executable, "-m", "dllm_cli", "generate", "--json", *FLAGS, *flags, "-"]
    run = subprocess.run(
        args, input="\n".join(questions) + "\n", capture_output=True, text=True, env=ENV, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr
    return [json.loads(line)["text"] for line in run.stdout.splitlines()]


@pytest.fixture(scope="module")
def expected() -> list[str]:
    """`dllm generate`'s answers to QUESTIONS with the server's settings (batch == alone)."""
    return generated(QUESTIONS)


@pytest.fixture(scope="module")
def server():
    proc, url = serve()
    yield url
    proc.terminate()
    proc.wait(timeout=60)


@pytest.fixture(name="browser")
def browser_fixture():
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium; .ci/run does)")
    with tempfile.TemporaryDirectory() as profile:
        browser = Browser(CHROMIUM, Path(profile), size=(1100, 900))
        try:
            browser.call("Network.enable")
            yield browser
        finally:
            browser.close()


def type_question(browser: Browser, text: str) -> None:
    """Focus the box, insert the text as typing does, click Send."""
    browser.js("document.getElementById('question').focus()")
    browser.call("Input.insertText", text=text)
    browser.click("#send")


def settle(browser: Browser) -> str:
    browser.wait_for("document.body.dataset.state === 'done'")
    return browser.js("document.querySelector('.msg.assistant:last-child .text').textContent")


def requested(browser: Browser) -> list[str]:
    return [
        e["params"]["request"]["url"]
        for e in browser.events
        if e.get("method") == "Network.requestWillBeSent"
    ]


def metric(url: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", httpx.get(url + "/metrics").text, re.M)
    return float(found.group(1))


def keep(browser: Browser, name: str) -> None:
    where = os.environ.get("DLLM_KEEP_SCREENSHOTS")
    if where:
        browser.screenshot(Path(where) / name)


def test_page_draws_the_canvas_then_the_answer_generate_gives(server, browser, expected):
    browser.open(server + "/")
    assert browser.js("document.getElementById('model').textContent") == "tiny-gsm-dream"
    browser.js(PROBE)
    type_question(browser, QUESTIONS[0])
    text = settle(browser)
    assert text == expected[0]
    frames = browser.js("window.seen")
    assert len(frames) >= 3  # distinct canvases drawn before it settled
    assert "░" in frames[0] and "▶ B0" in frames[0]  # masks, the current block
    assert sum(f.count("░") for f in frames[:3]) > frames[2].count("░")  # masks go away
    drawn = int(browser.js("document.querySelector('.canvas').dataset.frames"))
    stats = browser.js("document.querySelector('.msg.assistant .stats').textContent")
    steps = re.search(r"\d+ tokens · (\d+) steps · forwards (\d+) · [\d.]+ tok/s", stats)
    assert steps is not None, stats
    assert drawn == int(steps.group(1)) == int(steps.group(2)) > 3  # a frame per step
    assert browser.js("getComputedStyle(document.querySelector('.canvas')).display") == "none"
    keep(browser, "web-settled.png")

    # A second turn sends the whole conversation (the chat template renders it on the server).
    type_question(browser, "And how many pens?")
    settle(browser)
    assert browser.js("document.querySelectorAll('.msg.user').length") == 2
    assert all(u.startswith(server + "/") for u in requested(browser))  # nothing from outside


def test_stop_aborts_on_the_server_and_settings_errors_are_shown(server, browser):
    browser.open(server + "/")
    browser.js("document.getElementById('settings').open = true")
    browser.js("document.querySelector('[name=block_length]').value = 'abc'")
    type_question(browser, QUESTIONS[0])
    error = browser.wait_for("!document.getElementById('error').hidden && "
                             "document.getElementById('error').textContent")  # fmt: skip
    assert error.startswith("400: block_length") and "abc" in error
    assert browser.js("document.getElementById('question').value") == QUESTIONS[0]  # kept

    before = metric(server, "dllm_aborted_total")
    browser.js("document.querySelector('[name=block_length]').value = ''")
    for name in ("gen_length", "steps"):  # a long answer: 256 steps of one token
        browser.js(f"document.querySelector('[name={name}]').value = '256'")
    browser.js("document.querySelector('[name=early_stop]').value = 'false'")  # to the end
    browser.click("#send")
    browser.wait_for("Number(document.querySelector('.canvas')?.dataset.frames) >= 100")
    assert browser.js("document.querySelectorAll('.block.pruned').length") >= 1  # suffix window
    keep(browser, "web-decoding.png")
    browser.click("#stop")
    browser.wait_for("document.body.dataset.state === 'stopped'")
    deadline = time.monotonic() + 30
    while metric(server, "dllm_aborted_total") < before + 1:
        assert time.monotonic() < deadline, "the server never aborted the request"
        time.sleep(0.1)
    frames = int(browser.js("document.querySelector('.canvas').dataset.frames"))
    assert frames < 256  # it stopped before the answer was done


def test_two_tabs_decode_at_once(server, browser, expected):
    first = browser.session
    target = browser.call("Target.createTarget", page=False, url="about:blank")["targetId"]
    second = browser.call("Target.attachToTarget", page=False, targetId=target, flatten=True)
    tabs = [first, second["sessionId"]]
    for tab in tabs:
        browser.session = tab
        browser.call("Network.enable")
        browser.open(server + "/")
        browser.js(PROBE)
    for tab, question in zip(tabs, QUESTIONS, strict=True):
        browser.session = tab
        type_question(browser, question)
    texts, spans = [], []
    for tab in tabs:
        browser.session = tab
        texts.append(settle(browser))
        times = browser.js("window.times")
        spans.append((times[0], times[-1]))
    assert texts == expected
    (a0, a1), (b0, b1) = spans
    assert a0 < b1 and b0 < a1  # the two canvases were being drawn at the same time
    assert all(u.startswith(server + "/") for u in requested(browser))
    browser.session = first


def test_with_an_api_key_the_page_asks_for_it(browser, expected):
    proc, url = serve("--api-key", "sk-page")
    try:
        browser.open(url + "/")
        assert not browser.js("document.getElementById('key-box').hidden")
        type_question(browser, QUESTIONS[0])
        error = browser.wait_for("!document.getElementById('error').hidden && "
                                 "document.getElementById('error').textContent")  # fmt: skip
        assert error.startswith("401: missing or wrong API key")
        browser.js("document.getElementById('key').focus()")
        browser.call("Input.insertText", text="sk-page")
        browser.click("#send")  # the question was kept in the box
        assert settle(browser) == expected[0]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
