"""Answer text streamed as it becomes final: every position up to it committed, and none a
revoking rule (WINO) or LLaDA2.1's edits can still change."""

from __future__ import annotations

from collections.abc import Callable

from dllm_cli.decoding.events import StepEvent


class TextStream:
    """Answer text printed as soon as its prefix is final (every position up to it committed)."""

    def __init__(self, gen_length: int, to_text: Callable[[list[int]], str], row: int = 0):
        self.tokens: list[int | None] = [None] * gen_length
        self.to_text = to_text  # tokens -> answer text (cut at the first stop token)
        self.row = row
        self.final = 0  # length of the committed prefix
        self.shown = ""

    def feed(self, event: StepEvent) -> str:
        """Text that became final with this event ("" when none did)."""
        for commit in event.commits:
            if commit.row == self.row:
                for pos, tok in zip(commit.positions, commit.tokens, strict=True):
                    self.tokens[pos] = tok
        for draft in event.drafts:  # a draft over a committed token is an edit (LLaDA2.1)
            if draft.row == self.row:
                for pos, tok in zip(draft.positions, draft.tokens, strict=True):
                    if self.tokens[pos] is not None:
                        self.tokens[pos] = tok
        n = self.final
        held = dict(event.revocable).get(self.row, len(self.tokens))  # WINO: not final yet
        while n < min(len(self.tokens), held) and self.tokens[n] is not None:
            n += 1
        if n == self.final:
            return ""
        self.final = n
        # A byte-level tokenizer may end a prefix inside a character: hold that part back.
        text = self.to_text(self.tokens[:n]).rstrip("\ufffd")  # type: ignore[arg-type]
        if not text.startswith(self.shown):
            return ""
        new, self.shown = text[len(self.shown) :], text
        return new

    def finish(self, text: str) -> str:
        """The rest of the final answer, newline included."""
        if text.startswith(self.shown):
            return text[len(self.shown) :] + "\n"
        return "\n" + text + "\n"  # the streamed part changed (not expected): print it whole
