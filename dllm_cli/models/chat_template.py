"""Chat templates rendered with jinja2 as transformers 5's `apply_chat_template` renders them.

The environment is transformers' (utils/chat_template_utils.py, 5.24): an immutable sandbox,
`trim_blocks` and `lstrip_blocks`, loop controls, a `{% generation %}` block rendered as its
body, `tojson` without HTML escaping, the globals `raise_exception`, `strftime_now`, `dict` and
`namespace`; the template sees `messages`, `tools`, `documents`, `add_generation_prompt` and
the tokenizer's named special tokens.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, ClassVar

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning is passed under; transformers copies the first one found to
# `reasoning_content` and `thinking` (templates read one or the other).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: its body, unchanged."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


class TemplateDict:
    """`dict(...)` for templates without the type itself (no attribute escapes)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's namespace that refuses underscore names (CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            TemplateNamespace.check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        TemplateNamespace.check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace ({name!r})"
            )


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def strftime_now(format):
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The template compiled once per text (transformers caches the same way)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(source)


def plain(value: Any) -> Any:
    """Template inputs as plain JSON types (what transformers hands the sandbox)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool | int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    return f"<{type(value).__name__}>"


def messages_for_template(conversation: list[dict]) -> list[dict]:
    """Messages without None-valued keys, reasoning under its aliases (transformers' order)."""
    out = []
    for message in conversation:
        if not isinstance(message, dict):
            raise TypeError(f"chat messages should be dicts, got {message!r}")
        m = plain({k: v for k, v in message.items() if v is not None})
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render(
    source: str,
    conversation: list[dict],
    special_tokens: dict[str, str],
    *,
    add_generation_prompt: bool = False,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    **kwargs,
) -> str:
    """One conversation rendered to text; keyword arguments override the special tokens."""
    if not conversation:
        raise ValueError("cannot apply a chat template to an empty conversation")
    return compile_template(source).render(
        messages=messages_for_template(conversation),
        tools=plain(tools),
        documents=plain(documents),
        add_generation_prompt=add_generation_prompt,
        **plain({**special_tokens, **kwargs}),
    )
