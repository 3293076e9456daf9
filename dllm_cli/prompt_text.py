"""Raw input -> prompt text: each line decoded on its own, and what is not text refused.

Batch input is read as bytes and every line decoded as UTF-8 by itself, so one bad line costs
only its own record. A prompt may hold any Unicode text except control characters (Unicode
category Cc: U+0000-U+001F, U+007F-U+009F) other than tab, newline and carriage return: NUL,
ESC and the rest are not text a person types. They are the mark of binary or terminal output
piped in by mistake, tokenizers turn them into unknown or byte tokens a model never learned
from, and a control sequence echoed back (--verbose-prompt, an error line) would drive the
user's terminal. Lone surrogates (U+D800-U+DFFF, from JSON `\\ud800` escapes) are refused too:
no UTF-8 text can hold them.
"""

from __future__ import annotations

import os
import re

from dllm_cli.errors import InputError

BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark, as Windows editors start a file
ALLOWED_CONTROLS = "\t\n\r"
_NOT_TEXT = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")
_SURROGATES = re.compile(r"[\ud800-\udfff]")


def strip_line_end(raw: bytes) -> bytes:
    """One input line without its `\\n` or `\\r\\n` (lines are split at `\\n` only)."""
    return raw.rstrip(b"\r\n")


def decode_line(raw: bytes, *, first: bool = False) -> str:
    """A line's bytes as text; the first line of an input may start with a byte-order mark."""
    if first and raw.startswith(BOM):
        raw = raw[len(BOM) :]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = " ".join(f"0x{b:02x}" for b in raw[e.start : e.end])
        noun = "byte" if e.end - e.start == 1 else "bytes"
        raise InputError(f"not valid UTF-8: {noun} {bad} at byte offset {e.start}") from None


def escape_bytes(raw: bytes) -> str:
    """Bytes shown as text: valid UTF-8 as itself, other bytes as `\\xNN`, `\\` as `\\\\`."""
    return raw.replace(b"\\", b"\\\\").decode("utf-8", "backslashreplace")


def from_argv(arg: str) -> str:
    """A prompt from the command line as text: Python hands an argument's undecodable bytes
    over as lone surrogates (PEP 383); they are turned back into bytes to say where."""
    if _SURROGATES.search(arg) is None:
        return arg
    try:
        raw = os.fsencode(arg)
    except UnicodeError:  # surrogates that were never bytes: check_text names them
        return arg
    return decode_line(raw)


def check_text(text: str) -> str:
    """The text itself, or an InputError naming its first character that is not text."""
    found = _NOT_TEXT.search(text)
    if found is None:
        return text
    char, at = found.group(), found.start()
    if "\ud800" <= char <= "\udfff":
        raise InputError(
            f"prompt has a lone surrogate U+{ord(char):04X} at character offset {at} (not text)"
        )
    raise InputError(
        f"prompt has control character U+{ord(char):04X} at character offset {at} "
        "(tab, newline and carriage return are the only ones allowed)"
    )
