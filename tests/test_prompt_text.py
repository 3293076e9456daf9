"""Raw input -> prompt text: where a line is not UTF-8, what is not text, bytes shown reversibly."""

from __future__ import annotations

import codecs
import os
import re
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dllm_cli.errors import InputError
from dllm_cli.prompt_text import (
    ALLOWED_CONTROLS,
    check_text,
    decode_line,
    escape_bytes,
    from_argv,
    strip_line_end,
)

EXAMPLES = settings(max_examples=200, deadline=None, derandomize=True, database=None)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\xff\xfe bad line", "byte 0xff at byte offset 0"),
        (b"caf\xc3", "byte 0xc3 at byte offset 3"),  # cut short at the end
        (b"ok \xe2\x82 then", "bytes 0xe2 0x82 at byte offset 3"),  # a 3-byte sequence of 2
        (b"\xed\xa0\x80", "byte 0xed at byte offset 0"),  # a surrogate written as UTF-8
        (b"\xc0\xaf", "byte 0xc0 at byte offset 0"),  # an overlong '/'
    ],
)
def test_a_line_that_is_not_utf8_says_where(raw, message):
    with pytest.raises(InputError, match=f"not valid UTF-8: {message}$"):
        decode_line(raw)


def test_a_byte_order_mark_starts_only_the_first_line():
    assert decode_line(b"\xef\xbb\xbfhi", first=True) == "hi"
    assert decode_line(b"\xef\xbb\xbfhi") == "\ufeffhi"


def test_line_ends_go_and_nothing_else():
    assert strip_line_end(b"a b\r\n") == b"a b"
    assert strip_line_end(b"a\rb\n") == b"a\rb"
    assert strip_line_end(b" x \t") == b" x \t"


@EXAMPLES
@given(st.binary(max_size=64))
def test_escaped_bytes_read_back_exactly(raw):
    shown = escape_bytes(raw)
    assert shown.encode("utf-8", "surrogatepass").decode("utf-8") == shown  # real text
    assert codecs.escape_decode(shown.encode("utf-8"))[0] == raw


def test_valid_utf8_is_shown_as_itself():
    assert escape_bytes("héllo\\".encode()) == "héllo\\\\"
    assert escape_bytes(b"\xffa") == "\\xffa"


def refused(c: str) -> bool:
    kind = unicodedata.category(c)
    return kind == "Cs" or (kind == "Cc" and c not in ALLOWED_CONTROLS)


# any character at all: text() leaves lone surrogates out, so they are drawn on their own
ANY_CHAR = st.characters(exclude_categories=()) | st.characters(categories=["Cs"])


@EXAMPLES
@given(st.lists(ANY_CHAR, max_size=30).map("".join))
def test_only_controls_and_lone_surrogates_are_refused(text):
    bad = [i for i, c in enumerate(text) if refused(c)]
    if bad:
        with pytest.raises(InputError, match=f"at character offset {bad[0]} "):
            check_text(text)
    else:
        assert check_text(text) == text


@pytest.mark.parametrize(
    "text",
    [
        "tab\there",
        "two\nlines\r\n",
        "\u202eright-to-left override",
        "e\u0301\u0302 combining",
        "\u200bzero width",
        "\ufeffBOM",
        "שלום עולם",
        "\U0001f600",
    ],
)
def test_unusual_text_is_still_text(text):
    assert check_text(text) == text


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("x\x00y", "control character U+0000 at character offset 1"),
        ("\x1b[31mred", "control character U+001B at character offset 0"),
        ("a\x7f", "control character U+007F"),
        ("a\x85", "control character U+0085"),
        ("a\ud800", "lone surrogate U+D800 at character offset 1"),
    ],
)
def test_what_is_not_text_is_named(text, words):
    with pytest.raises(InputError, match=re.escape(words)):
        check_text(text)


def test_an_argument_with_undecodable_bytes_says_where():
    arg = os.fsdecode(b"Tom \xff has")  # how Python hands over argv bytes it cannot decode
    with pytest.raises(InputError, match="byte 0xff at byte offset 4"):
        from_argv(arg)
    assert from_argv("Tom has 3 pens") == "Tom has 3 pens"
    assert from_argv("\ud800") == "\ud800"  # never bytes: check_text refuses it later
