"""Grammar engines compared on real vocabularies: schema compile time, mask time per token.

    .venv/bin/python scripts/measure_grammar_engines.py

For llguidance, xgrammar and outlines-core (each measured when installed): the shipped
tiny-gsm word-level vocabulary, and a 32,000-token byte-level BPE trained with `tokenizers` on
Python's standard library (a real BPE of a typical size, no download). Per schema: the compile
time; per token of a valid instance (the tokenizer's own encoding, then EOS): the time to
compute the next-token mask. One markdown row per library and vocabulary
(docs/structured-output.md).
"""

from __future__ import annotations

import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "dllm_cli" / "tinygsm" / "weights" / "tiny-gsm" / "tokenizer.json"
SMALL = [
    ({"type": "integer"}, "42"),
    ({"type": "integer", "minimum": 0, "maximum": 500}, "123"),
    ({"type": "number"}, "3.5"),
    ({"enum": [2, 3, 5, 7, 11]}, "7"),
    ({"type": "integer", "exclusiveMinimum": 0}, "9"),
]
TEXT = {"type": "string", "maxLength": 20}
BIG = [
    (
        {"type": "object", "properties": {"name": TEXT, "age": {"type": "integer"}},
         "required": ["name", "age"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36},
    ),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 8}, [1, 2, 3, 5, 8, 13]),
    (
        {"type": "object", "additionalProperties": False, "required": ["kind", "legs", "tags"],
         "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer"},
                        "tags": {"type": "array", "items": TEXT, "maxItems": 3}}},
        {"kind": "dog", "legs": 4, "tags": ["good", "loud"]},
    ),
    (
        {"type": "object", "additionalProperties": False, "required": ["ok", "score", "note"],
         "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"},
                        "note": {"type": ["string", "null"], "maxLength": 30}}},
        {"ok": True, "score": 0.75, "note": None},
    ),
    (
        {"type": "object", "additionalProperties": False, "required": ["id", "n"],
         "properties": {"id": {"type": "string", "pattern": "^[a-z]{3}-[0-9]{3}$"},
                        "n": {"type": "integer"}}},
        {"id": "abc-123", "n": 10},
    ),
]  # fmt: skip


def trained_bpe(size: int) -> Tokenizer:
    """A byte-level BPE of `size` tokens trained on the standard library's sources."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[:3000]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=size, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet
    )
    tok.train_from_iterator(texts(files), trainer)
    return tok


def texts(files: list[Path]):
    """The files' texts (those not UTF-8 are left out)."""
    for path in files:
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: character -> byte."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = keep[:], 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


def token_bytes(backend: Tokenizer, byte_level: bool) -> tuple[list[bytes], list[int]]:
    """Every token's bytes (special ones 0xFF + name) and the special ids."""
    n = backend.get_vocab_size(with_added_tokens=True)
    special = sorted(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
    table, out = byte_level_table(), []
    anchor = next(i for i in range(n) if i not in special)
    base = backend.decode([anchor])
    for i in range(n):
        name = backend.id_to_token(i)
        if i in special:
            out.append(b"\xff" + name.encode())
        elif byte_level:
            out.append(bytes(table[c] for c in name))
        else:
            out.append(backend.decode([anchor, i])[len(base) :].encode())
    return out, special


def llguidance(backend, toks, special, cases):
    import llguidance as llg

    class Spelled:
        eos_token_id, bos_token_id, tokens, special_token_ids = 0, None, toks, special

        def __call__(self, s):
            text = s.decode() if isinstance(s, bytes) else s
            return backend.encode(text, add_special_tokens=False).ids

    tok = llg.LLTokenizer(llg.TokenizerWrapper(Spelled()), n_vocab=len(toks), eos_token=0)
    compiled, masks = [], []
    for schema, text in cases:
        began = time.perf_counter()
        grammar = llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
        m = llg.LLMatcher(tok, grammar)
        compiled.append(time.perf_counter() - began)
        for t in [*backend.encode(text, add_special_tokens=False).ids, 0]:
            began = time.perf_counter()
            m.compute_bitmask()
            masks.append(time.perf_counter() - began)
            if not m.consume_token(t):
                raise ValueError(f"rejected a valid instance {text}")
    return compiled, masks


def xgrammar(backend, toks, special, cases):
    import xgrammar as xgr

    vocab = [b"" if i in special else t for i, t in enumerate(toks)]
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=[0])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    compiled, masks = [], []
    for schema, text in cases:
        began = time.perf_counter()
        grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        compiled.append(time.perf_counter() - began)
        m = xgr.GrammarMatcher(grammar)
        for t in [*backend.encode(text, add_special_tokens=False).ids, 0]:
            began = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            masks.append(time.perf_counter() - began)
            if not m.accept_token(t):
                raise ValueError(f"rejected a valid instance {text}")
    return compiled, masks


def outlines_core(backend, toks, special, cases):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    table: dict[bytes, list[int]] = {}
    for i, b in enumerate(toks):
        if i not in special:
            table.setdefault(b, []).append(i)
    vocab = Vocabulary(0, table)
    compiled, masks = [], []
    for schema, text in cases:
        began = time.perf_counter()
        index = Index(build_regex_from_schema(json.dumps(schema), ""), vocab)
        compiled.append(time.perf_counter() - began)
        guide = Guide(index)
        buffer = torch.zeros(1, (len(toks) + 31) // 32, dtype=torch.int32)
        for t in [*backend.encode(text, add_special_tokens=False).ids, 0]:
            began = time.perf_counter()
            guide.write_mask_into(buffer.data_ptr(), buffer.numel(), 4)
            masks.append(time.perf_counter() - began)
            if t != 0:
                guide.advance(t)
    return compiled, masks


ENGINES = {"llguidance": llguidance, "xgrammar": xgrammar, "outlines-core": outlines_core}


def main() -> None:
    compact = (",", ":")
    vocabularies = [
        ("tiny-gsm (167, word-level)", Tokenizer.from_file(str(SHIPPED)), False, SMALL),
        ("byte-level BPE 32000", trained_bpe(32000), True,
         [(s, json.dumps(x, separators=compact)) for s, x in BIG]),
    ]  # fmt: skip
    print("| library | vocabulary | compile ms median / max | mask us median / mean |")
    print("|---|---|---|---|")
    for label, backend, byte_level, cases in vocabularies:
        toks, special = token_bytes(backend, byte_level)
        for name, measure in ENGINES.items():
            try:
                compiled, masks = measure(backend, toks, special, cases)
            except ImportError:
                print(f"| {name} | {label} | not installed | |")
                continue
            except Exception as e:  # a library's refusal is a result too
                print(f"| {name} | {label} | failed: {type(e).__name__}: {str(e)[:80]} | |")
                continue
            c = f"{statistics.median(compiled) * 1e3:.2f} / {max(compiled) * 1e3:.2f}"
            m = f"{statistics.median(masks) * 1e6:.1f} / {statistics.mean(masks) * 1e6:.1f}"
            print(f"| {name} | {label} | {c} | {m} |", flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
