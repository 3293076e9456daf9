"""A request's records inside the worker: its ticket from submit to outcome, and the outcome.

Kept apart from the stepping thread (worker.py) so the routes can name them without the thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dllm_cli.serve import engines, scores
from dllm_cli.serve.answers import Deltas
from dllm_cli.serve.canvas import Frames
from dllm_cli.serve.protocol import Job

Post = Callable[[str, object], None]  # (kind, payload) -> the request's own event queue


@dataclass
class Outcome:
    """A finished request: its text and what it cost."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    forwards: int
    guide_forwards: int
    steps: int
    seconds: float
    prompt_text: str = ""  # the prompt as text (an echoed answer starts with it)
    logprobs: list[scores.TokenLogprob] | None = None  # per answer token, when the request asked


@dataclass(eq=False)  # compared by identity: two equal requests are two tickets
class Ticket:
    """One request inside the worker, from submit to its outcome."""

    job: Job
    post: Post
    group: engines.Group | None = None
    rid: int | None = None
    ids: list[int] = field(default_factory=list)
    deltas: Deltas | None = None
    added: float = field(default_factory=time.perf_counter)
    first_text: float | None = None
    done: bool = False
    totals: list[float] = field(default_factory=list)  # a scoring job's estimates so far
    buffers: object = None  # logprobs.Buffers of an answer a stop string ended
    sent_tokens: int = 0  # streamed with logprobs: answer tokens whose logprobs went out
    frames: Frames | None = None  # its canvas stream (stream_options.include_canvas)
    row: int | None = None  # its row in the engine's StepEvents, once decoding
