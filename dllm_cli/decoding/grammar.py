"""Structured output's grammars: schema / Lark / regex compiled for llguidance, and the vocabulary.

The model's tokenizer is bridged to llguidance's (an LLTokenizer, built once per tokenizer,
spelling each token's bytes where llguidance cannot read the tokenizer itself); a grammar is
compiled and validated against it, and a bad one is a GrammarError (the server answers 400).
The committer that makes a decode follow a grammar is grammar_committer.py.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from dllm_cli.errors import InputError

try:
    import llguidance as llg
except ImportError:  # pragma: no cover - a runtime dependency, present where dllm installs
    llg = None


class GrammarError(InputError):
    """A grammar or JSON schema the grammar engine refuses (the server answers 400)."""


# Compact JSON (no free whitespace between tokens): a model cannot spend its answer on
# blanks, and the output is what json.dumps(separators=(",", ":")) writes.
JSON_OPTIONS = {"whitespace_flexible": False}


def from_json_schema(schema: Any) -> str:
    """A JSON schema (dict or its text) as llguidance's grammar."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"the JSON schema is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be a JSON object")
    return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)


def from_json_object(_: Any = None) -> str:
    """OpenAI's json_object: any JSON object."""
    return from_json_schema({"type": "object"})


def from_lark(text: str) -> str:
    """A Lark grammar (llguidance's dialect: `start` is the answer; regexes as terminals)."""
    return llg.LLMatcher.grammar_from_lark(text)


def from_regex(text: str) -> str:
    """A regular expression the whole answer matches."""
    return llg.LLMatcher.grammar_from_regex(text)


# kind (as `--grammar` files and response_format name them) -> source -> llguidance grammar
GRAMMAR_KINDS: dict[str, Callable[[Any], str]] = {
    "json_schema": from_json_schema,
    "json_object": from_json_object,
    "lark": from_lark,
    "regex": from_regex,
}

# `--grammar FILE` suffix -> kind (any other suffix is read as Lark)
GRAMMAR_SUFFIXES = {".regex": "regex", ".lark": "lark"}


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar: llguidance's grammar text, checked against a vocabulary."""

    kind: str
    text: str


def compile_grammar(kind: str, source: Any, vocab: GrammarVocab | None = None) -> Grammar:
    """A grammar of `kind` from its source, validated (GrammarError names the problem)."""
    require_library()
    if kind not in GRAMMAR_KINDS:
        raise GrammarError(f"unknown grammar kind {kind!r} (one of {', '.join(GRAMMAR_KINDS)})")
    try:
        text = GRAMMAR_KINDS[kind](source)
    except ValueError as e:
        raise GrammarError(f"bad {kind}: {one_line(str(e))}") from None
    message = llg.LLMatcher.validate_grammar(text, None if vocab is None else vocab.tokenizer)
    if message and not message.startswith("WARNING"):
        raise GrammarError(f"bad {kind}: {one_line(message)}")
    grammar = Grammar(kind, text)
    if vocab is not None:
        check_writable(grammar, vocab)
    return grammar


def check_writable(grammar: Grammar, vocab: GrammarVocab) -> None:
    """GrammarError when the vocabulary cannot begin an answer the grammar accepts (no tokens
    spell the bytes it forces first, or none may come first), which would otherwise end every
    answer empty and invalid without a word of warning."""
    m = vocab.matcher(grammar)
    if m.is_error():
        return
    forced = m.compute_ff_bytes()
    if not vocab.spells(forced):
        raise GrammarError(
            f"this model's vocabulary cannot write an answer under this {grammar.kind}: no "
            f"tokens spell the {one_line(repr(forced.decode('utf-8', 'replace')))} "
            "it begins with (use a model whose tokenizer can)"
        )
    if not m.is_accepting() and not vocab.can_begin(m):
        raise GrammarError(
            f"this model's vocabulary cannot write an answer under this {grammar.kind}: none "
            "of its tokens may begin one (use a model whose tokenizer can)"
        )


def one_line(text: str) -> str:
    return " ".join(text.split())[:300]


def require_library() -> None:
    if llg is None:
        raise GrammarError(
            "structured output needs the llguidance package (pip install llguidance)"
        )


class GrammarVocab:
    """The model's vocabulary as llguidance sees it: token bytes, and the stop tokens (a
    tokenizer.json llguidance cannot read, e.g. word-level, is spelled token by token)."""

    def __init__(self, tokenizer, vocab_size: int, stops: tuple[int, ...]):
        require_library()
        # dllm's tokenizer keeps its tokenizers.Tokenizer as `backend`; transformers' fast
        # tokenizers (DiffusionGemma's) as `backend_tokenizer` (their `backend` names a library)
        backend = getattr(tokenizer, "backend_tokenizer", None) or tokenizer.backend
        size = max(vocab_size, backend.get_vocab_size(with_added_tokens=True))
        self.stops = tuple(stops)
        try:
            self.tokenizer = llg.LLTokenizer(backend.to_str(), n_vocab=size, eos_token=list(stops))
        except ValueError:  # a decoder llguidance does not know: spell every token out
            wrapper = llg.TokenizerWrapper(SpelledTokens(backend, size, stops))
            self.tokenizer = llg.LLTokenizer(wrapper, n_vocab=size, eos_token=list(stops))
        self.words = (self.tokenizer.vocab_size + 31) // 32  # int32 words of a bitmask
        # ids past the tokenizer's own (embedding rows no token names) are never allowed
        self.known = backend.get_vocab_size(with_added_tokens=True)

    def spells(self, data: bytes) -> bool:
        """Whether some tokens of the vocabulary write exactly `data`."""
        return self.tokenizer.decode_bytes(self.tokenizer.tokenize_bytes(data)) == data

    def can_begin(self, matcher) -> bool:
        """Whether the matcher allows some real token next (not a stop, not an unnamed id)."""
        raw = matcher.compute_bitmask()  # (words * 4,) bytes, bit i: token i allowed
        bits = int.from_bytes(raw, "little") & ((1 << self.known) - 1)
        for stop in self.stops:
            bits &= ~(1 << stop)
        return bits != 0

    def matcher(self, grammar: Grammar):
        m = llg.LLMatcher(self.tokenizer, grammar.text)
        if m.is_error():
            raise GrammarError(f"bad {grammar.kind}: {one_line(m.get_error())}")
        return m


def next_tokens(matcher, vocab: GrammarVocab) -> np.ndarray:
    """(V,) bool: the tokens the grammar allows next; a stop token only once it is complete."""
    if matcher.is_stopped():
        mask = np.zeros(vocab.words * 32, dtype=bool)
        mask[list(vocab.stops)] = True
        return mask
    raw = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)  # stops only where it accepts
    mask = np.unpackbits(raw, bitorder="little")[: vocab.words * 32].astype(bool)
    mask[vocab.known :] = False
    if not vocab.spells(matcher.compute_ff_bytes()):  # forced bytes no token writes: dead
        mask[:] = False
    return mask


class SpelledTokens:
    """What llguidance's TokenizerWrapper reads: each token's bytes, the special ids."""

    def __init__(self, backend, size: int, stops: tuple[int, ...]):
        decoder = backend.get_added_tokens_decoder()
        self.special_token_ids = sorted(i for i, t in decoder.items() if t.special)
        special = set(self.special_token_ids)
        anchor = next(i for i in range(size) if i not in special)
        base = backend.decode([anchor], skip_special_tokens=False)
        self.tokens = [spell(backend, i, special, anchor, base) for i in range(size)]
        self.eos_token_id, self.bos_token_id = stops[0], None
        self.backend = backend

    def __call__(self, text: str | bytes) -> list[int]:
        """The tokenizer's own ids for `text` (llguidance tokenizes forced strings)."""
        data = text if isinstance(text, bytes) else text.encode()
        ids = self.backend.encode(data.decode("utf-8", "replace"), add_special_tokens=False).ids
        # Only ids that spell the text: a piece the vocabulary cannot write comes back as its
        # unknown token, which is no spelling of it (llguidance would force it, then reject it).
        out, at = [], 0
        for i in ids:
            piece = self.tokens[i]
            if not piece or piece[:1] == b"\xff" or not data.startswith(piece, at):
                break
            out.append(i)
            at += len(piece)
        return out


def spell(backend, i: int, special: set[int], anchor: int, base: str) -> bytes:
    """Token `i`'s bytes: a special token's name after 0xFF (llguidance's convention), an
    unnamed id (an embedding row past the tokenizer) none, else its decoded text."""
    name = backend.id_to_token(i)
    if name is None:
        return b""
    if i in special:
        return b"\xff" + name.encode()
    return backend.decode([anchor, i], skip_special_tokens=False)[len(base) :].encode()


VOCABS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> GrammarVocab


def vocab_of(runtime) -> GrammarVocab:
    """The runtime's vocabulary for grammars, built once per tokenizer (~0.1 s on 32k tokens)."""
    tok, special = runtime.loaded.tokenizer, runtime.loaded.special
    if tok not in VOCABS:
        size = special.real_vocab(runtime.loaded.model.vocab_size)
        VOCABS[tok] = GrammarVocab(tok, size, special.stop)
    return VOCABS[tok]
