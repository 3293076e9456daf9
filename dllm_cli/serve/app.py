"""The FastAPI app: OpenAI's chat and completions routes on the stepping thread's engines.

Bodies are read as raw JSON and validated by protocol.py (not by pydantic models), so every
refusal names its field in OpenAI's error object; every error, a bug included, is answered as
one, never as a traceback. A handler waits on its request's own event queue, which the
stepping thread fills (accepted, text, done, error); a client that leaves aborts its request.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from dllm_cli.errors import DllmError
from dllm_cli.serve import engines
from dllm_cli.serve.metrics import CONTENT_TYPE, Metrics
from dllm_cli.serve.protocol import ApiError, Job, parse
from dllm_cli.serve.worker import Outcome, Ticket, Worker

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


class Gone(Exception):
    """The client disconnected."""


def create_app(served: Served) -> FastAPI:
    app = FastAPI(title="dllm", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served = served

    @app.middleware("http")
    async def guard(request: Request, call_next):
        """API key (not for /health), and any uncaught error as an error object (500)."""
        path = request.url.path
        if served.api_key is not None and path != "/health" and not authorized(request, served):
            error = ApiError(401, "missing or wrong API key (send Authorization: Bearer KEY)")
            return answer_error(served, path, error)
        try:
            return await call_next(request)
        except Exception as e:  # a bug of ours: a one-line error object, never a traceback
            return answer_error(served, path, ApiError(500, f"internal error: {type(e).__name__}"))

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, e: ApiError):
        return answer_error(served, request.url.path, e)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, e: HTTPException):
        return answer_error(served, request.url.path, ApiError(e.status_code, str(e.detail)))

    @app.get("/health")
    async def health():
        if served.worker.stopping.is_set():
            raise ApiError(503, "the server is shutting down")
        return {"status": "ok", "model": served.model_id}

    @app.get("/v1/models")
    async def models():
        served.metrics.request("/v1/models", 200)
        return {"object": "list", "data": [model_card(served)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != served.model_id:
            raise ApiError(404, f"model {name!r} is not served here", "model")
        return model_card(served)

    @app.get("/metrics")
    async def metrics():
        return Response(served.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await answer(served, request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(served, request, "completion")

    from dllm_cli.serve.ollama import add_routes  # imports this module: added once it exists

    add_routes(app, served)
    return app


def authorized(request: Request, served: Served) -> bool:
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip(), served.api_key)


def answer_error(served: Served, path: str, e: ApiError) -> JSONResponse:
    served.metrics.request(path, e.status)
    body = {"error": e.message} if path.startswith("/api/") else e.body()  # Ollama's shape
    return JSONResponse(body, status_code=e.status)


def model_card(served: Served) -> dict:
    return {"id": served.model_id, "object": "model", "created": served.created, "owned_by": "dllm"}


async def read_json(request: Request) -> object:
    raw = await request.body()
    if len(raw) > MAX_BODY:
        raise ApiError(413, f"request body over {MAX_BODY} bytes")
    try:
        return json.loads(raw, parse_constant=refuse_constant)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"invalid JSON body: {str(e).splitlines()[0][:200]}") from None


def refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


async def answer(served: Served, request: Request, kind: str) -> Response:
    try:
        return await complete(served, request, kind)
    except Gone:  # nobody reads this answer; 499 as nginx logs a client that left
        served.metrics.request(request.url.path, 499)
        return Response(status_code=499)


async def complete(served: Served, request: Request, kind: str) -> Response:
    path = request.url.path
    body = await read_json(request)
    worker = served.worker
    job = parse(
        body, kind, worker.runtime.settings, served.model_id, worker.runtime.guide is not None
    )
    try:
        engines.check_settings(worker.runtime, job.settings)
    except DllmError as e:
        raise ApiError(400, str(e)) from None
    job = engines.with_grammar(worker.runtime, job)
    events: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def post(what: str, payload: object) -> None:
        loop.call_soon_threadsafe(events.put_nowait, (what, payload))

    ticket = worker.submit(job, post, served.limit)
    try:
        what, payload = await next_event(events, request)
    except Gone:
        worker.abort(ticket)
        raise
    if what == "error":
        raise payload  # type: ignore[misc]
    if job.stream:
        served.metrics.request(path, 200)
        chunks = stream(served, request, job, ticket, events, kind)
        return StreamingResponse(chunks, media_type="text/event-stream")
    try:
        while what != "done":
            what, payload = await next_event(events, request)
            if what == "error":
                raise payload  # type: ignore[misc]
    except Gone:
        worker.abort(ticket)
        raise
    served.metrics.request(path, 200)
    return JSONResponse(whole(served, job, payload, kind))  # type: ignore[arg-type]


async def next_event(events: asyncio.Queue, request: Request) -> tuple[str, object]:
    """The request's next event; Gone when the client left while it waited."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), POLL)
        except TimeoutError:
            if await request.is_disconnected():
                raise Gone() from None


async def stream(
    served: Served, request: Request, job: Job, ticket: Ticket, events: asyncio.Queue, kind: str
) -> AsyncIterator[str]:
    """Server-sent events: text as it is committed, the finish chunk (with usage), [DONE]."""
    ids = response_id(kind)
    finished = False
    try:
        if kind == "chat":
            yield sse(chunk(served, ids, kind, {"role": "assistant", "content": ""}))
        while True:
            what, payload = await next_event(events, request)
            if what == "text":
                yield sse(chunk(served, ids, kind, payload))
            elif what == "error":
                finished = True
                yield sse(payload.body())  # type: ignore[union-attr]
                break
            elif what == "done":
                finished = True
                yield sse(chunk(served, ids, kind, None, payload))  # type: ignore[arg-type]
                break
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # the client left (or the response was cancelled): free its slot
            served.worker.abort(ticket)


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def response_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)


def chunk(
    served: Served, rid: str, kind: str, text: object, outcome: Outcome | None = None
) -> dict:
    """One SSE chunk in OpenAI's format; the last carries the finish reason and usage."""
    reason = outcome.finish_reason if outcome is not None else None
    if kind == "chat":
        delta = text if isinstance(text, dict) else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": int(time.time()), "model": served.model_id}
    out["choices"] = [choice]
    if outcome is not None:
        out["usage"] = usage(outcome)
    return out


def whole(served: Served, job: Job, outcome: Outcome, kind: str) -> dict:
    """A non-streamed answer."""
    if kind == "chat":
        message = {"role": "assistant", "content": outcome.text}
        choice = {"index": 0, "message": message, "logprobs": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": outcome.text, "logprobs": None}
        obj = "text_completion"
    choice["finish_reason"] = outcome.finish_reason
    return {
        "id": response_id(kind),
        "object": obj,
        "created": int(time.time()),
        "model": served.model_id,
        "choices": [choice],
        "usage": usage(outcome),
    }


def usage(o: Outcome) -> dict:
    """OpenAI's token counts, then dllm's own (what the answer cost the model)."""
    return {
        "prompt_tokens": o.prompt_tokens,
        "completion_tokens": o.completion_tokens,
        "total_tokens": o.prompt_tokens + o.completion_tokens,
        "forwards": o.forwards,
        "guide_forwards": o.guide_forwards,
        "steps": o.steps,
        "seconds": round(o.seconds, 6),
    }
