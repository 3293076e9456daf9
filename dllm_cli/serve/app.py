"""The FastAPI app: OpenAI's chat and completions routes on the stepping thread's engines.

Bodies are read as raw JSON and validated by protocol.py (not by pydantic models), so every
refusal names its field in OpenAI's error object; every error, a bug included, is answered as
one, never as a traceback. A handler waits on its request's own event queue, which the
stepping thread fills (accepted, text, done, error); a client that leaves aborts its request.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from itertools import accumulate

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from dllm_cli.serve import canvas, engines, ollama, page
from dllm_cli.serve.metrics import CONTENT_TYPE
from dllm_cli.serve.plumbing import (
    Served,
    Waiting,
    answer_error,
    authorized,
    read_json,
    route_error,
    unless_gone,
)
from dllm_cli.serve.protocol import ApiError, Job, Score, choices, parse
from dllm_cli.serve.scores import Scored, TokenLogprob
from dllm_cli.serve.tickets import Outcome


def create_app(served: Served) -> FastAPI:
    app = FastAPI(title="dllm", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served = served

    @app.middleware("http")
    async def guard(request: Request, call_next):
        """API key (not for /health), and any uncaught error as an error object (500)."""
        path = request.url.path
        open_path = path == "/health" or page.is_page(path, served.ui)  # the page asks for a key
        if served.api_key is not None and not open_path and not authorized(request, served):
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
        return answer_error(served, request.url.path, route_error(request, e))

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
        return await unless_gone(served, request, complete(served, request, "chat"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await unless_gone(served, request, complete(served, request, "completion"))

    ollama.add_routes(app, served)
    page.add_routes(app, served)
    return app


def model_card(served: Served) -> dict:
    return {"id": served.model_id, "object": "model", "created": served.created, "owned_by": "dllm"}


async def complete(served: Served, request: Request, kind: str) -> Response:
    """Validate, submit every prompt and choice together, then answer (or stream) them."""
    path = request.url.path
    body = await read_json(request)
    rt = served.worker.runtime
    job = engines.checked(rt, parse(body, kind, rt.settings, served.model_id, rt.guide is not None))
    if job.kind == "score":
        job = replace(job, score=served_defaults(served, job.score))
    waiting = Waiting.submit(served, request, choices(job))
    await waiting.accepted()
    if job.stream:
        served.metrics.request(path, 200)
        chunks = stream(served, waiting, kind)
        return StreamingResponse(chunks, media_type="text/event-stream")
    outcomes = await waiting.outcomes()
    served.metrics.request(path, 200)
    if job.kind == "score":
        return JSONResponse(scored_answer(served, job, outcomes))  # type: ignore[arg-type]
    return JSONResponse(whole(served, outcomes, kind))  # type: ignore[arg-type]


def served_defaults(served: Served, score: Score) -> Score:
    """A scoring request's options with the server's defaults where it gave none."""
    samples = score.samples or served.score_samples
    batch = score.batch if samples is None or (score.batch or 0) <= samples else None
    splits = score.splits or served.score_splits
    return replace(score, samples=samples, batch=batch, splits=splits)


async def stream(served: Served, waiting: Waiting, kind: str) -> AsyncIterator[str]:
    """Server-sent events: text as it is committed (each choice by its index), each choice's
    finish chunk (the last one with the request's usage), [DONE]."""
    ids = response_id(kind)
    left = len(waiting.tickets)
    finished: list[Outcome] = []
    offsets = [0] * left  # completions: each choice's text sent so far (text_offset)
    try:
        if kind == "chat":
            for i in range(left):
                yield sse(chunk(served, ids, kind, {"role": "assistant", "content": ""}, i))
        while left:
            index, what, payload = await waiting.next()
            if what == "text":
                text, entries = payload if isinstance(payload, tuple) else (payload, None)
                logprobs = None if entries is None else shaped(entries, kind, offsets[index])
                offsets[index] += len(text)  # type: ignore[arg-type]
                yield sse(chunk(served, ids, kind, text, index, logprobs=logprobs))
            elif what == "canvas":  # stream_options.include_canvas (serve/canvas.py)
                yield sse(canvas.chunk(served.model_id, ids, kind, payload, index))
            elif what == "error":
                left = 0
                waiting.abort()
                yield sse(payload.body())  # type: ignore[union-attr]
            elif what == "done":
                left -= 1
                finished.append(payload)  # type: ignore[arg-type]
                total = summed(finished) if not left else None
                last = chunk(served, ids, kind, None, index, payload, total)  # type: ignore[arg-type]
                yield sse(last)
        yield "data: [DONE]\n\n"
    finally:
        if left:  # the client left (or the response was cancelled): free the slots
            waiting.abort()


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def response_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)


def chunk(
    served: Served,
    rid: str,
    kind: str,
    text: object,
    index: int = 0,
    outcome: Outcome | None = None,
    total: Outcome | None = None,
    logprobs: dict | None = None,
) -> dict:
    """One SSE chunk in OpenAI's format (logprobs: those of its text's tokens); a choice's
    last carries its finish reason, the request's last the usage."""
    reason = outcome.finish_reason if outcome is not None else None
    if kind == "chat":
        delta = text if isinstance(text, dict) else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": int(time.time()), "model": served.model_id}
    out["choices"] = [choice]
    if total is not None:
        out["usage"] = usage(total)
    return out


def whole(served: Served, outcomes: list[Outcome], kind: str) -> dict:
    """A non-streamed answer: one choice per prompt and n, by index."""
    picked = []
    for i, outcome in enumerate(outcomes):
        logprobs = rendered(outcome, kind)
        if kind == "chat":
            message = {"role": "assistant", "content": outcome.text}
            choice = {"index": i, "message": message, "logprobs": logprobs}
        else:
            choice = {"index": i, "text": outcome.prompt_text + outcome.text, "logprobs": logprobs}
        choice["finish_reason"] = outcome.finish_reason
        picked.append(choice)
    return envelope(served, kind, picked, usage(summed(outcomes)))


def rendered(outcome: Outcome, kind: str) -> dict | None:
    """An answer's token logprobs in OpenAI's shape for `kind` (None when not asked)."""
    if outcome.logprobs is None:
        return None
    return shaped(outcome.logprobs, kind, len(outcome.prompt_text))


def shaped(entries: list[TokenLogprob], kind: str, start: int) -> dict:
    """Token logprobs as chat's `content` list or completions' parallel lists."""
    if kind == "chat":
        return {"content": [chat_token(t) for t in entries], "refusal": None}
    tokens = [t.token for t in entries]
    top = [dict(t.top) for t in entries]
    return completion_logprobs(tokens, [t.logprob for t in entries], top, start)


def completion_logprobs(tokens: list[str], values: list, top: list, start: int = 0) -> dict:
    """Completions' parallel lists; text_offset: where each token starts, counted from `start`."""
    offsets = list(accumulate((len(t) for t in tokens[:-1]), initial=start)) if tokens else []
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top, "text_offset": offsets}


def chat_token(t: TokenLogprob) -> dict:
    top = [{"token": s, "logprob": v, "bytes": list(s.encode())} for s, v in t.top]
    entry = {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode())}
    return entry | {"top_logprobs": top}


def envelope(served: Served, kind: str, picked: list[dict], counts: dict) -> dict:
    obj = "chat.completion" if kind == "chat" else "text_completion"
    return {
        "id": response_id(kind),
        "object": obj,
        "created": int(time.time()),
        "model": served.model_id,
        "choices": picked,
        "usage": counts,
    }


def scored_answer(served: Served, job: Job, outcomes: list[Scored]) -> dict:
    """Echo scoring in OpenAI's completions logprobs shape (see docs/scoring.md)."""
    picked = []
    for i, s in enumerate(outcomes):
        logprobs = completion_logprobs(s.tokens, s.values, s.top)
        reason = "length" if job.score.generate else "stop"
        choice = {"index": i, "text": "".join(s.tokens), "logprobs": logprobs}
        picked.append(choice | {"finish_reason": reason})
    prompt = sum(s.prompt_tokens for s in outcomes)
    made = len(outcomes) if job.score.generate else 0
    counts = {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made}
    counts |= {"forwards": sum(s.forwards for s in outcomes), "guide_forwards": 0, "steps": 0}
    counts["seconds"] = round(max(s.seconds for s in outcomes), 6)
    return envelope(served, "completion", picked, counts)


def summed(outcomes: list[Outcome]) -> Outcome:
    """One request's counts over its choices (seconds: the longest)."""
    added = ("prompt_tokens", "completion_tokens", "forwards", "guide_forwards", "steps")
    counts = {name: sum(getattr(o, name) for o in outcomes) for name in added}
    return Outcome(text="", finish_reason="", **counts, seconds=max(o.seconds for o in outcomes))


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
