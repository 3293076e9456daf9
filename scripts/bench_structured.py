"""Structured output on the shipped model: validity over 5 schemas, tokens per forward.

    .venv/bin/python scripts/bench_structured.py [--requests 50] [--gen-length 48]

Decodes `requests` GSM questions (each under one of five JSON schemas, round robin), greedy
and sampled, through the engine with continuous batching (8 slots); every answer is parsed
and validated with `jsonschema`. One table row per mode, the unconstrained decode beside it:
answer tokens (through the stop token) per engine forward (one forward serves every live row)
and per forward of each request's own (the sum of each request's forwards).
"""

from __future__ import annotations

import argparse
import json
import time

import jsonschema

from dllm_cli.decoding import grammar as G
from dllm_cli.decoding import grammar_committer as GC
from dllm_cli.decoding.answer import answer_length
from dllm_cli.decoding.run import open_engine
from dllm_cli.runtime import open_runtime

NAMES = ["Sam", "Mia", "Tom", "Ava", "Leo", "Zoe", "Ben", "Lily"]
THINGS = ["apples", "cards", "eggs", "books", "coins"]
SCHEMAS = [
    {"type": "integer", "minimum": 0, "maximum": 999},
    {"enum": [2, 3, 5, 7, 11, 13]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 4},
    {
        "type": "object",
        "properties": {"op": {"enum": ["+", "-", "*", "/"]}, "ok": {"type": "boolean"}},
        "required": ["op", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "answer": {"type": "integer", "minimum": 0, "maximum": 999},
        },
        "required": ["name", "answer"],
        "additionalProperties": False,
    },
]


def question(i: int) -> str:
    name, thing = NAMES[i % len(NAMES)], THINGS[i % len(THINGS)]
    a, b = 3 + i % 7, 2 + i % 5
    return f"Question: {name} has {a} {thing} and buys {b} more. How many {thing} does {name} have?"


def run(rt, requests: int, constrained: bool, forward: bool) -> tuple[int, int, int, int, float]:
    """(valid answers, answer tokens, engine forwards, the requests' own forwards summed,
    seconds) of one pass."""
    vocab = G.vocab_of(rt)
    committer = None
    if constrained:
        committer = GC.runtime_committer(rt, guided=False, fast_forward=forward)
    model, special = rt.loaded.model, rt.loaded.special
    engine = open_engine(model, special, rt.settings, committer, slots=8)
    schema_of = {}
    for i in range(requests):
        rid = engine.add(rt.prepare(question(i)), sampling={"seed": i})
        schema_of[rid] = SCHEMAS[i % len(SCHEMAS)]
        if constrained:
            committer.bind(rid, G.compile_grammar("json_schema", schema_of[rid], vocab))
    valid = tokens = own = 0
    began = time.perf_counter()
    while engine.has_work:
        for done in engine.step().finished:
            ids = list(done.tokens)
            tokens += answer_length(ids, special.stop)
            own += done.forwards
            valid += is_valid(rt.text(ids), schema_of[done.id])
    return valid, tokens, engine.forwards, own, time.perf_counter() - began


def is_valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--gen-length", type=int, default=48)
    parser.add_argument("--profile", default="tiny-gsm-dream")
    parser.add_argument(
        "--no-fast-forward", action="store_true", help="forced tokens one per step, as drafts"
    )
    args = parser.parse_args()
    print(
        "| mode | valid | answer tokens | engine forwards | tokens / engine forward "
        "| tokens / own forward | seconds |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, temperature in (("greedy", 0.0), ("sampled (T=0.8)", 0.8)):
        overrides = {"decode.gen_length": args.gen_length, "decode.temperature": temperature}
        rt = open_runtime(args.profile, overrides, use_guide=False)
        for constrained in (False, True):
            forward = not args.no_fast_forward
            valid, tokens, forwards, own, seconds = run(rt, args.requests, constrained, forward)
            mode = f"{label}, {'5 schemas' if constrained else 'unconstrained'}"
            shown = f"{valid}/{args.requests}" if constrained else "-"
            row = f"| {mode} | {shown} | {tokens} | {forwards} | {tokens / forwards:.2f} |"
            print(f"{row} {tokens / own:.2f} | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
