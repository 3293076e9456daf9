"""The stepping thread: it alone touches the engines and the tokenizer.

Requests arrive on a queue (`submit`, `abort`, `stop` are the only thread-safe calls) that the
thread drains before every step, so an engine is only ever used from one thread. The thread
also encodes prompts and decodes answers: a Hugging Face fast tokenizer flips shared state to
split special tokens, which is not safe under concurrent calls.

An engine decodes one canvas shape with one set of engine and schedule settings; sampling
(temperature, top_p, top_k, seed) is each request's own (lifetimes.py). Requests whose other
settings differ (max_tokens, block length, steps, cache, threshold, guide, ...) need engines of
their own: one per distinct settings group, created on first use, at most `max_engines` at a
time; a group without an engine waits until an engine falls idle and is dropped (least
recently used first). Engines with work are stepped in turn, one step each.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from dllm_cli.chat import encode_plain
from dllm_cli.errors import DllmError, InputError
from dllm_cli.families import FAMILIES
from dllm_cli.prompt_text import check_text
from dllm_cli.runtime import Runtime
from dllm_cli.serve import engines
from dllm_cli.serve.answers import Deltas, cut_at_stops, finish_reason
from dllm_cli.serve.conversation import encode_messages
from dllm_cli.serve.metrics import Metrics
from dllm_cli.serve.protocol import ApiError, Job, input_error

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


class Worker:
    """Owns the model's engines; one thread steps them (see the module docstring)."""

    def __init__(self, runtime: Runtime, slots: int, max_engines: int, metrics: Metrics):
        self.runtime, self.slots, self.max_engines = runtime, slots, max_engines
        self.metrics = metrics
        self.inbox: queue.Queue = queue.Queue()
        self.engines: OrderedDict[engines.Group, engines.Pool] = OrderedDict()
        self.parked: list[Ticket] = []  # their group has no engine yet
        self.tickets: dict[tuple[engines.Group, int], Ticket] = {}
        self.count = 0  # requests submitted and not yet answered (the queue limit's count)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.loop, name="dllm-engine", daemon=True)
        self.failure: BaseException | None = None
        self.aborting = False  # stop(abort=True) was called: new requests are refused too

    # --- thread-safe calls -----------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job, post: Post, limit: int) -> Ticket:
        """Queue a request, or ApiError(429) when `limit` requests are already in."""
        with self.lock:
            if self.stopping.is_set():
                raise ApiError(503, "the server is shutting down")
            if self.failure is not None:
                raise ApiError(500, f"internal error: {type(self.failure).__name__}")
            if self.count >= limit:
                raise ApiError(429, f"the server is full ({limit} requests waiting or decoding)")
            self.count += 1
        ticket = Ticket(job, post)
        self.inbox.put(("add", ticket))
        return ticket

    def abort(self, ticket: Ticket) -> None:
        """The client left: drop its request (its slot is free on the next step)."""
        self.inbox.put(("abort", ticket))

    def stop(self, abort: bool) -> None:
        """Refuse new requests; with `abort`, drop every request in flight."""
        self.stopping.set()
        if abort:
            self.inbox.put(("abort_all", None))

    def close(self) -> None:
        self.inbox.put(("exit", None))
        self.thread.join(timeout=10)

    @property
    def busy(self) -> int:
        return self.count

    # --- the stepping thread ---------------------------------------------------------------
    def loop(self) -> None:
        try:
            while self.drain(block=not self.has_work()):
                for group, pool in list(self.engines.items()):
                    if pool.engine.has_work:
                        self.step_or_drop(group, pool)
                self.metrics.set_load(
                    self.waiting(), self.running(), self.slots * len(self.engines)
                )
        except BaseException as e:  # a bug: answer every request rather than hang them
            self.failure = e
            for ticket in [*self.tickets.values(), *self.parked]:
                self.fail(ticket, ApiError(500, f"internal error: {type(e).__name__}: {e}"))

    def step_or_drop(self, group: engines.Group, pool: engines.Pool) -> None:
        """One step; an engine that fails (a bug) answers its requests 500 and is dropped,
        and the server goes on with the others."""
        try:
            self.step(group, pool)
        except Exception as e:
            error = ApiError(500, f"internal error: {type(e).__name__}: {str(e)[:200]}")
            for key, ticket in list(self.tickets.items()):
                if key[0] == group:
                    del self.tickets[key]
                    self.fail(ticket, error)
            del self.engines[group]

    def has_work(self) -> bool:
        return bool(self.parked) or any(p.engine.has_work for p in self.engines.values())

    def waiting(self) -> int:
        return len(self.parked) + sum(p.engine.waiting for p in self.engines.values())

    def running(self) -> int:
        return sum(p.engine.running for p in self.engines.values())

    def drain(self, block: bool) -> bool:
        """Take every queued message (waiting for one when idle); False once told to exit."""
        try:
            message = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, ticket = message
            if kind == "exit":
                return False
            handlers = {"add": self.on_add, "abort": self.on_abort, "abort_all": self.on_abort_all}
            handlers[kind](ticket)
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                break
        self.place_parked()
        return True

    def on_add(self, ticket: Ticket) -> None:
        job = ticket.job
        try:
            per_request = FAMILIES[self.runtime.loaded.family].per_request_sampling
            ticket.group = engines.group_of(job, per_request)
            ticket.ids = self.encode(job)
            engines.check_length(self.runtime, ticket.ids, job.settings)
        except InputError as e:
            return self.fail(ticket, input_error(e, job.kind))
        except DllmError as e:
            return self.fail(ticket, ApiError(400, str(e)))
        ticket.deltas = Deltas(self.runtime.text, job.stop)
        if self.aborting:
            return self.fail(ticket, ApiError(503, "the server is shutting down"))
        self.parked.append(ticket)
        ticket.post("accepted", None)

    def on_abort(self, ticket: Ticket) -> None:
        if ticket.done:
            return
        if ticket in self.parked:
            self.parked.remove(ticket)
        elif ticket.rid is not None:
            self.engines[ticket.group].engine.abort(ticket.rid)
            self.tickets.pop((ticket.group, ticket.rid), None)
        self.finish(ticket)

    def on_abort_all(self, _: None) -> None:
        self.aborting = True
        for ticket in [*self.tickets.values(), *self.parked]:
            self.on_abort(ticket)
            ticket.post("error", ApiError(503, "the server is shutting down; request aborted"))

    def encode(self, job: Job) -> list[int]:
        if job.kind == "chat":
            return encode_messages(self.runtime.loaded.tokenizer, list(job.messages))
        check_text(job.prompt)
        if not job.prompt.strip():
            raise InputError("empty prompt")
        return encode_plain(self.runtime.loaded.tokenizer, job.prompt)  # a raw prompt: no template

    def place_parked(self) -> None:
        """Parked requests into their group's engine, making one where there is room."""
        still = []
        for ticket in self.parked:
            try:
                pool = self.engine_for(ticket.group)
            except DllmError as e:  # settings this engine refuses: this request's 400 only
                self.fail(ticket, ApiError(400, str(e)))
                continue
            if pool is None:
                still.append(ticket)
                continue
            try:
                ticket.rid = engines.add(pool, ticket.ids, ticket.job, ticket)
            except DllmError as e:
                self.fail(ticket, input_error(e, ticket.job.kind))
                continue
            self.tickets[(ticket.group, ticket.rid)] = ticket
        self.parked = still

    def engine_for(self, group: engines.Group) -> engines.Pool | None:
        if group in self.engines:
            self.engines.move_to_end(group)
            return self.engines[group]
        if len(self.engines) >= self.max_engines:
            idle = [g for g, p in self.engines.items() if not p.engine.has_work]
            if not idle:
                return None
            del self.engines[idle[0]]  # least recently used first
        self.engines[group] = engines.build(self.runtime, group, self.slots)
        return self.engines[group]

    def step(self, group: engines.Group, pool: engines.Pool) -> None:
        out = pool.engine.step()
        self.metrics.stepped(pool.engine)
        for done in out.finished:
            ticket = self.tickets.pop((group, done.id))
            self.complete(ticket, done.tokens, done)
        for (g, rid), ticket in list(self.tickets.items()):
            if g != group or not (ticket.job.stream or ticket.job.stop):
                continue
            new = ticket.deltas.feed(pool.engine.progress(rid))
            if new:
                self.send(ticket, new)
            if ticket.deltas.stopped:  # a stop string: the answer is final before it
                del self.tickets[(g, rid)]
                self.complete(ticket, *engines.stop_early(pool.engine, rid))

    def send(self, ticket: Ticket, text: str) -> None:
        if ticket.first_text is None:
            ticket.first_text = time.perf_counter()
            self.metrics.first_text(ticket.first_text - ticket.added)
        if ticket.job.stream:
            ticket.post("text", text)

    def complete(self, ticket: Ticket, tokens: list[int], done: engines.Counts) -> None:
        """The answer is final: the text still unsent, then the outcome with its counts."""
        special = self.runtime.loaded.special
        text = cut_at_stops(self.runtime.text(tokens), ticket.job.stop, final=True).text
        rest = ticket.deltas.finish(text)
        if rest:
            self.send(ticket, rest)
        outcome = Outcome(
            text=text,
            finish_reason=finish_reason(tokens, special.stop, ticket.deltas.stopped),
            prompt_tokens=len(ticket.ids),
            completion_tokens=engines.completion_tokens(tokens, special.stop),
            forwards=done.forwards,
            guide_forwards=done.guide_forwards,
            steps=done.steps,
            seconds=time.perf_counter() - ticket.added,
        )
        self.metrics.answered(outcome)
        ticket.post("done", outcome)
        self.finish(ticket)

    def fail(self, ticket: Ticket, error: ApiError) -> None:
        ticket.post("error", error)
        self.finish(ticket)

    def finish(self, ticket: Ticket) -> None:
        if ticket.done:
            return
        ticket.done = True
        with self.lock:
            self.count -= 1
