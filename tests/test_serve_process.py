"""`dllm serve` as a process: the API key, a full queue, and SIGTERM/SIGINT (finish or abort the
requests in flight, refuse new ones, exit 0)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from served import launch

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-test-key"
# A slow unguided answer: one token per step, no cache, every position decoded.
SLOW = {"max_tokens": 96, "guide": False, "cache": "none", "unmask": "fixed", "early_stop": False}
MESSAGES = [{"role": "user", "content": "Tom has 3 apples and buys 2 more. How many apples?"}]


def start(*flags: str) -> tuple[subprocess.Popen, str]:
    """`dllm serve --port 0 ...` on the shipped model; its URL from the note on stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "dllm_cli", "serve", "--port", "0", "--gen-length", "16", *flags]
    return launch(args, env)


def post(url: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)


def gauge(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def in_flight(url: str, n: int) -> list:
    """`n` slow requests on threads; returns once the server holds all of them."""
    replies: list = [None] * n

    def send(i: int) -> None:
        replies[i] = post(url, {"messages": MESSAGES, **SLOW})

    for i in range(n):
        threading.Thread(target=send, args=(i,), daemon=True).start()
    deadline = time.monotonic() + 60
    while gauge(url, "dllm_queue_depth") + gauge(url, "dllm_slots_busy") < n:
        assert time.monotonic() < deadline, "requests never arrived"
        time.sleep(0.05)
    return replies


def wait_for(replies: list, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while any(r is None for r in replies) and time.monotonic() < deadline:
        time.sleep(0.1)


def test_key_queue_and_graceful_sigterm():
    proc, url = start("--api-key", KEY, "--batch-size", "1", "--max-queue", "1")
    try:
        assert httpx.get(url + "/health").status_code == 200  # no key needed
        for key in (None, "sk-wrong"):
            reply = post(url, {"messages": MESSAGES}, key=key)
            assert (
                reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"
            )
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        assert client.chat.completions.create(model="tiny-gsm-dream", messages=MESSAGES).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()

        replies = in_flight(url, 2)  # one decoding, one waiting: the server is full
        full = post(url, {"messages": MESSAGES})
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"

        proc.send_signal(signal.SIGTERM)  # finish both, refuse the rest, exit 0
        time.sleep(0.5)
        with pytest.raises(httpx.HTTPError):
            post(url, {"messages": MESSAGES})
        assert proc.wait(timeout=120) == 0
        wait_for(replies)
        assert [r.status_code for r in replies] == [200, 200]
        assert all(r.json()["choices"][0]["message"]["content"] for r in replies)  # whole answers
    finally:
        proc.kill()


@pytest.mark.slow
def test_sigint_with_abort_on_exit_aborts_in_flight():
    proc, url = start("--batch-size", "1", "--abort-on-exit")
    try:
        replies = in_flight(url, 2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        wait_for(replies, 10)
        assert [r.status_code for r in replies] == [503, 503]
        assert all(r.json()["error"]["code"] == "shutting_down" for r in replies)
    finally:
        proc.kill()


def test_requests_differing_only_in_max_tokens_share_one_engine():
    """Two concurrent requests with different max_tokens (the openai client, a real server):
    both answered, each as it is alone, decoded side by side in the one engine built."""
    proc, url = start("--batch-size", "2")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        extra = {k: v for k, v in SLOW.items() if k != "max_tokens"}

        def ask(tokens: int) -> str:
            reply = client.chat.completions.create(
                model="tiny-gsm-dream", messages=MESSAGES, max_tokens=tokens, extra_body=extra
            )
            return reply.choices[0].message.content

        lengths, together = (8, 48), {}
        threads = [
            threading.Thread(target=lambda n=n: together.update({n: ask(n)})) for n in lengths
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while gauge(url, "dllm_slots_busy") < 2:  # both decoding at once, side by side
            assert time.monotonic() < deadline and len(together) < 2, "never side by side"
            time.sleep(0.02)
        for t in threads:
            t.join(120)
        assert gauge(url, "dllm_slots") == 2  # one engine of 2 slots (not one per max_tokens)
        assert [together[n] for n in lengths] == [ask(n) for n in lengths]  # each alone
        assert len(together[8]) < len(together[48])  # cut at its own max_tokens
    finally:
        proc.kill()
