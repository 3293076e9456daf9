"""The server's counters in Prometheus' text exposition format (version 0.0.4), kept by hand.

Counters and gauges are plain numbers; a histogram keeps cumulative bucket counts, a sum and a
count, as Prometheus' client libraries do. Updates come from two threads (the stepping thread
and the event loop), so every change and the rendering take one lock.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
ROUTES += ("/api/generate", "/api/chat", "/api/tags", "/api/show", "/api/ps", "/api/version")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Histogram:
    def __init__(self, bounds: tuple[float, ...] = SECONDS):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        i = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[i] += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for bound, n in zip((*map(repr, self.bounds), "+Inf"), self.counts, strict=True):
            total += n
            out.append(f'{name}_bucket{{le="{bound}"}} {total}')
        return [*out, f"{name}_sum {self.sum}", f"{name}_count {total}"]


class Metrics:
    """What GET /metrics reports."""

    def __init__(self, model_id: str):
        self.model_id = model_id
        self.lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()  # (endpoint, status) -> count
        self.forwards = self.guide_forwards = self.steps = self.aborts = 0
        self.prompt_tokens = self.completion_tokens = 0
        self.waiting = self.running = self.slots = 0
        self.latency, self.ttft = Histogram(), Histogram()
        self.reported: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> counts

    def request(self, endpoint: str, status: int) -> None:
        """Count an answer; paths that are no route count as "other" (bounded labels)."""
        where = "/v1/models" if endpoint.startswith("/v1/models/") else endpoint
        where = where if where in ROUTES else "other"
        with self.lock:
            self.requests[(where, status)] += 1

    def set_load(self, waiting: int, running: int, slots: int) -> None:
        with self.lock:
            self.waiting, self.running, self.slots = waiting, running, slots

    def stepped(self, engine) -> None:
        """Engine-wide forwards so far are summed per engine step (deltas kept per engine)."""
        with self.lock:
            last = self.reported.get(engine, (0, 0, 0))
            now = (engine.forwards, engine.guide_forwards, engine.steps)
            self.forwards += now[0] - last[0]
            self.guide_forwards += now[1] - last[1]
            self.steps += now[2] - last[2]
            self.reported[engine] = now

    def aborted(self) -> None:
        """A request dropped before its answer was final (its client left, or shutdown)."""
        with self.lock:
            self.aborts += 1

    def first_text(self, seconds: float) -> None:
        with self.lock:
            self.ttft.observe(seconds)

    def answered(self, outcome) -> None:
        with self.lock:
            self.prompt_tokens += outcome.prompt_tokens
            self.completion_tokens += outcome.completion_tokens
            self.latency.observe(outcome.seconds)

    def render(self) -> str:
        with self.lock:
            return "\n".join(self._lines()) + "\n"

    def _lines(self) -> list[str]:
        out = [
            "# HELP dllm_requests_total HTTP requests answered, by endpoint and status.",
            "# TYPE dllm_requests_total counter",
        ]
        for (endpoint, status), n in sorted(self.requests.items()):
            out.append(f'dllm_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
        for name, kind, value, what in (
            ("queue_depth", "gauge", self.waiting, "Requests waiting for a slot."),
            ("slots_busy", "gauge", self.running, "Slots decoding a request."),
            ("slots", "gauge", self.slots, "Slots of the engines alive."),
            ("forwards_total", "counter", self.forwards, "Diffusion-model forwards."),
            ("guide_forwards_total", "counter", self.guide_forwards, "AR guide forwards."),
            ("steps_total", "counter", self.steps, "Engine decoding steps."),
            ("aborted_total", "counter", self.aborts, "Requests aborted before their answer."),
            ("prompt_tokens_total", "counter", self.prompt_tokens, "Prompt tokens answered."),
            ("completion_tokens_total", "counter", self.completion_tokens, "Answer tokens."),
        ):
            out += [f"# HELP dllm_{name} {what}", f"# TYPE dllm_{name} {kind}"]
            out.append(f"dllm_{name} {value}")
        for name, hist, what in (
            ("request_seconds", self.latency, "Seconds from request to full answer."),
            ("time_to_first_token_seconds", self.ttft, "Seconds from request to first text."),
        ):
            out += [f"# HELP dllm_{name} {what}", f"# TYPE dllm_{name} histogram"]
            out += hist.lines(f"dllm_{name}")
        return out
