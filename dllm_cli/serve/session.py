"""A chat session with the model loaded once: the conversation, its prompt, and each answer.

Every question is answered from the whole conversation rendered by the chat template
(conversation.py). When that prompt leaves no room for the answer in the model's context, the
oldest exchanges (a user message and its answer; system messages stay) are dropped until it
fits, and the caller is told how many. An answer that is stopped is not kept: the
conversation stays as it was before the question.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from dllm_cli.decoding import decode_steps
from dllm_cli.decoding.events import DecodeResult, StepEvent
from dllm_cli.errors import InputError
from dllm_cli.runtime import Runtime
from dllm_cli.serve.answers import Deltas
from dllm_cli.serve.conversation import Message, encode_messages
from dllm_cli.serve.engines import check_length


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

    def reset(self) -> None:
        self.messages = []

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
        self.run = decode_steps(model, special, [prompt.ids], rt.settings, committer=rt.committer())
        self.deltas = Deltas(rt.text, ())
        self.committed: list[int | None] = [None] * rt.settings.gen_length
        self.text: str | None = None
        self.result: DecodeResult | None = None
        self.rest = ""

    def __iter__(self) -> Iterator[tuple[StepEvent, str]]:
        for event in self.run:
            for commit in event.commits:
                if commit.row == 0:
                    for pos, tok in zip(commit.positions, commit.tokens, strict=True):
                        self.committed[pos] = tok
            yield event, self.deltas.feed(self.prefix())
        self.result = self.run.result()
        self.text = self.session.runtime.text(self.result.tokens[0])
        self.rest = self.deltas.finish(self.text)  # text the last steps did not send
        s = self.session
        kept = s.messages[2 * self.prompt.dropped :]
        s.messages = [*kept, Message("user", self.question), Message("assistant", self.text)]

    def prefix(self) -> list[int]:
        """The committed answer prefix (up to its first mask)."""
        n = next((i for i, t in enumerate(self.committed) if t is None), len(self.committed))
        return self.committed[:n]  # type: ignore[return-value]
