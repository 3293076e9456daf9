"""Structured output (decoding/grammar.py, grammar_committer.py): every answer parses and
validates against its schema.

On the shipped tiny-gsm-dream model (its WordPiece vocabulary spells JSON), greedy and sampled,
under every cache policy, with rows admitted mid-decode, through `dllm generate` and through a
real `dllm serve` driven by the official `openai` client.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import jsonschema
import openai
import pytest
from cli_fixtures import invoke

from dllm_cli.decoding import grammar as G
from dllm_cli.decoding import grammar_committer as GC
from dllm_cli.decoding.run import decode, open_engine
from dllm_cli.runtime import open_runtime
from dllm_cli.serve import server

GEN = 24
OP = {
    "type": "object",
    "properties": {"op": {"enum": ["+", "-", "*", "/"]}, "ok": {"type": "boolean"}},
    "required": ["op", "ok"],
    "additionalProperties": False,
}
SCHEMAS = [{"type": "integer", "minimum": 0, "maximum": 99}, {"enum": [2, 3, 5, 7]}, OP]
QUESTIONS = [
    "Question: Sam has 3 apples and buys 4 more. How many apples does Sam have now?",
    "Question: Mia has 10 cards and gives 2 to Tom. How many cards does Mia have now?",
]


@pytest.fixture(scope="module")
def runtime():
    return open_runtime(None, {"decode.gen_length": GEN}, use_guide=False)


def valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def grammar(rt, schema) -> G.Grammar:
    return G.compile_grammar("json_schema", schema, G.vocab_of(rt))


@pytest.mark.parametrize(
    ("kind", "source", "words"),
    [
        ("json_schema", '{"type": "integer"', "not JSON"),
        ("json_schema", {"type": "integer", "minimum": "x"}, "bad json_schema"),
        ("lark", "start: missing_rule", "bad lark"),
        ("regex", "([a-z", "bad regex"),
    ],
)
def test_bad_grammars_are_one_line_input_errors(runtime, kind, source, words):
    with pytest.raises(G.GrammarError) as caught:
        G.compile_grammar(kind, source, G.vocab_of(runtime))
    assert words in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["none", "prefix", "dual", "freecache"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_answer_validates_under_every_cache(runtime, cache, temperature):
    settings = replace(runtime.settings, cache=cache, temperature=temperature, block_length=8)
    rt = replace(runtime, settings=settings)
    ids = [rt.prepare(q) for q in QUESTIONS]
    for schema in (SCHEMAS[0], OP):
        committer = GC.runtime_committer(rt, grammar(rt, schema))
        result = decode(rt.loaded.model, rt.loaded.special, ids, settings, committer=committer)
        for tokens in result.tokens:
            valid(rt.text(tokens), schema)


RULES = [
    ("threshold", {}),
    ("factor", {}),
    ("fixed", {}),
    ("sdlm", {}),
    ("eb", {"eb_gamma": 0.5}),
    ("klass", {"threshold": 0.3, "kl_threshold": 0.5, "kl_history": 1}),
]


@pytest.mark.parametrize(("unmask", "extra"), RULES, ids=[r for r, _ in RULES])
def test_every_rule_a_grammar_follows_validates_and_batch_equals_alone(runtime, unmask, extra):
    """The frontier window moves and narrows between steps: KLASS's history follows columns."""
    settings = replace(runtime.settings, unmask=unmask, block_length=8, **extra)
    rt = replace(runtime, settings=settings)
    ids = [rt.prepare(q) for q in QUESTIONS]
    model, special = rt.loaded.model, rt.loaded.special

    def run(prompts):
        committer = GC.runtime_committer(rt, grammar(rt, OP))
        return decode(model, special, prompts, settings, committer=committer).tokens

    together = run(ids)
    for i, tokens in enumerate(together):
        valid(rt.text(tokens), OP)
        assert run([ids[i]])[0] == tokens


@pytest.mark.slow
def test_forced_tokens_are_committed_in_the_step_that_forces_them(runtime):
    rt, ids = runtime, [runtime.prepare(QUESTIONS[0])]
    model, special = rt.loaded.model, rt.loaded.special
    forwards = {}
    for fast in (True, False):
        committer = GC.runtime_committer(rt, grammar(rt, OP), fast_forward=fast)
        result = decode(model, special, ids, rt.settings, committer=committer)
        valid(rt.text(result.tokens[0]), OP)
        forwards[fast] = (result.forwards, committer.forced)
    assert forwards[False][1] == 0 < forwards[True][1]  # {"op":" and the like
    assert forwards[True][0] < forwards[False][0]


@pytest.mark.slow
def test_rows_admitted_mid_decode_equal_alone(runtime):
    rt = runtime
    model, special = rt.loaded.model, rt.loaded.special
    prompts = [rt.prepare(q) for q in [*QUESTIONS, "Question: Tom has 5 eggs. How many eggs?"]]
    schemas = [OP, SCHEMAS[0], SCHEMAS[1]]

    def alone(i: int) -> list[int]:
        committer = GC.runtime_committer(rt, grammar(rt, schemas[i]))
        return decode(model, special, [prompts[i]], rt.settings, committer=committer).tokens[0]

    committer = GC.runtime_committer(rt, guided=False)
    engine = open_engine(model, special, rt.settings, committer, slots=2)
    answers, rids = {}, []
    for i in range(2):
        rids.append(engine.add(prompts[i], sampling={"temperature": 0.7 * i, "seed": 3}))
        committer.bind(rids[-1], grammar(rt, schemas[i]))
    engine.step()
    engine.step()
    rids.append(engine.add(prompts[2]))  # joins when a slot frees up, mid-decode
    committer.bind(rids[-1], grammar(rt, schemas[2]))
    while engine.has_work:
        for done in engine.step().finished:
            answers[done.id] = list(done.tokens)
    assert answers[rids[0]] == alone(0) and answers[rids[2]] == alone(2)
    for i, rid in enumerate(rids):
        valid(rt.text(answers[rid]), schemas[i])


@pytest.mark.slow
def test_python_api_json_schema():
    from dllm_cli import LLM

    llm = LLM(gen_length=GEN)  # the default profile: its guide stays out of constrained calls
    for c in llm.generate(QUESTIONS, json_schema=OP, temperature=0.7, seed=1):
        valid(c.text, OP)
    with pytest.raises(G.GrammarError, match="bad json_schema"):
        llm.generate(QUESTIONS[0], json_schema={"type": "integer", "maximum": "x"})


ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
NUMBER = {"type": "integer", "minimum": 0, "maximum": 99}


@pytest.mark.slow
@pytest.mark.parametrize("profile", ["tiny-gsm", "tiny-gsm-dream"])
def test_python_api_answers_as_the_cli_does_on_both_shipped_models(tmp_path, profile):
    """The API's answer validates and is the CLI's for the same prompt and settings; a schema
    the vocabulary cannot spell (tiny-gsm's 167 pieces have no `{` or `"`) is refused, by both,
    in the same one line, not decoded into an empty answer past a llguidance warning."""
    from dllm_cli import LLM

    llm, question = LLM(profile, gen_length=GEN), "What is 2 + 3?"
    for schema in [NUMBER, ANSWER]:
        path = tmp_path / "schema.json"
        path.write_text(json.dumps(schema))
        cli = invoke("generate", "-p", profile, "--gen-length", str(GEN), "--json-schema",
                     str(path), question)  # fmt: skip
        if profile == "tiny-gsm" and schema is ANSWER:
            with pytest.raises(G.GrammarError) as caught:
                llm.generate([question], json_schema=schema, batch_size=1)
            assert "cannot write" in str(caught.value), caught.value
            assert cli.exit_code == G.GrammarError.exit_code, cli.output
            assert f"dllm: error: {caught.value}" in cli.stderr
            continue
        (c,) = llm.generate([question], json_schema=schema, batch_size=1)
        valid(c.text, schema)
        assert cli.exit_code == 0, cli.output
        assert cli.stdout.strip() == c.text


@pytest.mark.slow
def test_benchmark_script_validates_each_of_its_schemas(runtime):
    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_structured.py"
    spec = importlib.util.spec_from_file_location("bench_structured", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rt = replace(runtime, settings=replace(runtime.settings, gen_length=48))  # the script's
    count = len(bench.SCHEMAS)  # one request per schema
    valid_answers, tokens, forwards, own, _ = bench.run(rt, count, True, True)
    assert valid_answers == count and 0 < forwards <= own < tokens


@pytest.mark.slow
def test_the_guide_verifies_what_the_grammar_allows():
    rt = open_runtime(None, {"decode.gen_length": GEN})  # the default profile has a guide
    model, special = rt.loaded.model, rt.loaded.special
    prompts = [rt.prepare(q) for q in QUESTIONS]
    committer = GC.runtime_committer(rt, guided=True)
    assert isinstance(committer, GC.GuidedGrammarCommitter)
    engine = open_engine(model, special, rt.settings, committer, slots=2)
    rids, answers = [], {}
    for prompt, schema in zip(prompts, (OP, SCHEMAS[0]), strict=True):
        rids.append(engine.add(prompt))
        committer.bind(rids[-1], grammar(rt, schema))
    while engine.has_work:
        for done in engine.step().finished:
            answers[done.id] = (list(done.tokens), done.guide_forwards)
    for rid, schema in zip(rids, (OP, SCHEMAS[0]), strict=True):
        valid(rt.text(answers[rid][0]), schema)
        assert answers[rid][1] > 0  # the guide verified its drafts
    alone = GC.runtime_committer(rt, grammar(rt, OP))
    assert (
        decode(model, special, prompts[:1], rt.settings, committer=alone).tokens[0]
        == (answers[rids[0]][0])
    )


@pytest.mark.slow
def test_generate_json_schema_and_grammar_files(tmp_path):
    schema = tmp_path / "op.json"
    schema.write_text(json.dumps(OP))
    lines = "\n".join(QUESTIONS) + "\n"
    result = invoke("generate", "--json-schema", str(schema), "--gen-length", str(GEN), "-",
                    input=lines)  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "decoding without the profile's guide" in result.stderr
    for line in result.stdout.splitlines():
        valid(line, OP)
    regex = tmp_path / "n.regex"
    regex.write_text("[0-9]{1,3} apples")
    result = invoke("generate", "--grammar", str(regex), "--gen-length", "12", QUESTIONS[0])
    assert result.exit_code == 0 and result.stdout.strip().endswith(" apples"), result.output
    assert invoke("generate", "--json-schema", str(tmp_path / "none.json"), "x").exit_code == 2
    both = invoke("generate", "--guide", "--json-schema", str(schema), "--gen-length", str(GEN),
                  QUESTIONS[0])  # fmt: skip
    assert both.exit_code == 0 and "without the profile's guide" not in both.stderr, both.output
    valid(both.stdout, OP)


@pytest.fixture(scope="module")
def client():
    rt = open_runtime(
        None, {"decode.gen_length": GEN}
    )  # with its guide: constrained ones go without
    handle = server.start_in_thread(rt, server.Options(port=0, slots=4, max_queue=16))
    yield openai.OpenAI(base_url=handle.url + "/v1", api_key="unused", max_retries=0)
    handle.stop()


def chat(client, question: str, **kw):
    messages = [{"role": "user", "content": question}]
    return client.chat.completions.create(model="tiny-gsm-dream", messages=messages, **kw)


@pytest.mark.slow
def test_server_response_formats(client):
    for i, schema in enumerate(SCHEMAS):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
        answer = chat(client, QUESTIONS[i % 2], response_format=fmt, temperature=0.5 * i, seed=i)
        valid(answer.choices[0].message.content, schema)
    plain = client.completions.create(
        model="tiny-gsm-dream",
        prompt=QUESTIONS[0],
        extra_body={"response_format": {"type": "json_object"}},  # (not in the client's API)
    )
    assert isinstance(json.loads(plain.choices[0].text), dict)
    fmt = {"type": "json_schema", "json_schema": {"name": "op", "schema": OP, "strict": True}}
    chunks = chat(client, QUESTIONS[1], response_format=fmt, stream=True)
    valid("".join(c.choices[0].delta.content or "" for c in chunks if c.choices), OP)
    guided = chat(client, QUESTIONS[0], response_format=fmt, extra_body={"guide": True})
    valid(guided.choices[0].message.content, OP)
    unconstrained = chat(client, QUESTIONS[0])  # beside them, the guided engine answers as before
    assert unconstrained.choices[0].message.content


@pytest.mark.parametrize(
    ("fmt", "words"),
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}, "bad"),
        ({"type": "yaml"}, "must be one of"),
        ({"type": "json_schema", "json_schema": {"schema": {}, "color": 1}}, "json_schema:"),
    ],
)
def test_bad_response_formats_get_400(client, fmt, words):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, QUESTIONS[0], response_format=fmt)
    error = caught.value.body
    assert error["param"] == "response_format" and words in error["message"], error
