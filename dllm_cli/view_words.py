"""Canvas cells spelled as the tokenizer detokenises them: sub-word pieces joined into words.

A tokenizer marks where a word starts in its own way (WordPiece `##`, SentencePiece `▁`,
byte-level BPE `Ġ`, a character split over several byte tokens), so the view never reads token
strings: it decodes runs of ids and looks at the text. A committed token continues the word
before it when decoding the word with it adds text that does not start with a blank; a lone
blank token joins the word after it (the cell is the word, its blank is the gap before it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import pairwise

MAX_WORD = 16  # tokens in one cell at most (a run with no blank still wraps somewhere)


class Speller:
    """Decodes runs of ids (cached) to find words and each token's share of a word's text."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode  # ids -> text, the tokenizer's own detokenisation
        self.texts: dict[tuple[int, ...], str] = {}

    def text(self, ids: tuple[int, ...]) -> str:
        if ids not in self.texts:
            self.texts[ids] = self.decode(list(ids))
        return self.texts[ids]

    def continues(self, word: tuple[int, ...], token: int) -> bool:
        """Whether `token` is the next piece of `word`: no blank between them, or `word` is
        only a blank (byte-level BPE writes the space before a digit as a token of its own)."""
        before = self.text(word)
        if not before or len(word) >= MAX_WORD:
            return False
        after = self.text((*word, token))
        added = after[shared(before, after) :]
        if not added:  # nothing new to show: a byte inside an unfinished character, or not
            return before.endswith("\ufffd")
        if added[0].isspace():
            return False
        return not before[-1].isspace() or not before.strip(" ")

    def words(self, tokens: Sequence[int | None]) -> list[tuple[int, int]]:
        """[start, end) of each cell over the canvas: a word of committed pieces, or one
        position (`None`: not a word token: a mask, a draft, the answer's end)."""
        spans: list[tuple[int, int]] = []
        pos = 0
        while pos < len(tokens):
            end = pos + 1
            if tokens[pos] is not None:
                word = (tokens[pos],)
                while end < len(tokens) and tokens[end] is not None:
                    if not self.continues(word, tokens[end]):
                        break
                    word = (*word, tokens[end])
                    end += 1
            spans.append((pos, end))
            pos = end
        return spans

    def pieces(self, word: tuple[int, ...]) -> list[str]:
        """Each token's part of the word's text: a token that ends inside a character (a
        byte-level piece) gets nothing, the one that completes it gets the character."""
        final = self.text(word)
        starts = [0]
        for n in range(1, len(word)):
            stable = shared(self.text(word[:n]), final)
            starts.append(max(starts[-1], stable))
        bounds = [*starts, len(final)]
        return [final[a:b] for a, b in pairwise(bounds)]


def shared(a: str, b: str) -> int:
    """Length of the common prefix of two texts."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
