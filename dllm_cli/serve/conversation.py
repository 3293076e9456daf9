"""A conversation (system, user and assistant messages) -> prompt ids through the chat template.

The rule is chat.py's, for many messages: only the template writes special tokens. The
template is rendered once with a placeholder for each message and once with the real texts;
the placeholders cut the rendering into the template's own segments. Each segment is cut at
its first and last special token: the ids between come from the template text as the
tokenizer reads it, the plain text around them is tokenized together with the neighbouring
messages with special tokens split, so a message's `<|eot_id|>` stays text. When no message
holds a special token string, the ids are exactly those of the whole rendered string.

A template may write a message as given or trimmed (LLaDA's `| trim`); any other change to a
message is refused with a one-line InputError rather than guessed at.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dllm_cli.chat import _ids, _spans, special_ids
from dllm_cli.errors import InputError
from dllm_cli.prompt_text import check_text

if TYPE_CHECKING:  # ours (models/tokenizer.py) or, for folders it declines, transformers'
    from dllm_cli.models.loading import AnyTokenizer

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Message:
    role: str  # system | user | assistant
    content: str


def placeholder(i: int) -> str:
    """Private-use characters around a number: no template trims them or gives them meaning."""
    return f"\ue000dllm-message-{i}\ue001"


def check_messages(messages: list[Message]) -> None:
    """Roles known, texts that are text, and a user message last (the one to answer)."""
    if not messages:
        raise InputError("messages is empty: give at least one user message")
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise InputError(
                f"messages[{i}].role must be one of {', '.join(ROLES)} (got {m.role!r})"
            )
        try:
            check_text(m.content)
        except InputError as e:
            raise InputError(
                f"messages[{i}].content: {str(e).replace('prompt has ', '')}"
            ) from None
    if messages[-1].role != "user":
        raise InputError("the last message must be the user's (the one to answer)")
    if not messages[-1].content.strip():
        raise InputError("empty prompt (the last user message has no text)")


def render(tok: AnyTokenizer, contents: list[str], roles: list[str]) -> str:
    messages = [{"role": r, "content": c} for r, c in zip(roles, contents, strict=True)]
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def segments(tok: AnyTokenizer, roles: list[str]) -> list[str]:
    """The template's text around the messages: len(roles) + 1 segments."""
    marks = [placeholder(i) for i in range(len(roles))]
    text = render(tok, marks, roles)
    out = []
    for mark in marks:
        if text.count(mark) != 1:
            raise InputError(
                "this model's chat template does not write each message exactly once; "
                "send a raw prompt to /v1/completions instead"
            )
        head, text = text.split(mark)
        out.append(head)
    return [*out, text]


def written(full: str, parts: list[str], contents: list[str]) -> list[str]:
    """Each message as the template wrote it (as given, or trimmed), checked against `full`."""
    at, out = len(parts[0]), []
    if not full.startswith(parts[0]):
        raise InputError("this model's chat template changes around these messages")
    for i, content in enumerate(contents):
        after = parts[i + 1]
        for candidate in (content, content.strip()):
            if full.startswith(candidate + after, at) and (
                i + 1 < len(contents) or at + len(candidate + after) == len(full)
            ):
                out.append(candidate)
                at += len(candidate) + len(after)
                break
        else:
            raise InputError(f"this model's chat template changes messages[{i}] beyond trimming")
    return out


def encode_messages(tok: AnyTokenizer, messages: list[Message]) -> list[int]:
    """Prompt ids for answering the conversation; message texts are tokenized as text only."""
    check_messages(messages)
    if not tok.chat_template:
        raise InputError("this model's tokenizer has no chat template; use /v1/completions")
    roles, contents = [m.role for m in messages], [m.content for m in messages]
    parts = segments(tok, roles)
    texts = written(render(tok, contents, roles), parts, contents)
    specials = special_ids(tok)
    ids: list[int] = []
    plain = ""  # text waiting to be tokenized as text (a message and the plain text around it)
    for i, part in enumerate(parts):
        spans = _spans(tok, part, specials)
        if not spans:
            plain += part
        else:
            first, last = spans[0][0], spans[-1][1]
            ids += _ids(tok, plain + part[:first], split=True)
            ids += _ids(tok, part[first:last])
            plain = part[last:]
        if i < len(texts):
            plain += texts[i]
    return ids + _ids(tok, plain, split=True)
