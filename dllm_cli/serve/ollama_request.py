"""Ollama's request bodies -> the OpenAI-shaped job protocol.py validates (ollama.py serves them).

Both APIs hear the same messages about the same settings: a body is translated field by field,
what dllm cannot honour is refused by name, and options that only tune Ollama's own loader are
accepted and ignored.
"""

from __future__ import annotations

from dllm_cli.serve import engines
from dllm_cli.serve.plumbing import Served
from dllm_cli.serve.protocol import SETTINGS, ApiError, Job, parse

TAG = ":latest"  # Ollama names carry a tag; the served model answers to both spellings

# Ollama option -> the body field it sets when their names differ (temperature, top_p, top_k,
# seed, stop and dllm's own settings pass under their names).
OPTIONS = {"num_predict": "gen_length"}
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
        if target not in (*SETTINGS, "stop", "guide"):
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
            used = name not in ("role", "content") and given not in (None, "", [])
            if name not in MESSAGE_FIELDS or used:
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
        return engines.checked(runtime, job)
    except ApiError as e:
        raise ApiError(e.status, ollama_names(e.message)) from None


def ollama_names(message: str) -> str:
    """A settings message in the names the client sent (num_predict for gen_length)."""
    return message.replace("gen_length", "num_predict").replace("max_tokens", "num_predict")
