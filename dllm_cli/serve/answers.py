"""Committed token prefixes -> answer text as it may be sent: streamed deltas and stop strings.

Text goes out once it and everything before it are committed (as `dllm generate` streams to a
terminal). A stop string cuts the answer before its first occurrence; while the text ends in
something that could still grow into a stop string, that tail is held back, so a client never
receives text that a later step reveals to be past a stop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Cut:
    """The answer so far as it may be sent, and whether a stop string has ended it."""

    text: str
    stopped: bool


def cut_at_stops(text: str, stops: tuple[str, ...], final: bool) -> Cut:
    """Text before the first stop string; unless final, less a tail that may start one."""
    at = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if at >= 0:
        return Cut(text[:at], True)
    if final:
        return Cut(text, False)
    hold = 0
    for s in stops:  # the longest tail of `text` that is a proper prefix of a stop string
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return Cut(text[: len(text) - hold], False)


class Deltas:
    """Text newly sendable after each step, from the request's committed answer prefix."""

    def __init__(self, to_text: Callable[[list[int]], str], stops: tuple[str, ...]):
        self.to_text, self.stops = to_text, stops
        self.seen = -1  # prefix length last turned into text
        self.sent = ""
        self.stopped = False

    def feed(self, prefix: list[int]) -> str:
        """New text for a longer committed prefix ("" when nothing new may be sent)."""
        if len(prefix) == self.seen or self.stopped:
            return ""
        self.seen = len(prefix)
        # A byte-level tokenizer may end a prefix inside a character: hold that part back.
        text = self.to_text(prefix).rstrip("\ufffd")
        cut = cut_at_stops(text, self.stops, final=False)
        self.stopped = cut.stopped
        return self._advance(cut.text)

    def finish(self, text: str) -> str:
        """The rest of the final answer (cut at its stop strings)."""
        cut = cut_at_stops(text, self.stops, final=True)
        self.stopped = self.stopped or cut.stopped
        return self._advance(cut.text)

    def _advance(self, text: str) -> str:
        # Answer text is stripped at both ends, so a prefix's text may lack the spaces that the
        # next token follows: only text extending what was sent goes out.
        if not text.startswith(self.sent):
            return ""
        new, self.sent = text[len(self.sent) :], text
        return new


def finish_reason(tokens: list[int], stop_ids: tuple[int, ...] | list[int], stopped: bool) -> str:
    """OpenAI's: "stop" for a stop string or an end-of-answer token, "length" when it ran out."""
    return "stop" if stopped or not set(stop_ids).isdisjoint(tokens) else "length"
