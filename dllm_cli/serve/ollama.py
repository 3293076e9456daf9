"""Ollama's API beside OpenAI's: /api/generate, /api/chat, /api/tags, /api/show, /api/ps, /api/version.

A request is translated (ollama_request.py) into the OpenAI-shaped body protocol.py validates
(so both APIs hear the same messages about the same settings) and decoded by the same worker;
only the answer's shape differs. Ollama streams by default: one JSON object per line (NDJSON),
text as it is committed, then a last object with `done: true`, the finish reason and the counts.
Errors are Ollama's `{"error": "..."}` with the HTTP status (plumbing.answer_error writes that
shape for every path under /api/). What dllm cannot honour is refused by name, as on the OpenAI
routes; options that only tune Ollama's own loader (num_ctx, num_gpu, ...) are accepted and
ignored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dllm_cli.serve.ollama_request import (
    CHAT_FIELDS,
    GENERATE_FIELDS,
    check_fields,
    check_model,
    is_load_only,
    served_name,
    to_job,
)
from dllm_cli.serve.plumbing import Served, Waiting, read_object, unless_gone
from dllm_cli.serve.tickets import Outcome
from dllm_cli.version import __version__

PREFIX = "/api/"
API_VERSION = "0.12.0"  # the Ollama API version these routes follow (clients gate features on it)
NEVER = "2318-01-01T00:00:00Z"  # expires_at of a model kept loaded (Ollama's keep_alive -1)
NDJSON = "application/x-ndjson"


def add_routes(app: FastAPI, served: Served) -> None:
    """Ollama's routes on the OpenAI server's app (same worker, key, limits and metrics)."""

    @app.get("/api/version")
    async def version():
        served.metrics.request("/api/version", 200)
        return {"version": API_VERSION, "dllm": __version__}

    @app.get("/api/tags")
    async def tags():
        served.metrics.request("/api/tags", 200)
        return {"models": [tag_card(served)]}

    @app.get("/api/ps")
    async def ps():
        served.metrics.request("/api/ps", 200)
        return {"models": [loaded_card(served)]}

    @app.post("/api/show")
    async def show(request: Request):
        body = await read_object(request)
        check_model(served, body.get("model", body.get("name")))
        served.metrics.request("/api/show", 200)
        return show_card(served)

    @app.post("/api/generate")
    async def generate(request: Request):
        return await unless_gone(served, request, complete(served, request, "generate"))

    @app.post("/api/chat")
    async def chat(request: Request):
        return await unless_gone(served, request, complete(served, request, "chat"))


# --- answers ------------------------------------------------------------------------------------


async def complete(served: Served, request: Request, route: str) -> Response:
    path = request.url.path
    body = await read_object(request)
    check_fields(body, CHAT_FIELDS if route == "chat" else GENERATE_FIELDS)
    check_model(served, body.get("model"))
    if is_load_only(body, route):
        served.metrics.request(path, 200)
        return JSONResponse(head(served, route, "") | {"done": True, "done_reason": "load"})
    job = to_job(served, body, route)
    waiting = Waiting.submit(served, request, [job])
    await waiting.accepted()
    if job.stream:
        served.metrics.request(path, 200)
        return StreamingResponse(stream(served, waiting, route), media_type=NDJSON)
    outcome = (await waiting.outcomes())[0]
    served.metrics.request(path, 200)
    return JSONResponse(final(served, route, outcome, outcome.text))  # type: ignore[arg-type]


async def stream(served: Served, waiting: Waiting, route: str) -> AsyncIterator[str]:
    """NDJSON: one object per committed piece of text, then the `done` object."""
    finished = False
    try:
        while not finished:
            _, what, payload = await waiting.next()
            if what == "text":
                yield line(piece(served, route, payload))  # type: ignore[arg-type]
            elif what == "error":
                finished = True
                yield line({"error": payload.message})  # type: ignore[union-attr]
            elif what == "done":
                finished = True
                yield line(final(served, route, payload, ""))  # type: ignore[arg-type]
    finally:
        if not finished:  # the client left: free its slot
            waiting.abort()


def line(data: dict) -> str:
    return json.dumps(data, ensure_ascii=False) + "\n"


def now() -> str:
    """Ollama's created_at: RFC 3339 in UTC."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def head(served: Served, route: str, text: str) -> dict:
    """What every answer object starts with: the model, the time, the text."""
    message = {"role": "assistant", "content": text}
    said = {"message": message} if route == "chat" else {"response": text}
    return {"model": served_name(served), "created_at": now(), **said}


def piece(served: Served, route: str, text: str) -> dict:
    return head(served, route, text) | {"done": False}


def final(served: Served, route: str, o: Outcome, text: str) -> dict:
    """The last object: Ollama's counts and durations (nanoseconds), and dllm's own counts."""
    nanos = int(o.seconds * 1e9)
    return head(served, route, text) | {
        "done": True,
        "done_reason": o.finish_reason,
        "total_duration": nanos,
        "load_duration": 0,
        "prompt_eval_count": o.prompt_tokens,
        "prompt_eval_duration": 0,  # the prompt is read inside every denoising step
        "eval_count": o.completion_tokens,
        "eval_duration": nanos,
        "forwards": o.forwards,
        "guide_forwards": o.guide_forwards,
        "steps": o.steps,
    }


# --- model cards --------------------------------------------------------------------------------


FACTS: dict[int, dict] = {}  # id(served) -> its model's facts (one server, one model)


def model_facts(served: Served) -> dict:
    """What the model cards say, computed once (the model is only read)."""
    if id(served) in FACTS:
        return FACTS[id(served)]
    loaded = served.worker.runtime.loaded
    params = list(loaded.model.parameters()) + list(loaded.model.buffers())
    folder = Path(loaded.path)
    files = [p for p in folder.iterdir() if p.is_file()] if folder.is_dir() else []
    config = folder / "config.json"
    facts = {
        "parameters": sum(p.numel() for p in loaded.model.parameters()),
        "memory": sum(p.numel() * p.element_size() for p in params),
        "disk": sum(p.stat().st_size for p in files),
        "digest": hashlib.sha256(config.read_bytes() if config.is_file() else b"").hexdigest(),
        "modified": datetime.fromtimestamp(
            config.stat().st_mtime if config.is_file() else time.time(), timezone.utc
        ).isoformat(),
    }
    FACTS[id(served)] = facts
    return facts


def parameter_size(n: int) -> str:
    """Ollama's "8.0B" / "12.3M"."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def precision(served: Served) -> str:
    """Ollama's quantization_level, in dllm's terms: INT8/INT4, else the weights' dtype."""
    runtime = served.worker.runtime
    scheme = runtime.profile.model.quantize
    if scheme and scheme != "none":
        return scheme.upper()
    names = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
    dtype = str(runtime.loaded.dtype).removeprefix("torch.")
    return names.get(dtype, dtype.upper())


def details(served: Served) -> dict:
    loaded = served.worker.runtime.loaded
    return {
        "parent_model": "",
        "format": "safetensors",
        "family": loaded.family,
        "families": [loaded.family],
        "parameter_size": parameter_size(model_facts(served)["parameters"]),
        "quantization_level": precision(served),
    }


def tag_card(served: Served) -> dict:
    facts = model_facts(served)
    return {
        "name": served_name(served),
        "model": served_name(served),
        "modified_at": facts["modified"],
        "size": facts["disk"],
        "digest": facts["digest"],
        "details": details(served),
    }


def loaded_card(served: Served) -> dict:
    facts = model_facts(served)
    on_gpu = served.worker.runtime.loaded.device.type == "cuda"
    card = {k: v for k, v in tag_card(served).items() if k != "modified_at"}
    card |= {"size": facts["memory"], "size_vram": facts["memory"] if on_gpu else 0}
    card["expires_at"] = NEVER
    card["context_length"] = served.worker.runtime.loaded.model.context_length
    return card


def parameters_text(served: Served) -> str:
    """The server's defaults as Modelfile PARAMETER lines: Ollama's names, then dllm's."""
    settings = dataclasses.asdict(served.worker.runtime.settings)
    names = {"gen_length": "num_predict"}
    return "\n".join(
        f"{names.get(k, k)} {json.dumps(v)}" for k, v in settings.items() if v is not None
    )


def show_card(served: Served) -> dict:
    runtime = served.worker.runtime
    loaded, facts = runtime.loaded, model_facts(served)
    params = parameters_text(served)
    modelfile = f"# served by dllm {__version__}\nFROM {loaded.path}\n" + "".join(
        f"PARAMETER {p}\n" for p in params.splitlines()
    )
    arch = loaded.architecture
    return {
        "modelfile": modelfile,
        "parameters": params,
        "template": getattr(loaded.tokenizer, "chat_template", None) or "",
        "details": details(served),
        "model_info": {
            "general.architecture": arch,
            "general.parameter_count": facts["parameters"],
            f"{arch}.context_length": loaded.model.context_length,
            f"{arch}.vocab_size": loaded.model.vocab_size,
        },
        "capabilities": ["completion"],
        "modified_at": facts["modified"],
    }
