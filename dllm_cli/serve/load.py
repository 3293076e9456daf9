"""`dllm bench --serve`: a load test of the server, in one process, over real HTTP.

A server starts on a free loopback port (server.start_in_thread) and N chat requests, the
hand-written TinyGSM questions in turn, are sent by C client threads: every other request
streamed, and a chosen fraction cancelled by their client (streamed, the connection closed
after the first text). Each pass reports requests/s, answer tokens/s, latency and time to first
text (p50/p99). After one untimed warm-up request, the same requests are sent at C = 1, one after another: those answers
are the single-run answers every concurrent answer must equal. Every request is checked to be
answered exactly once (none lost, none twice); resident memory is read after the first pass
(warm-up) and at the end. The client is the standard library's http.client, so the benchmark
needs nothing beyond the main install.
"""

from __future__ import annotations

import http.client
import json
import resource
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlparse

from dllm_cli.problems import HELDOUT
from dllm_cli.runtime import Runtime
from dllm_cli.serve import server


@dataclass
class Reply:
    """What the client saw for one request."""

    index: int
    text: str = ""
    status: int = 0
    cancelled: bool = False
    seconds: float = 0.0
    first_text: float | None = None  # seconds to the first text chunk (streamed)
    tokens: int = 0
    finishes: int = 0  # final answers received (exactly 1 unless cancelled)


@dataclass
class Pass:
    concurrency: int
    replies: list[Reply]
    seconds: float
    rss_mb: float = 0.0
    stats: dict = field(default_factory=dict)


def questions(n: int) -> list[str]:
    """The hand-written questions, in order, repeated to n."""
    texts = []
    for path in (HELDOUT / "hand.jsonl", HELDOUT / "hand2.jsonl"):
        texts += [json.loads(line)["question"] for line in path.read_text().splitlines() if line]
    return [texts[i % len(texts)] for i in range(n)]


def send(url: str, index: int, question: str, stream: bool, cancel: bool) -> Reply:
    """One chat request over a connection of its own."""
    where = urlparse(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=600)
    body = {"messages": [{"role": "user", "content": question}], "stream": stream or cancel}
    reply, began = Reply(index, cancelled=cancel), time.perf_counter()
    try:
        headers = {"Content-Type": "application/json"}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
        answer = conn.getresponse()
        reply.status = answer.status
        if not body["stream"] or answer.status != 200:
            data = json.loads(answer.read())
            if answer.status == 200:
                reply.text = data["choices"][0]["message"]["content"]
                reply.tokens, reply.finishes = data["usage"]["completion_tokens"], 1
        else:
            read_stream(answer, reply, began, cancel)
    finally:
        conn.close()
    reply.seconds = time.perf_counter() - began
    return reply


def read_stream(answer, reply: Reply, began: float, cancel: bool) -> None:
    for raw in answer:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: ") :])
        choice = chunk["choices"][0]
        text = choice["delta"].get("content") or ""
        if text and reply.first_text is None:
            reply.first_text = time.perf_counter() - began
            if cancel:
                return  # the client leaves: the server must abort it
        reply.text += text
        if choice["finish_reason"] is not None:
            reply.finishes += 1
            reply.tokens = chunk["usage"]["completion_tokens"]


def run_pass(url: str, texts: list[str], concurrency: int, cancelled: set[int]) -> Pass:
    """Every request at `concurrency`; resident memory once a tenth are done and at the end."""
    lock, done, warm = threading.Lock(), [0], [0.0]

    def one(i: int) -> Reply:
        reply = send(url, i, texts[i], stream=i % 2 == 1, cancel=i in cancelled)
        with lock:
            done[0] += 1
            if done[0] == max(1, len(texts) // 10):
                warm[0] = rss_mb()
        return reply

    began = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        replies = list(pool.map(one, range(len(texts))))
    result = Pass(concurrency, replies, time.perf_counter() - began, rss_mb())
    result.stats["rss_mb_warm"] = round(warm[0], 1)
    return result


def rss_mb() -> float:
    """Resident memory now (Linux /proc), else the peak so far."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * resource.getpagesize() / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def summarize(p: Pass, reference: list[Reply] | None) -> dict:
    done = [r for r in p.replies if not r.cancelled]
    latencies = [r.seconds for r in done]
    ttft = [r.first_text for r in p.replies if r.first_text is not None]
    stats = {
        "concurrency": p.concurrency,
        "requests": len(p.replies),
        "cancelled": len(p.replies) - len(done),
        "seconds": round(p.seconds, 3),
        "requests_per_second": round(len(done) / p.seconds, 3),
        "tokens_per_second": round(sum(r.tokens for r in done) / p.seconds, 1),
        "latency_p50": round(percentile(latencies, 50), 3),
        "latency_p99": round(percentile(latencies, 99), 3),
        "ttft_p50": round(percentile(ttft, 50), 3),
        "ttft_p99": round(percentile(ttft, 99), 3),
        "lost": sum(r.status != 200 or r.finishes == 0 for r in done),
        "answered_twice": sum(r.finishes > 1 for r in p.replies),
        "rss_mb_warm": p.stats["rss_mb_warm"],  # after the first tenth of the requests
        "rss_mb": round(p.rss_mb, 1),  # at the end
    }
    if reference is not None:
        same = sum(r.text == reference[r.index].text for r in done)
        stats["identical"] = f"{same}/{len(done)}"
    return stats


def run(
    runtime: Runtime,
    n: int,
    concurrency: int,
    cancel: float,
    slots: int,
    report: Callable[[dict], None],
) -> list[dict]:
    """The C = 1 pass (the single-run answers), then the pass at `concurrency`."""
    texts = questions(n)
    every = round(1 / cancel) if cancel > 0 else 0
    cancelled = {i for i in range(n) if every and i % every == every - 1}
    options = server.Options(port=0, slots=slots, max_queue=max(n, 64))
    handle = server.start_in_thread(runtime, options)
    try:
        send(handle.url, -1, texts[0], stream=False, cancel=False)  # warm-up, not timed
        alone = run_pass(handle.url, texts, 1, set())
        records = [summarize(alone, None)]
        report(records[0])
        together = run_pass(handle.url, texts, concurrency, cancelled)
        records.append(summarize(together, alone.replies))
        records[-1]["speedup"] = round(alone.seconds / together.seconds, 2)  # same requests
        report(records[-1])
    finally:
        handle.stop()
    return records
