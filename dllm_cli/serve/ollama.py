"""Ollama's API beside OpenAI's: /api/generate, /api/chat, /api/tags, /api/show, /api/ps, /api/version.

A request is translated into the OpenAI-shaped body protocol.py validates (so both APIs hear
the same messages about the same settings) and decoded by the same worker; only the answer's
shape differs. Ollama streams by default: one JSON object per line (NDJSON), text as it is
committed, then a last object with `done: true`, the finish reason and the counts. Errors are
Ollama's `{"error": "..."}` with the HTTP status (app.answer_error writes that shape for every
path under /api/). What dllm cannot honour is refused by name, as on the OpenAI routes; options
that only tune Ollama's own loader (num_ctx, num_gpu, ...) are accepted and ignored.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dllm_cli.errors import DllmError
from dllm_cli.serve import engines
from dllm_cli.serve.app import Gone, Served, next_event, read_json
from dllm_cli.serve.protocol import EXTRA, ApiError, Job, parse
from dllm_cli.serve.worker import Outcome, Ticket
from dllm_cli.version import __version__

PREFIX = "/api/"
API_VERSION = "0.12.0"  # the Ollama API version these routes follow (clients gate features on it)
TAG = ":latest"  # Ollama names carry a tag; the served model answers to both spellings
NEVER = "2318-01-01T00:00:00Z"  # expires_at of a model kept loaded (Ollama's keep_alive -1)
NDJSON = "application/x-ndjson"

# Ollama option -> the OpenAI/DecodeSettings body field it sets.
OPTIONS = {
    "num_predict": "gen_length",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "stop": "stop",
}
# Ollama options that size or place its own runner: nothing an answer depends on here.
LOADER_OPTIONS = (
    "numa", "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
    "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep",
    "repeat_last_n",  # the window of repeat_penalty, which must be neutral
)  # fmt: skip
# Ollama options dllm cannot honour: refused unless given their neutral value.
NEUTRAL_OPTIONS = {
    "repeat_penalty": (1, 1.0),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "mirostat": (0,),
    "tfs_z": (1, 1.0),
    "typical_p": (1, 1.0),
    "min_p": (0, 0.0),
    "penalize_newline": (False,),
}
# Top-level fields refused unless given the value that changes nothing.
NEUTRAL_FIELDS = {
    "images": ([],),
    "tools": ([],),
    "suffix": ("",),
    "template": ("",),
    "context": ([],),
    "think": (False,),
    "logprobs": (False,),
    "top_logprobs": (0,),
}
IGNORED_FIELDS = ("keep_alive", "truncate", "shift")
GENERATE_FIELDS = ("model", "prompt", "system", "raw", "stream", "options", "format")
CHAT_FIELDS = ("model", "messages", "stream", "options", "format")
MESSAGE_FIELDS = ("role", "content", "images", "thinking", "tool_calls", "tool_name")


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
        body = await read_json(request)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        check_model(served, body.get("model", body.get("name")))
        served.metrics.request("/api/show", 200)
        return show_card(served)

    @app.post("/api/generate")
    async def generate(request: Request):
        return await answer(served, request, "generate")

    @app.post("/api/chat")
    async def chat(request: Request):
        return await answer(served, request, "chat")


# --- requests -> jobs ---------------------------------------------------------------------------


def served_name(served: Served) -> str:
    return served.model_id + TAG


def check_model(served: Served, name: object) -> None:
    """Ollama requires the model; the served one answers to NAME and NAME:latest."""
    if name is None or name == "":
        raise ApiError(400, "model is required")
    if not isinstance(name, str):
        raise ApiError(400, f"model must be a string (got {name!r})")
    if name not in (served.model_id, served_name(served)):
        raise ApiError(404, f"model {name!r} not found (this server serves {served.model_id!r})")


def check_fields(body: dict, allowed: tuple[str, ...]) -> None:
    for name, value in body.items():
        if name in NEUTRAL_FIELDS:
            if value is not None and value not in NEUTRAL_FIELDS[name]:
                raise ApiError(400, f"{name} is not supported by dllm")
        elif name not in allowed and name not in IGNORED_FIELDS:
            raise ApiError(400, f"unknown field {name!r}")


def translate_options(options: object) -> dict:
    """Ollama's options -> OpenAI body fields (dllm's own settings pass under their names)."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ApiError(400, "options must be an object")
    out: dict = {}
    for name, value in options.items():
        if value is None or name in LOADER_OPTIONS:
            continue
        if name in NEUTRAL_OPTIONS:
            if value not in NEUTRAL_OPTIONS[name]:
                raise ApiError(400, f"options.{name} is not supported by dllm")
            continue
        if name == "num_predict" and value == -1:  # Ollama's "until it stops": the server's length
            continue
        target = OPTIONS.get(name, name)
        if target not in (*OPTIONS.values(), *EXTRA, "guide"):
            raise ApiError(400, f"unknown option {name!r}")
        out[target] = value
    return out


def to_openai(body: dict, route: str, chat_template: bool) -> tuple[dict, str]:
    """An Ollama body -> (the OpenAI-shaped body protocol.parse takes, its kind)."""
    openai = translate_options(body.get("options"))
    structure = response_format(body.get("format"))
    if structure is not None:
        openai["response_format"] = structure
    if route == "chat":
        openai["messages"] = chat_messages(body["messages"])
        return openai, "chat"
    prompt, system = body.get("prompt"), body.get("system")
    if system is not None and not isinstance(system, str):
        raise ApiError(400, "system must be a string")
    if not isinstance(prompt, str):
        raise ApiError(400, "prompt must be a string")
    raw = body.get("raw", False)
    if not isinstance(raw, bool):
        raise ApiError(400, f"raw must be true or false (got {raw!r})")
    if raw or not chat_template:  # the prompt as it is (Ollama's template "{{ .Prompt }}")
        if system:
            raise ApiError(400, "system needs the model's chat template (not with raw)")
        openai["prompt"] = prompt
        return openai, "completion"
    turns = [{"role": "system", "content": system}] if system else []
    openai["messages"] = [*turns, {"role": "user", "content": prompt}]
    return openai, "chat"


def response_format(value: object) -> dict | None:
    """Ollama's `format` ("json", or a JSON schema) as OpenAI's response_format."""
    if value in (None, ""):
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}
    raise ApiError(400, 'format must be "json" or a JSON schema object')


def chat_messages(value: object) -> list[dict]:
    if not isinstance(value, list):
        raise ApiError(400, "messages must be a list of {role, content} objects")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object with a role and a content")
        for name, given in m.items():
            if name not in MESSAGE_FIELDS:
                raise ApiError(400, f"messages[{i}].{name} is not supported by dllm")
            if name not in ("role", "content") and given not in (None, "", []):
                raise ApiError(400, f"messages[{i}].{name} is not supported by dllm")
        out.append({"role": m.get("role"), "content": m.get("content", "")})
    return out


def is_load_only(body: dict, route: str) -> bool:
    """No prompt (generate) or no messages (chat): Ollama's way to load a model; it is loaded."""
    if route == "chat":
        return body.get("messages") in (None, [])
    return body.get("prompt") in (None, "")


def to_job(served: Served, body: dict, route: str) -> Job:
    runtime = served.worker.runtime
    has_template = bool(getattr(runtime.loaded.tokenizer, "chat_template", None))
    openai, kind = to_openai(body, route, has_template)
    openai["stream"] = body.get("stream", True)  # Ollama streams unless told not to
    try:
        job = parse(openai, kind, runtime.settings, served.model_id, runtime.guide is not None)
        engines.check_settings(runtime, job.settings)
        job = engines.with_grammar(runtime, job)
    except ApiError as e:
        raise ApiError(e.status, ollama_names(e.message)) from None
    except DllmError as e:
        raise ApiError(400, ollama_names(str(e))) from None
    return job


def ollama_names(message: str) -> str:
    """A settings message in the names the client sent (num_predict for gen_length)."""
    return message.replace("gen_length", "num_predict").replace("max_tokens", "num_predict")


# --- answers ------------------------------------------------------------------------------------


async def answer(served: Served, request: Request, route: str) -> Response:
    try:
        return await complete(served, request, route)
    except Gone:
        served.metrics.request(request.url.path, 499)
        return Response(status_code=499)


async def complete(served: Served, request: Request, route: str) -> Response:
    path = request.url.path
    body = await read_json(request)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_fields(body, CHAT_FIELDS if route == "chat" else GENERATE_FIELDS)
    check_model(served, body.get("model"))
    if is_load_only(body, route):
        served.metrics.request(path, 200)
        return JSONResponse(loaded_reply(served, route))
    job = to_job(served, body, route)
    events: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def post(what: str, payload: object) -> None:
        loop.call_soon_threadsafe(events.put_nowait, (what, payload))

    ticket = served.worker.submit(job, post, served.limit)
    try:
        what, payload = await next_event(events, request)
        if what == "error":
            raise payload  # type: ignore[misc]
        if job.stream:
            served.metrics.request(path, 200)
            lines = stream(served, request, ticket, events, route)
            return StreamingResponse(lines, media_type=NDJSON)
        while what != "done":
            what, payload = await next_event(events, request)
            if what == "error":
                raise payload  # type: ignore[misc]
    except Gone:
        served.worker.abort(ticket)
        raise
    served.metrics.request(path, 200)
    return JSONResponse(final(served, route, payload, payload.text))  # type: ignore[arg-type]


async def stream(
    served: Served, request: Request, ticket: Ticket, events: asyncio.Queue, route: str
) -> AsyncIterator[str]:
    """NDJSON: one object per committed piece of text, then the `done` object."""
    finished = False
    try:
        while True:
            what, payload = await next_event(events, request)
            if what == "text":
                yield line(piece(served, route, payload))  # type: ignore[arg-type]
            elif what == "error":
                finished = True
                yield line({"error": payload.message})  # type: ignore[union-attr]
                break
            elif what == "done":
                finished = True
                yield line(final(served, route, payload, ""))  # type: ignore[arg-type]
                break
    finally:
        if not finished:  # the client left: free its slot
            served.worker.abort(ticket)


def line(data: dict) -> str:
    return json.dumps(data, ensure_ascii=False) + "\n"


def now() -> str:
    """Ollama's created_at: RFC 3339 in UTC."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def text_field(route: str, text: str) -> dict:
    if route == "chat":
        return {"message": {"role": "assistant", "content": text}}
    return {"response": text}


def piece(served: Served, route: str, text: str) -> dict:
    return {
        "model": served_name(served),
        "created_at": now(),
        **text_field(route, text),
        "done": False,
    }


def final(served: Served, route: str, o: Outcome, text: str) -> dict:
    """The last object: Ollama's counts and durations (nanoseconds), and dllm's own counts."""
    nanos = int(o.seconds * 1e9)
    return {
        "model": served_name(served),
        "created_at": now(),
        **text_field(route, text),
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


def loaded_reply(served: Served, route: str) -> dict:
    body = {"model": served_name(served), "created_at": now(), **text_field(route, "")}
    return body | {"done": True, "done_reason": "load"}


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
    card["size"] = facts["memory"]
    card["size_vram"] = facts["memory"] if on_gpu else 0
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
