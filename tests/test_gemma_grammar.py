"""DiffusionGemma's structured output (decoding/gemma_grammar.py): each finished canvas keeps the
argmax where the grammar allows it and the grammar's most likely token where it does not, so
every answer is valid; a row without a grammar keeps transformers' tokens; batch == alone."""

from __future__ import annotations

import json

import pytest
import torch
from gemma_fixtures import (  # noqa: F401
    TEXTS,
    encode,
    gemma_ckpt_fixture,
    gemma_fixture,
    gemma_settings,
)

from dllm_cli.decoding import open_engine
from dllm_cli.decoding.gemma_grammar import CanvasGrammar
from dllm_cli.decoding.grammar import GrammarVocab, compile_grammar

SCHEMAS = {
    "integer": {"type": "integer"},
    "object": {
        "type": "object",
        "properties": {"n": {"enum": [1, 2, 3]}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module", name="vocab")
def vocab_fixture(gemma) -> GrammarVocab:
    size = gemma.special.real_vocab(gemma.model.vocab_size)
    return GrammarVocab(gemma.tokenizer, size, gemma.special.stop)


def run(gemma, s, texts, grammar: CanvasGrammar | None = None, bound=None) -> list[list[int]]:
    """Answers of `texts` decoded as one static batch (`bound`: text index -> its grammar)."""
    engine = open_engine(gemma.model, gemma.special, s, grammar, slots=len(texts))
    ids = [engine.add(encode(gemma, t)) for t in texts]
    for i, g in (bound or {}).items():
        grammar.bind(ids[i], g)
    done = {}
    while engine.has_work:
        done |= {f.id: f.tokens for f in engine.step().finished}
    return [done[rid] for rid in ids]


def text(gemma, tokens: list[int]) -> str:
    return gemma.tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize("schema", list(SCHEMAS))
def test_every_answer_is_valid_and_equals_its_run_alone(gemma, vocab, schema):
    grammar = compile_grammar("json_schema", SCHEMAS[schema], vocab)
    s = gemma_settings(gen_length=48, early_stop=True)
    committer = CanvasGrammar(vocab, grammar, gemma.special.eos)
    batch = run(gemma, s, TEXTS, committer)
    for t, answer in zip(TEXTS, batch, strict=True):
        value = json.loads(text(gemma, answer))
        assert isinstance(value, int) if schema == "integer" else set(value) == {"n", "ok"}
        assert run(gemma, s, [t], CanvasGrammar(vocab, grammar, gemma.special.eos)) == [answer]
    assert committer.masked > 0  # a random model's argmax is not JSON: the grammar chose


def test_a_request_without_a_grammar_keeps_transformers_tokens(gemma, vocab):
    """One bound request in a batch of unconstrained ones: only its answer changes."""
    grammar = compile_grammar("json_schema", SCHEMAS["integer"], vocab)
    s = gemma_settings(gen_length=32, early_stop=True)
    free = run(gemma, s, TEXTS[:3])
    committer = CanvasGrammar(vocab, None, gemma.special.eos)
    mixed = run(gemma, s, TEXTS[:3], committer, {1: grammar})
    assert mixed[0] == free[0] and mixed[2] == free[2] and mixed[1] != free[1]
    assert isinstance(json.loads(text(gemma, mixed[1])), int)


def test_the_walk_keeps_an_allowed_argmax_and_masks_the_first_rejected_column(gemma, vocab):
    """Hand-made logits over one canvas: the argmax run the grammar accepts is kept, the first
    column it rejects takes the grammar's best token there, EOS fills the rest once complete."""
    grammar = compile_grammar("regex", "ab", vocab)
    tok = gemma.tokenizer
    a, b = (tok.convert_tokens_to_ids(c) for c in "ab")
    eos, width = gemma.special.eos, gemma.model.vocab_size
    committer = CanvasGrammar(vocab, grammar, eos)
    logits = torch.zeros(1, 4, width)
    logits[0, 1, b], logits[0, 1, a] = 1.0, 2.0  # the model prefers a where only b may go
    canvas = torch.tensor([[a, a, a, a]])
    (matcher,) = committer.matchers([0])
    out = committer.choose([matcher], canvas, logits)
    assert out[0].tolist() == [a, b, eos, eos] and committer.masked == 1  # complete: EOS
    assert committer.choose([None], canvas, logits) is canvas  # unconstrained: untouched
