"""Property-based fuzzing of the public entry points on tiny models (Hypothesis).

Random byte lines and random Unicode through batch mode, random JSON-input lines, random
prompts as an argument and random values for every numeric and choice flag. Invariants:
never a traceback or an internal error; one record per input line, in input order; every good
line decoded exactly as it is alone; no [MASK] in any output; exit codes from the table.

A fixed set of examples runs by default (derandomized, so CI sees the same inputs each time);
`DLLM_FUZZ_EXAMPLES=N` runs N fresh random examples per test instead, for a longer hunt:
    DLLM_FUZZ_EXAMPLES=500 .venv/bin/python -m pytest -q tests/test_fuzz.py
"""

from __future__ import annotations

import json
import os
import typing
from functools import cache

import pytest
from checkpoints import DREAM_SPECIALS, LLADA_SPECIALS, WORDS, write_dream, write_llada
from cli_fixtures import invoke, isolated_fixture, profile_text  # noqa: F401
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dllm_cli import runtime as runtime_module
from dllm_cli.batch import json_line
from dllm_cli.decoding import decode
from dllm_cli.errors import InputError
from dllm_cli.models import loading
from dllm_cli.options import FLAGS
from dllm_cli.prompt_text import decode_line, escape_bytes, strip_line_end
from dllm_cli.runtime import open_runtime
from dllm_cli.settings import CACHES, CONFIDENCES, UNMASKS

LONG_RUN = int(os.environ.get("DLLM_FUZZ_EXAMPLES", "0"))
EXIT_CODES = {0, 1, 2, 3, 4, 5}  # the documented table, less 70 internal / 130 / 141
GEN = 8


def fuzz(examples: int):
    """`examples` fixed examples, or DLLM_FUZZ_EXAMPLES random ones."""
    return settings(
        max_examples=LONG_RUN or examples,
        derandomize=not LONG_RUN,
        deadline=None,
        database=None,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,  # the fixtures are module-scoped
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
        ],
    )


@pytest.fixture(scope="module", autouse=True)
def loaded_once():
    """Each checkpoint is read once per module: the runs differ in input, not in weights."""
    real, seen = loading.load_model, {}

    def cached(path, **kwargs):
        key = (str(path), repr(sorted(kwargs.items())))
        if key not in seen:
            seen[key] = real(path, **kwargs)
        return seen[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runtime_module, "load_model", cached)
        yield


@pytest.fixture(scope="module", params=["llada", "dream"])
def profile(request, tmp_path_factory):
    """A tiny checkpoint (context 96) and a profile for it: dual cache, threshold, GEN tokens."""
    folder = tmp_path_factory.mktemp("fuzz") / request.param
    if request.param == "llada":
        write_llada(folder, seed=1, max_sequence_length=96)
    else:
        write_dream(folder, max_position_embeddings=96)
    path = folder.parent / f"{request.param}.toml"
    path.write_text(profile_text(folder).replace("gen_length = 16", f"gen_length = {GEN}"))
    return path


# --- lines -----------------------------------------------------------------------------------

SPECIALS = st.sampled_from(sorted(set(LLADA_SPECIALS + DREAM_SPECIALS)))
SENTENCE = st.lists(st.sampled_from(WORDS) | SPECIALS, min_size=1, max_size=8).map(" ".join)
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=24)  # controls included
ODD = st.sampled_from(
    [
        "e\u0301\u0323 combining marks",
        "\u202eright-to-left override\u202c",
        "שלום, how many apples?",
        "مرحبا tom has 3 pens",
        "\ufeffBOM inside",
        "\ud800 lone surrogate",
        "\u200b\u200d zero width",
    ]
)
SPACES = st.text(st.sampled_from(" \t\u00a0\u2003\u3000\r"), max_size=4)  # empty or blank
LONG = st.integers(40, 3000).map(lambda n: " ".join(WORDS[i % len(WORDS)] for i in range(n)))
TEXT_LINE = st.one_of(
    SENTENCE, ANY_TEXT, ODD, SPACES, LONG, st.tuples(SENTENCE, ANY_TEXT).map("".join)
)
LINE = st.one_of(
    TEXT_LINE.map(lambda t: t.encode("utf-8", "surrogatepass")),  # a surrogate: not UTF-8
    st.binary(max_size=32),
).map(lambda b: b.replace(b"\n", b" "))


@cache
def opened(path: str):
    return open_runtime(path)


def expected(path: str, line: bytes, *, first: bool = False, json_input: bool = False) -> dict:
    """The record of one line (without its line end) decoded alone, straight from the library."""
    try:
        prompt = decode_line(line, first=first)
    except InputError as e:
        return {"raw": escape_bytes(line), "error": str(e)}
    try:
        if json_input:
            prompt = json_line(prompt)[0]
        ids = opened(path).prepare(prompt)
    except InputError as e:
        return {"prompt": prompt, "error": str(e)}
    return {"prompt": prompt, **alone(path, tuple(ids))}


@cache
def alone(path: str, ids: tuple[int, ...]) -> dict:
    rt = opened(path)
    result = decode(rt.loaded.model, rt.loaded.special, [list(ids)], rt.settings)
    tokens = result.tokens[0]
    return {"text": rt.text(tokens), "token_ids": result.answer(0, rt.loaded.special.stop)}


def kept(record: dict) -> dict:
    """A record without its timings (forwards, steps and seconds are its batch's)."""
    return {
        k: v
        for k, v in record.items()
        if k not in ("forwards", "guide_forwards", "steps", "seconds")
    }


def check_run(result, path: str, lines: list[bytes], json_input: bool = False) -> None:
    """The invariants of one batch run."""
    assert "Traceback" not in result.output and "internal error" not in result.stderr
    assert result.exit_code in (0, InputError.exit_code), result.output
    records = [json.loads(r) for r in result.stdout.splitlines()]
    assert [r["line"] for r in records] == list(range(1, len(lines) + 1))
    mask = opened(path).loaded.special.mask
    for record, raw in zip(records, lines, strict=True):
        n = record["line"]
        want = expected(path, strip_line_end(raw), first=n == 1, json_input=json_input)
        assert kept(record) == {"line": n, **want}, raw
        assert mask not in record.get("token_ids", [])
    failed = any("error" in r for r in records)
    event(f"{sum('text' in r for r in records)} of {len(records)} decoded")
    assert result.exit_code == (InputError.exit_code if failed else 0)


@fuzz(12)
@given(lines=st.lists(LINE, min_size=1, max_size=6), size=st.integers(1, 4), end=st.booleans())
def test_random_lines_through_batch_mode(profile, lines, size, end):
    stdin = b"\n".join(lines) + (b"\n" if end else b"")
    result = invoke(
        "generate", "-", "-p", str(profile), "--json", "--batch-size", str(size), input=stdin
    )
    check_run(result, str(profile), lines_of(stdin))


def lines_of(stdin: bytes) -> list[bytes]:
    """The lines a reader sees: split at \\n, a last \\n ends its line rather than starting one."""
    lines = stdin.split(b"\n")
    return lines[:-1] if lines[-1] == b"" else lines


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
PROMPT_OBJECT = st.fixed_dictionaries(
    {"prompt": TEXT_LINE | JSON_VALUES}, optional={"id": JSON_VALUES}
)
JSON_LINE = st.one_of(
    PROMPT_OBJECT.map(lambda d: json.dumps(d).encode()),  # surrogates as \ud800 escapes
    PROMPT_OBJECT.map(lambda d: json.dumps(d, ensure_ascii=False).encode("utf-8", "surrogatepass")),
    JSON_VALUES.map(lambda v: json.dumps(v).encode()),
    LINE,
)


@fuzz(10)
@given(lines=st.lists(JSON_LINE, min_size=1, max_size=5), size=st.integers(1, 3))
def test_random_json_input_lines(profile, lines, size):
    stdin = b"\n".join(lines)
    result = invoke(
        "generate",
        "-",
        "-p",
        str(profile),
        "--json",
        "--json-input",
        "--batch-size",
        str(size),
        input=stdin,
    )
    check_run(result, str(profile), lines_of(stdin), json_input=True)


@fuzz(10)
@given(
    raw=st.binary(min_size=1, max_size=24)
    | TEXT_LINE.map(lambda t: t.encode("utf-8", "surrogatepass"))
)
def test_a_random_argument_is_one_record(profile, raw):
    """argv cannot hold NUL; any other bytes arrive as Python makes them (PEP 383)."""
    raw = raw.replace(b"\x00", b"").replace(b"\n", b" ")
    arg = os.fsdecode(raw)
    result = invoke("generate", "--json", "-p", str(profile), "--", arg)
    assert "Traceback" not in result.output and "internal error" not in result.stderr
    assert result.exit_code in (0, InputError.exit_code), result.output
    (record,) = [json.loads(r) for r in result.stdout.splitlines()]
    assert kept(record) == expected(str(profile), raw)


# --- flags -----------------------------------------------------------------------------------

CHOICES = {
    "cache": CACHES,
    "unmask": UNMASKS,
    "confidence": CONFIDENCES,
    "device": ("cpu", "auto", "cuda", "cuda:1", "mps", "cpu:0"),
    "dtype": ("auto", "float32", "bfloat16", "float16", "int8"),
}
NOT_FUZZED = {"profile", "model", "accept"}  # paths, and a flag generate does not take
INTS = st.integers(-3, 100) | st.integers(-(2**70), 2**70)
EXTREMES = st.sampled_from([1e300, -1e300, 1e-40, 5e-324, -0.0, float("nan"), float("inf")])
FLOATS = st.floats(-0.5, 2.0) | st.floats() | EXTREMES


def kind_of(name: str) -> type:
    return typing.get_args(typing.get_args(FLAGS[name].option)[0])[0]


def flag_values(name: str) -> st.SearchStrategy[list[str]]:
    """Command-line words for one flag: a random value of its type, in and out of range."""
    option = "--" + name.replace("_", "-")
    kind = kind_of(name)
    if kind is bool:
        return st.booleans().map(lambda on: [option if on else "--no-" + option[2:]])
    if kind is int:
        values = INTS.map(str)
    elif kind is float:
        values = FLOATS.map(repr)
    else:
        values = st.sampled_from(CHOICES.get(name, ("",))) | st.text(max_size=8)
    return values.map(lambda v: [f"{option}={v}"])


FUZZED = [name for name in FLAGS if name not in NOT_FUZZED]


@fuzz(40)
@given(data=st.data())
def test_random_flag_values(profile, data):
    names = data.draw(st.lists(st.sampled_from(FUZZED), unique=True, max_size=6))
    args = [word for name in names for word in data.draw(flag_values(name))]
    args += data.draw(st.sampled_from([[], ["--batch-size", "0"], ["--batch-size", "-2"]]))
    result = invoke("generate", "how many apples", "-p", str(profile), "--json-canvas", *args)
    assert "Traceback" not in result.output and "internal error" not in result.stderr, args
    assert result.exit_code in EXIT_CODES, (args, result.output)
    event(f"exit {result.exit_code}")
    if result.exit_code == 0:
        record = json.loads(result.stdout)
        assert opened(str(profile)).loaded.special.mask not in record["canvas_ids"]


def test_every_fuzzed_flag_has_values():
    for name in FUZZED:
        assert kind_of(name) in (bool, int, float, str), name
