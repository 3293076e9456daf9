"""Per-token logprobs (decoding/logprobs.py): opt-in per request, the same answers, one device
read per step, and each token's value under the distribution of the step that committed it
(checked against a straightforward one-token-per-step loop)."""

from __future__ import annotations

import math

import pytest
import torch
from decode_fixtures import MASK, SPECIAL, one_thread, prompts, settings, tiny  # noqa: F401
from test_decode_syncs import RULES, assert_one_read_per_step

from dllm_cli.decoding.engine import Engine


def finish_all(engine: Engine) -> dict:
    done = {}
    while engine.has_work:
        for f in engine.step().finished:
            done[f.id] = f
    return done


@torch.inference_mode()
def reference_logprobs(model, prompt: list[int], gen: int) -> tuple[list[int], list[float]]:
    """LLaDA greedy, one block, one token per step (the most confident mask), no cache: each
    committed token and its log-probability under that step's softmax (mask never drafted)."""
    x = torch.tensor([[*prompt, *[MASK] * gen]])
    logp = [0.0] * gen
    for _ in range(gen):
        logits = model(x)[0, len(prompt) :, : model.vocab_size].double()  # (G, V)
        logits[:, MASK] = -math.inf
        probs = logits.softmax(dim=-1)
        conf, tokens = probs.max(dim=-1)
        conf[x[0, len(prompt) :] != MASK] = -math.inf
        j = int(conf.argmax())
        x[0, len(prompt) + j] = tokens[j]
        logp[j] = float(torch.log(probs[j, tokens[j]]))
    return x[0, len(prompt) :].tolist(), logp


def test_each_token_has_its_committing_steps_log_probability():
    loaded = tiny("llada")
    gen = 8
    s = settings(cache="none", unmask="fixed", steps=gen, block_length=gen, gen_length=gen)
    engine = Engine(loaded.model, SPECIAL, s, slots=2)
    prompt = prompts([5], seed=3)[0]
    rid = engine.add(prompt, logprobs=3)
    engine.add(prompts([4], seed=4)[0])  # a neighbour that asked for nothing
    done = finish_all(engine)
    chosen, top_ids, top_values = done[rid].token_logprobs(3)
    tokens, want = reference_logprobs(loaded.model, prompt, gen)
    assert done[rid].tokens == tokens
    assert chosen == pytest.approx(want, abs=1e-6)
    assert all(ids[0] == t for ids, t in zip(top_ids, tokens, strict=True))  # greedy: top-1
    assert all(v[0] == pytest.approx(c) and v == sorted(v, reverse=True)
               for v, c in zip(top_values, chosen, strict=True))  # fmt: skip
    assert done[1 - rid].token_logprobs(3) == ([], [], [])


@pytest.mark.parametrize("kind", ["llada", "dream"])
def test_asking_changes_no_answer(kind):
    loaded = tiny(kind, eos_from=6)
    s = settings(cache="dual", early_stop=True, block_length=4, unmask="threshold")
    answers = []
    for asked in (None, 2):
        engine = Engine(loaded.model, SPECIAL, s, slots=2, quantum=4)
        for p in prompts([3, 7, 2], seed=2):
            engine.add(p, sampling={"temperature": 0.8, "seed": 5}, logprobs=asked)
        answers.append([f.tokens for _, f in sorted(finish_all(engine).items())])
    assert answers[0] == answers[1]


@pytest.mark.parametrize("rule", ["threshold", "fixed"])
def test_logprobs_keep_one_device_read_per_step(monkeypatch, rule):
    loaded = tiny("dream", eos_from=6)
    s = settings(cache="dual", early_stop=True, block_length=4, **RULES[rule])
    engine = Engine(loaded.model, SPECIAL, s, slots=2, admission="continuous", quantum=4)
    for i, p in enumerate(prompts([3, 7, 2, 5], seed=2)):
        engine.add(p, logprobs=2 if i % 2 else None)
    assert_one_read_per_step(engine, monkeypatch, requests=4)
