"""OpenAI request bodies -> validated jobs, and OpenAI-style error objects.

Fields follow OpenAI's chat and completions APIs: `max_tokens` is the generation length (the
canvas dllm denoises), `stop` cuts the answer before the first of its strings. A completion's
`prompt` may be a string, a list of strings, a list of token ids or a list of such lists (one
choice per prompt and `n`); `echo` with `logprobs` and `max_tokens` 0 or 1 asks for
likelihood scores of the prompt (scoring.py). What dllm cannot honour (tools, logit_bias,
...) is refused with a 400 naming the field rather than silently ignored. dllm's own decoding
settings come as extra body fields (the `openai` client's `extra_body`) under DecodeSettings'
names and are validated by DecodeSettings itself, so a request hears the messages a CLI flag
would.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dllm_cli.errors import DllmError, InputError
from dllm_cli.lifetimes import SAMPLING_FIELDS
from dllm_cli.serve.conversation import Message
from dllm_cli.setting_spec import declared
from dllm_cli.settings import DecodeSettings
from dllm_cli.strict_toml import did_you_mean

# DecodeSettings fields a request may set, under their own names: every field its declaration
# (settings.py) says is served (not batching: how the server batches is the server's).
SETTINGS = tuple(name for name, spec in declared(DecodeSettings) if spec.served)
# the ones each request brings to the engine itself (lifetimes.py: its rows sample apart)
SAMPLING = tuple(name for name in SAMPLING_FIELDS if name in SETTINGS)
# Accepted and ignored: they change nothing an answer depends on.
IGNORED = ("user", "metadata", "store", "service_tier", "stream_options")
# OpenAI fields dllm cannot honour, refused by name (a value equal to the default passes).
UNSUPPORTED = {
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
    "best_of": (None, 1),
    "suffix": (None, ""),
}
COMMON = ("model", "max_tokens", "stop", "stream", "n", "guide", "response_format")
CHAT_FIELDS = ("messages", "max_completion_tokens", "logprobs", "top_logprobs", *COMMON)
SCORE_FIELDS = ("score_samples", "score_batch", "score_splits")  # dllm's own (docs/scoring.md)
COMPLETION_FIELDS = ("prompt", "echo", "logprobs", *SCORE_FIELDS, *COMMON)
MAX_STOPS = 4  # as OpenAI
MAX_N = 16  # choices per prompt
MAX_PROMPTS = 64  # prompts per completion request
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI: 5 on completions, 20 on chat)
MAX_SCORE_SAMPLES = 4096
STREAM_OPTIONS = {"include_usage", "include_canvas"}  # the second is dllm's (serve/canvas.py)


class ApiError(Exception):
    """An HTTP error answered as OpenAI's error object."""

    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str = "", code: str = ""
    ):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or KINDS.get(status, "invalid_request_error")
        self.code = code or CODES.get(status)

    def body(self) -> dict:
        error = {"message": self.message, "type": self.kind, "param": self.param}
        return {"error": error | {"code": self.code}}


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

    kind: str  # "chat" | "completion" | "score"
    messages: tuple[Message, ...] = ()  # chat
    prompt: str | tuple[int, ...] = ""  # completion, score: text or token ids
    settings: DecodeSettings = field(default_factory=DecodeSettings)  # the engine's group
    sampling: dict = field(default_factory=dict)  # per-request sampling overrides given
    guide: bool = True  # decode with the loaded guide (if any)
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_canvas: bool = False  # stream_options.include_canvas: a canvas chunk per step
    prompts: tuple[str | tuple[int, ...], ...] = ()  # completion: every prompt, in order
    n: int = 1  # choices per prompt
    echo: bool = False  # the answer's text starts with the prompt's
    score: Score | None = None  # kind "score": how to estimate
    logprobs: int | None = None  # answer tokens' logprobs with this many alternatives each

    structure: tuple[str, object] | None = None  # response_format: (grammar kind, source)
    grammar: object | None = None  # the compiled grammar (app.py compiles `structure`)


@dataclass(frozen=True)
class Score:
    """A scoring request's options (scoring.py): samples and batch None take the family's."""

    samples: int | None
    batch: int | None
    splits: int | None  # score only the last this many positions (None: every one)
    top: int  # alternatives per position (the request's logprobs)
    generate: bool  # max_tokens 1: one token decoded after the prompt, as OpenAI's echo does


def parse(body: object, kind: str, base: DecodeSettings, model_id: str, guided: bool) -> Job:
    """A request body -> Job, or ApiError(400/404) naming the field at fault."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    allowed = (CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS) + SETTINGS + IGNORED
    for name, value in body.items():
        if name in UNSUPPORTED:
            if not any(value == ok and type(value) is type(ok) for ok in UNSUPPORTED[name]):
                raise ApiError(400, f"{name} is not supported by dllm", name)
        elif name not in allowed:
            hint = did_you_mean(name, allowed)
            raise ApiError(400, f"unknown field {name!r}{hint}", name)
    check_model(body.get("model"), model_id)
    n = count(body, "n", 1, MAX_N)
    stream = flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - STREAM_OPTIONS):
        raise ApiError(
            400, "stream_options may only hold include_usage and include_canvas", "stream_options"
        )
    flag(options or {}, "include_usage", "stream_options.include_usage")  # usage comes anyway
    canvas = flag(options or {}, "include_canvas", "stream_options.include_canvas")
    if canvas and not stream:
        raise ApiError(400, "include_canvas needs stream: true", "stream_options.include_canvas")
    structure = response_format(body.get("response_format"))
    guide = flag(body, "guide", default=guided and structure is None)  # asked for: both verify
    if guide and not guided:
        raise ApiError(400, "guide: the served profile has no guide model loaded", "guide")
    if kind == "completion" and flag(body, "echo") and body.get("logprobs") is not None:
        return score_job(body, base, n, stream)
    top = answer_logprobs(body, kind)
    if top is not None and guide:
        raise ApiError(
            400, "logprobs needs an unguided decode (send guide: false): guided drafts are "
            "the guide's argmax and keep no distribution", "logprobs",
        )  # fmt: skip
    settings, sampling = decode_settings(body, base)
    common = {"settings": settings, "sampling": sampling, "guide": guide, "stream": stream}
    common |= {"stop": stops(body.get("stop")), "n": n, "logprobs": top, "structure": structure}
    common["include_canvas"] = canvas
    if kind == "chat":
        return Job("chat", messages=messages(body.get("messages")), **common)
    prompts = completion_prompts(body.get("prompt"))
    return Job("completion", prompt=prompts[0], prompts=prompts, echo=flag(body, "echo"), **common)


def answer_logprobs(body: dict, kind: str) -> int | None:
    """Alternatives per answer token asked for (None: no logprobs): chat's logprobs: true with
    top_logprobs k, a completion's logprobs: k."""
    if kind == "completion":
        return count(body, "logprobs", None, MAX_LOGPROBS, low=0)
    asked = flag(body, "logprobs")
    top = count(body, "top_logprobs", None, MAX_LOGPROBS, low=0)
    if top is not None and not asked:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if asked else None


def score_job(body: dict, base: DecodeSettings, n: int, stream: bool) -> Job:
    """echo + logprobs: the prompt's likelihood scores (max_tokens 0, or 1 as lm-eval sends)."""
    if stream:
        raise ApiError(400, "stream is not supported with echo scoring", "stream")
    if n != 1:
        raise ApiError(400, "n must be 1 with echo scoring (scores are one estimate)", "n")
    top = count(body, "logprobs", 0, MAX_LOGPROBS, low=0)
    tokens = body.get("max_tokens", 0)
    if tokens not in (0, 1) or isinstance(tokens, bool):
        raise ApiError(
            400, f"max_tokens must be 0 or 1 with echo and logprobs (got {tokens!r})", "max_tokens"
        )
    if tokens == 1 and body.get("temperature", 0) not in (0, 0.0, None):
        raise ApiError(
            400, "echo with max_tokens 1 decodes its token greedily: temperature must be 0",
            "temperature",
        )  # fmt: skip
    rest = {k: v for k, v in body.items() if k in ("seed", "cfg_scale") and v is not None}
    settings, _ = decode_settings(rest, base)
    samples = count(body, "score_samples", None, MAX_SCORE_SAMPLES)
    batch = count(body, "score_batch", None, MAX_SCORE_SAMPLES)
    if samples is not None and batch is not None and batch > samples:
        raise ApiError(400, "score_batch must not exceed score_samples", "score_batch")
    splits = count(body, "score_splits", None, 1 << 20)
    score = Score(samples, batch, splits, top, tokens == 1)
    prompts = completion_prompts(body.get("prompt"))
    return Job("score", prompt=prompts[0], prompts=prompts, settings=settings, score=score)


def count(body: dict, name: str, default: int | None, high: int, low: int = 1) -> int | None:
    """An integer field in [low, high] (None or absent: `default`)."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ApiError(400, f"{name} must be an integer in [{low}, {high}] (got {value!r})", name)
    return value


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
    given = {k: v for k, v in body.items() if k in SETTINGS and v is not None}
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


def completion_prompts(value: object) -> tuple[str | tuple[int, ...], ...]:
    """OpenAI's prompt forms: a string, a list of strings, token ids, or lists of token ids."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and value and all(is_token(t) for t in value):
        return (tuple(value),)
    if not isinstance(value, list) or not value:
        raise ApiError(400, PROMPT_FORMS, "prompt")
    if len(value) > MAX_PROMPTS:
        raise ApiError(400, f"prompt may hold at most {MAX_PROMPTS} prompts", "prompt")
    out: list[str | tuple[int, ...]] = []
    for i, p in enumerate(value):
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, list) and p and all(is_token(t) for t in p):
            out.append(tuple(p))
        else:
            raise ApiError(400, f"prompt[{i}]: {PROMPT_FORMS}", "prompt")
    return tuple(out)


PROMPT_FORMS = (
    "prompt must be a string, a list of strings, a list of token ids, or a list of lists of "
    "token ids (none empty)"
)


def is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def input_error(e: InputError, kind: str) -> ApiError:
    """A prompt the model refuses, as a 400 on the field that carried it."""
    return ApiError(400, str(e), "messages" if kind == "chat" else "prompt")


def choices(job: Job) -> list[Job]:
    """A completion's one-prompt, one-choice jobs, in answer order (prompt-major, as OpenAI's
    index); choice i of a prompt decodes with the request's seed + i."""
    if job.kind == "chat" and job.n == 1:
        return [job]
    prompts = job.prompts or (job.prompt,)
    out = []
    for p in prompts:
        for i in range(job.n):
            seeded = dataclasses.replace(job.settings, seed=(job.settings.seed + i) % 2**63)
            sampling = {**job.sampling, "seed": seeded.seed} if i else job.sampling
            out.append(dataclasses.replace(
                job, prompt=p, prompts=(p,), n=1, settings=seeded, sampling=sampling
            ))  # fmt: skip
    return out
