"""HTTP plumbing the OpenAI routes (app.py) and Ollama's (ollama.py) share.

What the routes are served with, the API key check, error answers in each API's shape,
reading a JSON body, and waiting on a request's events while its client is still there.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from dllm_cli.serve.metrics import ROUTES, Metrics
from dllm_cli.serve.protocol import ApiError, Job
from dllm_cli.serve.worker import Worker

MAX_BODY = 4 * 1024 * 1024  # bytes: a request body past this is refused (413)
POLL = 0.25  # seconds between checks that a waiting client is still there


@dataclass
class Served:
    """What the routes need besides the worker."""

    model_id: str
    worker: Worker
    metrics: Metrics
    limit: int  # requests waiting or decoding before a 429
    api_key: str | None = None
    created: int = 0
    score_samples: int | None = None  # echo scoring's default (None: the family's)
    score_splits: int | None = None  # echo scoring's default (None: every position)
    ui: bool = True  # the chat page at / (serve/page.py); --no-ui: 404


class Gone(Exception):
    """The client disconnected."""


def route_error(request: Request, e: HTTPException) -> ApiError:
    """Starlette's refusals (no such route, wrong method) as error objects naming the route."""
    where = f"{request.method} {request.url.path}"
    if e.status_code == 404:
        message = f"unknown route {where} (dllm serves {', '.join(ROUTES)})"
        return ApiError(404, message, kind="invalid_request_error", code="unknown_route")
    if e.status_code == 405:
        return ApiError(405, f"method not allowed: {where}", code="method_not_allowed")
    return ApiError(e.status_code, str(e.detail))


def authorized(request: Request, served: Served) -> bool:
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip(), served.api_key)


def answer_error(served: Served, path: str, e: ApiError) -> JSONResponse:
    served.metrics.request(path, e.status)
    body = {"error": e.message} if path.startswith("/api/") else e.body()  # Ollama's shape
    return JSONResponse(body, status_code=e.status)


async def read_json(request: Request) -> object:
    raw = await request.body()
    if len(raw) > MAX_BODY:
        raise ApiError(413, f"request body over {MAX_BODY} bytes")
    try:
        return json.loads(raw, parse_constant=refuse_constant)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"invalid JSON body: {str(e).splitlines()[0][:200]}") from None


async def read_object(request: Request) -> dict:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


async def next_event(events: asyncio.Queue, request: Request) -> tuple[str, object]:
    """The request's next event; Gone when the client left while it waited."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), POLL)
        except TimeoutError:
            if await request.is_disconnected():
                raise Gone() from None


def poster(events: asyncio.Queue, *tag: object) -> Callable[[str, object], None]:
    """The stepping thread's callback for one request: (*tag, what, payload) onto `events`,
    on the handler's event loop."""
    loop = asyncio.get_running_loop()

    def post(what: str, payload: object) -> None:
        loop.call_soon_threadsafe(events.put_nowait, (*tag, what, payload))

    return post


async def unless_gone(served: Served, request: Request, answer: Awaitable[Response]) -> Response:
    """The answer, or 499 (as nginx logs a client that left) when nobody reads it."""
    try:
        return await answer
    except Gone:
        served.metrics.request(request.url.path, 499)
        return Response(status_code=499)


class Waiting:
    """A request's tickets and their tagged events; any failure aborts them all."""

    def __init__(self, events: asyncio.Queue, request: Request, worker: Worker, tickets: list):
        self.events, self.request, self.worker, self.tickets = events, request, worker, tickets
        self.early: list[tuple[int, str, object]] = []  # text that came before every accept

    @classmethod
    def submit(cls, served: Served, request: Request, jobs: list[Job]) -> Waiting:
        """Every job queued together (all or none), their events tagged by index."""
        events: asyncio.Queue = asyncio.Queue()
        posts = [(job, poster(events, i)) for i, job in enumerate(jobs)]
        return cls(events, request, served.worker, served.worker.submit_all(posts, served.limit))

    async def next(self) -> tuple[int, str, object]:
        if self.early:
            return self.early.pop(0)
        try:
            return await next_event(self.events, self.request)
        except Gone:
            self.abort()
            raise

    def abort(self) -> None:
        for ticket in self.tickets:
            self.worker.abort(ticket)

    async def accepted(self) -> None:
        """Every part accepted, or the first refusal raised (the others aborted)."""
        await self.every("accepted", keep=True)

    async def outcomes(self) -> list[object]:
        """Every part's outcome, in part order."""
        done = await self.every("done", keep=False)
        return [done[i] for i in range(len(self.tickets))]

    async def every(self, wanted: str, keep: bool) -> dict[int, object]:
        """Each part's `wanted` event's payload; an error raised (the others aborted), other
        events kept for later where `keep` (text that came before every accept)."""
        got: dict[int, object] = {}
        while len(got) < len(self.tickets):
            index, what, payload = await self.next()
            if what == "error":
                self.abort()
                raise payload  # type: ignore[misc]
            if what == wanted:
                got[index] = payload
            elif keep:
                self.early.append((index, what, payload))
        return got
