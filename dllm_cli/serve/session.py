"""A chat session with the model loaded once: the conversation, its prompt, and each answer.

Every question is answered from the whole conversation rendered by the chat template
(conversation.py). When that prompt leaves no room for the answer in the model's context, the
oldest exchanges (a user message and its answer; system messages stay) are dropped until it
fits, and the caller is told how many. An answer that is stopped is not kept: the
conversation stays as it was before the question.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace

from dllm_cli.decoding import decode_steps
from dllm_cli.decoding.events import DecodeResult, StepEvent
from dllm_cli.errors import InputError, SettingsError
from dllm_cli.runtime import Runtime, check_family
from dllm_cli.serve.conversation import Message, encode_messages
from dllm_cli.serve.engines import check_length
from dllm_cli.settings import DecodeSettings
from dllm_cli.strict_toml import did_you_mean
from dllm_cli.text_stream import TextStream


@dataclass
class Prompt:
    """The ids to answer a question with, and how many old exchanges were dropped for room."""

    ids: list[int]
    dropped: int


@dataclass
class Session:
    runtime: Runtime
    messages: list[Message] = field(default_factory=list)
    system: list[Message] = field(default_factory=list)  # kept through /reset and trimming
    guided: bool = True  # the guide verifies drafts (when the runtime has one)

    def reset(self) -> None:
        self.messages = []

    def set(self, key: str, text: str) -> None:
        """Change one decoding setting for the next answers (`/set threshold=0.8`)."""
        name = key.strip().replace("-", "_")
        if name == "guide":
            value = parse_value(text)
            if not isinstance(value, bool):
                raise SettingsError(f"guide must be true or false (got {text!r})")
            if value and self.runtime.guide is None:
                raise SettingsError(
                    "no guide model is loaded (the profile has none, or --no-guide)"
                )
            self.guided = value
            return
        if name not in setting_names():  # (guide: handled above)
            raise SettingsError(f"unknown setting {key!r}{did_you_mean(name, setting_names())}")
        settings = replace(self.runtime.settings, **{name: parse_value(text)})
        self.runtime.settings = check_family(self.runtime.loaded, settings)
        self.runtime.provenance[f"decode.{name}"] = "/set"

    def prompt(self, question: str) -> Prompt:
        """The conversation plus `question`, trimmed from the oldest exchange to fit."""
        tok, settings = self.runtime.loaded.tokenizer, self.runtime.settings
        history = list(self.messages)
        dropped = 0
        while True:
            ids = encode_messages(tok, [*self.system, *history, Message("user", question)])
            try:
                check_length(self.runtime, ids, settings)
                return Prompt(ids, dropped)
            except InputError:
                if not history:
                    raise
            history = history[2:]  # one user message and its answer
            dropped += 1

    def answer(self, question: str, prompt: Prompt) -> Answer:
        """Decode the answer to `question` (iterate it); the conversation keeps it once done."""
        return Answer(self, question, prompt)


class Answer:
    """One answer being decoded: iterate for (event, new text); `text` once it is done."""

    def __init__(self, session: Session, question: str, prompt: Prompt):
        rt = session.runtime
        self.session, self.question, self.prompt = session, question, prompt
        model, special = rt.loaded.model, rt.loaded.special
        committer = rt.committer() if session.guided else None
        self.run = decode_steps(model, special, [prompt.ids], rt.settings, committer=committer)
        self.stream = TextStream(rt.settings.gen_length, rt.text)  # final text only
        self.text: str | None = None
        self.result: DecodeResult | None = None
        self.rest = ""

    def __iter__(self) -> Iterator[tuple[StepEvent, str]]:
        for event in self.run:
            yield event, self.stream.feed(event)
        self.result = self.run.result()
        self.text = self.session.runtime.text(self.result.tokens[0])
        self.rest = self.stream.finish(self.text)[:-1]  # text the last steps did not send
        s = self.session
        kept = s.messages[2 * self.prompt.dropped :]
        s.messages = [*kept, Message("user", self.question), Message("assistant", self.text)]


def parse_value(text: str) -> object:
    """A /set value: a JSON number, true/false or null, else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text.strip()


def setting_names() -> list[str]:
    return [f.name for f in fields(DecodeSettings) if f.name != "batching"] + ["guide"]
