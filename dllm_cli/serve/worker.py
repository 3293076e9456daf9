"""The stepping thread: it alone touches the engines and the tokenizer.

Requests arrive on a queue (`submit`, `abort`, `stop` are the only thread-safe calls) that the
thread drains before every step, so an engine is only ever used from one thread. The thread
also encodes prompts and decodes answers: a Hugging Face fast tokenizer flips shared state to
split special tokens, which is not safe under concurrent calls.

An engine decodes with one set of engine and schedule settings; length (max_tokens) and
sampling (temperature, top_p, top_k, seed) are each request's own (lifetimes.py). Requests
whose other settings differ (steps, cache, guide, ...) need engines of their own, one per
settings group, made on first use, at most `max_engines`; a group without one waits until an
engine falls idle and is dropped (least recently used first). Engines take turns, a step each.

Scoring requests (echo + logprobs, scoring.py) run on the same thread, one estimate (one
context/continuation split of one prompt) per turn between the engines' steps, so a long
prompt to score delays decoding by one estimate at a time, never by its whole scoring.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from dllm_cli.chat import encode_plain
from dllm_cli.decoding.answer import answer_length
from dllm_cli.errors import DllmError, InputError
from dllm_cli.families import FAMILIES
from dllm_cli.models.collectives import RankLost
from dllm_cli.prompt_text import check_text
from dllm_cli.runtime import Runtime
from dllm_cli.serve import canvas, engines, scores
from dllm_cli.serve.answers import Deltas, cut_at_stops, finish_reason
from dllm_cli.serve.conversation import encode_messages
from dllm_cli.serve.metrics import Metrics
from dllm_cli.serve.protocol import ApiError, Job, input_error
from dllm_cli.serve.tickets import Outcome, Post, Ticket

if TYPE_CHECKING:
    from dllm_cli.serve.mirror import Leader


class Worker:
    """Owns the model's engines; one thread steps them (see the module docstring)."""

    def __init__(self, runtime: Runtime, slots: int, max_engines: int, metrics: Metrics):
        self.runtime, self.slots, self.max_engines = runtime, slots, max_engines
        self.metrics = metrics
        self.inbox: queue.Queue = queue.Queue()
        self.engines: OrderedDict[engines.Group, engines.Pool] = OrderedDict()
        self.parked: list[Ticket] = []  # their group has no engine yet
        self.scoring: list[Ticket] = []  # scoring jobs, advanced one estimate per turn
        self.tickets: dict[tuple[engines.Group, int], Ticket] = {}
        self.count = 0  # requests submitted and not yet answered (the queue limit's count)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.loop, name="dllm-engine", daemon=True)
        self.failure: BaseException | None = None
        self.aborting = False  # stop(abort=True) was called: new requests are refused too
        self.mirror: Leader | None = None  # --tensor-parallel: the other ranks follow (mirror.py)
        self.ended: Callable[[], None] = lambda: None  # a rank was lost: the server stops

    # --- thread-safe calls -----------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job, post: Post, limit: int) -> Ticket:
        """Queue a request, or ApiError(429) when `limit` requests are already in."""
        return self.submit_all([(job, post)], limit)[0]

    def submit_all(self, jobs: list[tuple[Job, Post]], limit: int) -> list[Ticket]:
        """Queue one request's prompts together (all or none), in one message: they reach
        their engine in the same turn and decode together."""
        with self.lock:
            if self.stopping.is_set():
                raise ApiError(503, "the server is shutting down")
            if self.failure is not None:
                raise ApiError(500, f"internal error: {type(self.failure).__name__}")
            if self.count + len(jobs) > max(limit, len(jobs)) or self.count >= limit:
                raise ApiError(429, f"the server is full ({limit} requests waiting or decoding)")
            self.count += len(jobs)
        tickets = [Ticket(job, post) for job, post in jobs]
        for ticket in tickets:
            self.inbox.put(("add", ticket))
        return tickets

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

    # --- the stepping thread ---------------------------------------------------------------
    def loop(self) -> None:
        try:
            while self.drain(block=not self.has_work()):
                busy = [(g, p) for g, p in self.engines.items() if p.engine.has_work]
                split = scores.Split.next(self.scoring[0]) if self.scoring else None
                if self.mirror is not None:  # the other ranks step and score the same
                    self.mirror.turn([g for g, _ in busy], split)
                for group, pool in busy:
                    self.step_or_drop(group, pool)
                if split is not None:
                    self.score_or_fail(self.scoring[0], split)
                self.metrics.set_load(
                    self.waiting(), self.running(), self.slots * len(self.engines)
                )
            if self.mirror is not None:
                self.mirror.close()
        except BaseException as e:  # answer every request rather than hang them
            self.failure, lost = e, isinstance(e, RankLost)  # lost: the model cannot run
            bug = ApiError(500, f"internal error: {type(e).__name__}: {e}")
            for ticket in [*self.tickets.values(), *self.parked, *self.scoring]:
                self.fail(ticket, ApiError(503, str(e)) if lost else bug)
            if lost:  # without that rank: the server ends
                self.ended()

    def step_or_drop(self, group: engines.Group, pool: engines.Pool) -> None:
        """One step; an engine that fails (a bug) answers its requests 500 and is dropped,
        and the server goes on with the others."""
        try:
            self.step(group, pool)
        except RankLost:
            raise
        except Exception as e:
            error = ApiError(500, f"internal error: {type(e).__name__}: {str(e)[:200]}")
            for key, ticket in list(self.tickets.items()):
                if key[0] == group:
                    del self.tickets[key]
                    self.fail(ticket, error)
            del self.engines[group]
            self.record("drop", group)

    def has_work(self) -> bool:
        engines_busy = any(p.engine.has_work for p in self.engines.values())
        return bool(self.parked) or bool(self.scoring) or engines_busy

    def waiting(self) -> int:
        engines_waiting = sum(p.engine.waiting for p in self.engines.values())
        return len(self.parked) + len(self.scoring) + engines_waiting

    def running(self) -> int:
        return sum(p.engine.running for p in self.engines.values())

    def record(self, *change) -> None:
        """An engine change the other ranks of --tensor-parallel make too (mirror.py)."""
        if self.mirror is not None:
            self.mirror.note(*change)

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
        if job.kind == "score":
            return self.add_scoring(ticket)
        try:
            if job.logprobs is not None:
                scores.check_logprobs(self.runtime)
            shared = FAMILIES[self.runtime.loaded.family].traits.batch_wide
            gen = self.runtime.settings.gen_length
            ticket.group = engines.group_of(job, shared, gen)
            ticket.ids = self.encode(job)
            engines.check_length(self.runtime, ticket.ids, job.settings)
        except InputError as e:
            return self.fail(ticket, input_error(e, job.kind))
        except DllmError as e:
            return self.fail(ticket, ApiError(400, str(e)))
        ticket.deltas = Deltas(self.runtime.text, job.stop)
        if job.include_canvas:
            ticket.frames = canvas.frames_for(self.runtime, job)
        if self.aborting:
            return self.fail(ticket, ApiError(503, "the server is shutting down"))
        self.parked.append(ticket)
        ticket.post("accepted", None)

    def on_abort(self, ticket: Ticket) -> None:
        if ticket.done:
            return
        self.metrics.aborted()
        if ticket in self.parked:
            self.parked.remove(ticket)
        elif ticket in self.scoring:
            self.scoring.remove(ticket)
        elif ticket.rid is not None:
            self.engines[ticket.group].engine.abort(ticket.rid)
            self.record("abort", ticket.group, ticket.rid)
            self.tickets.pop((ticket.group, ticket.rid), None)
        self.finish(ticket)

    def on_abort_all(self, _: None) -> None:
        self.aborting = True
        for ticket in [*self.tickets.values(), *self.parked, *self.scoring]:
            self.on_abort(ticket)
            ticket.post("error", ApiError(503, "the server is shutting down; request aborted"))

    def encode(self, job: Job) -> list[int]:
        if job.kind == "chat":
            return encode_messages(self.runtime.loaded.tokenizer, list(job.messages))
        if isinstance(job.prompt, tuple):  # token ids, as given
            return list(job.prompt)
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
            job, group, rid = ticket.job, ticket.group, ticket.rid
            self.record("add", group, ticket.ids, job.settings, rid, job.logprobs, job.grammar)
            self.tickets[(group, rid)] = ticket
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
            self.record("drop", idle[0])
        self.engines[group] = engines.build(self.runtime, group, self.slots)
        self.record("build", group)
        return self.engines[group]

    def step(self, group: engines.Group, pool: engines.Pool) -> None:
        out = pool.engine.step()
        self.metrics.stepped(pool.engine)
        watching = [(rid, t) for (g, rid), t in self.tickets.items() if g == group and t.frames]
        if watching:  # only then is the step's StepEvent built (serve/canvas.py)
            canvas.draw(pool.engine, out, watching)
        for done in out.finished:
            ticket = self.tickets.pop((group, done.id))
            self.complete(ticket, done.tokens, done)
        for (g, rid), ticket in list(self.tickets.items()):
            if g != group or not (ticket.job.stream or ticket.job.stop):
                continue
            prefix = pool.engine.progress(rid)
            new = ticket.deltas.feed(prefix)
            if new:
                self.send(ticket, new, self.streamed_logprobs(ticket, pool, rid, prefix))
            if ticket.deltas.stopped:  # a stop string: the answer is final before it
                del self.tickets[(g, rid)]
                ticket.buffers = pool.engine.requests[rid].logprob_buffers
                self.complete(ticket, *engines.stop_early(pool.engine, rid))
                self.record("stop", g, rid)

    def streamed_logprobs(self, ticket: Ticket, pool: engines.Pool, rid: int, prefix: list[int]):
        """A streamed answer's logprobs for the tokens its sent text now covers (a read of
        the request's buffers, for requests that asked only)."""
        if not ticket.job.stream or ticket.job.logprobs is None:
            return None
        buffers = pool.engine.requests[rid].logprob_buffers
        lo = ticket.sent_tokens
        ticket.sent_tokens = scores.covered(self.runtime, prefix, lo, ticket.deltas.sent)
        k = ticket.job.logprobs
        return scores.token_entries(self.runtime, buffers, k, prefix, lo, ticket.sent_tokens)

    def send(self, ticket: Ticket, text: str, logprobs: list | None = None) -> None:
        if ticket.first_text is None and text:
            ticket.first_text = time.perf_counter()
            self.metrics.first_text(ticket.first_text - ticket.added)
        if ticket.job.stream:
            ticket.post("text", text if logprobs is None else (text, logprobs))

    def complete(self, ticket: Ticket, tokens: list[int], done: engines.Counts) -> None:
        """The answer is final: the text still unsent, then the outcome with its counts."""
        special = self.runtime.loaded.special
        text = cut_at_stops(self.runtime.text(tokens), ticket.job.stop, final=True).text
        rest = ticket.deltas.finish(text)
        logprobs = self.answer_logprobs(ticket, tokens, done, text)
        unsent = (
            None if logprobs is None or not ticket.job.stream else logprobs[ticket.sent_tokens :]
        )
        if rest or unsent:
            self.send(ticket, rest, unsent)
        outcome = Outcome(
            text=text,
            finish_reason=finish_reason(tokens, special.stop, ticket.deltas.stopped),
            prompt_tokens=len(ticket.ids),
            completion_tokens=answer_length(tokens, special.stop),  # through its first stop
            forwards=done.forwards,
            guide_forwards=done.guide_forwards,
            steps=done.steps,
            seconds=time.perf_counter() - ticket.added,
            prompt_text=self.prompt_text(ticket) if ticket.job.echo else "",
            logprobs=logprobs,
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

    def answer_logprobs(self, ticket: Ticket, tokens: list[int], done, text: str):
        """The answer's per-token logprobs (scores.py), or None when not asked."""
        if ticket.job.logprobs is None:
            return None
        buffers = getattr(done, "logprobs", None) or ticket.buffers
        return scores.answer_logprobs(self.runtime, buffers, ticket.job.logprobs, tokens, text)

    def prompt_text(self, ticket: Ticket) -> str:
        """The prompt as text: as given, or its token ids decoded."""
        prompt = ticket.job.prompt
        if isinstance(prompt, str):
            return prompt
        return self.runtime.loaded.tokenizer.decode(list(prompt), skip_special_tokens=False)

    # --- scoring -------------------------------------------------------------------------------
    def add_scoring(self, ticket: Ticket) -> None:
        """A scoring job's checks (one-line 400s), then its place in the scoring queue."""
        try:
            ticket.ids = self.encode(ticket.job)
            scores.check_scoring(self.runtime, ticket.ids, ticket.job.score.generate)
        except InputError as e:
            return self.fail(ticket, input_error(e, "completion"))
        if self.aborting:
            return self.fail(ticket, ApiError(503, "the server is shutting down"))
        self.scoring.append(ticket)
        ticket.post("accepted", None)

    def score_or_fail(self, ticket: Ticket, split: scores.Split) -> None:
        """One estimate (one split) of the first scoring job; its answer after the last."""
        job, ids = ticket.job, ticket.ids
        try:
            ticket.totals.append(split.estimate(self.runtime))
            if split.last:
                self.scoring.remove(ticket)
                seconds = time.perf_counter() - ticket.added
                ticket.post(
                    "done", scores.scored(self.runtime, ids, ticket.totals, job.score, seconds)
                )
                self.finish(ticket)
        except RankLost:
            raise
        except Exception as e:  # a bug: this request's 500, the server goes on
            self.scoring.remove(ticket)
            self.fail(ticket, ApiError(500, f"internal error: {type(e).__name__}: {e}"[:300]))
