"""Structured output on the block-causal stepper (block_step.grammar_runs): SDAR's byte-level
BPE spells JSON, so every answer of a tiny random SDAR folder validates against its schema,
greedy and sampled, under both block caches; rows joining mid-decode equal alone; LLaDA2.1's
token editing and the AR guide are refused in one line."""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import pytest
import torch
from block_checkpoints import write_sdar

from dllm_cli.decoding import grammar as G
from dllm_cli.decoding import grammar_committer as GC
from dllm_cli.decoding.run import decode, open_engine
from dllm_cli.decoding.unmask import Committer
from dllm_cli.errors import SettingsError
from dllm_cli.runtime import open_runtime

OP = {
    "type": "object",
    "properties": {"op": {"enum": ["+", "-", "*", "/"]}, "ok": {"type": "boolean"}},
    "required": ["op", "ok"],
    "additionalProperties": False,
}
SCHEMAS = [{"type": "integer", "minimum": 0, "maximum": 99}, OP, {"enum": ["yes", "no"]}]
QUESTIONS = ["how many apples", "tom has 3 pens and 4 books", "what is 2 + 2 ?"]


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    torch.set_num_threads(1)
    folder = write_sdar(tmp_path_factory.mktemp("bg") / "sdar").folder
    values = {"decode.gen_length": 24, "decode.block_length": 4, "decode.threshold": 0.05}
    return open_runtime(None, {"model.path": str(folder), "model.device": "cpu", **values},
                        use_guide=False)  # fmt: skip


def grammar(rt, schema) -> G.Grammar:
    return G.compile_grammar("json_schema", schema, G.vocab_of(rt))


def valid(rt, tokens: list[int], schema: dict) -> None:
    jsonschema.validate(json.loads(rt.text(tokens)), schema)


@pytest.mark.parametrize("cache", ["prefix", "none"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_answer_validates_under_both_block_caches(runtime, cache, temperature):
    settings = replace(runtime.settings, cache=cache, temperature=temperature)
    rt = replace(runtime, settings=settings)
    ids = [rt.prepare(q) for q in QUESTIONS]
    model, special = rt.loaded.model, rt.loaded.special
    for schema in SCHEMAS:
        committer = GC.runtime_committer(rt, grammar(rt, schema))
        result = decode(model, special, ids, settings, committer=committer)
        for tokens in result.tokens:
            valid(rt, tokens, schema)
        batch = result.tokens
        alone = [
            decode(model, special, [p], settings,
                   committer=GC.runtime_committer(rt, grammar(rt, schema))).tokens[0]
            for p in ids
        ]  # fmt: skip
        assert batch == alone


def test_rows_admitted_mid_decode_equal_alone(runtime):
    rt = runtime
    model, special = rt.loaded.model, rt.loaded.special
    prompts = [rt.prepare(q) for q in QUESTIONS]

    def alone(i: int) -> list[int]:
        committer = GC.runtime_committer(rt, grammar(rt, SCHEMAS[i]))
        return decode(model, special, [prompts[i]], rt.settings, committer=committer).tokens[0]

    committer = GC.runtime_committer(rt)
    engine = open_engine(model, special, rt.settings, committer, slots=2, admission="continuous")
    rids = []
    for i in range(2):
        rids.append(engine.add(prompts[i]))
        committer.bind(rids[-1], grammar(rt, SCHEMAS[i]))
    answers = {}
    for _ in range(2):
        answers |= {f.id: list(f.tokens) for f in engine.step().finished}
    rids.append(engine.add(prompts[2]))  # joins mid-decode
    committer.bind(rids[-1], grammar(rt, SCHEMAS[2]))
    while engine.has_work:
        answers |= {f.id: list(f.tokens) for f in engine.step().finished}
    for i, rid in enumerate(rids):
        assert answers[rid] == alone(i)
        valid(rt, answers[rid], SCHEMAS[i])


def test_a_grammar_commits_left_to_right_from_the_first_mask(runtime):
    rt = runtime
    committer = GC.runtime_committer(rt, grammar(rt, OP))
    engine = open_engine(rt.loaded.model, rt.loaded.special, rt.settings, committer, slots=1)
    rid = engine.add(rt.prepare(QUESTIONS[1]))
    while engine.has_work:
        for f in engine.step().finished:
            marks = [m for m in f.commit_steps if m >= 0]
            assert f.id == rid and marks == sorted(marks)  # never a column before a later one


class Walker(Committer):
    walks_blocks = True


def test_token_editing_and_the_guide_are_refused_with_a_grammar(runtime):
    model, special = runtime.loaded.model, runtime.loaded.special
    editing = replace(runtime.settings, edit_threshold=0.0)
    with pytest.raises(SettingsError, match="cannot follow LLaDA2\\.1's token editing"):
        open_engine(model, special, editing, Walker(), slots=1)
    with pytest.raises(SettingsError, match="a guide model does not apply"):
        open_engine(model, special, runtime.settings, Committer(), slots=1)
