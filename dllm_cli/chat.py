"""Prompt text -> token ids, where only the chat template may write special tokens.

A tokenizer reads `<|eot_id|>` or `<|mdm_mask|>` in any text it is given as that special
token, so a template rendered to one string and tokenized whole would let a user's text (or a
document pasted into it) end the user turn, write the assistant's header or place [MASK]
positions. Here the user's text is tokenized with special tokens split (the tokenizers
library's `encode_special_tokens`, transformers' `split_special_tokens=True`): it stays
text. Tokenizers already cut their input at special tokens and tokenize the stretches in
between on their own, so cutting the rendered template at the special tokens next to the
user's text gives exactly the ids of the whole string whenever the text holds no special
token string: nothing changes for ordinary prompts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dllm_cli.errors import InputError

if TYPE_CHECKING:  # ours (models/tokenizer.py) or, for folders it declines, transformers'
    from dllm_cli.models.loading import AnyTokenizer

# Private-use characters: no template trims them and no tokenizer gives them a meaning.
PLACEHOLDER = "\ue000dllm-user-text\ue001"


@dataclass(frozen=True)
class Frame:
    """The rendered chat template around the user's text, cut next to its special tokens.

    The template renders `head + text + tail`. `head_ids` are the ids of `head` up to and
    including its last special token, `lead` the plain text after it; `trail` is the plain
    text of `tail` before its first special token, `tail_ids` the ids from there on.
    """

    head: str
    tail: str
    head_ids: list[int]
    lead: str
    trail: str
    tail_ids: list[int]


def special_ids(tok: AnyTokenizer) -> set[int]:
    """Ids of the special tokens the tokenizer reads from text (its special added tokens)."""
    return {i for i, t in tok.added_tokens_decoder.items() if t.special}


def frame(tok: AnyTokenizer) -> Frame:
    """Where the template puts one user message (the generation prompt included)."""
    around = render(tok, PLACEHOLDER)
    if around.count(PLACEHOLDER) != 1:
        raise InputError(
            "this model's chat template does not write the user's message exactly once; "
            "use --no-chat"
        )
    head, tail = around.split(PLACEHOLDER)
    specials = special_ids(tok)
    cut_head = max((end for _, end in _spans(tok, head, specials)), default=0)
    cut_tail = min((start for start, _ in _spans(tok, tail, specials)), default=len(tail))
    return Frame(
        head,
        tail,
        _ids(tok, head[:cut_head]),
        head[cut_head:],
        tail[:cut_tail],
        _ids(tok, tail[cut_tail:]),
    )


def render(tok: AnyTokenizer, content: str) -> str:
    messages = [{"role": "user", "content": content}]
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def encode_chat(tok: AnyTokenizer, prompt: str, around: Frame) -> list[int]:
    """The template's ids around the user's text, which is tokenized as text only."""
    full = render(tok, prompt)
    head, tail = around.head, around.tail
    if len(full) < len(head) + len(tail) or not (full.startswith(head) and full.endswith(tail)):
        raise InputError("this model's chat template changes around this prompt; use --no-chat")
    text = full[len(head) : len(full) - len(tail)]  # the prompt as the template wrote it
    middle = _ids(tok, around.lead + text + around.trail, split=True)
    return around.head_ids + middle + around.tail_ids


def encode_plain(tok: AnyTokenizer, prompt: str) -> list[int]:
    """Raw text (no chat template): the tokenizer's own BOS/EOS if it adds any; text as text."""
    return tok(prompt, split_special_tokens=True).input_ids


def _ids(tok: AnyTokenizer, text: str, *, split: bool = False) -> list[int]:
    if not text:
        return []
    return tok(text, add_special_tokens=False, split_special_tokens=split).input_ids


def _spans(tok: AnyTokenizer, text: str, specials: set[int]) -> list[tuple[int, int]]:
    """(start, end) in `text` of each special token the tokenizer reads there."""
    if not text:
        return []
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    return [
        span for i, span in zip(enc.input_ids, enc.offset_mapping, strict=True) if i in specials
    ]


def pieces(tok: AnyTokenizer, ids: list[int]) -> list[str]:
    """Each token's own text (special tokens as their strings), to show a prompt token by token."""
    return [tok.decode([i], skip_special_tokens=False) for i in ids]
