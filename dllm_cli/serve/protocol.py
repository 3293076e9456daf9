"""OpenAI request bodies -> validated jobs, and OpenAI-style error objects.

Fields follow OpenAI's chat and completions APIs: `max_tokens` is the generation length (the
canvas dllm denoises), `stop` cuts the answer before the first of its strings. What dllm
cannot honour (`n` other than 1, logprobs, tools, ...) is refused with a 400 naming the field
rather than silently ignored. dllm's own decoding settings come as extra body fields (the
`openai` client's `extra_body`) under DecodeSettings' names and are validated by
DecodeSettings itself, so a request hears the messages a CLI flag would.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dllm_cli.errors import DllmError, InputError
from dllm_cli.serve.conversation import Message
from dllm_cli.settings import DecodeSettings
from dllm_cli.strict_toml import did_you_mean

# Sampling settings a request may set without a canvas of its own (per-request in the engine).
SAMPLING = ("temperature", "top_p", "top_k", "seed")
# DecodeSettings fields a request may not set: how the server batches is the server's.
SERVER_ONLY = ("batching",)
EXTRA = tuple(
    f.name for f in dataclasses.fields(DecodeSettings) if f.name not in (*SAMPLING, *SERVER_ONLY)
)
# Accepted and ignored: they change nothing an answer depends on.
IGNORED = ("user", "metadata", "store", "service_tier", "stream_options")
# OpenAI fields dllm cannot honour, refused by name (a value equal to the default passes).
UNSUPPORTED = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "parallel_tool_calls": (None,),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
}
COMMON = ("model", "max_tokens", "stop", "stream", "n", *SAMPLING, "guide", "response_format")
CHAT_FIELDS = ("messages", "max_completion_tokens", *COMMON)
COMPLETION_FIELDS = ("prompt", *COMMON)
MAX_STOPS = 4  # as OpenAI


class ApiError(Exception):
    """An HTTP error answered as OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = ""):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or KINDS.get(status, "invalid_request_error")

    def body(self) -> dict:
        code = CODES.get(self.status)
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": code}
        }


KINDS = {
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "server_error",
    500: "server_error",
}
CODES = {401: "invalid_api_key", 404: "model_not_found", 429: "queue_full", 503: "shutting_down"}


@dataclass(frozen=True)
class Job:
    """One request, validated: what to decode, with which settings, and how to answer."""

    kind: str  # "chat" | "completion"
    messages: tuple[Message, ...] = ()  # chat
    prompt: str = ""  # completion
    settings: DecodeSettings = field(default_factory=DecodeSettings)  # the engine's group
    sampling: dict = field(default_factory=dict)  # per-request sampling overrides given
    guide: bool = True  # decode with the loaded guide (if any)
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a usage chunk before [DONE]
    structure: tuple[str, object] | None = None  # response_format: (grammar kind, source)
    grammar: object | None = None  # the compiled grammar (app.py compiles `structure`)


def parse(body: object, kind: str, base: DecodeSettings, model_id: str, guided: bool) -> Job:
    """A request body -> Job, or ApiError(400/404) naming the field at fault."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    allowed = (CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS) + EXTRA + IGNORED
    for name, value in body.items():
        if name in UNSUPPORTED:
            if not any(value == ok and type(value) is type(ok) for ok in UNSUPPORTED[name]):
                raise ApiError(400, f"{name} is not supported by dllm", name)
        elif name not in allowed:
            hint = did_you_mean(name, allowed)
            raise ApiError(400, f"unknown field {name!r}{hint}", name)
    check_model(body.get("model"), model_id)
    if body.get("n", 1) != 1 or isinstance(body.get("n"), bool):
        raise ApiError(
            400, f"n must be 1: dllm returns one answer per request (got {body['n']!r})", "n"
        )
    stream = flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise ApiError(400, "stream_options may only hold include_usage", "stream_options")
    usage = flag(options or {}, "include_usage", "stream_options.include_usage")
    structure = response_format(body.get("response_format"))
    guide = flag(body, "guide", default=guided and structure is None)  # asked for: both verify
    if guide and not guided:
        raise ApiError(400, "guide: the served profile has no guide model loaded", "guide")
    settings, sampling = decode_settings(body, base)
    common = {"settings": settings, "sampling": sampling, "guide": guide, "stream": stream}
    common |= {"stop": stops(body.get("stop")), "include_usage": usage, "structure": structure}
    if kind == "chat":
        return Job("chat", messages=messages(body.get("messages")), **common)
    return Job("completion", prompt=completion_prompt(body.get("prompt")), **common)


def response_format(value: object) -> tuple[str, object] | None:
    """OpenAI's response_format -> (grammar kind, source); None for plain text."""
    where = "response_format"
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ApiError(400, "response_format must be an object with a type", where)
    kind = value["type"]
    if kind not in FORMATS:
        raise ApiError(400, f"response_format.type must be one of {', '.join(FORMATS)}", where)
    extra = set(value) - {"type", *FORMATS[kind]}
    if extra:
        raise ApiError(400, f"response_format: unknown field {sorted(extra)[0]!r}", where)
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", None
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise ApiError(400, "response_format.json_schema must be an object with a schema", where)
    if not isinstance(spec.get("name", ""), str) or set(spec) - SCHEMA_FIELDS:
        raise ApiError(400, "response_format.json_schema: name, schema, strict, description", where)
    return "json_schema", spec.get("schema", {})


# response_format.type -> the fields beside `type` it may have (OpenAI's shapes)
FORMATS = {"text": (), "json_object": (), "json_schema": ("json_schema",)}
SCHEMA_FIELDS = {"name", "schema", "strict", "description"}


def check_model(name: object, model_id: str) -> None:
    if name is None:
        return
    if not isinstance(name, str):
        raise ApiError(400, f"model must be a string (got {name!r})", "model")
    if name != model_id:
        raise ApiError(
            404, f"model {name!r} is not served here (this server serves {model_id!r})", "model"
        )


def flag(body: dict, name: str, param: str | None = None, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false (got {value!r})", param or name)
    return value


def decode_settings(body: dict, base: DecodeSettings) -> tuple[DecodeSettings, dict]:
    """The server's settings with the request's own: validated as DecodeSettings validates."""
    given = {k: v for k, v in body.items() if (k in EXTRA or k in SAMPLING) and v is not None}
    alias = None  # max_tokens (or max_completion_tokens): OpenAI's name for gen_length
    for name in ("max_tokens", "max_completion_tokens"):
        if body.get(name) is not None:
            if "gen_length" in given and given["gen_length"] != body[name]:
                raise ApiError(400, f"give {name} or gen_length, not both", name)
            given["gen_length"], alias = body[name], name
    try:
        settings = dataclasses.replace(base, **given)
    except DllmError as e:
        message, param = str(e), blamed(str(e), given)
        if alias is not None and param == "gen_length":
            message, param = alias + message.removeprefix("gen_length"), alias
        raise ApiError(400, message, param) from None
    sampling = {k: getattr(settings, k) for k in SAMPLING if k in given}
    return settings, sampling


def blamed(message: str, given: dict) -> str | None:
    """The field a settings message starts with (DecodeSettings messages name it first)."""
    first = message.split(" ", 1)[0].strip("(:,")
    return first if first in given else next(iter(given), None)


def stops(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise ApiError(400, "stop must be a string or a list of strings", "stop")
    if len(texts) > MAX_STOPS:
        raise ApiError(400, f"stop may hold at most {MAX_STOPS} strings (got {len(texts)})", "stop")
    if any(not t for t in texts):
        raise ApiError(400, "stop strings must not be empty", "stop")
    return tuple(texts)


def messages(value: object) -> tuple[Message, ...]:
    if not isinstance(value, list) or not value:
        raise ApiError(
            400, "messages must be a non-empty list of {role, content} objects", "messages"
        )
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"{where} must be an object with a role and a content", where)
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise ApiError(400, f"{where}.{sorted(extra)[0]} is not supported by dllm", where)
        out.append(Message(m["role"], content_text(m.get("content"), where)))
    return tuple(out)


def content_text(value: object, where: str) -> str:
    """A message's text: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        and set(p) <= {"type", "text"} for p in value
    ):  # fmt: skip
        return "".join(p["text"] for p in value)
    raise ApiError(
        400, f"{where}.content must be text (a string or text parts)", f"{where}.content"
    )


def completion_prompt(value: object) -> str:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]  # what the openai client sends for a one-prompt list
    if not isinstance(value, str):
        raise ApiError(400, "prompt must be a string (one prompt per request)", "prompt")
    return value


def input_error(e: InputError, kind: str) -> ApiError:
    """A prompt the model refuses, as a 400 on the field that carried it."""
    return ApiError(400, str(e), "messages" if kind == "chat" else "prompt")
